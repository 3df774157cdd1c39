"""CPU tests of the benchmark harness (bench/): its pure modules and its command line.

Nothing here needs torch, CuPy or a GPU; the GPU layer (bench/gpu.py) is not imported.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from bench import metrics, report
from bench.candidates import PEERS, candidate_label, tensor_core_candidates, v1_fields
from bench.shapes import TOKENS, Shape, grid, make_shape, normalize_dtype


# ---- FLOPs ----
def test_effective_keys():
    assert metrics.effective_keys(1024, 1024, causal=False) == 1024
    assert metrics.effective_keys(1024, 1024, causal=True) == 512
    assert metrics.effective_keys(128, 256, causal=True) == 192  # (128 + 256) / 2
    assert metrics.effective_keys(256, 128, causal=True) == 64  # (0 + 128) / 2
    assert metrics.effective_keys(3, 4, causal=True) == 2.5


def test_attention_flops_hand_computed():
    # 4 * B * H * Sq * D * Sk_eff, worked out by hand.
    assert metrics.attention_flops(1, 1, 1, 1, 8, causal=False) == 32
    assert metrics.attention_flops(2, 3, 128, 256, 64, causal=False) == 4 * 2 * 3 * 128 * 64 * 256
    assert metrics.attention_flops(2, 3, 128, 256, 64, causal=False) == 50_331_648
    assert metrics.attention_flops(2, 3, 128, 256, 64, causal=True) == 37_748_736  # Sk_eff 192
    assert metrics.attention_flops(2, 3, 256, 128, 64, causal=True) == 25_165_824  # Sk_eff 64
    # hdim 128, 16 heads, 4 x 4096 tokens, non-causal: the NOTES.md example.
    assert metrics.attention_flops(4, 16, 4096, 4096, 128, causal=False) == 549_755_813_888
    assert metrics.attention_flops(4, 16, 4096, 4096, 128, causal=True) == 274_877_906_944


def test_bytes_and_floors():
    shape = make_shape("bf16", 128, False, 4096)
    sizes = metrics.tensor_bytes(shape)
    assert sizes == {"q": 67_108_864, "k": 67_108_864, "v": 67_108_864, "out": 67_108_864}
    assert metrics.lse_bytes(shape) == 4 * 4 * 16 * 4096
    assert metrics.min_bytes(shape) == 4 * 67_108_864 + 1_048_576
    assert metrics.input_set_bytes(shape) == 3 * 67_108_864
    assert metrics.naive_score_bytes(shape) == 4 * 4 * 16 * 4096 * 4096
    compute, memory = metrics.floor_ms(1e12, 2e9, tflops_peak=500.0, bytes_per_s=2e12)
    assert compute == pytest.approx(2.0)
    assert memory == pytest.approx(1.0)
    assert metrics.floor_ms(1e12, 2e9, None, None) == (None, None)
    assert metrics.tflops(2e12, 4.0) == pytest.approx(500.0)
    assert metrics.tflops(1e12, None) is None
    assert metrics.tflops(1e12, 0.0) is None


# ---- shapes ----
def test_full_grid():
    shapes = grid()
    assert len(shapes) == 6 * 3 * 2 * 2
    assert {s.seqlen_q for s in shapes} == {512, 1024, 2048, 4096, 8192, 16384}
    assert {s.head_dim for s in shapes} == {64, 128, 256}
    assert {s.dtype for s in shapes} == {"bfloat16", "float16"}
    assert {s.causal for s in shapes} == {False, True}
    for s in shapes:
        assert s.batch * s.seqlen_q == TOKENS == 16384
        assert s.seqlen_q == s.seqlen_k
        assert s.heads == (32 if s.head_dim == 64 else 16)
    assert len({s.key for s in shapes}) == len(shapes)


def test_quick_grid_is_small():
    shapes = grid(quick=True)
    assert len(shapes) == 8
    assert {s.seqlen_q for s in shapes} == {1024, 4096}
    assert {s.head_dim for s in shapes} == {64, 128}
    assert {s.dtype for s in shapes} == {"bfloat16"}
    assert all(s.batch * s.seqlen_q == 16384 for s in shapes)
    assert len(tensor_core_candidates(quick=True)) < len(tensor_core_candidates())


def test_grid_filters():
    shapes = grid(dtypes=["fp16"], head_dims=[256], seqlens=[16384, 512], causal=True)
    assert [(s.dtype, s.head_dim, s.seqlen_q, s.causal, s.batch) for s in shapes] == [
        ("float16", 256, 512, True, 32),
        ("float16", 256, 16384, True, 1),
    ]
    assert {s.causal for s in grid(quick=True, causal=False)} == {False}
    with pytest.raises(ValueError, match="bf16"):
        normalize_dtype("fp8")


def test_shape_key():
    assert make_shape("bfloat16", 128, True, 4096).key == "bf16-d128-s4096-causal"
    assert make_shape("fp16", 64, False, 512).key == "fp16-d64-s512"
    odd = Shape("float16", 64, True, 128, 256, 1, 2)
    assert odd.key == "fp16-d64-q128-k256-causal"


# ---- statistics and rotation ----
def test_stats_on_known_data():
    data = [float(x) for x in range(1, 12)]  # 1..11
    assert metrics.percentile(data, 50) == 6.0
    assert metrics.percentile(data, 10) == 2.0
    assert metrics.percentile(data, 90) == 10.0
    assert metrics.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # unsorted, even count
    assert metrics.percentile([1.0, 2.0], 10) == pytest.approx(1.1)
    summary = metrics.summarize([5.0, 1.0, 9.0, 3.0, 7.0])
    assert summary == {
        "median_ms": 5.0,
        "p10_ms": pytest.approx(1.8),
        "p90_ms": pytest.approx(8.2),
        "min_ms": 1.0,
        "max_ms": 9.0,
        "reps": 5,
    }
    with pytest.raises(ValueError):
        metrics.percentile([], 50)


def test_rotation_count():
    mib = 1 << 20
    assert metrics.rotation_count(50 * mib, 10 * mib) == 11  # 110 MiB > 100 MiB
    assert metrics.rotation_count(50 * mib, 192 * mib) == 2  # never fewer than two
    assert metrics.rotation_count(None, 10 * mib) == 11  # default L2 of 50 MiB
    assert metrics.rotation_count(60 * mib, 1 * mib, maximum=64) == 64
    for l2, size in ((50 * mib, 7 * mib), (40 * mib, 3 * mib)):
        n = metrics.rotation_count(l2, size)
        assert n * size > 2 * l2
    with pytest.raises(ValueError):
        metrics.rotation_count(mib, 0)


def test_repetitions():
    assert metrics.repetitions(0.1, 500) == 500
    assert metrics.repetitions(1.0, 500) == 500
    assert metrics.repetitions(10.0, 500) == 50
    assert metrics.repetitions(100.0, 500) == 20  # the minimum wins over the budget
    assert metrics.repetitions(0.01, 500, max_reps=300) == 300


def test_tolerances():
    assert metrics.tolerance("bfloat16") == 2e-2
    assert metrics.tolerance("float16") == 5e-3
    assert metrics.tolerance("float8_e4m3") == 2.0**-4  # the fp8 tests' relative-error bound


# ---- candidates ----
def test_tensor_core_candidates_follow_the_mma_rules():
    for quick in (False, True):
        for c in tensor_core_candidates(quick):
            assert c["mma"] == "mma_sync"
            assert c["loop_order"] == "v2"
            assert c["block_m"] in (16 * c["num_warps"], 32 * c["num_warps"])
            assert 2 <= c["stages"] <= 4
            assert c["smem_layout"] in ("padded", "swizzled")
    from kernelgen.tuning.candidates import TC_BLOCK_N, TC_LAYOUTS, TC_STAGES, TC_WARP_TILINGS

    labels = [candidate_label(c) for c in tensor_core_candidates()]
    # the autotuner's whole tensor-core grid, each point once
    grid = len(TC_WARP_TILINGS) * len(TC_BLOCK_N) * len(TC_STAGES) * len(TC_LAYOUTS)
    assert len(set(labels)) == len(labels) == grid
    assert len(tensor_core_candidates(quick=True)) == len(TC_WARP_TILINGS) * len(TC_BLOCK_N)
    assert {"m64n128w4s2-swz", "m128n32w4s3-pad", "m128n32w8s2-swz"} <= set(labels)
    assert v1_fields({"loop_order": "v2", "block_m": 64})["loop_order"] == "v1"


# ---- report ----
def _fake_rows() -> list[dict]:
    a = make_shape("bf16", 128, False, 4096)
    b = make_shape("bf16", 128, True, 16384)
    rows = [
        report.make_row(a, "torch-flash", report.OK, tflops=400.0, median_ms=1.37),
        report.make_row(a, "torch-cudnn", report.OK, tflops=500.0, median_ms=1.1),
        report.make_row(a, "torch-efficient", report.UNAVAILABLE, reason="No available kernel"),
        report.make_row(a, "cupy-naive", report.OK, tflops=50.0),
        report.make_row(a, "kg-simt-v1", report.WRONG, rel_err=0.25, reason="rel. error 0.25"),
        report.make_row(a, "kg-simt-v2", report.ERROR, reason="CompileError: boom"),
        report.make_row(
            a,
            "kg-tc-v2",
            report.OK,
            tflops=300.0,
            spec_uri="fa_fwd_v2_x",
            frac_of_matmul=0.4,
            candidates=[{"status": "ok"}, {"status": "invalid"}],
        ),
        report.make_row(b, "torch-flash", report.OK, tflops=450.0),
        report.make_row(b, "cupy-naive", report.SKIPPED, reason="score matrix too big"),
        report.make_row(b, "kg-tc-v2", report.WRONG, rel_err=None, reason="3 non-finite"),
    ]
    return rows


def test_markdown_table_rows_and_cells():
    table = report.markdown_table(_fake_rows())
    lines = table.splitlines()
    assert len(lines) == 2 + 2  # header, rule, one line per shape
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:5] == ["dtype", "D", "causal", "S", "BxH"]
    assert header[5 : 5 + len(PEERS)] == [p.short for p in PEERS]
    assert header[-2:] == ["tc/best", "tc/flash"]
    first = [c.strip() for c in lines[2].strip("|").split("|")]
    assert first[:5] == ["bf16", "128", "-", "4096", "4x16"]
    assert first[5:12] == ["400.0", "500.0", "n/a", "50.0", "WRONG 2.5e-01", "ERR", "300.0"]
    assert first[-2:] == ["0.60x", "0.75x"]  # 300 / best torch (cudnn 500); 300 / flash 400
    second = [c.strip() for c in lines[3].strip("|").split("|")]
    assert second[3] == "16384" and second[4] == "1x16"
    assert second[5:12] == ["450.0", "-", "-", "skip", "-", "-", "WRONG nan"]
    assert second[-2:] == ["-", "-"]


def test_plot_draws_every_panel_as_a_png():
    """The .png the benchmark writes (matplotlib: the `bench` extra, which `dev` installs) is
    drawn from result rows; no rows is a ValueError, which the benchmark reports and skips."""
    pytest.importorskip("matplotlib")
    from bench.plot import plot_png

    rows = _fake_rows()
    png = plot_png(rows, "attention forward, Fake GPU")
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    with pytest.raises(ValueError, match="no rows"):
        plot_png([], "empty")


def test_markdown_compact_and_document():
    compact = report.markdown_table(_fake_rows(), compact=True)
    assert compact.splitlines()[0].startswith("| dtype | D | c | S | flash")
    assert "BxH" not in compact
    result = report.build_result(
        {"gpu_name": "Fake GPU", "date": "2026-01-02", "git_commit": "abc", "git_dirty": True},
        {"copy_gbps": 3000.0, "matmul_tflops": {"bfloat16": 700.0, "float16": 710.0}},
        _fake_rows(),
        {"quick": True},
    )
    doc = report.markdown_document(result)
    assert "# Attention forward benchmark: Fake GPU (2026-01-02)" in doc
    assert "copy 3000.0 GB/s" in doc and "bf16 700.0" in doc
    assert "`fa_fwd_v2_x`" in doc and "1/2" in doc and "40%" in doc
    assert "torch-efficient (unavailable): No available kernel" in doc
    assert "(dirty)" in doc


def test_ratio_and_best_torch():
    rows = {r["peer"]: r for r in _fake_rows()[:7]}
    assert report.best_torch(rows)["peer"] == "torch-cudnn"
    assert report.ratio(rows["kg-tc-v2"], rows["torch-flash"]) == pytest.approx(0.75)
    assert report.ratio(rows["kg-tc-v2"], rows["kg-simt-v1"]) is None
    assert report.ratio(None, rows["torch-flash"]) is None


def test_make_row_rejects_unknown_status():
    with pytest.raises(ValueError, match="status"):
        report.make_row(make_shape("bf16", 64, False, 512), "torch-flash", "fast")


def test_slug_and_file_names(tmp_path):
    assert report.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert report.slug("  Tesla/V100-SXM2 (16GB) ") == "tesla-v100-sxm2-16gb"
    assert report.slug("???") == "unknown"
    stem = report.result_stem(dt.date(2026, 3, 4), "NVIDIA H200")
    assert stem == "2026-03-04-nvidia-h200"
    assert report.result_stem(dt.date(2026, 3, 4), "NVIDIA H200", tag="d64 only") == (
        "2026-03-04-nvidia-h200-d64-only"
    )
    paths = report.result_paths(tmp_path, stem)
    assert paths["json"] == tmp_path / "2026-03-04-nvidia-h200.json"
    assert {p.suffix for p in paths.values()} == {".json", ".md", ".png"}


def test_json_and_atomic_write(tmp_path):
    rows = _fake_rows()
    rows[0]["rel_err"] = float("nan")
    result = report.build_result({"gpu_name": "x"}, {}, rows, {})
    text = report.to_json(result)
    data = json.loads(text)  # strict JSON: NaN became null
    assert data["schema"] == report.SCHEMA_VERSION
    assert data["rows"][0]["rel_err"] is None
    assert {"meta", "settings", "floors", "rows"} <= set(data)
    target = tmp_path / "sub" / "r.json"
    report.write_atomic(target, text)
    report.write_atomic(target, text)  # replaces
    assert json.loads(target.read_text()) == data
    assert [p.name for p in target.parent.iterdir()] == ["r.json"]  # no temp file left
    report.write_atomic(tmp_path / "b.png", b"\x89PNG")
    assert (tmp_path / "b.png").read_bytes() == b"\x89PNG"


def test_merge_rows_replaces_same_shape_and_peer():
    rows = _fake_rows()
    newer = dict(rows[0], tflops=410.0)
    merged = report.merge_rows(rows, [newer])
    assert len(merged) == len(rows)
    assert next(r["tflops"] for r in merged if r["peer"] == "torch-flash") == 410.0


# ---- command line ----
def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU even on a GPU machine
    return subprocess.run(
        [sys.executable, "-m", "bench.attention", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_help_without_gpu():
    proc = _run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    for flag in ("--quick", "--out", "--decode", "--dtype", "--head-dim", "--seqlen", "--causal"):
        assert flag in proc.stdout


def test_cli_without_gpu_fails_with_one_line(tmp_path):
    proc = _run_cli("--quick", "--out", str(tmp_path))
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench: no usable GPU")
    assert not any(tmp_path.iterdir())


def test_cli_list_and_decode_need_no_gpu():
    listed = _run_cli("--list", "--quick", "--causal")
    assert listed.returncode == 0, listed.stderr
    assert "4 shapes" in listed.stdout and "bf16-d128-s4096-causal" in listed.stdout
    decode = _run_cli("--decode", "--quick", "--list")
    assert decode.returncode == 0, decode.stderr
    assert decode.stdout.startswith("4 decode shapes")
    bad = _run_cli("--dtype", "fp8")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


# ---- static loop analysis (bench.sass_loop) ----
SASS_SNIPPET = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, RZ ;
        /*0020*/                   FMUL R2, R2, R3 ;
        /*0030*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0040*/              @!PT LDS RZ, [RZ] ;
        /*0050*/               @P0 BRA 0x10 ;
        /*0060*/                   FADD R2, R2, R3 ;
        /*0070*/               @P1 BRA 0x60 ;
        /*0080*/                   EXIT ;
"""


