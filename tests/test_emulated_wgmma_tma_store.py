"""Emulation tier of the wgmma forward's TMA-store epilogue (``epilogue: tma``, docs/hopper.md):
each consumer warpgroup writes o / l in 16 bits into its rows of the Q tile with stmatrix, fences,
meets its warps on a named barrier, and one thread stores the rows with TMA through ``out_map``,
then waits until the store has read them. Against float64 on shapes that are no multiples of
the tiles, GQA and MQA, both layouts, causal, the loop schedules, outputs poisoned with NaN; the
rows of a padded output buffer past seqlen_q must stay NaN (the map clips there).

Mutations that must fail: no fence.proxy.async after the stmatrix writes, no named barrier
before the elected thread's store, no wait_group.read before the thread leaves (the emulator's
exit check), an out_map whose row extent overshoots seqlen_q (writes the padding), and the
tile written without the swizzle out_map reads it with (wrong numbers).
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest
from attention_cases import Case, CaseData, assert_matches, example_variants, make_case
from test_emulated_kernels import run_emulated

from kernelgen.calls.emulated import emulate_attention
from kernelgen.errors import CPUBackendWarning, HazardError
from kernelgen.kernels.render import render
from kernelgen.runtime import emulated_launch as launches
from kernelgen.runtime.emulated_launch import from_device_dtype, run_launches, to_device_dtype
from kernelgen.runtime.launch import Problem
from kernelgen.runtime.tensor_maps import tensor_map_layouts
from kernelgen.specs.forward import spec_from_dict

pytestmark = pytest.mark.emulate

BASE = dict(loop_order="v2", mma="wgmma", epilogue="tma")
TMA_CASES = [
    # (spec fields, case): the default d128 tiling, a half-used column block (d96), four
    # column blocks (d256), one consumer warpgroup, the overlapped, ping-pong and
    # Q-in-registers loops
    (dict(dtype="bfloat16", head_dim=128, block_m=128, block_n=128), Case(2, 4, 2, 17, 33)),
    (
        dict(dtype="bfloat16", head_dim=128, block_m=128, block_n=128, causal=True),
        Case(1, 2, 1, 130, 129, layout="bshd", mask="broadcast"),
    ),
    (dict(dtype="bfloat16", head_dim=96, block_m=128, block_n=64), Case(1, 2, 2, 70, 45)),
    (dict(dtype="float16", head_dim=256, block_m=128, block_n=64), Case(1, 2, 1, 70, 100)),
    (
        dict(dtype="float16", head_dim=64, block_m=64, block_n=64, causal=True),
        Case(2, 2, 1, 100, 150, layout="bshd", scale=-0.2),
    ),
    (
        dict(dtype="float16", head_dim=64, block_m=128, block_n=64, stages=3, overlap=True),
        Case(1, 2, 1, 40, 300, key_growth=6.0),
    ),
    (
        dict(dtype="bfloat16", head_dim=64, block_m=128, block_n=64, pingpong=True, causal=True),
        Case(1, 2, 2, 200, 333, mask="full", scale=0.3),
    ),
    (
        dict(dtype="bfloat16", head_dim=64, block_m=128, block_n=128, q_in_registers=True),
        Case(1, 1, 1, 1, 1),
    ),
]


def tma_spec(**fields):
    return spec_from_dict({**BASE, **fields})


@pytest.mark.parametrize(("fields", "case"), TMA_CASES, ids=lambda x: str(x)[:60])
def test_tma_store_epilogue_matches_float64(fields, case):
    spec = tma_spec(**fields)
    seed = zlib.crc32(f"{spec.uri} {case}".encode())
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed)
    out, lse = run_emulated(spec, case, data)
    assert_matches(out, lse, data, spec.dtype)


def test_tma_store_epilogue_with_key_lengths_and_a_null_lse():
    """seqlens_k with an entry of no key (its block loads no Q and still stores out = 0 through
    the tile), then no lse asked for (a null pointer)."""
    spec = tma_spec(dtype="bfloat16", head_dim=64, block_m=128, block_n=64)
    case = Case(2, 2, 1, 70, 90)
    data = make_case(case, spec.dtype, spec.head_dim, False, seed=7)
    out, lse = run_emulated(spec, case, data, seqlens_k=np.array([0, 90], np.int32))
    assert (out[0] == 0).all() and np.isneginf(lse[0]).all()
    q, k, v, ref_out, ref_lse = (
        x[1:] for x in (data.q, data.k, data.v, data.ref_out, data.ref_lse)
    )
    assert_matches(out[1:], lse[1:], CaseData(q, k, v, None, ref_out, ref_lse), spec.dtype)
    out, lse = run_emulated(spec, case, data, want_lse=False)
    assert lse is None
    assert_matches(out, None, data, spec.dtype)


def test_tma_store_epilogue_with_a_window_and_sinks():
    spec = tma_spec(dtype="bfloat16", head_dim=64, block_m=128, block_n=64, window=True, sinks=True)
    case = Case(1, 2, 1, 150, 300)
    values = example_variants(spec.variants, case.batch, case.heads, 7, window=(70, 5))
    data = make_case(case, spec.dtype, spec.head_dim, False, 7, values)
    out, lse = run_emulated(spec, case, data, variants=values)
    assert_matches(out, lse, data, spec.dtype)


# ---- rows past seqlen_q: a padded output buffer whose padding must stay NaN -------------------

PAD = 64  # rows of padding after each (batch, head)'s seqlen_q rows
PADDED_SPEC = tma_spec(dtype="bfloat16", head_dim=64, block_m=128, block_n=64)


def overshooting_layouts(spec, problem):
    """Mutation: the layouts with out_map's row extent rounded up to the tile (a map of the
    tile grid rather than of the queries)."""
    layouts = tensor_map_layouts(spec, problem)
    out = layouts["out_map"]
    rows = -(-problem.seqlen_q // spec.block_m) * spec.block_m
    return {**layouts, "out_map": dataclasses.replace(out, dims=(out.dims[0], rows, *out.dims[2:]))}


def run_into_padded_out(
    spec, case: Case, data, layouts=tensor_map_layouts
) -> tuple[np.ndarray, np.ndarray]:
    """The spec's launches writing out into a NaN buffer of seqlen_q + PAD rows per (batch,
    head), in the case's layout, with the tensor maps of ``layouts``: returns (out rows,
    padding rows), both (B, H, S, D) float32."""
    first = emulate_attention(spec, data.q, data.k, data.v, layout=case.layout)
    # q, k, v as that call stored them: (B, H, S, D) laid out in the case's layout, contiguous
    order = (0, 1, 2, 3) if case.layout == "bhsd" else (0, 2, 1, 3)
    arrays = {
        name: to_device_dtype(x.transpose(order), spec.dtype)
        for name, x in (("q", data.q), ("k", data.k), ("v", data.v))
    }
    b, h, sq, d = data.q.shape
    rows = sq + PAD
    shape = (b, h, rows, d) if case.layout == "bhsd" else (b, rows, h, d)
    arrays["out"] = np.full(shape, 0xFFFF, np.uint16)  # bf16 NaN everywhere
    arrays["lse"] = np.full((b, h, sq), np.nan, np.float32)
    strides = (h * rows * d, rows * d, d) if case.layout == "bhsd" else (rows * h * d, d, h * d)
    problem = Problem(**{**first.problem.__dict__, "out_strides": strides})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launches, "tensor_map_layouts", layouts)
        run_launches(spec, problem, arrays, 1.0 / np.sqrt(d))
    full = from_device_dtype(arrays["out"], spec.dtype)
    if case.layout == "bshd":
        full = full.transpose(0, 2, 1, 3)
    return full[:, :, :sq], full[:, :, sq:]


def check_rows_past_seqlen_q(layout: str, layouts=tensor_map_layouts) -> None:
    """Sq 70 of a 128-row tile: the second consumer's rows 70..127 are clipped by out_map; the
    buffer's padding stays NaN and out matches float64."""
    case = Case(2, 2, 1, 70, 100, layout=layout)
    data = make_case(case, PADDED_SPEC.dtype, PADDED_SPEC.head_dim, False, seed=11)
    out, padding = run_into_padded_out(PADDED_SPEC, case, data, layouts)
    assert np.isnan(padding).all()
    assert_matches(out, None, data, PADDED_SPEC.dtype)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_rows_past_seqlen_q_are_not_written(layout):
    check_rows_past_seqlen_q(layout)


