"""Emulation tier: the tensor-core backward's interior-tile test on the diagonals of the band.

A tile whose keys every query row sees skips the per-score causal and window tests
(``tile_is_interior`` in templates/fa_bwd_tc.cu.j2), so an off-by-one there lets one key past a
row's diagonal (or before its window's left edge) into that row's gradients, and only where the
edge falls two keys before a full tile's end (one offset Sk - Sq in block_n): the previous fuzzing
round caught the late diagonal in 1 case of 80. On random inputs the leaked probability is about
1 / (keys the row sees), a few times the tolerance at these sizes (measured: 1.5x to 7x) and
below it at larger ones. Here the key just past each row's edge is the row's own query doubled,
so a leaked score dominates its row (errors of 1 to 700 against 2e-3), and the shapes put the
edges inside tiles at several offsets (Sq != Sk with the causal mask aligned to the bottom right,
block_m != block_n, lengths that are no multiple of the tiles).
Each case's tiles are counted in Python (``_flipped_tiles``) to show the mutation changes at
least one of them; both loosened edges must then fail every case against the float64 gradients.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_emulated_backward import check, make_problem, run, tc_spec

from kernelgen.calls import backward as backward_api
from kernelgen.errors import EmulatorLaunchError
from kernelgen.families import backward

pytestmark = pytest.mark.emulate

# Off-by-one loosenings of tile_is_interior: its right edge (the causal diagonal or the window's
# right side, bounded by the tile's first row) and its left edge (the window's left side, bounded
# by its last row). Tightening either edge by one only sends an interior tile down the exact path,
# which computes the same numbers: no gradient check can see it.
MUTATIONS = {
    "right-edge-one-key-late": (
        "k0 + KEYS - 1 <= m0 + offset + va.right",
        "k0 + KEYS - 2 <= m0 + offset + va.right",
    ),
    "left-edge-one-key-early": (
        "k0 >= m0 + ROWS - 1 + offset - va.left",
        "k0 + 1 >= m0 + ROWS - 1 + offset - va.left",
    ),
}
UNBOUNDED = 1 << 30

CAUSAL = tc_spec("float16", 32, causal=True, block_m=64, block_n=32, num_warps=2)
WINDOW = tc_spec("float16", 32, window=True, block_m=32, block_n=64, num_warps=4)

# name: (spec, (batch, heads, kv_heads, seqlen_q, seqlen_k), window (left, right; -1 unbounded)
# or None for causal). Offsets Sk - Sq of 30, -34 and 62 put the causal diagonal two keys before
# a 32-key tile's end in some full tile; the windows' edges fall likewise inside 64-key tiles.
CASES = {
    "causal-sq-lt-sk": (CAUSAL, (1, 2, 1, 64, 94), None),
    "causal-sq-gt-sk": (CAUSAL, (1, 2, 1, 129, 95), None),
    "causal-offset-62": (CAUSAL, (2, 1, 1, 65, 127), None),
    "window-right-square": (WINDOW, (1, 2, 1, 64, 64), (-1, 30)),
    "window-left-sq-lt-sk": (WINDOW, (1, 2, 1, 33, 64), (61, -1)),
    "window-left-sq-gt-sk": (WINDOW, (1, 2, 1, 65, 64), (29, -1)),
    "window-two-sided": (WINDOW, (2, 1, 1, 34, 64), (60, 40)),
}  # fmt: skip


def _edges(case: str) -> tuple[int, int]:
    """(left, right) of the band, UNBOUNDED for a side with none: causal is (UNBOUNDED, 0)."""
    window = CASES[case][2]
    if window is None:
        return UNBOUNDED, 0
    left, right = window
    return (UNBOUNDED if left < 0 else left), (UNBOUNDED if right < 0 else right)


def _flipped_tiles(case: str, mutation: str | None) -> int:
    """Full (block_m x block_n) tiles that tile_is_interior, as mutated, calls interior while some
    score in them is hidden (a Python copy of its test)."""
    spec, (_, _, _, sq, sk), _ = CASES[case]
    left, right = _edges(case)
    late = mutation == "right-edge-one-key-late"
    early = mutation == "left-edge-one-key-early"
    bm, bn, offset, count = spec.block_m, spec.block_n, sk - sq, 0
    for m0 in range(0, sq - bm + 1, bm):
        for k0 in range(0, sk - bn + 1, bn):
            interior = k0 + bn - 1 - late <= m0 + offset + right
            interior &= k0 + early >= m0 + bm - 1 + offset - left
            exact = k0 + bn - 1 <= m0 + offset + right and k0 >= m0 + bm - 1 + offset - left
            count += interior and not exact
    return count


def _problem(case: str):
    """The case's inputs with key i + offset + right + 1 (just past row i's right edge) and key
    i + offset - left - 1 (just before its left edge) set to twice query i in head 0."""
    spec, shape, window = CASES[case]
    options = {"causal": spec.causal} | ({"window_size": window} if window else {})
    p = make_problem(spec.dtype, (*shape, spec.head_dim), seed=sum(map(ord, case)), options=options)
    sq, sk = shape[3], shape[4]
    left, right = _edges(case)
    for shift in (sk - sq + right + 1, sk - sq - left - 1):
        if abs(shift) >= UNBOUNDED // 2:
            continue
        rows = np.arange(max(0, -shift), min(sq, sk - shift))
        p.k[:, 0, rows + shift] = 2 * p.q[:, 0, rows]
    return p


@pytest.mark.parametrize("case", CASES)
def test_band_edges_inside_tiles_match_the_float64_gradients(case):
    spec = CASES[case][0]
    assert _flipped_tiles(case, None) == 0
    p = _problem(case)
    check(p, run(p, spec=spec), spec.dtype)


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_interior_tile_off_by_one_fails_every_case(mutation, monkeypatch):
    """The loosened edge changes some tile in every case it is run on, and each of those cases
    then fails (the unmutated kernel passes them: the test above)."""
    original, mutated = MUTATIONS[mutation]
    render = backward.render
    for spec in {CAUSAL, WINDOW}:
        assert render(spec).count(original) == 1, (spec.uri, original)
    monkeypatch.setattr(backward, "render", lambda s: render(s).replace(original, mutated))
    monkeypatch.setattr(backward_api, "_KERNELS", {})
    cases = [c for c in CASES if _flipped_tiles(c, mutation) > 0]
    assert len(cases) >= 3, cases
    missed = []
    for case in cases:
        p = _problem(case)
        try:
            check(p, run(p, spec=CASES[case][0]), CASES[case][0].dtype)
        except (AssertionError, EmulatorLaunchError):
            continue
        missed.append(case)
    assert not missed, f"{mutation} gave the right gradients in {missed}"