def test_hmma_loop_counts_the_body_of_the_backward_branch_around_the_hmmas():
    from kernelgen.model.perfmodel import hmma_loop

    body = hmma_loop(SASS_SNIPPET)
    # 0x10..0x50: two HMMA, one FMUL, the branch; the @!PT padding and the HMMA-free loop are out
    assert body.counts == {"HMMA": 2, "FMUL": 1, "BRA": 1}
    assert body.issued == 4 and body.per_hmma == 2.0 and body.inner_loops == 0
    nested = SASS_SNIPPET.replace("@P1 BRA 0x60", "@P1 BRA 0x0")  # 0x0..0x70 holds 0x10..0x50
    outer = hmma_loop(nested)
    assert outer.inner_loops == 1 and outer.counts["HMMA"] == 2 and outer.issued == 7
    with pytest.raises(ValueError, match="no loop"):
        hmma_loop(SASS_SNIPPET.replace("HMMA", "IMMA"))


def test_opcode_counts_read_every_address_width():
    from kernelgen.kernels.compile import count_opcodes

    far = "        /*1a2b0*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;\n"
    counts = count_opcodes(SASS_SNIPPET + far)  # kernels past 64 KiB have 5-digit addresses
    assert counts["HMMA"] == 3 and counts["LDS"] == 0  # `@!PT LDS` padding never runs