def test_an_out_map_overshooting_seqlen_q_writes_the_padding():
    """The overshooting map lets the stores write rows 70..127 of each (batch, head) (inside
    the padded buffer): the padding check fails."""
    with pytest.raises(AssertionError):
        check_rows_past_seqlen_q("bshd", overshooting_layouts)


# ---- mutations of the epilogue's synchronisation -----------------------------------------------

# A staged write and the TMA store's read of it that no barrier orders: the emulator reports the
# race from whichever side its thread order reaches second (the store reading an unordered
# write, or a write after, or during, the store's read), so a mutation test accepts each form.
STAGING_RACE = r"no barrier ordering the write|still reads it|no barrier orders that thread"
EPILOGUE_MUTATIONS = {
    "no fence.proxy.async after stmatrix": (
        "fence_proxy_async();  // this thread's staging writes",
        "//",
        r"no fence\.proxy\.async after the write",
    ),
    "no named barrier before the store": (
        "named_barrier_sync(STORE_BARRIER + store_consumer, 128);",
        "",
        STAGING_RACE,
    ),
    "no wait_group.read before leaving": (
        "bulk_wait_read<0>();",
        "",
        r"leaves the kernel with \d+ TMA store\(s\) still reading shared memory",
    ),
}


@pytest.mark.parametrize("name", EPILOGUE_MUTATIONS)
def test_mutated_epilogue_is_a_hazard(name):
    original, mutated, message = EPILOGUE_MUTATIONS[name]
    spec = PADDED_SPEC
    source = render(spec)
    assert source.count(original) == 1, original
    case = Case(1, 2, 1, 130, 100)
    data = make_case(case, spec.dtype, spec.head_dim, False, seed=3)
    out, lse = run_emulated(spec, case, data, source=source)  # the original passes
    assert_matches(out, lse, data, spec.dtype)
    with pytest.raises(HazardError, match=message):
        run_emulated(spec, case, data, source=source.replace(original, mutated))


