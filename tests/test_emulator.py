"""Tests of the CPU CUDA emulator (kernelgen.emulator): small kernels checked against numpy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kernelgen.emulator import (
    EmulatorArgumentError,
    EmulatorArgumentTypeError,
    EmulatorUnavailableError,
    build_kernel,
    transform_source,
)
from kernelgen.errors import ToolchainMissingError

pytestmark = pytest.mark.emulate

FULL = "0xffffffffu"


def _run_isolated(script: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh interpreter (so a hang or stuck threads cannot hurt pytest)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
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
    from kernelgen.emulator import build_kernel
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


def test_deadlock_is_reported_at_once():
    """Every thread waits for another: no resumption can change anything, so the launch fails
    without waiting for the watchdog (a timeout of 60 s is not reached)."""
    script = f"""
    import time
    import numpy as np
    from kernelgen.emulator import build_kernel
    from kernelgen.errors import EmulatorTimeoutError
    k = build_kernel({DEADLOCK_SRC!r}, "deadlock", [("int*", "out")])
    out = np.zeros(64, np.int32)
    t0 = time.perf_counter()
    try:
        k(grid=1, block=64, args=[out], timeout=60.0)
    except EmulatorTimeoutError as e:
        print(e)
    else:
        print("no error")
    print(f"seconds {{time.perf_counter() - t0:.3f}}")
    """
    res = _run_isolated(script, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "block (0,0,0) deadlocked: 64 of 64 threads wait for each other" in res.stdout, (
        res.stdout + res.stderr
    )
    seconds = float(res.stdout.rsplit("seconds ", 1)[1])
    assert seconds < 30.0, res.stdout


ENDLESS_SRC = r"""
extern "C" __global__ void endless(volatile int* flag, int* out) {
  if (threadIdx.x == 0) {
    while (*flag == 0) {}  // spins without a wait the emulator can switch at
  }
  __syncthreads();
  out[threadIdx.x] = 1;
}
"""


def test_watchdog_reports_an_endless_loop():
    script = f"""
    import numpy as np
    from kernelgen.emulator import build_kernel
    k = build_kernel({ENDLESS_SRC!r}, "endless", [("volatile int*", "flag"), ("int*", "out")])
    flag = np.zeros(1, np.int32)
    out = np.zeros(64, np.int32)
    try:
        k(grid=1, block=64, args=[flag, out], timeout=1.0)
    except RuntimeError as e:
        print(e)
    else:
        print("no error")
    """
    res = _run_isolated(script, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "did not finish within 1000 ms" in res.stdout, res.stdout + res.stderr


ORDER_SRC = r"""
extern "C" __global__ void arrival_order(unsigned* counter, int* order, float* out) {
  // Which thread gets here first, second, ... between two barriers: the runner's schedule.
  order[blockIdx.x * blockDim.x + atomicAdd(&counter[blockIdx.x], 1u)] = threadIdx.x;
  __syncthreads();
  // Threads still meet correctly whatever the order: a block-wide sum through a shuffle tree.
  float v = (float)threadIdx.x;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __shared__ float partial[8];
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int w = 0; w < (int)(blockDim.x / 32); ++w) s += partial[w];
    out[blockIdx.x] = s;
  }
}
"""


ORDER_PARAMS = [("unsigned*", "counter"), ("int*", "order"), ("float*", "out")]


def _arrival_orders(seed: str | None, launches: int, define: str | None = None) -> list:
    script = f"""
    import os
    import numpy as np
    from kernelgen.emulator import build_kernel
    defines = {{{define!r}: 1}} if {define!r} else None
    k = build_kernel({ORDER_SRC!r}, "arrival_order",
                     [("unsigned*", "counter"), ("int*", "order"), ("float*", "out")],
                     defines=defines)
    for _ in range({launches}):
        counter = np.zeros(3, np.uint32)
        order = np.full((3, 256), -1, np.int32)
        out = np.zeros(3, np.float32)
        k(grid=3, block=256, args=[counter, order, out])
        assert counter.tolist() == [256] * 3
        for block in order:
            assert sorted(block.tolist()) == list(range(256)), block
        np.testing.assert_array_equal(out, np.full(3, 255 * 256 / 2, np.float32))
        print(" ".join(map(str, order.ravel())))
    """
    env = dict(os.environ)
    env.pop("KG_EMULATOR_SCHEDULE_SEED", None)
    if seed is not None:
        env["KG_EMULATOR_SCHEDULE_SEED"] = seed
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.splitlines()


def test_threads_run_in_a_fresh_order_per_launch_unless_the_seed_is_fixed():
    """The runner resumes a block's threads in a pseudo-random order (so that which thread runs
    ahead varies, as on a GPU); KG_EMULATOR_SCHEDULE_SEED replays one schedule exactly. The
    order array records each block's arrival order at the first atomicAdd."""
    free = _arrival_orders(None, 3)
    assert len(set(free)) == 3, "three launches ran their threads in the same order"
    assert free[0] != " ".join(map(str, list(range(256)) * 3)), "threads ran in index order"
    fixed = _arrival_orders("12345", 2) + _arrival_orders("12345", 1)
    assert len(set(fixed)) == 1, fixed
    assert _arrival_orders("54321", 1)[0] != fixed[0]


def test_the_ucontext_fallback_runs_the_same_kernels():
    """Off x86-64 (or with KG_EMU_UCONTEXT) the fibers switch through ucontext."""
    orders = _arrival_orders("7", 1, define="KG_EMU_UCONTEXT")
    assert orders == _arrival_orders("7", 1)


