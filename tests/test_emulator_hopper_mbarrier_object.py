"""The mbarrier object's 8 bytes in the CPU emulator: only mbarrier instructions may touch them.

PTX ISA, "Parallel Synchronization and Communication Instructions: mbarrier": "Performing any
non-mbarrier or mbarrier.init operations on an initialized mbarrier object results in undefined
behavior", and (mbarrier.inval) "An mbarrier object must be invalidated before using its memory
location for any other purpose". The emulator keeps a barrier's state apart from its bytes, so
it reports such accesses itself: each kind it models (st.shared, ld.shared, a cp.async, bulk and
tensor TMA destination, a plain C++ store, a second mbarrier.init, another block's
st.shared::cluster) is a HazardError naming the barrier, while the valid uses (the mbarrier
instructions, cp.async.mbarrier.arrive, a TMA's complete_tx, try_wait/test_wait, neighbouring
bytes, the memory reused after mbarrier.inval, a new barrier there) run and give the right
bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_emulator_hopper import COMMON
from test_emulator_hopper_cluster import CLUSTER_HELPERS

from kernelgen.emulator import (
    EmulatorLaunchError,
    HazardError,
    build_kernel,
    encode_tensor_map_tiled,
)

pytestmark = pytest.mark.emulate

# One warp. `bar` (shared offset 64) is a live barrier from its init on; `cp_bar` (offset 104)
# tracks a cp.async. Mode 0 is the valid program; modes 1-8 each add one access the PTX ISA
# forbids; mode 9 is mode 0 without its mbarrier.inval (the reuse then overlaps a live barrier).
SRC = (
    COMMON
    + r"""
__device__ uint32_t test_parity(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile("{ .reg .pred p; mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2; "
               "selp.b32 %0, 1, 0, p; }" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done;
}
extern "C" __global__ void object(const __grid_constant__ CUtensorMap tmap,
                                  const unsigned char* src, int* out, int mode) {
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t base = smem_u32(smem), bar = base + 64, cp_bar = base + 104;
  if (threadIdx.x != 0) return;
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar));
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(cp_bar));
  // neighbours of both barriers: plain and st.shared stores, an ld.shared load
  asm volatile("st.shared.u32 [%0], %1;" :: "r"(bar - 4), "r"(11));
  asm volatile("st.shared.u32 [%0], %1;" :: "r"(bar + 8), "r"(12));
  reinterpret_cast<int*>(smem)[15] = 13;  // bytes 60..63, already 11: now 13
  reinterpret_cast<int*>(smem)[25] = 14;  // bytes 100..103, just below cp_bar
  uint32_t loaded;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(loaded) : "r"(bar + 8));
  out[0] = static_cast<int>(loaded);
  out[1] = reinterpret_cast<int*>(smem)[15];
  out[2] = reinterpret_cast<int*>(smem)[25];
  if (mode == 1) asm volatile("st.shared.u32 [%0], %1;" :: "r"(bar + 4), "r"(1));
  if (mode == 2) asm volatile("ld.shared.u32 %0, [%1];" : "=r"(loaded) : "r"(bar));
  if (mode == 3)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" :: "r"(bar), "l"(src) : "memory");
  if (mode == 4)
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1], 16, [%2];" :: "r"(bar), "l"(src), "r"(cp_bar) : "memory");
  if (mode == 5) {  // a TMA box of 64 bytes at 128 over a barrier at 176
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(base + 176));
    asm volatile("cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2}], [%3];" :: "r"(base + 128), "l"(&tmap), "r"(0), "r"(bar)
                 : "memory");
  }
  if (mode == 6 || mode == 7) reinterpret_cast<int*>(smem)[17] = 5;  // bytes 68..71 of bar
  if (mode == 8) asm volatile("mbarrier.init.shared::cta.b64 [%0], 2;" :: "r"(bar));
  if (mode == 7) return;  // the block ends with the changed bytes
  // a bulk copy of 32 bytes completing on bar, waited for by test_wait then try_wait
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 32;" :: "r"(bar) : "memory");
  out[4] = test_parity(bar, 0);
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
               " [%0], [%1], 32, [%2];" :: "r"(base + 128), "l"(src), "r"(bar) : "memory");
  wait_phase(bar, 0);
  out[5] = test_parity(bar, 0);
  for (int i = 0; i < 32; ++i) out[8 + i] = smem[128 + i];
  // a cp.async tracked by cp_bar
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" :: "r"(base + 192), "l"(src + 32)
               : "memory");
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(cp_bar) : "memory");
  wait_phase(cp_bar, 0);
  for (int i = 0; i < 16; ++i) out[40 + i] = smem[192 + i];
  // bar's memory reused after mbarrier.inval: st.shared, ld.shared, a plain store, then a new
  // barrier there (cp_bar stays live to the end, its bytes untouched)
  if (mode != 9) asm volatile("mbarrier.inval.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
  asm volatile("st.shared.u32 [%0], %1;" :: "r"(bar), "r"(21));
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(loaded) : "r"(bar));
  out[56] = static_cast<int>(loaded);
  reinterpret_cast<int*>(smem)[17] = 22;
  out[57] = reinterpret_cast<int*>(smem)[17];
  // the new barrier's phase 0 takes a second copy into the bytes the first one wrote
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar));
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 32;" :: "r"(bar) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
               " [%0], [%1], 32, [%2];" :: "r"(base + 128), "l"(src + 32), "r"(bar) : "memory");
  wait_phase(bar, 0);
  out[58] = test_parity(bar, 0);
  out[59] = smem[128];
}
"""
)

PARAMS = [
    ("const __grid_constant__ CUtensorMap", "tmap"),
    ("const unsigned char*", "src"),
    ("int*", "out"),
    ("int", "mode"),
]


@pytest.fixture(scope="module")
def kernel():
    return build_kernel(SRC, "object", PARAMS)


def _run(kernel, mode: int) -> tuple[np.ndarray, np.ndarray]:
    src = np.arange(100, 164, dtype=np.uint8)
    box = np.arange(32, dtype=np.uint16)  # 1d, 32 bf16 bit patterns: one 64-byte box
    tmap = encode_tensor_map_tiled("bfloat16", 1, box, (32,), (), (32,), (1,))
    out = np.full(64, -1, np.int32)
    kernel(grid=1, block=32, shared_mem=256, args=[tmap, src, out, mode], timeout=30)
    return out, src


def test_valid_uses_of_an_mbarrier_and_its_neighbours_are_not_flagged(kernel):
    """Neighbouring stores and loads, expect_tx and a bulk copy's complete_tx, test_wait and
    try_wait, cp.async.mbarrier.arrive, the bytes reused after mbarrier.inval and a new
    barrier there: no report, and every value as written."""
    out, src = _run(kernel, 0)
    assert list(out[:3]) == [12, 13, 14]
    assert list(out[4:6]) == [0, 1]  # the phase completes with the copy's bytes
    np.testing.assert_array_equal(out[8:40], src[:32])
    np.testing.assert_array_equal(out[40:56], src[32:48])
    assert list(out[56:58]) == [21, 22]  # the bytes reused after inval
    assert list(out[58:60]) == [1, src[32]]  # a new barrier there, its copy landed


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (1, r"st\.shared\.u32: shared 0x444 \(\+4 bytes\) overlaps the live mbarrier at s.*0x440"),
        (2, r"ld\.shared\.u32: shared 0x440 \(\+4 bytes\) overlaps the live mbarrier at s.*0x440"),
        (3, r"cp\.async destination: shared 0x440 \(\+16 bytes\) overlaps the live mbarrier"),
        (4, r"cp\.async\.bulk destination: shared 0x440 \(\+16 bytes\) overlaps the live mbarr"),
        (5, r"cp\.async\.bulk\.tensor destination: .* overlaps the live mbarrier at shared 0x4b0"),
        (6, r"mbarrier\.arrive\.expect_tx: the bytes of the live mbarrier at shared 0x440 were "
            r"changed since its mbarrier\.init by a write that was not an mbarrier instruction"),
        (7, r"block \(0,0,0\) ends with the bytes of its live mbarrier at shared 0x440 changed"),
        (8, r"mbarrier\.init on the live mbarrier at shared 0x440"),
        (9, r"st\.shared\.u32: shared 0x440 \(\+4 bytes\) overlaps the live mbarrier at s.*0x440"),
    ],
)  # fmt: skip
def test_accesses_to_a_live_mbarrier_are_hazards(kernel, mode, message):
    with pytest.raises(HazardError, match=message):
        _run(kernel, mode)


def test_mbarrier_inval_of_no_barrier_traps():
    src = (
        COMMON
        + r"""
