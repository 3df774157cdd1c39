"""Cases of context-parallel attention run in gloo process groups (tests/test_distributed.py).

A :class:`Case` makes the same global inputs on every rank (from its seed), each rank runs the
forward and backward on its shard, and saves what it got; the parent compares the unsharded
results with the float64 reference. :func:`run_cases` spawns the processes (one group for a
list of cases), with a timeout on the group's collectives and on the whole run, so that a hung
or crashed peer fails the test with a message instead of hanging the suite.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

import kernelgen
from kernelgen.distributed import Segment, Sharding, Visibility, context_parallel_attention
from kernelgen.distributed.blocks import BlockCall, plan_blocks
from kernelgen.distributed.calls import Options, block_kwargs
from kernelgen.distributed.positions import globalize
from kernelgen.distributed.ulysses import kv_repeats
from kernelgen.errors import CPUBackendWarning
from kernelgen.specs.expressions import inputs_from_arrays, parse_expression

# Expressions over global positions and heads (the arrays cover the whole sequence, S <= 64)
SCORE_MOD = "score + 0.5 * bias[h, q_idx - kv_idx + 64]"
MASK_MOD = "doc[b, q_idx] == doc[b, kv_idx]"
COLLECTIVE_TIMEOUT_S = 120  # a peer that stops answering fails its collective after this
RUN_TIMEOUT_S = 900  # the whole spawned run (all cases of one group)


@dataclass(frozen=True)
class Case:
    """One call: schedule, group size, sharding and attention options; global shapes
    (B, H, S, D) for q and (B, Hkv, S, D) for k, v; inputs of ``dtype`` from ``seed``."""

    name: str
    schedule: str
    world: int
    sharding: str = "contiguous"  # or "zigzag"; ``lengths`` give an uneven contiguous one
    total: int = 32
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 16
    batch: int = 1
    causal: bool = True
    window: tuple[int, int] | None = None
    softcap: float | None = None
    alibi: bool = False
    sinks: bool = False
    lengths: tuple[int, ...] | None = None
    layout: str = "bhsd"
    dtype: str = "float32"
    score_mod: bool = False  # SCORE_MOD: a relative bias per head
    mask_mod: bool = False  # MASK_MOD: documents packed in the sequence
    seed: int = 0

    def make_sharding(self) -> Sharding:
        if self.sharding == "zigzag":
            return Sharding.zigzag(self.total, self.world)
        return Sharding.contiguous(self.total, self.world, self.lengths)

    def inputs(self) -> dict[str, torch.Tensor]:
        """The global inputs (bhsd; q, k, v and dout in ``dtype``, slopes and sinks float32), the
        same in every process."""
        gen = torch.Generator().manual_seed(self.seed)
        b, h, hkv, s, d = self.batch, self.heads, self.kv_heads, self.total, self.head_dim

        def draw(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen)

        dtype = getattr(torch, self.dtype)
        found = {"q": draw(b, h, s, d), "k": draw(b, hkv, s, d), "v": draw(b, hkv, s, d)}
        found["dout"] = draw(b, h, s, d)
        found = {n: x.to(dtype) for n, x in found.items()}  # the float64 reference: rounded
        if self.alibi:
            found["alibi_slopes"] = torch.rand(h, generator=gen) * 0.5 + 0.1
        if self.sinks:
            found["sinks"] = draw(h)
        if self.score_mod:
            found["bias"] = draw(h, 128)
        if self.mask_mod:
            starts = torch.randint(1, s, (b, 3), generator=gen)
            found["doc"] = (torch.arange(s)[None, :, None] >= starts[:, None, :]).sum(-1).int()
        return found

    def options(self, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        """attention()'s keyword arguments of the case (the arrays from ``inputs``)."""
        kw: dict[str, Any] = {"causal": self.causal}
        if self.window is not None:
            kw["window_size"] = self.window
        if self.softcap is not None:
            kw["softcap"] = self.softcap
        for name in ("alibi_slopes", "sinks"):
            if name in inputs:
                kw[name] = inputs[name]
        arrays = {n: inputs[n] for n in ("bias", "doc") if n in inputs}
        if arrays:
            kw["mod_inputs"] = arrays
            kw["score_mod"] = SCORE_MOD if self.score_mod else None
            kw["mask_mod"] = MASK_MOD if self.mask_mod else None
        return kw


