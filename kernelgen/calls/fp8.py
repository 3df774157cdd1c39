"""fp8 (e4m3) attention through :func:`kernelgen.attention`: its checks, the V^T operand built
where the data lives, and the launch of the fp8 wgmma forward (docs/hopper.md, fp8).

What a call may pass: q, k and v all ``float8_e4m3fn`` (torch.float8_e4m3fn tensors: CUDA ones
on a compute capability 9.0 device, CPU ones through the emulator; NumPy arrays of
``ml_dtypes.float8_e4m3fn``: the emulator), head dim 64, 96, 128, 192 or 256, causal or not,
GQA/MQA, either layout, float32 descales (B, Hkv), ``scale``, ``return_lse``, a float8_e4m3
``spec``, the built-in variants (window_size, softcap, alibi_slopes, sinks) and user expressions
(score_mod, mask_mod, mod_inputs), which act on the descaled scores, a ``block_mask`` in tiles
the fp8 kernel takes (block-sparse: :func:`check_block_mask_tiles`), and ``seqlens_k`` (V^T's
keys past each entry's length are zeroed).
CuPy has no fp8 dtype: CuPy arrays of bytes are refused with the way to view them as torch fp8
tensors. The kernels read q and k in place, and a V^T copy of v
(:func:`kernelgen.runtime.fp8.v_operand`) made by v's own library on v's device (one extra read
and write of v), or, with a spec of ``fp8_v_layout: kernel``, v in place too (the kernel
transposes it in shared memory). out is bfloat16, lse float32.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kernelgen.calls import attention as api
from kernelgen.calls.attention import (
    CallPlan,
    CheckedCall,
    Paging,
    TensorInfo,
    check_expression_libraries,
    check_flags,
    check_inputs,
    common_device,
    describe,
    plan,
    seqlens_k_array,
)
from kernelgen.calls.block_mask import BlockMask
from kernelgen.calls.expression_inputs import with_expressions
from kernelgen.calls.variant_inputs import NO_VARIANTS, VariantArgs
from kernelgen.errors import InputError, InputTypeError
from kernelgen.model.policy import fp8_default_spec
from kernelgen.runtime.fp8 import check_descales, v_operand, v_operand_layout
from kernelgen.runtime.frameworks import Arrays, arrays_of, dtype_name, launch_arg
from kernelgen.runtime.host import emulated_kernel
from kernelgen.runtime.launch import check_fits_device
from kernelgen.specs.forward import FP8_BLOCK_N_BY_HEAD_DIM, FP8_DTYPE, KernelSpec

__all__ = [
    "FP8_BLOCK_M",
    "FP8_LIBRARY_DTYPE",
    "Fp8Call",
    "check_block_mask_tiles",
    "check_fp8_call",
    "fp8_attention",
]

FP8_LIBRARY_DTYPE = "float8_e4m3fn"  # torch's and ml_dtypes' name of OCP e4m3 (no infinities)
FP8_CAPABILITY = 90  # the wgmma kernel's devices (sm_90a: H100, H200)
FP8_BLOCK_M = 128  # the fp8 kernels' query tile (two consumer warpgroups; block masks' block_m)
# How to pass fp8 data (in the errors about a dtype).
HOW_TO_PASS = (
    "pass torch.float8_e4m3fn tensors or NumPy ml_dtypes.float8_e4m3fn arrays (CuPy has no fp8 "
    "dtype: view its e4m3 bytes as torch.from_dlpack(x).view(torch.float8_e4m3fn))"
)
# The arguments of attention() the fp8 kernel has no use for yet -> what it lacks.
NOT_BUILT = {
    "mask": "additive mask",
    "num_splits": "split-KV form (num_splits 1 or None)",
    "deterministic": "backward pass",
}


def wants_fp8(q: Any, k: Any, v: Any, q_descale: Any, k_descale: Any, v_descale: Any) -> bool:
    """Whether a call is an fp8 one: a descale given, or 1-byte elements in q, k or v (fp8, or
    bytes meant as fp8, which :func:`fp8_attention` refuses by name). On every call's path."""
    return (
        q_descale is not None
        or k_descale is not None
        or v_descale is not None
        or _one_byte(q)
        or _one_byte(k)
        or _one_byte(v)
    )


