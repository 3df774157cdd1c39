"""TFLOP/s against sequence length, one panel per (dtype, head dim, causal). Needs matplotlib."""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

from bench.candidates import PEERS
from bench.report import OK
from bench.shapes import DTYPE_SHORT


def plot_png(rows: Iterable[dict[str, Any]], title: str) -> bytes:
    """PNG bytes of the plot; raises ImportError when matplotlib is missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["seqlen_q"] == r["seqlen_k"]]
    columns = sorted({(r["dtype"], r["causal"]) for r in rows})
    head_dims = sorted({r["head_dim"] for r in rows})
    if not columns or not head_dims:
        raise ValueError("no rows to plot")
    fig, axes = plt.subplots(
        len(head_dims),
        len(columns),
        figsize=(4.2 * len(columns), 3.2 * len(head_dims)),
        squeeze=False,
        sharex=True,
    )
    for i, head_dim in enumerate(head_dims):
        for j, (dtype, causal) in enumerate(columns):
            ax = axes[i][j]
            panel = [
                r
                for r in rows
                if r["head_dim"] == head_dim and r["dtype"] == dtype and r["causal"] == causal
            ]
            for peer in PEERS:
                points = sorted(
                    (r["seqlen_q"], r["tflops"])
                    for r in panel
                    if r["peer"] == peer.name and r["status"] == OK and r.get("tflops")
                )
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, marker="o", markersize=3, label=peer.short)
            ax.set_xscale("log", base=2)
            ticks = sorted({r["seqlen_q"] for r in rows})
            ax.set_xticks(ticks, [f"{t // 1024}k" if t >= 1024 else str(t) for t in ticks])
            ax.set_ylim(bottom=0)
            ax.set_title(
                f"{DTYPE_SHORT.get(dtype, dtype)} d{head_dim} {'causal' if causal else 'full'}",
                fontsize=9,
            )
            ax.grid(True, alpha=0.3)
            if j == 0:
                ax.set_ylabel("TFLOP/s")
            if i == len(head_dims) - 1:
                ax.set_xlabel("seqlen")
            if ax.get_lines():
                ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()
