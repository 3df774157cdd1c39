"""The fp8 fuzzer's newer forms (kernelgen.testing.fuzz_fp8): V transposed in the kernel, the
decode forms (split-KV, packed GQA, paged KV on pages a multiple of block_n and not) run through
attention_with_kvcache, block-sparse document masks, NaN rows past seqlens_k. The draws reach
each form; a fixed decode case runs paged and split as drawn and passes; two mutants of the
decode path (a paged row's offset, the split partials' v descale) are mismatches; a fixed
block-sparse case passes. Four emulated runs (CI's time)."""

from __future__ import annotations

import pytest

from kernelgen.kernels.render import render
from kernelgen.runtime.emulated_launch import recording
from kernelgen.specs.forward import spec_from_dict
from kernelgen.testing import fuzz, fuzz_fp8
from kernelgen.testing.fuzz_space import FuzzProblem


def test_fp8_draws_reach_the_newer_forms():
    """Over 250 fp8 cases of seed 3: each newer form in some valid spec, paged both ways."""
    seen: set[str] = set()
    for index in range(250):
        case, _ = fuzz.draw_case(3, index, "fp8")
        spec, p = spec_from_dict(case.spec), case.problem
        seen |= {
            n for n in ("split_kv", "pack_gqa", "paged_kv", "block_sparse") if case.spec.get(n)
        }
        seen |= {"vk"} if spec.fp8_v_layout == "kernel" else set()
        if fuzz_fp8.is_decode(spec):
            assert spec.fp8_v_layout == "kernel"  # the validator's rule, so the draw's
        if spec.paged_kv:
            assert p.page_size % 16 == 0 and p.page_size > 0
            seen.add("tma pages" if p.page_size % spec.block_n == 0 else "row pages")
        if p.nan_past:
            assert p.seqlens_k is not None
            seen.add("nan past")
    wanted = {"split_kv", "pack_gqa", "paged_kv", "block_sparse", "vk", "tma pages",
              "row pages", "nan past"}  # fmt: skip
    assert wanted <= seen, wanted - seen


# Split (3 chunks), packed GQA 2, paged on 48-key pages (no multiple of 64: cp.async row
# copies, tiles straddling pages), causal, two queries, lengths off the tiles with NaN past them.
DECODE = fuzz.FuzzCase(
    dict(loop_order="v2", mma="wgmma", dtype="float8_e4m3", head_dim=64, block_m=64, block_n=64)
    | dict(stages=2, causal=True, fp8_v_layout="kernel", split_kv=True, pack_gqa=True)
    | dict(paged_kv=True),
    FuzzProblem(
        batch=2,
        heads=4,
        kv_heads=2,
        seqlen_q=2,
        seqlen_k=150,
        layout="bhsd",
        data_seed=5,
        seqlens_k=(97, 150),
        nan_past=True,
        page_size=48,
        num_splits=3,
        descales=("q_descale", "k_descale", "v_descale"),
    ),
)
BLOCK_SPARSE = fuzz.FuzzCase(
    dict(loop_order="v2", mma="wgmma", dtype="float8_e4m3", head_dim=128, block_m=128)
    | dict(block_n=128, stages=4, causal=True, q_in_registers=True, fp8_v_layout="kernel")
    | dict(mask_mod="qdoc[b, q_idx] == kdoc[b, kv_idx]", block_sparse=True)
    | dict(mod_inputs=["qdoc:int32[2]", "kdoc:int32[2]"]),
    FuzzProblem(
        batch=1,
        heads=4,
        kv_heads=1,
        seqlen_q=17,
        seqlen_k=146,
        layout="bhsd",
        data_seed=1658267103,
        seqlens_k=(127,),
        descales=("k_descale", "v_descale"),
    ),
)
MUTATIONS = {
    "a paged row's offset from the tile's first key, not its page's": (
        "r.row_in_page * stride_row + chunk",
        "(first_row + i * ROW_STEP) * stride_row + chunk",
    ),
    "the split partials without v's descale": (
        "const float inv_l = inverse_sum(row_l) * out_factor;\n    float* o_row",
        "const float inv_l = inverse_sum(row_l);\n    float* o_row",
    ),
}


@pytest.mark.emulate
def test_a_drawn_decode_case_runs_paged_and_split_through_kvcache_within_the_bound():
    spec = spec_from_dict(DECODE.spec)
    keywords, hooks = fuzz_fp8.call_keywords(spec, DECODE.problem)
    with recording(None) as recorded:
        result = fuzz_fp8.run(spec, DECODE.problem, keywords, hooks)
    assert result["outcome"] == "ok", result
    assert 0 < result["bound_ratio"] <= 1
    assert recorded.problem.page_size == 48 and recorded.problem.num_splits == 3
    assert spec.uri in recorded.stats


@pytest.mark.emulate
@pytest.mark.parametrize("name", MUTATIONS)
def test_the_fuzzer_judges_a_mutated_decode_path_a_mismatch(name):
    original, mutated = MUTATIONS[name]
    spec = spec_from_dict(DECODE.spec)
    source = render(spec)
    assert source.count(original) == 1, original
    keywords, hooks = fuzz_fp8.call_keywords(spec, DECODE.problem)
    result = fuzz_fp8.run(
        spec, DECODE.problem, keywords, hooks, source=source.replace(original, mutated)
    )
    assert result["outcome"] == "mismatch", result


@pytest.mark.emulate
def test_a_drawn_block_sparse_case_with_v_transposed_in_the_kernel_passes():
    result = fuzz.run_case(BLOCK_SPARSE)
    assert result["outcome"] == "ok", result
    assert 0 < result["bound_ratio"] <= 1
