"""Runtime and engine outputs for a fixed schedule, saved to an npz, and a comparison of two such files: the
check that a refactor or an optimisation left the served numbers unchanged.

    python tools/logit_fingerprint.py run before.npz      # on the old code
    python tools/logit_fingerprint.py run after.npz       # on the new code
    python tools/logit_fingerprint.py compare before.npz after.npz

Runner schedule, per configuration (preset tiny / small / the tiny V4 x replay on/off x KV format): two prompts
prefilled in uneven chunks that share steps, three decode steps, then a prefix hit on the first prompt's blocks
(encoder-side replay when on) beside a prompt-logprobs request, then two more decodes. Saved: full logit rows,
sampled tokens, their logprobs and top logprobs, prompt logprobs.

Served schedule (`serving.LLM`, the engine with its scheduler, async scheduling and output path), per configuration
(tiny V4.1 float weights / release weights + release KV, replay on/off, float32 and bfloat16; the tiny V4; tiny
with DSpark speculative decoding): requests sharing a prefix (a prefix hit), chunked prefill, a mixed batch, greedy and seeded sampling,
logprobs, prompt logprobs, a stop string and min_tokens. Saved: every request's token ids, logprobs, top logprobs,
prompt logprobs, finish reason, cached tokens; for speculation the accepted drafts per position.

Random weights from a fixed seed, so both sides see the same model.
"""

from __future__ import annotations

import argparse

import numpy as np

import dsv41
from dsv41.config import load_config
from serving.runtime.batch import SeqChunk
from serving.runtime.block_manager import BlockManager
from serving.runtime.config import RuntimeConfig
from serving.runtime.encoder_replay import plan_prefix_hit
from serving.runtime.kv_cache import smallest_block_size
from serving.runtime.runner import Runner

V4_CONFIG = "tests/fixtures/oracle/v4_tiny/config.json"  # 4 layers: SWA (hash-routed), CSA, HCA, CSA

# per preset: runtime capacities, prompt lengths (a, b, c), prefill schedule (tokens per request per step), hit length
SCHEDULES = {
    "tiny": (dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, block_size=8,
                  token_buckets=(1, 2, 4, 8, 16, 24, 32)),
             (77, 40, 25), [{"a": 20, "b": 12}, {"a": 12, "b": 20}, {"a": 32}, {"a": 13, "b": 8}], 64),
    "small": (dict(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024, token_buckets=(4, 128, 256)),
              (300, 150, 60), [{"a": 200, "b": 56}, {"a": 100, "b": 94}], 256),
    "v4": (dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, token_buckets=(8, 32, 64)),
           (300, 90, 40), [{"a": 40, "b": 24}, {"a": 64}, {"a": 30, "b": 34}, {"a": 64}, {"a": 64}, {"b": 32}], 256),
}


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, min(vocab, 250) - 1, n)]


def _model(preset: str, seed: int = 7, **kw):
    return dsv41.random_model(load_config(V4_CONFIG) if preset == "v4" else preset, seed=seed, **kw)


