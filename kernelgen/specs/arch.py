"""Facts about the GPU architectures kernelgen compiles for (one table, no scattered constants)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    """One compile target: ``name`` is the NVRTC ``-arch`` value; the per-SM figures are the
    CUDA programming guide's table of compute-capability limits (occupancy,
    kernelgen.runtime.occupancy)."""

    name: str
    compute_capability: int
    max_smem_per_block: int  # bytes, with the dynamic shared-memory opt-in
    smem_per_sm: int  # bytes of shared memory an SM can give its resident blocks
    threads_per_sm: int
    blocks_per_sm: int  # resident blocks an SM can hold at most
    registers_per_thread: int = 255
    registers_per_sm: int = 64 * 1024
    # The reference device of the arch, for the static model's shape terms
    # (kernelgen.model.perfmodel_shape); None where kernelgen has no reference device for it.
    device: Device | None = None


@dataclass(frozen=True)
class Device:
    """The whole-GPU figures of one reference device (its vendor's datasheet unless stated)."""

    name: str
    sm_count: int
    clock_hz: float  # the SM clock the model converts clocks to seconds at (max boost)
    hbm_bytes_per_s: float  # DRAM bandwidth
    l2_bytes_per_clock: float  # L2 read bandwidth of the whole GPU per SM clock


# A100 SXM4 80GB: 108 SMs, 1410 MHz boost, HBM2e 2039 GB/s (NVIDIA A100 datasheet); L2 5120
# bytes per clock (NVIDIA A100 Tensor Core GPU Architecture whitepaper, V100 2048).
A100_SXM = Device("A100 SXM4 80GB", 108, 1.410e9, 2.039e12, 5120)
# H100 SXM5 80GB: 132 SMs, 1980 MHz max boost (also nvidia-smi's clocks.max.sm in the committed
# runs), HBM3 3.35 TB/s (NVIDIA H100 datasheet). NVIDIA publishes no L2 bandwidth for Hopper: the
# A100 whitepaper's 5120 bytes per clock is assumed (docs/performance-model.md).
H100_SXM = Device("H100 SXM5 80GB", 132, 1.980e9, 3.35e12, 5120)


KIB = 1024
ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch("sm_80", 80, 163 * KIB, 164 * KIB, 2048, 32, device=A100_SXM),  # A100
        Arch("sm_86", 86, 99 * KIB, 100 * KIB, 1536, 16),  # RTX 30xx, A10, A40
        Arch("sm_89", 89, 99 * KIB, 100 * KIB, 1536, 24),  # RTX 40xx, L4, L40
        Arch("sm_90", 90, 227 * KIB, 228 * KIB, 2048, 32, device=H100_SXM),  # H100, H200
        # sm_90 with its architecture-specific instructions (wgmma, setmaxnreg): code compiled
        # for it runs on compute capability 9.0 only. After sm_90, so that a 9.0 device's
        # nearest_arch stays the portable sm_90.
        Arch("sm_90a", 90, 227 * KIB, 228 * KIB, 2048, 32, device=H100_SXM),
        Arch("sm_100", 100, 227 * KIB, 228 * KIB, 2048, 32),  # B200
        Arch("sm_120", 120, 99 * KIB, 100 * KIB, 1536, 32),  # RTX 50xx
    )
}

DEFAULT_ARCHS: tuple[str, ...] = ("sm_80", "sm_90")


def arch_for_capability(major: int, minor: int) -> str:
    """NVRTC target name for a device's compute capability, e.g. (9, 0) -> ``sm_90``."""
    return f"sm_{major}{minor}"


def nearest_arch(capability: int) -> str | None:
    """The newest architecture of :data:`ARCHS` at or below compute ``capability`` (e.g. 87 ->
    ``sm_86``), whose limits a device of that capability meets; None below all of them."""
    known = [a for a in ARCHS.values() if a.compute_capability <= capability]
    return max(known, key=lambda a: a.compute_capability).name if known else None
