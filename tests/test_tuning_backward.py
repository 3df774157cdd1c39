"""CPU tier: tuning the backward family: its own keys (forward keys unchanged), candidates and
pruning, records, attention_backward's spec choice on fake CuPy, ``kernelgen tune --backward``;
and (emulation tier) the backward bench's launches and check, run by the emulator."""

from __future__ import annotations

import importlib
import json
import logging
import time
import types

import numpy as np
import pytest
import typer
from conftest import install_fake_libraries
from test_tuning_fakes import DEVICE, SOFTWARE, fake_compile, fake_tuner, problem
from typer.testing import CliRunner

import kernelgen
from kernelgen.calls import backward as backward_api
from kernelgen.cli import tune as cli_tune
from kernelgen.errors import InputError
from kernelgen.families import backward
from kernelgen.model.policy import default_backward_spec
from kernelgen.runtime.launch import clear_kernel_cache
from kernelgen.specs.arch import ARCHS
from kernelgen.specs.backward import BackwardSpec
from kernelgen.specs.forward import MAX_ACCUMULATORS_PER_THREAD, MAX_HEAD_DIM
from kernelgen.testing import fake_cupy
from kernelgen.tuning import (
    DeviceInfo,
    ProblemDesc,
    TuningDB,
    TuningKey,
    TuningMissError,
    autotune,
    clear_memo,
    gpu,
    heuristic_spec,
    make_key,
    prune,
    select_launch,
    warmup,
)
from kernelgen.tuning import candidates as candidates_module
from kernelgen.tuning.candidates import kernel_set_resources, valid_candidates
from kernelgen.tuning.db import wrap
from kernelgen.tuning.key import key_problems

# the module (kernelgen.tuning.autotune, as an attribute, is the function)
AUTOTUNE = importlib.import_module("kernelgen.tuning.autotune")


@pytest.fixture(autouse=True)
def isolated(tuning_sandbox):
    """Every test gets its own tuning cache and memo (conftest)."""


def bwd(**overrides: object) -> ProblemDesc:
    """A backward problem (the fakes' forward shape by default)."""
    return problem(family="backward", **overrides)


def counting_tuner():
    calls: list[str] = []
    inner = fake_tuner()

    def tuner(p, key):
        calls.append(key.id)
        return inner(p, key)

    return tuner, calls


# ---- keys ----------------------------------------------------------------------------------
# Forward key ids and key JSON as they were before backward problems existed (computed at the
# commit before this file): forward records keep their files and checksums.
PAGED_DECODE = ProblemDesc("float16", 1, 32, 8, 1, 32768, 128, causal=True, mask=True,
                           page_size=64, variants=("window", "sinks"))  # fmt: skip
FORWARD_KEYS = [
    (
        problem(),
        "bf16_d128_full_nomask_g1_q1024_k1024_bh32-2b962bb21e74",
        '{"batch_heads": 32, "causal": false, "dtype": "bfloat16", "gqa_ratio": 1, '
        '"head_dim": 128, "mask": false, "seqlen_k": 1024, "seqlen_q": 1024}',
    ),
    (
        PAGED_DECODE,
        "window_sinks_f16_d128_causal_mask_g4_q1_k32768_bh32_page64-fc0e541c799d",
        '{"batch_heads": 32, "causal": true, "dtype": "float16", "gqa_ratio": 4, '
        '"head_dim": 128, "mask": true, "page_size": 64, "seqlen_k": 32768, "seqlen_q": 1, '
        '"variants": ["window", "sinks"]}',
    ),
]


@pytest.mark.parametrize("forward, key_id, problem_json", FORWARD_KEYS)
def test_forward_keys_are_unchanged(forward, key_id, problem_json):
    key = make_key(forward, DEVICE, SOFTWARE)
    assert key.id == key_id
    assert json.dumps(key.as_dict()["problem"], sort_keys=True) == problem_json
    assert TuningKey.from_dict(json.loads(json.dumps(key.as_dict()))) == key


