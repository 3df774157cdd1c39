"""Emulation tier: every spec's generated CUDA, run on the CPU (kernelgen.emulator), against
float64 NumPy. Outputs and the v1 workspace are poisoned with NaN before each run.

This checks the kernels' logic (tiles that do not divide the lengths, causal limits, GQA, masks,
layouts, empty rows) where no GPU exists; `pytest -m gpu` runs the same cases on a device.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest
from attention_cases import Case, assert_matches, example_expressions, example_variants, make_case
from conftest import HEAD_DIM_SWEEP, POINTER_SPEC_PATHS

from kernelgen.calls.emulated import emulate_attention
from kernelgen.specs.forward import KernelSpec, load_spec

pytestmark = pytest.mark.emulate

CASES = [
    Case(2, 4, 2, 17, 33),  # GQA, Sq < Sk, partial tiles
    Case(1, 2, 1, 70, 45, layout="bshd", mask="broadcast"),  # MQA, Sq > Sk, empty rows
    Case(1, 1, 1, 1, 1),
    Case(1, 2, 2, 130, 129, mask="full", scale=0.3),  # several tiles both ways
    Case(1, 2, 1, 40, 300, key_growth=6.0),  # row maxima keep moving: the rescale path
    Case(1, 1, 1, 33, 150, scale=-0.2),  # a negative scale: no tile keeps raw dot products
]


def run_emulated(
    spec: KernelSpec,
    case: Case,
    data,
    num_splits: int | None = None,
    seqlens_k: np.ndarray | None = None,
    keep: dict | None = None,
    stats: dict | None = None,
    want_lse: bool = True,
    source: str | None = None,
    page_size: int | None = None,
    variants: dict | None = None,
):
    """out and lse of the spec's launches on ``data`` through
    :func:`kernelgen.calls.emulated.emulate_attention` (and, into ``keep``, every array;
    into ``stats``, each kernel's LaunchStats by symbol); ``source`` replaces the rendered CUDA.
    Without ``want_lse`` the kernels get a null lse and lse is None. ``variants``: the variant
    arguments of attention() (window_size, softcap, alibi_slopes, sinks).

    Split-KV specs default to 3 key chunks, so every case goes through the combine kernel."""
    run = emulate_attention(
        spec,
        data.q,
        data.k,
        data.v,
        data.mask,
        layout=case.layout,
        scale=case.scale,
        num_splits=num_splits,
        seqlens_k=seqlens_k,
        want_lse=want_lse,
        source=source,
        page_size=page_size,
        **(variants or {}),
    )
    if stats is not None:
        stats.update(run.stats)
    if keep is not None:
        keep.update(run.arrays)
    return run.out, run.lse


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("path", POINTER_SPEC_PATHS, ids=lambda p: p.stem)
def test_spec_matches_float64_reference(path, case):
    """Every spec; one compiled with variants (docs/variants.md) or user expressions
    (docs/expressions.md) runs them with example values."""
    spec = load_spec(path)
    seed = zlib.crc32(f"{spec.uri} {case}".encode())  # stable across processes
    variants = example_variants(spec.variants, case.batch, case.heads, seed)
    expressions, hooks = example_expressions(spec, case, seed)  # docs/expressions.md
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed, {**variants, **hooks})
    out, lse = run_emulated(spec, case, data, variants={**variants, **expressions})
    assert_matches(out, lse, data, spec.dtype)


@pytest.mark.parametrize("path", POINTER_SPEC_PATHS, ids=lambda p: p.stem)
def test_a_null_lse_is_not_written(path):
    """attention() passes a null lse when the caller did not ask for it: every kernel (the
    combine too) must skip that store and still write out (a store through null would crash)."""
    spec = load_spec(path)
    case = Case(1, 2, 1, 17, 40)  # GQA, partial tiles, rows that see no key when causal
    variants = example_variants(spec.variants, case.batch, case.heads, seed=11)
    expressions, hooks = example_expressions(spec, case, 11)
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, 11, {**variants, **hooks})
    out, lse = run_emulated(spec, case, data, want_lse=False, variants={**variants, **expressions})
    assert lse is None
    assert_matches(out, None, data, spec.dtype)


PAGED_SPECS = [s for s in map(load_spec, POINTER_SPEC_PATHS) if s.paged_kv]


@pytest.mark.parametrize("page_size", [16, 48, 64, 256])
@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=str)
@pytest.mark.parametrize("spec", PAGED_SPECS, ids=lambda s: s.uri)
def test_paged_specs_at_every_kind_of_page_size(spec, case, page_size):
    """Pages smaller than the key tile and not dividing it (a lookup per page each thread's
    rows enter), equal to it and a multiple of it (one lookup per tile), in reverse order
    after a NaN spare page; split-KV chunks start inside pages."""
    seed = zlib.crc32(f"{spec.uri} {case} {page_size}".encode())
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed)
    out, lse = run_emulated(spec, case, data, page_size=page_size)
    assert_matches(out, lse, data, spec.dtype)


def test_nan_inputs_propagate_only_to_their_rows():
    spec = load_spec(POINTER_SPEC_PATHS[0])
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
    spec = next(load_spec(p) for p in POINTER_SPEC_PATHS if load_spec(p).dtype == "float32")
    case = Case(1, 1, 1, 5, 40, scale=30.0)
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed=3)
    assert np.abs(data.ref_lse[np.isfinite(data.ref_lse)]).max() > 100
    out, lse = run_emulated(spec, case, data)
    assert_matches(out, lse, data, spec.dtype)


@pytest.mark.parametrize("spec", HEAD_DIM_SWEEP, ids=lambda s: s.uri)
def test_every_head_dim_on_the_tensor_cores(spec):
    """Head dims 32 to 256 in steps of 8. Dims that are not a multiple of 16 run with
    zero-filled padding columns; ldmatrix stays free of bank conflicts in both layouts. Half
    the dims (padded and not) take the (B, S, H, D) layout with a broadcast additive mask."""
    case = Case(1, 2, 1, 33, 70)  # GQA, partial row and key tiles
    if spec.head_dim // 8 % 4 in (1, 2):  # 40, 48, 72, 80, ...: odd and even multiples of 8
        case = dataclasses.replace(case, layout="bshd", mask="broadcast")
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed=spec.head_dim)
    stats: dict = {}
    out, lse = run_emulated(spec, case, data, stats=stats)
    assert_matches(out, lse, data, spec.dtype)
    ran = spec.with_additive_mask() if data.mask is not None else spec  # what attention() runs
    launched = stats[ran.uri]
    assert launched.ldmatrix_wavefronts == launched.ldmatrix_ideal, launched.first_conflict