def test_attention_on_host_arrays_with_the_tma_epilogue():
    """kernelgen.attention() on NumPy arrays: the call plan encodes out_map per out buffer
    (a new one each call), GQA, causal, both layouts."""
    import warnings

    import kernelgen

    spec = tma_spec(dtype="float16", head_dim=64, block_m=128, block_n=64, causal=True)
    case = Case(1, 4, 2, 50, 80)
    data = make_case(case, spec.dtype, spec.head_dim, True, seed=21)
    q, k, v = (x.astype(np.float16) for x in (data.q, data.k, data.v))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPUBackendWarning)
        for _ in range(2):
            out, lse = kernelgen.attention(q, k, v, causal=True, return_lse=True, spec=spec)
            assert_matches(out.astype(np.float32), lse, data, spec.dtype)
        bshd = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v)]
        out = kernelgen.attention(*bshd, causal=True, layout="bshd", spec=spec)
    assert_matches(out.transpose(0, 2, 1, 3).astype(np.float32), None, data, spec.dtype)


def test_stmatrix_rows_written_unswizzled_give_wrong_numbers():
    """Mutation: the tile written without the 128-byte swizzle that out_map reads it with: the
    columns of rows 1..7 of every 8 land in other chunks (no hazard, wrong numbers)."""
    original = "const int chunk = ((col % 64) / 8) ^ swizzle_phase(st_row);"
    source = render(PADDED_SPEC)
    assert source.count(original) == 1
    case = Case(1, 2, 1, 70, 100)
    data = make_case(case, PADDED_SPEC.dtype, PADDED_SPEC.head_dim, False, seed=5)
    mutant = source.replace(original, "const int chunk = (col % 64) / 8;")
    out, lse = run_emulated(PADDED_SPEC, case, data, source=mutant)
    with pytest.raises(AssertionError):
        assert_matches(out, lse, data, PADDED_SPEC.dtype)