def _one_byte(array: Any) -> bool:
    """Whether ``array``'s elements are one byte (its dtype's itemsize; none: False)."""
    return getattr(getattr(array, "dtype", None), "itemsize", 0) == 1


@dataclass(frozen=True)
class Fp8Call:
    """An fp8 call's checked metadata: the arguments as TensorInfo, its spec (the call's, or
    :func:`~kernelgen.model.policy.fp8_default_spec` where it named none: ``named`` False, and
    a GPU call asks the tuner instead), its descales as float32 (B, Hkv) arrays of q's
    library."""

    call: CheckedCall
    spec: KernelSpec
    descales: dict[str, Any]
    named: bool = True


def check_fp8_call(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool,
    scale: float | None,
    spec: KernelSpec | None,
    return_lse: bool,
    layout: str,
    descales: dict[str, Any],
    unsupported: dict[str, Any],
    variants: VariantArgs = NO_VARIANTS,
    seqlens_k: Any = None,
    kv_infos: tuple[TensorInfo, TensorInfo] | None = None,
) -> Fp8Call:
    """Every check of an fp8 call, on metadata only (nothing is copied or launched; the torch
    operator's fake implementation runs them at trace time). ``unsupported``: the call's other
    arguments by name, each of which must be absent; ``variants``: the built-in variants' and
    user expressions' arguments (a block mask in the fp8 kernel's tiles: the spec, named or
    default, is block-sparse in them); ``seqlens_k`` is taken so that the
    torch operator passes one argument set to this and :func:`fp8_attention`, and is checked
    where that converts it, as for 16-bit calls (its values may live on the device).
    ``kv_infos``: k and v as the kernels see them where the arrays are not (a paged cache:
    (B, S_max, Hkv, D) views of the pool, kernelgen.calls.kvcache_fp8)."""
    check_flags(causal=causal, return_lse=return_lse)
    for name, value in unsupported.items():
        if value is not None and not (name == "num_splits" and value == 1):
            shown = repr(value) if len(repr(value)) <= 80 else type(value).__name__
            raise InputError(
                f"{name}={shown} is not allowed with fp8 inputs: the fp8 kernel has no "
                f"{NOT_BUILT.get(name, name)} (not built yet; docs/hopper.md, fp8); leave it out"
            )
    named = {"q": q, "k": k, "v": v}
    _check_dtypes(named, descales)
    _refuse_grad({**named, **descales, **variants.arrays()})
    infos = [replace(describe(x, name), dtype=FP8_DTYPE) for name, x in named.items()]
    if kv_infos is not None:
        infos[1:] = [replace(t, dtype=FP8_DTYPE) for t in kv_infos]
    call = check_inputs(
        *infos, None, layout=layout, scale=scale, spec=spec, causal=bool(causal),
        variants=variants, dtypes=(FP8_DTYPE,),
    )  # fmt: skip
    batch, _, _, head_dim = call.q.shape
    named = spec is not None
    if spec is None:  # (a GPU call without expressions asks the tuner instead)
        # a named spec's tiles are checked against the mask's by check_inputs
        check_block_mask_tiles(call.expressions.block_mask, head_dim)
        spec = with_expressions(
            fp8_default_spec(head_dim, causal, call.variants.flags), call.expressions
        )
    checked = check_descales(descales, batch, call.k.shape[1], fp8=True)
    return Fp8Call(call, spec, checked, named)


