"""Emulation tier: every spec's generated CUDA, run on the CPU (tests/cuda_emulator), against
float64 NumPy. Outputs and the v1 workspace are poisoned with NaN before each run.

This checks the kernels' logic (tiles that do not divide the lengths, causal limits, GQA, masks,
layouts, empty rows) where no GPU exists; `pytest -m gpu` runs the same cases on a device.
"""

from __future__ import annotations

import dataclasses
import shutil
import zlib
from functools import cache
from typing import TYPE_CHECKING

import numpy as np
import pytest
from attention_cases import Case, assert_matches, float_to_bf16_bits, make_case
from conftest import HEAD_DIM_SWEEP, SPEC_PATHS, require_toolchain

from kernelgen.api import TensorInfo, check_inputs, plan
from kernelgen.launch import Problem, kernel_arguments, launch_steps, scratch_floats
from kernelgen.render import render
from kernelgen.spec import KernelSpec, load_spec

if TYPE_CHECKING:
    from cuda_emulator import LaunchStats

pytestmark = pytest.mark.emulate

CASES = [
    Case(2, 4, 2, 17, 33),  # GQA, Sq < Sk, partial tiles
    Case(1, 2, 1, 70, 45, layout="bshd", mask="broadcast"),  # MQA, Sq > Sk, empty rows
    Case(1, 1, 1, 1, 1),
    Case(1, 2, 2, 130, 129, mask="full", scale=0.3),  # several tiles both ways
    Case(1, 2, 1, 40, 300, key_growth=6.0),  # row maxima keep moving: the rescale path
    Case(1, 1, 1, 33, 150, scale=-0.2),  # a negative scale: no tile keeps raw dot products
]


@cache
def emulated(spec: KernelSpec, symbol: str, params: tuple):
    from cuda_emulator import build_kernel

    return build_kernel(render(spec), symbol, [(p.ctype, p.name) for p in params])


def launch_emulated(
    spec: KernelSpec, problem: Problem, arrays: dict[str, np.ndarray], scale: float
) -> dict[str, LaunchStats]:
    """Every launch of the spec's plan, in order, with NaN-poisoned scratch buffers; returns
    each kernel's launch statistics by symbol."""
    from cuda_emulator import LaunchStats

    for name, floats in scratch_floats(spec, problem).items():
        arrays[name] = np.full(floats, np.nan, dtype=np.float32)
    stats: dict[str, LaunchStats] = {}
    for step in launch_steps(spec, problem):
        args = kernel_arguments(step.params, problem, arrays, scale, null=None)
        kernel = emulated(spec, step.symbol, step.params)
        launched = kernel(grid=step.grid, block=step.block, shared_mem=step.shared_mem, args=args)
        stats[step.symbol] = stats.get(step.symbol, LaunchStats()) + launched
    return stats


def to_device_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float16":
        return x.astype(np.float16)
    if dtype == "bfloat16":
        return float_to_bf16_bits(x)
    return x.astype(np.float32)


def from_device_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


