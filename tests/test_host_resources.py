"""CPU tier: what a call holds on the device, checked with fakes that behave like the real
libraries where it matters (kernelgen/testing): torch's allocator hands a freed block to the next
allocation at once, CuPy's ExternalStream warns, CuPy's pool keeps freed blocks, a stream can
capture a CUDA graph. Covers the temporaries the kernels read, the stream handle, graph
capture, the memory tuning leaves, and NaN-poisoned outputs in both libraries."""

from __future__ import annotations

import importlib
import sys
import types
import warnings

import numpy as np
import pytest
from conftest import install_fake_libraries, launched_kernel
from test_tuning_fakes import FakeBench, fake_compile

import kernelgen
from kernelgen.errors import CaptureError
from kernelgen.kernels.render import kernel_params
from kernelgen.runtime import frameworks as frameworks
from kernelgen.runtime.launch import clear_kernel_cache
from kernelgen.testing import fake_cupy, fake_torch


@pytest.fixture
def launches(monkeypatch, tuning_sandbox):
    """Fake CuPy and torch; each launch records its arguments by parameter name and, for every
    pointer argument, the live torch allocation it falls in (None: none)."""
    recorded: list[dict] = []

    def launch(symbol, grid, block, args, shared_mem):
        _, params = launched_kernel(symbol)
        named = {p.name: a for p, a in zip(params, args, strict=True)}
        owners = {
            name: live_torch_block(int(a))
            for name, a in named.items()
            if type(a) is np.uint64 and int(a) and int(a) >= 1 << 32  # torch's pointers
        }
        recorded.append({"args": named, "owners": owners, "stream": fake_cupy.CURRENT["stream"]})

    install_fake_libraries(monkeypatch, launch)
    yield recorded
    clear_kernel_cache()


def live_torch_block(ptr: int) -> int | None:
    """The start of the live fake torch allocation that holds ``ptr``."""
    for start, tensor in list(fake_torch.ALLOCATED.items()):
        if start <= ptr < start + max(1, int(np.prod(tensor.shape))) * tensor.dtype.itemsize:
            return start
    return None


def torch_qkv(seqlen_q=100, seqlen_k=120):
    f16 = fake_torch.float16
    return (
        fake_torch.Tensor((2, 4, seqlen_q, 64), f16),
        fake_torch.Tensor((2, 2, seqlen_k, 64), f16),
        fake_torch.Tensor((2, 2, seqlen_k, 64), f16),
    )


# ---- temporaries the kernels read ----------------------------------------------------------
def test_a_converted_torch_mask_lives_until_the_kernel_is_queued(launches):
    """The float32 copy of an fp16 mask is freed only after the launch: the lse allocated after
    it must not take its block (torch's allocator would hand it over at once)."""
    q, k, v = torch_qkv()
    mask = fake_torch.Tensor((1, 1, 100, 120), fake_torch.float16)
    kernelgen.attention(q, k, v, mask=mask, return_lse=True)
    (launch,) = launches
    owners = launch["owners"]
    assert None not in owners.values(), owners  # every pointer is in a live allocation
    assert len(set(owners.values())) == len(owners), owners  # and no two share one
    converted = next(a for a in fake_torch.LOG if a.ptr == owners["mask"])
    assert converted.dtype is fake_torch.float32


# ---- the stream handle --------------------------------------------------------------------
def test_torch_streams_reach_cupy_without_a_deprecation_warning(launches):
    fake_torch.STREAMS[0] = 0xBEEF
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a -W error user: ExternalStream would raise here
        kernelgen.attention(*torch_qkv())
    assert launches[0]["stream"] == 0xBEEF


def test_the_stream_handle_keeps_cupys_device_check(launches):
    stream = frameworks.cupy_stream(0xF00, 1)
    assert (stream.ptr, stream.device_id) == (0xF00, 1)
    with pytest.raises(RuntimeError, match="does not match"):  # device 0 is current
        stream.__enter__()


# ---- CUDA graph capture -------------------------------------------------------------------
def test_host_lengths_are_refused_during_graph_capture(launches):
    torch = sys.modules["torch"]
    q, k, v = torch_qkv(seqlen_q=1)
    for _ in range(2):  # the checked path, then the remembered plan
        kernelgen.attention(q, k, v, seqlens_k=[120, 3])
        launched = len(launches)
        with (
            torch.cuda.graph(torch.cuda.CUDAGraph()),
            pytest.raises(CaptureError, match=r"seqlens_k is list .* int32 device array"),
        ):
            kernelgen.attention(q, k, v, seqlens_k=[120, 3])
        assert len(launches) == launched


