"""CPU tier: the CUDA path of a wgmma spec with the TMA-store epilogue (docs/hopper.md) on the
fakes of torch and CuPy (kernelgen/testing/): its one launch receives out_map over torch's out
(its address, its (B, S, H, D) strides, seqlen_q rows, 64-row boxes) beside q_map, k_map and
v_map, and still the out pointer and strides its parameter list keeps; packed GQA's out_map is
5-d, split-KV's maps the o_partial scratch the launch passes (and the combine reads)."""

from __future__ import annotations

import pytest
from test_fp8_cuda_path import map_words, recorded  # noqa: F401 (recorded: a fixture)

import kernelgen
from kernelgen.specs.forward import spec_from_dict
from kernelgen.testing import fake_torch

B, H, HKV, SQ, SK, D = 2, 4, 2, 70, 150, 128
SPEC = spec_from_dict(
    dict(loop_order="v2", mma="wgmma", dtype="bfloat16", head_dim=D, block_m=128, block_n=128)
    | dict(causal=True, epilogue="tma")
)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_the_launch_gets_an_out_map_over_the_calls_out(recorded, layout):  # noqa: F811
    shape = (B, SQ, H, D) if layout == "bshd" else (B, H, SQ, D)
    kv_shape = (B, SK, HKV, D) if layout == "bshd" else (B, HKV, SK, D)
    q = fake_torch.Tensor(shape, fake_torch.bfloat16)
    k, v = (fake_torch.Tensor(kv_shape, fake_torch.bfloat16) for _ in range(2))
    out = kernelgen.attention(q, k, v, causal=True, layout=layout, spec=SPEC)
    (launch,) = recorded
    args = launch["args"]
    assert launch["symbol"] == SPEC.uri and out.shape == shape
    assert int(args["out"]) == out.data_ptr()
    words = map_words(args["out_map"])
    assert words[0] == out.data_ptr()
    assert words[1:5] == [D, SQ, H, B]  # seqlen_q rows: a store clips the rows past them
    s, h, b = (H * D, D, SQ * H * D) if layout == "bshd" else (D, SQ * D, H * SQ * D)
    assert words[5:8] == [2 * s, 2 * h, 2 * b]  # bytes
    assert words[8:12] == [64, 64, 1, 1]  # one consumer warpgroup's rows of a column block
    assert map_words(args["q_map"])[1:5] == [D, SQ, H, B]


def test_packed_and_split_launches_get_their_out_maps(recorded):  # noqa: F811
    """Packed GQA: out_map is 5-d over out, (64, group, 64 / group) boxes. Split-KV: out_map
    maps the launch's o_partial scratch (the pointer the kernel also gets), fp32, with split
    and batch as one dimension; the combine launch follows."""
    q = fake_torch.Tensor((B, H, SQ, D), fake_torch.bfloat16)
    k, v = (fake_torch.Tensor((B, HKV, SK, D), fake_torch.bfloat16) for _ in range(2))
    fields = SPEC.model_dump() | {"block_m": 64, "num_warps": 8, "pack_gqa": True}
    packed = spec_from_dict(fields)
    out = kernelgen.attention(q, k, v, causal=True, spec=packed)
    words = map_words(recorded[-1]["args"]["out_map"])
    group = H // HKV
    assert words[0] == out.data_ptr() and words[1:6] == [D, group, SQ, HKV, B]
    assert words[6:10] == [2 * SQ * D, 2 * D, 2 * group * SQ * D, 2 * H * SQ * D]
    assert words[10:15] == [64, group, 64 // group, 1, 1]
    split = spec_from_dict(fields | {"split_kv": True})
    recorded.clear()
    kernelgen.attention(q, k, v, causal=True, spec=split, num_splits=3)
    main, combine = recorded
    assert (main["symbol"], combine["symbol"]) == (split.uri, split.combine_uri)
    words = map_words(main["args"]["out_map"])
    assert words[0] == int(main["args"]["o_partial"]) == int(combine["args"]["o_partial"])
    assert words[1:6] == [D, group, SQ, HKV, 3 * B]
    assert words[6:10] == [4 * SQ * D, 4 * D, 4 * group * SQ * D, 4 * H * SQ * D]
    assert words[10:15] == [32, group, 64 // group, 1, 1]
