"""`python -m serving.bench.replay_quality`: what SWA bounded replay costs in held-out quality, measured with the
serving runtime on the trained nano-austen model (or any checkpoint / preset and passages you pass).

Each passage of L tokens is a context of L - S tokens and a continuation of S tokens, run as requests in the
runner's slots in four modes (spec §3.3-3.4):

| mode | context prefill | what is approximate |
|---|---|---|
| exact | every row, no prefix hit | nothing: the reference |
| decoder | each chunk runs the layers after the cut on its last `window` rows | the last context rows' decoder windows |
| encoder@H | prefix hit of H tokens, replay from H - window with the windows cut there | the replayed rows in every layer, hence the global KV rows written after H |
| both@H | the two together (the server's default after a hit) | both |

The hit's cached rows are the exact request's own (its block table's first H / block_size blocks), as a
prefix-cache hit on an earlier request with the same prefix would give.

- **Perplexity**: the continuation is scored teacher-forced: the context's last row predicts its first token,
  then one untrimmed chunk over the continuation returns every row's next-token log-probability (the same rows
  S teacher-forced decode steps would compute). Per mode: the mean NLL over passages and its standard error
  (SE), the paired difference to exact and its SE, and the difference in units of exact's SE (the seeds'
  "within 1.5 standard errors" criterion).
- **Greedy agreement**: separate requests prefill the same context in the same mode, then decode S tokens
  greedily; the share of positions equal to exact's tokens, and the tokens before the first difference.

Prints a markdown table and writes JSON (`--out`). The defaults (8 passages of 1K, 2K and 4K tokens, hits at
1/4, 1/2 and 3/4 of the context) took 7.5 minutes on a 2-core CPU (70 s of it compilation).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from scipy.special import log_softmax

import dsv41
from serving.runtime.batch import SeqChunk
from serving.runtime.config import RuntimeConfig
from serving.runtime.encoder_replay import PrefixPlan, plan_prefix_hit
from serving.runtime.compiler import enable_compilation_cache
from serving.runtime.runner import Runner
from serving.runtime.sampling_params import SamplingParams

WITHIN_SE = 1.5  # the seeds' claim: accuracy gaps of bounded replay within about 1.5 standard errors
GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class Mode:
    name: str
    trim: bool  # decoder replay: each prefill chunk runs the layers after the cut on its last window rows
    hit: int = 0  # prefix-cache hit, tokens (block aligned; 0: cold)
    bounded_hit: bool = True  # replay the last window before the hit (False: the exact halo; a control)

    def plan(self, config: dsv41.ModelConfig) -> PrefixPlan:
        if not self.hit:
            return PrefixPlan(0, 0, 0)
        plan = plan_prefix_hit(self.hit, config, self.bounded_hit)
        if plan.hit_tokens != self.hit:
            raise ValueError(f"{self.name}: a hit of {self.hit} tokens is not adopted (it must exceed the replay "
                             "length)")
        return plan


def hit_lengths(context: int, fractions: Sequence[float], block_size: int, window: int) -> list[int]:
    """Block-aligned hits at `fractions` of the context that the runtime adopts (longer than one window)."""
    hits = sorted({int(f * context) // block_size * block_size for f in fractions})
    return [h for h in hits if window < h < context]


def study_modes(context: int, fractions: Sequence[float], block_size: int, window: int) -> list[Mode]:
    hits = hit_lengths(context, fractions, block_size, window)
    return ([Mode("exact", False), Mode("decoder", True)] + [Mode(f"encoder@{h}", False, h) for h in hits]
            + [Mode(f"both@{h}", True, h) for h in hits])


@dataclass
class PassageResult:
    logprobs: dict[str, np.ndarray]  # mode -> [S] log-probability of each continuation token
    greedy: dict[str, np.ndarray]  # mode -> [S] greedy tokens after the context


class ReplayStudy:
    """One runner with a slot per (mode, role): `score` requests give the teacher-forced log-probabilities,
    `greedy` requests the free-running continuation. The exact score request (slot 0) is the prefix donor."""

    def __init__(self, model: dsv41.Model, *, max_modes: int, max_len: int, continuation: int, chunk: int = 512,
                 block_size: int = 64, progress: bool = True):
        c = model.config
        self.config, self.S, self.chunk, self.block_size = c, continuation, chunk, block_size
        self.max_modes = max_modes
        slots = 2 * max_modes
        if max_modes * continuation > chunk:
            raise ValueError(f"{max_modes} modes x {continuation} continuation tokens exceed the {chunk}-token step")
        decode = 1 << (max_modes - 1).bit_length()
        buckets = tuple(sorted({decode, continuation, c.sliding_window, chunk}))
        rc = RuntimeConfig(max_num_seqs=slots, max_num_batched_tokens=chunk, max_model_len=max_len,
                           block_size=block_size, token_buckets=buckets)
        self.runner = Runner(model, rc, progress=progress)
        self.compile_seconds = self.runner.compiler.precompile()

    def _table(self, slot: int, hit: int) -> list[int]:
        """The slot's own blocks, the first hit / block_size of them replaced by the donor's (slot 0)."""
        mb = self.runner.max_blocks
        shared = hit // self.block_size
        return list(range(shared)) + list(range(slot * mb + shared, (slot + 1) * mb))

    def _prefill(self, requests: list[dict], context: list[int]) -> dict[int, np.ndarray]:
        """Prefill each request's context from its replay start, packing chunks of several requests into steps
        of at most `chunk` tokens; returns slot -> the context's last-row logits [V]."""
        todo = {r["slot"]: r["start"] for r in requests}
        by_slot = {r["slot"]: r for r in requests}
        last = {}
        while todo:
            budget, step = self.chunk, []
            for slot, start in list(todo.items()):
                if budget == 0:
                    break
                end = min(len(context), start + budget)
                r = by_slot[slot]
                step.append(SeqChunk(slot=slot, block_table=r["table"], token_ids=context, start=start, end=end,
                                     kv_floor=r["kv_floor"], write_floor=r["write_floor"], trim=r["trim"]))
                budget -= end - start
                if end == len(context):
                    del todo[slot]
                else:
                    todo[slot] = end
            logits = np.asarray(self.runner.forward(step), np.float64)
            for ch, row in zip(step, logits):
                if ch.end == len(context):
                    last[ch.slot] = row
        return last

    def run_passage(self, tokens: Sequence[int], modes: Sequence[Mode]) -> PassageResult:
        if len(modes) > self.max_modes or modes[0] != Mode("exact", False):
            raise ValueError(f"modes must start with exact and number at most {self.max_modes}")
        tokens = [int(t) for t in tokens]
        L, S = len(tokens), self.S
        context = tokens[: L - S]
        reqs = {}
        for role, offset in (("score", 0), ("greedy", self.max_modes)):
            for i, m in enumerate(modes):
                plan = m.plan(self.config)
                reqs[role, m.name] = {"slot": offset + i, "table": self._table(offset + i, plan.hit_tokens),
                                      "start": plan.replay_start, "kv_floor": plan.replay_start,
                                      "write_floor": plan.write_floor, "trim": m.trim}
        donor = reqs["score", "exact"]
        last = self._prefill([donor], context)  # its global rows below each hit are what the hits reuse
        last |= self._prefill([r for r in reqs.values() if r is not donor], context)

        def chunk(r, ids, start, **kw):
            return SeqChunk(slot=r["slot"], block_table=r["table"], token_ids=ids, start=start, end=len(ids),
                            kv_floor=r["kv_floor"], write_floor=r["write_floor"], **kw)

        # teacher-forced: row L-S-1 predicts the first continuation token, the continuation's rows the rest
        score = [reqs["score", m.name] for m in modes]
        out = self.runner.step([chunk(r, tokens, L - S, trim=False, prompt_logprobs=True) for r in score],
                               [GREEDY] * len(score))
        logprobs = {}
        for i, (m, r) in enumerate(zip(modes, score)):
            first = log_softmax(last[r["slot"]])
            logprobs[m.name] = np.concatenate([[first[tokens[L - S]]], out.prompt_logprobs[i].logprob[: S - 1]])

        greedy = [reqs["greedy", m.name] for m in modes]
        seqs = [context + [int(np.argmax(last[r["slot"]]))] for r in greedy]
        for _ in range(S - 1):
            step = [chunk(r, ids, len(ids) - 1) for r, ids in zip(greedy, seqs)]
            for ids, row in zip(seqs, np.asarray(self.runner.forward(step))):
                ids.append(int(np.argmax(row)))
        return PassageResult(logprobs, {m.name: np.array(ids[L - S:]) for m, ids in zip(modes, seqs)})


