"""Static performance model of the tensor-core kernels: what one unit of work costs, from SASS.

No GPU is needed: the kernel is compiled offline, its steady-state key-tile loop is found in the
SASS, and its instructions are counted per *unit* of work, 64 queries x 64 keys (at head dim 128:
512 m16n8k16 MMAs, the figure FlashAttention 2's kernels are compared by). Four per-SM resources
bound how fast a unit can go; the largest of the four times is the predicted cost, and its
inverse the predicted ceiling. The model ranks kernels and explains them: it predicts *ratios*
between kernels on one architecture, not absolute times, and it assumes the loop is the whole
cost (long sequences), enough resident warps to overlap the four resources, and no stalls on
global memory. docs/performance-model.md states the assumptions and the constants.

The steady-state loop is the one an *interior* key tile takes (no key hidden: no bounds, causal
or mask test; all but the last few tiles of a long row). The kernels decide that per tile, so
the model compiles a variant whose tests are fixed to "interior" (:func:`interior_source`) and
counts the loop that issues the HMMAs, on the path where no row moves its softmax reference
(the block a move adds is reported beside it). It is meant for the prefill kernels: the 1-2 warp
decode tiles copy K/V in inner loops, whose repeats a count of the loop body does not see.

The backward family's tensor-core kernel (:func:`model_backward_spec`) is modelled the same way:
its steady state is the query-tile loop of the main kernel (one iteration: block_m queries x
block_n keys of the whole block), counted in an interior variant (no score tests, full copies,
every row of the tile in range) and scaled to the same 64 x 64 unit; its shared-memory traffic is
counted by each instruction's width (ldmatrix matrices, cp.async, STS and LDS), and its dQ
atomics (RED) are counted beside the classes above.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Protocol

from kernelgen.errors import SettingError
from kernelgen.families.backward import render as render_backward
from kernelgen.kernels.compile import (
    Resources,
    SassInstruction,
    backward_target,
    branch_target,
    compile_offline,
    disassemble,
    function_sass,
    sass_instructions,
    sass_loops,
)
from kernelgen.kernels.render import WGMMA_OPERAND, render
from kernelgen.kernels.schedule import schedule_problem
from kernelgen.runtime.occupancy import kernel_occupancy
from kernelgen.specs.backward import BackwardSpec
from kernelgen.specs.forward import KernelSpec

UNIT_QUERIES = UNIT_KEYS = 64
WARP_MEMORY_BYTES = 512  # bytes one warp-wide LDSM.x4 or LDGSTS.128 moves through shared memory

# What makes a key tile take the interior path in the tensor-core template, and what the
# interior variant writes instead: no key hidden and no mask (scores stay raw), and a full K/V
# tile to copy (no bounds test). interior_source() checks each appears exactly once.
# the exact-path test of fwd_tc_schedule.cuh.j2's score_paths, which both engines render
_EXACT_TEST = {
    "mask_mod_tile || tile >= first_exact || (WINDOW && tile < interior_begin) || "
    "has_mask;": "false;"
}
INTERIOR = {
    "mma_sync": {**_EXACT_TEST, "if (key0 + BLOCK_N <= num_keys) {": "if (true) {"},
    # TMA copies have no bounds test (the copy engine zero-fills); only the scores' path differs
    "wgmma": _EXACT_TEST,
}
# Instruction classes shown per unit: the tensor and memory instructions, the softmax's float
# work, and the rest (integer, address, control).
CLASSES = (
    "HMMA",
    "HGMMA",
    "LDSM",
    "LDGSTS",
    "UTMALDG",
    "FFMA",
    "FADD",
    "FMUL",
    "FMNMX",
    "MUFU",
    "SHFL",
    "BAR",
    "SYNCS",
)
TENSOR_FAMILIES = ("HMMA", "HGMMA")
# SASS families counted as another: fp8 wgmma is QGMMA in the SASS, one wgmma product like HGMMA.
_TENSOR_ALIASES = {"QGMMA": "HGMMA"}
# wgmma multiply-adds per clock of an operand type over those of 16-bit ones (H100: fp8's dense
# peak is twice bf16's); the model counts fp8 products in 16-bit-equivalent multiply-adds.
WGMMA_RATE = {"float16": 1, "bfloat16": 1, "float8_e4m3": 2}
# The backward adds its atomics (RED: fp32 adds to the dq accumulator; REDG on sm_90) and its
# shared-memory stores and loads (the P^T and dS^T tiles, the rows' statistics).
BACKWARD_CLASSES = (*CLASSES, "RED", "ATOM", "STS", "LDS")
_FAMILY_ALIASES = {"REDG": "RED", "ATOMG": "ATOM", "ATOMS": "ATOM"}
# What makes a query tile take the interior path in the backward template (fa_bwd_tc.cu.j2):
# no score test, full Q/dO copies, every row of the tile inside seqlen_q (atomics unpredicated).
BACKWARD_INTERIOR = {
    "has_mask || mask_mod_tile || scale <= 0.f || !tile_is_interior<BLOCK_M, BLOCK_N>(m0, k0, "
    "seqlen_q, seqlen_k, va);": "false;",
    "if (row0 + ROWS <= seq_len) {": "if (true) {",
    "const bool full_tile = m0 + BLOCK_M <= seqlen_q;": "const bool full_tile = true;",
}
MMA_SYNC_MACS = 16 * 8 * 16  # multiply-adds of one m16n8k16
_HGMMA_SHAPE = re.compile(r"[HQ]GMMA\.(\d+)x(\d+)x(\d+)")


@dataclass(frozen=True)
class MachineRates:
    """Per-SM, per-clock throughputs of one architecture (warp instructions unless stated)."""

    issue: float  # instructions issued (one scheduler per SM sub-partition)
    smem_bytes: float  # shared-memory bytes (LDSM reads, LDGSTS writes)
    hmma: float  # m16n8k16 mma.sync instructions
    mufu: float  # MUFU (exp2) instructions: 16 lanes per clock per SM
    wgmma_macs: float = 0.0  # fp16/bf16 multiply-adds of wgmma (0: the arch has none)


# A100: 4 schedulers, 128 B/clk shared memory, 1024 dense fp16 FMA/clk (0.5 m16n8k16 per clock),
# 16 MUFU lanes/clk. H100: the same issue, shared-memory and MUFU rates; mma.sync reaches about
# two thirds of the wgmma peak (2048 FMA/clk), so 2/3 m16n8k16 per clock.
RATES: dict[str, MachineRates] = {
    "sm_80": MachineRates(issue=4, smem_bytes=128, hmma=0.5, mufu=0.5),
    "sm_90": MachineRates(issue=4, smem_bytes=128, hmma=2 / 3, mufu=0.5),
    # sm_90a: the same SM; wgmma reaches the dense peak, 2048 fp16/bf16 multiply-adds per clock.
    "sm_90a": MachineRates(issue=4, smem_bytes=128, hmma=2 / 3, mufu=0.5, wgmma_macs=2048),
}


@dataclass(frozen=True)
class UnitFigures:
    """Per unit of work (64 queries x 64 keys): warp instructions by class, their total, and the
    shared-memory bytes that LDSM and LDGSTS move."""

    instructions: float
    by_class: dict[str, float]
    smem_bytes: float
    rescale: float = 0.0  # instructions a row's moving reference adds (per unit)
    # multiply-adds the unit's HGMMA (and fp8 QGMMA) do, in 16-bit-equivalents (WGMMA_RATE)
    wgmma_macs: float = 0.0
    # (LDSM + LDGSTS) x 512 B, the forward's measure of the traffic (the backward's smem_bytes
    # counts every shared-memory instruction by its width; 0: not counted separately)
    ldsm_ldgsts_bytes: float = 0.0

    def count(self, name: str) -> float:
        return self.by_class.get(name, 0.0)


# FlashAttention 2, hdim 128 bf16 forward (128 x 64 tile, 4 warps, 32 query rows per warp), its
# steady-state loop measured the same way from its SASS: 1866 instructions, 160 LDSM.x4 and 32
# LDGSTS.128 (96 KiB), 512 HMMA and 136 MUFU per unit.
FA2_D128 = UnitFigures(
    instructions=1866,
    by_class={"HMMA": 512, "LDSM": 160, "LDGSTS": 32, "MUFU": 136},
    smem_bytes=96 * 1024,
)
# FlashAttention 2's backward at head dim 128, bf16 (64 x 128 tiles, 8 warps), its main loop
# measured the same way on sm_80: 3540 instructions and 320 KiB of shared memory per unit, the
# five products' 1280 HMMA.
FA2_BWD_D128 = UnitFigures(instructions=3540, by_class={"HMMA": 1280}, smem_bytes=320 * 1024)


@dataclass(frozen=True)
class Prediction:
    """Clocks one SM needs per unit under each resource, the binding one, and the ceiling as a
    fraction of the peak of the tensor instructions the kernel uses (mma.sync or wgmma; 1.0: the
    tensor cores never wait)."""

    clocks: dict[str, float]
    limiter: str
    fraction_of_peak: float

    @property
    def cost(self) -> float:
        return self.clocks[self.limiter]


def rates_of(arch: str) -> MachineRates:
    """:data:`RATES` of ``arch``; a SettingError naming the modelled archs otherwise."""
    if arch not in RATES:
        raise SettingError(f"arch={arch!r}: the performance model knows {', '.join(RATES)}")
    return RATES[arch]


def predict(figures: UnitFigures, arch: str) -> Prediction:
    """The four per-SM bounds of ``figures`` on ``arch`` (:data:`RATES`)."""
    rates = rates_of(arch)
    if figures.wgmma_macs and not rates.wgmma_macs:
        raise SettingError(f"arch={arch!r} has no wgmma; model wgmma specs on sm_90a")
    wgmma = figures.wgmma_macs / rates.wgmma_macs if figures.wgmma_macs else 0.0
    clocks = {
        "issue": figures.instructions / rates.issue,
        "shared memory": figures.smem_bytes / rates.smem_bytes,
        "tensor": figures.count("HMMA") / rates.hmma + wgmma,
        "MUFU": figures.count("MUFU") / rates.mufu,
    }
    limiter = max(clocks, key=lambda name: clocks[name])
    return Prediction(clocks, limiter, clocks["tensor"] / clocks[limiter])


@dataclass(frozen=True)
class LoopBody:
    """Opcode families of one loop body, ``@!PT`` padding excluded: ``counts`` on the path of a
    tile where no row moves its reference m, ``rescale`` the instructions of the blocks that a
    warp vote (VOTE.ANY, then a forward branch) skips there."""

    counts: dict[str, int]
    rescale: int = 0
    inner_loops: int = 0  # backward branches inside the body: their repeats are not counted
    hgmma: tuple[tuple[int, int, int, bool], ...] = ()  # (m, n, k, A from smem) per HGMMA
    opcodes: dict[str, int] = field(default_factory=dict)  # whole opcodes (e.g. STS.128)

    @property
    def issued(self) -> int:
        return sum(self.counts.values())

    @property
    def per_hmma(self) -> float:
        return self.issued / self.counts.get("HMMA", 0)

    def hgmma_smem_bytes(self, elem_bytes: int) -> float:
        """Shared-memory bytes the body's HGMMA read, per warp: a warpgroup reads A (m x k,
        unless in registers) and B (k x n) once per instruction, which each of its 4 warps
        issues."""
        total = sum((m * k if a_smem else 0) + k * n for m, n, k, a_smem in self.hgmma)
        return total * elem_bytes / 4

    @property
    def hgmma_macs(self) -> float:
        """Multiply-adds of the body's HGMMA, per warp (a quarter of the warpgroup's)."""
        return sum(m * n * k for m, n, k, _ in self.hgmma) / 4


def hmma_loop(sass: str, family: str | tuple[str, ...] = TENSOR_FAMILIES) -> LoopBody:
    """The largest loop (backward branch, no EXIT inside) whose body holds ``family``
    instructions (by default the tensor instructions, HMMA or HGMMA; "UTMALDG" finds a TMA
    producer's loop)."""
    families = (family,) if isinstance(family, str) else family
    best: LoopBody | None = None
    for body in sass_loops(sass_instructions(sass)):
        skipped = _vote_skipped(body)
        kept = [row for row in body if row.address not in skipped]
        counts = Counter(_TENSOR_ALIASES.get(row.family, row.family) for row in kept)
        # A range holding an EXIT is no loop: ptxas's out-of-line wait blocks branch back
        # into a loop from below the kernel's exits.
        real = "EXIT" not in counts
        if real and any(counts[f] for f in families) and (best is None or len(kept) > best.issued):
            inner = sum(backward_target(row) is not None for row in body[:-1])
            shapes = Counter(
                row.opcode + row.operands
                for row in kept
                if _TENSOR_ALIASES.get(row.family, row.family) == "HGMMA"
            )
            opcodes = dict(Counter(row.opcode for row in kept))
            best = LoopBody(
                dict(counts), len(skipped), inner, _hgmma_operands(shapes), opcodes=opcodes
            )
    if best is None:
        raise ValueError(f"no loop with {'/'.join(families)} instructions in the SASS")
    return best


def transposer_loop(sass: str) -> LoopBody:
    """fp8 with V transposed in the kernel (``fp8_v_layout: kernel``): one step of the producer
    warps' transpose_v_tile (a 16-key x 4-column block per thread), the smallest loop (no EXIT)
    holding byte permutes and shared-memory stores: the step of a tile whose keys are all the
    entry's (the last tile's key test is a loop of its own)."""
    best: LoopBody | None = None
    for body in sass_loops(sass_instructions(sass)):
        counts = Counter(row.family for row in body)
        if "EXIT" in counts or not (counts["PRMT"] and counts["STS"]):
            continue
        if best is None or len(body) < best.issued:
            best = LoopBody(dict(counts), opcodes=dict(Counter(row.opcode for row in body)))
    if best is None:
        raise ValueError("no loop with PRMT and STS instructions (the V transpose) in the SASS")
    return best


def transposer_steps(spec: KernelSpec) -> float:
    """Warp steps of transpose_v_tile per key tile: one per 32 blocks of 16 keys x 4 columns."""
    return spec.head_dim // 4 * (spec.block_n // 16) / 32


def _hgmma_operands(instructions: Counter[str]) -> tuple[tuple[int, int, int, bool], ...]:
    """(m, n, k, A from shared memory) of each HGMMA of a loop body (its text: opcode and
    operands); A comes from registers when the operand after D is a register."""
    found = []
    for text, count in instructions.items():
        m, n, k = (int(x) for x in _HGMMA_SHAPE.search(text).groups())  # type: ignore[union-attr]
        operands = [o.strip() for o in text.split(" ", 1)[1].split(",")]
        a_in_smem = not re.fullmatch(r"R\d+", operands[1])
        found += [(m, n, k, a_in_smem)] * count
    return tuple(found)


RESCALE_MIN_FMUL = 8  # a forward-skipped block of at least this many FMUL ...
RESCALE_FMUL_SHARE = 0.9  # ... that make up this share of it is a rescale of the output


def _vote_skipped(body: list[SassInstruction]) -> set[int]:
    """Addresses of the rescale blocks a warp jumps over when none of its rows moved (the
    branch on a VOTE.ANY): blocks that a forward branch skips and that are nearly all FMUL
    (o *= alpha). Found by content, not from the vote: a pipelined loop votes in one tile and
    rescales in the next, its vote's result carried across the loop's back edge in a register."""
    skipped: set[int] = set()
    for row in body:
        end = branch_target(row)
        if end is None or end <= row.address:
            continue
        block = [r for r in body if row.address < r.address < end]
        fmul = sum(r.family == "FMUL" for r in block)
        if fmul >= RESCALE_MIN_FMUL and fmul >= RESCALE_FMUL_SHARE * len(block):
            skipped |= {r.address for r in block}
    return skipped


def interior_source(source: str, mma: str = "mma_sync") -> str:
    """The rendered kernel with every key tile taking the interior (no-test) path."""
    for test, interior in INTERIOR[mma].items():
        if source.count(test) != 1:
            raise ValueError(f"the {mma} template no longer contains {test!r} once")
        source = source.replace(test, interior)
    return source


def unit_figures(
    body: LoopBody,
    spec: KernelSpec,
    producer: LoopBody | None = None,
    transposer: LoopBody | None = None,
) -> UnitFigures:
    """Per-unit figures of one warp's loop body: a warp's iteration covers rows_per_warp
    queries x block_n keys, so a unit takes 4096 / (rows_per_warp * block_n) of them.

    wgmma: a consumer iteration covers as many key tiles as its HGMMA say (two when the loop
    is unrolled for the overlap); ``producer`` is the TMA producer's loop, one thread's
    iteration per key tile of the block (block_m x block_n), added to the consumers';
    shared-memory traffic is what the HGMMA read (:meth:`LoopBody.hgmma_smem_bytes`) plus what
    the TMA copies write (the K and V tiles, whole 128-byte column blocks, once per block).
    ``transposer``: fp8's in-kernel V transpose step (:func:`transposer_loop`), run
    :func:`transposer_steps` times per key tile; its instructions and the bytes its LDS and STS
    move are added (bytes, not bank wavefronts: docs/hopper.md counts its conflicts)."""
    per_unit = UNIT_QUERIES * UNIT_KEYS / (spec.rows_per_warp * spec.block_n)
    per_unit_block = UNIT_QUERIES * UNIT_KEYS / (spec.block_m * spec.block_n)
    if spec.engine.warp_specialized:  # an overlapped loop is unrolled: one iteration, two tiles
        k = WGMMA_OPERAND[spec.dtype].k  # a tile's products: k-steps of Q K^T and of P V
        per_unit /= len(body.hgmma) / ((spec.head_dim_padded + spec.block_n) // k)
    by_class = {name: body.counts.get(name, 0) * per_unit for name in CLASSES}
    issued = body.issued * per_unit
    if producer is not None:
        for name in CLASSES:
            by_class[name] += producer.counts.get(name, 0) * per_unit_block
        issued += producer.issued * per_unit_block
    transposed = 0.0
    if transposer is not None:
        steps = transposer_steps(spec) * per_unit_block
        for name in CLASSES:
            by_class[name] += transposer.counts.get(name, 0) * steps
        issued += transposer.issued * steps
        transposed = sum(shared_bytes(op) * n for op, n in transposer.opcodes.items()) * steps
    by_class["other"] = issued - sum(by_class.values())
    memory = (by_class["LDSM"] + by_class["LDGSTS"]) * WARP_MEMORY_BYTES + transposed
    memory += body.hgmma_smem_bytes(spec.elem_bytes) * per_unit
    if spec.engine.warp_specialized:
        memory += tma_tile_bytes(spec) * per_unit_block
    macs = body.hgmma_macs * per_unit / WGMMA_RATE.get(spec.dtype, 1)
    return UnitFigures(issued, by_class, memory, body.rescale * per_unit, macs)


def tma_tile_bytes(spec: KernelSpec) -> int:
    """Bytes a wgmma block's TMA copies write per key tile: the K and V tiles, each block_n
    rows of whole swizzled column blocks (fp8's V^T: head-dim rows of block_n keys)."""
    if spec.v_transposed_in_kernel:  # V lands K-shaped in the staging ring
        return 2 * spec.k_tile_bytes
    return spec.k_tile_bytes + spec.v_tile_bytes


class ShapeTerms(Protocol):
    """What a report shows of a shape's terms (kernelgen.model.perfmodel_shape.ShapeEstimate)."""

    def summary(self) -> str: ...


@dataclass(frozen=True)
class ModelReport:
    """The model of one tensor-core spec on one arch: resources, per-unit figures, prediction,
    and the predicted ceiling over FlashAttention 2's (head dim 128 only, where FA2's figures
    were measured; None elsewhere)."""

    uri: str
    arch: str
    registers: int
    spill_bytes: int
    stack_bytes: int
    blocks_per_sm: int
    unit: UnitFigures
    prediction: Prediction
    vs_fa2: float | None = field(default=None)
    # What is wrong with the loop's schedule (kernelgen.kernels.schedule: wgmma specs; serialized
    # products, an overlap that ptxas undid),
    # None when nothing is (or nothing was promised).
    schedule: str | None = field(default=None)
    backward: bool = False  # a backward spec: vs_fa2 is against FlashAttention 2's backward
    # One call's predicted time with the grid fill, latency and memory terms, when the model was
    # given a problem shape (kernelgen.model.perfmodel_shape.model_with_shape).
    shape: ShapeTerms | None = None

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["prediction"]["limiter"] = self.prediction.limiter
        return out

    def summary(self) -> str:
        """One line for ``kernelgen check``."""
        u, p = self.unit, self.prediction
        fa2 = "FA2's backward ceiling" if self.backward else "FA2's ceiling"
        versus = "" if self.vs_fa2 is None else f", {self.vs_fa2:.2f}x {fa2}"
        tensor = "HGMMA" if u.count("HGMMA") else "HMMA"
        peak = "wgmma" if tensor == "HGMMA" else "mma.sync"
        extra = ""
        if self.backward:
            extra = (
                f", {u.count('LDSM'):.0f} LDSM, {u.count('RED') + u.count('ATOM'):.0f} atomics "
                f"(LDSM + LDGSTS: {u.ldsm_ldgsts_bytes / 1024:.0f} KiB)"
            )
        return (
            f"model per 64x64 unit: {u.instructions:.0f} instructions, "
            f"{u.smem_bytes / 1024:.0f} KiB shared memory, {u.count(tensor):.0f} {tensor}, "
            f"{u.count('MUFU'):.0f} MUFU{extra}; bound by {p.limiter} ({p.cost:.0f} clk); "
            f"{p.fraction_of_peak:.2f} of the {peak} peak{versus}"
        )


def analytic_figures(spec: KernelSpec) -> UnitFigures:
    """The per-unit figures that follow from the tiling alone (no compile): HMMA, LDSM, LDGSTS,
    MUFU and shared-memory bytes; ``instructions`` counts only those (the rest needs the SASS).
    A warp's key tile reads Q (rows_per_warp / 16 x k-steps LDSM.x4, Q is re-read every tile), K
    and V (block_n / 16 x k-steps each) and issues 2 x m-tiles x n8-tiles x k-steps HMMA; the
    block copies the K and V tiles once (16-byte LDGSTS); one exp2 per score (and with softcap
    one tanh per score) and one per row and tile for the rescale factor."""
    if spec.engine.warp_specialized:
        return _wgmma_analytic_figures(spec)
    rows, keys = spec.rows_per_warp, spec.block_n
    k_steps = spec.head_dim_padded // 16
    per_unit = UNIT_QUERIES * UNIT_KEYS / (rows * keys)
    ldsm = (rows // 16 + 2 * keys // 16) * k_steps * per_unit
    hmma = 2 * (rows // 16) * (keys // 8) * k_steps * per_unit
    copy_bytes = 2 * keys * spec.head_dim_padded * spec.elem_bytes  # K and V tile, per block
    ldgsts = copy_bytes / WARP_MEMORY_BYTES * UNIT_QUERIES * UNIT_KEYS / (spec.block_m * keys)
    per_score = 2 if spec.softcap else 1  # exp2, and the cap's tanh
    mufu = (per_score * rows * keys / 32 + 2 * rows // 16) * per_unit
    by_class = {"HMMA": hmma, "LDSM": ldsm, "LDGSTS": ldgsts, "MUFU": mufu}
    memory = (ldsm + ldgsts) * WARP_MEMORY_BYTES
    return UnitFigures(sum(by_class.values()), by_class, memory)


def _wgmma_analytic_figures(spec: KernelSpec) -> UnitFigures:
    """analytic_figures of a wgmma spec. A consumer warp's key tile issues head_dim / k HGMMA
    for S (m64 x block_n x k, k = 16, or 32 for fp8; both operands in shared memory) and
    block_n / k for O (A, the probabilities, in registers); per warpgroup and tile they read Q
    (64 rows; not with ``q_in_registers``, whose one read per block the steady state does not
    see) and the K and V tiles once. The TMA copies write the K and V tiles once per block
    (``fp8_v_layout: kernel``: V K-shaped, and the producer reads it and writes V^T). MUFU as
    for mma.sync."""
    keys, dim, k = spec.block_n, spec.head_dim_padded, WGMMA_OPERAND[spec.dtype].k
    per_unit = UNIT_QUERIES * UNIT_KEYS / (spec.rows_per_warp * keys)
    per_warpgroup_tile = UNIT_QUERIES * UNIT_KEYS / (64 * keys)
    hgmma = (dim // k + keys // k) * per_unit
    q_rows = 0 if spec.q_in_registers else 64
    reads = (q_rows + 2 * keys) * dim * spec.elem_bytes * per_warpgroup_tile
    writes = tma_tile_bytes(spec) * UNIT_QUERIES * UNIT_KEYS / (spec.block_m * keys)
    if spec.v_transposed_in_kernel:  # the producer reads the staged V and writes V^T
        writes += 2 * spec.head_dim * keys * UNIT_QUERIES * UNIT_KEYS / (spec.block_m * keys)
    per_score = 2 if spec.softcap else 1  # exp2, and the cap's tanh
    mufu = (per_score * spec.rows_per_warp * keys / 32 + 2) * per_unit
    by_class = {"HGMMA": hgmma, "LDSM": 0.0, "LDGSTS": 0.0, "MUFU": mufu}
    macs = 2 * UNIT_QUERIES * UNIT_KEYS * dim / WGMMA_RATE.get(spec.dtype, 1)
    return UnitFigures(sum(by_class.values()), by_class, reads + writes, wgmma_macs=macs)


def analytic_cost(spec: KernelSpec, arch: str) -> float:
    """Predicted clocks per unit from :func:`analytic_figures`, issue left out: what the
    autotuner orders candidates by where no SASS is at hand (a GPU host at run time)."""
    if spec.engine.arch_target is not None:  # what a 9.0 device runs it as
        arch = spec.engine.arch_target
    prediction = predict(analytic_figures(spec), arch if arch in RATES else "sm_80")
    return max(v for k, v in prediction.clocks.items() if k != "issue")


def interior_compile(spec: KernelSpec, arch: str) -> tuple[str, str]:
    """SASS and ptxas log of ``spec``'s interior variant compiled for ``arch``. Needs the NVRTC
    and cuobjdump/nvdisasm wheels (``pip install 'kernelgen[nvrtc]'``)."""
    source = interior_source(render(spec), spec.mma)
    compiled = compile_offline(source, spec.uri, arch, sass=False)
    sass = disassemble(compiled.cubin)
    if sass is None:
        raise SettingError("cuobjdump/nvdisasm are not installed (pip install 'kernelgen[nvrtc]')")
    # The main kernel alone: a split-KV cubin also holds the combine kernel, whose addresses
    # start at 0 again and would mix into the loop's address ranges. Its "Function :" header
    # stays, so that readers that select the function (kernelgen.kernels.schedule) find it again.
    main = function_sass(sass, spec.uri)
    return (f"\tFunction : {main}" if main else sass), compiled.log


def interior_sass(spec: KernelSpec, arch: str) -> str:
    """SASS of ``spec``'s interior variant compiled for ``arch`` (:func:`interior_compile`)."""
    return interior_compile(spec, arch)[0]


def interior_loop(spec: KernelSpec, arch: str) -> LoopBody:
    """The steady-state key-tile loop of ``spec``'s interior variant compiled for ``arch``."""
    return hmma_loop(interior_sass(spec, arch))


def interior_loops(spec: KernelSpec, arch: str) -> tuple[LoopBody, LoopBody | None]:
    """The consumers' key-tile loop and, for wgmma specs, the TMA producer's (else None)."""
    return loops_of(spec, interior_sass(spec, arch))


def loops_of(spec: KernelSpec, sass: str) -> tuple[LoopBody, LoopBody | None]:
    producer = hmma_loop(sass, "UTMALDG") if spec.engine.warp_specialized else None
    return hmma_loop(sass), producer


def model_spec(
    spec: KernelSpec | BackwardSpec, arch: str, resources: Resources | None = None
) -> ModelReport:
    """Model ``spec``'s key-tile loop on ``arch``; ``resources`` is the real kernel's ptxas report
    where the caller has it (else it is compiled for it). Backward specs:
    :func:`model_backward_spec`; one call's time for a problem shape:
    :func:`kernelgen.model.perfmodel_shape.model_with_shape`."""
    if isinstance(spec, BackwardSpec):
        return model_backward_spec(spec, arch, resources)
    if not spec.engine.modelled:
        raise SettingError(f"{spec.uri}: the performance model covers tensor-core specs only")
    rates_of(arch)  # an arch the model knows, before compiling anything
    sass, log = interior_compile(spec, arch)
    consumer, producer = loops_of(spec, sass)
    transposer = transposer_loop(sass) if spec.v_transposed_in_kernel else None
    figures = unit_figures(consumer, spec, producer, transposer)
    res = resources or compile_offline(render(spec), spec.uri, arch, sass=False).resources
    prediction = predict(figures, arch)
    vs_fa2 = None
    if spec.head_dim == 128:
        vs_fa2 = predict(FA2_D128, arch).cost / prediction.cost
    return ModelReport(
        uri=spec.uri,
        arch=arch,
        registers=res.registers,
        spill_bytes=res.spill_store_bytes + res.spill_load_bytes,
        stack_bytes=res.stack_bytes,
        blocks_per_sm=kernel_occupancy(spec, arch, res).blocks,
        unit=figures,
        prediction=prediction,
        vs_fa2=vs_fa2,
        schedule=schedule_problem(spec, sass, log),
    )


# ---- the backward family ----------------------------------------------------------------------
_LDSM_MATRICES = {"1": 1, "2": 2, "4": 4}
_WIDTH_BITS = {"64": 64, "128": 128, "U8": 8, "S8": 8, "U16": 16, "S16": 16}


def shared_bytes(opcode: str) -> int:
    """Bytes one warp instruction moves through shared memory: LDSM 128 per 8x8 matrix,
    LDGSTS/STS/LDS 32 lanes times their width (32 bits unless the opcode says otherwise); 0 for
    any other opcode."""
    family, *modifiers = opcode.split(".")
    if family == "LDSM":
        matrices = [_LDSM_MATRICES[m] for m in modifiers if m in _LDSM_MATRICES]
        return 128 * (matrices[-1] if matrices else 1)
    if family in ("LDGSTS", "STS", "LDS"):
        bits = next((_WIDTH_BITS[m] for m in modifiers if m in _WIDTH_BITS), 32)
        return 32 * bits // 8
    return 0


def backward_interior_source(source: str, deterministic: bool = False) -> str:
    """The rendered backward kernels with every query tile of the main kernel taking the
    interior path (:data:`BACKWARD_INTERIOR`; a deterministic kernel has no atomics to test)."""
    for test, interior in BACKWARD_INTERIOR.items():
        wanted = 0 if deterministic and "full_tile" in test else 1
        if source.count(test) != wanted:
            raise ValueError(f"the backward template no longer contains {test!r} once")
        source = source.replace(test, interior)
    return source


def backward_unit_figures(body: LoopBody, spec: BackwardSpec) -> UnitFigures:
    """Per-unit figures of the backward main loop: one warp's iteration is its share of a
    block_m x block_n tile, which every warp of the block runs, so a unit takes num_warps x 4096
    / (block_m x block_n) warp iterations. Shared-memory bytes by instruction width."""
    per_unit = spec.num_warps * UNIT_QUERIES * UNIT_KEYS / (spec.block_m * spec.block_n)
    by_class = dict.fromkeys(BACKWARD_CLASSES, 0.0)
    for family, count in body.counts.items():
        name = _FAMILY_ALIASES.get(family, family)
        if name in by_class:
            by_class[name] += count * per_unit
    issued = body.issued * per_unit
    by_class["other"] = issued - sum(by_class.values())
    memory = sum(shared_bytes(op) * n for op, n in body.opcodes.items()) * per_unit
    copies = (by_class["LDSM"] + by_class["LDGSTS"]) * WARP_MEMORY_BYTES
    return UnitFigures(issued, by_class, memory, ldsm_ldgsts_bytes=copies)


# split_roles kernels: the statement that gives a warp its role. Its two halves run different
# code in the loop, each warp one of them: the model counts each role's loop (the statement set to
# one role) and takes their mean, as half the warps run each.
BACKWARD_ROLE = "const bool p_role = dw == 0;"
BACKWARD_ROLES = ("const bool p_role = true;", "const bool p_role = false;")


def mean_figures(figures: list[UnitFigures]) -> UnitFigures:
    """The mean of per-unit figures (of warps that run different loops in equal numbers)."""
    n = len(figures)
    by_class = {name: sum(f.by_class[name] for f in figures) / n for name in figures[0].by_class}
    return UnitFigures(
        sum(f.instructions for f in figures) / n,
        by_class,
        sum(f.smem_bytes for f in figures) / n,
        ldsm_ldgsts_bytes=sum(f.ldsm_ldgsts_bytes for f in figures) / n,
    )


def backward_interior_loop(spec: BackwardSpec, arch: str, role: str | None = None) -> LoopBody:
    """The steady-state query-tile loop of ``spec``'s main kernel (interior variant) on
    ``arch``; for a split_roles spec, ``role`` (one of :data:`BACKWARD_ROLES`) fixes the warps'
    role."""
    source = backward_interior_source(render_backward(spec), spec.deterministic)
    if role is not None:
        if source.count(BACKWARD_ROLE) != 1:
            raise ValueError(f"the backward template no longer contains {BACKWARD_ROLE!r} once")
        source = source.replace(BACKWARD_ROLE, role)
    compiled = compile_offline(source, spec.uri, arch, sass=False)
    sass = disassemble(compiled.cubin)
    if sass is None:
        raise SettingError("cuobjdump/nvdisasm are not installed (pip install 'kernelgen[nvrtc]')")
    return hmma_loop(function_sass(sass, spec.uri))


def model_backward_spec(
    spec: BackwardSpec, arch: str, resources: Resources | None = None
) -> ModelReport:
    """Model the main loop of a tensor-core backward spec on ``arch`` (per 64 x 64 unit, against
    FlashAttention 2's backward at head dim 128)."""
    if not spec.engine.modelled:
        raise SettingError(f"{spec.uri}: the performance model covers tensor-core specs only")
    rates_of(arch)
    if spec.split_roles:  # half the warps run each role's loop
        roles = [
            backward_unit_figures(backward_interior_loop(spec, arch, role), spec)
            for role in BACKWARD_ROLES
        ]
        figures = mean_figures(roles)
    else:
        figures = backward_unit_figures(backward_interior_loop(spec, arch), spec)
    res = resources or compile_offline(render_backward(spec), spec.uri, arch, sass=False).resources
    prediction = predict(figures, arch)
    vs_fa2 = None
    if spec.head_dim == 128:
        vs_fa2 = predict(FA2_BWD_D128, arch).cost / prediction.cost
    return ModelReport(
        uri=spec.uri,
        arch=arch,
        registers=res.registers,
        spill_bytes=res.spill_store_bytes + res.spill_load_bytes,
        stack_bytes=res.stack_bytes,
        blocks_per_sm=kernel_occupancy(spec, arch, res).blocks,  # type: ignore[arg-type]
        unit=figures,
        prediction=prediction,
        vs_fa2=vs_fa2,
        backward=True,
    )
