"""The fuzzer's backward cases (``python -m kernelgen.testing.fuzz --family backward``): backward
spec fields from the spaces :class:`~kernelgen.specs.backward.BackwardSpec` allows, problems for
a valid spec, and the run: ``kernelgen.attention_backward`` on the emulator (NumPy arrays),
its dq, dk, dv (and dsinks) judged against the float64
:func:`~kernelgen.references.attention.attention_backward` with the backward tests' limit
(:func:`~kernelgen.references.attention.grad_mismatches`).

The forward's out and lse the backward reads are the float64 reference's (out rounded to the
dtype, lse in fp32), not a forward kernel's: a failure is the backward's own, and a case costs
one family's emulation. The reference gradients are those of the out the backward is given
(``attention_backward(out=)``): its rounding enters D_i = dout_i . out_i, and through
dP - D and dsinks = -sum P_sink D (differences and sums that cancel) it alone put dsinks 0.2%
off in float16 (seed 201 case 22: the kernel matched the float64 of the rounded out to 1e-7).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernelgen.families import spec_of_family
from kernelgen.references.attention import attention_backward, grad_mismatches
from kernelgen.specs.backward import (
    BACKWARD_TILES,
    BACKWARD_WARPS,
    TC_STAGES,
    TC_TILES,
    BackwardSpec,
)
from kernelgen.testing.fuzz_inputs import call_arguments, draw_values, rounded
from kernelgen.testing.fuzz_space import (
    MAX_SEQLEN,
    DrawStats,
    FuzzProblem,
    chance,
    draw_length,
    draw_scale,
    draw_switches,
    draw_valid,
    draw_window,
    pick,
    shrink_to_work,
)

ENGINES = ("simt", "mma_sync", "all")
SIMT_HEAD_DIMS = (8, 16, 24, 32, 40, 64, 96, 128)
TC_HEAD_DIMS = (16, 32, 64, 64, 96, 128, 128)  # 256: no tc tiling fits its accumulators
# The backward recomputes the scores and runs three more products per tile: a quarter of the
# forward's bound (fuzz_space.MAX_WORK) keeps a case to seconds.
MAX_WORK = 2**22
# wide_range rows of the backward are scaled by 2^-4..2^1, not the forward's 2^4: P is
# recomputed as exp(s - lse) in fp32, and at |s| near 771 fp32's spacing (6e-5) alone put an
# fp32 dk 1.15e-4 off (seed 202 case 63, limit 1e-4): a limit fp32 cannot meet there.
WIDE_RANGE_EXPONENTS = (-4, 1)


def draw_fields(rng: np.random.Generator, engine: str) -> dict[str, Any]:
    """One draw of backward spec fields for ``engine`` (simt, mma_sync, or all: either, half
    the cases each) (not checked: the validator decides)."""
    if engine == "all":
        engine = pick(rng, ("simt", "mma_sync"))
    tc = engine == "mma_sync"
    fields: dict[str, Any] = {
        "family": "backward",
        "mma": engine,
        "dtype": pick(rng, ("float16", "bfloat16") if tc else ("float32", "float16", "bfloat16")),
        "head_dim": pick(rng, TC_HEAD_DIMS if tc else SIMT_HEAD_DIMS),
        "block_m": pick(rng, TC_TILES if tc else BACKWARD_TILES),
        "block_n": pick(rng, TC_TILES if tc else BACKWARD_TILES),
        "num_warps": pick(rng, BACKWARD_WARPS),
    }
    if tc:
        fields["stages"] = pick(rng, TC_STAGES)
        if chance(rng, 0.25):
            fields["split_roles"] = True
    switches = (
        ("causal", 0.35), ("deterministic", 0.4), ("window", 0.15), ("softcap", 0.15),
        ("alibi", 0.15), ("sinks", 0.15), ("additive_mask", 0.12),
    )  # fmt: skip
    return draw_switches(rng, fields, switches, documents=0.15)


def draw_spec(
    rng: np.random.Generator, engine: str, stats: DrawStats | None = None
) -> tuple[dict[str, Any], BackwardSpec, list[tuple[dict[str, Any], str]]]:
    """Draw fields until the validator takes them: (fields, spec, the refused draws with their
    first problem)."""
    if engine == "all":  # once per case: the engine whose draws are refused more keeps its half
        engine = pick(rng, ("simt", "mma_sync"))
    draw = lambda: draw_fields(rng, engine)  # noqa: E731
    fields, spec, refused = draw_valid(
        draw, spec_of_family, stats, f"backward draws for engine {engine!r}"
    )
    assert isinstance(spec, BackwardSpec)
    return fields, spec, refused


def _shifts(spec: BackwardSpec) -> tuple[int, ...]:
    """Sk - Sq just off a tile edge: of the block's tiles, and of the warps' 16- and 32-key
    sub-tiles (the tensor-core kernel classifies those as interior or not). Without the
    -2 (mod 16) offsets a diagonal one key too far in that test went unseen in 80 cases."""
    near = (-2, -1, 0, 1, 2, 14, 30, spec.block_n - 2, spec.block_n - 1, spec.block_n + 1)
    return (*near, -spec.block_m)


def draw_problem(rng: np.random.Generator, spec: BackwardSpec) -> FuzzProblem:
    """A backward problem for ``spec`` (sizes within :data:`MAX_WORK`): GQA groups, lengths off
    the tiles, Sk - Sq near a tile edge, either layout, the scale, the variants' values."""
    batch = int(rng.integers(1, 3))
    kv_heads = int(rng.integers(1, 3))
    heads = kv_heads * pick(rng, (1, 2, 3, 4))
    seqlen_q = draw_length(rng, spec.block_m)
    seqlen_k = draw_length(rng, spec.block_n)
    if chance(rng, 0.4):  # Sk - Sq where a causal or window bound crosses a tile's corner
        seqlen_k = min(MAX_SEQLEN, max(1, seqlen_q + pick(rng, _shifts(spec))))
    # Rows that see one key have dS = 0 exactly: where every row does, dq = dk = 0 and their
    # relative error is float64 noise over nothing (see _window). At least 2 keys; with the
    # document mask at least 16 keys and 4 queries (with 2 keys, or one query whose document has
    # one key, seed 202 cases 121 and 611 gave 1e9).
    min_q, min_k = (4, 16) if spec.mask_mod is not None else (1, 2)
    seqlen_q, seqlen_k = max(min_q, seqlen_q), max(min_k, seqlen_k)
    sizes = (batch, heads, kv_heads, seqlen_q, seqlen_k)
    batch, heads, kv_heads, seqlen_q, seqlen_k = shrink_to_work(
        spec, sizes, min_q=min_q, min_k=min_k, fold_groups=False, max_work=MAX_WORK
    )
    scale = draw_scale(rng, spec.head_dim)
    return FuzzProblem(
        batch=batch,
        heads=heads,
        kv_heads=kv_heads,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        layout=pick(rng, ("bhsd", "bshd")),
        scale=scale,
        data_seed=int(rng.integers(2**31)),
        wide_range=chance(rng, 0.15),
        mask=pick(rng, ("broadcast", "full")) if spec.additive_mask else None,
        window=_window(rng, spec) if spec.window else None,
        softcap=pick(rng, (0.3, 1.5, 5.0, 20.0)) if spec.softcap else None,
        alibi_per_batch=spec.alibi and chance(rng, 0.5),
    )