def summarize(results: Sequence[PassageResult], unigram: np.ndarray | None = None) -> list[dict]:
    """Per mode: mean NLL per token over passages and its SE, perplexity, the paired difference to exact, and
    greedy agreement. `unigram`: [passages, S] unigram NLLs of the same tokens (the baseline row)."""
    names = list(results[0].logprobs)
    n = len(results)
    nll = {m: np.array([-r.logprobs[m].mean() for r in results]) for m in names}
    se = lambda x: float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    exact = nll["exact"]
    rows = []
    for m in names:
        d = nll[m] - exact
        same = np.array([r.greedy[m] == r.greedy["exact"] for r in results])  # [n, S]
        prefix = [int(np.argmin(s)) if not s.all() else s.size for s in same]
        row = {"mode": m, "nll": float(nll[m].mean()), "nll_se": se(nll[m]), "ppl": float(math.exp(nll[m].mean())),
               "delta_nll": float(d.mean()), "delta_se": se(d), "greedy_agreement": float(same.mean()),
               "greedy_identical_prefix": float(np.mean(prefix))}
        row["delta_in_exact_se"] = row["delta_nll"] / row["nll_se"] if row["nll_se"] > 0 else 0.0
        row["within_1p5_se"] = bool(abs(row["delta_in_exact_se"]) <= WITHIN_SE)
        rows.append(row)
    if unigram is not None:
        u = unigram.mean(axis=1)
        rows.append({"mode": "unigram", "nll": float(u.mean()), "nll_se": se(u), "ppl": float(math.exp(u.mean()))})
    return rows