def test_a_backward_problem_is_its_own_bucket():
    forward = make_key(problem(causal=True), DEVICE, SOFTWARE)
    atomic = make_key(bwd(causal=True), DEVICE, SOFTWARE)
    det = make_key(bwd(causal=True, deterministic=True), DEVICE, SOFTWARE)
    assert len({forward.id, atomic.id, det.id}) == 3
    assert atomic.id.startswith("bwd_bf16_d128_causal_nomask_g1_q1024_k1024_bh32-")
    assert det.id.startswith("bwd_bf16_d128_causal_nomask_g1_q1024_k1024_bh32_det-")
    assert atomic.as_dict()["problem"]["family"] == "backward"
    assert "deterministic" not in atomic.as_dict()["problem"]
    assert det.as_dict()["problem"]["deterministic"] is True
    for key in (atomic, det):
        assert key_problems(key.as_dict()) == []
        assert TuningKey.from_dict(json.loads(json.dumps(key.as_dict()))) == key


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"deterministic": True}, "deterministic=True is a backward option"),
        ({"family": "sideways"}, "family='sideways' is not allowed"),
        ({"family": "backward", "page_size": 16}, "a backward problem has no paged KV cache"),
    ],
)
def test_backward_problem_fields_are_checked(fields, message):
    with pytest.raises(InputError, match=message):
        problem(**fields)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"family": "sideways"}, "problem.family='sideways' is not one of"),
        ({"family": 1}, "problem.family=1 is not a string"),
        ({"deterministic": True}, "problem.deterministic=True is not a forward problem's field"),
        ({"deterministic": "yes"}, "problem.deterministic='yes' is not bool"),
        ({"family": "backward", "page_size": 16}, "problem.page_size=16 for a backward problem"),
    ],
)
def test_key_problems_of_the_new_fields(change, message):
    data = make_key(problem(), DEVICE, SOFTWARE).as_dict()
    data["problem"].update(change)
    problems = key_problems(data)
    assert len(problems) == 1 and problems[0].startswith(message), problems


# ---- candidates and pruning ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_backward_candidates_are_valid_backward_specs_of_the_call(dtype, head_dim):
    p = bwd(dtype=dtype, head_dim=head_dim, causal=True, mask=True, deterministic=True,
            variants=("window", "alibi"))  # fmt: skip
    specs, dropped = valid_candidates(p, "sm_80")
    assert len({s.uri for s in specs}) == len(specs)
    simt = [s for s in specs if s.mma == "simt"]
    tc = [s for s in specs if s.mma == "mma_sync"]
    assert 5 <= len(simt) <= 27
    assert bool(tc) == (dtype != "float32")  # fp16/bf16 on sm_80: the tensor-core grid too
    for s in specs:
        assert isinstance(s, BackwardSpec) and s.archs == ("sm_80",)
        assert (s.dtype, s.head_dim, s.causal, s.deterministic) == (dtype, head_dim, True, True)
        assert s.additive_mask and s.variants == ("window", "alibi")
    for s in simt:
        assert s.accumulators_per_thread <= MAX_ACCUMULATORS_PER_THREAD["simt"]
    assert {(s.block_m, s.block_n, s.num_warps) for s in simt} <= {
        (m, n, w) for m in (16, 32, 64) for n in (16, 32, 64) for w in (2, 4, 8)
    }
    assert {(s.block_m, s.block_n, s.num_warps, s.stages) for s in tc} <= {
        (m, n, w, st) for m in (64, 128) for n in (64, 128) for w in (4, 8) for st in (1, 2)
    }
    assert all(d.stage == "validation" for d in dropped)
    if head_dim >= 128:  # 64 keys x 128 dims over 2 warps: 256 accumulators per thread
        assert any("dK and dV accumulators" in d.reason for d in dropped)


