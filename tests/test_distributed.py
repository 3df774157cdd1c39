"""Context-parallel attention (kernelgen.distributed, docs/distributed.md).

CPU tier: shardings, the block planner against a brute-force count of every visible pair, the
cost model, bench/distributed.py's arguments and --dry-run, the argument checks.
Emulation tier: each schedule in one process (a group of one), then in spawned gloo groups of
2 and 4 processes (tests/distributed_cases.py; marked ``distributed``, in the default run:
``-m "not distributed"`` leaves them out), forward and backward against the float64 reference
and single-process ``kernelgen.attention``. Each group runs all its cases in one spawn, with a
timeout on its collectives and on the whole run; the kernels are built first in this process.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from conftest import ROOT

from kernelgen.distributed import Segment, Sharding, Visibility, plan_blocks, plan_pair
from kernelgen.distributed.blocks import BlockCall, visible_pairs
from kernelgen.distributed.cost import (
    H100_BF16,
    INFINIBAND_NDR,
    NVLINK_H100,
    Link,
    Problem,
    break_even_length,
    schedule_costs,
)
from kernelgen.errors import InputError
from kernelgen.references.attention import LSE_TOLERANCE, OUT_TOLERANCE, relative_error

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

EMULATED = [
    pytest.mark.emulate,
    pytest.mark.filterwarnings("ignore::kernelgen.errors.CPUBackendWarning"),
]


# ---- shardings -------------------------------------------------------------------------------
def test_contiguous_sharding_equal_and_given_lengths():
    even = Sharding.contiguous(10, 3)
    assert even.runs == (((0, 3),), ((3, 3),), ((6, 4),))
    assert [even.length(r) for r in range(3)] == [3, 3, 4] and even.total == 10
    given = Sharding.contiguous(10, 3, [0, 7, 3])
    assert given.segments(0) == [] and given.positions(1) == list(range(7))
    assert given.segments(2) == [Segment(7, 3, 0)]


def test_zigzag_sharding_holds_a_chunk_and_its_mirror():
    z = Sharding.zigzag(16, 4)  # chunks of 2
    assert z.runs[0] == ((0, 2), (14, 2)) and z.runs[3] == ((6, 2), (8, 2))
    assert z.positions(1) == [2, 3, 12, 13]
    assert z.segments(1) == [Segment(2, 2, 0), Segment(12, 2, 2)]
    odd = Sharding.zigzag(30, 2)  # chunks 7, 8, 7, 8
    assert [odd.length(r) for r in range(2)] == [15, 15] and odd.total == 30


@pytest.mark.parametrize(
    "sharding",
    [Sharding.contiguous(13, 3), Sharding.zigzag(13, 3), Sharding.contiguous(13, 3, [5, 0, 8])],
    ids=["contiguous", "zigzag", "uneven"],
)
def test_shard_and_unshard_round_trip(sharding):
    x = torch.arange(2 * 13 * 3).reshape(2, 13, 3)
    shards = [sharding.shard(x, r, dim=1) for r in range(3)]
    assert [s.shape[1] for s in shards] == [sharding.length(r) for r in range(3)]
    for r, s in enumerate(shards):
        assert s[0, :, 0].tolist() == [3 * p for p in sharding.positions(r)]
    assert torch.equal(sharding.unshard(shards, dim=1), x)
    arrays = [sharding.shard(x.numpy(), r, dim=1) for r in range(3)]
    np.testing.assert_array_equal(sharding.unshard(arrays, dim=1), x.numpy())


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Sharding.contiguous(10, 3, [5, 5]), "lengths"),
        (lambda: Sharding.contiguous(10, 2, [11, -1]), "lengths"),
        (lambda: Sharding.contiguous(10, 0), "world"),
        (lambda: Sharding((((0, 4),), ((5, 5),))), "tile"),
        (lambda: Sharding((((0, 6),), ((5, 5),))), "tile"),
        (lambda: Sharding.contiguous(8, 2).shard(torch.zeros(1, 1, 9, 1), 0), "positions"),
        (lambda: Sharding.contiguous(8, 2).unshard([torch.zeros(1, 1, 4, 1)]), "2 ranks"),
    ],
)
def test_bad_shardings_raise(make, match):
    with pytest.raises(InputError, match=match):
        make()


# ---- the block planner -----------------------------------------------------------------------
def _local_visible(call: BlockCall, i: int, j: int) -> bool:
    """attention()'s rule inside one call: bottom-right aligned causal and window."""
    diagonal = i + call.keys - call.rows
    left, right = call.window if call.window is not None else (-1, -1)
    if call.causal and j > diagonal:
        return False
    return (left < 0 or j >= diagonal - left) and (right < 0 or j <= diagonal + right)


