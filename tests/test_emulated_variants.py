"""Emulation tier: the built-in variants (window, softcap, ALiBi, sinks; docs/variants.md) on
every kernel family, alone and together, against the float64 reference; and the key tiles a
window lets the kernels skip, counted from the emulator's launch statistics.

Shapes are tiny: each spec is one g++ build of its generated CUDA."""

from __future__ import annotations

import dataclasses
import math
import zlib

import numpy as np
import pytest
from attention_cases import (
    Case,
    assert_matches,
    check_kvcache,
    check_varlen,
    example_variants,
    kvcache_data,
    kvcache_reference,
    make_case,
    packed_varlen,
    varlen_reference,
)
from test_emulated_kernels import run_emulated

import kernelgen
from kernelgen.runtime.launch import launch_geometry
from kernelgen.specs.forward import KernelSpec

pytestmark = pytest.mark.emulate

ALL = ("window", "softcap", "alibi", "sinks")
TC = dict(loop_order="v2", mma="mma_sync", num_warps=4, stages=2)
# (name, spec fields): the kernel families, a couple of head dims and tile shapes.
FAMILIES = {
    "tc-f16-d32-m64n16": dict(TC, dtype="float16", head_dim=32, block_m=64, block_n=16),
    "tc-bf16-d40-m32n32-w1": dict(
        TC, dtype="bfloat16", head_dim=40, block_m=32, block_n=32, num_warps=1, stages=3
    ),
    "simt-v2-f32-d16": dict(loop_order="v2", dtype="float32", head_dim=16, block_m=16, block_n=16),
    "simt-v1-f16-d24": dict(loop_order="v1", dtype="float16", head_dim=24, block_m=32, block_n=16),
}
# Variants alone and together, with GQA, odd lengths, both layouts, masks and causal.
COMBOS = [
    (("window",), Case(1, 2, 1, 37, 70), False, (9, 3)),
    (("window",), Case(1, 2, 2, 45, 30, layout="bshd"), True, (4, 5)),  # Sq > Sk: empty rows
    (("softcap",), Case(2, 2, 1, 19, 41, mask="broadcast"), False, None),
    (("alibi",), Case(2, 4, 2, 23, 50), True, None),
    (("sinks",), Case(1, 2, 1, 40, 25, mask="broadcast"), True, None),  # rows with only a sink
    (ALL, Case(2, 2, 1, 33, 66, layout="bshd", mask="full"), False, (20, 0)),
    (ALL, Case(1, 2, 1, 29, 47, scale=-0.3), True, (-1, 2)),  # a negative scale
    # left = 17: the last row that sees a 16-key tile starts a 32-row tile (v1's row range)
    (("window", "sinks"), Case(1, 1, 1, 70, 70), True, (17, -1)),
]


def _id(combo) -> str:
    flags, case, causal, window = combo
    return "+".join(flags) + f"-{case}" + ("-causal" if causal else "") + f"-w{window}"


def _spec(family: str, flags: tuple[str, ...], causal: bool, **extra) -> KernelSpec:
    return KernelSpec(**FAMILIES[family], causal=causal, **dict.fromkeys(flags, True), **extra)


def _check(spec, case, flags, window, seed, num_splits=None, stats=None):
    variants = example_variants(flags, case.batch, case.heads, seed, window=window)
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed, variants)
    out, lse = run_emulated(spec, case, data, variants=variants, num_splits=num_splits, stats=stats)
    assert_matches(out, lse, data, spec.dtype)
    return data


# v1 shares tile_scores (softcap, ALiBi) with simt v2: it runs the window, sinks and all combos.
MATRIX = [
    (family, combo)
    for family in FAMILIES
    for combo in COMBOS
    if not (family.startswith("simt-v1") and combo[0] in (("softcap",), ("alibi",)))
]


@pytest.mark.parametrize(("family", "combo"), MATRIX, ids=[f"{f}-{_id(c)}" for f, c in MATRIX])
def test_variants_match_float64(family, combo):
    flags, case, causal, window = combo
    spec = _spec(family, flags, causal)
    seed = zlib.crc32(f"{spec.uri} {_id(combo)}".encode())
    _check(spec, case, flags, window, seed)


