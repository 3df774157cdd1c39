"""Facts about the GPU architectures kernelgen compiles for (one table, no scattered constants)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    """One compile target: ``name`` is the NVRTC ``-arch`` value."""

    name: str
    compute_capability: int
    max_smem_per_block: int  # bytes, with the dynamic shared-memory opt-in
    registers_per_thread: int = 255


ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch("sm_80", 80, 163 * 1024),  # A100
        Arch("sm_86", 86, 99 * 1024),  # RTX 30xx, A10, A40
        Arch("sm_89", 89, 99 * 1024),  # RTX 40xx, L4, L40
        Arch("sm_90", 90, 227 * 1024),  # H100, H200
        Arch("sm_100", 100, 227 * 1024),  # B200
        Arch("sm_120", 120, 99 * 1024),  # RTX 50xx
    )
}

DEFAULT_ARCHS: tuple[str, ...] = ("sm_80", "sm_90")


def arch_for_capability(major: int, minor: int) -> str:
    """NVRTC target name for a device's compute capability, e.g. (9, 0) -> ``sm_90``."""
    return f"sm_{major}{minor}"
