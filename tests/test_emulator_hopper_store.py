"""stmatrix and TMA stores in the CPU emulator.

The layouts are decoded here from the PTX ISA's definitions, written independently of the
emulator's C++: stmatrix's fragment (each lane holds a row fragment of every 8x8 matrix, the
transposed matrix with .trans, as ldmatrix defines it) and the TMA box written in box order
with the map's swizzle (test_emulator_hopper's model). Each check has a mutation of the kernel
the emulator must catch (a hazard), and a mutation of the emulator the probes catch.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_emulator_hopper import COMMON, SWIZZLE_SPAN, mutated, swizzle  # noqa: F401 (mutated: a fixture)

from kernelgen.emulator import (
    EmulatorSourceError,
    HazardError,
    build_kernel,
    encode_tensor_map_tiled,
    transform_source,
)

pytestmark = pytest.mark.emulate

VARIANTS = [(n, trans) for trans in (False, True) for n in (1, 2, 4)]


def stmatrix_image(regs: np.ndarray, rows: np.ndarray, n: int, trans: bool) -> dict[int, int]:
    """{byte offset: 16-bit value} that stmatrix.xN{.trans} writes: lane l holds, in register i,
    matrix i's elements (l / 4, 2 (l % 4) + h) (h = 0 the low half), or with .trans the elements
    (2 (l % 4) + h, l / 4); lane 8i + r gives the address of row r of matrix i."""
    out = {}
    for lane in range(32):
        for i in range(n):
            for h in range(2):
                value = (int(regs[lane, i]) >> (16 * h)) & 0xFFFF
                r, c = (lane // 4, 2 * (lane % 4) + h)
                if trans:
                    r, c = c, r
                out[int(rows[8 * i + r]) + 2 * c] = value
    return out


STMATRIX_SRC = (
    COMMON
    + r"""
