"""Thread-block clusters in the CPU emulator: the blocks of a cluster run at once.

Checked against the PTX ISA's definitions: the cluster special registers of every block of a
grid of clusters, barrier.cluster, distributed shared memory (mapa, ld/st.shared::cluster), an
arrival on another block's mbarrier, a multicast TMA load completing on each destination block's
mbarrier, and static __shared__ variables (an mbarrier among them) that are each block's own.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_emulator_hopper import COMMON, mutated  # noqa: F401 (mutated: a fixture)

from kernelgen.emulator import (
    EmulatorArgumentError,
    EmulatorLaunchError,
    EmulatorSourceError,
    EmulatorTimeoutError,
    HazardError,
    build_kernel,
    encode_tensor_map_tiled,
    transform_source,
)

pytestmark = pytest.mark.emulate

SREGS = [
    "cluster_ctarank",
    "cluster_nctarank",
    "clusterid.x",
    "clusterid.y",
    "cluster_ctaid.x",
    "cluster_ctaid.y",
    "cluster_nctaid.x",
    "cluster_nctaid.y",
    "nclusterid.x",
    "nclusterid.y",
    "laneid",
]

# A block's .shared::cluster address of another rank's variable, and the cluster barrier.
CLUSTER_HELPERS = r"""
__device__ uint32_t mapa(uint32_t addr, uint32_t rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}
__device__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
"""

CLUSTER_SRC = (
    COMMON
    + "__device__ void sregs(unsigned* o) {\n"
    + "\n".join(
        f'  asm volatile("mov.u32 %0, %%{name};" : "=r"(o[{i}]));' for i, name in enumerate(SREGS)
    )
    + "\n}\n"
    + CLUSTER_HELPERS
    + r"""
