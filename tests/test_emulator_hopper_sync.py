"""Warpgroup-collective wgmma and named barriers in the CPU emulator.

A wgmma and its commit_group / wait_group are executed by the four warps of a warpgroup together
(``.sync.aligned``), so a pipeline stage may be freed by one elected thread per consumer warpgroup
right after ``wgmma.wait_group`` (CUTLASS's ``PipelineTmaAsync``, FlashAttention 3): the emulator
must accept that, and still catch a stage freed before the wait or a wait that only some threads
of the warpgroup execute. Operands are small integers, so results compare exactly with float64.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_emulator_hopper import COMMON, PIPELINE_PARAMS, bf16_bits, decode, mutated, wgmma_ss  # noqa: F401 (mutated: a fixture)

from kernelgen.emulator import (
    EmulatorLaunchError,
    EmulatorTimeoutError,
    HazardError,
    build_kernel,
    encode_tensor_map_tiled,
)

pytestmark = pytest.mark.emulate

# D (128 x 64) = A (128 x 64 k) B over `tiles` k-tiles through a 2-stage ring: a producer
# warpgroup (one thread issues the TMA) and two consumer warpgroups of 64 rows each. Each consumer
# warpgroup frees a stage with one elected thread (the empty barriers count 2 arrivals).
# mutation 1: the elected thread frees the stage before the warpgroup's wgmma.wait_group;
# 2: only the first warp of each consumer warpgroup waits before the stage is freed.
ELECTED_SRC = (
    COMMON
    + wgmma_ss(64)
    + r"""
__device__ uint64_t desc128(uint32_t addr) {  // K-major, 128B swizzle, 8-row groups 1024 apart
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
constexpr uint32_t kStage = 24576, kA = 16384;  // A: 128 x 64 bf16, then B: 64 x 64
extern "C" __global__ void elected(const __grid_constant__ CUtensorMap tmap_a,
                                   const __grid_constant__ CUtensorMap tmap_b, int tiles,
                                   float* out, int mutation) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = smem_u32(smem);
  const uint32_t full = base + 2 * kStage, empty = full + 16;
  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(full + 8 * s));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 2;" :: "r"(empty + 8 * s));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warpgroup == 0) {
    if (threadIdx.x == 0) {
      for (int t = 0; t < tiles; ++t) {
        const int s = t % 2;
        if (t >= 2) wait_phase(empty + 8 * s, ((t / 2) - 1) & 1);
        const uint32_t bar = full + 8 * s, a = base + kStage * s, b = a + kA;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 24576;" :: "r"(bar));
        asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                     " [%0], [%1, {%2, %3}], [%4];"
                     :: "r"(a), "l"(&tmap_a), "r"(64 * t), "r"(0), "r"(bar) : "memory");
        asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                     " [%0], [%1, {%2, %3}], [%4];"
                     :: "r"(b), "l"(&tmap_b), "r"(64 * t), "r"(0), "r"(bar) : "memory");
      }
    }
    return;
  }
  const uint32_t rows = 8192 * (warpgroup - 1);  // this warpgroup's 64 rows of A
  const bool leader = threadIdx.x % 128 == 0;
  float d[32];
  for (int r = 0; r < 32; ++r) d[r] = 0.f;
  for (int t = 0; t < tiles; ++t) {
    const int s = t % 2;
    wait_phase(full + 8 * s, (t / 2) & 1);
    const uint32_t a = base + kStage * s + rows, b = base + kStage * s + kA;
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    for (int k = 0; k < 4; ++k) {
      wgmma_ss_64<0, 0, 1>(d, desc128(a + 32 * k), desc128(b + 32 * k), t > 0 || k > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    if (mutation == 1 && leader) {
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(empty + 8 * s) : "memory");
    }
    // (the mutant lets the refill land before its wait, so the overwrite surely falls in flight)
    if (mutation == 1 && t + 2 < tiles) wait_phase(full + 8 * s, ((t / 2) + 1) & 1);
    if (mutation != 2 || threadIdx.x % 128 < 32) {
      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    }
    if (mutation != 1 && leader) {
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(empty + 8 * s) : "memory");
    }
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  for (int r = 0; r < 32; ++r) out[(threadIdx.x - 128) * 32 + r] = d[r];
}
"""
)

ELECTED_PARAMS = PIPELINE_PARAMS  # the same kernel signature as test_emulator_hopper's pipeline


@pytest.fixture(scope="module")
def elected_kernel():
    return build_kernel(ELECTED_SRC, "elected", ELECTED_PARAMS)


def run_elected(
    kernel, a: np.ndarray, b: np.ndarray, mutation: int = 0, timeout: float = 120.0
) -> np.ndarray:
    """D = a @ b (a 128 x 64k, b 64k x 64) through the kernel; returns the 128 x 64 result."""
    tiles = a.shape[1] // 64
    maps = [
        encode_tensor_map_tiled(
            "bfloat16",
            2,
            bf16_bits(x),
            (64 * tiles, x.shape[0]),
            (128 * tiles,),
            (64, x.shape[0]),
            (1, 1),
            swizzle="128B",
        )
        for x in (a, b.T)
    ]
    out = np.zeros((256, 32), np.float32)
    kernel(
        grid=1,
        block=384,
        shared_mem=2 * 24576 + 32,
        args=[*maps, tiles, out, mutation],
        timeout=timeout,
    )
    return np.vstack([decode(out[:128], 64), decode(out[128:], 64)])


def operands(seed: int, tiles: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.integers(-3, 4, (128, 64 * tiles)).astype(np.float64)
    b = rng.integers(-3, 4, (64 * tiles, 64)).astype(np.float64)
    return a, b


def test_stage_freed_by_one_elected_thread_after_the_wait(elected_kernel):
    """Two consumer warpgroups free each stage with one thread each right after
    wgmma.wait_group; the producer refills it at once. Exactly A @ B, no hazard (the GPU retires
    a wgmma for the whole warpgroup at the wait)."""
    a, b = operands(21, 5)
    for _ in range(3):  # thread timing differs between runs; each must pass
        np.testing.assert_array_equal(run_elected(elected_kernel, a, b), a @ b)


def test_stage_freed_before_the_wait_is_a_hazard(elected_kernel):
    """The elected thread frees the stage before the warpgroup's wait: the next TMA overwrites
    the operands of the wgmmas in flight."""
    a, b = operands(22, 5)
    with pytest.raises(HazardError, match="changed between its issue"):
        run_elected(elected_kernel, a, b, mutation=1)


def test_a_wait_of_only_some_threads_of_the_warpgroup_is_a_hazard(elected_kernel):
    """wgmma.wait_group executed by one warp of the warpgroup: the others are at their next
    commit_group when it waits, a hazard naming both."""
    a, b = operands(23, 3)
    with pytest.raises(HazardError, match="different warpgroup-collective instructions"):
        run_elected(elected_kernel, a, b, mutation=2)


# ---- named barriers --------------------------------------------------------------------------

# Two consumer warpgroups in ping-pong over named barriers (FlashAttention 3's schedule): each
# computes D = rounds * A @ B (A 64 x 64, B 64 x 64, one TMA'd stage), warpgroup 0 first; a
# warpgroup waits for its turn on barrier 3 + wg (bar.sync, 256 threads) and hands the turn over
# with bar.arrive on the other's. One thread per warpgroup waits on the mbarrier and passes the
# phase on to its warpgroup with bar.sync 1 + wg, 128. order[1..] logs the turns.
# mutation 1: no bar.sync 1 + wg (the other threads read the tile without seeing the phase);
# 2: warpgroup 0 arrives on barrier 4 with count 224 while warpgroup 1 waits with 256;
# 3: warpgroup 0 never arrives on barrier 4, which warpgroup 1 alone can never fill (a deadlock).
PINGPONG_SRC = (
    COMMON
    + wgmma_ss(64)
    + r"""
