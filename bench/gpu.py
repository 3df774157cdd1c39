"""The GPU layer: device facts, inputs, the peers as callables, correctness, memory and timing.

Everything here needs torch with CUDA and CuPy; the arithmetic it uses lives in the pure modules.
All work runs on torch's current stream; CuPy and kernelgen launches are put on the same stream.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import shutil
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from bench.metrics import percentile, repetitions, summarize, tolerance

# Quiet-NaN bit patterns used to poison outputs before the correctness check.
TIMING_METHOD = (
    "CUDA events around each call on torch's current stream; warm-up >= 3 calls and >= 25 ms; "
    "the host queues all timed calls behind a sleep kernel so that the events time the device, "
    "not Python; inputs rotated over independent sets exceeding 2x L2"
)
MEMORY_METHOD = (
    "torch.cuda.max_memory_allocated delta plus the bytes requested through CuPy's allocator "
    "during one call, minus the output's bytes"
)


class NoGPUError(RuntimeError):
    """No usable CUDA device (or torch / CuPy missing): the benchmark cannot run."""


class FatalGPUError(RuntimeError):
    """The CUDA context is unusable (e.g. after an illegal address): stop the run."""


@dataclass
class Env:
    """torch, CuPy and (when importable) kernelgen, with the device's facts."""

    torch: Any
    cupy: Any
    kernelgen: Any | None
    kernelgen_error: str | None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def arch(self) -> str:
        return f"sm_{self.info['compute_capability']}"

    def stream(self) -> Any:
        """A CuPy stream object for torch's current stream (use as a context manager)."""
        stream = self.torch.cuda.current_stream()
        if not stream.cuda_stream:
            return self.cupy.cuda.Stream.null
        return self.cupy.cuda.Stream.from_external(stream)  # ExternalStream warns since CuPy 14

    def kg_module(self, name: str) -> Any:
        """A kernelgen submodule (``kernelgen.kernels.render``, say)."""
        return importlib.import_module(f"kernelgen.{name}")

    def sync(self) -> None:
        try:
            self.torch.cuda.synchronize()
        except Exception as exc:  # a sticky CUDA error poisons the whole context
            raise FatalGPUError(f"CUDA context unusable: {first_line(exc)}") from exc


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


def open_gpu() -> Env:
    """Import torch and CuPy and check for a device; NoGPUError with a one-line reason if not."""
    try:
        import torch
    except ImportError as exc:
        raise NoGPUError(f"torch is not installed ({exc})") from None
    if not torch.cuda.is_available():
        raise NoGPUError("torch.cuda.is_available() is False (no CUDA device or driver)")
    try:
        import cupy
    except ImportError as exc:
        raise NoGPUError(f"CuPy is not installed ({exc}); install cupy-cuda13x") from None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise NoGPUError("CuPy sees no CUDA device")
    except NoGPUError:
        raise
    except Exception as exc:
        raise NoGPUError(f"CuPy cannot reach the device: {first_line(exc)}") from None
    kernelgen, error = None, None
    try:
        import kernelgen
        import kernelgen.runtime.launch
    except Exception as exc:
        kernelgen, error = None, f"kernelgen import failed: {first_line(exc)}"
    env = Env(torch, cupy, kernelgen, error)
    env.info = device_info(env)
    return env


def _nvidia_smi_driver() -> str | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def _cuda_version(number: int) -> str:
    return f"{number // 1000}.{number % 1000 // 10}"


