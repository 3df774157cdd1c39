"""Emulation tier: how the tensor-core kernels use memory, from the emulator's launch statistics.

Two properties that no output shows and that the profiler would measure on a GPU:
* ldmatrix is free of shared-memory bank conflicts in both layouts ("padded or
  XOR-swizzled, no bank conflicts on ldmatrix"; ncu's bank-conflict counter on hardware);
* the cp.async copies read every K/V row a block needs exactly once, and with packed GQA once
  per K/V head rather than once per query head, within each sequence's length;
* causal blocks skip the key tiles entirely above their diagonal.
Removing the causal bound from the template (kv_end = seqlen_k) fails the diagonal test for
all 7 causal tensor-core specs.
"""

from __future__ import annotations

import re
import zlib

import numpy as np
import pytest
from attention_cases import Case, make_case
from conftest import SPEC_PATHS
from test_emulated_kernels import run_emulated

from kernelgen.kernels.render import render
from kernelgen.specs.forward import DTYPE_BYTES, load_spec

pytestmark = pytest.mark.emulate

# The plain tensor-core specs (a window reads fewer key tiles: tests/test_emulated_variants.py;
# user expressions and block masks: tests/test_emulated_expressions.py).
TC_SPECS = [
    s
    for s in map(load_spec, SPEC_PATHS)
    if s.mma == "mma_sync" and not s.variants and not s.has_expressions
]


def _data(spec, case: Case):
    seed = zlib.crc32(f"{spec.uri} {case} memory".encode())
    return make_case(case, spec.dtype, spec.head_dim, spec.causal, seed)


@pytest.mark.parametrize("spec", TC_SPECS, ids=lambda s: s.uri)
def test_ldmatrix_is_free_of_bank_conflicts(spec):
    case = Case(1, 2, 1, 40, 130)  # full and partial tiles of queries and keys
    stats: dict = {}
    run_emulated(spec, case, _data(spec, case), stats=stats)
    main = stats[spec.uri]
    assert main.ldmatrix > 0
    assert main.ldmatrix_wavefronts == main.ldmatrix_ideal, main.first_conflict


def test_bank_conflict_check_sees_an_unswizzled_tile():
    """The check can fail: without the XOR, a d128 tile's rows (256 bytes apart) all sit in one
    bank group, so each 8x8 matrix takes 8 wavefronts; the output is still right."""
    spec = next(s for s in TC_SPECS if s.smem_layout == "swizzled" and s.head_dim == 128)
    swizzle = "(SWIZZLED ? chunk ^ (row & 7) : chunk)"
    source = render(spec)
    assert swizzle in source
    case = Case(1, 1, 1, 16, 64)
    stats: dict = {}
    run_emulated(
        spec, case, _data(spec, case), stats=stats, source=source.replace(swizzle, "chunk")
    )
    main = stats[spec.uri]
    assert main.ldmatrix_wavefronts == 8 * main.ldmatrix_ideal
    # Which warp reports first depends on thread timing; the rows are one 256-byte row apart.
    found = re.fullmatch(
        r"ldmatrix\.x4 in block \(0,0,0\) warp \d: matrix \d takes 8 wavefronts, rows at(.*)",
        main.first_conflict,
    )
    assert found, main.first_conflict
    rows = [int(a, 16) for a in found.group(1).split()]
    assert np.diff(rows).tolist() == [256] * 7


