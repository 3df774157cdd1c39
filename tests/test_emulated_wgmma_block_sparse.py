"""Block-sparse masks on the Hopper (wgmma) forward (docs/hopper.md, "Block-sparse masks").

Emulation tier: the producer loads exactly the key tiles a block mask lists (the TMA bytes
count them), the consumers evaluate the mask_mod on the partly visible tiles only, and a query
tile with no listed tile writes out 0 and lse -inf, against the float64 reference with hazard
checks on; five mutations must fail. CPU tier: the spec's refusals, the dispatch of a block-sparse
call on a 9.0 device. CI is near its time budget: eight emulated runs, small shapes.
"""

from __future__ import annotations

import numpy as np
import pytest
from attention_cases import Case, CaseData, assert_matches, make_case
from test_api_inputs import infos
from test_emulated_kernels import run_emulated

from kernelgen.calls import attention as api
from kernelgen.calls.block_mask import BlockMask, block_mask_reference
from kernelgen.calls.variant_inputs import VariantArgs
from kernelgen.errors import EmulatorError, SpecError
from kernelgen.kernels.render import render
from kernelgen.references.attention import naive_attention
from kernelgen.references.expressions import evaluate
from kernelgen.specs.expressions import inputs_from_arrays, parse_mask_mod
from kernelgen.specs.forward import KernelSpec, spec_from_dict

# Documents of queries and keys given apart, so a query tile can belong to no key's document.
DOC_MASK = "qdoc[q_idx] == kdoc[kv_idx]"
EMPTY_DOC = 99  # a document no key belongs to
WG = dict(loop_order="v2", mma="wgmma", dtype="bfloat16", stages=2)


def _spec(causal: bool = False, **fields) -> KernelSpec:
    return KernelSpec(
        **{**WG, **fields},
        causal=causal,
        mask_mod=DOC_MASK,
        mod_inputs=["qdoc:int32[1]", "kdoc:int32[1]"],
        block_sparse=True,
    )


def _documents(key_sizes: list[int], query_docs: np.ndarray) -> dict[str, np.ndarray]:
    kdoc = np.repeat(np.arange(len(key_sizes)), key_sizes).astype(np.int32)
    return {"qdoc": query_docs.astype(np.int32), "kdoc": kdoc}


def _aligned(kdoc: np.ndarray, seqlen_q: int) -> np.ndarray:
    """Query i in the document of key i + (Sk - Sq) (bottom-right aligned)."""
    return kdoc[len(kdoc) - seqlen_q :].copy()


def _reference(data: CaseData, causal: bool, inputs: dict, seqlens_k=None) -> CaseData:
    expression = parse_mask_mod(DOC_MASK, inputs_from_arrays(inputs))

    def hook(b, h, q, k):
        return evaluate(expression, b=b, h=h, q_idx=q, kv_idx=k, inputs=inputs)

    out, lse = naive_attention(
        data.q, data.k, data.v, causal=causal, seqlens_k=seqlens_k, mask_mod=hook
    )
    return CaseData(data.q, data.k, data.v, None, out, lse)


def _mask(spec: KernelSpec, case: Case, inputs: dict) -> BlockMask:
    return block_mask_reference(
        DOC_MASK, 1, 1, case.seqlen_q, case.seqlen_k, block_m=spec.block_m,
        block_n=spec.block_n, mod_inputs=inputs,
    )  # fmt: skip


def _run(spec, case, data, inputs, mask, **options):
    variants = {"mask_mod": DOC_MASK, "mod_inputs": inputs, "block_mask": mask}
    return run_emulated(spec, case, data, variants=variants, **options)


def _listed_tiles(mask: BlockMask, case: Case, causal: bool, block_m: int) -> np.ndarray:
    """Per query tile, the key tiles the kernel must load: those the mask lists (partly or
    fully visible) that some row of the tile may see (causal: up to its last row's diagonal)."""
    states = mask.tile_states()[0, 0]  # (q_tiles, key_tiles): 0 hidden, 1 partial, 2 full
    key0 = np.arange(mask.key_tiles)[None, :] * mask.block_n
    last_row = np.minimum(np.arange(mask.q_tiles) * block_m + block_m - 1, case.seqlen_q - 1)
    reachable = key0 <= last_row[:, None] + (case.seqlen_k - case.seqlen_q) if causal else True
    return ((states > 0) & reachable).sum(axis=1)


def _tma_bytes(spec: KernelSpec, tiles_per_q_tile: np.ndarray, heads_x_batch: int) -> int:
    """What TMA writes: per block with a key tile, its Q tile and a K and a V tile per tile."""
    row = spec.column_blocks * spec.qk_row_bytes
    per_block = np.where(
        tiles_per_q_tile > 0, spec.block_m * row + tiles_per_q_tile * 2 * spec.block_n * row, 0
    )
    return heads_x_batch * int(per_block.sum())