def test_kernels_link_the_shared_runtime_library_and_survive_its_deletion(tmp_path):
    """A kernel's library links the shim's runtime library, built once per cache; a cached
    kernel whose runtime library was deleted still loads (the library is made again)."""
    script = f"""
    import numpy as np
    from kernelgen.emulator import build_kernel
    k = build_kernel({ORDER_SRC!r}, "arrival_order", {ORDER_PARAMS!r})
    counter, order = np.zeros(3, np.uint32), np.zeros((3, 256), np.int32)
    out = np.zeros(3, np.float32)
    k(grid=3, block=256, args=[counter, order, out])
    print(out.tolist(), k.compile_seconds > 0)
    """
    env = dict(os.environ, KG_EMULATOR_CACHE=str(tmp_path / "cache"))
    # The precompiled shim and the runtime library of this process's cache (both keyed by
    # content) spare the subprocesses their builds: only the deleted runtime is built again.
    from kernelgen.emulator import kernel as emulator_kernel

    build_kernel(ORDER_SRC, "arrival_order", ORDER_PARAMS)
    (tmp_path / "cache").mkdir(mode=0o700)
    for shared in emulator_kernel.cache_dir().glob("pch-*"):
        shutil.copytree(shared, tmp_path / "cache" / shared.name)

    def run() -> str:
        res = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=env,
        )
        assert res.returncode == 0, res.stdout + res.stderr
        return res.stdout.strip()

    expected = str([255 * 256 / 2] * 3)
    assert run() == f"{expected} True"
    runtimes = list((tmp_path / "cache").glob("libkg_emu_runtime-*.so"))
    assert len(runtimes) == 1
    kernels = [p for p in (tmp_path / "cache").glob("arrival_order-*.so")]
    assert len(kernels) == 1
    readelf = shutil.which("readelf")
    if readelf is not None:
        dynamic = subprocess.run([readelf, "-d", str(kernels[0])], capture_output=True, text=True)
        assert runtimes[0].name in dynamic.stdout
    runtimes[0].unlink()
    assert run() == f"{expected} False"  # the cached kernel, not rebuilt
    assert runtimes[0].exists()


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
    with pytest.raises(EmulatorArgumentError):
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
    with pytest.raises(EmulatorUnavailableError, match=r"g\+\+.*apt-get install g\+\+") as info:
        build_kernel(STRIDED_SRC, "strided_scale", STRIDED_PARAMS)
    assert isinstance(info.value, ToolchainMissingError)  # the CLI's one line, exit 2


def test_headers_ship_as_package_data(tmp_path):
    """pyproject lists kernelgen.emulator and its include/*.h, so a wheel (non-editable
    install) carries every header; and the emulator finds them next to its module wherever the
    package is installed (a copy of the package outside the checkout builds a kernel)."""
    from fnmatch import fnmatch

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    import kernelgen
    from kernelgen.emulator import include_dir

    config = tomllib.loads((Path(kernelgen.__file__).parents[1] / "pyproject.toml").read_text())
    setup = config["tool"]["setuptools"]
    assert "kernelgen.emulator" in setup["packages"]
    patterns = setup["package-data"]["kernelgen.emulator"]
    headers = sorted(p.relative_to(include_dir().parent) for p in include_dir().iterdir())
    assert {h.name for h in headers} >= {"kg_emulator.h", "kg_ptx.h", "cuda_fp16.h"}
    assert all(any(fnmatch(str(h), pat) for pat in patterns) for h in headers)

    site = tmp_path / "site"
    shutil.copytree(Path(kernelgen.__file__).parent, site / "kernelgen")
    script = f"""
        import numpy as np
        from kernelgen.emulator import build_kernel, include_dir
        assert str(include_dir()).startswith({str(site)!r}), include_dir()
        k = build_kernel('extern "C" __global__ void f(float* y) {{ y[threadIdx.x] = 2.f; }}',
                         "f", [("float*", "y")])
        y = np.zeros(32, np.float32)
        k(grid=1, block=32, args=[y])
        assert (y == 2).all()
    """
    env = {**os.environ, "PYTHONPATH": str(site), "KG_EMULATOR_CACHE": str(tmp_path / "cache")}
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr


def test_unsupported_parameter_types_are_rejected():
    with pytest.raises(ValueError, match="unsupported"):
        build_kernel(STRIDED_SRC, "strided_scale", [("float**", "x")])
    with pytest.raises(ValueError, match="unsupported"):
        build_kernel(STRIDED_SRC, "strided_scale", [("__half", "x")])


TWIN_SRC = r"""
extern "C" __global__ void twice(const float* x, float* y) {
  y[threadIdx.x] = 2.f * x[threadIdx.x];
}
extern "C" __global__ void plus(const float* x, float* y, float c) {
  y[threadIdx.x] = x[threadIdx.x] + c;
}
"""
TWIN_PARAMS = {
    "twice": [("const float*", "x"), ("float*", "y")],
    "plus": [("const float*", "x"), ("float*", "y"), ("float", "c")],
}


def test_a_sources_kernels_build_into_one_library():
    """build_kernels: one g++ run for both kernels of a source, each launcher running its own
    kernel with its own parameters; naming them in another order finds the same library."""
    from uuid import uuid4

    from kernelgen.emulator import build_kernels

    source = f"// {uuid4()}: a build of its own\n{TWIN_SRC}"
    built = build_kernels(source, TWIN_PARAMS)
    assert list(built) == ["twice", "plus"]  # the caller's order
    twice, plus = built["twice"], built["plus"]
    assert twice.so_path == plus.so_path and twice.compile_seconds > 0
    x = np.random.default_rng(1).standard_normal(64).astype(np.float32)
    y = np.full(64, np.nan, np.float32)
    twice(grid=1, block=64, args=[x, y])
    np.testing.assert_array_equal(y, 2 * x)
    plus(grid=1, block=64, args=[x, y, 0.5])
    np.testing.assert_array_equal(y, x + np.float32(0.5))
    again = build_kernels(source, dict(reversed(TWIN_PARAMS.items())))
    assert again["plus"].so_path == plus.so_path and again["plus"].compile_seconds == 0.0
    with pytest.raises(EmulatorArgumentTypeError, match="takes 3 arguments"):
        again["plus"](grid=1, block=64, args=[x, y])


