"""Shared cases and checks for the kernel tiers (CPU emulation and GPU).

Inputs are fresh random numbers rounded to the kernel's dtype; the reference is float64 NumPy on
exactly those rounded values. Tolerances are docs/design.md's and are never loosened.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernelgen.references.attention import (
    LSE_TOLERANCE,
    OUT_TOLERANCE,
    mismatches,
    naive_attention,
    relative_error,
)
from kernelgen.references.example_inputs import EXAMPLE_MOD_INPUTS, expression_arguments
from kernelgen.runtime.emulated_launch import to_device_dtype


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    layout: str = "bhsd"
    mask: str | None = None  # None, "broadcast" (1, H, Sq, Sk) with empty rows, "full"
    scale: float | None = None
    # Key j is scaled by 1 + key_growth * j / seqlen_k: later tiles hold far larger scores, so a
    # row's maximum keeps passing its running reference (the kernels' rescale path).
    key_growth: float = 0.0

    def __str__(self) -> str:
        parts = [
            f"b{self.batch}h{self.heads}kv{self.kv_heads}",
            f"q{self.seqlen_q}k{self.seqlen_k}",
        ]
        parts += [self.layout] + ([f"mask-{self.mask}"] if self.mask else [])
        parts += [f"scale{self.scale}"] if self.scale is not None else []
        return "-".join(parts + ([f"growth{self.key_growth}"] if self.key_growth else []))


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded (RNE) to ``dtype``, returned as float32."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return bf16_bits_to_float(float_to_bf16_bits(x))
    return x


def float_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    return to_device_dtype(x, "bfloat16")


def bf16_bits_to_float(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


@dataclass
class CaseData:
    """Inputs in (B, H, S, D) order as float32 holding dtype-exact values, plus the reference."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray | None
    ref_out: np.ndarray
    ref_lse: np.ndarray


def example_variants(
    flags: tuple[str, ...], batch: int, heads: int, seed: int, window: tuple[int, int] = (9, 3)
) -> dict:
    """attention() arguments for the built-in variants ``flags`` (a spec's ``variants``): a
    window of ``window`` (left, right), a cap that bends the scores (1.5 at unit-variance
    scores), per-(batch, head) ALiBi slopes and per-head sinks, fp32 as attention() wants."""
    rng = np.random.default_rng(seed + 1)
    values = {
        "window": ("window_size", window),
        "softcap": ("softcap", 1.5),
        "alibi": ("alibi_slopes", rng.uniform(0.05, 0.5, (batch, heads)).astype(np.float32)),
        "sinks": ("sinks", (2 * rng.standard_normal(heads)).astype(np.float32)),
    }
    return dict(values[name] for name in flags)


# The inputs the specs' user expressions read (specs/*.yaml, docs/expressions.md), by name:
# (case, rng) -> array. A spec that reads another name needs a maker there.
EXPRESSION_INPUTS = EXAMPLE_MOD_INPUTS


def example_expressions(spec, case: Case, seed: int) -> tuple[dict, dict]:
    """attention()'s expression arguments for a spec with user expressions (host arrays; a
    block-sparse spec also gets its block mask, from the NumPy builder) and the reference's
    hooks (the float64 evaluator); two empty dicts for a spec without expressions."""
    if not spec.has_expressions:
        return {}, {}
    rng = np.random.default_rng(seed + 13)
    score_mod, mask_mod = spec.expressions
    declared = (score_mod or mask_mod).inputs
    inputs = {i.name: EXPRESSION_INPUTS[i.name](case, rng) for i in declared}
    return expression_arguments(spec, case, inputs)


def make_case(
    case: Case, dtype: str, head_dim: int, causal: bool, seed: int, variants: dict | None = None
) -> CaseData:
    """Random inputs for ``case`` and the float64 reference; ``variants``: attention()'s variant
    arguments (window_size, softcap, alibi_slopes, sinks), given to the reference as well."""
    rng = np.random.default_rng(seed)
    q = round_to(rng.standard_normal((case.batch, case.heads, case.seqlen_q, head_dim)), dtype)
    kv_shape = (case.batch, case.kv_heads, case.seqlen_k, head_dim)
    growth = 1.0 + case.key_growth * np.arange(case.seqlen_k) / case.seqlen_k
    k = round_to(rng.standard_normal(kv_shape) * growth[:, None], dtype)
    v = round_to(rng.standard_normal(kv_shape), dtype)
    mask = None
    if case.mask == "broadcast":
        mask = rng.standard_normal((1, case.heads, case.seqlen_q, case.seqlen_k)).astype(np.float32)
        mask[:, :, ::5, :] = -np.inf  # every fifth row sees no key at all
        mask[:, :, 1::3, ::2] = -np.inf  # some rows lose every other key
    elif case.mask == "full":
        shape = (case.batch, case.heads, case.seqlen_q, case.seqlen_k)
        mask = (2 * rng.standard_normal(shape)).astype(np.float32)
    ref_out, ref_lse = naive_attention(
        q, k, v, causal=causal, scale=case.scale, mask=mask, **(variants or {})
    )
    return CaseData(q, k, v, mask, ref_out, ref_lse)


