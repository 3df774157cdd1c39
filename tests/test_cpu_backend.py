"""Emulation tier, the CPU backend: ``kernelgen.attention()`` on NumPy arrays and CPU torch
tensors runs the GPU path (checks, heuristic spec, call plan, split-KV, decode packing) with
host arrays and the emulator as the kernel runner, against float64 (kernelgen.runtime.host)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from attention_cases import Case, assert_matches, make_case
from conftest import CPU_BACKEND_MARKS

import kernelgen
from kernelgen.calls import attention as api
from kernelgen.errors import CPUBackendWarning, InputTypeError
from kernelgen.references.attention import naive_attention
from kernelgen.runtime import host as host
from kernelgen.specs.forward import spec_from_dict

pytestmark = CPU_BACKEND_MARKS
HEAD_DIM = 32


def torch_of(x: np.ndarray, dtype: str):
    torch = pytest.importorskip("torch")
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(getattr(torch, dtype))


def as_float(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    return x.float().numpy().astype(np.float64)


def test_numpy_fp32_gqa_causal_with_lse():
    data = make_case(Case(2, 4, 2, 19, 45), "float32", HEAD_DIM, True, seed=1)
    out, lse = kernelgen.attention(data.q, data.k, data.v, causal=True, return_lse=True)
    assert type(out) is np.ndarray and out.dtype == np.float32 and out.shape == data.q.shape
    assert type(lse) is np.ndarray and lse.dtype == np.float32 and lse.shape == (2, 4, 19)
    assert_matches(out, lse, data, "float32")


def test_numpy_fp16_bshd_with_a_mask():
    """A (1, H, Sq, Sk) float32 NumPy mask with fully masked rows; (B, S, H, D) views."""
    data = make_case(Case(1, 2, 1, 17, 40, mask="broadcast"), "float16", HEAD_DIM, False, seed=2)
    q, k, v = (getattr(data, n).astype(np.float16).transpose(0, 2, 1, 3) for n in "qkv")
    out, lse = kernelgen.attention(q, k, v, mask=data.mask, layout="bshd", return_lse=True)
    assert out.dtype == np.float16 and out.shape == q.shape
    assert_matches(out.transpose(0, 2, 1, 3), lse, data, "float16")


def test_torch_bf16_gqa_causal_gives_torch_outputs_and_reuses_its_plan():
    torch = pytest.importorskip("torch")
    for seed in (3, 4):  # the second call takes the remembered call plan
        data = make_case(Case(1, 4, 2, 24, 24), "bfloat16", HEAD_DIM, True, seed=seed)
        q, k, v = (torch_of(getattr(data, n), "bfloat16") for n in "qkv")
        out, lse = kernelgen.attention(q, k, v, causal=True, return_lse=True)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
        assert out.device.type == "cpu" and lse.dtype == torch.float32
        assert_matches(as_float(out), as_float(lse), data, "bfloat16")
    assert len(api._CALL_PLANS) == 1


def test_torch_fp16_decode_with_seqlens_k_splits_and_packs():
    """Sq = 1, 8 query heads on 2 K/V heads: the decode spec (GQA packed, split-KV, combine)."""
    data = make_case(Case(3, 8, 2, 1, 150), "float16", HEAD_DIM, False, seed=5)
    q, k, v = (torch_of(getattr(data, n), "float16") for n in "qkv")
    lengths = [150, 1, 70]
    out, lse = kernelgen.attention(q, k, v, seqlens_k=lengths, num_splits=3, return_lse=True)
    decode = [s for s in host._KERNELS if s.pack_gqa and s.split_kv and s.dtype == "float16"]
    assert decode, f"no packed split-KV decode spec among {list(host._KERNELS)}"
    ref_out, ref_lse = naive_attention(data.q, data.k, data.v, seqlens_k=lengths)
    want = type(data)(data.q, data.k, data.v, None, ref_out, ref_lse)
    assert_matches(as_float(out), as_float(lse), want, "float16")


def test_torch_fp32_mask_and_numpy_lengths():
    """A CPU torch mask (converted and broadcast by torch) and int32 NumPy key lengths."""
    data = make_case(Case(2, 2, 2, 8, 33, mask="broadcast"), "float32", HEAD_DIM, True, seed=6)
    q, k, v, mask = (torch_of(getattr(data, n), "float32") for n in ("q", "k", "v", "mask"))
    lengths = np.array([33, 20], dtype=np.int32)
    out = kernelgen.attention(q, k, v, causal=True, mask=mask, seqlens_k=lengths)
    ref_out, ref_lse = naive_attention(
        data.q, data.k, data.v, causal=True, mask=data.mask, seqlens_k=lengths
    )
    want = type(data)(data.q, data.k, data.v, data.mask, ref_out, ref_lse)
    assert_matches(as_float(out), None, want, "float32")


def test_numpy_bfloat16_through_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    data = make_case(Case(1, 2, 2, 16, 16), "bfloat16", HEAD_DIM, False, seed=7)
    q, k, v = (getattr(data, n).astype(ml_dtypes.bfloat16) for n in "qkv")
    out = kernelgen.attention(q, k, v)
    assert out.dtype == q.dtype
    assert_matches(out.astype(np.float64), None, data, "bfloat16")


def test_the_warning_is_given_once(monkeypatch):
    monkeypatch.setattr(host, "_WARNED", type(host._WARNED)())
    data = make_case(Case(1, 1, 1, 4, 8), "float32", HEAD_DIM, False, seed=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            kernelgen.attention(data.q, data.k, data.v)
    assert [w.category for w in caught] == [CPUBackendWarning]
    assert "not speed" in str(caught[0].message) and caught[0].filename == __file__


def test_host_and_device_arrays_do_not_mix():
    try:
        from kernelgen.testing import fake_torch
    except ImportError:
        from bench import fake_torch

    data = make_case(Case(1, 1, 1, 4, 8), "float16", HEAD_DIM, False, seed=9)
    q = data.q.astype(np.float16)
    cuda_k = fake_torch.Tensor(q.shape, fake_torch.float16, device_index=0)
    with pytest.raises(InputTypeError, match="k is on CUDA device 0 but q is on the CPU"):
        kernelgen.attention(q, cuda_k, q)


def unmasked_tc_spec():
    return spec_from_dict(
        {"loop_order": "v2", "mma": "mma_sync", "dtype": "float16", "head_dim": HEAD_DIM,
         "block_m": 64, "block_n": 32}
    )  # fmt: skip


def test_a_call_with_a_mask_runs_its_spec_compiled_to_read_one():
    """A spec without additive_mask is run with it for a masked call (and without it
    otherwise); its kernels never read a mask, so the launch refuses one."""
    spec = unmasked_tc_spec()
    assert not spec.additive_mask and "amask" not in spec.uri
    masked = spec.with_additive_mask()
    assert masked.additive_mask and masked.uri == spec.uri + "_amask"
    assert masked.with_additive_mask() is masked
    assert "additive_mask" not in spec.model_dump() and masked.model_dump()["additive_mask"]
    data = make_case(Case(1, 2, 1, 20, 40, mask="full"), "float16", HEAD_DIM, False, seed=8)
    q, k, v = (getattr(data, n).astype(np.float16) for n in "qkv")
    out, lse = kernelgen.attention(q, k, v, mask=data.mask, spec=spec, return_lse=True)
    assert_matches(out, lse, data, "float16")
    assert masked in host._KERNELS
    plain = make_case(Case(1, 2, 1, 20, 40), "float16", HEAD_DIM, False, seed=9)
    out, lse = kernelgen.attention(
        *(getattr(plain, n).astype(np.float16) for n in "qkv"), spec=spec, return_lse=True
    )
    assert_matches(out, lse, plain, "float16")
    assert spec in host._KERNELS


def test_a_kernel_that_reads_no_mask_refuses_one(monkeypatch):
    """The launch's guard, with the API's flag step removed (what a caller of the launch layer
    that forgot it would do): an InputError, not a silently unmasked result."""
    from kernelgen.errors import InputError
    from kernelgen.specs.forward import KernelSpec

    monkeypatch.setattr(KernelSpec, "with_additive_mask", lambda self: self)
    data = make_case(Case(1, 2, 1, 12, 24, mask="full"), "float16", HEAD_DIM, False, seed=10)
    q, k, v = (getattr(data, n).astype(np.float16) for n in "qkv")
    spec = unmasked_tc_spec()
    with pytest.raises(InputError, match="additive_mask=false"):
        kernelgen.attention(q, k, v, mask=data.mask, spec=spec)