def device_info(env: Env) -> dict[str, Any]:
    """GPU name, compute capability, SMs, L2, memory, driver, CUDA and library versions."""
    torch, cupy = env.torch, env.cupy
    device = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(device)
    l2 = getattr(props, "L2_cache_size", None)
    if not l2:
        with contextlib.suppress(Exception):
            l2 = cupy.cuda.Device(device).attributes["L2CacheSize"]
    info: dict[str, Any] = {
        "gpu_name": props.name,
        "compute_capability": f"{props.major}{props.minor}",
        "sm_count": props.multi_processor_count,
        "l2_bytes": int(l2) if l2 else None,
        "total_memory_bytes": int(props.total_memory),
        "driver_version": _nvidia_smi_driver(),
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn_version": (
            torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        ),
        "cupy_version": cupy.__version__,
    }
    with contextlib.suppress(Exception):
        info["cuda_driver_api"] = _cuda_version(cupy.cuda.runtime.driverGetVersion())
    with contextlib.suppress(Exception):
        info["cuda_runtime"] = _cuda_version(cupy.cuda.runtime.runtimeGetVersion())
    if info["driver_version"] is None:
        info["driver_version"] = f"CUDA {info.get('cuda_driver_api', '?')} (nvidia-smi missing)"
    return info