__device__ uint64_t desc128(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
extern "C" __global__ void pingpong(const __grid_constant__ CUtensorMap tmap_a,
                                    const __grid_constant__ CUtensorMap tmap_b, int rounds,
                                    float* out, int* order, int mutation) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t a = smem_u32(smem), b = a + 8192, full = a + 16384;
  const int wg = threadIdx.x / 128;
  const bool leader = threadIdx.x % 128 == 0;
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(full));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  asm volatile("bar.sync 0;" ::: "memory");  // __syncthreads
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 16384;" :: "r"(full));
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];" :: "r"(a), "l"(&tmap_a), "r"(0), "r"(0), "r"(full)
                 : "memory");
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];" :: "r"(b), "l"(&tmap_b), "r"(0), "r"(0), "r"(full)
                 : "memory");
  }
  if (leader) wait_phase(full, 0);
  if (mutation != 1) asm volatile("bar.sync %0, 128;" :: "r"(1 + wg) : "memory");
  const int count = mutation == 2 && wg == 0 ? 224 : 256;
  float d[32];
  for (int r = 0; r < 32; ++r) d[r] = 0.f;
  for (int r = 0; r < rounds; ++r) {
    if (wg == 1 || r > 0) asm volatile("barrier.sync.aligned %0, %1;" :: "r"(3 + wg), "r"(256));
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    for (int k = 0; k < 4; ++k) {
      wgmma_ss_64<0, 0, 1>(d, desc128(a + 32 * k), desc128(b + 32 * k), r > 0 || k > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    if (leader) order[1 + atomicAdd(&order[0], 1)] = wg;
    if ((wg == 0 && mutation != 3) || (wg == 1 && r + 1 < rounds)) {
      asm volatile("bar.arrive %0, %1;" :: "r"(4 - wg), "r"(count) : "memory");
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  }
  __syncthreads();
  for (int r = 0; r < 32; ++r) out[threadIdx.x * 32 + r] = d[r];
}
"""
)


@pytest.fixture(scope="module")
def pingpong_kernel():
    return build_kernel(
        PINGPONG_SRC,
        "pingpong",
        [*ELECTED_PARAMS[:4], ("int*", "order"), ("int", "mutation")],
    )


def run_pingpong(kernel, a, b, rounds, mutation=0, timeout=60.0):
    maps = [
        encode_tensor_map_tiled(
            "bfloat16", 2, bf16_bits(x), (64, 64), (128,), (64, 64), (1, 1), swizzle="128B"
        )
        for x in (a, b.T)
    ]
    out = np.zeros((256, 32), np.float32)
    order = np.zeros(1 + 2 * rounds, np.int32)
    kernel(
        grid=1,
        block=256,
        shared_mem=16384 + 8,
        args=[*maps, rounds, out, order, mutation],
        timeout=timeout,
    )
    return decode(out[:128], 64), decode(out[128:], 64), order


def test_pingpong_of_two_warpgroups_on_named_barriers(pingpong_kernel):
    """Both warpgroups get rounds * A @ B, their turns alternate 0, 1, 0, 1, ... and the TMA
    phase one thread saw reaches its warpgroup through bar.sync (no hazard)."""
    a, b = operands(31, 1)
    a = a[:64]
    d0, d1, order = run_pingpong(pingpong_kernel, a, b, rounds=3)
    np.testing.assert_array_equal(d0, 3 * (a @ b))
    np.testing.assert_array_equal(d1, 3 * (a @ b))
    assert order.tolist() == [6, 0, 1, 0, 1, 0, 1]


def test_a_missing_named_barrier_sync_is_a_hazard(pingpong_kernel):
    """Without bar.sync 1 + wg only the leader saw the TMA phase: the others read the tile
    before the copy completed for them (or before it landed, which it then overwrites under
    their wgmma)."""
    a, b = operands(32, 1)
    with pytest.raises(HazardError, match=r"before its TMA write completed|changed between its"):
        run_pingpong(pingpong_kernel, a[:64], b, rounds=2, mutation=1)


def test_different_counts_on_one_named_barrier_are_an_error(pingpong_kernel):
    a, b = operands(33, 1)
    with pytest.raises(EmulatorLaunchError, match="barrier 4 is under way with a thread count"):
        run_pingpong(pingpong_kernel, a[:64], b, rounds=2, mutation=2)


def test_a_named_barrier_count_never_filled_is_a_deadlock_naming_it(pingpong_kernel):
    a, b = operands(34, 1)
    with pytest.raises(
        EmulatorTimeoutError, match="named barrier 4 has 128 of 256 threads arrived"
    ):
        run_pingpong(pingpong_kernel, a[:64], b, rounds=2, mutation=3, timeout=3.0)


# ---- mutations of the emulator that the tests above catch -------------------------------------


def test_mutation_threads_retiring_on_their_own_is_caught(mutated):  # noqa: F811
    """Without the warpgroup's meeting at commit_group / wait_group (each thread retiring its
    share alone) the elected free fails correct code whenever the elected thread runs ahead of
    the others (thread timing: a few runs): a false hazard, or a deadlock when the producer
    refills the stage twice before a lagging thread waits for its first fill (the parity then
    names a phase that already passed)."""
    mutated(
        "kg_wgmma.h",
        "return wg < tctx().launch->nwarpgroups ? &tctx().cta->warpgroups[wg] : nullptr;",
        "return wg < tctx().launch->nwarpgroups ? nullptr : nullptr;",
    )
    kernel = build_kernel(ELECTED_SRC, "elected", ELECTED_PARAMS)
    a, b = operands(21, 5)
    with pytest.raises((HazardError, EmulatorTimeoutError)):
        for _ in range(20):
            run_elected(kernel, a, b, timeout=10.0)


def test_mutation_named_barrier_passing_nothing_on_is_caught(mutated):  # noqa: F811
    """A bar.sync that does not pass on the phases its arriving threads saw: the ping-pong's
    correct code raises a false hazard."""
    mutated("kg_barrier.h", "mbarrier_know(s.slot, s.completed);", "(void)s;")
    kernel = build_kernel(
        PINGPONG_SRC, "pingpong", [*ELECTED_PARAMS[:4], ("int*", "order"), ("int", "mutation")]
    )
    a, b = operands(31, 1)
    with pytest.raises(HazardError):
        run_pingpong(kernel, a[:64], b, rounds=3)
