"""The static model's shape terms (kernelgen.model.perfmodel_shape): grid fill, latency and traffic
on shapes whose figures are worked out by hand, their errors, ``kernelgen model --shape``, and how
they rank the committed H100 measurements (bench.model_terms)."""

from __future__ import annotations

import json
import math

import pytest
from conftest import ROOT, require_toolchain

from kernelgen.errors import InputError, SettingError
from kernelgen.kernels.compile import cuobjdump_path, nvrtc_available
from kernelgen.model.perfmodel import Prediction
from kernelgen.model.perfmodel_shape import (
    ProblemShape,
    analytic_estimate,
    block_key_tiles,
    estimate,
    grid_fill,
    latency_clocks,
    traffic,
)
from kernelgen.specs.forward import spec_from_dict

H100_SMS, H100_CLOCK = 132, 1.98e9


def wgmma(**fields):
    base = {"loop_order": "v2", "mma": "wgmma", "dtype": "bfloat16", "head_dim": 128}
    return spec_from_dict({**base, "block_m": 128, "block_n": 128, **fields})


def mma_sync(**fields):
    base = {"loop_order": "v2", "mma": "mma_sync", "dtype": "bfloat16", "head_dim": 128}
    return spec_from_dict({**base, "block_m": 128, "block_n": 32, "num_warps": 4, **fields})


def shape(batch=4, heads=16, seqlen_q=4096, seqlen_k=4096, kv_heads=None):
    return ProblemShape(batch, heads, seqlen_q, seqlen_k, heads if kv_heads is None else kv_heads)


# A per-unit prediction as the SASS would give it (d128 wgmma, 128 x 128: tensor-bound).
D128 = Prediction({"issue": 200, "shared memory": 448, "tensor": 512, "MUFU": 264}, "tensor", 1.0)


# ---- grid fill --------------------------------------------------------------------------------
def test_grid_fill_of_a_uniform_grid_is_waves_over_ideal_waves():
    """4 x 16 heads x 32 row tiles = 2048 blocks on 132 slots: 16 waves for 15.52 ideal."""
    fill = grid_fill(wgmma(), shape(), "sm_90a", resident=1)
    assert (fill.blocks, fill.slots, fill.waves) == (2048, 132, 16)
    assert fill.ideal_waves == pytest.approx(2048 / 132)
    assert fill.fill == pytest.approx(16 / (2048 / 132))  # 1.03125
    # 2 resident blocks: 264 slots, 8 waves for 7.76; a small problem fills half a wave
    two = grid_fill(wgmma(), shape(), "sm_90a", resident=2)
    assert (two.slots, two.waves, two.fill) == (264, 8, pytest.approx(8 / (2048 / 264)))
    small = grid_fill(wgmma(), shape(batch=1, heads=8, seqlen_q=1024), "sm_90a", resident=1)
    assert (small.blocks, small.waves) == (64, 1)
    assert small.fill == pytest.approx(132 / 64)
    # the A100 has 108 SMs: 2048 blocks are 19 waves there (18.96 ideal)
    a100 = grid_fill(mma_sync(), shape(), "sm_80", resident=1)
    assert (a100.slots, a100.waves, a100.fill) == (108, 19, pytest.approx(19 / (2048 / 108)))


def test_causal_blocks_walk_their_visible_tiles_longest_first():
    """Causal, aligned bottom right: 512 queries x 512 keys in 128 x 64 tiles, row tile r sees
    keys up to 128 (r + 1): 2, 4, 6, 8 tiles, launched longest first; 256 queries over 512 keys
    see 256 more keys each: 6 and 8 tiles. Without causal every tile."""
    causal = wgmma(block_n=64, causal=True)
    assert block_key_tiles(causal, shape(1, 1, 512, 512)) == [8, 6, 4, 2]
    assert block_key_tiles(causal, shape(1, 1, 256, 512)) == [8, 6]
    assert block_key_tiles(wgmma(block_n=64), shape(1, 1, 300, 500)) == [8, 8, 8]  # 500 / 64
    # more queries than keys: the first 256 rows see none (their tile walks 0 tiles)
    assert block_key_tiles(causal, shape(1, 1, 512, 256)) == [4, 2, 0, 0]
    # pack_gqa: a block's rows are (query, head) pairs, query-major: 4 heads per kv head, 64
    # queries -> 256 rows; rows 0-127 are queries 0-31 (32 keys: 1 tile of 32), 128-255 2 tiles
    packed = mma_sync(pack_gqa=True, causal=True)
    assert block_key_tiles(packed, shape(1, 8, 64, 64, kv_heads=2)) == [2, 1]
    assert grid_fill(packed, shape(1, 8, 64, 64, kv_heads=2), "sm_90", 1).blocks == 4


