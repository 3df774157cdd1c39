"""Decode benchmark results (pure, no GPU): peers, row order, comparisons, tables, targets.

Rows are :func:`bench.report.make_row` rows of :class:`bench.decode_shapes.DecodeShape`s; a
timed row carries ``median_ms``, ``achieved_gbps`` and ``frac_of_copy`` (bench.metrics). A row
with peer :data:`ALL` stands for the whole shape (skipped by the memory budget, or failed while
making its inputs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from bench import report
from bench.candidates import PEERS, Peer
from bench.report import ERROR, OK, UNAVAILABLE, WRONG
from bench.shapes import DTYPE_SHORT

DECODE_PEER = "kg-decode"
TUNED_PEER = "kg-decode-tuned"
NOSPLIT_PEER = "kg-nosplit"
ALL = "all"
SPLIT_PREFIX = "kg-split-"
SPLIT_SWEEP: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
PAGED_PREFIX = "kg-paged-"
PAGE_SIZES: tuple[int, ...] = (16, 256)  # a lookup per key row / one per key tile
# The Hopper (wgmma) decode kernel, 9.0 devices only (policy.hopper_decode_spec): contiguous,
# and paged with pages of WGMMA_PAGE_SIZE keys (a multiple of its key tile: one TMA copy each)
# and of WGMMA_SMALL_PAGE_SIZE keys (a tile spans several pages: rows copied by cp.async).
WGMMA_DECODE_PEER = "kg-decode-wg"
WGMMA_PAGE_SIZE = 256
WGMMA_SMALL_PAGE_SIZE = 16
WGMMA_PAGED_PREFIX = "kg-wg-paged-"
WGMMA_PAGED_PEER = f"{WGMMA_PAGED_PREFIX}{WGMMA_PAGE_SIZE}"
WGMMA_SMALL_PAGED_PEER = f"{WGMMA_PAGED_PREFIX}{WGMMA_SMALL_PAGE_SIZE}"
WGMMA_PAGED_PEERS = (WGMMA_PAGED_PEER, WGMMA_SMALL_PAGED_PEER)
# kg-decode-wg's spec with the TMA-store epilogue (docs/hopper.md): the split partials staged in
# shared memory and stored by TMA instead of 8-byte stores from the accumulators.
WGMMA_TMA_PEER = "kg-decode-wg-tma"
# fp8 caches (e4m3, 9.0 devices only; not run unless --peers names them): the bf16 sets rounded
# to e4m3 outside the timed region, read in place by attention_with_kvcache with
# policy.fp8_decode_spec, contiguous and in pages of WGMMA_SMALL_PAGE_SIZE keys (cp.async row
# copies). Their rows are e4m3 shapes: the bytes model counts 1-byte q, k and v and bf16 out.
FP8_DECODE_PEER = "kg-decode-wg-fp8"
FP8_PAGED_PEER = f"kg-wg-fp8-paged-{WGMMA_SMALL_PAGE_SIZE}"
FP8_DECODE_PEERS = (FP8_DECODE_PEER, FP8_PAGED_PEER)
FP8_DTYPE = "float8_e4m3"

DECODE_PEERS: tuple[Peer, ...] = (
    Peer(
        DECODE_PEER,
        "kg-decode",
        "kernelgen default_spec(decode_rows=Sq*H/Hkv): packed GQA, split-KV, heuristic splits",
        "kernelgen",
    ),
    Peer(
        TUNED_PEER,
        "kg-tuned",
        "kernelgen attention(spec=None): the autotuner's spec and split count",
        "kernelgen",
    ),
    Peer(
        NOSPLIT_PEER,
        "kg-nosplit",
        "kernelgen tensor-core prefill default_spec: no split-KV, no GQA packing",
        "kernelgen",
    ),
    *(
        Peer(
            f"{PAGED_PREFIX}{size}",
            f"kg-p{size}",
            f"kernelgen attention_with_kvcache on a paged copy of the cache (pages of {size} keys "
            "in shuffled order, device lengths and block table): kg-decode's tiling with paged_kv",
            "kernelgen",
        )
        for size in PAGE_SIZES
    ),
    Peer(
        WGMMA_DECODE_PEER,
        "kg-wg",
        "kernelgen Hopper wgmma + TMA decode (sm_90a, 9.0 devices only; "
        "policy.hopper_decode_spec): packed GQA, split-KV, heuristic splits",
        "kernelgen",
    ),
    Peer(
        WGMMA_PAGED_PEER,
        f"kg-wg-p{WGMMA_PAGE_SIZE}",
        f"kernelgen attention_with_kvcache, Hopper wgmma decode on a paged copy of the cache "
        f"(pages of {WGMMA_PAGE_SIZE} keys in shuffled order: one TMA copy per key tile)",
        "kernelgen",
    ),
    Peer(
        WGMMA_SMALL_PAGED_PEER,
        f"kg-wg-p{WGMMA_SMALL_PAGE_SIZE}",
        f"kernelgen attention_with_kvcache, Hopper wgmma decode on a paged copy of the cache "
        f"(pages of {WGMMA_SMALL_PAGE_SIZE} keys in shuffled order: key tiles copied row by "
        "row with cp.async)",
        "kernelgen",
    ),
    Peer(
        WGMMA_TMA_PEER,
        "kg-wg-tma",
        "kg-decode-wg's spec with epilogue: tma (its partials stored through shared memory by TMA)",
        "kernelgen",
    ),
    Peer(
        FP8_DECODE_PEER,
        "kg-wg-fp8",
        "kernelgen attention_with_kvcache on an e4m3 cache (the bf16 set rounded, read in place: "
        "policy.fp8_decode_spec, V transposed in the kernel, split-KV), checked against float64 "
        "of the rounded inputs; opt-in (--peers)",
        "kernelgen",
    ),
    Peer(
        FP8_PAGED_PEER,
        f"kg-wg-fp8-p{WGMMA_SMALL_PAGE_SIZE}",
        f"kg-decode-wg-fp8 on a paged copy of the cache (pages of {WGMMA_SMALL_PAGE_SIZE} keys in "
        "shuffled order: key tiles copied row by row with cp.async); opt-in (--peers)",
        "kernelgen",
    ),
    *(p for p in PEERS if p.family == "torch"),
)
DECODE_PEER_NAMES: tuple[str, ...] = tuple(p.name for p in DECODE_PEERS)
DECODE_PEERS_BY_NAME: dict[str, Peer] = {p.name: p for p in DECODE_PEERS}
# what bench.decode runs without --peers (and so bench.session's decode stage): not the fp8 ones
DEFAULT_PEER_NAMES: tuple[str, ...] = tuple(
    n for n in DECODE_PEER_NAMES if n not in FP8_DECODE_PEERS
)
KERNELGEN_DECODE_PEERS = (DECODE_PEER, TUNED_PEER)
WGMMA_DECODE_PEERS = (WGMMA_DECODE_PEER, *WGMMA_PAGED_PEERS, WGMMA_TMA_PEER)
PAGED_PEERS: tuple[str, ...] = tuple(f"{PAGED_PREFIX}{size}" for size in PAGE_SIZES)

LEGEND = (
    "Median ms, with the achieved bandwidth (bytes model above) as a percentage of the measured "
    "copy bandwidth in parentheses. n/a: the implementation refused the shape; skip: not run by "
    "the benchmark's policy (memory budget); WRONG e: failed the correctness check with relative "
    "error e, not timed; ERR: raised an error (reasons below and in the JSON). dec/nosplit and "
    "dec/torch: kg-decode's speedup over kg-nosplit and over the fastest torch backend; "
    "tuned/torch: the same for kg-decode-tuned; pN/dec: kg-paged-N's bandwidth over kg-decode's; "
    "wg/dec: kg-decode-wg's (Hopper wgmma) over kg-decode's (mma.sync); tma/wg: kg-decode-wg-tma's "
    "(the TMA-store epilogue) over kg-decode-wg's."
)


def split_peer(num_splits: int) -> str:
    """Peer name of the split-count sweep at ``num_splits`` chunks."""
    return f"{SPLIT_PREFIX}{num_splits}"


def split_count(peer: str) -> int | None:
    """The ``num_splits`` of a sweep peer (``kg-split-8``: 8), else None."""
    digits = peer.removeprefix(SPLIT_PREFIX)
    return int(digits) if peer.startswith(SPLIT_PREFIX) and digits.isdigit() else None


def page_size_of(peer: str) -> int | None:
    """The page size of a paged peer (``kg-paged-16``: 16), else None."""
    digits = peer.removeprefix(PAGED_PREFIX)
    return int(digits) if peer.startswith(PAGED_PREFIX) and digits.isdigit() else None


def wgmma_page_size_of(peer: str) -> int:
    """The page size of a wgmma paged peer (``kg-wg-paged-16``: 16), else 0 (contiguous)."""
    digits = peer.removeprefix(WGMMA_PAGED_PREFIX)
    return int(digits) if peer.startswith(WGMMA_PAGED_PREFIX) and digits.isdigit() else 0


def fp8_page_size_of(peer: str) -> int:
    """The page size of an fp8 peer's cache (``kg-wg-fp8-paged-16``: 16), 0: contiguous."""
    return WGMMA_SMALL_PAGE_SIZE if peer == FP8_PAGED_PEER else 0


