"""`python -m serving.bench.side_by_side`: the same `random` workload through our server and through HF
transformers `generate`, one after the other on the same machine, and a side-by-side table.

    python -m serving.bench.side_by_side --model CK/v41 --hf-model CK/v4 --hf-python /path/to/torch/python \
        --num-prompts 16 --concurrency 8 --input-len 512 --output-len 64 --dtype bfloat16 --output-json sbs.json

(CK from `python -m serving.bench.make_checkpoints CK --size peer`.) Our runtime serves V4.1 and HF has
only V4, so the two models may differ; the table names both and their parameter counts. Steps:
1. start `python -m serving.server --model DIR --port FREE ...` (issue #4's flags), wait for /health;
2. `serve.run` against it with the workload (greedy, --ignore-eos, forced output length), then stop the
   server (always, also on errors or Ctrl-C) so it leaves the cores to HF;
3. `hf_generate.py` under --hf-python with the same prompts (same seed and flags), batch = concurrency.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from serving.bench import serve
from serving.bench.server_process import free_port, server_process

HF_GENERATE = Path(__file__).with_name("hf_generate.py")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving.bench.side_by_side", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="our server's checkpoint folder (V4.1 or V4)")
    p.add_argument("--hf-model", required=True, help="HF's checkpoint folder (V4)")
    p.add_argument("--hf-python", required=True, help="a Python with torch + transformers >= 5.24")
    p.add_argument("--served-model-name", default="bench-model")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8, help="server lanes and HF batch size")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--token-id-range", default=None,
                   help="LOW,HIGH prompt ids (default: 10 to the smaller vocabulary of the two models)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="both engines")
    p.add_argument("--hf-threads", type=int, default=os.cpu_count())
    p.add_argument("--num-warmups", type=int, default=2, help="warm-up requests / generate calls, not timed")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="server flag (default: its own)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="server flag (default: input + output length rounded up to 256)")
    p.add_argument("--server-arg", action="append", default=[], help="extra server argument (repeatable)")
    p.add_argument("--server-python", default=sys.executable)
    p.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds to wait for /health")
    p.add_argument("--log-dir", type=Path, default=Path("bench-logs"))
    p.add_argument("--output-json", default=None)
    return p


def model_identity(folder: str) -> dict:
    """model_type / architectures / parameter count of a release or converted checkpoint folder."""
    import dsv41

    raw = json.loads((Path(folder) / "config.json").read_text())
    config = dsv41.load_config(folder)
    _, abstract = dsv41.abstract_params(config)
    return {"path": str(folder), "model_type": raw.get("model_type"), "architectures": raw.get("architectures"),
            "parameters": int(sum(int(v.size) for v in abstract.values())), "vocab_size": config.vocab_size}


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    max_len = args.max_model_len or -(-(args.input_len + args.output_len) // 256) * 256
    cmd = [args.server_python, "-m", "serving.server", "--model", str(args.model),
           "--served-model-name", args.served_model_name, "--host", "127.0.0.1", "--port", str(port),
           "--max-num-seqs", str(args.concurrency), "--max-model-len", str(max_len), "--dtype", args.dtype,
           "--seed", str(args.seed)]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return cmd + args.server_arg


def workload_flags(args: argparse.Namespace, token_ids: str) -> list[str]:
    """The flags both serve.py and hf_generate.py take, so both draw the same prompts."""
    return ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len), "--output-len",
            str(args.output_len), "--token-id-range", token_ids, "--seed", str(args.seed)]


def run_client(url: str, model: str, args: argparse.Namespace, token_ids: str, output_json: Path) -> dict:
    """`serve.run` of the workload against a started server: `args.concurrency` lanes, forced output lengths,
    `args.num_warmups` warm-up requests first; its JSON to `output_json`."""
    flags = ["--base-url", url, "--model", model, "--max-concurrency", str(args.concurrency), "--ignore-eos",
             "--num-warmups", str(args.num_warmups), "--output-json", str(output_json),
             *workload_flags(args, token_ids)]
    return serve.run(serve.parse_args(flags))


def run_ours(args: argparse.Namespace, token_ids: str) -> dict:
    port = free_port()
    with server_process(server_command(args, port), port, args.log_dir / f"server-{port}.log",
                        args.startup_timeout) as url:
        return run_client(url, args.served_model_name, args, token_ids, args.log_dir / "ours.json")


def run_hf(args: argparse.Namespace, token_ids: str) -> dict:
    out = args.log_dir / "hf.json"
    cmd = [args.hf_python, str(HF_GENERATE), "--model", str(args.hf_model), "--batch-size", str(args.concurrency),
           "--dtype", args.dtype, "--threads", str(args.hf_threads), "--num-warmups", str(args.num_warmups),
           "--output-json", str(out), *workload_flags(args, token_ids)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)  # its log is kept either way
    (args.log_dir / "hf.log").write_text(done.stdout + done.stderr)
    if done.returncode:
        raise RuntimeError(f"hf_generate failed ({done.returncode}); log {args.log_dir / 'hf.log'}:\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    return json.loads(out.read_text())


ROWS = (("output_throughput", "Output tok/s", "higher"), ("total_token_throughput", "Total tok/s", "higher"),
        ("request_throughput", "Requests/s", "higher"), ("median_ttft_ms", "TTFT median (ms)", "lower"),
        ("median_tpot_ms", "TPOT median (ms)", "lower"), ("p90_interactivity_tok_s", "P90 interactivity tok/s/user",
                                                          "higher"))


def comparison(ours: dict, hf: dict) -> list[dict]:
    """One row per metric: ours, HF, ours / HF (None where HF is 0)."""
    rows = []
    for key, label, better in ROWS:
        a, b = ours["summary"].get(key), hf["summary"].get(key)
        rows.append({"metric": key, "label": label, "better": better, "ours": a, "hf": b,
                     "ratio_ours_over_hf": a / b if a is not None and b else None})
    return rows


def format_table(result: dict) -> str:
    o, h = result["models"]["ours"], result["models"]["hf"]
    w = result["workload"]
    lines = [(f"workload: {w['num_prompts']} prompts x {w['input_len']} in / {w['output_len']} out, "
              f"concurrency {w['concurrency']}, {w['dtype']}, ids {w['token_id_range']}, seed {w['seed']}"),
             f"ours: {o['path']} ({o['model_type']}, {o['parameters'] / 1e6:.2f}M params)",
             f"HF:   {h['path']} ({h['model_type']}, {h['parameters'] / 1e6:.2f}M params)",
             f"{'metric':<30} {'ours':>12} {'HF':>12} {'ours/HF':>9}  better"]
    for r in result["rows"]:
        cells = [f"{v:12.2f}" if v is not None else f"{'n/a':>12}" for v in (r["ours"], r["hf"])]
        ratio = f"{r['ratio_ours_over_hf']:9.2f}" if r["ratio_ours_over_hf"] is not None else f"{'n/a':>9}"
        lines.append(f"{r['label']:<30} {cells[0]} {cells[1]} {ratio}  {r['better']}")
    lines.append(f"failed requests (ours): {result['ours']['summary']['failed']}; HF TTFT = batch prefill + "
                 "first token, HF TPOT = one batched decode step (see hf.json 'approximations')")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    ours_id = model_identity(args.model)
    hf_cfg = json.loads((Path(args.hf_model) / "config.json").read_text())
    token_ids = args.token_id_range or f"10,{min(ours_id['vocab_size'], hf_cfg['vocab_size'])}"
    args.log_dir.mkdir(parents=True, exist_ok=True)
    print(f"our server: {ours_id['model_type']} {ours_id['parameters'] / 1e6:.2f}M params from {args.model}",
          flush=True)
    ours = run_ours(args, token_ids)
    print(serve.format_report(ours), flush=True)
    hf = run_hf(args, token_ids)
    result = {"workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                           "output_len": args.output_len, "concurrency": args.concurrency, "dtype": args.dtype,
                           "token_id_range": token_ids, "seed": args.seed},
              "models": {"ours": ours_id, "hf": hf["model"]}, "rows": comparison(ours, hf), "ours": ours, "hf": hf}
    print(format_table(result))
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