# ---- the plain loop, GQA, documents: partial, full, skipped tiles and an empty query tile ----
PLAIN = _spec(head_dim=64, block_m=64, block_n=32)
PLAIN_CASE = Case(1, 4, 2, 290, 300)  # GQA; ragged last query and key tiles


def _plain_inputs() -> dict[str, np.ndarray]:
    inputs = _documents([45, 100, 30, 125], np.zeros(0))
    qdoc = _aligned(inputs["kdoc"], PLAIN_CASE.seqlen_q)
    qdoc[128:192] = EMPTY_DOC  # query tile 2 sees no key: its lists are empty
    return inputs | {"qdoc": qdoc}


@pytest.mark.emulate
def test_document_mask_loads_exactly_the_listed_tiles():
    inputs = _plain_inputs()
    mask = _mask(PLAIN, PLAIN_CASE, inputs)
    states = mask.tile_states()[0, 0]
    assert (states == 1).any() and (states == 2).any() and (states == 0).any()
    assert mask.partial_counts[0, 0, 2] == mask.full_counts[0, 0, 2] == 0
    data = make_case(PLAIN_CASE, PLAIN.dtype, PLAIN.head_dim, False, seed=31)
    data = _reference(data, False, inputs)
    assert np.isneginf(data.ref_lse[:, :, 128:192]).all()
    stats: dict = {}
    out, lse = _run(PLAIN, PLAIN_CASE, data, inputs, mask, stats=stats)
    assert_matches(out, lse, data, PLAIN.dtype)  # the empty tile: out 0, lse -inf exactly
    listed = _listed_tiles(mask, PLAIN_CASE, False, PLAIN.block_m)
    assert listed.sum() < mask.q_tiles * mask.key_tiles / 2  # mostly skipped
    heads = PLAIN_CASE.batch * PLAIN_CASE.heads
    assert stats[PLAIN.uri].tma_bytes == _tma_bytes(PLAIN, listed, heads)


# Mutations the tests must catch (each must fail: a hazard, a deadlock or a wrong result).
MUTATIONS = {
    "the producer loads tile_begin + t, ignoring the list": (
        "const int kv_row = key_tile(t) * BLOCK_N",
        "const int kv_row = (tile_begin + t) * BLOCK_N",
    ),
    "the consumers skip the mask_mod on partly visible tiles": (
        "const bool mask_mod_tile = t < num_partial;",
        "const bool mask_mod_tile = false;",
    ),
    "the consumers place the tile at tile_begin + t, not where the producer says": (
        "const int tile = slot_tiles[2 * slot];",
        "const int tile = tile_begin + t;",
    ),
    # (the emulator's check that only mbarrier instructions touch a live mbarrier's bytes)
    "the slot words right after kv_empty, over the v_staged barrier": (
        "smem + (v_staged + 8 - smem_addr(smem))",
        "smem + (kv_empty + 8 * STAGES - smem_addr(smem))",
    ),
}


@pytest.mark.emulate
@pytest.mark.parametrize("name", MUTATIONS)
def test_mutated_block_sparse_kernel_fails(name):
    """The unmutated kernel passes on these inputs (the test above); each mutant must not."""
    original, mutated = MUTATIONS[name]
    source = render(PLAIN)
    assert source.count(original) == 1, original
    inputs = _plain_inputs()
    mask = _mask(PLAIN, PLAIN_CASE, inputs)
    data = make_case(PLAIN_CASE, PLAIN.dtype, PLAIN.head_dim, False, seed=31)
    data = _reference(data, False, inputs)
    with pytest.raises((EmulatorError, AssertionError)):
        out, lse = _run(
            PLAIN, PLAIN_CASE, data, inputs, mask, source=source.replace(original, mutated)
        )
        assert_matches(out, lse, data, PLAIN.dtype)


# ---- causal with block sparsity, the overlapped loop with Q in registers --------------------
@pytest.mark.emulate
def test_causal_overlap_q_in_registers():
    spec = _spec(True, head_dim=64, block_m=128, block_n=64, stages=3, overlap=True,
                 q_in_registers=True)  # fmt: skip
    case = Case(1, 2, 1, 300, 300)
    inputs = _documents([70, 90, 40, 100], np.zeros(0))
    qdoc = _aligned(inputs["kdoc"], case.seqlen_q)
    qdoc[128:256] = EMPTY_DOC  # query tile 1 sees no key
    inputs["qdoc"] = qdoc
    mask = _mask(spec, case, inputs)
    data = _reference(make_case(case, spec.dtype, spec.head_dim, True, seed=32), True, inputs)
    stats: dict = {}
    out, lse = _run(spec, case, data, inputs, mask, stats=stats)
    assert_matches(out, lse, data, spec.dtype)
    listed = _listed_tiles(mask, case, True, spec.block_m)
    assert listed[1] == 0 and listed.sum() < (mask.tile_states()[0, 0] > 0).sum()
    assert stats[spec.uri].tma_bytes == _tma_bytes(spec, listed, case.batch * case.heads)


