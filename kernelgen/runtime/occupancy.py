"""How many blocks of a kernel an SM holds at once, and which resource stops it there.

The CUDA occupancy rules for the architectures in :data:`kernelgen.specs.arch.ARCHS`: registers are
handed to warps in granules of 256 (a thread's count rounded up to 8), each block also takes
1 KiB of shared memory the system reserves, and threads and blocks per SM have their own caps.
Used by the split-KV heuristic (how many block slots a grid has to fill) and shown by
``kernelgen check`` and ``kernelgen tune --dry-run`` beside each kernel's registers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kernelgen.kernels.compile import Resources
from kernelgen.specs.arch import ARCHS

REGISTER_GRANULE = 256  # registers a warp is given at a time
SMEM_RESERVED_PER_BLOCK = 1024  # bytes of shared memory the system keeps per resident block


class BlockShape(Protocol):
    """What the occupancy of a spec's main kernel depends on (a spec of either family)."""

    @property
    def threads(self) -> int: ...

    @property
    def smem_bytes(self) -> int: ...


@dataclass(frozen=True)
class Occupancy:
    blocks: int  # resident blocks per SM (0: the kernel cannot launch there)
    limiter: str  # "registers", "shared memory", "threads" or "blocks"


def blocks_per_sm(
    arch: str, threads: int, smem_bytes: int, registers: int | None = None
) -> Occupancy:
    """Resident blocks per SM of a ``threads``-thread block using ``smem_bytes`` of dynamic and
    static shared memory and ``registers`` per thread (None: not known, registers not counted)."""
    facts = ARCHS[arch]
    warps = -(-threads // 32)
    limits = {
        "blocks": facts.blocks_per_sm,
        "threads": facts.threads_per_sm // threads,
        "shared memory": facts.smem_per_sm // (smem_bytes + SMEM_RESERVED_PER_BLOCK),
    }
    if registers is not None:
        per_warp = -(-registers * 32 // REGISTER_GRANULE) * REGISTER_GRANULE
        limits["registers"] = facts.registers_per_sm // (per_warp * warps)
    limiter = min(limits, key=lambda name: limits[name])
    return Occupancy(limits[limiter], limiter)


def kernel_occupancy(spec: BlockShape, arch: str, res: Resources | None) -> Occupancy:
    """:func:`blocks_per_sm` of ``spec``'s main kernel (either family) on ``arch``, with its
    ptxas report ``res`` (registers, static shared memory) where there is one."""
    if res is None:
        return blocks_per_sm(arch, spec.threads, spec.smem_bytes)
    return blocks_per_sm(arch, spec.threads, spec.smem_bytes + res.static_smem_bytes, res.registers)
