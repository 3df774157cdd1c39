"""The fuzzer's fp8 (e4m3, wgmma) forward cases (:mod:`kernelgen.testing.fuzz`): what a problem
of an fp8 spec may hold, the quantized inputs with their descales, and the run judged against
:func:`kernelgen.references.fp8.fp8_reference` with the fp8 tests' limits
(:func:`kernelgen.references.fp8.fp8_mismatches`). The spec fields are drawn by
:func:`kernelgen.testing.fuzz_space.draw_fp8_fields`.

Which fp8 forms exist is the validator's to say (``KernelSpec._fp8_problems``): the draw asks for
the variants, V transposed in the kernel, the decode forms and document masks, and counts the
refusals. Call arguments that are not spec fields (per-entry ``seqlens_k``, the bshd layout, no
lse) are drawn only where the calls take them. Specs with a decode form (split_kv, pack_gqa,
paged_kv) run as a decode step does, through :func:`kernelgen.attention_with_kvcache` on the
emulator (the cache as (B, S, Hkv, D) e4m3, paged by
:func:`kernelgen.calls.emulated.paged_pool`: pages in reverse order, NaN past the keys);
the others through :func:`emulate_fp8_attention` (which takes a block mask).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import numpy as np

from kernelgen.references.fp8 import DESCALE_NAMES, fp8_mismatches, fp8_reference, quantize
from kernelgen.specs.forward import KernelSpec
from kernelgen.testing.fuzz_inputs import call_arguments
from kernelgen.testing.fuzz_space import FuzzProblem, chance

# Spread of the drawn values before quantization (q and k, v), and the per (batch, kv head)
# descales (log-uniform): the fp8 tests' ranges. The fp8 lse limit is absolute
# (FP8_LSE_TOLERANCE = 1e-4), which fp32 resolves only while |lse| stays below about 2^8 (its
# spacing is 2.4e-4 at 2^11): so wide_range problems scale fp8 rows by 2^-4..2^0 (small values,
# e4m3 subnormals), never up (scores of thousands gave lse errors of 1-2 fp32 ulps, 5e-4).
INPUT_SIGMA = (1.5, 2.0)
DESCALE_RANGE = (0.5, 2.0)
WIDE_RANGE_EXPONENTS = (-4, 0)
DESCALE_P = 0.7  # each descale is given (else None: 1) with this chance
VARIANT_NAMES = ("window_size", "softcap", "alibi_slopes", "sinks")  # the reference takes these


def decode_step(
    spec: KernelSpec, p: FuzzProblem, x: Fp8Inputs, k: np.ndarray, v: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One :func:`kernelgen.attention_with_kvcache` call of a decode-form spec on the cache k, v
    ((B, Hkv, S, D) bits; paged with p.page_size when the spec is): (out (B, H, Sq, D) float32,
    lse). The call takes no block mask: the spec's mask_mod and its inputs only."""
    import ml_dtypes

    import kernelgen
    from kernelgen.calls.emulated import paged_pool

    def bshd(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.transpose(0, 2, 1, 3))

    k_cache, v_cache, table = bshd(k), bshd(v), None
    if spec.paged_kv:
        assert p.page_size is not None
        k_cache, table, _ = paged_pool(k_cache, "k", spec.dtype, "bshd", p.page_size)
        v_cache, _, _ = paged_pool(v_cache, "v", spec.dtype, "bshd", p.page_size)
    lengths = np.array(p.seqlens_k or (p.seqlen_k,) * p.batch, np.int32)
    keywords = {n: value for n, value in x.keywords.items() if n != "block_mask"}
    f8 = ml_dtypes.float8_e4m3fn
    out, lse = kernelgen.attention_with_kvcache(
        bshd(x.q).view(f8), k_cache.view(f8), v_cache.view(f8), lengths, block_table=table,
        causal=spec.causal, scale=p.scale, return_lse=True, spec=spec,
        num_splits=p.num_splits, **x.descales, **keywords,
    )  # fmt: skip
    return np.asarray(out, np.float32).transpose(0, 2, 1, 3), np.asarray(lse)


def fit_problem(rng: np.random.Generator, p: FuzzProblem) -> FuzzProblem:
    """A forward problem made one of emulate_fp8_attention's: bhsd (it takes no layout), every
    lse, per-entry lengths as drawn; and which descales are given."""
    given = tuple(name for name in DESCALE_NAMES if chance(rng, DESCALE_P))
    lengths = p.seqlens_k
    return dataclasses.replace(
        p,
        layout="bhsd",
        null_lse=False,
        seqlens_k=lengths,
        nan_past=p.nan_past and lengths is not None,
        descales=given,
    )


