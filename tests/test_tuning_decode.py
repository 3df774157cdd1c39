"""CPU tier: the autotuner's split-KV decode candidates, split counts, records and attention()'s
use of the tuned launch (fake GPU, fake compile)."""

from __future__ import annotations

import importlib
import json
import math

import pytest
from test_api_inputs import check
from test_tuning_fakes import DEVICE, FAST, SOFTWARE, FakeBench, fake_compile, problem

from kernelgen.calls import attention as api
from kernelgen.errors import InputError
from kernelgen.runtime.launch import MAX_SPLITS
from kernelgen.tuning import (
    DeviceInfo,
    TunedLaunch,
    TuningDB,
    clear_memo,
    make_key,
    prune,
    select_launch,
    select_spec,
    tune_problem,
)
from kernelgen.tuning import gpu as tuning_gpu
from kernelgen.tuning.candidates import (
    decode_rows,
    grid_blocks,
    heuristic_splits,
    launch_problem,
    split_counts,
    valid_candidates,
)
from kernelgen.tuning.db import unwrap, wrap

autotune_module = importlib.import_module("kernelgen.tuning.autotune")  # the package's
# `autotune` attribute is the function of that name


@pytest.fixture(autouse=True)
def isolated(tuning_sandbox):
    """Every test gets its own tuning cache and memo (conftest)."""


def decode(**overrides):
    """B=1 decode: one query, 32 query heads on 8 K/V heads, a 32k-key cache."""
    fields = {"batch": 1, "num_heads": 32, "num_kv_heads": 8, "seqlen_q": 1, "seqlen_k": 32768}
    return problem(**{**fields, **overrides})


# ---- candidates -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "rows"),
    [
        ({}, 4),
        ({"seqlen_q": 16, "num_kv_heads": 8}, 64),
        ({"seqlen_q": 16, "num_kv_heads": 4}, 128),  # two 64-row tiles per K/V head
        ({"seqlen_q": 16, "num_kv_heads": 1}, 512),  # MQA: eight tiles, not 32 query heads
        ({"seqlen_q": 17, "num_kv_heads": 4}, None),  # past 16 queries and 64 rows: prefill
        ({"seqlen_q": 64, "num_kv_heads": 32}, 64),  # 64 queries of one head fill one tile
        ({"dtype": "float32"}, 4),  # the CUDA-core split kernel
        ({"seqlen_q": 1024, "seqlen_k": 1024, "num_kv_heads": 32}, None),
    ],
)
def test_decode_problems(overrides, rows):
    assert decode_rows(decode(**overrides)) == rows


def test_a_decode_step_past_one_tile_gets_packed_multi_tile_candidates():
    """16 queries on an MQA model: 512 packed rows, 64-row (and 32-row) packed split tiles."""
    specs, _ = valid_candidates(decode(seqlen_q=16, num_kv_heads=1), "sm_90")
    split = [s for s in specs if s.split_kv]
    assert split and all(s.pack_gqa for s in split)
    assert {s.block_m for s in split if s.mma == "mma_sync"} == {64, 32}
    assert {s.block_m for s in split if s.mma == "wgmma"} == {128}  # two consumer warpgroups


def test_decode_candidates_are_packed_split_specs_plus_baselines():
    specs, _ = valid_candidates(decode(), "sm_80")
    split = [s for s in specs if s.split_kv]
    assert split and all(s.pack_gqa and s.mma == "mma_sync" for s in split)
    assert {s.num_warps for s in split} == {1}  # 4 packed rows fit one warp's 16
    assert {s.block_n for s in split} == {32, 64, 128} and {s.stages for s in split} == {2, 3}
    unsplit = [s for s in specs if not s.split_kv]
    assert any(s.pack_gqa for s in unsplit)  # same tiles without split-KV
    assert any(s.block_m == 64 and not s.pack_gqa for s in unsplit)  # the prefill default
    assert len(specs) <= 20
    # a 9.0 device adds the Hopper decode grid: packed, 64-key and 128-key tiles, split or not
    hopper = [s for s in valid_candidates(decode(), "sm_90")[0] if s.mma == "wgmma"]
    assert {(s.block_n, s.split_kv) for s in hopper} == {(64, True), (64, False), (128, True),
                                                         (128, False)}  # fmt: skip
    assert all(s.pack_gqa and s.block_m == 64 and s.archs == ("sm_90a",) for s in hopper)
    # and the TMA-store epilogue's twin of each (split-KV: it stores the fp32 partials)
    twins = {(s.block_n, s.split_kv) for s in hopper if s.epilogue == "tma"}
    assert twins == {(64, True), (64, False), (128, True), (128, False)}
    assert len(hopper) == 8 and len(specs) + len(hopper) <= 28
    prefill, _ = valid_candidates(problem(), "sm_90")
    assert not any(s.split_kv or s.pack_gqa for s in prefill)


