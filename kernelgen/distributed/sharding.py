"""Which global sequence positions each rank of a context-parallel group holds.

A :class:`Sharding` lists, per rank, the runs of consecutive global positions (segments) its
local tensors hold, in local order. Two layouts are built in:

- ``Sharding.contiguous(total, world)``: rank r holds one run; equal lengths by default
  (``r * total // world`` to ``(r + 1) * total // world``), or any ``lengths`` summing to
  ``total`` (zero included).
- ``Sharding.zigzag(total, world)``: the sequence is cut into ``2 * world`` chunks
  (``c * total // (2 * world)`` boundaries) and rank r holds chunks ``r`` and
  ``2 * world - 1 - r``, in that order: under a causal mask every rank then has the same work.

The helpers cut a global tensor into a rank's shard (:meth:`Sharding.shard`), put shards back
together (:meth:`Sharding.unshard`) and give a rank's global positions (for rotary embeddings:
:meth:`Sharding.positions`). Everything here is pure; only ``shard``/``unshard`` touch tensors
(torch or NumPy), through their ``narrow``/slicing.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kernelgen.errors import InputError

__all__ = ["Segment", "Sharding"]


@dataclass(frozen=True)
class Segment:
    """A run of ``length`` consecutive global positions from ``start``, held from row ``offset``
    of a local tensor."""

    start: int
    length: int
    offset: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Sharding:
    """Per rank, the ``(start, length)`` runs of global positions it holds, in local order; the
    runs of all ranks tile ``[0, total)`` exactly once. ``name`` is for messages."""

    runs: tuple[tuple[tuple[int, int], ...], ...]
    name: str = "custom"

    def __post_init__(self) -> None:
        if not self.runs:
            raise InputError("sharding: needs at least one rank")
        if any(length < 0 for rank in self.runs for _, length in rank):
            raise InputError(f"sharding: runs {self.runs} hold a negative length")
        position = 0
        for start, length in sorted((s, n) for rank in self.runs for s, n in rank if n):
            if start != position:
                raise InputError(
                    f"sharding: runs {self.runs} must tile [0, total) once, without gaps or "
                    "overlaps (a run is (start, length >= 0))"
                )
            position += length

    # ---- constructors
    @classmethod
    def contiguous(cls, total: int, world: int, lengths: Sequence[int] | None = None) -> Sharding:
        """One run per rank, in rank order: equal (``total // world``, the remainder spread over
        the last ranks) or the given ``lengths`` (one per rank, >= 0, summing to ``total``)."""
        total, world = _positive("total", total, 0), _positive("world", world, 1)
        if lengths is None:
            bounds = [r * total // world for r in range(world + 1)]
        else:
            lengths = [int(n) for n in lengths]
            if len(lengths) != world or any(n < 0 for n in lengths) or sum(lengths) != total:
                raise InputError(
                    f"lengths={lengths} must give {world} lengths >= 0 summing to total={total}"
                )
            bounds = [sum(lengths[:r]) for r in range(world + 1)]
        runs = tuple(((bounds[r], bounds[r + 1] - bounds[r]),) for r in range(world))
        return cls(runs, "contiguous")

    @classmethod
    def zigzag(cls, total: int, world: int) -> Sharding:
        """``2 * world`` chunks; rank r holds chunks r and ``2 * world - 1 - r`` (load balance of
        causal attention: each rank holds one early and one late chunk)."""
        total, world = _positive("total", total, 0), _positive("world", world, 1)
        chunks = 2 * world
        bounds = [c * total // chunks for c in range(chunks + 1)]

        def chunk(c: int) -> tuple[int, int]:
            return (bounds[c], bounds[c + 1] - bounds[c])

        runs = tuple((chunk(r), chunk(chunks - 1 - r)) for r in range(world))
        return cls(runs, "zigzag")

    # ---- queries
    @property
    def world(self) -> int:
        return len(self.runs)

    @property
    def total(self) -> int:
        return sum(n for rank in self.runs for _, n in rank)

    def length(self, rank: int) -> int:
        """Tokens rank ``rank`` holds."""
        return sum(n for _, n in self.runs[rank])

    @property
    def max_length(self) -> int:
        return max(self.length(r) for r in range(self.world))

    def segments(self, rank: int) -> list[Segment]:
        """Rank ``rank``'s non-empty runs as :class:`Segment` (with their local rows)."""
        found, offset = [], 0
        for start, length in self.runs[rank]:
            if length:
                found.append(Segment(start, length, offset))
            offset += length
        return found

    def positions(self, rank: int) -> list[int]:
        """The global position of each local token of rank ``rank``, in local order."""
        return [p for s in self.segments(rank) for p in range(s.start, s.end)]

    def global_order(self) -> list[tuple[int, Segment]]:
        """Every ``(rank, segment)`` by global start: reading them in turn gives the sequence."""
        pieces = [(r, s) for r in range(self.world) for s in self.segments(r)]
        return sorted(pieces, key=lambda item: item[1].start)

    # ---- tensors
    def shard(self, x: Any, rank: int, dim: int = 2) -> Any:
        """Rank ``rank``'s shard of the global tensor ``x`` (sequence along ``dim``): a view for
        one run, a concatenation otherwise (torch tensors or NumPy arrays)."""
        if x.shape[dim] != self.total:
            raise InputError(
                f"x has {x.shape[dim]} positions along dim {dim}, the sharding {self.total}"
            )
        pieces = [_narrow(x, dim, start, length) for start, length in self.runs[rank]]
        return pieces[0] if len(pieces) == 1 else _cat(pieces, dim)

    def unshard(self, shards: Sequence[Any], dim: int = 2) -> Any:
        """The global tensor from every rank's shard (in rank order), sequence along ``dim``."""
        if len(shards) != self.world:
            raise InputError(f"unshard: got {len(shards)} shards for {self.world} ranks")
        for r, x in enumerate(shards):
            if x.shape[dim] != self.length(r):
                raise InputError(
                    f"unshard: shard {r} has {x.shape[dim]} positions along dim {dim}, the "
                    f"sharding gives rank {r} {self.length(r)}"
                )
        pieces = [_narrow(shards[r], dim, s.offset, s.length) for r, s in self.global_order()]
        if not pieces:
            return _narrow(shards[0], dim, 0, 0)
        return _cat(pieces, dim)


def _positive(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InputError(f"{name}={value!r}: expected an integer >= {least}")
    return value


def _narrow(x: Any, dim: int, start: int, length: int) -> Any:
    if hasattr(x, "narrow"):
        return x.narrow(dim, start, length)
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, start + length)
    return x[tuple(index)]


def _cat(pieces: list[Any], dim: int) -> Any:
    """Concatenate torch tensors (torch is loaded: they exist) or NumPy arrays along ``dim``."""
    first = pieces[0]
    if type(first).__module__.startswith("torch"):
        return sys.modules["torch"].cat(pieces, dim=dim)
    import numpy as np

    return np.concatenate(pieces, axis=dim)