def fp8_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool,
    scale: float | None,
    spec: KernelSpec | None,
    return_lse: bool,
    layout: str,
    descales: dict[str, Any],
    unsupported: dict[str, Any],
    variants: VariantArgs = NO_VARIANTS,
    seqlens_k: Any = None,
    num_splits: int | None = None,
    paging: Paging | None = None,
    kv_infos: tuple[TensorInfo, TensorInfo] | None = None,
) -> Any:
    """:func:`kernelgen.attention` for a call that :func:`wants_fp8` (``unsupported``: its other
    arguments by name, each of which must be absent; ``variants``: its built-in variants' and
    user expressions' arguments; ``seqlens_k``: one key length per batch entry, as for 16-bit
    calls; ``num_splits``: a split-KV spec's key chunks, None: the launch's default;
    ``paging`` and ``kv_infos``: a paged cache, k and v its pools; the fp8 decode path,
    :mod:`kernelgen.calls.kvcache_fp8`). The checks (:func:`check_fp8_call`) run
    before v is copied or anything is launched (descales of another dtype or layout are
    converted first). Without a spec, a GPU call
    without expressions runs the autotuner's choice among the fp8 loops
    (:func:`kernelgen.tuning.select_launch`, under ``KERNELGEN_AUTOTUNE`` as every call; off:
    :func:`~kernelgen.model.policy.fp8_default_spec`), others the default."""
    checked_call = check_fp8_call(
        q, k, v, causal=causal, scale=scale, spec=spec, return_lse=return_lse, layout=layout,
        descales=descales, unsupported=unsupported, variants=variants, seqlens_k=seqlens_k,
        kv_infos=kv_infos,
    )  # fmt: skip
    call, spec, checked = checked_call.call, checked_call.spec, checked_call.descales
    if spec.paged_kv != (paging is not None):
        raise InputError(
            f"spec {spec.uri} has paged_kv={spec.paged_kv} but the call needs "
            f"paged_kv={paging is not None} ({'a' if paging else 'no'} block_table)"
        )
    batch, heads, seqlen_q, _ = call.q.shape
    named = {"q": q, "k": k, "v": v}
    check_expression_libraries(q, call.expressions)
    arrays = arrays_of(q)
    device = common_device(
        {**named, **checked, "seqlens_k": seqlens_k, **variants.arrays(),
         **call.expressions.named_arrays()}
    )  # fmt: skip
    with arrays.scope(device):
        lengths = None  # int32 (B,) on the device (host lengths range-checked, then uploaded)
        if seqlens_k is not None:
            lengths = seqlens_k_array(seqlens_k, batch, call.k.shape[2], arrays)
        if arrays.host:  # the CPU backend: the same launch, run by the emulator
            kernel: Any = emulated_kernel(spec)
        else:
            capability, _ = api.device_arch()
            if capability != FP8_CAPABILITY:
                raise InputError(
                    f"q is float8_e4m3fn on CUDA device {device} (sm_{capability}); fp8 "
                    "attention runs on compute capability 9.0 only (H100, H200: the wgmma "
                    "kernel), or on the CPU (CPU tensors: the emulator)"
                )
            # the tuner's loop (KERNELGEN_AUTOTUNE=0: the default); expressions are compiled
            # per call, so their calls run the default, as 16-bit ones do
            if not checked_call.named and not call.expressions.present:
                spec = api.tuned_launch(call, bool(causal), arrays.name).spec
            check_fits_device(spec, device)
            kernel = api.runtime_kernel(spec)
        q_bytes, k_bytes, v_bytes = (_bytes(x) for x in (q, k, v))
        if spec.v_transposed_in_kernel:  # v as it is, like k (fp8_v_layout: kernel)
            problem, out_shape = plan(call, layout)
            if paging is not None:
                problem = replace(
                    problem, page_size=paging.page_size, block_table_stride=paging.table_stride,
                    num_pages=paging.num_pages,
                )  # fmt: skip
            launch = kernel.prepare(problem, call.scale, num_splits if spec.split_kv else None)
            v_t = v_bytes
        else:
            v_shape, v_strides = v_operand_layout(*call.k.shape)  # the copy v_operand makes
            problem, out_shape = plan(
                replace(call, v=TensorInfo("v", v_shape, v_strides, FP8_DTYPE, None)), layout
            )
            launch = kernel.prepare(problem, call.scale)  # the maps' checks: nothing made yet
            if layout == "bshd":  # v_operand takes (B, Hkv, Sk, D): a view, no copy
                v_bytes = v_bytes.swapaxes(1, 2)
            v_t = v_operand(v_bytes, lengths)  # on v's device, in v's library
        tensors = {
            "q": launch_arg(arrays, q_bytes),
            "k": launch_arg(arrays, k_bytes),
            "v": launch_arg(arrays, v_t),
            **{name: launch_arg(arrays, x) for name, x in checked.items()},
            **call.variants.tensors(arrays),
            **call.expressions.tensors(arrays),
        }
        if lengths is not None:
            tensors["seqlens_k"] = launch_arg(arrays, lengths)
        table = None
        if paging is not None:  # a host block table is uploaded for a device launch
            table = paging.block_table
            if isinstance(table, np.ndarray) and not arrays.host:
                table = arrays.from_host(np.ascontiguousarray(table, np.int32))
            tensors["block_table"] = launch_arg(arrays, table)
        call_plan = CallPlan(
            launch, out_shape, _bfloat16(arrays), (batch, heads, seqlen_q), call.k.shape[2],
            arrays, device,
        )  # fmt: skip
        out, lse = call_plan.launch_outputs(tensors, bool(return_lse))
        del v_t, checked, lengths, table  # freed in stream order once the launch is queued
    return (out, lse) if return_lse else out


