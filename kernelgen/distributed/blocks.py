"""The per-block calls of context-parallel attention: which (query run, key run) pairs of global
positions are full, diagonal, partly visible or skipped, and the ``attention()`` arguments that
make a local call see global positions.

``attention()`` aligns its causal mask and window to the bottom right: local query i sits on
local key ``i + n - m`` (m queries, n keys). For a block of global queries ``[qs, qe)`` and keys
``[ks, ke)`` the true diagonal is ``delta = qe - ke`` keys further right, so the global rule
"key ``kg`` is visible to query ``qg`` iff ``qg - left <= kg <= qg + right``" is the local
window ``(left - delta, right + delta)``. Both sides must come out at least 0 (a window side is
-1 only when unbounded); they do once the block is trimmed: keys past the last query's right
bound, or before the first query's left bound, and queries past the last key's reach or before
the first key's, see nothing of the block and are cut off first (a fixed point of those four
cuts). Then a block is

- **skipped** when nothing is left;
- **full** when every query sees every key: a plain call, no mask;
- **diagonal**: the local window is ``(-1, 0)`` (the causal rule with ``delta == 0``):
  ``causal=True``;
- **partial** otherwise: ``window_size`` = the local window (``causal=True`` when its right
  side is 0).

Position-dependent scores: ALiBi's ``|qg - kg|`` is the kernels' ``|i + n - m - j|`` only when
``delta == 0`` (:attr:`BlockCall.aligned`); other blocks take it, and user expressions always,
as expressions over the block's first positions (:mod:`kernelgen.distributed.positions`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kernelgen.distributed.sharding import Segment

__all__ = ["BlockCall", "Visibility", "plan_blocks", "plan_pair"]

Kind = Literal["full", "diagonal", "partial"]


@dataclass(frozen=True)
class Visibility:
    """The global rule: key ``kg`` is visible to query ``qg`` iff ``qg - left <= kg`` (left >=
    0) and ``kg <= qg + right`` (right >= 0); -1 leaves a side unbounded."""

    left: int = -1
    right: int = -1

    @classmethod
    def of(cls, causal: bool, window_size: tuple[int, int] | None) -> Visibility:
        """attention()'s rule for ``causal`` and ``window_size`` (causal narrows right to 0)."""
        left, right = window_size if window_size is not None else (-1, -1)
        return cls(int(left), 0 if causal else int(right))


@dataclass(frozen=True)
class BlockCall:
    """One local attention call: local query rows ``q_rows`` against local key rows ``k_rows``
    (half-open), whose first positions are global ``q_start`` and ``k_start``; ``causal`` and
    ``window`` are the call's arguments (``window`` None: no window). ``contiguous`` is False
    for a full block coalesced over runs that are not globally consecutive (then the starts are
    the first run's and the positions in between are not those of the rows)."""

    q_rows: tuple[int, int]
    k_rows: tuple[int, int]
    q_start: int
    k_start: int
    causal: bool
    window: tuple[int, int] | None
    kind: Kind
    contiguous: bool = True

    @property
    def rows(self) -> int:
        return self.q_rows[1] - self.q_rows[0]

    @property
    def keys(self) -> int:
        return self.k_rows[1] - self.k_rows[0]

    @property
    def shift(self) -> int:
        """Global ``qg - kg`` minus local ``i - j``."""
        return self.q_start - self.k_start

    @property
    def aligned(self) -> bool:
        """Whether the local diagonal is the global one (``delta = 0``: the last query and the
        last key are at the same global position), so ALiBi can be the built-in one."""
        return self.contiguous and self.q_start + self.rows == self.k_start + self.keys


def plan_pair(q: Segment, k: Segment, rule: Visibility) -> BlockCall | None:
    """The call for queries ``q`` against keys ``k`` under ``rule``, or None (skipped)."""
    qs, qe, ks, ke = q.start, q.end, k.start, k.end
    left, right = rule.left, rule.right
    while True:  # every cut only shrinks a range: a fixed point in a few rounds
        before = (qs, qe, ks, ke)
        if left >= 0:
            ks = max(ks, qs - left)  # keys before the first query's reach
            qe = min(qe, ke + left)  # queries whose reach starts past the last key
        if right >= 0:
            ke = min(ke, qe + right)  # keys past the last query's reach
            qs = max(qs, ks - right)  # queries whose reach ends before the first key
        if qs >= qe or ks >= ke:
            return None
        if (qs, qe, ks, ke) == before:
            break
    full = (left < 0 or qe - 1 - left <= ks) and (right < 0 or qs + right >= ke - 1)
    causal, window, kind = False, None, "full"
    if not full:
        delta = qe - ke
        local_left = -1 if left < 0 else left - delta  # >= 0 after the cuts
        local_right = -1 if right < 0 else right + delta  # >= 0 after the cuts
        causal = local_right == 0
        window = None if causal and local_left < 0 else (local_left, local_right)
        kind = "diagonal" if causal and window is None else "partial"
    return BlockCall(
        q_rows=(q.offset + qs - q.start, q.offset + qe - q.start),
        k_rows=(k.offset + ks - k.start, k.offset + ke - k.start),
        q_start=qs,
        k_start=ks,
        causal=causal,
        window=window,
        kind=kind,
    )