class _Schedule:
    """A minimal driver of one Runner: requests with slots and blocks, no scheduler policy."""

    def __init__(self, runner: Runner, config, replay: bool, out: dict):
        self.r, self.config, self.replay, self.out = runner, config, replay, out
        self.bm = BlockManager(runner.layout.num_blocks, runner.layout.block_size, True)
        self.reqs, self.slots, self.last = {}, list(range(4)), {}

    def start(self, rid: str, toks: list[int]) -> None:
        hit = self.bm.lookup(toks[:-1])
        plan = plan_prefix_hit(hit.num_tokens, self.config, self.replay)
        if plan.hit_tokens < hit.num_tokens:
            hit = type(hit)(plan.hit_tokens, hit.block_ids[: plan.hit_tokens // self.bm.block_size])
        self.bm.admit(rid, toks, hit)
        self.reqs[rid] = dict(toks=list(toks), slot=self.slots.pop(0), plan=plan, done=plan.replay_start)

    def release(self, rid: str) -> dict:
        req = self.reqs.pop(rid)
        self.bm.free(rid)
        self.slots.append(req["slot"])
        return req

    def step(self, work: dict[str, int], key: str, keep: tuple[str, ...] = ()) -> None:
        """Run `work` (request -> at most that many tokens); with `keep`, a sampling step whose kept requests
        also return prompt logprobs, else a logits step."""
        chunks = []
        for rid, n in work.items():
            q = self.reqs[rid]
            s, e = q["done"], min(q["done"] + n, len(q["toks"]))
            assert self.bm.allocate(rid, e)
            chunks.append(SeqChunk(slot=q["slot"], block_table=self.bm.block_table(rid), token_ids=q["toks"][:e],
                                   start=s, end=e, kv_floor=q["plan"].replay_start, write_floor=q["plan"].write_floor,
                                   trim=self.replay and rid not in keep,
                                   prompt_logprobs=rid in keep and s < len(q["toks"]) - 1))
        logits = None if keep else np.asarray(self.r.forward(chunks))
        sampled = self.r.step(chunks, [None] * len(chunks)) if keep else None
        for i, rid in enumerate(work):
            q = self.reqs[rid]
            q["done"] = chunks[i].end
            self.bm.commit(rid, q["toks"], q["done"])
            if logits is not None:
                self.out[f"{key}{rid}_logits"] = logits[i]
                self.last[rid] = int(np.argmax(logits[i]))
                continue
            self.last[rid] = int(sampled.tokens[i])
            self.out[f"{key}{rid}_tok"] = sampled.tokens[i]
            self.out[f"{key}{rid}_lp"] = sampled.logprobs[i]
            self.out[f"{key}{rid}_top"] = sampled.top_logprobs[i]
            self.out[f"{key}{rid}_topids"] = sampled.top_ids[i]
            if i in sampled.prompt_logprobs:
                rows = sampled.prompt_logprobs[i]
                self.out[f"{key}{rid}_rows"] = np.concatenate([rows.logprob, rows.top_logprobs.ravel()])

    def decode(self, rids: tuple[str, ...], key: str) -> None:
        for rid in rids:
            q = self.reqs[rid]
            if q["done"] == len(q["toks"]):
                q["toks"].append(self.last[rid])
        self.step({rid: 1 if self.reqs[rid]["done"] == len(self.reqs[rid]["toks"]) - 1 else 10**6 for rid in rids},
                  key)


def fingerprint(preset: str, replay: bool, kv_format: str, kernel_impl: str) -> dict[str, np.ndarray]:
    model = _model(preset)
    config = model.config
    capacities, lengths, prefill, hit = SCHEDULES[preset]
    capacities = {"block_size": max(64, smallest_block_size(config)), **capacities}
    runner = Runner(model, RuntimeConfig(**capacities, swa_bounded_replay=replay, kv_cache_dtype=kv_format,
                                         fake_quant=kv_format == "release", kernel_impl=kernel_impl), progress=False)
    runner.compiler.precompile()
    out: dict[str, np.ndarray] = {}
    s = _Schedule(runner, config, replay, out)
    vocab, budget = config.vocab_size, capacities["max_num_batched_tokens"]
    s.start("a", _prompt(1, lengths[0], vocab))
    s.start("b", _prompt(2, lengths[1], vocab))
    for n, work in enumerate(prefill):
        s.step(work, f"s{n}_")
    for rid in ("a", "b"):  # any prefill the schedule left
        while s.reqs[rid]["done"] < len(s.reqs[rid]["toks"]):
            s.step({rid: budget}, f"p{rid}_")
    for n in range(3):
        s.decode(("a", "b"), f"d{n}_")
    a = s.release("a")
    s.start("c", a["toks"][:hit] + _prompt(3, lengths[2], vocab))
    out["c_hit"] = np.array([s.reqs["c"]["plan"].hit_tokens, s.reqs["c"]["plan"].replay_start])
    s.start("k", _prompt(4, lengths[2], vocab))
    s.step({"c": budget - lengths[2], "k": lengths[2]}, "h_", keep=("k",))
    n = 0
    while s.reqs["c"]["done"] < len(s.reqs["c"]["toks"]):
        s.step({"c": budget}, f"h{n}_")
        n += 1
    for n in range(2):
        s.decode(("c",), f"e{n}_")
    return out


# served configurations: (model preset, model keywords, engine keywords)
_SERVED_RC = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, block_size=8,
                  token_buckets=(2, 4, 8, 16, 32), seed=5)
SERVED = {
    "tiny-exact": ("tiny", {}, dict(_SERVED_RC, swa_bounded_replay=False)),
    "tiny-replay": ("tiny", {}, dict(_SERVED_RC, swa_bounded_replay=True)),
    "tiny-release": ("tiny", dict(weights="release"), dict(_SERVED_RC, kv_cache_dtype="release")),
    "tiny-sync": ("tiny", {}, dict(_SERVED_RC, async_scheduling=False)),
    "tiny-spec": ("tiny", {}, dict(_SERVED_RC, swa_bounded_replay=False,
                                   speculative_config='{"method": "dspark", "num_speculative_tokens": 3}')),
    "v4": ("v4", {}, dict(_SERVED_RC, max_num_batched_tokens=64, max_model_len=512, block_size=None,
                          token_buckets=(8, 32, 64))),
    "tiny-bf16": ("tiny", dict(dtype="bfloat16"), _SERVED_RC),
    "tiny-spec-bf16": ("tiny", dict(dtype="bfloat16"), dict(_SERVED_RC, speculative_config='{"method": "dspark"}')),
}


def served(name: str) -> dict[str, np.ndarray]:
    """The served schedule through `serving.LLM` (see the module docstring)."""
    from serving import LLM, SamplingParams
    from serving.text.tokenizer import byte_level_tokenizer

    preset, model_kw, engine_kw = SERVED[name]
    model = _model(preset, seed=11, **model_kw)
    vocab = model.config.vocab_size
    text = preset != "v4"  # the tiny V4's 256 ids hold no byte-level tokenizer with V4.1's special tokens
    llm = LLM(model, tokenizer=byte_level_tokenizer() if text else None, progress=False, **engine_kw)
    spec = "speculative_config" in engine_kw
    shared = _prompt(21, 160 if preset == "v4" else 64, vocab)
    prompts = [shared + _prompt(22, 9, vocab), _prompt(23, 70 if preset == "v4" else 45, vocab),
               shared + _prompt(24, 13, vocab), _prompt(25, 6, vocab), shared[:24] + _prompt(26, 30, vocab)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3)
    params = [greedy,
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=10, logprobs=2),
              greedy if spec else SamplingParams(temperature=0.0, max_tokens=9, logprobs=1, prompt_logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=7, min_tokens=5, stop_token_ids=(7,)),
              SamplingParams(temperature=0.0, max_tokens=14)]
    out: dict[str, np.ndarray] = {}

    def record(key: str, results) -> None:
        for i, r in enumerate(results):
            c = r.outputs[0]
            out[f"{key}{i}_ids"] = np.array(c.token_ids, np.int64)
            out[f"{key}{i}_finish"] = np.array([("length", "stop", "abort").index(c.finish_reason),
                                                 -1 if not isinstance(c.stop_reason, int) else c.stop_reason,
                                                 r.num_cached_tokens])
            if c.logprobs:
                out[f"{key}{i}_lp"] = np.array([[t.logprob, *(v for _, v in t.top)] for t in c.logprobs])
                out[f"{key}{i}_topids"] = np.array([[t.token_id, *(k for k, _ in t.top)] for t in c.logprobs])
            if r.prompt_logprobs is not None:
                out[f"{key}{i}_plp"] = np.array([[t.logprob, *(v for _, v in t.top)]
                                                 for t in r.prompt_logprobs if t is not None])
            if text:
                out[f"{key}{i}_text"] = np.frombuffer(c.text.encode(), np.uint8)

    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    record("a", first)
    # again, now that the shared prefix is cached (prefix hits), and with a stop string taken from the first run's
    # text of request 4 where there is text
    stop = ()
    if text:
        t = first[4].outputs[0].text
        stop = (t[len(t) // 2:len(t) // 2 + 2],) if len(t) >= 4 else ()
    params[4] = SamplingParams(temperature=0.0, max_tokens=14, stop=stop, logprobs=0)
    record("b", llm.generate([{"prompt_token_ids": p} for p in prompts], params))
    if spec:
        m = llm.engine.metrics
        out["spec"] = np.array([m.spec_drafts._value.get(), m.spec_draft_tokens._value.get(),
                                m.spec_accepted._value.get(), *(c._value.get() for c in m.spec_accepted_per_pos)])
    return out


def compare(before: str, after: str, show_all: bool = False) -> float:
    a, b = np.load(before), np.load(after)
    only = sorted(set(a.files) ^ set(b.files))
    worst: dict[str, float] = {}
    for k in sorted(set(a.files) & set(b.files)):
        if a[k].shape != b[k].shape:
            print(f"{k}: shape {a[k].shape} vs {b[k].shape}")
            worst[k] = float("inf")
            continue
        d = float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) if a[k].size else 0.0
        group = "/".join(k.split("/")[:3])
        worst[group] = max(worst.get(group, 0.0), d)
        if d > 0 and show_all:
            print(f"{k}: {d:.3g}")
    for group, d in sorted(worst.items()):
        print(f"{group:28s} max|diff| = {d:.3g}")
    print(f"compared {len(set(a.files) & set(b.files))} arrays; in only one file: {len(only)}"
          + (f" (e.g. {only[:3]})" if only else ""))
    return max(worst.values(), default=0.0) if not only else float("inf")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run the schedule and save the outputs")
    run.add_argument("out")
    run.add_argument("--presets", default="tiny,small,v4", help=f"comma list of {sorted(SCHEDULES)}")
    run.add_argument("--served", default=",".join(SERVED), help=f"comma list of {sorted(SERVED)}")
    run.add_argument("--kernel-impl", default="auto", choices=("auto", "pallas", "xla", "reference"))
    cmp = sub.add_parser("compare", help="max |diff| per configuration of two saved runs")
    cmp.add_argument("before")
    cmp.add_argument("after")
    cmp.add_argument("--all", action="store_true", help="also print every differing array")
    args = p.parse_args()
    if args.cmd == "compare":
        raise SystemExit(0 if compare(args.before, args.after, args.all) == 0 else 1)
    presets = [p for p in args.presets.split(",") if p]
    if unknown := set(presets) - set(SCHEDULES):
        p.error(f"--presets: unknown {sorted(unknown)}; choose from {sorted(SCHEDULES)}")
    res = {}
    for preset in presets:
        for replay in (False, True):
            for kv_format in ("auto", "release") if preset == "tiny" else ("auto",):
                o = fingerprint(preset, replay, kv_format, args.kernel_impl)
                res.update({f"{preset}/{'on' if replay else 'off'}/{kv_format}/{k}": np.asarray(v) for k, v in o.items()})
                print(preset, "replay" if replay else "exact", kv_format, len(o), "arrays", flush=True)
    for name in filter(None, args.served.split(",")):
        o = served(name)
        res.update({f"served/{name}/x/{k}": np.asarray(v) for k, v in o.items()})
        print("served", name, len(o), "arrays", flush=True)
    np.savez(args.out, **res)


if __name__ == "__main__":
    main()