@pytest.mark.parametrize(
    ("kernels", "message"),
    [({}, "at least one kernel"), ({"not a name": []}, "bad kernel name 'not a name'")],
)
def test_build_kernels_names_bad_input(kernels, message):
    from kernelgen.emulator import EmulatorSourceError, build_kernels

    with pytest.raises(EmulatorSourceError, match=message):
        build_kernels(TWIN_SRC, kernels)


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


# ---------------------------------------------------------------------------------------------
# (g) inline PTX: ldmatrix, mma.sync m16n8k16, cp.async; __half2 / __nv_bfloat162
# ---------------------------------------------------------------------------------------------

SMEM_ADDR_HELPER = r"""
__device__ __forceinline__ unsigned smem_addr(const void* ptr) {
  return static_cast<unsigned>(__cvta_generic_to_shared(ptr));
}
"""

# Six ldmatrix variants, written in different asm spellings on purpose (named operands,
# __asm__ __volatile__, .shared::cta, int destinations, a comment between string pieces).
LDMATRIX_SRC = (
    SMEM_ADDR_HELPER
    + r"""
extern "C" __global__ void ldm_probe(const unsigned short* __restrict__ image, int image_len,
                                     const int* __restrict__ lane_offset,
                                     unsigned* __restrict__ out, unsigned* __restrict__ addrs) {
  extern __shared__ __align__(128) unsigned short smem[];
  for (int i = threadIdx.x; i < image_len; i += blockDim.x) smem[i] = image[i];
  __syncthreads();
  const int lane = threadIdx.x;
  addrs[lane] = smem_addr(smem + lane);
  for (int v = 0; v < 6; ++v) {
    const int off = lane_offset[v * 32 + lane];
    const unsigned addr = off >= 0 ? smem_addr(smem + off) : 0u;  // 0 is never valid
    unsigned r[4] = {0xDEADBEEFu, 0xDEADBEEFu, 0xDEADBEEFu, 0xDEADBEEFu};
    int ri[2];
    switch (v) {
      case 0:
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
                     : "=r"(r[0]) : "r"(addr));
        break;
      case 1:
        __asm__ __volatile__("ldmatrix.sync.aligned.m8n8.x1.trans.shared::cta.b16 {%[d]}, [%[p]];"
                             : [d] "=r"(r[0])
                             : [p] "r"(addr));
        break;
      case 2:
        asm volatile(
            "ldmatrix.sync.aligned.m8n8.x2.shared.b16 "  // destinations next
            "{%0, %1}, [%2];\n"
            : "=r"(ri[0]), "=r"(ri[1])
            : "r"(addr));
        r[0] = static_cast<unsigned>(ri[0]);
        r[1] = static_cast<unsigned>(ri[1]);
        break;
      case 3:
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
                     : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
        break;
      case 4:
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr));
        break;
      default:
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr));
    }
    for (int k = 0; k < 4; ++k) out[(v * 32 + lane) * 4 + k] = r[k];
  }
}
"""
)
LDMATRIX_VARIANTS = [(1, False), (1, True), (2, False), (2, True), (4, False), (4, True)]


@pytest.fixture(scope="module")
def ldmatrix_kernel():
    params = [
        ("const unsigned short*", "image"),
        ("int", "image_len"),
        ("const int*", "lane_offset"),
        ("unsigned*", "out"),
        ("unsigned*", "addrs"),
    ]
    return build_kernel(LDMATRIX_SRC, "ldm_probe", params)


