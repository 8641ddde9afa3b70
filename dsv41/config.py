"""ModelConfig: the DeepSeek-V4.1 / V4 text model read from a release `config.json`.

One frozen dataclass holds the release fields under their release names; `roles` derives the per-layer
role table (spec §1.2): which layer owns a compressor and global KV (KV source), which runs an indexer
(index source), whose top-k indices and global rows every other layer reads (CED sharing), the candidate
source, Engram layers and the RoPE table of each layer. Every check names the field it rejects.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dsv41.config_checks import ConfigError, validate

PRESET_DIR = Path(__file__).parent / "presets"
PRESETS = ("v41-flash", "v41-flash-slice", "v4-flash", "tiny", "small", "nano")

Family = Literal["v41", "v4"]
# Attention kinds: "swa" = sliding window only; "compressed" = V4.1 SWA + top-k over a (shared) global KV;
# V4 compat: "csa" = ratio-4 overlapping compressor + own indexer, "hca" = ratio-128, all compressed rows.
AttnKind = Literal["swa", "compressed", "csa", "hca"]




@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class LayerRole:
    """What one backbone layer does and whose published tensors it reads (spec §1.2)."""

    layer_id: int
    compress_ratio: int
    attn_kind: AttnKind
    rope: Literal["main", "compress"]  # main: theta rope_theta, no YaRN; compress: compress_rope_theta + YaRN
    kv_source: int | None = None  # layer whose global KV rows this layer attends to
    index_source: int | None = None  # layer whose top-k indices this layer uses
    is_kv_source: bool = False  # owns compressor (+ indexer wk/k_norm in V4.1)
    is_index_source: bool = False  # runs an indexer query (wq_b, weights_proj)
    is_candidate_source: bool = False  # publishes candidate blocks
    uses_candidates: bool = False  # restricts its top-k to the candidate source's blocks
    engram_index: int | None = None  # position in engram_layer_ids
    hash_routed: bool = False  # V4: experts from tid2eid[token]


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V4.1 (or V4 compatibility) text model. Field names follow the release config.json."""

    family: Family
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    norm_topk_prob: bool
    rms_norm_eps: float
    sliding_window: int
    compress_ratios: tuple[int, ...]  # one per backbone layer
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: YarnScaling | None
    max_position_embeddings: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    num_hash_layers: int = 0
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 0
    num_nextn_predict_layers: int = 0
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    bos_token_id: int = 0
    eos_token_id: int = 1
    # Structural switches; derived from the family, overridable for experiments (spec §7.1).
    delayed_pre: bool = True  # V4.1: collapse with the previous sublayer's pre-mix
    q_head_norm: bool = False  # V4: unweighted per-head RMSNorm on q
    hc_head: bool = False  # V4: learned final stream collapse
    # Release quantization (None = unquantized tensors); weight_block_size of FP8 linears.
    quantization: dict[str, Any] | None = field(default=None, compare=False)
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        validate(self)

    # ------------------------------------------------------------------ derived
    @property
    def n_hc_coeffs(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def engram_hash_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def cut_layer(self) -> int | None:
        """The CED cut: the last KV source (layer 20 of V4.1), whose global KV the decoder layers share."""
        return max(self.kv_source_layer_ids) if self.kv_source_layer_ids else None

    @functools.cached_property
    def roles(self) -> tuple[LayerRole, ...]:
        return _roles(self)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_release_dict(self) -> dict[str, Any]:
        """The release config.json for this config (V4.1 nested under text_config, V4 flat)."""
        skip = {"family", "source", "quantization", "delayed_pre", "q_head_norm", "hc_head", "rope_scaling",
                "candidate_source_layer_id"}
        text: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name not in skip:
                v = getattr(self, f.name)
                text[f.name] = list(v) if isinstance(v, tuple) else v
        if self.family == "v4":
            for k in [k for k in text if k.startswith(("engram_", "dspark_")) or k in (
                    "kv_source_layer_ids", "index_source_layer_ids", "candidate_topk_blocks",
                    "candidate_block_size")]:
                del text[k]
        else:
            del text["num_hash_layers"]
        if self.candidate_source_layer_id is not None:
            text["candidate_source_layer_id"] = self.candidate_source_layer_id
        if self.rope_scaling is not None:
            y = self.rope_scaling
            text["rope_scaling"] = {"rope_type": "yarn", "factor": y.factor, "beta_fast": y.beta_fast,
                                    "beta_slow": y.beta_slow,
                                    "original_max_position_embeddings": y.original_max_position_embeddings}
        text.update(num_key_value_heads=1, hidden_act="silu", scoring_func="sqrtsoftplus",
                    topk_method="noaux_tc", tie_word_embeddings=False)
        if self.family == "v4":
            root = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", **text}
        else:
            text["model_type"] = "deepseek_v41_text"
            root = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
                    "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id, "text_config": text}
        if self.quantization is not None:
            root["quantization_config"] = dict(self.quantization)
        return root

    # --------------------------------------------------------------- constructors
    @classmethod
    def from_release_dict(cls, raw: dict[str, Any], source: str = "") -> ModelConfig:
        return _parse(raw, source)

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        return _parse(raw, str(path))

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; presets are {', '.join(PRESETS)}")
        return cls.from_json(PRESET_DIR / f"{name}.json")


def load_config(path_or_preset: str | Path) -> ModelConfig:
    """A preset name, a checkpoint folder (its config.json) or a config.json path."""
    if str(path_or_preset) in PRESETS:
        return ModelConfig.preset(str(path_or_preset))
    p = Path(path_or_preset)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise ConfigError(f"{path_or_preset}: neither a preset ({', '.join(PRESETS)}) nor a config.json")
    return ModelConfig.from_json(p)


# ============================================================================ parsing
_V41_TYPES = ("deepseek_v41", "deepseek_v41_text")
_V4_TYPES = ("deepseek_v4",)


def _parse(raw: dict[str, Any], source: str) -> ModelConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: config.json must hold a JSON object")
    model_type = raw.get("model_type")
    if "text_config" in raw:
        if model_type not in _V41_TYPES:
            raise ConfigError(f"{source}: model_type {model_type!r} with a text_config; expected 'deepseek_v41'")
        text = dict(raw["text_config"])
        for key in ("bos_token_id", "eos_token_id", "quantization_config"):
            if key in raw and key not in text:
                text[key] = raw[key]
        family: Family = "v41"
    elif model_type in _V41_TYPES:
        text, family = dict(raw), "v41"
    elif model_type in _V4_TYPES:
        text, family = dict(raw), "v4"
    else:
        raise ConfigError(
            f"{source}: model_type {model_type!r} is not supported (expected deepseek_v41 with a nested "
            "text_config, or deepseek_v4)"
        )
    r = _Reader(text, source)
    n_layers = r.int("num_hidden_layers")
    n_next = r.int("num_nextn_predict_layers", 0)
    ratios = r.int_list("compress_ratios")
    if len(ratios) not in (n_layers, n_layers + n_next):
        raise ConfigError(
            f"{source}: compress_ratios has {len(ratios)} entries; expected num_hidden_layers ({n_layers}) "
            f"or num_hidden_layers + num_nextn_predict_layers ({n_layers + n_next})"
        )
    if any(x != 0 for x in ratios[n_layers:]):
        raise ConfigError(f"{source}: compress_ratios entries past num_hidden_layers (draft layers) must be 0")
    if r.int("num_key_value_heads", 1) != 1:
        raise ConfigError(f"{source}: num_key_value_heads must be 1 (one shared K=V latent)")
    if r.get("tie_word_embeddings", False):
        raise ConfigError(f"{source}: tie_word_embeddings must be false (embed and head are separate tensors)")
    if r.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act {r.get('hidden_act')!r} unsupported; only 'silu'")
    if r.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise ConfigError(f"{source}: scoring_func {r.get('scoring_func')!r} unsupported; only 'sqrtsoftplus'")
    if r.int("first_k_dense_replace", 0) != 0:
        raise ConfigError(f"{source}: first_k_dense_replace must be 0 (every layer is MoE)")
    n_shared = r.int("n_shared_experts", 1)
    if n_shared != 1:
        raise ConfigError(f"{source}: n_shared_experts must be 1, got {n_shared}")
    candidate = r.get("candidate_source_layer_id")
    quant = text.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ConfigError(f"{source}: quantization_config must be an object")
    return ModelConfig(
        family=family,
        vocab_size=r.int("vocab_size"),
        hidden_size=r.int("hidden_size"),
        num_hidden_layers=n_layers,
        num_attention_heads=r.int("num_attention_heads"),
        head_dim=r.int("head_dim"),
        qk_rope_head_dim=r.int("qk_rope_head_dim"),
        q_lora_rank=r.int("q_lora_rank"),
        o_lora_rank=r.int("o_lora_rank"),
        o_groups=r.int("o_groups"),
        n_routed_experts=r.int("n_routed_experts"),
        n_shared_experts=n_shared,
        num_experts_per_tok=r.int("num_experts_per_tok"),
        moe_intermediate_size=r.int("moe_intermediate_size"),
        routed_scaling_factor=r.float("routed_scaling_factor", 1.0),
        swiglu_limit=r.float("swiglu_limit", 10.0),
        norm_topk_prob=bool(r.get("norm_topk_prob", True)),
        rms_norm_eps=r.float("rms_norm_eps"),
        sliding_window=r.int("sliding_window"),
        compress_ratios=tuple(ratios[:n_layers]),
        rope_theta=r.float("rope_theta", 10000.0),
        compress_rope_theta=r.float("compress_rope_theta", 160000.0),
        rope_scaling=_yarn(r),
        max_position_embeddings=r.int("max_position_embeddings"),
        hc_mult=r.int("hc_mult", 4),
        hc_sinkhorn_iters=r.int("hc_sinkhorn_iters", 20),
        hc_eps=r.float("hc_eps", 1e-6),
        index_n_heads=r.int("index_n_heads", 0),
        index_head_dim=r.int("index_head_dim", 0),
        index_topk=r.int("index_topk", 0),
        kv_source_layer_ids=tuple(r.int_list("kv_source_layer_ids", [])),
        index_source_layer_ids=tuple(r.int_list("index_source_layer_ids", [])),
        candidate_source_layer_id=None if candidate is None else r.int("candidate_source_layer_id"),
        candidate_topk_blocks=r.int("candidate_topk_blocks", 0),
        candidate_block_size=r.int("candidate_block_size", 0),
        num_hash_layers=r.int("num_hash_layers", 0),
        engram_layer_ids=tuple(r.int_list("engram_layer_ids", [])),
        engram_num_embeddings=tuple(r.int_list("engram_num_embeddings", [])),
        engram_max_ngram_size=r.int("engram_max_ngram_size", 4),
        engram_vocab_size=r.int("engram_vocab_size", 0),
        engram_n_heads=r.int("engram_n_heads", 0),
        engram_head_dim=r.int("engram_head_dim", 0),
        engram_pad_token_id=r.int("engram_pad_token_id", 2),
        engram_compressed_vocab_size=r.int("engram_compressed_vocab_size", 0),
        num_nextn_predict_layers=n_next,
        dspark_block_size=r.int("dspark_block_size", 0),
        dspark_noise_token_id=r.int("dspark_noise_token_id", 0),
        dspark_target_layer_ids=tuple(r.int_list("dspark_target_layer_ids", [])),
        dspark_markov_rank=r.int("dspark_markov_rank", 0),
        dspark_n_routed_experts=r.int("dspark_n_routed_experts", 0),
        dspark_num_experts_per_tok=r.int("dspark_num_experts_per_tok", 0),
        bos_token_id=r.int("bos_token_id", 0),
        eos_token_id=_first_int(r, "eos_token_id", 1),
        delayed_pre=family == "v41",
        q_head_norm=family == "v4",
        hc_head=family == "v4",
        quantization=quant,
        source=source,
    )


def _first_int(r: _Reader, key: str, default: int) -> int:
    v = r.get(key, default)
    if isinstance(v, list) and v and all(isinstance(x, int) for x in v):
        return v[0]
    return r.int(key, default)


def _yarn(r: _Reader) -> YarnScaling | None:
    rs = r.get("rope_scaling")
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise ConfigError(f"{r.source}: rope_scaling must be an object")
    kind = rs.get("rope_type", rs.get("type"))
    if kind != "yarn":
        raise ConfigError(f"{r.source}: rope_scaling.rope_type {kind!r} unsupported; only 'yarn'")
    try:
        return YarnScaling(
            factor=float(rs["factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
            beta_fast=float(rs.get("beta_fast", 32)),
            beta_slow=float(rs.get("beta_slow", 1)),
        )
    except KeyError as e:
        raise ConfigError(f"{r.source}: rope_scaling.{e.args[0]} is required for YaRN") from e


class _Reader:
    def __init__(self, d: dict[str, Any], source: str):
        self.d, self.source = d, source

    def get(self, key: str, default: Any = None) -> Any:
        return self.d.get(key, default)

    def int(self, key: str, default: Any = ...) -> int:
        v = self.d.get(key, default)
        if v is ...:
            raise ConfigError(f"{self.source}: required field {key} is missing")
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{self.source}: field {key} must be an integer, got {v!r}")
        return v

    def float(self, key: str, default: Any = ...) -> float:
        v = self.d.get(key, default)
        if v is ...:
            raise ConfigError(f"{self.source}: required field {key} is missing")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{self.source}: field {key} must be a number, got {v!r}")
        return float(v)

    def int_list(self, key: str, default: Any = ...) -> list[int]:
        v = self.d.get(key, default)
        if v is ...:
            raise ConfigError(f"{self.source}: required field {key} is missing")
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise ConfigError(f"{self.source}: field {key} must be a list of integers, got {v!r}")
        return list(v)


# ============================================================================= roles
def _roles(c: ModelConfig) -> tuple[LayerRole, ...]:
    roles = []
    for i, ratio in enumerate(c.compress_ratios):
        engram = c.engram_layer_ids.index(i) if i in c.engram_layer_ids else None
        common = dict(layer_id=i, compress_ratio=ratio, engram_index=engram,
                      hash_routed=c.family == "v4" and i < c.num_hash_layers)
        if ratio == 0:
            roles.append(LayerRole(attn_kind="swa", rope="main", **common))
        elif c.family == "v4":
            kind: AttnKind = "csa" if ratio == 4 else "hca"
            roles.append(LayerRole(attn_kind=kind, rope="compress", kv_source=i, is_kv_source=True,
                                   index_source=i if kind == "csa" else None, is_index_source=kind == "csa",
                                   **common))
        else:
            kv = max(s for s in c.kv_source_layer_ids if s <= i)
            idx = max(s for s in c.index_source_layer_ids if s <= i)
            cand = c.candidate_source_layer_id
            roles.append(LayerRole(
                attn_kind="compressed", rope="compress", kv_source=kv, index_source=idx,
                is_kv_source=i in c.kv_source_layer_ids, is_index_source=i in c.index_source_layer_ids,
                is_candidate_source=i == cand,
                uses_candidates=cand is not None and i in c.index_source_layer_ids and i > cand,
                **common))
    return tuple(roles)


def dspark_role(c: ModelConfig, k: int) -> LayerRole:
    """DSpark block k: SWA-only, theta rope_theta, layer id num_hidden_layers + k."""
    return LayerRole(layer_id=c.num_hidden_layers + k, compress_ratio=0, attn_kind="swa", rope="main")


def yarn_bounds(c: ModelConfig) -> tuple[float, float]:
    """The YaRN ramp [low, high] over rotary pairs (spec §2.4): 15 and 25 for V4.1-Flash."""
    y = c.rope_scaling
    assert y is not None
    d = c.qk_rope_head_dim

    def corr(rot: float) -> float:
        wavelengths = y.original_max_position_embeddings / (rot * 2 * math.pi)
        return d * math.log(wavelengths) / (2 * math.log(c.compress_rope_theta))

    return max(math.floor(corr(y.beta_fast)), 0), min(math.ceil(corr(y.beta_slow)), d - 1)
