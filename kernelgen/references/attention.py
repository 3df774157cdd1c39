"""Float64 NumPy reference models of attention, used to check the generated kernels.

All models compute ``out = softmax(scale * Q K^T + M) V`` row-wise over the keys and also
return ``lse``, the natural log of the softmax denominator (the log-sum-exp of the visible
scores). Shapes: ``q`` is (B, H, Sq, D); ``k`` and ``v`` are (B, Hkv, Sk, D) with
``H % Hkv == 0`` (GQA/MQA: query head ``h`` reads kv head ``h // (H // Hkv)``). With
``causal=True`` key ``j`` is visible to query ``i`` iff ``j <= i + (Sk - Sq)`` (bottom-right
aligned, as in FlashAttention 2.1+). ``mask`` is an optional additive float array that
broadcasts to (B, H, Sq, Sk); ``-inf`` entries hide keys. A row that sees no key gives
``out = 0`` and ``lse = -inf``, never NaN.

The built-in variants (docs/variants.md) are keyword arguments of every model, with
``offset = Sk - Sq`` and ``s_ij = scale * q_i . k_j``:

* ``window_size=(left, right)``: key ``j`` is visible to query ``i`` iff
  ``i + offset - left <= j <= i + offset + right``; ``-1`` leaves that side unbounded.
  ``causal=True`` further limits ``right`` to 0 (causal alone is the window ``(-1, 0)``).
* ``softcap=c``: ``s <- c * tanh(s / c)``, first.
* ``alibi_slopes`` of shape (H,) or (B, H): ``s <- s - slope * |i + offset - j|``.
* ``sinks`` of shape (H,): a logit per head that joins the softmax denominator only; the lse
  includes it, and a row that sees no key gives ``out = 0`` and ``lse = sink``.

Scores are transformed in the order softcap, ``score_mod``, ALiBi, additive ``mask``, and then
hidden by the window/causal rule and ``mask_mod``. ``score_mod(score, b, h, q_idx, kv_idx)``
and ``mask_mod(b, h, q_idx, kv_idx)`` are the hooks of user expressions: NumPy callables over
broadcastable index arrays, returning the new scores and the visible keys (bool).

The models:

* :func:`naive_attention` - the direct formula over the full score matrix.
* :func:`online_softmax_attention` - one key at a time with the online-softmax recurrence.
* :func:`tiled_v1` - FlashAttention-1 loop order (K/V tiles outside, Q tiles inside).
* :func:`tiled_v2` - FlashAttention-2 loop order (Q tiles outside, K/V tiles inside).
* :func:`split_kv` - the split-KV (flash-decoding) model: partial states folded at the end.
* :func:`attention_backward` - the backward pass: the analytic gradients of
  ``sum(out * dout)`` with respect to q, k, v and the sinks (:class:`BackwardGrads`).

The streaming models are all built on the attention monoid of partial softmax states
``(o, l, m)`` (:class:`SoftmaxState`, :func:`combine`, :func:`identity_state`): the state of
a set of keys with scores ``x_j`` and values ``v_j`` is ``m = max x_j``,
``l = sum e^{x_j - m}``, ``o = sum e^{x_j - m} v_j``; :func:`finalize` turns it into
``(out, lse) = (o / l, m + log l)``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "BackwardGrads",
    "SoftmaxState",
    "Variants",
    "attention_backward",
    "combine",
    "combine_partials",
    "finalize",
    "grad_mismatches",
    "identity_state",
    "mismatches",
    "naive_attention",
    "online_softmax_attention",
    "relative_error",
    "split_kv",
    "split_kv_partials",
    "tile_state",
    "tiled_v1",
    "tiled_v2",
]


# --------------------------------------------------------------------------------------------
# The attention monoid
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class SoftmaxState:
    """A partial softmax state: ``o`` (..., D), ``l`` (...) and ``m`` (...), all float64.

    ``m`` is the running max of the scores seen, ``l`` the sum of ``e^{x - m}`` and ``o`` the
    sum of ``e^{x - m} v``. The identity (no keys seen) is ``(0, 0, -inf)``.
    """

    o: np.ndarray
    l: np.ndarray  # noqa: E741 - the paper's name for the running denominator
    m: np.ndarray


def identity_state(shape: tuple[int, ...], head_dim: int) -> SoftmaxState:
    """The identity state ``(0, 0, -inf)`` for rows of shape ``shape`` and head dim ``head_dim``."""
    shape = tuple(shape)
    return SoftmaxState(
        o=np.zeros((*shape, head_dim), dtype=np.float64),
        l=np.zeros(shape, dtype=np.float64),
        m=np.full(shape, -np.inf, dtype=np.float64),
    )


def _rescale_factors(m1: np.ndarray, m2: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(m, a, b)`` with ``m = max(m1, m2)``, ``a = e^{m1 - m}``, ``b = e^{m2 - m}``.

    Where both maxima are ``-inf`` (two empty states) ``a = b = 0`` instead of
    ``e^{-inf - -inf} = NaN``, so the identity stays the identity.
    """
    m = np.maximum(m1, m2)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    return m, np.exp(m1 - m_safe), np.exp(m2 - m_safe)


