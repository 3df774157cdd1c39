"""CUDA written by others (CUTLASS-style inline PTX): each gap closed has a probe of the
semantics (PTX ISA) and a mutation of the emulator that the probe catches."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from kernelgen.emulator import (
    EmulatorCompileError,
    EmulatorError,
    EmulatorLaunchError,
    EmulatorSourceError,
    build_kernel,
    kernel,
    transform,
    transform_source,
)

pytestmark = pytest.mark.emulate

SMEM = r"""
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
"""


@pytest.fixture
def fresh_cache(one_off_emulator_builds):
    """An empty build cache: a mutation of the Python translation must not meet a cached build
    of the real one (the cache keys on the emulator's files, not on patched functions)."""


@pytest.fixture
def mutate_header(tmp_path, monkeypatch, one_off_emulator_builds):
    """``mutate_header(file, old, new)``: the emulator's headers with one edit (a fresh build)."""

    def apply(name: str, old: str, new: str) -> None:
        copy = tmp_path / "include"
        if not copy.exists():
            shutil.copytree(kernel.INCLUDE_DIR, copy)
        text = (copy / name).read_text()
        assert old in text, old
        (copy / name).write_text(text.replace(old, new))
        monkeypatch.setattr(kernel, "INCLUDE_DIR", copy)

    return apply


# ---- ldmatrix qualifiers in any order --------------------------------------------------------

LDM_ORDERS = [
    # (qualifiers, matrices, trans)
    ("ldmatrix.sync.aligned.x4.m8n8.shared.b16", 4, False),  # CUTLASS
    ("ldmatrix.sync.aligned.x4.trans.m8n8.shared.b16", 4, True),  # CUTLASS
    ("ldmatrix.sync.aligned.m8n8.x2.shared.b16", 2, False),  # the PTX ISA's order
    ("ldmatrix.sync.aligned.x2.trans.m8n8.shared::cta.b16", 2, True),
    ("ldmatrix.aligned.sync.m8n8.trans.x1.shared.b16", 1, True),
]


def _ldmatrix_source(qualifiers: str, n: int) -> str:
    regs = ", ".join(f"%{i}" for i in range(n))
    outs = ", ".join(f'"=r"(r[{i}])' for i in range(n))
    return (
        SMEM
        + f"""
extern "C" __global__ void ldm(const unsigned short* image, unsigned* out) {{
  extern __shared__ __align__(128) unsigned short smem[];
  for (int i = threadIdx.x; i < 4 * 64; i += 32) smem[i] = image[i];
  __syncthreads();
  const int lane = threadIdx.x;
  unsigned r[4] = {{0u, 0u, 0u, 0u}};
  // rows of matrix m: 8 rows of 8 elements, matrix m at element 64 m
  const unsigned addr = smem_addr(smem + 64 * ((lane / 8) % {n}) + 8 * (lane % 8));
  asm volatile("{qualifiers} {{{regs}}}, [%{n}];\\n" : {outs} : "r"(addr));
  for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
}}
"""
    )


def check_ldmatrix_order(qualifiers: str, n: int, trans: bool) -> None:
    kern = build_kernel(
        _ldmatrix_source(qualifiers, n),
        "ldm",
        [("const unsigned short*", "image"), ("unsigned*", "out")],
    )
    mats = np.random.default_rng(1).integers(0, 2**16, (4, 8, 8)).astype(np.uint16)
    out = np.zeros((32, 4), np.uint32)
    kern(grid=1, block=32, shared_mem=512, args=[mats.reshape(-1), out])
    lane = np.arange(32)
    m = mats.astype(np.uint32)
    for i in range(n):
        if trans:  # rows 2(l%4), 2(l%4)+1 of column l/4
            r0, col = 2 * (lane % 4), lane // 4
            want = m[i, r0, col] | (m[i, r0 + 1, col] << 16)
        else:  # row l/4, columns 2(l%4), 2(l%4)+1
            row, c0 = lane // 4, 2 * (lane % 4)
            want = m[i, row, c0] | (m[i, row, c0 + 1] << 16)
        np.testing.assert_array_equal(out[:, i], want, err_msg=f"{qualifiers} matrix {i}")
    assert (out[:, n:] == 0).all()


@pytest.mark.parametrize(("qualifiers", "n", "trans"), LDM_ORDERS, ids=lambda x: str(x))
def test_ldmatrix_qualifiers_in_any_order(qualifiers, n, trans):
    check_ldmatrix_order(qualifiers, n, trans)


def test_mutation_ldmatrix_order_losing_trans_is_caught(monkeypatch, fresh_cache):
    """A parser that sees .trans only in the PTX ISA's order (.m8n8.xN.trans), as the old
    regular expression did: CUTLASS's .xN.trans.m8n8 then loads untransposed."""
    real = transform._ldmatrix_qualifiers

    def positional(stmt, qualifiers, instr):
        n, _ = real(stmt, qualifiers, instr)
        words = qualifiers.split(".")[1:]
        return n, any(w == "trans" and words[i - 2] == "m8n8" for i, w in enumerate(words))

    monkeypatch.setattr(transform, "_ldmatrix_qualifiers", positional)
    with pytest.raises(AssertionError):
        check_ldmatrix_order(*LDM_ORDERS[1])


@pytest.mark.parametrize(
    ("qualifiers", "message"),
    [
        ("ldmatrix.sync.aligned.x4.x2.m8n8.shared.b16", "each once"),
        ("ldmatrix.sync.aligned.x4.m8n8.shared.b8", "unknown .b8"),
        ("ldmatrix.sync.x4.m8n8.shared.b16", "lacks .aligned"),
    ],
)
def test_bad_ldmatrix_qualifiers_are_rejected(qualifiers, message):
    src = f'__device__ void f(unsigned a, unsigned x) {{ asm volatile("{qualifiers} {{%0}}, [%1];"'
    src += ' : "=r"(x) : "r"(a)); }'
    with pytest.raises(EmulatorSourceError, match=message):
        transform_source(src)


# ---- f32 accumulators as "=r" / "r" / "+r" ---------------------------------------------------

MMA_R_SRC = r"""
extern "C" __global__ void mma_r(const unsigned* a, const unsigned* b, const float* c,
                                 float* d_plus, float* d_eq) {
  const int lane = threadIdx.x;
  unsigned fa[4], fb[2];
  for (int i = 0; i < 4; ++i) fa[i] = a[lane * 4 + i];
  for (int i = 0; i < 2; ++i) fb[i] = b[lane * 2 + i];
  uint32_t acc[4];  // CUTLASS-style: the f32 accumulators' bits in 32-bit integers
  for (int i = 0; i < 4; ++i) memcpy(&acc[i], &c[lane * 4 + i], 4);
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(acc[0]), "+r"(acc[1]), "+r"(acc[2]), "+r"(acc[3])
      : "r"(fa[0]), "r"(fa[1]), "r"(fa[2]), "r"(fa[3]), "r"(fb[0]), "r"(fb[1]));
  int d[4];
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%11,%12,%13};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(fa[0]), "r"(fa[1]), "r"(fa[2]), "r"(fa[3]), "r"(fb[0]), "r"(fb[1]),
        "r"(acc[0]), "r"(acc[1]), "r"(acc[2]), "r"(acc[3]));
  for (int i = 0; i < 4; ++i) {
    memcpy(&d_plus[lane * 4 + i], &acc[i], 4);
    memcpy(&d_eq[lane * 4 + i], &d[i], 4);
  }
}
"""


def _bf16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    bits = (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # exact: small ints
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def check_mma_r_accumulators() -> None:
    kern = build_kernel(
        MMA_R_SRC,
        "mma_r",
        [
            ("const unsigned*", "a"),
            ("const unsigned*", "b"),
            ("const float*", "c"),
            ("float*", "d_plus"),
            ("float*", "d_eq"),
        ],
    )
    rng = np.random.default_rng(2)
    a_bits, a = _bf16(rng.integers(-8, 9, (16, 16)).astype(np.float32))
    b_bits, b = _bf16(rng.integers(-8, 9, (16, 8)).astype(np.float32))
    c = rng.integers(-100, 100, (16, 8)).astype(np.float32) + 0.5
    g, t = np.arange(32) // 4, np.arange(32) % 4

    def pairs(mat, rows, cols):  # two 16-bit elements per register, the lower column low
        return mat[rows, cols].astype(np.uint32) | (mat[rows, cols + 1].astype(np.uint32) << 16)

    fa = np.stack(
        [
            pairs(a_bits, g, 2 * t),
            pairs(a_bits, g + 8, 2 * t),
            pairs(a_bits, g, 2 * t + 8),
            pairs(a_bits, g + 8, 2 * t + 8),
        ],
        1,
    )
    bt = b_bits.T
    fb = np.stack([pairs(bt, g, 2 * t), pairs(bt, g, 2 * t + 8)], 1)
    frag_c = np.stack([c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]], 1)
    d_plus = np.full((32, 4), np.nan, np.float32)
    d_eq = np.full((32, 4), np.nan, np.float32)
    kern(grid=1, block=32, args=[fa.copy(), fb.copy(), frag_c.copy(), d_plus, d_eq])
    ab = a @ b
    want = np.stack(
        [ab[g, 2 * t], ab[g, 2 * t + 1], ab[g + 8, 2 * t], ab[g + 8, 2 * t + 1]], 1
    ) + frag_c.astype(np.float64)
    np.testing.assert_array_equal(d_plus, want.astype(np.float32))  # small integers: exact
    np.testing.assert_array_equal(d_eq, (want + ab_frag(ab, g, t)).astype(np.float32))


def ab_frag(ab: np.ndarray, g: np.ndarray, t: np.ndarray) -> np.ndarray:
    return np.stack([ab[g, 2 * t], ab[g, 2 * t + 1], ab[g + 8, 2 * t], ab[g + 8, 2 * t + 1]], 1)


def test_mma_f32_accumulators_as_r_operands():
    """ "+r" accumulators, then "=r" outputs with "r" C inputs (d = A B + (A B + C))."""
    check_mma_r_accumulators()


def test_mutation_r_accumulators_converted_by_value_is_caught(mutate_header):
    """Reading an "r" accumulator as an integer value instead of the float's bits."""
    mutate_header(
        "kg_ptx.h",
        "  float f;\n  std::memcpy(&f, &u, 4);\n  return f;",
        "  return static_cast<float>(u);",
    )
    with pytest.raises(AssertionError):
        check_mma_r_accumulators()


# ---- cp.async with its size as an "n" operand ------------------------------------------------

CP_N_SRC = (
    SMEM
    + r"""
template <int Bytes>
__device__ __forceinline__ void copy(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n"
               :: "r"(smem_addr(dst)), "l"(src), "n"(Bytes));
}
extern "C" __global__ void cp_n(const unsigned char* src, unsigned char* out) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int t = threadIdx.x;
  for (int i = t; i < 1024; i += 32) smem[i] = 0xEE;
  __syncthreads();
  unsigned char* mine = smem + 32 * t;
  const unsigned char* s = src + 32 * t;
  copy<4>(mine, s);
  copy<8>(mine + 8, s + 8);
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], %2, %3;\n"
               :: "r"(smem_addr(mine + 16)), "l"(s + 16), "n"(16), "n"(12));
  asm volatile("cp.async.commit_group;\n" ::);
  asm volatile("cp.async.wait_group %0;\n" :: "n"(0));
  for (int i = 0; i < 32; ++i) out[32 * t + i] = mine[i];
}
"""
)


def check_cp_async_n_sizes() -> None:
    kern = build_kernel(
        CP_N_SRC, "cp_n", [("const unsigned char*", "src"), ("unsigned char*", "out")]
    )
    src = np.random.default_rng(3).integers(0, 200, 1024).astype(np.uint8)
    out = np.zeros(1024, np.uint8)
    stats = kern(grid=1, block=32, shared_mem=1024, args=[src, out])
    s, o = src.reshape(32, 32), out.reshape(32, 32)
    want = np.full((32, 32), 0xEE, np.uint8)
    want[:, 0:4] = s[:, 0:4]
    want[:, 8:16] = s[:, 8:16]
    want[:, 16:28] = s[:, 16:28]
    want[:, 28:32] = 0  # src-size 12 of 16: zero-filled
    np.testing.assert_array_equal(o, want)
    assert stats.cp_async_global_bytes == 32 * (4 + 8 + 12)
    assert stats.cp_async_copies_by_arg == {"src": 96, "out": 0}


def test_cp_async_size_as_n_operand():
    check_cp_async_n_sizes()


def test_mutation_cp_async_n_size_taken_as_16_is_caught(monkeypatch, fresh_cache):
    monkeypatch.setattr(transform, "_cp_size", lambda *args: "16")
    with pytest.raises((AssertionError, EmulatorLaunchError)):
        check_cp_async_n_sizes()


def test_cp_async_cg_with_an_n_size_other_than_16_does_not_compile():
    src = CP_N_SRC.replace('"n"(16), "n"(12)', '"n"(8), "n"(8)')
    with pytest.raises(EmulatorCompileError, match=r"cp\.async\.cg copies 16 bytes"):
        build_kernel(src, "cp_n", [("const unsigned char*", "src"), ("unsigned char*", "out")])


# ---- inline asm in multi-line #defines, and in macros never used -----------------------------

MACRO_SRC = (
    SMEM
    + r"""
#define CP_ASYNC(dst, src, N)                                              \
  asm volatile("cp.async.cg.shared.global [%0], [%1], " #N ";\n"          \
               :: "r"(smem_addr(dst)), "l"(src))
#define LDSM_X1(r, addr)                                                   \
  asm volatile("ldmatrix.sync.aligned.x1.m8n8.shared.b16 {%0}, [%1];\n"   \
               : "=r"(r)                                                   \
               : "r"(addr))
// Never used, and the emulator does not model these: they must not matter.
#define UNUSED_BARRIER() asm volatile("membar.gl;\n" ::)
#define UNUSED_LANEID(x) asm volatile("mov.u32 %0, %%laneid;" : "=r"(x))
#if 0
__device__ void never_compiled() { asm volatile("wgmma.fence.sync.aligned;\n" ::); }
#endif

extern "C" __global__ void macros(const unsigned short* src, unsigned* out) {
  extern __shared__ __align__(128) unsigned short smem[];
  const int lane = threadIdx.x;
  if (lane < 8) CP_ASYNC(smem + 8 * lane, src + 8 * lane, 16);
  asm volatile("cp.async.wait_all;\n" ::);
  __syncthreads();
  unsigned r;
  LDSM_X1(r, smem_addr(smem + 8 * (lane % 8)));
  out[lane] = r;
}
"""
)


def check_asm_in_macros() -> None:
    kern = build_kernel(
        MACRO_SRC, "macros", [("const unsigned short*", "src"), ("unsigned*", "out")]
    )
    mat = np.random.default_rng(4).integers(0, 2**16, (8, 8)).astype(np.uint16)
    out = np.zeros(32, np.uint32)
    kern(grid=1, block=32, shared_mem=256, args=[mat.reshape(-1), out])
    lane = np.arange(32)
    m = mat.astype(np.uint32)
    np.testing.assert_array_equal(
        out, m[lane // 4, 2 * (lane % 4)] | (m[lane // 4, 2 * (lane % 4) + 1] << 16)
    )


def test_asm_in_multiline_defines_and_unused_macros():
    check_asm_in_macros()


def test_mutation_no_preprocessing_is_caught(monkeypatch, fresh_cache):
    """Rewriting the source as written (before preprocessing) meets the unused macros."""
    real = kernel._preprocess

    def as_written(cxx, source, name, dirs, defines):
        text = real(cxx, "", name, dirs, defines)  # the shim only
        return text + f'# 1 "{name}.cu"\n' + source

    monkeypatch.setattr(kernel, "_preprocess", as_written)
    with pytest.raises(EmulatorSourceError):
        check_asm_in_macros()


def test_unsupported_asm_in_a_used_macro_is_still_reported():
    src = MACRO_SRC.replace("  unsigned r;\n", "  unsigned r;\n  UNUSED_BARRIER();\n")
    with pytest.raises(EmulatorSourceError, match=r"unsupported instruction 'membar\.gl'"):
        build_kernel(src, "macros", [("const unsigned short*", "src"), ("unsigned*", "out")])


# ---- C++14 digit separators -------------------------------------------------------------------

SEPARATOR_SRC = r"""
constexpr int kSmemBytes = 1'024;  // read as a character literal, it would hide the declaration
extern "C" __global__ void separators(float* out) {
  extern __shared__ __align__(16) float buf[];
  constexpr unsigned kMask = 0xFF'FF;
  buf[threadIdx.x] = static_cast<float>(threadIdx.x + kSmemBytes / 1'000 + (kMask >> 16));
  __syncthreads();
  out[threadIdx.x] = buf[31 - threadIdx.x] + ('\'' == 39 && u'x' == 120 ? 0.5f : 0.f);
}
"""


def check_digit_separators() -> None:
    kern = build_kernel(SEPARATOR_SRC, "separators", [("float*", "out")])
    out = np.zeros(32, np.float32)
    kern(grid=1, block=32, shared_mem=128, args=[out])
    np.testing.assert_array_equal(out, (31 - np.arange(32) + 1).astype(np.float32) + 0.5)


def test_digit_separators_do_not_hide_the_shared_memory_declaration():
    check_digit_separators()
    out = transform_source(SEPARATOR_SRC)
    assert "extern __shared__" not in out and "1'024" in out


def test_mutation_separator_read_as_a_char_literal_is_caught(monkeypatch, fresh_cache):
    monkeypatch.setattr(transform, "_is_digit_separator", lambda src, i: False)
    with pytest.raises((EmulatorError, AssertionError)):
        check_digit_separators()


# ---- __cvta_generic_to_shared on addresses that ldmatrix .x1/.x2 ignores -----------------------

CVTA_SRC = (
    SMEM
    + r"""
extern "C" __global__ void cvta_ignored(const unsigned short* image, const unsigned short* far,
                                        unsigned* out, int bad_lane) {
  extern __shared__ __align__(128) unsigned short smem[];
  for (int i = threadIdx.x; i < 128; i += 32) smem[i] = image[i];
  __syncthreads();
  const int lane = threadIdx.x;
  // CUTLASS computes every lane's pointer; lanes 16.. point far outside shared memory.
  const unsigned short* p = lane < 16 ? smem + 64 * (lane / 8) + 8 * (lane % 8) : far + lane;
  if (lane == bad_lane) p = far;
  const unsigned addr = smem_addr(p);
  unsigned r0, r1;
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r0), "=r"(r1) : "r"(addr));
  out[2 * lane] = r0;
  out[2 * lane + 1] = r1;
}
"""
)
CVTA_PARAMS = [
    ("const unsigned short*", "image"),
    ("const unsigned short*", "far"),
    ("unsigned*", "out"),
    ("int", "bad_lane"),
]


def check_cvta_of_ignored_lanes() -> None:
    kern = build_kernel(CVTA_SRC, "cvta_ignored", CVTA_PARAMS)
    mats = np.random.default_rng(5).integers(0, 2**16, (2, 8, 8)).astype(np.uint16)
    far = np.zeros(64, np.uint16)
    out = np.zeros((32, 2), np.uint32)
    kern(grid=1, block=32, shared_mem=256, args=[mats.reshape(-1), far, out, -1])
    lane = np.arange(32)
    m = mats.astype(np.uint32)
    for i in range(2):
        want = m[i, lane // 4, 2 * (lane % 4)] | (m[i, lane // 4, 2 * (lane % 4) + 1] << 16)
        np.testing.assert_array_equal(out[:, i], want)


def test_cvta_of_addresses_ldmatrix_ignores_does_not_trap():
    check_cvta_of_ignored_lanes()


def test_cvta_of_an_address_ldmatrix_uses_still_traps():
    kern = build_kernel(CVTA_SRC, "cvta_ignored", CVTA_PARAMS)
    args = [np.zeros(128, np.uint16), np.zeros(64, np.uint16), np.zeros((32, 2), np.uint32), 9]
    # Whichever thread of the warp runs the collective first reports it: lane 9 itself names
    # the pointer it converted, another lane names lane 9's address (both name lane and cvta).
    either = r"ldmatrix row: .*(from lane 9.*__cvta_generic|__cvta_generic.*from lane 9)"
    with pytest.raises(EmulatorLaunchError, match=either):
        kern(grid=1, block=32, shared_mem=256, args=args)


def test_mutation_cvta_trapping_at_conversion_is_caught(mutate_header):
    mutate_header(
        "kg_ptx.h",
        "    last_outside_cvta() = p;\n",
        '    trap_with("__cvta_generic_to_shared(%p): outside", p);\n',
    )
    with pytest.raises(EmulatorLaunchError):
        check_cvta_of_ignored_lanes()