def _covered_pairs(sharding, rank, src, rule, positional):
    """The global (query, key) pairs the calls of (rank, src) see, with multiplicity."""
    q_pos, k_pos = sharding.positions(rank), sharding.positions(src)
    seen = Counter()
    for call in plan_blocks(sharding.segments(rank), sharding.segments(src), rule, positional):
        count = 0
        for i, j in itertools.product(range(call.rows), range(call.keys)):
            if _local_visible(call, i, j):
                seen[q_pos[call.q_rows[0] + i], k_pos[call.k_rows[0] + j]] += 1
                count += 1
        assert visible_pairs(call) == count
        if positional:  # ALiBi reads positions: every call covers consecutive ones
            assert call.contiguous
            assert q_pos[call.q_rows[0] : call.q_rows[1]] == list(
                range(call.q_start, call.q_start + call.rows)
            )
    return seen


SHARDINGS = {
    "contiguous": Sharding.contiguous(23, 3),
    "zigzag": Sharding.zigzag(23, 3),
    "uneven": Sharding.contiguous(23, 4, [9, 0, 3, 11]),
    "zigzag-4": Sharding.zigzag(32, 4),
}
RULES = [Visibility(left, right) for left in (-1, 0, 2, 7) for right in (-1, 0, 3)]


@pytest.mark.parametrize("name", SHARDINGS)
@pytest.mark.parametrize("positional", [False, True], ids=["plain", "positional"])
def test_the_calls_see_every_visible_pair_once(name, positional):
    sharding = SHARDINGS[name]
    for rule in RULES:
        for rank, src in itertools.product(range(sharding.world), repeat=2):
            want = Counter(
                (a, b)
                for a in sharding.positions(rank)
                for b in sharding.positions(src)
                if (rule.left < 0 or b >= a - rule.left) and (rule.right < 0 or b <= a + rule.right)
            )
            assert _covered_pairs(sharding, rank, src, rule, positional) == want, (rule, rank, src)


def test_a_block_on_the_diagonal_is_a_causal_call():
    call = plan_pair(Segment(8, 8, 0), Segment(8, 8, 0), Visibility.of(True, None))
    assert (call.kind, call.causal, call.window, call.aligned) == ("diagonal", True, None, True)
    full = plan_pair(Segment(8, 8, 0), Segment(0, 8, 0), Visibility.of(True, None))
    assert (full.kind, full.causal, full.window, full.aligned) == ("full", False, None, False)
    assert plan_pair(Segment(0, 8, 0), Segment(8, 8, 0), Visibility.of(True, None)) is None
    # keys past the last query are cut: the diagonal lands on the last key kept
    cut = plan_pair(Segment(4, 8, 0), Segment(0, 16, 0), Visibility.of(True, None))
    assert (cut.k_rows, cut.kind, cut.aligned) == ((0, 12), "diagonal", True)
    # a window that starts inside the block: the local window is shifted by delta = qe - ke
    window = plan_pair(Segment(16, 8, 0), Segment(8, 8, 0), Visibility.of(True, (10, 0)))
    assert (window.kind, window.causal, window.window) == ("partial", False, (2, 8))


def test_zigzag_ring_steps_are_one_call_of_equal_work():
    sharding, rule = Sharding.zigzag(64, 4), Visibility.of(True, None)
    for rank in range(4):
        work = []
        for step in range(4):
            src = (rank - step) % 4
            calls = plan_blocks(sharding.segments(rank), sharding.segments(src), rule, False)
            assert len(calls) == (3 if step == 0 else 1)
            work.append(sum(visible_pairs(c) for c in calls))
        assert work[1:] == [128] * 3  # half the queries against all keys, or all against half


