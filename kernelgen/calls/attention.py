"""``kernelgen.attention``: input checks, layout handling, spec choice (policy or tuner), launch.

Every check runs on metadata before anything is launched or allocated, so bad input raises a
typed error naming the argument and leaves the GPU untouched.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from kernelgen.calls.block_mask import BlockMask, check_library
from kernelgen.calls.expression_inputs import (
    CallExpressions,
    check_spec_expressions,
    with_expressions,
)
from kernelgen.calls.variant_inputs import (
    NO_VARIANTS,
    CallVariants,
    VariantArgs,
    check_spec_variants,
    check_variants,
)
from kernelgen.errors import InputError, InputTypeError, KernelgenError, caller_stacklevel
from kernelgen.model.policy import (
    HOPPER_DEVICE_ARCH,
    decode_rows,
    default_spec,
    hopper_default_spec,
)
from kernelgen.runtime.frameworks import (
    Arrays,
    CupyArrays,
    TorchArrays,
    arrays_of,
    as_cupy,
    device_of,
    dtype_name,
    float32_broadcast,
    launch_arg,
    module_of,
    pointer_of,
    refuse_during_capture,
)
from kernelgen.runtime.host import EMULATED_CAPABILITY, emulated_kernel, is_host_array
from kernelgen.runtime.launch import (
    MAX_SPLITS,
    PreparedLaunch,
    Problem,
    check_fits_device,
    import_cupy,
    runtime_kernel,
)
from kernelgen.specs.expressions import FLOAT32_MAX
from kernelgen.specs.forward import DTYPE_BYTES, MAX_HEAD_DIM, KernelSpec

Layout = Literal["bhsd", "bshd"]
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
# What a dtype error adds about fp8: where it is taken, and how (docs/hopper.md, fp8).
FP8_INPUTS = (
    "fp8 (float8_e4m3fn, as torch.float8_e4m3fn tensors or NumPy ml_dtypes.float8_e4m3fn "
    "arrays) only in kernelgen.attention and attention_with_kvcache (docs/fp8.md)"
)
_TYPESTR_DTYPES = {"<f4": "float32", "<f2": "float16", "<f8": "float64", "<i4": "int32"}


@dataclass(frozen=True)
class TensorInfo:
    """What attention() needs to know about an array before touching it."""

    name: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str
    source: Any  # the object as given

    def permuted(self, order: tuple[int, ...]) -> TensorInfo:
        return TensorInfo(
            self.name,
            tuple(self.shape[i] for i in order),
            tuple(self.strides[i] for i in order),
            self.dtype,
            self.source,
        )


def describe(array: Any, name: str) -> TensorInfo:
    """Shape, strides and dtype of a device array, read without copying or launching anything."""
    module = module_of(array)
    if (
        module == "numpy"
    ):  # the CPU backend (kernelgen.runtime.host): runs the kernels in the emulator
        itemsize = array.dtype.itemsize
        strides = tuple(s // itemsize for s in array.strides)
        return TensorInfo(name, array.shape, strides, dtype_name(array.dtype), array)
    if module == "cupy":
        itemsize = array.dtype.itemsize
        return TensorInfo(
            name,
            tuple(array.shape),
            tuple(s // itemsize for s in array.strides),
            dtype_name(array.dtype),
            array,
        )
    if module == "torch":
        if not array.is_cuda and array.device.type != "cpu":  # CPU: kernelgen.runtime.host
            raise InputTypeError(
                f"{name} is a torch tensor on {array.device}; move it to a CUDA device (or the "
                "CPU, to run it in the emulator)"
            )
        return TensorInfo(
            name, tuple(array.shape), tuple(array.stride()), dtype_name(array.dtype), array
        )
    interface = getattr(array, "__cuda_array_interface__", None)
    if interface is not None:
        typestr = interface["typestr"]
        dtype = _TYPESTR_DTYPES.get(typestr, typestr)
        itemsize = int(typestr[2:])
        shape = tuple(interface["shape"])
        strides = interface.get("strides")
        if strides is None:
            strides, running = [], 1
            for size in reversed(shape):
                strides.insert(0, running)
                running *= size
        else:
            strides = [s // itemsize for s in strides]
        return TensorInfo(name, shape, tuple(strides), dtype, array)
    if hasattr(array, "__dlpack__"):
        device_type = array.__dlpack_device__()[0] if hasattr(array, "__dlpack_device__") else 0
        if int(device_type) != 2:  # kDLCUDA
            raise InputTypeError(
                f"{name} lives on DLPack device type {int(device_type)}, not a CUDA device (2); "
                f"{ACCEPTED_ARRAYS}"
            )
        return describe(as_cupy(array), name)
    raise InputTypeError(f"{name} has type {type(array).__name__}; {ACCEPTED_ARRAYS}")


# What attention() and its siblings take, on both backends (an error names both: the caller's
# backend is the one its q picks).
ACCEPTED_ARRAYS = (
    "expected a NumPy array or CPU torch tensor (the CPU backend, run by the emulator) or, on a "
    "GPU, a CuPy array, a CUDA torch tensor or an object exposing __cuda_array_interface__ or "
    "__dlpack__"
)


@dataclass(frozen=True)
class CheckedCall:
    """A validated call: metadata in (batch, head, seq, dim) order."""

    q: TensorInfo
    k: TensorInfo
    v: TensorInfo
    mask: TensorInfo | None
    dtype: str
    scale: float
    variants: CallVariants = field(default_factory=CallVariants)  # expressions included

    @property
    def expressions(self) -> CallExpressions:
        """The call's checked user expressions and block mask (part of ``variants``)."""
        return self.variants.expressions


