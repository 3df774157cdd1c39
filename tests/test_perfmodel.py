"""The static performance model (kernelgen.model.perfmodel): its arithmetic on hand-made figures,
and its SASS counts against what the tiling alone says every tensor-core spec must issue."""

from __future__ import annotations

import itertools
import json

import pytest
from conftest import SPEC_PATHS, require_toolchain

from kernelgen.errors import SettingError
from kernelgen.kernels.compile import compile_offline, cuobjdump_path, nvrtc_available
from kernelgen.kernels.render import WGMMA_OPERAND, render
from kernelgen.model.perfmodel import (
    FA2_D128,
    WGMMA_RATE,
    UnitFigures,
    analytic_cost,
    analytic_figures,
    interior_loop,
    interior_sass,
    loops_of,
    model_spec,
    predict,
    transposer_loop,
    unit_figures,
)
from kernelgen.model.policy import hopper_default_spec
from kernelgen.specs.forward import VARIANT_FLAGS, load_spec, spec_from_dict

# The prefill kernels: the decode tiles (1-2 warps, split-KV) copy K/V in inner loops whose
# repeats a loop-body count cannot see, so the model is for the prefill kernels.
TC_SPECS = [p for p in SPEC_PATHS if load_spec(p).mma == "mma_sync" and not load_spec(p).split_kv]


def tc_spec(**fields):
    base = {"loop_order": "v2", "mma": "mma_sync", "dtype": "bfloat16", "head_dim": 128}
    return spec_from_dict({**base, "num_warps": 4, "stages": 2, **fields})


def test_fa2_reference_is_bound_by_the_tensor_cores_on_a100_and_ties_shared_memory_on_h100():
    a100, h100 = predict(FA2_D128, "sm_80"), predict(FA2_D128, "sm_90")
    # 512 HMMA at 0.5 per clock; 96 KiB at 128 B per clock; 1866 instructions at 4 per clock
    assert a100.clocks == pytest.approx(
        {"issue": 466.5, "shared memory": 768, "tensor": 1024, "MUFU": 272}
    )
    assert a100.limiter == "tensor" and a100.fraction_of_peak == 1.0
    assert h100.clocks["tensor"] == pytest.approx(768) and h100.cost == pytest.approx(768)


def test_the_binding_resource_sets_the_fraction_of_peak():
    figures = UnitFigures(6000, {"HMMA": 512, "MUFU": 100}, 64 * 1024)
    prediction = predict(figures, "sm_80")
    assert prediction.limiter == "issue" and prediction.cost == 1500
    assert prediction.fraction_of_peak == pytest.approx(1024 / 1500)
    slow_memory = predict(UnitFigures(100, {"HMMA": 512}, 256 * 1024), "sm_80")
    assert slow_memory.limiter == "shared memory"
    assert slow_memory.fraction_of_peak == pytest.approx(1024 / 2048)
    with pytest.raises(SettingError, match="sm_70"):
        predict(figures, "sm_70")


@pytest.mark.parametrize(
    ("fields", "ldsm", "ldgsts", "kib"),
    [
        # 16 rows per warp: every warp re-reads K and V for 16 rows (FA2 figures' 1.8x traffic)
        ({"block_m": 64, "block_n": 64}, 288, 64, 176),
        # 32 rows per warp, 32-key tiles: Q re-read per 32 keys
        ({"block_m": 128, "block_n": 32}, 192, 32, 112),
        # head dim 64, 32 rows x 64 keys: half the k-steps of d128, so half the traffic
        ({"block_m": 128, "block_n": 64, "head_dim": 64}, 80, 16, 48),
        # 8 warps x 16 rows: the K/V tile is copied once for 128 rows, read by 8 warps
        ({"block_m": 128, "block_n": 64, "num_warps": 8}, 288, 32, 160),
    ],
)
def test_analytic_traffic_per_unit(fields, ldsm, ldgsts, kib):
    spec = tc_spec(**fields)
    figures = analytic_figures(spec)
    assert figures.count("LDSM") == pytest.approx(ldsm)
    assert figures.count("LDGSTS") == pytest.approx(ldgsts)
    assert figures.smem_bytes == pytest.approx(kib * 1024)
    assert figures.count("HMMA") == pytest.approx(512 * spec.head_dim / 128)


