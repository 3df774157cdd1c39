"""The float64 backward reference: the analytic gradients of ``L = sum(out * dout)`` checked
entry by entry against central finite differences of naive_attention, for every variant."""

from __future__ import annotations

import numpy as np
import pytest

from kernelgen.references import attention as reference
from kernelgen.references.attention import (
    BackwardGrads,
    attention_backward,
    naive_attention,
    relative_error,
)

STEP = 1e-6  # central-difference step: rounding in L / (2 * STEP) costs ~1e-9 relative error
RTOL = 1e-7  # relative Frobenius error against the differences (measured: ~1e-9)


def problem(rng, b=1, h=2, hkv=1, sq=5, sk=7, d=8):
    q = rng.standard_normal((b, h, sq, d))
    k = rng.standard_normal((b, hkv, sk, d))
    v = rng.standard_normal((b, hkv, sk, d))
    dout = rng.standard_normal((b, h, sq, d))
    return dout, q, k, v


def finite_differences(loss, x: np.ndarray) -> np.ndarray:
    """dL/dx by central differences, one entry at a time (x is perturbed in place, restored)."""
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        x0 = x[idx]
        x[idx] = x0 + STEP
        hi = loss()
        x[idx] = x0 - STEP
        lo = loss()
        x[idx] = x0
        grad[idx] = (hi - lo) / (2 * STEP)
    return grad


def fd_errors(dout, q, k, v, wrt=("q", "k", "v", "sinks"), **kw) -> tuple[BackwardGrads, dict]:
    """The analytic gradients and their relative errors against finite differences."""
    grads = attention_backward(dout, q, k, v, **kw)
    fwd_kw = {name: value for name, value in kw.items() if name != "score_mod_grad"}
    inputs = {"q": q, "k": k, "v": v}
    if kw.get("sinks") is not None:
        inputs["sinks"] = fwd_kw["sinks"] = np.array(kw["sinks"], dtype=np.float64)

    def loss() -> float:
        out, _ = naive_attention(inputs["q"], inputs["k"], inputs["v"], **fwd_kw)
        return float(np.sum(out * dout))

    errors = {}
    for name, x in inputs.items():
        if name not in wrt:
            continue
        got = getattr(grads, "d" + name)
        want = finite_differences(loss, x)
        assert got.shape == x.shape
        assert np.isfinite(got).all() and np.isfinite(want).all()
        errors[name] = relative_error(got, want)
    return grads, errors


def check(dout, q, k, v, **kw) -> BackwardGrads:
    grads, errors = fd_errors(dout, q, k, v, **kw)
    assert all(isinstance(e, float) and e < RTOL for e in errors.values()), errors
    for x in (grads.dq, grads.dk, grads.dv, grads.out, grads.delta):
        assert x.dtype == np.float64 and not np.isnan(x).any()
    assert (grads.dsinks is None) == (kw.get("sinks") is None)
    return grads


def tanh_mod(s, b, h, qi, ki):
    return 2.0 * np.tanh(s / 2.0) + 0.1 * h


def tanh_mod_grad(s, b, h, qi, ki):
    return 1.0 - np.tanh(s / 2.0) ** 2


def linear_mod(s, b, h, qi, ki):
    return s * 0.5 + 0.1 * (qi - ki)


def stripes(b, h, qi, ki):
    return (qi + ki + h) % 3 != 0