def assert_matches(out: np.ndarray, lse: np.ndarray | None, data: CaseData, dtype: str) -> None:
    """out/lse (B, H, Sq, D)/(B, H, Sq) against the float64 reference, with docs/design.md's limits
    (lse None: a call that did not ask for it; out alone is checked): every check of
    kernelgen.references.attention.mismatches must hold."""
    found = mismatches(out, lse, data.ref_out, data.ref_lse, dtype)
    assert not found.failed, "; ".join(found.failed)


# ---- packed variable-length batches (attention_varlen) ----


def varlen_offsets(lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed_varlen(lengths_q, lengths_k, heads, kv_heads, dtype, seed, head_dim=32):
    """Packed varlen q, k, v holding ``dtype`` values (as float64) and the int32 offsets."""
    rng = np.random.default_rng(seed)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = round_to(rng.standard_normal((total_q, heads, head_dim)), dtype)
    k = round_to(rng.standard_normal((total_k, kv_heads, head_dim)), dtype)
    v = round_to(rng.standard_normal((total_k, kv_heads, head_dim)), dtype)
    return q, k, v, varlen_offsets(lengths_q), varlen_offsets(lengths_k)


def _per_entry(variants: dict, b: int) -> dict:
    """The variant arguments of batch entry (or sequence) b: (B, H) ALiBi slopes sliced."""
    slopes = variants.get("alibi_slopes")
    if slopes is None or np.ndim(slopes) == 1:
        return variants
    return {**variants, "alibi_slopes": slopes[b : b + 1]}


def varlen_reference(q, k, v, cu_q, cu_k, causal, **variants):
    """float64 out (total_q, H, D) and lse (H, total_q), one sequence at a time; ``variants``:
    attention()'s variant arguments ((B, H) ALiBi slopes: one row per sequence)."""
    out = np.zeros(q.shape)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.start == rows.stop:
            continue
        o, s = naive_attention(
            q[rows].transpose(1, 0, 2)[None],
            k[keys].transpose(1, 0, 2)[None],
            v[keys].transpose(1, 0, 2)[None],
            causal=causal,
            **_per_entry(variants, b),
        )
        out[rows] = o[0].transpose(1, 0, 2)
        lse[:, rows] = s[0]
    return out, lse


def check_varlen(out, lse, ref_out, ref_lse, dtype):
    out = np.asarray(out, dtype=np.float64)
    assert not np.isnan(out).any()
    error = relative_error(out, ref_out)
    assert error <= OUT_TOLERANCE[dtype], f"relative error {error:.3g} > {OUT_TOLERANCE[dtype]}"
    empty = np.isneginf(ref_lse)  # (H, total_q)
    assert np.all(out.transpose(1, 0, 2)[empty] == 0.0), "rows that see no key give out = 0"
    if lse is None:
        return
    assert lse.dtype == np.float32 and lse.shape == ref_lse.shape
    assert np.array_equal(np.isneginf(lse), empty), "lse is -inf exactly where no key is seen"
    if (~empty).any():
        assert np.max(np.abs(lse[~empty] - ref_lse[~empty])) <= LSE_TOLERANCE


# ---- a contiguous KV cache with appended rows (attention_with_kvcache) ----


def kvcache_data(batch, seqlen_q, new_len, max_keys, heads, kv_heads, dtype, seed, head_dim=32):
    """float32 q (B, Sq, H, D), caches (B, S_max, Hkv, D) and k_new/v_new (B, S_new, Hkv, D),
    all holding values of ``dtype``."""
    rng = np.random.default_rng(seed)

    def draw(*shape):
        return round_to(rng.standard_normal(shape), dtype)

    q = draw(batch, seqlen_q, heads, head_dim)
    k_cache, v_cache = (draw(batch, max_keys, kv_heads, head_dim) for _ in range(2))
    k_new, v_new = (draw(batch, new_len, kv_heads, head_dim) for _ in range(2))
    return q, k_cache, v_cache, k_new, v_new


def kvcache_reference(q, k_cache, v_cache, k_new, v_new, lengths, causal, **variants):
    """float64 out (B, Sq, H, D) and lse (B, H, Sq): entry b attends to its first lengths[b]
    cached keys followed by its new ones (the concatenation, no cache involved); ``variants``:
    attention()'s variant arguments."""
    batch, seqlen_q, heads, _ = q.shape
    out = np.zeros(q.shape)
    lse = np.full((batch, heads, seqlen_q), -np.inf)
    for b, length in enumerate(lengths):
        keys = np.concatenate([k_cache[b, :length], k_new[b]])
        values = np.concatenate([v_cache[b, :length], v_new[b]])
        o, s = naive_attention(
            q[b].transpose(1, 0, 2)[None],
            keys.transpose(1, 0, 2)[None],
            values.transpose(1, 0, 2)[None],
            causal=causal,
            **_per_entry(variants, b),
        )
        out[b] = o[0].transpose(1, 0, 2)
        lse[b] = s[0]
    return out, lse


def nan_past_lengths(cache, lengths, new_len):
    """A copy of the cache (B, S_max, Hkv, D) whose rows past each entry's keys after the append
    (lengths[b] + new_len on) are NaN, as never-written device memory may be."""
    poisoned = cache.copy()
    for b, length in enumerate(lengths):
        poisoned[b, length + new_len :] = np.nan
    return poisoned


def appended_cache(cache, new, lengths):
    """The cache as it must be after the call: ``new`` in rows lengths[b]:, the rest as was."""
    want = cache.copy()
    for b, length in enumerate(lengths):
        want[b, length : length + new.shape[1]] = new[b]
    return want


def check_kvcache(out, lse, ref_out, ref_lse, dtype):
    out = np.asarray(out, dtype=np.float64)
    assert not np.isnan(out).any()
    error = relative_error(out, ref_out)
    assert error <= OUT_TOLERANCE[dtype], f"relative error {error:.3g} > {OUT_TOLERANCE[dtype]}"
    empty = np.isneginf(ref_lse)  # (B, H, Sq)
    assert np.all(out.transpose(0, 2, 1, 3)[empty] == 0.0), "rows that see no key give out = 0"
    if lse is None:
        return
    assert lse.dtype == np.float32 and lse.shape == ref_lse.shape
    assert np.array_equal(np.isneginf(lse), empty), "lse is -inf exactly where no key is seen"
    if (~empty).any():
        assert np.max(np.abs(lse[~empty] - ref_lse[~empty])) <= LSE_TOLERANCE


# ---- a paged KV cache (attention_with_kvcache with block_table) ----


SPARE_PAGE_VALUE = 4096.0  # exact in every dtype; far from any softmax-weighted value


def paged_cache(cache, page_size, seed, shared=(), spare=3):
    """A contiguous cache (B, S_max, Hkv, D) (S_max a multiple of page_size) scattered into a
    pool of pages (num_pages, page_size, Hkv, D) in shuffled order, with ``spare`` pages no
    entry uses (filled with SPARE_PAGE_VALUE: reading one shows). ``shared``: (b_from, b_to,
    pages) triples, entry b_to's first pages are b_from's (prefix sharing: its logical cache
    changes to match). Returns (pool, block_table int32 (B, S_max / page_size), the logical
    cache the table describes)."""
    rng = np.random.default_rng(seed)
    batch, max_keys = cache.shape[:2]
    per_seq = max_keys // page_size
    logical = cache.copy()
    owner = np.arange(batch * per_seq).reshape(batch, per_seq)  # logical page of each slot
    for b_from, b_to, pages in shared:
        owner[b_to, :pages] = owner[b_from, :pages]
        logical[b_to, : pages * page_size] = logical[b_from, : pages * page_size]
    used = np.unique(owner)
    order = rng.permutation(used.size + spare)  # pool page of each used logical page
    pool = np.full((used.size + spare, page_size, *cache.shape[2:]), SPARE_PAGE_VALUE, cache.dtype)
    where = dict(zip(used.tolist(), order[: used.size].tolist(), strict=True))
    table = np.vectorize(where.__getitem__)(owner).astype(np.int32)
    for b in range(batch):
        for j in range(per_seq):
            pool[table[b, j]] = logical[b, j * page_size : (j + 1) * page_size]
    return pool, table, logical


def gather_pages(pool, table):
    """The logical caches (B, pages x page_size, Hkv, D) a block table describes."""
    batch, per_seq = table.shape
    return pool[table].reshape(batch, per_seq * pool.shape[1], *pool.shape[2:])