# ---- inputs and reference -----------------------------------------------------------------------
def make_sets(env: Env, shape: Any, count: int, seed: int) -> list[tuple[Any, Any, Any]]:
    """``count`` independent (q, k, v) sets in (B, H, S, D): torch.randn in fp32, then cast."""
    torch = env.torch
    dtype = getattr(torch, shape.dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q_shape = (shape.batch, shape.heads, shape.seqlen_q, shape.head_dim)
    kv_shape = (shape.batch, shape.heads, shape.seqlen_k, shape.head_dim)
    sets = []
    for _ in range(count):
        sets.append(
            tuple(
                torch.randn(s, device="cuda", dtype=torch.float32, generator=gen).to(dtype)
                for s in (q_shape, kv_shape, kv_shape)
            )
        )
    return sets


@contextlib.contextmanager
def exact_fp32(torch: Any) -> Iterator[None]:
    """fp32 matrix products without TF32 for the reference."""
    precision = torch.get_float32_matmul_precision()
    allow = torch.backends.cuda.matmul.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow
        torch.set_float32_matmul_precision(precision)


def reference(env: Env, q: Any, k: Any, v: Any, causal: bool, chunk_bytes: int = 1 << 30) -> Any:
    """fp32 SDPA (math backend) on upcast inputs, in groups of (batch, head) pairs whose score
    matrices fit ``chunk_bytes``. Sq = Sk, so torch's top-left causal mask is kernelgen's."""
    torch = env.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    if causal and seqlen_q != seqlen_k:
        raise ValueError("the causal reference assumes Sq == Sk")
    flat = [t.reshape(batch * heads, t.shape[2], head_dim) for t in (q, k, v)]
    out = torch.empty((batch * heads, seqlen_q, head_dim), device=q.device, dtype=torch.float32)
    group = max(1, chunk_bytes // (seqlen_q * seqlen_k * 4))
    with exact_fp32(torch), sdpa_kernel(SDPBackend.MATH):
        for start in range(0, batch * heads, group):
            part = slice(start, start + group)
            out[part] = torch.nn.functional.scaled_dot_product_attention(
                *(t[part].float() for t in flat), is_causal=causal
            )
    return out.view(batch, heads, seqlen_q, head_dim)


def relative_error(env: Env, out: Any, ref: Any) -> tuple[float | None, int]:
    """(||out - ref|| / ||ref||, count of non-finite outputs); the error is None when any is."""
    torch = env.torch
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"output shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    o = out.float()
    bad = int((~torch.isfinite(o)).sum().item())
    if bad:
        return None, bad
    diff = torch.linalg.vector_norm(o - ref).item()
    return diff / torch.linalg.vector_norm(ref).item(), 0


# ---- implementations ----------------------------------------------------------------------------
@dataclass
class Impl:
    """One peer ready to call: ``call(q, k, v)`` on torch tensors returns a torch tensor."""

    peer: str
    call: Callable[[Any, Any, Any], Any]
    spec_uri: str | None = None
    poison: Callable[[], contextlib.AbstractContextManager[None]] | None = None
    tolerance: float | None = None  # of its correctness check (None: the shape dtype's)


def torch_sdpa(env: Env, backend: str, causal: bool, gqa: bool = False) -> Impl:
    """torch SDPA forced to ``backend``; ``gqa``: ``enable_gqa=True`` (K/V keep Hkv heads)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, backend)
    sdpa = env.torch.nn.functional.scaled_dot_product_attention
    options = {"enable_gqa": True} if gqa else {}

    def call(q: Any, k: Any, v: Any) -> Any:
        with sdpa_kernel(chosen):
            return sdpa(q, k, v, is_causal=causal, **options)

    return Impl(f"torch-{BACKEND_PEERS[backend]}", call)


BACKEND_PEERS = {
    "FLASH_ATTENTION": "flash",
    "CUDNN_ATTENTION": "cudnn",
    "EFFICIENT_ATTENTION": "efficient",
}
TORCH_BACKENDS = tuple(BACKEND_PEERS)


def naive_cupy(env: Env, shape: Any) -> Impl:
    """fp32 scores (B, H, Sq, Sk) by CuPy matmul, softmax, matmul with v; casts done by torch."""
    cupy, torch = env.cupy, env.torch
    scale = 1.0 / math.sqrt(shape.head_dim)
    mask = None
    if shape.causal:  # bottom-right aligned: query i sees keys j <= i + Sk - Sq
        with env.stream():
            rows = cupy.arange(shape.seqlen_q)[:, None] + (shape.seqlen_k - shape.seqlen_q)
            cols = cupy.arange(shape.seqlen_k)[None, :]
            mask = cupy.where(cols > rows, -cupy.inf, 0.0).astype(cupy.float32)

    def call(q: Any, k: Any, v: Any) -> Any:
        qf, kf, vf = (cupy.from_dlpack(t.float()) for t in (q, k, v))
        with env.stream():
            scores = cupy.matmul(qf, kf.swapaxes(-1, -2))
            scores *= scale
            if mask is not None:
                scores += mask
            scores -= scores.max(axis=-1, keepdims=True)
            cupy.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            out = cupy.matmul(scores, vf)
        return torch.from_dlpack(out).to(q.dtype)

    return Impl("cupy-naive", call)


def kernelgen_impl(env: Env, peer: str, spec: Any, causal: bool) -> Impl:
    kg = env.kernelgen

    def call(q: Any, k: Any, v: Any) -> Any:
        with env.stream():
            return kg.attention(q, k, v, causal=causal, spec=spec)

    return Impl(peer, call, spec_uri=spec.uri, poison=lambda: poisoned_kernelgen_outputs(env))


def quantize_sets(env: Env, sets: list[tuple[Any, Any, Any]]) -> dict[int, tuple[Any, ...]]:
    """Each (q, k, v) set rounded to torch.float8_e4m3fn (no descales: randn values fit e4m3's
    range), keyed by the id of the set's q: the fp8 rows' inputs, made before any timing."""
    fp8 = env.torch.float8_e4m3fn
    return {id(q): (q.to(fp8), k.to(fp8), v.to(fp8)) for q, k, v in sets}


def kernelgen_fp8_impl(
    env: Env, peer: str, spec: Any, causal: bool, quantized: dict[int, tuple[Any, ...]]
) -> Impl:
    """kernelgen.attention with an fp8 spec on the quantized copy of the set it is called with
    (:func:`quantize_sets`), checked within the fp8 tolerance against the reference of the
    quantized inputs (the caller's)."""
    kg = env.kernelgen

    def call(q: Any, k: Any, v: Any) -> Any:
        q8, k8, v8 = quantized[id(q)]
        with env.stream():
            return kg.attention(q8, k8, v8, causal=causal, spec=spec)

    return Impl(
        peer,
        call,
        spec_uri=spec.uri,
        poison=lambda: poisoned_kernelgen_outputs(env),
        tolerance=tolerance(spec.dtype),
    )


def compile_spec(env: Env, spec: Any) -> float:
    """Compile (or fetch from the process cache) a spec's kernel; seconds taken."""
    start = time.perf_counter()
    env.kg_module("runtime.launch").runtime_kernel(spec)
    return time.perf_counter() - start


def poisoned_kernelgen_outputs(env: Env) -> contextlib.AbstractContextManager[None]:
    """kernelgen's allocations (CuPy or torch: out, lse, scratch) NaN-filled through its test
    hook, ``kernelgen.testing.poison.poisoned_outputs`` (bench/versions.sh swaps templates only,
    so the Python and its hook are always this tree's)."""
    return env.kg_module("testing.poison").poisoned_outputs()


def poison_allocators(env: Env, nbytes: int) -> None:
    """Best effort for peers that allocate their own output: leave NaN-filled blocks of the
    output's size free in torch's and CuPy's pools, so the next allocation likely reuses one."""
    torch, cupy = env.torch, env.cupy
    count = max(1, nbytes // 4)
    block = torch.full((count,), float("nan"), device="cuda", dtype=torch.float32)
    with env.stream():
        cblock = cupy.full((count,), cupy.nan, dtype=cupy.float32)
    env.sync()
    del block, cblock


# ---- memory -------------------------------------------------------------------------------------
def extra_memory(env: Env, impl: Impl, q: Any, k: Any, v: Any, out_bytes: int) -> int:
    """Peak device memory of one call beyond its inputs and its output (see MEMORY_METHOD)."""
    torch, cupy = env.torch, env.cupy
    pool = cupy.get_default_memory_pool()
    requested: list[int] = []

    def counting_malloc(size: int) -> Any:
        requested.append(size)
        return pool.malloc(size)

    env.sync()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with cupy.cuda.using_allocator(counting_malloc):
        out = impl.call(q, k, v)
    env.sync()
    torch_peak = torch.cuda.max_memory_allocated() - base
    del out
    return max(0, torch_peak + sum(requested) - out_bytes)


# ---- timing -------------------------------------------------------------------------------------
class Timer:
    """CUDA-event timing with warm-up, a repetition count from a time budget, rotation over
    input sets, and the host queued ahead of the device behind a sleep kernel."""

    def __init__(
        self,
        env: Env,
        budget_ms: float,
        min_reps: int = 20,
        max_reps: int = 500,
        warmup_ms: float = 25.0,
        warmup_calls: int = 3,
        max_pad_ms: float = 1000.0,
    ) -> None:
        self.env = env
        self.budget_ms = budget_ms
        self.min_reps = min_reps
        self.max_reps = max_reps
        self.warmup_ms = warmup_ms
        self.warmup_calls = warmup_calls
        self.max_pad_ms = max_pad_ms
        self.cycles_per_ms = self._calibrate_sleep()

    def _event(self) -> Any:
        return self.env.torch.cuda.Event(enable_timing=True)

    def _calibrate_sleep(self) -> float | None:
        """GPU clock cycles per ms of ``torch.cuda._sleep`` (None where it does not exist)."""
        sleep = getattr(self.env.torch.cuda, "_sleep", None)
        if sleep is None:
            return None
        cycles = 2_000_000
        sleep(cycles)
        rates = []
        for _ in range(3):
            start, end = self._event(), self._event()
            start.record()
            sleep(cycles)
            end.record()
            self.env.sync()
            rates.append(cycles / max(start.elapsed_time(end), 1e-3))
        return percentile(rates, 50)

    def measure(
        self,
        fn: Callable[[int], Any],
        n_sets: int,
        budget_ms: float | None = None,
        min_reps: int | None = None,
    ) -> tuple[list[float], dict[str, Any]]:
        """Per-call device times (ms) of ``fn(set_index)`` and how they were taken
        (``budget_ms``, ``min_reps``: this measurement's, default the timer's)."""
        env = self.env
        env.sync()
        begin, calls = time.perf_counter(), 0
        while calls < self.warmup_calls or (time.perf_counter() - begin) * 1e3 < self.warmup_ms:
            fn(calls % n_sets)
            env.sync()
            calls += 1
        device, host = [], []
        for i in range(3):
            start, end = self._event(), self._event()
            start.record()
            t0 = time.perf_counter()
            fn(i % n_sets)
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            env.sync()
            device.append(start.elapsed_time(end))
        estimate = percentile(device, 50)
        budget = self.budget_ms if budget_ms is None else budget_ms
        least = self.min_reps if min_reps is None else min_reps
        reps = repetitions(estimate, budget, least, self.max_reps)
        starts = [self._event() for _ in range(reps)]
        ends = [self._event() for _ in range(reps)]
        pad_ms = 0.0
        if self.cycles_per_ms:
            pad_ms = min(self.max_pad_ms, reps * percentile(host, 50) * 1.25 + 0.5)
            env.torch.cuda._sleep(int(pad_ms * self.cycles_per_ms))
        for i in range(reps):
            starts[i].record()
            fn(i % n_sets)
            ends[i].record()
        env.sync()
        times = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
        info = {
            "warmup_calls": calls,
            "warmup_ms": (time.perf_counter() - begin) * 1e3,
            "pad_ms": round(pad_ms, 3),
            "host_ms_per_call": round(percentile(host, 50), 4),
            "n_sets": n_sets,
        }
        return times, info


# ---- hardware floors ----------------------------------------------------------------------------
def measure_floors(env: Env, timer: Timer, copy_bytes: int = 1 << 30, n: int = 8192) -> dict:
    """Measured ceilings: device-to-device copy bandwidth and torch.matmul n^3 TFLOP/s."""
    torch = env.torch
    src = torch.randn(copy_bytes // 4, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    times, _ = timer.measure(lambda _i, s=src, d=dst: d.copy_(s), 1)
    copy = summarize(times)
    floors: dict[str, Any] = {
        "copy_bytes": copy_bytes,
        "copy_gbps": 2 * copy_bytes / (copy["median_ms"] * 1e-3) / 1e9,
        "copy_stats": copy,
        "copy_method": "torch Tensor.copy_ of a 1 GiB fp32 tensor; bytes read + bytes written",
        "matmul_n": n,
        "matmul_tflops": {},
        "matmul_stats": {},
        "matmul_method": f"torch.matmul of two randn {n}x{n} matrices, 2*n^3 FLOPs",
    }
    src = dst = None
    for name in ("bfloat16", "float16"):
        dtype = getattr(torch, name)
        a = torch.randn(n, n, device="cuda", dtype=torch.float32).to(dtype)
        b = torch.randn(n, n, device="cuda", dtype=torch.float32).to(dtype)
        times, _ = timer.measure(lambda _i, a=a, b=b: torch.matmul(a, b), 1)
        stats = summarize(times)
        floors["matmul_tflops"][name] = 2 * n**3 / (stats["median_ms"] * 1e-3) / 1e12
        floors["matmul_stats"][name] = stats
        del a, b
    torch.cuda.empty_cache()
    return floors


def release(env: Env) -> None:
    """Return cached blocks of both pools to the device between shapes."""
    env.sync()
    env.torch.cuda.empty_cache()
    env.cupy.get_default_memory_pool().free_all_blocks()


def classify_torch_failure(exc: BaseException, caught: list[Any]) -> tuple[bool, str]:
    """(is "unavailable", reason) for an SDPA call that raised under a forced backend."""
    messages = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
    reason = "; ".join(dict.fromkeys(messages))[:400]
    text = str(exc)
    unavailable = "No available kernel" in text or "not supported" in text.lower()
    return unavailable, (reason or first_line(exc))


@contextlib.contextmanager
def capture_warnings() -> Iterator[list[Any]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
