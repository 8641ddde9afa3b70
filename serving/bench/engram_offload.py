"""Decode step time with the Engram tables in host memory vs on the device, side by side in one run.

The model is nano-austen's architecture (random weights) with its two Engram tables grown to `--table-gib`
(random FP8 rows; `engram_vocab_size` scaled so the prime layout gives that many rows). Both variants run the
same runtime (`serving.runtime.Runner`): `--batch` requests prefilled to `--context` tokens, then decode steps
whose tokens are drawn at random, so every step's n-gram hashes land on random rows of the whole table.
host    the tables are host arrays (`dsv41.engram_host.HostEngramTables`); each step gathers its rows on the host
        and sends them with the batch (device memory for Engram: the staging rows only)
device  the tables are device parameters and the step gathers from them
The variants alternate `--repeats` times; each reports the median step time (batch build, both segments,
sampling, the tokens' copy back). Prints a table and writes JSON.

    python -m serving.bench.engram_offload --table-gib 4 --batch 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import dsv41
from dsv41.engram_host import HostEngramTables
from dsv41.init import random_params
from dsv41.layers.engram import engram_primes
from serving.runtime.batch import SeqChunk
from serving.runtime.config import RuntimeConfig
from serving.runtime.runner import Runner


def big_engram_config(table_gib: float) -> dsv41.ModelConfig:
    """nano's config with Engram tables of about `table_gib` GiB in all (FP8 rows + one scale byte per 32)."""
    c = dsv41.load_config("nano")
    row_bytes = c.engram_head_dim + c.engram_head_dim // 32
    per_vocab = len(c.engram_layer_ids) * c.engram_hash_cols * row_bytes  # table bytes per unit of engram vocab
    vocab = max(c.engram_vocab_size, int(table_gib * 2**30 / per_vocab))
    primes = engram_primes(len(c.engram_layer_ids), c.engram_max_ngram_size, c.engram_n_heads, vocab)
    return c.replace(engram_vocab_size=vocab, engram_num_embeddings=tuple(sum(p) for p in primes))


