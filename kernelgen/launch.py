"""Run-time compilation (CuPy RawModule / NVRTC) and launch geometry of generated kernels."""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernelgen.compile import COMMON_OPTIONS, cuda_include_dir
from kernelgen.errors import CompileError, ToolchainMissingError
from kernelgen.render import kernel_params, render, workspace_floats
from kernelgen.spec import KernelSpec

DEFAULT_DYNAMIC_SMEM = 48 * 1024  # above this a kernel must opt in


def import_cupy() -> Any:
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


def launch_geometry(spec: KernelSpec, problem: Problem) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(grid, block) for a problem: v2 launches a block per Q tile and head, v1 one per head."""
    heads = problem.batch * problem.num_heads
    if spec.loop_order == "v2":
        grid = (math.ceil(problem.seqlen_q / spec.block_m), heads, 1)
    else:
        grid = (heads, 1, 1)
    return grid, (spec.threads, 1, 1)


class RuntimeKernel:
    """A spec's kernel compiled for the current device, ready to launch."""

    def __init__(self, spec: KernelSpec) -> None:
        cupy = import_cupy()
        self.spec = spec
        self.params = kernel_params(spec)
        source = render(spec)
        options = [*COMMON_OPTIONS]
        with contextlib.suppress(ToolchainMissingError):  # else CuPy's own include directory
            options.append(f"-I{cuda_include_dir()}")
        try:
            module = cupy.RawModule(code=source, options=tuple(options), backend="nvrtc")
            self.function = module.get_function(spec.uri)
        except cupy.cuda.compiler.CompileException as exc:
            from kernelgen.compile import save_failed_source

            raise CompileError(spec.uri, str(exc), save_failed_source(spec.uri, source)) from None
        if spec.smem_bytes > DEFAULT_DYNAMIC_SMEM:
            self.function.max_dynamic_shared_size_bytes = spec.smem_bytes

    def __call__(self, tensors: dict[str, Any], problem: Problem, scale: float) -> None:
        """Launch on CuPy arrays ``tensors`` (q, k, v, out, lse and optionally mask)."""
        cupy = import_cupy()
        floats = workspace_floats(self.spec, problem.batch, problem.num_heads, problem.seqlen_q)
        if floats:
            tensors = {**tensors, "workspace": cupy.empty(floats, dtype=cupy.float32)}
        args = kernel_arguments(self.spec, problem, tensors, scale, null=np.uint64(0))
        grid, block = launch_geometry(self.spec, problem)
        self.function(grid, block, tuple(args), shared_mem=self.spec.smem_bytes)


def kernel_arguments(
    spec: KernelSpec, problem: Problem, tensors: dict[str, Any], scale: float, null: Any
) -> list[Any]:
    """Arguments in the order of :func:`kernel_params`; absent tensors become ``null``."""
    values: dict[str, Any] = {
        "batch": problem.batch,
        "num_heads": problem.num_heads,
        "num_kv_heads": problem.num_kv_heads,
        "seqlen_q": problem.seqlen_q,
        "seqlen_k": problem.seqlen_k,
        "scale_log2": scale * math.log2(math.e),
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
    casts = {"int": np.int32, "long long": np.int64, "float": np.float32}
    args = []
    for param in kernel_params(spec):
        if param.ctype in casts:
            args.append(casts[param.ctype](values[param.name]))
        else:
            tensor = tensors.get(param.name)
            args.append(null if tensor is None else tensor)
    return args


_KERNELS: dict[tuple[str, int], RuntimeKernel] = {}
_KERNELS_LOCK = threading.Lock()


def runtime_kernel(spec: KernelSpec) -> RuntimeKernel:
    """The compiled kernel for ``spec`` on the current device, compiled once per process."""
    cupy = import_cupy()
    key = (spec.canonical_json(), cupy.cuda.Device().id)
    kernel = _KERNELS.get(key)
    if kernel is None:
        with _KERNELS_LOCK:
            kernel = _KERNELS.get(key)
            if kernel is None:
                kernel = _KERNELS[key] = RuntimeKernel(spec)
    return kernel
