"""The static model's shape terms: what one call of a problem shape costs, from a spec's per-unit
model (:mod:`kernelgen.model.perfmodel`).

The per-unit model prices the steady state of one SM. A call adds three things it cannot see:

- **grid fill**: the grid's blocks run in waves of ``SMs x resident blocks``; the last wave may
  be partly empty (and causal blocks are of unequal length), so the call takes longer than its
  work spread evenly over the SMs;
- **latency**: a warp (wgmma: a consumer warpgroup) waits for its own products before its
  softmax and the softmax before the next products; only other resident consumer warps hide
  that chain (:func:`latency_clocks`);
- **memory**: Q, K, V, O and the LSE pass through HBM once, and every block re-reads its K/V
  head from L2 (:func:`traffic`).

The predicted time is the largest of the compute and HBM times (and the L2 time when asked).
docs/performance-model.md gives the formulas, the constants' sources and how the terms rank the
committed measurements.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass

from kernelgen.errors import InputError, SettingError
from kernelgen.kernels.compile import Resources
from kernelgen.model.perfmodel import (
    RATES,
    UNIT_KEYS,
    UNIT_QUERIES,
    ModelReport,
    Prediction,
    analytic_figures,
    model_spec,
    predict,
)
from kernelgen.runtime.occupancy import kernel_occupancy
from kernelgen.specs.arch import ARCHS, Device
from kernelgen.specs.backward import BackwardSpec
from kernelgen.specs.forward import DTYPE_BYTES, KernelSpec

WARP_SCHEDULERS = 4  # sub-partitions of an SM, one warp scheduler and tensor core each
LSE_BYTES = 4  # one fp32 log-sum-exp per query row
# Which terms the predicted time includes by default, as they ranked the committed measurements
# (docs/performance-model.md, "Shape terms"): the latency bound ranked them better; the L2 time,
# whose bandwidth for Hopper is assumed, ranked them slightly worse and is reported, not priced.
LATENCY_DEFAULT = True
L2_DEFAULT = False


@dataclass(frozen=True)
class ProblemShape:
    """One call's sizes: ``batch``, query ``heads``, ``seqlen_q``, ``seqlen_k`` and the
    key/value heads ``kv_heads`` (GQA/MQA; a divisor of ``heads``). Causal comes from the spec."""

    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    kv_heads: int

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "seqlen_q", "seqlen_k", "kv_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name}={value!r}: the shape's sizes are integers >= 1")
        if self.heads % self.kv_heads:
            raise InputError(
                f"kv_heads={self.kv_heads}: must divide heads={self.heads} (GQA groups)"
            )

    @classmethod
    def parse(cls, text: str) -> ProblemShape:
        """``BATCH,HEADS,SEQLEN_Q,SEQLEN_K[,KV_HEADS]`` (KV_HEADS absent: HEADS)."""
        parts = text.split(",")
        if len(parts) not in (4, 5) or not all(p.strip().isdigit() for p in parts):
            raise InputError(
                f"shape={text!r}: expected BATCH,HEADS,SEQLEN_Q,SEQLEN_K[,KV_HEADS] "
                "(integers >= 1, e.g. 4,16,4096,4096)"
            )
        sizes = [int(p) for p in parts]
        return cls(*sizes[:4], kv_heads=sizes[4] if len(sizes) == 5 else sizes[1])


def device_of(arch: str) -> Device:
    """The reference device of ``arch`` (:data:`kernelgen.specs.arch.ARCHS`); a SettingError when
    there is none."""
    facts = ARCHS.get(arch)
    if facts is None or facts.device is None:
        known = [name for name, a in ARCHS.items() if a.device is not None]
        raise SettingError(
            f"arch={arch!r}: the shape terms need a reference device; known for {', '.join(known)}"
        )
    return facts.device


def _check_spec(spec: KernelSpec) -> None:
    unsupported = [
        name
        for name, on in (
            ("loop_order v1", spec.loop_order != "v2"),
            ("split_kv", spec.split_kv),
            ("paged_kv", spec.paged_kv),
            ("window", spec.window),
            ("block_sparse", spec.block_sparse),
        )
        if on
    ]
    if unsupported:
        raise SettingError(
            f"{spec.uri}: the shape terms model the unsplit v2 grid of dense or causal "
            f"attention, not {', '.join(unsupported)}"
        )


def block_key_tiles(spec: KernelSpec, shape: ProblemShape) -> list[int]:
    """Key tiles each block of one (batch, head) walks, in launch order: every tile without
    causal; with it (aligned bottom right) up to the last row's last visible key, and the
    template launches the longest row tile first. With ``pack_gqa`` a block's rows are (query,
    head) pairs of one key/value head's group; with ``cluster_m`` the row tiles round up to
    whole clusters."""
    _check_spec(spec)
    group = shape.heads // shape.kv_heads if spec.pack_gqa else 1
    rows = shape.seqlen_q * group
    tiles = []
    for r in range(spec.row_tiles(rows)):
        if not spec.causal:
            tiles.append(math.ceil(shape.seqlen_k / spec.block_n))
            continue
        last_query = (min(rows, (r + 1) * spec.block_m) - 1) // group
        keys = min(shape.seqlen_k, max(0, last_query + 1 + shape.seqlen_k - shape.seqlen_q))
        tiles.append(math.ceil(keys / spec.block_n))
    return tiles[::-1] if spec.causal else tiles


@dataclass(frozen=True)
class GridFill:
    """How the grid's blocks fill the SMs: ``waves`` = ceil(blocks / slots) against the ideal
    blocks / slots (slots = SMs x resident blocks), and ``fill``, the makespan of the blocks
    (each started on the first slot to free, in launch order) over their work spread evenly on
    the SMs: waves / ideal when every block does the same work, >= 1."""

    blocks: int
    resident: int
    slots: int
    waves: int
    ideal_waves: float
    fill: float


def grid_fill(spec: KernelSpec, shape: ProblemShape, arch: str, resident: int) -> GridFill:
    """:class:`GridFill` of ``spec``'s grid for ``shape`` on ``arch``'s reference device with
    ``resident`` blocks per SM (:func:`kernelgen.runtime.occupancy.kernel_occupancy`)."""
    if resident < 1:
        raise InputError(f"resident={resident}: a kernel that runs holds >= 1 block per SM")
    per_head = block_key_tiles(spec, shape)
    heads = shape.batch * (shape.kv_heads if spec.pack_gqa else shape.heads)
    blocks = len(per_head) * heads
    slots = device_of(arch).sm_count * resident
    waves, ideal = math.ceil(blocks / slots), blocks / slots
    total = sum(per_head) * heads
    if total == 0:
        return GridFill(blocks, resident, slots, waves, ideal, 1.0)
    if len(set(per_head)) == 1:
        fill = waves / ideal
    else:  # list scheduling: a block starts on the slot that frees first
        free = [0.0] * min(slots, blocks)
        for _ in range(heads):
            for tiles in per_head:
                heapq.heapreplace(free, free[0] + tiles)
        fill = max(free) / (total / slots)
    return GridFill(blocks, resident, slots, waves, ideal, fill)


def hiding_warps(spec: KernelSpec, resident: int) -> float:
    """Consumer warps resident per warp scheduler: the warps whose products and softmax
    interleave with one another's (wgmma's producer warpgroup computes nothing)."""
    consumers = 4 * spec.consumer_warpgroups if spec.engine.warp_specialized else spec.num_warps
    return consumers * resident / WARP_SCHEDULERS


def latency_clocks(prediction: Prediction, spec: KernelSpec, resident: int) -> float:
    """Clocks per unit when the SM waits on each warp's own dependency chain: a warp's key tile
    runs its products, then its softmax, then the next products, so one warp alone takes the
    unit's tensor time plus its softmax time (the larger of issue and MUFU); W resident
    consumer warps per scheduler overlap W such chains: (tensor + max(issue, MUFU)) / W.
    ``overlap`` (the next tile's products issued before the softmax) and ``pingpong`` are not
    credited: their measured worth (0.73-1.15x) follows no rule the model could state yet
    (docs/performance-model.md)."""
    c = prediction.clocks
    return (c["tensor"] + max(c["issue"], c["MUFU"])) / hiding_warps(spec, resident)


@dataclass(frozen=True)
class Traffic:
    """Bytes one call moves: through HBM (Q and K/V read once, O and the LSE written once) and
    out of L2 (every block reads its rows of Q and the K/V tiles it walks; in a cluster of
    ``cluster_m`` blocks, its share of them)."""

    hbm_bytes: float
    l2_bytes: float


def traffic(spec: KernelSpec, shape: ProblemShape) -> Traffic:
    """:class:`Traffic` of one call of ``spec`` on ``shape``."""
    q_bytes = shape.batch * shape.heads * shape.seqlen_q * spec.head_dim * spec.elem_bytes
    out_bytes = shape.batch * shape.heads * shape.seqlen_q * spec.head_dim
    out_bytes *= DTYPE_BYTES[spec.out_dtype]
    lse_bytes = shape.batch * shape.heads * shape.seqlen_q * LSE_BYTES
    kv_bytes = 2 * shape.batch * shape.kv_heads * shape.seqlen_k * spec.head_dim * spec.elem_bytes
    heads = shape.batch * (shape.kv_heads if spec.pack_gqa else shape.heads)
    tile_bytes = 2 * spec.block_n * spec.head_dim * spec.elem_bytes  # a K and a V tile
    # With 2-CTA clusters (cluster_m) each block reads 1/cluster_m of a tile from L2 and
    # multicasts it to the others.
    kv_reads = sum(block_key_tiles(spec, shape)) * heads * tile_bytes / spec.cluster_m
    return Traffic(q_bytes + kv_bytes + out_bytes + lse_bytes, q_bytes + kv_reads)


@dataclass(frozen=True)
class ShapeEstimate:
    """The predicted time of one call: the steady state's compute time (units x clocks per unit
    over the SMs, the unit cost raised to the latency bound when ``latency``), scaled by the
    grid fill; the HBM and L2 times of its traffic; the largest of the three and which it is.
    ``steady_s`` is the per-unit model alone (no fill, latency or memory). ``latency`` and ``l2``
    say whether the latency bound and the L2 time are priced (both are always reported)."""

    shape: ProblemShape
    units: float
    grid: GridFill
    latency: bool
    l2: bool
    cost_clocks: float  # the per-unit model's clocks per unit
    latency_clocks: float
    unit_clocks: float  # the cost the compute time is priced at (latency bound included or not)
    steady_s: float
    compute_s: float
    hbm_bytes: float
    l2_bytes: float
    hbm_s: float
    l2_s: float
    time_s: float
    limiter: str

    def summary(self) -> str:
        """One line for ``kernelgen model``."""
        s, g = self.shape, self.grid
        kv = f" ({s.kv_heads} kv heads)" if s.kv_heads != s.heads else ""
        priced = {True: "priced", False: "not priced"}
        return (
            f"shape {s.batch}x{s.heads}x{s.seqlen_q}x{s.seqlen_k}{kv}: {g.blocks} blocks, "
            f"{g.resident}/SM, {g.waves} wave{'s' * (g.waves != 1)} ({g.ideal_waves:.2f} ideal, "
            f"fill {g.fill:.3f}); "
            f"latency {self.latency_clocks:.0f} clk/unit ({priced[self.latency]}); "
            f"HBM {self.hbm_bytes / 1e6:.1f} MB {self.hbm_s * 1e6:.1f} us, "
            f"L2 {self.l2_bytes / 1e6:.1f} MB {self.l2_s * 1e6:.1f} us ({priced[self.l2]}); "
            f"compute {self.compute_s * 1e6:.1f} us; predicted {self.time_s * 1e6:.1f} us, "
            f"bound by {self.limiter}"
        )


def estimate(
    spec: KernelSpec,
    prediction: Prediction,
    arch: str,
    resident: int,
    shape: ProblemShape,
    latency: bool = LATENCY_DEFAULT,
    l2: bool = L2_DEFAULT,
) -> ShapeEstimate:
    """The :class:`ShapeEstimate` of ``spec`` (per-unit ``prediction`` on ``arch``, ``resident``
    blocks per SM) for ``shape``; ``latency`` and ``l2`` price those terms."""
    device = device_of(arch)
    fill = grid_fill(spec, shape, arch, resident)
    heads = shape.batch * (shape.kv_heads if spec.pack_gqa else shape.heads)
    tiles = sum(block_key_tiles(spec, shape)) * heads
    units = tiles * spec.block_m * spec.block_n / (UNIT_QUERIES * UNIT_KEYS)
    wait = latency_clocks(prediction, spec, resident)
    unit_clocks = max(prediction.cost, wait) if latency else prediction.cost
    seconds = units / device.sm_count / device.clock_hz
    steady = seconds * prediction.cost
    compute = seconds * unit_clocks * fill.fill
    moved = traffic(spec, shape)
    hbm = moved.hbm_bytes / device.hbm_bytes_per_s
    l2_time = moved.l2_bytes / (device.l2_bytes_per_clock * device.clock_hz)
    times = {"compute": compute, "HBM": hbm, **({"L2": l2_time} if l2 else {})}
    limiter = max(times, key=lambda name: times[name])
    return ShapeEstimate(
        shape=shape,
        units=units,
        grid=fill,
        latency=latency,
        l2=l2,
        cost_clocks=prediction.cost,
        latency_clocks=wait,
        unit_clocks=unit_clocks,
        steady_s=steady,
        compute_s=compute,
        hbm_bytes=moved.hbm_bytes,
        l2_bytes=moved.l2_bytes,
        hbm_s=hbm,
        l2_s=l2_time,
        time_s=times[limiter],
        limiter=limiter,
    )


def model_with_shape(
    spec: KernelSpec | BackwardSpec,
    arch: str,
    shape: ProblemShape,
    resources: Resources | None = None,
) -> ModelReport:
    """:func:`kernelgen.model.perfmodel.model_spec` of a forward ``spec`` with its ``shape`` field
    set to the :class:`ShapeEstimate` of one call of ``shape`` (the default terms); the arch's
    device and the spec's grid are checked before anything is compiled."""
    if isinstance(spec, BackwardSpec):
        raise SettingError(f"{spec.uri}: the shape terms model forward specs only")
    device_of(arch)
    block_key_tiles(spec, shape)
    report = model_spec(spec, arch, resources)
    found = estimate(spec, report.prediction, arch, report.blocks_per_sm, shape)
    return dataclasses.replace(report, shape=found)


def analytic_estimate(
    spec: KernelSpec,
    arch: str,
    shape: ProblemShape,
    latency: bool = LATENCY_DEFAULT,
    l2: bool = L2_DEFAULT,
) -> ShapeEstimate:
    """:func:`estimate` from the tiling alone, as the autotuner ranks without SASS
    (:func:`kernelgen.model.perfmodel.analytic_cost`: the analytic figures, issue left out, so the
    latency chain is tensor + MUFU) with the blocks per SM that shared memory and threads allow
    (registers unknown)."""
    target = spec.engine.arch_target or arch
    bounds = predict(analytic_figures(spec), target if target in RATES else "sm_80").clocks
    clocks = {**bounds, "issue": 0.0}
    limiter = max(clocks, key=lambda name: clocks[name])
    prediction = Prediction(clocks, limiter, clocks["tensor"] / clocks[limiter])
    resident = kernel_occupancy(spec, arch, None).blocks
    return estimate(spec, prediction, arch, resident, shape, latency=latency, l2=l2)
