"""Tests of the CPU CUDA emulator (tests/cuda_emulator): small kernels checked against numpy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from cuda_emulator import EmulatorUnavailableError, build_kernel, transform_source  # noqa: E402

if shutil.which(os.environ.get("KG_EMULATOR_CXX", "g++")) is None:
    if os.environ.get("CI") == "true":
        pytest.fail("g++ is required for the CUDA emulator tests in CI", pytrace=False)
    pytest.skip("g++ not found: CUDA emulator tests skipped", allow_module_level=True)

pytestmark = pytest.mark.emulate

FULL = "0xffffffffu"


def _run_isolated(script: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh interpreter (so a hang or stuck threads cannot hurt pytest)."""
    prelude = f"import sys\nsys.path.insert(0, {str(TESTS_DIR)!r})\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# ---------------------------------------------------------------------------------------------
# (a) dynamic shared memory + __syncthreads over a 2-D grid
# ---------------------------------------------------------------------------------------------

REVERSE_SRC = r"""
#include <cuda_fp16.h>

extern "C" __global__ void __launch_bounds__(256)
reverse256(const float* __restrict__ in, float* __restrict__ out, int* __restrict__ info,
           int write_at) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* buf = reinterpret_cast<float*>(smem_raw);
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  const int b = blockIdx.y * gridDim.x + blockIdx.x;
  if (in != nullptr) buf[t] = in[b * 256 + t];
  if (write_at != -1 && t == 0) buf[write_at] = 1.0f;  // possibly out of bounds, on purpose
  __syncthreads();
  out[b * 256 + t] = buf[255 - t];
  if (t == 0) {
    info[4 * b + 0] = blockIdx.x;
    info[4 * b + 1] = blockIdx.y;
    info[4 * b + 2] = gridDim.x;
    info[4 * b + 3] = gridDim.y;
  }
}
"""
REVERSE_PARAMS = [
    ("const float*", "in"),
    ("float*", "out"),
    ("int*", "info"),
    ("int", "write_at"),
]


@pytest.fixture(scope="module")
def reverse_kernel():
    return build_kernel(REVERSE_SRC, "reverse256", REVERSE_PARAMS)


def test_dynamic_smem_reverse_2d_grid(reverse_kernel):
    gx, gy = 3, 2
    rng = np.random.default_rng(0)
    x = rng.standard_normal(gx * gy * 256).astype(np.float32)
    out = np.zeros_like(x)
    info = np.full(gx * gy * 4, -7, np.int32)
    reverse_kernel(grid=(gx, gy, 1), block=(32, 8, 1), shared_mem=256 * 4, args=[x, out, info, -1])
    np.testing.assert_array_equal(out, x.reshape(-1, 256)[:, ::-1].reshape(-1))
    expect = [(bx, by, gx, gy) for by in range(gy) for bx in range(gx)]
    np.testing.assert_array_equal(info.reshape(-1, 4), np.array(expect, np.int32))


def test_unwritten_dynamic_smem_reads_garbage(reverse_kernel, monkeypatch):
    out = np.zeros(256, np.float32)
    info = np.zeros(4, np.int32)
    reverse_kernel(grid=1, block=256, shared_mem=1024, args=[None, out, info, -1])
    assert np.isnan(out).all()  # default fill byte 0xFF: NaN
    monkeypatch.setenv("KG_EMULATOR_SMEM_FILL", "0xCD")
    reverse_kernel(grid=1, block=256, shared_mem=1024, args=[None, out, info, -1])
    np.testing.assert_array_equal(out.view(np.uint32), np.full(256, 0xCDCDCDCD, np.uint32))


def test_dynamic_smem_overflow_is_reported(reverse_kernel):
    out = np.zeros(256, np.float32)
    info = np.zeros(4, np.int32)
    x = np.ones(256, np.float32)
    with pytest.raises(RuntimeError, match="past the end of its 1024 bytes"):
        reverse_kernel(grid=1, block=256, shared_mem=1024, args=[x, out, info, 256])
    with pytest.raises(RuntimeError, match="before the start"):
        reverse_kernel(grid=1, block=256, shared_mem=1024, args=[x, out, info, -3])
    # The kernel stays usable after a failed launch.
    reverse_kernel(grid=1, block=256, shared_mem=1024, args=[x, out, info, 255])
    assert (out == 1.0).all()


# ---------------------------------------------------------------------------------------------
# (b) warp shuffles
# ---------------------------------------------------------------------------------------------