# ---- head dim 128, ping-pong with the TMA epilogue, seqlens_k over NaN rows -----------------
D128 = _spec(head_dim=128, block_m=128, block_n=64, pingpong=True, epilogue="tma")
D128_CASE = Case(2, 2, 1, 200, 310)  # GQA 2:1
D128_LENGTHS = np.array([310, 250], np.int32)


def _d128_inputs() -> tuple[dict, BlockMask, CaseData]:
    """Entry 1 holds 250 of 310 keys, the rest NaN. For query tile 0 (document 0: keys
    0..229) its last key tile (192..255) is partly visible and visited first, before the fully
    visible ones, so the producer's warps must zero that tile's V rows past the keys wherever
    the list puts it."""
    qdoc = np.repeat([0, 1], [128, 72])  # query tile 0: document 0, tile 1: document 1
    inputs = _documents([230, 80], qdoc)
    mask = _mask(D128, D128_CASE, inputs)
    assert list(mask.partial_indices[0, 0, 0, :1]) == [3]
    assert list(mask.full_indices[0, 0, 0, :3]) == [0, 1, 2]
    data = make_case(D128_CASE, D128.dtype, D128.head_dim, False, seed=33)
    k, v = data.k.copy(), data.v.copy()
    k[1, :, 250:] = np.nan
    v[1, :, 250:] = np.nan
    poisoned = CaseData(data.q, k, v, None, None, None)
    return inputs, mask, _reference(poisoned, False, inputs, seqlens_k=D128_LENGTHS)


@pytest.mark.emulate
def test_d128_pingpong_tma_epilogue_with_per_entry_key_lengths():
    inputs, mask, data = _d128_inputs()
    out, lse = _run(D128, D128_CASE, data, inputs, mask, seqlens_k=D128_LENGTHS)
    assert_matches(out, lse, data, D128.dtype)


@pytest.mark.emulate
def test_zeroing_the_last_visit_instead_of_the_last_key_tile_fails():
    """Mutation: the non-sparse kernel's choice (the last tile visited) zeroes rows of a fully
    visible tile and leaves the NaN rows of the partly visible one."""
    original = "      : num_tiles > num_partial && key_tile(num_tiles - 1) == tile_end - 1 ?"
    source = render(D128)
    assert source.count(original) == 1
    mutated = source.replace(original, "      : true ?")
    inputs, mask, data = _d128_inputs()
    with pytest.raises((EmulatorError, AssertionError)):
        out, lse = _run(D128, D128_CASE, data, inputs, mask, seqlens_k=D128_LENGTHS, source=mutated)
        assert_matches(out, lse, data, D128.dtype)


# ---- key tiles wider than mma.sync's: the block masks of wgmma's 160-key tiles -----------------
@pytest.mark.emulate
def test_key_tiles_wider_than_128_with_their_block_mask():
    """The fuzzer's first find (kernelgen.testing.fuzz, seed 1, case 20): the block-mask
    builders refused block_n above mma.sync's 128, so a valid block-sparse wgmma spec with
    160-key tiles could not be called. Causal, GQA, a document boundary inside a key tile."""
    spec = _spec(True, head_dim=64, block_m=128, block_n=160)
    case = Case(1, 2, 1, 150, 330)
    inputs = _documents([120, 130, 80], np.zeros(0))
    inputs["qdoc"] = _aligned(inputs["kdoc"], case.seqlen_q)
    mask = _mask(spec, case, inputs)
    assert mask.key_tiles == 3 and (mask.tile_states() == 1).any()
    data = _reference(make_case(case, spec.dtype, spec.head_dim, True, seed=34), True, inputs)
    out, lse = _run(spec, case, data, inputs, mask)
    assert_matches(out, lse, data, spec.dtype)


# ---- CPU tier: the spec's refusals, the dispatch ---------------------------------------------
@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"split_kv": True}, "block_sparse=true is not allowed with split_kv=true"),
        ({"pack_gqa": True}, "block_sparse=true is not allowed with pack_gqa=true"),
        ({"cluster_m": 2}, "cluster_m=2 is not allowed with block_sparse=True"),
        ({"mma": "simt", "dtype": "float16", "stages": 1, "block_m": 64, "block_n": 32},
         "block_sparse=true is not allowed with mma='simt'; use mma_sync or wgmma"),
    ],
)  # fmt: skip
def test_block_sparse_wgmma_refusals_name_the_field(fields, words):
    data = {**WG, "head_dim": 128, "block_m": 128, "block_n": 128, **fields}
    data |= {"mask_mod": DOC_MASK, "mod_inputs": ["qdoc:int32[1]", "kdoc:int32[1]"]}
    with pytest.raises(SpecError) as caught:
        spec_from_dict({**data, "block_sparse": True})
    assert words in str(caught.value)


