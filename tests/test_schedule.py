"""The static schedule check of the wgmma loops (kernelgen.kernels.schedule), on synthetic SASS and
logs and on the shipped kernels' real SASS (compile tier): the overlap holds after ptxas, and
the check fails on the order of waits that ptxas undid; with Q in registers, Q K^T issues its
products back to back, and the check fails on K's descriptors built in the loop."""

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
    MAX_ISSUE_CYCLES_PER_PRODUCT,
    descriptor_problem,
    overlap_problem,
    overlap_windows,
    qk_issue_groups,
    schedule_problem,
    serialization_problem,
)
from kernelgen.specs.engines import SASS_BY_DTYPE
from kernelgen.specs.forward import KernelSpec, load_spec


def ins(address: int, opcode: str, operands: str = "", stall: int = 0) -> SassInstruction:
    return SassInstruction(address, opcode.split(".")[0], operands, opcode, stall)


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


# Two lines of cuobjdump's SASS as it prints them: the instruction with the lower 64 bits of its
# encoding, then the upper 64 bits (control bits: stall count at bits 41-44).
SASS_TEXT = """\
  /*4250*/  UIADD3 UR8, UR4, 0x804, URZ ;  /* 0x0000080404087890 */
                                           /* 0x000fd2000fffe03f */
  /*4260*/  HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR8], R24 ;  /* 0x00e00098181879f0 */
                                                                   /* 0x000fe20008000818 */
  /*4270*/  UMOV UR10, UR8 ;  /* 0x00000008000a7c82 */
"""


def test_sass_instructions_read_the_stall_counts_of_the_control_bits():
    """The stall count is bits 41-44 of the upper word (0x000fd2... -> 9, 0x000fe2... -> 1);
    an instruction printed without its upper word gets 0."""
    read = sass_instructions(SASS_TEXT)
    assert [(i.family, i.stall) for i in read] == [("UIADD3", 9), ("HGMMA", 1), ("UMOV", 0)]
    assert read[1].operands.endswith("R24, R152, gdesc[UR8], R24 ")


def qk_group(
    address: int, per_gap: list[int], accumulator: str = "R24", looped: bool = True
) -> list[SassInstruction]:
    """A register-A Q K^T: a first product that ignores the old S, then one product per entry
    of ``per_gap``, each after a copy of its descriptor whose stall count is that entry; the
    wait, and with ``looped`` the loop's branch back to the group."""
    product = "HGMMA.64x128x16.F32.BF16"
    out = [ins(address, product, f"{accumulator}, R152, gdesc[UR8], RZ, !UPT", 1)]
    for n, cycles in enumerate(per_gap):
        a = address + 0x20 * (n + 1)
        out += [ins(a - 0x10, "UMOV", "UR10, UR9", cycles - 1)]
        out += [ins(a, product, f"{accumulator}, R156, gdesc[UR8], {accumulator}", 1)]
    end = address + 0x20 * (len(per_gap) + 1)
    out.append(ins(end, "WARPGROUP.DEPBAR.LE", "gsb0, 0x0"))
    return [*out, ins(end + 0x10, "BRA", f"{address - 0x10:#x}")] if looped else out


def test_a_q_k_group_issued_back_to_back_passes_and_a_slow_one_fails():
    """Stall cycles from the first product to the last, over the gaps: 4 per product passes,
    anything above MAX_ISSUE_CYCLES_PER_PRODUCT fails and names the group; a P V group
    (accumulating from its first product) and an S group of one product are not checked."""
    fast = qk_group(0x1000, [4] * 7)
    slow = qk_group(0x2000, [12] * 7)
    assert qk_issue_groups(fast) == [(0x1000, 8, 28)]
    assert descriptor_problem(fast) is None
    assert qk_issue_groups(fast + slow)[1] == (0x2000, 8, 84)
    problem = descriptor_problem(fast + slow)
    assert problem is not None and "0x2000 takes 84 cycles" in problem and "8 products" in problem
    edge = qk_group(0x3000, [MAX_ISSUE_CYCLES_PER_PRODUCT] * 7)
    assert descriptor_problem(edge) is None
    assert descriptor_problem(qk_group(0x3000, [MAX_ISSUE_CYCLES_PER_PRODUCT + 1] * 7))
    pv = [ins(i.address, i.opcode, i.operands.replace("RZ, !UPT", "R88"), i.stall) for i in slow]
    assert qk_issue_groups(pv) == [] and descriptor_problem(pv) is None
    assert descriptor_problem(qk_group(0x4000, [])) is None
    # a product into another accumulator ends the group (the next tile's S, or P V's O)
    other = qk_group(0x6000, [12] * 3, "R88", looped=False)[1:]
    split = [*qk_group(0x5000, [4] * 3, looped=False), *other, ins(0x6800, "BRA", "0x4ff0")]
    assert qk_issue_groups(split) == [(0x5000, 4, 12)]
    # a group outside every loop (a pipelined loop's first tile, once per block) is left out
    assert qk_issue_groups(qk_group(0x7000, [12] * 7, looped=False)) == []


QR_SPECS = [p for p in WGMMA_SPEC_PATHS if load_spec(p).q_in_registers]
# K's descriptors not pinned: the values are still built before the loop, but the compiler may
# build them again inside it (as the template did before issue 33's fix).
UNPINNED = ("pin_value(k_desc_low[slot][kk]);", "")


@pytest.mark.compile
@pytest.mark.parametrize("path", QR_SPECS, ids=lambda p: p.stem)
def test_q_in_registers_issues_q_k_products_back_to_back(path):
    """Every Q-in-registers spec file: each Q K^T takes at most MAX_ISSUE_CYCLES_PER_PRODUCT
    stall cycles per product in SASS (K's descriptors pinned before the loop)."""
    spec = load_spec(path)
    sass, log = sass_of(spec, render(spec))
    groups = qk_issue_groups(sass_instructions(function_sass(sass, spec.uri)), product_of(spec))
    assert groups and all(n > 1 for _, n, _ in groups), groups
    assert all(c <= MAX_ISSUE_CYCLES_PER_PRODUCT * (n - 1) for _, n, c in groups), groups
    assert schedule_problem(spec, sass, log) is None


@pytest.mark.compile
def test_the_check_fails_on_descriptors_built_in_the_loop():
    """The d128 Q-in-registers kernel without the pin: ptxas builds each K descriptor between
    the products again and the check says so; Q from shared memory is not held to it."""
    spec = load_spec(ROOT / "specs" / "v2_wg_bf16_d128_m128_n128_s2_qr.yaml")
    source = render(spec)
    assert source.count(UNPINNED[0]) == 1
    sass, log = sass_of(spec, source.replace(*UNPINNED))
    problem = schedule_problem(spec, sass, log)
    assert problem is not None and "descriptors are computed between them" in problem
    plain = KernelSpec.model_construct(**{**dict(spec), "q_in_registers": False})
    assert schedule_problem(plain, sass) is None  # Q from shared memory: not checked
