"""The float64 reference's attention variants (window, softcap, ALiBi, sinks and the score_mod /
mask_mod hooks) against a row-by-row formula written from docs/variants.md, and every streaming
model against the naive one with the variants on."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kernelgen.references.attention import (
    combine_partials,
    naive_attention,
    online_softmax_attention,
    relative_error,
    split_kv,
    split_kv_partials,
    tiled_v1,
    tiled_v2,
)

TIGHT = 1e-12


def formula(q, k, v, *, causal=False, scale=None, mask=None, window_size=(-1, -1), softcap=None,
            alibi_slopes=None, sinks=None, score_mod=None, mask_mod=None):  # fmt: skip
    """Row by row in Python floats: s = scale q.k, softcap, score_mod, ALiBi, mask; visible iff
    inside the window (causal: right <= 0) and mask_mod; the sink joins the denominator."""
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    offset = sk - sq
    left, right = window_size
    out = np.zeros((b, h, sq, d))
    lse = np.full((b, h, sq), -np.inf)
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // hkv)
            for i in range(sq):
                terms = []  # (score, value row or None for the sink)
                for j in range(sk):
                    if left >= 0 and j < i + offset - left:
                        continue
                    if right >= 0 and j > i + offset + right:
                        continue
                    if causal and j > i + offset:
                        continue
                    if mask_mod is not None and not mask_mod(bi, hi, i, j):
                        continue
                    s = scale * math.fsum(
                        float(q[bi, hi, i, c] * k[bi, kh, j, c]) for c in range(d)
                    )
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    if score_mod is not None:
                        s = float(score_mod(s, bi, hi, i, j))
                    if alibi_slopes is not None:
                        slopes = np.broadcast_to(alibi_slopes, (b, h))
                        s -= float(slopes[bi, hi]) * abs(i + offset - j)
                    if mask is not None:
                        s += float(np.broadcast_to(mask, (b, h, sq, sk))[bi, hi, i, j])
                    if s != -math.inf:
                        terms.append((s, v[bi, kh, j]))
                if sinks is not None:
                    terms.append((float(sinks[hi]), None))
                if not terms:
                    continue
                top = max(s for s, _ in terms)
                weights = [(math.exp(s - top), row) for s, row in terms]
                total = math.fsum(w for w, _ in weights)
                for c in range(d):
                    out[bi, hi, i, c] = (
                        math.fsum(w * row[c] for w, row in weights if row is not None) / total
                    )
                lse[bi, hi, i] = top + math.log(total)
    return out, lse


def problem(rng, b=2, h=4, hkv=2, sq=11, sk=19, d=8):
    return (
        rng.standard_normal((b, h, sq, d)),
        rng.standard_normal((b, hkv, sk, d)),
        rng.standard_normal((b, hkv, sk, d)),
    )


def assert_close(got, want):
    out, lse = got
    ref_out, ref_lse = want
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert relative_error(out, ref_out) < TIGHT
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=0, atol=1e-12)


def _slopes(rng, shape):
    return rng.uniform(0.05, 0.8, size=shape)


VARIANTS = {
    "window-both": dict(window_size=(3, 2)),
    "window-left": dict(window_size=(4, -1)),
    "window-right": dict(window_size=(-1, 1)),
    "window-zero": dict(window_size=(0, 0)),  # the diagonal key only
    "window-causal": dict(window_size=(5, 3), causal=True),  # causal narrows right to 0
    "causal-as-window": dict(window_size=(-1, 0)),
    "softcap": dict(softcap=2.5),
    "alibi-h": dict(alibi_slopes="h"),
    "alibi-bh": dict(alibi_slopes="bh"),
    "sinks": dict(sinks=True),
    "all": dict(window_size=(6, 1), softcap=3.0, alibi_slopes="bh", sinks=True, mask=True),
    "mods": dict(
        softcap=4.0,
        score_mod=True,
        mask_mod=True,
        alibi_slopes="h",
    ),
}


def _materialize(rng, spec, b, h, sq, sk):
    kw = dict(spec)
    if kw.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = _slopes(rng, (h,))
    elif kw.get("alibi_slopes") == "bh":
        kw["alibi_slopes"] = _slopes(rng, (b, h))
    if kw.get("sinks"):
        kw["sinks"] = rng.standard_normal(h) * 2
    if kw.get("mask"):
        mask = rng.standard_normal((1, h, sq, sk))
        mask[0, 1, 2, :] = -np.inf  # a row the mask hides entirely
        kw["mask"] = mask
    return kw


@pytest.mark.parametrize("name", list(VARIANTS))
def test_naive_matches_the_formula(name):
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    q, k, v = problem(rng)
    kw = _materialize(rng, VARIANTS[name], 2, 4, 11, 19)
    vector_kw, scalar_kw = dict(kw), dict(kw)
    if kw.get("score_mod"):  # the hooks: vectorized for the models, scalar for the formula
        vector_kw["score_mod"] = lambda s, b, h, i, j: s + 0.1 * h - 0.05 * np.abs(i - j)
        scalar_kw["score_mod"] = lambda s, b, h, i, j: s + 0.1 * h - 0.05 * abs(i - j)
    if kw.get("mask_mod"):
        vector_kw["mask_mod"] = lambda b, h, i, j: (i + j + b) % 3 != 0
        scalar_kw["mask_mod"] = lambda b, h, i, j: (i + j + b) % 3 != 0
    want = formula(q, k, v, **scalar_kw)
    assert_close(naive_attention(q, k, v, **vector_kw), want)
    assert_close(online_softmax_attention(q, k, v, **vector_kw), want)
    for bm, bn in ((4, 4), (3, 8), (16, 5)):
        assert_close(tiled_v1(q, k, v, block_m=bm, block_n=bn, **vector_kw), want)
        assert_close(tiled_v2(q, k, v, block_m=bm, block_n=bn, **vector_kw), want)
    assert_close(split_kv(q, k, v, num_splits=3, **vector_kw), want)


def test_window_rows_that_see_no_key_give_zero_and_minus_infinity():
    rng = np.random.default_rng(0)
    q, k, v = problem(rng, sq=9, sk=4)  # offset -5: row i sees keys i - 7 .. i - 5
    out, lse = naive_attention(q, k, v, window_size=(2, 0))
    assert np.isneginf(lse[:, :, :5]).all() and (out[:, :, :5] == 0).all()
    assert np.isfinite(lse[:, :, 5:]).all()


def test_sinks_join_the_denominator_only():
    """out = sum e^s v / (e^sink + sum e^s), lse = log(e^sink + sum e^s); rows that see no key
    give out 0 and lse = sink."""
    rng = np.random.default_rng(1)
    q, k, v = problem(rng, b=1, h=2, hkv=1, sq=6, sk=3)
    sinks = np.array([0.7, -1.3])
    plain_out, plain_lse = naive_attention(q, k, v, causal=True)
    out, lse = naive_attention(q, k, v, causal=True, sinks=sinks)
    seen = np.isfinite(plain_lse)
    assert not seen.all()  # causal with Sq > Sk: the first rows see no key
    total = np.logaddexp(plain_lse, sinks[None, :, None])
    np.testing.assert_allclose(lse, total, rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        out, plain_out * np.exp(np.where(seen, plain_lse, 0) - total)[..., None], atol=1e-12
    )
    assert (out[~seen] == 0).all()
    # no keys at all: out 0, lse = sink, in every model
    for model in (naive_attention, online_softmax_attention):
        out, lse = model(q, k[:, :, :0], v[:, :, :0], sinks=sinks)
        assert (out == 0).all() and (lse == sinks[None, :, None]).all()


def test_split_partials_with_a_window_and_sinks_combine_to_the_whole():
    rng = np.random.default_rng(2)
    q, k, v = problem(rng, b=2, h=2, hkv=1, sq=1, sk=100)
    kw = dict(window_size=(37, -1), softcap=5.0)
    sinks = np.array([0.2, 3.0])
    partials = split_kv_partials(q, k, v, num_splits=4, block_n=8, **kw)
    # the window's keys 62..99: tiles 7..12, dealt out two per chunk (the fourth chunk is empty)
    assert np.isneginf(partials[3][1]).all() and np.isfinite(partials[0][1]).all()
    assert_close(combine_partials(partials, sinks), naive_attention(q, k, v, sinks=sinks, **kw))


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(window_size=(-2, 0)), "window_size"),
        (dict(window_size=(1,)), "window_size"),
        (dict(window_size=(1.5, 0)), "window_size"),
        (dict(softcap=0.0), "softcap"),
        (dict(softcap=-1.0), "softcap"),
        (dict(softcap=math.inf), "softcap"),
        (dict(alibi_slopes=np.ones(3)), "alibi_slopes"),
        (dict(sinks=np.ones((1, 4))), "sinks"),
    ],
)
def test_bad_variants_name_the_argument(kw, words):
    rng = np.random.default_rng(3)
    q, k, v = problem(rng)
    with pytest.raises(ValueError, match=words):
        naive_attention(q, k, v, **kw)