def _window(rng: np.random.Generator, spec: BackwardSpec) -> tuple[int, int]:
    """A forward window, but never one key per row (left 0, right 0 or causal): then every
    score's dS = P (dP - D) is 0 exactly (P = 1, D = dP), dq = dk = 0, and their relative error
    against float64 rounding noise means nothing (seed 201 case 18, Sq = Sk = 1: 1e9)."""
    left, right = draw_window(rng, spec)
    if left == 0 and (right == 0 or spec.causal):
        left = 1
    return left, right


def _device(x: np.ndarray, dtype: str, layout: str) -> np.ndarray:
    """A (B, H, S, D) float array as the call's input: the dtype's NumPy type, in ``layout``."""
    import ml_dtypes

    types = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
    x = np.asarray(x, np.float32).astype(types[dtype])
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3) if layout == "bshd" else x)


def run(spec: BackwardSpec, p: FuzzProblem) -> dict[str, Any]:
    """Run the backward case on the emulator (exceptions propagate to the caller's verdict) and
    judge its gradients: ``{"outcome", "errors"[, "failed"]}``."""
    import kernelgen

    rng = np.random.default_rng(p.data_seed)
    d = spec.head_dim
    wide = WIDE_RANGE_EXPONENTS
    q = draw_values(rng, spec.dtype, p, p.batch, p.heads, p.seqlen_q, d, exponents=wide)
    k = draw_values(rng, spec.dtype, p, p.batch, p.kv_heads, p.seqlen_k, d, exponents=wide)
    v = draw_values(rng, spec.dtype, p, p.batch, p.kv_heads, p.seqlen_k, d, exponents=wide)
    dout = draw_values(rng, spec.dtype, p, p.batch, p.heads, p.seqlen_q, d, exponents=wide)
    mask, keywords, hooks = call_arguments(rng, spec, p)
    keywords.pop("block_mask", None)  # the backward lists its own tiles
    reference_keywords = {k: w for k, w in keywords.items() if k not in ("score_mod", "mask_mod")}
    reference_keywords.pop("mod_inputs", None)
    options = dict(causal=spec.causal, scale=p.scale, mask=mask, **reference_keywords, **hooks)
    exact = attention_backward(dout, q, k, v, **options)
    given = rounded(exact.out, spec.dtype)  # the out a forward in the dtype returns
    ref = attention_backward(dout, q, k, v, out=given, **options)
    out = _device(given, spec.dtype, p.layout)
    lse = np.ascontiguousarray(exact.lse.astype(np.float32))
    grads = kernelgen.attention_backward(
        *(_device(x, spec.dtype, p.layout) for x in (dout, q, k, v)), out, lse,
        causal=spec.causal, scale=p.scale, mask=mask, layout=p.layout,
        deterministic=spec.deterministic, spec=spec, **keywords,
    )  # fmt: skip
    if p.layout == "bshd":
        grads = tuple(g.transpose(0, 2, 1, 3) if g.ndim == 4 else g for g in grads)
    found = grad_mismatches([np.asarray(g).astype(np.float64) for g in grads], ref, spec.dtype)
    return {
        "outcome": "mismatch" if found.failed else "ok",
        "errors": {name: float(f"{e:.4g}") for name, e in found.errors.items()},
        **({"failed": list(found.failed)} if found.failed else {}),
    }
