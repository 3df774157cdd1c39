"""fp8 in the CPU emulator: wgmma m64nNk32 with .e4m3 / .e5m2 operands (f32 and f16
accumulators, A from shared memory or registers) and the cvt conversions to and from fp8.

The fp8 formats come from ml_dtypes (float8_e4m3fn, float8_e5m2), the layouts from the PTX ISA
written out here: the canonical K-major layouts in bytes (a core-matrix row of 16 bytes holds 16
elements; a k32 step spans two), the 8-bit register-A fragment (each register 4 consecutive k of
a row: a0 rows 0-7 and k 0-15, a1 rows 8-15, a2 k 16-31, a3 both), the f16 accumulator fragment
(the f32 one with adjacent columns packed in one register).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_emulator_hopper import COMMON, decode, mutated, swizzle  # noqa: F401 (mutated: a fixture)

from kernelgen.emulator import EmulatorSourceError, build_kernel, transform_source

ml_dtypes = pytest.importorskip("ml_dtypes")
pytestmark = pytest.mark.emulate

N = 32
FP8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
# (A type, B type, f16 accumulators, A in registers, swizzle span)
VARIANTS = [
    ("e4m3", "e4m3", False, False, 128),
    ("e5m2", "e4m3", True, False, 0),
    ("e4m3", "e5m2", False, True, 64),
    ("e5m2", "e5m2", True, True, 128),
]


def wgmma_fp8_asm(variant: int) -> str:
    ta, tb, f16, rs, _ = VARIANTS[variant]
    nregs = N // 4 if f16 else N // 2
    regs = ", ".join(f"%{i}" for i in range(nregs))
    kind = "+r" if f16 else "+f"
    outs = ", ".join(f'"{kind}"(d[{i}])' for i in range(nregs))
    dtype = "f16" if f16 else "f32"
    opcode = f"wgmma.mma_async.sync.aligned.m64n{N}k32.{dtype}.{ta}.{tb}"
    if rs:
        a = ", ".join(f"%{nregs + i}" for i in range(4))
        return (
            f'asm volatile("{opcode} {{{regs}}}, {{{a}}}, %{nregs + 4}, 1, 1, 1;" : {outs} '
            ': "r"(ar[0]), "r"(ar[1]), "r"(ar[2]), "r"(ar[3]), "l"(descs[1]));'
        )
    return (
        f'asm volatile("{opcode} {{{regs}}}, %{nregs}, %{nregs + 1}, 1, 1, 1;" : {outs} '
        ': "l"(descs[0]), "l"(descs[1]));'
    )


def case_body(variant: int) -> str:
    """The asm of a variant; f32 accumulators through a float view of the registers."""
    if VARIANTS[variant][2]:
        return wgmma_fp8_asm(variant)
    asm = wgmma_fp8_asm(variant).replace("(d[", "(dd[")
    return "float* dd = reinterpret_cast<float*>(d); " + asm


FP8_SRC = (
    COMMON
    + r"""