def check_inputs(
    q: TensorInfo,
    k: TensorInfo,
    v: TensorInfo,
    mask: TensorInfo | None,
    *,
    layout: str,
    scale: float | None,
    spec: KernelSpec | None,
    causal: bool,
    variants: VariantArgs = NO_VARIANTS,
    dtypes: tuple[str, ...] = SUPPORTED_DTYPES,
) -> CheckedCall:
    """All argument checks of attention(), on metadata only. ``variants``: the built-in
    variants' and user expressions' arguments (docs/variants.md; arrays or their TensorInfo).
    ``dtypes``: those q, k and v may have (the fp8 call: ``("float8_e4m3",)``)."""
    if layout not in ("bhsd", "bshd"):
        raise InputError(f"layout={layout!r} is not allowed; use 'bhsd' or 'bshd'")
    for t in (q, k, v):
        if len(t.shape) != 4:
            raise InputError(
                f"{t.name} has rank {len(t.shape)} (shape {t.shape}); expected rank 4, "
                f"({'B, H, S, D' if layout == 'bhsd' else 'B, S, H, D'})"
            )
        if t.dtype not in dtypes:
            raise InputTypeError(
                f"{t.name} has dtype {t.dtype}; allowed: {', '.join(dtypes)}"
                + (f"; {FP8_INPUTS}" if dtypes == SUPPORTED_DTYPES else "")
            )
        if 0 in t.shape:
            raise InputError(f"{t.name} has a zero-size dimension (shape {t.shape})")
    if layout == "bshd":
        q, k, v = (t.permuted((0, 2, 1, 3)) for t in (q, k, v))
    for t in (k, v):
        if t.dtype != q.dtype:
            raise InputTypeError(
                f"{t.name} has dtype {t.dtype} but q has {q.dtype}; they must match"
            )
    batch, heads, _, head_dim = q.shape
    if k.shape != v.shape:
        raise InputError(f"k has shape {k.shape} but v has {v.shape}; they must match")
    if k.shape[0] != batch:
        raise InputError(f"k has batch {k.shape[0]} but q has batch {batch}")
    if k.shape[3] != head_dim:
        raise InputError(f"k has head_dim {k.shape[3]} but q has head_dim {head_dim}")
    if heads % k.shape[1]:
        raise InputError(
            f"q has {heads} heads, not divisible by the {k.shape[1]} key/value heads of k"
        )
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        raise InputError(
            f"q has head_dim {head_dim}; allowed: a multiple of 8 from 8 to {MAX_HEAD_DIM}"
        )
    for t in (q, k, v):
        if t.strides[3] != 1:
            raise InputError(
                f"{t.name}'s last dimension is not contiguous (stride {t.strides[3]}); "
                f"pass {t.name} with stride 1 along head_dim (e.g. a .copy())"
            )
    if mask is not None:
        mask = _check_mask(mask, (batch, heads, q.shape[2], k.shape[2]))
    scale = _checked_scale(scale, head_dim)
    checked = check_variants(
        variants,
        describe=_described,
        causal=causal,
        batch=batch,
        heads=heads,
        seqlen_q=q.shape[2],
        seqlen_k=k.shape[2],
    )
    if spec is not None:
        if not isinstance(spec, KernelSpec):
            raise InputTypeError(f"spec has type {type(spec).__name__}; expected a KernelSpec")
        for name, wanted in (("dtype", q.dtype), ("head_dim", head_dim), ("causal", causal)):
            if getattr(spec, name) != wanted:
                raise InputError(
                    f"spec {spec.uri} has {name}={getattr(spec, name)!r} but the call needs "
                    f"{name}={wanted!r}"
                )
        check_spec_variants(spec, checked)
        check_spec_expressions(spec, checked.expressions)
        if spec.engine.chunk_bytes:  # tensor-core specs copy 16-byte chunks (cp.async, TMA)
            for t in (q, k, v):
                problem = _misaligned_strides(t)
                if problem:
                    raise InputError(f"{problem}; spec {spec.uri} copies 16-byte chunks")
    return CheckedCall(q, k, v, mask, q.dtype, float(scale), checked)