def plan_blocks(
    queries: Sequence[Segment], keys: Sequence[Segment], rule: Visibility, positional: bool
) -> list[BlockCall]:
    """The calls for every (query run, key run) pair, with untrimmed full pairs coalesced: runs
    adjacent in the local tensors (and, when scores depend on positions: ``positional``, in
    the sequence too) that are all full against the same key runs become one call. Zigzag's
    ring steps then take one call each past the first."""
    plans = {
        (i, j): plan_pair(q, k, rule) for i, q in enumerate(queries) for j, k in enumerate(keys)
    }

    def whole(i: int, j: int) -> bool:
        call = plans[i, j]
        return (
            call is not None
            and call.kind == "full"
            and call.rows == queries[i].length
            and call.keys == keys[j].length
        )

    def joins(a: Segment, b: Segment) -> bool:
        return a.offset + a.length == b.offset and (not positional or a.end == b.start)

    runs_of = []  # per key run: the maximal runs of query runs that see all of it
    for j in range(len(keys)):
        runs: list[tuple[int, ...]] = []
        for i in range(len(queries)):
            if not whole(i, j):
                continue
            if runs and runs[-1][-1] == i - 1 and joins(queries[i - 1], queries[i]):
                runs[-1] = (*runs[-1], i)
            else:
                runs.append((i,))
        runs_of.append(runs)
    merged: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # (query runs, key runs)
    for j, runs in enumerate(runs_of):
        for run in runs:
            previous = next((m for m in merged if m[0] == run and m[1][-1] == j - 1), None)
            if previous is not None and joins(keys[j - 1], keys[j]):
                merged[merged.index(previous)] = (run, (*previous[1], j))
            else:
                merged.append((run, (j,)))
    calls, covered = [], set()
    for run, key_runs in merged:
        covered.update((i, j) for i in run for j in key_runs)
        first_q, last_q = queries[run[0]], queries[run[-1]]
        first_k, last_k = keys[key_runs[0]], keys[key_runs[-1]]
        calls.append(
            BlockCall(
                q_rows=(first_q.offset, last_q.offset + last_q.length),
                k_rows=(first_k.offset, last_k.offset + last_k.length),
                q_start=first_q.start,
                k_start=first_k.start,
                causal=False,
                window=None,
                kind="full",
                contiguous=_consecutive(queries, run) and _consecutive(keys, key_runs),
            )
        )
    calls += [c for ij, c in plans.items() if c is not None and ij not in covered]
    return calls


def _consecutive(segments: Sequence[Segment], chosen: Sequence[int]) -> bool:
    """Whether the chosen segments follow each other in the sequence (each ends where the next
    starts)."""
    picked = [segments[i] for i in chosen]
    return all(a.end == b.start for a, b in itertools.pairwise(picked))


def visible_pairs(call: BlockCall) -> int:
    """How many (query, key) pairs of ``call`` its mask leaves visible (its work)."""
    m, n = call.rows, call.keys
    left, right = call.window if call.window is not None else (-1, -1)
    if call.causal:
        right = 0
    d = n - m  # row i's diagonal is key i + d
    high = _clipped_sum(d + right + 1, m, n) if right >= 0 else m * n
    low = _clipped_sum(d - left, m, n) if left >= 0 else 0
    return high - low


def _clipped_sum(a: int, m: int, n: int) -> int:
    """``sum(min(max(i + a, 0), n) for i in range(m))`` in O(1)."""
    first = max(0, 1 - a)  # the first i with i + a > 0
    last = min(m - 1, n - 1 - a)  # the last i with i + a < n
    middle = 0
    if first <= last:
        count = last - first + 1
        middle = count * (first + last + 2 * a) // 2
    saturated = max(0, m - max(0, n - a))  # the i < m with i + a >= n
    return middle + saturated * n
