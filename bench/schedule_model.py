"""A model of how the GPU runs a causal grid, to choose the order of its row tiles.

The block scheduler starts blocks in index order on the first free slot (SMs x blocks per SM).
A causal row tile's time grows with the key tiles it sees, so the order decides how the last
wave is filled: ascending (tile x at index x) leaves the longest blocks for the end, descending
(the kernels' order, `block_tile()`) runs them first and lets the short ones fill the gaps,
the longest-processing-time rule. This is arithmetic on the benchmark's shapes, not a
measurement; it predicts the change in causal time, which `bench.attention` then measures.

    python -m bench.schedule_model [--sms 132] [--overhead 0.5]
"""

from __future__ import annotations

import argparse
import heapq
import math
from collections.abc import Sequence

from bench.shapes import SEQLENS, TOKENS, heads_for

# (block_m, block_n, blocks per SM) of the shipped tensor-core prefill tiles
TILES: tuple[tuple[int, int, int], ...] = ((128, 32, 2), (64, 64, 2), (128, 64, 1))


def makespan(costs: Sequence[float], slots: int) -> float:
    """Finish time of blocks started in order, each on the earliest free of ``slots``."""
    free = [0.0] * slots
    end = 0.0
    for cost in costs:
        start = heapq.heappop(free)
        heapq.heappush(free, start + cost)
        end = max(end, start + cost)
    return end


def causal_costs(
    seqlen: int, block_m: int, block_n: int, grids: int, descending: bool, overhead: float
) -> list[float]:
    """Per-block cost, in key tiles plus ``overhead``, of ``grids`` (batch x head) causal grids
    with Sq = Sk = seqlen, row tiles in launch order (x fastest, as the hardware numbers blocks)."""
    tiles = math.ceil(seqlen / block_m)
    order = range(tiles - 1, -1, -1) if descending else range(tiles)
    row = [math.ceil(min(seqlen, (x + 1) * block_m) / block_n) + overhead for x in order]
    return row * grids


def table(sms: int, overhead: float) -> list[dict[str, float | int]]:
    """Makespan over the ideal (total work / slots) for both orders, per benchmark shape
    (batch x seqlen = TOKENS, the benchmark's heads for head dims 64 and 128)."""
    rows = []
    for seqlen in SEQLENS:
        for head_dim in (64, 128):
            grids = TOKENS // seqlen * heads_for(head_dim)
            for block_m, block_n, per_sm in TILES:
                slots = sms * per_sm
                ascending = causal_costs(seqlen, block_m, block_n, grids, False, overhead)
                descending = causal_costs(seqlen, block_m, block_n, grids, True, overhead)
                ideal = sum(ascending) / slots
                up, down = makespan(ascending, slots), makespan(descending, slots)
                rows.append(
                    {
                        "seqlen": seqlen,
                        "head_dim": head_dim,
                        "block_m": block_m,
                        "block_n": block_n,
                        "blocks_per_sm": per_sm,
                        "ascending": up / ideal,
                        "descending": down / ideal,
                        "speedup": up / down,
                    }
                )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sms", type=int, default=132, help="SM count (H100 SXM: 132)")
    parser.add_argument(
        "--overhead", type=float, default=0.5, help="per-block cost beyond its key tiles"
    )
    args = parser.parse_args(argv)
    print("| seqlen | head dim | tile | blocks/SM | ascending | descending | speedup |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for r in table(args.sms, args.overhead):
        print(
            f"| {r['seqlen']} | {r['head_dim']} | m{r['block_m']} n{r['block_n']} | "
            f"{r['blocks_per_sm']} | {r['ascending']:.3f} | {r['descending']:.3f} | "
            f"{r['speedup']:.3f} |"
        )


if __name__ == "__main__":
    main()
