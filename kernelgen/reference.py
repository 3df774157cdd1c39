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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "SoftmaxState",
    "Variants",
    "combine",
    "combine_partials",
    "finalize",
    "identity_state",
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
        # einsum (not matmul/BLAS) so that every score is bitwise the same whatever the tiling:
        # the models then differ only in how they combine the softmax.
        s = np.einsum("bhid,bhjd->bhij", self.q[:, :, i0:i1], self.k[:, :, j0:j1]) * self.scale
        var = self.variants
        b = np.arange(self.q.shape[0])[:, None, None, None]
        h = np.arange(self.q.shape[1])[None, :, None, None]
        rows = np.arange(i0, i1)[None, None, :, None]
        cols = np.arange(j0, j1)[None, None, None, :]
        diagonal = rows + (self.sk - self.sq)  # the key query i is aligned with
        if var.softcap is not None:
            s = var.softcap * np.tanh(s / var.softcap)
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
        return np.where(visible, s, -np.inf)

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
        return _per_sequence(q, k, v, seqlens_k, causal=causal, scale=scale, mask=mask, **variants)
    p = _prepare(q, k, v, causal, scale, mask, Variants(**variants))
    s = p.scores(0, p.sq, 0, p.sk)
    if p.variants.sinks is not None:  # the sink: one more score, with value 0
        sink = np.broadcast_to(p.variants.sinks[None, :, None, None], (*s.shape[:-1], 1))
        s = np.concatenate([s, sink], axis=-1)
        sink_value = np.zeros((*p.v.shape[:2], 1, p.v.shape[3]))
        p = dataclasses.replace(p, v=np.concatenate([p.v, sink_value], axis=2))
    m = s.max(axis=-1) if s.shape[-1] > 0 else np.full(s.shape[:-1], -np.inf)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(s - m_safe[..., None])
    denom = e.sum(axis=-1)
    seen = denom > 0
    denom_safe = np.where(seen, denom, 1.0)
    out = np.where(seen[..., None], np.matmul(e, p.v) / denom_safe[..., None], 0.0)
    lse = np.where(seen, m_safe + np.log(denom_safe), -np.inf)
    return out, lse


def _per_sequence(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    seqlens_k: Sequence[int] | np.ndarray,
    **kw: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """naive_attention of each batch entry over its own first seqlens_k[b] keys."""
    batch, heads, seqlen_q = np.shape(q)[:3]
    seqlen_k = np.shape(k)[2]
    if len(seqlens_k) != batch:
        raise ValueError(f"seqlens_k: expected {batch} lengths, got {len(seqlens_k)}")
    mask = kw.pop("mask")
    if mask is not None:
        mask = np.broadcast_to(mask, (batch, heads, seqlen_q, seqlen_k))
    slopes = kw.pop("alibi_slopes", None)
    if slopes is not None:
        slopes = np.broadcast_to(np.asarray(slopes, dtype=np.float64), (batch, heads))
    outs, lses = [], []
    for b, length in enumerate(seqlens_k):
        keys = min(max(int(length), 0), seqlen_k)
        mask_b = None if mask is None else mask[b : b + 1, :, :, :keys]
        if slopes is not None:
            kw["alibi_slopes"] = slopes[b : b + 1]
        out, lse = naive_attention(
            q[b : b + 1], k[b : b + 1, :, :keys], v[b : b + 1, :, :keys], mask=mask_b, **kw
        )
        outs.append(out)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


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
