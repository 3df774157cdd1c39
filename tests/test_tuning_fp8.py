"""CPU tier: tuning fp8 (e4m3) problems: their keys (others' unchanged), the fp8 loops as
candidates, records written and reused, the fallback to the default spec, the fp8 call's spec
choice on the fakes of torch and CuPy, typed errors; and (emulation tier) the fp8 bench's
inputs, launches and check on CPU torch tensors, run by the emulator."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re

import pytest
from conftest import install_fake_libraries
from test_tuning_backward import numpy_cupy
from test_tuning_fakes import DEVICE, SOFTWARE, FakeBench, fake_compile, problem, stable_ms

import kernelgen
from kernelgen.errors import InputError
from kernelgen.model.policy import fp8_default_spec
from kernelgen.runtime.launch import clear_kernel_cache
from kernelgen.specs.forward import load_spec
from kernelgen.testing import fake_cupy, fake_torch
from kernelgen.tuning import (
    DeviceInfo,
    ProblemDesc,
    TuningDB,
    TuningKey,
    TuningMissError,
    clear_memo,
    heuristic_spec,
    make_key,
    prune,
    select_launch,
    tune_problem,
)
from kernelgen.tuning import fp8_bench as fp8_bench_module
from kernelgen.tuning.candidates import valid_candidates
from kernelgen.tuning.key import key_problems
from kernelgen.tuning.measure import MeasureSettings

AUTOTUNE = importlib.import_module("kernelgen.tuning.autotune")
ROOT_SPECS = "specs/v2_wg_e4m3_d128_m128_n128_{}.yaml"
# the fp8 grid, in its order: the host V^T layout's loops, then the plain loop transposing V
LOOPS = ("s2", "s2_qr", "s3_ovl", "s3_ovl_qr", "s2_pp", "s2_tma", "s2_vk")
FAST = MeasureSettings(budget_ms=1.0, retime_top=3, retime_budget_ms=1.0, screen_budget_ms=0.5)


@pytest.fixture(autouse=True)
def isolated(tuning_sandbox):
    """Every test gets its own tuning cache and memo (conftest)."""


def fp8_problem(**overrides: object) -> ProblemDesc:
    """A GQA (16 query heads, 8 K/V heads) fp8 problem of 2 x 1024 x 1024 at head dim 128."""
    return problem(**{"dtype": "float8_e4m3", "num_kv_heads": 8, **overrides})


def loop_uris(causal: bool) -> list[str]:
    """The d128 candidates: every loop at 128-key tiles, then at 64-key tiles."""
    return [f"fa_fwd_v2_wg_e4m3_d128_m128_n{n}_w12_{loop}" + ("_causal" if causal else "")
            for n in (128, 64) for loop in LOOPS]  # fmt: skip


def ranked_uris(causal: bool) -> list[str]:
    """The d128 candidates in the model's order: the host-layout loops at 128-key tiles (264
    clk per unit, the exponentials' bound), then at 64-key tiles (272), then the plain loop
    transposing V at 128- and 64-key tiles (288 and 320: shared memory binds)."""
    uris = loop_uris(causal)
    host = [u for u in uris if "_vk" not in u]
    return host + [u for u in uris if "_vk" in u]


def preferring(loop: str):
    """Fake timings where the fp8 spec of ``loop`` is the fastest (0.5 ms), others stable_ms."""

    def timing(spec, num_splits=None):
        return 0.5 if spec.uri.removesuffix("_causal").endswith(f"_w12_{loop}") else stable_ms(spec)

    return timing


def counting_tuner(bench: FakeBench):
    calls: list[str] = []

    def tuner(p, key):
        calls.append(key.id)
        return tune_problem(p, key, bench, compile_fn=fake_compile(), settings=FAST)

    return tuner, calls


# ---- problems and keys ---------------------------------------------------------------------
def test_an_fp8_problem_has_its_own_key_and_label():
    p = fp8_problem(causal=True)
    assert p.dtype == "float8_e4m3" and p.fp8 and not problem().fp8
    assert p.bucket().label == "e4m3_d128_causal_nomask_g2_q1024_k1024_bh32"
    key = make_key(p, DEVICE, SOFTWARE)
    assert key.id.startswith("e4m3_d128_causal_nomask_g2_q1024_k1024_bh32-")
    assert key.as_dict()["problem"] == {
        "dtype": "float8_e4m3", "head_dim": 128, "causal": True, "mask": False, "gqa_ratio": 2,
        "seqlen_q": 1024, "seqlen_k": 1024, "batch_heads": 32,
    }  # fmt: skip
    assert TuningKey.from_dict(json.loads(json.dumps(key.as_dict()))) == key
    bf16 = make_key(problem(causal=True, num_kv_heads=8), DEVICE, SOFTWARE)
    assert bf16.id.startswith("bf16_d128_causal_nomask_g2_") and bf16.id != key.id


@pytest.mark.parametrize("name", ["e4m3", "float8_e4m3fn", "FLOAT8_E4M3"])
def test_an_fp8_problem_takes_the_dtype_by_its_names(name):
    assert ProblemDesc.from_shape("2,16,8,1024,1024,128", name).dtype == "float8_e4m3"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"head_dim": 80},
            "head_dim=80 is not allowed with dtype='float8_e4m3'; use "
            "64 or 96 or 128 or 192 or 256",
        ),
        ({"mask": True}, "mask=True is not allowed with dtype='float8_e4m3'; use False"),
        (
            {"family": "backward"},
            "family='backward' is not allowed with dtype='float8_e4m3'; use 'forward'",
        ),
    ],
)
def test_an_fp8_problem_refuses_what_the_fp8_kernels_lack(overrides, message):
    with pytest.raises(InputError, match=re.escape(message)):
        fp8_problem(**overrides)


def test_an_unknown_dtype_names_every_allowed_one():
    with pytest.raises(InputError, match=r"dtype='e5m2' is not allowed; use one of float32, .*"
                                         r"bf16, float8_e4m3, e4m3, float8_e4m3fn$"):  # fmt: skip
        fp8_problem(dtype="e5m2")


@pytest.mark.parametrize(("field", "value"), [("head_dim", 80), ("mask", True)])
def test_a_record_key_of_an_fp8_problem_no_kernel_takes_is_refused(field, value):
    data = make_key(fp8_problem(), DEVICE, SOFTWARE).as_dict()
    assert key_problems(data) == []
    data["problem"][field] = value
    assert [p for p in key_problems(data) if p.startswith(f"problem.{field}={value}")] == [
        f"problem.{field}={value!r} is not allowed with dtype='float8_e4m3'; use "
        f"{'64 or 96 or 128 or 192 or 256' if field == 'head_dim' else 'False'} (the fp8 kernels: "
        "docs/hopper.md, fp8)"
    ]


# ---- candidates ----------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_the_candidates_of_an_fp8_problem_are_the_fp8_loops(causal):
    """Plain, Q in registers, the overlap (3 stages) with and without it, ping-pong: causal as
    the problem is, sm_90a code, at 128- then 64-key tiles; the shipped fp8 specs are among them.
    None is invalid; the model keeps its top 8."""
    p = fp8_problem(causal=causal)
    specs, dropped = valid_candidates(p, "sm_90")
    assert [s.uri for s in specs] == loop_uris(causal) and dropped == []
    assert all(s.fp8 and s.causal == causal and s.archs == ("sm_90a",) for s in specs)
    shipped = [load_spec(ROOT_SPECS.format(loop)) for loop in ("s2", "s2_qr", "s3_ovl")]
    assert [s.uri for s in shipped] == loop_uris(False)[:3]
    # the model ranks the 64-key tiles below the 128-key ones (272 against 264 clk per unit, the
    # exponentials' bound): the first two of them make the top 8, the rest are dropped by rank
    kept, dropped = prune(p, DEVICE, fake_compile())
    assert [c.spec.uri for c in kept] == ranked_uris(causal)[:8]
    assert [(d.uri, d.reason.split(",")[1]) for d in dropped] == [
        (uri, f" rank {rank} > top 8") for rank, uri in enumerate(ranked_uris(causal)[8:], 9)
    ]


def test_an_fp8_problem_with_variants_gets_candidates_and_a_default_that_have_them():
    """An fp8 call with a window and a soft cap is tuned among the fp8 loops compiled with both
    (the problem's variants are every candidate's fields), and untuned runs the plain loop with
    both; the key tells it from the problem without variants."""
    p = fp8_problem(causal=True, variants=("window", "softcap"))
    specs, dropped = valid_candidates(p, "sm_90")
    assert len(specs) == len(loop_uris(True)) and dropped == []
    assert all(s.fp8 and s.variants == ("window", "softcap") for s in specs)
    assert heuristic_spec(p, DEVICE) == fp8_default_spec(128, True, ("window", "softcap"))
    assert make_key(p, DEVICE, SOFTWARE).id != make_key(fp8_problem(causal=True), DEVICE,
                                                        SOFTWARE).id  # fmt: skip


def test_the_candidates_at_head_dims_64_and_256_are_the_loops_that_fit():
    """d64: every loop at 128- and 64-key tiles but the TMA store (64-byte Q rows); d256 (64-key
    tiles): the plain loop, the overlap (168 accumulators, the budget), ping-pong and the TMA
    store; Q in registers wants more registers than fit, alone (192) and with the overlap (200;
    spec validation drops them)."""
    d64, dropped = valid_candidates(fp8_problem(head_dim=64), "sm_90")
    assert [s.uri for s in d64] == [
        f"fa_fwd_v2_wg_e4m3_d64_m128_n{n}_w12_{loop}"
        for n in (128, 64)
        for loop in ("s2", "s2_qr", "s3_ovl", "s3_ovl_qr", "s2_pp", "s2_vk")
    ]
    assert [d.reason.split(" (")[0] for d in dropped] == [
        "epilogue='tma' is not allowed with dtype='float8_e4m3' and head_dim=64"
    ] * 2
    d256, dropped = valid_candidates(fp8_problem(head_dim=256), "sm_90")
    assert [s.uri for s in d256] == [
        f"fa_fwd_v2_wg_e4m3_d256_m128_n64_w12_{loop}"
        for loop in ("s2", "s3_ovl", "s2_pp", "s2_tma", "s2_vk")
    ]
    assert [d.reason.split("; ")[0].split("need ")[1] for d in dropped] == [
        f"{n} fp32 accumulators per thread" for n in (192, 200)
    ]


def test_the_candidates_at_head_dims_96_and_192_are_the_loops_that_fit():
    """d96 (one 128-byte Q/K row, 96-row V^T tiles): every loop at 128- and 64-key tiles, the
    TMA store included; d192: every loop at 64-key tiles, and at 128-key tiles the plain loop,
    ping-pong and the TMA store (the overlap and Q in registers need 176, 184 and 200
    accumulators per thread: spec validation drops them)."""
    every = ("s2", "s2_qr", "s3_ovl", "s3_ovl_qr", "s2_pp", "s2_tma", "s2_vk")
    d96, dropped = valid_candidates(fp8_problem(head_dim=96), "sm_90")
    assert [s.uri for s in d96] == [
        f"fa_fwd_v2_wg_e4m3_d96_m128_n{n}_w12_{loop}" for n in (128, 64) for loop in every
    ]
    assert dropped == []
    d192, dropped = valid_candidates(fp8_problem(head_dim=192), "sm_90")
    assert [s.uri for s in d192] == [
        *(
            f"fa_fwd_v2_wg_e4m3_d192_m128_n128_w12_{loop}"
            for loop in ("s2", "s2_pp", "s2_tma", "s2_vk")
        ),
        *(f"fa_fwd_v2_wg_e4m3_d192_m128_n64_w12_{loop}" for loop in every),
    ]
    assert [d.reason.split("; ")[0].split("need ")[1] for d in dropped] == [
        f"{n} fp32 accumulators per thread" for n in (184, 176, 200)
    ]


@pytest.mark.parametrize("head_dim", [96, 192])
def test_the_untuned_fp8_default_at_head_dims_96_and_192_is_the_plain_loop_at_128_keys(head_dim):
    """No spec file ships for them: the default is the plain loop at 128-key tiles (at d192
    the model's fastest: 767 instructions per unit against 922 at 64-key tiles)."""
    spec = fp8_default_spec(head_dim, True)
    assert spec.uri == f"fa_fwd_v2_wg_e4m3_d{head_dim}_m128_n128_w12_s2_causal"
    assert heuristic_spec(fp8_problem(head_dim=head_dim, causal=True), DEVICE) == spec


def test_fp8_problems_are_tuned_on_compute_capability_9_0_only():
    a100 = DeviceInfo("Fake A100", "8.0", 108)
    tuned_on = r"dtype='float8_e4m3' problems are tuned on compute capability 9.0 devices only"
    with pytest.raises(InputError, match=tuned_on + r" .* this device is sm_80"):
        prune(fp8_problem(), a100, fake_compile())
    assert heuristic_spec(fp8_problem(causal=True), a100) == fp8_default_spec(128, True)


# ---- the flow ------------------------------------------------------------------------------
def test_an_fp8_problem_is_tuned_once_then_read_from_disk():
    bench = FakeBench(preferring("s3_ovl_qr"))
    tuner, calls = counting_tuner(bench)
    p = fp8_problem(causal=True)
    launch = select_launch(p, DEVICE, software=SOFTWARE, tuner=tuner)
    assert launch.spec.uri == loop_uris(True)[3] and launch.num_splits is None
    assert sorted(set(bench.timed)) == sorted(ranked_uris(True)[:8])  # the model's top 8
    key = make_key(p, DEVICE, SOFTWARE)
    record = TuningDB().load(key)
    assert record is not None and record.winner == launch.spec.model_dump(mode="json")
    assert {c["uri"]: c["status"] for c in record.candidates}[launch.spec.uri] == "winner"
    assert record.winner_ms == pytest.approx(0.5)
    assert [(d["stage"], d["uri"]) for d in record.dropped] == [
        ("model", uri) for uri in ranked_uris(True)[8:]
    ]
    clear_memo()  # a new process: the disk answers
    assert select_launch(p, DEVICE, software=SOFTWARE, tuner=tuner) == launch
    same_bucket = fp8_problem(causal=True, seqlen_q=1000, seqlen_k=777)
    assert select_launch(same_bucket, DEVICE, software=SOFTWARE, tuner=tuner) == launch
    assert calls == [key.id]
    # the non-causal problem is another key, with the non-causal loops
    full = select_launch(fp8_problem(), DEVICE, software=SOFTWARE, tuner=tuner)
    assert full.spec.uri == loop_uris(False)[3] and len(calls) == 2


def test_an_fp8_problem_falls_back_to_the_default_spec_untuned():
    """KERNELGEN_AUTOTUNE=0 (mode off): the plain fp8 loop, no record; offline: a miss."""
    tuner, calls = counting_tuner(FakeBench())
    p = fp8_problem(causal=True)
    launch = select_launch(p, DEVICE, software=SOFTWARE, mode="off", tuner=tuner)
    assert launch.spec == fp8_default_spec(128, True) and calls == []
    assert TuningDB().records() == []
    with pytest.raises(TuningMissError, match="no tuning record for e4m3_d128_causal"):
        select_launch(p, DEVICE, software=SOFTWARE, mode="offline", tuner=tuner)


def test_an_fp8_record_with_a_bf16_winner_is_a_miss(caplog):
    """A record whose winner is not an fp8 spec does not fit its key: re-tuned."""
    tuner, calls = counting_tuner(FakeBench(preferring("s2_pp")))
    p = fp8_problem()
    select_launch(p, DEVICE, software=SOFTWARE, tuner=tuner)
    key = make_key(p, DEVICE, SOFTWARE)
    db = TuningDB()
    record = db.load(key)
    bf16 = heuristic_spec(problem(), DEVICE).model_dump(mode="json")
    db.save(dataclasses.replace(record, winner=bf16))
    clear_memo()
    launch = select_launch(p, DEVICE, software=SOFTWARE, tuner=tuner)
    assert launch.spec.uri == loop_uris(False)[4] and len(calls) == 2


# ---- kernelgen tune --dtype e4m3 ------------------------------------------------------------
def test_the_dry_run_of_an_fp8_shape_lists_the_fp8_loops(monkeypatch):
    """On the assumed H100 the fourteen candidates (five loops, the TMA-store twin and the plain
    loop transposing V, at 128- and 64-key tiles), one of them spilling (a fake ptxas) dropped
    by name."""
    from test_tuning_cli import run

    from kernelgen.tuning import candidates

    spilling = loop_uris(True)[4]  # ping-pong
    monkeypatch.setattr(candidates, "offline_resources", fake_compile(frozenset({spilling})))
    monkeypatch.setenv("COLUMNS", "200")
    result = run("tune", "--shape", "2,16,8,4096,4096,128", "--dtype", "e4m3", "--causal",
                 "--dry-run")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "problem bucket e4m3_d128_causal_nomask_g2_q4096_k4096_bh32" in result.stdout
    assert all(uri in result.stdout for uri in loop_uris(True)[:4] + loop_uris(True)[5:])
    assert f"drop [resources] {spilling}: ptxas" in result.stdout
    assert "8 to time, 6 dropped (dry run: nothing timed)" in result.stdout  # 5 by the model


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--arch", "sm_80"), "problems are tuned on compute capability 9.0 devices only"),
        (("--shape", "2,16,8,4096,4096,80"), "head_dim=80 is not allowed with dtype="),
        (("--mask",), "mask=True is not allowed with dtype='float8_e4m3'; use False"),
        (("--backward",), "family='backward' is not allowed with dtype='float8_e4m3'"),
    ],
)
def test_an_fp8_tune_the_kernels_cannot_run_is_one_line_and_exit_2(args, message):
    from test_tuning_cli import run

    shape = () if "--shape" in args else ("--shape", "2,16,8,4096,4096,128")
    result = run("tune", *shape, "--dtype", "e4m3", "--dry-run", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1


# ---- the fp8 call on the fakes of torch and CuPy -------------------------------------------
B, H, HKV, SQ, SK, D = 2, 4, 2, 100, 200, 128


@pytest.fixture
def fp8_gpu(monkeypatch):
    """Fake CuPy and torch on an sm_90 device; launches recorded by symbol; a counting fake
    tuner that prefers the overlapped loop with Q in registers."""
    launches: list[str] = []
    install_fake_libraries(monkeypatch, lambda symbol, *args: launches.append(symbol))
    tuner, calls = counting_tuner(FakeBench(preferring("s3_ovl_qr")))
    monkeypatch.setattr(AUTOTUNE, "gpu_tuner", lambda **kw: tuner)
    yield launches, calls
    clear_kernel_cache()


def fp8_call(**options):
    q = fake_torch.Tensor((B, H, SQ, D), fake_torch.float8_e4m3fn)
    k, v = (fake_torch.Tensor((B, HKV, SK, D), fake_torch.float8_e4m3fn) for _ in range(2))
    return kernelgen.attention(q, k, v, causal=True, **options)


def test_an_fp8_call_runs_the_tuned_loop_and_reuses_its_record(fp8_gpu, monkeypatch):
    launches, calls = fp8_gpu
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "1")
    out = fp8_call()
    fp8_call()
    assert out.dtype is fake_torch.bfloat16
    assert launches == [loop_uris(True)[3]] * 2
    assert len(calls) == 1 and calls[0].startswith("e4m3_d128_causal_nomask_g2_q128_k256_bh8-")
    (record,) = [r for _, r in TuningDB().records()]
    assert record.winner["dtype"] == "float8_e4m3" and record.winner["q_in_registers"]


