"""The float64 reference models: checked against a brute-force formula, each other, and the
monoid laws, so that the kernels' oracle is itself trustworthy."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kernelgen.references.attention import (
    SoftmaxState,
    combine,
    combine_partials,
    finalize,
    identity_state,
    naive_attention,
    online_softmax_attention,
    relative_error,
    split_kv,
    split_kv_partials,
    tile_state,
    tiled_v1,
    tiled_v2,
)

TIGHT = 1e-12  # every model is float64 and differs from the others only in summation order


def brute_force(q, k, v, *, causal=False, scale=None, mask=None):
    """Row by row in plain Python floats: the textbook formula, no vectorization, no tiling."""
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b, h, sq, d))
    lse = np.full((b, h, sq), -np.inf)
    full_mask = None if mask is None else np.broadcast_to(mask, (b, h, sq, sk))
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // hkv)
            for i in range(sq):
                scores = []
                for j in range(sk):
                    if causal and j > i + sk - sq:
                        continue
                    s = scale * math.fsum(
                        float(q[bi, hi, i, c] * k[bi, kh, j, c]) for c in range(d)
                    )
                    if full_mask is not None:
                        s += float(full_mask[bi, hi, i, j])
                    if s != -math.inf:
                        scores.append((s, j))
                if not scores:
                    continue
                top = max(s for s, _ in scores)
                weights = [(math.exp(s - top), j) for s, j in scores]
                total = math.fsum(w for w, _ in weights)
                for c in range(d):
                    out[bi, hi, i, c] = math.fsum(w * v[bi, kh, j, c] for w, j in weights) / total
                lse[bi, hi, i] = top + math.log(total)
    return out, lse


def random_problem(rng, b=2, h=4, hkv=2, sq=13, sk=21, d=8):
    q = rng.standard_normal((b, h, sq, d))
    k = rng.standard_normal((b, hkv, sk, d))
    v = rng.standard_normal((b, hkv, sk, d))
    return q, k, v


def assert_close(got, want, tol=TIGHT):
    out, lse = got
    ref_out, ref_lse = want
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert relative_error(out, ref_out) < tol
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)  # -inf exactly where no key is seen
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=tol, atol=tol)


def all_models(q, k, v, block_m, block_n, num_splits, **kw):
    return {
        "naive": naive_attention(q, k, v, **kw),
        "online": online_softmax_attention(q, k, v, **kw),
        "v1": tiled_v1(q, k, v, block_m=block_m, block_n=block_n, **kw),
        "v2": tiled_v2(q, k, v, block_m=block_m, block_n=block_n, **kw),
        "split": split_kv(q, k, v, num_splits=num_splits, **kw),
    }


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("sq", "sk"), [(13, 21), (21, 13), (1, 9), (16, 16)])
def test_naive_matches_brute_force(causal, sq, sk):
    rng = np.random.default_rng(sq * 100 + sk)
    q, k, v = random_problem(rng, b=1, h=2, hkv=1, sq=sq, sk=sk, d=5)
    mask = np.where(rng.random((1, 1, sq, sk)) < 0.2, -np.inf, rng.standard_normal((1, 1, sq, sk)))
    for m in (None, mask):
        assert_close(
            naive_attention(q, k, v, causal=causal, mask=m),
            brute_force(q, k, v, causal=causal, mask=m),
        )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("sq", "sk"), [(13, 21), (21, 13), (1, 40), (32, 32), (5, 1)])
@pytest.mark.parametrize(("block_m", "block_n", "num_splits"), [(4, 8, 3), (16, 4, 7), (1, 1, 1)])
def test_streaming_models_match_naive(causal, sq, sk, block_m, block_n, num_splits):
    rng = np.random.default_rng(7 + sq + 3 * sk)
    q, k, v = random_problem(rng, sq=sq, sk=sk)
    models = all_models(q, k, v, block_m, block_n, num_splits, causal=causal, scale=0.7)
    for got in models.values():
        assert_close(got, models["naive"])


def test_mask_broadcast_and_fully_masked_rows():
    rng = np.random.default_rng(3)
    q, k, v = random_problem(rng, sq=6, sk=10)
    mask = np.zeros((1, 4, 6, 10))
    mask[:, :, 2, :] = -np.inf  # row 2 of every head sees nothing
    mask[:, 1, :, ::2] = -np.inf  # head 1 sees only odd keys
    want = brute_force(q, k, v, mask=mask)
    for name, got in all_models(q, k, v, 4, 3, 4, mask=mask).items():
        assert_close(got, want)
        out, lse = got
        assert (out[:, :, 2] == 0).all() and np.isneginf(lse[:, :, 2]).all(), name


def test_causal_with_more_queries_than_keys_hides_leading_rows():
    # Bottom-right alignment: query i sees keys j <= i + (Sk - Sq); with Sq = 9, Sk = 4 the
    # first 5 rows see no key at all and must give out = 0, lse = -inf (not NaN).
    rng = np.random.default_rng(4)
    q, k, v = random_problem(rng, sq=9, sk=4)
    for name, (out, lse) in all_models(q, k, v, 2, 2, 3, causal=True).items():
        assert (out[:, :, :5] == 0).all() and np.isneginf(lse[:, :, :5]).all(), name
        assert np.isfinite(lse[:, :, 5:]).all(), name


@pytest.mark.parametrize("magnitude", [1e2, 1e4])
def test_extreme_scores_do_not_overflow(magnitude):
    # One key scores `magnitude` above all others: out is exactly its value row, lse its score.
    sq, sk, d = 5, 12, 4
    q = np.ones((1, 1, sq, d))
    k = np.zeros((1, 1, sk, d))
    k[0, 0, 7] = magnitude / d  # score of key 7 = magnitude (scale 1), every other score = 0
    v = np.random.default_rng(5).standard_normal((1, 1, sk, d))
    top_value = np.broadcast_to(v[0, 0, 7], (sq, d))
    for name, (out, lse) in all_models(q, k, v, 2, 5, 3, scale=1.0).items():
        np.testing.assert_allclose(out[0, 0], top_value, rtol=0, atol=1e-30, err_msg=name)
        np.testing.assert_allclose(lse, magnitude, rtol=1e-15, err_msg=name)
    # And the very negative direction: -magnitude everywhere but key 7 changes nothing either.
    mask = np.full((1, 1, sq, sk), -magnitude)
    mask[..., 7] = 0.0
    for name, (out, lse) in all_models(q, np.zeros_like(k), v, 3, 4, 2, mask=mask).items():
        np.testing.assert_allclose(out[0, 0], top_value, rtol=0, atol=1e-30, err_msg=name)
        assert np.all(np.abs(lse) < 1e-30), name


def test_fp16_overflow_regime_and_shift_invariance():
    # Scores around 80 overflow e^x in fp16 (max 65504 = e^11.09) and fp32 (e^88.7) unless the
    # max is subtracted; a constant shift c of every score leaves out unchanged and moves lse by c.
    rng = np.random.default_rng(6)
    q, k, v = random_problem(rng, sq=7, sk=30)
    base = all_models(q, k, v, 4, 8, 5)
    for shift in (80.0, 700.0, -700.0):
        mask = np.full((1, 1, 1, 30), shift)
        for name, (out, lse) in all_models(q, k, v, 4, 8, 5, mask=mask).items():
            ref_out, ref_lse = base[name]
            assert relative_error(out, ref_out) < TIGHT, name
            np.testing.assert_allclose(lse - shift, ref_lse, atol=1e-10)


def test_non_finite_inputs_propagate_nan():
    rng = np.random.default_rng(8)
    q, k, v = random_problem(rng, b=1, h=1, hkv=1, sq=3, sk=5)
    v[0, 0, 2, 1] = np.nan
    for name, (out, _) in all_models(q, k, v, 2, 2, 2).items():
        assert np.isnan(out[0, 0, :, 1]).all(), name  # every row reads key 2 -> NaN in column 1
        assert np.isfinite(out[0, 0, :, 0]).all(), name


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 20, 21, 40])
def test_split_count_does_not_change_the_result(num_splits):
    # More splits than keys makes empty chunks, which must act as the identity.
    rng = np.random.default_rng(9)
    q, k, v = random_problem(rng, sq=1, sk=20, h=8, hkv=1)
    assert_close(split_kv(q, k, v, num_splits=num_splits), naive_attention(q, k, v))


# ---- split-KV in the kernels' form: (out, lse) partials over key tiles, LSE combine ---------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("num_splits", "block_n"), [(1, 4), (3, 4), (7, 2), (64, 8), (5, 1)])
def test_partials_combine_to_naive(causal, num_splits, block_n):
    rng = np.random.default_rng(num_splits * 10 + block_n)
    q, k, v = random_problem(rng, sq=3, sk=37, h=8, hkv=2)
    mask = rng.standard_normal((1, 8, 3, 37))
    mask[..., ::4] = -np.inf
    kw = {"causal": causal, "scale": 0.6, "mask": mask}
    partials = split_kv_partials(q, k, v, num_splits=num_splits, block_n=block_n, **kw)
    assert len(partials) == num_splits
    assert_close(combine_partials(partials), naive_attention(q, k, v, **kw))


@settings(max_examples=40, deadline=None)
@given(num_splits=st.integers(1, 40), block_n=st.integers(1, 16), seed=st.integers(0, 2**16))
def test_combine_does_not_depend_on_split_count_or_order(num_splits, block_n, seed):
    rng = np.random.default_rng(seed)
    q, k, v = random_problem(rng, b=1, sq=2, sk=int(rng.integers(1, 60)), h=4, hkv=1)
    partials = split_kv_partials(q, k, v, num_splits=num_splits, block_n=block_n)
    order = rng.permutation(len(partials))
    shuffled = combine_partials([partials[i] for i in order])
    assert_close(shuffled, naive_attention(q, k, v))


def test_empty_chunks_are_the_identity():
    rng = np.random.default_rng(4)
    q, k, v = random_problem(rng, sq=2, sk=5, h=2, hkv=2)
    partials = split_kv_partials(q, k, v, num_splits=8, block_n=1)  # chunks 5..7 hold no key
    for out, lse in partials[5:]:
        assert np.all(out == 0.0) and np.all(np.isneginf(lse))
    exact = combine_partials(partials[:5])
    padded = combine_partials([partials[6], *partials[:3], partials[5], *partials[3:5]])
    for a, b in zip(exact, padded, strict=True):
        assert np.array_equal(a, b)  # the identity leaves every bit alone


def test_chunks_whose_keys_are_all_masked_are_the_identity():
    rng = np.random.default_rng(5)
    q, k, v = random_problem(rng, b=1, sq=2, sk=12, h=2, hkv=2)
    mask = np.zeros((1, 2, 2, 12))
    mask[..., 4:8] = -np.inf  # chunk 1 of 3 sees nothing
    out1, lse1 = split_kv_partials(q, k, v, num_splits=3, block_n=4, mask=mask)[1]
    assert np.all(out1 == 0.0) and np.all(np.isneginf(lse1))
    partials = split_kv_partials(q, k, v, num_splits=3, block_n=4, mask=mask)
    assert_close(combine_partials(partials), naive_attention(q, k, v, mask=mask))


@pytest.mark.parametrize("causal", [False, True])
def test_seqlens_k_reads_each_sequence_prefix(causal):
    rng = np.random.default_rng(6)
    q, k, v = random_problem(rng, b=4, sq=3, sk=9, h=4, hkv=2)
    mask = rng.standard_normal((4, 1, 3, 9))
    lengths = [0, 1, 9, 5]
    out, lse = naive_attention(q, k, v, causal=causal, mask=mask, seqlens_k=lengths)
    for b, n in enumerate(lengths):
        ref = brute_force(
            q[b : b + 1],
            k[b : b + 1, :, :n],
            v[b : b + 1, :, :n],
            causal=causal,
            mask=mask[b : b + 1, :, :, :n],
        )
        assert_close((out[b : b + 1], lse[b : b + 1]), ref)
    assert np.all(out[0] == 0.0) and np.all(np.isneginf(lse[0]))  # no key: out 0, lse -inf


# ---- the attention monoid ------------------------------------------------------------------


scores_strategy = hnp.arrays(
    np.float64,
    st.tuples(st.just(3), st.integers(0, 6)),
    elements=st.one_of(st.floats(-50, 50, allow_nan=False), st.just(-np.inf), st.floats(-1e4, 1e4)),
)


def _state_from(scores, seed):
    values = np.random.default_rng(seed).standard_normal((scores.shape[-1], 4))
    return tile_state(scores, values)


def _assert_same_state(a: SoftmaxState, b: SoftmaxState):
    out_a, lse_a = finalize(a)
    out_b, lse_b = finalize(b)
    np.testing.assert_allclose(out_a, out_b, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse_a), np.isneginf(lse_b))
    finite = np.isfinite(lse_a)
    np.testing.assert_allclose(lse_a[finite], lse_b[finite], rtol=1e-12, atol=1e-12)


@settings(max_examples=200, deadline=None)
@given(scores_strategy, scores_strategy, scores_strategy, st.integers(0, 2**32 - 1))
def test_combine_is_associative_and_commutative(s1, s2, s3, seed):
    a, b, c = (_state_from(s, seed + i) for i, s in enumerate((s1, s2, s3)))
    _assert_same_state(combine(combine(a, b), c), combine(a, combine(b, c)))
    _assert_same_state(combine(a, b), combine(b, a))


@settings(max_examples=100, deadline=None)
@given(scores_strategy, st.integers(0, 2**32 - 1))
def test_identity_is_a_two_sided_unit(s, seed):
    a = _state_from(s, seed)
    e = identity_state((3,), 4)
    for got in (combine(e, a), combine(a, e)):
        np.testing.assert_array_equal(got.m, a.m)
        np.testing.assert_array_equal(got.l, a.l)
        np.testing.assert_array_equal(got.o, a.o)
    ee = combine(e, e)
    assert np.isneginf(ee.m).all() and (ee.l == 0).all() and (ee.o == 0).all()


@settings(max_examples=100, deadline=None)
@given(scores_strategy, st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_concatenated_keys_equal_combined_states(s, cut, seed):
    # The homomorphism the tiled kernels rely on: state(keys[:c] ++ keys[c:]) = a . b.
    values = np.random.default_rng(seed).standard_normal((s.shape[-1], 4))
    c = min(cut, s.shape[-1])
    whole = tile_state(s, values)
    parts = combine(tile_state(s[:, :c], values[:c]), tile_state(s[:, c:], values[c:]))
    _assert_same_state(whole, parts)


# ---- errors and helpers --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"k": np.zeros((1, 3, 4, 8)), "v": np.zeros((1, 3, 4, 8))}, "kv heads 3 must divide"),
        ({"v": np.zeros((1, 2, 5, 8))}, "v: shape"),
        ({"q": np.zeros((4, 8))}, "q: expected rank 4"),
        ({"scale": float("nan")}, "scale: must be finite"),
        ({"mask": np.zeros((2, 4, 4), dtype=bool)}, "mask: must be an additive float"),
        ({"mask": np.full((1, 1, 1, 4), np.inf)}, "no NaN, no \\+inf"),
        ({"mask": np.zeros((3, 4))}, "does not broadcast"),
    ],
)
def test_bad_inputs_name_the_argument(kwargs, message):
    args = {"q": np.zeros((1, 4, 4, 8)), "k": np.zeros((1, 2, 4, 8)), "v": np.zeros((1, 2, 4, 8))}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        naive_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_block_sizes_must_be_positive_integers(bad):
    q = np.zeros((1, 1, 2, 8))
    with pytest.raises(ValueError, match="block_m"):
        tiled_v2(q, q, q, block_m=bad, block_n=2)
    with pytest.raises(ValueError, match="num_splits"):
        split_kv(q, q, q, num_splits=bad)


def test_relative_error():
    ref = np.array([3.0, 4.0])
    assert relative_error(ref, ref) == 0.0
    assert relative_error(np.array([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert relative_error(np.array([0.0, 2.0]), np.zeros(2)) == 2.0
    with pytest.raises(ValueError, match="shape"):
        relative_error(np.zeros(3), ref)