// Warp 0 stores the registers `regs` (4 per lane) with stmatrix variant `variant`, rows at
// `rows`; warp 1 loads them back with the same ldmatrix variant. mode: 0 __syncthreads between,
// 1 a named barrier of the two warps, 2 nothing between (a race), 3 warp 1 reads first, then
// warp 0 overwrites with no barrier between, 4 stmatrix with a generic address.
extern "C" __global__ void stm_probe(const unsigned* regs, const int* rows, unsigned* back,
                                     unsigned char* image, int variant, int mode) {
  extern __shared__ __align__(128) unsigned char smem[];
  for (int i = threadIdx.x; i < 1024; i += blockDim.x) smem[i] = 0;
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned addr = smem_u32(smem + rows[lane]);
  unsigned r[4] = {0, 0, 0, 0};
  if (warp == 1 && mode == 3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];" : "=r"(r[0]) : "r"(addr));
  }
  if (warp == 0) {
    const unsigned* v = regs + 4 * lane;
    switch (variant) {
      case 0: asm volatile("stmatrix.sync.aligned.m8n8.x1.shared.b16 [%0], {%1};"
                           :: "r"(addr), "r"(v[0]) : "memory"); break;
      case 1: asm volatile("stmatrix.sync.aligned.x2.m8n8.shared::cta.b16 [%0], {%1, %2};"
                           :: "r"(addr), "r"(v[0]), "r"(v[1]) : "memory"); break;
      case 2:
        if (mode == 4) {
          asm volatile("stmatrix.sync.aligned.m8n8.x4.b16 [%0], {%1, %2, %3, %4};"
                       :: "l"(smem + rows[lane]), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
                       : "memory");
        } else {
          asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                       :: "r"(addr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]) : "memory");
        }
        break;
      case 3: asm volatile("stmatrix.sync.aligned.m8n8.x1.trans.shared.b16 [%0], {%1};"
                           :: "r"(addr), "r"(v[0]) : "memory"); break;
      case 4: asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};"
                           :: "r"(addr), "r"(v[0]), "r"(v[1]) : "memory"); break;
      default: asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                            :: "r"(addr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]) : "memory");
    }
  }
  if (mode == 0 || mode == 4) __syncthreads();
  if (mode == 1) asm volatile("bar.sync 1, 64;" ::: "memory");
  if (warp == 1 && mode != 3) {
    switch (variant) {
      case 0: asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];"
                           : "=r"(r[0]) : "r"(addr)); break;
      case 1: asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
                           : "=r"(r[0]), "=r"(r[1]) : "r"(addr)); break;
      case 2: asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                           : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr)); break;
      case 3: asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];"
                           : "=r"(r[0]) : "r"(addr)); break;
      case 4: asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
                           : "=r"(r[0]), "=r"(r[1]) : "r"(addr)); break;
      default: asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                            : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
    }
    for (int i = 0; i < 4; ++i) back[4 * lane + i] = r[i];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 1024; i += blockDim.x) image[i] = smem[i];
}
"""
)
STMATRIX_PARAMS = [
    ("const unsigned*", "regs"),
    ("const int*", "rows"),
    ("unsigned*", "back"),
    ("unsigned char*", "image"),
    ("int", "variant"),
    ("int", "mode"),
]


@pytest.fixture(scope="module")
def stm_kernel():
    return build_kernel(STMATRIX_SRC, "stm_probe", STMATRIX_PARAMS)


def run_stmatrix(kernel, variant: int, mode: int = 0, seed: int = 0):
    rng = np.random.default_rng(seed + variant)
    regs = rng.integers(0, 2**32, (32, 4), dtype=np.uint64).astype(np.uint32)
    rows = (16 * rng.permutation(64)[:32]).astype(np.int32)  # 32 distinct rows, any order
    back = np.zeros((32, 4), np.uint32)
    image = np.zeros(1024, np.uint8)
    kernel(grid=1, block=64, shared_mem=1024, args=[regs, rows, back, image, variant, mode])
    return regs, rows, back, image


@pytest.mark.parametrize("variant", range(6))
def test_stmatrix_layout_every_lane(stm_kernel, variant):
    """Every lane's registers land where the PTX ISA's fragment puts them (all 16-bit values
    distinct), nothing else is written, and ldmatrix of the same shape gives them back."""
    n, trans = VARIANTS[variant]
    regs, rows, back, image = run_stmatrix(stm_kernel, variant)
    want = np.zeros(512, np.uint16)
    for offset, value in stmatrix_image(regs, rows, n, trans).items():
        want[offset // 2] = value
    np.testing.assert_array_equal(image.view(np.uint16), want)
    np.testing.assert_array_equal(back[:, :n], regs[:, :n])


def test_stmatrix_generic_address(stm_kernel):
    regs, _, back, _ = run_stmatrix(stm_kernel, 2, mode=4)
    np.testing.assert_array_equal(back, regs)


def test_stmatrix_ordered_by_a_named_barrier(stm_kernel):
    """A named barrier of the two warps orders the write before the other warp's read."""
    regs, _, back, _ = run_stmatrix(stm_kernel, 5, mode=1)
    np.testing.assert_array_equal(back, regs)


@pytest.mark.parametrize("mode", [2, 3])
def test_stmatrix_races_are_hazards(stm_kernel, mode):
    """Another warp's ldmatrix with no barrier after the stmatrix, or a stmatrix over a row
    another warp read with no barrier between, whatever the thread timing."""
    for _ in range(2):
        with pytest.raises(
            HazardError,
            match=r"thread \d+ writes .* and thread \d+ reads .* "
            "with no barrier ordering them",
        ):
            run_stmatrix(stm_kernel, 2, mode=mode)