def info(name: str, array: np.ndarray, dtype: str) -> TensorInfo:
    strides = tuple(s // array.itemsize for s in array.strides)
    return TensorInfo(name, array.shape, strides, dtype, array)


def run_emulated(
    spec: KernelSpec,
    case: Case,
    data,
    num_splits: int | None = None,
    seqlens_k: np.ndarray | None = None,
    keep: dict | None = None,
    stats: dict | None = None,
    want_lse: bool = True,
):
    """out and lse of the spec's launches on ``data`` (and, into ``keep``, every array; into
    ``stats``, each kernel's LaunchStats by symbol). Without ``want_lse`` the kernels get a
    null lse, as attention() passes when the lse is not asked for, and lse is None.

    Split-KV specs default to 3 key chunks, so every case goes through the combine kernel."""
    if num_splits is None:
        num_splits = 3 if spec.split_kv else 1
    dtype = spec.dtype
    arrays = {}
    for name in ("q", "k", "v"):
        x = getattr(data, name)
        if case.layout == "bshd":  # store (B, S, H, D) in memory, pass that array
            x = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
        arrays[name] = to_device_dtype(x, dtype)
    infos = [info(n, arrays[n], dtype) for n in ("q", "k", "v")]
    mask_info = None
    if data.mask is not None:
        full = (*data.q.shape[:3], data.k.shape[2])
        arrays["mask"] = np.broadcast_to(data.mask.astype(np.float32), full)
        mask_info = info("mask", arrays["mask"], "float32")
    call = check_inputs(
        *infos, mask_info, layout=case.layout, scale=case.scale, spec=spec, causal=spec.causal
    )
    problem, out_shape = plan(call, case.layout)
    problem = Problem(**{**problem.__dict__, "num_splits": num_splits})
    if seqlens_k is not None:
        arrays["seqlens_k"] = np.asarray(seqlens_k, dtype=np.int32)
    out_dtype = np.uint16 if dtype == "bfloat16" else arrays["q"].dtype
    arrays["out"] = np.full(out_shape, 0xFFFF if dtype == "bfloat16" else np.nan, dtype=out_dtype)
    if want_lse:
        arrays["lse"] = np.full(call.q.shape[:3], np.nan, dtype=np.float32)
    launched = launch_emulated(spec, problem, arrays, call.scale)
    if stats is not None:
        stats.update(launched)
    if keep is not None:
        keep.update(arrays)
    out = from_device_dtype(arrays["out"], dtype)
    if case.layout == "bshd":
        out = out.transpose(0, 2, 1, 3)
    return out, arrays.get("lse")


@pytest.fixture(scope="module", autouse=True)
def _gxx():
    require_toolchain(shutil.which("g++") is not None, "g++ (for the CUDA emulator)")


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("path", SPEC_PATHS, ids=lambda p: p.stem)
def test_spec_matches_float64_reference(path, case):
    spec = load_spec(path)
    seed = zlib.crc32(f"{spec.uri} {case}".encode())  # stable across processes
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed)
    out, lse = run_emulated(spec, case, data)
    assert_matches(out, lse, data, spec.dtype)


@pytest.mark.parametrize("path", SPEC_PATHS, ids=lambda p: p.stem)
def test_a_null_lse_is_not_written(path):
    """attention() passes a null lse when the caller did not ask for it: every kernel (the
    combine too) must skip that store and still write out (a store through null would crash)."""
    spec = load_spec(path)
    case = Case(1, 2, 1, 17, 40)  # GQA, partial tiles, rows that see no key when causal
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed=11)
    out, lse = run_emulated(spec, case, data, want_lse=False)
    assert lse is None
    assert_matches(out, None, data, spec.dtype)


def test_nan_inputs_propagate_only_to_their_rows():
    spec = load_spec(SPEC_PATHS[0])
    case = Case(1, 1, 1, 9, 20)
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed=7)
    data.q[0, 0, 3, 5] = np.nan
    out, lse = run_emulated(spec, case, data)
    assert np.isnan(out[0, 0, 3]).all()
    rows = [i for i in range(9) if i != 3]
    assert not np.isnan(out[0, 0, rows]).any()
    assert not np.isnan(lse[0, 0, rows]).any()


def test_large_scores_do_not_overflow():
    """Scores far beyond the range where e^x overflows fp16 (x > 11, seed 002) stay exact.

    (Scores of 1e4 are the NumPy models' test: fp32 itself resolves an lse of 1e4 only to ~1e-3.)
    """
    spec = next(load_spec(p) for p in SPEC_PATHS if load_spec(p).dtype == "float32")
    case = Case(1, 1, 1, 5, 40, scale=30.0)
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed=3)
    assert np.abs(data.ref_lse[np.isfinite(data.ref_lse)]).max() > 100
    out, lse = run_emulated(spec, case, data)
    assert_matches(out, lse, data, spec.dtype)


@pytest.mark.parametrize("spec", HEAD_DIM_SWEEP, ids=lambda s: s.uri)
def test_every_head_dim_on_the_tensor_cores(spec):
    """Issue #3: head dims 32 to 256 in steps of 8. Dims that are not a multiple of 16 run with
    zero-filled padding columns; ldmatrix stays free of bank conflicts in both layouts. Half
    the dims (padded and not) take the (B, S, H, D) layout with a broadcast additive mask."""
    case = Case(1, 2, 1, 33, 70)  # GQA, partial row and key tiles
    if spec.head_dim // 8 % 4 in (1, 2):  # 40, 48, 72, 80, ...: odd and even multiples of 8
        case = dataclasses.replace(case, layout="bshd", mask="broadcast")
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed=spec.head_dim)
    stats: dict = {}
    out, lse = run_emulated(spec, case, data, stats=stats)
    assert_matches(out, lse, data, spec.dtype)
    launched = stats[spec.uri]
    assert launched.ldmatrix_wavefronts == launched.ldmatrix_ideal, launched.first_conflict