def build_models(c: dsv41.ModelConfig, dtype: str, seed: int = 0) -> tuple[dsv41.Model, dsv41.Model]:
    """(tables on the device, the same tables in host memory), the other weights random and shared."""
    _, abstract = dsv41.abstract_params(c, jnp.dtype(dtype), engram_fp8=True)
    rest = {p: s for p, s in abstract.items() if p[2:4] != ("engram", "embed")}
    params = {p: jnp.asarray(a) for p, a in random_params(c, rest, seed).items()}
    rng = np.random.default_rng(seed)
    values, scales = [], []
    for rows in c.engram_num_embeddings:  # positive e4m3 bytes below NaN (0x7f), exponents near 2**-4
        values.append(rng.integers(0, 0x7F, (rows, c.engram_head_dim), dtype=np.uint8))
        scales.append(rng.integers(119, 125, (rows, c.engram_head_dim // 32), dtype=np.uint8))
    token_map = np.arange(c.vocab_size) % c.engram_compressed_vocab_size
    host = dsv41.Model(c, params, dtype=jnp.dtype(dtype), token_map=token_map,
                       engram_tables=HostEngramTables(values, scales))
    on_device = dict(params)
    for lid, v, s in zip(c.engram_layer_ids, values, scales):
        on_device[("layers", lid, "engram", "embed", "weight")] = jnp.asarray(v.view(ml_dtypes.float8_e4m3fn))
        on_device[("layers", lid, "engram", "embed", "scale")] = jnp.asarray(s)
    device = dsv41.Model(c, on_device, dtype=jnp.dtype(dtype), token_map=token_map)
    return device, host


class _Decoder:
    """`batch` requests on one runner: prefill, then decode steps with random tokens."""

    def __init__(self, model: dsv41.Model, rc: RuntimeConfig, batch: int, context: int, seed: int):
        self.runner = Runner(model, rc, progress=False)
        self.runner.compiler.precompile()
        rng = np.random.default_rng(seed)
        self.vocab, self.rng = model.config.vocab_size, rng
        self.seqs = [[int(t) for t in rng.integers(3, self.vocab, context)] for _ in range(batch)]
        per_seq = -(-rc.max_model_len // rc.block_size)
        self.tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(batch)]
        for s, seq in enumerate(self.seqs):
            for start in range(0, context, rc.max_num_batched_tokens):
                end = min(start + rc.max_num_batched_tokens, context)
                self.runner.forward([self._chunk(s, start, end)]).block_until_ready()

    def _chunk(self, s: int, start: int, end: int) -> SeqChunk:
        return SeqChunk(slot=s, block_table=self.tables[s], token_ids=self.seqs[s][:end], start=start, end=end)

    def step(self) -> float:
        chunks = []
        for s, seq in enumerate(self.seqs):
            seq.append(int(self.rng.integers(3, self.vocab)))
            chunks.append(self._chunk(s, len(seq) - 1, len(seq)))
        t = time.perf_counter()
        np.asarray(self.runner.step(chunks, [None] * len(chunks)).tokens)
        return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.bench.engram_offload", description=__doc__.splitlines()[0])
    ap.add_argument("--table-gib", type=float, default=4.0, help="both Engram tables together")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=24, help="decode steps per variant and repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--out", default="bench_engram_offload.json")
    a = ap.parse_args(argv)
    c = big_engram_config(a.table_gib)
    t0 = time.perf_counter()
    device, host = build_models(c, a.dtype)
    table_bytes = host.engram_tables.nbytes
    max_len = a.context + a.repeats * (a.steps + 1) + 8
    rc = RuntimeConfig(max_num_seqs=a.batch, max_num_batched_tokens=64, max_model_len=max_len, block_size=64,
                       token_buckets=tuple(sorted({a.batch, 64})))
    decoders = {"device": _Decoder(device, rc, a.batch, a.context, 1), "host": _Decoder(host, rc, a.batch, a.context, 1)}
    setup = time.perf_counter() - t0
    times: dict[str, list[float]] = {k: [] for k in decoders}
    for _ in range(a.repeats):
        for name, d in decoders.items():
            d.step()  # warm
            times[name].append(statistics.median(d.step() for _ in range(a.steps)))
    ids = host.engram_hashes(np.asarray(decoders["host"].seqs[0]))[-a.batch:]
    gather = statistics.median(_timed(lambda: host.engram_tables.gather(ids)) for _ in range(50))
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"table_gib": table_bytes / 2**30, "engram_rows": list(c.engram_num_embeddings), "batch": a.batch,
           "dtype": a.dtype, "steps": a.steps, "repeats": a.repeats, "device": jax.devices()[0].device_kind,
           "step_ms": {k: [round(t * 1e3, 3) for t in v] for k, v in times.items()},
           "median_step_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
           "host_over_device": med["host"] / med["device"],
           "host_gather_ms_per_step": gather * 1e3,
           "staging_bytes_per_step": host.engram_tables.staging_bytes(a.batch, c.engram_hash_cols),
           "device_param_bytes": {"device": device.device_bytes(), "host": host.device_bytes()},
           "setup_seconds": round(setup, 1)}
    print(f"Engram tables {out['table_gib']:.2f} GiB, decode batch {a.batch}, {a.dtype}, {jax.devices()[0].device_kind}")
    print("| tables | median step (ms) | per repeat (ms) | device parameter bytes |")
    print("|---|---|---|---|")
    for k in decoders:
        print(f"| {k} | {out['median_step_ms'][k]:.2f} | {', '.join(f'{t:.2f}' for t in out['step_ms'][k])} | "
              f"{out['device_param_bytes'][k] / 2**20:.1f} MiB |")
    print(f"host / device = {out['host_over_device']:.3f}; host gather {gather * 1e3:.3f} ms per step, staging "
          f"{out['staging_bytes_per_step']} B per step")
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    raise SystemExit(main())
