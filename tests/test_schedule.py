"""The static schedule check of the wgmma loops (kernelgen.kernels.schedule), on synthetic SASS and
logs and on the shipped kernels' real SASS (compile tier): the overlap holds after ptxas, and
the check fails on the order of waits that ptxas undid."""

from __future__ import annotations

import pytest
from conftest import ROOT, WGMMA_SPEC_PATHS, require_toolchain

from kernelgen.kernels.compile import (
    SassInstruction,
    compile_offline,
    cuobjdump_path,
    disassemble,
    function_sass,
    nvrtc_available,
    sass_instructions,
)
from kernelgen.kernels.render import render
from kernelgen.kernels.schedule import (
    overlap_problem,
    overlap_windows,
    schedule_problem,
    serialization_problem,
)
from kernelgen.specs.engines import SASS_BY_DTYPE
from kernelgen.specs.forward import KernelSpec, load_spec


def ins(address: int, opcode: str, operands: str = "") -> SassInstruction:
    return SassInstruction(address, opcode.split(".")[0], operands, opcode)


def batch(start: int, ex2_between: int, ex2_after: int) -> list[SassInstruction]:
    """ARRIVE, S's group and P V's group of products, wait 1, exponentials, wait 0, more."""
    a = start
    out = [ins(a, "WARPGROUP.ARRIVE")]
    out += [ins(a + 0x10, "HGMMA.64x64x16.F32.BF16", "R88, gdesc[UR12], R88, gsb0")]
    out += [ins(a + 0x20, "HGMMA.64x128x16.F32.BF16", "R24, R132, gdesc[UR12].tnspB, R24, gsb0")]
    out += [ins(a + 0x30, "WARPGROUP.DEPBAR.LE", "gsb0, 0x1")]
    out += [ins(a + 0x40 + 0x10 * i, "MUFU.EX2", "R1, R2") for i in range(ex2_between)]
    out += [ins(a + 0x800, "WARPGROUP.DEPBAR.LE", "gsb0, 0x0")]
    out += [ins(a + 0x810 + 0x10 * i, "MUFU.EX2", "R1, R2") for i in range(ex2_after)]
    return out


def test_exponentials_between_the_waits_count_as_overlapped():
    sass = batch(0x1000, 30, 4) + batch(0x2000, 34, 0)
    windows = overlap_windows(sass)
    assert [(w.inside, w.total) for w in windows] == [(30, 34), (34, 34)]
    assert overlap_problem(sass) is None


def test_exponentials_after_the_second_wait_fail_the_check():
    sass = batch(0x1000, 30, 4) + batch(0x2000, 0, 34)
    problem = overlap_problem(sass)
    assert problem is not None and "1 of 2 pipelined windows" in problem
    assert "0 of 34 MUFU.EX2" in problem and "0x2000" in problem


def test_fp8_products_are_qgmma():
    """fp8 operands' products are QGMMA in SASS: the windows of an fp8 loop are found when the
    check is told so (as schedule_problem does for an fp8 spec), and not under HGMMA's name."""
    sass = [
        ins(i.address, i.opcode.replace("HGMMA", "QGMMA").replace("BF16", "E4M3"), i.operands)
        for i in batch(0x1000, 66, 0)
    ]
    assert [(w.inside, w.total) for w in overlap_windows(sass, "QGMMA")] == [(66, 66)]
    assert overlap_problem(sass, "QGMMA") is None
    assert overlap_windows(sass) == []


def test_a_loop_with_one_group_in_flight_has_no_window():
    serial = [
        ins(0x10, "WARPGROUP.ARRIVE"),
        ins(0x20, "HGMMA.64x64x16.F32.BF16", "R88, gdesc[UR12], R88, gsb0"),
        ins(0x30, "WARPGROUP.DEPBAR.LE", "gsb0, 0x0"),
        ins(0x40, "MUFU.EX2", "R1, R2"),
    ]
    assert overlap_windows(serial) == []
    assert "no pipelined wgmma window" in overlap_problem(serial)