def test_contiguous_causal_ring_rank_0_works_at_step_0_only():
    sharding, rule = Sharding.contiguous(64, 4), Visibility.of(True, None)
    calls = [
        plan_blocks(sharding.segments(0), sharding.segments(src), rule, False)
        for src in (0, 3, 2, 1)  # the blocks rank 0 sees at steps 0..3
    ]
    assert [len(c) for c in calls] == [1, 0, 0, 0] and calls[0][0].kind == "diagonal"


def test_expressions_are_shifted_to_global_positions():
    from kernelgen.distributed.positions import globalize, with_alibi
    from kernelgen.specs.expressions import ModInput, parse_mask_mod, parse_score_mod

    text = globalize("doc[b, q_idx] == doc[b, kv_idx] and h < 2")
    assert text == "doc[b, q_idx + cp_pos[0]] == doc[b, kv_idx + cp_pos[1]] and h + cp_pos[2] < 2"
    inputs = [ModInput("doc", "int32", 2), ModInput("cp_pos", "int32", 1)]
    assert parse_mask_mod(text, inputs).uses("cp_pos")
    both = with_alibi(globalize("score * 2"))
    assert both == "(score * 2) - cp_alibi[b, h] * abs(q_idx - kv_idx + cp_pos[0] - cp_pos[1])"
    parse_score_mod(both, [ModInput("cp_alibi", "float32", 2), inputs[1]])


# ---- the cost model --------------------------------------------------------------------------
def test_break_even_without_latency_is_the_closed_form():
    """Non-causal: 4 B H L^2 d / R = 2 e B Hkv L d / BW, so L = e Hkv R / (2 H BW)."""
    link = Link("ideal", 450e9, 0.0)
    for heads, kv_heads in ((32, 32), (32, 8)):
        problem = Problem(1024, 8, heads=heads, kv_heads=kv_heads, causal=False)
        want = 2 * kv_heads * H100_BF16.flops / (2 * heads * link.bandwidth)
        assert break_even_length(problem, H100_BF16, link) == pytest.approx(want)
        zigzag = Problem(1024, 8, heads=heads, kv_heads=kv_heads, causal=True)
        assert break_even_length(zigzag, H100_BF16, link) == pytest.approx(2 * want)


def test_cost_model_figures():
    p = Problem(131072, 8)  # Llama-3-8B-like attention, zigzag causal
    ring = schedule_costs(p, H100_BF16, NVLINK_H100, "ring")
    assert ring.hidden == (True, True)
    assert ring.time[0] == pytest.approx(p.total_flops() / 8 / H100_BF16.flops, rel=1e-9)
    gather = schedule_costs(p, H100_BF16, INFINIBAND_NDR, "allgather")
    assert gather.memory[0] == p.kv_bytes(131072) and gather.time[0] > ring.time[0]
    with pytest.raises(ValueError, match="schedule"):
        schedule_costs(p, H100_BF16, NVLINK_H100, "tree")


def test_the_docs_table_is_the_models():
    """docs/distributed.md's figures at 8 GPUs come from bench.distributed --dry-run's model."""
    from bench import distributed as bd

    text = (ROOT / "docs" / "distributed.md").read_text()
    for seqlen in (131072, 1048576):
        for link in ("nvlink", "ib"):
            args = bd.parse_args(["--dry-run", "--seqlen", str(seqlen), "--link", link])
            for schedule in ("ring", "allgather", "ulysses"):
                m = bd.model(args, schedule, seqlen, 8)
                row = f"| {seqlen:,} | {bd.LINKS[link].name} | {schedule} |"
                assert row in text, row
                line = next(x for x in text.splitlines() if x.startswith(row))
                assert f"{m['model_forward_ms']:,.1f}" in line, (line, m)
                assert f"{m['model_backward_ms']:,.1f}" in line, (line, m)
                memory = m["model_extra_memory_gb"]
                assert f"| {memory[0]:.2f} / {memory[1]:.2f} |" in line, (line, m)


