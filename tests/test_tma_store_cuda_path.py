"""CPU tier: the CUDA path of a wgmma spec with the TMA-store epilogue (docs/hopper.md) on the
fakes of torch and CuPy (kernelgen/testing/): its one launch receives out_map over torch's out
(its address, its (B, S, H, D) strides, seqlen_q rows, 64-row boxes) beside q_map, k_map and
v_map, and still the out pointer and strides its parameter list keeps."""

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