def test_ptxas_serializing_the_products_is_reported():
    log = (
        "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are "
        "serialized due to insufficient register resources for the function 'k'\n"
    )
    assert serialization_problem(log) == (
        "ptxas serialized every wgmma (due to insufficient register resources)"
    )
    assert serialization_problem("ptxas info    : Used 168 registers") is None


OVERLAP_SPECS = [p for p in WGMMA_SPEC_PATHS if load_spec(p).overlap]
# The old order: the step waits for its P V (wait_group 0) right after the softmax. ptxas
# then hoists that wait above the exponentials, which is what an H100 measured (the
# overlapped loop slower than the plain one).
WAIT_AT_THE_END = (
    "      moved = weigh(s, j + 1, next_slot, alpha);\n",
    "      moved = weigh(s, j + 1, next_slot, alpha);\n      wgmma_wait<0>();\n",
)


def sass_of(spec, source: str) -> tuple[str, str]:
    require_toolchain(nvrtc_available(), "NVRTC")
    require_toolchain(cuobjdump_path() is not None, "cuobjdump + nvdisasm wheels")
    compiled = compile_offline(source, spec.uri, "sm_90a", sass=False)
    return disassemble(compiled.cubin), compiled.log


@pytest.mark.compile
@pytest.mark.parametrize("path", OVERLAP_SPECS, ids=lambda p: p.stem)
def test_the_overlap_kernels_run_the_softmax_under_the_p_v_product(path):
    """In the SASS of every overlap spec each pipelined window issues all its exponentials
    between wait_group 1 and wait_group 0 (the wait for P V opens the next step)."""
    spec = load_spec(path)
    sass, log = sass_of(spec, render(spec))
    windows = overlap_windows(sass_instructions(function_sass(sass, spec.uri)), product_of(spec))
    assert windows, "the overlapped loop has pipelined windows in SASS"
    assert all(w.inside == w.total > 0 for w in windows), windows
    assert schedule_problem(spec, sass, log) is None


def product_of(spec: KernelSpec) -> str:
    """The SASS opcode of a wgmma spec's products: HGMMA, or QGMMA for fp8 operands."""
    return SASS_BY_DTYPE.get(spec.dtype, {}).get("HGMMA", "HGMMA")


@pytest.mark.compile
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3"])
def test_the_check_fails_on_the_old_order_of_the_waits(dtype):
    """The same kernel with the wait for P V closing the step (the loop as it shipped before):
    ptxas moves that wait above the softmax and the check says so (16-bit and fp8 products)."""
    spec = next(s for s in map(load_spec, OVERLAP_SPECS) if s.head_dim == 128 and s.dtype == dtype)
    source = render(spec)
    assert source.count(WAIT_AT_THE_END[0]) == 1
    sass, log = sass_of(spec, source.replace(*WAIT_AT_THE_END))
    windows = overlap_windows(sass_instructions(function_sass(sass, spec.uri)), product_of(spec))
    assert windows and all(w.inside == 0 and w.total > 0 for w in windows), windows
    problem = schedule_problem(spec, sass, log)
    assert problem is not None and "does not overlap the P V product" in problem
    plain = load_spec(ROOT / "specs" / "v2_wg_bf16_d128_m128_n128_s2.yaml")
    assert schedule_problem(plain, sass) is None  # no overlap promised: no window check


@pytest.mark.compile
def test_serialized_products_fail_the_check():
    """Q in registers with the overlap at 128 keys and head dim 128 (192 registers of
    accumulators and operands, which the spec refuses): ptxas serializes every wgmma."""
    base = load_spec(ROOT / "specs" / "v2_wg_bf16_d128_m128_n128_s2.yaml")
    spec = KernelSpec.model_construct(**{**dict(base), "overlap": True, "q_in_registers": True})
    sass, log = sass_of(spec, render(spec))
    assert "ptxas serialized every wgmma" in (schedule_problem(spec, sass, log) or "")