def _described(array: Any, name: str) -> TensorInfo:
    """A variant array's metadata (an array, or already its TensorInfo)."""
    return array if isinstance(array, TensorInfo) else describe(array, name)


CHUNK_BYTES = 16  # the tensor-core kernels move rows in 16-byte chunks (cp.async)


def _misaligned_strides(t: TensorInfo) -> str | None:
    """Why ``t`` cannot be read in 16-byte chunks (strides), or None."""
    elems = CHUNK_BYTES // DTYPE_BYTES[t.dtype]
    bad = [s for s in t.strides[:3] if s % elems]
    if bad:
        return f"{t.name} has strides {t.strides} (elements); they must be multiples of {elems}"
    return None


def _misaligned_pointer(ptr: int, name: str) -> str | None:
    if ptr % CHUNK_BYTES:
        return f"{name}'s data pointer {ptr:#x} is not {CHUNK_BYTES}-byte aligned"
    return None


def _check_mask(mask: TensorInfo, full: tuple[int, int, int, int]) -> TensorInfo:
    if mask.dtype not in ("float32", "float16", "bfloat16", "float64"):
        raise InputTypeError(f"mask has dtype {mask.dtype}; expected a floating-point array")
    if len(mask.shape) > 4:
        raise InputError(f"mask has rank {len(mask.shape)}; at most 4 (B, H, Sq, Sk)")
    shape = (1,) * (4 - len(mask.shape)) + mask.shape
    for size, want, axis in zip(
        shape, full, ("batch", "heads", "seqlen_q", "seqlen_k"), strict=True
    ):
        if size not in (1, want):
            raise InputError(
                f"mask has shape {mask.shape}, not broadcastable to {full} (B, H, Sq, Sk): "
                f"its {axis} size is {size}, allowed 1 or {want}"
            )
    return mask


_warned_no_backward = False


def warn_if_grad_wanted(*arrays: Any, why: str) -> None:
    """Warn once per process when a torch input asks for gradients while autograd records but
    the call cannot give them (``why``): its output is computed without a graph and carries
    none. :func:`kernelgen.attention` differentiates the other calls (kernelgen.calls.training)."""
    global _warned_no_backward
    if _warned_no_backward or not any(getattr(x, "requires_grad", False) for x in arrays):
        return
    import torch

    if torch.is_grad_enabled():
        _warned_no_backward = True
        import warnings

        warnings.warn(
            f"kernelgen.attention: an input requires grad, but {why} (no backward pass): the "
            "output carries no gradient and is detached from the autograd graph",
            UserWarning,
            stacklevel=caller_stacklevel(),
        )


