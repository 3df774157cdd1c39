"""CPU tier: the CUDA path of an fp8 call of ``kernelgen.attention`` (docs/hopper.md, fp8) on the
fakes of torch and CuPy (kernelgen/testing/): what the fp8 kernel's one launch receives (tensor
maps over q, k and a V^T copy made by torch on q's device, torch's bf16 out and fp32 lse, the
descales as given), on torch's current stream; the V^T copy spelled in torch's operations gives
NumPy's bytes; a device other than compute capability 9.0 is refused before anything is
allocated."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import install_fake_libraries, launched_kernel

import kernelgen
from kernelgen.errors import InputError
from kernelgen.model.policy import fp8_default_spec
from kernelgen.runtime.fp8 import v_operand
from kernelgen.runtime.launch import clear_kernel_cache
from kernelgen.testing import fake_cupy, fake_torch

B, H, HKV, SQ, SK, D = 2, 4, 2, 70, 150, 128
SK_PADDED = 160  # V^T rows: keys rounded up to 16


@pytest.fixture
def recorded(monkeypatch, tuning_sandbox):
    """Launches (symbol, stream, arguments by parameter name) on an sm_90 fake; no tuning."""
    launches: list[dict] = []

    def launch(symbol, grid, block, args, shared_mem):
        _, params = launched_kernel(symbol)
        named = {p.name: a for p, a in zip(params, args, strict=True)}
        launches.append({"symbol": symbol, "stream": fake_cupy.CURRENT["stream"], "args": named})

    install_fake_libraries(monkeypatch, launch)
    yield launches
    clear_kernel_cache()


def fp8_bshd(shape_bhsd: tuple[int, ...]) -> fake_torch.Tensor:
    """A (B, S, H, D) fp8 view of (B, H, S, D) memory on CUDA device 0."""
    return fake_torch.Tensor(shape_bhsd, fake_torch.float8_e4m3fn).swapaxes(1, 2)


def map_words(tensor_map) -> list[int]:
    """The fake map's words: address, dims, byte strides, box (fake_cupy.encode_tensor_map)."""
    return [int(w) for w in np.asarray(tensor_map).view(np.uint64)]


def test_the_fp8_launch_gets_q_k_v_transposed_out_lse_and_descales(recorded):
    fake_torch.STREAMS[0] = 0xF8
    q = fp8_bshd((B, H, SQ, D))
    k, v = fp8_bshd((B, HKV, SK, D)), fp8_bshd((B, HKV, SK, D))
    descales = {n: fake_torch.Tensor((B, HKV), fake_torch.float32) for n in ("q", "k", "v")}
    out, lse = kernelgen.attention(
        q, k, v, causal=True, layout="bshd", return_lse=True,
        **{f"{n}_descale": x for n, x in descales.items()},
    )  # fmt: skip
    (launch,) = recorded
    args = launch["args"]
    assert launch["symbol"] == fp8_default_spec(D, True).uri and launch["stream"] == 0xF8
    assert out.dtype is fake_torch.bfloat16 and out.shape == (B, SQ, H, D)
    assert lse.dtype is fake_torch.float32 and lse.shape == (B, H, SQ)
    assert int(args["out"]) == out.data_ptr() and int(args["lse"]) == lse.data_ptr()
    assert (args["out_stride_b"], args["out_stride_h"], args["out_stride_s"]) == (
        SQ * H * D, D, H * D,
    )  # fmt: skip
    for name, tensor in descales.items():  # float32 and contiguous: passed as they are
        assert int(args[f"{name}_descale"]) == tensor.data_ptr()
    # q and k read in place through their strides (bytes: 1-byte elements); fp8_bshd's views
    # of (B, H, S, D) memory step D between keys and S x D between heads
    for name, tensor, seq, heads in (("q", q, SQ, H), ("k", k, SK, HKV)):
        words = map_words(args[f"{name}_map"])
        assert words[0] == tensor.data_ptr()
        assert words[1:5] == [D, seq, heads, B]
        assert words[5:8] == [D, seq * D, heads * seq * D]  # (s, h, b) byte strides
    # v: a fresh uint8 (B, Hkv, D, Sk rounded up to 16) allocation, written by one indexed
    # write of v and one of the padding keys, read as rows of keys
    (v_t,) = [a for a in fake_torch.LOG if a.shape == (B, HKV, D, SK_PADDED)]
    assert v_t.dtype is fake_torch.uint8
    words = map_words(args["v_map"])
    assert words[0] == v_t.ptr
    assert words[1:5] == [SK_PADDED, D, HKV, B]
    assert words[5:8] == [SK_PADDED, D * SK_PADDED, HKV * D * SK_PADDED]
    assert [ptr for ptr, _ in fake_torch.WRITES] == [v_t.ptr, v_t.ptr]


def test_v_operand_in_torchs_operations_matches_numpys(monkeypatch):
    """fp8.v_operand spelled in torch's operations (a backed fake: empty, swapaxes, as_tensor,
    indexed writes) on a strided bshd view gives NumPy's bytes."""
    install_fake_libraries(monkeypatch, lambda *args: None, backed=True)
    rng = np.random.default_rng(9)
    v = rng.integers(0, 256, (B, SK, HKV, D), dtype=np.uint8)
    on_device = v_operand(fake_torch.from_numpy(v).swapaxes(1, 2))
    assert on_device.dtype is fake_torch.uint8 and on_device.get_device() == 0
    np.testing.assert_array_equal(on_device.host, v_operand(v.transpose(0, 2, 1, 3)))
    clear_kernel_cache()


def test_fp8_refuses_a_device_other_than_9_0(recorded, monkeypatch):
    monkeypatch.setattr(fake_cupy, "COMPUTE_CAPABILITY", "80")
    q = fp8_bshd((B, H, SQ, D))
    k, v = fp8_bshd((B, HKV, SK, D)), fp8_bshd((B, HKV, SK, D))
    allocated = len(fake_torch.LOG)
    with pytest.raises(InputError, match=r"CUDA device 0 \(sm_80\); fp8 attention runs on"):
        kernelgen.attention(q, k, v, layout="bshd")
    assert recorded == [] and len(fake_torch.LOG) == allocated
