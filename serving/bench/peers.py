"""`python -m serving.bench.peers`: our server, HF transformers `generate` and vLLM CPU on one V4 checkpoint, the
same prompts and client, in one run; plus this machine's measured matmul and weight-streaming rates and our
prefill / decode as fractions of them.

    python -m serving.bench.peers --model PEER_DIR/tiny-v4 --hf-python PEER_DIR/hfvenv/bin/python \
        [--vllm-python PEER_DIR/vllmcpu/bin/python] --concurrency 1,8 --output-json peers.json

(PEER_DIR from ../shared/peer: `setup_hf_venv.sh`, `build_tiny_v4.sh`, `setup_vllm_cpu.sh`.) Each engine runs
the `random` workload (`serve.py` / `hf_generate.py`: token-id prompts, greedy, forced output length) at every
concurrency after its warm-up requests, one engine at a time so each has the cores. Our server runs as a user
starts it: its default flags (plus any --server-arg), an empty compile cache, timed from launch; the waves start
when /health answers, while its background compile may still run (`serving.bench.full_speed` times when it
reaches full speed). vLLM runs when --vllm-python is given and the CPU has AVX-512 (vllm-cpu 0.32 fails to load V4
on AVX2); otherwise the table says why and shows ../shared/peer's recorded vLLM figures, marked as recorded
(another machine, another day).

Rates (jitted in this process before any server starts): the matmul rate is the median of a [1024, 4096] x
[4096, 4096] dot in our compute dtype (--dtype, "auto" resolved here once and passed to our server as the dtype it
picked); the streaming rate a jitted sum over 256 MiB. Our prefill fraction = (the model's
prefill FLOPs for input_len tokens / matmul rate) / our c=1 median TTFT; decode fraction = (the weight bytes a
decode step of c rows reads / streaming rate) / our median TPOT at concurrency c.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from serving.bench import side_by_side
from serving.bench.roofline import decode_weight_bytes, matmul_rate, prefill_flops, weight_read_rate
from serving.bench.server_process import free_port, server_process

# ../shared/peer/README.md, "vLLM" section: an AVX-512 machine, both cores to the worker (start_vllm.sh default)
RECORDED_VLLM = {1: {"output_throughput": "57-62", "median_ttft_ms": "200-300", "median_tpot_ms": "13-15"},
                 8: {"output_throughput": "146-206", "median_ttft_ms": "1300-1900", "median_tpot_ms": "19-25"}}
# vLLM CPU runs V4 (MLA) with chunked prefill off, so a step holds whole prompts up to max_model_len tokens: it
# prefills a c=8 wave of 512-token prompts in one step, then decodes them together (start_vllm.sh's setting).
VLLM_MAX_MODEL_LEN = 4096
METRICS = (("output_throughput", "out tok/s"), ("median_ttft_ms", "TTFT ms"), ("median_tpot_ms", "TPOT ms"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving.bench.peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a V4 checkpoint folder every engine loads")
    p.add_argument("--hf-python", required=True, help="a Python with torch + transformers >= 5.24")
    p.add_argument("--vllm-python", default=None, help="the patched vllm-cpu venv's python (../shared/peer)")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--num-prompts", type=int, default=16, help="at c > 1 (c=1 runs max(4, n / 4))")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-warmups", type=int, default=2)
    p.add_argument("--dtype", default="auto",
                   help="our server's --dtype (auto: the checkpoint's; float32 on a CPU without fast bf16 matmuls)")
    p.add_argument("--hf-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--hf-threads", type=int, default=os.cpu_count())
    p.add_argument("--server-arg", action="append", default=[],
                   help="a flag of our server beyond its defaults (repeatable), e.g. "
                        "--server-arg=--no-background-compile")
    p.add_argument("--startup-timeout", type=float, default=1800.0)
    p.add_argument("--log-dir", type=Path, default=Path("bench-logs/peers"))
    p.add_argument("--output-json", default=None)
    return p


def machine_rates(dtype: str) -> dict:
    """{"matmul_flop_s": the dot rate in our compute dtype, "stream_bytes_s": read rate} of this device, medians of
    10."""
    return {"matmul_dtype": dtype, "matmul_flop_s": matmul_rate(dtype=dtype), "stream_bytes_s": weight_read_rate()}


def run_ours(args, conc: list[int], token_ids: str) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="peers-compile-cache-") as empty:
        cmd = [sys.executable, "-m", "serving.server", "--model", str(args.model), "--served-model-name",
               "bench-model", "--port", str(port), "--dtype", args.dtype, "--compilation-cache-dir", empty,
               *args.server_arg]
        return _measure_server(args, "ours", cmd, port, conc, token_ids)


def vllm_server(python: str, model: str, port: int) -> tuple[list[str], dict]:
    """(command, environment) of vLLM CPU serving `model` as `bench-model` on `port`, as ../shared/peer's
    start_vllm.sh starts it (both cores to its worker)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_CPU_KVCACHE_SPACE": "4",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "bench-model",
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(VLLM_MAX_MODEL_LEN),
           "--dtype", "bfloat16"]
    return cmd, env


