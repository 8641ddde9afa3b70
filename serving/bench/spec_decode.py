"""DSpark speculative decoding, measured in one run on the built-in nano-austen (its drafter was trained with it):

acceptance  held-out prompts (passages of *Persuasion*, which training never saw), greedy, k = 1 .. block drafts
            verified per step: the mean acceptance length (1 + accepted drafts / verification steps, vLLM's
            definition), the per-position acceptance rate (drafts accepted at position i / verification steps) and
            whether every output equals non-speculative decoding token for token.
            (Every step verifies k drafts: `"adaptive": false`.) At k = block, the drafter's confidence head against
            verification: per tenth of its confidence, the fraction of drafts accepted (`/metrics`'
            `dsv41:spec_decode_confidence_*`).
sampled     the same prompts at k = block, sampled at `--temperatures` (a seed per prompt): acceptance length and
            per-position rate, where a draft passes with probability min(1, p / q).
throughput  decode tokens/s of the engine's step loop (scheduler, runner, detokenizer) at `--concurrency` (default
            1 and 8) concurrent requests, speculation off, on with the adaptive default and on at k = block every
            step, alternating, `--repeats` each, medians: tokens generated after every request had its first token,
            over the time from then to the last token. The server-level comparison: `serving.bench.spec_server`.

    python -m serving.bench.spec_decode [--dtype auto] [--skip-acceptance | --skip-throughput] [--concurrency 1,8]
        [--json docs/benchmarks/spec_decode.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from serving.api.server import ServerArgs


def _engine(model, tok, spec: str | None, c: int, args):
    from serving.engine.args import EngineArgs
    from serving.engine.engine import Engine

    kw = dict(max_num_seqs=max(c, 8), max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.prompt_len + args.max_tokens + 16, token_buckets=tuple(args.token_buckets))
    return Engine(model, tok, EngineArgs.of(**kw, speculative_config=spec), progress=False)


def _run(engine, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0
         ) -> tuple[list[list[int]], float, int]:
    """Outputs (greedy, or sampled at `temperature` with a seed per prompt), and the decode window: (outputs, seconds
    from every request's first token to the last token, tokens generated in that window)."""
    from serving.runtime.sampling_params import SamplingParams

    out = {}
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                                seed=i if temperature else None)
        engine.add_request(f"b{i}", p, params)
        out[f"b{i}"] = []
    t_all_first = None
    at_start = 0
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        if t_all_first is None and all(out.values()):
            t_all_first, at_start = time.perf_counter(), sum(map(len, out.values()))
    seconds = time.perf_counter() - t_all_first
    return [out[f"b{i}"] for i in range(len(prompts))], seconds, sum(map(len, out.values())) - at_start


def _counter(engine, name: str, position: int | None = None, label: str | None = None) -> float:
    label = label or (None if position is None else f'position="{position}"')
    for line in engine.metrics.render().decode().splitlines():
        if line.startswith(name + "_total{") and (label is None or label in line):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _acceptance_row(eng, k: int) -> dict:
    drafts = _counter(eng, "vllm:spec_decode_num_drafts")
    acc = _counter(eng, "vllm:spec_decode_num_accepted_tokens")
    return {"k": k, "verification_steps": int(drafts), "accepted": int(acc), "acceptance_length": 1 + acc / drafts,
            "per_position_rate": [_counter(eng, "vllm:spec_decode_num_accepted_tokens_per_pos", i) / drafts
                                  for i in range(k)]}


def acceptance(model, tok, prompts, plain_out, args) -> list[dict]:
    rows = []
    B = model.config.dspark_block_size
    for k in range(1, B + 1):
        eng = _engine(model, tok, json.dumps({"method": "dspark", "num_speculative_tokens": k, "adaptive": False}),
                      len(prompts), args)
        out, _, _ = _run(eng, prompts, args.max_tokens)
        rows.append({**_acceptance_row(eng, k), "outputs_equal_plain": sum(a == b for a, b in zip(out, plain_out)),
                     "prompts": len(prompts), "confidence_bins": confidence_bins(eng)})
        print(f"k={k}: acceptance length {rows[-1]['acceptance_length']:.3f}", flush=True)
    return rows


def sampled_acceptance(model, tok, prompts, args) -> list[dict]:
    """At k = block, sampled requests (a seed each): drafts pass verification with probability min(1, p / q), the
    target's over the drafter's probability of the draft, both at the request's temperature."""
    B, rows = model.config.dspark_block_size, []
    for t in args.temperatures:
        eng = _engine(model, tok, json.dumps({"method": "dspark", "adaptive": False}), len(prompts), args)
        _run(eng, prompts, args.max_tokens, temperature=t)
        rows.append({"temperature": t, **_acceptance_row(eng, B)})
        print(f"temperature {t}: acceptance length {rows[-1]['acceptance_length']:.3f}", flush=True)
    return rows


def confidence_bins(engine) -> list[dict]:
    """The drafter's confidence head against verification: per tenth of its confidence, the drafts verified with
    every draft before them accepted, and the fraction accepted (calibrated: about the bin's confidence)."""
    rows = []
    for b in range(10):
        label = f"{b / 10:.1f}"
        reached = _counter(engine, "dsv41:spec_decode_confidence_drafts", label=f'bin="{label}"')
        accepted = _counter(engine, "dsv41:spec_decode_confidence_accepted", label=f'bin="{label}"')
        rows.append({"bin": label, "drafts": int(reached), "accepted": int(accepted),
                     "accepted_rate": accepted / reached if reached else None})
    return rows