def test_interior_source_replaces_each_tile_test_once():
    from kernelgen.model.perfmodel import INTERIOR, interior_source

    assert set(INTERIOR) == {"mma_sync", "wgmma"}
    for mma, tests in INTERIOR.items():  # each template's own tile tests
        source = " ".join(tests)
        assert interior_source(source, mma) == " ".join(tests.values())
        for test in tests:
            with pytest.raises(ValueError, match="no longer contains"):
                interior_source(source.replace(test, ""), mma)
            with pytest.raises(ValueError, match="no longer contains"):
                interior_source(source + test, mma)


def test_schedule_model_runs_longest_blocks_first_to_a_shorter_finish():
    from bench.schedule_model import causal_costs, makespan, table

    assert makespan([2.0] * 5, slots=2) == 6.0  # three waves
    assert makespan([1, 1, 1, 3], slots=2) == 4.0  # the long block starts last
    assert makespan([3, 1, 1, 1], slots=2) == 3.0  # longest first: the short ones fill in
    # Sq = Sk = 256, 128-row tiles over 64-key tiles: the tiles see 2 and 4 key tiles.
    assert causal_costs(256, 128, 64, grids=2, descending=False, overhead=0.5) == [2.5, 4.5] * 2
    assert causal_costs(256, 128, 64, grids=1, descending=True, overhead=0.0) == [4, 2]
    rows = table(sms=132, overhead=0.5)
    assert all(r["descending"] <= r["ascending"] + 1e-12 for r in rows)
    assert all(r["descending"] >= 1.0 for r in rows)  # never below the ideal