def test_backward_pruning_occupancy_and_resources(caplog):
    """B x Hkv = 8 with 1024 keys: 64-key tiles give 128 blocks for 132 SMs (dropped), 32-key
    tiles 256; a spilling candidate is dropped; no model stage for the backward."""
    p = bwd(batch=1, num_heads=8, num_kv_heads=8)
    spilling = "fa_bwd_simt_bf16_d128_m32_n32_w4"
    with caplog.at_level(logging.INFO, logger="kernelgen.tuning"):
        kept, dropped = prune(p, DEVICE, fake_compile(spills=frozenset({spilling})))
    stages = {d.stage for d in dropped}
    assert stages == {"validation", "occupancy", "resources"}
    assert all(c.spec.block_n < 64 for c in kept) and all(c.num_splits is None for c in kept)
    assert any(d.uri.endswith("_n64_w8") and "128 blocks" in d.reason for d in dropped)
    assert [d.uri for d in dropped if d.stage == "resources"] == [spilling]
    assert "dropped fa_bwd_simt" in caplog.text


def test_each_backward_engine_adds_its_grid(monkeypatch):
    """The grid is one function per engine: another engine's function adds its field sets."""
    extra = {"mma": "simt", "block_m": 16, "block_n": 16, "num_warps": 1}
    before, _ = valid_candidates(bwd(head_dim=64), "sm_90")
    monkeypatch.setitem(candidates_module.BACKWARD_GRIDS, "extra", lambda p, arch: iter([extra]))
    specs, _ = valid_candidates(bwd(head_dim=64), "sm_90")
    assert sum(s.num_warps == 1 for s in specs) == 1 and len(specs) == len(before) + 1
    assert {s.mma for s in before} == {"simt", "mma_sync"}


def test_a_backward_spec_is_judged_by_its_worst_kernel():
    lines = []
    for symbol, regs, spill in (("k_pre", 30, 0), ("k", 200, 0), ("k_dq", 255, 24)):
        lines += [
            f"ptxas info    : Compiling entry function '{symbol}' for 'sm_80'",
            f"ptxas info    : Function properties for {symbol}",
            f"    {spill} bytes stack frame, {spill} bytes spill stores, 0 bytes spill loads",
            f"ptxas info    : Used {regs} registers, 380 bytes cmem[0]",
        ]
    res = kernel_set_resources("\n".join(lines), ["k_pre", "k", "k_dq"], "sm_80")
    assert (res.registers, res.spill_store_bytes, res.stack_bytes) == (255, 24, 24)


# ---- the flow --------------------------------------------------------------------------------
def test_a_backward_problem_is_tuned_once_then_read_from_disk():
    tuner, calls = counting_tuner()
    p = bwd(causal=True, deterministic=True)
    launch = select_launch(p, DEVICE, software=SOFTWARE, tuner=tuner)
    assert isinstance(launch.spec, BackwardSpec) and launch.num_splits is None
    assert launch.spec.deterministic and launch.spec.archs == ("sm_90",)
    key = make_key(p, DEVICE, SOFTWARE)
    record = TuningDB().load(key)
    assert record is not None and record.winner["family"] == "backward"
    assert record.winner == launch.spec.model_dump(mode="json")
    clear_memo()  # a new process: the disk answers
    assert select_launch(p, DEVICE, software=SOFTWARE, tuner=tuner) == launch
    assert calls == [key.id]
    # the forward problem of the same shape is another key, tuned on its own
    forward = select_launch(problem(causal=True), DEVICE, software=SOFTWARE, tuner=tuner)
    assert not isinstance(forward.spec, BackwardSpec) and len(calls) == 2


@pytest.mark.parametrize("family", ["backward", "forward"])
def test_a_winner_of_the_other_family_is_an_invalid_record(family, caplog):
    """A backward key whose record holds a forward winner (or the reverse) is a miss with a
    warning, re-tuned in mode 1, never launched."""
    other = "forward" if family == "backward" else "backward"
    p, q = problem(family=family), problem(family=other)
    db = TuningDB()
    record = fake_tuner()(p, make_key(p, DEVICE, SOFTWARE))
    foreign = fake_tuner()(q, make_key(q, DEVICE, SOFTWARE))
    payload = {**record.payload(), "winner": foreign.winner}
    db.path(record.key).parent.mkdir(parents=True, exist_ok=True)
    db.path(record.key).write_text(json.dumps(wrap(payload)))
    with caplog.at_level(logging.WARNING, logger="kernelgen.tuning"):
        assert db.load(record.key) is None
        with pytest.raises(TuningMissError):
            select_launch(p, DEVICE, software=SOFTWARE, db=db, mode="offline")
    assert f"a {other} spec, the key is a {family} problem" in caplog.text
    tuner, calls = counting_tuner()
    launch = select_launch(p, DEVICE, software=SOFTWARE, db=db, tuner=tuner)
    assert isinstance(launch.spec, BackwardSpec) == (family == "backward") and len(calls) == 1