def throughput(model, tok, prompts, args) -> list[dict]:
    B = model.config.dspark_block_size
    rows = []
    for c in args.concurrency:
        engines = {"off": _engine(model, tok, None, c, args),
                   "adaptive": _engine(model, tok, json.dumps({"method": "dspark"}), c, args),
                   "on": _engine(model, tok, json.dumps({"method": "dspark", "num_speculative_tokens": B,
                                                         "adaptive": False}), c, args)}
        for eng in engines.values():
            _run(eng, prompts[:c], args.max_tokens)  # warm-up (the adaptive policy's trials at this concurrency)
        tps = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, eng in engines.items():
                _, seconds, n = _run(eng, prompts[:c], args.max_tokens)
                tps[name].append(n / seconds)
        med = {name: statistics.median(v) for name, v in tps.items()}
        rows.append({"concurrency": c, "tokens_per_s_off": med["off"], "tokens_per_s_adaptive": med["adaptive"],
                     "tokens_per_s_on": med["on"], "speedup": med["on"] / med["off"],
                     "adaptive_speedup": med["adaptive"] / med["off"], "repeats": tps})
        print(f"c={c}: off {med['off']:.1f} tok/s, adaptive {med['adaptive']:.1f}, k={B} {med['on']:.1f}", flush=True)
    return rows


def _print(result: dict) -> None:
    if result["acceptance"]:
        print("\n| k | acceptance length | per-position acceptance rate | outputs equal to plain |")
        print("|---|---|---|---|")
        for r in result["acceptance"]:
            rates = " / ".join(f"{x:.2f}" for x in r["per_position_rate"])
            print(f"| {r['k']} | {r['acceptance_length']:.3f} | {rates} | {r['outputs_equal_plain']}/{r['prompts']} |")
        print("\n| temperature (k = block, sampled) | acceptance length | per-position acceptance rate |")
        print("|---|---|---|")
        for r in result["sampled"]:
            rates = " / ".join(f"{x:.2f}" for x in r["per_position_rate"])
            print(f"| {r['temperature']} | {r['acceptance_length']:.3f} | {rates} |")
        top = result["acceptance"][-1]
        print(f"\nThe drafter's confidence head at k = {top['k']} (greedy): drafts verified with every draft before "
              "them accepted, by the head's confidence")
        print("\n| confidence | drafts | accepted |")
        print("|---|---|---|")
        for r in top["confidence_bins"]:
            if r["drafts"]:
                print(f"| {r['bin']}-{float(r['bin']) + 0.1:.1f} | {r['drafts']} | {r['accepted_rate']:.2f} |")
    if result["throughput"]:
        print("\n| concurrency | decode tok/s off | adaptive | adaptive / off | k = block every step "
              "| k = block / off |")
        print("|---|---|---|---|---|---|")
        for r in result["throughput"]:
            print(f"| {r['concurrency']} | {r['tokens_per_s_off']:.1f} | {r['tokens_per_s_adaptive']:.1f} | "
                  f"{r['adaptive_speedup']:.2f} | {r['tokens_per_s_on']:.1f} | {r['speedup']:.2f} |")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", type=Path, default=None, help="a nano-austen folder (default: the built-in one)")
    ap.add_argument("--skip-throughput", action="store_true", help="the acceptance table only")
    ap.add_argument("--skip-acceptance", action="store_true", help="the throughput table only")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8],
                    help="the throughput table's concurrencies")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts for the acceptance table")
    ap.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.7, 1.0],
                    help="sampled requests' acceptance at k = block, at these temperatures")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=128)
    ap.add_argument("--token-buckets", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32, 64, 128])
    ap.add_argument("--compilation-cache-dir", default=ServerArgs.compilation_cache_dir)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    import dsv41
    from dsv41 import nano
    from serving.runtime.compiler import enable_compilation_cache
    from serving.text.tokenizer import Tokenizer

    enable_compilation_cache(args.compilation_cache_dir)
    folder = args.model or nano.NANO_DIR
    model = dsv41.load(folder, dtype=dsv41.auto_dtype({}, release=True).name if args.dtype == "auto" else args.dtype)
    tok = Tokenizer.from_dir(folder)
    prompts = [list(map(int, p)) for p in nano.passages(args.prompt_len, args.prompts, folder)]
    result = {"model": folder.name, "dtype": model.dtype.name, "block": model.config.dspark_block_size,
              "prompts": args.prompts, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
              "acceptance": [], "sampled": [], "throughput": []}
    if not args.skip_acceptance:
        plain_out, _, _ = _run(_engine(model, tok, None, len(prompts), args), prompts, args.max_tokens)
        result["acceptance"] = acceptance(model, tok, prompts, plain_out, args)
        result["sampled"] = sampled_acceptance(model, tok, prompts, args)
    if not args.skip_throughput:
        result["throughput"] = throughput(model, tok, prompts, args)
    _print(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
