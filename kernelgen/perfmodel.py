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
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field

from kernelgen.compile import (
    Resources,
    SassInstruction,
    compile_offline,
    disassemble,
    sass_instructions,
)
from kernelgen.errors import SettingError
from kernelgen.occupancy import kernel_occupancy
from kernelgen.render import render
from kernelgen.spec import KernelSpec

UNIT_QUERIES = UNIT_KEYS = 64
WARP_MEMORY_BYTES = 512  # bytes one warp-wide LDSM.x4 or LDGSTS.128 moves through shared memory

# What makes a key tile take the interior path in the tensor-core template, and what the
# interior variant writes instead: no key hidden and no mask (scores stay raw), and a full K/V
# tile to copy (no bounds test). interior_source() checks each appears exactly once.
INTERIOR = {
    "exact = tile >= first_exact || (WINDOW && tile < interior_begin) || mask != nullptr;": (
        "exact = false;"
    ),
    "if (key0 + BLOCK_N <= num_keys) {": "if (true) {",
}
# Instruction classes shown per unit: the tensor and memory instructions, the softmax's float
# work, and the rest (integer, address, control).
CLASSES = ("HMMA", "LDSM", "LDGSTS", "FFMA", "FADD", "FMUL", "FMNMX", "MUFU", "SHFL", "BAR")
_TARGET = re.compile(r"0x([0-9a-f]+)")


@dataclass(frozen=True)
class MachineRates:
    """Per-SM, per-clock throughputs of one architecture (warp instructions unless stated)."""

    issue: float  # instructions issued (one scheduler per SM sub-partition)
    smem_bytes: float  # shared-memory bytes (LDSM reads, LDGSTS writes)
    hmma: float  # m16n8k16 mma.sync instructions
    mufu: float  # MUFU (exp2) instructions: 16 lanes per clock per SM


# A100: 4 schedulers, 128 B/clk shared memory, 1024 dense fp16 FMA/clk (0.5 m16n8k16 per clock),
# 16 MUFU lanes/clk. H100: the same issue, shared-memory and MUFU rates; mma.sync reaches about
# two thirds of the wgmma peak (2048 FMA/clk), so 2/3 m16n8k16 per clock.
RATES: dict[str, MachineRates] = {
    "sm_80": MachineRates(issue=4, smem_bytes=128, hmma=0.5, mufu=0.5),
    "sm_90": MachineRates(issue=4, smem_bytes=128, hmma=2 / 3, mufu=0.5),
}


@dataclass(frozen=True)
class UnitFigures:
    """Per unit of work (64 queries x 64 keys): warp instructions by class, their total, and the
    shared-memory bytes that LDSM and LDGSTS move."""

    instructions: float
    by_class: dict[str, float]
    smem_bytes: float
    rescale: float = 0.0  # instructions a row's moving reference adds (per unit)

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