extern "C" __global__ void fp8_probe(const unsigned char* image, int image_bytes,
                                     const unsigned long long* descs, const unsigned* a_regs,
                                     const unsigned* c, unsigned* out, int variant) {
  extern __shared__ __align__(1024) unsigned char smem[];
  for (int i = threadIdx.x; i < image_bytes; i += blockDim.x) smem[i] = image[i];
  __syncthreads();
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  unsigned d[16];
  unsigned ar[4];
  for (int r = 0; r < 16; ++r) d[r] = c[threadIdx.x * 16 + r];
  for (int r = 0; r < 4; ++r) ar[r] = a_regs[threadIdx.x * 4 + r];
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  switch (variant) {
"""
    + "\n".join(f"    case {v}: {{ {case_body(v)} break; }}" for v in range(len(VARIANTS)))
    + r"""
  }
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  for (int r = 0; r < 16; ++r) out[threadIdx.x * 16 + r] = d[r];
}
"""
)
FP8_PARAMS = [
    ("const unsigned char*", "image"),
    ("int", "image_bytes"),
    ("const unsigned long long*", "descs"),
    ("const unsigned*", "a_regs"),
    ("const unsigned*", "c"),
    ("unsigned*", "out"),
    ("int", "variant"),
]


@pytest.fixture(scope="module")
def fp8_kernel():
    return build_kernel(FP8_SRC, "fp8_probe", FP8_PARAMS)


def fp8_values(rng, kind: str, shape) -> np.ndarray:
    """Random fp8 bit patterns of finite values of magnitude at most 8."""
    bits = np.arange(256, dtype=np.uint8)
    values = bits.view(FP8[kind]).astype(np.float64)
    ok = bits[np.isfinite(values) & (np.abs(values) <= 8)]
    return rng.choice(ok, size=shape).astype(np.uint8)


def place_k_major(image: np.ndarray, base: int, mat: np.ndarray, span: int) -> tuple[int, int]:
    """Write ``mat`` (extent x 32 bytes, K-major) at ``base`` in the PTX ISA's canonical K-major
    layout, in bytes: no swizzle ((8,m),(16,2)):((16,SBO),(1,LBO)); swizzled W
    ((8,m),32):((W,SBO),1), then Swizzle<B,4,3>. Returns (LBO, SBO)."""
    lbo, sbo = (128, 256) if span == 0 else (0, 8 * span)
    for mn in range(mat.shape[0]):
        for k in range(32):
            if span == 0:
                off = (mn % 8) * 16 + (mn // 8) * sbo + k % 16 + (k // 16) * lbo
            else:
                off = (mn % 8) * span + (mn // 8) * sbo + k
            image[base + swizzle(off, span)] = mat[mn, k]
    return lbo, sbo


def descriptor(start: int, lbo: int, sbo: int, span: int) -> int:
    mode = {0: 0, 128: 1, 64: 2, 32: 3}[span]
    enc = lambda x: (x & 0x3FFFF) >> 4  # noqa: E731
    return enc(start) | enc(lbo) << 16 | enc(sbo) << 32 | mode << 62


def register_a(a: np.ndarray) -> np.ndarray:
    """(128, 4) registers of the 8-bit A fragment: thread t of warp w = t / 32, g = (t % 32) / 4,
    q = t % 4; register r holds row 16 w + g + 8 (r % 2), k = 16 (r / 2) + 4 q .. + 3 (the lower
    k in the lower byte)."""
    out = np.zeros((128, 4), np.uint32)
    for t in range(128):
        w, g, q = t // 32, (t % 32) // 4, t % 4
        for r in range(4):
            row, k = 16 * w + g + 8 * (r % 2), 16 * (r // 2) + 4 * q
            out[t, r] = int.from_bytes(a[row, k : k + 4].tobytes(), "little")
    return out


def run_fp8(kernel, variant: int, seed: int = 0):
    ta, tb, f16, rs, span = VARIANTS[variant]
    rng = np.random.default_rng(seed + variant)
    a = fp8_values(rng, ta, (64, 32))
    b = fp8_values(rng, tb, (32, N))
    image = np.full(16384, 0xFF, np.uint8)
    lbo, sbo = place_k_major(image, 0, a, span)
    descs = [descriptor(0x400, lbo, sbo, span)]
    lbo, sbo = place_k_major(image, 8192, b.T.copy(), span)
    descs.append(descriptor(0x400 + 8192, lbo, sbo, span))
    a_val = a.view(FP8[ta]).astype(np.float64)
    b_val = b.view(FP8[tb]).astype(np.float64)
    c_val = rng.integers(-4, 5, (64, N)).astype(np.float64)
    # C in the accumulator fragment: element x of thread t is d[x] of the f32 layout
    t = np.arange(128)[:, None]
    x = np.arange(N // 2)[None, :]
    row = 16 * (t // 32) + (t % 32) // 4 + 8 * ((x % 4) // 2)
    col = 8 * (x // 4) + 2 * (t % 4) + x % 2
    c_elems = c_val[row, col]
    c = np.zeros((128, 16), np.uint32)
    if f16:
        c[:, : N // 4] = c_elems.astype(np.float16).view(np.uint32)
    else:
        c[:, : N // 2] = c_elems.astype(np.float32).view(np.uint32)
    out = np.zeros((128, 16), np.uint32)
    a_regs = register_a(a) if rs else np.zeros((128, 4), np.uint32)
    kernel(
        grid=1,
        block=128,
        shared_mem=16384,
        args=[image, 16384, np.array(descs, np.uint64), a_regs, c, out, variant],
    )
    exact = a_val @ b_val + c_val
    if f16:
        got = decode(out[:, : N // 4].copy().view(np.float16).astype(np.float64), N)
        want = exact.astype(np.float16).astype(np.float64)
    else:
        got = decode(out[:, : N // 2].copy().view(np.float32).astype(np.float64), N)
        want = exact.astype(np.float32).astype(np.float64)
    return got, want


@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_wgmma_fp8_layouts_and_accumulators(fp8_kernel, variant):
    """m64n32k32 of every pair of fp8 types: the products are exact, so D is A @ B + C rounded
    once to the accumulator type, for every element of every thread's fragment."""
    got, want = run_fp8(fp8_kernel, variant)
    np.testing.assert_array_equal(got, want)