def test_a_cupy_mask_needing_a_copy_is_refused_during_capture(launches):
    torch = sys.modules["torch"]
    q, k, v = torch_qkv()
    fp16_mask = fake_cupy.ndarray((1, 1, 100, 120), np.float16)
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        with pytest.raises(CaptureError, match=r"mask is ndarray .* float32 mask"):
            kernelgen.attention(q, k, v, mask=fp16_mask)
        kernelgen.attention(q, k, v, mask=fake_cupy.ndarray((1, 1, 100, 120), np.float32))
    assert len(launches) == 1


def test_torch_temporaries_are_capture_safe(launches):
    """A torch mask (converted by torch, from the graph's pool) and int32 torch lengths run
    during capture, on the capturing stream."""
    torch = sys.modules["torch"]
    q, k, v = torch_qkv()
    mask = fake_torch.Tensor((1, 1, 100, 120), fake_torch.bfloat16)
    lengths = fake_torch.Tensor((2,), fake_torch.int32)
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        kernelgen.attention(q, k, v, mask=mask, seqlens_k=lengths)
        capturing = fake_torch.STREAMS[0]
    assert capturing != 0 and {launch["stream"] for launch in launches} == {capturing}


# ---- memory tuning leaves ---------------------------------------------------------------------
class PoolBench(FakeBench):
    """A FakeBench whose input sets are 4 MiB of CuPy arrays, as CupyBench's are."""

    def __init__(self, problem, device) -> None:
        super().__init__()
        cupy = sys.modules["cupy"]
        self.sets = [cupy.empty((1 << 18,), cupy.float32) for _ in range(4)]


@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_tuning_in_a_torch_call_leaves_no_blocks_in_cupys_pool(launches, monkeypatch, library):
    from kernelgen.tuning import gpu

    autotune = importlib.import_module("kernelgen.tuning.autotune")

    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "1")
    monkeypatch.setattr(gpu, "CupyBench", PoolBench)
    real_prune = autotune.prune
    monkeypatch.setattr(autotune, "prune", lambda p, d, c: real_prune(p, d, fake_compile()))
    gpu._device.cache_clear()
    gpu.detect_software.cache_clear()
    if library == "torch":
        qkv = torch_qkv()
    else:
        qkv = [fake_cupy.ndarray(t.shape, np.float16) for t in torch_qkv()]
    try:
        kernelgen.attention(*qkv)
    finally:
        gpu._device.cache_clear()
        gpu.detect_software.cache_clear()
    pool = sys.modules["cupy"].get_default_memory_pool()
    if library == "torch":
        assert pool.total_bytes() == 0
    else:  # a CuPy caller keeps its pool's blocks for its own next arrays
        assert pool.total_bytes() - pool.used_bytes() >= 4 << 20
    assert len(launches) == 1


# ---- NaN-poisoned outputs ---------------------------------------------------------------------
@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_the_benchmarks_poison_reaches_outputs_of_both_libraries(launches, library):
    """bench's check runs torch tensors: out, lse and the split partials must start as NaN."""
    from bench import gpu

    env = types.SimpleNamespace(
        cupy=sys.modules["cupy"], kg_module=lambda n: importlib.import_module(f"kernelgen.{n}")
    )
    qkv = torch_qkv(seqlen_q=1, seqlen_k=4096)
    filled = fake_torch.FILLED
    if library == "cupy":
        qkv, filled = [fake_cupy.ndarray(t.shape, np.float16) for t in qkv], fake_cupy.FILLED
    with gpu.poisoned_kernelgen_outputs(env):
        out, lse = kernelgen.attention(*qkv, num_splits=4, return_lse=True)
    pointer = frameworks.pointer_of
    main = launches[0]["args"]
    assert {pointer(out), pointer(lse), int(main["o_partial"])} <= filled
    kernelgen.attention(*qkv, num_splits=4)  # outside the block: nothing filled
    assert len(filled) == 3


def test_kernel_params_hold_the_scratch_names():
    spec = kernelgen.default_spec("float16", 64, False, "sm_90", decode_rows=4)
    assert {"o_partial", "lse_partial"} <= {p.name for p in kernel_params(spec)}


@pytest.mark.parametrize("dtype", ["int32", "int64", "float16", "float32"])
def test_the_poison_fills_integer_buffers_too(monkeypatch, dtype):
    """Block-mask builders allocate int32 counts and indices through the same allocator: they
    are poisoned with -1 (an H100 run of the GPU tier failed on a float-only poison)."""
    import torch

    from kernelgen.testing import poison

    monkeypatch.setattr(poison, "import_cupy", lambda: np)  # NumPy stands in for CuPy here
    array = poison._nan_cupy(np.zeros(6, dtype))
    tensor = poison._nan_torch(torch.zeros(6, dtype=getattr(torch, dtype)))
    if dtype.startswith("int"):
        assert (array == -1).all() and (tensor == -1).all()
    else:
        assert np.isnan(array).all() and torch.isnan(tensor).all()
