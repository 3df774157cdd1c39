"""``kernelgen emulate SPEC``: the table, the exit codes, and the two negative checks (a broken
fragment layout fails the error check, a missing cp.async wait is a hazard)."""

from __future__ import annotations

import pytest
from conftest import ROOT
from typer.testing import CliRunner

from kernelgen.cli import app
from kernelgen.kernels.render import render
from kernelgen.runtime import emulated_launch as launches
from kernelgen.specs.forward import load_spec

pytestmark = pytest.mark.emulate

runner = CliRunner()
TC_SPEC = ROOT / "specs" / "v2_tc_f16_d64_m64_n64_s2_swz.yaml"  # not causal
SIMT_SPEC = ROOT / "specs" / "v2_f32_d64_causal.yaml"
SMALL = "1,2,1,33,70"  # GQA, partial query and key tiles


def run(*args: str):
    return runner.invoke(app, ["emulate", *map(str, args)])


def _value(output: str, check: str) -> str:
    line = next(line for line in output.splitlines() if line.strip().startswith(check))
    return line.split(check, 1)[1].split()[0]


def test_a_tensor_core_spec_passes_with_its_facts():
    result = run(TC_SPEC, "--shape", SMALL, "--seed", 3)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "fa_fwd_v2_tc_f16_d64_m64_n64_w4_s2_swz  B=1 H=2 HKV=1 SQ=33 SK=70" in out
    assert "<= 0.002" in out and "<= 0.001" in out and "FAIL" not in out
    assert float(_value(out, "out: relative Frobenius error")) <= 2e-3
    wavefronts = int(_value(out, "ldmatrix shared-memory wavefronts"))
    assert f"ideal {wavefronts}" in out  # no bank conflicts
    # 2 query heads x 1 row tile, 70 keys in 64-key tiles: 4 tiles, none skipped
    assert _value(out, "key tiles visited") == "4" and "of 4 (no skipping)" in out
    # q once per head, k and v once per query head (GQA not packed) over whole key tiles
    assert int(_value(out, "global bytes read (cp.async)")) == (2 * 33 + 2 * 2 * 70) * 64 * 2


def test_causal_override_skips_tiles_above_the_diagonal():
    result = run(TC_SPEC, "--shape", "1,1,1,64,256", "--causal")
    assert result.exit_code == 0, result.output
    assert "fa_fwd_v2_tc_f16_d64_m64_n64_w4_s2_swz_causal" in result.output
    # One 64-row tile at the bottom right of 256 keys sees all of them: 4 tiles of 4.
    assert _value(result.output, "key tiles visited") == "4"
    result = run(TC_SPEC, "--shape", "1,1,1,256,256", "--causal")
    assert result.exit_code == 0, result.output
    assert _value(result.output, "key tiles visited") == "10"  # 1 + 2 + 3 + 4 of 16
    assert "of 16 (no skipping)" in result.output


def test_a_cuda_core_spec_has_no_cp_async_facts():
    result = run(SIMT_SPEC, "--shape", SMALL)
    assert result.exit_code == 0, result.output
    assert _value(result.output, "key tiles visited") == "n/a"
    assert "no ldmatrix" in result.output


WINDOW_SPEC = ROOT / "specs" / "v2_tc_bf16_d128_m64_n64_s2_swz_causal_window.yaml"


def test_a_window_spec_reports_the_tiles_its_window_skips():
    result = run(WINDOW_SPEC, "--shape", "1,1,1,256,256", "--window", "40,0")
    assert result.exit_code == 0, result.output
    # query tile t (rows 64t..64t+63) sees keys 64t-40 .. 64t+63: tiles t-1 and t (t = 0: one)
    assert _value(result.output, "key tiles visited") == "7" and "of 16" in result.output