def test_block_sparse_fp8_is_allowed_and_its_decode_forms_refused_by_name():
    """fp8 takes block-sparse masks (tests/test_emulated_fp8_block_sparse.py); its decode forms
    with the host V^T layout stay refused, naming what fp8 takes for them."""
    data = {**WG, "dtype": "float8_e4m3", "head_dim": 128, "block_m": 128, "block_n": 128}
    data |= {"mask_mod": DOC_MASK, "mod_inputs": ["qdoc:int32[1]", "kdoc:int32[1]"]}
    assert spec_from_dict({**data, "block_sparse": True}).block_sparse
    with pytest.raises(SpecError) as caught:
        spec_from_dict({**data, "paged_kv": True})
    assert "paged_kv=True is not allowed with dtype='float8_e4m3'" in str(caught.value)
    assert "use fp8_v_layout: kernel" in str(caught.value)


def _sparse_call(tiles: tuple[int, int], head_dim: int = 128, causal: bool = False):
    arrays, _ = infos(q=(1, 4, 300, head_dim), k=(1, 2, 300, head_dim), dtype="<f2")
    inputs = _documents([100, 200], np.zeros(300))
    mask = block_mask_reference(
        DOC_MASK, 1, 1, 300, 300, block_m=tiles[0], block_n=tiles[1], mod_inputs=inputs
    )
    variants = VariantArgs(mask_mod=DOC_MASK, mod_inputs=inputs, block_mask=mask)
    return api.check_inputs(
        *arrays, None, layout="bhsd", scale=None, spec=None, causal=causal, variants=variants
    )


@pytest.mark.parametrize(
    ("tiles", "head_dim", "expected"),
    [
        ((128, 128), 128, "fa_fwd_v2_wg_f16_d128_m128_n128_w12_s2_causal"),
        ((64, 64), 64, "fa_fwd_v2_wg_f16_d64_m64_n64_w8_s2_qr_causal"),  # Q in registers
        ((32, 64), 128, "fa_fwd_v2_tc_f16_d128_m32_n64_w2_s2_swz_causal"),  # no wgmma m32
        ((64, 64), 80, "fa_fwd_v2_tc_f16_d80_m64_n64_w4_s2_pad_causal"),  # no wgmma d80
    ],
)
def test_a_block_sparse_call_on_a_9_0_device_runs_wgmma_where_it_takes_the_tiles(
    monkeypatch, tiles, head_dim, expected
):
    monkeypatch.setattr(api, "device_arch", lambda: (90, "sm_90"))
    call = _sparse_call(tiles, head_dim)
    spec, splits = api._untuned_or_tuned_launch(call, True, aligned=True, split=False)
    spec = api.with_expressions(spec, call.expressions)
    assert splits is None and spec.block_sparse
    assert (spec.block_m, spec.block_n) == tiles
    assert spec.uri.startswith(expected + "_mmod"), spec.uri
    api.check_spec_expressions(spec, call.expressions)  # the launch's own check passes


def test_a_block_sparse_call_elsewhere_keeps_the_mma_sync_kernel(monkeypatch):
    monkeypatch.setattr(api, "device_arch", lambda: (80, "sm_80"))
    call = _sparse_call((64, 64))
    spec, _ = api._untuned_or_tuned_launch(call, False, aligned=True, split=False)
    assert api.with_expressions(spec, call.expressions).mma == "mma_sync"


def test_kernelgen_emulate_expects_the_listed_tiles():
    """`kernelgen emulate`'s TMA row (kernelgen.cli.emulate_table) counts a block-sparse spec's
    key tiles against its block mask, not against every tile in causal reach."""
    from kernelgen.cli.emulate_table import tma_rows

    for causal, spec in ((False, PLAIN), (True, _spec(True, head_dim=64, block_m=64, block_n=32))):
        mask = _mask(spec, PLAIN_CASE, _plain_inputs())
        listed = _listed_tiles(mask, PLAIN_CASE, causal, spec.block_m)
        shape = (1, 4, 2, PLAIN_CASE.seqlen_q, PLAIN_CASE.seqlen_k)
        exact = _tma_bytes(spec, listed, PLAIN_CASE.heads)
        one_tile = 2 * spec.block_n * spec.column_blocks * spec.qk_row_bytes
        for tma_bytes, ok in ((exact, True), (exact + one_tile, False)):
            (_, tiles) = tma_rows(spec, tma_bytes, 1, shape, 1, mask)
            assert (tiles.value, tiles.ok) == (f"{listed.sum() * 4 + (not ok)}", ok)
