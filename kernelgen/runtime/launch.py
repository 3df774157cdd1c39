"""Run-time compilation (CuPy RawModule / NVRTC) and launch geometry of generated kernels."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import tempfile
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from kernelgen.errors import CompileError, InputError, ToolchainMissingError
from kernelgen.kernels.compile import COMMON_OPTIONS, cuda_include_dir
from kernelgen.kernels.render import (
    COMBINE_WARPS,
    MAX_SPLITS,
    VARIANT_OFF,
    Param,
    combine_params,
    kernel_params,
    render,
    workspace_floats,
)
from kernelgen.runtime.occupancy import blocks_per_sm
from kernelgen.runtime.tensor_maps import (
    Encoder,
    TensorMapCache,
    device_pointer,
    encode_device_tensor,
    tensor_map_layouts,
)
from kernelgen.specs.arch import nearest_arch
from kernelgen.specs.engines import engine_of
from kernelgen.specs.forward import KernelSpec

DEFAULT_DYNAMIC_SMEM = 48 * 1024  # above this a kernel must opt in


log = logging.getLogger(__name__)


def import_cupy() -> Any:
    """The cupy module (from sys.modules when imported: this sits on every call's path)."""
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        return cupy
    try:
        import cupy
    except ImportError as exc:
        raise ToolchainMissingError(
            "CuPy is not installed; install kernelgen[cuda] (cupy-cuda13x)"
        ) from exc
    return cupy


@dataclass(frozen=True)
class Problem:
    """Sizes and strides of one attention call, in elements, in (batch, head, seq, dim) order."""

    batch: int
    num_heads: int
    num_kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    q_strides: tuple[int, int, int]
    k_strides: tuple[int, int, int]
    v_strides: tuple[int, int, int]
    out_strides: tuple[int, int, int]
    mask_strides: tuple[int, int, int, int] = (0, 0, 0, 0)
    num_splits: int = 1  # key chunks of a split-KV spec (1 for the others)
    # Paged-KV specs: keys per page and the block table's row stride (k/v_strides[0] is then
    # the stride between pages, seqlen_k the pages per sequence times page_size).
    page_size: int = 0
    block_table_stride: int = 0
    num_pages: int = 0  # pages in the pool (the TMA tensor maps of a wgmma paged spec span it)
    # Scalar arguments of the built-in variants by parameter name (CallVariants.scalars(),
    # render.VARIANT_PARAMS); a parameter absent here gets its render.VARIANT_OFF value.
    variant_scalars: tuple[tuple[str, int | float], ...] = ()
    # Further integer arguments by parameter name: the user expressions' input shapes and
    # strides, a block mask's strides (docs/expressions.md).
    extra_scalars: tuple[tuple[str, int], ...] = ()

    @property
    def window(self) -> tuple[int, int]:
        """The window's (left, right), -1 unbounded (both without one): what tile skipping and
        split counts read."""
        values = {**VARIANT_OFF, **dict(self.variant_scalars)}
        return int(values["window_left"]), int(values["window_right"])

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads


Grid = tuple[int, int, int]


@dataclass(frozen=True)
class LaunchStep:
    """One kernel launch of a spec's plan: symbol, parameters, geometry, dynamic shared memory."""

    symbol: str
    params: tuple[Param, ...]
    grid: Grid
    block: Grid
    shared_mem: int


def tile_rows(spec: KernelSpec, problem: Problem) -> int:
    """Rows a thread block's tiles walk through: the queries of one head, or with ``pack_gqa``
    the (query, head) pairs of the query heads that share one key/value head."""
    return problem.seqlen_q * (problem.group if spec.pack_gqa else 1)


# CUDA's grid limits: gridDim.x up to 2^31 - 1 blocks, gridDim.y and gridDim.z up to 65535.
MAX_GRID = (2**31 - 1, 65535, 65535)


def launch_geometry(spec: KernelSpec, problem: Problem) -> tuple[Grid, Grid]:
    """(grid, block) of the main kernel. v2: gridDim.x runs over the row tiles of a head (a
    key/value head with ``pack_gqa``), then the (batch, head) pairs; gridDim.y over the key
    chunks (``split_kv``); with ``cluster_m`` > 1 the row tiles of a head are rounded up to whole
    clusters. v1: one block per (batch, head) on gridDim.x. The heads share x,
    whose limit is 2^31 - 1, so a large batch never meets y's 65535."""
    heads = problem.batch * (problem.num_kv_heads if spec.pack_gqa else problem.num_heads)
    if spec.loop_order == "v2":
        splits = problem.num_splits if spec.split_kv else 1
        grid = (spec.row_tiles(tile_rows(spec, problem)) * heads, splits, 1)
    else:
        grid = (heads, 1, 1)
    if any(size > limit for size, limit in zip(grid, MAX_GRID, strict=True)):
        raise InputError(
            f"{spec.uri}: batch={problem.batch} x heads x seqlen_q={problem.seqlen_q} needs the "
            f"grid {grid}, over CUDA's limit of {MAX_GRID} blocks; split the call over the batch"
        )
    return grid, (spec.threads, 1, 1)


def launch_steps(spec: KernelSpec, problem: Problem) -> list[LaunchStep]:
    """The launches that compute one attention call, in order (split-KV: main, then combine)."""
    grid, block = launch_geometry(spec, problem)
    steps = [LaunchStep(spec.uri, kernel_params(spec), grid, block, spec.smem_bytes)]
    if spec.split_kv:
        rows = problem.batch * problem.num_heads * problem.seqlen_q
        steps.append(
            LaunchStep(
                spec.combine_uri,
                combine_params(spec),
                (rows, 1, 1),
                (32 * COMBINE_WARPS, 1, 1),
                0,
            )
        )
    return steps


def scratch_floats(spec: KernelSpec, problem: Problem) -> dict[str, int]:
    """fp32 scratch buffers a launch needs, by parameter name: v1's row states, split-KV's
    per-chunk outputs and LSEs, laid out (split, batch * num_heads, seqlen_q[, head_dim])."""
    rows = problem.batch * problem.num_heads * problem.seqlen_q
    buffers = {}
    if spec.loop_order == "v1":
        buffers["workspace"] = workspace_floats(
            spec, problem.batch, problem.num_heads, problem.seqlen_q
        )
    if spec.split_kv:
        buffers["o_partial"] = problem.num_splits * rows * spec.head_dim
        buffers["lse_partial"] = problem.num_splits * rows
    return buffers


SCRATCH_ALIGN_FLOATS = 64  # each scratch buffer starts on a 256-byte boundary


def scratch_layout(
    buffers: tuple[tuple[str, int], ...],
) -> tuple[tuple[tuple[str, int], ...], int]:
    """Scratch buffers (name, floats) packed into one fp32 allocation: ((name, offset in
    floats), ...) and the total floats."""
    offsets, total = [], 0
    for name, floats in buffers:
        offsets.append((name, total))
        total += -(-floats // SCRATCH_ALIGN_FLOATS) * SCRATCH_ALIGN_FLOATS
    return tuple(offsets), total


def window_keys(spec: KernelSpec, problem: Problem) -> int:
    """Keys one query tile of ``problem.seqlen_q`` rows can see: all ``seqlen_k``, or with a
    window bounded on both sides (causal bounds the right) about left + Sq + right of them, the
    keys split-KV's chunks cut."""
    left, right = problem.window
    if spec.causal:
        right = 0
    if not spec.window or left < 0 or right < 0:
        return problem.seqlen_k
    return max(1, min(problem.seqlen_k, left + problem.seqlen_q + right))


def default_num_splits(
    spec: KernelSpec,
    problem: Problem,
    sm_count: int,
    arch: str = "sm_90",
    registers: int | None = None,
) -> int:
    """Key chunks for a split-KV launch: enough blocks to fill the GPU's block slots (SMs x
    resident blocks per SM on ``arch``, from shared memory, threads and, when known, the
    kernel's ``registers`` per thread) in nearly whole waves, never more chunks than key
    tiles, 1 when the grid already fills the GPU.

    Uses the padded ``problem.seqlen_k`` (per-sequence lengths are on the device)."""
    if not spec.split_kv:
        return 1
    grid, _ = launch_geometry(spec, Problem(**{**problem.__dict__, "num_splits": 1}))
    blocks = grid[0] * grid[1]
    per_sm = max(1, blocks_per_sm(arch, spec.threads, spec.smem_bytes, registers).blocks)
    slots = sm_count * per_sm
    if blocks >= 0.8 * slots:
        return 1
    key_tiles = math.ceil(window_keys(spec, problem) / spec.block_n)
    efficiency = {}
    for splits in range(1, min(MAX_SPLITS, key_tiles) + 1):
        # a count that leaves the chunk size unchanged only adds empty chunks
        if splits > 1 and math.ceil(key_tiles / splits) == math.ceil(key_tiles / (splits - 1)):
            continue
        waves = blocks * splits / slots
        efficiency[splits] = waves / math.ceil(waves)
    best = max(efficiency.values())
    return min(s for s, e in efficiency.items() if e >= 0.85 * best)


def compile_functions(cupy: Any, name: str, source: str, symbols: list[str]) -> dict[str, Any]:
    """The functions ``symbols`` of CUDA ``source`` (called ``name`` in errors), compiled for
    the current device by CuPy (NVRTC); a CompileError keeps the rejected source."""
    options = [*COMMON_OPTIONS]
    with contextlib.suppress(ToolchainMissingError):  # else CuPy's own include directory
        options.append(f"-I{cuda_include_dir()}")
    try:
        module = cupy.RawModule(code=source, options=tuple(options), backend="nvrtc")
        return {symbol: module.get_function(symbol) for symbol in symbols}
    except cupy.cuda.compiler.CompileException as exc:
        from kernelgen.kernels.compile import save_failed_source

        raise CompileError(name, str(exc), save_failed_source(name, source)) from None


class RuntimeKernel:
    """A spec's kernels compiled for the current device, ready to launch."""

    # How a wgmma spec's TMA tensor maps are made from its tensors (the driver's encoder).
    encode_tensor_map: Encoder = staticmethod(encode_device_tensor)

    def __init__(self, spec: KernelSpec, cubin_path: str | Path | None = None) -> None:
        cupy = import_cupy()
        self.spec = spec
        symbols = [spec.uri] + ([spec.combine_uri] if spec.split_kv else [])
        self._prepared: dict[tuple[Problem, float], PreparedLaunch] = {}
        self.functions = self._load(cupy, cubin_path, symbols) if cubin_path else {}
        if not self.functions:
            self.functions = self._compile(cupy, symbols)
        if spec.smem_bytes > DEFAULT_DYNAMIC_SMEM:
            self.functions[spec.uri].max_dynamic_shared_size_bytes = spec.smem_bytes

    def _compile(self, cupy: Any, symbols: list[str]) -> dict[str, Any]:
        """The spec's functions, compiled from its rendered source by CuPy (NVRTC)."""
        source = render(self.spec)
        if self.spec.engine.arch_target is not None:
            return self._compile_arch_specific(cupy, source, symbols)
        return compile_functions(cupy, self.spec.uri, source, symbols)

    def _compile_arch_specific(self, cupy: Any, source: str, symbols: list[str]) -> dict[str, Any]:
        """wgmma specs target sm_90a, which CuPy's own compile (it picks sm_90) cannot: the cubin
        is compiled offline for each of the spec's archs and loaded from a file."""
        from kernelgen.kernels.compile import compile_offline

        (arch,) = self.spec.archs
        compiled = compile_offline(source, self.spec.uri, arch, sass=False, report=False)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / f"{self.spec.uri}.cubin"
            path.write_bytes(compiled.cubin)
            module = cupy.RawModule(path=str(path))
            return {symbol: module.get_function(symbol) for symbol in symbols}

    def _load(self, cupy: Any, cubin_path: str | Path, symbols: list[str]) -> dict[str, Any]:
        """The spec's functions from a cubin compiled offline for this device's arch; empty
        (the caller compiles) when the driver will not load it."""
        try:
            module = cupy.RawModule(path=str(cubin_path))
            return {symbol: module.get_function(symbol) for symbol in symbols}
        except Exception as exc:  # any refusal: compiling from source still works
            log.warning("cannot load %s (%s); compiling %s instead", cubin_path, exc, self.spec.uri)
            return {}

    def prepare(
        self, problem: Problem, scale: float, num_splits: int | None = None
    ) -> PreparedLaunch:
        """The launches of one call shape, scalars converted once and kept (see
        :class:`PreparedLaunch`). ``num_splits`` (split-KV specs) defaults to
        :func:`default_num_splits`."""
        if self.spec.split_kv:
            if num_splits is None:
                num_splits = self.default_num_splits(problem)
            problem = Problem(**{**problem.__dict__, "num_splits": num_splits})
        key = (problem, scale)
        prepared = self._prepared.get(key)
        if prepared is None:
            if len(self._prepared) >= MAX_PREPARED:
                self._prepared.clear()
            prepared = PreparedLaunch(
                self.spec, self.functions, problem, scale, self.encode_tensor_map
            )
            self._prepared[key] = prepared
        return prepared

    def default_num_splits(self, problem: Problem) -> int:
        """:func:`default_num_splits` on the current device, with this kernel's registers."""
        limits = _device_limits(current_device())
        registers = getattr(self.functions.get(self.spec.uri), "num_regs", None)
        return default_num_splits(
            self.spec,
            problem,
            limits.sm_count,
            limits.arch,
            registers if isinstance(registers, int) else None,
        )

    def __call__(
        self, tensors: dict[str, Any], problem: Problem, scale: float, num_splits: int | None = None
    ) -> None:
        """Launch on CuPy arrays ``tensors`` (q, k, v, out; optionally lse, mask, seqlens_k)."""
        self.prepare(problem, scale, num_splits)(tensors)


MAX_PREPARED = 256  # call shapes a RuntimeKernel keeps prepared (then it starts over)
# C type of each scalar kernel parameter -> the NumPy type its argument is passed as; every other
# parameter is a tensor.
SCALAR_CASTS: dict[str, Any] = {"int": np.int32, "long long": np.int64, "float": np.float32}


class PreparedLaunch:
    """The launches of one call shape (a spec, a Problem, a scale): grids, blocks and every
    scalar argument converted once, so a call only allocates the scratch buffers and puts its
    tensors into the argument lists. This is what keeps a repeated attention() call cheap."""

    def __init__(
        self,
        spec: KernelSpec,
        functions: dict[str, Any],
        problem: Problem,
        scale: float,
        encode_tensor_map: Encoder = encode_device_tensor,
    ) -> None:
        self.spec_uri = spec.uri
        self.problem = problem  # split count included: what the CPU backend's recording reports
        self.reads_mask = spec.additive_mask
        # wgmma: the TMA tensor maps' layouts are checked and fixed here, once per call shape
        self.tensor_maps = (
            TensorMapCache(tensor_map_layouts(spec, problem), encode_tensor_map)
            if spec.engine.warp_specialized
            else None
        )
        buffers = tuple(scratch_floats(spec, problem).items())
        self.scratch_offsets, self.scratch_floats = scratch_layout(buffers)
        self.steps: list[tuple[Any, Grid, Grid, int, list[Any], tuple[tuple[int, str], ...]]] = []
        for step in launch_steps(spec, problem):
            template = kernel_arguments(step.params, problem, {}, scale, null=np.uint64(0))
            tensor_slots = tuple(
                (index, param.name)
                for index, param in enumerate(step.params)
                if param.ctype not in SCALAR_CASTS
            )
            function = functions[step.symbol]
            self.steps.append(
                (function, step.grid, step.block, step.shared_mem, template, tensor_slots)
            )

    def scratch_pointers(self, base: int) -> dict[str, Any]:
        """Each scratch buffer's device pointer (``np.uint64``) in the one fp32 allocation of
        ``scratch_floats`` floats at address ``base`` (:func:`scratch_layout`)."""
        return {name: np.uint64(base + 4 * offset) for name, offset in self.scratch_offsets}

    def __call__(self, tensors: dict[str, Any]) -> None:
        """Launch on ``tensors`` by parameter name (CuPy arrays or device pointers as
        ``np.uint64``; absent ones are null, lse included). Scratch buffers not given are allocated
        by CuPy, in one allocation."""
        if not self.reads_mask and tensors.get("mask") is not None:
            raise InputError(
                f"spec {self.spec_uri} reads no additive mask (additive_mask=false) but a mask "
                "was given; run spec.with_additive_mask()"
            )
        if any(name not in tensors for name, _ in self.scratch_offsets):
            cupy = import_cupy()
            tensors = dict(tensors)
            scratch = cupy.empty(self.scratch_floats, dtype=cupy.float32)  # alive until launched
            for name, pointer in self.scratch_pointers(scratch.data.ptr).items():
                tensors.setdefault(name, pointer)
        if self.tensor_maps is not None:
            tensors = {**tensors, **self.tensor_maps.arguments(tensors, device_pointer)}
        for function, grid, block, shared_mem, template, tensor_slots in self.steps:
            args = list(template)
            for index, name in tensor_slots:
                tensor = tensors.get(name)
                if tensor is not None:
                    args[index] = tensor
            function(grid, block, tuple(args), shared_mem=shared_mem)


def current_device() -> int:
    """Index of the current CUDA device."""
    return import_cupy().cuda.runtime.getDevice()


@dataclass(frozen=True)
class DeviceLimits:
    """What a launch needs to know of a device, read once per device."""

    capability: int  # compute capability, e.g. 90
    sm_count: int
    smem_optin: int  # shared memory a block may opt in to, bytes

    @property
    def arch(self) -> str:
        """The architecture whose per-SM limits the split heuristic uses (devices before sm_80,
        which run only the CUDA-core kernels, are counted as sm_80)."""
        return nearest_arch(self.capability) or "sm_80"


@cache
def _device_limits(device: int) -> DeviceLimits:
    gpu = import_cupy().cuda.Device(device)
    return DeviceLimits(
        capability=int(gpu.compute_capability),
        sm_count=int(gpu.attributes["MultiProcessorCount"]),
        smem_optin=int(gpu.attributes["MaxSharedMemoryPerBlockOptin"]),
    )


def check_fits_device(spec: KernelSpec, device: int) -> None:
    """Raise an InputError naming the spec when ``device`` cannot run it (too old for its
    instructions, too little shared memory per block), before CUDA refuses the launch."""
    limits = _device_limits(device)
    engine = engine_of(spec)
    exact = engine.exact_capability
    if exact is not None and limits.capability != exact:
        raise InputError(
            f"spec {spec.uri} has mma={spec.mma}, compiled for sm_{exact}a, which runs only on "
            f"compute capability {exact // 10}.{exact % 10} (H100, H200); device {device} is "
            f"sm_{limits.capability}: use an mma_sync spec"
        )
    if limits.capability < engine.min_capability:
        raise InputError(
            f"spec {spec.uri} has mma={spec.mma}, which needs compute capability "
            f"{engine.min_capability} or newer; device {device} is sm_{limits.capability}"
        )
    if spec.smem_bytes > limits.smem_optin:
        raise InputError(
            f"spec {spec.uri} needs {spec.smem_bytes} bytes of shared memory per block; device "
            f"{device} (sm_{limits.capability}) allows at most {limits.smem_optin}: use "
            "smaller block_m, block_n or stages"
        )


def kernel_arguments(
    params: tuple[Param, ...], problem: Problem, tensors: dict[str, Any], scale: float, null: Any
) -> list[Any]:
    """Arguments in the order of ``params``; absent tensors become ``null``."""
    values: dict[str, Any] = {
        "batch": problem.batch,
        "num_heads": problem.num_heads,
        "num_kv_heads": problem.num_kv_heads,
        "seqlen_q": problem.seqlen_q,
        "max_seqlen_k": problem.seqlen_k,
        "num_splits": problem.num_splits,
        "page_size": problem.page_size,
        "block_table_stride_b": problem.block_table_stride,
        "scale_log2": scale * math.log2(math.e),
        **VARIANT_OFF,
        **dict(problem.variant_scalars),
        **dict(problem.extra_scalars),
    }
    for tensor, axes, strides in (
        ("q", "bhs", problem.q_strides),
        ("k", "bhs", problem.k_strides),
        ("v", "bhs", problem.v_strides),
        ("out", "bhs", problem.out_strides),
        ("mask", "bhqk", problem.mask_strides),
    ):
        for axis, stride in zip(axes, strides, strict=True):
            values[f"{tensor}_stride_{axis}"] = stride
    args = []
    for param in params:
        if param.ctype in SCALAR_CASTS:
            args.append(SCALAR_CASTS[param.ctype](values[param.name]))
        else:
            tensor = tensors.get(param.name)
            args.append(null if tensor is None else tensor)
    return args


_KERNELS: dict[tuple[KernelSpec, int], RuntimeKernel] = {}  # equal specs hash alike
_KERNELS_LOCK = threading.Lock()


def runtime_kernel(spec: KernelSpec, cubin_path: str | Path | None = None) -> RuntimeKernel:
    """The compiled kernel for ``spec`` on the current device, compiled once per process (or
    loaded from ``cubin_path``, a cubin of the spec for this device's arch, when given)."""
    key = (spec, current_device())
    kernel = _KERNELS.get(key)
    if kernel is None:
        with _KERNELS_LOCK:
            kernel = _KERNELS.get(key)
            if kernel is None:
                kernel = _KERNELS[key] = RuntimeKernel(spec, cubin_path)
    return kernel


def clear_kernel_cache() -> None:
    """Forget the compiled kernels of this process (CuPy's on-disk cache is CuPy's own)."""
    with _KERNELS_LOCK:
        _KERNELS.clear()
