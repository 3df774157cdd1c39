"""A FlashAttention-3-shaped forward kernel, written for this test, run by the CPU emulator.

The shape of FA3's Hopper forward (not its code): a 2-block cluster whose producer warps load
K and V through a 2-stage ring of mbarriers, each block multicasting its half (block 0 K, block 1
V) to both blocks; two consumer warpgroups per block that take turns on named barriers
(ping-pong), compute S = Q K^T with shared-memory wgmma and O += P V with P in registers, free a
stage with one elected thread per warpgroup after wgmma.wait_group (on both blocks' empty
barriers), and write O through stmatrix, fence.proxy.async, a named barrier of the consumers and
a TMA store, reusing the staging buffer for a second head after cp.async.bulk.wait_group.read.
The result is compared with float64 attention; each mutation of the kernel (a missing barrier,
fence or wait, a stage freed early, a wrong multicast mask) must be caught.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_emulator_hopper import COMMON, wgmma_ss

from kernelgen.emulator import (
    EmulatorTimeoutError,
    HazardError,
    build_kernel,
    encode_tensor_map_tiled,
)
from kernelgen.runtime.emulated_launch import to_device_dtype

pytestmark = pytest.mark.emulate

HEADS, SEQ_Q, SEQ_K, DIM = 2, 256, 192, 64  # per head: 2 blocks x 128 query rows, 3 key tiles

FA3_SRC = (
    COMMON
    + wgmma_ss(64)
    + r"""
constexpr int kTiles = 3, kHeads = 2;
constexpr uint32_t kQ = 0, kK = 16384, kStage = 16384, kV = 8192, kO = 49152, kBars = 65536;
__device__ uint64_t desc(uint32_t addr) {  // 128B swizzle, 8-row groups 1024 bytes apart
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(8192 >> 4) << 16) |
         ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