def rank_blocks(case: Case, rank: int) -> list[tuple[int, int, BlockCall]]:
    """Every block call rank ``rank`` makes for ``case``, with the (query, K/V) heads it runs
    on: the planner's calls as each schedule asks for them."""
    sharding = case.make_sharding()
    rule = Visibility.of(case.causal, case.window)
    positional = case.alibi or case.score_mod or case.mask_mod
    mine, everything = sharding.segments(rank), [Segment(0, case.total, 0)]
    if case.schedule == "ring":
        sources = [sharding.segments((rank - s) % case.world) for s in range(case.world)]
        calls = [c for keys in sources for c in plan_blocks(mine, keys, rule, positional)]
        return [(case.heads, case.kv_heads, c) for c in calls]
    if case.schedule == "allgather":
        calls = plan_blocks(mine, everything, rule, positional)
        return [(case.heads, case.kv_heads, c) for c in calls]
    kv_heads = case.kv_heads * kv_repeats(case.kv_heads, case.world) // case.world
    calls = plan_blocks(everything, everything, rule, positional)
    return [(case.heads // case.world, kv_heads, c) for c in calls]


def warm_kernels(cases: list[Case]) -> int:
    """Build here, once, the kernels the cases' ranks will run (one forward and backward call
    per distinct kernel choice), so that the spawned ranks load them from the emulator's disk
    cache instead of all building the same ones at once. Returns the calls made."""
    seen = set()
    for case in cases:
        inputs = case.inputs()
        kw_case = case.options(inputs)
        arrays = kw_case.get("mod_inputs", {})
        declared = inputs_from_arrays(arrays)
        expressions = {
            kind: globalize(parse_expression(kind, kw_case[kind], declared).text)
            for kind in ("score_mod", "mask_mod")
            if kw_case.get(kind)
        }
        for rank in range(case.world):
            for heads, kv_heads, call in rank_blocks(case, rank):
                slopes = torch.full((case.batch, heads), 0.25) if case.alibi else None
                options = Options(scale=case.head_dim**-0.5, softcap=case.softcap, alibi=slopes,
                                  mod_inputs=arrays, **expressions)  # fmt: skip
                kw = block_kwargs(call, options, torch.device("cpu"))
                # what picks the kernels: dtype and head dim (fixed here), the GQA group and rows
                # (decode packing), causal, the variants and expressions present
                texts = (kw.get("score_mod"), kw.get("mask_mod"))
                key = (case.dtype, heads // kv_heads, call.rows, call.causal, tuple(sorted(kw)),
                       texts)  # fmt: skip
                if key in seen:
                    continue
                seen.add(key)
                dtype = getattr(torch, case.dtype)
                q = torch.randn(case.batch, heads, call.rows, case.head_dim).to(dtype)
                k, v = (
                    torch.randn(case.batch, kv_heads, call.keys, case.head_dim).to(dtype)
                    for _ in "kv"
                )
                out, lse = kernelgen.attention(q, k, v, return_lse=True, **kw)
                kernelgen.attention_backward(torch.randn_like(q), q, k, v, out, lse, **kw)
    return len(seen)


def run_case(case: Case, rank: int) -> dict[str, Any]:
    """This rank's forward and backward of ``case``: its out, lse and gradients (bhsd)."""
    sharding = case.make_sharding()
    inputs = case.inputs()
    local = {n: sharding.shard(inputs[n], rank).clone() for n in ("q", "k", "v", "dout")}
    leaves = {n: local[n].requires_grad_() for n in ("q", "k", "v")}
    kw = case.options(inputs)
    if case.sinks:
        kw["sinks"] = leaves["sinks"] = inputs["sinks"].clone().requires_grad_()
    q, k, v = leaves["q"], leaves["k"], leaves["v"]
    dout = local["dout"]
    if case.layout == "bshd":
        q, k, v, dout = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))
    start = time.perf_counter()
    out, lse = context_parallel_attention(
        q, k, v, schedule=case.schedule, sharding=sharding, return_lse=True,
        layout=case.layout, **kw,
    )  # fmt: skip
    forward_s = time.perf_counter() - start
    start = time.perf_counter()
    (out * dout).sum().backward()
    backward_s = time.perf_counter() - start
    if case.layout == "bshd":
        out = out.transpose(1, 2)
    result = {name: leaf.grad.detach().clone() for name, leaf in leaves.items()}
    result.update(out=out.detach().clone(), lse=lse.clone(), forward_s=forward_s,
                  backward_s=backward_s)  # fmt: skip
    return result


def _worker(rank: int, world: int, init_file: str, cases: list[dict], out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=CPUBackendWarning)  # once per rank: noise
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        for fields in cases:
            case = Case(**fields)
            try:
                result = run_case(case, rank)
            except Exception:
                result = {"error": traceback.format_exc()}
                _save(result, Path(out_dir) / f"{case.name}.{rank}.pkl")
                raise
            _save(result, Path(out_dir) / f"{case.name}.{rank}.pkl")
    finally:
        dist.destroy_process_group()


def _save(result: dict[str, Any], path: Path) -> None:
    """A rank's result as NumPy arrays (float32 copies of the tensors, with their dtype names)
    and scalars, pickled: a spawned rank's torch.save of its tensors was once read back by the
    parent with a storage record that did not match its size (seen under a loaded pytest-xdist
    run, not reproduced alone)."""
    plain = {
        name: ("tensor", value.detach().float().numpy().copy(), str(value.dtype))
        if isinstance(value, torch.Tensor)
        else ("value", value, None)
        for name, value in result.items()
    }
    path.write_bytes(pickle.dumps(plain))


def _load(path: Path) -> dict[str, Any]:
    """What :func:`_save` wrote, tensors rebuilt in their dtype (exact: they were widened)."""
    plain = pickle.loads(path.read_bytes())
    return {
        name: torch.from_numpy(value).to(getattr(torch, dtype.removeprefix("torch.")))
        if kind == "tensor"
        else value
        for name, (kind, value, dtype) in plain.items()
    }


def run_cases(cases: list[Case], world: int, timeout_s: float = RUN_TIMEOUT_S) -> dict[str, list]:
    """Run ``cases`` (all of group size ``world``) in ``world`` spawned gloo processes; returns
    each case's per-rank results. Raises RuntimeError when a process fails or the run takes
    longer than ``timeout_s`` (the processes are then terminated)."""
    assert all(c.world == world for c in cases)
    with tempfile.TemporaryDirectory(prefix="kg-dist-") as tmp:
        init_file = os.path.join(tmp, "init")
        context = mp.start_processes(
            _worker,
            args=(world, init_file, [asdict(c) for c in cases], tmp),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the {world}-process run of {[c.name for c in cases]} took longer "
                        f"than {timeout_s:.0f} s: a peer hung (terminated)"
                    )
        except ProcessException as exc:
            raise RuntimeError(f"a rank of the {world}-process run failed:\n{exc}") from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
        return {
            c.name: [_load(Path(tmp) / f"{c.name}.{r}.pkl") for r in range(world)] for c in cases
        }