def test_stmatrix_forms_refused_loudly():
    bad = {
        "stmatrix.sync.aligned.m16n8.x4.trans.shared.b8 [%0], {%1, %2, %3, %4};": "unknown .m16n8",
        "stmatrix.sync.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};": "lacks .aligned",
        "stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2};": "expected operands",
    }
    for text, message in bad.items():
        src = (
            "__device__ void f(unsigned a, unsigned b, unsigned c, unsigned d, unsigned e) {\n"
            f'  asm volatile("{text}" :: "r"(a), "r"(b), "r"(c), "r"(d), "r"(e));\n}}\n'
        )
        with pytest.raises(EmulatorSourceError, match=rf"line 2: .*{message}"):
            transform_source(src)


# ---- TMA stores and reductions ------------------------------------------------------------------


def tma_store_asm(rank: int, op: str = "") -> str:
    coords = ", ".join(f"%{1 + i}" for i in range(rank))
    ins = ", ".join(f'"r"(c[{i}])' for i in range(rank))
    opcode = (
        f"cp.async.bulk.tensor.{rank}d.global.shared::cta.bulk_group"
        if not op
        else f"cp.reduce.async.bulk.tensor.{rank}d.global.shared::cta.{op}.tile.bulk_group"
    )
    return (
        f'asm volatile("{opcode} [%0, {{{coords}}}], [%{1 + rank}];" '
        f':: "l"(&tmap), {ins}, "r"(src) : "memory");'
    )


TMA_STORE_SRC = (
    COMMON
    + r"""
// The image goes into shared memory (plain stores), then thread 0 writes the box at `coords`
// with a TMA store (op 0, rank 1..5) or a reduction (op 1 add, 2 min, 3 max; 2d), or the first
// `bytes` to `plain` with cp.async.bulk (op 4), each in its own bulk async-group. `seen`: what
// thread 0 reads of plain[0] before and after the wait (op 4).
extern "C" __global__ void tma_store(const __grid_constant__ CUtensorMap tmap,
                                     const unsigned char* image, int bytes, const int* coords,
                                     int rank, int op, unsigned* plain, unsigned* seen) {
  extern __shared__ __align__(1024) unsigned char smem[];
  for (int i = threadIdx.x; i < bytes; i += blockDim.x) smem[i] = image[i];
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t src = smem_u32(smem);
    const int* c = coords;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    if (op == 0) {
      switch (rank) {
        case 1: """
    + tma_store_asm(1)
    + " break;\n        case 2: "
    + tma_store_asm(2)
    + " break;\n        case 3: "
    + tma_store_asm(3)
    + " break;\n        case 4: "
    + tma_store_asm(4)
    + " break;\n        default: "
    + tma_store_asm(5)
    + r"""
      }
    } else if (op == 1) {
      """
    + tma_store_asm(2, "add")
    + r"""
    } else if (op == 2) {
      """
    + tma_store_asm(2, "min")
    + r"""
    } else if (op == 3) {
      """
    + tma_store_asm(2, "max")
    + r"""
    } else {
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   :: "l"(plain), "r"(src), "r"(bytes) : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    seen[0] = *reinterpret_cast<volatile unsigned*>(plain);
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    seen[1] = *reinterpret_cast<volatile unsigned*>(plain);
  }
}
"""
)
TMA_STORE_PARAMS = [
    ("const __grid_constant__ CUtensorMap", "tmap"),
    ("const unsigned char*", "image"),
    ("int", "bytes"),
    ("const int*", "coords"),
    ("int", "rank"),
    ("int", "op"),
    ("unsigned*", "plain"),
    ("unsigned*", "seen"),
]


@pytest.fixture(scope="module")
def store_kernel():
    return build_kernel(TMA_STORE_SRC, "tma_store", TMA_STORE_PARAMS)


