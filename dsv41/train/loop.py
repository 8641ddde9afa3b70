"""The training run: backbone steps, then DSpark steps against the frozen backbone, with held-out evaluation,
Orbax checkpoints and a progress bar.

The NNX model is built and split once (graph definition + flat parameters); each step is one `jax.jit`
function over plain dicts of arrays keyed by the dotted parameter path, which merges the module inside
the trace. Three parameter groups (`dsv41.train.params.param_group`): the backbone (AdamW during the
backbone phase), the drafter (AdamW during the DSpark phase) and the MoE router biases, which follow
DeepSeek's aux-loss-free rule b_i += rate * sign(mean load - load_i) after every step.

Determinism: parameters come from `init_train_params(seed)`, batch b of step s from
`Windows.batch_at(s)` (seed, step) (the DSpark phase's from `Rows.batch_at(s)` when
`dspark_data` names fixed windows) and the DSpark anchors from default_rng([seed, step, 1]); nothing
else is random, so a run is a function of its config, and a resumed run repeats the uninterrupted one.
A checkpoint holds the step, the three groups and both optimiser states.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from dsv41.api import abstract_params
from dsv41.config import ModelConfig
from dsv41.layers.engram import EngramLayout
from dsv41.layers.basic import with_kernels
from dsv41.model import Transformer
from dsv41.train.config import TrainConfig
from dsv41.train.data import Rows, Windows, eval_windows
from dsv41.train.drafter import draft_losses
from dsv41.train.forward import backbone_forward
from dsv41.train.params import decays, init_train_params, param_group
from pallas_kernels.kernel_config import KernelConfig

Params = dict[str, jax.Array]


def _key(path: tuple) -> str:
    return ".".join(str(p) for p in path)


# ============================================================================ compiled steps
@functools.cache
def _graph(c: ModelConfig) -> tuple[nnx.GraphDef, dict[str, tuple], dict[str, jax.ShapeDtypeStruct]]:
    """Graph definition of the training model (XLA kernel paths: Pallas calls have no gradient rule),
    {dotted key: path} and {dotted key: abstract array}."""
    model = with_kernels(nnx.eval_shape(lambda: Transformer(c, dtype=jnp.float32)), KernelConfig(impl="xla"))
    graphdef, _ = nnx.split(model)
    _, abstract = abstract_params(c, jnp.float32)
    return graphdef, {_key(p): p for p in abstract}, {_key(p): v for p, v in abstract.items()}


def _merge(graphdef, paths: dict[str, tuple], *groups: Params):
    flat = [(paths[k], nnx.Param(v)) for g in groups for k, v in g.items()]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _optimizer(tc: TrainConfig, steps: int, lr: float, keys: list[str], paths: dict[str, tuple]):
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(tc.warmup_steps, max(steps - 1, 1)), max(steps, 2),
                                                  lr * tc.final_lr_fraction)
    mask = {k: decays(paths[k]) for k in keys}
    return optax.chain(optax.clip_by_global_norm(tc.grad_clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=tc.weight_decay, mask=mask))


def _bias_update(biases: Params, loads: jax.Array, keys: list[str], rate: float) -> Params:
    """Aux-loss-free balancing: each listed router bias moves by rate * sign(mean load - load)."""
    out = dict(biases)
    for i, k in enumerate(keys):
        load = loads[i].astype(jnp.float32)
        out[k] = biases[k] + rate * jnp.sign(jnp.mean(load) - load)
    return out


@functools.cache
def compiled_steps(c: ModelConfig, tc: TrainConfig) -> dict[str, Callable]:
    """The jitted functions of a (model config, train config) pair, shared by every Trainer of that pair."""
    graphdef, paths, abstract = _graph(c)
    groups = {g: sorted(k for k in paths if param_group(paths[k]) == g) for g in ("backbone", "dspark", "bias")}
    bb_bias = [k for k in groups["bias"] if not k.startswith("dspark.")]
    ds_bias = [k for k in groups["bias"] if k.startswith("dspark.")]
    opt_bb = _optimizer(tc, tc.backbone_steps, tc.learning_rate, groups["backbone"], paths)
    opt_ds = _optimizer(tc, tc.dspark_steps, tc.dspark_learning_rate, groups["dspark"], paths)

    def backbone_batch(bb, ds, bias, seqs, hashes):
        model = _merge(graphdef, paths, bb, ds, bias)
        one = lambda s, h: backbone_forward(model, s[:-1], s[1:], h, tc.moe_compute, tc.indexer_kl_stride)  # noqa: E731
        return jax.vmap(one)(seqs, hashes)

    def backbone_loss(bb, ds, bias, seqs, hashes):
        out = backbone_batch(bb, ds, bias, seqs, hashes)
        lm, kl, bal = jnp.mean(out.lm), jnp.mean(out.indexer_kl), jnp.mean(out.balance)
        loss = lm + tc.indexer_loss_weight * kl + tc.balance_loss_weight * bal
        return loss, (lm, kl, bal, jnp.sum(out.loads, axis=0))

    def backbone_step(state, seqs, hashes):
        p = state["params"]
        (_, (lm, kl, bal, loads)), grads = jax.value_and_grad(backbone_loss, has_aux=True)(
            p["backbone"], p["dspark"], p["bias"], seqs, hashes)
        updates, opt = opt_bb.update(grads, state["opt"]["backbone"], p["backbone"])
        params = {**p, "backbone": optax.apply_updates(p["backbone"], updates),
                  "bias": _bias_update(p["bias"], loads, bb_bias, tc.bias_update_rate)}
        metrics = {"loss": lm, "indexer_kl": kl, "balance": bal, "max_load": _max_load(loads)}
        return {"step": state["step"] + 1, "params": params, "opt": {**state["opt"], "backbone": opt}}, metrics

    def draft_batch(bb, ds, bias, seqs, hashes, anchors):
        model = _merge(graphdef, paths, bb, ds, bias)

        def one(s, h, a):
            target = backbone_forward(model, s[:-1], s[1:], h, tc.moe_compute, tc.indexer_kl_stride)
            return draft_losses(model, s[:-1], target.features, target.logits, a, tc.moe_compute)

        return jax.vmap(one)(seqs, hashes, anchors)

    def draft_loss(ds, bb, bias, seqs, hashes, anchors):
        out = draft_batch(bb, ds, bias, seqs, hashes, anchors)
        ce, bce, bal = jnp.mean(out.ce), jnp.mean(out.confidence_bce), jnp.mean(out.balance)
        loss = ce + tc.confidence_loss_weight * bce + tc.balance_loss_weight * bal
        return loss, (ce, bce, jnp.mean(out.accept_len), jnp.sum(out.loads, axis=0))

    def dspark_step(state, seqs, hashes, anchors):
        p = state["params"]
        (_, (ce, bce, acc, loads)), grads = jax.value_and_grad(draft_loss, has_aux=True)(
            p["dspark"], p["backbone"], p["bias"], seqs, hashes, anchors)
        updates, opt = opt_ds.update(grads, state["opt"]["dspark"], p["dspark"])
        params = {**p, "dspark": optax.apply_updates(p["dspark"], updates),
                  "bias": _bias_update(p["bias"], loads, ds_bias, tc.bias_update_rate)}
        metrics = {"loss": ce, "confidence_bce": bce, "accept_len": acc, "max_load": _max_load(loads)}
        return {"step": state["step"] + 1, "params": params, "opt": {**state["opt"], "dspark": opt}}, metrics

    def eval_backbone(params, seqs, hashes):
        out = backbone_batch(params["backbone"], params["dspark"], params["bias"], seqs, hashes)
        return jnp.sum(out.lm) * (seqs.shape[1] - 1)

    def eval_draft(params, seqs, hashes, anchors):
        out = draft_batch(params["backbone"], params["dspark"], params["bias"], seqs, hashes, anchors)
        return jnp.stack([jnp.mean(out.ce), jnp.mean(out.accept_len)])

    return {"backbone_step": jax.jit(backbone_step, donate_argnums=0),
            "dspark_step": jax.jit(dspark_step, donate_argnums=0),
            "eval_backbone": jax.jit(eval_backbone), "eval_draft": jax.jit(eval_draft),
            "init_opt": lambda p: {"backbone": opt_bb.init(p["backbone"]), "dspark": opt_ds.init(p["dspark"])},
            "groups": groups, "abstract": abstract}


def checkpoint_params(folder: str, config: ModelConfig, abstract: dict[tuple, jax.ShapeDtypeStruct]
                      ) -> dict[tuple, np.ndarray]:
    """A checkpoint's parameters as float32 arrays for every path of `abstract` (its FP8 / MXFP4 tensors and FP8
    Engram rows decoded); the checkpoint must be of `config`."""
    import dsv41
    from dsv41.layers.engram import decode_rows

    model = dsv41.load(folder, "float32", weights="dequantize")
    unquantized = lambda c: {k: v for k, v in c.to_release_dict().items() if k != "quantization_config"}  # noqa: E731
    if unquantized(model.config) != unquantized(config):
        raise ValueError(f"init_from {folder} holds another model config than the one trained")
    out = {}
    for path, spec in abstract.items():
        if path not in model.params:
            raise ValueError(f"init_from {folder} has no tensor {'.'.join(map(str, path))}")
        value = model.params[path]
        if path[-1] == "weight" and path[-2] == "embed" and "engram" in path and value.dtype != np.float32:
            value = decode_rows(value, model.params[path[:-1] + ("scale",)], jnp.float32)
        value = np.asarray(value, np.float32)
        if value.shape != tuple(spec.shape):
            raise ValueError(f"init_from {folder}: {'.'.join(map(str, path))} is {value.shape}, not {spec.shape}")
        out[path] = value
    return out


def _max_load(loads_LE: jax.Array) -> jax.Array:
    """Worst layer's busiest expert over the mean load (1.0 = perfectly balanced)."""
    loads = loads_LE.astype(jnp.float32)
    return jnp.max(jnp.max(loads, axis=1) / jnp.maximum(jnp.mean(loads, axis=1), 1.0))


