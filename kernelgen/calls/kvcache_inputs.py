"""A KV-cache call's own inputs, shared by the 16-bit and the fp8 cache calls
(:mod:`kernelgen.calls.kvcache`, :mod:`kernelgen.calls.kvcache_fp8`): ``k_new``/``v_new``
against the cache, ``cache_seqlens`` and the block table on the host or the device, the paged
cache's geometry, and the appends (slice assignments and scatters of the arrays' own library).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from kernelgen.calls.attention import TensorInfo, describe, host_lengths, host_values
from kernelgen.calls.kvcache_checks import (
    PAGE_SIZE_MULTIPLE,
    PagedLayout,
    check_table_info,
    validate_on_device,
)
from kernelgen.errors import InputError, InputTypeError
from kernelgen.runtime.frameworks import module_of, refuse_during_capture
from kernelgen.runtime.host import is_host_array

LIBRARIES = ("numpy", "cupy", "torch")


def check_new(k_new: Any, v_new: Any, cache: Any) -> list[TensorInfo]:
    """k_new's and v_new's infos, checked against the cache's (B, S_max, Hkv, D) info."""
    if k_new is None or v_new is None:
        given, missing = ("k_new", "v_new") if v_new is None else ("v_new", "k_new")
        raise InputError(f"{given} is given but {missing} is not; pass both or neither")
    batch, _, kv_heads, head_dim = cache.shape
    infos = [describe(k_new, "k_new"), describe(v_new, "v_new")]
    for t in infos:
        if len(t.shape) != 4:
            raise InputError(
                f"{t.name} has rank {len(t.shape)} (shape {t.shape}); expected rank 4, "
                "(B, S_new, Hkv, D)"
            )
        if (t.shape[0], t.shape[2], t.shape[3]) != (batch, kv_heads, head_dim):
            raise InputError(
                f"{t.name} has shape {t.shape}; expected (B, S_new, Hkv, D) = ({batch}, S_new, "
                f"{kv_heads}, {head_dim}), the cache's batch, heads and head_dim"
            )
        if t.dtype != cache.dtype:
            raise InputTypeError(
                f"{t.name} has dtype {t.dtype} but the cache has {cache.dtype}; they must match"
            )
    if infos[0].shape != infos[1].shape:
        raise InputError(
            f"k_new has shape {infos[0].shape} but v_new has {infos[1].shape}; they must match"
        )
    return infos


