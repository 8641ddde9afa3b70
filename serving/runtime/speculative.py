"""Speculative decoding with the checkpoint's DSpark drafter (spec serving §4): its configuration, in vLLM's
`--speculative-config` format, and the verification of a step's drafted tokens by the target.

A request in speculative decode runs one chunk of 1 + k rows per step: its last emitted token (not yet in
the KV) and the k tokens the drafter proposed after it. The target's logits at those rows verify the drafts
left to right; the step emits the n accepted drafts and one more token from the row after them (the
"bonus"), so every step emits 1 .. k + 1 tokens. Methods (`rejection_sample_method`):

  standard   rejection sampling (Leviathan et al.): draft i is accepted with probability min(1, p_i / q_i)
             of its token, a rejection resamples from norm(max(p - q, 0)); the emitted tokens have exactly
             the target's distribution p (temperature, top-k / top-p / min-p and banned ids applied as the
             non-speculative sampler does). Greedy requests accept a draft iff it is the target's argmax,
             so their output equals non-speculative greedy decoding token for token.
  block      block verification (Sun et al. 2024, arXiv 2403.10444): the drafts are judged jointly, so a draft the
             target likes more than the drafter can repair an earlier one it liked less; the longest prefix that
             passes its test is accepted and the correction is drawn from norm(max(a p - q, 0)). Also exact in
             distribution, and accepts at least as many tokens as `standard` on average.
  synthetic  accept each draft with one calibrated probability whatever it is, so that the mean acceptance
             length equals `synthetic_acceptance_length` (InferenceX's throughput runs): a benchmark mode,
             its text is not the model's.

Acceptance length = emitted tokens per verification step = 1 + accepted drafts (vLLM's definition).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from dsv41.config import ModelConfig
from serving.runtime.sampler import argmax

METHODS = ("dspark",)
REJECTION_METHODS = ("standard", "block", "synthetic")
# vLLM keys this engine reads; others (enable_adaptive_verification, ...) are refused by name
_KEYS = ("method", "num_speculative_tokens", "rejection_sample_method", "synthetic_acceptance_length",
         "draft_sample_method", "adaptive")
DRAFT_SAMPLE_METHODS = ("probabilistic", "greedy")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "dspark"
    num_speculative_tokens: int | None = None  # drafts verified per step (default: the checkpoint's DSpark block)
    rejection_sample_method: str = "standard"
    synthetic_acceptance_length: float | None = None  # synthetic: mean tokens emitted per verification step
    draft_sample_method: str = "probabilistic"  # sampled requests draft from softmax(draft logits / T); greedy: argmax
    # each step verifies the k in 0..num_speculative_tokens measured to emit the most tokens per second at the
    # batch's concurrency, k = 0 being a plain step (serving.engine.spec_policy); False: always
    # num_speculative_tokens
    adaptive: bool = True

    def __post_init__(self):
        for name, allowed in (("method", METHODS), ("rejection_sample_method", REJECTION_METHODS),
                              ("draft_sample_method", DRAFT_SAMPLE_METHODS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"speculative_config {name} {getattr(self, name)!r}: choose one of {allowed}")
        k = self.num_speculative_tokens
        if k is not None and (not isinstance(k, int) or k < 1):
            raise ValueError(f"speculative_config num_speculative_tokens must be a positive integer, got {k!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config adaptive must be true or false, got {self.adaptive!r}")
        L = self.synthetic_acceptance_length
        if (self.rejection_sample_method == "synthetic") != (L is not None):
            raise ValueError("speculative_config synthetic_acceptance_length is given with, and only with, "
                             "rejection_sample_method 'synthetic'")
        if L is not None and not (isinstance(L, (int, float)) and L >= 1):
            raise ValueError(f"speculative_config synthetic_acceptance_length must be >= 1, got {L!r}")

    @classmethod
    def parse(cls, spec: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From vLLM's JSON text (`--speculative-config '{"method": "dspark", ...}'`) or the same dict."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            if not spec.strip():
                return None
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(spec).__name__}")
        unknown = sorted(set(spec) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config keys {unknown} are not supported (known: {list(_KEYS)})")
        if "method" not in spec:
            raise ValueError("speculative_config needs a method (\"dspark\")")
        return cls(**spec)

    def resolve(self, c: ModelConfig) -> SpeculativeConfig:
        """The config for this checkpoint: k defaults to its DSpark block, which bounds it (the drafter proposes
        one block per step; vLLM measured acceptance collapsing when k exceeds the trained block)."""
        if c.family != "v41" or not c.num_nextn_predict_layers:
            raise ValueError("speculative_config method 'dspark' needs a checkpoint with DSpark stages "
                             "(num_nextn_predict_layers > 0); this model has none")
        B = c.dspark_block_size
        k = self.num_speculative_tokens or B
        if k > B:
            raise ValueError(f"speculative_config num_speculative_tokens {k} exceeds the checkpoint's DSpark block "
                             f"of {B} tokens (dspark_block_size): the drafter proposes {B} tokens per step")
        if B + 1 > c.sliding_window:
            raise ValueError(f"the DSpark block of {B} tokens plus the verified token exceeds the sliding window "
                             f"{c.sliding_window}: a verification chunk would overwrite its own ring rows")
        if self.synthetic_acceptance_length is not None and self.synthetic_acceptance_length > k + 1:
            raise ValueError(f"speculative_config synthetic_acceptance_length {self.synthetic_acceptance_length} "
                             f"exceeds 1 + num_speculative_tokens ({k + 1})")
        if min(c.dspark_target_layer_ids) < c.cut_layer:
            raise ValueError(f"DSpark target layers {list(c.dspark_target_layer_ids)} must lie at or after the CED "
                             f"cut {c.cut_layer}: the runtime takes the draft features from segment 2")
        return dataclasses.replace(self, num_speculative_tokens=k)

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in dataclasses.asdict(self).items() if v is not None})

    @property
    def synthetic_rate(self) -> float:
        """Per-draft acceptance probability a with sum_{i=1..k} a^i = synthetic_acceptance_length - 1 (a run
        of accepts stops at the first reject, so this gives the configured mean)."""
        k, target = self.num_speculative_tokens, self.synthetic_acceptance_length - 1
        lo, hi = 0.0, 1.0
        for _ in range(60):
            a = (lo + hi) / 2
            lo, hi = (a, hi) if sum(a ** i for i in range(1, k + 1)) < target else (lo, a)
        return (lo + hi) / 2


def gumbel_argmax(logits_NV: jax.Array, keys_N: jax.Array) -> jax.Array:
    g = jax.vmap(lambda k: jax.random.gumbel(k, logits_NV.shape[1:], jnp.float32))(keys_N)
    return argmax(logits_NV + g)


def row_keys(seed_N: jax.Array, position_N: jax.Array, stream: int) -> jax.Array:
    """One PRNG key per row from its request's seed, the position it samples and a stream id (0: the
    non-speculative sampler's stream, 1: acceptance uniforms, 2: bonus / residual draws, 3: drafts)."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), p), stream))(
        seed_N, position_N)