def test_causal_fill_is_the_makespan_of_blocks_in_launch_order():
    """Causal 256 x 256 in 128 x 128 tiles: each head launches a 2-tile then a 1-tile block.
    66 heads on 132 slots: every block has its own slot, the 2-tile ones end last: makespan 2
    against 198 tiles / 132 slots = 1.5. 132 heads: the second half of the blocks goes to the
    slots that free first (the 66 that ran a 1-tile block, at 1, then those free at 2), and the
    last ones end at 4 against 396 / 132 = 3."""
    causal = wgmma(causal=True)
    half = grid_fill(causal, shape(1, 66, 256, 256), "sm_90a", resident=1)
    assert (half.blocks, half.waves, half.fill) == (132, 1, pytest.approx(2 / 1.5))
    full = grid_fill(causal, shape(1, 132, 256, 256), "sm_90a", resident=1)
    assert (full.blocks, full.waves, full.fill) == (264, 2, pytest.approx(4 / 3))


# ---- latency ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "resident", "expected"),
    [
        # one consumer warpgroup (block_m 64), 1 block: W = 1, the whole chain 512 + 264
        (wgmma(block_m=64), 1, 776),
        # two consumer warpgroups (block_m 128, with or without ping-pong): W = 2
        (wgmma(), 1, 388),
        (wgmma(pingpong=True), 1, 388),
        # the overlap is not credited: the same chain as without it
        (wgmma(block_m=64, overlap=True), 1, 776),
        # mma.sync: every warp computes; 4 warps x 2 blocks over 4 schedulers: W = 2
        (mma_sync(), 2, 388),
        (mma_sync(block_m=256, num_warps=8), 1, 388),
        (mma_sync(block_m=64), 1, 776),
    ],
)
def test_latency_is_the_warps_chain_over_the_warps_that_hide_it(spec, resident, expected):
    assert latency_clocks(D128, spec, resident) == pytest.approx(expected)


def test_latency_takes_the_larger_of_issue_and_mufu():
    issue_bound = Prediction({"issue": 400, "shared memory": 0, "tensor": 512, "MUFU": 264}, "", 1)
    assert latency_clocks(issue_bound, wgmma(block_m=64), 1) == pytest.approx(912)


# ---- traffic and the estimate ------------------------------------------------------------------
def test_traffic_by_hand():
    """MQA, 1 x 2 heads x 256 queries, 512 keys, d64 bf16, 128 x 32 tiles: HBM moves Q (64 KiB),
    K and V of the one kv head (128 KiB), O (64 KiB) and the LSE (2 KiB); L2 serves Q once and
    2 heads x 2 blocks x 16 tiles of K and V (8 KiB each)."""
    spec = mma_sync(head_dim=64)
    moved = traffic(spec, shape(1, 2, 256, 512, kv_heads=1))
    assert moved.hbm_bytes == 65536 + 131072 + 65536 + 2048
    assert moved.l2_bytes == 65536 + 2 * 2 * 16 * 8192
    # fp8: 1-byte Q/K/V, a bf16 output
    fp8 = traffic(wgmma(dtype="float8_e4m3"), shape(1, 1, 128, 128))
    assert fp8.hbm_bytes == 128 * 128 + 2 * 128 * 128 + 2 * 128 * 128 + 4 * 128