def test_wgmma_peer_and_its_candidates():
    """The Hopper peer times the autotuner's wgmma grid: valid specs for archs [sm_90a]."""
    from bench.candidates import PEERS_BY_NAME, candidate_label, wgmma_candidates
    from kernelgen.specs.forward import spec_from_dict

    assert PEERS_BY_NAME["kg-wgmma"].family == "kernelgen"
    grid = wgmma_candidates()
    # 2 x 2 tilings x overlap on or off, and 2-CTA clusters and ping-pong of the 128-row ones;
    # without overlap also the TMA-store epilogue and Q in registers; one stage count (one more
    # for the overlap, which releases a slot a tile later); the wide 128 x 176 tiling without
    # overlap, with its twins but Q in registers
    assert len(grid) == 28 and len(wgmma_candidates(quick=True)) == 28
    # head dims 128, 192 and 256 add their own tilings (144; 96 and 112; 80 keys), each with
    # the overlap and the twins (field sets: validation drops those past the registers)
    for head_dim, own in ((128, {144}), (192, {96, 112}), (256, {80})):
        extra = wgmma_candidates(head_dim=head_dim)
        assert extra[:28] == grid and {g["block_n"] for g in extra[28:]} == own
        assert len(extra) == 28 + len(own) * 8
    assert wgmma_candidates(head_dim=64) == grid
    overlapped_turns = [g for g in grid if g["overlap"] and g.get("pingpong")]
    assert {(g["block_m"], g["block_n"], g["stages"]) for g in overlapped_turns} == {
        (128, 128, 3), (128, 64, 3)
    }  # fmt: skip
    assert sum(g["block_n"] == 176 for g in grid) == 4
    assert {g["stages"] for g in grid} == {2, 3}
    assert all(g["stages"] == 3 for g in grid if g["overlap"])
    identity = {"dtype": "bfloat16", "head_dim": 128, "causal": False, "archs": ["sm_80"]}
    specs = [spec_from_dict({**identity, **fields}) for fields in grid if not fields["overlap"]]
    assert all(s.mma == "wgmma" and s.archs == ("sm_90a",) for s in specs)
    assert [candidate_label(g) for g in grid[:5]] == [
        "wg-m128n128s2", "wg-m128n128s2-c2", "wg-m128n128s2-tma", "wg-m128n128s2-qr",
        "wg-m128n128s2-pp",
    ]  # fmt: skip
    assert sum(s.epilogue == "tma" for s in specs) == 5  # one per tiling, the plain loop
    assert sum(s.cluster_m == 2 for s in specs) == 3  # the 128-row plain loops (and overlaps)
    assert all(s.block_m == 128 for s in specs if s.pingpong)


