"""Emulation tier of the TMA-store epilogue (``epilogue: tma``) of the fp8 (e4m3) forward
(docs/hopper.md): out is bf16 while the Q tile is fp8, so a consumer's 64 rows of out (two
64-column blocks) are staged in its own rows of the Q tile (block 0) and of one extra column block
of shared memory right after it (block 1), then stored through a bf16 ``out_map``.

Against the float64 reference of the quantized inputs with tests/test_emulated_fp8.py's
element-wise bound, GQA 2, 4 and 8, causal and not, Sq no multiple of the tile; the out bits equal
the direct epilogue's (the same rounding of the same o / l * v_descale). Through
``kernelgen.attention`` on ml_dtypes arrays in the bshd layout (out_map's strides in bf16
elements). Mutations that must fail: the v descale left out of the staged rows, block 1 staged
in the other consumer's Q rows, an out box of 128 columns (fp8 Q's box, not out's), and the
epilogue's fence, named barrier and wait_group.read removed (hazards).
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
from test_emulated_fp8 import bound_ratio, fp8_spec, problem, reference
from test_emulated_wgmma_tma_store import EPILOGUE_MUTATIONS, STAGING_RACE

import kernelgen
from kernelgen.calls.emulated import emulate_fp8_attention
from kernelgen.errors import CPUBackendWarning, EmulatorError, HazardError
from kernelgen.kernels.render import render
from kernelgen.references.fp8 import FP8_LSE_TOLERANCE, P_RELATIVE
from kernelgen.runtime import launch
from kernelgen.runtime.tensor_maps import tensor_map_layouts

pytestmark = pytest.mark.emulate

SCALE = 128**-0.5
TMA = fp8_spec(epilogue="tma")
# (causal, (B, H, Hkv, Sq, Sk)): groups 2 and 8 (4 after the other loops, below), lengths off
# the tiles and off 16
CASES = [
    pytest.param(False, (2, 4, 2, 70, 150), id="group2-sq70"),
    pytest.param(True, (1, 8, 1, 17, 300), id="group8-causal-sq17"),
]


@pytest.mark.parametrize(("causal", "shape"), CASES)
def test_fp8_tma_store_within_the_bound_and_equal_to_direct(causal, shape):
    spec = fp8_spec(epilogue="tma", causal=causal)
    q, k, v, descales = problem(sum(shape), *shape)
    result = emulate_fp8_attention(spec, q, k, v, **descales)
    ref, lse, a, b = reference(q, k, v, descales, causal, SCALE)
    assert bound_ratio(result.out, ref, a, b) <= 1.0
    assert np.linalg.norm(result.out - ref) / np.linalg.norm(ref) < P_RELATIVE
    np.testing.assert_allclose(result.lse, lse, rtol=0, atol=FP8_LSE_TOLERANCE)
    direct = emulate_fp8_attention(fp8_spec(causal=causal), q, k, v, **descales)
    np.testing.assert_array_equal(result.out, direct.out)
    np.testing.assert_array_equal(result.lse, direct.lse)


@pytest.mark.parametrize(
    "loop",
    [dict(q_in_registers=True), dict(stages=3, overlap=True, q_in_registers=True)],
    ids=["qr", "ovl-qr"],
)
def test_fp8_tma_store_after_the_other_loops(loop):
    """The epilogue after the Q-in-registers and overlapped loops (their last products retire
    before the staging overwrites Q's rows): equal to the direct epilogue of the same loop."""
    shape = (1, 8, 2, 100, 150)  # group 4
    q, k, v, descales = problem(sum(shape), *shape)
    result = emulate_fp8_attention(
        fp8_spec(epilogue="tma", causal=True, **loop), q, k, v, **descales
    )
    ref, _, a, b = reference(q, k, v, descales, True, SCALE)
    assert bound_ratio(result.out, ref, a, b) <= 1.0
    direct = emulate_fp8_attention(fp8_spec(causal=True, **loop), q, k, v, **descales)
    np.testing.assert_array_equal(result.out, direct.out)


def test_fp8_tma_store_shared_memory_is_one_extra_column_block():
    direct = fp8_spec()
    assert (TMA.out_column_blocks, TMA.q_region_blocks) == (2, 2)
    assert TMA.smem_bytes - direct.smem_bytes == TMA.block_m * 128  # 16 KiB


def test_fp8_tma_store_through_attention_in_bshd():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v, descales = problem(5, 1, 4, 2, 70, 150)
    as_bshd = lambda x: x.view(ml_dtypes.float8_e4m3fn).transpose(0, 2, 1, 3)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPUBackendWarning)
        out = kernelgen.attention(
            *(as_bshd(x) for x in (q, k, v)), layout="bshd", spec=TMA, **descales
        )
    ref, _, a, b = reference(q, k, v, descales, False, SCALE)
    assert bound_ratio(out.astype(np.float64).transpose(0, 2, 1, 3), ref, a, b) <= 1.0


# ---- mutations -------------------------------------------------------------------------------

SHAPE = (1, 2, 1, 128, 300)  # both consumers hold rows; three key tiles


def run_mutant(source: str | None = None):
    q, k, v, descales = problem(7, *SHAPE)
    result = emulate_fp8_attention(TMA, q, k, v, source=source, **descales)
    ref, _, a, b = reference(q, k, v, descales, False, SCALE)
    return bound_ratio(result.out, ref, a, b)


def test_fp8_tma_store_without_the_v_descale_breaks_the_bound():
    original = "inv_l[half] = inverse_sum(row_l) * out_factor;"
    source = render(TMA)
    assert source.count(original) == 1
    assert run_mutant(source) <= 1.0
    assert run_mutant(source.replace(original, "inv_l[half] = inverse_sum(row_l);")) > 1.0


def test_fp8_tma_store_in_the_other_consumers_q_rows_is_a_hazard():
    """Mutation: column block 1 staged 64 rows further into the Q tile instead of in the extra
    block: consumer 0 writes consumer 1's rows."""
    original = "stmatrix_x4(out_rows + (col / 64) * Q_BLOCK_BYTES"
    source = render(TMA)
    assert source.count(original) == 1
    mutant = source.replace(original, "stmatrix_x4(out_rows + (col / 64) * 64 * ROW_BYTES")
    with pytest.raises(HazardError, match=STAGING_RACE):
        run_mutant(mutant)


def test_an_out_box_of_fp8_q_columns_is_refused():
    """Mutation: out_map's box as wide as fp8 Q's (128 elements: 256 bf16 bytes, past the
    128-byte swizzle span the staged rows are written in)."""

    def wide_box(spec, problem):
        layouts = tensor_map_layouts(spec, problem)
        out = layouts["out_map"]
        return {**layouts, "out_map": dataclasses.replace(out, box=(128, *out.box[1:]))}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "tensor_map_layouts", wide_box)  # the fp8 call's launch plan
        with pytest.raises(EmulatorError, match="swizzle"):
            run_mutant()


@pytest.mark.parametrize("name", EPILOGUE_MUTATIONS)
def test_mutated_fp8_epilogue_is_a_hazard(name):
    original, mutated, message = EPILOGUE_MUTATIONS[name]
    source = render(TMA)
    assert source.count(original) == 1, original
    with pytest.raises(HazardError, match=message):
        run_mutant(source.replace(original, mutated))