def box_positions(dims, box, estrides, coords):
    """Per element of a box in box order (innermost first): its tensor index (outermost first)
    and whether it lies inside the tensor."""
    counts = [-(-b // e) for b, e in zip(box, estrides, strict=True)]
    for linear in range(int(np.prod(counts))):
        rest, at = linear, []
        for count, start, step in zip(counts, coords, estrides, strict=True):
            at.append(start + (rest % count) * step)
            rest //= count
        inside = all(0 <= c < d for c, d in zip(at, dims, strict=True))
        yield linear, tuple(at[::-1]), inside


def expected_store(tensor, image, dims, box, estrides, coords, span, op):
    """The tensor after a TMA store (op "") or reduction of the box read from the shared image
    (element e at the swizzled byte address e * size): elements outside the tensor are not
    written."""
    out = tensor.copy()
    esz = tensor.dtype.itemsize
    for linear, index, inside in box_positions(dims, box, estrides, coords):
        if not inside:
            continue
        at = swizzle(linear * esz, span)
        value = np.frombuffer(image[at : at + esz].tobytes(), tensor.dtype)[0]
        if op == "add":
            value = out[index] + value
        elif op in ("min", "max"):
            value = getattr(np, f"{op}imum")(out[index], value)
        out[index] = value
    return out


STORE_CASES = [
    # dtype, dims (innermost first), box, element strides, swizzle, coords, op
    ("uint16", (100, 70), (64, 16), (1, 1), "128B", (40, 60), ""),
    ("uint16", (48, 9), (32, 8), (1, 1), "64B", (-8, -3), ""),
    ("float32", (8, 5, 3), (8, 4, 2), (1, 1, 1), "32B", (0, 2, 2), ""),
    ("uint8", (40,), (32,), (1,), "none", (20,), ""),
    ("float16", (8, 3, 2, 3, 2), (8, 2, 2, 2, 2), (1, 2, 1, 1, 1), "none", (0, 1, 1, 2, 1), ""),
    ("float32", (40, 20), (16, 8), (1, 1), "none", (30, 15), "add"),
    ("float16", (64, 20), (64, 8), (1, 1), "128B", (0, -2), "add"),
    ("float32", (16, 8), (16, 8), (1, 1), "64B", (0, 0), "min"),
    ("float32", (16, 8), (16, 8), (1, 1), "64B", (0, 0), "max"),
]
OPS = {"": 0, "add": 1, "min": 2, "max": 3}


@pytest.mark.parametrize(
    "case", STORE_CASES, ids=[f"{c[0]}-{len(c[1])}d-{c[4]}-{c[6]}" for c in STORE_CASES]
)
def test_tma_store_boxes(store_kernel, case):
    """cp.async.bulk.tensor.Nd.global.shared::cta stores the box the tiled mode defines (element
    strides, each swizzle's byte permutation of the shared source) and skips the elements outside
    the tensor; cp.reduce.async.bulk.tensor adds (min, max) them into it."""
    dtype, dims, box, estrides, swz, coords, op = case
    rng = np.random.default_rng(len(dims) + len(op))
    esz = np.dtype(dtype).itemsize
    padded = -(-dims[0] * esz // 16) * 16 // esz  # rows a multiple of 16 bytes
    full = rng.integers(0, 50, (*dims[:0:-1], padded)).astype(dtype)
    tensor = full[..., : dims[0]]
    strides = [full.strides[len(dims) - 1 - i] for i in range(1, len(dims))]
    before = full.copy()
    tmap = encode_tensor_map_tiled(
        dtype, len(dims), full, dims, strides, box, estrides, swizzle=swz
    )
    counts = [-(-b // e) for b, e in zip(box, estrides, strict=True)]
    nbytes = int(np.prod(counts)) * tensor.dtype.itemsize
    image = rng.integers(0, 50, nbytes // tensor.dtype.itemsize).astype(dtype).view(np.uint8)
    cs = np.zeros(5, np.int32)
    cs[: len(coords)] = coords
    plain = np.zeros(4, np.uint32)
    seen = np.zeros(2, np.uint32)
    args = [tmap, image, nbytes, cs, len(dims), OPS[op], plain, seen]
    store_kernel(grid=1, block=64, shared_mem=max(nbytes, 1024), args=args)
    want = before.copy()
    want[..., : dims[0]] = expected_store(
        before[..., : dims[0]], image, dims, box, estrides, coords, SWIZZLE_SPAN[swz], op
    )
    np.testing.assert_array_equal(full, want)
    assert tensor.base is full


def test_bulk_store_reaches_global_memory_at_the_wait(store_kernel):
    """cp.async.bulk.global.shared::cta copies the bytes; the issuing thread reads the old global
    value before its cp.async.bulk.wait_group and the new one after it."""
    image = (np.arange(16, dtype=np.uint32) + 7).view(np.uint8)
    plain = np.zeros(16, np.uint32)
    seen = np.zeros(2, np.uint32)
    tmap = encode_tensor_map_tiled("float32", 1, plain, (16,), (), (16,), (1,))
    store_kernel(
        grid=1,
        block=64,
        shared_mem=1024,
        args=[tmap, image, 64, np.zeros(5, np.int32), 1, 4, plain, seen],
    )
    np.testing.assert_array_equal(plain.view(np.uint8), image)
    assert seen[0] == 0 and seen[1] == plain[0]


# Warp 1 writes a 64 x 4 bf16 tile by stmatrix (32 rows of 16 bytes, one per lane), fences and
# meets thread 0 at a named barrier; thread 0 stores it to rows 0..3 with a TMA store and waits
# for the read; after a __syncthreads warp 1 writes the second tile into the same buffer, which
# thread 0 stores to rows 4..7 (an epilogue reusing its staging buffer). mode (mutations):
# 1 no fence.proxy.async after the first stmatrix, 2 no named barrier before the first store,
# 3 no cp.async.bulk.wait_group.read before the refill, 4 no __syncthreads between the wait and
# the refill, 5 thread 0 overwrites the source (plain store) before the wait, 6 the fence is
# executed by thread 0, not by the writers, 7 thread 0 leaves without waiting for the second
# store (its read may outlive the block's shared memory).
STORE_HAZARD_SRC = (
    COMMON
    + r"""
__device__ void fill(const unsigned* words, uint32_t src) {
  const int lane = threadIdx.x % 32;
  uint32_t r[4];
  for (int i = 0; i < 4; ++i) r[i] = words[(8 * i + lane / 4) * 4 + lane % 4];
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
               :: "r"(src + 16 * lane), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
__device__ void store_rows(const CUtensorMap* tmap, uint32_t src, int row) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%1, %2}], [%3];"
               :: "l"(tmap), "r"(0), "r"(row), "r"(src) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
extern "C" __global__ void store_hazard(const __grid_constant__ CUtensorMap tmap,
                                        const unsigned* tiles, int mode) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t src = smem_u32(smem);
  const int warp = threadIdx.x / 32;
  if (warp == 1) {
    fill(tiles, src);
    if (mode != 1 && mode != 6) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  if (mode == 6 && threadIdx.x == 0) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  if (mode != 2) asm volatile("bar.sync 1, 64;" ::: "memory");
  if (threadIdx.x == 0) {
    store_rows(&tmap, src, 0);
    if (mode == 5) smem[0] ^= 1;
    if (mode != 3) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  }
  if (mode != 4) __syncthreads();
  if (warp == 1) {
    fill(tiles + 128, src);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  asm volatile("bar.sync 1, 64;" ::: "memory");
  if (threadIdx.x == 0) {
    store_rows(&tmap, src, 4);
    if (mode != 7) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
}
"""
)


@pytest.fixture(scope="module")
def hazard_kernel():
    params = [
        ("const __grid_constant__ CUtensorMap", "tmap"),
        ("const unsigned*", "tiles"),
        ("int", "mode"),
    ]
    return build_kernel(STORE_HAZARD_SRC, "store_hazard", params)


def run_store_hazard(kernel, mode: int = 0):
    rng = np.random.default_rng(5)
    tiles = rng.integers(0, 2**16, (2, 4, 64)).astype(np.uint16)
    out = np.zeros((8, 64), np.uint16)
    tmap = encode_tensor_map_tiled("bfloat16", 2, out, (64, 8), (128,), (64, 4), (1, 1))
    kernel(grid=1, block=64, shared_mem=1024, args=[tmap, tiles.view(np.uint32), mode], timeout=20)
    return tiles, out


def test_tma_store_epilogue_reusing_its_buffer(hazard_kernel):
    """stmatrix, fence.proxy.async and a named barrier before the store, wait_group.read and a
    barrier before the buffer is written again: both tiles arrive, no hazard."""
    for _ in range(3):  # thread timing differs between runs; each must pass
        tiles, out = run_store_hazard(hazard_kernel)
        np.testing.assert_array_equal(out, tiles.reshape(8, 64))


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (1, r"wrote by stmatrix or st\.shared with no fence\.proxy\.async after the write"),
        (2, r"no barrier ordering the write|still reads it|no barrier orders that thread"),
        (3, r"stmatrix writes shared 0x[0-9a-f]+ while a TMA store of thread 0 still reads it"),
        (4, r"no barrier orders that thread|still reads it|no barrier ordering the write"),
        (5, r"changed between its issue and the cp\.async\.bulk\.wait_group\.read"),
        (6, r"wrote by stmatrix or st\.shared with no fence\.proxy\.async after the write"),
        (7, r"leaves the kernel with 1 TMA store\(s\) still reading shared memory"),
    ],
)
def test_tma_store_hazards(hazard_kernel, mode, message):
    """Each missing fence, barrier or wait of the epilogue is reported, whatever the timing."""
    for _ in range(2):
        with pytest.raises(HazardError, match=message):
            run_store_hazard(hazard_kernel, mode)


def test_mutations_of_the_emulator_are_caught(mutated):  # noqa: F811
    """One build of the emulator with three edits, each caught by its probe: stmatrix .trans
    taking the wrong half of a register, TMA stores reading the shared source unswizzled, and
    the fence.proxy.async check of stmatrix writes skipped."""
    mutated("kg_ptx.h", "const int high = Trans ? r % 2 : col % 2;", "const int high = col % 2;")
    mutated(
        "kg_tma.h",
        "swizzle_address(op.src + static_cast<uint32_t>(e * esz), op.box.span)",
        "swizzle_address(op.src + static_cast<uint32_t>(e * esz), 0)",
    )
    mutated(
        "kg_ptx.h",
        "if (!w.any || PointStamp::of(sh.fence.load()).before_me()) return;",
        "if (true) return;",
    )
    stm = build_kernel(STMATRIX_SRC, "stm_probe", STMATRIX_PARAMS)
    with pytest.raises(AssertionError):
        test_stmatrix_layout_every_lane(stm, 5)
    store = build_kernel(TMA_STORE_SRC, "tma_store", TMA_STORE_PARAMS)
    with pytest.raises(AssertionError):
        test_tma_store_boxes(store, STORE_CASES[0])
    hazard = build_kernel(
        STORE_HAZARD_SRC,
        "store_hazard",
        [
            ("const __grid_constant__ CUtensorMap", "tmap"),
            ("const unsigned*", "tiles"),
            ("int", "mode"),
        ],
    )
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        test_tma_store_hazards(hazard, 1, "fence")


def test_mutation_leaving_before_the_read_wait_unreported_is_caught(mutated):  # noqa: F811
    """The emulator without its exit check of TMA stores still reading: mode 7 passes."""
    mutated("kg_tma.h", "if (reading != 0) {", "if (false) {")
    hazard = build_kernel(
        STORE_HAZARD_SRC,
        "store_hazard",
        [
            ("const __grid_constant__ CUtensorMap", "tmap"),
            ("const unsigned*", "tiles"),
            ("int", "mode"),
        ],
    )
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        test_tma_store_hazards(hazard, 7, "leaves the kernel")