def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = False,
    scale: float | None = None,
    mask: Any = None,
    spec: KernelSpec | None = None,
    return_lse: bool = False,
    layout: Layout = "bhsd",
    seqlens_k: Any = None,
    num_splits: int | None = None,
    window_size: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    mod_inputs: Mapping[str, Any] | None = None,
    block_mask: BlockMask | None = None,
    validate: bool = False,
) -> Any:
    """FlashAttention forward: ``softmax(scale * q k^T + mask) v`` over keys.

    The forward pass only: :func:`kernelgen.attention` (kernelgen.calls.training) is this call,
    differentiable by torch autograd (docs/backward.md).

    q is (B, H, Sq, D), k and v (B, Hkv, Sk, D) with H % Hkv == 0 (or (B, S, H, D) with
    ``layout="bshd"``); mask is an additive float array broadcastable to (B, H, Sq, Sk).
    ``seqlens_k`` (a KV cache): one key length per batch entry, K/V padded to Sk; a host
    sequence is range-checked, an int32 device array is clamped to [0, Sk] by the kernels.
    ``num_splits``: key chunks of a split-KV kernel (1 to 128; default: tuned or heuristic).
    Returns out (same layout and dtype as q), and with ``return_lse`` also the fp32 log-sum-exp
    of shape (B, H, Sq). CuPy inputs give CuPy outputs; torch tensors give torch tensors and run
    on torch's current stream (see docs/design-decisions.md). NumPy arrays and CPU torch tensors
    take this same path with the kernels run by the CPU emulator (kernelgen.runtime.host; slow, for
    correctness; it warns once), and give NumPy arrays / CPU torch tensors.

    The built-in variants (docs/variants.md), compiled into the kernel: ``window_size=(left,
    right)`` (query i sees keys i + Sk - Sq - left .. i + Sk - Sq + right, -1 unbounded; with
    ``causal`` right is narrowed to 0), ``softcap`` (s <- c tanh(s / c), c > 0),
    ``alibi_slopes`` (float32 (H,) or (B, H): s <- s - slope |i + Sk - Sq - j|) and ``sinks``
    (float32 (H,): a logit per head in each row's softmax denominator and lse).

    User expressions (docs/expressions.md), compiled into the kernel: ``score_mod`` (a string
    giving the new score from ``score, b, h, q_idx, kv_idx``), ``mask_mod`` (a string, true where
    key ``kv_idx`` is visible to query ``q_idx``), ``mod_inputs`` (name -> array, the arrays
    they read, of q's library and device) and ``block_mask`` (``kernelgen.block_mask(...)`` of
    the mask_mod: only the key tiles it lists are visited; it sets the kernel's tile shape).
    A block mask's lists are checked on every call (int32, of q's library and device, their
    shapes) and so are their values when they live on the host; device lists are read only
    with ``validate=True`` (one synchronisation, checked there by their own library).

    fp8 inputs are :func:`kernelgen.attention`'s (kernelgen.calls.training, kernelgen.calls.fp8);
    this forward refuses them.
    """
    check_flags(causal=causal, return_lse=return_lse, validate=validate)
    warn_if_grad_wanted(
        q,
        k,
        v,
        sinks,
        why="calls with seqlens_k are not differentiable"
        if seqlens_k is not None
        else "kernelgen.calls.attention.attention is the forward pass only (kernelgen.attention "
        "differentiates)",
    )
    variants = VariantArgs(
        window_size, softcap, alibi_slopes, sinks, score_mod, mask_mod, mod_inputs, block_mask
    )
    arrays_in = variants.arrays()
    plan_key = (
        None  # expressions take the checked path on every call
        if variants.has_expressions
        else _call_plan_key(
            q, k, v, mask, seqlens_k, causal, scale, spec, layout, num_splits, variants
        )
    )
    if plan_key is not None and (known := _CALL_PLANS.get(plan_key)) is not None:
        inputs = {"q": q, "k": k, "v": v, "seqlens_k": seqlens_k, **arrays_in}
        out, lse = known.run(inputs, return_lse)
        return (out, lse) if return_lse else out
    infos = [describe(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))]
    if isinstance(block_mask, BlockMask):  # its lists as the kernels will index them
        block_mask.check_arrays(arrays_of(q).name, device_of(q))
    mask_info = describe(mask, "mask") if mask is not None else None
    call = check_inputs(
        *infos, mask_info, layout=layout, scale=scale, spec=spec, causal=bool(causal),
        variants=variants,
    )  # fmt: skip
    num_splits = check_num_splits(num_splits, spec)
    check_expression_libraries(q, call.expressions)
    arrays = arrays_of(q)
    device = common_device(
        {
            "q": q,
            "k": k,
            "v": v,
            "mask": mask,
            "seqlens_k": seqlens_k,
            **arrays_in,
            **call.expressions.named_arrays(),
        }
    )
    with arrays.scope(device):
        if block_mask is not None and (validate or is_host_array(block_mask.partial_counts)):
            block_mask.check_values()
        # temporaries: what the kernels read that the call made (a converted mask, uploaded
        # lengths), held until the launches are queued on the stream they were made on
        call_plan, tensors, temporaries = checked_plan(
            call, bool(causal), seqlens_k, spec, num_splits, layout, arrays, device
        )
        if plan_key is not None:
            if len(_CALL_PLANS) >= MAX_CALL_PLANS:
                _CALL_PLANS.clear()
            _CALL_PLANS[plan_key] = call_plan
        out, lse = call_plan.launch_outputs(tensors, bool(return_lse))
        del temporaries  # each library frees in stream order: safe once queued
    return (out, lse) if return_lse else out


# The kernels take scale * log2(e) as a float32: the largest |scale| it is finite for.
MAX_SCALE = FLOAT32_MAX / math.log2(math.e)