def test_estimate_prices_fill_latency_and_hbm_and_reports_l2():
    """d128 wgmma, 4 x 16 x 4096 x 4096: 2048 blocks x 32 tiles x 4 units = 262144 units; one
    consumer warpgroup (block_m 64: 4096 blocks, 32 waves for 31.03) is priced at its latency
    776 clocks per unit, two at the cost 512."""
    units = 2048 * 32 * 4
    two = estimate(wgmma(), D128, "sm_90a", 1, shape())
    assert two.units == units and two.unit_clocks == 512
    steady = units * 512 / H100_SMS / H100_CLOCK
    assert two.steady_s == pytest.approx(steady)
    assert two.compute_s == pytest.approx(steady * 16 / (2048 / 132))
    assert two.time_s == two.compute_s and two.limiter == "compute"
    one = estimate(wgmma(block_m=64), D128, "sm_90a", 1, shape())
    assert one.grid.waves == 32 and one.unit_clocks == 776
    assert one.compute_s == pytest.approx(steady * 776 / 512 * 32 / (4096 / 132))
    plain = estimate(wgmma(block_m=64), D128, "sm_90a", 1, shape(), latency=False)
    assert plain.unit_clocks == 512 and plain.latency_clocks == 776
    # HBM: Q, K, V, O of 64 heads x 4096 x 128 bf16 (64 MiB each) and the LSE; at 3.35 TB/s
    hbm = 4 * (64 * 4096 * 128 * 2) + 64 * 4096 * 4
    assert two.hbm_bytes == hbm and two.hbm_s == pytest.approx(hbm / 3.35e12)
    # L2: Q once, and each of the 2048 blocks 32 K and V tiles of 64 KiB; 5120 B per clock
    l2 = 64 * 4096 * 128 * 2 + 2048 * 32 * 65536
    assert two.l2_bytes == l2 and two.l2_s == pytest.approx(l2 / (5120 * H100_CLOCK))
    assert not two.l2 and two.l2_s < two.time_s  # reported, not priced by default
    priced = estimate(wgmma(block_m=64), D128, "sm_90a", 1, shape(), latency=False, l2=True)
    assert priced.limiter == "L2" and priced.time_s == priced.l2_s


def test_the_tiling_only_estimate_uses_the_analytic_figures():
    """d128 wgmma 128 x 128 from the tiling alone: tensor 512 clocks per unit, MUFU (16 rows x
    128 keys / 32 + 2 per warp and tile, 2 tiles per unit: 132) 264, issue not counted; 1 block
    per SM (shared memory): latency (512 + 264) / 2, the same time as the SASS figures give."""
    found = analytic_estimate(wgmma(), "sm_90a", shape())
    assert (found.cost_clocks, found.latency_clocks, found.grid.resident) == (512, 388, 1)
    assert found.time_s == pytest.approx(estimate(wgmma(), D128, "sm_90a", 1, shape()).time_s)


def test_a_short_decode_call_is_bound_by_hbm():
    """One query per head over 32k keys: 64 blocks of one wave, a few units, and 2 x 64 heads x
    32k keys x 256 bytes of K/V to read: HBM binds."""
    found = estimate(wgmma(block_m=64), D128, "sm_90a", 1, shape(1, 64, 1, 32768))
    assert found.limiter == "HBM"
    kv = 2 * 64 * 32768 * 128 * 2
    assert found.hbm_bytes == kv + 64 * 128 * 2 * 2 + 64 * 4
    assert found.time_s == pytest.approx(found.hbm_bytes / 3.35e12)


# ---- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 16, 4096, 4096, 16), "batch=0"),
        ((1, 16, -1, 4096, 16), "seqlen_q=-1"),
        ((1, 16, 4096, 4096.0, 16), "seqlen_k=4096.0"),
        ((1, 16, 4096, 4096, True), "kv_heads=True"),
        ((1, 16, 4096, 4096, 3), "kv_heads=3: must divide heads=16"),
    ],
)
def test_a_bad_shape_names_the_argument(args, message):
    with pytest.raises(InputError, match=message):
        ProblemShape(*args)


