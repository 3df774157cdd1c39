"""The fp8 (e4m3) bench: times fp8 specs on torch ``float8_e4m3fn`` inputs with descales.

CuPy has no fp8 dtype, so the inputs are torch tensors on the GPU (torch draws them and rounds
them to e4m3), and the kernels get their bytes by raw pointer, as an fp8 call passes them
(:mod:`kernelgen.calls.fp8`): q and k in place, v as the V^T copy an fp8 call makes
(:func:`kernelgen.runtime.fp8.v_operand`, made again in each timed launch, as a call makes it)
or, for a spec with ``fp8_v_layout: kernel``, v in place (no copy), the three descales, and
the problem's variants with :func:`kernelgen.tuning.gpu.bench_variants`' values (a record
serves every value). A paged problem's k and v are pools of pages, each sequence's in shuffled
order, with its block table and key lengths (as :class:`kernelgen.tuning.gpu.CupyBench`'s); a
split-KV candidate is launched with its split count (the partials and the combine). Launches
go to torch's current stream (CuPy's while the bench's scope is entered); the events and the
timing loop are :class:`kernelgen.tuning.gpu.EventBench`'s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from kernelgen.errors import ToolchainMissingError
from kernelgen.runtime.fp8 import DESCALES, v_operand, v_operand_layout
from kernelgen.runtime.frameworks import arrays_of, device_of, launch_arg
from kernelgen.specs.forward import KernelSpec
from kernelgen.tuning.candidates import pages_per_sequence
from kernelgen.tuning.gpu import (
    EventBench,
    bench_variants,
    require_device,
    set_count,
    variant_launch_problem,
)
from kernelgen.tuning.key import DeviceInfo, ProblemDesc

TORCH_DEVICE = "cuda"  # where the inputs live (the emulated test runs the bench on "cpu")
DESCALE_RANGE = (0.5, 2.0)  # the descales are drawn uniformly from it (never all 1)
BF16_NAN = 0x7FC0  # the bit pattern that poisons out before the check
PAGING = ("block_table", "seqlens_k")  # a paged problem's arrays besides the pools
# The float64 check's slice: batch entry 0, the query heads of K/V head 0, their last rows (as
# many as keep it to this many scores) against every key.
CHECK_SCORES = 1 << 21


def import_torch() -> Any:
    """torch, which makes the fp8 inputs (ToolchainMissingError without it)."""
    try:
        import torch
    except ImportError:
        raise ToolchainMissingError(
            "tuning an fp8 problem needs torch (its inputs are torch.float8_e4m3fn tensors: "
            "CuPy has no fp8 dtype); install torch"
        ) from None
    return torch


def bench_kernel(spec: KernelSpec, arch: str) -> Any:
    """The spec's kernel for the current device (a RuntimeKernel): from the pruning step's
    cubin where it was built for ``arch``, else compiled by CuPy."""
    from kernelgen.runtime.launch import runtime_kernel
    from kernelgen.tuning.candidates import offline_cubin

    return runtime_kernel(spec, offline_cubin(spec, spec.compile_arch(arch)))


class Fp8Bench(EventBench):
    """Times fp8 specs for one fp8 problem on e4m3 inputs with descales, rotated against L2 as
    :class:`kernelgen.tuning.gpu.CupyBench`'s; checks the winner against float64."""

    def __init__(self, problem: ProblemDesc, device: DeviceInfo, seed: int = 0) -> None:

        self.cupy = require_device()
        torch = self.torch = import_torch()
        p = self.problem = problem
        self.device = device
        self.scale = 1.0 / math.sqrt(p.head_dim)
        q_shape = (p.batch, p.num_heads, p.seqlen_q, p.head_dim)
        kv_shape = (p.batch, p.num_kv_heads, p.seqlen_k, p.head_dim)
        v_shape, v_strides = v_operand_layout(*kv_shape)
        pool_shape = None
        if p.page_size:  # (pages, page_size, Hkv, D) pools, as launch_problem lays them out
            pages = pages_per_sequence(p)
            pool_shape = (p.batch * pages, p.page_size, p.num_kv_heads, p.head_dim)
        # bytes per set: q, k, v and a launch's V^T (1 byte), out (2), lse and the descales (4)
        per_set = 3 * math.prod(q_shape) + 2 * math.prod(kv_shape) + math.prod(v_shape)
        count = set_count(device, per_set + 4 * (math.prod(q_shape[:3]) + 3 * p.batch))
        generator = torch.Generator(device=TORCH_DEVICE)
        generator.manual_seed(seed)

        def e4m3(shape: tuple[int, ...]) -> Any:
            normal = torch.randn(shape, generator=generator, device=TORCH_DEVICE)
            return normal.to(torch.float8_e4m3fn)

        def descale() -> Any:
            low, high = DESCALE_RANGE
            uniform = torch.rand((p.batch, p.num_kv_heads), generator=generator,
                                 device=TORCH_DEVICE)  # fmt: skip
            return low + (high - low) * uniform

        def empty(shape: tuple[int, ...], dtype: Any) -> Any:
            return torch.empty(shape, dtype=dtype, device=TORCH_DEVICE)

        paged: dict[str, Any] = {}
        if pool_shape is not None:  # each sequence's pages in shuffled order
            order = torch.randperm(pool_shape[0], generator=generator, device=TORCH_DEVICE)
            paged = {
                "block_table": order.reshape(p.batch, -1).to(torch.int32),
                "seqlens_k": torch.full((p.batch,), p.seqlen_k, dtype=torch.int32,
                                        device=TORCH_DEVICE),
            }  # fmt: skip
        self.sets: list[dict[str, Any]] = []
        for _ in range(count):
            s = {"q": e4m3(q_shape), "k": e4m3(pool_shape or kv_shape),
                 "v": e4m3(pool_shape or kv_shape), **{name: descale() for name in DESCALES},
                 "out": empty(q_shape, torch.bfloat16), "lse": empty(q_shape[:3], torch.float32),
                 **paged}  # fmt: skip
            self.sets.append(s)
        self.variants = bench_variants(p)  # host values; the slopes and sinks also on the GPU
        self.variant_arrays = {
            name: torch.from_numpy(self.variants[name]).to(TORCH_DEVICE)
            for name in ("alibi_slopes", "sinks")
            if name in self.variants
        }
        self.arrays = arrays_of(self.sets[0]["q"])
        self.device_index = device_of(self.sets[0]["q"])
        self.tensors = [self._arguments(s) for s in self.sets]
        # host-layout kernels read V^T: its (batch, kv head, head-dim row) strides; kernels
        # that transpose V themselves read v as k
        natural = variant_launch_problem(p, self.variants)
        self.launch_problems = {
            "host": dataclasses.replace(natural, v_strides=v_strides[:3]),
            "kernel": natural,
        }
        # (spec, split count) -> its PreparedLaunch
        self.launches: dict[tuple[KernelSpec, int | None], Any] = {}
        # (spec, split count) -> its scratch buffer and the kernels' pointers into it
        self.scratch: dict[tuple[KernelSpec, int | None], tuple[Any, dict[str, Any]]] = {}

    def _arguments(self, s: dict[str, Any]) -> dict[str, Any]:
        """A set's kernel arguments by parameter name but v (each launch's): q and k as their
        e4m3 bytes."""
        uint8 = self.torch.uint8
        tensors = {"q": s["q"].view(uint8), "k": s["k"].view(uint8),
                   "out": s["out"], "lse": s["lse"], **{n: s[n] for n in DESCALES},
                   **{n: s[n] for n in PAGING if n in s}, **self.variant_arrays}  # fmt: skip
        return {name: launch_arg(self.arrays, x) for name, x in tensors.items()}

    def _launch(self, spec: Any, index: int, num_splits: int | None = None) -> None:
        """One launch on set ``index``: a host-layout spec's includes the V^T copy of the
        call's path (so that it compares with a spec that transposes V in the kernel)."""
        s, tensors = self.sets[index % len(self.sets)], self.tensors[index % len(self.sets)]
        v_bytes = s["v"].view(self.torch.uint8)
        v = v_bytes if spec.v_transposed_in_kernel else v_operand(v_bytes)
        key = self._prepare(spec, num_splits)
        _, scratch = self.scratch[key]
        self.launches[key]({**tensors, **scratch, "v": launch_arg(self.arrays, v)})

    def _prepare(self, spec: KernelSpec, num_splits: int | None) -> tuple[KernelSpec, int | None]:
        """The key of the spec's PreparedLaunch at ``num_splits`` in :attr:`launches` (split-KV;
        None: the launch's default), built on first use (the kernel, the tensor maps' checks,
        the partials' scratch: one fp32 buffer, allocated once on the inputs' device)."""
        key = (spec, num_splits if spec.split_kv else None)
        if key not in self.launches:
            kernel = bench_kernel(spec, self.device.arch)
            problem = self.launch_problems[spec.fp8_v_layout]
            prepared = self.launches[key] = kernel.prepare(problem, self.scale, key[1])
            arrays = self.arrays
            floats = arrays.empty((prepared.scratch_floats,), arrays.float32(), self.device_index)
            self.scratch[key] = (floats, prepared.scratch_pointers(arrays.pointer(floats)))
        return key

    def compile(self, spec: KernelSpec) -> None:
        """Build (or load) the spec's kernel, prepare its launch (the tensor maps' checks) and
        launch it once, outside the timed region."""
        with self.arrays.scope(self.device_index):
            self._launch(spec, 0)
            self.cupy.cuda.get_current_stream().synchronize()

    def time(
        self,
        spec: Any,
        budget_ms: float,
        num_splits: int | None = None,
        *,
        min_reps: int,
    ) -> list[float]:
        """EventBench's timing loop on torch's current stream."""
        with self.arrays.scope(self.device_index):
            return super().time(spec, budget_ms, num_splits, min_reps=min_reps)

    @property
    def check_rows(self) -> int:
        """Query rows of the check's float64 slice (all of them when the slice is small)."""
        p = self.problem
        return min(p.seqlen_q, max(1, CHECK_SCORES // (p.gqa_ratio * p.seqlen_k)))

    def check(self, spec: KernelSpec, num_splits: int | None = None) -> str | None:
        """None when out of set 0 (NaN-poisoned first) is finite and its slice (batch entry 0,
        the query heads of K/V head 0, the last :attr:`check_rows` rows) is within the fp8
        tolerance of the float64 attention of the same e4m3 inputs and descales
        (:mod:`kernelgen.references.fp8`), else why not."""
        from kernelgen.references.attention import relative_error
        from kernelgen.references.fp8 import FP8_TOLERANCE, fp8_reference

        torch, p, s = self.torch, self.problem, self.sets[0]
        with self.arrays.scope(self.device_index):
            s["out"].view(torch.int16).fill_(BF16_NAN)  # poison, so unwritten rows show up
            self._launch(spec, 0, num_splits)
            self.cupy.cuda.get_current_stream().synchronize()
        if not bool(torch.isfinite(s["out"]).all()):
            return "NaN or inf in the output"
        first, group = p.seqlen_q - self.check_rows, p.gqa_ratio

        def host(x: Any) -> Any:
            return x.cpu().numpy()

        def e4m3_bits(x: Any) -> Any:
            return host(x.view(torch.uint8))

        reference = fp8_reference(
            e4m3_bits(s["q"][:1, :group, first:]),
            e4m3_bits(self._keys(s, "k")),
            e4m3_bits(self._keys(s, "v")),
            {name: host(s[name][:1, :1]) for name in DESCALES},
            causal=p.causal,
            scale=self.scale,
            **{name: x[:group] if name in ("alibi_slopes", "sinks") else x
               for name, x in self.variants.items()},
        )  # fmt: skip
        error = relative_error(host(s["out"][:1, :group, first:].float()), reference.out)
        if error > FP8_TOLERANCE:
            return f"relative error {error:.2e} > {FP8_TOLERANCE:.2e} against float64 (fp8)"
        return None

    def _keys(self, s: dict[str, Any], name: str) -> Any:
        """k or v of batch entry 0, K/V head 0, as (1, 1, Sk, D) (a paged problem's gathered
        from its pages)."""
        p = self.problem
        if not p.page_size:
            return s[name][:1, :1]
        pages = s[name][s["block_table"][0].long()]  # (pages, page_size, Hkv, D)
        rows = pages.reshape(-1, p.num_kv_heads, p.head_dim)[: p.seqlen_k, 0]
        return rows[None, None]
