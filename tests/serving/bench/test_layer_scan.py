"""The layer-scan benchmark's three forms of G same-structure layers (unrolled, scanned over stacked parameters,
one compiled layer called G times) compute the same bits, and its HLO reader counts the layer-axis slices."""

import dsv41
from serving.bench.layer_scan import VARIANTS, LayerStack, layer_axis_slice_bytes, measure

HLO = """
  %ds.1 = bf16[1,16,256,512]{3,2,1,0} dynamic-slice(bf16[3,16,256,512]{3,2,1,0} %p, s32[] %i, s32[] %z), dynamic_slice_sizes={1,16,256,512}
  %ds.2 = f32[4,8]{1,0} dynamic-slice(f32[16,8]{1,0} %q, s32[] %i, s32[] %z), dynamic_slice_sizes={4,8}
  %ds.3 = pred[1,4]{1,0} dynamic-slice(pred[3,4]{1,0} %m, s32[] %i, s32[] %z), dynamic_slice_sizes={1,4}
  %c = bf16[1,64]{1,0} copy(bf16[1,64]{1,0} %x)
"""


def test_layer_axis_slice_bytes_counts_leading_unit_slices_only():
    assert layer_axis_slice_bytes(HLO) == 16 * 256 * 512 * 2 + 4


def test_unrolled_scanned_and_per_layer_forms_agree():
    model = dsv41.random_model("tiny", dtype="bfloat16")
    assert model.config.roles[7].attn_kind == "compressed" and not model.config.roles[7].is_index_source
    stack = LayerStack(model, 7, 3)
    assert not all((a == b).all() for a, b in zip(stack.per_layer[0], stack.per_layer[2]))  # distinct copies
    m = measure(stack, 8, repeats=1)
    assert all(m[v]["same_bits"] for v in VARIANTS), m
    assert m["scanned"]["sliced_mb_per_layer"] > 0  # the scan reads its layers through slices of the stack
