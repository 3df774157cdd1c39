"""The peers of the benchmark and the tensor-core spec candidates kernelgen is timed with.

Candidates are plain dicts of tiling fields laid over a shape's identity (dtype, head_dim,
causal, archs); fields they leave out (``smem_pad``) take the spec's own defaults. Whether each
one is valid is for ``kernelgen.specs.forward.spec_from_dict`` to say: the GPU layer skips the ones
it rejects. kernelgen's own tensor-core ``default_spec`` is tried too, first.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Peer:
    """One implementation in the comparison."""

    name: str  # key in the JSON rows
    short: str  # column header of the markdown tables
    label: str  # legend of the plot, prose
    family: str  # "torch", "cupy" or "kernelgen"


PEERS: tuple[Peer, ...] = (
    Peer("torch-flash", "flash", "torch SDPA, FLASH_ATTENTION backend", "torch"),
    Peer("torch-cudnn", "cudnn", "torch SDPA, CUDNN_ATTENTION backend", "torch"),
    Peer("torch-efficient", "effic", "torch SDPA, EFFICIENT_ATTENTION backend", "torch"),
    Peer("cupy-naive", "naive", "CuPy naive: fp32 matmul + softmax + matmul", "cupy"),
    Peer("kg-simt-v1", "kg-v1", "kernelgen CUDA-core v1 (default tiles, FA1 order)", "kernelgen"),
    Peer("kg-simt-v2", "kg-v2", "kernelgen CUDA-core v2 (default_spec)", "kernelgen"),
    Peer("kg-tc-v2", "kg-tc", "kernelgen tensor-core v2, best of N specs per shape", "kernelgen"),
    Peer(
        "kg-wgmma",
        "kg-wg",
        "kernelgen Hopper wgmma + TMA (sm_90a, 9.0 devices only), best of N specs per shape",
        "kernelgen",
    ),
    Peer(
        "kg-wgmma-fp8",
        "kg-fp8",
        "kernelgen Hopper fp8: the bf16 inputs quantized to e4m3 outside the timed region, bf16 "
        "out (sm_90a, head dim 128), best of its loops",
        "kernelgen",
    ),
)
PEER_NAMES: tuple[str, ...] = tuple(p.name for p in PEERS)
PEERS_BY_NAME: dict[str, Peer] = {p.name: p for p in PEERS}
TORCH_PEERS: tuple[str, ...] = tuple(p.name for p in PEERS if p.family == "torch")
TENSOR_CORE_PEER = "kg-tc-v2"
WGMMA_PEER = "kg-wgmma"
FP8_PEER = "kg-wgmma-fp8"
FLASH_PEER = "torch-flash"


def tensor_core_candidates(quick: bool = False) -> list[dict[str, Any]]:
    """Spec-field overrides for the tensor-core (mma_sync) v2 kernel: the autotuner's grid
    (kernelgen.tuning.candidates), so "best of N" here is the exhaustive check of its choice.
    Quick: 2 stages, swizzled only."""
    from kernelgen.tuning.candidates import (
        TC_BLOCK_N,
        TC_LAYOUTS,
        TC_STAGES,
        TC_WARP_TILINGS,
        tc_fields,
    )

    stages = TC_STAGES[:1] if quick else TC_STAGES
    layouts = ("swizzled",) if quick else TC_LAYOUTS
    return [
        tc_fields(warps, block_n, stage_count, layout, rows_per_warp=rows)
        for (warps, rows), block_n, stage_count, layout in itertools.product(
            TC_WARP_TILINGS, TC_BLOCK_N, stages, layouts
        )
    ]


def wgmma_candidates(quick: bool = False, head_dim: int | None = None) -> list[dict[str, Any]]:
    """Spec-field overrides for the Hopper (wgmma) kernel: the autotuner's grid for 9.0 devices
    (kernelgen.tuning.candidates), with ``head_dim`` also that head dim's own tilings (d192: 96
    and 112 keys). Quick: 2 stages."""
    from kernelgen.tuning.candidates import WGMMA_STAGES, wgmma_grid

    return list(wgmma_grid(WGMMA_STAGES[:1] if quick else WGMMA_STAGES, head_dim))


def fp8_candidates(head_dim: int = 128) -> list[dict[str, Any]]:
    """Spec-field overrides for the fp8 (e4m3) wgmma forward: each of its loops at 128-row tiles
    and each key tile the head dim takes (``FP8_BLOCK_N_BY_HEAD_DIM``: d256 one, the others
    two; docs/hopper.md, fp8): plain, Q in registers, ping-pong (2 stages), the overlap alone,
    with Q in registers and with ping-pong (3 stages), and the plain loop with V transposed in
    the kernel (``fp8_v_layout: kernel``: the call makes no V^T copy, which the other rows'
    timings include). Those a tiling refuses (the overlap and Q
    in registers at d256 and at d192 with 128-key tiles) are recorded invalid with kernelgen's
    reason. These rows are where a GPU times the loops against each other."""
    from kernelgen.specs.forward import FP8_BLOCK_N_BY_HEAD_DIM

    base = {"loop_order": "v2", "mma": "wgmma", "dtype": "float8_e4m3", "block_m": 128,
            "archs": ["sm_90a"]}  # fmt: skip
    loops = (
        {"stages": 2},
        {"stages": 2, "q_in_registers": True},
        {"stages": 2, "pingpong": True},
        {"stages": 3, "overlap": True},
        {"stages": 3, "overlap": True, "q_in_registers": True},
        {"stages": 3, "overlap": True, "pingpong": True},
        {"stages": 2, "fp8_v_layout": "kernel"},  # V^T made in the kernel: no copy per call
    )
    return [
        {**base, "block_n": block_n, **loop}
        for block_n in FP8_BLOCK_N_BY_HEAD_DIM.get(head_dim, (128,))
        for loop in loops
    ]


def candidate_label(fields: dict[str, Any]) -> str:
    """Short tag of a candidate, e.g. ``m64n128w4s2-swz`` (wgmma: ``wg-m128n64s2-ovl``; fp8:
    ``fp8-m128n128s2-qr``)."""
    if fields.get("mma") == "wgmma":
        engine = "fp8" if fields.get("dtype") == "float8_e4m3" else "wg"
        overlap = "-ovl" if fields.get("overlap") else ""
        turns = "-pp" if fields.get("pingpong") else ""
        q_regs = "-qr" if fields.get("q_in_registers") else ""
        store = "-tma" if fields.get("epilogue") == "tma" else ""
        cluster = f"-c{fields['cluster_m']}" if fields.get("cluster_m", 1) > 1 else ""
        v_layout = "-vk" if fields.get("fp8_v_layout") == "kernel" else ""
        return (
            f"{engine}-m{fields['block_m']}n{fields['block_n']}s{fields.get('stages', '?')}"
            f"{overlap}{turns}{q_regs}{store}{cluster}{v_layout}"
        )
    layout = {"swizzled": "swz", "padded": "pad"}.get(fields.get("smem_layout", ""), "?")
    return (
        f"m{fields['block_m']}n{fields['block_n']}w{fields['num_warps']}"
        f"s{fields.get('stages', '?')}-{layout}"
    )


IDENTITY_FIELDS = ("dtype", "head_dim", "causal", "archs")


def spec_fields(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A spec dict: ``base``'s fields with ``overrides`` laid over them."""
    return {**base, **overrides}


def identity(base: dict[str, Any]) -> dict[str, Any]:
    """The fields of a spec that the problem fixes (not the tiling)."""
    return {k: base[k] for k in IDENTITY_FIELDS if k in base}


def v1_fields(base: dict[str, Any]) -> dict[str, Any]:
    """The CUDA-core default (v2) spec's tiles with the FA1 loop order."""
    return spec_fields(base, {"loop_order": "v1"})