# ---- bench/distributed.py --------------------------------------------------------------------
def test_bench_arguments():
    from bench import distributed as bd

    args = bd.parse_args([])
    assert args.schedule == ["ring", "allgather", "ulysses"] and args.seqlen == [131072]
    assert args.causal and args.backward and not args.dry_run and args.sharding == "zigzag"
    args = bd.parse_args(["--schedule", "ring", "--seqlen", "4096", "--no-causal", "--world", "4"])
    assert (args.schedule, args.seqlen, args.causal, args.world) == (["ring"], [4096], False, 4)
    for bad in (["--heads", "30", "--kv-heads", "8"], ["--seqlen", "0"], ["--schedule", "tree"]):
        with pytest.raises(SystemExit):
            bd.parse_args(bad)


def test_bench_dry_run_prints_the_plan_and_the_model(capsys):
    from bench import distributed as bd

    args = bd.parse_args(["--dry-run", "--world", "4", "--seqlen", "8192", "--sharding",
                          "contiguous"])  # fmt: skip
    assert bd.main(["--dry-run", "--world", "4", "--seqlen", "8192", "--sharding",
                    "contiguous"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "ring break-even (fwd):" in text and "ulysses" in text
    ring = bd.plan(args, "ring", 8192, 4)
    assert ring["calls_per_step"][0] == [1, 0, 0, 0]  # rank 0: the diagonal only
    assert ring["imbalance"] == pytest.approx(1.75, rel=1e-3)  # rank 3: 3.5 blocks of 8
    zig = bd.plan(bd.parse_args(["--world", "4"]), "ring", 8192, 4)
    assert zig["imbalance"] == pytest.approx(1.0)


@pytest.mark.distributed
@pytest.mark.emulate
def test_bench_runs_under_torchrun_on_the_cpu(tmp_path):
    from distributed_cases import Case, warm_kernels

    warm_kernels([Case(s, s, 2, heads=2, kv_heads=1) for s in ("ring", "allgather", "ulysses")])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "bench.distributed", "--cpu", "--seqlen", "32",
               "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--warmup", "1",
               "--repeats", "1", "--out", str(tmp_path)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]))
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [
        line for line in done.stdout.splitlines() if re.match(r"(ring|allgather|ulysses) ", line)
    ]
    assert len(rows) == 3, done.stdout
    for line in rows[1:]:  # every schedule's out agrees with the first's
        assert float(line.rsplit(" ", 1)[1]) < 1e-5, line
    assert len(list(tmp_path.glob("*-distributed-w2.json"))) == 1


# ---- argument checks -------------------------------------------------------------------------
def _group(rank: int, world: int):
    from kernelgen.distributed.comm import Group

    return Group(None, rank, world)


def _setup(q, k, v, group, **kw):
    from kernelgen.calls.variant_inputs import VariantArgs
    from kernelgen.distributed.attention import _setup

    options = dict(sharding=None, schedule="ring", causal=True, scale=None)
    variants = {name: kw.pop(name) for name in list(kw) if name not in options}
    options.update(kw)
    return _setup(q, k, v, group, **options, variants=VariantArgs(**variants))


def test_the_checks_name_the_problem():
    q, kv = torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 8, 16)
    setup = _setup(q, kv, kv, _group(1, 2))
    assert setup.sharding == Sharding.contiguous(16, 2) and setup.rule == Visibility(-1, 0)
    assert setup.options.scale == 0.25 and setup.kv_heads == 2
    with pytest.raises(InputError, match=r"ulysses.*6 query heads over 4 ranks"):
        _setup(torch.zeros(1, 6, 8, 16), kv, kv, _group(0, 4), schedule="ulysses")
    with pytest.raises(InputError, match="q holds 8 positions on rank 1; the zigzag sharding"):
        _setup(q, kv, kv, _group(1, 2), sharding=Sharding.zigzag(20, 2))
    with pytest.raises(InputError, match="sharding is for 3 ranks"):
        _setup(q, kv, kv, _group(0, 2), sharding=Sharding.contiguous(24, 3))
    with pytest.raises(InputError, match="window_size"):
        _setup(q, kv, kv, _group(0, 2), window_size=(-2, 0))
    with pytest.raises(InputError, match="sinks"):
        _setup(q, kv, kv, _group(0, 2), sinks=torch.zeros(3))
    with pytest.raises(InputError, match="divisible"):
        _setup(q, torch.zeros(1, 3, 8, 16), torch.zeros(1, 3, 8, 16), _group(0, 2))
    with pytest.raises(InputError, match=r"'cp_doc'.*reserved"):
        _setup(q, kv, kv, _group(0, 2), mask_mod="cp_doc[q_idx] > 0",
               mod_inputs={"cp_doc": torch.zeros(16, dtype=torch.int32)})  # fmt: skip
    with pytest.raises(InputError, match="mask_mod"):
        _setup(q, kv, kv, _group(0, 2), mask_mod="q_idx + 1")  # not a boolean
    setup = _setup(q, kv, kv, _group(0, 2), score_mod="score + 0.1 * (q_idx - kv_idx)")
    assert setup.options.score_mod == "score + 0.1 * (q_idx + cp_pos[0] - (kv_idx + cp_pos[1]))"
    empty = torch.zeros(1, 4, 0, 16)  # a rank may hold no position
    assert _setup(empty, empty[:, :2], empty[:, :2], _group(0, 2),
                  sharding=Sharding.contiguous(8, 2, [0, 8])).world == 2  # fmt: skip


