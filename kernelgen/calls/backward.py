"""``kernelgen.attention_backward``: dq, dk, dv (and dsinks) of attention, from the forward's
out and lse (docs/backward.md).

The same checks as :func:`kernelgen.attention` (they are its functions), the spec (given, or
the autotuner's choice on a GPU as attention()'s, or the policy's default), then the backward
family's launch plan (:mod:`kernelgen.families.backward`) on CuPy, torch or, for NumPy arrays
and CPU torch tensors, the emulator.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from kernelgen.calls.attention import (
    CheckedCall,
    TensorInfo,
    _misaligned_pointer,
    _misaligned_strides,
    check_flags,
    check_inputs,
    common_device,
    describe,
    device_arch,
    mask_shape,
    plan,
    tuned_launch,
)
from kernelgen.calls.backward_mask import BackwardMasks, backward_masks
from kernelgen.calls.block_mask import BlockMask
from kernelgen.calls.expression_inputs import check_spec_expressions
from kernelgen.calls.variant_inputs import VariantArgs, check_spec_variants
from kernelgen.errors import InputError, InputTypeError
from kernelgen.families import backward
from kernelgen.model.policy import default_backward_spec
from kernelgen.runtime.frameworks import (
    Arrays,
    arrays_of,
    device_of,
    float32_broadcast,
    launch_arg,
    pointer_of,
)
from kernelgen.runtime.host import EMULATED_CAPABILITY, HOST_DEVICE, as_numpy, is_host_array
from kernelgen.runtime.launch import (
    DEFAULT_DYNAMIC_SMEM,
    MAX_PREPARED,
    LaunchStep,
    Problem,
    check_fits_device,
    compile_functions,
    current_device,
    import_cupy,
    kernel_arguments,
)
from kernelgen.specs.backward import BackwardSpec

__all__ = ["attention_backward"]


def attention_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    *,
    causal: bool = False,
    scale: float | None = None,
    mask: Any = None,
    layout: str = "bhsd",
    window_size: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    mod_inputs: Mapping[str, Any] | None = None,
    block_mask: BlockMask | None = None,
    deterministic: bool = False,
    spec: BackwardSpec | None = None,
) -> tuple[Any, ...]:
    """Gradients of ``out = attention(q, k, v, ...)`` given ``dout`` = dL/dout.

    ``out`` and ``lse`` are what the forward returned (``return_lse=True``); every other
    argument is the forward call's, with its meaning (docs/variants.md, docs/expressions.md).
    Returns ``(dq, dk, dv)`` in the inputs' dtype and layout (dk and dv summed over the query
    heads of each GQA group), and with ``sinks`` also ``dsinks`` (fp32, like sinks). No gradient
    flows into ``mask``, ``alibi_slopes`` or ``mod_inputs``. ``deterministic=True`` computes dQ
    without atomics: bitwise identical results on every run, at the cost of recomputing the
    scores once more. CuPy in, CuPy out; torch in, torch out; NumPy or CPU torch run in the
    emulator. Without ``spec``, a GPU call runs the autotuner's choice for its backward problem
    (``KERNELGEN_AUTOTUNE``, docs/autotuning.md), a host call or one with user expressions the
    policy's default.

    With a ``mask_mod`` (or the forward's ``block_mask``, whose mask_mod serves when mask_mod is
    None) the kernels are block-sparse (docs/backward.md, "Block sparsity"): they visit only the
    tiles the mask_mod leaves partly or fully visible, listed for their own tile shapes where q
    lives (a ``block_mask`` is used for its mask_mod, broadcast batch and heads, and its lists
    where the dQ kernel's tiles are its own; what is derived from it is cached on it).
    """
    check_flags(causal=causal, deterministic=deterministic)
    if spec is not None and not isinstance(spec, BackwardSpec):
        raise InputTypeError(f"spec has type {type(spec).__name__}; expected a BackwardSpec")
    infos = [describe(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))]
    if isinstance(block_mask, BlockMask):  # its lists as the kernels will index them
        block_mask.check_arrays(arrays_of(q).name, device_of(q))
    variants = VariantArgs(
        window_size, softcap, alibi_slopes, sinks, score_mod, mask_mod, mod_inputs, block_mask
    )
    call = check_inputs(
        *infos, describe(mask, "mask") if mask is not None else None, layout=layout,
        scale=scale, spec=None, causal=bool(causal), variants=variants,
    )  # fmt: skip
    order = (0, 1, 2, 3) if layout == "bhsd" else (0, 2, 1, 3)
    grads_in = {
        name: _check_like_q(describe(x, name).permuted(order), call)
        for name, x in (("dout", dout), ("out", out))
    }
    _check_lse(describe(lse, "lse"), call)
    arrays = arrays_of(q)
    device = common_device(
        {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse, "mask": mask,
         **variants.arrays(), **call.expressions.named_arrays()}
    )  # fmt: skip
    misaligned = _misaligned([call.q, call.k, call.v, grads_in["dout"]])
    with arrays.scope(device):
        if spec is None:  # with the call's device current: the tuner times on it
            spec = _untuned_or_tuned_spec(call, bool(causal), bool(deterministic), arrays,
                                          misaligned)  # fmt: skip
        spec = _checked_spec(spec, call, bool(causal), bool(deterministic), misaligned)
        kernels = _kernels(spec, arrays, device)
        tensors = {t.name: launch_arg(arrays, t.source) for t in (call.q, call.k, call.v)}
        tensors.update({name: launch_arg(arrays, t.source) for name, t in grads_in.items()})
        tensors["lse"] = launch_arg(arrays, lse)
        temporaries = []
        if call.mask is not None:
            mask_array, strides = float32_broadcast(call.mask.source, mask_shape(call))
            tensors["mask"] = launch_arg(arrays, mask_array)
            temporaries.append(mask_array)
            call = replace(call, mask=TensorInfo("mask", mask_shape(call), strides, "float32",
                                                 mask_array))  # fmt: skip
        tensors.update(call.variants.tensors(arrays))  # no kernel takes sinks: _sink_gradients
        if block_mask is not None and is_host_array(block_mask.partial_counts):
            block_mask.check_values()
        expressions = replace(call.expressions, block_mask=None)  # the forward's lists: below
        tensors.update(expressions.tensors(arrays))
        variants_here = replace(call.variants, expressions=expressions)
        problem, q_shape = plan(replace(call, variants=variants_here), layout)
        if spec.block_sparse:
            masks = _backward_masks(spec, call, q)
            tensors.update({n: launch_arg(arrays, x) for n, x in masks.tensors().items()})
            problem = replace(problem, extra_scalars=problem.extra_scalars + masks.scalars())
        # plan() gives the strides of a fresh forward output; the backward reads the caller's
        # out, which may be a view (rows of a wider out, a context-parallel block)
        problem = replace(problem, out_strides=grads_in["out"].strides[:3])
        dtype = arrays.dtype_of(call.q.source)
        k_shape = tuple(call.k.shape[i] for i in order)
        grads = {
            "dq": arrays.empty(q_shape, dtype, device),
            "dk": arrays.empty(k_shape, dtype, device),
            "dv": arrays.empty(k_shape, dtype, device),
        }
        strides = {"dout": grads_in["dout"].strides[:3], "out": grads_in["out"].strides[:3]}
        for name, array in grads.items():
            tensors[name] = arrays.launch_arg(array)
            strides[name] = _contiguous_strides(array.shape, layout)
        extra = [(f"{t}_stride_{a}", s[i]) for t, s in strides.items() for i, a in enumerate("bhs")]
        problem = replace(problem, extra_scalars=problem.extra_scalars + tuple(extra))
        scratch = {
            name: arrays.empty((floats,), arrays.float32(), device)
            for name, floats in backward.scratch_floats(spec, problem).items()
        }
        tensors.update({name: arrays.launch_arg(x) for name, x in scratch.items()})
        kernels.launch(problem, tensors, call.scale)
        result = (grads["dq"], grads["dk"], grads["dv"])
        if call.variants.sinks is not None:
            result += (_sink_gradients(arrays, call, lse, scratch["delta"], problem),)
        del temporaries  # each library frees in stream order: safe once queued
    return result


def _check_like_q(t: TensorInfo, call: CheckedCall) -> TensorInfo:
    """dout and out: q's shape and dtype (in (B, H, S, D) order), the last dimension contiguous."""
    if t.shape != call.q.shape:
        raise InputError(f"{t.name} has shape {t.shape} but q has {call.q.shape}; they must match")
    if t.dtype != call.q.dtype:
        raise InputTypeError(f"{t.name} has dtype {t.dtype} but q has {call.q.dtype}")
    if t.strides[3] != 1:
        raise InputError(
            f"{t.name}'s last dimension is not contiguous (stride {t.strides[3]}); pass it with "
            "stride 1 along head_dim"
        )
    return t


def _check_lse(t: TensorInfo, call: CheckedCall) -> None:
    """lse: the forward's fp32 (B, H, Sq), contiguous."""
    batch, heads, seqlen_q, _ = call.q.shape
    if t.shape != (batch, heads, seqlen_q) or t.dtype != "float32":
        raise InputError(
            f"lse has shape {t.shape} and dtype {t.dtype}; expected float32 "
            f"{(batch, heads, seqlen_q)}, the forward's return_lse=True output"
        )
    if t.strides != (heads * seqlen_q, seqlen_q, 1):
        raise InputError(f"lse has strides {t.strides}; pass it contiguous")


def _contiguous_strides(shape: tuple[int, ...], layout: str) -> tuple[int, int, int]:
    """(b, h, s) strides of a contiguous array of ``shape`` in ``layout``."""
    d = shape[3]
    if layout == "bhsd":
        return (shape[1] * shape[2] * d, shape[2] * d, d)
    return (shape[1] * shape[2] * d, d, shape[2] * d)


def _misaligned(tensors: list[TensorInfo]) -> list[str]:
    """Why each tensor the tensor-core kernels copy in 16-byte chunks (q, k, v, dout) cannot be
    (strides, or the data pointer), as in the forward."""
    return [
        why
        for t in tensors
        if (why := _misaligned_strides(t) or _misaligned_pointer(pointer_of(t.source), t.name))
    ]


def _policy_spec(
    call: CheckedCall,
    causal: bool,
    deterministic: bool,
    capability: int,
    misaligned: list[str],
    arch: str | None = None,
) -> BackwardSpec:
    """The policy's backward spec for a call on a device of ``capability`` (``arch``: its
    shared memory; None: sm_80 and sm_90): the tensor-core engine for fp16/bf16 on sm_80+ when
    q, k, v and dout copy in 16-byte chunks (none ``misaligned``), else the CUDA-core one."""
    return default_backward_spec(
        call.dtype,
        call.q.shape[3],
        causal=causal,
        variants=call.variants.flags,
        expressions=call.expressions,
        deterministic=deterministic,
        tensor_cores=capability >= 80 and not misaligned,
        additive_mask=call.mask is not None,
        arch=arch,
    )


def _untuned_or_tuned_spec(
    call: CheckedCall, causal: bool, deterministic: bool, arrays: Arrays, misaligned: list[str]
) -> BackwardSpec:
    """The backward spec for a call without one, chosen as attention() chooses its forward
    spec: the autotuner's (:func:`kernelgen.tuning.select_launch` with the call's backward
    problem: memo, disk or a fresh tuning; ``KERNELGEN_AUTOTUNE=0`` the policy's default,
    ``offline`` the database only) on a GPU of sm_80 or newer with q, k, v and dout copyable in
    16-byte chunks; else :func:`_policy_spec`: on the CPU backend (no GPU to time; sm_80's
    instructions), for calls with user expressions (compiled per expression, not in a tuning
    key) and for misaligned inputs."""
    capability, arch = (EMULATED_CAPABILITY, None) if arrays.host else device_arch()
    if arrays.host or call.expressions.present or capability < 80 or misaligned:
        return _policy_spec(call, causal, deterministic, capability, misaligned, arch)
    spec = tuned_launch(
        call, causal, arrays.name, family="backward", deterministic=deterministic
    ).spec
    assert isinstance(spec, BackwardSpec)  # the key's family: a backward record's winner
    return spec


def _checked_spec(
    spec: BackwardSpec,
    call: CheckedCall,
    causal: bool,
    deterministic: bool,
    misaligned: list[str] | None = None,
) -> BackwardSpec:
    """``spec`` checked against the call (a tensor-core spec needs 16-byte chunks: none of
    ``misaligned``), with the mask's flag where the call has a mask."""
    for name, wanted in (("dtype", call.dtype), ("head_dim", call.q.shape[3]),
                         ("causal", causal)):  # fmt: skip
        if getattr(spec, name) != wanted:
            raise InputError(
                f"spec {spec.uri} has {name}={getattr(spec, name)!r} but the call needs "
                f"{name}={wanted!r}"
            )
    if deterministic and not spec.deterministic:
        raise InputError(
            f"deterministic=True but spec {spec.uri} accumulates dQ with atomics; use a "
            "spec with deterministic: true"
        )
    if spec.engine.chunk_bytes and misaligned:
        raise InputError(f"{misaligned[0]}; spec {spec.uri} copies 16-byte chunks")
    if call.mask is not None:
        spec = spec.with_additive_mask()
    check_spec_variants(spec, call.variants)
    # block_sparse is the backward spec's own choice (its lists are built for its tiles)
    check_spec_expressions(spec, call.expressions, sparsity_given=False)
    return spec


def _backward_masks(spec: BackwardSpec, call: CheckedCall, q: Any) -> BackwardMasks:
    """The tile lists of a block-sparse spec for the call (kernelgen.calls.backward_mask)."""
    batch, heads, seqlen_q, _ = call.q.shape
    seqlen_k = call.k.shape[2]
    expressions = call.expressions
    assert expressions.mask_mod is not None  # a block-sparse spec has the call's mask_mod
    return backward_masks(
        spec, expressions.mask_mod, expressions.block_mask, (batch, heads, seqlen_q, seqlen_k),
        expressions.arrays, q,
    )  # fmt: skip


def _sink_gradients(
    arrays: Arrays, call: CheckedCall, lse: Any, delta: Any, problem: Problem
) -> Any:
    """dsinks[h] = -sum over (b, i) of exp(sink_h - lse_bhi) D_bhi: the sink is a key of value 0,
    so its dP is 0 and its dS is -P D. Summed by the array library (a fixed-order reduction)."""
    sinks = call.variants.sinks.source
    rows = (problem.batch, problem.num_heads, problem.seqlen_q)
    if arrays.host:
        lse_v, d_v = as_numpy(lse).astype(np.float64), np.asarray(delta).reshape(rows)
        sinks_v = as_numpy(sinks).astype(np.float64)
        weights = np.exp(sinks_v[None, :, None] - lse_v)
        grad = arrays.empty((problem.num_heads,), arrays.float32(), HOST_DEVICE)
        as_numpy(grad)[:] = -(weights * d_v).sum(axis=(0, 2))
        return grad
    if arrays.name == "torch":
        torch = sys.modules["torch"]
        d_t = delta.view(rows)
        return -(torch.exp(sinks.float()[None, :, None] - lse) * d_t).sum(dim=(0, 2))
    cupy = import_cupy()
    d_c = delta.reshape(rows)
    return -(cupy.exp(cupy.asarray(sinks)[None, :, None] - cupy.asarray(lse)) * d_c).sum(
        axis=(0, 2)
    )


class _BackwardKernels:
    """A backward spec's kernels, compiled for one device (CuPy) or built by the emulator, and
    launched in the family's order."""

    def __init__(self, spec: BackwardSpec, host: bool) -> None:
        self.spec = spec
        self.host = host
        self._steps: dict[Problem, list[LaunchStep]] = {}
        source = backward.render(spec)
        if host:
            from kernelgen.runtime.emulated_launch import spec_kernels

            steps = backward.launch_steps(spec, _UNIT_PROBLEM)  # one library for all three
            kernels = tuple((s.symbol, tuple(s.params)) for s in steps)
            self.functions = dict(spec_kernels(spec, kernels, source))
        else:
            self.functions = compile_functions(
                import_cupy(), spec.uri, source, backward.symbols(spec)
            )
            for step in backward.launch_steps(spec, _UNIT_PROBLEM):
                if step.shared_mem > DEFAULT_DYNAMIC_SMEM:
                    self.functions[step.symbol].max_dynamic_shared_size_bytes = step.shared_mem

    def launch(self, problem: Problem, tensors: dict[str, Any], scale: float) -> dict[str, Any]:
        """Every step in order; in the emulator, returns each kernel's launch statistics by
        symbol (the tests count the tiles a kernel copied), else an empty dict."""
        null = None if self.host else np.uint64(0)
        stats: dict[str, Any] = {}
        steps = self._steps.get(problem)
        if steps is None:  # a call shape's grids, worked out once (as PreparedLaunch does)
            if len(self._steps) >= MAX_PREPARED:
                self._steps.clear()
            steps = self._steps[problem] = backward.launch_steps(self.spec, problem)
        for step in steps:
            args = kernel_arguments(step.params, problem, tensors, scale, null=null)
            function = self.functions[step.symbol]
            if self.host:
                stats[step.symbol] = function(
                    grid=step.grid, block=step.block, shared_mem=step.shared_mem, args=args
                )
            else:
                function(step.grid, step.block, tuple(args), shared_mem=step.shared_mem)
        return stats


# Any problem gives the same symbols and parameters (only the grids depend on it).
_UNIT_PROBLEM = Problem(1, 1, 1, 1, 1, 8, (8, 8, 8), (8, 8, 8), (8, 8, 8), (8, 8, 8))
_KERNELS: dict[tuple[BackwardSpec, int], _BackwardKernels] = {}
_KERNELS_LOCK = threading.Lock()


def _kernels(spec: BackwardSpec, arrays: Arrays, device: int) -> _BackwardKernels:
    """The spec's kernels for ``device`` (host: the emulator), built once per process."""
    if not arrays.host:
        check_fits_device(spec, device)
        device = current_device()
    key = (spec, device)
    kernels = _KERNELS.get(key)
    if kernels is None:
        with _KERNELS_LOCK:
            kernels = _KERNELS.get(key)
            if kernels is None:
                kernels = _KERNELS[key] = _BackwardKernels(spec, arrays.host)
    return kernels
