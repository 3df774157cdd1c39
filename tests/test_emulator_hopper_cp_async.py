"""cp.async tracked by an mbarrier (``cp.async.mbarrier.arrive{.noinc}``) in the CPU emulator.

The PTX ISA: the instruction makes the barrier track every prior cp.async of the executing
thread; an arrive-on is triggered when they have all completed. Without ``.noinc`` the pending
count is raised by one first (no net change); with ``.noinc`` the arrive-on counts against the
count given to ``mbarrier.init``. cp.async (not ``.bulk``) writes shared memory in the generic
proxy, so before wgmma (the async proxy) reads the bytes a thread that saw the phase complete
must execute ``fence.proxy.async``, ordered before the read.

The probe kernel: a producer warpgroup copies two 64 x 64 bf16 tiles (A, B) with 16-byte
cp.async into the 128-byte-swizzled layout wgmma reads (chunk c of row r at chunk c ^ (r % 8)),
rows of B at or past ``valid_rows`` in the last round zero-filled by src-size 0; its thread 0
relays the copies' phase (waits for it, fences, arrives on the consumers' barrier); a consumer
warpgroup computes D += A B^T per round. Operands are small integers, so D is exact.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_emulator_hopper import COMMON, bf16_bits, decode, mutated, wgmma_ss  # noqa: F401

from kernelgen.emulator import (
    EmulatorTimeoutError,
    HazardError,
    build_kernel,
    transform_source,
)

pytestmark = pytest.mark.emulate

# mode 0: .noinc, staged init 128 (one arrive-on per producer thread), the relay fences;
# 1: the relay does not fence; 2: without .noinc, staged init 1, completed by thread 0's own
# arrive; 3: .noinc with init 96 (too few: the phase completes at the 96th); 4: the consumer
# reads after a named barrier with the producers instead of the relay's barrier; 5: the
# consumer fences after its wait, not the relay; 6: as 0, with A's copies in a committed group.
SRC = (
    COMMON
    + wgmma_ss(64)
    + r"""