def test_off_mode_takes_the_policy_default(monkeypatch):
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "0")
    tuner, calls = counting_tuner()
    p = bwd(head_dim=256, mask=True, variants=("softcap",))
    spec = select_launch(p, DEVICE, software=SOFTWARE, tuner=tuner).spec
    expected = default_backward_spec(
        "bfloat16", 256, causal=False, variants=("softcap",), additive_mask=True,
        arch=DEVICE.target_arch,
    )  # fmt: skip
    assert spec == expected == heuristic_spec(p, DEVICE) and calls == []


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_policy_has_a_backward_default_for_every_head_dim(dtype):
    """Every head dim a call takes, with every variant, a mask and deterministic dQ: a valid
    spec within the device's shared memory (the untuned spec and the bench's reference)."""
    for head_dim in range(8, MAX_HEAD_DIM + 1, 8):
        p = bwd(dtype=dtype, head_dim=head_dim, mask=True, deterministic=True,
                variants=("window", "softcap", "alibi", "sinks"))  # fmt: skip
        spec = heuristic_spec(p, DEVICE)
        assert isinstance(spec, BackwardSpec) and spec.additive_mask and spec.deterministic
        assert spec.smem_bytes <= ARCHS[DEVICE.target_arch].max_smem_per_block
        assert spec.archs == (DEVICE.target_arch,)


def test_warmup_and_autotune_take_backward_problems():
    tuner, calls = counting_tuner()
    specs = warmup(["1,8,8,512,512,64"], "fp16", causal=True, backward=True, deterministic=True,
                   device=DEVICE, software=SOFTWARE, tuner=tuner)  # fmt: skip
    assert [type(s) for s in specs] == [BackwardSpec] and specs[0].deterministic
    again = autotune([bwd(dtype="float16", batch=1, num_heads=8, num_kv_heads=8, seqlen_q=512,
                          seqlen_k=512, head_dim=64, causal=True, deterministic=True)],
                     DEVICE, software=SOFTWARE, tuner=tuner)  # fmt: skip
    assert again == specs and len(calls) == 1


# ---- attention_backward on fake CuPy -------------------------------------------------------
@pytest.fixture
def fake_gpu(monkeypatch, tuning_sandbox):
    """Fake CuPy, backward kernels that record their launches, and a counting fake tuner."""
    launches: list[tuple] = []
    install_fake_libraries(monkeypatch, lambda *launch: launches.append(launch))

    def stub_functions(cupy, name, source, symbols):
        return {s: fake_cupy.StubFunction(s, lambda *a: launches.append(a), None) for s in symbols}

    monkeypatch.setattr(backward_api, "compile_functions", stub_functions)
    monkeypatch.setattr(backward_api, "_KERNELS", {})
    tuner, calls = counting_tuner()
    monkeypatch.setattr(AUTOTUNE, "gpu_tuner", lambda **kw: tuner)
    yield launches, calls
    clear_kernel_cache()


def backward_call(deterministic=False):
    b, h, hkv, sq, sk, d = 2, 4, 2, 100, 120, 64
    q, dout, out = (fake_cupy.ndarray((b, h, sq, d), np.float16) for _ in range(3))
    k, v = (fake_cupy.ndarray((b, hkv, sk, d), np.float16) for _ in range(2))
    lse = fake_cupy.ndarray((b, h, sq), np.float32)
    return kernelgen.attention_backward(
        dout, q, k, v, out, lse, causal=True, deterministic=deterministic
    )


