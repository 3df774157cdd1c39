"""Hopper's asynchronous instructions in the CPU emulator: wgmma, mbarrier, TMA.

Every layout is decoded here from the PTX ISA's definitions, written independently of the
emulator's C++: the canonical shared-memory layouts in CuTe notation (shape:stride, then
Swizzle<B,4,3> on byte addresses), the accumulator fragment of m64nNk16, the register-A
fragment, and the TMA box written in box order with the map's swizzle. Operands are small
integers, so the products are exact and results compare for equality with NumPy. Each check has
a mutation of the kernel the emulator must catch (a hazard or wrong numbers).
"""

from __future__ import annotations

import numpy as np
import pytest

from kernelgen.emulator import (
    EmulatorArgumentError,
    EmulatorLaunchError,
    EmulatorSourceError,
    HazardError,
    build_kernel,
    encode_tensor_map_tiled,
    transform_source,
)

pytestmark = pytest.mark.emulate

SWIZZLE_SPAN = {"none": 0, "32B": 32, "64B": 64, "128B": 128}
DESC_MODE = {0: 0, 128: 1, 64: 2, 32: 3}  # descriptor bits 62-63 by swizzle span


# ---- the PTX ISA's definitions, in NumPy ------------------------------------------------------


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns of small integers (exact: the top half of their float32 bits)."""
    return np.ascontiguousarray((np.asarray(x, np.float32).view(np.uint32) >> 16), np.uint16)


def swizzle(addr: int, span: int) -> int:
    """CuTe's Swizzle<B,4,3> on a byte address, B = log2(span / 16): bits 7..7+B-1 XOR into
    bits 4..4+B-1 (the identity without a swizzle)."""
    if span == 0:
        return addr
    bits = (span // 16).bit_length() - 1
    mask = ((1 << bits) - 1) << 7
    return addr ^ ((addr & mask) >> 3)


def cute(shape: tuple[int, ...], stride: tuple[int, ...], index: int) -> int:
    """Offset of ``index`` in a flat CuTe mode shape:stride (first sub-mode fastest)."""
    off = 0
    for size, step in zip(shape, stride, strict=True):
        off += (index % size) * step
        index //= size
    return off


def canonical(mn_major: bool, span: int, extent_mn: int, lbo: int, sbo: int):
    """(MN mode, K mode) of the PTX ISA's canonical layout of a 16-bit operand for one k16 step,
    in bytes (T = 8 elements = 16 bytes; W = span):
    K-major  none ((8,m),(T,2k)):((1T,SBO),(1,LBO));  W: ((8,m),(T,2k)):((W/2 elem,SBO),(1,T))
    MN-major none ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)); W: ((T,W/16,m),(8,k)):((1,T,LBO),(W,SBO))"""
    if not mn_major:
        mn = ((8, extent_mn // 8), (16 if span == 0 else span, sbo))
        k = ((8, 2), (2, lbo if span == 0 else 16))
    elif span == 0:
        mn = ((8, 1, extent_mn // 8), (2, 16, sbo))
        k = ((8, 2), (16, lbo))
    else:
        mn = ((8, span // 16, extent_mn // (span // 2)), (2, 16, lbo))
        k = ((8, 2), (span, sbo))
    return mn, k


def place(image: np.ndarray, base: int, matrix: np.ndarray, layout) -> None:
    """Write ``matrix`` (extent_mn x 16, bf16 bits) into the byte image at ``base`` through
    ``layout`` and the swizzle of ``span``, its pattern starting at ``base``."""
    (mn_shape, mn_stride), (k_shape, k_stride), span = layout
    for i in range(matrix.shape[0]):
        for kk in range(16):
            logical = cute(mn_shape, mn_stride, i) + cute(k_shape, k_stride, kk)
            at = base + swizzle(logical, span)
            image[at : at + 2] = np.frombuffer(matrix[i, kk].tobytes(), np.uint8)


def descriptor(start: int, lbo: int, sbo: int, span: int, base_offset: int = 0) -> int:
    """The 64-bit matrix descriptor (PTX ISA "Matrix Descriptor Format")."""
    enc = lambda x: (x & 0x3FFFF) >> 4  # noqa: E731
    return (
        enc(start)
        | enc(lbo) << 16
        | enc(sbo) << 32
        | (base_offset & 7) << 49
        | DESC_MODE[span] << 62
    )


def accumulator_positions(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of D held by thread t, register r of an m64nNk16 f32 wgmma (PTX ISA figure
    "WGMMA .m64nNk16 register fragment layout for accumulator matrix D"): warp w = t / 32 owns
    rows 16w..16w+15; within it the mma.sync m16n8 C layout repeats every 8 columns."""
    t = np.arange(128)[:, None]
    r = np.arange(n // 2)[None, :]
    w, lane = t // 32, t % 32
    row = 16 * w + lane // 4 + 8 * ((r % 4) // 2)
    col = 8 * (r // 4) + 2 * (lane % 4) + r % 2
    return row, col


def decode(out: np.ndarray, n: int) -> np.ndarray:
    """The 64 x n matrix D from the per-thread registers ``out`` (128 x n/2)."""
    row, col = accumulator_positions(n)
    d = np.full((64, n), np.nan)
    d[row, col] = out.reshape(128, n // 2)
    return d


# ---- kernels -----------------------------------------------------------------------------------

COMMON = r"""
#include <cuda.h>
#include <cstdint>
__device__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ void wait_phase(uint32_t bar, uint32_t phase) {
  uint32_t done;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
                 "selp.b32 %0, 1, 0, p; }" : "=r"(done) : "r"(bar), "r"(phase) : "memory");
  } while (!done);
}
"""


def wgmma_ss(n: int, elem: str = "bf16") -> str:
    """A device function template: one m64nNk16 wgmma from two descriptors (CUTLASS's operand
    style: scale-d through a predicate set from a "r" operand, the immediates as "n")."""
    regs = ", ".join(f"%{i}" for i in range(n // 2))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n // 2))
    h = n // 2
    return f"""
template <int TA, int TB, int SA>
__device__ void wgmma_ss_{n}(float* d, uint64_t da, uint64_t db, int scale_d) {{
  asm volatile("{{\\n .reg .pred p;\\n setp.ne.b32 p, %{h + 2}, 0;\\n"
               "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{elem}.{elem} {{{regs}}}, %{h}, "
               "%{h + 1}, p, %{h + 3}, 1, %{h + 4}, %{h + 5};\\n}}\\n"
               : {outs}
               : "l"(da), "l"(db), "r"(scale_d), "n"(SA), "n"(TA), "n"(TB));
}}
"""


def wgmma_rs(n: int, elem: str = "bf16") -> str:
    regs = ", ".join(f"%{i}" for i in range(n // 2))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n // 2))
    h = n // 2
    return f"""
__device__ void wgmma_rs_{n}(float* d, const uint32_t* a, uint64_t db, int scale_d) {{
  asm volatile("{{ .reg .pred p; setp.ne.b32 p, %{h + 5}, 0; "
               "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{elem}.{elem} {{{regs}}}, "
               "{{%{h}, %{h + 1}, %{h + 2}, %{h + 3}}}, %{h + 4}, p, 1, 1, 0; }}"
               : {outs}
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}}
"""


FENCE = 'asm volatile("wgmma.fence.sync.aligned;" ::: "memory");'
COMMIT = 'asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");'
WAIT0 = 'asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");'


def probe_source(n: int, elem: str = "bf16") -> str:
    """Shared memory from a byte image, one wgmma per k step, the registers out. ``mutation``:
    1 no wait_group, 2 an accumulator written in flight, 3 operand memory overwritten in flight,
    4 no wgmma.fence, 5 different descriptors in different warps."""
    calls = "\n".join(
        f"  else if (ta == {ta} && tb == {tb} && neg == {sa}) "
        f"wgmma_ss_{n}<{ta}, {tb}, {-1 if sa else 1}>(d, descs[2 * s] + skew, descs[2 * s + 1], "
        "scale_d || s > 0);"
        for ta in (0, 1)
        for tb in (0, 1)
        for sa in (0, 1)
    )
    return (
        COMMON
        + wgmma_ss(n, elem)
        + f"""
extern "C" __global__ void probe_{n}(const unsigned char* image, int image_bytes,
    const unsigned long long* descs, int steps, const float* c, float* out, int ta, int tb,
    int neg, int scale_d, int mutation) {{
  extern __shared__ __align__(1024) unsigned char smem[];
  for (int i = threadIdx.x; i < image_bytes; i += blockDim.x) smem[i] = image[i];
  __syncthreads();
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  float d[{n // 2}];
  for (int r = 0; r < {n // 2}; ++r) d[r] = c[threadIdx.x * {n // 2} + r];
  // mutation 5: warps 1..3 see A 32 bytes further on (per-warp descriptors are not allowed)
  const unsigned long long skew = mutation == 5 && threadIdx.x >= 32 ? 2 : 0;
  if (mutation != 4) {FENCE}
  for (int s = 0; s < steps; ++s) {{
    if (false) {{}}
{calls}
  }}
  {COMMIT}
  if (mutation == 2) d[1] = 0.f;
  if (mutation == 3) {{ __syncthreads(); if (threadIdx.x == 0) smem[0] ^= 0x40; }}
  if (mutation != 1) {WAIT0}
  for (int r = 0; r < {n // 2}; ++r) out[threadIdx.x * {n // 2} + r] = d[r];
}}
"""
    )


PROBE_PARAMS = [
    ("const unsigned char*", "image"),
    ("int", "image_bytes"),
    ("const unsigned long long*", "descs"),
    ("int", "steps"),
    ("const float*", "c"),
    ("float*", "out"),
    ("int", "ta"),
    ("int", "tb"),
    ("int", "neg"),
    ("int", "scale_d"),
    ("int", "mutation"),
]


@pytest.fixture(scope="module")
def probe64():
    return build_kernel(probe_source(64), "probe_64", PROBE_PARAMS)


def operand_layout(mn_major: bool, span: int, extent_mn: int):
    """A canonical layout with strides no dense tile has (gaps), so that a descriptor field the
    emulator ignores or misplaces shows: (layout, lbo, sbo, bytes used)."""
    if not mn_major:
        if span == 0:
            lbo, sbo = 128, 384  # 2 core matrices along K, 3 core-matrix slots per 8 rows
            used = sbo * (extent_mn // 8)
        else:
            lbo, sbo = 0x3FF0, 2 * 8 * span  # LBO unused (garbage); a gap between 8-row groups
            used = sbo * (extent_mn // 8)
    elif span == 0:
        lbo, sbo = 128, 512  # K groups interleaved inside 8-column groups 512 bytes apart
        used = sbo * (extent_mn // 8)
    else:
        atoms = extent_mn // (span // 2)
        lbo, sbo = 8 * span, 8 * span * (atoms + 1)  # K groups after the atoms, plus a gap
        used = 2 * sbo
    mn, k = canonical(mn_major, span, extent_mn, lbo, sbo)
    return (mn, k, span), lbo, sbo, used


def run_probe(
    kernel,
    n,
    a,
    b,
    ta,
    tb,
    span,
    *,
    neg=0,
    scale_d=0,
    c=None,
    mutation=0,
    bits=bf16_bits,
    shift=0,
):
    """D of ``steps`` k16 wgmmas: a (64 x 16 steps) and b (16 steps x n) placed per step in the
    canonical layout (K-major, or MN-major for ta / tb), each operand region 1024-aligned plus
    ``shift`` bytes (a multiple of 128: the descriptors then carry the base offset)."""
    steps = a.shape[1] // 16
    image_size = 0
    descs = []
    image = np.full(1 << 16, 0xFF, np.uint8)  # bf16 NaN where nothing was placed
    for s in range(steps):
        a_step = a[:, 16 * s : 16 * s + 16]  # (m, k)
        b_step = b[16 * s : 16 * s + 16, :].T  # (n, k)
        for operand, mn_major, extent in ((a_step, ta, 64), (b_step, tb, n)):
            layout, lbo, sbo, used = operand_layout(bool(mn_major), span, extent)
            base = image_size + shift
            place(image, base, bits(operand), layout)
            base_offset = ((0x400 + base) >> 7) & 7 if span else 0
            descs.append(descriptor(0x400 + base, lbo, sbo, span, base_offset))
            image_size = base + -(-used // 1024) * 1024
    assert image_size <= image.size
    c = np.zeros((128, n // 2), np.float32) if c is None else c
    out = np.zeros((128, n // 2), np.float32)
    kernel(
        grid=1,
        block=128,
        shared_mem=image_size,
        args=[
            image,
            image_size,
            np.array(descs, np.uint64),
            steps,
            c,
            out,
            ta,
            tb,
            neg,
            scale_d,
            mutation,
        ],
    )
    return decode(out, n)


LAYOUTS = [
    (ta, tb, span) for span in (0, 32, 64, 128) for ta, tb in ((0, 0), (1, 1), (0, 1), (1, 0))
]


@pytest.mark.parametrize(("ta", "tb", "span"), LAYOUTS)
def test_wgmma_descriptor_layouts_and_accumulator_fragment(probe64, ta, tb, span):
    """Every major-ness x swizzle of the PTX ISA's canonical layouts (placed by NumPy through
    CuTe's shape:stride and Swizzle<B,4,3>), two k steps, D decoded through the accumulator
    fragment: exactly A @ B."""
    rng = np.random.default_rng(span + 2 * ta + tb)
    a = rng.integers(-4, 5, (64, 32)).astype(np.float64)
    b = rng.integers(-4, 5, (32, 64)).astype(np.float64)
    np.testing.assert_array_equal(run_probe(probe64, 64, a, b, ta, tb, span), a @ b)


@pytest.mark.parametrize(("n", "elem"), [(8, "f16"), (128, "f16"), (200, "bf16")])
def test_wgmma_other_widths_and_f16(n, elem):
    """m64nNk16 at the smallest N, at N = 128 with f16 inputs, and at an N that is no power of
    two; MN-major A, K-major B, 64B swizzle."""
    kernel = build_kernel(probe_source(n, elem), f"probe_{n}", PROBE_PARAMS)
    rng = np.random.default_rng(n)
    a = rng.integers(-4, 5, (64, 16)).astype(np.float64)
    b = rng.integers(-4, 5, (16, n)).astype(np.float64)
    bits = bf16_bits if elem == "bf16" else (lambda x: np.asarray(x, np.float16).view(np.uint16))
    got = run_probe(kernel, n, a, b, 1, 0, 64 if n % 32 == 0 else 0, bits=bits)
    np.testing.assert_array_equal(got, a @ b)


@pytest.mark.parametrize("span", [32, 64, 128])
def test_wgmma_base_offset(probe64, span):
    """Swizzled tiles whose pattern starts 384 bytes past a 1024-byte boundary, described with
    the PTX ISA's base offset ((pattern start >> 7) & 7): still exactly A @ B."""
    rng = np.random.default_rng(span)
    a = rng.integers(-4, 5, (64, 16)).astype(np.float64)
    b = rng.integers(-4, 5, (16, 64)).astype(np.float64)
    np.testing.assert_array_equal(run_probe(probe64, 64, a, b, 0, 1, span, shift=384), a @ b)


def test_wgmma_needs_a_whole_warpgroup(probe64):
    """A block of 64 threads holds no complete warpgroup: its wgmma traps."""
    image = np.zeros(4096, np.uint8)
    out = np.zeros(64 * 32, np.float32)
    args = [image, 4096, np.zeros(2, np.uint64), 1, out, out, 0, 0, 0, 0, 0]
    with pytest.raises(EmulatorLaunchError, match=r"warpgroup \(threads 0..127\) is not complete"):
        probe64(grid=1, block=64, shared_mem=4096, args=args)


def test_wgmma_accumulate_and_negate(probe64):
    """scale-d 1 adds the accumulators' previous values; imm-scale-a -1 negates A."""
    rng = np.random.default_rng(7)
    a = rng.integers(-4, 5, (64, 16)).astype(np.float64)
    b = rng.integers(-4, 5, (16, 64)).astype(np.float64)
    c = rng.integers(-50, 50, (128, 32)).astype(np.float32)
    got = run_probe(probe64, 64, a, b, 0, 1, 128, neg=1, scale_d=1, c=c)
    np.testing.assert_array_equal(got, -(a @ b) + decode(c, 64))
    overwrite = run_probe(probe64, 64, a, b, 0, 1, 128, neg=0, scale_d=0, c=c)
    np.testing.assert_array_equal(overwrite, a @ b)


def test_wgmma_descriptors_differ_across_the_warpgroup(probe64):
    """Each warp would compute its own rows right, but the PTX ISA requires one descriptor for
    the whole warpgroup: reported."""
    a = np.ones((64, 16))
    with pytest.raises(EmulatorLaunchError, match=r"wgmma.mma_async #0 of warpgroup 0 differs"):
        run_probe(probe64, 64, a, np.ones((16, 64)), 0, 0, 128, mutation=5)


@pytest.mark.parametrize(
    ("mutation", "message"),
    [
        (1, "leaves the kernel with 2 wgmma.mma_async not retired"),
        (2, "accumulator d1 of a wgmma in flight was written"),
        (3, r"shared memory a wgmma reads .* changed between its issue"),
        (4, "without a wgmma.fence"),
    ],
)
def test_wgmma_async_hazards(probe64, mutation, message):
    """A missing wgmma.wait_group, an accumulator written in flight, operand shared memory
    overwritten in flight and a missing wgmma.fence are hazards of the launch."""
    rng = np.random.default_rng(1)
    a = rng.integers(-4, 5, (64, 32)).astype(np.float64)
    b = rng.integers(-4, 5, (32, 64)).astype(np.float64)
    with pytest.raises(HazardError, match=message):
        run_probe(probe64, 64, a, b, 0, 0, 128, mutation=mutation)


def register_a_source(n: int) -> str:
    """A from registers (each thread loads its fragment from global memory by the documented
    layout), B by descriptor; two chained k steps without a wait between them."""
    return (
        COMMON
        + wgmma_rs(n)
        + f"""
__device__ uint32_t pack(uint16_t lo, uint16_t hi) {{ return lo | (uint32_t(hi) << 16); }}
extern "C" __global__ void rs_{n}(const uint16_t* a, const unsigned char* image, int image_bytes,
                                  const unsigned long long* descs, float* out, int mutation) {{
  extern __shared__ __align__(1024) unsigned char smem[];
  for (int i = threadIdx.x; i < image_bytes; i += blockDim.x) smem[i] = image[i];
  __syncthreads();
  const int t = threadIdx.x, w = t / 32, g = (t % 32) / 4, q = t % 4;
  float d[{n // 2}];
  for (int r = 0; r < {n // 2}; ++r) d[r] = 0.f;
  uint32_t frag[2][4];
  for (int s = 0; s < 2; ++s) {{
    const uint16_t* as = a + 16 * s;  // A is 64 x 32, row major
    auto at = [&](int row, int col) {{ return as[(16 * w + row) * 32 + col]; }};
    frag[s][0] = pack(at(g, 2 * q), at(g, 2 * q + 1));
    frag[s][1] = pack(at(g + 8, 2 * q), at(g + 8, 2 * q + 1));
    frag[s][2] = pack(at(g, 2 * q + 8), at(g, 2 * q + 9));
    frag[s][3] = pack(at(g + 8, 2 * q + 8), at(g + 8, 2 * q + 9));
  }}
  {FENCE}
  for (int s = 0; s < 2; ++s) wgmma_rs_{n}(d, frag[s], descs[s], s);
  {COMMIT}
  if (mutation == 1) frag[0][2] ^= 1u;
  {WAIT0}
  for (int r = 0; r < {n // 2}; ++r) out[threadIdx.x * {n // 2} + r] = d[r];
}}
"""
    )


@pytest.fixture(scope="module")
def rs256():
    params = [
        ("const uint16_t*", "a"),
        ("const unsigned char*", "image"),
        ("int", "image_bytes"),
        ("const unsigned long long*", "descs"),
        ("float*", "out"),
        ("int", "mutation"),
    ]
    return build_kernel(register_a_source(256), "rs_256", params)


def run_register_a(kernel, a, b, mutation=0):
    image = np.full(1 << 17, 0xFF, np.uint8)
    descs, size = [], 0
    for s in range(2):
        layout, lbo, sbo, used = operand_layout(False, 64, 256)
        place(image, size, bf16_bits(b[16 * s : 16 * s + 16, :].T), layout)
        descs.append(descriptor(0x400 + size, lbo, sbo, 64))
        size += -(-used // 1024) * 1024
    out = np.zeros((128, 128), np.float32)
    kernel(
        grid=1,
        block=128,
        shared_mem=size,
        args=[bf16_bits(a), image, size, np.array(descs, np.uint64), out, mutation],
    )
    return decode(out, 256)


def test_wgmma_register_a_fragment_n256(rs256):
    """m64n256k16 with A in registers (mma.sync's A fragment per warp) and B K-major 64B
    swizzled: exactly A @ B through the 128-register accumulator fragment; a register-A variable
    overwritten before the wait is a hazard."""
    rng = np.random.default_rng(3)
    a = rng.integers(-4, 5, (64, 32)).astype(np.float64)
    b = rng.integers(-4, 5, (32, 256)).astype(np.float64)
    np.testing.assert_array_equal(run_register_a(rs256, a, b), a @ b)
    with pytest.raises(HazardError, match="register-A operand of a wgmma in flight"):
        run_register_a(rs256, a, b, mutation=1)


# ---- TMA -----------------------------------------------------------------------------------


def tma_load_asm(rank: int) -> str:
    coords = ", ".join(f"%{2 + i}" for i in range(rank))
    ins = ", ".join(f'"r"(c[{i}])' for i in range(rank))
    return (
        f'    case {rank}: asm volatile("cp.async.bulk.tensor.{rank}d.shared::cluster.global.tile'
        f'.mbarrier::complete_tx::bytes [%0], [%1, {{{coords}}}], [%{2 + rank}];" :: "r"(dst), '
        f'"l"(reinterpret_cast<uint64_t>(&tmap)), {ins}, "r"(bar) : "memory"); break;'
    )


TMA_SRC = (
    COMMON
    + r"""
// Two loads on one mbarrier (phases 0 and 1), each box copied out after its wait.
extern "C" __global__ void tma_box(const __grid_constant__ CUtensorMap tmap, const int* coords,
                                   int rank, int bytes, unsigned char* out, int mutation) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t dst = smem_u32(smem), bar = smem_u32(smem + 16384);
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "n"(1));
    asm volatile("prefetch.tensormap [%0];" :: "l"(&tmap));
  }
  __syncthreads();
  for (int load = 0; load < 2; ++load) {
    uint32_t elected = 0, leader = 0;
    asm volatile("{ .reg .pred p; .reg .b32 r; elect.sync r|p, %2; @p mov.b32 %0, 1; "
                 "mov.b32 %1, r; }" : "+r"(elected), "=r"(leader) : "r"(0xffffffffu));
    if (threadIdx.x < 32 && elected) {
      const int* c = coords + 5 * load;
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                   :: "r"(bar), "r"(bytes) : "memory");
      switch (rank) {
"""
    + "\n".join(tma_load_asm(r) for r in range(1, 6))
    + r"""
      }
    }
    __syncthreads();  // issued (the emulator copies at issue): only the wait orders the reads
    if (mutation != 1) wait_phase(bar, load & 1);
    // ldmatrix reads are race-checked: each lane names one 16-byte row of the box (the same
    // number of warp-collective instructions in every lane).
    for (int first = 0; first < bytes / 16; first += blockDim.x) {
      const int row = min(first + static_cast<int>(threadIdx.x), bytes / 16 - 1);
      uint32_t r0, r1, r2, r3;
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                   : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(dst + 16 * row));
    }
    for (int i = threadIdx.x; i < bytes; i += blockDim.x) out[load * bytes + i] = smem[i];
    __syncthreads();
  }
}
"""
)


@pytest.fixture(scope="module")
def tma_kernel():
    params = [
        ("const __grid_constant__ CUtensorMap", "tmap"),
        ("const int*", "coords"),
        ("int", "rank"),
        ("int", "bytes"),
        ("unsigned char*", "out"),
        ("int", "mutation"),
    ]
    return build_kernel(TMA_SRC, "tma_box", params)


def expected_box(tensor, coords, box, estrides, span, nan_bits):
    """The shared-memory image of a TMA box (PTX ISA / CUDA driver API "tiled" mode): elements at
    coords + i * elementStride, innermost dimension first, packed densely, out-of-bounds ones
    zero (or NaN), the byte address then swizzled. ``tensor`` is indexed outermost first."""
    esz = tensor.dtype.itemsize
    dims = tensor.shape[::-1]
    counts = [-(-b // e) for b, e in zip(box, estrides, strict=True)]
    image = np.zeros(int(np.prod(counts)) * esz, np.uint8)
    for linear in range(int(np.prod(counts))):
        rest, at_coord = linear, []
        for count, start, step in zip(counts, coords, estrides, strict=True):
            at_coord.append(start + (rest % count) * step)
            rest //= count
        if all(0 <= c < d for c, d in zip(at_coord, dims, strict=True)):
            value = tensor[tuple(at_coord[::-1])].tobytes()
        elif nan_bits is not None:
            value = int(nan_bits).to_bytes(esz, "little")
        else:
            value = bytes(esz)
        at = swizzle(linear * esz, span)
        image[at : at + esz] = np.frombuffer(value, np.uint8)
    return image


TMA_CASES = [
    # dtype, dims (innermost first), padded inner, box, element strides, swizzle, coords x2, oob
    ("float16", (40, 7), 48, (64, 8), (1, 1), "128B", [(-8, 3), (0, -2)], "none"),
    ("uint16", (32, 5, 3), 40, (32, 4, 2), (1, 1, 1), "64B", [(0, 2, 1), (0, 0, 0)], "none"),
    ("uint8", (32, 9), 48, (32, 8), (1, 1), "32B", [(0, 0), (0, 4)], "none"),
    ("float32", (100,), 100, (16,), (1,), "none", [(90,), (-4,)], "nan"),
    (
        "float32",
        (4, 3, 2, 2, 2),
        8,
        (4, 3, 2, 1, 2),
        (1, 2, 1, 1, 1),
        "none",
        [(0, 1, 0, 1, -1), (0, 0, 1, 0, 0)],
        "nan",
    ),
]


@pytest.mark.parametrize("case", TMA_CASES, ids=[f"{c[0]}-{len(c[1])}d-{c[5]}" for c in TMA_CASES])
def test_tma_box_loads(tma_kernel, case):
    """cp.async.bulk.tensor 1d..5d writes the box as the driver's tiled mode defines it: element
    strides, out-of-bounds zero or NaN fill, each swizzle's byte permutation; two loads on one
    mbarrier wait on parities 0 and 1."""
    dtype, dims, padded, box, estrides, swz, coords, oob = case
    rng = np.random.default_rng(len(dims))
    shape = (*dims[:0:-1], padded)  # outermost first, the innermost row padded
    full = rng.integers(0, 250, shape).astype(dtype)
    tensor = full[..., : dims[0]]
    strides = [full.strides[len(dims) - 1 - i] for i in range(1, len(dims))]
    tmap = encode_tensor_map_tiled(
        dtype, len(dims), full, dims, strides, box, estrides, swizzle=swz, oob_fill=oob
    )
    nan = {"float16": 0x7FFF, "float32": 0x7FFFFFFF}.get(dtype) if oob == "nan" else None
    want = [expected_box(tensor, c, box, estrides, SWIZZLE_SPAN[swz], nan) for c in coords]
    nbytes = want[0].size
    cs = np.zeros((2, 5), np.int32)
    for i, c in enumerate(coords):
        cs[i, : len(c)] = c
    out = np.zeros(2 * nbytes, np.uint8)
    stats = tma_kernel(
        grid=1, block=64, shared_mem=16384 + 8, args=[tmap, cs, len(dims), nbytes, out, 0]
    )
    np.testing.assert_array_equal(out.reshape(2, nbytes), np.stack(want))
    assert stats.tma_bytes == 2 * nbytes


def test_tma_innermost_element_stride_is_refused(tma_kernel):
    data = np.zeros((8, 64), np.float16)
    tmap = encode_tensor_map_tiled("float16", 2, data, (64, 8), (128,), (64, 8), (2, 1))
    out = np.zeros(2 * 512, np.uint8)
    with pytest.raises(EmulatorLaunchError, match="element stride 2 in the innermost dimension"):
        tma_kernel(
            grid=1,
            block=64,
            shared_mem=16392,
            args=[tmap, np.zeros((2, 5), np.int32), 2, 512, out, 0],
            timeout=30,
        )


def test_tma_read_before_the_mbarrier_wait_is_a_hazard(tma_kernel):
    """Without the wait, the ldmatrix read of the box is reported, though its bytes are there."""
    data = np.arange(64 * 8, dtype=np.float16).reshape(8, 64)
    tmap = encode_tensor_map_tiled("float16", 2, data, (64, 8), (128,), (64, 8), (1, 1))
    out = np.zeros(2 * 1024, np.uint8)
    cs = np.zeros((2, 5), np.int32)
    with pytest.raises(HazardError, match=r"before its TMA write completed .* phase 0"):
        tma_kernel(
            grid=1, block=64, shared_mem=16384 + 8, args=[tmap, cs, 2, 1024, out, 1], timeout=30
        )


# ---- TMA into swizzled tiles, read by wgmma descriptors ---------------------------------------

GEMM_SRC = (
    COMMON
    + wgmma_ss(64)
    + r"""
// The host lists the TMA loads (map 0 or 1, shared offset, two coordinates) and the descriptors
// of each k16 step; D = A B over the steps.
extern "C" __global__ void tma_gemm(const __grid_constant__ CUtensorMap tmap_a,
                                    const __grid_constant__ CUtensorMap tmap_b, const int* loads,
                                    int n_loads, int tx_bytes, const unsigned long long* descs,
                                    int steps, int tb, float* out) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = smem_u32(smem), bar = smem_u32(smem + 32768);
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(1));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(bar), "r"(tx_bytes));
    for (int i = 0; i < n_loads; ++i) {
      const int* l = loads + 4 * i;
      const CUtensorMap* map = l[0] ? &tmap_b : &tmap_a;
      asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                   " [%0], [%1, {%2, %3}], [%4];"
                   :: "r"(base + l[1]), "l"(reinterpret_cast<uint64_t>(map)), "r"(l[2]), "r"(l[3]),
                      "r"(bar) : "memory");
    }
  }
  wait_phase(bar, 0);
  float d[32];
  for (int r = 0; r < 32; ++r) d[r] = 0.f;
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  for (int s = 0; s < steps; ++s) {
    if (tb) wgmma_ss_64<0, 1, 1>(d, descs[2 * s], descs[2 * s + 1], s > 0);
    else wgmma_ss_64<0, 0, 1>(d, descs[2 * s], descs[2 * s + 1], s > 0);
  }
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  for (int r = 0; r < 32; ++r) out[threadIdx.x * 32 + r] = d[r];
}
"""
)


@pytest.fixture(scope="module")
def gemm_kernel():
    params = [
        ("const __grid_constant__ CUtensorMap", "tmap_a"),
        ("const __grid_constant__ CUtensorMap", "tmap_b"),
        ("const int*", "loads"),
        ("int", "n_loads"),
        ("int", "tx_bytes"),
        ("const unsigned long long*", "descs"),
        ("int", "steps"),
        ("int", "tb"),
        ("float*", "out"),
    ]
    return build_kernel(GEMM_SRC, "tma_gemm", params)


def tma_tiles(span: int, mn_major: bool, base: int, operand: int):
    """TMA boxes and per-k16-step (start, lbo, sbo) of a 64 x 64 operand in shared memory at
    ``base`` (K = 64): K-major boxes of span/2 k by 64 rows (8 k without swizzle), a step
    advancing the start inside the swizzle row; MN-major boxes of span/2 mn by 64 k rows."""
    width = span // 2 if span else 8  # box inner elements
    box_bytes = 64 * width * 2
    loads = [(operand, base + i * box_bytes, i * width, 0) for i in range(64 // width)]
    steps = []
    for s in range(4):
        k0 = 16 * s
        if not mn_major and span:
            start = base + (k0 // width) * box_bytes + 2 * (k0 % width)
            steps.append((start, 16, 8 * span))
        elif not mn_major:  # core matrices: 8 rows of 16 bytes, k groups a box apart
            steps.append((base + (k0 // 8) * box_bytes, box_bytes, 128))
        elif span:  # rows are k; 8-row groups 8 * span apart; mn atoms a box apart
            steps.append((base + k0 * span, box_bytes, 8 * span))
        else:  # MN-major core matrices: 8 k rows of 8 mn; k groups 128 apart, mn a box apart
            steps.append((base + k0 * 16, 128, box_bytes))
    return loads, steps, (width, 64)


@pytest.mark.parametrize("span", [0, 32, 64, 128])
@pytest.mark.parametrize("tb", [0, 1])
def test_tma_swizzle_agrees_with_wgmma_descriptors(gemm_kernel, span, tb):
    """A and B loaded by TMA with each swizzle, read by wgmma descriptors of the same mode, 4
    k-steps (K-major steps move the start address inside the swizzle row): exactly A @ B. A
    map whose swizzle disagrees with the descriptors gives wrong numbers (the mutation)."""
    rng = np.random.default_rng(span + tb)
    a = rng.integers(-4, 5, (64, 64)).astype(np.float64)  # m x k
    b = rng.integers(-4, 5, (64, 64)).astype(np.float64)  # k x n
    a_bits = bf16_bits(a)  # row m: k contiguous (K-major)
    b_bits = bf16_bits(b if tb else b.T)  # MN-major: n contiguous; K-major: k contiguous
    loads_a, steps_a, box = tma_tiles(span, False, 0, 0)
    loads_b, steps_b, _ = tma_tiles(span, bool(tb), 16384, 1)
    descs = []
    for (sa, la, ba), (sb, lb, bb) in zip(steps_a, steps_b, strict=True):
        descs += [descriptor(0x400 + sa, la, ba, span), descriptor(0x400 + sb, lb, bb, span)]
    loads = np.array(loads_a + loads_b, np.int32)
    swz = {0: "none", 32: "32B", 64: "64B", 128: "128B"}[span]

    def run(map_swizzle: str) -> np.ndarray:
        maps = [
            encode_tensor_map_tiled("bfloat16", 2, x, (64, 64), (128,), box, (1, 1), swizzle=sw)
            for x, sw in ((a_bits, map_swizzle), (b_bits, map_swizzle))
        ]
        out = np.zeros((128, 32), np.float32)
        args = [*maps, loads, len(loads), 2 * 8192, np.array(descs, np.uint64), 4, tb, out]
        gemm_kernel(grid=1, block=128, shared_mem=32768 + 8, args=args, timeout=30)
        return decode(out, 64)

    np.testing.assert_array_equal(run(swz), a @ b)
    if span:
        assert not np.array_equal(run("none"), a @ b)


def test_tma_wgmma_gemm_of_random_bf16_against_float64(gemm_kernel):
    """Random normal bf16 operands (round to nearest even), K = 64 through TMA (128B swizzle)
    and wgmma: the fp32 result is within fp32 rounding of the float64 product."""
    rng = np.random.default_rng(5)

    def bf16(x):  # round to nearest even; returns (bits, values)
        u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
        bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    a_bits, a = bf16(rng.standard_normal((64, 64)))
    b_bits, b = bf16(rng.standard_normal((64, 64)))  # k x n, n contiguous: MN-major B
    loads_a, steps_a, box = tma_tiles(128, False, 0, 0)
    loads_b, steps_b, _ = tma_tiles(128, True, 16384, 1)
    descs = []
    for (sa, la, ba), (sb, lb, bb) in zip(steps_a, steps_b, strict=True):
        descs += [descriptor(0x400 + sa, la, ba, 128), descriptor(0x400 + sb, lb, bb, 128)]
    maps = [
        encode_tensor_map_tiled("bfloat16", 2, x, (64, 64), (128,), box, (1, 1), swizzle="128B")
        for x in (a_bits, b_bits)
    ]
    loads = np.array(loads_a + loads_b, np.int32)
    out = np.zeros((128, 32), np.float32)
    args = [*maps, loads, len(loads), 16384, np.array(descs, np.uint64), 4, 1, out]
    gemm_kernel(grid=1, block=128, shared_mem=32768 + 8, args=args, timeout=30)
    ref = a @ b
    err = np.abs(decode(out, 64) - ref).max() / np.abs(ref).max()
    assert err < 1e-7, err


# ---- mbarrier --------------------------------------------------------------------------------

MBAR_SRC = (
    COMMON
    + r"""
__device__ uint64_t arrive(uint32_t bar) {
  uint64_t state;
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 %0, [%1];"
               : "=l"(state) : "r"(bar) : "memory");
  return state;
}
__device__ int test_parity(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile("{ .reg .pred p; mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2; "
               "selp.b32 %0, 1, 0, p; }" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done;
}
__device__ int test_state(uint32_t bar, uint64_t state) {
  uint32_t done;
  asm volatile("{ .reg .pred p; mbarrier.test_wait.shared::cta.b64 p, [%1], %2; "
               "@p mov.u32 %0, 1; @!p mov.u32 %0, 0; }" : "=r"(done) : "r"(bar), "l"(state));
  return done;
}
__device__ int try_state(uint32_t bar, uint64_t state) {
  uint32_t done;
  asm volatile("{ .reg .pred p; mbarrier.try_wait.acquire.cta.shared::cta.b64 p, [%1], %2; "
               "selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(bar), "l"(state) : "memory");
  return done;
}
// mode 0: phases of a 4-arrival barrier and a transaction barrier, recorded in `out`;
// 1: wait on a barrier never initialized; 2: one arrival too many; 3: tx-count overflow;
// 4: init count 0.
extern "C" __global__ void mbar(const unsigned char* src, int* out, int mode) {
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t bar = smem_u32(smem), tx_bar = smem_u32(smem + 8), data = smem_u32(smem + 128);
  const int t = threadIdx.x, lane = t % 32;
  if (t == 0 && mode != 1) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;" :: "r"(bar), "r"(mode == 4 ? 0 : 4));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(tx_bar));
  }
  __syncthreads();
  if (mode == 1) { wait_phase(bar, 0); return; }
  if (mode == 2 && t == 0) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], 16;" :: "r"(tx_bar));
    arrive(tx_bar);
    arrive(tx_bar);
  }
  if (mode == 3 && t == 0) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(tx_bar), "r"((1 << 20) - 1));
    asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], 1;" :: "r"(tx_bar));
  }
  if (mode != 0) return;
  for (int phase = 0; phase < 3; ++phase) {
    int* o = out + 8 * phase;
    if (t == 0) o[0] = test_parity(bar, phase & 1);  // nobody arrived yet
    __syncthreads();
    uint64_t state = 0;
    if (lane == 0 && t != 0) state = arrive(bar);  // warps 1..3
    __syncthreads();
    if (t == 0) {
      o[1] = test_parity(bar, phase & 1);  // 3 of 4 arrived
      o[2] = static_cast<int>(state);
      state = arrive(bar);
      o[3] = static_cast<int>(state);   // the phase it arrived on
      o[4] = test_parity(bar, phase & 1);
      o[5] = test_parity(bar, (phase + 1) & 1);  // the next phase has not completed
      o[6] = test_state(bar, state) + 2 * try_state(bar, state);
    }
    wait_phase(bar, phase & 1);
    __syncthreads();
  }
  if (t == 0) {  // transactions: arrive first, the bytes complete the phase
    uint64_t state;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], 32;"
                 : "=l"(state) : "r"(tx_bar) : "memory");
    out[24] = test_parity(tx_bar, 0);
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1], 32, [%2];" :: "r"(data), "l"(src), "r"(tx_bar) : "memory");
    out[25] = test_parity(tx_bar, 0);
    wait_phase(tx_bar, 0);
    for (int i = 0; i < 32; ++i) out[26 + i] = smem[128 + i];
  }
}
"""
)


@pytest.fixture(scope="module")
def mbar_kernel():
    params = [("const unsigned char*", "src"), ("int*", "out"), ("int", "mode")]
    return build_kernel(MBAR_SRC, "mbar", params)


def test_mbarrier_phases_and_transactions(mbar_kernel):
    """A phase completes at the last expected arrival (parity flips every phase; the arrive
    state names the phase); a transaction phase completes when its bytes arrive."""
    src = np.arange(16, 48, dtype=np.uint8)
    out = np.full(64, -1, np.int32)
    mbar_kernel(grid=1, block=128, shared_mem=256, args=[src, out, 0], timeout=30)
    for phase in range(3):
        # not done, not done, (state of warp 1..3 arrivals not recorded), its phase, done,
        # next parity not done, test_wait and try_wait on the state both true
        assert list(out[8 * phase : 8 * phase + 7]) == [0, 0, 0, phase, 1, 0, 3], phase
    assert list(out[24:26]) == [0, 1]
    np.testing.assert_array_equal(out[26:58], src)


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (1, "was not initialized"),
        (2, r"1 arrival\(s\) on the mbarrier .* expects 0 more"),
        (3, "transaction count .* would be 1048576"),
        (4, "count 0 outside"),
    ],
)
def test_mbarrier_misuse_traps(mbar_kernel, mode, message):
    out = np.zeros(64, np.int32)
    with pytest.raises(EmulatorLaunchError, match=message):
        mbar_kernel(
            grid=1, block=128, shared_mem=256, args=[np.zeros(32, np.uint8), out, mode], timeout=30
        )


# ---- the forms accepted, and what is refused -----------------------------------------------------


def test_block_forms_rewrite():
    """A PTX block's registers become C++ locals of a lambda run in place; guards become ifs."""
    src = (
        "__device__ void f(unsigned bar, unsigned parity, unsigned& done) {\n"
        '  asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;'
        ' @p mov.u32 %0, 1; @!p mov.u32 %0, 0; }" : "=r"(done) : "r"(bar), "r"(parity));\n}\n'
    )
    out = transform_source(src)
    assert out.count("\n") == src.count("\n")
    assert "[&]() { bool kg_ptx_p = 0;" in out
    assert "(kg_ptx_p = ::kg_emu::ptx::mbarrier_try_wait(::kg_emu::ptx::b32(bar), true," in out
    assert "if (!kg_ptx_p) ::kg_emu::ptx::set_b32((done), static_cast<uint32_t>(0));" in out


def test_wgmma_accumulators_as_32_bit_integers_rewrite():
    """CUTLASS-style accumulators: "+r" uint32_t holding the float bits, immediates as "n"."""
    src = (
        "__device__ void f(unsigned (&d)[4], unsigned long long da, unsigned long long db) {\n"
        '  asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, %4,'
        ' %5, 1, %6, 1, 0, %7;" : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])'
        ' : "l"(da), "l"(db), "n"(-1), "n"(1));\n}\n'
    )
    out = transform_source(src)
    want = (
        "::kg_emu::ptx::wgmma_ss<::kg_emu::ptx::Elem::f16, 8>(static_cast<uint64_t>(da), "
        "static_cast<uint64_t>(db), true, (-1), 1, 0, (1), (d[0]), (d[1]), (d[2]), (d[3]))"
    )
    assert want in out


@pytest.mark.parametrize(
    ("stmt", "message"),
    [
        (
            'asm volatile("wgmma.mma_async.sync.aligned.m64n12k16.f32.bf16.bf16 {%0}, %1, %1,'
            ' 1, 1, 1, 0, 0;" : "+f"(f) : "l"(p));',
            r"N=12 is not a multiple of 8",
        ),
        (
            'asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %0, %0, %0},'
            ' %1, %1, 1, 1, 1, 0, 0;" : "=f"(f) : "l"(p));',
            r'is read and written by wgmma: declare it "\+f"',
        ),
        (
            'asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %0, %0, %0},'
            ' %1, %1, 1, 2, 1, 0, 0;" : "+f"(f) : "l"(p));',
            r"imm-scale is 2; allowed: 1, -1",
        ),
        (
            'asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %0, %0, %0},'
            ' %1, %1, %2, 1, 1, 0, 0;" : "+f"(f) : "l"(p), "r"(x));',
            r"scale-d must be a predicate",
        ),
        (
            'asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.bf16 {%0, %0, %0, %0},'
            ' %1, %1, 1, 1, 1, 0, 0;" : "+f"(f) : "l"(p));',
            r"A and B must have the same type",
        ),
        ('asm volatile("setmaxnreg.inc.sync.aligned.u32 20;");', r"multiple of 8 in \[24, 256\]"),
        (
            'asm volatile("mbarrier.try_wait.parity.shared::cta.b64 %0, [%1], %2;"'
            ' : "=r"(x) : "r"(x), "r"(x));',
            r"must be a predicate declared in the asm block",
        ),
        (
            'asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx'
            '::bytes [%0], [%1, {%0}], [%0];" :: "r"(x), "l"(p));',
            r"expected operands 'addr \[tmap, vec2\] addr'",
        ),
        (
            'asm volatile("{ .reg .pred p; LOOP: mbarrier.try_wait.parity.shared.b64 p, [%0], 0;'
            ' @!p bra ELSEWHERE; }" :: "r"(x));',
            r"bra to ELSEWHERE, which is not a label of the asm block",
        ),
        ('asm volatile("@q mov.u32 %0, 1;" : "=r"(x));', r"guard @q is not a declared predicate"),
        (
            'asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.xor.bulk_group'
            ' [%0, {%1, %1}], [%1];" :: "l"(p), "r"(x));',
            r"unsupported instruction .*not \.xor",
        ),
    ],
)
def test_unsupported_hopper_asm_is_rejected(stmt, message):
    src = "__device__ void f(unsigned x, float f, const void* p) {\n\n  " + stmt + "\n}\n"
    with pytest.raises(EmulatorSourceError, match=message):
        transform_source(src)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tensor_rank": 6}, "tensorRank=6"),
        ({"global_strides": (100,)}, r"globalStrides=\(100,\); allowed: multiples of 16"),
        ({"box_dim": (64, 300)}, r"boxDim=\(64, 300\); allowed: each in \[1, 256\]"),
        ({"box_dim": (4, 8)}, "a multiple of 16 bytes"),
        ({"swizzle": "64B"}, "at most the swizzle span 64 bytes"),
        ({"swizzle": "16B"}, "swizzle='16B'"),
        ({"element_strides": (1, 9)}, r"elementStrides=\(1, 9\)"),
        ({"tensor_data_type": "int8"}, "tensorDataType='int8'"),
        ({"tensor_data_type": "uint16", "oob_fill": "nan"}, "'none' for integer data types"),
        ({"global_dim": (64,)}, r"globalDim=\(64,\); allowed: 2 integers"),
    ],
)
def test_tensor_map_encode_checks_the_driver_rules(change, message):
    q = np.zeros((8, 64), np.float16)
    kwargs = dict(
        tensor_data_type="float16",
        tensor_rank=2,
        global_address=q,
        global_dim=(64, 8),
        global_strides=(128,),
        box_dim=(64, 8),
        element_strides=(1, 1),
        swizzle="128B",
    )
    kwargs.update(change)
    with pytest.raises(EmulatorArgumentError, match=message):
        encode_tensor_map_tiled(**kwargs)


def test_tensor_map_parameter_needs_a_tensor_map(tma_kernel):
    with pytest.raises(TypeError, match="needs a TensorMap"):
        tma_kernel(grid=1, block=64, shared_mem=16392, args=[b"x" * 128, None, 1, 16, None, 0])


# ---- mutations of the emulator that the probes above catch ---------------------------------------


@pytest.fixture
def mutated(tmp_path, monkeypatch, one_off_emulator_builds):
    """``mutated(header, old, new)``: later builds use the emulator's headers with one edit (and
    an empty build cache)."""
    import shutil

    from kernelgen.emulator import kernel

    copy = tmp_path / "include"
    shutil.copytree(kernel.INCLUDE_DIR, copy)
    monkeypatch.setattr(kernel, "INCLUDE_DIR", copy)

    def apply(name: str, old: str, new: str) -> None:
        text = (copy / name).read_text()
        assert old in text, old
        (copy / name).write_text(text.replace(old, new))

    return apply


def test_mutation_accumulator_fragment_is_caught(mutated):
    mutated(
        "kg_wgmma.h", "4 * j + 2 * r + static_cast<int>(i)", "4 * j + r + 2 * static_cast<int>(i)"
    )
    kernel = build_kernel(probe_source(64), "probe_64", PROBE_PARAMS)
    rng = np.random.default_rng(0)
    a = rng.integers(-4, 5, (64, 16)).astype(np.float64)
    b = rng.integers(-4, 5, (16, 64)).astype(np.float64)
    assert not np.array_equal(run_probe(kernel, 64, a, b, 0, 0, 128), a @ b)


def test_mutation_register_a_fragment_is_caught(mutated):
    mutated("kg_wgmma.h", "[(row >= 8) + 2 * (k >= 8)]", "[2 * (row >= 8) + (k >= 8)]")
    params = [
        ("const uint16_t*", "a"),
        ("const unsigned char*", "image"),
        ("int", "image_bytes"),
        ("const unsigned long long*", "descs"),
        ("float*", "out"),
        ("int", "mutation"),
    ]
    kernel = build_kernel(register_a_source(256), "rs_256", params)
    rng = np.random.default_rng(3)
    a = rng.integers(-4, 5, (64, 32)).astype(np.float64)
    b = rng.integers(-4, 5, (32, 256)).astype(np.float64)
    assert not np.array_equal(run_register_a(kernel, a, b), a @ b)


def test_mutation_tma_fill_and_arrival_check_are_caught(mutated):
    mutated("kg_tma.h", "std::memset(out, 0, esz);", "std::memset(out, 0x11, esz);")
    mutated("kg_mbarrier.h", "if (count < 1 || count > b.pending) {", "if (count < 1) {")
    tma = build_kernel(
        TMA_SRC,
        "tma_box",
        [
            ("const __grid_constant__ CUtensorMap", "tmap"),
            ("const int*", "coords"),
            ("int", "rank"),
            ("int", "bytes"),
            ("unsigned char*", "out"),
            ("int", "mutation"),
        ],
    )
    with pytest.raises(AssertionError):
        test_tma_box_loads(tma, TMA_CASES[0])
    mbar = build_kernel(
        MBAR_SRC, "mbar", [("const unsigned char*", "src"), ("int*", "out"), ("int", "mode")]
    )
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        test_mbarrier_misuse_traps(mbar, 2, "arrival")


# ---- a warp-specialized pipeline ---------------------------------------------------------------

PIPELINE_SRC = (
    COMMON
    + wgmma_ss(64)
    + r"""
__device__ uint64_t desc128(uint32_t addr) {  // K-major, 128B swizzle, 8-row groups 1024 apart
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
// D (64 x 64) = A (64 x 64 tiles) B over `tiles` k-tiles through a 2-stage ring: a producer
// warpgroup (one elected thread issues the TMA) and a consumer warpgroup. mutation 1: the
// consumer skips the full-barrier wait; 2: it releases a stage before its wgmma retired.
extern "C" __global__ void pipeline(const __grid_constant__ CUtensorMap tmap_a,
                                    const __grid_constant__ CUtensorMap tmap_b, int tiles,
                                    float* out, int mutation) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = smem_u32(smem);
  const uint32_t full = base + 65536, empty = full + 16;  // two barriers each
  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(full + 8 * s));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 128;" :: "r"(empty + 8 * s));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    uint32_t elected = 0;
    asm volatile("{ .reg .pred p; elect.sync _|p, %1; selp.b32 %0, 1, 0, p; }"
                 : "=r"(elected) : "r"(0xffffffffu));
    if (threadIdx.x / 32 == 0 && elected) {
      for (int t = 0; t < tiles; ++t) {
        const int s = t % 2;
        if (t >= 2) wait_phase(empty + 8 * s, ((t / 2) - 1) & 1);  // stage freed
        const uint32_t bar = full + 8 * s, a = base + 32768 * s, b = a + 16384;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 16384;" :: "r"(bar));
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
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  float d[32];
  for (int r = 0; r < 32; ++r) d[r] = 0.f;
  for (int t = 0; t < tiles; ++t) {
    const int s = t % 2;
    if (mutation != 1) wait_phase(full + 8 * s, (t / 2) & 1);
    const uint32_t a = base + 32768 * s, b = a + 16384;
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    for (int k = 0; k < 4; ++k) {
      wgmma_ss_64<0, 0, 1>(d, desc128(a + 32 * k), desc128(b + 32 * k), t > 0 || k > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    if (mutation != 2) asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(empty + 8 * s) : "memory");
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  for (int r = 0; r < 32; ++r) out[(threadIdx.x - 128) * 32 + r] = d[r];
}
"""
)


PIPELINE_PARAMS = [
    ("const __grid_constant__ CUtensorMap", "tmap_a"),
    ("const __grid_constant__ CUtensorMap", "tmap_b"),
    ("int", "tiles"),
    ("float*", "out"),
    ("int", "mutation"),
]


@pytest.fixture(scope="module")
def pipeline_kernel():
    return build_kernel(PIPELINE_SRC, "pipeline", PIPELINE_PARAMS)


def run_pipeline(kernel, a, b, mutation=0, timeout=30):
    tiles = a.shape[1] // 64
    maps = [
        encode_tensor_map_tiled(
            "bfloat16",
            2,
            bf16_bits(x),
            (64 * tiles, 64),
            (128 * tiles,),
            (64, 64),
            (1, 1),
            swizzle="128B",
        )
        for x in (a, b.T)
    ]
    out = np.zeros((128, 32), np.float32)
    stats = kernel(
        grid=1,
        block=256,
        shared_mem=65536 + 32,
        args=[*maps, tiles, out, mutation],
        timeout=timeout,
    )
    return decode(out, 64), stats


def test_warp_specialized_pipeline(pipeline_kernel):
    """A producer/consumer ring of 2 stages over 5 k-tiles (full and empty mbarriers, parities
    wrapping): exactly A @ B; 8 KiB of TMA per operand tile, 4 wgmmas per tile."""
    rng = np.random.default_rng(11)
    a = rng.integers(-3, 4, (64, 320)).astype(np.float64)
    b = rng.integers(-3, 4, (320, 64)).astype(np.float64)
    got, stats = run_pipeline(pipeline_kernel, a, b)
    np.testing.assert_array_equal(got, a @ b)
    assert (stats.wgmma, stats.tma_bytes) == (20, 5 * 16384)


def test_pipeline_missing_waits_fail(pipeline_kernel):
    """A consumer that skips its full-barrier wait reads tiles before their TMA completed (a
    hazard; or, when it runs ahead of the copy, garbage, which the copy then overwrites under the
    wgmma: a hazard, or wrong numbers); one that frees a stage before its wgmma retired lets the
    next TMA overwrite the operands in flight (a hazard)."""
    rng = np.random.default_rng(12)
    a = rng.integers(-3, 4, (64, 256)).astype(np.float64)
    b = rng.integers(-3, 4, (256, 64)).astype(np.float64)
    try:  # two tiles: the producer never waits for a stage (with more, a consumer running
        # ahead completes empty-barrier phases early and the producer waits forever)
        got, _ = run_pipeline(pipeline_kernel, a[:, :128], b[:128], mutation=1)
    except HazardError as e:  # read after the copy, or the copy landed under the wgmma
        assert "before its TMA write completed" in str(e) or "changed between its issue" in str(e)
    else:
        assert not np.array_equal(got, a[:, :128] @ b[:128])
    with pytest.raises(HazardError, match="changed between its issue"):
        run_pipeline(pipeline_kernel, a, b, mutation=2)


def test_a_stuck_transaction_names_its_mbarrier():
    """A producer that expects more bytes than its copies bring deadlocks the consumers; the
    watchdog's report names the barrier and what it still waits for."""
    src = PIPELINE_SRC.replace('_, [%0], 16384;"', '_, [%0], 16400;"')
    kernel = build_kernel(src, "pipeline", PIPELINE_PARAMS)
    a = np.ones((64, 64))
    with pytest.raises(EmulatorLaunchError, match="0 of 1 arrivals and 16 transaction bytes"):
        run_pipeline(kernel, a, a, timeout=5)