__device__ uint64_t desc128(uint32_t addr) {  // K-major, 128B swizzle, 8-row groups 1024 apart
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
__device__ int test_phase(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile("{ .reg .pred p; mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2; "
               "selp.b32 %0, 1, 0, p; }" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return int(done);
}
constexpr uint32_t kTile = 8192;  // 64 rows of 128 bytes
extern "C" __global__ void cpa_tile(const unsigned short* a, const unsigned short* b, int rounds,
                                    int valid_rows, float* out, int* flags, int mode) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = smem_u32(smem);
  const uint32_t staged = base + 2 * kTile, full = staged + 8, empty = full + 8;
  if (threadIdx.x == 0) {
    const int count = mode == 2 ? 1 : mode == 3 ? 96 : 128;
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(staged), "r"(count));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(full));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(empty));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    for (int k = 0; k < rounds; ++k) {
      if (k > 0) wait_phase(empty, (k - 1) & 1);
      for (int i = threadIdx.x; i < 1024; i += 128) {  // 512 chunks of A, then 512 of B
        const int m = i / 512, r = (i / 8) % 64, c = i % 8;
        const unsigned short* src = (m ? b : a) + ((size_t)k * 64 + r) * 64 + c * 8;
        const uint32_t dst = base + m * kTile + r * 128 + ((c ^ (r % 8)) * 16);
        const int bytes = m == 1 && k == rounds - 1 && r >= valid_rows ? 0 : 16;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                     :: "r"(dst), "l"(src), "r"(bytes) : "memory");
        if (mode == 6 && i < 512 && i + 128 >= 512)  // A's copies committed, B's not
          asm volatile("cp.async.commit_group;" ::: "memory");
      }
      if (mode == 2) {
        asm volatile("cp.async.mbarrier.arrive.shared.b64 [%0];" :: "r"(staged) : "memory");
        // a second one of thread 0, tracking no copy: 129 arrive-ons, an odd number
        if (threadIdx.x == 0)
          asm volatile("cp.async.mbarrier.arrive.shared.b64 [%0];" :: "r"(staged) : "memory");
      } else
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(staged)
                     : "memory");
      if (mode == 6) asm volatile("cp.async.wait_group 1;" ::: "memory");  // one group left
      if (mode == 4) {
        asm volatile("bar.sync 1, 256;" ::: "memory");
        continue;
      }
      asm volatile("bar.sync 2, 128;" ::: "memory");  // every producer thread's arrive-on
      if (threadIdx.x != 0) continue;
      flags[2 * k] = test_phase(staged, k & 1);
      if (mode == 2) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(staged));
      wait_phase(staged, k & 1);
      flags[2 * k + 1] = 1;
      if (mode != 1 && mode != 5) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(full) : "memory");
    }
    return;
  }
  float d[32];
  for (int r = 0; r < 32; ++r) d[r] = 0.f;
  for (int k = 0; k < rounds; ++k) {
    if (mode == 4)
      asm volatile("bar.sync 1, 256;" ::: "memory");
    else
      wait_phase(full, k & 1);
    if (mode == 5) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    for (int kk = 0; kk < 4; ++kk)
      wgmma_ss_64<0, 0, 1>(d, desc128(base + 32 * kk), desc128(base + kTile + 32 * kk),
                           k > 0 || kk > 0);
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    if (threadIdx.x == 128)
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(empty) : "memory");
  }
  for (int r = 0; r < 32; ++r) out[(threadIdx.x - 128) * 32 + r] = d[r];
}
"""
)

PARAMS = [
    ("const unsigned short*", "a"),
    ("const unsigned short*", "b"),
    ("int", "rounds"),
    ("int", "valid_rows"),
    ("float*", "out"),
    ("int*", "flags"),
    ("int", "mode"),
]


@pytest.fixture(scope="module")
def cpa_kernel():
    return build_kernel(SRC, "cpa_tile", PARAMS)


def operands(seed: int, rounds: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.integers(-3, 4, (rounds, 64, 64)).astype(np.float64)
    b = rng.integers(-3, 4, (rounds, 64, 64)).astype(np.float64)
    return a, b


def run(kernel, a, b, valid_rows=64, mode=0, timeout=60.0) -> tuple[np.ndarray, np.ndarray]:
    """(D, flags): D = sum over rounds of a[k] b[k]^T (64 x 64), flags per round: whether the
    copies' phase had completed when thread 0 looked after every producer's arrive-on, then 1
    once it waited for it."""
    rounds = a.shape[0]
    out = np.full((128, 32), np.nan, np.float32)
    flags = np.full(2 * rounds, -1, np.int32)
    kernel(
        grid=1,
        block=256,
        shared_mem=2 * 8192 + 24,
        args=[bf16_bits(a), bf16_bits(b), rounds, valid_rows, out, flags, mode],
        timeout=timeout,
    )
    return decode(out, 64), flags


def expected(a: np.ndarray, b: np.ndarray, valid_rows: int = 64) -> np.ndarray:
    b = b.copy()
    b[-1, valid_rows:] = 0.0  # the last round's rows of B past valid_rows are zero-filled
    return np.einsum("kmd,knd->mn", a, b)


def test_noinc_arrive_ons_complete_the_phase_counted_at_init(cpa_kernel):
    """.noinc, init 128: the 128 producers' arrive-ons complete each phase (three rounds, so
    both parities and the ring's reuse), the relay fences, wgmma reads the swizzled tiles."""
    a, b = operands(1, 3)
    d, flags = run(cpa_kernel, a, b)
    np.testing.assert_array_equal(d, expected(a, b))
    np.testing.assert_array_equal(flags, [1, 1] * 3)


def test_src_size_zero_fills_the_rows(cpa_kernel):
    """The last round's B rows 40-63 copied with src-size 0: zeros, not the previous round's
    bytes still in those rows."""
    a, b = operands(2, 2)
    d, _ = run(cpa_kernel, a, b, valid_rows=40)
    np.testing.assert_array_equal(d, expected(a, b, 40))
    assert np.any(expected(a, b, 64)[:, 40:] != expected(a, b, 40)[:, 40:])


def test_without_noinc_the_arrive_on_leaves_the_count_unchanged(cpa_kernel):
    """Without .noinc and init 1: the 128 arrive-ons raise and lower the pending count, so the
    phase is still open until thread 0's own mbarrier.arrive."""
    a, b = operands(3, 2)
    d, flags = run(cpa_kernel, a, b, mode=2)
    np.testing.assert_array_equal(d, expected(a, b))
    np.testing.assert_array_equal(flags, [0, 1] * 2)


def test_noinc_arrive_ons_beyond_the_init_count_start_the_next_phase(cpa_kernel):
    """.noinc with init 96: the 96th arrive-on completes the phase and the later ones count
    towards the next, so the relay passes on a phase that does not cover every copy and the
    consumer's read of the others is a hazard."""
    a, b = operands(4, 1)
    with pytest.raises(HazardError, match=r"before its cp.async write completed .* phase 1"):
        run(cpa_kernel, a, b, mode=3)


def test_wgmma_read_without_a_proxy_fence_is_a_hazard(cpa_kernel):
    """cp.async writes in the generic proxy: no fence.proxy.async between the copies' phase and
    wgmma's read."""
    a, b = operands(5, 1)
    with pytest.raises(HazardError, match=r"wgmma reads .* which cp.async wrote .* fence\.proxy"):
        run(cpa_kernel, a, b, mode=1)