def _checked_scale(scale: Any, head_dim: int) -> float:
    """``scale`` as a float (None: 1 / sqrt(head_dim)): a real number, not a boolean, whose
    log2-domain factor the kernels receive is finite in float32 (docs/variants.md, Scale)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise InputTypeError(
            f"scale has type {type(scale).__name__}; use a real number (or None: 1/sqrt(head_dim))"
        )
    value = float(scale)
    if not (math.isfinite(value) and abs(value) <= MAX_SCALE):
        raise InputError(
            f"scale={scale!r} is not allowed; use a finite number with |scale| <= "
            f"{MAX_SCALE:.4g} (scale * log2(e) must be finite in float32) or None"
        )
    return value


def common_device(named: dict[str, Any]) -> int:
    """The device all arrays among ``named`` live on (-1: host arrays, the CPU backend; a host
    ``seqlens_k`` sequence is skipped)."""
    where = {
        name: device_of(x)
        for name, x in named.items()
        if x is not None and not (name == "seqlens_k" and is_host_sequence(x))
    }
    device = where["q"]
    for name, index in where.items():
        if index != device:
            error = InputError if min(index, device) >= 0 else InputTypeError
            raise error(
                f"{name} is on {_device_name(index)} but q is on {_device_name(device)}; pass "
                f"{', '.join(where)} on one device (the CPU: NumPy arrays or CPU torch tensors)"
            )
    return device


def check_expression_libraries(q: Any, expressions: CallExpressions) -> None:
    """Every mod input is of q's library: NumPy with NumPy q, torch (CPU or CUDA) with torch q,
    CuPy (or an array CuPy views: ``__cuda_array_interface__``, DLPack) with any other q."""
    library = arrays_of(q).name
    for name, array in expressions.arrays.items():
        check_library(
            f"mod_inputs[{name!r}]",
            array,
            "q",
            library,
            "pass mod inputs of q's library and device",
        )


def _device_name(index: int) -> str:
    return "the CPU" if index < 0 else f"CUDA device {index}"


@dataclass(frozen=True)
class Paging:
    """A paged KV cache's launch inputs (the call's k and v describe the cache as (B, Hkv,
    pages per sequence x page_size, D) with the page stride as batch stride): keys per page
    and the checked int32 block table (B, pages per sequence), NumPy or of q's library."""

    page_size: int
    block_table: Any
    table_stride: int  # elements between the block table's rows
    num_pages: int = 0  # pages in the pool (the wgmma kernels' tensor maps span it)


def checked_plan(
    call: CheckedCall,
    causal: bool,
    seqlens_k: Any,
    spec: KernelSpec | None,
    num_splits: int | None,
    layout: str,
    arrays: Arrays,
    device: int,
    paging: Paging | None = None,
) -> tuple[CallPlan, dict[str, Any], list[Any]]:
    """The plan of a checked call (spec, split count, prepared launch), its kernel arguments by
    parameter name, and the temporaries they point into (the caller keeps them alive until
    launched: torch arguments are raw pointers); runs with the call's device and stream
    current. ``paging``: k and v are a paged cache (a paged-KV spec; a host block table is
    uploaded here)."""
    batch = call.q.shape[0]
    max_keys = call.k.shape[2]
    seqlens = None if seqlens_k is None else seqlens_k_array(seqlens_k, batch, max_keys, arrays)
    page_size = paging.page_size if paging is not None else 0
    if spec is not None and spec.paged_kv != bool(paging):
        raise InputError(
            f"spec {spec.uri} has paged_kv={spec.paged_kv} but the call needs "
            f"paged_kv={bool(paging)} ({'a' if paging else 'no'} block_table)"
        )
    misaligned = [
        why
        for t in (call.q, call.k, call.v)
        if (why := _misaligned_strides(t) or _misaligned_pointer(pointer_of(t.source), t.name))
    ]
    if spec is None:
        spec, tuned_splits = _untuned_or_tuned_launch(
            call,
            causal,
            aligned=not misaligned,
            split=num_splits is not None,
            library=arrays.name,
            host=arrays.host,
            page_size=page_size,
        )
        spec = with_expressions(spec, call.expressions)
        num_splits = num_splits or tuned_splits
    elif spec.engine.chunk_bytes and misaligned:
        raise InputError(f"{misaligned[0]}; spec {spec.uri} copies 16-byte chunks")
    # only kernels compiled with additive_mask read a mask (docs/design.md)
    if call.mask is not None:
        spec = spec.with_additive_mask()
    check_spec_variants(spec, call.variants)
    check_spec_expressions(spec, call.expressions)
    if arrays.host:  # the CPU backend: the same launches, run by the emulator
        kernel = emulated_kernel(spec)
    else:
        check_fits_device(spec, device)
        kernel = runtime_kernel(spec)
    tensors = {t.name: launch_arg(arrays, t.source) for t in (call.q, call.k, call.v)}
    temporaries = []
    if seqlens is not None:
        tensors["seqlens_k"] = launch_arg(arrays, seqlens)
        temporaries.append(seqlens)
    if paging is not None:
        table = paging.block_table
        if is_host_sequence(table) and not arrays.host:
            refuse_during_capture("block_table", table, "an int32 device array of q's library")
            table = arrays.from_host(np.ascontiguousarray(table, np.int32))
            temporaries.append(table)
        tensors["block_table"] = launch_arg(arrays, table)
    if call.mask is not None:
        mask_array, strides = float32_broadcast(call.mask.source, mask_shape(call))
        tensors["mask"] = launch_arg(arrays, mask_array)
        temporaries.append(mask_array)
        mask_info = TensorInfo("mask", mask_shape(call), strides, "float32", mask_array)
        call = replace(call, mask=mask_info)
    tensors.update(call.variants.tensors(arrays))
    tensors.update(call.expressions.tensors(arrays))
    problem, out_shape = plan(call, layout)
    if paging is not None:
        problem = replace(
            problem,
            page_size=paging.page_size,
            block_table_stride=paging.table_stride,
            num_pages=paging.num_pages,
        )
    launch = kernel.prepare(problem, call.scale, num_splits if spec.split_kv else None)
    out_dtype = arrays.dtype_of(call.q.source)
    call_plan = CallPlan(
        launch, out_shape, out_dtype, call.q.shape[:3], call.k.shape[2], arrays, device
    )
    return call_plan, tensors, temporaries


