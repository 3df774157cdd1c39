"""The float64 model of fp8 (e4m3) attention and its stated error bound (docs/hopper.md, "fp8").

The reference decodes e4m3 bit patterns exactly (through ml_dtypes, not the kernels' table),
applies the per (batch, kv head) descales and computes softmax attention in float64. The fp8
kernel rounds the weights P to e4m3 (relative error 2^-4 while a weight is a normal e4m3
number, absolute 2^-18 of the maximum's weight below) and out to bf16, so every output element
obeys

    |out - ref| <= vd (2^-4 sum_j p_j |v_j| + 2^-18 sum_j |v_j|) / l + 2^-8 |ref| + fp32 slack

(p the float64 weights, l their sum, vd the v descale). :func:`fp8_reference` returns the two
sums' terms beside out and lse; :func:`bound_ratio` is the largest error over its bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from kernelgen.references.attention import (
    Variants,
    _prepare,
    _softmax_parts,
    _with_sinks,
    lse_mismatches,
    relative_error,
)

P_RELATIVE = 2.0**-4  # e4m3 rounding of a normal weight: 3 mantissa bits
P_ABSOLUTE = 2.0**-18  # half the e4m3 subnormal spacing (2^-10), over the maximum's weight 256
OUT_RELATIVE = 2.0**-8  # bf16 output rounding (2^-9), with room for the fp32 epilogue
FP32_SLACK = 1e-5  # fp32 scores, exponentials and sums, relative to sum_j p_j |v_j| / l
FP8_TOLERANCE = 2.0**-4  # relative Frobenius error of out (measured about 1%)
FP8_LSE_TOLERANCE = 1e-4  # absolute error of the lse: fp32 scores of exact e4m3 products
DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


@dataclass(frozen=True)
class Fp8Reference:
    """float64 out (B, H, Sq, D) and lse (B, H, Sq) of fp8 inputs, and the bound's terms
    ``weighted`` = vd sum_j p_j |v_j| / l and ``total`` = vd sum_j |v_j| / l."""

    out: np.ndarray
    lse: np.ndarray
    weighted: np.ndarray
    total: np.ndarray

    def bound(self) -> np.ndarray:
        """Each output element's allowed absolute error (the module's formula)."""
        return (
            (P_RELATIVE + FP32_SLACK) * self.weighted
            + P_ABSOLUTE * self.total
            + OUT_RELATIVE * np.abs(self.out)
        )

    def bound_ratio(self, out: np.ndarray) -> float:
        """max |out - ref| / bound over the elements (<= 1: within the bound; a NaN, or an
        error where the bound is 0 (a row that sees no key): inf)."""
        error = np.abs(np.asarray(out, np.float64) - self.out)
        error = np.where(np.isnan(error), np.inf, error)
        bound = self.bound()
        ratio = np.divide(error, bound, out=np.where(error > 0, np.inf, 0.0), where=bound > 0)
        return float(np.max(ratio, initial=0.0))


@dataclass(frozen=True)
class Fp8Mismatches:
    """What :func:`fp8_mismatches` found: ``failed`` (one line per broken limit), the largest
    error over its bound, out's relative Frobenius error and the largest lse error."""

    failed: tuple[str, ...]
    bound_ratio: float
    out_error: float
    lse_error: float


