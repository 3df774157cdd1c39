"""The table ``kernelgen emulate`` prints: one row per check (what, the emulated value, the
reference, ok/FAIL or information only), and the rows of the memory facts every forward spec
shares (ldmatrix wavefronts, cp.async or TMA bytes read, key tiles visited)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from rich import box
from rich.table import Table

from kernelgen.specs.forward import DTYPE_BYTES, KernelSpec


@dataclass
class Row:
    what: str
    value: str
    reference: str
    ok: bool | None  # None: information only


def memory_rows(spec: KernelSpec, run, shape: tuple[int, ...], block_mask: Any = None) -> list[Row]:
    """``block_mask``: a block-sparse spec's (the TMA count expects its listed tiles)."""
    from kernelgen.runtime.launch import launch_geometry

    b, h, hkv, sq, sk = shape
    main = run.stats[spec.uri]
    rows = []
    if main.ldmatrix:
        rows.append(
            Row(
                "ldmatrix shared-memory wavefronts",
                f"{main.ldmatrix_wavefronts}",
                f"ideal {main.ldmatrix_ideal}",
                None,
            )
        )
    else:
        rows.append(Row("ldmatrix shared-memory wavefronts", "n/a", "no ldmatrix", None))
    row_bytes = spec.head_dim * DTYPE_BYTES[spec.dtype]
    minimum = (b * h * sq + 2 * b * hkv * sk) * row_bytes  # q, k and v read once
    if main.cp_async_global_bytes:
        ratio = main.cp_async_global_bytes / minimum
        rows.append(
            Row(
                "global bytes read (cp.async)",
                f"{main.cp_async_global_bytes} ({ratio:.2f}x)",
                f"minimum {minimum}",
                None,
            )
        )
        # Every key tile a block visits is copied whole (rows past Sk zero-filled).
        per_tile = spec.block_n * spec.head_dim_padded * DTYPE_BYTES[spec.dtype] // 16
        visited = main.cp_async_copies_by_arg.get("k", 0) / per_tile
        row_blocks = launch_geometry(spec, run.problem)[0][0]  # (row tile, head) blocks
        every = row_blocks * math.ceil(sk / spec.block_n)
        rows.append(Row("key tiles visited", f"{visited:g}", f"of {every} (no skipping)", None))
    elif main.tma_bytes:
        rows += tma_rows(spec, main.tma_bytes, minimum, shape, run.problem.num_splits, block_mask)
    else:
        rows.append(Row("global bytes read (cp.async)", "n/a", "plain loads, not counted", None))
        rows.append(Row("key tiles visited", "n/a", "counted from cp.async", None))
    return rows


def tma_rows(
    spec: KernelSpec,
    tma_bytes: int,
    minimum: int,
    shape: tuple[int, ...],
    num_splits: int = 1,
    block_mask: Any = None,
) -> list:
    """wgmma specs: the bytes their TMA boxes brought in (whole boxes: 128-byte column blocks,
    rows past the sequence zero-filled) and the key tiles they visited, from those bytes less
    the Q tiles of the blocks that load one (a block whose rows see no key, or whose split-KV
    chunk holds none of them, loads nothing). Packed GQA: a block's rows are (query, head)
    pairs of one K/V head. Block-sparse (``block_mask``): the tiles its lists hold within each
    row tile's causal reach."""
    b, h, hkv, sq, sk = shape
    row_bytes = spec.column_blocks * spec.qk_row_bytes  # a Q tile row (whole swizzled blocks)
    rows_per_query, heads = (h // hkv, b * hkv) if spec.pack_gqa else (1, b * h)
    all_tiles = math.ceil(sk / spec.block_n)
    splits = num_splits if spec.split_kv else 1
    per_chunk = math.ceil(all_tiles / splits)
    ends = []  # per row tile: the end of the key tiles its rows may see
    for first in range(0, sq * rows_per_query, spec.block_m):
        last = (min(first + spec.block_m, sq * rows_per_query) - 1) // rows_per_query
        kv_end = min(sk, last + 1 + sk - sq) if spec.causal else sk
        ends.append(math.ceil(kv_end / spec.block_n) if kv_end > 0 else 0)
    if block_mask is None:
        key_tiles = [  # per (row tile, chunk) block of one head
            max(0, min(end, chunk * per_chunk + per_chunk) - chunk * per_chunk)
            for end in ends
            for chunk in range(splits)
        ]
        loading, expected = heads * sum(1 for n in key_tiles if n), heads * sum(key_tiles)
    else:  # (not split, not packed) per (batch entry, head, row tile) block
        listed = np.broadcast_to(block_mask.tile_states() > 0, (b, h, len(ends), all_tiles))
        counts = (listed & (np.arange(all_tiles) < np.array(ends)[:, None])).sum(axis=-1)
        loading, expected = int((counts > 0).sum()), int(counts.sum())
    q_bytes = loading * spec.block_m * row_bytes
    visited = (tma_bytes - q_bytes) / (spec.k_tile_bytes + spec.v_tile_bytes)
    every = heads * len(ends) * all_tiles
    return [
        Row(
            "global bytes read (TMA boxes)",
            f"{tma_bytes} ({tma_bytes / minimum:.2f}x)",
            f"minimum {minimum}",
            None,
        ),
        Row(
            "key tiles visited",
            f"{visited:g}",
            f"{expected} expected of {every}",
            visited == expected,
        ),
    ]


def table(spec: KernelSpec, shape: tuple[int, ...], rows: list[Row]) -> Table:
    b, h, hkv, sq, sk = shape
    result = Table(
        title=f"{spec.uri}  B={b} H={h} HKV={hkv} SQ={sq} SK={sk}",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    result.add_column("check")
    result.add_column("emulated", justify="right")
    result.add_column("reference", justify="right")
    result.add_column("", no_wrap=True)
    for row in rows:
        verdict = "" if row.ok is None else ("ok" if row.ok else "FAIL")
        result.add_row(row.what, row.value, row.reference, verdict)
    return result