def _row_offset(layout: str, matrix: int, row: int) -> int:
    """Element offset of row ``row`` of 8x8 matrix ``matrix`` in a shared tile."""
    if layout == "padded":  # a 16x16 tile, rows padded to 24 elements; matrices like an A frag
        return (8 * (matrix % 2) + row) * 24 + 8 * (matrix // 2)
    if layout == "unswizzled":  # 8 rows of 64 elements: a matrix's rows share one bank group
        return row * 64 + 8 * (2 * matrix + 1)
    if layout == "stride32":  # rows of 32 elements: 2 bank groups of 4 rows each
        return row * 32 + 8 * matrix
    # 8 rows of 64 elements (8 chunks of 16 bytes), chunk c stored at c ^ (row % 8)
    return row * 64 + 8 * ((2 * matrix + 1) ^ (row % 8))


# Shared-memory wavefronts per 8x8 matrix: the most rows (at distinct addresses) in one group.
LAYOUT_WAYS = {"padded": 1, "swizzled": 1, "unswizzled": 8, "stride32": 4}


@pytest.mark.parametrize("layout", LAYOUT_WAYS)
def test_ldmatrix_fragments(ldmatrix_kernel, layout):
    rng = np.random.default_rng(10)
    mats = rng.integers(0, 2**16, (4, 8, 8), dtype=np.uint64).astype(np.uint16)
    image = np.zeros(1024, np.uint16)
    for i in range(4):
        for r in range(8):
            off = _row_offset(layout, i, r)
            image[off : off + 8] = mats[i, r]
    lane_offset = np.full((6, 32), -1, np.int32)  # lanes past 8 * n give an invalid address
    for v, (n, _) in enumerate(LDMATRIX_VARIANTS):
        for lane in range(8 * n):
            lane_offset[v, lane] = _row_offset(layout, lane // 8, lane % 8)
    out = np.zeros((6, 32, 4), np.uint32)
    addrs = np.zeros(32, np.uint32)
    stats = ldmatrix_kernel(
        grid=1, block=32, shared_mem=2048, args=[image, image.size, lane_offset, out, addrs]
    )
    matrices = sum(n for n, _ in LDMATRIX_VARIANTS)
    assert (stats.ldmatrix, stats.ldmatrix_ideal) == (len(LDMATRIX_VARIANTS), matrices)
    assert stats.ldmatrix_wavefronts == LAYOUT_WAYS[layout] * matrices
    assert stats.cp_async_global_bytes == 0
    if LAYOUT_WAYS[layout] == 1:
        assert stats.first_conflict == ""
    else:
        first_rows = " ".join(f"0x{a:x}" for a in addrs[0] + 2 * lane_offset[0, :8])
        assert stats.first_conflict == (
            f"ldmatrix.x1 in block (0,0,0) warp 0: matrix 0 takes {LAYOUT_WAYS[layout]} "
            f"wavefronts, rows at {first_rows}"
        )
    assert addrs[0] != 0
    np.testing.assert_array_equal(addrs - addrs[0], 2 * np.arange(32))

    lane = np.arange(32)
    m = mats.astype(np.uint32)
    for v, (n, trans) in enumerate(LDMATRIX_VARIANTS):
        for i in range(4):
            got = out[v, :, i]
            if i >= n:
                assert (got == 0xDEADBEEF).all()
            elif trans:  # rows 2(l%4), 2(l%4)+1 of column l/4
                r0, col = 2 * (lane % 4), lane // 4
                np.testing.assert_array_equal(got, m[i, r0, col] | (m[i, r0 + 1, col] << 16))
            else:  # row l/4, columns 2(l%4), 2(l%4)+1
                row, c0 = lane // 4, 2 * (lane % 4)
                np.testing.assert_array_equal(got, m[i, row, c0] | (m[i, row, c0 + 1] << 16))


# A and B^T arrive by cp.async, B ([k][n]) by plain stores; fragments by ldmatrix; two mma forms
# ("+f" accumulators, and "=f" outputs with a separate "f" C operand).
MMA_SRC = (
    SMEM_ADDR_HELPER
    + r"""
constexpr int LDA = 24;   // padded rows, in elements (48 bytes)
constexpr int LDBT = 24;
constexpr int LDB = 16;

extern "C" __global__ void mma_tile(const unsigned short* __restrict__ a,   // [batch][16][16]
                                    const unsigned short* __restrict__ bt,  // [batch][8][16]
                                    const unsigned short* __restrict__ b,   // [batch][16][8]
                                    const float* __restrict__ c,            // [batch][16][8]
                                    float* __restrict__ d_col,  // A B + C via the [n][k] tile
                                    float* __restrict__ d_row) {  // A B via the [k][n] tile
  extern __shared__ __align__(128) unsigned short smem[];
  unsigned short* sA = smem;            // 16 x LDA
  unsigned short* sBt = sA + 16 * LDA;  // 8 x LDBT
  unsigned short* sB = sBt + 8 * LDBT;  // 16 x LDB
  const int lane = threadIdx.x;
  const int batch = blockIdx.x;
  a += batch * 256;
  bt += batch * 128;
  b += batch * 128;
  c += batch * 128;
  d_col += batch * 128;
  d_row += batch * 128;
  {
    const int row = lane / 2, chunk = lane % 2;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                 ::"r"(smem_addr(sA + row * LDA + chunk * 8)), "l"(a + row * 16 + chunk * 8));
  }
  if (lane < 16) {
    const int row = lane / 2, chunk = lane % 2;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                     smem_addr(sBt + row * LDBT + chunk * 8)),
                 "l"(bt + row * 16 + chunk * 8), "n"(16));
  }
  asm volatile("cp.async.commit_group;\n" ::);
  for (int i = lane; i < 128; i += 32) sB[(i / 8) * LDB + i % 8] = b[i];
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  __syncthreads();

  unsigned fa[4], fb[2], fbt[2];
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(fa[0]), "=r"(fa[1]), "=r"(fa[2]), "=r"(fa[3])
               : "r"(smem_addr(sA + (lane % 16) * LDA + (lane / 16) * 8)));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(fb[0]), "=r"(fb[1])
               : "r"(smem_addr(sBt + (lane % 8) * LDBT + ((lane / 8) % 2) * 8)));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(fbt[0]), "=r"(fbt[1])
               : "r"(smem_addr(sB + (lane % 16) * LDB)));

  const int g = lane / 4, t = lane % 4;
  float acc[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t],
                  c[(g + 8) * 8 + 2 * t + 1]};
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.ELEM.ELEM.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(fa[0]), "r"(fa[1]), "r"(fa[2]), "r"(fa[3]), "r"(fb[0]), "r"(fb[1]));
  float d[4];
  const float zero = 0.0f;
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.ELEM.ELEM.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%10,%10,%10};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(fa[0]), "r"(fa[1]), "r"(fa[2]), "r"(fa[3]), "r"(fbt[0]), "r"(fbt[1]), "f"(zero));
  const int rows[4] = {g, g, g + 8, g + 8};
  for (int i = 0; i < 4; ++i) {
    d_col[rows[i] * 8 + 2 * t + i % 2] = acc[i];
    d_row[rows[i] * 8 + 2 * t + i % 2] = d[i];
  }
}
"""
)
MMA_PARAMS = [
    ("const unsigned short*", "a"),
    ("const unsigned short*", "bt"),
    ("const unsigned short*", "b"),
    ("const float*", "c"),
    ("float*", "d_col"),
    ("float*", "d_row"),
]


def _to_16bit(x: np.ndarray, elem: str) -> tuple[np.ndarray, np.ndarray]:
    """(bit patterns as uint16, exact float64 values) of ``x`` rounded to f16 or bf16."""
    if elem == "f16":
        h = x.astype(np.float16)
        return h.view(np.uint16), h.astype(np.float64)
    bits = _bf16_reference_bits(x.astype(np.float32))
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("elem", ["f16", "bf16"])
def test_mma_m16n8k16_from_ldmatrix_fragments(elem):
    kern = build_kernel(MMA_SRC.replace("ELEM", elem), "mma_tile", MMA_PARAMS)
    rng = np.random.default_rng(11)
    batch = 3
    a_bits, a = _to_16bit(rng.standard_normal((batch, 16, 16)) * 3, elem)
    b_bits, b = _to_16bit(rng.standard_normal((batch, 16, 8)), elem)
    c = (rng.standard_normal((batch, 16, 8)) * 10).astype(np.float32)
    bt_bits = np.ascontiguousarray(b_bits.transpose(0, 2, 1))
    d_col = np.full((batch, 16, 8), np.nan, np.float32)
    d_row = np.full((batch, 16, 8), np.nan, np.float32)
    smem = (16 * 24 + 8 * 24 + 16 * 16) * 2
    kern(grid=batch, block=32, shared_mem=smem, args=[a_bits, bt_bits, b_bits, c, d_col, d_row])
    ab = a @ b  # float64; each product of two 16-bit floats is exact
    # The emulator rounds the (double) dot product plus C once to fp32.
    np.testing.assert_allclose(d_col, ab + c.astype(np.float64), rtol=2**-23, atol=1e-12)
    np.testing.assert_allclose(d_row, ab, rtol=2**-23, atol=1e-12)
    assert (d_col.astype(np.float64) != ab).any()  # C was really added


def test_mma_exact_for_integers():
    """Small integers: every step is exact, so the result must match bit for bit."""
    kern = build_kernel(MMA_SRC.replace("ELEM", "bf16"), "mma_tile", MMA_PARAMS)
    rng = np.random.default_rng(12)
    a_bits, a = _to_16bit(rng.integers(-8, 9, (1, 16, 16)).astype(np.float64), "bf16")
    b_bits, b = _to_16bit(rng.integers(-8, 9, (1, 16, 8)).astype(np.float64), "bf16")
    c = rng.integers(-100, 100, (1, 16, 8)).astype(np.float32)
    d_col = np.zeros((1, 16, 8), np.float32)
    d_row = np.zeros((1, 16, 8), np.float32)
    bt_bits = np.ascontiguousarray(b_bits.transpose(0, 2, 1))
    kern(grid=1, block=32, shared_mem=2048, args=[a_bits, bt_bits, b_bits, c, d_col, d_row])
    np.testing.assert_array_equal(d_col, (a @ b + c).astype(np.float32))
    np.testing.assert_array_equal(d_row, (a @ b).astype(np.float32))


# Every thread owns 64 bytes (4 chunks of 16) of shared memory and fills them through four
# cp.async groups; `snap` records what the thread (or its neighbour) sees after each step.
ASYNC_SRC = (
    SMEM_ADDR_HELPER
    + r"""
extern "C" __global__ void async_copy(const unsigned char* __restrict__ src,
                                      const int* __restrict__ src_bytes,
                                      unsigned* __restrict__ snap) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int t = threadIdx.x;
  const int n = blockDim.x;
  const unsigned char* s = src + (blockIdx.x * n + t) * 64;
  unsigned char* mine = smem + t * 64;
  const unsigned char* next = smem + ((t + 1) % n) * 64;
  unsigned* out = snap + blockIdx.x * 7 * n * 16;
  auto record = [&](int step, const unsigned char* region) {
    for (int w = 0; w < 16; ++w) {
      unsigned v;
      memcpy(&v, region + 4 * w, 4);
      out[(step * n + t) * 16 + w] = v;
    }
  };
  const int sb = src_bytes[blockIdx.x * n + t];
  // group 0: chunk 0, 16 bytes with a run-time src-size (0..16)
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(mine)),
               "l"(s), "r"(sb));
  asm volatile("cp.async.commit_group;\n" ::);
  // group 1: chunk 1 as two 8-byte copies (partial, then without src-size)
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(smem_addr(mine + 16)),
               "l"(s + 16), "r"(sb < 8 ? sb : 8));
  asm volatile("cp.async.ca.shared.global [%0+8], [%1+8], 8;" ::"r"(smem_addr(mine + 16)),
               "l"(s + 16));
  asm volatile("cp.async.commit_group;" ::: "memory");
  // group 2: chunk 2 as four 4-byte copies; the second reads nothing (src-size 0, null src)
  const unsigned char* nothing = nullptr;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, 4;" ::"r"(smem_addr(mine + 32)),
               "l"(s + 32));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(mine + 36)),
               "l"(nothing), "n"(0));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(mine + 40)),
               "l"(s + 40));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n\tcp.async.commit_group;\n" ::"r"(
                   smem_addr(mine + 44)),
               "l"(s + 44), "r"(2));
  // chunk 3: issued but never committed
  asm volatile("cp.async.cg.shared::cta.global [%0], [%1], 16;" ::"r"(smem_addr(mine + 48)),
               "l"(s + 48));

  record(0, mine);   // nothing waited for yet
  __syncthreads();
  record(1, next);   // a neighbour's region: not copied either
  __syncthreads();
  asm volatile("cp.async.wait_group 2;\n" ::);
  record(2, mine);   // group 0 only
  asm volatile("cp.async.wait_group %0;\n" ::"n"(1));
  record(3, mine);   // groups 0, 1
  asm volatile("cp.async.wait_group 0;\n" ::);
  record(4, mine);   // groups 0-2, not the uncommitted copy
  asm volatile("cp.async.wait_all;\n" ::);
  record(5, mine);   // everything
  __syncthreads();
  record(6, next);
}
"""
)


def test_cp_async_groups_and_zero_fill():
    kern = build_kernel(
        ASYNC_SRC,
        "async_copy",
        [("const unsigned char*", "src"), ("const int*", "src_bytes"), ("unsigned*", "snap")],
    )
    rng = np.random.default_rng(13)
    nb, n = 2, 64
    src = rng.integers(0, 256, (nb, n, 64), dtype=np.uint64).astype(np.uint8)
    src_bytes = rng.integers(0, 17, (nb, n)).astype(np.int32)
    src_bytes[:, :3] = [0, 16, 5]
    snap = np.zeros((nb, 7, n, 64), np.uint8)
    stats = kern(grid=nb, block=n, shared_mem=n * 64, args=[src, src_bytes, snap.view(np.uint32)])
    # Source bytes of every copy issued (the never-committed one too): src-size, else the size.
    issued = src_bytes + np.minimum(src_bytes, 8) + 8 + (4 + 0 + 4 + 2) + 16
    assert stats.cp_async_global_bytes == issued.sum()
    assert stats.ldmatrix == 0

    garbage = np.full(16, 0xFF, np.uint8)
    for blk in range(nb):
        for t in range(n):
            s, sb = src[blk, t], src_bytes[blk, t]
            chunk0 = np.where(np.arange(16) < sb, s[0:16], 0)
            chunk1 = np.concatenate([np.where(np.arange(8) < min(sb, 8), s[16:24], 0), s[24:32]])
            zeros = np.zeros(4, np.uint8)
            chunk2 = np.concatenate([s[32:36], zeros, s[40:44], s[44:46], zeros[:2]])
            chunk3 = s[48:64]
            full = np.concatenate([chunk0, chunk1, chunk2, chunk3])
            expect = [
                np.tile(garbage, 4),
                np.tile(garbage, 4),
                np.concatenate([chunk0, garbage, garbage, garbage]),
                np.concatenate([chunk0, chunk1, garbage, garbage]),
                np.concatenate([chunk0, chunk1, chunk2, garbage]),
                full,
            ]
            for step, want in enumerate(expect):
                np.testing.assert_array_equal(snap[blk, step, t], want, err_msg=f"{blk} {t} {step}")
        neighbour_full = snap[blk, 5, (np.arange(n) + 1) % n]
        np.testing.assert_array_equal(snap[blk, 6], neighbour_full)


BAD_ACCESS_SRC = (
    SMEM_ADDR_HELPER
    + r"""
extern "C" __global__ void bad_access(const float* __restrict__ src, unsigned* __restrict__ out,
                                      int mode) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x;
  unsigned addr = smem_addr(smem + 16 * (lane % 8));
  if (mode == 0 && lane == 3) addr += 2;               // misaligned ldmatrix row
  if (mode == 5 && lane >= 16) addr = 0;               // .x4 uses the addresses of all 32 lanes
  unsigned r[4];
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
  if (lane == 0) {
    unsigned dst = smem_addr(smem);
    int n = 16;
    if (mode == 1) dst += 4;            // misaligned destination
    if (mode == 2) dst += 1024;         // past the end of the buffer
    if (mode == 3) dst = smem_addr(src);  // global memory
    if (mode == 4) n = 17;              // src-size > cp-size
    const float* s = (mode == 6) ? src + 1 : src;  // misaligned global source
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(s), "r"(n));
    asm volatile("cp.async.wait_all;\n" ::);
  }
  out[lane] = r[0] + r[1] + r[2] + r[3];
}
"""
)


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (0, r"ldmatrix row: shared address 0x[0-9a-f]+ \(from lane 3\) is not 16-byte aligned"),
        (5, r"ldmatrix row: shared address 0x0 \(from lane 16\) .* outside the dynamic shared"),
        (1, r"cp.async destination: shared address 0x[0-9a-f]+ is not 16-byte aligned"),
        (2, r"cp.async destination: .* outside the dynamic shared memory"),
        (3, r"__cvta_generic_to_shared\(.*\): not a pointer into the 1024 bytes"),
        (4, r"cp.async: src-size 17 outside \[0, 16\]"),
        (6, r"cp.async: global source .* is not 16-byte aligned"),
    ],
)
def test_bad_shared_addresses_trap(mode, message):
    kern = build_kernel(
        BAD_ACCESS_SRC,
        "bad_access",
        [("const float*", "src"), ("unsigned*", "out"), ("int", "mode")],
    )
    src = np.zeros(8, np.float32)
    out = np.zeros(32, np.uint32)
    with pytest.raises(RuntimeError, match=message + r".* in block \(0,0,0\) thread"):
        kern(grid=1, block=32, shared_mem=1024, args=[src, out, mode])
    kern(grid=1, block=32, shared_mem=1024, args=[src, out, -1])  # still usable, no error