CASES = {
    "plain": dict(shape=dict(b=2, h=2, hkv=2), kw={}),
    "causal_sq_lt_sk": dict(shape=dict(sq=5, sk=7), kw=dict(causal=True)),
    "gqa": dict(shape=dict(b=1, h=4, hkv=2), kw=dict(scale=0.3)),
    "mqa": dict(shape=dict(h=3, hkv=1, d=16), kw={}),
    "window": dict(shape=dict(h=2, hkv=2), kw=dict(window_size=(2, 1))),
    "window_causal": dict(shape=dict(sq=7, sk=5), kw=dict(window_size=(1, -1), causal=True)),
    "softcap": dict(shape=dict(h=2, hkv=1), kw=dict(softcap=0.8, scale=1.0)),
    "alibi_1d": dict(shape=dict(h=2), kw=dict(alibi_slopes=np.array([0.5, 0.25]))),
    "alibi_2d": dict(shape=dict(b=2, h=2), kw=dict(alibi_slopes=np.array([[0.5, 0.1], [1, 0]]))),
    "sinks": dict(shape=dict(h=4, hkv=2), kw=dict(sinks=[0.5, -1.0, 2.0, 0.0])),
    "score_mod_linear": dict(
        shape={}, kw=dict(score_mod=linear_mod, score_mod_grad=lambda s, b, h, qi, ki: 0.5)
    ),
    "score_mod_tanh": dict(
        shape=dict(h=2, hkv=2), kw=dict(score_mod=tanh_mod, score_mod_grad=tanh_mod_grad)
    ),
    "score_mod_fd_fallback": dict(shape=dict(h=2, hkv=2), kw=dict(score_mod=tanh_mod)),
    "mask_mod": dict(shape=dict(h=2), kw=dict(mask_mod=stripes)),
    "softcap_score_mod_alibi": dict(
        shape=dict(h=2),
        kw=dict(softcap=1.5, score_mod=tanh_mod, score_mod_grad=tanh_mod_grad, alibi_slopes=[1, 2]),
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_gradients_match_finite_differences(name):
    case = CASES[name]
    check(*problem(np.random.default_rng(len(name)), **case["shape"]), **case["kw"])


def test_causal_rows_that_see_no_key_have_zero_gradients():
    # Sq > Sk: rows 0 and 1 of the bottom-right aligned causal mask see no key.
    dout, q, k, v = problem(np.random.default_rng(1), h=2, hkv=1, sq=7, sk=5)
    grads = check(dout, q, k, v, causal=True)
    assert (grads.dq[:, :, :2] == 0).all() and (grads.out[:, :, :2] == 0).all()
    assert np.isneginf(grads.lse[:, :, :2]).all() and np.isfinite(grads.lse[:, :, 2:]).all()
    assert (grads.dq[:, :, 2:] != 0).all()


def test_additive_mask_with_inf_entries_and_hidden_rows():
    dout, q, k, v = problem(np.random.default_rng(2), b=2, h=2, hkv=1)
    rng = np.random.default_rng(3)
    mask = np.where(rng.random((2, 1, 5, 7)) < 0.3, -np.inf, rng.standard_normal((2, 1, 5, 7)))
    mask[0, 0, 3] = -np.inf  # batch 0's row 3 sees nothing
    mask[1, 0, :, 4] = -np.inf  # batch 1 never sees key 4
    grads = check(dout, q, k, v, mask=mask)
    assert (grads.dq[0, :, 3] == 0).all() and np.isneginf(grads.lse[0, :, 3]).all()
    assert (grads.dk[1, :, 4] == 0).all() and (grads.dv[1, :, 4] == 0).all()


def test_sinks_on_rows_that_see_no_key():
    # lse = sink and out = 0 on the empty rows; the sinks still get their gradient elsewhere.
    dout, q, k, v = problem(np.random.default_rng(4), h=2, hkv=1, sq=7, sk=5)
    sinks = np.array([0.3, -0.7])
    grads = check(dout, q, k, v, causal=True, sinks=sinks)
    np.testing.assert_array_equal(grads.lse[0, :, :2], np.repeat(sinks[:, None], 2, axis=1))
    assert (grads.dq[:, :, :2] == 0).all() and (grads.dsinks != 0).all()


def test_everything_at_once():
    dout, q, k, v = problem(np.random.default_rng(5), b=2, h=4, hkv=2, sq=7, sk=5)
    mask = np.zeros((7, 5))
    mask[4, 1] = -np.inf
    mask[5] = 0.25
    check(
        dout,
        q,
        k,
        v,
        causal=True,
        window_size=(3, -1),
        softcap=2.0,
        alibi_slopes=np.full((2, 4), 0.3),
        sinks=np.array([0.0, 1.0, -1.0, 0.5]),
        mask=mask,
        score_mod=linear_mod,
        score_mod_grad=lambda s, b, h, qi, ki: 0.5,
        mask_mod=stripes,
    )


def test_per_sequence_key_lengths():
    dout, q, k, v = problem(np.random.default_rng(6), b=2, h=2, hkv=1, sq=3, sk=7)
    grads = check(
        dout,
        q,
        k,
        v,
        seqlens_k=[7, 4],
        causal=True,
        alibi_slopes=[[0.5, 1], [0.2, 0]],
        sinks=[1, 2],
    )
    assert (grads.dk[1, :, 4:] == 0).all() and (grads.dv[1, :, 4:] == 0).all()


def test_score_mod_that_hides_keys_gives_no_nan():
    # score_mod returning -inf hides key 0; the central-difference fallback gives NaN there,
    # which must not reach the gradients.
    dout, q, k, v = problem(np.random.default_rng(7))
    grads = check(dout, q, k, v, score_mod=lambda s, b, h, qi, ki: np.where(ki == 0, -np.inf, s))
    assert (grads.dk[:, :, 0] == 0).all() and (grads.dv[:, :, 0] == 0).all()


def test_score_mod_fallback_agrees_with_its_derivative():
    dout, q, k, v = problem(np.random.default_rng(8), b=2, h=2, hkv=2)
    exact = attention_backward(
        dout, q, k, v, softcap=1.0, score_mod=tanh_mod, score_mod_grad=tanh_mod_grad
    )
    fallback = attention_backward(dout, q, k, v, softcap=1.0, score_mod=tanh_mod)
    assert relative_error(fallback.dq, exact.dq) < 1e-9
    assert relative_error(fallback.dk, exact.dk) < 1e-9


def test_delta_out_and_lse_are_the_forwards():
    dout, q, k, v = problem(np.random.default_rng(9), b=2, h=4, hkv=2)
    kw = dict(causal=True, sinks=np.array([0.1, 0.2, 0.3, 0.4]), softcap=3.0)
    grads = attention_backward(dout, q, k, v, **kw)
    out, lse = naive_attention(q, k, v, **kw)
    np.testing.assert_allclose(grads.out, out, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(grads.lse, lse, rtol=1e-13)
    np.testing.assert_allclose(grads.delta, np.sum(dout * out, axis=-1), rtol=1e-12, atol=1e-15)
    assert grads.dsinks.shape == (4,) and attention_backward(dout, q, k, v).dsinks is None


def test_a_dropped_softcap_factor_is_detected(monkeypatch):
    dout, q, k, v = problem(np.random.default_rng(10))
    monkeypatch.setattr(reference, "_softcap_grad", lambda raw, c: np.ones_like(raw))
    _, errors = fd_errors(dout, q, k, v, wrt=("q",), softcap=0.8, scale=1.0)
    assert errors["q"] > 1e-2


def test_a_wrong_score_mod_grad_is_detected():
    dout, q, k, v = problem(np.random.default_rng(11))
    wrong = dict(score_mod=tanh_mod, score_mod_grad=lambda s, b, h, qi, ki: 1.0)
    _, errors = fd_errors(dout, q, k, v, wrt=("k",), scale=1.0, **wrong)
    assert errors["k"] > 1e-2


def test_input_checks():
    dout, q, k, v = problem(np.random.default_rng(12))
    with pytest.raises(ValueError, match="dout"):
        attention_backward(dout[:, :, 1:], q, k, v)
    with pytest.raises(ValueError, match="score_mod_grad"):
        attention_backward(dout, q, k, v, score_mod_grad=tanh_mod_grad)
    kv = np.zeros((1, 2, 7, 8))  # 2 kv heads do not divide 3 query heads
    with pytest.raises(ValueError, match="kv heads"):
        attention_backward(dout[:, :1].repeat(3, axis=1), q[:, :1].repeat(3, axis=1), kv, kv)


def test_the_out_a_backward_is_given_enters_only_d():
    """attention_backward(out=): the gradients of the out a backward kernel got (its rounding),
    through D_i = dout_i . out_i alone: dv is out's own, dS = P (dP - D) moves by -P dD, and
    dsinks = -sum P_sink D."""
    rng = np.random.default_rng(11)
    q, dout = rng.standard_normal((2, 1, 2, 6, 8))
    k, v = rng.standard_normal((2, 1, 1, 9, 8))
    sinks = rng.standard_normal(2)
    exact = attention_backward(dout, q, k, v, causal=True, sinks=sinks)
    same = attention_backward(dout, q, k, v, causal=True, sinks=sinks, out=exact.out)
    for name in ("dq", "dk", "dv", "dsinks", "delta"):
        np.testing.assert_array_equal(getattr(same, name), getattr(exact, name))
    given = exact.out + 1e-3 * rng.standard_normal(exact.out.shape)
    moved = attention_backward(dout, q, k, v, causal=True, sinks=sinks, out=given)
    np.testing.assert_allclose(moved.delta, np.einsum("bhid,bhid->bhi", dout, given), rtol=1e-14)
    np.testing.assert_array_equal(moved.dv, exact.dv)
    np.testing.assert_array_equal(moved.out, exact.out)  # out stays the forward's
    p_sink = np.exp(sinks[None, :, None] - exact.lse)
    np.testing.assert_allclose(moved.dsinks, -(p_sink * moved.delta).sum(axis=(0, 2)), rtol=1e-12)
    assert np.abs(moved.dq - exact.dq).max() > 1e-6  # D enters dq
    with pytest.raises(ValueError, match="out: shape"):
        attention_backward(dout, q, k, v, out=given[:, :, :-1])
