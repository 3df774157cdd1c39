"""Block sparsity of the backward kernels (docs/backward.md, "Block sparsity").

The backward's main kernel owns a key tile and walks query tiles; its deterministic dQ kernel
owns a query tile and walks key tiles; both use their own tile shapes, not the forward's. For a
call with a ``mask_mod`` this module gives each kernel the tiles it must visit:

- the main kernel: per (batch entry, query head, key tile of ``block_n`` keys) the query tiles of
  ``block_m`` rows that the mask_mod makes partly visible (the kernel evaluates it per score)
  and fully visible (it does not): the transposed block mask, built by the block-mask builder in
  its transposed form (templates/block_mask.cu.j2) where the forward builds its masks (q's
  library and device; the CPU emulator for host arrays);
- the dQ kernel: a block mask (per query tile, key tiles) at its tile shape: the forward's block
  mask itself when the tiles agree, else built by the same builder.

With GQA the main kernel walks each query head of its group through that head's own list, so a
query tile visible to any head of the group is visited. Lists of a ``BlockMask`` are cached on
it (``BlockMask.derived``): a mask reused across layers is derived once per tile shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernelgen.calls.block_mask import (
    OUTPUTS,
    BlockMask,
    _listed,
    block_mask_reference,
    run_builder,
    to_host,
)
from kernelgen.families.backward import KEY_LISTS, QUERY_LISTS
from kernelgen.specs.expressions import Expression

__all__ = ["BackwardMasks", "TileLists", "backward_masks", "tile_lists", "tile_lists_reference"]


@dataclass(frozen=True, eq=False)
class TileLists:
    """For each (batch entry or 1, head or 1, own tile) the listed tiles (of the other axis) that
    are partly / fully visible, ascending, then -1: int32 arrays ``partial_counts`` (B, H, own
    tiles), ``partial_indices`` (B, H, own tiles, listed tiles), ``full_counts``,
    ``full_indices``. A batch (heads) of 1 holds for every batch entry (head)."""

    partial_counts: Any
    partial_indices: Any
    full_counts: Any
    full_indices: Any

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(batch, heads, own tiles, listed tiles)."""
        return tuple(int(n) for n in self.partial_indices.shape)  # type: ignore[return-value]

    def tensors(self, prefix: str) -> dict[str, Any]:
        """The four arrays by kernel parameter name (``{prefix}_partial_counts``, ...)."""
        return {f"{prefix}_{name}": getattr(self, name) for name in OUTPUTS}

    def scalars(self, prefix: str) -> tuple[tuple[str, int], ...]:
        """The (batch, head) strides of the lists in own-tile rows (0 where they broadcast)."""
        batch, heads, own, _ = self.shape
        return (
            (f"{prefix}_mask_stride_b", heads * own if batch > 1 else 0),
            (f"{prefix}_mask_stride_h", own if heads > 1 else 0),
        )

    def tile_states(self) -> np.ndarray:
        """int8 (batch, heads, own tiles, listed tiles) on the host: 0 hidden, 1 partial, 2
        full."""
        states = np.zeros(self.shape, dtype=np.int8)
        for name, state in (("partial", 1), ("full", 2)):
            indices = to_host(getattr(self, f"{name}_indices"))
            counts = to_host(getattr(self, f"{name}_counts"))
            listed = np.arange(self.shape[3]) < counts[..., None]
            b, h, own, slot = np.nonzero(listed)
            states[b, h, own, indices[b, h, own, slot]] = state
        return states

    def visited(self) -> int:
        """Listed tiles over all rows."""
        return int(to_host(self.partial_counts).sum() + to_host(self.full_counts).sum())


@dataclass(frozen=True, eq=False)
class BackwardMasks:
    """A backward call's lists: ``queries`` for the main kernel (per key tile), ``keys`` for the
    deterministic dQ kernel (per query tile; None with atomic dQ)."""

    queries: TileLists
    keys: TileLists | None

    def tensors(self) -> dict[str, Any]:
        found = self.queries.tensors(QUERY_LISTS)
        if self.keys is not None:
            found.update(self.keys.tensors(KEY_LISTS))
        return found

    def scalars(self) -> tuple[tuple[str, int], ...]:
        found = self.queries.scalars(QUERY_LISTS)
        return found + (self.keys.scalars(KEY_LISTS) if self.keys is not None else ())