def _peer_index(peer: str) -> tuple[int, int]:
    if peer == ALL:
        return (-1, 0)
    count = split_count(peer)
    if count is not None:
        return (len(DECODE_PEER_NAMES), count)
    if peer in DECODE_PEER_NAMES:
        return (DECODE_PEER_NAMES.index(peer), 0)
    return (len(DECODE_PEER_NAMES) + 1, 0)


def sort_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Decode rows by dtype, batch, kv heads (most first), seqlen_q, seqlen_k, then peer."""

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        shape = (r["dtype"], r["batch"], -r["kv_heads"], r["seqlen_q"], r["seqlen_k"])
        return (*shape, *_peer_index(r["peer"]))

    return sorted(rows, key=key)


def group_by_shape(rows: Iterable[dict[str, Any]]) -> list[tuple[str, dict[str, dict]]]:
    return report.group_by_shape(rows, sort=sort_rows)


# ---- comparisons ----------------------------------------------------------------------------
def add_comparisons(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Set ``speedup_vs_nosplit`` and ``speedup_vs_best_torch`` (with ``best_torch_peer``) on
    every timed row whose comparison peer was timed on the same shape, and on the paged rows
    ``paged_vs_contiguous`` (their bandwidth over kg-decode's), on kg-decode-wg-tma's
    ``tma_vs_direct`` (over kg-decode-wg's); returns the rows.
    (bench.report.ratio divides TFLOP/s: one shape's peers do the same FLOPs, so it is the
    inverse ratio of their median times.)"""
    rows = list(rows)
    for _, peers in group_by_shape(rows):
        nosplit = peers.get(NOSPLIT_PEER)
        torch = report.best_torch(peers)
        for row in peers.values():
            if row["status"] != OK:
                continue
            row["speedup_vs_nosplit"] = report.ratio(row, nosplit)
            row["speedup_vs_best_torch"] = report.ratio(row, torch)
            row["best_torch_peer"] = torch["peer"] if torch else None
            if page_size_of(row["peer"]) is not None:
                row["paged_vs_contiguous"] = report.ratio(row, peers.get(DECODE_PEER))
            if row["peer"] == WGMMA_DECODE_PEER:
                row["wgmma_vs_decode"] = report.ratio(row, peers.get(DECODE_PEER))
            if row["peer"] in WGMMA_PAGED_PEERS:
                row["paged_vs_contiguous"] = report.ratio(row, peers.get(WGMMA_DECODE_PEER))
            if row["peer"] == WGMMA_TMA_PEER:
                row["tma_vs_direct"] = report.ratio(row, peers.get(WGMMA_DECODE_PEER))
    return rows


