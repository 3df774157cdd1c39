"""Emulation tier: user expressions (score_mod, mask_mod, their mod_inputs) compiled into every
kernel family, alone, together and with the built-in variants, against the float64 reference;
block-sparse kernels that visit exactly the key tiles a block mask lists; attention()'s
expression arguments and their errors.

Shapes are tiny: each spec is one g++ build of its generated CUDA."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from attention_cases import Case, assert_matches, example_variants, make_case
from test_emulated_kernels import run_emulated

import kernelgen
from kernelgen.calls.block_mask import block_mask_reference
from kernelgen.errors import InputError, InputTypeError
from kernelgen.references.attention import naive_attention, relative_error
from kernelgen.references.expressions import evaluate
from kernelgen.specs.expressions import inputs_from_arrays, parse_mask_mod, parse_score_mod
from kernelgen.specs.forward import KernelSpec

pytestmark = pytest.mark.emulate

TC = dict(loop_order="v2", mma="mma_sync", stages=2)
FAMILIES = {
    "tc-f16-d32-m64n16": dict(TC, dtype="float16", head_dim=32, block_m=64, block_n=16),
    "tc-bf16-d40-m64n32-w2": dict(TC, dtype="bfloat16", head_dim=40, block_m=64, block_n=32,
                                  num_warps=2),  # 32 rows per warp
    "simt-v2-f32-d16": dict(loop_order="v2", dtype="float32", head_dim=16, block_m=16, block_n=16),
    "simt-v1-f16-d24": dict(loop_order="v1", dtype="float16", head_dim=24, block_m=32, block_n=16),
}  # fmt: skip
# A relative-position bias read from a bf16 table, a tanh bend of the score itself, and a
# document mask from per-key document ids (queries aligned bottom-right: query i is key i + off).
SCORE_MOD = "score + 0.5 * bias[h, q_idx, kv_idx] - 0.01 * abs(q_idx - kv_idx)"
SCORE_MOD_TANH = "where(score > 0, 2 * tanh(score / 2), score)"
MASK_MOD = "doc[b, q_idx + offset[0]] == doc[b, kv_idx]"


def _inputs(case: Case, seed: int, docs: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + 7)
    doc = np.sort(rng.integers(0, docs, (case.batch, case.seqlen_k)), axis=1).astype(np.int32)
    bias = rng.standard_normal((case.heads, case.seqlen_q, case.seqlen_k)).astype(np.float32)
    return {
        "bias": bias.astype(_bf16()),
        "doc": doc,
        "offset": np.array([case.seqlen_k - case.seqlen_q], np.int64),
    }


def _bf16():
    import ml_dtypes

    return ml_dtypes.bfloat16


def _callables(score_mod, mask_mod, inputs):
    """The reference's hooks: the float64 evaluator of each expression."""
    declared = inputs_from_arrays(inputs)
    hooks = {}
    if score_mod is not None:
        score_expression = parse_score_mod(score_mod, declared)
        hooks["score_mod"] = lambda s, b, h, q, k: evaluate(
            score_expression, score=s, b=b, h=h, q_idx=q, kv_idx=k, inputs=inputs
        )
    if mask_mod is not None:
        mask_expression = parse_mask_mod(mask_mod, declared)
        hooks["mask_mod"] = lambda b, h, q, k: evaluate(
            mask_expression, b=b, h=h, q_idx=q, kv_idx=k, inputs=inputs
        )
    return hooks


def _data(case, spec, seed, score_mod, mask_mod, inputs, variants=None):
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed)
    hooks = _callables(score_mod, mask_mod, inputs)
    ref = naive_attention(
        data.q, data.k, data.v, causal=spec.causal, scale=case.scale, mask=data.mask,
        **(variants or {}), **hooks,
    )  # fmt: skip
    return dataclasses.replace(data, ref_out=ref[0], ref_lse=ref[1])


def _spec(family, causal, score_mod, mask_mod, inputs, **extra) -> KernelSpec:
    declared = inputs_from_arrays(inputs)
    return KernelSpec(
        **{**FAMILIES[family], **extra},
        causal=causal,
        score_mod=score_mod,
        mask_mod=mask_mod,
        mod_inputs=[i.signature for i in declared],
    )


def _run(spec, case, data, score_mod, mask_mod, inputs, variants=None, **kwargs):
    expressions = {"score_mod": score_mod, "mask_mod": mask_mod, "mod_inputs": inputs}
    return run_emulated(spec, case, data, variants={**(variants or {}), **expressions}, **kwargs)