def test_refused_arguments_and_an_uninitialized_group():
    from kernelgen.distributed import context_parallel_attention

    q = torch.zeros(1, 2, 8, 16)
    for name in ("mask", "block_mask", "seqlens_k", "num_splits"):
        with pytest.raises(InputError, match=f"{name}: not supported by context-parallel"):
            context_parallel_attention(q, q, q, **{name: 1})
    with pytest.raises(TypeError, match="unexpected argument 'dropout'"):
        context_parallel_attention(q, q, q, dropout=0.1)
    with pytest.raises(InputError, match="schedule='tree'"):
        context_parallel_attention(q, q, q, schedule="tree")
    if not dist.is_initialized():
        with pytest.raises(InputError, match="init_process_group"):
            context_parallel_attention(q, q, q)


# ---- one process (a group of one) ------------------------------------------------------------
@pytest.fixture
def group_of_one(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["ring", "allgather", "ulysses"])
@pytest.mark.usefixtures("group_of_one")
def test_a_group_of_one_is_plain_attention(schedule):
    import kernelgen
    from kernelgen.distributed import context_parallel_attention

    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, 20, 16, generator=gen).requires_grad_()
    k, v = (torch.randn(1, 2, 20, 16, generator=gen).requires_grad_() for _ in "kv")
    sinks = torch.randn(4, generator=gen).requires_grad_()
    kw = dict(causal=True, window_size=(6, 0), sinks=sinks)
    out, lse = context_parallel_attention(q, k, v, schedule=schedule, return_lse=True, **kw)
    want_out, want_lse = kernelgen.attention(*(x.detach() for x in (q, k, v)), return_lse=True,
                                             **dict(kw, sinks=sinks.detach()))  # fmt: skip
    assert relative_error(out.detach().numpy(), want_out.numpy()) <= 1e-6
    assert np.abs(lse.numpy() - want_lse.numpy()).max() <= 1e-5
    dout = torch.randn(out.shape, generator=gen)
    (out * dout).sum().backward()
    want = kernelgen.attention_backward(dout, *(x.detach() for x in (q, k, v)), want_out,
                                        want_lse, **dict(kw, sinks=sinks.detach()))  # fmt: skip
    for got, expected in zip((q.grad, k.grad, v.grad, sinks.grad), want, strict=True):
        assert relative_error(got.numpy(), expected.numpy()) <= 1e-5


for _mark in EMULATED:
    test_a_group_of_one_is_plain_attention = _mark(test_a_group_of_one_is_plain_attention)


# ---- the docs' two-process example, run as a script ----------------------------------------
@pytest.mark.distributed
@pytest.mark.emulate
def test_the_docs_two_process_example_runs(tmp_path):
    text = (ROOT / "docs" / "distributed.md").read_text()
    script = re.search(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL).group(1)
    assert "mp.spawn" in script
    path = tmp_path / "two_ranks.py"
    path.write_text(script)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]))
    done = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    assert [line[:6] for line in lines] == ["rank 0", "rank 1"], done.stdout
    for line in lines:
        error = float(re.search(r"= ([0-9.e+-]+),", line).group(1))
        assert error < 1e-5 and "dq (1, 2, 16, 16)" in line, line