# A two-slot cp.async ring read by ldmatrix, the tensor-core kernels' pipeline in miniature:
# thread t copies chunk (t + 32) % 64 of each 1 KiB tile and warp w reads chunks 32w .. 32w + 31,
# so every chunk is written by one warp and read by the other. `mode` picks the synchronization:
# 0 one barrier per tile (wait, barrier, issue the next tile, read), 5 two barriers per tile
# (issue, wait, barrier, read, barrier): both correct; the others leave out one ordering.
RING_SRC = (
    SMEM_ADDR_HELPER
    + r"""
extern "C" __global__ void ring(const unsigned char* __restrict__ src, unsigned* __restrict__ out,
                                int tiles, int mode) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int t = threadIdx.x;
  const auto issue = [&](int tile) {
    const int chunk = (t + 32) % 64;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                     smem_addr(smem + (tile % 2) * 1024 + chunk * 16)),
                 "l"(src + tile * 1024 + chunk * 16));
  };
  const auto commit = [] { asm volatile("cp.async.commit_group;\n" ::); };
  issue(0);
  if (mode == 4) issue(0);  // a second copy into the same bytes before the first landed
  commit();
  for (int i = 0; i < tiles; ++i) {
    if (mode == 0 || mode == 4) {
      asm volatile("cp.async.wait_group 0;\n" ::);
      __syncthreads();
      if (i + 1 < tiles) issue(i + 1);
      commit();
    } else if (mode == 1) {  // the next tile is issued before the barrier: write after read
      if (i + 1 < tiles) issue(i + 1);
      commit();
      asm volatile("cp.async.wait_group 1;\n" ::);
      __syncthreads();
    } else if (mode == 2) {  // waited for, but no barrier before another warp reads it
      asm volatile("cp.async.wait_group 0;\n" ::);
    } else if (mode == 3) {  // a barrier but no wait: the copies are still in flight
      __syncthreads();
    } else if (mode == 5) {
      if (i + 1 < tiles) issue(i + 1);
      commit();
      asm volatile("cp.async.wait_group 1;\n" ::);
      __syncthreads();
    }
    unsigned r[4];
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(smem + (i % 2) * 1024 + t * 16)));
    for (int m = 0; m < 4; ++m) out[(i * 64 + t) * 4 + m] = r[m];
    if (mode == 5) __syncthreads();
  }
}
"""
)