# (score_mod, mask_mod, case, causal, built-in variants)
COMBOS = [
    (SCORE_MOD, None, Case(2, 2, 1, 21, 37, mask="broadcast"), False, ()),
    (None, MASK_MOD, Case(2, 4, 2, 33, 50, layout="bshd"), True, ()),
    (SCORE_MOD, MASK_MOD, Case(1, 2, 2, 40, 40), True, ("softcap", "alibi")),
    (SCORE_MOD_TANH, MASK_MOD, Case(1, 2, 1, 29, 47), False, ("window", "sinks")),
]


def _id(combo) -> str:
    score_mod, mask_mod, case, causal, flags = combo
    parts = ["score" if score_mod else "", "mask" if mask_mod else "", str(case)]
    return "-".join(p for p in (*parts, "causal" if causal else "", *flags) if p)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("combo", COMBOS, ids=_id)
def test_expressions_match_the_float64_reference(family, combo):
    score_mod, mask_mod, case, causal, flags = combo
    inputs = _inputs(case, seed=len(family))
    spec = _spec(family, causal, score_mod, mask_mod, inputs, **dict.fromkeys(flags, True))
    variants = example_variants(flags, case.batch, case.heads, seed=3, window=(11, 4))
    data = _data(case, spec, 5, score_mod, mask_mod, inputs, variants)
    out, lse = _run(spec, case, data, score_mod, mask_mod, inputs, variants)
    assert_matches(out, lse, data, spec.dtype)
    # the expressions change the result: the same kernel checked against attention without
    # them would fail (the test can tell a kernel that ignores them)
    plain = naive_attention(
        data.q, data.k, data.v, causal=causal, scale=case.scale, mask=data.mask, **variants
    )[0]
    assert relative_error(np.asarray(out, np.float64), plain) > 0.05


@pytest.mark.parametrize("paged", [False, True])
def test_split_decode_with_packed_gqa_and_expressions(paged):
    case = Case(2, 8, 2, 3, 90)  # 3 new tokens, 4 query heads per K/V head
    inputs = _inputs(case, seed=11)
    spec = _spec(
        "tc-f16-d32-m64n16", True, SCORE_MOD, MASK_MOD, inputs,
        block_m=16, num_warps=1, pack_gqa=True, split_kv=True, paged_kv=paged,
    )  # fmt: skip
    data = _data(case, spec, 12, SCORE_MOD, MASK_MOD, inputs)
    kwargs = {"page_size": 32} if paged else {}
    out, lse = _run(spec, case, data, SCORE_MOD, MASK_MOD, inputs, num_splits=3, **kwargs)
    assert_matches(out, lse, data, spec.dtype)


# ---- block sparsity ----

DOC_MASK = "doc[b, q_idx] == doc[b, kv_idx]"


def _documents(batch: int, seqlen: int, docs: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, seqlen), (batch, docs - 1), replace=False), axis=1)
    ids = np.zeros((batch, seqlen), np.int32)
    for b in range(batch):
        for cut in cuts[b]:
            ids[b, cut:] += 1
    return ids


def _key_tiles_loaded(stats, spec) -> float:
    per_tile = spec.block_n * spec.head_dim_padded * 2 // 16  # 16-byte copies of one K tile
    return stats[spec.uri].cp_async_copies_by_arg["k"] / per_tile


@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_visits_exactly_the_listed_tiles(causal):
    case = Case(2, 2, 1, 250, 250)
    doc = np.repeat(np.arange(4, dtype=np.int32), [64, 64, 62, 60])  # 4 documents
    inputs = {"doc": np.stack([doc, doc[::-1].copy()])}
    spec = _spec("tc-f16-d32-m64n16", causal, None, DOC_MASK, inputs, block_n=32,
                 block_sparse=True)  # fmt: skip
    mask = kernelgen.block_mask(
        DOC_MASK, case.batch, 1, case.seqlen_q, case.seqlen_k, block_m=64, block_n=32,
        mod_inputs=inputs,
    )  # fmt: skip
    data = _data(case, spec, 2, None, DOC_MASK, inputs)
    stats: dict = {}
    variants = {"mask_mod": DOC_MASK, "mod_inputs": inputs, "block_mask": mask}
    out, lse = run_emulated(spec, case, data, variants=variants, stats=stats)
    assert_matches(out, lse, data, spec.dtype)
    states = mask.tile_states()  # (batch, 1, q_tiles, key_tiles): 0 hidden, 1 partial, 2 full
    q_tile = np.arange(mask.q_tiles)[:, None]
    key_tile = np.arange(mask.key_tiles)[None, :]
    reachable = (
        key_tile * 32 <= np.minimum(q_tile * 64 + 63, case.seqlen_q - 1)
        if causal
        else np.ones_like(key_tile * q_tile, bool)
    )
    expected = case.heads * int(((states[:, 0] > 0) & reachable).sum())
    assert _key_tiles_loaded(stats, spec) == expected
    every = case.batch * case.heads * mask.q_tiles * mask.key_tiles
    assert expected < every / 2  # four documents: mostly the diagonal blocks


