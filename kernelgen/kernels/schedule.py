"""Static schedule check of the pipelined wgmma loop, read from SASS (not assumed from PTX).

The overlapped loop (``overlap: true``) issues tile t's S = Q K^T and tile t - 1's O += P V as
two asynchronous groups, waits for the older one only (``wgmma.wait_group 1``), computes tile
t's softmax, then waits for the rest (``wait_group 0``). The point is that the softmax's
exponentials run while the P V product is still on the tensor cores. ptxas may move the second
wait up (it did: see docs/hopper.md), which leaves the PTX looking pipelined while nothing
overlaps. In SASS the two waits are ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` and ``..., 0x0`` after a
``WARPGROUP.ARRIVE`` and the batch of ``HGMMA`` (``QGMMA`` for fp8 operands) that ends two
groups; the softmax's exponentials are ``MUFU.EX2``. The check counts the exponentials issued
between the two waits of every such window. It also reports, for every wgmma spec, when ptxas
serialized the products altogether (its log says so; the SASS then waits after every HGMMA),
and, with Q in registers, when a key loop's Q K^T issues its products slowly (the stall counts
of the control bits: K's descriptors computed between the products, :func:`descriptor_problem`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kernelgen.kernels.compile import (
    SassInstruction,
    function_sass,
    sass_instructions,
    sass_loops,
)
from kernelgen.specs.engines import SASS_BY_DTYPE
from kernelgen.specs.forward import KernelSpec

WAIT_OLDER, WAIT_ALL = "0x1", "0x0"  # wgmma.wait_group's count in DEPBAR.LE's operand
MIN_SHARE_INSIDE = 0.5  # of a window's exponentials, for it to count as overlapped


@dataclass(frozen=True)
class OverlapWindow:
    """One pipelined batch: its ARRIVE, its two waits, and the exponentials issued between the
    waits (``inside``) and in the whole batch up to the next ARRIVE (``total``)."""

    arrive: int
    wait_older: int
    wait_all: int
    inside: int
    total: int

    @property
    def overlapped(self) -> bool:
        return self.total > 0 and self.inside >= MIN_SHARE_INSIDE * self.total


def _is(instruction: SassInstruction, opcode: str) -> bool:
    return instruction.opcode.startswith(opcode)


def _wait_count(instruction: SassInstruction) -> str | None:
    """``0x1`` / ``0x0`` of a ``WARPGROUP.DEPBAR.LE gsb0, N`` (None for anything else)."""
    if not _is(instruction, "WARPGROUP.DEPBAR"):
        return None
    return instruction.operands.split(",")[-1].strip()


def overlap_windows(
    instructions: Sequence[SassInstruction], product: str = "HGMMA"
) -> list[OverlapWindow]:
    """Every batch whose products (``product``: their SASS opcode) end two groups and that
    waits for the older one first."""
    arrives = [i for i, ins in enumerate(instructions) if _is(ins, "WARPGROUP.ARRIVE")]
    windows = []
    for n, start in enumerate(arrives):
        end = arrives[n + 1] if n + 1 < len(arrives) else len(instructions)
        batch = instructions[start:end]
        groups = sum(1 for ins in batch if _is(ins, product) and "gsb0" in ins.operands)
        older = next((i for i, ins in enumerate(batch) if _wait_count(ins) == WAIT_OLDER), None)
        if groups < 2 or older is None:
            continue
        rest = batch[older + 1 :]
        done = next((i for i, ins in enumerate(rest) if _wait_count(ins) == WAIT_ALL), None)
        if done is None:
            continue
        windows.append(
            OverlapWindow(
                arrive=batch[0].address,
                wait_older=batch[older].address,
                wait_all=rest[done].address,
                inside=sum(1 for ins in rest[:done] if _is(ins, "MUFU.EX2")),
                total=sum(1 for ins in batch if _is(ins, "MUFU.EX2")),
            )
        )
    return windows


def overlap_problem(instructions: Sequence[SassInstruction], product: str = "HGMMA") -> str | None:
    """None when every pipelined window issues most of its exponentials between its two waits;
    otherwise what is wrong, in one line. ``product``: the wgmma products' SASS opcode."""
    windows = overlap_windows(instructions, product)
    if not windows:
        return "no pipelined wgmma window (two groups in flight, wait_group 1 then 0) in the SASS"
    serial = [w for w in windows if not w.overlapped]
    if not serial:
        return None
    w = serial[0]
    return (
        f"the softmax does not overlap the P V product in {len(serial)} of {len(windows)} "
        f"pipelined windows: at {w.arrive:#x}, {w.inside} of {w.total} MUFU.EX2 lie between "
        f"wait_group 1 ({w.wait_older:#x}) and wait_group 0 ({w.wait_all:#x})"
    )


# ptxas' note (C7510-C7515) when it gives up pipelining a function's products and waits for
# each wgmma right after issuing it, e.g. "... serialized due to insufficient register
# resources for the function 'f'".
SERIALIZED = "wgmma.mma_async instructions are serialized"


