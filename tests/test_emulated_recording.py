"""Emulation tier: ``emulate_attention`` is kernelgen's own call on NumPy arrays (the CPU
backend), recorded (kernelgen.runtime.emulated_launch): what the recording reports, that it changes
nothing of the call (same result as ``kernelgen.attention()``, the same checks), that a
``source`` stays with its call, and that the backend's allocations start as NaN."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from attention_cases import Case, assert_matches, make_case
from conftest import POINTER_SPEC_PATHS

import kernelgen
from kernelgen.calls.emulated import emulate_attention
from kernelgen.errors import CPUBackendWarning, InputError
from kernelgen.kernels.render import render
from kernelgen.runtime import host as host
from kernelgen.runtime.emulated_launch import active_recording, recording
from kernelgen.runtime.launch import scratch_floats
from kernelgen.specs.forward import KernelSpec, load_spec

pytestmark = pytest.mark.emulate

# CUDA cores, fp32, split-KV: a main kernel and a combine, scratch buffers, exact fp32 inputs
SPLIT = KernelSpec(
    loop_order="v2", dtype="float32", head_dim=32, block_m=16, block_n=32, num_warps=4,
    split_kv=True,
)  # fmt: skip
CASE = Case(2, 4, 2, 9, 70)
# The combine writes no lse for row 0 (batch 0, head 0, query 0): a mutated source
LSE_STORE = "if (threadIdx.x == 0 && lse != nullptr) lse[row]"
LSE_STORE_BUT_ROW_0 = "if (threadIdx.x == 0 && lse != nullptr && row != 0) lse[row]"


def _data(seed: int = 1):
    return make_case(CASE, SPLIT.dtype, SPLIT.head_dim, SPLIT.causal, seed)


def test_the_recording_reports_problem_stats_arrays_and_steps():
    data = _data()
    steps: list[tuple[int, int]] = []
    run = emulate_attention(SPLIT, data.q, data.k, data.v, on_step=lambda *s: steps.append(s))
    assert_matches(run.out, run.lse, data, SPLIT.dtype)
    assert steps == [(1, 2), (2, 2)]  # the main kernel, then the combine
    assert run.problem.num_splits == 3 and run.problem.seqlen_k == CASE.seqlen_k
    assert set(run.stats) == {SPLIT.uri, SPLIT.combine_uri}
    sizes = scratch_floats(SPLIT, run.problem)
    assert {n: run.arrays[n].size for n in sizes} == sizes  # cut to each buffer
    assert not np.isnan(run.arrays["o_partial"]).any()
    np.testing.assert_array_equal(run.arrays["q"], data.q)
    assert run.arrays["lse"] is run.lse and active_recording() is None


def test_emulate_is_the_api_call_bit_for_bit():
    data = _data(2)
    run = emulate_attention(SPLIT, data.q, data.k, data.v, num_splits=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPUBackendWarning)
        out, lse = kernelgen.attention(
            *(np.float32(x) for x in (data.q, data.k, data.v)),
            spec=SPLIT,
            num_splits=2,
            return_lse=True,
        )
    np.testing.assert_array_equal(run.out, out)
    np.testing.assert_array_equal(run.lse, lse)


PAGED = next(s for s in map(load_spec, POINTER_SPEC_PATHS) if s.paged_kv)


@pytest.mark.parametrize("spec", [SPLIT, PAGED], ids=["contiguous", "paged"])
def test_emulate_runs_the_api_checks(spec):
    """Checks of attention()'s plan the former copy of it lacked: the split count's range, host
    key lengths against the keys k and v hold."""
    data = make_case(CASE, spec.dtype, spec.head_dim, spec.causal, seed=3)
    with pytest.raises(InputError, match="num_splits=0 is not allowed; use 1 to 128"):
        emulate_attention(spec, data.q, data.k, data.v, num_splits=0)
    lengths = np.array([70, 200], np.int32)  # k and v hold 70 keys (paged: 80, 5 pages)
    with pytest.raises(InputError, match=r"seqlens_k holds 200; allowed 0 to [78]0 "):
        emulate_attention(spec, data.q, data.k, data.v, seqlens_k=lengths)


def test_a_recorded_call_does_not_warn_nor_use_up_the_warning(monkeypatch):
    monkeypatch.setattr(host, "_WARNED", type(host._WARNED)())
    data = _data(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        emulate_attention(SPLIT, data.q, data.k, data.v)
        assert not caught
        kernelgen.attention(data.q, data.k, data.v, spec=SPLIT)
    assert [w.category for w in caught] == [CPUBackendWarning]


def test_a_source_stays_with_its_call_and_unwritten_elements_are_nan():
    """The mutated combine leaves lse[0, 0, 0] unwritten: NaN (the backend's poison); the calls
    after it, recorded or not, run the spec's own kernels again."""
    data = _data(5)
    source = render(SPLIT)
    assert source.count(LSE_STORE) == 1
    mutated = source.replace(LSE_STORE, LSE_STORE_BUT_ROW_0)
    run = emulate_attention(SPLIT, data.q, data.k, data.v, source=mutated)
    assert np.isnan(run.lse[0, 0, 0]) and np.isfinite(run.lse.reshape(-1)[1:]).all()
    assert_matches(run.out, None, data, SPLIT.dtype)
    qkv = (data.q, data.k, data.v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPUBackendWarning)
        _, lse = kernelgen.attention(*qkv, spec=SPLIT, num_splits=3, return_lse=True)
    assert np.isfinite(lse).all()
    with recording() as recorded:
        _, lse = kernelgen.attention(*qkv, spec=SPLIT, num_splits=3, return_lse=True)
    assert np.isfinite(lse).all() and recorded.done == 2
    again = emulate_attention(SPLIT, *qkv)
    assert_matches(again.out, again.lse, data, SPLIT.dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32", "int32", "int16"])
def test_host_allocations_start_poisoned(dtype):
    """NaN for float types (bfloat16 bits, kept as int16 by CPU torch, included), -1 for
    integers: what out, lse and scratch hold until a kernel writes them."""
    array = host.NumpyArrays.empty((3, 5), np.dtype(dtype), host.HOST_DEVICE)
    if dtype.startswith("float"):
        assert np.isnan(array).all()
    else:
        assert (array == -1).all()
        if dtype == "int16":  # bfloat16's all-ones bits are a NaN
            assert np.isnan((array.view(np.uint16).astype(np.uint32) << 16).view(np.float32)).all()
