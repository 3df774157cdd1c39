"""CPU tests of the variant benchmark (bench/variants.py): its cases, FLOP count, table and
command line; nothing here needs torch or a GPU."""

from __future__ import annotations

import itertools
import math

import pytest

from bench import gpu, report, variants


def test_cases_cover_every_variant_on_causal_bf16_shapes():
    quick = variants.cases(quick=True)
    assert [c.name for c in quick] == list(variants.VARIANTS)
    assert all(c.shape.causal and c.shape.dtype == "bfloat16" for c in quick)
    assert len(variants.cases()) == len(variants.VARIANTS) * len(variants.SEQLENS)
    assert [c.key for c in variants.cases(True, ["sinks"])] == ["sinks-bf16-d128-s4096-causal"]


def test_visible_flops_count_the_window_and_the_causal_triangle():
    (window,) = variants.cases(True, ["window"])
    (softcap,) = variants.cases(True, ["softcap"])
    s, w = 4096, variants.WINDOW
    per_pair = 4 * window.shape.batch * window.shape.heads * window.shape.head_dim
    # rows 0..w-1 see i + 1 keys, the others w
    assert variants.visible_flops(window) == per_pair * (w * (w + 1) // 2 + (s - w) * w)
    assert variants.visible_flops(softcap) == per_pair * s * (s + 1) / 2
    (document,) = variants.cases(True, ["document"])
    length = s // variants.DOCUMENTS  # causal within each of the equal documents
    assert (
        variants.visible_flops(document)
        == per_pair * variants.DOCUMENTS * length * (length + 1) / 2
    )


def test_alibi_slopes_are_the_geometric_sequence():
    slopes = variants.alibi_slopes(8)
    assert slopes[0] == 0.5 and math.isclose(slopes[-1], 2**-8)
    assert all(math.isclose(a / b, 2.0) for a, b in itertools.pairwise(slopes))


def test_markdown_table_has_a_line_per_case():
    shape = variants.cases(True, ["window"])[0].shape
    rows = [
        report.make_row(shape, "kernelgen", report.OK, variant="window", median_ms=1.5),
        report.make_row(shape, "flex", report.WRONG, variant="window", reason="x"),
    ]
    table = variants.markdown(rows)
    assert "| window | bf16-d128-s4096-causal | 1.500 ms | wrong | - |" in table


def test_list_needs_no_gpu(capsys):
    assert variants.main(["--list", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "window-bf16-d128-s4096-causal" in out
    assert "peers: kernelgen, flex, flash-attn, kernelgen-wg, kernelgen-wg-fp8" in out


def test_run_without_gpu_is_one_line(tmp_path, capsys, monkeypatch):
    def no_gpu() -> None:
        raise gpu.NoGPUError("torch is not installed")

    monkeypatch.setattr(gpu, "open_gpu", no_gpu)
    assert variants.main(["--quick", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "bench: no usable GPU: torch is not installed"
    assert not any(tmp_path.iterdir())


def test_unknown_variant_is_refused():
    with pytest.raises(SystemExit):
        variants.main(["--variant", "relative-bias"])


def test_the_wgmma_twin_times_the_shipped_block_sparse_spec_on_9_0_devices_only():
    from pathlib import Path
    from types import SimpleNamespace

    from kernelgen.specs.forward import load_spec

    shipped = Path(__file__).parent.parent / "specs"
    spec = load_spec(shipped / "v2_wg_bf16_d128_m128_n128_s2_causal_docmask_bsparse.yaml")
    assert variants.wgmma_document_spec(variants.HEAD_DIM) == spec
    (document,) = variants.cases(True, ["document"])
    (window,) = variants.cases(True, ["window"])
    with pytest.raises(NotImplementedError, match=r"compute capability 9\.0 only"):
        variants.kernelgen_wg_peer(SimpleNamespace(arch="sm_80"), document)
    with pytest.raises(NotImplementedError, match="document mask only"):
        variants.kernelgen_wg_peer(SimpleNamespace(arch="sm_90"), window)


def test_the_fp8_wgmma_twin_times_the_shipped_fp8_block_sparse_spec_on_9_0_devices_only():
    from pathlib import Path
    from types import SimpleNamespace

    from kernelgen.specs.forward import load_spec

    shipped = Path(__file__).parent.parent / "specs"
    spec = load_spec(shipped / "v2_wg_e4m3_d128_m128_n128_s2_causal_docmask_bsparse.yaml")
    assert variants.wgmma_document_spec(variants.HEAD_DIM, fp8=True) == spec
    (document,) = variants.cases(True, ["document"])
    (window,) = variants.cases(True, ["window"])
    with pytest.raises(NotImplementedError, match=r"compute capability 9\.0 only"):
        variants.kernelgen_wg_fp8_peer(SimpleNamespace(arch="sm_80"), document, [])
    with pytest.raises(NotImplementedError, match="fp8 wgmma twin times the block-sparse"):
        variants.kernelgen_wg_fp8_peer(SimpleNamespace(arch="sm_90"), window, [])