def test_alibi_slopes_per_head_broadcast_over_the_batch():
    spec = _spec("tc-f16-d32-m64n16", ("alibi",), False)
    case = Case(2, 2, 1, 21, 40)
    rng = np.random.default_rng(5)
    variants = {"alibi_slopes": rng.uniform(0.1, 0.9, 2).astype(np.float32)}
    data = make_case(case, spec.dtype, spec.head_dim, False, 5, variants)
    out, lse = run_emulated(spec, case, data, variants=variants)
    assert_matches(out, lse, data, spec.dtype)


@pytest.mark.parametrize("flags", [("window", "sinks"), ALL], ids="+".join)
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_split_kv_decode_with_variants(flags, num_splits):
    """Packed-GQA split-KV decode (4 queries x 4 heads per K/V head in one 16-row tile): the
    chunks split the window's tiles, and the combine adds each head's sink once."""
    spec = KernelSpec(
        **{**FAMILIES["tc-f16-d32-m64n16"], "block_m": 16, "num_warps": 1},
        pack_gqa=True,
        split_kv=True,
        causal=True,
        **dict.fromkeys(flags, True),
    )
    case = Case(2, 8, 2, 4, 150)
    _check(spec, case, flags, (61, -1), seed=num_splits, num_splits=num_splits)


def test_simt_split_kv_with_every_variant():
    spec = _spec("simt-v2-f32-d16", ALL, False, split_kv=True)
    _check(spec, Case(1, 2, 1, 3, 90), ALL, (30, 1), seed=3, num_splits=4)