def _lists(outputs: Mapping[str, Any]) -> TileLists:
    return TileLists(*(outputs[name] for name in OUTPUTS))


def tile_lists(
    mask_mod: Expression,
    sizes: tuple[int, int, int, int],
    block_m: int,
    block_n: int,
    mod_inputs: Mapping[str, Any],
    like: Any,
    *,
    transposed: bool,
) -> TileLists:
    """The lists of the checked ``mask_mod`` over (batch, heads, seqlen_q, seqlen_k) in
    ``block_m`` x ``block_n`` tiles, built by the block-mask builder in the library and on the
    device of ``like`` (q): per key tile the query tiles with ``transposed``, else per query
    tile the key tiles."""
    outputs = run_builder(
        mask_mod, sizes, block_m, block_n, dict(mod_inputs), like, transposed=transposed
    )
    return _lists(outputs)


def tile_lists_reference(
    mask_mod: Expression | str,
    sizes: tuple[int, int, int, int],
    block_m: int,
    block_n: int,
    mod_inputs: Mapping[str, Any] | None = None,
    *,
    transposed: bool,
) -> TileLists:
    """:func:`tile_lists` from the NumPy block mask (the float64 evaluator), host arrays."""
    mask = block_mask_reference(
        mask_mod, *sizes, block_m=block_m, block_n=block_n, mod_inputs=mod_inputs
    )
    states = mask.tile_states()
    if transposed:
        states = states.transpose(0, 1, 3, 2)
    partial_counts, partial_indices = _listed(states == 1)
    full_counts, full_indices = _listed(states == 2)
    return TileLists(partial_counts, partial_indices, full_counts, full_indices)


def _mask_sizes(
    mask_mod: Expression, block_mask: BlockMask | None, sizes: tuple[int, int, int, int]
) -> tuple[int, int, int, int]:
    """The (batch, heads) to build for: a block mask's own (1 broadcasts, as in the forward),
    else 1 where mask_mod reads no ``b`` (``h``), so one copy serves every batch entry (head)."""
    batch, heads, seqlen_q, seqlen_k = sizes
    if block_mask is not None:
        return block_mask.batch, block_mask.heads, seqlen_q, seqlen_k
    return (
        batch if mask_mod.uses("b") else 1,
        heads if mask_mod.uses("h") else 1,
        seqlen_q,
        seqlen_k,
    )


def _derived(
    mask_mod: Expression,
    block_mask: BlockMask | None,
    sizes: tuple[int, int, int, int],
    tile: tuple[int, int],
    mod_inputs: Mapping[str, Any],
    like: Any,
    transposed: bool,
) -> TileLists:
    """One kernel's lists: the block mask's own when it already has them (same tiles, not
    transposed), its cached derivation, or a fresh build."""
    if block_mask is None:
        return tile_lists(mask_mod, sizes, *tile, mod_inputs, like, transposed=transposed)
    if not transposed and tile == (block_mask.block_m, block_mask.block_n):
        return _lists({name: getattr(block_mask, name) for name in OUTPUTS})
    key = (transposed, *tile)
    found = block_mask.derived.get(key)
    if found is None:
        found = tile_lists(mask_mod, sizes, *tile, mod_inputs, like, transposed=transposed)
        block_mask.derived[key] = found
    return found


def backward_masks(
    spec: Any,
    mask_mod: Expression,
    block_mask: BlockMask | None,
    sizes: tuple[int, int, int, int],
    mod_inputs: Mapping[str, Any],
    like: Any,
) -> BackwardMasks:
    """The lists a block-sparse backward ``spec`` (a BackwardSpec) reads for a call of (batch,
    heads, seqlen_q, seqlen_k) ``sizes`` with ``mask_mod`` (and the forward's ``block_mask``,
    if any), in ``like``'s library and device."""
    built = _mask_sizes(mask_mod, block_mask, sizes)
    queries = _derived(
        mask_mod, block_mask, built, (spec.block_m, spec.block_n), mod_inputs, like, True
    )
    keys = None
    if spec.deterministic:
        keys = _derived(
            mask_mod, block_mask, built, (spec.dq_block_m, spec.dq_block_n), mod_inputs, like,
            False,
        )  # fmt: skip
    return BackwardMasks(queries, keys)
