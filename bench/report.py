"""Result rows, file naming, the markdown tables and the JSON document (all pure, no GPU).

A row is a flat dict: the shape's fields, ``shape`` (its key), ``peer``, ``status`` (one of
:data:`STATUSES`), ``reason`` and the measured figures (``median_ms``, ``tflops``, ...).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.candidates import FLASH_PEER, PEER_NAMES, PEERS, TENSOR_CORE_PEER, TORCH_PEERS
from bench.decode_shapes import DecodeShape
from bench.shapes import DTYPE_SHORT, Shape
from kernelgen.fileio import atomic_write_bytes

OK, WRONG, UNAVAILABLE, SKIPPED, ERROR = "ok", "wrong", "unavailable", "skipped", "error"
STATUSES = (OK, WRONG, UNAVAILABLE, SKIPPED, ERROR)
# 2: timed rows carry rounds, round_medians_ms and round_spread (1: one measurement each)
SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)
Rows = Iterable[dict[str, Any]]
SortRows = Callable[[Rows], list[dict[str, Any]]]  # a benchmark's row order

LEGEND = (
    "TFLOP/s from the median time. n/a: the implementation refused the shape; skip: not run "
    "by the benchmark's policy; WRONG e: failed the correctness check with relative error e, "
    "not timed; ERR: raised an error (reasons in the JSON)."
)


def make_row(shape: Shape | DecodeShape, peer: str, status: str, **fields: Any) -> dict[str, Any]:
    """A result row for ``peer`` on ``shape``."""
    if status not in STATUSES:
        raise ValueError(f"status={status!r}; expected one of {', '.join(STATUSES)}")
    return {"shape": shape.key, **shape.as_dict(), "peer": peer, "status": status, **fields}


# ---- names ------------------------------------------------------------------------------------
def slug(text: str) -> str:
    """Lower-case, runs of anything but letters and digits become one dash: a file-name part."""
    out = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return out or "unknown"


def result_stem(date: dt.date, gpu_name: str, tag: str | None = None) -> str:
    """``<YYYY-MM-DD>-<gpu-slug>[-<tag>]``: the name of a run's .json, .md and .png."""
    stem = f"{date.isoformat()}-{slug(gpu_name)}"
    return f"{stem}-{slug(tag)}" if tag else stem


def result_paths(out_dir: Path, stem: str) -> dict[str, Path]:
    return {ext: out_dir / f"{stem}.{ext}" for ext in ("json", "md", "png")}


# ---- rows -------------------------------------------------------------------------------------
def _peer_index(peer: str) -> int:
    return PEER_NAMES.index(peer) if peer in PEER_NAMES else len(PEER_NAMES)


def _shape_sort_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["dtype"], row["head_dim"], row["causal"], row["seqlen_q"], row["seqlen_k"])


def sort_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: (*_shape_sort_key(r), _peer_index(r["peer"])))


def merge_rows(old: Rows, new: Rows, sort: SortRows = sort_rows) -> list[dict[str, Any]]:
    """Rows of an earlier run combined with a new run's: a new row replaces the old row of the
    same shape and peer. ``sort``: the rows' order (another benchmark's rows, e.g. decode)."""
    merged = {(r["shape"], r["peer"]): r for r in old}
    merged.update({(r["shape"], r["peer"]): r for r in new})
    return sort(merged.values())


def group_by_shape(rows: Rows, sort: SortRows = sort_rows) -> list[tuple[str, dict[str, dict]]]:
    """[(shape key, {peer: row})] in grid order."""
    groups: dict[str, dict[str, dict]] = {}
    for row in sort(rows):
        groups.setdefault(row["shape"], {})[row["peer"]] = row
    return list(groups.items())