def test_an_fp8_call_without_tuning_runs_the_default(fp8_gpu, monkeypatch):
    launches, calls = fp8_gpu
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "0")  # install_fake_libraries' too
    fp8_call()
    assert launches == [fp8_default_spec(D, True).uri] and calls == []
    assert TuningDB().records() == []
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "offline")
    with pytest.raises(TuningMissError):
        fp8_call()
    assert len(launches) == 1


def test_an_fp8_call_with_variants_runs_a_kernel_compiled_with_them(fp8_gpu, monkeypatch):
    """Tuned and untuned, an fp8 call with softcap and sinks launches a spec with both flags."""
    launches, calls = fp8_gpu
    sinks = fake_torch.Tensor((H,), fake_torch.float32)
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "1")
    fp8_call(softcap=20.0, sinks=sinks)
    assert launches[0] in {uri + "_cap_sink" for uri in loop_uris(True)}
    (record,) = [r for _, r in TuningDB().records()]
    assert record.winner["softcap"] and record.winner["sinks"] and "window" not in record.winner
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "0")
    fp8_call(softcap=20.0, sinks=sinks)
    assert launches[1] == fp8_default_spec(D, True, ("softcap", "sinks")).uri
    assert len(calls) == 1


def test_a_named_fp8_spec_is_not_tuned(fp8_gpu, monkeypatch):
    launches, calls = fp8_gpu
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "1")
    spec = load_spec(ROOT_SPECS.format("s3_ovl")).model_copy(update={"causal": True})
    fp8_call(spec=spec)
    assert launches == [spec.uri] and calls == []