// Static __shared__ variables (each block's own): the multicast destination, its mbarrier, the
// words the neighbours exchange, the barrier every block's thread 0 arrives on in rank 0.
// mode 1: the multicast mask leaves out the last rank (its mbarrier never completes);
// 2: barrier.cluster.wait without an arrive; 3: __syncthreads instead of the cluster barrier
// after the initialisation (the other blocks' arrivals and multicast may reach the barriers
// before, or without a barrier.cluster after, their mbarrier.init).
extern "C" __global__ void cluster_probe(const __grid_constant__ CUtensorMap tmap, unsigned* ids,
                                         unsigned* words, unsigned char* tiles, int mode) {
  __shared__ __align__(128) unsigned char tile[512];
  __shared__ uint64_t full, gather;
  __shared__ unsigned word[2];
  const unsigned block = blockIdx.x + gridDim.x * blockIdx.y;
  sregs(ids + (block * blockDim.x + threadIdx.x) * 11);
  unsigned rank, n;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_u32(&full)));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_u32(&gather)), "r"(n));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    word[0] = 100 * rank + block;
  }
  if (mode == 2) asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
  if (mode == 3) {
    __syncthreads();  // (mutation) this block only
  } else {
    cluster_sync();  // the barriers are initialized, word[0] written, in every block
  }
  if (threadIdx.x == 0) {
    unsigned next;
    asm volatile("ld.shared::cluster.u32 %0, [%1];"
                 : "=r"(next) : "r"(mapa(smem_u32(&word[0]), (rank + 1) % n)));
    words[3 * block] = next;
    asm volatile("st.shared::cluster.u32 [%0], %1;"
                 :: "r"(mapa(smem_u32(&word[1]), (rank + 1) % n)), "r"(rank) : "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 512;" :: "r"(smem_u32(&full)));
    if (rank == 0) {
      unsigned cx, cy;
      asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(cx));
      asm volatile("mov.u32 %0, %%clusterid.y;" : "=r"(cy));
      const unsigned short mask = mode == 1 ? (1u << (n - 1)) - 1 : (1u << n) - 1;
      asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                   ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;"
                   :: "r"(smem_u32(tile)), "l"(&tmap), "r"(64 * cx), "r"(4 * cy),
                      "r"(smem_u32(&full)), "h"(mask) : "memory");
    }
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];"
                 :: "r"(mapa(smem_u32(&gather), 0)) : "memory");
  }
  wait_phase(smem_u32(&full), 0);
  for (int i = threadIdx.x; i < 512; i += blockDim.x) tiles[512 * block + i] = tile[i];
  if (rank == 0) wait_phase(smem_u32(&gather), 0);
  cluster_sync();  // the neighbour's store has landed; no block leaves while others use it
  if (threadIdx.x == 0) {
    words[3 * block + 1] = word[1];
    words[3 * block + 2] = rank == 0 ? 1 : 0;  // rank 0 saw every block's arrival
  }
}
"""
)
CLUSTER_PARAMS = [
    ("const __grid_constant__ CUtensorMap", "tmap"),
    ("unsigned*", "ids"),
    ("unsigned*", "words"),
    ("unsigned char*", "tiles"),
    ("int", "mode"),
]


@pytest.fixture(scope="module")
def cluster_kernel():
    return build_kernel(CLUSTER_SRC, "cluster_probe", CLUSTER_PARAMS)


GRID, CLUSTER = (4, 2), (2, 2)


def run_cluster(kernel, mode=0, timeout=60.0, block_order=0):
    rng = np.random.default_rng(7)
    data = rng.integers(0, 2**16, (8, 128)).astype(np.uint16)  # 2 x 2 tiles of 64 x 4
    tmap = encode_tensor_map_tiled("uint16", 2, data, (128, 8), (256,), (64, 4), (1, 1))
    nblocks = GRID[0] * GRID[1]
    ids = np.zeros((nblocks, 64, len(SREGS)), np.uint32)
    words = np.zeros((nblocks, 3), np.uint32)
    tiles = np.zeros((nblocks, 512), np.uint8)
    kernel(
        grid=GRID,
        block=64,
        args=[tmap, ids, words, tiles, mode],
        cluster=CLUSTER,
        timeout=timeout,
        block_order=block_order,
    )
    return data, ids, words, tiles


def expected_ids(bx: int, by: int) -> list[int]:
    """The PTX ISA's cluster registers of block (bx, by): %cluster_ctaid is the block's position
    in its cluster, %cluster_ctarank its rank (x fastest), %clusterid the cluster's position."""
    cx, cy = bx % CLUSTER[0], by % CLUSTER[1]
    return [
        cx + CLUSTER[0] * cy,
        CLUSTER[0] * CLUSTER[1],
        bx // CLUSTER[0],
        by // CLUSTER[1],
        cx,
        cy,
        CLUSTER[0],
        CLUSTER[1],
        GRID[0] // CLUSTER[0],
        GRID[1] // CLUSTER[1],
    ]