# ================================================================================ the run
class Progress:
    """One carriage-returned status line: phase, step, bar, loss, tokens/s, eta."""

    def __init__(self, stream=sys.stderr, width: int = 24):
        self.stream, self.width = stream, width

    def update(self, phase: str, step: int, total: int, metrics: dict, tokens_per_s: float, eta_s: float) -> None:
        filled = int(self.width * step / max(total, 1))
        extra = "".join(f" {k} {v:.3f}" for k, v in metrics.items() if k != "loss")
        self.stream.write(f"\r{phase} {step}/{total} |{'#' * filled}{'.' * (self.width - filled)}| loss "
                          f"{metrics['loss']:.4f}{extra} | {tokens_per_s:,.0f} tok/s | eta {_hms(eta_s)}  ")
        self.stream.flush()

    def line(self, text: str) -> None:
        self.stream.write("\n" + text + "\n")
        self.stream.flush()


def _hms(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Trainer:
    """One training run of `config` under `tc` on token arrays; writes into `out_dir` (checkpoints,
    train_config.json, log.jsonl). `run()` resumes from the newest checkpoint there."""

    def __init__(self, config: ModelConfig, tc: TrainConfig, train_tokens: np.ndarray, heldout_tokens: np.ndarray,
                 out_dir: str | Path, *, token_map: np.ndarray | None = None, progress: Progress | None = None):
        if config.family != "v41":
            raise ValueError("training covers V4.1 configs")
        if config.num_nextn_predict_layers == 0 and tc.dspark_steps:
            raise ValueError("dspark_steps > 0 but the config has no DSpark stages (num_nextn_predict_layers 0)")
        self.config, self.tc = config, tc
        self.out_dir = Path(out_dir).absolute()
        # neither the seed nor the drafter's data file is in the graph
        self.fns = compiled_steps(config, dataclasses.replace(tc.math(), seed=0, dspark_data=""))
        self.windows = Windows(train_tokens, tc.seq_len, tc.batch_size, tc.seed, config.bos_token_id)
        self.draft_windows = (Rows.load(tc.dspark_data, tc.seq_len, tc.batch_size, tc.seed, config.bos_token_id,
                                        config.vocab_size) if tc.dspark_data else self.windows)
        self.heldout = eval_windows(heldout_tokens, tc.seq_len, None, config.bos_token_id)
        if not len(self.heldout):
            raise ValueError(f"the held-out split has fewer than seq_len {tc.seq_len} tokens")
        self.engram = EngramLayout.from_config(config) if config.engram_layer_ids else None
        if self.engram is not None and token_map is None:
            if config.vocab_size > config.engram_compressed_vocab_size:
                raise ValueError("Engram needs the tokenizer's compressed token map (token_map)")
            token_map = np.arange(config.vocab_size)
        self.token_map = token_map
        self.progress = progress or Progress()
        self.history: list[dict] = []

    # ------------------------------------------------------------------ inputs
    def hashes(self, seqs: np.ndarray) -> np.ndarray:
        """Engram hash ids [B, T, layers, cols] of the model inputs (each window from position 0)."""
        if self.engram is None:
            return np.zeros((seqs.shape[0], seqs.shape[1] - 1, 0, 0), np.int32)
        return np.stack([self.engram.hash_ids(s[:-1], self.token_map) for s in seqs])

    def anchors(self, step: int, n_seqs: int) -> np.ndarray:
        """[B, A] DSpark anchor positions, each in [0, seq_len - block]."""
        rng = np.random.default_rng([self.tc.seed, step, 1])
        high = self.tc.seq_len - self.config.dspark_block_size + 1
        return np.sort(rng.integers(0, high, (n_seqs, self.tc.dspark_anchors)), axis=1).astype(np.int32)

    # ------------------------------------------------------------------ state
    def init_state(self) -> dict:
        abstract = {k: v for k, v in self.fns["abstract"].items()}
        _, paths, _ = _graph(self.config)
        drawn = init_train_params(self.config, {paths[k]: v for k, v in abstract.items()}, self.tc.seed)
        if self.tc.init_from:
            drawn = checkpoint_params(self.tc.init_from, self.config, {paths[k]: v for k, v in abstract.items()})
        params = {g: {k: jnp.asarray(drawn[paths[k]]) for k in keys} for g, keys in self.fns["groups"].items()}
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt": self.fns["init_opt"](params)}
        # committed like a restored checkpoint's arrays, so a resumed run reuses the compiled steps
        return jax.device_put(state, jax.devices()[0])

    def _manager(self) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(self.out_dir / "checkpoints",
                                     options=ocp.CheckpointManagerOptions(max_to_keep=self.tc.keep_checkpoints))

    def save(self, state: dict) -> None:
        with self._manager() as mngr:
            mngr.save(int(state["step"]), args=ocp.args.StandardSave(state))
            mngr.wait_until_finished()

    def restore(self) -> dict | None:
        """The newest checkpoint's state, or None when there is none."""
        if not (self.out_dir / "checkpoints").is_dir():
            return None
        with self._manager() as mngr:
            step = mngr.latest_step()
            if step is None:
                return None
            # the fresh state's placement, so the restored arrays hit the compiled steps' cache
            target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                  self.init_state())
            return mngr.restore(step, args=ocp.args.StandardRestore(target))

    def _check_config(self) -> None:
        """Refuse to resume under a config that changes the math; write it on a fresh start."""
        path = self.out_dir / "train_config.json"
        mine = {"model": self.config.to_release_dict(), "train": dataclasses.asdict(self.tc)}
        if path.is_file():
            saved = json.loads(path.read_text())
            for name in TrainConfig.math_fields():
                if saved["train"].get(name) != mine["train"][name]:
                    raise ValueError(f"{self.out_dir} was trained with {name}={saved['train'].get(name)!r}, "
                                     f"not {mine['train'][name]!r}: use another out_dir")
            if saved["model"] != mine["model"]:
                raise ValueError(f"{self.out_dir} holds a run of another model config: use another out_dir")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(mine, indent=1) + "\n")

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, state: dict, n_windows: int | None = None) -> dict:
        """Held-out metrics over the first `n_windows` windows (all when None): backbone perplexity and, once
        the drafter trains, its cross-entropy against the target and the teacher-forced accepted length."""
        windows = self.heldout if n_windows is None else self.heldout[:n_windows]
        B = min(self.tc.batch_size, len(windows))
        nll, n_tok, draft = 0.0, 0, []
        for i in range(0, len(windows) - B + 1, B):
            seqs = windows[i: i + B]
            nll += float(self.fns["eval_backbone"](state["params"], seqs, self.hashes(seqs)))
            n_tok += seqs.shape[0] * (seqs.shape[1] - 1)
            if int(state["step"]) > self.tc.backbone_steps:
                anchors = np.random.default_rng([self.tc.seed, i, 2]).integers(
                    0, self.tc.seq_len - self.config.dspark_block_size + 1, (B, self.tc.dspark_anchors))
                draft.append(np.asarray(self.fns["eval_draft"](state["params"], seqs, self.hashes(seqs),
                                                               np.sort(anchors, axis=1).astype(np.int32))))
        out = {"heldout_nll": nll / n_tok, "heldout_ppl": float(np.exp(nll / n_tok)), "heldout_tokens": n_tok}
        if draft:
            ce, accept = np.mean(draft, axis=0)
            out.update(heldout_draft_ce=float(ce), heldout_accept_len=float(accept))
        return out

    # ------------------------------------------------------------------ the loop
    def run(self, stop_at: int | None = None) -> dict:
        """Train from the newest checkpoint (or from scratch) to the end, or only to step `stop_at`; returns
        the final state. Appends every step's metrics to log.jsonl and `history`."""
        tc = self.tc
        self._check_config()
        state = self.restore()
        state = self.init_state() if state is None else state
        total = tc.backbone_steps + tc.dspark_steps
        end = total if stop_at is None else min(stop_at, total)
        timed = {"backbone": [0, 0.0], "dspark": [0, 0.0]}  # phase -> [tokens, seconds] after compiling
        started: set[str] = set()
        log = open(self.out_dir / "log.jsonl", "a")
        try:
            for step in range(int(state["step"]), end):
                phase = "backbone" if step < tc.backbone_steps else "dspark"
                seqs = (self.windows if phase == "backbone" else self.draft_windows).batch_at(step)
                hashes = self.hashes(seqs)
                t0 = time.perf_counter()
                if phase == "backbone":
                    state, m = self.fns["backbone_step"](state, seqs, hashes)
                else:
                    state, m = self.fns["dspark_step"](state, seqs, hashes, self.anchors(step, tc.batch_size))
                metrics = {k: float(v) for k, v in m.items()}
                dt = time.perf_counter() - t0
                if phase in started:  # a phase's first step in this process compiles: not timed
                    timed[phase][0] += tc.tokens_per_step
                    timed[phase][1] += dt
                started.add(phase)
                tokens, seconds = timed[phase]
                rate = tokens / seconds if seconds else 0.0
                record = {"step": step + 1, "phase": phase, **metrics, "step_s": round(dt, 3)}
                done = step + 1
                if tc.eval_windows and (done % tc.eval_every == 0 or done in (tc.backbone_steps, total)):
                    record.update(self.evaluate(state, None if done == total else tc.eval_windows))
                    self.progress.line(f"step {done}: " + ", ".join(
                        f"{k} {v:.4g}" for k, v in record.items() if k.startswith("heldout")))
                self.history.append(record)
                log.write(json.dumps(record) + "\n")
                log.flush()
                steps_left = end - done
                self.progress.update(phase, done, total, metrics, rate,
                                     steps_left * tc.tokens_per_step / rate if rate else 0.0)
                if done % tc.checkpoint_every == 0 or done in (tc.backbone_steps, end):
                    self.save(state)
        finally:
            log.close()
        self.tokens_per_s = {p: t / s for p, (t, s) in timed.items() if s}
        return state