def decode(bits: np.ndarray) -> np.ndarray:
    """e4m3 bit patterns (uint8) as float64 values (OCP E4M3: bias 7, no infinities)."""
    return np.asarray(bits, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


_ALL = decode(np.arange(256, dtype=np.uint8))
_FINITE = np.flatnonzero(np.isfinite(_ALL))
_ORDER = _FINITE[np.argsort(_ALL[_FINITE], kind="stable")]  # bit patterns by value
_SORTED = _ALL[_ORDER]


def quantize(x: np.ndarray) -> np.ndarray:
    """The nearest e4m3 bit pattern (uint8) of each value, saturating at +-448 (ties either
    way: the tests and the fuzzer only need e4m3 data)."""
    i = np.clip(np.searchsorted(_SORTED, x), 1, len(_SORTED) - 1)
    nearer_lower = np.abs(x - _SORTED[i - 1]) <= np.abs(_SORTED[i] - x)
    return _ORDER[np.where(nearer_lower, i - 1, i)].astype(np.uint8)


def fp8_reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    descales: dict[str, np.ndarray | None],
    *,
    causal: bool,
    scale: float,
    seqlens_k: np.ndarray | list[int] | None = None,
    **variants: Any,
) -> Fp8Reference:
    """Attention of e4m3 bit patterns q (B, H, Sq, D), k and v (B, Hkv, Sk, D) (uint8) with
    ``descales`` (name -> (B, Hkv) or None: 1), in float64; causal aligned bottom right.
    ``seqlens_k``: entry b sees its first ``seqlens_k[b]`` keys only (clamped to [0, Sk];
    causal and ALiBi aligned to that length); ``variants``: those of
    :func:`kernelgen.references.attention.naive_attention` (window_size, softcap, alibi_slopes,
    sinks, and the score_mod / mask_mod hooks, called with the true batch index), applied to
    the descaled scores. A sink is a key of value 0: it joins l (so the
    bound's terms) and the lse; the bound's absolute term sums the visible keys' |v|."""
    heads, kv_heads = q.shape[1], k.shape[1]
    batch, seqlen_k = k.shape[0], k.shape[2]
    group = heads // kv_heads
    ones = np.ones(k.shape[:2])

    def per_head(name: str) -> np.ndarray:
        value = descales.get(name)
        factor = ones if value is None else np.asarray(value, np.float64)
        return np.repeat(factor, group, axis=1)[:, :, None, None]

    qf = decode(q) * per_head("q_descale")
    kf = np.repeat(decode(k), group, axis=1) * per_head("k_descale")
    vf = np.repeat(decode(v), group, axis=1) * per_head("v_descale")
    slopes = variants.pop("alibi_slopes", None)
    if slopes is not None:
        slopes = np.broadcast_to(np.asarray(slopes, np.float64), (batch, heads))
    parts = []
    for b in range(batch):
        keys = seqlen_k if seqlens_k is None else int(np.clip(seqlens_k[b], 0, seqlen_k))
        entry = _batch_hooks(variants, b)
        if slopes is not None:
            entry["alibi_slopes"] = slopes[b : b + 1]
        parts.append(_entry(qf[b : b + 1], kf[b : b + 1, :, :keys], vf[b : b + 1, :, :keys],
                            causal, scale, entry))  # fmt: skip
    out, lse, weighted, total = (np.concatenate(x) for x in zip(*parts, strict=True))
    return Fp8Reference(out=out, lse=lse, weighted=weighted, total=total)


def _batch_hooks(variants: dict[str, Any], entry: int) -> dict[str, Any]:
    """``variants`` for batch entry ``entry`` run as a batch of one: the hooks get b + entry."""
    hooked = dict(variants)
    score_mod, mask_mod = variants.get("score_mod"), variants.get("mask_mod")
    if score_mod is not None:
        hooked["score_mod"] = lambda s, b, h, q, k: score_mod(s, b + entry, h, q, k)
    if mask_mod is not None:
        hooked["mask_mod"] = lambda b, h, q, k: mask_mod(b + entry, h, q, k)
    return hooked


def _entry(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, scale: float, variants: dict
) -> tuple[np.ndarray, ...]:
    """(out, lse, weighted, total) of one batch entry's descaled float64 inputs (K/V expanded
    to the query heads, cut to the entry's keys)."""
    keys = k.shape[2]
    problem = _prepare(q, k, v, causal, scale, None, Variants(**variants))
    s = _with_sinks(problem.scores(0, q.shape[2], 0, keys), problem.variants.sinks)
    p, l, seen, lse = _softmax_parts(s)  # noqa: E741  (l: 1 where no key or sink is seen)
    p = p[..., :keys]  # the keys' weights (a sink's value is 0)
    visible = np.isfinite(s[..., :keys]).astype(np.float64)
    l = l[..., None]  # noqa: E741
    return (
        np.where(seen[..., None], p @ v / l, 0.0),
        lse,
        p @ np.abs(v) / l,
        visible @ np.abs(v) / l,
    )


def fp8_mismatches(out: np.ndarray, lse: np.ndarray | None, ref: Fp8Reference) -> Fp8Mismatches:
    """An fp8 forward's out (B, H, Sq, D) and lse (B, H, Sq) against :func:`fp8_reference` with
    the fp8 limits: every element within the stated bound (NaN, and out != 0 on a row that sees
    no key, break it), the relative Frobenius error under :data:`FP8_TOLERANCE`, the lse -inf
    exactly where a row sees no key and within :data:`FP8_LSE_TOLERANCE` elsewhere (lse None:
    not asked for). The fp8 tests assert it empty; the fuzzer reports it."""
    out = np.asarray(out, np.float64)
    failed = []
    ratio = ref.bound_ratio(out)
    if not ratio <= 1.0:
        failed.append(f"max error / bound {ratio:.3g} > 1")
    error = relative_error(np.nan_to_num(out, nan=0.0), ref.out)
    if not error < FP8_TOLERANCE:
        failed.append(f"out relative error {error:.3g} >= {FP8_TOLERANCE}")
    lse_error = 0.0
    if lse is not None:
        lse_failed, lse_error = lse_mismatches(lse, ref.lse, FP8_LSE_TOLERANCE)
        failed += lse_failed
    return Fp8Mismatches(tuple(failed), ratio, error, lse_error)