def combine(a: SoftmaxState, b: SoftmaxState) -> SoftmaxState:
    """The monoid product ``a . b``: both states rescaled to the common max and summed.

    ``(o1, l1, m1) . (o2, l2, m2) = (s1 o1 + s2 o2, s1 l1 + s2 l2, m)`` with
    ``m = max(m1, m2)``, ``s1 = e^{m1 - m}``, ``s2 = e^{m2 - m}``. This is the one place the
    rescaling logic lives; every streaming model folds its states with it.
    """
    m, s1, s2 = _rescale_factors(a.m, b.m)
    return SoftmaxState(
        o=s1[..., None] * a.o + s2[..., None] * b.o,
        l=s1 * a.l + s2 * b.l,
        m=m,
    )


def tile_state(scores: np.ndarray, values: np.ndarray) -> SoftmaxState:
    """The state of a block of keys: ``scores`` (..., n) and ``values`` (..., n, D).

    ``values`` broadcasts against ``scores`` over the leading axes. Rows whose scores are all
    ``-inf`` (and every row when ``n == 0``) give the identity.
    """
    scores = np.asarray(scores, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    if values.ndim < 2 or values.shape[-2] != scores.shape[-1]:
        raise ValueError(
            f"values: expected shape (..., n, D) with n = scores.shape[-1] = {scores.shape[-1]},"
            f" got {values.shape}"
        )
    lead = np.broadcast_shapes(scores.shape[:-1], values.shape[:-2])
    head_dim = values.shape[-1]
    if scores.shape[-1] == 0:
        return identity_state(lead, head_dim)
    m = np.broadcast_to(scores.max(axis=-1), lead)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    p = np.exp(scores - m_safe[..., None])  # exp(-inf) = 0 hides masked keys
    l = np.broadcast_to(p.sum(axis=-1), lead)  # noqa: E741
    o = np.broadcast_to(np.matmul(p[..., None, :], values)[..., 0, :], (*lead, head_dim))
    return SoftmaxState(o=np.array(o), l=np.array(l), m=np.array(m))


def finalize(state: SoftmaxState) -> tuple[np.ndarray, np.ndarray]:
    """``(out, lse) = (o / l, m + log l)``; rows with ``l == 0`` give out 0 and lse ``-inf``."""
    o = np.asarray(state.o, dtype=np.float64)
    l = np.asarray(state.l, dtype=np.float64)  # noqa: E741
    m = np.asarray(state.m, dtype=np.float64)
    seen = l > 0
    l_safe = np.where(seen, l, 1.0)
    out = np.where(seen[..., None], o / l_safe[..., None], 0.0)
    lse = np.where(seen, m + np.log(l_safe), -np.inf)
    return out, lse


# --------------------------------------------------------------------------------------------
# Shared input handling
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _ScoreStages:
    """The scores of one block at each stage: ``raw = scale * q.k``, ``capped`` (after softcap,
    what ``score_mod`` receives), ``final`` (all variants, ``-inf`` where hidden), and the
    broadcastable ``(b, h, q_idx, kv_idx)`` index arrays the hooks were called with."""

    raw: np.ndarray
    capped: np.ndarray
    final: np.ndarray
    index: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class _Problem:
    """Validated float64 inputs with K/V expanded to the query heads (GQA/MQA)."""

    q: np.ndarray  # (B, H, Sq, D)
    k: np.ndarray  # (B, H, Sk, D)
    v: np.ndarray  # (B, H, Sk, D)
    mask: np.ndarray | None  # read-only broadcast view of shape (B, H, Sq, Sk)
    scale: float
    causal: bool
    variants: Variants = dataclasses.field(default_factory=lambda: Variants())  # checked

    @property
    def sq(self) -> int:
        return self.q.shape[2]

    @property
    def sk(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    def scores(self, i0: int, i1: int, j0: int, j1: int) -> np.ndarray:
        """Masked scaled scores of query rows ``[i0, i1)`` against keys ``[j0, j1)``."""
        return self.score_stages(i0, i1, j0, j1).final

    def score_stages(self, i0: int, i1: int, j0: int, j1: int) -> _ScoreStages:
        """:meth:`scores` with the intermediate scores the backward pass differentiates."""
        # einsum (not matmul/BLAS) so that every score is bitwise the same whatever the tiling:
        # the models then differ only in how they combine the softmax.
        raw = np.einsum("bhid,bhjd->bhij", self.q[:, :, i0:i1], self.k[:, :, j0:j1]) * self.scale
        var = self.variants
        b = np.arange(self.q.shape[0])[:, None, None, None]
        h = np.arange(self.q.shape[1])[None, :, None, None]
        rows = np.arange(i0, i1)[None, None, :, None]
        cols = np.arange(j0, j1)[None, None, None, :]
        diagonal = rows + (self.sk - self.sq)  # the key query i is aligned with
        s = raw
        if var.softcap is not None:
            s = var.softcap * np.tanh(s / var.softcap)
        capped = s
        if var.score_mod is not None:  # user expressions are inserted here
            s = np.asarray(var.score_mod(s, b, h, rows, cols), dtype=np.float64)
        if var.alibi_slopes is not None:
            s = s - var.alibi_slopes[:, :, None, None] * np.abs(diagonal - cols)
        if self.mask is not None:
            s = s + self.mask[:, :, i0:i1, j0:j1]
        left, right = self.window
        visible = np.ones(s.shape[2:], dtype=bool)
        if left >= 0:
            visible = visible & (cols >= diagonal - left)[0, 0]
        if right >= 0:
            visible = visible & (cols <= diagonal + right)[0, 0]
        if var.mask_mod is not None:  # user expressions are inserted here
            visible = visible & np.asarray(var.mask_mod(b, h, rows, cols), dtype=bool)
        return _ScoreStages(raw, capped, np.where(visible, s, -np.inf), (b, h, rows, cols))

    @property
    def window(self) -> tuple[int, int]:
        """The effective (left, right) window, causal included (-1: unbounded)."""
        left, right = self.variants.window_size
        if self.causal:
            right = 0 if right < 0 else min(right, 0)
        return left, right

    def key_range(self, i0: int, i1: int) -> tuple[int, int]:
        """Keys ``[j0, j1)`` that some query row of ``[i0, i1)`` may see under the window."""
        left, right = self.window
        offset = self.sk - self.sq
        j0 = 0 if left < 0 else max(0, i0 + offset - left)
        j1 = self.sk if right < 0 else min(self.sk, i1 - 1 + offset + right + 1)
        return j0, max(j0, j1)

    def initial_state(self, rows: int) -> SoftmaxState:
        """The state a row starts from: the identity, or with sinks the sink's own state
        ``(0, 1, sink_h)`` (a key of score sink_h and value 0)."""
        b, h = self.q.shape[:2]
        state = identity_state((b, h, rows), self.head_dim)
        if self.variants.sinks is None:
            return state
        sink = np.broadcast_to(self.variants.sinks[None, :, None], (b, h, rows))
        return SoftmaxState(state.o, np.ones((b, h, rows)), np.array(sink, dtype=np.float64))

    def values(self, j0: int, j1: int) -> np.ndarray:
        """Values of keys ``[j0, j1)`` as (B, H, 1, n, D), shared by every query row."""
        return self.v[:, :, None, j0:j1]


ScoreMod = Callable[..., np.ndarray]  # (score, b, h, q_idx, kv_idx) -> new score
MaskMod = Callable[..., np.ndarray]  # (b, h, q_idx, kv_idx) -> bool, True where visible


@dataclass(frozen=True)
class Variants:
    """The attention variants of one call (module docstring), validated; ``alibi_slopes`` is
    (B, H) float64 after :func:`_prepare`, ``sinks`` (H,)."""

    window_size: tuple[int, int] = (-1, -1)
    softcap: float | None = None
    alibi_slopes: np.ndarray | None = None
    sinks: np.ndarray | None = None
    score_mod: ScoreMod | None = None
    mask_mod: MaskMod | None = None


def _check_variants(variants: Variants, batch: int, heads: int) -> Variants:
    window = tuple(variants.window_size)
    if len(window) != 2 or any(
        isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < -1 for w in window
    ):
        raise ValueError(f"window_size: expected (left, right) integers >= -1, got {window!r}")
    softcap = variants.softcap
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap: must be a finite number > 0, got {softcap!r}")
    slopes = variants.alibi_slopes
    if slopes is not None:
        slopes = np.asarray(slopes, dtype=np.float64)
        if slopes.shape not in ((heads,), (batch, heads)):
            raise ValueError(
                f"alibi_slopes: expected shape ({heads},) or ({batch}, {heads}), got {slopes.shape}"
            )
        slopes = np.broadcast_to(slopes, (batch, heads))
    sinks = variants.sinks
    if sinks is not None:
        sinks = np.asarray(sinks, dtype=np.float64)
        if sinks.shape != (heads,):
            raise ValueError(f"sinks: expected shape ({heads},), got {sinks.shape}")
    return Variants(
        (int(window[0]), int(window[1])),
        None if softcap is None else float(softcap),
        slopes,
        sinks,
        variants.score_mod,
        variants.mask_mod,
    )


def _prepare(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    causal: bool,
    scale: float | None,
    mask: np.ndarray | None,
    variants: Variants | None = None,
) -> _Problem:
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name}: expected rank 4 (B, H, S, D), got shape {x.shape}")
    b, h, sq, d = q.shape
    bk, hkv, sk, dk = k.shape
    if bk != b:
        raise ValueError(f"k: batch {bk} does not match q's batch {b}")
    if v.shape != k.shape:
        raise ValueError(f"v: shape {v.shape} must equal k's shape {k.shape}")
    if dk != d:
        raise ValueError(f"k: head_dim {dk} does not match q's head_dim {d}")
    if hkv < 1 or h % hkv != 0:
        raise ValueError(f"k: kv heads {hkv} must divide q's heads {h} (H % Hkv == 0)")
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0
    else:
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale: must be finite, got {scale}")
    group = h // hkv
    if group > 1:
        k = np.repeat(k, group, axis=1)  # query head h reads kv head h // group
        v = np.repeat(v, group, axis=1)
    full_mask = None
    if mask is not None:
        mask_arr = np.asarray(mask)
        if mask_arr.dtype == np.bool_:
            raise ValueError("mask: must be an additive float array (-inf hides a key), got bool")
        mask_arr = mask_arr.astype(np.float64, copy=False)
        if np.isnan(mask_arr).any() or np.isposinf(mask_arr).any():
            raise ValueError("mask: entries must be finite or -inf (no NaN, no +inf)")
        try:
            full_mask = np.broadcast_to(mask_arr, (b, h, sq, sk))
        except ValueError:
            raise ValueError(
                f"mask: shape {mask_arr.shape} does not broadcast to (B, H, Sq, Sk) = "
                f"{(b, h, sq, sk)}"
            ) from None
    checked = _check_variants(variants or Variants(), b, h)
    return _Problem(
        q=q, k=k, v=v, mask=full_mask, scale=scale, causal=bool(causal), variants=checked
    )


def _check_block(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    return int(value)


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def naive_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    causal: bool = False,
    scale: float | None = None,
    mask: np.ndarray | None = None,
    seqlens_k: Sequence[int] | np.ndarray | None = None,
    **variants: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """Direct attention over the full (B, H, Sq, Sk) score matrix; returns ``(out, lse)``.

    Uses the max-subtraction trick, so any finite scores work without overflow. ``seqlens_k``
    (the KV-cache case) gives batch entry b only its first ``seqlens_k[b]`` keys (clamped to
    [0, Sk]); causal alignment is then to that length.
    """
    if seqlens_k is not None:
        kw = dict(causal=causal, scale=scale, mask=mask, **variants)
        results = [
            naive_attention(*qkv, **kw_b) for _, qkv, kw_b in _sequences(q, k, v, seqlens_k, kw)
        ]
        return np.concatenate([r[0] for r in results]), np.concatenate([r[1] for r in results])
    p = _prepare(q, k, v, causal, scale, mask, Variants(**variants))
    s = _with_sinks(p.scores(0, p.sq, 0, p.sk), p.variants.sinks)
    e, denom, seen, lse = _softmax_parts(s)
    out = np.where(seen[..., None], np.matmul(e[..., : p.sk], p.v) / denom[..., None], 0.0)
    return out, lse


def _with_sinks(s: np.ndarray, sinks: np.ndarray | None) -> np.ndarray:
    """The scores (B, H, Sq, Sk) with the sinks (a key of value 0) as one more column."""
    if sinks is None:
        return s
    sink = np.broadcast_to(sinks[None, :, None, None], (*s.shape[:-1], 1))
    return np.concatenate([s, sink], axis=-1)


def _softmax_parts(s: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(e, denom, seen, lse)`` of rows of scores ``s`` (..., n): ``e = e^{s - m}`` with ``m``
    the row max, ``denom`` its row sum (1 where no key is seen), ``seen = denom > 0`` and ``lse``
    (``-inf`` where no key is seen). The softmax is ``e / denom`` where ``seen``, else 0."""
    m = s.max(axis=-1) if s.shape[-1] > 0 else np.full(s.shape[:-1], -np.inf)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(s - m_safe[..., None])
    denom = e.sum(axis=-1)
    seen = denom > 0
    denom_safe = np.where(seen, denom, 1.0)
    lse = np.where(seen, m_safe + np.log(denom_safe), -np.inf)
    return e, denom_safe, seen, lse


def _sequences(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    seqlens_k: Sequence[int] | np.ndarray,
    kw: dict[str, Any],
) -> Iterator[tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray], dict[str, Any]]]:
    """Each batch entry b as its own problem over its first ``seqlens_k[b]`` keys: yields
    ``(keys, (q_b, k_b, v_b), kw_b)``, ``kw`` with its mask and ALiBi slopes cut to entry b.
    The problems have batch 1, so the hooks see batch index 0."""
    batch, heads, seqlen_q = np.shape(q)[:3]
    seqlen_k = np.shape(k)[2]
    if len(seqlens_k) != batch:
        raise ValueError(f"seqlens_k: expected {batch} lengths, got {len(seqlens_k)}")
    mask = kw.get("mask")
    if mask is not None:
        mask = np.broadcast_to(mask, (batch, heads, seqlen_q, seqlen_k))
    slopes = kw.get("alibi_slopes")
    if slopes is not None:
        slopes = np.broadcast_to(np.asarray(slopes, dtype=np.float64), (batch, heads))
    for b, length in enumerate(seqlens_k):
        keys = min(max(int(length), 0), seqlen_k)
        kw_b = dict(kw, mask=None if mask is None else mask[b : b + 1, :, :, :keys])
        if slopes is not None:
            kw_b["alibi_slopes"] = slopes[b : b + 1]
        qkv = (q[b : b + 1], k[b : b + 1, :, :keys], v[b : b + 1, :, :keys])
        yield keys, qkv, kw_b


def online_softmax_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    causal: bool = False,
    scale: float | None = None,
    mask: np.ndarray | None = None,
    **variants: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """Online softmax: every query row folds in the keys one at a time.

    ``m_j = max(m_{j-1}, x_j)``, ``l_j = l_{j-1} e^{m_{j-1} - m_j} + e^{x_j - m_j}``,
    ``o_j = o_{j-1} e^{m_{j-1} - m_j} + e^{x_j - m_j} v_j``; vectorized over (B, H, Sq).
    """
    p = _prepare(q, k, v, causal, scale, mask, Variants(**variants))
    state = p.initial_state(p.sq)
    for j in range(p.sk):
        x = p.scores(0, p.sq, j, j + 1)  # (B, H, Sq, 1)
        state = combine(state, tile_state(x, p.values(j, j + 1)))
    return finalize(state)


def tiled_v1(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    block_m: int,
    block_n: int,
    causal: bool = False,
    scale: float | None = None,
    mask: np.ndarray | None = None,
    **variants: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """FlashAttention-1 loop order: K/V tiles of ``block_n`` outside, Q tiles of ``block_m`` inside.

    The running ``(o, l, m)`` of every query row lives in global arrays between outer steps:
    each (Q tile, K tile) pair reads it, combines it with the tile's state and writes it back.
    Pairs that the window (causal included) hides entirely are skipped.
    """
    block_m = _check_block("block_m", block_m)
    block_n = _check_block("block_n", block_n)
    p = _prepare(q, k, v, causal, scale, mask, Variants(**variants))
    init = p.initial_state(p.sq)
    o_glob, l_glob, m_glob = init.o, init.l, init.m
    for j0 in range(0, p.sk, block_n):
        j1 = min(j0 + block_n, p.sk)
        v_tile = p.values(j0, j1)
        for i0 in range(0, p.sq, block_m):
            i1 = min(i0 + block_m, p.sq)
            keys = p.key_range(i0, i1)
            if j1 <= keys[0] or j0 >= keys[1]:
                continue  # no row of this Q tile sees any key of this K tile
            prev = SoftmaxState(o_glob[:, :, i0:i1], l_glob[:, :, i0:i1], m_glob[:, :, i0:i1])
            new = combine(prev, tile_state(p.scores(i0, i1, j0, j1), v_tile))
            o_glob[:, :, i0:i1] = new.o
            l_glob[:, :, i0:i1] = new.l
            m_glob[:, :, i0:i1] = new.m
    return finalize(SoftmaxState(o_glob, l_glob, m_glob))


def tiled_v2(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    block_m: int,
    block_n: int,
    causal: bool = False,
    scale: float | None = None,
    mask: np.ndarray | None = None,
    **variants: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """FlashAttention-2 loop order: Q tiles of ``block_m`` outside, K/V tiles of ``block_n`` inside.

    The state stays with its Q tile and is finalized once per Q tile. The inner loop visits only
    the K tiles that some row of the Q tile can see under the window (causal included).
    """
    block_m = _check_block("block_m", block_m)
    block_n = _check_block("block_n", block_n)
    p = _prepare(q, k, v, causal, scale, mask, Variants(**variants))
    b, h = p.q.shape[:2]
    out = np.zeros_like(p.q)
    lse = np.full((b, h, p.sq), -np.inf)
    for i0 in range(0, p.sq, block_m):
        i1 = min(i0 + block_m, p.sq)
        j_begin, j_end = p.key_range(i0, i1)
        state = p.initial_state(i1 - i0)
        for j0 in range(j_begin // block_n * block_n, j_end, block_n):
            j1 = min(j0 + block_n, p.sk)
            state = combine(state, tile_state(p.scores(i0, i1, j0, j1), p.values(j0, j1)))
        out[:, :, i0:i1], lse[:, :, i0:i1] = finalize(state)
    return out, lse


def split_kv(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    num_splits: int,
    causal: bool = False,
    scale: float | None = None,
    mask: np.ndarray | None = None,
    **variants: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """Split-KV model: the key axis is cut into ``num_splits`` contiguous chunks.

    Chunk ``s`` holds keys ``[s * Sk // num_splits, (s + 1) * Sk // num_splits)`` (empty when
    there are more splits than keys). Each chunk's partial state is computed on its own, then
    the partials are folded in order with :func:`combine`, starting from the sinks' state.
    """
    num_splits = _check_block("num_splits", num_splits)
    p = _prepare(q, k, v, causal, scale, mask, Variants(**variants))
    bounds = [s * p.sk // num_splits for s in range(num_splits + 1)]
    partials = [
        tile_state(p.scores(0, p.sq, j0, j1), p.values(j0, j1))
        for j0, j1 in itertools.pairwise(bounds)
    ]
    state = p.initial_state(p.sq)
    for part in partials:
        state = combine(state, part)
    return finalize(state)


def split_kv_partials(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    num_splits: int,
    block_n: int = 1,
    causal: bool = False,
    scale: float | None = None,
    mask: np.ndarray | None = None,
    **variants: Any,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The split-KV kernels' partials: ``(out_c, lse_c)``, attention over chunk c's keys alone.

    Chunks are cut as the kernels cut them: the ceil(Sk / block_n) key tiles are dealt out
    ceil(tiles / num_splits) per chunk, so trailing chunks may be empty ((0, -inf)). With a
    window the tiles dealt out are those the window lets query rows [0, Sq) see (the kernels
    cut per query tile: the same when Sq fits one tile, as in decoding). Sinks are not in the
    partials: :func:`combine_partials` adds them."""
    num_splits = _check_block("num_splits", num_splits)
    block_n = _check_block("block_n", block_n)
    p = _prepare(q, k, v, causal, scale, mask, Variants(**variants))
    first_tile = 0
    end_tile = math.ceil(p.sk / block_n)
    if p.variants.window_size != (-1, -1):
        keys = p.key_range(0, p.sq)
        first_tile, end_tile = keys[0] // block_n, math.ceil(keys[1] / block_n)
    tiles_per_split = math.ceil(max(0, end_tile - first_tile) / num_splits)
    partials = []
    for split in range(num_splits):
        j0 = min(p.sk, (first_tile + split * tiles_per_split) * block_n)
        j1 = min(p.sk, (first_tile + (split + 1) * tiles_per_split) * block_n)
        partials.append(finalize(tile_state(p.scores(0, p.sq, j0, j1), p.values(j0, j1))))
    return partials


def combine_partials(
    partials: Sequence[tuple[np.ndarray, np.ndarray]],
    sinks: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The combine kernel's fold: each partial ``(out_c, lse_c)`` is the state
    ``(out_c, 1, lse_c)`` (an empty one, ``lse_c = -inf``, weighs 0), folded with
    :func:`combine`; with ``sinks`` (H,) (partials (B, H, Sq, D)) the fold starts from the
    sink's state ``(0, 1, sink_h)`` instead of the identity."""
    if not partials:
        raise ValueError("partials: need at least one (out, lse) pair")
    out0, lse0 = (np.asarray(x, dtype=np.float64) for x in partials[0])
    state = identity_state(lse0.shape, out0.shape[-1])
    if sinks is not None:
        sink = np.broadcast_to(np.asarray(sinks, dtype=np.float64)[None, :, None], lse0.shape)
        state = SoftmaxState(state.o, np.ones(lse0.shape), np.array(sink))
    for out, lse in partials:
        lse = np.asarray(lse, dtype=np.float64)
        part = SoftmaxState(np.asarray(out, dtype=np.float64), np.ones_like(lse), lse)
        state = combine(state, part)
    return finalize(state)


# --------------------------------------------------------------------------------------------
# Backward pass
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class BackwardGrads:
    """The gradients of ``L = sum(out * dout)`` from :func:`attention_backward`, float64.

    ``dq`` is (B, H, Sq, D); ``dk`` and ``dv`` are (B, Hkv, Sk, D), summed over the query heads
    of each GQA group; ``dsinks`` is (H,), or None without sinks. ``out`` and ``lse`` are the
    forward's (as :func:`naive_attention`), ``delta`` (B, H, Sq) is ``D_i = dout_i . out_i``.
    """

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dsinks: np.ndarray | None
    out: np.ndarray
    lse: np.ndarray
    delta: np.ndarray


# Relative step of the central difference that differentiates a score_mod given without its
# score_mod_grad: eps^(1/3) balances rounding (eps / h) against truncation (h^2), ~1e-10 error.
SCORE_MOD_FD_STEP = float(np.finfo(np.float64).eps) ** (1 / 3)


def _softcap_grad(raw: np.ndarray, softcap: float) -> np.ndarray:
    """``d/ds c tanh(s / c) = 1 - tanh(s / c)^2``."""
    return 1.0 - np.tanh(raw / softcap) ** 2


def _score_mod_grad(
    stages: _ScoreStages, score_mod: ScoreMod, score_mod_grad: ScoreMod | None
) -> np.ndarray:
    """``d score_mod / d score`` at ``stages.capped``: ``score_mod_grad`` if given, else a
    central difference with relative step :data:`SCORE_MOD_FD_STEP`."""
    s = stages.capped
    if score_mod_grad is not None:
        grad = score_mod_grad(s, *stages.index)
    else:
        h = SCORE_MOD_FD_STEP * np.maximum(1.0, np.abs(s))
        hi = np.asarray(score_mod(s + h, *stages.index), dtype=np.float64)
        lo = np.asarray(score_mod(s - h, *stages.index), dtype=np.float64)
        with np.errstate(invalid="ignore"):  # -inf - -inf where score_mod hides a key
            grad = (hi - lo) / (2 * h)
    return np.broadcast_to(np.asarray(grad, dtype=np.float64), s.shape)


def attention_backward(
    dout: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    causal: bool = False,
    scale: float | None = None,
    mask: np.ndarray | None = None,
    seqlens_k: Sequence[int] | np.ndarray | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
    alibi_slopes: np.ndarray | None = None,
    sinks: np.ndarray | None = None,
    score_mod: ScoreMod | None = None,
    score_mod_grad: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    out: np.ndarray | None = None,
) -> BackwardGrads:
    """The analytic gradients of ``L = sum(out * dout)`` for :func:`naive_attention`'s forward.

    With ``x`` the final scores, ``P = e^{x - lse}`` (0 where hidden or no key is seen):
    ``dv = P^T dout``, ``dP = dout v^T``, ``D_i = dout_i . out_i``, ``dx = P (dP - D)``; ``ds``
    is ``dx`` times ``dx/ds`` through the transforms (softcap ``1 - tanh^2(s / c)``, score_mod's
    derivative, ALiBi and mask 1); ``dq = scale ds k``, ``dk = scale ds^T q``. The sink is a key
    of value 0, so ``dsinks_h = -sum_{b,i} P_sink D_i``. No gradient flows into ``mask`` or the
    slopes.

    ``score_mod_grad(score, b, h, q_idx, kv_idx)`` returns ``d score_mod / d score`` at the
    softcapped score; without it the derivative is a float64 central difference of
    ``score_mod`` (:data:`SCORE_MOD_FD_STEP`). ``seqlens_k`` is as in :func:`naive_attention`:
    keys past an entry's length get zero ``dk``/``dv``.

    ``out`` is the forward output a backward kernel is given (its rounding to the dtype), for
    ``D_i = dout_i . out_i``; default the exact one. A backward is a function of out: the float64
    model of that function takes the out it got, as it takes the rounded q, k and v (D enters
    dS = P (dP - D) by a difference, and dsinks = -sum P_sink D by a sum, that can cancel).
    """
    dout = np.asarray(dout, dtype=np.float64)
    if dout.shape != np.shape(q):
        raise ValueError(f"dout: shape {dout.shape} must equal q's shape {np.shape(q)}")
    if score_mod_grad is not None and score_mod is None:
        raise ValueError("score_mod_grad: given without a score_mod")
    variants = dict(
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        score_mod=score_mod,
        mask_mod=mask_mod,
    )
    kw: dict[str, Any] = dict(causal=causal, scale=scale, mask=mask, **variants)
    if seqlens_k is not None:
        if out is not None:
            raise ValueError("out: not supported with seqlens_k (give each entry's call)")
        return _backward_per_sequence(dout, q, k, v, seqlens_k, kw, score_mod_grad)
    p = _prepare(q, k, v, causal, scale, mask, Variants(**variants))
    var = p.variants
    stages = p.score_stages(0, p.sq, 0, p.sk)
    e, denom, seen, lse = _softmax_parts(_with_sinks(stages.final, var.sinks))
    prob = np.where(seen[..., None], e / denom[..., None], 0.0)
    p_keys = prob[..., : p.sk]
    exact = np.matmul(p_keys, p.v)
    given = exact if out is None else np.asarray(out, dtype=np.float64)
    if given.shape != exact.shape:
        raise ValueError(f"out: shape {given.shape} must equal q's shape {exact.shape}")
    delta = np.einsum("bhid,bhid->bhi", dout, given)
    dp = np.matmul(dout, np.swapaxes(p.v, -1, -2))
    dx = p_keys * (dp - delta[..., None])
    chain = np.ones_like(dx)
    if var.softcap is not None:
        chain = chain * _softcap_grad(stages.raw, var.softcap)
    if var.score_mod is not None:
        chain = chain * _score_mod_grad(stages, var.score_mod, score_mod_grad)
    ds = np.where(p_keys > 0, dx * chain, 0.0)  # hidden keys: no 0 * inf/NaN from the chain
    dq = p.scale * np.matmul(ds, p.k)
    group = p.q.shape[1] // np.shape(k)[1]
    dk = p.scale * np.matmul(np.swapaxes(ds, -1, -2), p.q)
    dv = np.matmul(np.swapaxes(p_keys, -1, -2), dout)
    dk, dv = (x.reshape(x.shape[0], -1, group, *x.shape[2:]).sum(axis=2) for x in (dk, dv))
    dsinks = None if var.sinks is None else -(prob[..., p.sk] * delta).sum(axis=(0, 2))
    return BackwardGrads(dq, dk, dv, dsinks, exact, lse, delta)


def _backward_per_sequence(
    dout: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    seqlens_k: Sequence[int] | np.ndarray,
    kw: dict[str, Any],
    score_mod_grad: ScoreMod | None,
) -> BackwardGrads:
    """attention_backward of each batch entry over its own first seqlens_k[b] keys."""
    dk = np.zeros(np.shape(k))
    dv = np.zeros(np.shape(k))
    parts = []
    for b, (keys, qkv, kw_b) in enumerate(_sequences(q, k, v, seqlens_k, kw)):
        g = attention_backward(dout[b : b + 1], *qkv, score_mod_grad=score_mod_grad, **kw_b)
        dk[b, :, :keys], dv[b, :, :keys] = g.dk[0], g.dv[0]
        parts.append(g)
    dsinks = None if kw["sinks"] is None else np.sum([g.dsinks for g in parts], axis=0)
    dq, out, lse, delta = (
        np.concatenate([getattr(g, name) for g in parts]) for name in ("dq", "out", "lse", "delta")
    )
    return BackwardGrads(dq, dk, dv, dsinks, out, lse, delta)


# --------------------------------------------------------------------------------------------
# Comparison helper
# --------------------------------------------------------------------------------------------


# The project's limits against float64 (docs/design.md; never loosened): relative Frobenius
# error of out by input dtype, absolute error of the lse.
OUT_TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1e-2}
LSE_TOLERANCE = 1e-3


def relative_error(x: np.ndarray, ref: np.ndarray) -> float:
    """``||x - ref||_F / ||ref||_F`` in float64; ``||x||_F`` when ``||ref||_F == 0``."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if x.shape != ref.shape:
        raise ValueError(f"x: shape {x.shape} does not match ref's shape {ref.shape}")
    ref_norm = float(np.linalg.norm(ref.ravel()))
    diff_norm = float(np.linalg.norm((x - ref).ravel()))
    if ref_norm == 0.0:
        return float(np.linalg.norm(x.ravel()))
    return diff_norm / ref_norm


@dataclass(frozen=True)
class Mismatches:
    """What :func:`mismatches` found: ``failed`` (one line per broken limit; empty: within them),
    out's relative error and the largest lse error over the rows that see a key."""

    failed: tuple[str, ...]
    out_error: float
    lse_error: float


def mismatches(
    out: np.ndarray, lse: np.ndarray | None, ref_out: np.ndarray, ref_lse: np.ndarray, dtype: str
) -> Mismatches:
    """out/lse (B, H, Sq, D)/(B, H, Sq) against the float64 reference with the project's limits:
    no NaN, out within OUT_TOLERANCE[dtype], out = 0 on rows that see no key, lse -inf exactly
    there and within LSE_TOLERANCE elsewhere (lse None: a call that did not ask for it; out
    alone is judged). The test suite asserts it empty; the fuzzer reports it."""
    out = np.asarray(out, dtype=np.float64)
    failed = []
    if np.isnan(out).any():
        failed.append(f"NaN in out at {np.argwhere(np.isnan(out))[:5].tolist()}")
    error = relative_error(np.nan_to_num(out, nan=0.0), ref_out)
    if not error <= OUT_TOLERANCE[dtype]:
        failed.append(f"out relative error {error:.3g} > {OUT_TOLERANCE[dtype]}")
    empty = np.isneginf(ref_lse)
    if not np.all(out[empty] == 0.0):
        failed.append("rows that see no key give out = 0")
    lse_error = 0.0
    if lse is not None:
        lse_failed, lse_error = lse_mismatches(lse, ref_lse, LSE_TOLERANCE)
        failed += lse_failed
    return Mismatches(tuple(failed), error, lse_error)


def lse_mismatches(lse: Any, ref_lse: np.ndarray, tolerance: float) -> tuple[list[str], float]:
    """What is wrong with a kernel's lse against the reference's (one line each) and its largest
    error: no NaN, -inf exactly on the rows that see no key, within ``tolerance`` elsewhere."""
    lse = np.asarray(lse, dtype=np.float64)
    empty = np.isneginf(ref_lse)
    failed, lse_error = [], 0.0
    if np.isnan(lse).any():
        failed.append(f"NaN in lse at {np.argwhere(np.isnan(lse))[:5].tolist()}")
    if not np.array_equal(np.isneginf(lse), empty):
        where = np.argwhere(np.isneginf(lse) != empty)[:5].tolist()
        failed.append(f"lse is -inf exactly where a row sees no key (not at {where})")
    if (~empty).any():
        lse_error = float(np.max(np.abs(lse[~empty] - ref_lse[~empty])))
        if not lse_error <= tolerance:
            failed.append(f"lse error {lse_error:.3g} > {tolerance}")
    return failed, lse_error


@dataclass(frozen=True)
class GradMismatches:
    """What :func:`grad_mismatches` found: ``failed`` (one line per broken limit) and each
    gradient's relative Frobenius error (``dq``, ``dk``, ``dv`` and, with sinks, ``dsinks``)."""

    failed: tuple[str, ...]
    errors: dict[str, float]


def grad_mismatches(grads: Sequence[Any], ref: BackwardGrads, dtype: str) -> GradMismatches:
    """A backward's gradients (dq, dk, dv[, dsinks], in (B, H, S, D) order) against the float64
    :func:`attention_backward` with the project's limit: each of the reference's shape, finite,
    and within OUT_TOLERANCE[dtype] in relative Frobenius error (the forward's limit for the
    input dtype). The backward tests assert it empty; the fuzzer reports it."""
    names = ["dq", "dk", "dv"] + ([] if ref.dsinks is None else ["dsinks"])
    if len(grads) != len(names):
        return GradMismatches((f"{len(grads)} gradients; expected {', '.join(names)}",), {})
    failed, errors = [], {}
    for name, got in zip(names, grads, strict=True):
        got = np.asarray(got, dtype=np.float64)
        want = getattr(ref, name)
        if got.shape != want.shape:
            failed.append(f"{name} has shape {got.shape}; expected {want.shape}")
            continue
        if not np.isfinite(got).all():
            failed.append(f"non-finite {name} at {np.argwhere(~np.isfinite(got))[:5].tolist()}")
        errors[name] = relative_error(np.nan_to_num(got, nan=0.0, posinf=0.0, neginf=0.0), want)
        if not errors[name] <= OUT_TOLERANCE[dtype]:
            failed.append(f"{name} relative error {errors[name]:.3g} > {OUT_TOLERANCE[dtype]}")
    return GradMismatches(tuple(failed), errors)
