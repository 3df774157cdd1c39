"""The GPU layer: device and toolchain facts and real timing, through CuPy (imported lazily).

Nothing else in kernelgen.tuning imports CuPy, so candidates, pruning, the database and the
CLI's dry run work on a machine without a GPU. Two benches: :class:`CupyBench` times forward
specs, :class:`BackwardBench` backward specs (:func:`kernelgen.tuning.autotune.bench_for` picks
them, or :class:`kernelgen.tuning.fp8_bench.Fp8Bench` for fp8 problems).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from kernelgen.errors import ToolchainMissingError
from kernelgen.families import AnySpec, backward
from kernelgen.model.policy import default_backward_spec, default_spec
from kernelgen.runtime.launch import (
    DEFAULT_DYNAMIC_SMEM,
    Problem,
    compile_functions,
    kernel_arguments,
)
from kernelgen.specs.backward import BackwardSpec
from kernelgen.specs.forward import KernelSpec
from kernelgen.tuning.key import DeviceInfo, ProblemDesc, SoftwareInfo, local_software

log = logging.getLogger(__name__)

NAN_BITS = {"float16": (0x7E00, 16), "bfloat16": (0x7FC0, 16), "float32": (0x7FC00000, 32)}
TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1e-2}  # relative Frobenius error
WARMUP_MS = 10.0
MAX_REPS = 1000


def repetitions(budget_ms: float, launch_ms: float, min_reps: int) -> int:
    """Timed launches for a budget: as many as fit, at least ``min_reps``, at most MAX_REPS."""
    return int(min(MAX_REPS, max(min_reps, budget_ms / max(launch_ms, 1e-3))))


def nan_fill(cupy: Any, array: Any) -> Any:
    """Fill a float16, bfloat16 or float32 CuPy array with NaN by bit pattern (no fill kernel of
    the dtype needed), so that elements a kernel leaves unwritten show up; returns ``array``."""
    bits, width = NAN_BITS[str(array.dtype)]
    array.view(cupy.uint16 if width == 16 else cupy.uint32).fill(bits)
    return array


def require_device() -> Any:
    """CuPy, once a CUDA device is known to be visible (ToolchainMissingError otherwise).

    Without a driver (CuPy installed on a machine with no GPU) every runtime call raises
    ``CUDARuntimeError``, ``getDeviceCount`` included: that counts as no device."""
    from kernelgen.runtime.launch import import_cupy

    cupy = import_cupy()
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise ToolchainMissingError(f"no usable CUDA device: {exc}") from None
    if count < 1:
        raise ToolchainMissingError("no CUDA device is visible")
    return cupy


def free_memory_pool() -> None:
    """Give the free blocks of CuPy's default memory pool back to the device (blocks of live
    arrays stay; CuPy frees a block only once its array is gone, in stream order)."""
    from kernelgen.runtime.launch import import_cupy

    import_cupy().get_default_memory_pool().free_all_blocks()


@cache
def _device(index: int) -> DeviceInfo:
    cupy = require_device()
    props = cupy.cuda.runtime.getDeviceProperties(index)
    name = props["name"]
    return DeviceInfo(
        name=name.decode() if isinstance(name, bytes) else str(name),
        compute_capability=f"{props['major']}.{props['minor']}",
        sm_count=int(props["multiProcessorCount"]),
        l2_bytes=int(props.get("l2CacheSize", 0)),
    )


def detect_device() -> DeviceInfo:
    """The current CUDA device (cached per device index); ToolchainMissingError without one
    (checked before any call that needs a driver)."""
    cupy = require_device()
    try:
        index = cupy.cuda.runtime.getDevice()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise ToolchainMissingError(f"no usable CUDA device: {exc}") from None
    return _device(index)


def _version(number: int) -> str:
    return f"{number // 1000}.{number % 1000 // 10}"


@cache
def detect_software() -> SoftwareInfo:
    """kernelgen, templates, NVRTC, CUDA runtime and CuPy versions of this process."""
    cupy = require_device()
    major, minor = cupy.cuda.nvrtc.getVersion()
    return local_software(
        f"{major}.{minor}", _version(cupy.cuda.runtime.runtimeGetVersion()), cupy.__version__
    )


def element_dtype(name: str) -> Any:
    """The NumPy/CuPy dtype of an element type (bfloat16 comes from ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return name


def bfloat16_bits(xp: Any, values: Any) -> Any:
    """float32 ``values`` rounded to bfloat16 (nearest, ties to even) as uint16 bit patterns;
    ``xp`` is NumPy or CuPy (integer arithmetic only: no bfloat16 kernels needed)."""
    bits = values.astype(xp.float32).view(xp.uint32)
    rounded = bits + xp.uint32(0x7FFF) + ((bits >> xp.uint32(16)) & xp.uint32(1))
    return (rounded >> xp.uint32(16)).astype(xp.uint16)


def as_float32(xp: Any, array: Any) -> Any:
    """``array`` (float16/bfloat16/float32, NumPy or CuPy) widened to float32; bfloat16 by
    its bits (the upper half of a float32), so no bfloat16 kernel is needed."""
    if str(array.dtype) == "bfloat16":
        return (array.view(xp.uint16).astype(xp.uint32) << xp.uint32(16)).view(xp.float32)
    return array.astype(xp.float32)


def as_element(xp: Any, values: Any, dtype: str) -> Any:
    """float32 ``values`` (NumPy or CuPy) as ``dtype`` elements; bfloat16 rounded through its
    bits (:func:`bfloat16_bits`), so no bfloat16 kernel is needed."""
    if dtype == "bfloat16":
        return bfloat16_bits(xp, values).view(element_dtype(dtype))
    return values.astype(dtype)


def upload(cupy: Any, host: Any, dtype: str) -> Any:
    """A host array on the device as ``dtype`` elements (sent as float32, converted there)."""
    return as_element(cupy, cupy.asarray(host, dtype=cupy.float32), dtype)


def device_normal(cupy: Any, state: Any, shape: tuple[int, ...], dtype: str) -> Any:
    """Standard-normal values of ``dtype`` drawn on the device (fresh, never zeros)."""
    return as_element(cupy, state.standard_normal(shape, dtype=cupy.float32), dtype)


def set_count(device: DeviceInfo, set_bytes: int) -> int:
    """Independent input sets a bench rotates through: enough to fill twice the L2 (a launch
    never finds its inputs there), 2 to 16."""
    return max(2, min(16, math.ceil(2 * max(device.l2_bytes, 1) / set_bytes)))


class EventBench:
    """The timing loop of both benches: CUDA events around each launch of :meth:`_launch`, on
    the next input set each time."""

    cupy: Any

    def _launch(self, spec: Any, index: int, num_splits: int | None = None) -> None:
        raise NotImplementedError

    def time(
        self,
        spec: Any,
        budget_ms: float,
        num_splits: int | None = None,
        *,
        min_reps: int,
    ) -> list[float]:
        cuda = self.cupy.cuda
        start, stop = cuda.Event(), cuda.Event()
        start.record()
        launches = 0
        while True:  # warm-up, which also estimates the time of one launch
            self._launch(spec, launches, num_splits)
            launches += 1
            stop.record()
            stop.synchronize()
            elapsed = cuda.get_elapsed_time(start, stop)
            if elapsed >= WARMUP_MS or launches >= 100:
                break
        reps = repetitions(budget_ms, elapsed / launches, min_reps)
        events = [(cuda.Event(), cuda.Event()) for _ in range(reps)]
        for i, (a, b) in enumerate(events):
            a.record()
            self._launch(spec, launches + i, num_splits)
            b.record()
        events[-1][1].synchronize()
        return [cuda.get_elapsed_time(a, b) for a, b in events]


class CupyBench(EventBench):
    """Times specs on the current GPU for one problem, with inputs rotated against L2."""

    def __init__(self, problem: ProblemDesc, device: DeviceInfo, seed: int = 0) -> None:
        from kernelgen.tuning.candidates import pages_per_sequence

        cupy = self.cupy = require_device()
        p = self.problem = problem
        self.device = device
        state = cupy.random.RandomState(seed)
        dtype = element_dtype(p.dtype)
        q_shape = (p.batch, p.num_heads, p.seqlen_q, p.head_dim)
        kv_shape = (p.batch, p.num_kv_heads, p.seqlen_k, p.head_dim)
        paged: dict[str, Any] = {}
        if p.page_size:  # a pool of pages, each sequence's in shuffled order
            pages = pages_per_sequence(p)
            kv_shape = (p.batch * pages, p.page_size, p.num_kv_heads, p.head_dim)
            order = np.random.default_rng(seed).permutation(p.batch * pages)
            paged["block_table"] = cupy.asarray(order.reshape(p.batch, pages).astype(np.int32))
            paged["seqlens_k"] = cupy.full((p.batch,), p.seqlen_k, cupy.int32)
        elem = np.dtype(dtype).itemsize
        count = set_count(device, elem * (2 * math.prod(q_shape) + 2 * math.prod(kv_shape)))

        def tensor(shape: tuple[int, ...]) -> Any:
            return device_normal(cupy, state, shape, p.dtype)

        self.sets = [
            {
                "q": tensor(q_shape),
                "k": tensor(kv_shape),
                "v": tensor(kv_shape),
                "out": cupy.empty(q_shape, dtype),
                "lse": cupy.empty(q_shape[:3], cupy.float32),
                **paged,
            }
            for _ in range(count)
        ]
        if p.mask:  # one (Sq, Sk) mask broadcast over batch and heads
            mask = state.standard_normal((p.seqlen_q, p.seqlen_k), dtype=cupy.float32)
            for s in self.sets:
                s["mask"] = mask
        # the built-in variants' run-time values, as the backward bench's: a kernel with sinks
        # or ALiBi reads its per-head arrays, and one with a soft cap divides by it
        self.variants = bench_variants(p)
        for name in ("alibi_slopes", "sinks"):
            if name in self.variants:
                values = cupy.asarray(self.variants[name])
                for s in self.sets:
                    s[name] = values
        self.scale = 1.0 / math.sqrt(p.head_dim)
        self.launch_problem = variant_launch_problem(p, self.variants)

    def _launch(self, spec: KernelSpec, index: int, num_splits: int | None = None) -> None:
        from kernelgen.runtime.launch import runtime_kernel

        kernel = runtime_kernel(spec)
        kernel(self.sets[index % len(self.sets)], self.launch_problem, self.scale, num_splits)

    def compile(self, spec: KernelSpec) -> None:
        """Load the spec's cubin from the offline compile of the pruning step where it was
        built for this device's arch, else compile it (outside the timed region)."""
        from kernelgen.runtime.launch import runtime_kernel
        from kernelgen.tuning.candidates import offline_cubin

        runtime_kernel(spec, offline_cubin(spec, spec.compile_arch(self.device.arch)))
        self._launch(spec, 0)  # a first launch loads the module outside the timed region
        self.cupy.cuda.get_current_stream().synchronize()

    def reference(self, s: dict[str, Any]) -> Any:
        """float32 attention on the GPU, one (batch, head) at a time."""
        cp, p = self.cupy, self.problem
        out = cp.empty((p.batch, p.num_heads, p.seqlen_q, p.head_dim), cp.float32)
        rows = cp.arange(p.seqlen_q)[:, None]
        hidden = cp.arange(p.seqlen_k)[None, :] > rows + (p.seqlen_k - p.seqlen_q)
        for b in range(p.batch):
            for h in range(p.num_heads):
                kv = h // p.gqa_ratio
                q = as_float32(cp, s["q"][b, h])
                scores = self.scale * q @ as_float32(cp, self._rows(s, "k", b, kv)).T
                if p.mask:
                    scores = scores + s["mask"]
                if p.causal:
                    scores = cp.where(hidden, -cp.inf, scores)
                peak = scores.max(axis=1, keepdims=True)
                weights = cp.exp(scores - cp.where(cp.isfinite(peak), peak, 0))
                total = weights.sum(axis=1, keepdims=True)
                probs = weights / cp.where(total > 0, total, 1)
                out[b, h] = probs @ as_float32(cp, self._rows(s, "v", b, kv))
        return out

    def _rows(self, s: dict[str, Any], name: str, b: int, kv_head: int) -> Any:
        """The (Sk, D) keys or values of sequence b, K/V head kv_head (gathered from its pages
        in a paged problem)."""
        p = self.problem
        if not p.page_size:
            return s[name][b, kv_head]
        pages = s[name][s["block_table"][b]]  # (pages, page_size, Hkv, D)
        return pages.reshape(-1, p.num_kv_heads, p.head_dim)[: p.seqlen_k, kv_head]

    def reference_slice(self) -> np.ndarray:
        """float64 out (kernelgen.references.attention) of the check's slice of set 0 with the
        variants' values: batch entry 0, the query heads of K/V head 0 and their last
        :func:`check_rows` rows, every key (the variants' semantics are the reference's)."""
        from kernelgen.references.attention import naive_attention

        p, s = self.problem, self.sets[0]
        group, first = p.gqa_ratio, p.seqlen_q - check_rows(p)
        options = slice_options(self.variants, group)
        if p.mask:
            options["mask"] = host_float64(self.cupy, s["mask"][first:])
        out, _ = naive_attention(
            host_float64(self.cupy, s["q"][:1, :group, first:]),
            host_float64(self.cupy, self._rows(s, "k", 0, 0)[None, None]),
            host_float64(self.cupy, self._rows(s, "v", 0, 0)[None, None]),
            causal=p.causal,
            scale=self.scale,
            **options,
        )
        return out

    def check(self, spec: KernelSpec, num_splits: int | None = None) -> str | None:
        """None when the spec's out on set 0 is finite and matches: against the float32 GPU
        reference (every row), or with variants against float64 on the check's slice."""
        from kernelgen.references.attention import relative_error

        cp, p = self.cupy, self.problem
        s = self.sets[0]
        nan_fill(cp, s["out"])  # poison, so unwritten rows show up
        self._launch(spec, 0, num_splits)
        got = as_float32(cp, s["out"])
        if not bool(cp.isfinite(got).all()):
            return "NaN or inf in the output"
        limit = TOLERANCE[p.dtype]
        if p.variants:
            first = p.seqlen_q - check_rows(p)
            part = cp.asnumpy(got[:1, : p.gqa_ratio, first:])
            err = relative_error(part, self.reference_slice())
            return None if err <= limit else f"relative error {err:.2e} > {limit:.0e} (float64)"
        ref = self.reference(s)
        err = float(cp.linalg.norm(got - ref) / max(float(cp.linalg.norm(ref)), 1e-30))
        return None if err <= limit else f"relative error {err:.2e} > {limit:.0e}"


# ---- the backward bench --------------------------------------------------------------------
GRADIENTS = ("dq", "dk", "dv")
# The float64 check's slice: batch entry 0, the query heads of K/V head 0, their last rows (as
# many as keep it to this many scores) against every key.
CHECK_SCORES = 1 << 21
# Run-time values of the built-in variants in the backward bench (a record serves every value).
BENCH_SOFTCAP = 20.0
BENCH_SINK = 0.5


def bench_variants(problem: ProblemDesc) -> dict[str, Any]:
    """The variants' run-time values the benches (forward, backward, fp8) run a problem with, as
    attention_backward's keyword arguments (host arrays): a window of a quarter of the keys on
    each side (none to the right when causal), a soft cap, the usual ALiBi slopes
    2^(-8 h / H) and sinks."""
    p, values = problem, {}
    if "window" in p.variants:
        left = max(1, p.seqlen_k // 4)
        values["window_size"] = (left, 0 if p.causal else left)
    if "softcap" in p.variants:
        values["softcap"] = BENCH_SOFTCAP
    if "alibi" in p.variants:
        heads = np.arange(1, p.num_heads + 1, dtype=np.float64)
        values["alibi_slopes"] = (2.0 ** (-8.0 * heads / p.num_heads)).astype(np.float32)
    if "sinks" in p.variants:
        values["sinks"] = np.full(p.num_heads, BENCH_SINK, np.float32)
    return values


def check_rows(problem: ProblemDesc) -> int:
    """Query rows of a bench check's float64 slice (all of them when the slice is small)."""
    p = problem
    return min(p.seqlen_q, max(1, CHECK_SCORES // (p.gqa_ratio * p.seqlen_k)))


def slice_options(variants: dict[str, Any], group: int) -> dict[str, Any]:
    """:func:`bench_variants`' values for the float64 reference of a check's slice, whose
    query heads are the ``group`` of K/V head 0."""
    options = {k: v for k, v in variants.items() if k in ("window_size", "softcap")}
    options.update({k: variants[k][:group] for k in ("alibi_slopes", "sinks") if k in variants})
    return options


def host_float64(cupy: Any, array: Any) -> np.ndarray:
    """A (slice of a) device array as float64 on the host (bfloat16 moved as its bits: no
    bfloat16 copy kernel needed)."""
    if str(array.dtype) == "bfloat16":
        bits = cupy.asnumpy(cupy.ascontiguousarray(array.view(cupy.uint16)))
        return as_float32(np, bits.view(array.dtype)).astype(np.float64)
    return np.asarray(cupy.asnumpy(array), dtype=np.float64)


def backward_launch_problem(problem: ProblemDesc, variants: dict[str, Any]) -> Problem:
    """The kernel-level problem of a backward problem on contiguous (B, H, S, D) tensors: the
    forward's (:func:`~kernelgen.tuning.candidates.launch_problem`) with the variants' values
    and the strides of dout, out, dq, dk and dv (attention_backward's extra scalars)."""

    base = variant_launch_problem(problem, variants)
    strides = {"dout": base.q_strides, "out": base.out_strides, "dq": base.q_strides,
               "dk": base.k_strides, "dv": base.v_strides}  # fmt: skip
    extra = tuple(
        (f"{tensor}_stride_{axis}", values[i])
        for tensor, values in strides.items()
        for i, axis in enumerate("bhs")
    )
    return dataclasses.replace(base, extra_scalars=extra)


def variant_launch_problem(problem: ProblemDesc, variants: dict[str, Any]) -> Problem:
    """The kernel-level problem of ``problem`` (:func:`~kernelgen.tuning.candidates.launch_problem`)
    with :func:`bench_variants`' scalar values: what every bench launches with."""
    from kernelgen.tuning.candidates import launch_problem

    return dataclasses.replace(launch_problem(problem), variant_scalars=variant_scalars(variants))


def variant_scalars(variants: dict[str, Any]) -> tuple[tuple[str, int | float], ...]:
    """The scalar kernel arguments of :func:`bench_variants`' values (ALiBi's (H,) slopes have
    batch stride 0, render.VARIANT_OFF's value)."""
    scalars: list[tuple[str, int | float]] = []
    if "window_size" in variants:  # bench_variants' window is bounded on both sides already
        scalars += zip(("window_left", "window_right"), variants["window_size"], strict=True)
    if "softcap" in variants:
        scalars.append(("softcap", variants["softcap"]))
    return tuple(scalars)


def backward_functions(cupy: Any, spec: BackwardSpec, cubin: Path | None) -> dict[str, Any]:
    """A backward spec's kernels for the current device by symbol: from the cubin of the
    offline compile where there is one and the driver loads it, else compiled by CuPy."""
    symbols = backward.symbols(spec)
    if cubin is not None:
        try:
            module = cupy.RawModule(path=str(cubin))
            return {symbol: module.get_function(symbol) for symbol in symbols}
        except Exception as exc:  # any refusal: compiling from source still works
            log.warning("cannot load %s (%s); compiling %s instead", cubin, exc, spec.uri)
    return compile_functions(cupy, spec.uri, backward.render(spec), symbols)


def forward_kernel(spec: KernelSpec) -> Any:
    """The forward kernel that makes the backward bench's out and lse (a RuntimeKernel)."""
    from kernelgen.runtime.launch import runtime_kernel

    return runtime_kernel(spec)


class BackwardBench(EventBench):
    """Times backward specs on the current GPU for one backward problem: each launch is a
    spec's kernels in order (:func:`kernelgen.families.backward.launch_steps`), on inputs made
    once: q, k, v and dout drawn at random, out and lse from the untuned forward kernel with the
    same mask and variants; sets rotated against L2 as :class:`CupyBench`'s."""

    def __init__(self, problem: ProblemDesc, device: DeviceInfo, seed: int = 0) -> None:
        cupy = self.cupy = require_device()
        p = self.problem = problem
        self.device = device
        self.scale = 1.0 / math.sqrt(p.head_dim)
        self.variants = bench_variants(p)
        self.launch_problem = backward_launch_problem(p, self.variants)
        arch = device.target_arch
        default = default_backward_spec(
            p.dtype, p.head_dim, causal=p.causal, variants=p.variants,
            deterministic=p.deterministic, additive_mask=p.mask,
        )  # fmt: skip
        # the policy's default as a candidate is built: for this arch only
        self.heuristic = BackwardSpec.model_validate(
            {**default.model_dump(mode="json"), "archs": [arch]}
        )
        state = cupy.random.RandomState(seed)
        dtype = element_dtype(p.dtype)
        q_shape = (p.batch, p.num_heads, p.seqlen_q, p.head_dim)
        kv_shape = (p.batch, p.num_kv_heads, p.seqlen_k, p.head_dim)
        elem = np.dtype(dtype).itemsize
        count = set_count(device, elem * 4 * (math.prod(q_shape) + math.prod(kv_shape)))
        shared: dict[str, Any] = {
            name: cupy.asarray(self.variants[name]) for name in ("alibi_slopes", "sinks")
            if name in self.variants
        }  # fmt: skip
        if p.mask:  # one (Sq, Sk) mask broadcast over batch and heads
            shared["mask"] = state.standard_normal((p.seqlen_q, p.seqlen_k), dtype=cupy.float32)
        rows = p.batch * p.num_heads * p.seqlen_q
        self.scratch = {  # every launch rewrites them: one for all sets
            "delta": cupy.empty((rows,), cupy.float32),
            "dq_accum": cupy.empty((rows * p.head_dim,), cupy.float32),
        }

        def tensor(shape: tuple[int, ...]) -> Any:
            return device_normal(cupy, state, shape, p.dtype)

        self.sets = []
        for _ in range(count):
            s = {"q": tensor(q_shape), "k": tensor(kv_shape), "v": tensor(kv_shape),
                 "dout": tensor(q_shape), "out": cupy.empty(q_shape, dtype),
                 "lse": cupy.empty(q_shape[:3], cupy.float32),
                 **{name: cupy.empty(q_shape if name == "dq" else kv_shape, dtype)
                    for name in GRADIENTS},
                 **shared}  # fmt: skip
            self.sets.append(s)
        forward = forward_kernel(
            default_spec(p.dtype, p.head_dim, p.causal, arch, variants=p.variants,
                         additive_mask=p.mask)
        )  # fmt: skip
        for s in self.sets:
            forward(s, self.launch_problem, self.scale)
        cupy.cuda.get_current_stream().synchronize()
        self.functions: dict[BackwardSpec, dict[str, Any]] = {}
        self._calls: dict[tuple[BackwardSpec, int], list[tuple[Any, ...]]] = {}
        self._slice: Any = None  # the float64 reference of the check's slice, once made
        self._heuristic_grads: dict[str, Any] | None = None

    @property
    def check_rows(self) -> int:
        """Query rows of the check's float64 slice (:func:`check_rows`)."""
        return check_rows(self.problem)

    def compile(self, spec: AnySpec) -> None:
        """Load the spec's kernels from the pruning step's cubin (built for this device's
        arch), else compile them, and launch them once (outside any timed region)."""
        from kernelgen.tuning.candidates import offline_cubin

        assert isinstance(spec, BackwardSpec)
        if spec not in self.functions:
            cubin = offline_cubin(spec, spec.compile_arch(self.device.arch))
            self.functions[spec] = backward_functions(self.cupy, spec, cubin)
        self._launch(spec, 0)
        self.cupy.cuda.get_current_stream().synchronize()

    def _launch(self, spec: Any, index: int, num_splits: int | None = None) -> None:
        """The spec's kernels on set ``index`` (arguments packed once per spec and set)."""
        index %= len(self.sets)
        calls = self._calls.get((spec, index))
        if calls is None:
            functions = self.functions[spec]
            tensors = {**self.sets[index], **self.scratch}
            calls = []
            for step in backward.launch_steps(spec, self.launch_problem):
                function = functions[step.symbol]
                if step.shared_mem > DEFAULT_DYNAMIC_SMEM:
                    function.max_dynamic_shared_size_bytes = step.shared_mem
                args = kernel_arguments(
                    step.params, self.launch_problem, tensors, self.scale, null=np.uint64(0)
                )
                calls.append((function, step.grid, step.block, tuple(args), step.shared_mem))
            self._calls[(spec, index)] = calls
        for function, grid, block, args, shared_mem in calls:
            function(grid, block, args, shared_mem=shared_mem)

    def _host(self, array: Any) -> np.ndarray:
        return host_float64(self.cupy, array)

    def reference_slice(self) -> Any:
        """float64 gradients (kernelgen.references.attention) of the check's slice of set 0: batch
        entry 0, the query heads of K/V head 0 and their last :attr:`check_rows` rows, every key; dq
        of those rows, and dk and dv of K/V head 0 where the slice holds every row."""
        if self._slice is None:
            from kernelgen.references.attention import attention_backward as reference_backward

            p, s, rows = self.problem, self.sets[0], self.check_rows
            group, first = p.gqa_ratio, p.seqlen_q - rows
            options: dict[str, Any] = {
                "causal": p.causal, "scale": self.scale, **slice_options(self.variants, group)
            }  # fmt: skip
            if p.mask:
                options["mask"] = self._host(s["mask"][first:])
            self._slice = reference_backward(
                self._host(s["dout"][:1, :group, first:]),
                self._host(s["q"][:1, :group, first:]),
                self._host(s["k"][:1, :1]),
                self._host(s["v"][:1, :1]),
                **options,
            )
        return self._slice

    def heuristic_gradients(self) -> dict[str, Any]:
        """dk and dv (float32, on the device) of the policy's default spec on set 0: what a
        candidate's are compared with where the float64 slice does not cover them."""
        if self._heuristic_grads is None:
            self.compile(self.heuristic)
            self._launch(self.heuristic, 0)
            s = self.sets[0]
            self._heuristic_grads = {n: as_float32(self.cupy, s[n]).copy() for n in ("dk", "dv")}
        return self._heuristic_grads

    def check(self, spec: AnySpec, num_splits: int | None = None) -> str | None:
        """None when the spec's gradients on set 0 are finite and match: dq of the slice (and dk,
        dv of K/V head 0 where the slice holds every row) against float64, else dk and dv
        against the policy's default spec; the forward's tolerances."""
        from kernelgen.references.attention import relative_error

        cp, p, s = self.cupy, self.problem, self.sets[0]
        reference = self.reference_slice()
        whole = self.check_rows == p.seqlen_q
        heuristic = None if whole or spec == self.heuristic else self.heuristic_gradients()
        for name in GRADIENTS:
            nan_fill(cp, s[name])  # poison, so unwritten elements show up
        self._launch(spec, 0)
        got = {name: as_float32(cp, s[name]) for name in GRADIENTS}
        for name, array in got.items():
            if not bool(cp.isfinite(array).all()):
                return f"NaN or inf in {name}"
        first = p.seqlen_q - self.check_rows
        pairs = [("dq", got["dq"][:1, : p.gqa_ratio, first:], reference.dq)]
        if whole:
            pairs += [(n, got[n][:1, :1], getattr(reference, n)) for n in ("dk", "dv")]
        limit = TOLERANCE[p.dtype]
        for name, array, expected in pairs:
            err = relative_error(cp.asnumpy(array), expected)
            if err > limit:
                return f"{name}: relative error {err:.2e} > {limit:.0e} against float64"
        for name, expected in (heuristic or {}).items():
            diff = float(cp.linalg.norm(got[name] - expected))
            err = diff / max(float(cp.linalg.norm(expected)), 1e-30)
            if err > limit:
                uri = self.heuristic.uri
                return f"{name}: relative error {err:.2e} > {limit:.0e} against {uri}"
        return None