# ---- spawned gloo groups ---------------------------------------------------------------------
def _cases(world: int) -> list:
    from distributed_cases import Case

    if world == 2:
        return [
            Case("ring-causal", "ring", 2),  # rank 0 skips step 1
            Case("ring-zigzag-gqa", "ring", 2, sharding="zigzag", heads=4, kv_heads=2),
            Case("ring-zigzag-odd-chunks", "ring", 2, sharding="zigzag", total=30),
            Case("ring-window-sinks", "ring", 2, window=(5, 0), sinks=True),
            Case(
                "ring-two-sided-alibi-softcap",
                "ring",
                2,
                causal=False,
                window=(3, 6),
                alibi=True,
                softcap=2.0,
            ),
            Case("ring-full-bshd", "ring", 2, causal=False, layout="bshd", kv_heads=1),
            Case(
                "ring-zigzag-f16-batch2",
                "ring",
                2,
                sharding="zigzag",
                dtype="float16",
                batch=2,
                alibi=True,
            ),
            Case("ring-uneven", "ring", 2, lengths=(20, 12), causal=False, window=(9, -1)),
            Case(
                "allgather-zigzag-gqa-alibi",
                "allgather",
                2,
                sharding="zigzag",
                heads=4,
                kv_heads=1,
                alibi=True,
            ),
            Case(
                "allgather-uneven-window-sinks",
                "allgather",
                2,
                lengths=(20, 12),
                window=(7, 0),
                sinks=True,
            ),
            Case("ulysses-gqa", "ulysses", 2, heads=4, kv_heads=2),
            Case(
                "ring-zigzag-documents-bias",
                "ring",
                2,
                sharding="zigzag",
                heads=4,
                kv_heads=2,
                score_mod=True,
                mask_mod=True,
            ),
            Case(
                "ring-bias-alibi-window",
                "ring",
                2,
                causal=False,
                window=(4, 7),
                alibi=True,
                score_mod=True,
            ),
            Case(
                "allgather-documents-alibi",
                "allgather",
                2,
                sharding="zigzag",
                alibi=True,
                mask_mod=True,
            ),
            Case(
                "ulysses-bias-heads",
                "ulysses",
                2,
                heads=4,
                kv_heads=2,
                score_mod=True,
                mask_mod=True,
            ),
            Case(
                "ulysses-zigzag-bshd-all",
                "ulysses",
                2,
                sharding="zigzag",
                heads=4,
                kv_heads=1,
                sinks=True,
                alibi=True,
                window=(6, 0),
                layout="bshd",
            ),
        ]
    return [
        Case("ring-causal-4", "ring", 4, total=48),  # rank 0 works at step 0 only
        Case("ring-zigzag-4", "ring", 4, sharding="zigzag", total=64, heads=4, kv_heads=2),
        Case("ring-zigzag-alibi-4", "ring", 4, sharding="zigzag", alibi=True, sinks=True),
        Case("ring-empty-rank-4", "ring", 4, lengths=(0, 14, 10, 8), window=(9, 0)),
        Case("allgather-empty-rank-4", "allgather", 4, lengths=(0, 14, 10, 8), sinks=True),
        Case(
            "allgather-zigzag-4", "allgather", 4, sharding="zigzag", total=40, heads=4, kv_heads=2
        ),
        Case("ulysses-4", "ulysses", 4, heads=4, kv_heads=2, window=(5, 0)),  # K/V repeated
        Case(
            "ring-zigzag-documents-4",
            "ring",
            4,
            sharding="zigzag",
            total=48,
            mask_mod=True,
            score_mod=True,
            sinks=True,
        ),
        Case("ulysses-bias-4", "ulysses", 4, heads=4, kv_heads=1, score_mod=True),
        Case(
            "ulysses-uneven-4",
            "ulysses",
            4,
            heads=4,
            kv_heads=4,
            lengths=(0, 14, 10, 8),
            causal=False,
            alibi=True,
        ),
    ]