def test_the_readers_own_fence_after_its_wait_suffices(cpa_kernel):
    """The consumer learnt of the copies' phase through the relay's arrival and fences itself."""
    a, b = operands(6, 2)
    d, _ = run(cpa_kernel, a, b, mode=5)
    np.testing.assert_array_equal(d, expected(a, b))


def test_the_arrive_on_tracks_committed_copies_too(cpa_kernel):
    """A's copies committed as a group before the arrive-on, B's not: both are tracked (every
    prior cp.async of the thread), and a later wait_group still counts the group."""
    a, b = operands(8, 2)
    d, flags = run(cpa_kernel, a, b, mode=6)
    np.testing.assert_array_equal(d, expected(a, b))
    np.testing.assert_array_equal(flags, [1, 1] * 2)


def test_read_before_the_copies_phase_completed_is_a_hazard(cpa_kernel):
    """The consumer meets the producers on a named barrier after their arrive-ons: the bytes
    are there in the emulator, but no thread it learnt from saw the phase complete."""
    a, b = operands(7, 1)
    with pytest.raises(HazardError, match=r"before its cp.async write completed"):
        run(cpa_kernel, a, b, mode=4)


def test_transform_spells_both_forms():
    src = (
        '__global__ void k(unsigned bar) { asm volatile("cp.async.mbarrier.arrive.noinc.shared'
        '::cta.b64 [%0];" :: "r"(bar)); asm volatile("cp.async.mbarrier.arrive.shared.b64 '
        '[%0];" :: "r"(bar)); }'
    )
    out = transform_source(src)
    assert "cp_async_mbarrier_arrive(" in out and ", true)" in out and ", false)" in out


# ---- mutations of the emulator that the tests above catch -------------------------------------

INCREMENT = "  if (!noinc) {\n    if (b.pending + 1"  # the pending count raised without .noinc


def test_mutation_noinc_ignored_is_caught(mutated):  # noqa: F811
    """Every arrive-on raising the count first (.noinc ignored): the phase never completes."""
    mutated(
        "kg_ptx.h", "  if (!noinc) {\n    if (b.pending + 1", "  if (true) {\n    if (b.pending + 1"
    )
    kernel = build_kernel(SRC, "cpa_tile", PARAMS)
    a, b = operands(1, 1)
    with pytest.raises(EmulatorTimeoutError, match="deadlocked"):
        run(kernel, a, b, timeout=5.0)


def test_mutation_increment_dropped_is_caught(mutated):  # noqa: F811
    """Without .noinc treated as .noinc: each of the 129 arrive-ons completes a phase of the
    init-1 barrier (129 of them, then thread 0's arrive: 130), so thread 0 waits for a parity
    that has passed."""
    mutated(
        "kg_ptx.h",
        "  if (!noinc) {\n    if (b.pending + 1",
        "  if (false) {\n    if (b.pending + 1",
    )
    kernel = build_kernel(SRC, "cpa_tile", PARAMS)
    a, b = operands(3, 1)
    with pytest.raises(EmulatorTimeoutError, match="deadlocked"):  # waits for phase 130
        run(kernel, a, b, mode=2, timeout=10.0)


def test_mutation_fence_not_required_is_caught(mutated):  # noqa: F811
    mutated(
        "kg_mbarrier.h",
        "if ((static_cast<uint32_t>(stamp) & kCpAsyncStamp) == 0) return;",
        "return;",
    )
    kernel = build_kernel(SRC, "cpa_tile", PARAMS)
    a, b = operands(5, 1)
    d, _ = run(kernel, a, b, mode=1)  # no hazard any more: the test above would fail
    np.testing.assert_array_equal(d, expected(a, b))


def test_mutation_committed_copies_left_out_is_caught(mutated):  # noqa: F811
    """An arrive-on that tracks only the uncommitted copies: A's stay in flight, so wgmma's read
    of them is a hazard (or, were they never performed, D would be wrong)."""
    mutated("kg_ptx.h", "    copies.insert(copies.end(), g.begin(), g.end());\n", "")
    kernel = build_kernel(SRC, "cpa_tile", PARAMS)
    a, b = operands(8, 1)
    with pytest.raises((HazardError, AssertionError)):
        d, _ = run(kernel, a, b, mode=6)
        np.testing.assert_array_equal(d, expected(a, b))


def test_mutation_copies_unstamped_is_caught(mutated):  # noqa: F811
    """Copies that do not record their phase: the early read goes unnoticed."""
    mutated("kg_ptx.h", "const uint64_t old = sh.tma.exchange(stamp);", "const uint64_t old = 0;")
    kernel = build_kernel(SRC, "cpa_tile", PARAMS)
    a, b = operands(7, 1)
    d, _ = run(kernel, a, b, mode=4)
    np.testing.assert_array_equal(d, expected(a, b))
