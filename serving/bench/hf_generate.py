"""The `random` benchmark workload through HF transformers `generate` on a V4 checkpoint (the baseline).

    HF_PYTHON serving/bench/hf_generate.py --model DIR --num-prompts 16 --batch-size 8 \
        --input-len 512 --output-len 64 --dtype bfloat16 --output-json hf.json

Runs under a Python with torch + transformers >= 5.24 (DeepseekV4ForCausalLM) and no jax: it is run as a
script and loads `workloads.py` and `metrics.py` by file path, so neither jax nor the `serving` package is
imported, and the prompts are the ones `serve.py` sends for the same flags and seed.

Requests go in batches of `--batch-size` (= the server's concurrency), greedy, with the output length
forced (`min_new_tokens = max_new_tokens`). A streamer timestamps every generated step, so the same
per-request records as the HTTP client come out and `metrics.summarize` gives the same JSON names. What
the numbers mean here (the `approximations` field of the JSON):
* TTFT = the batch's prefill + first token: every request of a batch is "sent" when the batch starts,
  which is when the previous batch has finished.
* TPOT / ITL = one decode step of the whole batch per token; all rows of a batch generate
  max(output_len of the batch) tokens (only different with --range-ratio > 0).
* no prefix cache: cached tokens are 0. Left padding when prompt lengths differ (--range-ratio > 0).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# Run as a script, this folder is sys.path[0], and its modules would shadow the packages transformers probes for
# (kernels.py here for HF's `kernels`: the probe imported it, and with it jax); the siblings it needs load by path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def _load_sibling(name: str):
    """Import serving/bench/<name>.py without importing the `serving` package (which pulls in jax)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", _HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


workloads = _load_sibling("workloads")
metrics = _load_sibling("metrics")

APPROXIMATIONS = {
    "ttft": "batch prefill + first token; a batch's requests start together when the previous batch ends",
    "tpot_itl": "one decode step of the whole batch per token",
    "output_tokens": "every row of a batch generates the batch's max output_len",
    "cached_tokens": "HF generate has no prefix cache: 0",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="V4 checkpoint folder (config.json + safetensors)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--token-id-range", default="10,8000", help="prompt ids drawn uniformly from [LOW, HIGH)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="requests per generate call (the concurrency)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    p.add_argument("--num-warmups", type=int, default=1, help="short generate calls before timing")
    p.add_argument("--percentiles", default="50,90,99")
    p.add_argument("--output-json", default=None)
    return p


def prompts_for(args: argparse.Namespace) -> list:
    """The workload's one-turn sessions (identical to serve.py's for the same flags)."""
    low, high = (int(x) for x in args.token_id_range.split(","))
    return workloads.random_sessions(args.num_prompts, args.input_len, args.output_len,
                                     range_ratio=args.range_ratio, token_id_range=(low, high), seed=args.seed)


def _load_model(folder: str, dtype_name: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    if cfg.model_type != "deepseek_v4":
        raise ValueError(f"{folder}: model_type {cfg.model_type!r}; HF transformers runs only deepseek_v4")
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype_name),
                                                       output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise ValueError(f"{folder}: from_pretrained reported {bad}")
    return model.eval()


def _timing_streamer():
    from transformers.generation.streamers import BaseStreamer

    class StepTimes(BaseStreamer):
        """perf_counter of every generated step (the first `put` is the prompt)."""

        def __init__(self):
            self.puts: list[float] = []

        def put(self, value):
            self.puts.append(time.perf_counter())

        def end(self):
            pass

    return StepTimes()


def run_batch(model, sessions: list, pad_id: int) -> tuple[list, dict]:
    """Generate one batch; returns its RequestRecords and {prefill_s, decode_s, new_tokens}."""
    import torch

    prompts = [s.turns[0].prompt_ids for s in sessions]
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    new = max(s.turns[0].output_len for s in sessions)
    streamer = _timing_streamer()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=pad_id, streamer=streamer)
    t1 = time.perf_counter()
    steps = streamer.puts[1:]
    if out.shape[1] - width != new or len(steps) != new:
        raise RuntimeError(f"generate made {out.shape[1] - width} tokens ({len(steps)} streamed), expected {new}")
    records = [metrics.RequestRecord(send_time=t0, end_time=t1, chunk_times=list(steps), prompt_tokens=len(p),
                                     completion_tokens=new, cached_tokens=0, session_id=s.session_id)
               for s, p in zip(sessions, prompts)]
    return records, {"batch": len(sessions), "prompt_width": width, "new_tokens": new,
                     "prefill_s": steps[0] - t0, "decode_s": steps[-1] - steps[0]}


def run(args: argparse.Namespace) -> dict:
    import torch

    if args.batch_size < 1 or args.num_prompts < 1:
        raise ValueError("--batch-size and --num-prompts must be >= 1")
    torch.set_num_threads(args.threads)
    sessions = prompts_for(args)
    model = _load_model(args.model, args.dtype)
    pad_id = model.config.eos_token_id
    pad_id = pad_id[0] if isinstance(pad_id, list) else pad_id
    for _ in range(args.num_warmups):
        warm = workloads.warmup_sessions(1, min(16, args.input_len), 2, seed=args.seed,
                                         token_id_range=tuple(int(x) for x in args.token_id_range.split(",")))
        run_batch(model, warm, pad_id)
    records, batches = [], []
    for i in range(0, len(sessions), args.batch_size):
        recs, info = run_batch(model, sessions[i:i + args.batch_size], pad_id)
        records += recs
        batches.append(info)
        print(f"batch {len(batches)}: {info['batch']} x {info['prompt_width']} tokens, prefill "
              f"{info['prefill_s']:.3f} s, decode {info['new_tokens'] - 1} steps {info['decode_s']:.3f} s", flush=True)
    percentiles = [float(x) for x in args.percentiles.split(",")]
    # state-dict tensors, as our count: HF keeps tid2eid and the router bias as buffers, not parameters
    n_params = sum(t.numel() for t in model.state_dict().values())
    result = {"settings": {**vars(args), "engine": "hf-transformers-generate", "torch": torch.__version__,
                           "transformers": __import__("transformers").__version__},
              "model": {"path": str(args.model), "model_type": model.config.model_type,
                        "architectures": list(model.config.architectures or []), "parameters": n_params},
              "summary": metrics.summarize(records, percentiles), "batches": batches,
              "approximations": APPROXIMATIONS}
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run(args)
    s = result["summary"]
    print(f"HF generate ({result['model']['parameters'] / 1e6:.1f}M params, {args.dtype}, {args.threads} threads, "
          f"batch {args.batch_size}): output {s['output_throughput']:.1f} tok/s, total "
          f"{s['total_token_throughput']:.1f} tok/s, TTFT median {s['median_ttft_ms']:.0f} ms, "
          f"TPOT median {s['median_tpot_ms']:.1f} ms")
    if args.output_json:
        print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
