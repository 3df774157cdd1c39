"""CPU tier: resident blocks per SM (kernelgen.runtime.occupancy) and the split-KV heuristic that
uses them, against occupancies worked out by hand from the CUDA limits of each architecture."""

from __future__ import annotations

import pytest

from kernelgen.runtime.launch import (
    Problem,
    RuntimeKernel,
    clear_kernel_cache,
    default_num_splits,
    runtime_kernel,
)
from kernelgen.runtime.occupancy import blocks_per_sm
from kernelgen.specs.forward import KernelSpec
from kernelgen.testing import fake_cupy


@pytest.mark.parametrize(
    ("arch", "threads", "smem", "registers", "blocks", "limiter"),
    [
        # 4 warps at 255 registers: 256 x 32 = 8192 a warp, 32768 a block, 2 in 65536
        ("sm_90", 128, 49152, 255, 2, "registers"),
        # the same block with its registers unknown: (228 KiB) // (48 KiB + 1 KiB) = 4
        ("sm_90", 128, 49152, None, 4, "shared memory"),
        # 168 registers round to 168 (a multiple of 8): 5376 a warp, 21504 a block -> 3
        ("sm_90", 128, 16384, 168, 3, "registers"),
        # 170 round up to 176: 5632 a warp, 22528 a block -> 2
        ("sm_90", 128, 16384, 170, 2, "registers"),
        # A100: 164 KiB a SM, so 80 KiB blocks fit 2 (81 KiB each with the reserve)
        ("sm_80", 128, 80 * 1024, 128, 2, "shared memory"),
        # RTX 4090: 100 KiB a SM -> one 80 KiB block
        ("sm_89", 128, 80 * 1024, 128, 1, "shared memory"),
        # 1-warp decode blocks: threads allow 64, registers 65536 / (64 x 32) = 32, blocks 32
        ("sm_90", 32, 0, 64, 32, "blocks"),
        # sm_86 caps threads at 1536: 6 blocks of 256
        ("sm_86", 256, 0, 32, 6, "threads"),
        # a block that cannot be resident at all
        ("sm_86", 128, 120 * 1024, 64, 0, "shared memory"),
    ],
)
def test_blocks_per_sm_by_hand(arch, threads, smem, registers, blocks, limiter):
    occupancy = blocks_per_sm(arch, threads, smem, registers)
    assert (occupancy.blocks, occupancy.limiter) == (blocks, limiter)


# 4 warps x 16 rows, 32-key tiles: 48 KiB of shared memory, 4 blocks an H100 SM by that alone
SPLIT = KernelSpec(
    loop_order="v2", mma="mma_sync", dtype="bfloat16", head_dim=128, block_m=64, block_n=32,
    num_warps=4, stages=2, smem_layout="swizzled", split_kv=True,
)  # fmt: skip


def decode_problem(batch: int = 1, heads: int = 16, seqlen_k: int = 32768) -> Problem:
    d = 128
    q = (heads * d, d, d)
    kv = (heads * seqlen_k * d, seqlen_k * d, d)
    return Problem(batch, heads, heads, 1, seqlen_k, d, q, kv, kv, q, (0, 0, 0, 0))


def test_registers_and_arch_change_the_slots_the_split_count_fills():
    """16 blocks (B=1, 16 heads, one row tile each) of 1024 key tiles: the heuristic takes the
    smallest count whose waves are >= 85 % full (about as full as any count's). With s chunks,
    16 s blocks fill 16 s / slots waves:
    - H100, registers unknown: 4 x 132 = 528 slots; s = 28 fills 0.848 of a wave, 27 only 0.818;
    - H100, 255 registers: 2 x 132 = 264 slots; s = 14 fills 0.848, 13 only 0.788;
    - A100, 255 registers: 2 x 108 = 216 slots; s = 12 fills 0.889, 11 only 0.815."""
    problem = decode_problem()
    assert blocks_per_sm("sm_90", SPLIT.threads, SPLIT.smem_bytes).blocks == 4
    assert blocks_per_sm("sm_90", SPLIT.threads, SPLIT.smem_bytes, 255).blocks == 2
    assert default_num_splits(SPLIT, problem, 132, "sm_90") == 28
    assert default_num_splits(SPLIT, problem, 132, "sm_90", registers=255) == 14
    assert default_num_splits(SPLIT, problem, 108, "sm_80", registers=255) == 12
    # 17 x 16 = 272 blocks: over 80 % of 264 register-bound slots (not split), not of 528
    wide = decode_problem(batch=17)
    assert default_num_splits(SPLIT, wide, 132, "sm_90", registers=255) == 1
    assert default_num_splits(SPLIT, wide, 132, "sm_90") > 1


def test_the_runtime_heuristic_uses_the_compiled_kernels_registers(fake_runtime, monkeypatch):
    """RuntimeKernel.default_num_splits: the device's SMs and arch, CuPy's num_regs."""
    problem = decode_problem()
    plain = runtime_kernel(SPLIT).default_num_splits(problem)
    assert plain == default_num_splits(SPLIT, problem, 132, "sm_90")  # num_regs unknown
    monkeypatch.setattr(RuntimeKernel, "_compile", fake_cupy.stub_compile(print, 255))
    clear_kernel_cache()
    heavy = runtime_kernel(SPLIT).default_num_splits(problem)
    assert heavy == default_num_splits(SPLIT, problem, 132, "sm_90", registers=255)
    assert heavy < plain