def window_tiles(spec: KernelSpec, case: Case, window: tuple[int, int]) -> int:
    """Key tiles the kernels must visit, from the window's bounds: for each query tile of each
    (batch, head), the tiles from the one holding its first query's first key to the one holding
    its last query's last key (causal narrows right to 0)."""
    left, right = window
    if spec.causal:
        right = 0 if right < 0 else min(right, 0)
    offset = case.seqlen_k - case.seqlen_q
    visited = 0
    for q0 in range(0, case.seqlen_q, spec.block_m):
        q1 = min(q0 + spec.block_m, case.seqlen_q) - 1
        begin = 0 if left < 0 else max(0, q0 + offset - left)
        end = case.seqlen_k if right < 0 else max(0, min(case.seqlen_k, q1 + offset + right + 1))
        visited += max(0, math.ceil(end / spec.block_n) - begin // spec.block_n)
    return visited * case.batch * case.heads


@pytest.mark.parametrize(
    ("case", "causal", "window"),
    [
        (Case(1, 2, 1, 256, 256), True, (15, -1)),  # a 16-key causal window: O(Sq * W)
        (Case(1, 1, 1, 200, 300), False, (40, 40)),
        (Case(2, 1, 1, 100, 700), False, (-1, 10)),  # only the right side bounded
        (Case(1, 1, 1, 130, 40), True, (3, -1)),  # Sq > Sk: the first tile sees no key at all
    ],
    ids=str,
)
def test_a_window_visits_only_the_key_tiles_its_bounds_allow(case, causal, window):
    spec = _spec("tc-f16-d32-m64n16", ("window",), causal)
    stats: dict = {}
    _check(spec, case, ("window",), window, seed=1, stats=stats)
    per_tile = spec.block_n * spec.head_dim_padded * 2 // 16  # 16-byte copies of one K tile
    visited = stats[spec.uri].cp_async_copies_by_arg["k"] / per_tile
    expected = window_tiles(spec, case, window)
    assert visited == expected
    row_blocks = launch_geometry(spec, _problem(case))[0][0]
    every = row_blocks * math.ceil(case.seqlen_k / spec.block_n)
    assert expected < every  # the window skips tiles (causal alone would visit more)


def test_split_decode_visits_the_window_once_over_all_chunks():
    spec = KernelSpec(
        **{**FAMILIES["tc-f16-d32-m64n16"], "block_m": 16, "num_warps": 1},
        pack_gqa=True,
        split_kv=True,
        window=True,
    )
    case = Case(1, 4, 1, 1, 1000)  # one query of 4 packed heads, a 1000-key cache
    stats: dict = {}
    _check(spec, case, ("window",), (99, -1), seed=2, num_splits=5, stats=stats)
    per_tile = spec.block_n * spec.head_dim_padded * 2 // 16
    visited = stats[spec.uri].cp_async_copies_by_arg["k"] / per_tile
    # keys 900..999: tiles 56..62 (7 of 63), dealt out 2 per chunk over 4 chunks
    assert visited == math.ceil(1000 / 16) - 900 // 16 == 7


def _problem(case: Case):
    from kernelgen.runtime.launch import Problem

    return Problem(
        case.batch, case.heads, case.kv_heads, case.seqlen_q, case.seqlen_k, 32,
        (0, 0, 0), (0, 0, 0), (0, 0, 0), (0, 0, 0),
    )  # fmt: skip


def test_window_equal_to_causal_matches_the_causal_kernel():
    """window_size=(-1, 0) on a window kernel is causal attention."""
    spec = _spec("tc-f16-d32-m64n16", ("window",), False)
    case = Case(1, 2, 1, 40, 70)
    variants = {"window_size": (-1, 0)}
    data = make_case(case, spec.dtype, spec.head_dim, False, 9, variants)
    causal = make_case(case, spec.dtype, spec.head_dim, True, 9)
    np.testing.assert_array_equal(data.ref_out, causal.ref_out)
    out, lse = run_emulated(spec, case, data, variants=variants)
    assert_matches(out, lse, dataclasses.replace(causal), spec.dtype)


# ---- the serving entry points on the CPU backend (NumPy in, the emulator runs the kernels) ----


@pytest.mark.filterwarnings("ignore::kernelgen.errors.CPUBackendWarning")
@pytest.mark.usefixtures("cpu_backend_only")
def test_varlen_with_variants():
    """Per sequence, each its own offset Sk - Sq; (B, H) slopes one row per sequence; a
    sequence with queries but no keys gives out 0 and lse = its sink."""
    lengths_q, lengths_k = [3, 0, 2, 5, 5, 1], [9, 4, 0, 5, 5, 30]
    q, k, v, cu_q, cu_k = packed_varlen(lengths_q, lengths_k, 4, 2, "float16", seed=4)
    variants = example_variants(ALL, len(lengths_q), 4, seed=4, window=(6, 1))
    out, lse = kernelgen.attention_varlen(
        *(x.astype(np.float16) for x in (q, k, v)),
        cu_q,
        cu_k,
        5,
        30,
        causal=True,
        return_lse=True,
        **variants,
    )
    ref_out, ref_lse = varlen_reference(q, k, v, cu_q, cu_k, True, **variants)
    check_varlen(out, lse, ref_out, ref_lse, "float16")
    no_keys = slice(3, 5)  # the third sequence's queries
    np.testing.assert_allclose(lse[:, no_keys], np.repeat(variants["sinks"][:, None], 2, 1))


@pytest.mark.filterwarnings("ignore::kernelgen.errors.CPUBackendWarning")
@pytest.mark.usefixtures("cpu_backend_only")
@pytest.mark.parametrize("splits", [None, 3])
def test_kvcache_decode_with_variants(splits):
    """A decode step appending one token per entry, aligned to each entry's updated length."""
    lengths = [0, 17, 38]
    data = kvcache_data(3, 1, 1, 40, 8, 2, "float16", seed=6)
    q, k_cache, v_cache, k_new, v_new = (x.astype(np.float16) for x in data)
    variants = example_variants(ALL, 3, 8, seed=6, window=(11, -1))
    out, lse = kernelgen.attention_with_kvcache(
        q,
        k_cache,
        v_cache,
        np.array(lengths, np.int32),
        k_new=k_new,
        v_new=v_new,
        causal=True,
        num_splits=splits,
        return_lse=True,
        **variants,
    )
    check_kvcache(out, lse, *kvcache_reference(*data, lengths, True, **variants), "float16")
