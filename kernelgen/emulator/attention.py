"""Attention on the emulator from float arrays: kernelgen's input checks and plan, then the
spec's launches (:mod:`kernelgen.emulator.launches`). Used by ``kernelgen emulate`` and the
emulation tests.

It sits above :mod:`kernelgen.api` (it uses its checks and plan); the API itself must import
:mod:`kernelgen.emulator.launches`, never this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kernelgen.api import TensorInfo, check_inputs, plan
from kernelgen.emulator.kernel import LaunchStats
from kernelgen.emulator.launches import from_device_dtype, run_launches, to_device_dtype
from kernelgen.launch import Problem
from kernelgen.spec import KernelSpec

__all__ = ["EmulatedAttention", "emulate_attention"]


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
    window_size: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: np.ndarray | None = None,
    sinks: np.ndarray | None = None,
) -> EmulatedAttention:
    """Run ``spec``'s kernels on q (B, H, Sq, D), k and v (B, Hkv, Sk, D) given as floats in
    (B, H, S, D) order (rounded to the spec's dtype), stored in memory in ``layout``. ``out`` and
    ``lse`` start as NaN. Without ``want_lse`` the kernels get a null lse (as attention() passes
    when the lse is not asked for). Split-KV specs default to 3 key chunks. The variants
    (docs/variants.md) are attention()'s; the spec must have their flags."""
    if num_splits is None:
        num_splits = 3 if spec.split_kv else 1
    dtype = spec.dtype
    arrays: dict[str, np.ndarray] = {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        if layout == "bshd":  # store (B, S, H, D) in memory, pass that array
            x = np.ascontiguousarray(np.asarray(x).transpose(0, 2, 1, 3))
        arrays[name] = to_device_dtype(x, dtype)
    infos = [_info(n, arrays[n], dtype) for n in ("q", "k", "v")]
    mask_info = None
    if mask is not None:
        full = (*q.shape[:3], k.shape[2])
        arrays["mask"] = np.broadcast_to(np.asarray(mask, dtype=np.float32), full)
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
    )
    problem, out_shape = plan(call, layout)
    problem = Problem(**{**problem.__dict__, "num_splits": num_splits})
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