@pytest.mark.parametrize("block_order", [0, 3])
def test_cluster_registers_dsmem_remote_arrive_and_multicast(cluster_kernel, block_order):
    """A 4 x 2 grid of 2 x 2 clusters (in order, and clusters shuffled): every thread's cluster
    registers; each block reads its next rank's word and writes the next rank's other word
    through mapa and .shared::cluster; every block's thread 0 arrives on rank 0's mbarrier; rank
    0's multicast TMA load reaches the static __shared__ tile of each block of its cluster."""
    data, ids, words, tiles = run_cluster(cluster_kernel, block_order=block_order)
    for by in range(GRID[1]):
        for bx in range(GRID[0]):
            block = bx + GRID[0] * by
            want = expected_ids(bx, by)
            np.testing.assert_array_equal(ids[block, :, :10], np.tile(want, (64, 1)))
            np.testing.assert_array_equal(ids[block, :, 10], np.arange(64) % 32)
            rank = want[0]
            # the block of rank r + 1 in the same cluster
            nx = (bx - bx % 2) + (rank + 1) % 4 % 2
            ny = (by - by % 2) + (rank + 1) % 4 // 2
            assert words[block, 0] == 100 * ((rank + 1) % 4) + nx + GRID[0] * ny
            assert words[block, 1] == (rank + 3) % 4
            assert words[block, 2] == (rank == 0)
            tile = data[4 * (by // 2) : 4 * (by // 2) + 4, 64 * (bx // 2) : 64 * (bx // 2) + 64]
            np.testing.assert_array_equal(tiles[block].view(np.uint16).reshape(4, 64), tile)


def test_wrong_multicast_mask_deadlocks_naming_the_mbarrier(cluster_kernel):
    """The multicast leaves out the last rank: its mbarrier waits for 512 bytes forever."""
    with pytest.raises(EmulatorTimeoutError, match=r"cluster of blocks .*512 transaction bytes"):
        run_cluster(cluster_kernel, mode=1, timeout=2.0)


def test_a_barrier_reached_from_another_block_before_a_cluster_barrier_fails(
    cluster_kernel, monkeypatch
):
    """mbarrier.init, then only __syncthreads: another block's remote arrival or multicast is a
    hazard when it comes after the initialisation (no barrier.cluster orders the two, whatever
    the emulator's order) and a trap when it comes before; four fixed schedules, every one
    fails, and the hazard shows."""
    messages = []
    for seed in range(1, 5):
        monkeypatch.setenv("KG_EMULATOR_SCHEDULE_SEED", str(seed))
        with pytest.raises((HazardError, EmulatorLaunchError)) as raised:
            run_cluster(cluster_kernel, mode=3)
        messages.append(str(raised.value))
    hazard = "with no barrier.cluster between that block's mbarrier.init and this thread"
    assert any(hazard in m for m in messages), messages
    assert all(hazard in m or "was not initialized (mbarrier.init)" in m for m in messages)


def test_cluster_wait_without_arrive_traps(cluster_kernel):
    with pytest.raises(
        EmulatorLaunchError, match=r"barrier\.cluster\.wait without a barrier\.cluster\.arrive"
    ):
        run_cluster(cluster_kernel, mode=2)


def test_cluster_launch_checks(cluster_kernel):
    data, ids, words, tiles = run_cluster(cluster_kernel)
    tmap = encode_tensor_map_tiled("uint16", 2, data, (128, 8), (256,), (64, 4), (1, 1))
    args = [tmap, ids, words, tiles, 0]
    with pytest.raises(EmulatorArgumentError, match="not a multiple of the cluster"):
        cluster_kernel(grid=(3, 2), block=64, args=args, cluster=(2, 1))
    with pytest.raises(EmulatorArgumentError, match="at most 8 blocks"):
        cluster_kernel(grid=(16, 1), block=64, args=args, cluster=(16, 1))


DIMS_SRC = r"""
extern "C" __global__ void __cluster_dims__(2, 1, 1) dims_probe(unsigned* out) {
  __shared__ unsigned mine;
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  if (threadIdx.x == 0) mine = 10 + rank;
  __cluster_barrier_arrive();
  __cluster_barrier_wait();
  const unsigned* other = static_cast<const unsigned*>(__cluster_map_shared_rank(&mine, rank ^ 1));
  if (threadIdx.x == 0) out[blockIdx.x] = *other + 100 * __clusterRelativeBlockRank();
  __cluster_barrier_arrive();
  __cluster_barrier_wait();
}
"""


def test_cluster_dims_attribute_and_cuda_cluster_functions():
    """__cluster_dims__ sets the kernel's cluster shape (a launch may not ask for another);
    CUDA's __cluster_map_shared_rank reaches the other block's static __shared__ variable."""
    kernel = build_kernel(DIMS_SRC, "dims_probe", [("unsigned*", "out")])
    assert kernel.cluster_dims == (2, 1, 1)
    out = np.zeros(4, np.uint32)
    kernel(grid=4, block=32, args=[out])
    np.testing.assert_array_equal(out, [11, 110, 11, 110])
    with pytest.raises(EmulatorArgumentError, match=r"differs from the kernel's __cluster_dims__"):
        kernel(grid=4, block=32, args=[out], cluster=(4, 1, 1))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("mov.u32 %0, %%smid;", r"%smid is not a register declared in the asm block nor a special"),
        ("mov.u32 %0, %%clusterid;", r"special register %clusterid needs \.x, \.y or \.z"),
        ("mapa.shared::cluster.u32 %0, %1;", r"expected operands 'd a rank'"),
        (
            "mbarrier.arrive.shared::cluster.b64 %0, [%1];",
            r"an arrive on a \.shared::cluster mbarrier returns no state",
        ),
    ],
)
def test_cluster_forms_refused_loudly(text, message):
    src = (
        "__device__ void f(unsigned long long& s, unsigned a) {\n"
        f'  asm volatile("{text}" : "=l"(s) : "r"(a));\n}}\n'
    )
    with pytest.raises(EmulatorSourceError, match=rf"line 2: .*{message}"):
        transform_source(src)


