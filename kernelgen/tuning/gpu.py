"""The GPU layer: device and toolchain facts and real timing, through CuPy (imported lazily).

Nothing else in kernelgen.tuning imports CuPy, so candidates, pruning, the database and the
CLI's dry run work on a machine without a GPU.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

from kernelgen.errors import ToolchainMissingError
from kernelgen.spec import KernelSpec
from kernelgen.tuning.key import DeviceInfo, ProblemDesc, SoftwareInfo, local_software

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
    from kernelgen.launch import import_cupy

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
    from kernelgen.launch import import_cupy

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


class CupyBench:
    """Times specs on the current GPU for one problem, with inputs rotated against L2."""

    def __init__(self, problem: ProblemDesc, device: DeviceInfo, seed: int = 0) -> None:
        import numpy as np

        from kernelgen.tuning.candidates import launch_problem, pages_per_sequence

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
        set_bytes = elem * (2 * math.prod(q_shape) + 2 * math.prod(kv_shape))
        count = max(2, min(16, math.ceil(2 * max(device.l2_bytes, 1) / set_bytes)))

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
        self.scale = 1.0 / math.sqrt(p.head_dim)
        self.launch_problem = launch_problem(p)

    def _launch(self, spec: KernelSpec, index: int, num_splits: int | None = None) -> None:
        from kernelgen.launch import runtime_kernel

        kernel = runtime_kernel(spec)
        kernel(self.sets[index % len(self.sets)], self.launch_problem, self.scale, num_splits)

    def compile(self, spec: KernelSpec) -> None:
        """Load the spec's cubin from the offline compile of the pruning step where it was
        built for this device's arch, else compile it (outside the timed region)."""
        from kernelgen.launch import runtime_kernel
        from kernelgen.tuning.candidates import offline_cubin

        runtime_kernel(spec, offline_cubin(spec, spec.compile_arch(self.device.arch)))
        self._launch(spec, 0)  # a first launch loads the module outside the timed region
        self.cupy.cuda.get_current_stream().synchronize()

    def time(
        self,
        spec: KernelSpec,
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

    def check(self, spec: KernelSpec, num_splits: int | None = None) -> str | None:
        cp = self.cupy
        s = self.sets[0]
        nan_fill(cp, s["out"])  # poison, so unwritten rows show up
        self._launch(spec, 0, num_splits)
        ref = self.reference(s)
        got = as_float32(cp, s["out"])
        if not bool(cp.isfinite(got).all()):
            return "NaN or inf in the output"
        err = float(cp.linalg.norm(got - ref) / max(float(cp.linalg.norm(ref)), 1e-30))
        limit = TOLERANCE[self.problem.dtype]
        return None if err <= limit else f"relative error {err:.2e} > {limit:.0e}"