__device__ uint32_t mapa(uint32_t addr, uint32_t rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}
__device__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ uint32_t pack(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
// O += P V: P (64 x 16 keys) in registers, V K-major in keys (MN-major B: trans-b 1).
__device__ void wgmma_pv(float* d, const uint32_t* a, uint64_t db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "
               "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
               "{%32, %33, %34, %35}, %36, 1, 1, 1, 1;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                 "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                 "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                 "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                 "+f"(d[30]), "+f"(d[31])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
__device__ void arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ void arrive_cluster(uint32_t bar) {  // a .shared::cluster address
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" :: "r"(bar)
               : "memory");
}

// mode (mutations): 1 no named barrier of the consumers before the TMA store of O; 2 the stage
// freed before the PV wgmma.wait_group (the consumer then waits for the refill); 3 no
// cp.async.bulk.wait_group.read before the O buffer is written again; 4 a multicast mask that
// leaves out the other block; 5 no fence.proxy.async after the stmatrix of O.
extern "C" __global__ void fa3(const __grid_constant__ CUtensorMap tmap_q,
                               const __grid_constant__ CUtensorMap tmap_k,
                               const __grid_constant__ CUtensorMap tmap_v,
                               const __grid_constant__ CUtensorMap tmap_o, float scale_log2,
                               int mode) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = smem_u32(smem);
  const uint32_t full = base + kBars, empty = full + 16, q_full = full + 32, q_empty = full + 40;
  const int wg = threadIdx.x / 128;
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(full + 8 * s));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 4;" :: "r"(empty + 8 * s));  // 2 x 2 WGs
    }
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(q_full));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 2;" :: "r"(q_empty));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();  // every block's barriers exist before any multicast or remote arrival
  if (wg == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      const unsigned short mask = mode == 4 ? (1u << rank) : 3u;
      for (int h = 0; h < kHeads; ++h) {
        if (h > 0) wait_phase(q_empty, (h - 1) & 1);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 16384;" :: "r"(q_full));
        asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                     " [%0], [%1, {%2, %3, %4}], [%5];"
                     :: "r"(base + kQ), "l"(&tmap_q), "r"(0), "r"(128 * rank), "r"(h),
                        "r"(q_full) : "memory");
        for (int t = 0; t < kTiles; ++t) {
          const int it = h * kTiles + t, s = it % 2;
          if (it >= 2) wait_phase(empty + 8 * s, ((it / 2) - 1) & 1);
          asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 16384;"
                       :: "r"(full + 8 * s));
          // block 0 multicasts the K tile, block 1 the V tile, to both blocks
          const uint32_t dst = base + kK + kStage * s + (rank == 0 ? 0 : kV);
          asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                       ".multicast::cluster [%0], [%1, {%2, %3, %4}], [%5], %6;"
                       :: "r"(dst), "l"(rank == 0 ? &tmap_k : &tmap_v), "r"(0), "r"(64 * t),
                          "r"(h), "r"(full + 8 * s), "h"(mask) : "memory");
        }
      }
    }
  } else {  // consumers: warpgroup c computes query rows 64 c .. 64 c + 63 of the block
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int c = wg - 1, tid = threadIdx.x - 128, w = (tid % 128) / 32, lane = tid % 32;
    const bool elected = tid % 128 == 0;
    const uint32_t peer = rank ^ 1u;
    if (c == 1) asm volatile("bar.arrive 2, 256;" ::: "memory");  // warpgroup 0 goes first
    for (int h = 0; h < kHeads; ++h) {
      wait_phase(q_full, h & 1);
      float o[32], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
      for (int r = 0; r < 32; ++r) o[r] = 0.f;
      for (int t = 0; t < kTiles; ++t) {
        const int it = h * kTiles + t, s = it % 2;
        const uint32_t k_tile = base + kK + kStage * s, v_tile = k_tile + kV;
        wait_phase(full + 8 * s, (it / 2) & 1);
        asm volatile("bar.sync %0, 256;" :: "r"(2 + c) : "memory");  // this warpgroup's turn
        float sc[32];
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        for (int k = 0; k < 4; ++k) {
          const uint64_t da = desc(base + kQ + 8192 * c + 32 * k), db = desc(k_tile + 32 * k);
          wgmma_ss_64<0, 0, 1>(sc, da, db, k > 0);
        }
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        if (!(c == 1 && it == kHeads * kTiles - 1)) {
          asm volatile("bar.arrive %0, 256;" :: "r"(3 - c) : "memory");  // the other's turn
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        // online softmax over this thread's rows g and g + 8 (a row spans the 4 lanes of a quad)
        float alpha[2];
        for (int r = 0; r < 2; ++r) {
          float mx = m[r];
          for (int j = 0; j < 8; ++j) {
            mx = fmaxf(mx, fmaxf(sc[4 * j + 2 * r], sc[4 * j + 2 * r + 1]) * scale_log2);
          }
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          alpha[r] = exp2f(m[r] - mx);
          m[r] = mx;
          float sum = 0.f;
          for (int j = 0; j < 8; ++j) {
            for (int i = 0; i < 2; ++i) {
              const int x = 4 * j + 2 * r + i;
              sc[x] = exp2f(sc[x] * scale_log2 - mx);
              sum += sc[x];
            }
          }
          sum += __shfl_xor_sync(0xffffffffu, sum, 1);
          sum += __shfl_xor_sync(0xffffffffu, sum, 2);
          l[r] = l[r] * alpha[r] + sum;
        }
        for (int j = 0; j < 8; ++j) {
          for (int x = 0; x < 4; ++x) o[4 * j + x] *= alpha[x / 2];
        }
        uint32_t p[4][4];  // the accumulator fragment of S is the A fragment of P V
        for (int k = 0; k < 4; ++k) {
          for (int x = 0; x < 4; ++x) p[k][x] = pack(sc[8 * k + 2 * x], sc[8 * k + 2 * x + 1]);
        }
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        for (int k = 0; k < 4; ++k) wgmma_pv(o, p[k], desc(v_tile + 2048 * k));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        if (mode == 2) {
          if (elected) {
            arrive(empty + 8 * s);
            arrive_cluster(mapa(empty + 8 * s, peer));
          }
          if (it + 2 < kHeads * kTiles) wait_phase(full + 8 * s, ((it / 2) + 1) & 1);
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        if (mode != 2 && elected) {  // free the stage in both blocks (both were written)
          arrive(empty + 8 * s);
          arrive_cluster(mapa(empty + 8 * s, peer));
        }
      }
      if (elected) arrive(q_empty);
      // epilogue: O / l as bf16 through stmatrix into the 128B-swizzled staging buffer
      if (h > 0) {
        if (tid == 0 && mode != 3) {
          asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        }
        asm volatile("bar.sync 1, 256;" ::: "memory");  // the buffer is free again
      }
      for (int j = 0; j < 8; j += 2) {
        uint32_t v[4];
        for (int x = 0; x < 4; ++x) {
          const int jj = j + x / 2, r = x % 2;
          v[x] = pack(o[4 * jj + 2 * r] / l[r], o[4 * jj + 2 * r + 1] / l[r]);
        }
        const int mi = lane / 8, row = 64 * c + 16 * w + 8 * (mi % 2) + lane % 8;
        const int chunk = (j + mi / 2) ^ (row % 8);
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                     :: "r"(base + kO + 128 * row + 16 * chunk), "r"(v[0]), "r"(v[1]), "r"(v[2]),
                        "r"(v[3]) : "memory");
      }
      if (mode != 5) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      if (mode != 1) asm volatile("bar.sync 1, 256;" ::: "memory");
      if (tid == 0) {
        asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group"
                     " [%0, {%1, %2, %3}], [%4];"
                     :: "l"(&tmap_o), "r"(0), "r"(128 * rank), "r"(h), "r"(base + kO) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      }
    }
    if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
  cluster_sync();  // no block leaves while the other may still use its shared memory
}
"""
)
FA3_PARAMS = [
    ("const __grid_constant__ CUtensorMap", "tmap_q"),
    ("const __grid_constant__ CUtensorMap", "tmap_k"),
    ("const __grid_constant__ CUtensorMap", "tmap_v"),
    ("const __grid_constant__ CUtensorMap", "tmap_o"),
    ("float", "scale_log2"),
    ("int", "mode"),
]


@pytest.fixture(scope="module")
def fa3_kernel():
    return build_kernel(FA3_SRC, "fa3", FA3_PARAMS)


def bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def run_fa3(kernel, mode: int = 0, timeout: float = 120.0):
    """(O from the kernel, float64 attention of the same bf16 inputs)."""
    rng = np.random.default_rng(31)
    q, k, v = (
        to_device_dtype(rng.standard_normal((HEADS, n, DIM)), "bfloat16")
        for n in (SEQ_Q, SEQ_K, SEQ_K)
    )
    out = np.zeros((HEADS, SEQ_Q, DIM), np.uint16)

    def tmap(x: np.ndarray, rows: int):
        n = x.shape[1]
        return encode_tensor_map_tiled(
            "bfloat16",
            3,
            x,
            (DIM, n, HEADS),
            (2 * DIM, 2 * DIM * n),
            (DIM, rows, 1),
            (1, 1, 1),
            swizzle="128B",
        )

    scale = DIM**-0.5
    kernel(
        grid=(2, 1, 1),
        block=384,
        shared_mem=65536 + 64,
        args=[tmap(q, 128), tmap(k, 64), tmap(v, 64), tmap(out, 128), scale / np.log(2), mode],
        cluster=(2, 1, 1),
        timeout=timeout,
    )
    s = np.einsum("hqd,hkd->hqk", bf16(q), bf16(k)) * scale
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    ref = np.einsum("hqk,hkd->hqd", p / p.sum(axis=-1, keepdims=True), bf16(v))
    return bf16(out), ref


def test_fa3_shaped_kernel_matches_float64(fa3_kernel):
    """Both heads of both blocks: relative Frobenius error within the bf16 tolerance, no
    hazard (thread timing differs between runs; each must pass)."""
    for _ in range(2):
        got, ref = run_fa3(fa3_kernel)
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err < 1e-2, err


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (
            1,
            r"no barrier ordering the write and its fence\.proxy\.async|still reads it"
            r"|no barrier orders",
        ),
        (2, r"shared memory a wgmma reads .* changed between its issue"),
        (3, r"while a TMA store of thread 128 still reads it"),
        (5, r"no fence\.proxy\.async after the write"),
    ],
)
def test_fa3_mutants_are_hazards(fa3_kernel, mode, message):
    """A missing named barrier before the TMA store, a stage freed before wgmma.wait_group, a
    missing cp.async.bulk.wait_group.read before the staging buffer is reused, a missing
    fence.proxy.async."""
    with pytest.raises(HazardError, match=message):
        run_fa3(fa3_kernel, mode)


def test_fa3_wrong_multicast_mask_deadlocks(fa3_kernel):
    """Each block multicasting only to itself: the other block's full barrier never gets the
    bytes; the watchdog names the barrier with its pending transaction bytes."""
    with pytest.raises(EmulatorTimeoutError, match=r"transaction bytes pending"):
        run_fa3(fa3_kernel, 4, timeout=3.0)
