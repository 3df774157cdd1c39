"""Emulation tier, end to end: ``kernelgen.attention()`` itself (checks, spec choice, plan, the
library's scope and allocations, launch arguments: raw pointers for torch, arrays for CuPy)
runs the generated kernels in the CPU emulator, on CuPy arrays and torch tensors faked over
host memory (kernelgen/testing/fake_cupy, fake_torch with ``backed=True``), against float64."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from attention_cases import (
    Case,
    assert_matches,
    bf16_bits_to_float,
    float_to_bf16_bits,
    make_case,
    round_to,
)
from conftest import install_fake_libraries, launched_kernel

import kernelgen
from kernelgen.references.attention import naive_attention
from kernelgen.runtime.emulated_launch import spec_kernel
from kernelgen.runtime.launch import clear_kernel_cache
from kernelgen.testing import fake_cupy, fake_torch
from kernelgen.testing.poison import poisoned_outputs

pytestmark = pytest.mark.emulate


def host_of(arg):
    """A launch argument as the emulator takes it: host memory behind a pointer, or a scalar."""
    if isinstance(arg, fake_cupy.ndarray):
        return arg.host
    if type(arg) is np.uint64:
        if int(arg) == 0:
            return None  # an absent tensor
        return host_at(int(arg))
    return arg


def host_at(address: int) -> np.ndarray:
    """Host memory at a device pointer: a backed allocation, or the rest of the contiguous one
    the pointer falls into (kernelgen packs its scratch buffers into one allocation)."""
    for registry in (fake_cupy.HOST, fake_torch.HOST):
        if address in registry:
            return registry[address]
        for start, host in registry.items():
            if host.flags.c_contiguous and start < address < start + host.nbytes:
                assert (address - start) % host.itemsize == 0, f"{address:#x} splits an element"
                return host.reshape(-1)[(address - start) // host.itemsize :]
    raise AssertionError(f"pointer {address:#x} is in no backed allocation")


@pytest.fixture
def symbols(monkeypatch, tuning_sandbox):
    """Backed fakes of both libraries; every kernelgen launch runs in the emulator; the
    launched symbols are recorded."""
    launched: list[str] = []

    def launch(symbol, grid, block, args, shared_mem):
        spec, params = launched_kernel(symbol)
        values = [host_of(a) for a in args]
        spec_kernel(spec, symbol, params)(
            grid=grid, block=block, shared_mem=shared_mem, args=values
        )
        launched.append(symbol)

    install_fake_libraries(monkeypatch, launch, backed=True)  # sm_90 fake: tensor-core specs
    yield launched
    clear_kernel_cache()


def torch_inputs(data, layout: str):
    """q, k, v as fp16 fake torch tensors; "bshd": (B, S, H, D) views of (B, H, S, D) memory
    transposed, so the strides are not the contiguous ones."""
    tensors = []
    for name in "qkv":
        x = getattr(data, name).astype(np.float16)
        if layout == "bshd":
            x = np.ascontiguousarray(x).transpose(0, 2, 1, 3)  # strided view, no copy
        tensors.append(fake_torch.from_numpy(x))
    return tensors


def host_float(tensor_or_array) -> np.ndarray:
    """Values as float64 (a fake torch bfloat16 tensor holds uint16 bits)."""
    host = tensor_or_array.host
    if getattr(tensor_or_array, "dtype", None) is fake_torch.bfloat16:
        host = bf16_bits_to_float(host)
    return np.asarray(host, dtype=np.float64)


def reference(data, out: np.ndarray, lse: np.ndarray):
    """``data`` with its float64 reference replaced."""
    return dataclasses.replace(data, ref_out=out, ref_lse=lse)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_torch_prefill_with_a_torch_mask_matches_float64(symbols, layout):
    """GQA, causal, a (1, H, Sq, Sk) fp16 mask converted and broadcast by torch; the second call
    (new data, the remembered plan) is checked too."""
    case = Case(2, 4, 2, 40, 72, mask="broadcast")
    for seed in (1, 2):
        data = make_case(case, "float16", 64, True, seed=seed)
        q, k, v = torch_inputs(data, layout)
        mask = fake_torch.from_numpy(data.mask.astype(np.float16))
        out, lse = kernelgen.attention(
            q, k, v, causal=True, mask=mask, layout=layout, return_lse=True
        )
        assert isinstance(out, fake_torch.Tensor) and out.shape == q.shape
        got = host_float(out)
        if layout == "bshd":
            got = got.transpose(0, 2, 1, 3)
        # the kernels see the mask rounded to fp16, then widened: so does the reference
        rounded = data.mask.astype(np.float16).astype(np.float64)
        want = naive_attention(data.q, data.k, data.v, causal=True, mask=rounded)
        assert_matches(got, host_float(lse), reference(data, *want), "float16")
    assert len(symbols) == 2 and not any(s.endswith("_combine") for s in symbols)


@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_split_kv_decode_with_lengths_matches_float64(symbols, framework):
    """Sq = 1 with packed GQA over 4 key chunks, per-sequence key lengths (a host list for
    torch, an int32 device array for CuPy): partials allocated by the call's library, combined."""
    case = Case(3, 8, 2, 1, 300)
    data = make_case(case, "float16", 64, False, seed=7)
    lengths = [300, 1, 129]
    if framework == "torch":
        q, k, v = torch_inputs(data, "bhsd")
        seqlens = lengths
    else:
        q, k, v = (fake_cupy.from_host(getattr(data, n).astype(np.float16)) for n in "qkv")
        seqlens = fake_cupy.from_host(np.asarray(lengths, dtype=np.int32))
    out, lse = kernelgen.attention(q, k, v, seqlens_k=seqlens, num_splits=4, return_lse=True)
    assert [s.endswith("_combine") for s in symbols] == [False, True]
    want = naive_attention(data.q, data.k, data.v, seqlens_k=lengths)
    assert_matches(host_float(out), host_float(lse), reference(data, *want), "float16")


