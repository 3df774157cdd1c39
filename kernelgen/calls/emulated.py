"""Attention on the emulator from float arrays, for ``kernelgen emulate`` and the emulation tests:
the call is kernelgen's own on NumPy arrays (the CPU backend, :mod:`kernelgen.runtime.host`: the
same checks, spec handling, plan and launches as on a GPU), recorded
(:func:`kernelgen.runtime.emulated_launch.recording`) for its launch statistics, the arrays its
kernels saw and its Problem.

A contiguous call is :func:`kernelgen.calls.attention.attention` itself; a paged-KV spec's call (a
pool of pages built here, q in either layout) is that of
:func:`kernelgen.calls.kvcache.attention_with_kvcache` without the cache append:
:func:`~kernelgen.calls.attention.check_inputs`, then
:func:`~kernelgen.calls.attention.checked_plan` with the paging.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import ml_dtypes
import numpy as np

from kernelgen.calls.attention import (
    Paging,
    TensorInfo,
    attention,
    check_inputs,
    check_num_splits,
    checked_plan,
)
from kernelgen.calls.fp8 import fp8_attention
from kernelgen.calls.variant_inputs import VariantArgs
from kernelgen.emulator import LaunchStats
from kernelgen.errors import InputTypeError
from kernelgen.runtime.emulated_launch import Recording, recording, to_device_dtype
from kernelgen.runtime.host import HOST_DEVICE, NumpyArrays
from kernelgen.runtime.launch import Problem
from kernelgen.specs.forward import KernelSpec

__all__ = ["DEFAULT_PAGE_SIZE", "EmulatedAttention", "emulate_attention", "emulate_fp8_attention"]

# Keys per page when a paged-KV spec is emulated without a page size: smaller than every key
# tile but 16, so the kernels look each row's page up (pass block_n or a multiple of it for
# the one-lookup-per-tile path).
DEFAULT_PAGE_SIZE = 16
# What the spare page (page 0, which no block-table entry names) holds: NaN in the element
# type (bfloat16 as its bits), so a read of a wrong page poisons the output.
_NAN_BITS = {
    "float16": np.float16(np.nan),
    "bfloat16": np.uint16(0x7FC0),
    "float32": np.nan,
    "float8_e4m3": np.uint8(0x7F),  # e4m3 bit patterns as uint8
}


@dataclass
class EmulatedAttention:
    """out (B, H, Sq, D) as float32, lse (B, H, Sq) or None, launch statistics by kernel symbol,
    every array the kernels saw by parameter name (scratch buffers included) and the Problem
    they were launched for."""

    out: np.ndarray
    lse: np.ndarray | None
    stats: dict[str, LaunchStats]
    arrays: dict[str, np.ndarray]
    problem: Problem


def _host(x: np.ndarray) -> np.ndarray:
    """Device-dtype values as the CPU backend takes them (bfloat16 bits as ml_dtypes')."""
    return x.view(ml_dtypes.bfloat16) if x.dtype == np.uint16 else x


def _result(out: Any, lse: Any, recorded: Recording, layout: str = "bhsd") -> EmulatedAttention:
    out = np.asarray(out).astype(np.float32)
    if layout == "bshd":
        out = out.transpose(0, 2, 1, 3)
    assert recorded.problem is not None  # a launch was prepared: it ran
    return EmulatedAttention(out, lse, recorded.stats, recorded.arrays, recorded.problem)


def emulate_attention(
    spec: KernelSpec,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None = None,
    *,
    layout: str = "bhsd",
    scale: float | None = None,
    num_splits: int | None = None,
    seqlens_k: np.ndarray | None = None,
    want_lse: bool = True,
    source: str | None = None,
    on_step: Callable[[int, int], None] | None = None,
    page_size: int | None = None,
    window_size: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: np.ndarray | None = None,
    sinks: np.ndarray | None = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    mod_inputs: dict[str, np.ndarray] | None = None,
    block_mask: Any = None,
) -> EmulatedAttention:
    """Run ``spec``'s kernels on q (B, H, Sq, D), k and v (B, Hkv, Sk, D) given as floats in
    (B, H, S, D) order (rounded to the spec's dtype), stored in memory in ``layout``. ``out``,
    ``lse`` and the scratch buffers start as NaN (the CPU backend's allocations). Without
    ``want_lse`` the kernels get a null lse (as attention() passes when the lse is not asked
    for). Split-KV specs default to 3 key chunks. The variants (docs/variants.md) and user
    expressions (docs/expressions.md: score_mod, mask_mod, host mod_inputs, a host block_mask)
    are attention()'s; the spec must have them. ``source`` replaces the rendered CUDA;
    ``on_step(done, total)`` runs after each launch.

    A ``paged_kv`` spec gets k and v as a pool of pages of ``page_size`` keys (default
    :data:`DEFAULT_PAGE_SIZE`; a wgmma spec's block_n) in reverse order after a NaN spare page,
    with its block table, and ``seqlens_k`` (default Sk for every entry) hides the last page's
    padding; a mask is padded with zeros to the pages' keys."""
    if spec.fp8:
        raise InputTypeError(
            f"spec dtype={spec.dtype!r} is not allowed here (float inputs); fp8 specs take e4m3 "
            "bit patterns and descales: use kernelgen.calls.emulated.emulate_fp8_attention"
        )
    if num_splits is None and spec.split_kv:
        num_splits = 3
    inputs = {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        if layout == "bshd":  # store (B, S, H, D) in memory, pass that array
            x = np.ascontiguousarray(np.asarray(x).transpose(0, 2, 1, 3))
        inputs[name] = to_device_dtype(x, spec.dtype)
    if mask is not None:
        mask = np.asarray(mask, dtype=np.float32)
    if seqlens_k is not None:
        seqlens_k = np.asarray(seqlens_k, dtype=np.int32)

    def floats(x: np.ndarray | None) -> np.ndarray | None:
        return None if x is None else np.ascontiguousarray(x, dtype=np.float32)

    variants = VariantArgs(
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=floats(alibi_slopes),
        sinks=floats(sinks),
        score_mod=score_mod,
        mask_mod=mask_mod,
        mod_inputs=mod_inputs,
        block_mask=block_mask,
    )
    with recording(source, on_step) as recorded:
        if spec.paged_kv:
            out, lse = _paged_attention(
                spec, inputs, mask, layout, scale, num_splits, seqlens_k, want_lse,
                page_size, variants,
            )  # fmt: skip
        else:
            result = attention(
                *(_host(inputs[n]) for n in ("q", "k", "v")),
                causal=spec.causal,
                scale=scale,
                mask=mask,
                spec=spec,
                return_lse=want_lse,
                layout=layout,
                seqlens_k=seqlens_k,
                num_splits=num_splits,
                **variants.keywords(),
            )
            out, lse = result if want_lse else (result, None)
    return _result(out, lse, recorded, layout)


def _paged_attention(
    spec: KernelSpec,
    inputs: dict[str, np.ndarray],
    mask: np.ndarray | None,
    layout: str,
    scale: float | None,
    num_splits: int | None,
    seqlens_k: np.ndarray | None,
    want_lse: bool,
    page_size: int | None,
    variants: VariantArgs,
) -> tuple[np.ndarray, np.ndarray | None]:
    """The paged call of :func:`emulate_attention` (q, k, v in the device dtype, stored in
    ``layout``): k and v paged here, then kernelgen's checks and plan with that paging."""
    q = _host(inputs["q"])
    # wgmma copies a key tile from one page: its smallest page is one tile
    page_size = page_size or (spec.block_n if spec.engine.warp_specialized else DEFAULT_PAGE_SIZE)
    infos = [_info("q", q)]
    for name in ("k", "v"):  # one block table and page count for both
        pool, table, info = paged_pool(inputs[name], name, spec.dtype, layout, page_size)
        infos.append(info)
    keys = inputs["k"].shape[2 if layout == "bhsd" else 1]
    if seqlens_k is None:
        seqlens_k = np.full(q.shape[0], keys, np.int32)
    mask_info = None
    if mask is not None:
        batch, first, second = q.shape[:3]
        rows = (batch, second, first) if layout == "bshd" else (batch, first, second)
        full = np.broadcast_to(mask, (*rows, keys))  # (B, H, Sq, Sk)
        # the kernels see the pages' keys: zeros past Sk (never read)
        width = infos[1].shape[2 if layout == "bhsd" else 1] - keys
        mask_info = _info("mask", np.pad(full, ((0, 0), (0, 0), (0, 0), (0, width))))
    arrays = {name: _info(name, x) for name, x in variants.arrays().items() if x is not None}
    call = check_inputs(
        *infos,
        mask_info,
        layout=layout,
        scale=scale,
        spec=spec,
        causal=spec.causal,
        variants=replace(variants, **arrays),
    )
    num_splits = check_num_splits(num_splits, spec)
    paging = Paging(page_size, table, table.shape[1], pool.shape[0])
    with NumpyArrays.scope(HOST_DEVICE):
        call_plan, tensors, _ = checked_plan(
            call, spec.causal, seqlens_k, spec, num_splits, layout, NumpyArrays, HOST_DEVICE,
            paging,
        )  # fmt: skip
        return call_plan.launch_outputs(tensors, want_lse)


def _info(name: str, array: np.ndarray) -> TensorInfo:
    """What check_inputs needs of a NumPy array (its dtype's name: bfloat16 through ml_dtypes)."""
    strides = tuple(s // array.itemsize for s in array.strides)
    return TensorInfo(name, array.shape, strides, array.dtype.name, array)


def paged_pool(
    x: np.ndarray, name: str, dtype: str, layout: str, page_size: int
) -> tuple[np.ndarray, np.ndarray, TensorInfo]:
    """K or V (device dtype, stored in ``layout``) as a pool of pages (1 + B * P, page_size, Hkv,
    D): page 0 a NaN spare, entry b's logical page j at 1 + B * P - 1 - (b * P + j) (reverse
    order), the last page's rows past Sk NaN. Returns the pool, the int32 block table (B, P)
    and the pool's info as the kernels address it, (B, P * page_size keys) in ``layout`` with
    the page stride as batch stride."""
    rows = x if layout == "bshd" else x.transpose(0, 2, 1, 3)  # (B, Sk, Hkv, D)
    batch, keys, kv_heads, head_dim = rows.shape
    per_seq = -(-keys // page_size)
    # the last page's rows past Sk hold NaN, like the spare page: reading one poisons the output
    padded = np.full((batch, per_seq * page_size, kv_heads, head_dim), _NAN_BITS[dtype], x.dtype)
    padded[:, :keys] = rows
    order = np.arange(batch * per_seq)[::-1] + 1
    pool = np.full((1 + batch * per_seq, page_size, kv_heads, head_dim), _NAN_BITS[dtype], x.dtype)
    pool[order] = padded.reshape(batch * per_seq, page_size, kv_heads, head_dim)
    pool = _host(pool)
    table = order.reshape(batch, per_seq).astype(np.int32)
    page, row = page_size * kv_heads * head_dim, kv_heads * head_dim
    if layout == "bshd":
        shape, strides = (batch, per_seq * page_size, kv_heads, head_dim), (page, row, head_dim, 1)
    else:
        shape, strides = (batch, kv_heads, per_seq * page_size, head_dim), (page, head_dim, row, 1)
    return pool, table, TensorInfo(name, shape, strides, dtype, pool)


def emulate_fp8_attention(
    spec: KernelSpec,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    q_descale: np.ndarray | None = None,
    k_descale: np.ndarray | None = None,
    v_descale: np.ndarray | None = None,
    scale: float | None = None,
    source: str | None = None,
    seqlens_k: Any = None,
    **variants: Any,
) -> EmulatedAttention:
    """Run an fp8 spec's kernel on q (B, H, Sq, D), k and v (B, Hkv, Sk, D) given as e4m3 bit
    patterns (uint8), with optional fp32 descales of shape (B, Hkv): kernelgen's fp8 call on
    NumPy arrays (:func:`kernelgen.calls.fp8.fp8_attention`; v reaches the kernel as
    :func:`kernelgen.runtime.fp8.v_operand` makes it, V^T with keys permuted). ``seqlens_k``
    and ``variants`` (window_size, softcap, alibi_slopes, sinks) as for
    :func:`kernelgen.attention`. ``out`` (bf16, widened to float32) and ``lse`` start as NaN."""
    if not spec.fp8:
        raise InputTypeError(
            f"spec dtype={spec.dtype!r} is not allowed here; use a float8_e4m3 spec"
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != np.uint8 or x.ndim != 4:
            raise InputTypeError(
                f"{name} has dtype {x.dtype} and {x.ndim} dims; expected 4-d uint8 (e4m3 bits)"
            )
    e4m3 = [np.ascontiguousarray(x).view(ml_dtypes.float8_e4m3fn) for x in (q, k, v)]
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    with recording(source) as recorded:
        out, lse = fp8_attention(
            *e4m3, causal=spec.causal, scale=scale, spec=spec, return_lse=True, layout="bhsd",
            descales=descales, unsupported={}, variants=VariantArgs(**variants),
            seqlens_k=seqlens_k,
        )  # fmt: skip
    return _result(out, lse, recorded)