def test_every_variant_with_example_values():
    spec = ROOT / "specs" / "v2_f32_d64_window_softcap_alibi_sinks.yaml"
    result = run(spec, "--shape", "1,2,1,33,70", "--softcap", "2")
    assert result.exit_code == 0, result.output
    assert float(_value(result.output, "out: relative Frobenius error")) <= 1e-4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((WINDOW_SPEC, "--window", "4"), "--window '4': expected LEFT,RIGHT"),
        ((WINDOW_SPEC, "--window", "-2,0"), "LEFT and RIGHT must be >= -1"),
        ((TC_SPEC, "--window", "4,4"), "--window needs a spec with window: true"),
        ((TC_SPEC, "--softcap", "2"), "--softcap needs a spec with softcap: true"),
        ((TC_SPEC, "--shape", "1,2,1,33"), "expected B,H,HKV,SQ,SK, five positive integers"),
        ((TC_SPEC, "--shape", "1,3,2,8,8"), "H=3 must be a multiple of HKV=2"),
        ((TC_SPEC, "--shape", "1,2,1,0,8"), "five positive integers"),
        ((ROOT / "specs" / "missing.yaml",), "missing.yaml: cannot read spec file"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = run(*args)
    assert result.exit_code == 2
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def _with_source(monkeypatch, edit) -> None:
    """The emulated kernels are built from ``edit(rendered source)``."""
    original = launches.render
    monkeypatch.setattr(launches, "render", lambda spec: edit(original(spec)))
    launches.spec_kernels.cache_clear()


@pytest.fixture
def fresh_kernels():
    launches.spec_kernels.cache_clear()
    yield
    launches.spec_kernels.cache_clear()


def test_a_broken_fragment_layout_fails_the_error_check(monkeypatch, fresh_kernels):
    """V's B fragments loaded without .trans: the P.V product uses V's transpose."""
    trans = "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"
    assert trans in render(load_spec(TC_SPEC))
    _with_source(monkeypatch, lambda s: s.replace(trans, trans.replace(".trans", "")))
    result = run(TC_SPEC, "--shape", SMALL)
    assert result.exit_code == 1, result.output
    assert "FAIL" in result.output
    assert "failed: out: relative Frobenius error" in result.output


def test_a_missing_wait_is_a_hazard(monkeypatch, fresh_kernels):
    wait = 'asm volatile("cp.async.wait_group %0;\\n" ::"n"(PENDING));'
    assert wait in render(load_spec(TC_SPEC))
    _with_source(monkeypatch, lambda s: s.replace(wait, ""))
    result = run(TC_SPEC, "--shape", SMALL)
    assert result.exit_code == 1, result.output
    assert "hazard: " in result.output
    assert "is in flight" in result.output


def test_a_wgmma_spec_reports_its_tma_bytes_and_skipped_tiles():
    """A Hopper spec: no ldmatrix, the bytes its TMA boxes read, and the key tiles visited
    counted from them: causal skipping leaves half of them (300 queries, 100 keys, 64-key
    tiles: the first 128-row tile sees no key, the second one key tile, the third two)."""
    spec = ROOT / "specs" / "v2_wg_bf16_d128_m128_n64_s2_ovl.yaml"
    result = run(spec, "--shape", "2,2,1,300,100", "--causal", "--seed", 1)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "FAIL" not in out
    assert _value(out, "ldmatrix shared-memory wavefronts") == "n/a"
    assert int(_value(out, "global bytes read (TMA boxes)")) > 0
    assert _value(out, "key tiles visited") == "12"
    assert "12 expected of 24" in out


def test_a_wgmma_decode_spec_counts_packed_split_blocks():
    """Packed GQA and split-KV: 16 queries x 8 heads of one K/V head are two 64-row tiles, each
    cut into 3 chunks of the 3 key tiles (one each): 6 key tiles, each copied once; the paged
    spec reads the same tiles from its pages (causal, 3 queries: every key of 5 tiles, 2 K/V
    heads, 2 entries)."""
    split = ROOT / "specs" / "v2_wg_bf16_d128_m64_n128_s2_gqa_split.yaml"
    result = run(split, "--shape", "1,8,1,16,300")
    assert result.exit_code == 0, result.output
    assert _value(result.output, "key tiles visited") == "6"
    assert "6 expected of 6" in result.output
    paged = ROOT / "specs" / "v2_wg_f16_d128_m64_n64_s2_gqa_split_paged_causal.yaml"
    result = run(paged, "--shape", "2,8,2,3,300")
    assert result.exit_code == 0, result.output
    assert "20 expected of 20" in result.output


def test_a_backward_spec_reports_each_gradient_error():
    result = run(str(ROOT / "specs" / "bwd_simt_f16_d64_window_softcap_alibi_sinks.yaml"),
                 "--shape", "1,4,2,21,30")  # fmt: skip
    assert result.exit_code == 0, result.output
    for name in ("dq", "dk", "dv", "dsinks"):
        assert f"{name} rel. error" in result.stdout


def test_a_broken_backward_fails_the_error_check(monkeypatch):
    from kernelgen.calls import backward as backward_api
    from kernelgen.families import backward

    render_backward = backward.render
    monkeypatch.setattr(
        backward,
        "render",
        lambda s: render_backward(s).replace("ds = p * (dp - t.delta[i])", "ds = p * dp"),
    )
    monkeypatch.setattr(backward_api, "_KERNELS", {})
    result = run(str(ROOT / "specs" / "bwd_simt_f32_d64_causal.yaml"), "--shape", "1,2,1,20,30")
    assert result.exit_code == 1, result.output
    assert "failed: dq rel. error, dk rel. error" in result.output


# ---- fp8 (e4m3) specs: e4m3 inputs with descales, against the stated fp8 bound --------------
FP8_SPEC = ROOT / "specs" / "v2_wg_e4m3_d128_m128_n128_s2.yaml"
FP8_SHAPE = "1,3,1,70,150"  # MQA, Sq and Sk off the 128-row and 128-key tiles (Sk off 16)


def test_an_fp8_spec_runs_within_its_bound_against_float64():
    """The kernel's output against the float64 attention of the quantized inputs and descales
    (kernelgen.references.fp8, the model every fp8 test checks against); causal: 70 queries at
    the bottom right of 150 keys see both key tiles."""
    result = run(FP8_SPEC, "--shape", FP8_SHAPE, "--causal", "--seed", 5)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "fa_fwd_v2_wg_e4m3_d128_m128_n128_w12_s2_causal  B=1 H=3 HKV=1 SQ=70 SK=150" in out
    assert "FAIL" not in out
    assert 0.05 < float(_value(out, "out: max error / fp8 bound")) <= 1.0
    assert 1e-3 < float(_value(out, "out: relative Frobenius error")) <= 2.0**-4
    assert float(_value(out, "lse: max absolute error")) <= 1e-3
    assert "6 expected of 6" in out  # 3 heads x 2 key tiles, none skipped


def test_the_fp8_block_sparse_spec_visits_the_listed_tiles():
    """The shipped fp8 document-mask spec with example documents (3 per entry) and their block
    mask: within the bound, and its TMA bytes count the listed tiles only (28 of the 40 that
    the causal mask leaves in reach of 2 x 2 heads' 4 x 4 tiles; the emulate CLI used to pass
    the block mask to the reference and count every tile)."""
    spec = ROOT / "specs" / "v2_wg_e4m3_d128_m128_n128_s2_causal_docmask_bsparse.yaml"
    result = run(spec, "--shape", "2,2,1,400,400", "--seed", 3)
    assert result.exit_code == 0, result.output
    assert "FAIL" not in result.output
    assert float(_value(result.output, "out: max error / fp8 bound")) <= 1.0
    assert _value(result.output, "key tiles visited") == "28"
    assert "28 expected of 64" in result.output


def test_an_fp8_kernel_without_its_v_descale_fails_the_bound(monkeypatch, fresh_kernels):
    """Mutation: the epilogue's v descale dropped (out off by the descale's factor)."""
    factor = "const float out_factor = v_descale ? v_descale[descale_index] : 1.f;"
    assert factor in render(load_spec(FP8_SPEC))
    _with_source(monkeypatch, lambda s: s.replace(factor, "const float out_factor = 1.f;"))
    result = run(FP8_SPEC, "--shape", FP8_SHAPE)
    assert result.exit_code == 1, result.output
    assert "failed: out: max error / fp8 bound, out: relative Frobenius error" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--window", "4,0"), "--window needs a spec with window: true"),
        (("--softcap", "2"), "--softcap needs a spec with softcap: true"),
        (("--shape", "1,2,1,33"), "expected B,H,HKV,SQ,SK, five positive integers"),
        (("--seed", "-1"), "--seed -1: use an integer from 0"),
    ],
)
def test_bad_input_to_an_fp8_spec_is_one_line_and_exit_2(args, message):
    result = run(FP8_SPEC, *args)
    assert result.exit_code == 2
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1