def markdown(tables: dict[int, list[dict]], S: int, n: dict[int, int]) -> str:
    head = ("| passage | mode | NLL/token ± SE | ppl | ΔNLL vs exact ± SE (paired) | Δ / SE(exact) | "
            f"greedy agreement ({S} tok) | identical prefix |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for L, rows in tables.items():
        for r in rows:
            if r["mode"] == "unigram":
                lines.append(f"| {L} ({n[L]}) | unigram | {r['nll']:.3f} ± {r['nll_se']:.3f} | {r['ppl']:.1f} | | | | |")
                continue
            flag = "" if r["within_1p5_se"] else " (!)"
            lines.append(f"| {L} ({n[L]}) | {r['mode']} | {r['nll']:.4f} ± {r['nll_se']:.4f} | {r['ppl']:.2f} | "
                         f"{r['delta_nll']:+.5f} ± {r['delta_se']:.5f} | {r['delta_in_exact_se']:+.3f}{flag} | "
                         f"{r['greedy_agreement']:.3f} | {r['greedy_identical_prefix']:.1f} |")
    return "\n".join(lines)


def run_study(model: dsv41.Model, passages_by_length: dict[int, np.ndarray], *, continuation: int = 64,
              fractions: Sequence[float] = (0.25, 0.5, 0.75), chunk: int = 512, block_size: int = 64,
              unigram=None, progress: bool = True, study: ReplayStudy | None = None) -> dict:
    """`passages_by_length`: L -> int [n, L] token ids. `unigram(ids) -> NLLs` adds the baseline row. `study`: an
    existing ReplayStudy of the same model to run on (its compiled buckets), else one sized for these passages."""
    W = model.config.sliding_window
    modes = {L: study_modes(L - continuation, fractions, block_size, W) for L in passages_by_length}
    max_modes, max_len = max(len(m) for m in modes.values()), max(passages_by_length)
    if study is None:
        study = ReplayStudy(model, max_modes=max_modes, max_len=max_len, continuation=continuation, chunk=chunk,
                            block_size=block_size, progress=progress)
    elif (study.max_modes < max_modes or study.runner.rc.max_model_len < max_len or study.S != continuation
          or (study.chunk, study.block_size) != (chunk, block_size)):
        raise ValueError(f"the given ReplayStudy does not fit {max_modes} modes of {max_len}-token passages "
                         f"(continuation {continuation}, chunk {chunk}, block size {block_size})")
    tables, seconds = {}, {}
    for L, rows in passages_by_length.items():
        t = time.perf_counter()
        results = []
        for i, ids in enumerate(rows):
            results.append(study.run_passage(ids, modes[L]))
            if progress:
                print(f"\r{L}-token passages: {i + 1}/{len(rows)} ({time.perf_counter() - t:.0f} s)", end="",
                      file=sys.stderr, flush=True)
        if progress:
            print(file=sys.stderr)
        u = None if unigram is None else np.stack([unigram(r[L - continuation:]) for r in rows])
        tables[L], seconds[L] = summarize(results, u), time.perf_counter() - t
    return {"continuation": continuation, "hit_fractions": list(fractions), "block_size": block_size, "window": W,
            "chunk": chunk, "within_se": WITHIN_SE, "compile_seconds": study.compile_seconds,
            "passages": {L: len(r) for L, r in passages_by_length.items()},
            "modes": {L: [asdict(m) for m in ms] for L, ms in modes.items()}, "seconds": seconds, "tables": tables}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the built-in nano-austen, scored on "
                                                  "its held-out novel)")
    ap.add_argument("--lengths", default="1024,2048,4096", help="passage lengths in tokens")
    ap.add_argument("--passages", type=int, default=8, help="passages per length")
    ap.add_argument("--continuation", type=int, default=64, help="scored / greedily decoded tokens at the end")
    ap.add_argument("--hit-fractions", default="0.25,0.5,0.75", help="prefix-hit lengths as fractions of the context")
    ap.add_argument("--chunk", type=int, default=512, help="tokens per prefill step (the engine's default)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--compilation-cache-dir", default=str(Path.home() / ".cache" / "dsv41-jax" / "xla"))
    ap.add_argument("--out", default="replay_quality.json")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    enable_compilation_cache(args.compilation_cache_dir)
    from dsv41 import nano

    folder = Path(args.model) if args.model else nano.NANO_DIR
    model = dsv41.load(folder)
    lengths = [int(x) for x in args.lengths.split(",")]
    data = {L: nano.passages(L, args.passages, folder, bos_id=model.config.bos_token_id) for L in lengths}
    result = run_study(model, data, continuation=args.continuation,
                       fractions=[float(x) for x in args.hit_fractions.split(",")], chunk=args.chunk,
                       block_size=args.block_size, unigram=lambda ids: nano.unigram_nll(ids, folder),
                       progress=not args.quiet)
    result["model"] = str(folder.name)
    print(markdown(result["tables"], args.continuation, result["passages"]))
    print(f"\ncompile {result['compile_seconds']:.0f} s; " +
          ", ".join(f"{L} tokens {s:.0f} s" for L, s in result["seconds"].items()))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