@dataclass(frozen=True)
class CallPlan:
    """What a checked call decided (spec, prepared launches, output shapes, library, device),
    for the calls after it with the same :func:`_call_plan_key`: those skip the checks, the
    tuner lookup and the argument conversion, and only allocate the outputs and launch."""

    launch: PreparedLaunch
    out_shape: tuple[int, ...]
    out_dtype: Any  # q's dtype, in the plan's library
    lse_shape: tuple[int, ...]
    max_seqlen_k: int  # keys k and v hold: the bound of host seqlens_k
    arrays: Arrays
    device: int

    def run(self, inputs: dict[str, Any], want_lse: bool) -> tuple[Any, Any]:
        """A repeated call: ``inputs`` (q, k, v, seqlens_k; None: absent) are arrays of the
        plan's library, seqlens_k also a host sequence (range-checked and uploaded here, on the
        call's stream); returns (out, lse or None)."""
        arrays = self.arrays
        lengths = inputs.pop("seqlens_k")
        tensors = {name: arrays.launch_arg(x) for name, x in inputs.items() if x is not None}
        with arrays.scope(self.device):
            if is_host_sequence(lengths):
                lengths = seqlens_k_array(lengths, self.lse_shape[0], self.max_seqlen_k, arrays)
                tensors["seqlens_k"] = launch_arg(arrays, lengths)  # alive until launched
            elif lengths is not None:
                tensors["seqlens_k"] = arrays.launch_arg(lengths)
            return self.launch_outputs(tensors, want_lse)

    def launch_outputs(self, tensors: dict[str, Any], want_lse: bool) -> tuple[Any, Any]:
        """Allocate out, lse (only if wanted: the kernels skip a null lse) and the scratch
        buffers with the plan's library, add them to ``tensors`` (kernel arguments by parameter
        name), launch and return (out, lse or None). Runs in the plan's scope.

        The scratch buffers (split-KV partials, v1's row states) share one allocation: every
        allocation is a few microseconds of host time on the call's path."""
        arrays, device = self.arrays, self.device
        out = arrays.empty(self.out_shape, self.out_dtype, device)
        tensors["out"] = arrays.launch_arg(out)
        lse = None
        if want_lse:
            lse = arrays.empty(self.lse_shape, arrays.float32(), device)
            tensors["lse"] = arrays.launch_arg(lse)
        scratch = None
        if self.launch.scratch_floats:
            scratch = arrays.empty((self.launch.scratch_floats,), arrays.float32(), device)
            tensors.update(self.launch.scratch_pointers(arrays.pointer(scratch)))
        # scratch lives until the launches are queued: enough, as each library frees in stream
        # order
        self.launch(tensors)
        return out, lse


MAX_CALL_PLANS = 1024  # distinct call signatures remembered (then the table starts over)
_CALL_PLANS: dict[tuple[Any, ...], CallPlan] = {}


def _call_plan_key(
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    seqlens_k: Any,
    causal: Any,
    scale: Any,
    spec: Any,
    layout: Any,
    num_splits: Any,
    variants: VariantArgs = NO_VARIANTS,
) -> tuple[Any, ...] | None:
    """Everything a call's launches depend on but its data: shapes, strides, dtypes and 16-byte
    alignment of q, k, v, the options, the device, the autotune mode and the tuner memo's
    generation (a new winner or a cleared memo makes every plan stale). None where calls always
    take the checked path: q, k, v not all CuPy arrays or all torch tensors (of one type), a
    mask, seqlens_k neither of q's type nor a host sequence, variant arrays (ALiBi slopes,
    sinks) not of q's type, unhashable options. ``variants``: the call's (without expressions:
    those calls are always checked)."""
    if mask is not None or not type(q) is type(k) is type(v):
        return None
    module = module_of(q)
    if module == "torch":
        arrays: Arrays = TorchArrays
    elif module == "cupy" and type(q) is getattr(sys.modules.get("cupy"), "ndarray", None):
        arrays = CupyArrays
    else:
        return None
    if seqlens_k is None:
        lengths = None
    elif type(seqlens_k) is type(q):
        lengths = arrays.signature(seqlens_k)[:3]
    elif is_host_sequence(seqlens_k):
        lengths = ("host",)  # every call checks and uploads its own values (CallPlan.run)
    else:
        return None
    variant_signatures = []
    for x in variants.arrays().values():
        if x is not None and type(x) is not type(q):
            return None
        variant_signatures.append(None if x is None else arrays.signature(x))
    from kernelgen.tuning.autotune import memo_generation

    key = (
        *arrays.signature(q), *arrays.signature(k), *arrays.signature(v),
        lengths, bool(causal), type(scale), scale, spec, layout, num_splits,  # True == 1
        arrays.device_of(q), os.environ.get("KERNELGEN_AUTOTUNE"), memo_generation(),
        variants.key_scalars(), *variant_signatures,
    )  # fmt: skip
    try:
        hash(key)
    except TypeError:
        return None
    return key