def read_metadata(
    appending: bool,
    validate: bool,
    cache_seqlens: Any,
    block_table: Any,
    lengths: np.ndarray | None,
    table: np.ndarray | None,
    max_keys: int,
    layout: Any,
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The cache lengths and block table on the host where the call needs them: an appending
    call reads device values once (its write positions come from them; refused while a CUDA
    graph captures), a validating one checks device values where they are (``lengths`` and
    ``table``: the host values already known, or None). Returns (lengths, table)."""
    paged = block_table is not None
    if appending:
        for name, values, host in (
            ("cache_seqlens", cache_seqlens, lengths),
            ("block_table", block_table, table),
        ):
            if host is None and values is not None:
                refuse_during_capture(name, values, "host values (lists or NumPy arrays)")
        if lengths is None:
            lengths = host_values(cache_seqlens).astype(np.int64)
        if paged and table is None:
            table = host_values(block_table).astype(np.int64)
    elif validate and (lengths is None or (paged and table is None)):
        validate_on_device(
            cache_seqlens if lengths is None else lengths, 0, max_keys, layout,
            block_table if table is None else table,
        )  # fmt: skip
    return lengths, table


def cache_lengths(values: Any, batch: int, q: Any) -> np.ndarray | None:
    """``cache_seqlens`` as host int64 lengths, or None for an int32 device array of q's
    library (checked here, read later only if needed)."""
    library = module_of(values)
    if not isinstance(values, (int, np.integer, list, tuple)) and library not in LIBRARIES:
        raise InputTypeError(
            f"cache_seqlens has type {type(values).__name__}; expected an int, a list of ints "
            "or an int32 NumPy, CuPy or torch array"
        )
    lengths = host_lengths(values, "cache_seqlens", batch)
    if lengths is None and library != module_of(q):
        raise InputTypeError(
            f"cache_seqlens is a {library} array but q is a {module_of(q)} one; pass it in q's "
            "library or on the host"
        )
    return lengths


def paged_layout(cache: TensorInfo, block_table: Any, batch: int) -> PagedLayout:
    """The paged cache's geometry from k_cache (num_pages, page_size, Hkv, D) and the checked
    block table (host values copied, device ones described)."""
    num_pages, page_size = cache.shape[:2]
    if page_size % PAGE_SIZE_MULTIPLE or page_size == 0:
        raise InputError(
            f"k_cache has page_size {page_size} (shape {cache.shape}, (num_pages, page_size, "
            f"Hkv, D)); page_size must be a positive multiple of {PAGE_SIZE_MULTIPLE}"
        )
    if isinstance(block_table, (list, tuple)) or is_host_array(block_table):
        host = host_values(block_table)
        if isinstance(block_table, (list, tuple)):  # Python ints: converted, range-checked
            if host.size and host.dtype.kind not in "iu":
                raise InputTypeError(f"block_table holds {host.dtype} values; expected integers")
            host = host.astype(np.int64)
            check_table_info(describe(host.astype(np.int32), "block_table"), batch)
        else:
            check_table_info(describe(np.ascontiguousarray(host), "block_table"), batch)
        kernel_table = np.ascontiguousarray(host, np.int32)
        return PagedLayout(
            num_pages, page_size, host.shape[1], host.astype(np.int64), kernel_table, host.shape[1]
        )
    library = module_of(block_table)
    if library not in LIBRARIES:
        raise InputTypeError(
            f"block_table has type {type(block_table).__name__}; expected a list of lists or an "
            "int32 NumPy, CuPy or torch array"
        )
    info = describe(block_table, "block_table")
    check_table_info(info, batch)
    return PagedLayout(num_pages, page_size, info.shape[1], None, block_table, info.strides[0])


def as_batched(cache: TensorInfo, layout: PagedLayout | None) -> TensorInfo:
    """The cache as the kernels address it, (B, S_max, Hkv, D): itself when contiguous; a paged
    one as (B, pages per sequence x page_size, Hkv, D) with the page stride as batch stride
    (the kernels find each key's page in the block table)."""
    if layout is None:
        return cache
    batch = layout.kernel_table.shape[0]
    shape = (batch, layout.capacity, *cache.shape[2:])
    return TensorInfo(cache.name, shape, cache.strides, cache.dtype, cache.source)


def append_rows(cache: Any, new: Any, lengths: np.ndarray, new_len: int) -> None:
    """cache[b, lengths[b] : lengths[b] + new_len] = new[b] for every b (one slice assignment
    when all lengths are equal), in the arrays' own library and stream."""
    if lengths.size and (lengths == lengths[0]).all():
        start = int(lengths[0])
        cache[:, start : start + new_len] = new
        return
    for b, start in enumerate(lengths.tolist()):
        cache[b, start : start + new_len] = new[b]


def append_paged_rows(cache: Any, new: Any, pages: np.ndarray, rows: np.ndarray) -> None:
    """cache[pages[i], rows[i]] = row i of new (B, S_new, Hkv, D) in (b, s) order: one scatter
    in the arrays' own library and stream (the slots are distinct: paged_slots)."""
    flat = new.reshape(-1, *new.shape[2:])
    library = module_of(cache)
    if library == "torch":
        torch = sys.modules["torch"]
        index: tuple[Any, Any] = tuple(torch.from_numpy(x).to(cache.device) for x in (pages, rows))
    elif library == "cupy":
        cupy = sys.modules["cupy"]
        index = (cupy.asarray(pages), cupy.asarray(rows))
    else:
        index = (pages, rows)
    cache[index] = flat