@dataclass(frozen=True)
class Prediction:
    """Clocks one SM needs per unit under each resource, the binding one, and the ceiling as a
    fraction of the arch's mma.sync peak (1.0: the tensor cores never wait)."""

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
    clocks = {
        "issue": figures.instructions / rates.issue,
        "shared memory": figures.smem_bytes / rates.smem_bytes,
        "tensor": figures.count("HMMA") / rates.hmma,
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

    @property
    def issued(self) -> int:
        return sum(self.counts.values())

    @property
    def per_hmma(self) -> float:
        return self.issued / self.counts.get("HMMA", 0)


def hmma_loop(sass: str) -> LoopBody:
    """The largest loop (backward branch) whose body holds HMMA instructions."""
    rows = sass_instructions(sass)
    best: LoopBody | None = None
    for end in rows:
        start = _backward_target(end)
        if start is None:
            continue
        body = [row for row in rows if start <= row.address <= end.address]
        skipped = _vote_skipped(body)
        counts = Counter(row.family for row in body if row.address not in skipped)
        if counts["HMMA"] and (best is None or sum(counts.values()) > best.issued):
            inner = sum(_backward_target(row) is not None for row in body[:-1])
            best = LoopBody(dict(counts), len(skipped), inner)
    if best is None:
        raise ValueError("no loop with HMMA instructions in the SASS")
    return best


def _branch_target(row: SassInstruction) -> int | None:
    target = _TARGET.search(row.operands) if row.family == "BRA" else None
    return None if target is None else int(target.group(1), 16)


def _backward_target(row: SassInstruction) -> int | None:
    target = _branch_target(row)
    return target if target is not None and target < row.address else None


def _vote_skipped(body: list[SassInstruction]) -> set[int]:
    """Addresses that the first forward branch after each VOTE.ANY jumps over."""
    skipped: set[int] = set()
    for i, row in enumerate(body):
        if row.family != "VOTE":
            continue
        for later in body[i:]:
            end = _branch_target(later)
            if end is not None and end > later.address:
                skipped |= {r.address for r in body if later.address < r.address < end}
                break
    return skipped


def interior_source(source: str) -> str:
    """The rendered kernel with every key tile taking the interior (no-test) path."""
    for test, interior in INTERIOR.items():
        if source.count(test) != 1:
            raise ValueError(f"the tensor-core template no longer contains {test!r} once")
        source = source.replace(test, interior)
    return source


def unit_figures(body: LoopBody, spec: KernelSpec) -> UnitFigures:
    """Per-unit figures of one warp's loop body: a warp's iteration covers rows_per_warp
    queries x block_n keys, so a unit takes 4096 / (rows_per_warp * block_n) of them."""
    per_unit = UNIT_QUERIES * UNIT_KEYS / (spec.rows_per_warp * spec.block_n)
    by_class = {name: body.counts.get(name, 0) * per_unit for name in CLASSES}
    by_class["other"] = body.issued * per_unit - sum(by_class.values())
    memory = (by_class["LDSM"] + by_class["LDGSTS"]) * WARP_MEMORY_BYTES
    return UnitFigures(body.issued * per_unit, by_class, memory, body.rescale * per_unit)


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

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["prediction"]["limiter"] = self.prediction.limiter
        return out

    def summary(self) -> str:
        """One line for ``kernelgen check``."""
        u, p = self.unit, self.prediction
        versus = "" if self.vs_fa2 is None else f", {self.vs_fa2:.2f}x FA2's ceiling"
        return (
            f"model per 64x64 unit: {u.instructions:.0f} instructions, "
            f"{u.smem_bytes / 1024:.0f} KiB shared memory, {u.count('HMMA'):.0f} HMMA, "
            f"{u.count('MUFU'):.0f} MUFU; bound by {p.limiter} ({p.cost:.0f} clk); "
            f"{p.fraction_of_peak:.2f} of the mma.sync peak{versus}"
        )


def analytic_figures(spec: KernelSpec) -> UnitFigures:
    """The per-unit figures that follow from the tiling alone (no compile): HMMA, LDSM, LDGSTS,
    MUFU and shared-memory bytes; ``instructions`` counts only those (the rest needs the SASS).
    A warp's key tile reads Q (rows_per_warp / 16 x k-steps LDSM.x4, Q is re-read every tile), K
    and V (block_n / 16 x k-steps each) and issues 2 x m-tiles x n8-tiles x k-steps HMMA; the
    block copies the K and V tiles once (16-byte LDGSTS); one exp2 per score (and with softcap
    one tanh per score) and one per row and tile for the rescale factor."""
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


def analytic_cost(spec: KernelSpec, arch: str) -> float:
    """Predicted clocks per unit from :func:`analytic_figures`, issue left out: what the
    autotuner orders candidates by where no SASS is at hand (a GPU host at run time)."""
    prediction = predict(analytic_figures(spec), arch if arch in RATES else "sm_80")
    return max(v for k, v in prediction.clocks.items() if k != "issue")


def interior_loop(spec: KernelSpec, arch: str) -> LoopBody:
    """The steady-state key-tile loop of ``spec``'s interior variant compiled for ``arch``.
    Needs the NVRTC and cuobjdump/nvdisasm wheels (``pip install 'kernelgen[nvrtc]'``)."""
    compiled = compile_offline(interior_source(render(spec)), spec.uri, arch, sass=False)
    sass = disassemble(compiled.cubin)
    if sass is None:
        raise SettingError("cuobjdump/nvdisasm are not installed (pip install 'kernelgen[nvrtc]')")
    return hmma_loop(sass)


def model_spec(spec: KernelSpec, arch: str, resources: Resources | None = None) -> ModelReport:
    """Model ``spec``'s key-tile loop on ``arch``; ``resources`` is the real kernel's ptxas report
    where the caller has it (else it is compiled for it)."""
    if spec.mma != "mma_sync":
        raise SettingError(f"{spec.uri}: the performance model covers mma_sync specs only")
    rates_of(arch)  # an arch the model knows, before compiling anything
    figures = unit_figures(interior_loop(spec, arch), spec)
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
    )
