"""HF transformers DeepseekV4 as a numerical oracle (torch side of make_fixtures.py).

* ``load_v4_from_release_dir``: stock HF V4 loaded from a release-layout folder
  (HF's own release->HF key conversion is exercised), every parameter checked
  against our independent name map.
* ``build_v41_core``: the V4.1 "core" oracle of spec §5.2 — stock HF modules plus
  three patches: delayed pre-mix layer loop (``run_layers(delayed=True)``),
  ``q_b_norm`` -> identity, and every compressed layer an HCA compressor with its
  own rate r in {1, 2} and ``position_bias = 0``. Valid only when every compressed
  layer is its own KV/index source, there are no candidates and index_topk >= T.
* ``run_layers``: explicit layer loop over HF modules (delayed=False reproduces
  stock ``DeepseekV4ForCausalLM.forward``; checked by the caller).
* ``Margins``: forward hooks recording indexer top-k and router top-k margins.

Only used under the torch python (see make_fixtures.py for the environment).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.numpy import save_file
from torch import nn
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HCACompressor, DeepseekV4TopKRouter

from random_weights import model_variant, text_config

# Release block-suffix -> HF block-suffix (spec §5.4; cross-checked with the "deepseek_v4"
# entry of transformers/conversion_mapping.py). Routed experts are stacked separately.
_BLOCK_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    **{f"hc_{s}_{k}": f"{s}_hc.{k}" for s in ("attn", "ffn") for k in ("fn", "base", "scale")},
}
_GLOBAL_MAP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
# V4.1 indexer tensors: present in the checkpoint, no HF counterpart (top-k covers all rows).
_V41_UNUSED = ("attn.indexer.wk.weight", "attn.indexer.k_norm.weight", "attn.indexer.wq_b.weight",
               "attn.indexer.weights_proj.weight")


def release_to_hf(weights: dict[str, np.ndarray], tc: dict, v41: bool) -> tuple[dict, list[str]]:
    """Map release tensors to HF state-dict names. Returns (hf_tensors, unused release names)."""
    hf, unused = {}, []
    E = tc["n_routed_experts"]
    for name, x in weights.items():
        if name in _GLOBAL_MAP:
            hf[_GLOBAL_MAP[name]] = x
            continue
        _, L, suffix = name.split(".", 2)
        if v41 and suffix in _V41_UNUSED:
            unused.append(name)
        elif suffix in _BLOCK_MAP:
            hf[f"model.layers.{L}.{_BLOCK_MAP[suffix]}"] = x
        elif not suffix.startswith("ffn.experts."):
            raise KeyError(f"no HF mapping for release tensor {name}")
    for L in range(tc["num_hidden_layers"]):
        p = f"layers.{L}.ffn.experts."
        # HF gate_up_proj[e] = cat(w1_e, w3_e) along the output dim; chunk(2) -> (gate, up)
        hf[f"model.layers.{L}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([weights[f"{p}{e}.w1.weight"], weights[f"{p}{e}.w3.weight"]], 0) for e in range(E)])
        hf[f"model.layers.{L}.mlp.experts.down_proj"] = np.stack([weights[f"{p}{e}.w2.weight"] for e in range(E)])
    return hf, sorted(unused)


def _assert_state_matches(model: nn.Module, expected: dict[str, np.ndarray]) -> None:
    sd = model.state_dict()
    missing, extra = sorted(set(sd) - set(expected)), sorted(set(expected) - set(sd))
    assert not missing and not extra, f"HF params without a generated tensor: {missing}; unmapped: {extra}"
    for k, v in expected.items():
        got = sd[k].detach().cpu()
        want = torch.from_numpy(np.ascontiguousarray(v)).to(got.dtype)
        assert got.shape == want.shape and torch.equal(got, want), f"HF param {k} != generated tensor"


def load_v4_from_release_dir(config: dict, weights: dict[str, np.ndarray], tmpdir: str | Path):
    """Write release-layout model.safetensors + config.json, load with from_pretrained, verify."""
    assert model_variant(config) == "v4"
    tmpdir = Path(tmpdir)
    (tmpdir / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(tmpdir / "model.safetensors"),
              metadata={"format": "pt"})
    model, info = DeepseekV4ForCausalLM.from_pretrained(
        str(tmpdir), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(key), f"from_pretrained {key}: {info.get(key)}"
    assert model.config._experts_implementation == "eager"
    expected, _ = release_to_hf(weights, text_config(config), v41=False)
    _assert_state_matches(model, expected)
    return model.eval()


def hf_config_v41(config: dict) -> DeepseekV4Config:
    """HF V4 config for the V4.1 core: every compressed layer is an HCA layer (rates patched per layer)."""
    tc = text_config(config)
    keys = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "q_lora_rank", "qk_rope_head_dim", "num_experts_per_tok",
            "n_routed_experts", "n_shared_experts", "scoring_func", "norm_topk_prob", "routed_scaling_factor",
            "max_position_embeddings", "rope_theta", "compress_rope_theta", "rope_scaling", "hc_mult",
            "hc_sinkhorn_iters", "hc_eps", "swiglu_limit", "sliding_window", "o_groups", "o_lora_rank",
            "index_n_heads", "index_head_dim", "index_topk", "hidden_act", "rms_norm_eps", "bos_token_id",
            "eos_token_id", "tie_word_embeddings")
    kw = {k: tc[k] for k in keys if k in tc}
    n = tc["num_hidden_layers"]
    kw["layer_types"] = ["sliding_attention" if r == 0 else "heavily_compressed_attention"
                         for r in tc["compress_ratios"]]
    kw["mlp_layer_types"] = ["moe"] * n
    kw["num_nextn_predict_layers"] = 0
    cfg = DeepseekV4Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def check_v41_core_reduction(config: dict, T: int) -> None:
    """The patched HF model equals V4.1 only in this reduction (spec §5.2)."""
    tc = text_config(config)
    compressed = [L for L, r in enumerate(tc["compress_ratios"]) if r > 0]
    for key in ("kv_source_layer_ids", "index_source_layer_ids"):
        if sorted(tc.get(key, [])) != compressed:
            raise ValueError(f"v41 core oracle needs {key} == every compressed layer {compressed}")
    if any(k.startswith("candidate_") for k in tc):
        raise ValueError("v41 core oracle needs no candidate source (omit candidate_* keys)")
    if tc["index_topk"] < T:
        raise ValueError(f"v41 core oracle needs index_topk ({tc['index_topk']}) >= T ({T})")


def build_v41_core(config: dict, weights: dict[str, np.ndarray]) -> DeepseekV4ForCausalLM:
    """Patched HF model for the V4.1 core (see module docstring), weights loaded and verified."""
    assert model_variant(config) == "v41"
    tc = text_config(config)
    cfg = hf_config_v41(config)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    model.set_experts_implementation("eager")  # default is grouped_mm; eager = the per-expert loop
    expected, _ = release_to_hf(weights, tc, v41=True)
    for L, (layer, r) in enumerate(zip(model.model.layers, tc["compress_ratios"])):
        attn = layer.self_attn
        attn.q_b_norm = nn.Identity()  # V4.1 has no per-head q RMSNorm
        if r == 0:
            continue
        # HF's compress_rates is per layer *type*; give each layer a compressor with its own rate.
        cfg_r = copy.deepcopy(cfg)
        cfg_r.compress_rates = {**cfg.compress_rates, "heavily_compressed_attention": r}
        attn.compressor = DeepseekV4HCACompressor(cfg_r).float()
        p = f"model.layers.{L}.self_attn.compressor."
        expected[p + "position_bias"] = np.zeros((r, tc["head_dim"]), np.float32)  # V4.1 has no ape
        if r == 1:  # no wgate in the release; softmax over one token makes the gate irrelevant
            expected[p + "gate_proj.weight"] = np.zeros((tc["head_dim"], tc["hidden_size"]), np.float32)
    # V4.1 has no hc_head; HF's is only used by the stock forward in the delayed=False self-check.
    hc, D = tc["hc_mult"], tc["hidden_size"]
    expected["model.hc_head.hc_fn"] = np.zeros((hc, hc * D), np.float32)
    expected["model.hc_head.hc_base"] = np.zeros((hc,), np.float32)
    expected["model.hc_head.hc_scale"] = np.zeros((1,), np.float32)
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in expected.items()}, strict=True)
    _assert_state_matches(model, expected)
    assert model.config._experts_implementation == "eager"
    return model


def _hc_pre(hc: nn.Module, R: torch.Tensor) -> torch.Tensor:
    """The `pre` weights that DeepseekV4HyperConnection.forward computes but does not return."""
    flat = hc.input_norm(R.reshape(*R.shape[:2], -1).float())
    pre_w = F.linear(flat, hc.fn.float())[..., : hc.hc_mult]
    return torch.sigmoid(pre_w * hc.scale[0] + hc.base[: hc.hc_mult]) + hc.hc_eps


def _collapse(pre: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    return (pre.unsqueeze(-1) * R).sum(dim=2).to(R.dtype)


@torch.no_grad()
def run_layers(model: DeepseekV4ForCausalLM, input_ids: np.ndarray, delayed: bool) -> tuple[np.ndarray, float]:
    """Logits [T, V] from an explicit loop over HF modules.

    delayed=False: V4 semantics (each sublayer collapses with its own pre, final
    hc_head) — must equal stock HF. delayed=True: V4.1 (spec §2.3): layer-0
    attention takes stream 0, every later sublayer collapses with the previous
    sublayer's pre, the final collapse uses the last FFN's pre, no hc_head.
    Also returns max |our pre-collapse - HF's collapse| (validates `_hc_pre`).
    """
    m = model.model
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)[None]
    emb = m.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])[None]
    mask = create_sliding_window_causal_mask(
        config=m.config, inputs_embeds=emb, attention_mask=None, cache=None, position_ids=pos)
    # a None mask would silently drop the compressor's block_bias (modeling_deepseek_v4.py:849)
    assert isinstance(mask, torch.Tensor), "eager attention must get a materialised mask"
    pe = {k: m.rotary_emb(emb, position_ids=pos, layer_type=k) for k in ("main", "compress")}
    R = emb.unsqueeze(2).expand(-1, -1, m.config.hc_mult, -1).contiguous()
    dtype, carried, pre_err = R.dtype, None, 0.0

    def attn(layer, x):
        return layer.self_attn(x, position_embeddings=pe, position_ids=pos, attention_mask=mask, cache=None)[0]

    def ffn(layer, x):
        return layer.mlp(x, input_ids=ids)

    for layer in m.layers:
        for hc, norm, block in ((layer.attn_hc, layer.input_layernorm, attn),
                                (layer.ffn_hc, layer.post_attention_layernorm, ffn)):
            post, comb, collapsed = hc(R)
            if delayed:
                pre = _hc_pre(hc, R)
                pre_err = max(pre_err, (_collapse(pre, R) - collapsed).abs().max().item())
                x = R[:, :, 0] if carried is None else _collapse(carried, R)
                carried = pre
            else:
                x = collapsed
            y = block(layer, norm(x))
            # same expression as DeepseekV4DecoderLayer.forward (comb consumed transposed)
            R = post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), R)
    h = _collapse(carried, R) if delayed else m.hc_head(R)
    return model.lm_head(m.norm(h))[0].float().numpy(), pre_err


@torch.no_grad()
def stock_logits(model: DeepseekV4ForCausalLM, input_ids: np.ndarray) -> np.ndarray:
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)[None]
    return model(input_ids=ids, use_cache=False).logits[0].float().numpy()


class Margins:
    """Forward hooks: top-k boundary margins of the V4 indexer and of the routers.

    indexer: for each query with more visible compressed rows than index_topk,
    (k-th - (k+1)-th largest visible score) / max |visible score|; queries whose
    visible rows fit in top-k select everything and are not ambiguous.
    router: (k-th - (k+1)-th largest of score + bias) for every token (hash
    routers select by table and are skipped).
    """

    def __init__(self, model: DeepseekV4ForCausalLM):
        self.indexer, self.router, self.selecting_queries = [], [], 0
        self._handles = []
        for layer in model.model.layers:
            comp = layer.self_attn.compressor
            if comp is not None and hasattr(comp, "indexer"):
                idx = comp.indexer
                self._handles.append(idx.scorer.register_forward_hook(
                    lambda mod, inp, out, idx=idx: self._on_scores(out, idx.compress_rate, idx.index_topk)))
            if isinstance(layer.mlp.gate, DeepseekV4TopKRouter):
                self._handles.append(layer.mlp.gate.register_forward_hook(self._on_router))

    def _on_scores(self, scores, rate, k):
        s = scores[0].detach().double().numpy()  # [S, N_rows], unmasked
        for p in range(s.shape[0]):
            n_vis = min((p + 1) // rate, s.shape[1])
            if n_vis <= k:
                continue
            v = np.sort(s[p, :n_vis])[::-1]
            self.selecting_queries += 1
            self.indexer.append((v[k - 1] - v[k]) / max(np.abs(v).max(), 1e-30))

    def _on_router(self, mod, inp, out):
        logits = out[0]
        s = (mod.score_fn(logits) + mod.e_score_correction_bias).detach().double()
        v = torch.sort(s, dim=-1, descending=True).values
        self.router.extend((v[:, mod.top_k - 1] - v[:, mod.top_k]).tolist())

    def remove(self):
        for h in self._handles:
            h.remove()

    def summary(self) -> dict:
        return {
            "indexer_selecting_queries": self.selecting_queries,
            "indexer_min_rel_margin": float(min(self.indexer)) if self.indexer else None,
            "router_min_margin": float(min(self.router)) if self.router else None,
        }
