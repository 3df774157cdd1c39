"""The checks of a KV cache's metadata (``cache_seqlens``, ``block_table``) before any write:
on the host for host values, and on the device (``validate=True``) for device ones.

Every function raises :class:`~kernelgen.errors.InputError` naming the argument, the entry and
its value, or returns; none writes anything.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernelgen.errors import InputError, InputTypeError
from kernelgen.frameworks import module_of

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
    cache (entries past a sequence's pages are never read and may hold anything)."""
    used = used_pages(total_lengths, layout.page_size, layout.pages_per_seq)
    bad = np.argwhere(used & ((table < 0) | (table >= layout.num_pages)))
    if bad.size:
        b, j = (int(x) for x in bad[0])
        raise InputError(_page_message(b, j, int(table[b, j]), int(total_lengths[b]), layout))


def _page_message(b: int, j: int, value: int, keys: int, layout: PagedLayout) -> str:
    return (
        f"block_table[{b}, {j}] is {value}; entry b={b} reads {keys} keys, so its first "
        f"{-(-keys // layout.page_size)} entries must be page indices from 0 to "
        f"{layout.num_pages - 1} (k_cache holds {layout.num_pages} pages)"
    )


def paged_slots(
    table: np.ndarray, lengths: np.ndarray, new_len: int, page_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(pages, rows), int64 of B * S_new each in (b, s) order: where row s of entry b's new keys
    goes (key lengths[b] + s). Two entries writing one row (a page shared by both past their
    common prefix) raise: which write wins would be undefined."""
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
    return pages.reshape(-1), rows.reshape(-1)


# ---- validate=True: the same checks where the metadata lives ----------------------------


class _Ops:
    """The few array operations the device checks need, in NumPy's spelling, for NumPy, CuPy
    or torch arrays (``like``: an array of the library, on the device to use)."""

    def __init__(self, like: Any) -> None:
        self.library = module_of(like)
        self.like = like
        if self.library == "torch":
            self.xp = sys.modules["torch"]
        elif self.library == "cupy":
            self.xp = sys.modules["cupy"]
        else:
            self.xp = np

    def int64(self, values: Any) -> Any:
        """``values`` (host or of this library) as an int64 array of this library."""
        if self.library == "torch":
            torch = self.xp
            if not isinstance(values, torch.Tensor):
                values = torch.as_tensor(np.asarray(values))
            return values.to(device=self.like.device, dtype=torch.int64)
        return self.xp.asarray(values).astype(self.xp.int64)

    def arange(self, n: int) -> Any:
        if self.library == "torch":
            return self.xp.arange(n, device=self.like.device)
        return self.xp.arange(n)

    def first_true(self, mask: Any) -> int:
        """Flat index of the first True of ``mask``, or -1 (one read back to the host)."""
        if self.library == "torch":
            flat = mask.reshape(-1).to(self.xp.int32)
            if flat.numel() == 0:
                return -1
            found = self.xp.stack([flat.max(), flat.argmax().to(self.xp.int32)])
            any_true, index = (int(x) for x in found.cpu().tolist())
        else:
            flat = mask.reshape(-1).astype(self.xp.int32)
            if flat.size == 0:
                return -1
            found = self.xp.stack([flat.max(), flat.argmax().astype(self.xp.int32)])
            any_true, index = (int(x) for x in (found.get() if self.library == "cupy" else found))
        return index if any_true else -1

    def host(self, values: Any) -> np.ndarray:
        if self.library == "torch":
            return values.cpu().numpy()
        return values.get() if self.library == "cupy" else np.asarray(values)


def validate_on_device(
    cache_seqlens: Any, new_len: int, capacity: int, layout: PagedLayout | None, table: Any
) -> None:
    """``validate=True``: the length and block-table checks run by the arrays' own library
    where the metadata lives (device ``cache_seqlens`` and/or ``block_table``; host values
    are uploaded for the comparison), reading back one flag and index per check; raises like
    the host checks, before any launch or write."""
    like = table if cache_seqlens is None or module_of(cache_seqlens) == "numpy" else cache_seqlens
    ops = _Ops(like)
    lengths = ops.int64(cache_seqlens)
    bad = ops.first_true((lengths < 0) | (lengths + new_len > capacity))
    if bad >= 0:
        values = ops.host(lengths)
        check_lengths(values, new_len, capacity, layout.page_size if layout else 0)  # raises
    if layout is None:
        return
    pages = ops.int64(table)
    needed = (lengths + new_len + layout.page_size - 1) // layout.page_size
    used = ops.arange(layout.pages_per_seq)[None, :] < needed[:, None]
    bad = ops.first_true(used & ((pages < 0) | (pages >= layout.num_pages)))
    if bad >= 0:
        b, j = divmod(bad, layout.pages_per_seq)
        value = int(ops.host(pages[b, j]))
        keys = int(ops.host(lengths[b])) + new_len
        raise InputError(_page_message(b, j, value, keys, layout))


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