extern "C" __global__ void inval_none(int* out) {
  extern __shared__ __align__(128) unsigned char smem[];
  if (threadIdx.x == 0)
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];" :: "r"(smem_u32(smem) + 8) : "memory");
}
"""
    )
    kernel = build_kernel(src, "inval_none", [("int*", "out")])
    with pytest.raises(EmulatorLaunchError, match=r"mbarrier\.inval: the mbarrier at shared 0x408 "
                       r"was not initialized"):  # fmt: skip
        kernel(grid=1, block=32, shared_mem=64, args=[np.zeros(1, np.int32)], timeout=30)


REMOTE_SRC = (
    COMMON
    + CLUSTER_HELPERS
    + r"""
// Each block of a 2-block cluster has a live barrier at shared offset 64; rank 0 stores into
// rank 1's shared memory: beside the barrier (offset 72), or into it (mode 1, offset 68).
extern "C" __global__ void remote(int* out, int mode) {
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t bar = smem_u32(smem) + 64;
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  if (threadIdx.x == 0) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  cluster_sync();
  if (rank == 0 && threadIdx.x == 0)
    asm volatile("st.shared::cluster.u32 [%0], %1;" :: "r"(mapa(bar + (mode ? 4 : 8), 1)),
                 "r"(7) : "memory");
  cluster_sync();
  if (rank == 1 && threadIdx.x == 0) out[0] = reinterpret_cast<int*>(smem)[18];
}
"""
)


def test_a_store_into_another_blocks_live_mbarrier_is_a_hazard():
    """Distributed shared memory: rank 0's st.shared::cluster beside rank 1's barrier lands; one
    into it is reported, naming the block."""
    kernel = build_kernel(REMOTE_SRC, "remote", [("int*", "out"), ("int", "mode")])
    out = np.zeros(1, np.int32)
    kernel(grid=2, block=32, shared_mem=128, args=[out, 0], cluster=(2, 1, 1), timeout=30)
    assert out[0] == 7
    with pytest.raises(HazardError, match=r"shared 0x444 \(\+4 bytes\) of block rank 1 overlaps"):
        kernel(grid=2, block=32, shared_mem=128, args=[out, 1], cluster=(2, 1, 1), timeout=30)