def _ring_expected(src: np.ndarray, tiles: int) -> np.ndarray:
    """What ldmatrix .x4 returns per (tile, thread, matrix): lane l of warp w gets 4 bytes at
    column pair l % 4 of row l / 4 of matrix m, whose row addresses lanes 8m .. 8m + 7 gave."""
    chunks = src.reshape(tiles, 64, 16)
    want = np.zeros((tiles, 64, 4), np.uint32)
    for t in range(64):
        warp, lane = divmod(t, 32)
        for m in range(4):
            row = chunks[:, 32 * warp + 8 * m + lane // 4, 4 * (lane % 4) : 4 * (lane % 4) + 4]
            want[:, t, m] = row.copy().view(np.uint32)[:, 0]
    return want


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (0, None),
        (5, None),
        (1, r"after barrier \d+ a cp.async writes shared 0x[0-9a-f]+ and another warp reads it"),
        (2, r"after barrier 0 a cp.async writes shared 0x[0-9a-f]+ and another warp reads it"),
        (3, r"ldmatrix reads shared 0x[0-9a-f]+ while its cp.async .* is in flight"),
        (4, r"cp.async into shared 0x[0-9a-f]+ while thread \d+'s copy there .* in flight"),
    ],
)
def test_cp_async_ring_hazards_are_reported(mode, message):
    """Every missing wait or barrier of the ring is reported on every run (the stamps do not
    depend on thread timing); both correct schemes run clean and read the right bytes."""
    kern = build_kernel(
        RING_SRC,
        "ring",
        [("const unsigned char*", "src"), ("unsigned*", "out"), ("int", "tiles"), ("int", "mode")],
    )
    tiles = 1 if mode == 2 else 4
    src = np.random.default_rng(5).integers(0, 256, tiles * 1024, dtype=np.uint64).astype(np.uint8)
    out = np.zeros((tiles, 64, 4), np.uint32)
    for _ in range(3 if message else 1):  # the same verdict on repeated runs
        if message is None:
            kern(grid=2, block=64, shared_mem=2048, args=[src, out, tiles, mode])
            np.testing.assert_array_equal(out, _ring_expected(src, tiles))
        else:
            with pytest.raises(RuntimeError, match=message):
                kern(grid=2, block=64, shared_mem=2048, args=[src, out, tiles, mode])


