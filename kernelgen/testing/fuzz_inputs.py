"""Random inputs of a fuzz case (:mod:`kernelgen.testing.fuzz`), shared by the forward and the
backward: values exact in a dtype, an additive mask, the variants' values and document ids.
Each maker draws from the case's data generator in a fixed order, so a case's data is its
``data_seed``'s alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernelgen.references.example_inputs import ProblemSizes, expression_arguments
from kernelgen.runtime.emulated_launch import from_device_dtype, to_device_dtype
from kernelgen.testing.fuzz_space import EMPTY_DOC, FuzzProblem


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values of ``x`` rounded to ``dtype`` (float32, float16 or bfloat16)."""
    return from_device_dtype(to_device_dtype(np.asarray(x, np.float32), dtype), dtype)


def draw_values(
    rng: np.random.Generator,
    dtype: str,
    p: FuzzProblem,
    *shape: int,
    exponents: tuple[int, int] = (-4, 4),
) -> np.ndarray:
    """Standard normal values exact in ``dtype`` (float32); with ``p.wide_range`` each row
    scaled by a power of two 2^e, e from ``exponents`` (scores far apart, values of all
    sizes)."""
    x = rng.standard_normal(shape)
    if p.wide_range:
        low, high = exponents
        x = x * np.exp2(rng.integers(low, high + 1, shape[:-1]))[..., None]
    return rounded(x, dtype)


def additive_mask(rng: np.random.Generator, p: FuzzProblem) -> np.ndarray | None:
    """The problem's additive mask: ``broadcast`` (1, H, Sq, Sk) with rows that see no key and
    rows that lose every other key, ``full`` (B, H, Sq, Sk), or None."""
    if p.mask == "broadcast":
        mask = rng.standard_normal((1, p.heads, p.seqlen_q, p.seqlen_k)).astype(np.float32)
        mask[:, :, ::5, :] = -np.inf
        mask[:, :, 1::3, ::2] = -np.inf
        return mask
    if p.mask == "full":
        shape = (p.batch, p.heads, p.seqlen_q, p.seqlen_k)
        return (2 * rng.standard_normal(shape)).astype(np.float32)
    return None


def documents(rng: np.random.Generator, p: FuzzProblem) -> dict[str, np.ndarray]:
    """Document ids of keys (B, Sk: sorted, up to 4 documents) and queries (B, Sq: the
    document of the key each aligns with, bottom right; before the first key, or in a random
    stretch, :data:`EMPTY_DOC`)."""
    kdoc = np.sort(rng.integers(0, 4, (p.batch, p.seqlen_k)), axis=1).astype(np.int32)
    qdoc = np.full((p.batch, p.seqlen_q), EMPTY_DOC, np.int32)
    aligned = np.arange(p.seqlen_q) + p.seqlen_k - p.seqlen_q
    seen = aligned >= 0
    qdoc[:, seen] = kdoc[:, aligned[seen]]
    if p.seqlen_q > 8 and rng.random() < 0.3:
        start = int(rng.integers(p.seqlen_q - 8))
        qdoc[:, start : start + int(rng.integers(1, 70))] = EMPTY_DOC
    return {"qdoc": qdoc, "kdoc": kdoc}


def variant_keywords(rng: np.random.Generator, spec: Any, p: FuzzProblem) -> dict[str, Any]:
    """The call keywords of the spec's variants (window_size, softcap, alibi_slopes, sinks)."""
    keywords: dict[str, Any] = {}
    if spec.window:
        keywords["window_size"] = p.window
    if spec.softcap:
        keywords["softcap"] = p.softcap
    if spec.alibi:
        shape = (p.batch, p.heads) if p.alibi_per_batch else (p.heads,)
        keywords["alibi_slopes"] = rng.uniform(0.01, 0.5, shape).astype(np.float32)
    if spec.sinks:
        keywords["sinks"] = (2 * rng.standard_normal(p.heads)).astype(np.float32)
    return keywords


def call_arguments(
    rng: np.random.Generator, spec: Any, p: FuzzProblem
) -> tuple[np.ndarray | None, dict[str, Any], dict[str, Any]]:
    """What a case's call adds to q, k and v, drawn in this order: the additive mask (or None),
    the keywords (the variants' values, and with expressions their arguments: a document
    mask's inputs, a block mask) and the reference's expression hooks."""
    mask = additive_mask(rng, p)
    keywords = variant_keywords(rng, spec, p)
    hooks: dict[str, Any] = {}
    if spec.has_expressions:
        inputs = documents(rng, p) if spec.mask_mod is not None else {}
        sizes = ProblemSizes(p.batch, p.heads, p.seqlen_q, p.seqlen_k)
        expressions, hooks = expression_arguments(spec, sizes, inputs)
        keywords |= expressions
    return mask, keywords, hooks
