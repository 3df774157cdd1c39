"""Valid sm_90a inline PTX as third-party Hopper kernels write it, run by the CPU emulator: the
label-and-branch mbarrier wait loop (with a suspend-time hint), immediate TMA coordinates with a
cache hint, wgmma scale-d as an "n" operand, cvta in asm, and the instructions that are hints
on one block (nanosleep, prefetch, griddepcontrol)."""

from __future__ import annotations

import numpy as np
import pytest
from test_emulator_hopper import COMMON, bf16_bits, decode

from kernelgen.emulator import (
    EmulatorSourceError,
    HazardError,
    build_kernel,
    encode_tensor_map_tiled,
    transform_source,
)

pytestmark = pytest.mark.emulate

# D = A (64 x 64) @ B (64 x 64), both tiles loaded by TMA at immediate coordinates. Warps 0-1
# wait with CUTLASS's try_wait loop (suspend-time hint), warps 2-3 with a test_wait loop that
# branches back until the phase completes. The accumulators start as NaN: the first k step's
# scale-d "n"(0) must ignore them. mutation 1: warps 2-3 skip the wait.
FORMS_SRC = (
    COMMON
    + r"""
template <int ScaleD>
__device__ void mma(float* d, uint64_t da, uint64_t db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, "
               "%6, 1, 1, 0, 0;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "l"(da), "l"(db), "n"(ScaleD));
}
__device__ uint64_t desc128(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
extern "C" __global__ void forms(const __grid_constant__ CUtensorMap tmap_a,
                                 const __grid_constant__ CUtensorMap tmap_b, const float* hint,
                                 float* out, int mutation) {
  extern __shared__ __align__(1024) unsigned char smem[];
  uint32_t a;
  asm volatile("cvta.to.shared.u32 %0, %1;" : "=r"(a) : "l"(smem));
  const uint32_t b = a + 8192, bar = a + 16384;
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("prefetch.global.L2 [%0];" :: "l"(hint));
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar));
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 9216;" :: "r"(bar));
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 ".L2::cache_hint [%0], [%1, {0, 0}], [%2], %3;"
                 :: "r"(a), "l"(&tmap_a), "r"(bar), "l"(0x14F0000000000000ull) : "memory");
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {0, 0x0}], [%2];" :: "r"(b), "l"(&tmap_b), "r"(bar) : "memory");
  }
  __syncthreads();
  if (threadIdx.x < 64) {
    asm volatile("{\n"
                 ".reg .pred P1;\n"
                 "LAB_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1, %2;\n"
                 "@P1 bra DONE;\n"
                 "bra.uni LAB_WAIT;\n"
                 "DONE:\n"
                 "}\n" :: "r"(bar), "r"(0), "r"(0x989680) : "memory");
  } else if (mutation != 1) {
    asm volatile("{ .reg .pred done; $wait_%=: "
                 "mbarrier.test_wait.parity.shared::cta.b64 done, [%0], %1; "
                 "@done bra $ready_%=; nanosleep.u32 20; bra $wait_%=; $ready_%=: }"
                 :: "r"(bar), "r"(0) : "memory");
  }
  float d[4] = {NAN, NAN, NAN, NAN};
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  mma<0>(d, desc128(a), desc128(b));
  for (int k = 1; k < 4; ++k) mma<1>(d, desc128(a + 32 * k), desc128(b + 32 * k));
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
  for (int r = 0; r < 4; ++r) out[threadIdx.x * 4 + r] = d[r];
}
"""
)


@pytest.fixture(scope="module")
def forms_kernel():
    return build_kernel(
        FORMS_SRC,
        "forms",
        [
            ("const __grid_constant__ CUtensorMap", "tmap_a"),
            ("const __grid_constant__ CUtensorMap", "tmap_b"),
            ("const float*", "hint"),
            ("float*", "out"),
            ("int", "mutation"),
        ],
    )


def run_forms(kernel, a: np.ndarray, b: np.ndarray, mutation: int = 0) -> np.ndarray:
    maps = [
        encode_tensor_map_tiled(
            "bfloat16", 2, bf16_bits(x), (64, rows), (128,), (64, rows), (1, 1), swizzle="128B"
        )
        for x, rows in ((a, 64), (b.T, 8))
    ]
    out = np.zeros((128, 4), np.float32)
    hint = np.zeros(4, np.float32)
    kernel(grid=1, block=128, shared_mem=16384 + 8, args=[*maps, hint, out, mutation])
    return decode(out, 8)


def test_third_party_hopper_forms_run(forms_kernel):
    """Exactly A @ B: the immediate coordinates load the tiles, scale-d "n"(0) ignores the NaN
    accumulators, both wait loops (forward and backward branches) wait for the phase."""
    rng = np.random.default_rng(41)
    a = rng.integers(-3, 4, (64, 64)).astype(np.float64)
    b = rng.integers(-3, 4, (64, 8)).astype(np.float64)
    np.testing.assert_array_equal(run_forms(forms_kernel, a, b), a @ b)


def test_skipping_the_branch_loop_wait_is_a_hazard(forms_kernel):
    a = np.ones((64, 64))
    b = np.ones((64, 8))
    with pytest.raises(HazardError, match=r"before its TMA write completed|changed between its"):
        run_forms(forms_kernel, a, b, mutation=1)


def test_branch_loop_becomes_labels_and_gotos():
    out = transform_source(
        'asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;'
        ' @!p bra W; }" :: "r"(bar), "r"(0));'
    )
    assert "kg_ptx_L_W:" in out and "if (!kg_ptx_p) goto kg_ptx_L_W;" in out


@pytest.mark.parametrize(
    ("stmt", "message"),
    [
        ('asm("{ bra NOWHERE; }");', "bra to NOWHERE, which is not a label"),
        ('asm("{ L: L: }");', "label L defined twice"),
        ('asm("brx.idx %0, tbl;" :: "r"(i));', "unsupported"),
        ('asm("cvta.to.shared.u32 %0, %1;" : "=r"(x) : "r"(p));', 'needs constraint "l"'),
    ],
)
def test_bad_control_flow_and_cvta_are_refused(stmt, message):
    with pytest.raises(EmulatorSourceError, match=message):
        transform_source(stmt)