# ---- markdown -------------------------------------------------------------------------------
def cell(row: dict[str, Any] | None) -> str:
    """``ms (xx%)`` for a timed row, else why there is no time (bench.report.cell)."""
    if row is None or row["status"] != OK:
        return report.cell(row)
    ms, frac = row.get("median_ms"), row.get("frac_of_copy")
    if ms is None:
        return "?"
    return f"{ms:.3g} ({100 * frac:.0f}%)" if frac is not None else f"{ms:.3g}"


def _ratio_cell(row: dict[str, Any] | None, field: str) -> str:
    value = row.get(field) if row else None
    return f"{value:.2f}x" if value is not None else "-"


def _shape_cells(row: dict[str, Any]) -> list[str]:
    return [
        DTYPE_SHORT.get(row["dtype"], row["dtype"]),
        str(row["batch"]),
        f"{row['heads']}/{row['kv_heads']}",
        str(row["seqlen_q"]),
        str(row["seqlen_k"]),
    ]


SHAPE_HEADER = ["dtype", "B", "H/Hkv", "Sq", "Sk"]


def markdown_table(rows: Iterable[dict[str, Any]]) -> str:
    """One line per shape: ``ms (% of copy)`` per peer, then kg-decode's and kg-decode-tuned's
    speedups. A shape-wide row (peer ``all``) fills every peer's cell. The opt-in fp8 peers have
    columns only where some row is theirs (their rows are e4m3 shapes of their own)."""
    rows = add_comparisons(rows)
    ran = {r["peer"] for r in rows}
    shown = [p for p in DECODE_PEERS if p.name not in FP8_DECODE_PEERS or p.name in ran]
    ratios_header = ["dec/nosplit", "dec/torch", "tuned/torch"]
    ratios_header += [f"p{size}/dec" for size in PAGE_SIZES] + ["wg/dec", "tma/wg"]
    header = [*SHAPE_HEADER, *(p.short for p in shown), *ratios_header]
    lines = []
    for _, peers in group_by_shape(rows):
        first = next(iter(peers.values()))
        whole = peers.get(ALL)
        cells = [cell(whole or peers.get(p.name)) for p in shown]
        decode, tuned = peers.get(DECODE_PEER), peers.get(TUNED_PEER)
        ratios = [
            _ratio_cell(decode, "speedup_vs_nosplit"),
            _ratio_cell(decode, "speedup_vs_best_torch"),
            _ratio_cell(tuned, "speedup_vs_best_torch"),
            *(_ratio_cell(peers.get(name), "paged_vs_contiguous") for name in PAGED_PEERS),
            _ratio_cell(peers.get(WGMMA_DECODE_PEER), "wgmma_vs_decode"),
            _ratio_cell(peers.get(WGMMA_TMA_PEER), "tma_vs_direct"),
        ]
        lines.append([*_shape_cells(first), *cells, *ratios])
    align = ["---"] * len(SHAPE_HEADER) + ["---:"] * (len(shown) + len(ratios_header))
    return report.md_table(header, lines, align)