def test_parse_and_its_errors():
    assert ProblemShape.parse("4,16,4096,2048") == ProblemShape(4, 16, 4096, 2048, 16)
    assert ProblemShape.parse("4,16,4096,2048,2").kv_heads == 2
    for bad in ("4,16,4096", "4x16x4096x4096", "4,16,-1,8", "a,b,c,d"):
        with pytest.raises(InputError, match="BATCH,HEADS,SEQLEN_Q,SEQLEN_K"):
            ProblemShape.parse(bad)


def test_unmodelled_archs_and_grids_are_refused():
    with pytest.raises(SettingError, match=r"arch='sm_86'.*known for sm_80, sm_90, sm_90a"):
        estimate(mma_sync(), D128, "sm_86", 1, shape())
    split = mma_sync(split_kv=True)
    with pytest.raises(SettingError, match="not split_kv"):
        estimate(split, D128, "sm_90", 1, shape())
    with pytest.raises(InputError, match="resident=0"):
        grid_fill(mma_sync(), shape(), "sm_90", 0)


# ---- kernelgen model --shape ------------------------------------------------------------------
def test_model_command_refuses_a_bad_shape_in_one_line():
    from typer.testing import CliRunner

    from kernelgen.cli import app

    spec = ROOT / "specs" / "v2_wg_bf16_d64_m128_n128_s3.yaml"
    result = CliRunner().invoke(app, ["model", str(spec), "--shape", "4,16"])
    assert result.exit_code == 2 and "shape='4,16': expected BATCH,HEADS" in result.output
    assert "Traceback" not in result.output


@pytest.mark.compile
def test_model_command_prints_the_shape_terms():
    from typer.testing import CliRunner

    from kernelgen.cli import app

    require_toolchain(nvrtc_available(), "NVRTC (cuda-bindings + nvidia-cuda-nvrtc wheels)")
    require_toolchain(cuobjdump_path() is not None, "cuobjdump + nvdisasm wheels")
    spec = ROOT / "specs" / "v2_wg_bf16_d128_m128_n128_s2.yaml"
    args = ["model", str(spec), "--arch", "sm_90a", "--shape", "4,16,4096,4096"]
    text = CliRunner().invoke(app, args)
    assert text.exit_code == 0, text.output
    assert "shape 4x16x4096x4096: 2048 blocks, 1/SM, 16 waves (15.52 ideal, fill 1.031)" in (
        text.stdout
    )
    assert "latency 388 clk/unit (priced)" in text.stdout
    assert "HBM 269.5 MB 80.4 us" in text.stdout and "(not priced)" in text.stdout
    (report,) = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert report["shape"]["grid"]["waves"] == 16
    assert report["shape"]["limiter"] == "compute"
    assert report["prediction"]["limiter"] == "tensor"  # the per-unit keys are unchanged
    units = 2048 * 32 * 4
    cost = report["prediction"]["clocks"]["tensor"]
    assert math.isclose(report["shape"]["steady_s"], units * cost / H100_SMS / H100_CLOCK)


# ---- against the committed measurements --------------------------------------------------------
def test_the_default_terms_rank_the_committed_wgmma_rows_better_than_the_per_unit_model():
    """bench.model_terms on the committed H100 runs: the latency term lifts the wgmma rows'
    median rho (0.80 -> 0.87 over run 4-6's 491 specs, 0.80 -> 0.85 with run 8's, 604) and the
    default terms keep it (0.86); L2 on top adds less than 0.01 (0.857 against 0.855 with run
    8; below the default before it), which does not earn it a place in the default."""
    from bench import calibration, model_terms

    calibrated = calibration.calibrate(calibration.all_measured(), calibration.load_models())
    priced, skipped = model_terms.price(calibrated)
    assert len(priced) == 604 and not skipped
    fits = {f.name: f.row_medians["kg-wgmma"][1] for f in model_terms.term_fits(priced)}
    before = fits["per-unit model (before)"]
    assert fits["+ latency"] >= before + 0.04
    assert fits["default: fill, latency, HBM"] >= before + 0.05
    assert fits["default + L2"] < fits["default: fill, latency, HBM"] + 0.01