BUTTERFLY_SRC = r"""
extern "C" __global__ void butterfly(const float* x, float* sums, float* maxs, int group) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  float s = x[i];
  float m = s;
  for (int off = group / 2; off > 0; off >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, off);
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  }
  sums[i] = s;
  maxs[i] = m;
}
"""


@pytest.fixture(scope="module")
def butterfly_kernel():
    params = [("const float*", "x"), ("float*", "sums"), ("float*", "maxs"), ("int", "group")]
    return build_kernel(BUTTERFLY_SRC, "butterfly", params)


@pytest.mark.parametrize("group", [4, 8, 32])
def test_shfl_xor_butterfly_sum_and_max(butterfly_kernel, group):
    rng = np.random.default_rng(group)
    n = 2 * 128
    x = rng.integers(-1000, 1000, n).astype(np.float32)  # integer-valued: exact in any order
    sums = np.zeros_like(x)
    maxs = np.zeros_like(x)
    butterfly_kernel(grid=(2, 1, 1), block=(128, 1, 1), args=[x, sums, maxs, group])
    g = x.reshape(-1, group)
    np.testing.assert_array_equal(sums, np.repeat(g.sum(axis=1), group))
    np.testing.assert_array_equal(maxs, np.repeat(g.max(axis=1), group))


WARP_MISC_SRC = r"""
#include <cuda_runtime.h>
#include <math_constants.h>

extern "C" __global__ void warp_misc(const int* __restrict__ x, int* __restrict__ out,
                                     double* __restrict__ dout, float* __restrict__ fout,
                                     unsigned int* __restrict__ counter, int trap_at) {
  const int t = threadIdx.x;
  const int i = blockIdx.x * blockDim.x + t;
  const int v = __ldg(x + i);
  if (t == trap_at) __trap();
  out[8 * i + 0] = __shfl_sync(0xffffffffu, v, 3, 8);         // lane 3 of each 8-lane segment
  out[8 * i + 1] = __shfl_down_sync(0xffffffffu, v, 2, 16);   // own value past the segment
  out[8 * i + 2] = __shfl_up_sync(0xffffffffu, v, 1);         // own value on lane 0
  out[8 * i + 3] = __shfl_xor_sync(0xffffffffu, v, 5, 4);     // lane ^ 5 outside width 4 -> own
  out[8 * i + 4] = static_cast<int>(__ballot_sync(0xffffffffu, v > 0));
  out[8 * i + 5] = __any_sync(0xffffffffu, v > 900) + 2 * __all_sync(0xffffffffu, v > -1001);
  out[8 * i + 6] = min(v, 7LL) + max(2u, 1u);                  // mixed-type CUDA min/max
  out[8 * i + 7] = __popc(static_cast<unsigned>(t));
  dout[i] = __shfl_sync(0xffffffffu, 0.5 * v, 31 - (t & 31));   // 8-byte type
  __syncwarp();
  fout[4 * i + 0] = rsqrtf(4.0f) + __fdividef(1.0f, 4.0f) + __frcp_rn(2.0f);  // 1.25
  fout[4 * i + 1] = isinf(CUDART_INF_F) + isnan(CUDART_NAN_F) + (INFINITY > 0.0f);
  fout[4 * i + 2] = exp2f(log2f(8.0f)) + __expf(0.0f) + __logf(1.0f) + fabsf(-1.0f);  // 10
  fout[4 * i + 3] = min(2.5f, 1.5f) + max(-1.0f, NAN);  // 1.5 + (-1)
  atomicAdd(counter, 1u);
}
"""


@pytest.fixture(scope="module")
def warp_misc_kernel():
    params = [
        ("const int*", "x"),
        ("int*", "out"),
        ("double*", "dout"),
        ("float*", "fout"),
        ("unsigned int*", "counter"),
        ("int", "trap_at"),
    ]
    return build_kernel(WARP_MISC_SRC, "warp_misc", params)