CVT_SRC = r"""
// Thread i converts x[2i], x[2i + 1] to e4m3x2 and e5m2x2 (plain and .relu), the e4m3x2 and
// e5m2x2 results back to f16x2, and f16x2 h[i] to e4m3x2 / e5m2x2.
extern "C" __global__ void cvt_probe(const float* x, const unsigned* h, unsigned* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const float a = x[2 * i], b = x[2 * i + 1];
  unsigned short e4, e5, e4r, e5r, e4h, e5h;
  unsigned f4, f5;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(e4) : "f"(a), "f"(b));
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(e5) : "f"(a), "f"(b));
  asm("cvt.rn.satfinite.relu.e4m3x2.f32 %0, %1, %2;" : "=h"(e4r) : "f"(a), "f"(b));
  asm("cvt.rn.satfinite.relu.e5m2x2.f32 %0, %1, %2;" : "=h"(e5r) : "f"(a), "f"(b));
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(f4) : "h"(e4));
  asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(f5) : "h"(e5));
  asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(e4h) : "r"(h[i]));
  asm("cvt.rn.satfinite.e5m2x2.f16x2 %0, %1;" : "=h"(e5h) : "r"(h[i]));
  unsigned* o = out + 8 * i;
  o[0] = e4; o[1] = e5; o[2] = e4r; o[3] = e5r; o[4] = f4; o[5] = f5; o[6] = e4h; o[7] = e5h;
}
"""


def sat(x: np.ndarray, kind: str) -> np.ndarray:
    """cvt.rn.satfinite to fp8 as bit patterns: round to nearest even, magnitudes beyond the
    largest finite value (infinities too) give it, NaN stays NaN."""
    top = float(ml_dtypes.finfo(FP8[kind]).max)
    clipped = np.where(np.isnan(x), x, np.clip(x, -top, top))
    return clipped.astype(FP8[kind]).view(np.uint8).astype(np.uint32)


def is_nan8(bits: np.ndarray, kind: str) -> np.ndarray:
    return np.isnan(bits.astype(np.uint8).view(FP8[kind]).astype(np.float32))


