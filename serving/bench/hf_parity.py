"""`python -m serving.bench.hf_parity`: greedy tokens of our engine == HF transformers `generate` on one V4
checkpoint, float32, except where HF's top-2 logits are a near-tie.

    python -m serving.bench.hf_parity --model PEER_DIR/tiny-v4 --hf-python PEER_DIR/hfvenv/bin/python \
        --output-json parity.json

Prompts are seeded random token ids of 8 lengths (16 .. 2100: the longest has more than index_topk visible
CSA rows, so the indexer's top-k selects; several cross HCA's 128-token windows). HF runs as a subprocess
(this file, `--hf-worker`, under a Python with torch + transformers >= 5.24 and no jax): `generate` greedy with
the raw logits of every step. Our side is `serving.LLM` on the same folder. A prompt counts as equal when
all tokens agree; a divergence at step i is a near-tie when HF's top-2 logits at step i differ by
< --tie (1e-4 by default): the two engines' float32 rounding may pick either.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

LENGTHS = (16, 100, 129, 300, 512, 700, 1000, 2100)


def prompts(vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(10, min(vocab, 8000), n).tolist() for n in LENGTHS]


def hf_worker(model: str, prompts_json: str, new_tokens: int, out: str) -> None:
    """Under the torch Python: greedy tokens and each step's top-2 logit gap."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    res = []
    for p in json.loads(Path(prompts_json).read_text()):
        with torch.inference_mode():
            g = m.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           output_logits=True, return_dict_in_generate=True)
        gaps = [float(v[0] - v[1]) for v in (torch.topk(s[0].float(), 2).values for s in g.logits)]
        res.append({"tokens": g.sequences[0, len(p):].tolist(), "top2_gap": gaps})
    Path(out).write_text(json.dumps(res))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m serving.bench.hf_parity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a V4 checkpoint folder both engines load")
    ap.add_argument("--hf-python", required=True, help="a Python with torch + transformers >= 5.24")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--tie", type=float, default=1e-4, help="top-2 logit gap below which a divergence is a tie")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--hf-worker", nargs=3, metavar=("PROMPTS_JSON", "NEW_TOKENS", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.hf_worker:
        return hf_worker(a.model, a.hf_worker[0], int(a.hf_worker[1]), a.hf_worker[2])

    from serving import LLM, SamplingParams

    llm = LLM(a.model, dtype="float32", max_model_len=max(LENGTHS) + a.new_tokens + 128, max_num_seqs=8,
              max_num_batched_tokens=512, swa_bounded_replay=False, enable_prefix_caching=False)
    ps = prompts(llm.engine.runner.config.vocab_size, a.seed)
    ours = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True))]
    with tempfile.TemporaryDirectory() as tmp:
        pj, out = Path(tmp) / "prompts.json", Path(tmp) / "hf.json"
        pj.write_text(json.dumps(ps))
        subprocess.run([a.hf_python, __file__, "--model", a.model, "--hf-python", a.hf_python,
                        "--hf-worker", str(pj), str(a.new_tokens), str(out)], check=True)
        hf = json.loads(out.read_text())
    rows = []
    for p, mine, ref in zip(ps, ours, hf):
        first = next((i for i, (x, y) in enumerate(zip(mine, ref["tokens"])) if x != y), None)
        rows.append({"prompt_len": len(p), "equal": first is None, "first_divergence": first,
                     "hf_top2_gap_there": None if first is None else ref["top2_gap"][first],
                     "near_tie": first is not None and ref["top2_gap"][first] < a.tie})
    result = {"model": a.model, "new_tokens": a.new_tokens, "tie": a.tie, "prompts": rows,
              "equal": sum(r["equal"] for r in rows), "near_ties": sum(r["near_tie"] for r in rows),
              "real_mismatches": sum(not r["equal"] and not r["near_tie"] for r in rows)}
    print(f"{'prompt':>7} {'equal':>6} {'diverges at':>12} {'HF top-2 gap':>13}")
    for r in rows:
        gap = "" if r["hf_top2_gap_there"] is None else f"{r['hf_top2_gap_there']:.2e}"
        print(f"{r['prompt_len']:>7} {str(r['equal']):>6} {'' if r['equal'] else r['first_divergence']:>12} {gap:>13}")
    print(f"{result['equal']}/{len(rows)} equal, {result['near_ties']} near-ties (gap < {a.tie}), "
          f"{result['real_mismatches']} mismatches")
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(0 if (main() or {}).get("real_mismatches", 0) == 0 else 1)