def test_block_sparse_skips_mask_mod_on_full_tiles():
    """A block mask that calls a partly visible tile full makes the kernel attend to keys the
    mask_mod hides: full tiles are not tested per element (mutation of the lists)."""
    case = Case(1, 1, 1, 64, 64)
    inputs = {"doc": _documents(1, 64, 2, seed=3)}
    spec = _spec("tc-f16-d32-m64n16", False, None, DOC_MASK, inputs, block_sparse=True)
    good = block_mask_reference(DOC_MASK, 1, 1, 64, 64, block_m=64, block_n=16, mod_inputs=inputs)
    assert good.partial_counts[0, 0, 0] >= 1
    data = _data(case, spec, 4, None, DOC_MASK, inputs)
    variants = {"mask_mod": DOC_MASK, "mod_inputs": inputs}
    out, lse = run_emulated(spec, case, data, variants={**variants, "block_mask": good})
    assert_matches(out, lse, data, spec.dtype)
    states = good.tile_states()[0, 0, 0]
    full = np.flatnonzero(states > 0).astype(np.int32)  # every visible tile listed as full
    lists = dict(
        partial_counts=np.zeros_like(good.partial_counts),
        partial_indices=np.full_like(good.partial_indices, -1),
        full_counts=np.full_like(good.full_counts, full.size),
        full_indices=np.concatenate([full, np.full(4 - full.size, -1, np.int32)])[None, None, None],
    )
    wrong = dataclasses.replace(good, **lists)
    out, _ = run_emulated(spec, case, data, variants={**variants, "block_mask": wrong})
    assert relative_error(np.asarray(out, np.float64), data.ref_out) > 0.05


# ---- attention() ----


def test_attention_compiles_the_call_expressions_on_the_host():
    case = Case(1, 2, 1, 70, 70)
    inputs = {"doc": _documents(1, 70, 3, seed=5)}
    data = make_case(case, "float16", 32, False, 6)
    hooks = _callables(SCORE_MOD_TANH, DOC_MASK, inputs)
    ref = naive_attention(data.q, data.k, data.v, **hooks)
    data = dataclasses.replace(data, ref_out=ref[0], ref_lse=ref[1])
    q, k, v = (x.astype(np.float16) for x in (data.q, data.k, data.v))
    out, lse = kernelgen.attention(
        q, k, v, score_mod=SCORE_MOD_TANH, mask_mod=DOC_MASK, mod_inputs=inputs, return_lse=True
    )
    assert_matches(out, lse, data, "float16")
    mask = kernelgen.block_mask(DOC_MASK, 1, 1, 70, 70, block_m=64, block_n=32, mod_inputs=inputs)
    out, lse = kernelgen.attention(
        q, k, v, score_mod=SCORE_MOD_TANH, block_mask=mask, mod_inputs=inputs, return_lse=True
    )  # the block mask's mask_mod serves
    assert_matches(out, lse, data, "float16")


def _qkv():
    rng = np.random.default_rng(0)
    return [rng.standard_normal((1, 2, 40, 32)).astype(np.float16) for _ in range(3)]


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"mod_inputs": {"doc": np.zeros((1, 40), np.int32)}}, InputError, "without a score_mod"),
        ({"score_mod": 3}, InputTypeError, "score_mod has type int"),
        ({"score_mod": "score + x[q_idx]"}, InputError, "subscript"),
        ({"mask_mod": "q_idx.real > 0"}, InputError, "attribute"),
        ({"block_mask": "tiles"}, InputTypeError, "block_mask has type str"),
        ({"mask_mod": "q_idx >= 0", "mod_inputs": {"x": [1, 2]}}, InputTypeError, "x"),
        (
            {"mask_mod": "doc[b, q_idx] > 0", "mod_inputs": {"doc": np.zeros((1, 40), np.uint8)}},
            InputTypeError,
            "dtype uint8",
        ),
    ],
)
def test_bad_expression_arguments_raise_before_anything_runs(kwargs, error, words):
    q, k, v = _qkv()
    with pytest.raises(error, match=words):
        kernelgen.attention(q, k, v, **kwargs)