def test_shuffle_variants_ballot_and_math(warp_misc_kernel):
    rng = np.random.default_rng(1)
    nb, bs = 2, 128
    n = nb * bs
    x = rng.integers(-1000, 1000, n).astype(np.int32)
    out = np.zeros(8 * n, np.int32)
    dout = np.zeros(n, np.float64)
    fout = np.zeros(4 * n, np.float32)
    counter = np.zeros(1, np.uint32)
    warp_misc_kernel(grid=nb, block=bs, args=[x, out, dout, fout, counter, -1])
    out = out.reshape(n, 8)
    lane = np.arange(n) % 32
    warp_base = np.arange(n) - lane
    seg = lambda w: (lane // w) * w  # noqa: E731
    np.testing.assert_array_equal(out[:, 0], x[warp_base + seg(8) + 3])
    down = lane + 2
    np.testing.assert_array_equal(
        out[:, 1], np.where(down < seg(16) + 16, x[warp_base + np.minimum(down, 31)], x)
    )
    up = lane - 1
    np.testing.assert_array_equal(out[:, 2], np.where(up >= 0, x[warp_base + up], x))
    xor = lane ^ 5
    np.testing.assert_array_equal(out[:, 3], np.where(xor < seg(4) + 4, x[warp_base + xor], x))
    bits = (x.reshape(-1, 32) > 0).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    ballot = bits.sum(axis=1).astype(np.uint32).view(np.int32)
    np.testing.assert_array_equal(out[:, 4], np.repeat(ballot, 32))
    anys = (x.reshape(-1, 32) > 900).any(axis=1).astype(np.int32)
    np.testing.assert_array_equal(out[:, 5], np.repeat(anys + 2, 32))
    np.testing.assert_array_equal(out[:, 6], np.minimum(x, 7) + 2)
    np.testing.assert_array_equal(out[:, 7], [bin(t).count("1") for t in np.arange(n) % bs])
    np.testing.assert_array_equal(dout, 0.5 * x[warp_base + 31 - lane])
    np.testing.assert_allclose(fout.reshape(n, 4), np.tile([1.25, 3.0, 10.0, 0.5], (n, 1)))
    assert counter[0] == n


def test_trap_is_reported(warp_misc_kernel):
    n = 64
    args = [
        np.zeros(n, np.int32),
        np.zeros(8 * n, np.int32),
        np.zeros(n, np.float64),
        np.zeros(4 * n, np.float32),
        np.zeros(1, np.uint32),
        37,
    ]
    with pytest.raises(RuntimeError, match=r"__trap\(\) in block \(0,0,0\) thread \(37,0,0\)"):
        warp_misc_kernel(grid=1, block=64, args=args)


# ---------------------------------------------------------------------------------------------
# (c) float16 / bfloat16 conversions
# ---------------------------------------------------------------------------------------------

CONVERT_SRC = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

extern "C" __global__ void convert(const float* __restrict__ x, __half* __restrict__ h,
                                   float* __restrict__ h_back, __nv_bfloat16* __restrict__ b,
                                   float* __restrict__ b_back, const __half* __restrict__ h_all,
                                   const __nv_bfloat16* __restrict__ b_all,
                                   float* __restrict__ h_all_f, float* __restrict__ b_all_f,
                                   int n) {
  const int stride = gridDim.x * blockDim.x;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const __half hv = (i & 1) ? __float2half_rn(x[i]) : __float2half(x[i]);
    h[i] = hv;
    h_back[i] = __half2float(hv);
    const __nv_bfloat16 bv = (i & 1) ? __float2bfloat16_rn(x[i]) : __float2bfloat16(x[i]);
    b[i] = bv;
    b_back[i] = __bfloat162float(bv);
  }
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < 65536; i += stride) {
    h_all_f[i] = __half2float(h_all[i]);
    b_all_f[i] = __bfloat162float(b_all[i]);
  }
}
"""


@pytest.fixture(scope="module")
def convert_kernel():
    params = [
        ("const float*", "x"),
        ("__half*", "h"),
        ("float*", "h_back"),
        ("__nv_bfloat16*", "b"),
        ("float*", "b_back"),
        ("const __half*", "h_all"),
        ("const __nv_bfloat16*", "b_all"),
        ("float*", "h_all_f"),
        ("float*", "b_all_f"),
        ("int", "n"),
    ]
    return build_kernel(CONVERT_SRC, "convert", params)


def _tricky_values() -> np.ndarray:
    f = np.float32
    two = lambda e: f(2.0) ** f(e)  # noqa: E731
    vals = [
        0.0, -0.0, 1.0, -1.0, 0.1, 1 / 3, -3.14159265, 2049.0, 2051.0, 4097.0,
        1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-11 + 2**-23, 65504.0, 65519.99, 65520.0, -65520.0,
        65536.0, 1e10, -1e30, np.inf, -np.inf, np.nan, -np.nan,
        2**-14, 2**-14 - 2**-25, 2**-14 - 2**-24, 2**-24, 2**-25, -(2**-25), 3 * 2**-25,
        5 * 2**-26, 2**-25 + 2**-40, 2**-26, 1e-40, -1e-45, 6e-8, 6.1e-5,
        1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, 3.3895314e38, 3.39e38, 3.4028235e38,
        -3.4028235e38, 1.1754944e-38, 9.2e-41,
    ]  # fmt: skip
    arr = np.array(vals, dtype=np.float64).astype(np.float32)
    rng = np.random.default_rng(2)
    random_bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(f)
    scales = two(rng.integers(-30, 20, 20000))
    around_half = (rng.standard_normal(20000).astype(f) * scales).astype(f)
    return np.concatenate([arr, random_bits, around_half])


def _bf16_reference_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even of float32 bit patterns to bfloat16 (canonical NaN 0x7FFF)."""
    u = x.view(np.uint32)
    hi = (u >> 16).astype(np.uint32)
    lo = u & np.uint32(0xFFFF)
    round_up = (lo > 0x8000) | ((lo == 0x8000) & ((hi & 1) == 1))
    out = (hi + round_up).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FFF), out)