def test_analytic_cost_orders_tilings_by_their_shared_memory_traffic():
    wide = tc_spec(block_m=128, block_n=32)
    narrow = tc_spec(block_m=64, block_n=64)
    assert analytic_cost(wide, "sm_90") < analytic_cost(narrow, "sm_90")
    # On A100 the 32-row tiling reaches the tensor bound, which no tiling beats.
    assert analytic_cost(wide, "sm_80") == pytest.approx(1024)


@pytest.mark.compile
@pytest.mark.parametrize("path", TC_SPECS, ids=lambda p: p.stem)
def test_sass_loop_issues_what_the_tiling_requires(path):
    """The interior loop's HMMA, LDSM and MUFU per unit are exactly the tiling's (no extra or
    missing shared-memory reads, one exp2 per score and per row), and LDGSTS at least the
    bytes of the K and V tiles (head dims whose chunks do not divide the threads idle some
    lanes of a copy instruction)."""
    require_toolchain(nvrtc_available(), "NVRTC (cuda-bindings + nvidia-cuda-nvrtc wheels)")
    require_toolchain(cuobjdump_path() is not None, "cuobjdump + nvdisasm wheels")
    spec = load_spec(path)
    measured = unit_figures(interior_loop(spec, "sm_90"), spec)
    expected = analytic_figures(spec)
    for name in ("HMMA", "LDSM", "MUFU"):
        assert measured.count(name) == pytest.approx(expected.count(name)), name
    assert measured.count("LDGSTS") >= expected.count("LDGSTS") - 1e-9
    if (spec.threads // 32 * 32) % (spec.head_dim_padded // 8) == 0:
        assert measured.count("LDGSTS") == pytest.approx(expected.count("LDGSTS"))
    assert measured.instructions == pytest.approx(sum(measured.by_class.values()))


@pytest.mark.compile
def test_model_report_of_a_spec_is_complete_and_json_ready():
    require_toolchain(nvrtc_available(), "NVRTC (cuda-bindings + nvidia-cuda-nvrtc wheels)")
    require_toolchain(cuobjdump_path() is not None, "cuobjdump + nvdisasm wheels")
    report = model_spec(tc_spec(block_m=128, block_n=32), "sm_90")
    assert report.spill_bytes == 0 and report.blocks_per_sm >= 1
    assert report.unit.smem_bytes == pytest.approx(112 * 1024)
    assert report.prediction.limiter == "shared memory"
    assert report.vs_fa2 == pytest.approx(768 / 896)
    payload = json.loads(json.dumps(report.as_dict()))
    assert payload["prediction"]["limiter"] == "shared memory"
    assert "112 KiB shared memory" in report.summary()
    simt = spec_from_dict(
        {"loop_order": "v2", "dtype": "float32", "head_dim": 64, "block_m": 64, "block_n": 32}
    )
    with pytest.raises(SettingError, match="tensor-core specs only"):
        model_spec(simt, "sm_90")


# ---- where the model is used: the heuristic default and the autotuner's pruning ----


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_default_tiling_is_the_model_best_of_the_tilings_it_may_use(arch):
    from kernelgen.model.policy import default_spec

    for head_dim in (64, 80, 96, 128, 256):
        chosen = default_spec("bfloat16", head_dim, False, arch)
        for block_m, block_n in ((64, 64), (64, 32), (128, 32)):
            if head_dim > 128 and block_m == 128:
                continue  # 32 rows per warp: over the accumulator budget
            layout = "swizzled" if head_dim % 64 == 0 else "padded"
            other = tc_spec(head_dim=head_dim, block_m=block_m, block_n=block_n, smem_layout=layout)
            assert analytic_cost(chosen, arch) <= analytic_cost(other, arch), chosen.uri
    for arch_of_default in ("sm_80", "sm_90", None):
        widest = default_spec("bfloat16", 128, False, arch_of_default)
        # sm_90 takes the tiling an H100 measured fastest (4 warps, 128 x 48), the others the
        # model's (8 warps, 256 x 48); both 32 rows per warp, padded
        tiles = (128, 48, 4) if arch_of_default == "sm_90" else (256, 48, 8)
        assert (widest.block_m, widest.block_n, widest.num_warps) == tiles
        assert widest.smem_layout == "padded"  # the swizzle's offsets cost registers there
        if arch_of_default != "sm_90":
            # FlashAttention 2's ceiling (96 KiB per unit) or better on every arch modelled
            for model_arch in ("sm_80", "sm_90"):
                assert analytic_figures(widest).smem_bytes <= 96 * 1024
                assert analytic_cost(widest, model_arch) <= predict(FA2_D128, model_arch).cost
        rich = default_spec("bfloat16", 128, False, arch_of_default, variants=("softcap",))
        assert (rich.block_m, rich.block_n, rich.num_warps) == (128, 32, 4)
        with_expressions = default_spec("float16", 128, True, arch_of_default, expressions=True)
        assert (with_expressions.rows_per_warp, with_expressions.block_n) == (32, 32)
        assert default_spec("float16", 96, True, arch_of_default).block_n == 64
        assert default_spec("float16", 120, True, arch_of_default).block_m == tiles[0]
        # 16 rows per warp above 128 (accumulators), 8 warps, 48 keys
        for head_dim in (136, 232, 256):
            large = default_spec("bfloat16", head_dim, False, arch_of_default)
            assert (large.rows_per_warp, large.num_warps, large.block_n) == (16, 8, 48)
    # an arch without a table: 4 warps of 16 rows
    assert default_spec("bfloat16", 128, False, "sm_86").block_m == 64
    assert default_spec("bfloat16", 64, False, None).archs == ("sm_80", "sm_90")


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_wide_default_tiles_compile_without_spills_across_their_head_dim_range(arch):
    """Samples of each WIDE_TILES range (its ends and an odd head dim), fp16 without the causal
    mask and bf16 with it (the two dtypes' kernels differ only in conversions); the ends of the
    RICH_WIDE_TILES ranges with every built-in variant, and of the MASKED_WIDE_TILES ranges; the
    head dims above them (LARGE_HEAD_TILING) plain, with every variant and with a mask: the
    untuned default must never be a spilling kernel."""
    from kernelgen.kernels.build import static_problems
    from kernelgen.model.policy import MASKED_WIDE_TILES, RICH_WIDE_TILES, WIDE_TILES, default_spec

    require_toolchain(nvrtc_available(), "NVRTC (cuda-bindings + nvidia-cuda-nvrtc wheels)")
    limits = [limit for limit, _ in WIDE_TILES[arch]]
    head_dims = sorted({8, 40, *limits, *(limit - 8 for limit in limits)})
    plain = {"variants": (), "additive_mask": False}
    every_variant = {"variants": VARIANT_FLAGS, "additive_mask": False}
    masked = {"variants": (), "additive_mask": True}
    samples = [
        (head_dim, dtype, causal, plain)
        for head_dim in head_dims
        for dtype, causal in (("float16", False), ("bfloat16", True))
    ]
    rich_limits = [limit for limit, _ in RICH_WIDE_TILES[arch]]
    samples += itertools.product(rich_limits, ["bfloat16"], (False, True), [every_variant])
    masked_limits = [limit for limit, _ in MASKED_WIDE_TILES[arch]]
    samples += itertools.product(masked_limits, ["bfloat16"], (False, True), [masked])
    large = list(itertools.product((136, 256), ["float16"], [True], [plain, every_variant, masked]))
    for head_dim, dtype, causal, options in [*samples, *large]:
        spec = default_spec(dtype, head_dim, causal, arch, **options)
        assert spec.rows_per_warp == (32 if head_dim <= max(limits) else 16), spec.uri
        res = compile_offline(render(spec), spec.uri, arch, sass=False).resources
        assert not static_problems(spec, res), (spec.uri, static_problems(spec, res))


def test_autotuner_times_the_model_best_prefill_candidates_and_keeps_the_others():
    from kernelgen.tuning.candidates import Candidate, prune_by_model

    tilings = [(64, 32), (64, 64), (128, 32), (64, 128)]
    prefill = [Candidate(tc_spec(block_m=m, block_n=n)) for m, n in tilings]
    fallback = Candidate(
        spec_from_dict(
            {"loop_order": "v2", "dtype": "bfloat16", "head_dim": 128, "block_m": 64,
             "block_n": 32}
        )
    )  # fmt: skip
    kept, dropped = prune_by_model([*prefill, fallback], "sm_90", top_k=2)
    costs = sorted(analytic_cost(c.spec, "sm_90") for c in prefill)
    assert [analytic_cost(c.spec, "sm_90") for c in kept[:2]] == costs[:2]
    assert kept[0].spec.block_m == 128  # 32 rows per warp: the least shared-memory traffic
    assert kept[2] is fallback  # CUDA-core fallbacks are not the model's to cut
    assert len(dropped) == 2 and all(d.stage == "model" for d in dropped)
    assert all("> top 2" in d.reason for d in dropped)


def test_model_command_refuses_bad_input_in_one_line():
    from typer.testing import CliRunner

    from kernelgen.cli import app

    runner = CliRunner()
    bad_arch = runner.invoke(app, ["model", str(TC_SPECS[0]), "--arch", "sm_99"])
    assert bad_arch.exit_code == 2 and "--arch sm_99: unknown architecture" in bad_arch.output
    missing = runner.invoke(app, ["model", "no/such/spec.yaml"])
    assert missing.exit_code == 2 and "Traceback" not in missing.output


@pytest.mark.compile
def test_model_command_prints_json_per_spec_and_arch():
    from typer.testing import CliRunner

    from kernelgen.cli import app

    require_toolchain(nvrtc_available(), "NVRTC (cuda-bindings + nvidia-cuda-nvrtc wheels)")
    require_toolchain(cuobjdump_path() is not None, "cuobjdump + nvdisasm wheels")
    path = next(p for p in TC_SPECS if "d64_m64_n64" in p.stem)
    result = CliRunner().invoke(app, ["model", str(path), "--arch", "sm_80", "sm_90", "--json"])
    assert result.exit_code == 0, result.output
    reports = json.loads(result.stdout)
    assert [r["arch"] for r in reports] == ["sm_80", "sm_90"]
    assert all(r["unit"]["by_class"]["HMMA"] == 256 for r in reports)  # d64: half of 512


# ---- the Hopper (wgmma) kernels ----
WGMMA_SPECS = [p for p in SPEC_PATHS if load_spec(p).mma == "wgmma"]


@pytest.mark.compile
@pytest.mark.parametrize("path", WGMMA_SPECS, ids=lambda p: p.stem)
def test_wgmma_loop_issues_what_the_tiling_requires(path):
    """The consumers' interior loop issues exactly the tiling's HGMMA and exp2 and reads exactly
    its operands from shared memory (Q, K and V once per warpgroup and tile, P from registers),
    the TMA producer's loop adds the K/V tile writes (and with fp8's V transposed in the kernel,
    the transposing warps' reads and writes); no LDSM, no cp.async, no inner loop but the
    mbarrier waits' retries, and the products account for a unit's multiply-adds."""
    require_toolchain(nvrtc_available(), "NVRTC (cuda-bindings + nvidia-cuda-nvrtc wheels)")
    require_toolchain(cuobjdump_path() is not None, "cuobjdump + nvdisasm wheels")
    spec = load_spec(path)
    sass = interior_sass(spec, "sm_90a")
    consumer, producer = loops_of(spec, sass)
    transposer = transposer_loop(sass) if spec.v_transposed_in_kernel else None
    # backward branches inside the body can only be the retry loops of its mbarrier waits (K
    # and V of each tile: one pass once the tile has landed)
    k = WGMMA_OPERAND[spec.dtype].k  # 16, or 32 for fp8
    tiles = len(consumer.hgmma) / ((spec.head_dim_padded + spec.block_n) // k)
    assert consumer.inner_loops <= 2 * tiles and producer is not None
    measured = unit_figures(consumer, spec, producer, transposer)
    expected = analytic_figures(spec)
    for name in ("HGMMA", "MUFU", "LDSM", "LDGSTS"):
        assert measured.count(name) == pytest.approx(expected.count(name)), name
    assert measured.smem_bytes == pytest.approx(expected.smem_bytes)
    macs = 2 * 64 * 64 * spec.head_dim_padded / WGMMA_RATE.get(spec.dtype, 1)  # 16-bit-equivalent
    assert measured.wgmma_macs == pytest.approx(macs)
    assert measured.count("UTMALDG") > 0


@pytest.mark.compile
@pytest.mark.parametrize("mma", ["wgmma", "mma_sync"])
def test_a_split_kv_spec_is_modelled_on_its_main_kernel(mma):
    """A split-KV cubin also holds the combine kernel, whose SASS addresses start at 0 again:
    the model reads the main kernel alone, so the key-tile loop of a split spec is its unsplit
    twin's (the split changes the tile range and the epilogue only)."""
    require_toolchain(nvrtc_available(), "NVRTC (cuda-bindings + nvidia-cuda-nvrtc wheels)")
    require_toolchain(cuobjdump_path() is not None, "cuobjdump + nvdisasm wheels")
    fields = {"loop_order": "v2", "dtype": "bfloat16", "head_dim": 128, "mma": mma}
    if mma == "wgmma":
        fields |= {"block_m": 64, "block_n": 128, "pack_gqa": True}
        arch = "sm_90a"
    else:
        fields |= {"block_m": 16, "block_n": 64, "num_warps": 1, "smem_layout": "swizzled"}
        arch = "sm_90"
    split = model_spec(spec_from_dict({**fields, "split_kv": True}), arch).unit
    plain = model_spec(spec_from_dict(fields), arch).unit
    assert split.count("HGMMA" if mma == "wgmma" else "HMMA") == plain.count(
        "HGMMA" if mma == "wgmma" else "HMMA"
    )
    assert split.count("MUFU") == plain.count("MUFU")
    assert abs(split.instructions - plain.instructions) <= 0.02 * plain.instructions


@pytest.mark.compile
def test_wgmma_d128_bf16_default_meets_the_hopper_targets():
    """The untuned default at head dim 128, bf16, sm_90a (policy.hopper_default_spec: 128-key
    tiles, Q in registers without causality), per 64 x 64 unit of the steady state: no LDSM, at
    most 48 KiB of shared-memory traffic and 820 instructions over all warps (producer
    included), no spill or stack, products not serialized and Q K^T issued back to back (the
    schedule check); the tensor cores bind. Its twin with Q from shared memory
    (specs/v2_wg_bf16_d128_m128_n128_s2.yaml), still the causal default (docs/hopper.md), meets
    the same at 56 KiB."""
    require_toolchain(nvrtc_available(), "NVRTC (cuda-bindings + nvidia-cuda-nvrtc wheels)")
    require_toolchain(cuobjdump_path() is not None, "cuobjdump + nvdisasm wheels")
    spec = hopper_default_spec("bfloat16", 128, causal=False)
    assert spec is not None and spec.q_in_registers and spec.block_n == 128
    causal = hopper_default_spec("bfloat16", 128, causal=True)
    assert causal is not None and not causal.q_in_registers and causal.block_n == 128
    twin = load_spec(next(p for p in WGMMA_SPECS if p.stem == "v2_wg_bf16_d128_m128_n128_s2"))
    assert (
        not twin.q_in_registers
        and twin.canonical_json()
        == spec.model_copy(update={"q_in_registers": False}).canonical_json()
    )
    for candidate, traffic in ((spec, 48), (twin, 56)):
        report = model_spec(candidate, "sm_90a")
        assert report.unit.count("LDSM") == 0
        assert report.unit.smem_bytes <= traffic * 1024
        assert report.unit.instructions <= 820
        assert report.spill_bytes == report.stack_bytes == 0
        assert report.schedule is None
        assert report.prediction.limiter == "tensor"
        assert report.prediction.clocks["tensor"] == pytest.approx(512)  # 2048 MACs/clock
        assert "of the wgmma peak" in report.summary()


@pytest.mark.compile
def test_wgmma_d128_fp8_figures_next_to_bf16s():
    """The fp8 (e4m3) forward at d128 (docs/hopper.md, "fp8"), per 64 x 64 unit: half the
    products of the bf16 kernel (k32) and half its shared-memory traffic (1-byte operands), at
    most 760 instructions (744 measured; bf16 with Q from shared memory, the same loop: 803),
    no spill or stack; the exponentials bind once the products take half the time."""
    require_toolchain(nvrtc_available(), "NVRTC (cuda-bindings + nvidia-cuda-nvrtc wheels)")
    require_toolchain(cuobjdump_path() is not None, "cuobjdump + nvdisasm wheels")
    fp8, bf16 = (
        model_spec(load_spec(next(p for p in WGMMA_SPECS if p.stem == stem)), "sm_90a")
        for stem in ("v2_wg_e4m3_d128_m128_n128_s2", "v2_wg_bf16_d128_m128_n128_s2")
    )
    assert fp8.unit.count("HGMMA") * 2 == bf16.unit.count("HGMMA") == 32
    assert fp8.unit.smem_bytes * 2 == bf16.unit.smem_bytes == 56 * 1024
    assert fp8.unit.instructions <= 760
    assert fp8.spill_bytes == fp8.stack_bytes == 0
    assert fp8.prediction.clocks["tensor"] == pytest.approx(256)  # fp8: 4096 multiply-adds/clock
    assert fp8.prediction.limiter == "MUFU"


@pytest.mark.compile
@pytest.mark.parametrize(
    ("stem", "traffic_kib", "most"),
    [
        ("v2_wg_e4m3_d128_m128_n128_s2_qr", 24, 770),  # 760 measured
        ("v2_wg_e4m3_d128_m128_n128_s3_ovl", 28, 765),  # 755
        ("v2_wg_e4m3_d128_m128_n128_s3_ovl_qr", 24, 775),  # 763
    ],
)
def test_wgmma_d128_fp8_loops_figures(stem, traffic_kib, most):
    """The fp8 forward's other loops at d128 (docs/hopper.md, "fp8"), per 64 x 64 unit: Q in
    registers saves Q's 4 KiB of operand reads per unit (28 -> 24 KiB), the overlap costs a
    few instructions and passes the schedule check; 16 QGMMA, no spill or stack, and ptxas
    keeps the products pipelined (Q in registers with the overlap fits fp8's registers)."""
    require_toolchain(nvrtc_available(), "NVRTC (cuda-bindings + nvidia-cuda-nvrtc wheels)")
    require_toolchain(cuobjdump_path() is not None, "cuobjdump + nvdisasm wheels")
    report = model_spec(load_spec(next(p for p in WGMMA_SPECS if p.stem == stem)), "sm_90a")
    assert report.unit.count("HGMMA") == 16
    assert report.unit.smem_bytes == traffic_kib * 1024
    assert report.unit.instructions <= most
    assert report.spill_bytes == report.stack_bytes == 0
    assert report.schedule is None
    assert report.prediction.limiter == "MUFU"


@pytest.mark.compile
def test_wgmma_d128_bf16_overlap_at_128_keys_is_pipelined_in_at_most_820_instructions():
    """The overlapped loop at 128-key tiles (one P buffer): at most 820 instructions per unit,
    no spill, and the schedule check passes (the softmax runs under the P V product)."""
    require_toolchain(nvrtc_available(), "NVRTC (cuda-bindings + nvidia-cuda-nvrtc wheels)")
    require_toolchain(cuobjdump_path() is not None, "cuobjdump + nvdisasm wheels")
    spec = load_spec(next(p for p in WGMMA_SPECS if p.stem == "v2_wg_bf16_d128_m128_n128_s3_ovl"))
    report = model_spec(spec, "sm_90a")
    assert report.unit.instructions <= 820
    assert report.unit.smem_bytes == 56 * 1024  # Q is re-read per tile
    assert report.spill_bytes == report.stack_bytes == 0
    assert report.schedule is None


def test_wgmma_analytic_traffic_and_cost():
    """d128, 128 x 128 tiles: the warpgroups read Q, K, V (16 + 32 + 32 KiB per 64 x 128
    tile, i.e. 40 KiB per unit) and TMA writes K and V (64 KiB per 128 x 128 block tile: 16 KiB
    per unit); the cost on a 9.0 device is the wgmma peak's 512 clocks."""
    spec = spec_from_dict(
        {"loop_order": "v2", "mma": "wgmma", "dtype": "bfloat16", "head_dim": 128}
        | {"block_m": 128, "block_n": 128}
    )
    figures = analytic_figures(spec)
    assert figures.smem_bytes == 56 * 1024
    assert figures.count("HGMMA") == 32 and figures.count("LDSM") == 0
    assert analytic_cost(spec, "sm_90") == pytest.approx(512)
    with pytest.raises(SettingError, match="no wgmma"):
        predict(figures, "sm_90")