def test_attention_backward_asks_the_tuner_in_mode_1(fake_gpu, monkeypatch):
    launches, calls = fake_gpu
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "1")
    dq, dk, dv = backward_call(deterministic=True)
    assert dq.shape == (2, 4, 100, 64) and dk.shape == dv.shape == (2, 2, 120, 64)
    assert len(calls) == 1 and calls[0].startswith("bwd_f16_d64_causal_nomask_g2_q128_k128_bh8_det")
    records = TuningDB().records()
    assert len(records) == 1
    winner = BackwardSpec.model_validate(records[0][1].winner)
    assert [s for s, *_ in launches] == backward.symbols(winner)
    backward_call(deterministic=True)  # the memo answers
    assert len(calls) == 1 and len(launches) == 6


def test_attention_backward_takes_the_policy_default_in_mode_0(fake_gpu):
    launches, calls = fake_gpu  # install_fake_libraries sets KERNELGEN_AUTOTUNE=0
    backward_call()
    default = default_backward_spec("float16", 64, causal=True)
    assert calls == [] and TuningDB().records() == []
    assert [s for s, *_ in launches] == backward.symbols(default)


def test_attention_backward_with_a_spec_or_expressions_never_tunes(fake_gpu, monkeypatch):
    launches, calls = fake_gpu
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "1")
    b, h, s, d = 1, 2, 40, 32
    q, k, v, dout, out = (fake_cupy.ndarray((b, h, s, d), np.float32) for _ in range(5))
    lse = fake_cupy.ndarray((b, h, s), np.float32)
    spec = BackwardSpec(family="backward", dtype="float32", head_dim=d, block_m=16, block_n=16)
    kernelgen.attention_backward(dout, q, k, v, out, lse, spec=spec)
    kernelgen.attention_backward(dout, q, k, v, out, lse, score_mod="score * 0.5")
    symbols = [symbol for symbol, *_ in launches]
    assert calls == [] and symbols[:3] == backward.symbols(spec)
    assert symbols[4].startswith("fa_bwd_simt_f32_d32_m32_n32_w4_smod")  # the policy's default


# ---- kernelgen tune --backward -------------------------------------------------------------
runner = CliRunner()
app = typer.Typer()


@app.callback()
def _root() -> None:
    """Stands in for the kernelgen command."""


cli_tune.register(app)