def check_block_mask_tiles(block_mask: BlockMask | None, head_dim: int) -> None:
    """A block mask of an fp8 call without a spec must be built in tiles the default fp8
    kernel takes: ``block_m`` :data:`FP8_BLOCK_M` and a ``block_n`` of the head dim's
    :data:`~kernelgen.specs.forward.FP8_BLOCK_N_BY_HEAD_DIM` (nothing rebuilds the mask);
    otherwise :class:`InputError` names the mask's tiles and the allowed ones. (A named spec
    takes a mask of its own tiles, block_m 64 included.)"""
    if block_mask is None or head_dim not in FP8_BLOCK_N_BY_HEAD_DIM:
        return  # (a head dim fp8 does not take: the spec's check names it)
    block_ns = FP8_BLOCK_N_BY_HEAD_DIM[head_dim]
    if block_mask.block_m != FP8_BLOCK_M or block_mask.block_n not in block_ns:
        allowed = " or ".join(f"{FP8_BLOCK_M} x {n}" for n in block_ns)
        raise InputError(
            f"block_mask has {block_mask.block_m} x {block_mask.block_n} tiles (block_m x "
            f"block_n); fp8 kernels at head_dim={head_dim} take {allowed}: build it with "
            f"kernelgen.block_mask(..., block_m={FP8_BLOCK_M}, block_n={block_ns[0]})"
        )


def _check_dtypes(named: dict[str, Any], descales: dict[str, Any]) -> None:
    """q, k and v all float8_e4m3fn: descales with no fp8 input, another 1-byte dtype (uint8
    bytes, e5m2) or a mix of fp8 and other inputs raise :class:`InputTypeError`."""
    dtypes = {name: dtype_name(getattr(x, "dtype", type(x).__name__)) for name, x in named.items()}
    fp8 = [name for name, dtype in dtypes.items() if dtype == FP8_LIBRARY_DTYPE]
    for name, x in named.items():
        if dtypes[name] == FP8_LIBRARY_DTYPE:
            continue
        if _one_byte(x):
            raise InputTypeError(
                f"{name} has dtype {dtypes[name]}; fp8 attention takes float8_e4m3fn only: "
                f"{HOW_TO_PASS}"
            )
        if fp8:
            raise InputTypeError(
                f"{name} has dtype {dtypes[name]} but {fp8[0]} has {FP8_LIBRARY_DTYPE}; fp8 "
                f"attention takes q, k and v all in {FP8_LIBRARY_DTYPE}"
            )
    if not fp8:  # descales with non-fp8 inputs: check_descales names the first one
        check_descales(descales, 0, 0, fp8=False)


def _refuse_grad(named: dict[str, Any]) -> None:
    """An InputError for a torch input that requires grad while autograd records: the fp8
    forward has no backward pass."""
    for name, x in named.items():
        if getattr(x, "requires_grad", False) and sys.modules["torch"].is_grad_enabled():
            raise InputError(
                f"{name} requires grad, but fp8 attention has no backward pass (not built yet); "
                f"pass {name}.detach() or call it under torch.no_grad()"
            )


def _bytes(x: Any) -> Any:
    """An fp8 array or tensor as a view of its e4m3 bytes (uint8), in its own library."""
    if isinstance(x, np.ndarray):
        return x.view(np.uint8)
    return x.view(sys.modules["torch"].uint8)


def _bfloat16(arrays: Arrays) -> Any:
    """The bfloat16 dtype of a call's library (out's): torch's, or ml_dtypes' for NumPy."""
    if arrays.name == "torch":
        return sys.modules["torch"].bfloat16
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)
