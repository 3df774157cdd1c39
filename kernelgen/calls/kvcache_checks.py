"""The checks of a KV cache's metadata (``cache_seqlens``, ``block_table``) before any write:
on the host for host values, and on the device (``validate=True``) for device ones.

Every function raises :class:`~kernelgen.errors.InputError` naming the argument, the entry and
its value, or returns; none writes anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kernelgen.errors import InputError, InputTypeError
from kernelgen.runtime.array_ops import ArrayOps
from kernelgen.runtime.frameworks import module_of

PAGE_SIZE_MULTIPLE = 16  # a paged cache's keys per page: a multiple of one mma k-step


@dataclass(frozen=True)
class PagedLayout:
    """A paged cache (num_pages, page_size, Hkv, D) and its block table (B, pages_per_seq)."""

    num_pages: int
    page_size: int
    pages_per_seq: int
    host_table: np.ndarray | None  # int64 copy of a host block table; None: a device one
    kernel_table: Any  # what the kernels read: a contiguous int32 NumPy copy, or the device array
    row_stride: int  # elements between the kernel table's rows

    @property
    def capacity(self) -> int:
        """Keys one sequence can hold: its pages times the keys per page."""
        return self.pages_per_seq * self.page_size


def check_lengths(lengths: np.ndarray, new_len: int, capacity: int, page_size: int = 0) -> None:
    """0 <= cache_seqlens[b] and cache_seqlens[b] + S_new <= capacity, naming the first bad b
    (``page_size``: a paged cache, whose capacity is its block table's pages)."""
    bad = np.flatnonzero((lengths < 0) | (lengths + new_len > capacity))
    if not bad.size:
        return
    b = int(bad[0])
    length = int(lengths[b])
    if length < 0:
        raise InputError(f"cache_seqlens[{b}] is {length}; lengths are 0 or more")
    if page_size:
        need = -(-(length + new_len) // page_size)
        raise InputError(
            f"cache_seqlens[{b}] is {length} and S_new is {new_len}: {length + new_len} keys need "
            f"{need} pages of {page_size} keys but block_table has {capacity // page_size} pages "
            "per sequence"
        )
    raise InputError(
        f"cache_seqlens[{b}] is {length} and S_new is {new_len}: {length + new_len} keys do "
        f"not fit the cache's S_max = {capacity} rows"
    )


def used_pages(total_lengths: np.ndarray, page_size: int, pages_per_seq: int) -> np.ndarray:
    """(B, pages_per_seq) booleans: the block-table entries sequences of these lengths read."""
    needed = -(-total_lengths // page_size)
    return np.arange(pages_per_seq)[None, :] < needed[:, None]


def check_pages(table: np.ndarray, total_lengths: np.ndarray, layout: PagedLayout) -> None:
    """Every block-table entry a sequence of ``total_lengths`` keys reads names a page of the
    cache, and no row names one page twice among them (entries past a sequence's pages are
    never read and may hold anything)."""
    used = used_pages(total_lengths, layout.page_size, layout.pages_per_seq)
    bad = np.argwhere(used & ((table < 0) | (table >= layout.num_pages)))
    if bad.size:
        b, j = (int(x) for x in bad[0])
        raise InputError(_page_message(b, j, int(table[b, j]), int(total_lengths[b]), layout))
    repeated = np.flatnonzero(_repeated_pages(ArrayOps(table), table, used).any(axis=1))
    if repeated.size:
        b = int(repeated[0])
        raise InputError(_repeat_message(b, table[b], int(total_lengths[b]), layout))


def _repeated_pages(ops: ArrayOps, pages: Any, used: Any) -> Any:
    """(B, pages - 1) booleans, by ``ops``' library: True where a row's used entries, sorted,
    name one page twice (unused entries get distinct negative stand-ins, never pages)."""
    unused = -1 - ops.arange(pages.shape[1])[None, :]
    ordered = ops.sort_rows(ops.xp.where(used, pages, unused))
    return ordered[:, 1:] == ordered[:, :-1]


def _repeat_message(b: int, row: np.ndarray, keys: int, layout: PagedLayout) -> str:
    used = -(-keys // layout.page_size)
    first: dict[int, int] = {}
    for j, page in enumerate(row[:used].tolist()):
        if page in first:
            return (
                f"block_table[{b}, {j}] is {page}, as is block_table[{b}, {first[page]}]; entry "
                f"b={b} reads {keys} keys, so its first {used} entries must be distinct pages "
                "(a page holds keys of one position in a sequence)"
            )
        first[page] = j
    raise AssertionError("no repeated page in the row")  # the caller found one


def _page_message(b: int, j: int, value: int, keys: int, layout: PagedLayout) -> str:
    return (
        f"block_table[{b}, {j}] is {value}; entry b={b} reads {keys} keys, so its first "
        f"{-(-keys // layout.page_size)} entries must be page indices from 0 to "
        f"{layout.num_pages - 1} (k_cache holds {layout.num_pages} pages)"
    )


def paged_slots(
    table: np.ndarray, lengths: np.ndarray, new_len: int, layout: PagedLayout
) -> tuple[np.ndarray, np.ndarray]:
    """(pages, rows), int64 of B * S_new each in (b, s) order: where row s of entry b's new keys
    goes (key lengths[b] + s), for a table that passed :func:`check_pages`. Raises when two
    entries would write one row (which write wins would be undefined), or when a row written
    holds a key some entry reads (its own earlier keys included): pages shared between
    sequences are read-only."""
    page_size = layout.page_size
    keys = lengths[:, None] + np.arange(new_len)[None, :]
    pages = np.take_along_axis(table, keys // page_size, axis=1)
    rows = keys % page_size
    slots = (pages * page_size + rows).reshape(-1)
    unique, counts = np.unique(slots, return_counts=True)
    if (counts > 1).any():
        slot = int(unique[counts > 1][0])
        writers = sorted({int(i) // new_len for i in np.flatnonzero(slots == slot)})
        raise InputError(
            f"block_table: entries {writers} would all write k_new/v_new into page "
            f"{slot // page_size}, row {slot % page_size}; pages shared between sequences are "
            "read-only (append into pages only one sequence uses)"
        )
    _check_unread(table, lengths, pages.reshape(-1), rows.reshape(-1), layout)
    return pages.reshape(-1), rows.reshape(-1)


def _check_unread(
    table: np.ndarray, lengths: np.ndarray, pages: np.ndarray, rows: np.ndarray, layout: PagedLayout
) -> None:
    """No (pages[i], rows[i]) written holds one of the cache_seqlens[b] valid keys of an entry
    b: the rows of each page that valid keys fill are counted over every entry's pages."""
    page_size = layout.page_size
    starts = np.arange(layout.pages_per_seq)[None, :] * page_size
    filled = np.clip(lengths[:, None] - starts, 0, page_size)  # (B, pages): valid rows per entry
    in_use = filled > 0
    valid_rows = np.zeros(layout.num_pages, np.int64)  # rows 0 .. n - 1 of page p hold keys
    np.maximum.at(valid_rows, table[in_use], filled[in_use])
    bad = np.flatnonzero(rows < valid_rows[pages])
    if not bad.size:
        return
    i = int(bad[0])
    new_len = pages.size // lengths.size
    writer, key = i // new_len, int(lengths[i // new_len]) + i % new_len
    page, row = int(pages[i]), int(rows[i])
    owner, j = (int(x) for x in np.argwhere((table == page) & (filled > row))[0])
    raise InputError(
        f"block_table: entry b={writer} would write key {key} of k_new/v_new into page {page}, "
        f"row {row}, which holds key {j * page_size + row} of entry b={owner} "
        f"(cache_seqlens[{owner}] = {int(lengths[owner])}); appends go to rows no entry reads "
        "(block_table[b, j] for the keys past cache_seqlens[b] must name pages, or rows of "
        "them, that hold no valid key)"
    )


# ---- validate=True: the same checks where the metadata lives ----------------------------


def validate_on_device(
    cache_seqlens: Any, new_len: int, capacity: int, layout: PagedLayout | None, table: Any
) -> None:
    """``validate=True``: the length and block-table checks run by the arrays' own library
    where the metadata lives (device ``cache_seqlens`` and/or ``block_table``; host values
    are uploaded for the comparison), reading back one flag and index per check together (one
    synchronisation); raises like the host checks, before any launch or write."""
    like = table if cache_seqlens is None or module_of(cache_seqlens) == "numpy" else cache_seqlens
    ops = ArrayOps(like)
    lengths = ops.int64(cache_seqlens)
    flags = [(lengths < 0) | (lengths + new_len > capacity)]
    if layout is not None:
        pages = ops.int64(table)
        needed = (lengths + new_len + layout.page_size - 1) // layout.page_size
        used = ops.arange(layout.pages_per_seq)[None, :] < needed[:, None]
        flags.append(used & ((pages < 0) | (pages >= layout.num_pages)))
        flags.append(_repeated_pages(ops, pages, used))
    bad_length, *bad_pages = ops.first_true_each(flags)
    if bad_length >= 0:
        values = ops.host(lengths)
        check_lengths(values, new_len, capacity, layout.page_size if layout else 0)  # raises
    if layout is None:
        return
    bad_page, repeated = bad_pages
    if bad_page >= 0:
        b, j = divmod(bad_page, layout.pages_per_seq)
        value = int(ops.host(pages[b, j]))
        keys = int(ops.host(lengths[b])) + new_len
        raise InputError(_page_message(b, j, value, keys, layout))
    if repeated >= 0:
        check_pages(ops.host(pages), ops.host(lengths) + new_len, layout)  # raises


def check_table_info(info: Any, batch: int) -> None:
    """A block table's metadata (an api TensorInfo): int32, (batch, pages per sequence) with
    at least one page, rows contiguous."""
    if info.dtype != "int32":
        raise InputTypeError(f"block_table has dtype {info.dtype}; expected int32")
    if len(info.shape) != 2 or info.shape[0] != batch or info.shape[1] < 1:
        raise InputError(
            f"block_table has shape {info.shape}; expected ({batch}, pages per sequence), one "
            "row of at least one page index per batch entry"
        )
    if info.strides[1] != 1:
        raise InputError(
            f"block_table has strides {info.strides}; expected rows of contiguous entries"
        )