def run_vllm(args, conc: list[int], token_ids: str) -> dict:
    port = free_port()
    cmd, env = vllm_server(args.vllm_python, str(args.model), port)
    return _measure_server(args, "vllm", cmd, port, conc, token_ids, env)


def _measure_server(args, who: str, cmd: list[str], port: int, conc: list[int], token_ids: str,
                    env: dict | None = None) -> dict:
    """{"ready_s": start to /health, "runs": {c: the client's summary at concurrency c}} of one server."""
    t0 = time.perf_counter()
    with server_process(cmd, port, args.log_dir / f"{who}-{port}.log", args.startup_timeout, env) as url:
        ready = time.perf_counter() - t0
        runs = {c: side_by_side.run_client(url, "bench-model", _at(args, c), token_ids,
                                           args.log_dir / f"{who}-c{c}.json")["summary"] for c in conc}
    return {"ready_s": ready, "runs": runs}


def _at(args, c: int, **changes) -> argparse.Namespace:
    """args for one concurrency: c lanes (HF: batch c), 16 prompts at c > 1, max(4, n / 4) at c = 1."""
    n = args.num_prompts if c > 1 else max(4, args.num_prompts // 4)
    return argparse.Namespace(**{**vars(args), "concurrency": c, "num_prompts": n, **changes})


def run_hf(args, conc: list[int], token_ids: str) -> dict:
    """side_by_side.run_hf at each concurrency (batch = c), each in its own log folder."""
    out = {}
    for c in conc:
        run = _at(args, c, dtype=args.hf_dtype, hf_model=args.model, log_dir=args.log_dir / f"hf-c{c}")
        run.log_dir.mkdir(parents=True, exist_ok=True)
        out[c] = side_by_side.run_hf(run, token_ids)["summary"]
    return {"runs": out}


def vllm_skip_reason(args) -> str | None:
    if not args.vllm_python:
        return "no --vllm-python given"
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "avx512f" not in flags:
        return "this CPU has no AVX-512 (vllm-cpu 0.32 fails to load V4 on AVX2: convert_weight_packed missing)"
    return None


def format_table(result: dict) -> str:
    w, r = result["workload"], result["rates"]
    lines = [f"workload: {w['input_len']} in / {w['output_len']} out, token ids {w['token_id_range']}, "
             f"seed {w['seed']}; model {result['model']}; our server: defaults "
             f"{' '.join(w['our_server_args']) or '(no extra flags)'}, empty compile cache",
             f"machine: matmul {r['matmul_flop_s'] / 1e9:.1f} GFLOP/s ({r.get('matmul_dtype', 'float32')}), "
             f"weight streaming {r['stream_bytes_s'] / 1e9:.1f} GB/s",
             f"{'engine':<16} {'c':>3} " + " ".join(f"{label:>10}" for _, label in METRICS) + "   ours/peer out tok/s"]
    ours = result["engines"]["ours"]["runs"]
    for name, eng in result["engines"].items():
        for c, s in eng["runs"].items():
            cells = " ".join(f"{s[key]:>10.1f}" if isinstance(s.get(key), (int, float)) else f"{s.get(key, 'n/a'):>10}"
                             for key, _ in METRICS)
            ratio = ""
            if name != "ours" and isinstance(s.get("output_throughput"), (int, float)) and s["output_throughput"]:
                ratio = f"   {ours[c]['output_throughput'] / s['output_throughput']:.2f}"
            lines.append(f"{name:<16} {c:>3} {cells}{ratio}")
    if result.get("vllm_skipped"):
        lines.append(f"vLLM skipped: {result['vllm_skipped']}; 'vllm (recorded)' rows are ../shared/peer's figures")
    f = result["fractions"]
    lines.append(f"ours vs this machine: {w['input_len']}-token prefill {f['prefill_gflop']:.1f} GFLOP -> "
                 f"{f['prefill_of_matmul_roofline']:.0%} of the matmul rate (c=1 TTFT); decode "
                 + ", ".join(f"c={c} {v:.0%}" for c, v in f["decode_of_streaming_floor"].items())
                 + " of the weight-streaming floor (TPOT); ready in " + f"{result['engines']['ours']['ready_s']:.1f}s")
    return "\n".join(lines)


def _portable(path: str) -> str:
    """The checkpoint path as the README's command names it ($PEER_DIR/...), so a committed JSON names no folder
    of this machine: under $PEER_DIR relative to it, another absolute path by its last folder's name."""
    peer_dir = os.environ.get("PEER_DIR")
    if peer_dir and path.startswith(peer_dir):
        return "$PEER_DIR" + path[len(peer_dir.rstrip("/")):]
    return Path(path).name if os.path.isabs(path) else path


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    conc = [int(c) for c in args.concurrency.split(",")]
    args.log_dir.mkdir(parents=True, exist_ok=True)
    import dsv41

    config = dsv41.load_config(args.model)
    token_ids = f"10,{min(config.vocab_size, 8000)}"  # the peer client's range: ids its tokenizer has
    model = dsv41.load(args.model, dtype=args.dtype)  # "auto" resolved once here; our server gets the result
    args.dtype = model.dtype.name
    rates = machine_rates(args.dtype)
    print(f"rates: {json.dumps(rates)}", flush=True)
    engines = {"ours": run_ours(args, conc, token_ids)}
    print("ours done", flush=True)
    engines[f"hf ({args.hf_dtype})"] = run_hf(args, conc, token_ids)
    skip = vllm_skip_reason(args)
    if skip is None:
        engines["vllm"] = run_vllm(args, conc, token_ids)
    else:
        engines["vllm (recorded)"] = {"runs": {c: RECORDED_VLLM[c] for c in conc if c in RECORDED_VLLM}}
    ours = engines["ours"]["runs"]
    flops = prefill_flops(config, args.input_len)
    fractions = {"prefill_gflop": flops / 1e9,
                 "prefill_of_matmul_roofline": flops / rates["matmul_flop_s"] / (ours[conc[0]]["median_ttft_ms"] / 1e3),
                 "decode_of_streaming_floor": {c: decode_weight_bytes(model, c) / rates["stream_bytes_s"]
                                               / (ours[c]["median_tpot_ms"] / 1e3) for c in conc}}
    workload = {"input_len": args.input_len, "output_len": args.output_len, "token_id_range": token_ids,
                "seed": args.seed, "num_prompts": args.num_prompts, "our_dtype": args.dtype,
                "our_server_args": args.server_arg}
    result = {"model": _portable(str(args.model)), "workload": workload,
              "rates": rates, "engines": engines, "fractions": fractions, "vllm_skipped": skip}
    print(format_table(result))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
