"""Engines: how a kernel computes (docs/design.md, "Families and engines"), one row each.

Everything that depends on the engine a spec names with ``mma:`` is read from its row here:
the tensor-core and Hopper facts, the devices that run it and the target it compiles for, the
SASS its kernels must show, the register budget of its accumulators, the tag in kernel names.
No other module compares ``spec.mma`` with an engine's name (tests/test_engines.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

EngineName = Literal["simt", "mma_sync", "wgmma"]


@dataclass(frozen=True)
class Engine:
    """One engine's facts."""

    name: str
    uri_tag: str  # in a forward kernel's name after the loop order ("" for none)
    description: str  # what a generated file's header says the kernel runs on
    dtypes: tuple[str, ...]  # element types it computes in
    tensor_cores: bool  # mma.sync or wgmma: 16-bit operands, modelled by the static model
    chunk_bytes: int  # rows move in chunks of this many bytes (cp.async, TMA); 0: elements
    warp_specialized: bool  # producer and consumer warpgroups, TMA tensor maps, setmaxnreg
    block_sparse: bool  # may visit only the key tiles a block mask lists
    min_capability: int  # oldest compute capability that runs it
    exact_capability: int | None  # the only capability that runs it (arch-specific code)
    arch_target: str | None  # the arch it always compiles for (None: the device's own)
    required_sass: tuple[str, ...]  # instruction families its compiled kernels must show
    max_accumulators: int  # fp32 registers per thread for its score and output slices
    default_stages: int  # K/V tiles in flight when a spec does not say
    threads_per_row: int | None  # lanes sharing a query row (None: from the tiling)

    @property
    def modelled(self) -> bool:
        """Whether the static performance model covers it (docs/performance-model.md)."""
        return self.tensor_cores


ENGINES: dict[str, Engine] = {
    e.name: e
    for e in (
        Engine(
            name="simt",
            uri_tag="",
            description="CUDA cores",
            dtypes=("float32", "float16", "bfloat16"),
            tensor_cores=False,
            chunk_bytes=0,
            warp_specialized=False,
            block_sparse=False,
            min_capability=0,
            exact_capability=None,
            arch_target=None,
            required_sass=(),
            max_accumulators=128,
            default_stages=1,
            threads_per_row=None,
        ),
        # ldmatrix, cp.async and bf16 mma.sync: sm_80
        Engine(
            name="mma_sync",
            uri_tag="tc",
            description="tensor cores (mma.sync m16n8k16, ldmatrix, cp.async)",
            dtypes=("float16", "bfloat16"),
            tensor_cores=True,
            chunk_bytes=16,
            warp_specialized=False,
            block_sparse=True,
            min_capability=80,
            exact_capability=None,
            arch_target=None,
            required_sass=("HMMA", "LDSM"),
            max_accumulators=176,
            default_stages=2,
            threads_per_row=4,
        ),
        # wgmma, TMA and setmaxnreg: sm_90a, which runs on compute capability 9.0 only
        Engine(
            name="wgmma",
            uri_tag="wg",
            description="Hopper tensor cores (wgmma, TMA, mbarriers; warp-specialised)",
            dtypes=("float16", "bfloat16", "float8_e4m3"),
            tensor_cores=True,
            chunk_bytes=16,
            warp_specialized=True,
            block_sparse=True,
            min_capability=90,
            exact_capability=90,
            arch_target="sm_90a",
            required_sass=("HGMMA", "UTMALDG"),
            max_accumulators=168,  # 160 with the overlap and Q in registers (forward.py)
            default_stages=2,
            threads_per_row=4,
        ),
    )
}


def engine_of(spec: Any) -> Engine:
    """The row of the engine a spec (of any family) names."""
    return ENGINES[spec.mma]


# SASS families that differ by operand type from the engine row's: fp8 wgmma compiles to QGMMA
# where 16-bit wgmma gives HGMMA.
SASS_BY_DTYPE: dict[str, dict[str, str]] = {"float8_e4m3": {"HGMMA": "QGMMA"}}


def required_sass_of(spec: Any) -> tuple[str, ...]:
    """The instruction families a spec's compiled kernels must show (its engine's, renamed
    for its operand type)."""
    renamed = SASS_BY_DTYPE.get(spec.dtype, {})
    return tuple(renamed.get(name, name) for name in engine_of(spec).required_sass)