def test_mutation_multicast_to_one_block_is_caught(mutated):  # noqa: F811
    """The emulator writing a multicast box only into the first destination block: the other
    blocks' tiles keep the garbage fill (their mbarriers still complete)."""
    mutated(
        "kg_tma.h",
        "cta_shared_bytes(*t.cta[k], at, esz, esz,",
        "cta_shared_bytes(*t.cta[0], at, esz, esz,",
    )
    kernel = build_kernel(CLUSTER_SRC, "cluster_probe", CLUSTER_PARAMS)
    with pytest.raises(AssertionError):
        test_cluster_registers_dsmem_remote_arrive_and_multicast(kernel, 0)


def test_mutation_remote_init_order_unchecked_is_caught(mutated, monkeypatch):  # noqa: F811
    """The emulator no longer asking for a barrier.cluster between another block's mbarrier.init
    and a remote access: the probe's runs that reach the barriers after their initialisation
    pass, so the test above fails."""
    mutated(
        "kg_mbarrier.h",
        "&C != tctx().cta && cluster_passed() <= b.init_cluster_phase",
        "false && cluster_passed() <= b.init_cluster_phase",
    )
    kernel = build_kernel(CLUSTER_SRC, "cluster_probe", CLUSTER_PARAMS)
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        test_a_barrier_reached_from_another_block_before_a_cluster_barrier_fails(
            kernel, monkeypatch
        )


VECTOR_SRC = (
    COMMON
    + r"""
// st / ld .shared vectors (.v2, .v4 of 32- and 64-bit elements): element i at address + i *
// element size; an ld.shared.v2.b64 reads back what two st.shared.v4.b32 wrote.
extern "C" __global__ void vector_probe(const unsigned* in, unsigned* out) {
  __shared__ __align__(16) unsigned words[8];
  if (threadIdx.x != 0) return;
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" :: "r"(smem_u32(words)), "r"(in[0]),
               "r"(in[1]), "r"(in[2]), "r"(in[3]) : "memory");
  asm volatile("st.shared.v2.u64 [%0], {%1, %2};" :: "r"(smem_u32(words + 4)),
               "l"(static_cast<unsigned long long>(in[5]) << 32 | in[4]),
               "l"(static_cast<unsigned long long>(in[7]) << 32 | in[6]) : "memory");
  unsigned long long a, b;
  unsigned w[4];
  asm volatile("ld.shared.v2.b64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "r"(smem_u32(words)));
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(smem_u32(words + 4)));
  out[0] = unsigned(a);
  out[1] = unsigned(a >> 32);
  out[2] = unsigned(b);
  out[3] = unsigned(b >> 32);
  for (int i = 0; i < 4; ++i) out[4 + i] = w[i];
}
"""
)


def test_vector_ld_st_shared_move_elements_in_order():
    """st/ld.shared with .v2/.v4 (the wgmma kernel zeroes V rows with st.shared.v4.b32): the
    elements land at consecutive addresses, the first lowest (the PTX ISA's vector forms)."""
    kernel = build_kernel(
        VECTOR_SRC, "vector_probe", [("const unsigned*", "in"), ("unsigned*", "out")]
    )
    values = np.array([0x11111111 * (i + 1) for i in range(8)], np.uint32)
    out = np.zeros(8, np.uint32)
    kernel(grid=1, block=32, args=[values, out])
    np.testing.assert_array_equal(out, values)