def test_cvt_fp8_rounding_saturation_nan():
    """Every fp8 value, the midpoints between neighbours (ties to even), values beyond the
    largest finite one, infinities, NaN, subnormals, negative zero; then back to f16 (exact)."""
    kern = build_kernel(
        CVT_SRC,
        "cvt_probe",
        [("const float*", "x"), ("const unsigned*", "h"), ("unsigned*", "out")],
    )
    finite = [np.arange(256, dtype=np.uint8).view(FP8[k]).astype(np.float64) for k in FP8]
    vals = np.unique(np.concatenate([v[np.isfinite(v)] for v in finite]))
    mids = (vals[1:] + vals[:-1]) / 2
    special = [np.inf, -np.inf, np.nan, -0.0, 500.0, -1e6, 60000.0, 1e-12, 2.0**-10, 3 * 2.0**-11]
    x = np.concatenate([vals, mids, special]).astype(np.float32)
    x = np.concatenate([x, np.zeros((-x.size) % 64, np.float32)])
    pairs = x.size // 2
    with np.errstate(over="ignore"):
        h = np.ascontiguousarray(x.reshape(-1, 2)[:, ::-1]).astype(np.float16).view(np.uint32)
    out = np.zeros((pairs, 8), np.uint32)
    kern(grid=pairs // 32, block=32, args=[x, h, out])
    a, b = x[0::2].astype(np.float64), x[1::2].astype(np.float64)
    for col, kind in ((0, "e4m3"), (1, "e5m2")):
        want = sat(a, kind) << 8 | sat(b, kind)
        got = out[:, col]
        nan = is_nan8(want >> 8, kind) | is_nan8(want & 0xFF, kind)
        np.testing.assert_array_equal(got[~nan], want[~nan])
        assert (
            is_nan8(got[nan] >> 8, kind).sum() + is_nan8(got[nan] & 0xFF, kind).sum()
            == nan.sum() + (is_nan8(want[nan] >> 8, kind) & is_nan8(want[nan] & 0xFF, kind)).sum()
        )
        relu = (sat(np.where(a < 0, 0.0, a), kind) << 8) | sat(np.where(b < 0, 0.0, b), kind)
        keep = ~(np.isnan(a) | np.isnan(b))
        np.testing.assert_array_equal(out[keep, col + 2], relu[keep])
        # back to f16x2: exact (every fp8 value is an f16 value)
        back = out[:, col + 4].copy().view(np.float16).reshape(-1, 2)
        fp8 = got.astype(np.uint16).view(np.uint8).reshape(-1, 2).view(FP8[kind])
        np.testing.assert_array_equal(back[keep], fp8[keep].astype(np.float16))
        # from f16x2: the upper half is a, the lower b (h holds them swapped)
        hv = h.view(np.float16).reshape(-1, 2).astype(np.float64)
        want_h = sat(hv[:, 1], kind) << 8 | sat(hv[:, 0], kind)
        fin = np.isfinite(hv).all(axis=1)
        np.testing.assert_array_equal(out[fin, col + 6], want_h[fin])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("wgmma.mma_async.sync.aligned.m64n8k16.f32.e4m3.e4m3", r"the emulator models k16 with"),
        ("wgmma.mma_async.sync.aligned.m64n8k32.f16.bf16.bf16", r"the emulator models k16 with"),
        ("wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.f16", r"A and B must have the same type"),
    ],
)
def test_wgmma_fp8_forms_refused_loudly(text, message):
    src = (
        "__device__ void f(float* d, unsigned long long a, unsigned long long b) {\n"
        f'  asm volatile("{text} {{%0, %1, %2, %3}}, %4, %5, 1, 1, 1;" : "+f"(d[0]), "+f"(d[1]), '
        '"+f"(d[2]), "+f"(d[3]) : "l"(a), "l"(b));\n}\n'
    )
    with pytest.raises(EmulatorSourceError, match=rf"line 2: .*{message}"):
        transform_source(src)


def test_mutation_fp8_register_a_fragment_is_caught(mutated):  # noqa: F811
    """The 8-bit register-A fragment read with the 16-bit pattern's register order."""
    mutated(
        "kg_wgmma.h",
        "[(row >= 8) + 2 * (k >= 16)]",
        "[2 * (row >= 8) + (k >= 16)]",
    )
    kernel = build_kernel(FP8_SRC, "fp8_probe", FP8_PARAMS)
    got, want = run_fp8(kernel, 2)
    assert not np.array_equal(got, want)
