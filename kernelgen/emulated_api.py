"""Attention on the emulator from float arrays: kernelgen's input checks and plan, then the
spec's launches (:mod:`kernelgen.emulator.launches`). Used by ``kernelgen emulate`` and the
emulation tests.

It sits above :mod:`kernelgen.api` (it uses its checks and plan); the API itself must import
:mod:`kernelgen.emulator.launches`, never this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernelgen.api import TensorInfo, check_inputs, plan
from kernelgen.emulator.kernel import LaunchStats
from kernelgen.emulator.launches import from_device_dtype, run_launches, to_device_dtype
from kernelgen.errors import InputError, InputTypeError
from kernelgen.host import NumpyArrays
from kernelgen.launch import Problem
from kernelgen.spec import KernelSpec

__all__ = ["DEFAULT_PAGE_SIZE", "EmulatedAttention", "emulate_attention", "emulate_fp8_attention"]

# Keys per page when a paged-KV spec is emulated without a page size: smaller than every key
# tile but 16, so the kernels look each row's page up (pass block_n or a multiple of it for
# the one-lookup-per-tile path).
DEFAULT_PAGE_SIZE = 16
# What the spare page (page 0, which no block-table entry names) holds: NaN in the element
# type, so a read of a wrong page poisons the output.
_NAN_BITS = {"float16": np.float16(np.nan), "bfloat16": np.uint16(0x7FC0), "float32": np.nan}


@dataclass
class EmulatedAttention:
    """out (B, H, Sq, D) as float32, lse (B, H, Sq) or None, launch statistics by kernel symbol,
    and every array the kernels saw (scratch buffers included)."""

    out: np.ndarray
    lse: np.ndarray | None
    stats: dict[str, LaunchStats]
    arrays: dict[str, np.ndarray]
    problem: Problem


def _info(name: str, array: np.ndarray, dtype: str) -> TensorInfo:
    strides = tuple(s // array.itemsize for s in array.strides)
    return TensorInfo(name, array.shape, strides, dtype, array)


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
    (B, H, S, D) order (rounded to the spec's dtype), stored in memory in ``layout``. ``out`` and
    ``lse`` start as NaN. Without ``want_lse`` the kernels get a null lse (as attention() passes
    when the lse is not asked for). Split-KV specs default to 3 key chunks. The variants
    (docs/variants.md) and user expressions (docs/expressions.md: score_mod, mask_mod, host
    mod_inputs, a host block_mask) are attention()'s; the spec must have them.

    A ``paged_kv`` spec gets k and v as a pool of pages of ``page_size`` keys (default
    :data:`DEFAULT_PAGE_SIZE`; a wgmma spec's block_n) in reverse order after a NaN spare page,
    with its block table, and ``seqlens_k`` (default Sk for every entry) hides the last page's
    padding; a mask is padded with zeros to the pages' keys."""
    if spec.fp8:
        raise InputTypeError(
            f"spec dtype={spec.dtype!r} is not allowed here (float inputs); fp8 specs take e4m3 "
            "bit patterns and descales: use kernelgen.emulator.attention.emulate_fp8_attention"
        )
    if mask is not None:  # as attention() does
        spec = spec.with_additive_mask()
    if num_splits is None:
        num_splits = 3 if spec.split_kv else 1
    dtype = spec.dtype
    arrays: dict[str, np.ndarray] = {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        if layout == "bshd":  # store (B, S, H, D) in memory, pass that array
            x = np.ascontiguousarray(np.asarray(x).transpose(0, 2, 1, 3))
        arrays[name] = to_device_dtype(x, dtype)
    infos = [_info(n, arrays[n], dtype) for n in ("q", "k", "v")]
    keys = k.shape[2]
    if spec.paged_kv:
        # wgmma copies a key tile from one page: its smallest page is one tile
        page_size = page_size or (
            spec.block_n if spec.engine.warp_specialized else DEFAULT_PAGE_SIZE
        )
        for i, name in ((1, "k"), (2, "v")):
            arrays[name], arrays["block_table"], infos[i] = _paged(
                arrays[name], name, dtype, layout, page_size
            )
        if seqlens_k is None:
            seqlens_k = np.full(q.shape[0], keys, np.int32)
    mask_info = None
    if mask is not None:
        full = (*q.shape[:3], keys)
        arrays["mask"] = np.broadcast_to(np.asarray(mask, dtype=np.float32), full)
        if spec.paged_kv:  # the kernels see the pages' keys: zeros past Sk (never read)
            width = infos[1].shape[2 if layout == "bhsd" else 1] - keys
            arrays["mask"] = np.pad(arrays["mask"], ((0, 0), (0, 0), (0, 0), (0, width)))
        mask_info = _info("mask", arrays["mask"], "float32")
    variant_infos = {}
    for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is not None:
            arrays[name] = np.ascontiguousarray(x, dtype=np.float32)
            variant_infos[name] = _info(name, arrays[name], "float32")
    call = check_inputs(
        *infos,
        mask_info,
        layout=layout,
        scale=scale,
        spec=spec,
        causal=spec.causal,
        window_size=window_size,
        softcap=softcap,
        **variant_infos,
        score_mod=score_mod,
        mask_mod=mask_mod,
        mod_inputs=mod_inputs,
        block_mask=block_mask,
    )
    arrays.update(call.expressions.tensors(NumpyArrays))
    problem, out_shape = plan(call, layout)
    problem = Problem(**{**problem.__dict__, "num_splits": num_splits})
    if spec.paged_kv:
        pages_per_seq = arrays["block_table"].shape[1]
        problem = Problem(
            **{
                **problem.__dict__,
                "page_size": page_size,
                "block_table_stride": pages_per_seq,
                "num_pages": arrays["k"].shape[0],
            }
        )
    if seqlens_k is not None:
        arrays["seqlens_k"] = np.asarray(seqlens_k, dtype=np.int32)
    bf16 = dtype == "bfloat16"
    out_dtype = np.uint16 if bf16 else arrays["q"].dtype
    arrays["out"] = np.full(out_shape, 0xFFFF if bf16 else np.nan, dtype=out_dtype)
    if want_lse:
        arrays["lse"] = np.full(call.q.shape[:3], np.nan, dtype=np.float32)
    stats = run_launches(spec, problem, arrays, call.scale, source=source, on_step=on_step)
    out = from_device_dtype(arrays["out"], dtype)
    if layout == "bshd":
        out = out.transpose(0, 2, 1, 3)
    return EmulatedAttention(out, arrays.get("lse"), stats, arrays, problem)


def _paged(
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
) -> EmulatedAttention:
    """Run an fp8 spec's kernel on q (B, H, Sq, D), k and v (B, Hkv, Sk, D) given as e4m3 bit
    patterns (uint8, contiguous), with optional fp32 descales of shape (B, Hkv). v is passed
    to the kernel as :func:`kernelgen.fp8.v_operand` makes it (V^T, keys permuted). ``out``
    (bf16, widened to float32) and ``lse`` start as NaN."""
    from kernelgen.fp8 import check_descales, launch_problem, v_operand

    if not spec.fp8:
        raise InputTypeError(
            f"spec dtype={spec.dtype!r} is not allowed here; use a float8_e4m3 spec"
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != np.uint8 or x.ndim != 4:
            raise InputTypeError(
                f"{name} has dtype {x.dtype} and {x.ndim} dims; expected 4-d uint8 (e4m3 bits)"
            )
    batch, heads, seqlen_q, dim = q.shape
    kv_heads = k.shape[1]
    if dim != spec.head_dim or heads % kv_heads or k.shape != v.shape or k.shape[0] != batch:
        raise InputError(
            f"q {q.shape}, k {k.shape}, v {v.shape} do not fit the spec (head_dim="
            f"{spec.head_dim}; q (B, H, Sq, D), k and v (B, Hkv, Sk, D), H a multiple of Hkv)"
        )
    descales = check_descales(
        {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale},
        batch,
        kv_heads,
        fp8=True,
    )
    arrays: dict[str, np.ndarray] = {
        "q": np.ascontiguousarray(q),
        "k": np.ascontiguousarray(k),
        "v": v_operand(v),
        **descales,
    }
    out_shape = (batch, heads, seqlen_q, dim)
    problem = launch_problem(arrays["q"], arrays["k"], arrays["v"])
    arrays["out"] = np.full(out_shape, 0xFFFF, dtype=np.uint16)
    arrays["lse"] = np.full(out_shape[:3], np.nan, dtype=np.float32)
    scale = dim**-0.5 if scale is None else float(scale)
    stats = run_launches(spec, problem, arrays, scale, source=source)
    out = from_device_dtype(arrays["out"], spec.out_dtype)
    return EmulatedAttention(out, arrays["lse"], stats, arrays, problem)