def _reference_options(kw: dict) -> tuple[dict, dict]:
    """The float64 reference's keyword arguments for attention()'s ``kw`` (expressions as
    NumPy callables over global indices), and the backward's extra ones."""
    from kernelgen.references.expressions import evaluate
    from kernelgen.specs.expression_grad import score_mod_grad_callable
    from kernelgen.specs.expressions import inputs_from_arrays, parse_mask_mod, parse_score_mod

    plain = {n: x for n, x in kw.items() if n not in ("score_mod", "mask_mod", "mod_inputs")}
    ref = {n: x.numpy() if isinstance(x, torch.Tensor) else x for n, x in plain.items()}
    arrays = {n: x.numpy() for n, x in (kw.get("mod_inputs") or {}).items()}
    declared, grad = inputs_from_arrays(arrays), {}
    if kw.get("score_mod"):
        score = parse_score_mod(kw["score_mod"], declared)
        ref["score_mod"] = lambda s, b, h, q, k: evaluate(
            score, score=s, b=b, h=h, q_idx=q, kv_idx=k, inputs=arrays
        )
        grad["score_mod_grad"] = score_mod_grad_callable(score, arrays)
    if kw.get("mask_mod"):
        mask = parse_mask_mod(kw["mask_mod"], declared)
        ref["mask_mod"] = lambda b, h, q, k: evaluate(
            mask, b=b, h=h, q_idx=q, kv_idx=k, inputs=arrays
        )
    return ref, grad


def _errors(case, results) -> dict[str, float]:
    """The case's errors: out and gradients (relative Frobenius) and lse (absolute) against the
    float64 reference, and out against single-process kernelgen.attention."""
    import kernelgen
    from kernelgen.references import attention as reference

    sharding, inputs = case.make_sharding(), case.inputs()
    kw = case.options(inputs)
    kw64, grad_kw = _reference_options(kw)
    wide = {n: inputs[n].double().numpy() for n in ("q", "k", "v", "dout")}
    want_out, want_lse = reference.naive_attention(wide["q"], wide["k"], wide["v"], **kw64)
    grads = reference.attention_backward(wide["dout"], wide["q"], wide["k"], wide["v"], **kw64,
                                         **grad_kw)  # fmt: skip
    out = sharding.unshard([r["out"] for r in results]).float().numpy()
    lse = sharding.unshard([r["lse"] for r in results]).numpy()
    single = kernelgen.attention(inputs["q"], inputs["k"], inputs["v"], **kw).float().numpy()
    errors = {
        "out": relative_error(out, want_out),
        "lse": float(np.max(np.abs(lse - want_lse))),
        "out_vs_single": relative_error(out, single),
    }
    for name, want in (("q", grads.dq), ("k", grads.dk), ("v", grads.dv)):
        got = sharding.unshard([r[name] for r in results]).float().numpy()
        errors[f"d{name}"] = relative_error(got, want)
    if case.sinks:  # each rank's share, summed over the group
        errors["dsinks"] = relative_error(sum(r["sinks"] for r in results).numpy(), grads.dsinks)
    return errors


def _check_group(world: int) -> None:
    import distributed_cases

    cases = _cases(world)
    distributed_cases.warm_kernels(cases)
    results = distributed_cases.run_cases(cases, world)
    table, failed = [], []
    for case in cases:
        errors = _errors(case, results[case.name])
        table.append(f"{case.name:<34} " + " ".join(f"{k}={v:.1e}" for k, v in errors.items()))
        limit = OUT_TOLERANCE[case.dtype]
        bad = {k: v for k, v in errors.items() if not v <= (LSE_TOLERANCE if k == "lse" else limit)}
        if bad or any(not np.isfinite(r["out"].numpy()).all() for r in results[case.name]):
            failed.append(case.name)
    print("\n".join(table))
    assert not failed, f"{failed} out of tolerance:\n" + "\n".join(table)


@pytest.mark.distributed
def test_two_ranks_match_the_reference():
    _check_group(2)


@pytest.mark.distributed
def test_four_ranks_match_the_reference():
    _check_group(4)


for _mark in EMULATED:
    test_two_ranks_match_the_reference = _mark(test_two_ranks_match_the_reference)
    test_four_ranks_match_the_reference = _mark(test_four_ranks_match_the_reference)