def sweep_table(rows: Iterable[dict[str, Any]]) -> str:
    """The split-count sweep: one line per shape, ``ms (% of copy)`` per ``num_splits``."""
    swept = [r for r in rows if split_count(r["peer"]) is not None]
    if not swept:
        return ""
    counts = sorted({split_count(r["peer"]) or 0 for r in swept})
    lines = []
    for _, peers in group_by_shape(swept):
        first = next(iter(peers.values()))
        lines.append([*_shape_cells(first), *(cell(peers.get(split_peer(n))) for n in counts)])
    header = [*SHAPE_HEADER, *(f"s={n}" for n in counts)]
    return report.md_table(header, lines, ["---"] * len(SHAPE_HEADER) + ["---:"] * len(counts))


def kernelgen_table(rows: Iterable[dict[str, Any]]) -> str:
    """Per shape and kernelgen decode peer: the spec it ran, its split count, its scratch."""
    lines = []
    for key, peers in group_by_shape(rows):
        for name in (*KERNELGEN_DECODE_PEERS, NOSPLIT_PEER, *PAGED_PEERS, *WGMMA_DECODE_PEERS):
            row = peers.get(name)
            if row is None or row["status"] != OK:
                continue
            scratch = row.get("scratch_bytes")
            lines.append(
                [
                    key,
                    name,
                    f"`{row['spec_uri']}`" if row.get("spec_uri") else "?",
                    str(row.get("num_splits", "?")),
                    f"{scratch / 2**20:.2f}" if scratch is not None else "?",
                ]
            )
    if not lines:
        return ""
    header = ["shape", "peer", "spec", "splits", "scratch MiB"]
    return report.md_table(header, lines, ["---", "---", "---", "---:", "---:"])


