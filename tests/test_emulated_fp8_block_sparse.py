"""Block-sparse masks on the fp8 (e4m3) wgmma forward (docs/hopper.md, "fp8" and "Block-sparse
masks"), on the emulator against the float64 reference of the quantized inputs
(kernelgen.references.fp8, with the mask_mod as its hook) within the element-wise fp8 bound,
the relative Frobenius error below 2^-4 and the lse within 1e-4.

What differs from 16 bits: the producer's V^T box runs over keys (its column coordinate is the
slot's first key, key_tile(t) * BLOCK_N: the permutation of runtime.fp8.key_permutation stays
within 16 keys, so a tile's keys are its own columns), fp8 has no staged-V barrier (the slot
words follow kv_empty) and no zeroed V tile (the host's V^T copy zeroes keys past seqlens_k).

Cases: the shipped causal document-mask spec through kernelgen.attention on NumPy arrays (GQA;
partly, fully and not visible tiles), ping-pong with 64-key tiles and a query tile with no listed
tile (out 0, lse -inf; the TMA bytes are exactly the listed tiles'); mutations: the V^T box at
tile_begin + t, the consumers placing the tile at tile_begin + t. Four emulated runs (CI's time).
CPU tier: the tiles a block mask must have (tests/test_fp8_api_errors.py has the other refusals).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CPU_BACKEND_MARKS, ROOT
from test_emulated_expressions import _callables
from test_emulated_fp8 import fp8_spec, problem

import kernelgen
from kernelgen.calls.block_mask import BlockMask, block_mask_reference
from kernelgen.calls.emulated import emulate_fp8_attention
from kernelgen.calls.fp8 import check_fp8_call
from kernelgen.calls.variant_inputs import VariantArgs
from kernelgen.errors import EmulatorError, InputError
from kernelgen.kernels.render import render
from kernelgen.references.fp8 import FP8_LSE_TOLERANCE, FP8_TOLERANCE, Fp8Reference, fp8_reference
from kernelgen.specs.forward import load_spec

ml_dtypes = pytest.importorskip("ml_dtypes")

pytestmark = CPU_BACKEND_MARKS

SPEC = load_spec(ROOT / "specs" / "v2_wg_e4m3_d128_m128_n128_s2_causal_docmask_bsparse.yaml")
# Documents of queries and keys given apart, so a query tile can belong to no key's document.
SPLIT_DOCS = "qdoc[q_idx] == kdoc[kv_idx]"
EMPTY_DOC = 99  # a document no key belongs to


def assert_within_bound(out, lse, ref: Fp8Reference) -> float:
    """The bound per element (rows that see no key: out exactly 0), the relative error, the lse
    (those rows: -inf exactly); returns the bound ratio."""
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert np.isfinite(out).all()
    ratio = ref.bound_ratio(out)
    relative = float(np.linalg.norm(out - ref.out) / np.linalg.norm(ref.out))
    empty = np.isneginf(ref.lse)
    assert (np.isneginf(lse) == empty).all()
    lse_error = float(np.max(np.abs(lse[~empty] - ref.lse[~empty])))
    print(f"max error / bound {ratio:.3f}, relative error {relative:.4f}, lse {lse_error:.2e}")
    assert ratio <= 1.0
    assert relative < FP8_TOLERANCE
    assert lse_error <= FP8_LSE_TOLERANCE
    return ratio


def _documents(sizes: list[int]) -> np.ndarray:
    return np.repeat(np.arange(len(sizes)), sizes).astype(np.int32)


def _listed_tiles(mask: BlockMask) -> np.ndarray:
    """Per (batch, head, query tile), the key tiles its lists hold (not causal)."""
    return (mask.tile_states() > 0).sum(axis=-1)


# ---- the shipped spec through kernelgen.attention: causal documents, GQA ----------------------
# (B, H, Hkv, S): batch entry 0 has documents of 40 and 260 tokens, so query tile 2 sees key tile
# 0 partly and key tile 1 fully; entry 1 has 150, 100 and 50, so query tile 2 (document 2, from
# token 250) skips key tile 0 and sees key tile 1 partly.
DOC_SHAPE = (2, 4, 2, 300)
DOCS = np.stack([_documents([40, 260]), _documents([150, 100, 50])])


def test_shipped_causal_document_mask_through_kernelgen_attention():
    batch, heads, kv_heads, seqlen = DOC_SHAPE
    q, k, v, descales = problem(21, batch, heads, kv_heads, seqlen, seqlen)
    inputs = {"doc": DOCS}
    mask = kernelgen.block_mask(SPEC.mask_mod, batch, 1, seqlen, seqlen, block_m=128,
                                block_n=128, mod_inputs=inputs)  # fmt: skip
    states = mask.tile_states()[:, 0]
    assert states[0, 2, 0] == 1 and states[0, 2, 1] == 2 and states[1, 2, 0] == 0
    out, lse = kernelgen.attention(
        *(x.view(ml_dtypes.float8_e4m3fn) for x in (q, k, v)), causal=True, spec=SPEC,
        return_lse=True, mask_mod=SPEC.mask_mod, mod_inputs=inputs, block_mask=mask,
        **descales,
    )  # fmt: skip
    hooks = _callables(None, SPEC.mask_mod, inputs)
    ref = fp8_reference(q, k, v, descales, causal=True, scale=128**-0.5, **hooks)
    assert_within_bound(out.astype(np.float32), lse, ref)


# ---- ping-pong, 64-key tiles (64-byte V^T rows): a query tile with no listed tile ------------
PP = fp8_spec(head_dim=128, block_n=64, pingpong=True, mask_mod=SPLIT_DOCS,
              mod_inputs=["qdoc:int32[1]", "kdoc:int32[1]"], block_sparse=True)  # fmt: skip
PP_SHAPE = (1, 2, 1, 300, 270)  # (B, H, Hkv, Sq, Sk): ragged last tiles


def _pp_case(source: str | None = None):
    """Keys in documents of 64, 100 and 106 tokens; queries 0-127 in documents 0 and 2 (split
    at 60), 128-255 in none (EMPTY_DOC: an empty query tile), the rest in document 1. Query tile
    2 visits key tile 2 (partly visible) then 1 (fully), skipping 0, 3 and 4: not tile_begin + t.
    Returns (result, reference, block mask)."""
    batch, heads, kv_heads, seqlen_q, seqlen_k = PP_SHAPE
    qdoc = np.repeat([0, 2, EMPTY_DOC, 1], [60, 68, 128, 44]).astype(np.int32)
    inputs = {"qdoc": qdoc, "kdoc": _documents([64, 100, 106])}
    mask = block_mask_reference(SPLIT_DOCS, 1, 1, seqlen_q, seqlen_k, block_m=128, block_n=64,
                                mod_inputs=inputs)  # fmt: skip
    q, k, v, descales = problem(22, batch, heads, kv_heads, seqlen_q, seqlen_k)
    result = emulate_fp8_attention(PP, q, k, v, source=source, mask_mod=SPLIT_DOCS,
                                   mod_inputs=inputs, block_mask=mask, **descales)  # fmt: skip
    hooks = _callables(None, SPLIT_DOCS, inputs)
    ref = fp8_reference(q, k, v, descales, causal=False, scale=128**-0.5, **hooks)
    return result, ref, mask


def test_pingpong_64_key_tiles_with_an_empty_query_tile_loads_exactly_the_listed_tiles():
    result, ref, mask = _pp_case()
    listed = _listed_tiles(mask)[0, 0]
    assert listed[1] == 0 and listed[2] == 2
    assert mask.partial_indices[0, 0, 2, 0] == 2 and mask.full_indices[0, 0, 2, 0] == 1
    assert np.isneginf(ref.lse[:, :, 128:256]).all()
    assert_within_bound(result.out, result.lse, ref)
    assert (result.out[:, :, 128:256] == 0).all()
    heads = PP_SHAPE[0] * PP_SHAPE[1]
    per_block = np.where(listed > 0, PP.block_m * PP.column_blocks * PP.qk_row_bytes, 0)
    per_block += listed * (PP.k_tile_bytes + PP.v_tile_bytes)
    assert result.stats[PP.uri].tma_bytes == heads * int(per_block.sum())


# Mutations the checks must catch (each a wrong result, a hazard or a deadlock).
MUTATIONS = {
    "the V^T box at tile_begin + t, not the slot's key tile": (
        "tma_load_4d(v_ring + slot * V_TILE_BYTES, &v_map, kv_row, 0,",
        "tma_load_4d(v_ring + slot * V_TILE_BYTES, &v_map, (tile_begin + t) * BLOCK_N, 0,",
    ),
    "the consumers place the tile at tile_begin + t, not where the producer says": (
        "const int tile = slot_tiles[2 * slot];",
        "const int tile = tile_begin + t;",
    ),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_mutated_fp8_block_sparse_kernel_fails(name):
    """The unmutated kernel passes on these inputs (the test above); each mutant must not."""
    original, mutated = MUTATIONS[name]
    source = render(PP)
    assert source.count(original) == 1, original
    with pytest.raises((EmulatorError, AssertionError)):
        result, ref, _ = _pp_case(source.replace(original, mutated))
        assert_within_bound(result.out, result.lse, ref)


# ---- CPU tier: the block mask's tiles -----------------------------------------------------
@pytest.mark.parametrize(("tiles", "head_dim"), [((64, 128), 128), ((128, 128), 256),
                                                 ((128, 32), 64)])  # fmt: skip
def test_block_mask_in_tiles_no_fp8_kernel_takes_is_refused(tiles, head_dim):
    q, k, v, _ = problem(0, 1, 1, 1, 16, 16, descales=False, head_dim=head_dim)
    inputs = {"doc": np.zeros((1, 16), np.int32)}
    mask = block_mask_reference(SPEC.mask_mod, 1, 1, 16, 16, block_m=tiles[0],
                                block_n=tiles[1], mod_inputs=inputs)  # fmt: skip
    with pytest.raises(InputError, match=r"block_mask has \d+ x \d+ tiles") as info:
        kernelgen.attention(
            *(x.view(ml_dtypes.float8_e4m3fn) for x in (q, k, v)), mask_mod=SPEC.mask_mod,
            mod_inputs=inputs, block_mask=mask,
        )  # fmt: skip
    text = str(info.value)
    assert f"{tiles[0]} x {tiles[1]}" in text and f"head_dim={head_dim}" in text
    assert "128 x 64" in text  # an allowed tile at every head dim


@pytest.mark.parametrize("block_n", [128, 64])
def test_a_call_without_a_spec_runs_the_default_fp8_spec_in_the_masks_tiles(block_n):
    """Every fp8 call with a block mask and no spec, on the CPU backend or a 9.0 device (calls
    with expressions are not tuned), runs fp8_default_spec compiled with the mask_mod and made
    block-sparse in the mask's tiles: in 128 x 128 tiles, the shipped spec's kernel."""
    q, k, v, _ = problem(0, 2, 4, 2, 300, 300, descales=False)
    inputs = {"doc": DOCS}
    mask = block_mask_reference(SPEC.mask_mod, 2, 1, 300, 300, block_m=128, block_n=block_n,
                                mod_inputs=inputs)  # fmt: skip
    variants = VariantArgs(mask_mod=SPEC.mask_mod, mod_inputs=inputs, block_mask=mask)
    checked = check_fp8_call(
        *(x.view(ml_dtypes.float8_e4m3fn) for x in (q, k, v)), causal=True, scale=None,
        spec=None, return_lse=True, layout="bhsd", descales={}, unsupported={},
        variants=variants,
    )  # fmt: skip
    spec = checked.spec
    assert not checked.named and spec.block_sparse and spec.fp8 and not spec.pingpong
    assert (spec.block_m, spec.block_n, spec.mask_mod) == (128, block_n, SPEC.mask_mod)
    assert (spec.uri == SPEC.uri) == (block_n == 128)


def test_a_named_fp8_spec_takes_a_block_mask_of_its_own_tiles():
    """block_m 64 is refused for a call without a spec (above) but taken by a named m64 fp8
    spec of the mask's tiles (emulated once when written: every m64 loop within the bound on
    the ping-pong case); a named spec of other tiles names both."""
    q, k, v, _ = problem(0, 1, 2, 1, 300, 270, descales=False)
    inputs = {"qdoc": np.zeros(300, np.int32), "kdoc": np.zeros(270, np.int32)}
    mask = block_mask_reference(SPLIT_DOCS, 1, 1, 300, 270, block_m=64, block_n=64,
                                mod_inputs=inputs)  # fmt: skip
    variants = VariantArgs(mask_mod=SPLIT_DOCS, mod_inputs=inputs, block_mask=mask)
    fields = {"mask_mod": SPLIT_DOCS, "mod_inputs": ["qdoc:int32[1]", "kdoc:int32[1]"],
              "block_sparse": True}  # fmt: skip

    def check(spec):
        return check_fp8_call(
            *(x.view(ml_dtypes.float8_e4m3fn) for x in (q, k, v)), causal=False, scale=None,
            spec=spec, return_lse=True, layout="bhsd", descales={}, unsupported={},
            variants=variants,
        )  # fmt: skip

    m64 = fp8_spec(block_m=64, block_n=64, **fields)
    assert check(m64).spec == m64
    with pytest.raises(InputError, match=r"block_mask has 64 x 64 tiles \(block_m x block_n\)"):
        check(None)
    with pytest.raises(InputError, match=r"block_mask has 64 x 64 tiles but spec .*block_m=128"):
        check(fp8_spec(block_n=64, **fields))