@dataclasses.dataclass
class Fp8Inputs:
    """e4m3 bit patterns (uint8, (B, H, S, D)), descales by name, the call's variant keywords."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    descales: dict[str, np.ndarray | None]
    keywords: dict[str, Any]


def make_inputs(spec: KernelSpec, p: FuzzProblem, keywords: dict[str, Any]) -> Fp8Inputs:
    """Normal values quantized to e4m3 as the fp8 tests do (:func:`quantize`), and
    log-uniform descales of shape (B, Hkv) for the names the problem gives."""
    rng = np.random.default_rng(p.data_seed)

    def draw(sigma: float, *shape: int) -> np.ndarray:
        x = rng.normal(0.0, sigma, shape)
        if p.wide_range:
            low, high = WIDE_RANGE_EXPONENTS
            x = x * np.exp2(rng.integers(low, high + 1, shape[:-1]))[..., None]
        return quantize(x)

    d = spec.head_dim
    q = draw(INPUT_SIGMA[0], p.batch, p.heads, p.seqlen_q, d)
    k = draw(INPUT_SIGMA[0], p.batch, p.kv_heads, p.seqlen_k, d)
    v = draw(INPUT_SIGMA[1], p.batch, p.kv_heads, p.seqlen_k, d)
    low, high = np.log2(DESCALE_RANGE)
    descales: dict[str, np.ndarray | None] = {
        name: np.exp2(rng.uniform(low, high, (p.batch, p.kv_heads))).astype(np.float32)
        if name in (p.descales or ())
        else None
        for name in DESCALE_NAMES
    }
    return Fp8Inputs(q, k, v, descales, keywords)


def reference(
    spec: KernelSpec,
    p: FuzzProblem,
    x: Fp8Inputs,
    lengths: tuple[int, ...],
    hooks: dict[str, Any],
) -> Any:
    """:func:`fp8_reference` entry by entry over its first lengths[b] keys, concatenated (the
    expression ``hooks`` see the entry's own batch index)."""
    from kernelgen.references.fp8 import Fp8Reference

    scale = spec.head_dim**-0.5 if p.scale is None else p.scale
    variants = {n: x.keywords[n] for n in VARIANT_NAMES if n in x.keywords}
    parts = []
    for b, n in enumerate(lengths):
        entry = dict(variants)
        slopes = entry.get("alibi_slopes")
        if slopes is not None and slopes.ndim == 2:
            entry["alibi_slopes"] = slopes[b]
        if "score_mod" in hooks:
            entry["score_mod"] = lambda s, bb, h, i, j, b=b: hooks["score_mod"](s, bb + b, h, i, j)
        if "mask_mod" in hooks:
            entry["mask_mod"] = lambda bb, h, i, j, b=b: hooks["mask_mod"](bb + b, h, i, j)
        descales = {k: None if s is None else s[b : b + 1] for k, s in x.descales.items()}
        qkv = (x.q[b : b + 1], x.k[b : b + 1, :, :n], x.v[b : b + 1, :, :n])
        parts.append(fp8_reference(*qkv, descales, causal=spec.causal, scale=scale, **entry))
    fields = ("out", "lse", "weighted", "total")
    return Fp8Reference(*(np.concatenate([getattr(r, f) for r in parts]) for f in fields))


def call_keywords(spec: KernelSpec, p: FuzzProblem) -> tuple[dict[str, Any], dict[str, Any]]:
    """The case's call keywords (variant values, then the expressions' arguments: document ids,
    a block mask) and the reference's expression hooks, from the generator (data_seed, 1)."""
    _, keywords, hooks = call_arguments(np.random.default_rng([p.data_seed, 1]), spec, p)
    return keywords, hooks


def is_decode(spec: KernelSpec) -> bool:
    """Whether the spec has a decode form (run through attention_with_kvcache)."""
    return bool(spec.split_kv or spec.pack_gqa or spec.paged_kv)


def run(
    spec: KernelSpec,
    p: FuzzProblem,
    keywords: dict[str, Any],
    hooks: dict[str, Any] | None = None,
    source: str | None = None,
) -> dict[str, Any]:
    """Run the fp8 case on the emulator (exceptions propagate to the caller's verdict) and judge
    out and lse: ``{"outcome", "bound_ratio", "out_error", "lse_error"[, "failed"]}``.
    ``hooks``: the reference's expression hooks; ``source`` replaces the kernel's CUDA (a
    mutation)."""
    from kernelgen.calls.emulated import emulate_fp8_attention
    from kernelgen.runtime.emulated_launch import recording

    x = make_inputs(spec, p, keywords)
    lengths = p.seqlens_k or (p.seqlen_k,) * p.batch
    ref = reference(spec, p, x, lengths, hooks or {})
    k, v = x.k, x.v
    if p.nan_past:  # e4m3 NaN (0x7f) in the rows past each entry's length
        k, v = k.copy(), v.copy()
        for b, n in enumerate(lengths):
            k[b, :, n:] = v[b, :, n:] = 0x7F
    if is_decode(spec):  # (a caller's recording stays in force without a mutation)
        with recording(source) if source is not None else contextlib.nullcontext():
            out, lse = decode_step(spec, p, x, k, v)
    else:
        call: dict[str, Any] = dict(keywords)
        if p.seqlens_k is not None:
            call["seqlens_k"] = np.array(p.seqlens_k, np.int32)
        result = emulate_fp8_attention(
            spec, x.q, k, v, scale=p.scale, source=source, **x.descales, **call
        )
        out, lse = result.out, result.lse
    found = fp8_mismatches(out, lse, ref)
    return {
        "outcome": "mismatch" if found.failed else "ok",
        "bound_ratio": float(f"{found.bound_ratio:.4g}"),
        "out_error": float(f"{found.out_error:.4g}"),
        "lse_error": float(f"{found.lse_error:.4g}"),
        **({"failed": list(found.failed)} if found.failed else {}),
    }