# ---- targets -----------------------------------------------------------------------------
PASS, MISS, NOT_MEASURED = "PASS", "MISS", "not measured"
FAILED = (WRONG, ERROR, UNAVAILABLE)  # a kernelgen row in these states misses the target


@dataclass(frozen=True)
class Target:
    """One reported (never asserted) target: which shapes, which figure, which threshold."""

    name: str
    text: str
    applies: Callable[[dict[str, Any]], bool]
    figure: Callable[[dict[str, Any], dict[str, dict]], float | None]
    threshold: float
    strict: bool  # the figure must exceed the threshold (else reach it)
    percent: bool  # show the figure as a percentage (else as a ratio "x")

    def met(self, value: float) -> bool:
        return value > self.threshold if self.strict else value >= self.threshold

    def show(self, value: float) -> str:
        return f"{100 * value:.1f}%" if self.percent else f"{value:.2f}x"


def at_b1_32k(row: dict[str, Any]) -> bool:
    """The shapes of the split-KV speedup targets: batch 1, 32k keys."""
    return row["batch"] == 1 and row["seqlen_k"] == 32768


TARGETS: tuple[Target, ...] = (
    Target(
        "bandwidth",
        "achieved bandwidth >= 85% of the measured copy bandwidth at B=1, Sk >= 8k",
        lambda r: r["batch"] == 1 and r["seqlen_k"] >= 8192,
        lambda row, _peers: row.get("frac_of_copy"),
        0.85,
        strict=False,
        percent=True,
    ),
    Target(
        "vs-nosplit",
        ">= 5x kernelgen without split-KV (kg-nosplit) at B=1, Sk=32k",
        at_b1_32k,
        lambda row, peers: report.ratio(row, peers.get(NOSPLIT_PEER)),
        5.0,
        strict=False,
        percent=False,
    ),
    Target(  # the same reading without the GQA packing's share of the gain
        "vs-one-chunk",
        ">= 5x the same packed tiles in one chunk (kg-split-1, --sweep-splits) at B=1, Sk=32k",
        at_b1_32k,
        lambda row, peers: report.ratio(row, peers.get(split_peer(1))),
        5.0,
        strict=False,
        percent=False,
    ),
    Target(
        "vs-torch",
        "faster than every timed torch SDPA backend at Sk >= 4k",
        lambda r: r["seqlen_k"] >= 4096,
        lambda row, peers: report.ratio(row, report.best_torch(peers)),
        1.0,
        strict=True,
        percent=False,
    ),
)


# Paged peers are held to their own target: kg-decode's bandwidth with the same tiling.
PAGED_TARGET = Target(
    "paged",
    ">= 0.95x kg-decode's bandwidth with the cache in shuffled pages (same tiling, paged_kv)",
    lambda r: True,
    lambda row, peers: report.ratio(row, peers.get(DECODE_PEER)),
    0.95,
    strict=False,
    percent=False,
)


@dataclass(frozen=True)
class TargetResult:
    target: str
    peer: str
    status: str  # PASS, MISS or "not measured"
    detail: str