def device_arch() -> tuple[int, str]:
    """Compute capability of the current device as (e.g.) ``(90, "sm_90")``.

    CuPy reports it as a string ("90", "100"), so it is parsed, never unpacked digit by digit."""
    capability = int(import_cupy().cuda.Device().compute_capability)
    return capability, f"sm_{capability}"


def _untuned_or_tuned_launch(
    call: CheckedCall,
    causal: bool,
    aligned: bool,
    split: bool,
    library: str = "cupy",
    host: bool = False,
    page_size: int = 0,
) -> tuple[KernelSpec, int | None]:
    """The spec (and split count, None: heuristic) for a call without a spec: the autotuner's
    choice (memo, disk, or a fresh tuning; see docs/autotuning.md), or a heuristic default where
    tuning does not apply (inputs the tensor-core kernels cannot read, GPUs before sm_80) or
    where the caller fixed ``num_splits`` (``split``: then the default split-KV spec), for calls
    with user expressions (their kernels are compiled per expression; the caller adds them to
    the default spec), and on the CPU backend (``host``: no GPU to time; the portable spec,
    every arch's). Tuning for a torch call (``library``) leaves no free blocks in CuPy's memory
    pool. ``page_size`` (keys per page of a paged KV cache; 0: contiguous K/V) picks paged-KV
    specs and is part of the tuning key. A block-sparse call (a block mask) on a 9.0 device
    runs the Hopper kernel in the mask's tiles where one takes them (and the call has no
    additive mask, as for the untuned Hopper default), else the mma.sync one."""
    capability, arch = (EMULATED_CAPABILITY, None) if host else device_arch()
    _, heads, seqlen_q, head_dim = call.q.shape
    tensor_cores = capability >= 80 and aligned
    block_mask = call.expressions.block_mask
    hopper_sparse = tensor_cores and arch == HOPPER_DEVICE_ARCH and call.mask is None
    if block_mask is not None and hopper_sparse:
        tiles = (block_mask.block_m, block_mask.block_n)
        hopper = hopper_default_spec(call.dtype, head_dim, causal, call.variants.flags, tiles)
        if hopper is not None:
            return hopper, None
    if split or not tensor_cores or host or call.expressions.present:
        spec = default_spec(
            call.dtype,
            head_dim,
            causal,
            arch,
            tensor_cores=tensor_cores,
            decode_rows=decode_rows(seqlen_q, heads // call.k.shape[1]),
            split_kv=True if split else None,
            paged_kv=page_size > 0,
            variants=call.variants.flags,
            additive_mask=call.mask is not None,
            expressions=call.expressions.present,
        )
        return spec, None
    launch = tuned_launch(call, causal, library, page_size=page_size)
    return launch.spec, launch.num_splits


def tuned_launch(call: CheckedCall, causal: bool, library: str, **fields: Any) -> Any:
    """The autotuner's launch (:func:`kernelgen.tuning.select_launch`: memo, disk or a fresh
    tuning) for a checked call's problem: its dtype, shape, mask and variants, and ``fields``
    (``page_size``; ``family`` and ``deterministic`` for the backward). Torch calls give CuPy's
    memory pool back after tuning (torch cannot use its blocks)."""
    from kernelgen.tuning import ProblemDesc, select_launch
    from kernelgen.tuning.autotune import gpu_tuner

    batch, heads, seqlen_q, head_dim = call.q.shape
    problem = ProblemDesc(
        call.dtype,
        batch,
        heads,
        call.k.shape[1],
        seqlen_q,
        call.k.shape[2],
        head_dim,
        causal=causal,
        mask=call.mask is not None,
        variants=call.variants.flags,
        **fields,
    )
    tuner = gpu_tuner(free_pool=True) if library == "torch" else None
    return select_launch(problem, tuner=tuner)


def check_flags(**flags: Any) -> None:
    """Each flag a bool (NumPy's included): a string such as ``causal="no"`` would read as true."""
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise InputTypeError(
                f"{name}={value!r} has type {type(value).__name__}; expected True or False"
            )


def check_num_splits(num_splits: Any, spec: KernelSpec | None) -> int | None:
    """``num_splits`` as an int in 1..MAX_SPLITS (None stays None); above 1 it needs split-KV."""
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise InputTypeError(f"num_splits has type {type(num_splits).__name__}; expected an int")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise InputError(f"num_splits={num_splits} is not allowed; use 1 to {MAX_SPLITS}")
    if spec is not None and not spec.split_kv and num_splits > 1:
        raise InputError(
            f"num_splits={num_splits} needs a split-KV spec; spec {spec.uri} has split_kv=false"
        )
    return num_splits


def is_host_sequence(x: Any) -> bool:
    """Whether ``x`` lives on the host (a list, tuple or NumPy value): host ``seqlens_k``."""
    return isinstance(x, (list, tuple)) or module_of(x) == "numpy"


def seqlens_k_array(seqlens_k: Any, batch: int, max_keys: int, arrays: Arrays = CupyArrays) -> Any:
    """seqlens_k as a contiguous int32 array of shape (batch,) for ``arrays``' kernels (host
    values are checked and uploaded to the current device, on the current stream; refused
    while that stream captures a CUDA graph, which would replay the values of the capture)."""
    host = host_lengths(seqlens_k, "seqlens_k", batch)
    if host is None:
        return seqlens_k
    bad = host[(host < 0) | (host > max_keys)]
    if bad.size:
        raise InputError(
            f"seqlens_k holds {int(bad[0])}; allowed 0 to {max_keys} (the keys k and v hold)"
        )
    if not arrays.host:
        refuse_during_capture("seqlens_k", seqlens_k, "an int32 device array of q's library")
    return arrays.from_host(host.astype(np.int32))


def host_lengths(values: Any, name: str, batch: int) -> np.ndarray | None:
    """One length per batch entry (``seqlens_k``, ``cache_seqlens``; ``name`` in errors), shape
    (batch,): host values (an int for every entry, a list or tuple, a NumPy array of integers, a
    CPU torch tensor) as int64, or None for a device array, checked (int32, contiguous) but not
    read."""
    if isinstance(values, (int, np.integer)) and not isinstance(values, bool):
        return np.full((batch,), int(values), np.int64)
    if is_host_sequence(values) or is_host_array(values):
        host = host_values(values)
        if host.size and host.dtype.kind not in "iu":
            raise InputTypeError(f"{name} has dtype {host.dtype}; expected integers")
        if host.shape != (batch,):
            raise InputError(
                f"{name} has shape {host.shape}; expected ({batch},), one length per batch entry"
            )
        return host.astype(np.int64)
    info = describe(values, name)
    if info.shape != (batch,):
        raise InputError(
            f"{name} has shape {info.shape}; expected ({batch},), one length per batch entry"
        )
    if info.dtype != "int32":
        raise InputTypeError(f"{name} has dtype {info.dtype}; expected int32")
    if info.strides != (1,):
        raise InputError(f"{name} has stride {info.strides[0]}; expected a contiguous array")
    return None


def host_values(values: Any) -> np.ndarray:
    """A host sequence, NumPy array or torch tensor (any device: read back) as a NumPy array."""
    library = module_of(values)
    if library == "torch":
        return values.detach().cpu().numpy()
    if library == "cupy":
        return values.get()
    return np.asarray(values)


def mask_shape(call: CheckedCall) -> tuple[int, int, int, int]:
    batch, heads, seqlen_q, _ = call.q.shape
    return (batch, heads, seqlen_q, call.k.shape[2])


def plan(call: CheckedCall, layout: str) -> tuple[Problem, tuple[int, ...]]:
    """Kernel sizes and strides for a checked call, and the shape of ``out`` (q's layout).

    ``call.mask``, when present, must already be broadcast to (B, H, Sq, Sk) (strides 0 where
    broadcast)."""
    batch, heads, seqlen_q, head_dim = call.q.shape
    if layout == "bhsd":
        out_shape = (batch, heads, seqlen_q, head_dim)
        out_strides = (heads * seqlen_q * head_dim, seqlen_q * head_dim, head_dim)
    else:
        out_shape = (batch, seqlen_q, heads, head_dim)
        out_strides = (seqlen_q * heads * head_dim, head_dim, heads * head_dim)
    problem = Problem(
        batch=batch,
        num_heads=heads,
        num_kv_heads=call.k.shape[1],
        seqlen_q=seqlen_q,
        seqlen_k=call.k.shape[2],
        head_dim=head_dim,
        q_strides=call.q.strides[:3],
        k_strides=call.k.strides[:3],
        v_strides=call.v.strides[:3],
        out_strides=out_strides,
        mask_strides=call.mask.strides if call.mask is not None else (0, 0, 0, 0),
        variant_scalars=call.variants.scalars(),
        extra_scalars=call.expressions.scalars(),
    )
    return problem, out_shape


__all__ = ["KernelgenError", "attention", "check_inputs", "default_spec", "describe"]
