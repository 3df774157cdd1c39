"""Emulation tier: the backward family (dq, dk, dv, dsinks) run by the emulator through
``kernelgen.attention_backward``, against the float64 analytic gradients of
``kernelgen.references.attention.attention_backward`` (itself checked against finite differences in
test_reference_backward.py): every backward spec in specs/, every variant and expression, GQA,
odd lengths, Sq != Sk, rows that see no key, layouts and strides, on both engines (CUDA cores,
and the tensor cores, the default for fp16/bf16); determinism across emulated block orders;
mutations of both templates that the checks must catch.

Shapes are small: each spec is one g++ build of its generated CUDA."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import BACKWARD_SPEC_PATHS

import kernelgen
from kernelgen.calls import backward as backward_api
from kernelgen.errors import EmulatorLaunchError, InputError, InputTypeError
from kernelgen.families import backward, load_any_spec
from kernelgen.references.attention import attention_backward, grad_mismatches
from kernelgen.references.expressions import evaluate
from kernelgen.specs.backward import BackwardSpec
from kernelgen.specs.expression_grad import score_mod_grad_callable
from kernelgen.specs.expressions import inputs_from_arrays, parse_mask_mod, parse_score_mod

pytestmark = pytest.mark.emulate

NP_DTYPES = {"float32": np.float32, "float16": np.float16}


def _bf16():
    import ml_dtypes

    return ml_dtypes.bfloat16


@dataclasses.dataclass
class Problem:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dout: np.ndarray
    options: dict
    ref_options: dict


def make_problem(
    dtype="float32", shape=(1, 4, 2, 37, 53, 32), seed=0, options=None, ref_options=None
) -> Problem:
    """Random q, k, v and dout in ``dtype`` (B, H, Sq, D) / (B, Hkv, Sk, D)."""
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim = shape
    rng = np.random.default_rng(seed)
    np_dtype = _bf16() if dtype == "bfloat16" else NP_DTYPES[dtype]

    def draw(*s):
        return rng.standard_normal(s).astype(np.float32).astype(np_dtype)

    return Problem(
        draw(batch, heads, seqlen_q, head_dim),
        draw(batch, kv_heads, seqlen_k, head_dim),
        draw(batch, kv_heads, seqlen_k, head_dim),
        draw(batch, heads, seqlen_q, head_dim),
        dict(options or {}),
        dict(ref_options if ref_options is not None else options or {}),
    )


def run(p: Problem, **extra):
    """Forward (for out and lse) and backward through kernelgen on the emulator."""
    out, lse = kernelgen.attention(p.q, p.k, p.v, return_lse=True, **p.options)
    options = {k: v for k, v in p.options.items() if k != "spec"}
    return kernelgen.attention_backward(p.dout, p.q, p.k, p.v, out, lse, **options, **extra)


def check(p: Problem, grads, dtype: str) -> dict[str, float]:
    """Relative Frobenius errors of dq, dk, dv (and dsinks) against the float64 reference of the
    rounded inputs; asserts each finite and within the forward's tolerance for ``dtype``
    (kernelgen.references.attention.grad_mismatches, the fuzzer's check too)."""
    wide = [np.asarray(x, dtype=np.float64) for x in (p.dout, p.q, p.k, p.v)]
    found = grad_mismatches(grads, attention_backward(*wide, **p.ref_options), dtype)
    assert not found.failed, found
    return found.errors


# ---- every backward spec of specs/ ---------------------------------------------------------
def _variant_values(spec: BackwardSpec, heads: int) -> dict:
    rng = np.random.default_rng(3)
    values = {}
    if spec.window:
        values["window_size"] = (11, 5)
    if spec.softcap:
        values["softcap"] = 3.0
    if spec.alibi:
        values["alibi_slopes"] = rng.uniform(0.05, 0.5, heads).astype(np.float32)
    if spec.sinks:
        values["sinks"] = rng.normal(0, 1, heads).astype(np.float32)
    return values


@pytest.mark.parametrize("path", BACKWARD_SPEC_PATHS, ids=lambda p: p.stem)
def test_backward_spec_matches_the_float64_gradients(path):
    spec = load_any_spec(path)
    assert isinstance(spec, BackwardSpec)
    options = {"causal": spec.causal, **_variant_values(spec, 4)}
    p = make_problem(spec.dtype, (1, 4, 2, 37, 53, spec.head_dim), options=options)
    errors = check(p, run(p, spec=spec, deterministic=spec.deterministic), spec.dtype)
    assert errors["dq"] > 0  # a real comparison, not two copies


# ---- features through the default spec ------------------------------------------------------
CASES = {
    "plain-f16": ("float16", (1, 2, 2, 33, 47, 24), {}),
    "bf16-gqa": ("bfloat16", (2, 4, 1, 20, 31, 64), {}),
    "causal-sq-gt-sk": ("float32", (1, 2, 1, 45, 19, 16), {"causal": True}),  # rows see no key
    "causal-sq-lt-sk": ("float16", (1, 3, 3, 9, 70, 40), {"causal": True}),
    "window-causal": ("float32", (1, 2, 2, 40, 40, 16), {"causal": True, "window_size": (6, -1)}),
    "window-two-sided": ("float16", (1, 2, 1, 30, 50, 32), {"window_size": (4, 9)}),
    "softcap": ("float32", (1, 2, 2, 25, 33, 32), {"softcap": 2.5}),
    "d256": ("float16", (1, 2, 1, 17, 23, 256), {"causal": True}),
    "d136-odd": ("float32", (1, 1, 1, 13, 29, 136), {}),
}


@pytest.mark.parametrize("name", CASES)
def test_backward_feature_matches_the_float64_gradients(name):
    dtype, shape, options = CASES[name]
    p = make_problem(dtype, shape, seed=len(name), options=options)
    check(p, run(p), dtype)


def test_rows_that_see_no_key_get_zero_gradients():
    p = make_problem("float32", (1, 2, 1, 30, 10, 16), options={"causal": True})
    dq, dk, dv = run(p)
    assert np.all(dq[:, :, :20] == 0)  # queries 0..19 see no key (offset -20)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    check(p, (dq, dk, dv), "float32")


def test_alibi_per_batch_and_sinks():
    rng = np.random.default_rng(5)
    options = {
        "causal": True,
        "alibi_slopes": rng.uniform(0.1, 0.4, (2, 4)).astype(np.float32),
        "sinks": rng.normal(0, 1, 4).astype(np.float32),
    }
    p = make_problem("float16", (2, 4, 2, 21, 21, 32), options=options)
    errors = check(p, run(p), "float16")
    assert set(errors) == {"dq", "dk", "dv", "dsinks"}


def test_additive_mask_with_hidden_rows():
    p = make_problem("float32", (1, 2, 2, 12, 20, 16))
    mask = np.random.default_rng(1).normal(0, 1, (1, 1, 12, 20)).astype(np.float32)
    mask[..., 3, :] = -np.inf  # a row with no visible key
    mask[..., :, 7] = -np.inf
    p.options["mask"] = mask
    p.ref_options["mask"] = mask.astype(np.float64)
    grads = run(p)
    check(p, grads, "float32")
    assert np.all(grads[0][:, :, 3] == 0) and np.all(grads[1][:, :, 7] == 0)


def test_bshd_layout_and_strided_inputs():
    p = make_problem("float16", (2, 4, 2, 19, 26, 32), options={"causal": True})
    bshd = {n: np.ascontiguousarray(getattr(p, n).transpose(0, 2, 1, 3)) for n in "qkv"}
    do_bshd = np.ascontiguousarray(p.dout.transpose(0, 2, 1, 3))
    out, lse = kernelgen.attention(*bshd.values(), causal=True, layout="bshd", return_lse=True)
    grads = kernelgen.attention_backward(
        do_bshd, *bshd.values(), out, lse, causal=True, layout="bshd"
    )
    assert grads[0].shape == bshd["q"].shape and grads[1].shape == bshd["k"].shape
    check(p, [g.transpose(0, 2, 1, 3) for g in grads], "float16")
    # q, dout as views of wider arrays: strides in elements other than contiguous
    wide = np.zeros((2, 4, 19, 48), np.float16)
    wide[..., :32] = p.q
    q_view = wide[..., :32]
    assert not q_view.flags.c_contiguous
    strided = dataclasses.replace(p, q=q_view)
    check(strided, run(strided), "float16")


def test_out_and_dout_as_row_views_of_wider_arrays():
    """Rows of a longer sequence's out, dout and lse (a block of context-parallel attention):
    out's strides are the wide array's, not those of a fresh forward output."""
    p = make_problem("float32", (1, 2, 2, 30, 30, 16), options={"causal": True})
    out, lse = kernelgen.attention(p.q, p.k, p.v, return_lse=True, causal=True)
    rows = slice(7, 23)
    args = (p.dout[:, :, rows], p.q[:, :, rows], p.k, p.v, out[:, :, rows])
    lse_rows = np.ascontiguousarray(lse[:, :, rows])
    views = kernelgen.attention_backward(*args, lse_rows, causal=True)
    copies = kernelgen.attention_backward(*map(np.ascontiguousarray, args), lse_rows, causal=True)
    for got, want in zip(views, copies, strict=True):
        np.testing.assert_array_equal(got, want)


# ---- user expressions ------------------------------------------------------------------------
SCORE_MODS = ("score + 0.5 * bias[h, q_idx, kv_idx] - 0.01 * abs(q_idx - kv_idx)",
              "where(score > 0, 2 * tanh(score / 2), score * score / 4)")  # fmt: skip
MASK_MOD = "doc[b, q_idx + offset[0]] == doc[b, kv_idx]"


@pytest.mark.parametrize("score_mod", [*SCORE_MODS, None], ids=["bias", "tanh", "mask-only"])
def test_expressions_match_the_float64_gradients(score_mod):
    batch, heads, seqlen_q, seqlen_k = 1, 2, 18, 27
    rng = np.random.default_rng(9)
    doc = np.sort(rng.integers(0, 3, (batch, seqlen_k)), axis=1).astype(np.int32)
    inputs = {
        "bias": rng.standard_normal((heads, seqlen_q, seqlen_k)).astype(np.float32),
        "doc": doc,
        "offset": np.array([seqlen_k - seqlen_q], np.int64),
    }
    declared = inputs_from_arrays(inputs)
    mask_expression = parse_mask_mod(MASK_MOD, declared)
    ref = {
        "causal": True,
        "softcap": 4.0,
        "mask_mod": lambda b, h, q, k: evaluate(
            mask_expression, b=b, h=h, q_idx=q, kv_idx=k, inputs=inputs
        ),
    }
    if score_mod is not None:
        expression = parse_score_mod(score_mod, declared)
        ref["score_mod"] = lambda s, b, h, q, k: evaluate(
            expression, score=s, b=b, h=h, q_idx=q, kv_idx=k, inputs=inputs
        )
        ref["score_mod_grad"] = score_mod_grad_callable(expression, inputs)
    options = {"causal": True, "softcap": 4.0, "score_mod": score_mod, "mask_mod": MASK_MOD,
               "mod_inputs": inputs}  # fmt: skip
    p = make_problem("float32", (batch, heads, 1, seqlen_q, seqlen_k, 16), 4, options, ref)
    check(p, run(p), "float32")


# ---- determinism -------------------------------------------------------------------------------
def test_atomic_dq_depends_on_block_order_and_deterministic_does_not(monkeypatch):
    """Blocks of many key tiles (and a GQA group) add into each dq row: in a different block
    order the atomic sum rounds differently, while the deterministic dQ kernel (and dk, dv, which
    never use atomics) give the same bits in every order."""
    p = make_problem("float32", (1, 4, 1, 24, 160, 16), seed=11)
    out, lse = kernelgen.attention(p.q, p.k, p.v, return_lse=True)
    atomic, fixed = {}, {}
    for seed in (0, 1, 2, 3, 4):
        monkeypatch.setenv("KG_EMULATOR_BLOCK_ORDER", str(seed))
        atomic[seed] = kernelgen.attention_backward(p.dout, p.q, p.k, p.v, out, lse)
        fixed[seed] = kernelgen.attention_backward(
            p.dout, p.q, p.k, p.v, out, lse, deterministic=True
        )
    assert len({g[0].tobytes() for g in atomic.values()}) >= 2, "atomic dq never changed"
    for grads in (atomic, fixed):
        for i in (1, 2):  # dk, dv
            assert len({g[i].tobytes() for g in grads.values()}) == 1
    assert len({g[0].tobytes() for g in fixed.values()}) == 1
    check(p, fixed[3], "float32")
    check(p, atomic[3], "float32")


# ---- mutations of the template must fail the checks ---------------------------------------------
MUTATIONS = {
    # dK summed with P instead of dS (a wrong operand of the transposed product)
    "dk-from-p": ("dk += t.ds[i * PROB_ROW + j]", "dk += t.p[i * PROB_ROW + j]"),
    # D read from the tile's first row for every row
    "delta-wrong-row": ("ds = p * (dp - t.delta[i])", "ds = p * (dp - t.delta[0])"),
    # dS^T Q read as dS Q (the transpose dropped: key j indexes the row of dS)
    "ds-untransposed": ("dk += t.ds[i * PROB_ROW + j]", "dk += t.ds[j * PROB_ROW + i]"),
    # the softcap's chain factor left out
    "no-softcap-chain": ("grad *= 1.f - th * th;", "grad *= 1.f;"),
    # lse not rescaled to the log2 domain
    "lse-natural": ("lse[lse_row0 + m0 + i] * LOG2E", "lse[lse_row0 + m0 + i]"),
    # no barrier between the recomputed P/dS and the products that read them
    "dropped-syncthreads": (
        "mask_stride_q, mask_stride_k);\n      __syncthreads();",
        "mask_stride_q, mask_stride_k);\n",
    ),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_template_mutations_are_caught(name, monkeypatch):
    original, mutated = MUTATIONS[name]
    options = {"causal": True, "softcap": 2.0}
    p = make_problem("float32", (1, 2, 1, 64, 64, 16), seed=2, options=options)
    render = backward.render
    spec = backward_api.default_backward_spec("float32", 16, causal=True, variants=("softcap",))
    assert original in render(spec), name  # the mutation applies to the kernel under test

    monkeypatch.setattr(backward, "render", lambda s: render(s).replace(original, mutated))
    monkeypatch.setattr(backward_api, "_KERNELS", {})
    try:
        grads = run(p)
    except EmulatorLaunchError:  # a trap or hazard the emulator found is a catch too
        return
    with pytest.raises(AssertionError):
        check(p, grads, "float32")


# ---- input errors ------------------------------------------------------------------------------
def test_bad_inputs_raise_typed_errors():
    p = make_problem("float32", (1, 2, 2, 8, 8, 16))
    out, lse = kernelgen.attention(p.q, p.k, p.v, return_lse=True)
    with pytest.raises(InputError, match="lse"):
        kernelgen.attention_backward(p.dout, p.q, p.k, p.v, out, lse[:, :1])
    with pytest.raises(InputError, match="dout"):
        kernelgen.attention_backward(p.dout[:, :1], p.q, p.k, p.v, out, lse)
    with pytest.raises(InputTypeError, match="out"):
        kernelgen.attention_backward(p.dout, p.q, p.k, p.v, out.astype(np.float16), lse)
    with pytest.raises(InputTypeError, match="deterministic"):
        kernelgen.attention_backward(p.dout, p.q, p.k, p.v, out, lse, deterministic="yes")
    with pytest.raises(InputTypeError, match="BackwardSpec"):
        kernelgen.attention_backward(p.dout, p.q, p.k, p.v, out, lse, spec="fa_bwd")
    spec = BackwardSpec(family="backward", dtype="float32", head_dim=16)
    with pytest.raises(InputError, match="causal"):
        kernelgen.attention_backward(p.dout, p.q, p.k, p.v, out, lse, causal=True, spec=spec)
    with pytest.raises(InputError, match="deterministic"):
        kernelgen.attention_backward(p.dout, p.q, p.k, p.v, out, lse, spec=spec, deterministic=True)


# ---- the tensor-core engine (mma_sync) --------------------------------------------------------
def tc_spec(dtype: str, head_dim: int, **fields) -> BackwardSpec:
    """A small tensor-core tiling: 32 keys x 32 queries, 2 warps that split the queries 16 each
    (8-byte stores of P^T and dS^T); ``block_m=64, block_n=64, num_warps=4`` gives 32-query
    warp tiles (16-byte stores)."""
    base = {"family": "backward", "mma": "mma_sync", "dtype": dtype, "head_dim": head_dim,
            "block_m": 32, "block_n": 32, "num_warps": 2}  # fmt: skip
    return BackwardSpec(**{**base, **fields})


WIDE = {"block_m": 64, "block_n": 64, "num_warps": 4}
TC_CASES = {
    # odd lengths, Sq != Sk, GQA, a head dim with a padding n8 tile (40 = 48 - 8)
    "odd-gqa-f16": (tc_spec("float16", 40), (1, 4, 2, 37, 53), {}),
    "causal-sq-gt-sk-bf16": (tc_spec("bfloat16", 64, causal=True, **WIDE), (2, 2, 1, 45, 19), {}),
    "causal-sq-lt-sk-f16": (tc_spec("float16", 24, causal=True), (1, 3, 3, 9, 70), {}),
    "window-two-sided-bf16": (tc_spec("bfloat16", 32, window=True), (1, 2, 1, 30, 50),
                              {"window_size": (4, 9)}),
    "variants-uneven-pairs-f16": (  # 3 column pairs over 2 warps: the per-pair lane offsets
        tc_spec("float16", 96, causal=True, window=True, softcap=True, alibi=True, sinks=True,
                **WIDE),
        (1, 4, 2, 33, 47),
        {"window_size": (6, -1), "softcap": 2.5},
    ),
    "deterministic-gqa-bf16": (tc_spec("bfloat16", 64, deterministic=True), (1, 4, 1, 40, 35), {}),
    # split roles: 16-query groups, a padding n8 tile (dV^T/dK^T rows past the head dim), GQA
    "split-odd-gqa-f16": (tc_spec("float16", 40, split_roles=True), (1, 4, 2, 37, 53), {}),
    # split roles: 32-query groups, the exact tiles of causal, window, ALiBi and sinks (P warps)
    "split-variants-bf16": (
        tc_spec("bfloat16", 64, causal=True, window=True, alibi=True, sinks=True, split_roles=True,
                **WIDE),
        (1, 4, 2, 45, 70),
        {"window_size": (9, -1)},
    ),
    "split-deterministic-f16": (
        tc_spec("float16", 48, deterministic=True, split_roles=True, **WIDE), (2, 2, 1, 70, 33), {}
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", TC_CASES)
def test_tensor_core_backward_matches_the_float64_gradients(name):
    spec, shape, values = TC_CASES[name]
    options = {"causal": spec.causal, **_variant_values(spec, shape[1]), **values}
    p = make_problem(spec.dtype, (*shape, spec.head_dim), seed=len(name), options=options)
    errors = check(p, run(p, spec=spec, deterministic=spec.deterministic), spec.dtype)
    assert errors["dq"] > 0


def test_default_backward_uses_the_tensor_cores_for_fp16_and_bf16():
    p = make_problem("bfloat16", (1, 2, 1, 20, 30, 64))
    out, lse = kernelgen.attention(p.q, p.k, p.v, return_lse=True)
    seen = []
    kernels = backward_api._kernels

    def spy(spec, arrays, device):
        seen.append(spec)
        return kernels(spec, arrays, device)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backward_api, "_kernels", spy)
        grads = kernelgen.attention_backward(p.dout, p.q, p.k, p.v, out, lse)
    assert seen[0].mma == "mma_sync"
    check(p, grads, "bfloat16")


def test_tensor_core_additive_mask_with_hidden_rows():
    p = make_problem("float16", (1, 2, 2, 12, 40, 32))
    mask = np.random.default_rng(1).normal(0, 1, (1, 1, 12, 40)).astype(np.float32)
    mask[..., 3, :] = -np.inf  # a row with no visible key
    mask[..., :, 7] = -np.inf
    p.options["mask"] = mask
    p.ref_options["mask"] = mask.astype(np.float64)
    grads = run(p, spec=tc_spec("float16", 32))
    check(p, grads, "float16")
    assert np.all(grads[0][:, :, 3] == 0) and np.all(grads[1][:, :, 7] == 0)


def test_tensor_core_expressions_match_the_float64_gradients():
    batch, heads, seqlen_q, seqlen_k = 1, 2, 18, 27
    rng = np.random.default_rng(9)
    doc = np.sort(rng.integers(0, 3, (batch, seqlen_k)), axis=1).astype(np.int32)
    inputs = {
        "bias": rng.standard_normal((heads, seqlen_q, seqlen_k)).astype(np.float32),
        "doc": doc,
        "offset": np.array([seqlen_k - seqlen_q], np.int64),
    }
    declared = inputs_from_arrays(inputs)
    expression = parse_score_mod(SCORE_MODS[0], declared)
    mask_expression = parse_mask_mod(MASK_MOD, declared)
    ref = {
        "causal": True,
        "mask_mod": lambda b, h, q, k: evaluate(
            mask_expression, b=b, h=h, q_idx=q, kv_idx=k, inputs=inputs
        ),
        "score_mod": lambda s, b, h, q, k: evaluate(
            expression, score=s, b=b, h=h, q_idx=q, kv_idx=k, inputs=inputs
        ),
        "score_mod_grad": score_mod_grad_callable(expression, inputs),
    }
    options = {"causal": True, "score_mod": SCORE_MODS[0], "mask_mod": MASK_MOD,
               "mod_inputs": inputs}  # fmt: skip
    p = make_problem("bfloat16", (batch, heads, 1, seqlen_q, seqlen_k, 32), 4, options, ref)
    fields = {k: v for k, v in (("score_mod", SCORE_MODS[0]), ("mask_mod", MASK_MOD))}
    spec = tc_spec("bfloat16", 32, causal=True, mod_inputs=tuple(i.signature for i in declared),
                   **fields)  # fmt: skip
    check(p, run(p, spec=spec), "bfloat16")


@pytest.mark.parametrize("split", [False, True], ids=["grid", "split-roles"])
def test_tensor_core_backward_is_bitwise_stable_across_block_orders_when_deterministic(
    monkeypatch, split
):
    """dk, dv (no atomics) and the deterministic dq give the same bits in every block order; the
    atomic dq's fp32 sums are reordered too, but rounding to fp16 mostly hides it, so it is only
    checked against the reference. Both warp layouts (split_roles: one P and one dS warp)."""
    p = make_problem("float16", (1, 4, 1, 24, 160, 16), seed=11)
    out, lse = kernelgen.attention(p.q, p.k, p.v, return_lse=True)
    specs = {
        det: tc_spec("float16", 16, deterministic=det, split_roles=split) for det in (False, True)
    }
    grads = {False: {}, True: {}}
    for seed in (0, 1, 2):
        monkeypatch.setenv("KG_EMULATOR_BLOCK_ORDER", str(seed))
        for det, spec in specs.items():
            grads[det][seed] = kernelgen.attention_backward(
                p.dout, p.q, p.k, p.v, out, lse, spec=spec, deterministic=det
            )
    for runs in grads.values():
        for i in (1, 2):  # dk, dv
            assert len({g[i].tobytes() for g in runs.values()}) == 1
    assert len({g[0].tobytes() for g in grads[True].values()}) == 1
    check(p, grads[True][1], "float16")
    check(p, grads[False][1], "float16")


TC_MUTATIONS = {
    # no barrier between the warps' P^T / dS^T stores and the products that read them
    "dropped-mid-barrier": (
        "      __syncthreads();  // P^T and dS^T of every warp are in shared memory\n",
        "\n",
    ),
    # the products run before the query tile's copies have landed
    "dropped-cp-async-wait": (
        "cp_async_wait<0>();  // this thread's copies of tile t (and of K, V) have landed",
        "",
    ),
    # dO read untransposed as dV's B operand
    "trans-dropped": (
        "      ldmatrix_x4_trans(b, b_tile + b_lane.bytes(16 * kk,",
        "      ldmatrix_x4(b, b_tile + b_lane.bytes(16 * kk,",
    ),
    # D of the warp's first query columns for every lane
    "delta-wrong-rows": (
        "slot_stats + BLOCK_M + 2 * (query0 + 2 * n)",
        "slot_stats + BLOCK_M + 2 * (dw * WARP_Q + 2 * n)",
    ),
    # Q and dO rows of the scores in the plain order while P^T is stored in the permuted one
    "query-order-lost": (
        "dw * WARP_Q + QUERY_BLOCK * ((lane % 8) / 2) + 2 * (lane / 16) + lane % 2,",
        "dw * WARP_Q + (lane / 16) * 8 + lane % 8,",
    ),
}


def test_split_roles_agrees_with_the_grid_layout_to_one_ulp():
    """The split layout computes every product from the same fp32 values (P reaches the dS warps
    in fp32); only the order of the queries within a k16 step of dV and dK differs (permuted), so
    dq, dk and dv are the grid layout's to within one unit in the last place of fp16."""
    p = make_problem("float16", (1, 2, 1, 70, 100, 40), seed=4, options={"causal": True})
    grid = tc_spec("float16", 40, causal=True, **WIDE)
    split = tc_spec("float16", 40, causal=True, split_roles=True, **WIDE)
    expected = run(p, spec=grid)
    got = run(p, spec=split)
    check(p, got, "float16")
    for name, a, b in zip(("dq", "dk", "dv"), expected, got, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        ulp = np.spacing(np.maximum(np.abs(a), np.abs(b)))
        assert (np.abs(a.astype(np.float32) - b.astype(np.float32)) <= ulp).all(), name


# Mutations of the split-roles kernel (split_roles: true), run on SPLIT_SPEC.
SPLIT_MUTATIONS = {
    # the dS warps read P' before the barrier after which the P warps have stored it
    "split-read-before-barrier": (
        "          block_sync();\n          if (exact)\n            probs_to_grads<true>",
        "          if (exact)\n            probs_to_grads<true>",
        "probs_to_grads<false>(dp, pairs, pt_tile, dst_tile, split_p_at, ds_factor);\n",
        "probs_to_grads<false>(dp, pairs, pt_tile, dst_tile, split_p_at, ds_factor);\n"
        "          block_sync();\n",
    ),
    # the two fp32 halves of a lane's P' read back from each other's places
    "split-halves-swapped": (
        "        load_floats(dst_tile + at, first);\n        load_floats(pt_tile + at, second);",
        "        load_floats(pt_tile + at, first);\n        load_floats(dst_tile + at, second);",
    ),
    # the B fragment's registers (queries 2t.. and 8 + 2t..) swapped
    "split-b-fragment-order": (
        "a, b_pairs[g][mt][half][n0], b_pairs[g][mt][half][n0 + 1]);",
        "a, b_pairs[g][mt][half][n0 + 1], b_pairs[g][mt][half][n0]);",
    ),
    # dV^T not divided by sigma (P' = sigma P)
    "split-dv-scale-dropped": (
        "kv_acc,\n                                  inv_sigma, warp_key0, seqlen_k);",
        "kv_acc,\n                                  1.f, warp_key0, seqlen_k);",
    ),
    # dS^T not stored: dQ reads the P warps' fp32 P' left in the dS^T tile's place
    "split-ds-store-dropped": (
        "        store_pairs(dst_tile + at, grads[g][mt][half]);\n",
        "\n",
    ),
}
SPLIT_SPEC = tc_spec("float16", 32, causal=True, split_roles=True, **WIDE)


@pytest.mark.parametrize("name", [*TC_MUTATIONS, *SPLIT_MUTATIONS])
def test_tensor_core_template_mutations_are_caught(name, monkeypatch):
    if name in SPLIT_MUTATIONS:
        spec, pairs = SPLIT_SPEC, SPLIT_MUTATIONS[name]
    else:
        spec, pairs = tc_spec("float16", 32, causal=True), TC_MUTATIONS[name]
    p = make_problem("float16", (1, 2, 1, 70, 64, 32), seed=2, options={"causal": True})
    render = backward.render
    replacements = list(zip(pairs[::2], pairs[1::2], strict=True))
    for original, _ in replacements:  # the mutation applies to the kernel under test, once
        assert render(spec).count(original) == 1, (name, original)

    def mutated_render(s):
        text = render(s)
        for original, mutated in replacements:
            text = text.replace(original, mutated)
        return text

    monkeypatch.setattr(backward, "render", mutated_render)
    monkeypatch.setattr(backward_api, "_KERNELS", {})
    # A race through plain shared-memory stores is outside the race check (docs/emulator.md):
    # whether a warp reads before the other's store depends on thread timing, so such a mutant
    # is run until caught (about 3 runs in 4 catch it; 8 leave a 1.5e-5 chance of a miss).
    attempts = TIMING_DEPENDENT_MUTATIONS.get(name, 1)
    for _ in range(attempts):
        try:
            grads = run(p, spec=spec)
        except EmulatorLaunchError:  # a trap or hazard the emulator found is a catch too
            return
        try:
            check(p, grads, "float16")
        except AssertionError:
            return
    pytest.fail(f"mutation {name!r} gave the right gradients in {attempts} runs")


# Mutations whose wrong result depends on thread timing, and the runs that must catch them
# (split-read-before-barrier went uncaught in a cold CI run once emulator builds moved to
# -Og: which warp reaches the shared tile first changed).
TIMING_DEPENDENT_MUTATIONS = {"dropped-mid-barrier": 8, "split-read-before-barrier": 8}


def _launch_stats(monkeypatch) -> dict:
    """Collects the emulator's LaunchStats of every backward kernel launched, by symbol."""
    from kernelgen.runtime import emulated_launch as launches

    stats: dict = {}
    build = launches.spec_kernels

    def recording(spec, kernels, source=None):
        def launcher(symbol, kernel):
            def launch(**kwargs):
                stats[symbol] = kernel(**kwargs)
                return stats[symbol]

            return launch

        return {s: launcher(s, k) for s, k in build(spec, kernels, source).items()}

    monkeypatch.setattr(launches, "spec_kernels", recording)
    monkeypatch.setattr(backward_api, "_KERNELS", {})
    return stats


@pytest.mark.parametrize(
    "fields",
    [{}, {**WIDE, "deterministic": True}, {**WIDE, "split_roles": True}],
    ids=["16-query-warps", "32-query-warps-det", "split-roles"],
)
def test_tensor_core_backward_ldmatrix_is_free_of_bank_conflicts(fields, monkeypatch):
    """Every ldmatrix of the main kernel (the permuted Q and dO rows of S^T and dP^T included)
    and of the dQ kernel takes one wavefront per 8x8 matrix."""
    spec = tc_spec("bfloat16", 64, causal=True, **fields)
    stats = _launch_stats(monkeypatch)
    p = make_problem("bfloat16", (1, 2, 1, 40, 70, 64), options={"causal": True})
    check(p, run(p, spec=spec, deterministic=spec.deterministic), "bfloat16")
    kernels = [spec.uri] + ([f"{spec.uri}_dq"] if spec.deterministic else [])
    for name in kernels:
        assert stats[name].ldmatrix > 0
        assert stats[name].ldmatrix_wavefronts == stats[name].ldmatrix_ideal, stats[
            name
        ].first_conflict


def test_bank_conflict_check_sees_the_permuted_rows_without_their_swizzle(monkeypatch):
    """Without the (row / 4) term of the Q/dO swizzle, the 8 rows of a permuted S^T column tile
    fall in 2 bank groups; the results stay right."""
    spec = tc_spec("bfloat16", 64, **WIDE)
    swizzle = "if (KIND == SWZ_QD) return r ^ ((row >> 2) & 6);"
    render = backward.render
    assert swizzle in render(spec)
    monkeypatch.setattr(backward, "render", lambda s: render(s).replace(swizzle, ""))
    stats = _launch_stats(monkeypatch)
    p = make_problem("bfloat16", (1, 1, 1, 64, 64, 64))
    check(p, run(p, spec=spec), "bfloat16")
    assert stats[spec.uri].ldmatrix_wavefronts > stats[spec.uri].ldmatrix_ideal