def test_mqa_decode_step_past_one_tile_packs_every_query_head(symbols):
    """Sq = 3 queries x 32 query heads on one K/V head: 96 packed rows, more than a tile holds,
    so the default spec packs them into two 64-row tiles per K/V head (each reads K/V once)
    rather than one mostly idle tile per query head; causal, a key length not a tile multiple."""
    case = Case(1, 32, 1, 3, 100)
    data = make_case(case, "float16", 64, True, seed=11)
    q, k, v = (fake_cupy.from_host(getattr(data, n).astype(np.float16)) for n in "qkv")
    out, lse = kernelgen.attention(q, k, v, causal=True, num_splits=2, return_lse=True)
    main, combine = symbols
    spec, _ = launched_kernel(main)
    assert spec.pack_gqa and spec.split_kv and spec.block_m == 64 and combine.endswith("_combine")
    want = naive_attention(data.q, data.k, data.v, causal=True)
    assert_matches(host_float(out), host_float(lse), reference(data, *want), "float16")


def device_values(x: np.ndarray, dtype: str, library: str) -> np.ndarray:
    """float32 values as ``dtype`` elements in ``library``'s host representation (fake torch
    keeps bfloat16 as its uint16 bits, CuPy as ml_dtypes' type)."""
    if dtype == "bfloat16":
        bits = float_to_bf16_bits(x)
        return bits if library == "torch" else bits.view(ml_dtypes.bfloat16)
    return x.astype(dtype)


def as_float64(array) -> np.ndarray:
    """A fake array's or tensor's values (bfloat16 bits widened)."""
    host = array.host
    if isinstance(array, fake_torch.Tensor) and array.dtype is fake_torch.bfloat16:
        host = bf16_bits_to_float(host)
    return np.asarray(host, dtype=np.float64)


@pytest.mark.parametrize("library", ["torch", "cupy"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_every_dtype_through_both_libraries(symbols, dtype, library):
    """GQA, causal, a (1, H, Sq, Sk) mask of q's dtype in q's library (converted to float32 by
    that library), outputs poisoned through the test hook."""
    data = make_case(Case(1, 4, 2, 24, 40, mask="broadcast"), dtype, 64, True, seed=5)
    wrap = fake_torch.from_numpy if library == "torch" else fake_cupy.from_host
    q, k, v, mask = (
        wrap(device_values(getattr(data, name), dtype, library)) for name in ("q", "k", "v", "mask")
    )
    with poisoned_outputs():
        out, lse = kernelgen.attention(q, k, v, causal=True, mask=mask, return_lse=True)
    rounded = round_to(data.mask, dtype).astype(np.float64)  # the mask the kernels see
    want = naive_attention(data.q, data.k, data.v, causal=True, mask=rounded)
    assert_matches(as_float64(out), as_float64(lse), reference(data, *want), dtype)
    assert [s.endswith("_combine") for s in symbols] == [False, True]  # 48 packed rows: decode