def test_an_fp8_call_on_another_device_is_refused_before_tuning(fp8_gpu, monkeypatch):
    launches, calls = fp8_gpu
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "1")
    monkeypatch.setattr(fake_cupy, "COMPUTE_CAPABILITY", "80")
    with pytest.raises(InputError, match=r"fp8 attention runs on compute capability 9\.0 only"):
        fp8_call()
    assert launches == [] and calls == []


# ---- the fp8 bench, run by the emulator on CPU torch tensors -------------------------------
@pytest.fixture
def emulated_fp8_bench(monkeypatch):
    """An Fp8Bench whose torch tensors live on the CPU and whose kernels the emulator runs (the
    GPU path with "cuda" tensors and RuntimeKernels: tests/test_gpu_fp8.py)."""
    from kernelgen.runtime.host import emulated_kernel

    monkeypatch.setattr(fp8_bench_module, "require_device", numpy_cupy)
    monkeypatch.setattr(fp8_bench_module, "TORCH_DEVICE", "cpu")
    monkeypatch.setattr(fp8_bench_module, "bench_kernel", lambda spec, arch: emulated_kernel(spec))
    # causal GQA, Sq and Sk off the tiles (Sk off 16), every built-in variant (the bench runs
    # them with kernelgen.tuning.gpu.bench_variants' values)
    p = ProblemDesc("e4m3", 1, 2, 1, 70, 150, 128, causal=True,
                    variants=("window", "softcap", "alibi", "sinks"))  # fmt: skip
    return fp8_bench_module.Fp8Bench(p, DeviceInfo("Emulated", "9.0", 132))