def test_cli_tunes_backward_problems(monkeypatch):
    monkeypatch.setattr(candidates_module, "offline_resources", fake_compile())
    monkeypatch.setenv("COLUMNS", "200")
    shape = ["--shape", "1,16,4,1024,1024,128", "--dtype", "bf16", "--causal"]
    dry = runner.invoke(app, ["tune", *shape, "--backward", "--deterministic", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "bwd_bf16_d128_causal_nomask_g4_q1024_k1024_bh16_det" in dry.stdout
    assert "fa_bwd_simt_bf16_d128_m32_n32_w4_causal_det" in dry.stdout
    assert "drop [occupancy] fa_bwd_simt_bf16_d128_m16_n64_w4_causal_det" in dry.stdout
    monkeypatch.setattr(cli_tune, "current_environment", lambda: (DEVICE, SOFTWARE))
    tuner, calls = counting_tuner()
    monkeypatch.setattr(AUTOTUNE, "gpu_tuner", lambda **kw: tuner)
    tuned = runner.invoke(app, ["tune", *shape, "--backward"])
    assert tuned.exit_code == 0, tuned.output
    assert tuned.stdout.startswith("bwd_bf16_d128_causal_nomask_g4_q1024_k1024_bh16: fa_bwd_")
    assert len(calls) == 1 and len(TuningDB().records()) == 1
    wrong = runner.invoke(app, ["tune", *shape, "--deterministic", "--dry-run"])
    assert wrong.exit_code == 2 and wrong.stdout == ""
    assert wrong.stderr.strip() == "--deterministic is a backward option; add --backward"


# ---- the backward bench, run by the emulator ----------------------------------------------
def numpy_cupy() -> types.SimpleNamespace:
    """NumPy dressed as the slice of CuPy the backward bench uses (the emulator runs the
    kernels on its arrays); events read the host clock."""

    class Event:
        def record(self) -> None:
            self.at = time.perf_counter()

        def synchronize(self) -> None:
            pass

    class RandomState:
        def __init__(self, seed: int) -> None:
            self.rng = np.random.default_rng(seed)

        def standard_normal(self, shape, dtype):
            return self.rng.standard_normal(shape, dtype=dtype)

    stream = types.SimpleNamespace(synchronize=lambda: None)
    cuda = types.SimpleNamespace(
        Event=Event,
        get_elapsed_time=lambda a, b: (b.at - a.at) * 1e3,
        get_current_stream=lambda: stream,
    )
    return types.SimpleNamespace(
        random=types.SimpleNamespace(RandomState=RandomState),
        asarray=np.asarray, empty=np.empty, ascontiguousarray=np.ascontiguousarray,
        asnumpy=np.asarray, isfinite=np.isfinite, linalg=np.linalg,
        float32=np.float32, uint16=np.uint16, uint32=np.uint32, cuda=cuda,
    )  # fmt: skip


class EmulatedStep:
    """One backward kernel built by the emulator, called as a CuPy function is."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.skip = False

    def __call__(self, grid, block, args, shared_mem=0) -> None:
        if not self.skip:
            values = [None if type(a) is np.uint64 and not int(a) else a for a in args]
            self.kernel(grid=grid, block=block, shared_mem=shared_mem, args=values)


def bench_problem(dtype: str) -> ProblemDesc:
    """Every variant and a mask, GQA 2, Sq != Sk: the bench's slicing, strides and values."""
    return ProblemDesc(
        dtype, 1, 2, 1, 40, 48, 16, causal=True, mask=True,
        variants=("window", "softcap", "alibi", "sinks"), family="backward",
    )  # fmt: skip


@pytest.fixture(params=["float32", "bfloat16"])
def emulated_bench(request, monkeypatch):
    """A BackwardBench over NumPy whose kernels (the forward's too) the emulator runs."""
    from kernelgen.runtime.host import emulated_kernel

    p = bench_problem(request.param)

    def functions(cupy, spec, cubin):
        from kernelgen.runtime.emulated_launch import spec_kernels

        steps = backward.launch_steps(spec, gpu.backward_launch_problem(p, {}))
        kernels = tuple((s.symbol, tuple(s.params)) for s in steps)
        built = spec_kernels(spec, kernels, backward.render(spec))  # one library for the three
        return {symbol: EmulatedStep(kernel) for symbol, kernel in built.items()}

    monkeypatch.setattr(gpu, "require_device", numpy_cupy)
    monkeypatch.setattr(gpu, "backward_functions", functions)
    monkeypatch.setattr(gpu, "forward_kernel", emulated_kernel)
    monkeypatch.setattr(candidates_module, "offline_cubin", lambda spec, arch: None)
    return gpu.BackwardBench(p, DeviceInfo("Emulated", "9.0", 132))


@pytest.mark.emulate
def test_the_backward_bench_checks_and_times_by_the_emulator(emulated_bench, monkeypatch):
    bench = emulated_bench
    assert len(bench.sets) == 2 and bench.check_rows == 40  # the slice holds every row
    simt = {"mma": "simt", "block_m": 16, "block_n": 16, "num_warps": 2, "stages": None}
    spec = BackwardSpec.model_validate({**bench.heuristic.model_dump(), **simt})
    assert bench.heuristic.uri.endswith("_causal_amask_win_cap_alibi_sink")
    bench.compile(spec)
    assert bench.check(spec) is None  # dq, dk, dv against float64
    samples = bench.time(spec, 1.0, min_reps=2)
    assert len(samples) >= 2 and all(x > 0 for x in samples)
    # a slice of the last rows: dq against float64, dk and dv against the policy's default
    monkeypatch.setattr(gpu, "CHECK_SCORES", 16 * 2 * 48)  # 16 rows of both query heads
    bench._slice = None
    assert bench.check_rows == 16
    assert bench.check(spec) is None
    # a launch that leaves dq unwritten (the conversion kernel skipped) is rejected
    bench.functions[spec][f"{spec.uri}_dq_convert"].skip = True
    assert bench.check(spec) == "NaN or inf in dq"