def evaluate(target: Target, peer: str, groups: list[tuple[str, dict[str, dict]]]) -> TargetResult:
    """Whether ``peer`` meets ``target`` on every shape of the run it applies to.

    Per shape: a timed row with a figure counts as measured (met or missed); a kernelgen row
    that failed (wrong, error, unavailable) is a miss; no row, a skipped one, or no figure (its
    comparison peer was not timed) leaves the shape unmeasured."""
    shapes = [(key, peers) for key, peers in groups if target.applies(next(iter(peers.values())))]
    if not shapes:
        return TargetResult(target.name, peer, NOT_MEASURED, "no shape of this kind in the run")
    values: list[tuple[float, str]] = []
    failed: list[str] = []
    for key, peers in shapes:
        row = peers.get(peer)
        if row is not None and row["status"] in FAILED:
            failed.append(f"{key}: {row['status']}")
        elif row is not None and row["status"] == OK:
            value = target.figure(row, peers)
            if value is not None:
                values.append((value, key))
    if not values and not failed:
        return TargetResult(target.name, peer, NOT_MEASURED, f"0 of {len(shapes)} shapes measured")
    missed = [v for v in values if not target.met(v[0])]
    status = MISS if missed or failed else PASS
    parts = [f"{len(values)} of {len(shapes)} shapes measured"]
    if values:
        worst, key = min(values)
        parts.append(f"worst {target.show(worst)} ({key})")
    if missed:
        parts.append(f"{len(missed)} below the target")
    if failed:
        parts.append(f"failed on {', '.join(failed)}")
    return TargetResult(target.name, peer, status, "; ".join(parts))


def evaluate_targets(
    rows: Iterable[dict[str, Any]], peers: Iterable[str] = KERNELGEN_DECODE_PEERS
) -> list[TargetResult]:
    """Every target (:data:`TARGETS`) for every kernelgen decode peer, and
    :data:`PAGED_TARGET` for the paged peers, from the rows alone."""
    groups = group_by_shape(rows)
    results = [evaluate(t, p, groups) for t in TARGETS for p in peers]
    return results + [evaluate(PAGED_TARGET, p, groups) for p in PAGED_PEERS]


def target_lines(results: Iterable[TargetResult]) -> list[str]:
    texts = {t.name: t.text for t in (*TARGETS, PAGED_TARGET)}
    return [f"- {r.status}: {r.peer}, {texts[r.target]} ({r.detail})" for r in results]


# ---- the document ---------------------------------------------------------------------------
def markdown_document(result: dict[str, Any]) -> str:
    """The .md file: provenance, bytes model and copy floor, the table, the targets, the split
    sweep, the specs kernelgen ran, and why anything was not timed."""
    meta, floors, rows = result["meta"], result.get("floors", {}), result["rows"]
    copy = floors.get("copy_gbps")
    lines = [
        f"# Decode attention benchmark: {meta.get('gpu_name', '?')} ({meta.get('date', '?')})",
        "",
        *report.provenance(meta),
        f"- bytes model: {meta.get('bytes_model', '?')}",
        f"- measured copy bandwidth: {f'{copy:.1f}' if copy else '?'} GB/s (read + write)",
        "",
        "## Median ms (% of copy bandwidth)",
        "",
        markdown_table(rows),
        "",
        LEGEND,
        "",
        "## Targets (reported, not asserted)",
        "",
        *target_lines(evaluate_targets(rows)),
        "",
    ]
    for title, table in (
        ("## Split-count sweep (kg-decode spec, num_splits fixed)", sweep_table(rows)),
        ("## kernelgen specs and split counts", kernelgen_table(rows)),
    ):
        if table:
            lines += [title, "", table, ""]
    notes = report.reasons(rows, sort=sort_rows)
    if notes:
        lines += ["## Not timed", "", *(f"- {n}" for n in notes), ""]
    return "\n".join(lines)


def progress_line(row: dict[str, Any]) -> str:
    """One console line per finished row."""
    median = f"{row['median_ms']:9.4f} ms" if row.get("median_ms") else " " * 12
    rate = f"{row['achieved_gbps']:7.0f} GB/s" if row.get("achieved_gbps") else " " * 12
    frac = f"{100 * row['frac_of_copy']:4.0f}%" if row.get("frac_of_copy") else " " * 5
    reason = f"  {str(row.get('reason'))[:70]}" if row["status"] != OK else ""
    return f"{row['shape']:28} {row['peer']:16} {row['status']:11} {median} {rate} {frac}{reason}"