def test_block_mask_must_fit_the_call_and_its_mask_mod():
    q, k, v = _qkv()
    mask = block_mask_reference("q_idx >= kv_idx", 1, 1, 40, 40, block_m=64, block_n=32)
    with pytest.raises(InputError, match="block_mask was built for mask_mod"):
        kernelgen.attention(q, k, v, mask_mod="q_idx > kv_idx", block_mask=mask)
    other = block_mask_reference("q_idx >= kv_idx", 1, 1, 40, 48, block_m=64, block_n=32)
    with pytest.raises(InputError, match="seqlen_k 48"):
        kernelgen.attention(q, k, v, block_mask=other)


def test_a_spec_must_carry_the_call_expressions():
    q, k, v = _qkv()
    plain = KernelSpec(**FAMILIES["tc-f16-d32-m64n16"])
    with pytest.raises(InputError, match="mask_mod"):
        kernelgen.attention(q, k, v, spec=plain, mask_mod="q_idx >= kv_idx")
    compiled = KernelSpec(**FAMILIES["tc-f16-d32-m64n16"], mask_mod="q_idx >= kv_idx")
    with pytest.raises(InputError, match="passes none"):
        kernelgen.attention(q, k, v, spec=compiled)


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_appends_then_attends_with_expressions(paged):
    """attention_with_kvcache with a score_mod and mask_mod: kv_idx is the key's place in its
    entry's cache, b the entry (a per-entry key limit), after appending two new tokens."""
    from attention_cases import check_kvcache, kvcache_data, paged_cache

    batch, new_len, max_keys, heads, kv_heads = 3, 2, 64, 4, 2
    q, k_cache, v_cache, k_new, v_new = kvcache_data(
        batch, new_len, new_len, max_keys, heads, kv_heads, "float16", seed=21
    )
    lengths = [17, 0, 40]
    inputs = {"first": np.array([3, 0, 25], np.int32)}
    score_text = "score - 0.05 * (kv_idx % 5)"
    mask_text = "kv_idx >= first[b] or kv_idx % 4 == 0"
    hooks_of = _callables(score_text, mask_text, inputs)
    ref_out = np.zeros(q.shape)
    ref_lse = np.full((batch, heads, new_len), -np.inf)
    for b, length in enumerate(lengths):  # the concatenation, entry by entry
        keys = np.concatenate([k_cache[b, :length], k_new[b]]).transpose(1, 0, 2)[None]
        values = np.concatenate([v_cache[b, :length], v_new[b]]).transpose(1, 0, 2)[None]
        hooks = {
            "score_mod": lambda s, _b, h, i, j, b=b: hooks_of["score_mod"](s, b, h, i, j),
            "mask_mod": lambda _b, h, i, j, b=b: hooks_of["mask_mod"](b, h, i, j),
        }
        o, s = naive_attention(q[b].transpose(1, 0, 2)[None], keys, values, causal=True, **hooks)
        ref_out[b], ref_lse[b] = o[0].transpose(1, 0, 2), s[0]
    caches = {"k_cache": k_cache.astype(np.float16), "v_cache": v_cache.astype(np.float16)}
    table = None
    if paged:
        caches["k_cache"], table, _ = paged_cache(caches["k_cache"], 16, seed=1)
        caches["v_cache"], _, _ = paged_cache(caches["v_cache"], 16, seed=1)
    out, lse = kernelgen.attention_with_kvcache(
        q.astype(np.float16), caches["k_cache"], caches["v_cache"], lengths,
        block_table=table, k_new=k_new.astype(np.float16), v_new=v_new.astype(np.float16),
        causal=True, return_lse=True, score_mod=score_text, mask_mod=mask_text,
        mod_inputs=inputs,
    )  # fmt: skip
    check_kvcache(out, lse, ref_out, ref_lse, "float16")