@pytest.mark.emulate
@pytest.mark.filterwarnings("ignore::kernelgen.errors.CPUBackendWarning")
def test_the_fp8_bench_checks_and_times_by_the_emulator(emulated_fp8_bench, monkeypatch):
    torch = pytest.importorskip("torch")
    bench = emulated_fp8_bench
    assert isinstance(AUTOTUNE.bench_for(bench.problem, DEVICE), fp8_bench_module.Fp8Bench)
    assert len(bench.sets) == 2 and bench.check_rows == 70
    s = bench.sets[0]
    assert s["q"].dtype == torch.float8_e4m3fn and s["k"].shape == (1, 1, 150, 128)
    assert "v_t" not in s and "v" not in bench.tensors[0]  # each launch passes its v
    for name in ("q_descale", "k_descale", "v_descale"):
        assert s[name].dtype == torch.float32 and s[name].shape == (1, 1)
        assert 0.5 <= float(s[name]) < 2.0
    assert not torch.equal(s["q"].view(torch.uint8), bench.sets[1]["q"].view(torch.uint8))
    spec = valid_candidates(bench.problem, "sm_90")[0][3]  # the overlap with Q in registers
    assert spec.variants == ("window", "softcap", "alibi", "sinks")
    assert set(bench.tensors[0]) >= {"alibi_slopes", "sinks"}
    bench.compile(spec)
    assert bench.check(spec) is None  # out against float64 of the e4m3 inputs and descales
    samples = bench.time(spec, 1.0, min_reps=2)
    assert len(samples) >= 2 and all(x > 0 for x in samples)
    # a slice of the last rows of both query heads
    monkeypatch.setattr(fp8_bench_module, "CHECK_SCORES", 16 * 2 * 150)
    assert bench.check_rows == 16 and bench.check(spec) is None
    # the plain loop transposing V in the kernel reads v in place (the natural map's strides)
    transposing = valid_candidates(bench.problem, "sm_90")[0][6]
    assert transposing.fp8_v_layout == "kernel"
    bench.compile(transposing)
    assert bench.check(transposing) is None

    # mutation: V^T with its keys in their own order (not the fragment's permutation), which
    # the host layout's launches make
    def plain_v_t(v):
        plain = torch.zeros((1, 1, 128, 160), dtype=torch.uint8)
        plain[..., :150] = v.transpose(2, 3)
        return plain

    monkeypatch.setattr(fp8_bench_module, "v_operand", plain_v_t)
    assert bench.check(transposing) is None  # (no copy)
    assert re.fullmatch(r"relative error \S+ > 6.25e-02 against float64 \(fp8\)", bench.check(spec))
    # mutation: a launch that writes nothing leaves the NaN poison
    bench.launches[spec, None] = lambda tensors: None
    assert bench.check(spec) == "NaN or inf in the output"


def test_the_fp8_bench_needs_torch(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    monkeypatch.setattr(fp8_bench_module, "require_device", numpy_cupy)
    with pytest.raises(Exception, match="tuning an fp8 problem needs torch") as info:
        fp8_bench_module.Fp8Bench(fp8_problem(), DEVICE)
    assert type(info.value).__name__ == "ToolchainMissingError"