PAIRS_SRC = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

extern "C" __global__ void pack_pairs(const float* __restrict__ x, unsigned* __restrict__ h2,
                                      unsigned* __restrict__ b2, float* __restrict__ back,
                                      int* __restrict__ same, int n) {
  const int stride = gridDim.x * blockDim.x;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const __half2 h = __floats2half2_rn(x[2 * i], x[2 * i + 1]);
    const __nv_bfloat162 b = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
    h2[i] = *reinterpret_cast<const unsigned*>(&h);
    b2[i] = *reinterpret_cast<const unsigned*>(&b);
    const float2 v = make_float2(x[2 * i], x[2 * i + 1]);
    const __half2 h_again = __float22half2_rn(v);
    const __nv_bfloat162 b_again = __float22bfloat162_rn(v);
    same[i] = (h_again.x.__x == h.x.__x && h_again.y.__x == h.y.__x &&
               b_again.x.__x == b.x.__x && b_again.y.__x == b.y.__x &&
               __float_as_uint(__half2float(h.x)) == __float_as_uint(__low2float(h)))
              ? 1 : 0;
    back[4 * i + 0] = __low2float(h);
    back[4 * i + 1] = __high2float(h);
    back[4 * i + 2] = __low2float(b);
    back[4 * i + 3] = __high2float(b);
  }
}
"""


def test_half2_and_bfloat162_packing():
    params = [
        ("const float*", "x"),
        ("unsigned*", "h2"),
        ("unsigned*", "b2"),
        ("float*", "back"),
        ("int*", "same"),
        ("int", "n"),
    ]
    kern = build_kernel(PAIRS_SRC, "pack_pairs", params)
    x = _tricky_values()
    x = x[: x.size // 2 * 2]
    n = x.size // 2
    h2 = np.zeros(n, np.uint32)
    b2 = np.zeros(n, np.uint32)
    back = np.zeros((n, 4), np.float32)
    same = np.zeros(n, np.int32)
    kern(grid=4, block=128, args=[x, h2, b2, back, same, n])

    with np.errstate(over="ignore"):
        ref_h = x.astype(np.float16).view(np.uint16)
    ref_h = np.where(np.isnan(x), np.uint16(0x7FFF), ref_h).astype(np.uint32)
    np.testing.assert_array_equal(h2, ref_h[0::2] | (ref_h[1::2] << 16))  # .x in the low half
    ref_b = _bf16_reference_bits(x).astype(np.uint32)
    np.testing.assert_array_equal(b2, ref_b[0::2] | (ref_b[1::2] << 16))
    assert same.all()
    halves = np.stack([h2 & 0xFFFF, h2 >> 16], axis=1).astype(np.uint16).view(np.float16)
    np.testing.assert_array_equal(back[:, :2], halves.astype(np.float32))
    bfs = np.stack([b2 << 16, b2 & 0xFFFF0000], axis=1).astype(np.uint32).view(np.float32)
    np.testing.assert_array_equal(back[:, 2:].view(np.uint32), bfs.view(np.uint32))


# ---------------------------------------------------------------------------------------------
# The asm rewrite itself
# ---------------------------------------------------------------------------------------------

ASM_REWRITE_SRC = r"""__device__ void f(unsigned (&frag)[4], float (&acc)[4], const unsigned* a,
                  unsigned b0, unsigned b1, unsigned addr, const char* msg) {
  // asm volatile("not rewritten: a comment");
  const char* text = "asm(\"nor in a string\")";
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a[0]), "r"(a[(1)]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(static_cast<unsigned>(b1)));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(frag[0]), "=r"(frag[1]), "=r"(frag[2]), "=r"(frag[3]) : "r"(addr));
  asm volatile("" ::: "memory");
  asm volatile("cp.async.commit_group;\n" "cp.async.wait_group 1;\n" ::);
}
"""


def test_asm_rewrite_operands_and_lines():
    out = transform_source(ASM_REWRITE_SRC)
    assert out.count("\n") == ASM_REWRITE_SRC.count("\n")
    assert 'asm volatile("not rewritten: a comment");' in out
    assert 'const char* text = "asm(\\"nor in a string\\")";' in out
    b32 = "::kg_emu::ptx::b32"
    mma = (
        "::kg_emu::ptx::mma_m16n8k16<::kg_emu::ptx::Elem::f16>((acc[0]), (acc[1]), (acc[2]), "
        f"(acc[3]), {b32}(a[0]), {b32}(a[(1)]), {b32}(a[2]), {b32}(a[3]), {b32}(b0), "
        f"{b32}(static_cast<unsigned>(b1)), static_cast<float>(acc[0]), "
        "static_cast<float>(acc[1]), static_cast<float>(acc[2]), static_cast<float>(acc[3]))"
    )
    assert mma in out
    ldm = (
        f"::kg_emu::ptx::ldmatrix<4, true>({b32}(addr), (frag[0]), (frag[1]), (frag[2]), (frag[3]))"
    )
    assert ldm in out
    assert "::kg_emu::ptx::compiler_barrier();" in out
    two = "(::kg_emu::ptx::cp_async_commit_group(), ::kg_emu::ptx::cp_async_wait_group(1));"
    assert two in out
    assert "asm" not in out.split("const char* text")[1].split("\n", 1)[1]


@pytest.mark.parametrize(
    ("stmt", "message"),
    [
        (
            'asm volatile("mov.u32 %0, %%smid;" : "=r"(x));',
            r"line 3: unsupported instruction 'mov.u32 %0, %smid'",
        ),
        ('asm volatile("membar.gl;");', r"unsupported instruction 'membar.gl'"),
        ('asm volatile(TEXT : "=r"(x));', r"must be string literals"),
        ('asm goto("bra %l0;" :::: done);', r"asm goto"),
        (
            'asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1}, [%2];" '
            ': "=r"(x), "=r"(y) : "r"(x));',
            r"expected operands 'vec4 addr', got 'vec2 addr'",
        ),
        (
            'asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];" '
            ':: "r"(x), "r"(y));',
            r"is written but is an input operand",
        ),
        (
            'asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];" '
            ': "=r"(x), "=r"(y));',
            r"is read but is a write-only output",
        ),
        (
            'asm volatile("cp.async.cg.shared.global [%0], [%1], 8;" :: "r"(x), "l"(p));',
            r"cp-size 8 is not allowed with .cg",
        ),
        (
            'asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" :: "r"(x), "r"(y));',
            r'cp.async source %1 \("r"\(y\)\) needs constraint "l"',
        ),
        (
            'asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.bf16.f32 '
            '{%0,%0,%0,%0}, {%1,%1,%1,%1}, {%1,%1}, {%0,%0,%0,%0};" : "+f"(f) : "r"(x));',
            r"A and B must have the same type",
        ),
        ('asm volatile("cp.async.wait_group %5;" ::);', r"%5 refers to no operand"),
    ],
)
def test_unsupported_asm_is_rejected(stmt, message):
    src = "__device__ void f(unsigned x, unsigned y, float f, const void* p) {\n\n  " + stmt
    src += "\n}\n"
    with pytest.raises(ValueError, match=message):
        transform_source(src)