def test_fp8_peer_and_its_candidates():
    """The fp8 peer times each loop of the fp8 kernel on a bf16 d128 shape: valid fp8 specs for
    archs [sm_90a], one per loop, labelled apart from the bf16 ones; its implementation checks
    with the fp8 tolerance and calls kernelgen.attention on the quantized copy of the set it
    is given."""
    import contextlib
    import types

    from bench import gpu
    from bench.candidates import FP8_PEER, PEERS_BY_NAME, candidate_label, fp8_candidates
    from kernelgen.specs.forward import spec_from_dict

    assert PEERS_BY_NAME[FP8_PEER].family == "kernelgen"
    identity = {"dtype": "bfloat16", "head_dim": 128, "causal": True, "archs": ["sm_80"]}
    specs = [spec_from_dict({**identity, **fields}) for fields in fp8_candidates()]
    assert all(s.fp8 and s.causal and s.archs == ("sm_90a",) for s in specs)
    loops = {(s.q_in_registers, s.overlap, s.pingpong, s.stages) for s in specs}
    assert loops == {(False, False, False, 2), (True, False, False, 2), (False, False, True, 2),
                     (False, True, False, 3), (True, True, False, 3),
                     (False, True, True, 3)}  # fmt: skip
    kernel_layout = [f for f in fp8_candidates() if f.get("fp8_v_layout") == "kernel"]
    assert [candidate_label(f) for f in kernel_layout] == ["fp8-m128n128s2-vk", "fp8-m128n64s2-vk"]
    assert [candidate_label(f) for f in fp8_candidates()[:2]] == [
        "fp8-m128n128s2", "fp8-m128n128s2-qr"
    ]  # fmt: skip
    calls = []
    env = types.SimpleNamespace(
        kernelgen=types.SimpleNamespace(attention=lambda *a, **kw: calls.append((a, kw)) or "out"),
        stream=contextlib.nullcontext,
        kg_module=None,
    )
    q, k, v = object(), object(), object()
    quantized = {id(q): ("q8", "k8", "v8")}
    impl = gpu.kernelgen_fp8_impl(env, FP8_PEER, specs[0], True, quantized)
    assert impl.tolerance == 2.0**-4 and impl.spec_uri == specs[0].uri
    assert impl.call(q, k, v) == "out"
    assert calls == [(("q8", "k8", "v8"), {"causal": True, "spec": specs[0]})]