def test_float32_decode_tries_cuda_core_split_tiles():
    specs, _ = valid_candidates(decode(dtype="float32"), "sm_90")
    assert all(s.mma == "simt" for s in specs)
    split = [s for s in specs if s.split_kv]
    assert {s.block_n for s in split} == {16, 32, 64} and {s.block_m for s in split} == {16}
    kept, _ = prune(decode(dtype="float32"), DEVICE, fake_compile())
    assert kept and all(c.spec.split_kv and c.num_splits for c in kept)  # B*H=32: split


def test_wider_packs_also_try_half_the_warps():
    specs, _ = valid_candidates(decode(seqlen_q=12), "sm_90")  # 48 rows: 4 warps, and 2
    assert {s.num_warps for s in specs if s.split_kv and s.mma == "mma_sync"} == {2, 4}


def test_split_counts_surround_the_heuristic_within_the_key_tiles():
    p = decode()
    spec = next(s for s in valid_candidates(p, "sm_90")[0] if s.split_kv and s.block_n == 64)
    h = heuristic_splits(spec, p, DEVICE)
    counts = split_counts(spec, p, DEVICE)
    assert h in counts and h > 1
    assert counts == sorted({min(n, 512, MAX_SPLITS) for n in (h // 2, h, 2 * h, 4 * h)})
    short = decode(seqlen_k=200)  # 4 key tiles of 64: never more chunks than tiles
    assert max(split_counts(spec, short, DEVICE)) <= math.ceil(200 / 64)
    plain = next(s for s in valid_candidates(p, "sm_90")[0] if not s.split_kv)
    assert split_counts(plain, p, DEVICE) == [None]


def test_grid_blocks_count_heads_tiles_and_chunks():
    p = decode(batch=2)
    specs = {(s.split_kv, s.pack_gqa, s.block_m): s for s in valid_candidates(p, "sm_90")[0]}
    packed_split = specs[(True, True, 16)]
    assert grid_blocks(packed_split, p, 10) == 1 * (2 * 8) * 10  # row tiles x B*Hkv x chunks
    assert grid_blocks(specs[(False, True, 16)], p) == 2 * 8
    assert grid_blocks(specs[(False, False, 64)], p) == 2 * 32  # one tile per query head


def test_occupancy_keeps_splits_that_fill_the_gpu_and_drops_one_block_per_head():
    kept, dropped = prune(decode(), DEVICE, fake_compile())
    assert kept and all(c.spec.split_kv and c.num_splits for c in kept)
    assert all(grid_blocks(c.spec, decode(), c.num_splits) >= DEVICE.sm_count for c in kept)
    occupancy = {d.uri for d in dropped if d.stage == "occupancy"}
    assert "fa_fwd_v2_tc_bf16_d128_m16_n64_w1_s2_swz_gqa" in occupancy
    assert "fa_fwd_v2_tc_bf16_d128_m64_n64_w4_s2_swz" in occupancy


def test_a_full_grid_keeps_the_unsplit_candidates():
    p = decode(batch=64, num_kv_heads=32, seqlen_k=4096)  # 2048 heads: no need to split
    kept, _ = prune(p, DEVICE, fake_compile())
    assert any(c.num_splits is None and not c.spec.split_kv for c in kept)
    assert any(c.spec.split_kv for c in kept)


def test_a_spilling_spec_drops_all_its_launches():
    p = decode()
    victim = "fa_fwd_v2_tc_bf16_d128_m16_n64_w1_s2_swz_gqa_split"
    kept, dropped = prune(p, DEVICE, fake_compile(spills=frozenset({victim})))
    assert not any(c.spec.uri == victim for c in kept)
    resource_drops = [d for d in dropped if d.stage == "resources"]
    assert resource_drops and all(d.uri.startswith(victim + "@") for d in resource_drops)
    assert all("spill" in d.reason for d in resource_drops)


# ---- timing launches, records ------------------------------------------------------------
def favour(uri_part: str, splits: int | None):
    """A timing where the launch of ``uri_part`` with ``splits`` chunks is fastest."""

    def timing(spec, num_splits):
        if uri_part in spec.uri and num_splits == splits:
            return 0.5
        return 2.0 + (0.1 if spec.split_kv else 0.0)

    return timing


def tuned(p, timing):
    key = make_key(p, DEVICE, SOFTWARE)
    bench = FakeBench(timing=timing)
    return tune_problem(p, key, bench, compile_fn=fake_compile(), settings=FAST), bench


def test_the_winning_split_count_is_recorded_and_each_count_timed():
    p = decode()
    target = next(c for c in prune(p, DEVICE, fake_compile())[0] if c.spec.block_n == 32)
    record, bench = tuned(p, favour(target.spec.uri, target.num_splits))
    assert record.winner_launch == {"num_splits": target.num_splits}
    assert record.winner == target.spec.model_dump(mode="json")
    counts = [c["num_splits"] for c in record.candidates if c["uri"] == target.spec.uri]
    assert len(counts) == len(set(counts)) > 1  # every count of the spec timed on its own
    assert f"{target.spec.uri}@{target.num_splits}splits" in bench.checked


def test_an_unsplit_winner_records_no_split_count():
    p = decode(batch=64, num_kv_heads=32, seqlen_k=4096)
    uri = "fa_fwd_v2_tc_bf16_d128_m16_n64_w1_s2_swz_gqa"
    record, _ = tuned(p, favour(uri, None))
    assert record.winner["split_kv"] is False and record.winner_splits is None


def test_select_launch_returns_the_split_count_from_memo_and_disk(monkeypatch):
    p = decode()
    target = next(c for c in prune(p, DEVICE, fake_compile())[0] if c.spec.stages == 3)
    calls = []

    def tuner(prob, key):
        calls.append(key.id)
        return tuned(prob, favour(target.spec.uri, target.num_splits))[0]

    launch = select_launch(p, DEVICE, software=SOFTWARE, tuner=tuner)
    assert launch == TunedLaunch(target.spec, target.num_splits)
    assert select_launch(p, DEVICE, software=SOFTWARE, tuner=tuner) == launch  # memo
    clear_memo()
    assert select_launch(p, DEVICE, software=SOFTWARE, tuner=tuner) == launch  # disk
    assert select_spec(p, DEVICE, software=SOFTWARE, tuner=tuner) == target.spec
    assert len(calls) == 1


def test_records_without_a_launch_still_load(tmp_path):
    """Records written before split-KV have no winner_launch: the heuristic count applies."""
    p = problem()
    record, _ = tuned(p, lambda spec, n: 1.0)
    db = TuningDB()
    db.save(record)
    payload = unwrap(json.loads(db.path(record.key).read_text()))
    del payload["winner_launch"]
    db.path(record.key).write_text(json.dumps(wrap(payload)))
    loaded = db.load(record.key)
    assert loaded is not None and loaded.winner_launch is None and loaded.winner_splits is None


@pytest.mark.parametrize("bad", [{"num_splits": 0}, {"num_splits": "4"}, {"num_splits": True}])
def test_a_malformed_launch_is_a_miss(bad, caplog):
    record, _ = tuned(decode(), lambda spec, n: 1.0)
    db = TuningDB()
    db.save(record)
    payload = unwrap(json.loads(db.path(record.key).read_text()))
    payload["winner_launch"] = bad
    db.path(record.key).write_text(json.dumps(wrap(payload)))
    assert db.load(record.key) is None
    assert "winner_launch" in caplog.text


def test_autotune_off_uses_the_decode_heuristic(monkeypatch):
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "0")
    launch = select_launch(decode(), DEVICE, software=SOFTWARE)
    assert launch.num_splits is None  # the launch heuristic picks the count
    assert launch.spec == api.default_spec("bfloat16", 128, False, "sm_90", decode_rows=4)
    assert launch.spec.split_kv and launch.spec.pack_gqa
    prefill = select_launch(problem(), DEVICE, software=SOFTWARE)
    assert not prefill.spec.split_kv


# ---- attention() uses the tuned launch ------------------------------------------------------
@pytest.fixture
def fake_gpu(monkeypatch):
    """attention()'s tuning path on a fake sm_90 device with a fake tuner."""
    device = DeviceInfo("Fake GPU 80GB", "9.0", 132)
    monkeypatch.setattr(api, "device_arch", lambda: (90, "sm_90"))
    monkeypatch.setattr(tuning_gpu, "detect_device", lambda: device)
    monkeypatch.setattr(tuning_gpu, "detect_software", lambda: SOFTWARE)
    problems = []

    def fake_gpu_tuner():
        def tuner(prob, key):
            problems.append(prob)
            uri = "fa_fwd_v2_tc_f16_d64_m16_n32_w1_s3_swz_gqa_split"
            uri += "_paged" if prob.page_size else ""
            target = next(c for c in prune(prob, device, fake_compile())[0] if c.spec.uri == uri)
            return tuned(prob, favour(uri, target.num_splits))[0]

        return tuner

    monkeypatch.setattr(autotune_module, "gpu_tuner", fake_gpu_tuner)
    return problems


def test_attention_runs_the_tuned_split_count(fake_gpu):
    call = check(q=(1, 8, 1, 64), k=(1, 2, 4096, 64))
    spec, splits = api._untuned_or_tuned_launch(call, False, aligned=True, split=False)
    assert spec.uri == "fa_fwd_v2_tc_f16_d64_m16_n32_w1_s3_swz_gqa_split"
    assert splits is not None and splits > 1
    (prob,) = fake_gpu
    assert (prob.batch, prob.num_heads, prob.num_kv_heads, prob.seqlen_q) == (1, 8, 2, 1)
    assert (prob.seqlen_k, prob.head_dim, prob.dtype) == (4096, 64, "float16")


def test_a_caller_fixed_split_count_skips_tuning(fake_gpu):
    call = check(q=(1, 8, 1, 64), k=(1, 2, 4096, 64))
    spec, splits = api._untuned_or_tuned_launch(call, True, aligned=True, split=True)
    assert spec.split_kv and spec.pack_gqa and spec.causal and splits is None
    assert fake_gpu == []


def test_misaligned_inputs_fall_back_to_cuda_cores_untuned(fake_gpu):
    call = check(q=(1, 8, 1, 64), k=(1, 2, 4096, 64))
    spec, splits = api._untuned_or_tuned_launch(call, False, aligned=False, split=False)
    assert spec.mma == "simt" and splits is None and fake_gpu == []


# ---- paged KV caches --------------------------------------------------------------------
def test_paged_decode_has_its_own_key_and_paged_candidates():
    """Paged vs contiguous and the page size are part of the key (contiguous keys unchanged:
    no page field), and a paged problem's candidates are the decode grid with paged_kv."""
    contiguous, paged16, paged64 = decode(), decode(page_size=16), decode(page_size=64)
    ids = {make_key(p, DEVICE, SOFTWARE).id for p in (contiguous, paged16, paged64)}
    assert len(ids) == 3
    assert "page" not in make_key(contiguous, DEVICE, SOFTWARE).id
    assert make_key(paged16, DEVICE, SOFTWARE).id.split("-")[0].endswith("_page16")
    assert "page_size" not in make_key(contiguous, DEVICE, SOFTWARE).as_dict()["problem"]
    specs, _ = valid_candidates(paged64, "sm_90")
    plain, _ = valid_candidates(contiguous, "sm_90")
    assert specs and all(s.paged_kv for s in specs)
    # the Hopper decode grid keeps every key tile for any page size (a tile within one page is
    # one TMA copy, others are copied row by row with cp.async)
    assert {s.block_n for s in specs if s.mma == "wgmma"} == {64, 128}
    assert {s.block_n for s in plain if s.mma == "wgmma"} == {64, 128}
    assert [s.model_copy(update={"paged_kv": False}) for s in specs] == [
        s for s in plain if s.loop_order == "v2"
    ]
    # 16-key pages: also 16-key tiles, which lie in one page (one block-table load per tile)
    small, _ = valid_candidates(paged16, "sm_90")
    extra = {s.model_copy(update={"paged_kv": False}) for s in small} - set(plain)
    assert extra and {s.block_n for s in extra} == {16}
    assert {s.block_n for s in small if s.mma == "wgmma"} == {64, 128}
    assert autotune_module.heuristic_spec(paged16, DEVICE).paged_kv


def test_a_paged_launch_problem_addresses_a_pool_of_pages():
    p = decode(batch=3, seqlen_k=100, page_size=32)
    launch = launch_problem(p)
    kv_bytes_per_row = p.num_kv_heads * p.head_dim
    assert launch.k_strides == (32 * kv_bytes_per_row, p.head_dim, kv_bytes_per_row)
    assert (launch.seqlen_k, launch.page_size, launch.block_table_stride) == (128, 32, 4)


@pytest.mark.parametrize("page_size", [-16, 8, 40])
def test_bad_page_sizes_are_refused(page_size):
    with pytest.raises(InputError, match=f"page_size={page_size} is not allowed"):
        decode(page_size=page_size)


def test_a_paged_decode_tunes_and_records_its_winner():
    p = decode(page_size=64)
    target = next(c for c in prune(p, DEVICE, fake_compile())[0] if c.spec.split_kv)
    record, _ = tuned(p, favour(target.spec.uri, target.num_splits))
    assert record.winner["paged_kv"] is True
    assert record.winner_launch == {"num_splits": target.num_splits}


def test_a_paged_call_tunes_its_page_size(fake_gpu):
    call = check(q=(1, 8, 1, 64), k=(1, 2, 4096, 64))
    spec, splits = api._untuned_or_tuned_launch(
        call, False, aligned=True, split=False, page_size=32
    )
    assert spec.uri == "fa_fwd_v2_tc_f16_d64_m16_n32_w1_s3_swz_gqa_split_paged"
    assert splits is not None and splits > 1
    (prob,) = fake_gpu
    assert prob.page_size == 32
    api._untuned_or_tuned_launch(call, False, aligned=True, split=False, page_size=0)
    assert [p.page_size for p in fake_gpu] == [32, 0]  # its own record, not the paged one