def serialization_problem(log: str) -> str | None:
    """What ptxas said when it serialized the wgmma products (from its log), else None."""
    for line in log.splitlines():
        if SERIALIZED in line:
            reason = line.split(SERIALIZED, 1)[1].split(" for the function")[0].strip()
            return f"ptxas serialized every wgmma ({reason})"
    return None


# The most cycles a Q K^T with Q in registers may take per product to issue (the stall counts
# of its control bits, from its first product to its last, over the gaps). Measured offline
# (NVRTC 13.2 and 13.5, sm_90a, every loop and head dim): 4.0-5.3 with K's descriptors pinned
# (6.7 in the fp8 overlap's interior variant, where ptxas puts the loop counter between two
# products), 4.6-5.1 for Q from shared memory (distinct quads filled ahead), 7.4-12 with the
# descriptors built in the loop (8.6-10.6 at d128).
MAX_ISSUE_CYCLES_PER_PRODUCT = 7


def _destination(instruction: SassInstruction) -> str:
    """The first operand (the register a product accumulates into)."""
    return instruction.operands.split(",")[0].split()[-1]


def _looped(instructions: Sequence[SassInstruction]) -> set[int]:
    """Addresses inside a loop of the SASS (a backward branch's range holding no EXIT: not
    ptxas's out-of-line wait blocks, which branch back from below the exits)."""
    inside: set[int] = set()
    for body in sass_loops(list(instructions)):
        if not any(_is(row, "EXIT") for row in body):
            inside.update(row.address for row in body)
    return inside


def qk_issue_groups(
    instructions: Sequence[SassInstruction], product: str = "HGMMA"
) -> list[tuple[int, int, int]]:
    """Every Q K^T group of the key-tile loops as (address of its first product, products,
    encoded stall cycles from its first product to its last): a run of products into one
    accumulator whose first ignores the old value (``!UPT``), up to the next wait or a product
    into another accumulator. A group before the loop (a pipelined loop's first tile, once per
    block, which ptxas interleaves with the block's set-up) is left out."""
    looped = _looped(instructions)
    groups = []
    for start, first in enumerate(instructions):
        if not (_is(first, product) and "!UPT" in first.operands) or first.address not in looped:
            continue
        accumulator, last, count = _destination(first), start, 1
        for index in range(start + 1, len(instructions)):
            ins = instructions[index]
            if _is(ins, "WARPGROUP.DEPBAR") or (
                _is(ins, product) and _destination(ins) != accumulator
            ):
                break
            if _is(ins, product):
                last, count = index, count + 1
        cycles = sum(ins.stall for ins in instructions[start:last])
        groups.append((first.address, count, cycles))
    return groups


def descriptor_problem(
    instructions: Sequence[SassInstruction], product: str = "HGMMA"
) -> str | None:
    """With Q in registers: None when every Q K^T issues its products at most
    :data:`MAX_ISSUE_CYCLES_PER_PRODUCT` cycles apart (the control bits' stall counts);
    otherwise the slowest group, in one line.

    ptxas, left to build K's descriptors inside the loop, computes each one during the issue,
    into or for the register quad the next product reads, and waits out the arithmetic's
    latency before every product (8-11 cycles per product at d128 against 4: issue 33's
    measured loss of Q in registers). Built once before the loop and pinned (``pin_value``),
    they are only copied in. Q from shared memory is not checked: its products read distinct
    quads, filled ahead of them."""
    slow = [
        (address, count, cycles)
        for address, count, cycles in qk_issue_groups(instructions, product)
        if count > 1 and cycles > MAX_ISSUE_CYCLES_PER_PRODUCT * (count - 1)
    ]
    if not slow:
        return None
    address, count, cycles = max(slow, key=lambda group: group[2] / (group[1] - 1))
    return (
        f"Q K^T at {address:#x} takes {cycles} cycles to issue its {count} products (more "
        f"than {MAX_ISSUE_CYCLES_PER_PRODUCT} per product): its descriptors are computed "
        "between them, not built before the loop"
    )


def schedule_problem(spec: KernelSpec, sass: str, log: str = "") -> str | None:
    """The schedule check of a wgmma spec on its SASS text (cuobjdump's, every function) and
    ptxas' log: no serialized products; with ``overlap: true`` the softmax between the waits;
    with ``q_in_registers`` no descriptor arithmetic between Q K^T's products. None for other
    specs or when the schedule is as designed."""
    if not spec.engine.warp_specialized:
        return None
    serialized = serialization_problem(log)
    if serialized is not None:
        return serialized
    product = SASS_BY_DTYPE.get(spec.dtype, {}).get("HGMMA", "HGMMA")  # QGMMA for fp8
    instructions = sass_instructions(function_sass(sass, spec.uri))
    if spec.q_in_registers:
        problem = descriptor_problem(instructions, product)
        if problem is not None:
            return problem
    return overlap_problem(instructions, product) if spec.overlap else None
