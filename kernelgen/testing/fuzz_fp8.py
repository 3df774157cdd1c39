"""The fuzzer's fp8 (e4m3, wgmma) forward cases (:mod:`kernelgen.testing.fuzz`): what a problem
of an fp8 spec may hold, the quantized inputs with their descales, and the run judged against
:func:`kernelgen.references.fp8.fp8_reference` with the fp8 tests' limits
(:func:`kernelgen.references.fp8.fp8_mismatches`). The spec fields are drawn by
:func:`kernelgen.testing.fuzz_space.draw_fp8_fields`.

Which fp8 forms exist is the validator's to say (``KernelSpec._fp8_problems``): the draw asks for
the variants too (window, softcap, ALiBi, sinks) and counts the refusals, so the same code draws
them once the validator takes them. Call arguments that are not spec fields (per-entry
``seqlens_k``, the bshd layout, no lse) are drawn only where :func:`emulate_fp8_attention`
takes them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from kernelgen.references.fp8 import DESCALE_NAMES, fp8_mismatches, fp8_reference, quantize
from kernelgen.specs.forward import KernelSpec
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


def reference(spec: KernelSpec, p: FuzzProblem, x: Fp8Inputs, lengths: tuple[int, ...]) -> Any:
    """:func:`fp8_reference` entry by entry over its first lengths[b] keys, concatenated."""
    from kernelgen.references.fp8 import Fp8Reference

    scale = spec.head_dim**-0.5 if p.scale is None else p.scale
    parts = []
    for b, n in enumerate(lengths):
        entry = dict(x.keywords)
        slopes = entry.get("alibi_slopes")
        if slopes is not None and slopes.ndim == 2:
            entry["alibi_slopes"] = slopes[b]
        descales = {k: None if s is None else s[b : b + 1] for k, s in x.descales.items()}
        qkv = (x.q[b : b + 1], x.k[b : b + 1, :, :n], x.v[b : b + 1, :, :n])
        parts.append(fp8_reference(*qkv, descales, causal=spec.causal, scale=scale, **entry))
    fields = ("out", "lse", "weighted", "total")
    return Fp8Reference(*(np.concatenate([getattr(r, f) for r in parts]) for f in fields))


def run(spec: KernelSpec, p: FuzzProblem, keywords: dict[str, Any]) -> dict[str, Any]:
    """Run the fp8 case on the emulator (exceptions propagate to the caller's verdict) and judge
    out and lse: ``{"outcome", "bound_ratio", "out_error", "lse_error"[, "failed"]}``."""
    from kernelgen.calls.emulated import emulate_fp8_attention

    x = make_inputs(spec, p, keywords)
    lengths = p.seqlens_k or (p.seqlen_k,) * p.batch
    ref = reference(spec, p, x, lengths)
    k, v = x.k, x.v
    call: dict[str, Any] = dict(keywords)
    if p.seqlens_k is not None:
        call["seqlens_k"] = np.array(p.seqlens_k, np.int32)
        if p.nan_past:  # e4m3 NaN (0x7f) in the rows past each entry's length
            k, v = k.copy(), v.copy()
            for b, n in enumerate(p.seqlens_k):
                k[b, :, n:] = v[b, :, n:] = 0x7F
    if p.layout != "bhsd":
        call["layout"] = p.layout
    result = emulate_fp8_attention(spec, x.q, k, v, scale=p.scale, **x.descales, **call)
    found = fp8_mismatches(result.out, result.lse, ref)
    return {
        "outcome": "mismatch" if found.failed else "ok",
        "bound_ratio": float(f"{found.bound_ratio:.4g}"),
        "out_error": float(f"{found.out_error:.4g}"),
        "lse_error": float(f"{found.lse_error:.4g}"),
        **({"failed": list(found.failed)} if found.failed else {}),
    }