def verify(logp_RJV: jax.Array, greedy_R: jax.Array, drafts_RK: jax.Array, q_RKV: jax.Array, n_draft_R: jax.Array,
           seed_R: jax.Array, pos_R: jax.Array, *, method: str, synthetic_rate: float = 0.0
           ) -> tuple[jax.Array, jax.Array]:
    """(emitted tokens [R, J]: the accepted drafts then the bonus token, accepted drafts per request [R]).

    logp_RJV: the target's log-distribution at each verified row (-inf outside what may be sampled; greedy rows
    only need their argmax), row i predicting position pos_R + i + 1; drafts_RK: the drafted tokens (row i + 1's
    token is draft i); q_RKV: the draft distributions they were sampled from; n_draft_R: drafts verified per
    request (0: plain sampling of row 0)."""
    R, J, V = logp_RJV.shape
    K = J - 1
    i_K = jnp.arange(K)
    d = drafts_RK.astype(jnp.int32)
    lp_d = jnp.take_along_axis(logp_RJV[:, :K], d[..., None], axis=-1)[..., 0]  # [R, K] target log p of each draft
    q_d = jnp.take_along_axis(q_RKV, d[..., None], axis=-1)[..., 0]
    argmax_RJ = argmax(logp_RJV)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(
        row_keys(jnp.repeat(seed_R, K), (pos_R[:, None] + 1 + i_K).reshape(-1), 1)).reshape(R, K)
    if method == "synthetic":
        ok = u < synthetic_rate
    else:  # greedy rows: the draft is the target's argmax
        ok = jnp.where(greedy_R[:, None], argmax_RJ[:, :K] == d, u * q_d < jnp.exp(lp_d))
    ok &= i_K[None] < n_draft_R[:, None]
    n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # leading accepts
    scale = jnp.ones((R,), jnp.float32)  # the residual's weight on p (block verification's a_n)
    if method == "block":
        n_block, scale = _block_accepts(jnp.exp(logp_RJV), q_RKV, jnp.exp(lp_d), q_d, u, n_draft_R)
        n = jnp.where(greedy_R, n, n_block)
    lp_n = jnp.take_along_axis(logp_RJV, n[:, None, None], axis=1)[:, 0]  # [R, V]: the bonus row
    q_n = jnp.take_along_axis(q_RKV, jnp.minimum(n, K - 1)[:, None, None], axis=1)[:, 0]
    rejected = (n < n_draft_R) & (method != "synthetic")
    residual = jnp.maximum(scale[:, None] * jnp.exp(lp_n) - jnp.where(rejected[:, None], q_n, 0.0), 0.0)
    # the residual is empty only where p <= q everywhere, i.e. p == q: then no draft is ever rejected there
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, jnp.exp(lp_n))
    bonus_sampled = jax.lax.cond(jnp.any(~greedy_R),  # no noise to draw for a greedy batch
                                 lambda: gumbel_argmax(jnp.log(residual), row_keys(seed_R, pos_R + 1 + n, 2)),
                                 lambda: jnp.zeros((R,), jnp.int32))
    bonus = jnp.where(greedy_R, jnp.take_along_axis(argmax_RJ, n[:, None], axis=1)[:, 0], bonus_sampled)
    j_J = jnp.arange(J)[None]
    padded = jnp.concatenate([d, jnp.zeros((R, 1), jnp.int32)], axis=1)
    emitted = jnp.where(j_J < n[:, None], padded, jnp.where(j_J == n[:, None], bonus[:, None], 0))
    return emitted, n