@pytest.mark.parametrize("spec", TC_SPECS, ids=lambda s: s.uri)
def test_each_kv_row_is_read_once_per_kv_head(spec):
    """A decode step (2 queries, 2 query heads per K/V head, one query tile) with per-sequence
    lengths: the copies read each visible K/V row once per K/V head when GQA heads are packed,
    once per query head otherwise, and keys past a sequence's length never. Each block with a
    key tile reads its queries once; an empty split-KV chunk reads nothing."""
    case = Case(3, 4, 2, 2, 150)
    lengths = np.array([150, 77, 0], dtype=np.int32)  # 64-key tiles: sequence 1 has an empty chunk
    num_splits = 3 if spec.split_kv else 1
    group = case.heads // case.kv_heads
    stats: dict = {}
    run_emulated(
        spec, case, _data(spec, case), num_splits=num_splits, seqlens_k=lengths, stats=stats
    )
    # Chunks are cut per sequence: ceil(tiles / num_splits) key tiles each.
    tiles = -(-lengths // spec.block_n)
    tiles_per_chunk = np.maximum(1, -(-tiles // num_splits))
    chunks_with_keys = -(-tiles // tiles_per_chunk)
    row_bytes = spec.head_dim * DTYPE_BYTES[spec.dtype]
    q_bytes = int(chunks_with_keys.sum()) * case.heads * case.seqlen_q * row_bytes
    kv_bytes = 2 * case.kv_heads * int(lengths.sum()) * row_bytes  # K and V
    kv_readers = 1 if spec.pack_gqa else group  # blocks that stream one K/V head
    assert stats[spec.uri].cp_async_global_bytes == q_bytes + kv_readers * kv_bytes


def _kv_rows_read(spec, case: Case) -> int:
    """K (or V) rows a prefill launch must read: each row tile (a block) reads the key tiles up
    to its last query's causal diagonal, whole tiles, no key past Sk; tiles entirely above the
    diagonal are skipped."""
    group = case.heads // case.kv_heads
    rows_per_query = group if spec.pack_gqa else 1
    num_rows = case.seqlen_q * rows_per_query
    rows = 0
    for row0 in range(0, num_rows, spec.block_m):
        last_query = (min(row0 + spec.block_m, num_rows) - 1) // rows_per_query
        visible = case.seqlen_k
        if spec.causal:
            visible = max(0, min(visible, last_query + 1 + case.seqlen_k - case.seqlen_q))
        tiles = -(-visible // spec.block_n)
        rows += min(case.seqlen_k, tiles * spec.block_n)
    blocks_per_batch = case.kv_heads if spec.pack_gqa else case.heads
    return case.batch * blocks_per_batch * rows


@pytest.mark.parametrize("spec", TC_SPECS, ids=lambda s: s.uri)
def test_prefill_reads_only_key_tiles_up_to_the_diagonal(spec):
    """Several row tiles, one split: each block reads its query rows once and K/V up to its
    diagonal (causal) or to Sk, in whole key tiles."""
    case = Case(1, 2, 1, 170, 200)  # two row tiles even at block_m 128
    stats: dict = {}
    run_emulated(spec, case, _data(spec, case), num_splits=1, stats=stats)
    row_bytes = spec.head_dim * DTYPE_BYTES[spec.dtype]
    q_bytes = case.batch * case.heads * case.seqlen_q * row_bytes
    expected = q_bytes + 2 * _kv_rows_read(spec, case) * row_bytes
    assert stats[spec.uri].cp_async_global_bytes == expected


@pytest.mark.parametrize("spec", [s for s in TC_SPECS if s.causal], ids=lambda s: s.uri)
def test_causal_rows_that_see_no_key_read_nothing(spec):
    """Sq > Sk, bottom-right aligned: the first Sq - Sk queries see no key. A block made only of
    such rows writes the identity without reading its queries."""
    case = Case(1, 1, 1, 3 * spec.block_m, spec.block_m // 2)
    stats: dict = {}
    out, lse = run_emulated(spec, case, _data(spec, case), num_splits=1, stats=stats)
    blind = case.seqlen_q - case.seqlen_k  # queries above every key: 2.5 row tiles
    assert np.isneginf(lse[0, 0, :blind]).all() and (out[0, 0, :blind] == 0).all()
    q_rows = case.seqlen_q - blind // spec.block_m * spec.block_m  # the last row tile's
    row_bytes = spec.head_dim * DTYPE_BYTES[spec.dtype]
    expected = (q_rows + 2 * _kv_rows_read(spec, case)) * row_bytes
    assert stats[spec.uri].cp_async_global_bytes == expected