def best_torch(peers: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest torch SDPA backend that ran correctly on a shape, if any."""
    ok = [peers[p] for p in TORCH_PEERS if p in peers and peers[p]["status"] == OK]
    ok = [r for r in ok if r.get("tflops")]
    return max(ok, key=lambda r: r["tflops"]) if ok else None


def ratio(row: dict[str, Any] | None, other: dict[str, Any] | None) -> float | None:
    """TFLOP/s of ``row`` over ``other``, both correct and timed; else None."""
    if not row or not other or row["status"] != OK or other["status"] != OK:
        return None
    if not row.get("tflops") or not other.get("tflops"):
        return None
    return row["tflops"] / other["tflops"]


# ---- markdown ---------------------------------------------------------------------------------
def cell(row: dict[str, Any] | None) -> str:
    """One table cell: TFLOP/s, or why there is none."""
    if row is None:
        return "-"
    status = row["status"]
    if status == OK:
        value = row.get("tflops")
        return f"{value:.1f}" if value is not None else "?"
    if status == WRONG:
        err = row.get("rel_err")
        return f"WRONG {err:.1e}" if isinstance(err, float) and err == err else "WRONG nan"
    return {UNAVAILABLE: "n/a", SKIPPED: "skip", ERROR: "ERR"}[status]


def _fmt_ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def _shape_cells(row: dict[str, Any], compact: bool) -> list[str]:
    causal = "causal" if row["causal"] else "-"
    dtype = DTYPE_SHORT.get(row["dtype"], row["dtype"])
    seq = (
        str(row["seqlen_q"])
        if row["seqlen_q"] == row["seqlen_k"]
        else f"{row['seqlen_q']}/{row['seqlen_k']}"
    )
    if compact:
        return [dtype, str(row["head_dim"]), "c" if row["causal"] else "-", seq]
    return [dtype, str(row["head_dim"]), causal, seq, f"{row['batch']}x{row['heads']}"]


def md_table(header: Sequence[str], lines: Sequence[Sequence[str]], align: Sequence[str]) -> str:
    """A GitHub markdown table; ``align`` holds each column's delimiter ("---", "---:")."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)


def markdown_table(rows: Iterable[dict[str, Any]], compact: bool = False) -> str:
    """One line per shape: TFLOP/s of every peer, then kernelgen tensor-core v2 over the best
    torch backend and over torch's flash backend."""
    shape_header = ["dtype", "D", "c", "S"] if compact else ["dtype", "D", "causal", "S", "BxH"]
    header = [*shape_header, *(p.short for p in PEERS), "tc/best", "tc/flash"]
    lines = []
    for _, peers in group_by_shape(rows):
        first = next(iter(peers.values()))
        tc = peers.get(TENSOR_CORE_PEER)
        lines.append(
            [
                *_shape_cells(first, compact),
                *(cell(peers.get(p.name)) for p in PEERS),
                _fmt_ratio(ratio(tc, best_torch(peers))),
                _fmt_ratio(ratio(tc, peers.get(FLASH_PEER))),
            ]
        )
    align = ["---"] * len(shape_header) + ["---:"] * (len(PEERS) + 2)
    return md_table(header, lines, align)


def tensor_core_table(rows: Iterable[dict[str, Any]]) -> str:
    """Per shape: the best tensor-core spec, its TFLOP/s and how many candidates ran."""
    lines = []
    for key, peers in group_by_shape(rows):
        tc = peers.get(TENSOR_CORE_PEER)
        if tc is None:
            continue
        candidates = tc.get("candidates") or []
        timed = sum(1 for c in candidates if c.get("status") == OK)
        lines.append(
            [
                key,
                cell(tc),
                f"`{tc['spec_uri']}`" if tc.get("spec_uri") else "-",
                f"{timed}/{len(candidates)}",
                f"{100 * tc['frac_of_matmul']:.0f}%" if tc.get("frac_of_matmul") else "-",
            ]
        )
    if not lines:
        return ""
    header = ["shape", "kg-tc TFLOP/s", "best spec", "timed/tried", "of matmul"]
    return md_table(header, lines, ["---", "---:", "---", "---:", "---:"])


def reasons(rows: Rows, sort: SortRows = sort_rows) -> list[str]:
    """Distinct (peer, status, reason) lines for every row that was not timed."""
    seen: dict[tuple[str, str, str], None] = {}
    for row in sort(rows):
        if row["status"] != OK and row.get("reason"):
            seen[(row["peer"], row["status"], str(row["reason"]).splitlines()[0])] = None
    return [f"{peer} ({status}): {reason}" for peer, status, reason in seen]


def provenance(meta: dict[str, Any]) -> list[str]:
    """Markdown list items: the GPU, the software versions, the commit and the timing method."""
    return [
        f"- GPU: {meta.get('gpu_name')} (sm_{meta.get('compute_capability')}, "
        f"{meta.get('sm_count')} SMs, L2 {meta.get('l2_bytes')} B), driver "
        f"{meta.get('driver_version')}, CUDA runtime {meta.get('cuda_runtime')}",
        f"- torch {meta.get('torch_version')}, CuPy {meta.get('cupy_version')}, kernelgen "
        f"{meta.get('kernelgen_version')}, commit {meta.get('git_commit')}"
        f"{' (dirty)' if meta.get('git_dirty') else ''}, template hash "
        f"{str(meta.get('template_hash'))[:12]}",
        f"- timing: {meta.get('timing', '')}",
        f"- clocks (nvidia-smi, start / end): {_clocks(meta.get('clocks_start'))} / "
        f"{_clocks(meta.get('clocks_end'))}",
    ]


def _clocks(clocks: dict[str, Any] | None) -> str:
    """``SM 1980 MHz, memory 2619 MHz, 41 C``, or ``not recorded``."""
    if not clocks:
        return "not recorded"
    return (
        f"SM {_num(clocks.get('clocks.sm'))} MHz, memory {_num(clocks.get('clocks.mem'))} MHz, "
        f"{_num(clocks.get('temperature.gpu'))} C"
    )


def markdown_document(result: dict[str, Any]) -> str:
    """The .md file: provenance, measured floors, the main table, the tensor-core specs."""
    meta, floors, rows = result["meta"], result.get("floors", {}), result["rows"]
    lines = [
        f"# Attention forward benchmark: {meta.get('gpu_name', '?')} ({meta.get('date', '?')})",
        "",
        *provenance(meta),
    ]
    if floors:
        lines.append(
            "- measured floors: copy {copy} GB/s (read + write); matmul 8192^3 bf16 {bf16} "
            "TFLOP/s, fp16 {fp16} TFLOP/s".format(
                copy=_num(floors.get("copy_gbps")),
                bf16=_num(floors.get("matmul_tflops", {}).get("bfloat16")),
                fp16=_num(floors.get("matmul_tflops", {}).get("float16")),
            )
        )
    lines += ["", "## TFLOP/s", "", markdown_table(rows), "", LEGEND, ""]
    tc = tensor_core_table(rows)
    if tc:
        lines += [
            "## kernelgen tensor-core v2: best spec per shape",
            "",
            "Each candidate spec is checked and timed at each shape and the fastest is reported "
            "(an oracle choice per shape, not one fixed spec). All candidates' times are in the "
            "JSON.",
            "",
            tc,
            "",
        ]
    notes = reasons(rows)
    if notes:
        lines += ["## Not timed", "", *(f"- {n}" for n in notes), ""]
    return "\n".join(lines)


def _num(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) else "?"


# ---- files ------------------------------------------------------------------------------------
def build_result(
    meta: dict[str, Any],
    floors: dict[str, Any],
    rows: Rows,
    settings: dict[str, Any],
    sort: SortRows = sort_rows,
) -> dict[str, Any]:
    """The JSON document of a run."""
    return {
        "schema": SCHEMA_VERSION,
        "meta": meta,
        "settings": settings,
        "floors": floors,
        "rows": sort(rows),
    }


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` (text or bytes) atomically: kernelgen's temp file + fsync + ``os.replace``."""
    atomic_write_bytes(path, data.encode() if isinstance(data, str) else data)


def to_json(result: dict[str, Any]) -> str:
    """Strict JSON (NaN and infinities become null)."""
    return json.dumps(_finite(result), indent=1, allow_nan=False, default=_json_default) + "\n"


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, (dt.date, dt.datetime)):
        return value.isoformat()
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")
