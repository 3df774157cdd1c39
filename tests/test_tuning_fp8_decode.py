"""CPU tier: tuning fp8 (e4m3) decode and paged problems over the fp8 forms of the Hopper
decode grid (kernelgen.tuning.candidates.wgmma_decode_fields: V transposed in the kernel,
split or not, 64- and 128-key tiles as the head dim allows, packed GQA), with the fake bench;
their keys apart from bf16's; attention_with_kvcache on fp8 caches choosing the tuned launch
on the fakes of torch and CuPy; and (emulation tier) the fp8 bench on a paged split problem.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import install_fake_libraries
from test_tuning_fakes import DEVICE, SOFTWARE, FakeBench, fake_compile, problem, stable_ms
from test_tuning_fp8 import AUTOTUNE, counting_tuner

import kernelgen
from kernelgen.model.policy import fp8_decode_spec
from kernelgen.runtime.launch import clear_kernel_cache
from kernelgen.testing import fake_torch
from kernelgen.tuning import (
    DeviceInfo,
    ProblemDesc,
    TuningDB,
    clear_memo,
    heuristic_spec,
    make_key,
    prune,
    select_launch,
)
from kernelgen.tuning import fp8_bench as fp8_bench_module
from kernelgen.tuning.candidates import valid_candidates


@pytest.fixture(autouse=True)
def isolated(tuning_sandbox):
    """Every test gets its own tuning cache and memo (conftest)."""


def decode_problem(**overrides: object) -> ProblemDesc:
    """One query per sequence, 32 query heads over 8 K/V heads, 4096 keys in 48-key pages."""
    fields = {"dtype": "float8_e4m3", "batch": 4, "num_heads": 32, "num_kv_heads": 8,
              "seqlen_q": 1, "seqlen_k": 4096, "page_size": 48}  # fmt: skip
    return problem(**{**fields, **overrides})


def decode_uris(paged: bool, block_ns=(64, 128)) -> list[str]:
    """The grid's fp8 forms in order: per key tile, split then not, each with its TMA-store
    twin (d128, one consumer warpgroup of 64 packed rows; 3 stages on a paged cache)."""
    stages = 3 if paged else 2
    return [
        f"fa_fwd_v2_wg_e4m3_d128_m64_n{n}_w8_s{stages}{tma}_vk_gqa{split}"
        + ("_paged" if paged else "")
        for n in block_ns
        for split in ("_split", "")
        for tma in ("", "_tma")
    ]


@pytest.mark.parametrize("page_size", [48, 64, 0])
def test_an_fp8_decode_problem_gets_the_decode_grids_fp8_forms(page_size):
    """Pages of 48 keys take both tiles by row copies, of 64 the 64-key tiles by TMA and the
    128-key ones by rows; a contiguous cache no paged form. None is invalid; the occupancy
    step keeps the split launches, each at several split counts."""
    p = decode_problem(page_size=page_size)
    specs, dropped = valid_candidates(p, "sm_90")
    assert [s.uri for s in specs] == decode_uris(page_size > 0) and dropped == []
    assert all(s.fp8 and s.v_transposed_in_kernel and s.archs == ("sm_90a",) for s in specs)
    kept, _ = prune(p, DEVICE, fake_compile())
    assert kept and all(c.spec.split_kv and c.num_splits > 1 for c in kept)
    assert len({c.num_splits for c in kept if c.spec == specs[0]}) >= 3
    assert heuristic_spec(p, DEVICE) == fp8_decode_spec(128, False, 4, paged_kv=page_size > 0)


def test_an_fp8_decode_problem_at_head_dim_256_takes_64_key_tiles_only():
    specs, _ = valid_candidates(decode_problem(head_dim=256), "sm_90")
    assert {s.block_n for s in specs} == {64} and all(s.head_dim == 256 for s in specs)


def test_an_fp8_decode_winner_is_cached_apart_from_bf16():
    """Tuned once (the winner an fp8 paged split launch with its split count), then read from
    disk; the bf16 problem of the same shape is another key, tuned over 16-bit specs."""
    p = decode_problem()
    kept, _ = prune(p, DEVICE, fake_compile())
    fastest = kept[-1].spec.uri, kept[-1].num_splits  # the last launch the model keeps

    def timing(spec, num_splits=None):
        return 0.5 if (spec.uri, num_splits) == fastest else stable_ms(spec, num_splits)

    tuner, calls = counting_tuner(FakeBench(timing))
    launch = select_launch(p, DEVICE, software=SOFTWARE, tuner=tuner)
    assert (launch.spec.uri, launch.num_splits) == fastest and launch.spec.paged_kv
    key = make_key(p, DEVICE, SOFTWARE)
    assert key.id.startswith("e4m3_d128_full_nomask_g4_q1_k4096_bh128_page48-")
    record = TuningDB().load(key)
    assert record.winner["dtype"] == "float8_e4m3" and record.winner_splits == fastest[1]
    clear_memo()  # a new process: the disk answers
    assert select_launch(p, DEVICE, software=SOFTWARE, tuner=tuner) == launch
    bf16 = decode_problem(dtype="bfloat16")
    bf16_key = make_key(bf16, DEVICE, SOFTWARE)
    assert bf16_key.id.startswith("bf16_d128_full_nomask_g4_q1_k4096_bh128_page48-")
    bf16_launch = select_launch(bf16, DEVICE, software=SOFTWARE, tuner=tuner)
    assert bf16_launch.spec.dtype == "bfloat16" and calls == [key.id, bf16_key.id]


@pytest.fixture
def fp8_gpu(monkeypatch):
    """Fake CuPy and torch on an sm_90 device; launches recorded by symbol; a counting fake
    tuner with stable times."""
    launches: list[str] = []
    install_fake_libraries(monkeypatch, lambda symbol, *args: launches.append(symbol))
    tuner, calls = counting_tuner(FakeBench())
    monkeypatch.setattr(AUTOTUNE, "gpu_tuner", lambda **kw: tuner)
    yield launches, calls
    clear_kernel_cache()


def paged_decode_call(**options):
    q = fake_torch.Tensor((2, 1, 8, 128), fake_torch.float8_e4m3fn)
    pools = [fake_torch.Tensor((12, 48, 2, 128), fake_torch.float8_e4m3fn) for _ in range(2)]
    table = np.arange(12, dtype=np.int32).reshape(2, 6)
    return kernelgen.attention_with_kvcache(
        q, *pools, [100, 250], block_table=table, causal=True, **options
    )


def test_an_fp8_cache_call_runs_the_tuned_decode_launch(fp8_gpu, monkeypatch):
    launches, calls = fp8_gpu
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "1")
    out = paged_decode_call()
    paged_decode_call()
    assert out.dtype is fake_torch.bfloat16
    (record,) = [r for _, r in TuningDB().records()]
    winner = record.winner["block_n"], record.winner["split_kv"]
    assert len(calls) == 1 and calls[0].startswith("e4m3_d128_causal_nomask_g4_q1_k512_bh16_page48")
    uri = f"fa_fwd_v2_wg_e4m3_d128_m64_n{winner[0]}_w8_s3"  # 3 stages on a paged cache
    main = [x for x in launches if not x.endswith("_combine")]
    assert len(main) == 2 and all(x.startswith(uri) and x.endswith("_paged") for x in main)


def test_an_fp8_cache_call_without_tuning_runs_the_decode_default(fp8_gpu, monkeypatch):
    launches, calls = fp8_gpu
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "0")
    paged_decode_call()
    spec = fp8_decode_spec(128, True, 4, paged_kv=True)
    assert launches == [spec.uri, spec.combine_uri] and calls == []
    launches.clear()
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "1")
    paged_decode_call(num_splits=2)  # a fixed split count: the default, not tuned
    assert launches == [spec.uri, spec.combine_uri] and calls == []


@pytest.mark.emulate
@pytest.mark.filterwarnings("ignore::kernelgen.errors.CPUBackendWarning")
def test_the_fp8_bench_checks_and_times_a_paged_split_decode_by_the_emulator(monkeypatch):
    """Pools of 48-key pages in shuffled order, GQA 4 packed, split counts 2 and 3: out
    within the fp8 tolerance of float64 of the keys gathered from the pages; a launch that
    writes nothing leaves the NaN poison."""
    from test_tuning_backward import numpy_cupy

    from kernelgen.runtime.host import emulated_kernel

    torch = pytest.importorskip("torch")
    monkeypatch.setattr(fp8_bench_module, "require_device", numpy_cupy)
    monkeypatch.setattr(fp8_bench_module, "TORCH_DEVICE", "cpu")
    monkeypatch.setattr(fp8_bench_module, "bench_kernel", lambda spec, arch: emulated_kernel(spec))
    p = ProblemDesc("e4m3", 1, 4, 1, 1, 150, 128, causal=True, page_size=48)
    bench = fp8_bench_module.Fp8Bench(p, DeviceInfo("Emulated", "9.0", 132))
    s = bench.sets[0]
    assert s["k"].shape == (4, 48, 1, 128) and s["block_table"].dtype == torch.int32
    assert sorted(s["block_table"].flatten().tolist()) == [0, 1, 2, 3]
    spec = valid_candidates(p, "sm_90")[0][0]
    assert spec == fp8_decode_spec(128, True, 4, paged_kv=True)
    for splits in (2, 3):
        bench.compile(spec)
        assert bench.check(spec, splits) is None
    assert len(bench.time(spec, 1.0, 3, min_reps=2)) >= 2
    bench.launches[spec, 3] = lambda tensors: None  # (the key _prepare made)
    assert bench.check(spec, 3) == "NaN or inf in the output"