def _block_accepts(p_RJV: jax.Array, q_RKV: jax.Array, p_d: jax.Array, q_d: jax.Array, u_RK: jax.Array,
                   n_draft_R: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Block verification: (accepted drafts tau [R], the weight a_tau of the correction's residual [R]).

    a_0 = 1, a_i = min(a_(i-1) p_i(x_i) / q_i(x_i), 1) (draft i's joint survival); prefix i < n_draft passes with
    h_i = r_i / (r_i + 1 - a_i), r_i = sum_x max(a_i p_(i+1)(x) - q_(i+1)(x), 0), the full block with h = a_n;
    tau = the longest passing prefix (each tested with its own uniform), 0 if none."""
    R, K = q_d.shape
    a, prev = [], jnp.ones((R,), jnp.float32)
    for i in range(K):
        prev = jnp.minimum(prev * jnp.where(q_d[:, i] > 0, p_d[:, i] / jnp.maximum(q_d[:, i], 1e-30), 1.0), 1.0)
        a.append(prev)
    a_RK = jnp.stack(a, 1)  # a_1 .. a_K
    nxt_p, nxt_q = p_RJV[:, 1:K], q_RKV[:, 1:K]  # p_(i+1), q_(i+1) for prefixes i = 1 .. K - 1
    r = jnp.sum(jnp.maximum(a_RK[:, :K - 1, None] * nxt_p - nxt_q, 0.0), axis=-1)
    denom = r + 1.0 - a_RK[:, :K - 1]
    h_inner = jnp.where(denom > 0, r / jnp.where(denom > 0, denom, 1.0), 1.0)
    L = jnp.arange(1, K + 1)[None]
    h = jnp.where(L == n_draft_R[:, None], a_RK, jnp.concatenate([h_inner, a_RK[:, K - 1:]], axis=1))
    passes = (u_RK <= h) & (L <= n_draft_R[:, None])
    tau = jnp.max(jnp.where(passes, L, 0), axis=1)
    a_tau = jnp.where(tau > 0, jnp.take_along_axis(a_RK, jnp.maximum(tau - 1, 0)[:, None], axis=1)[:, 0], 1.0)
    return tau.astype(jnp.int32), jnp.where(tau < n_draft_R, a_tau, 1.0)