def test_half_and_bfloat16_round_trip(convert_kernel):
    x = _tricky_values()
    n = x.size
    h = np.zeros(n, np.float16)
    h_back = np.zeros(n, np.float32)
    b = np.zeros(n, np.uint16)
    b_back = np.zeros(n, np.float32)
    all16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    h_all_f = np.zeros(65536, np.float32)
    b_all_f = np.zeros(65536, np.float32)
    args = [x, h, h_back, b, b_back, all16.view(np.float16), all16, h_all_f, b_all_f, n]
    convert_kernel(grid=4, block=128, args=args)

    with np.errstate(over="ignore"):
        ref_h = x.astype(np.float16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(h.view(np.uint16)[~nan], ref_h.view(np.uint16)[~nan])
    assert (h.view(np.uint16)[nan] == 0x7FFF).all()  # the GPU's canonical NaN
    ref_back = ref_h.astype(np.float32)
    np.testing.assert_array_equal(h_back.view(np.uint32)[~nan], ref_back.view(np.uint32)[~nan])
    assert np.isnan(h_back[nan]).all()
    # Spot checks independent of numpy's conversion.
    special = {65504.0: 0x7BFF, 65520.0: 0x7C00, 2**-24: 0x0001, 2**-25: 0x0000, 3 * 2**-25: 0x0002}
    for value, bits in special.items():
        assert h.view(np.uint16)[np.flatnonzero(x == np.float32(value))[0]] == bits
    assert h.view(np.uint16)[1] == 0x8000  # -0.0

    np.testing.assert_array_equal(b, _bf16_reference_bits(x))
    b_ref_back = (b.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(b_back.view(np.uint32), b_ref_back.view(np.uint32))
    for value, bits in {1 + 2**-8: 0x3F80, 1 + 3 * 2**-8: 0x3F82, 3.4028235e38: 0x7F80}.items():
        assert b[np.flatnonzero(x == np.float32(value))[0]] == bits

    # Every 16-bit pattern widens exactly (NaN payloads included, as numpy does).
    np.testing.assert_array_equal(
        h_all_f.view(np.uint32), all16.view(np.float16).astype(np.float32).view(np.uint32)
    )
    np.testing.assert_array_equal(b_all_f.view(np.uint32), all16.astype(np.uint32) << 16)


# ---------------------------------------------------------------------------------------------
# (d) early return + __syncthreads does not deadlock; the watchdog catches a real deadlock
# ---------------------------------------------------------------------------------------------

EARLY_EXIT_SRC = r"""
extern "C" __global__ void early_exit(const float* in, float* out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* s = reinterpret_cast<float*>(smem_raw);
  const int t = threadIdx.x;
  const int i = blockIdx.x * blockDim.x + t;
  if (t % 5 == 0 || (t >= 32 && t < 64)) {  // scattered lanes and one whole warp leave
    out[i] = -1.0f;
    return;
  }
  s[t] = 2.0f * in[i];
  __syncthreads();
  __syncwarp();
  const float mine = s[t];
  __syncthreads();
  s[t] = mine + 1.0f;
  __syncthreads();
  out[i] = s[t];
}
"""

DEADLOCK_SRC = r"""
extern "C" __global__ void deadlock(int* out) {
  if (threadIdx.x == 0) {
    __syncwarp();       // the rest of warp 0 never gets here ...
  } else {
    __syncthreads();    // ... and thread 0 never gets here
  }
  out[threadIdx.x] = 1;
}
"""


def test_early_return_does_not_deadlock():
    script = f"""
    import numpy as np
    from cuda_emulator import build_kernel
    k = build_kernel({EARLY_EXIT_SRC!r}, "early_exit", [("const float*", "in"), ("float*", "out")])
    nb, bs = 3, 128
    x = np.arange(nb * bs, dtype=np.float32)
    out = np.zeros_like(x)
    k(grid=nb, block=bs, shared_mem=bs * 4, args=[x, out], timeout=50)
    t = np.arange(nb * bs) % bs
    exited = (t % 5 == 0) | ((t >= 32) & (t < 64))
    np.testing.assert_array_equal(out, np.where(exited, -1.0, 2.0 * x + 1.0))
    print("ok")
    """
    res = _run_isolated(script, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


def test_watchdog_reports_deadlock():
    script = f"""
    import numpy as np
    from cuda_emulator import build_kernel
    k = build_kernel({DEADLOCK_SRC!r}, "deadlock", [("int*", "out")])
    out = np.zeros(64, np.int32)
    try:
        k(grid=1, block=64, args=[out], timeout=1.0)
    except RuntimeError as e:
        print(e)
    else:
        print("no error")
    """
    res = _run_isolated(script, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "did not finish within 1000 ms" in res.stdout, res.stdout + res.stderr


# ---------------------------------------------------------------------------------------------
# (e) static __shared__ arrays inside a kernel (and dynamic smem declared at namespace scope)
# ---------------------------------------------------------------------------------------------

STATIC_SMEM_SRC = r"""
extern __shared__ __align__(16) unsigned char g_dyn[];  // namespace scope

namespace {
__device__ __forceinline__ float twice(float v) { return 2.0f * v; }
}  // namespace

extern "C" __global__ void static_smem(const float* __restrict__ in, float* __restrict__ out) {
  __shared__ float tile[64];
  __shared__ float total;
  const int t = threadIdx.x;
  tile[t] = in[blockIdx.x * 64 + t];
  reinterpret_cast<float*>(g_dyn)[t] = 1.0f;
  __syncthreads();
  if (t == 0) {
    float s = 0.0f;
    for (int k = 0; k < 64; ++k) s += tile[k];
    total = s;
  }
  __syncthreads();
  out[blockIdx.x * 64 + t] = twice(tile[63 - t]) + total + reinterpret_cast<float*>(g_dyn)[63 - t];
}
"""


def test_static_shared_array():
    k = build_kernel(STATIC_SMEM_SRC, "static_smem", [("const float*", "in"), ("float*", "out")])
    nb = 5
    x = np.random.default_rng(3).integers(-50, 50, nb * 64).astype(np.float32)
    out = np.zeros_like(x)
    k(grid=nb, block=64, shared_mem=64 * 4, args=[x, out])
    g = x.reshape(nb, 64)
    ref = 2 * g[:, ::-1] + g.sum(axis=1, keepdims=True) + 1.0
    np.testing.assert_array_equal(out, ref.reshape(-1))


# ---------------------------------------------------------------------------------------------
# (f) long long strides, non-contiguous views, a null pointer argument
# ---------------------------------------------------------------------------------------------

STRIDED_SRC = r"""
extern "C" __global__ void strided_scale(const float* __restrict__ x, float* __restrict__ y,
                                         const float* __restrict__ bias,
                                         long long x_row_stride, long long x_col_stride,
                                         long long y_row_stride, int cols, float alpha,
                                         long long tag, long long* __restrict__ tag_out) {
  const long long r = blockIdx.x;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    float v = alpha * x[r * x_row_stride + c * x_col_stride];
    if (bias != nullptr) v += bias[c];
    y[r * y_row_stride + c] = v;
  }
  if (r == 0 && threadIdx.x == 0) tag_out[0] = tag + 1;
}
"""
STRIDED_PARAMS = [
    ("const float* __restrict__", "x"),
    ("float* __restrict__", "y"),
    ("const float* __restrict__", "bias"),
    ("long long", "x_row_stride"),
    ("long long", "x_col_stride"),
    ("long long", "y_row_stride"),
    ("int", "cols"),
    ("float", "alpha"),
    ("long long", "tag"),
    ("long long*", "tag_out"),
]


@pytest.fixture(scope="module")
def strided_kernel():
    return build_kernel(STRIDED_SRC, "strided_scale", STRIDED_PARAMS)


@pytest.mark.parametrize("with_bias", [False, True])
def test_strides_and_null_pointer(strided_kernel, with_bias):
    rng = np.random.default_rng(4)
    base = rng.standard_normal((50, 40)).astype(np.float32)
    x = base[3:43:2, ::-3].T  # non-contiguous, negative column stride, transposed
    rows, cols = x.shape
    ybase = np.full((rows, cols + 5), 9.0, np.float32)
    y = ybase[:, 2 : 2 + cols]  # row stride cols + 5
    bias = rng.standard_normal(cols).astype(np.float32) if with_bias else None
    tag_out = np.zeros(1, np.int64)
    it = x.itemsize
    args = [
        x, y, bias, x.strides[0] // it, x.strides[1] // it, y.strides[0] // it,
        cols, np.float32(1.5), 3 << 40, tag_out,
    ]  # fmt: skip
    strided_kernel(grid=(rows, 1, 1), block=(32, 1, 1), args=args)
    ref = np.float32(1.5) * x + (bias if with_bias else np.float32(0))
    np.testing.assert_array_equal(y, ref)
    assert (ybase[:, :2] == 9.0).all() and (ybase[:, 2 + cols :] == 9.0).all()
    assert tag_out[0] == (3 << 40) + 1


def test_argument_validation(strided_kernel):
    x = np.zeros((4, 4), np.float32)
    y = np.zeros((4, 4), np.float32)
    t = np.zeros(1, np.int64)
    good = [x, y, None, 4, 1, 4, 4, 1.0, 0, t]
    strided_kernel(grid=4, block=32, args=good)
    with pytest.raises(TypeError, match="takes 10 arguments"):
        strided_kernel(grid=4, block=32, args=good[:-1])
    with pytest.raises(TypeError, match="numpy array or None"):
        strided_kernel(grid=4, block=32, args=[x, 0, *good[2:]])
    with pytest.raises(TypeError, match="dtype float32"):
        strided_kernel(grid=4, block=32, args=[x.astype(np.float64), *good[1:]])
    with pytest.raises(TypeError, match="needs an integer"):
        strided_kernel(grid=4, block=32, args=[*good[:3], 4.0, *good[4:]])
    with pytest.raises(OverflowError):
        strided_kernel(grid=4, block=32, args=[*good[:6], 2**31, *good[7:]])
    with pytest.raises(ValueError, match="multiple of 32"):
        strided_kernel(grid=4, block=(16, 3, 1), args=good)
    with pytest.raises(ValueError):
        strided_kernel(grid=4, block=2048, args=good)
    with pytest.raises(ValueError, match="shared_mem"):
        strided_kernel(grid=4, block=32, shared_mem=1 << 20, args=good)


# ---------------------------------------------------------------------------------------------
# Build errors and the source rewrite
# ---------------------------------------------------------------------------------------------


def test_compile_error_carries_compiler_output():
    src = 'extern "C" __global__ void broken(float* y) { y[0] = not_declared_anywhere; }'
    with pytest.raises(RuntimeError, match="not_declared_anywhere") as info:
        build_kernel(src, "broken", [("float*", "y")])
    assert "broken.cu:1" in str(info.value)


def test_missing_compiler_raises_unavailable(monkeypatch):
    monkeypatch.setenv("KG_EMULATOR_CXX", "definitely-not-a-compiler-kg")
    with pytest.raises(EmulatorUnavailableError):
        build_kernel(STRIDED_SRC, "strided_scale", STRIDED_PARAMS)


def test_unsupported_parameter_types_are_rejected():
    with pytest.raises(ValueError, match="unsupported"):
        build_kernel(STRIDED_SRC, "strided_scale", [("float**", "x")])
    with pytest.raises(ValueError, match="unsupported"):
        build_kernel(STRIDED_SRC, "strided_scale", [("__half", "x")])


@pytest.mark.parametrize(
    "decl",
    [
        "extern __shared__ __align__(16) unsigned char smem[];",
        "extern   __shared__\n    __align__( 128 )  unsigned char  smem [ ] ;",
        "extern __shared__ unsigned char __align__(16) smem[];",
        "extern __shared__ float4 smem[];",
    ],
)
def test_dynamic_smem_declaration_rewrite(decl):
    src = f"__global__ void k() {{\n  // extern __shared__ char in_comment[];\n  {decl}\n}}\n"
    out = transform_source(src)
    assert "::kg_emu::dynamic_smem()" in out
    assert "extern __shared__ char in_comment[];" in out  # comments untouched
    assert out.count("\n") == src.count("\n")  # line numbers kept
