"""GPU tier (`pytest -m gpu`): kernelgen.attention_backward on a CUDA device against the float64
analytic gradients (kernelgen.references.attention.attention_backward, itself checked against finite
differences in test_reference_backward.py): every backward spec of specs/ and the policy's
default spec, CuPy and torch inputs, GQA, causal with Sq != Sk, the variants and user
expressions, and deterministic dQ bitwise the same across calls. Every output and scratch buffer
starts as NaN. Tolerances are the forward's (kernelgen.references.attention.OUT_TOLERANCE). Skipped
where there is no device."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from attention_cases import (
    Case,
    bf16_bits_to_float,
    example_expressions,
    example_variants,
    round_to,
)
from conftest import BACKWARD_SPEC_PATHS

import kernelgen
from kernelgen.families import load_any_spec
from kernelgen.references.attention import OUT_TOLERANCE, attention_backward, relative_error

pytestmark = pytest.mark.gpu

CASES = [
    Case(2, 4, 2, 77, 77),  # batch > 1, GQA
    Case(1, 4, 1, 45, 300),  # MQA, Sq < Sk (causal: aligned to the bottom right)
    Case(1, 2, 2, 200, 61),  # Sq > Sk (causal: the first rows see no key)
    Case(2, 8, 2, 150, 333, layout="bshd"),
]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output and scratch buffer of kernelgen, CuPy or torch, starts as NaN; the forward
    that makes out and lse takes the heuristic spec (no tuning)."""
    from kernelgen.testing.poison import poisoned_outputs

    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "0")
    with poisoned_outputs():
        yield


def make_inputs(case: Case, dtype: str, head_dim: int, seed: int) -> list[np.ndarray]:
    """q, dout (B, H, Sq, D) and k, v (B, Hkv, Sk, D) as float32 holding ``dtype`` values."""
    rng = np.random.default_rng(seed)
    q_shape = (case.batch, case.heads, case.seqlen_q, head_dim)
    kv_shape = (case.batch, case.kv_heads, case.seqlen_k, head_dim)
    return [round_to(rng.standard_normal(s), dtype) for s in (q_shape, kv_shape, kv_shape, q_shape)]


def device_array(x: np.ndarray, dtype: str, layout: str):
    """``x`` (B, H, S, D) on the device as ``dtype`` in ``layout``."""
    import cupy

    from kernelgen.tuning.gpu import upload

    if layout == "bshd":
        x = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    return upload(cupy, x, dtype)


def host_float32(array) -> np.ndarray:
    """A device array of any element type as float32 NumPy."""
    import cupy

    from kernelgen.tuning.gpu import as_float32

    return as_float32(cupy, array).get()


def host_bhsd(array, layout: str) -> np.ndarray:
    """A device gradient as float32 NumPy in (B, H, S, D) order."""
    host = host_float32(array)
    return host.transpose(0, 2, 1, 3) if layout == "bshd" else host


def on_device(options: dict) -> dict:
    """attention()'s variant and expression arguments with their arrays on the device."""
    import cupy

    def device(x):
        return cupy.asarray(x) if isinstance(x, np.ndarray) else x

    result = {name: device(x) for name, x in options.items()}
    if "mod_inputs" in result:
        result["mod_inputs"] = {n: device(x) for n, x in result["mod_inputs"].items()}
    return result


def run_cupy(case: Case, host: list, dtype: str, causal: bool, spec=None, det=False, **options):
    """Forward (for out and lse) then backward through kernelgen on CuPy arrays; the gradients
    on the host in (B, H, S, D) order (dsinks as fp32)."""
    q, k, v, dout = (device_array(x, dtype, case.layout) for x in host)
    options = on_device(options)
    out, lse = kernelgen.attention(
        q, k, v, causal=causal, layout=case.layout, return_lse=True, **options
    )
    grads = kernelgen.attention_backward(
        dout, q, k, v, out, lse, causal=causal, layout=case.layout, deterministic=det, spec=spec,
        **options,
    )  # fmt: skip
    assert grads[0].dtype == q.dtype and grads[1].shape == k.shape
    return [host_bhsd(g, case.layout) for g in grads[:3]] + [host_float32(g) for g in grads[3:]]


def check(grads: list, host: list, dtype: str, **reference_options) -> dict[str, float]:
    """Each gradient's relative Frobenius error against the float64 reference of the rounded
    inputs, asserted within the forward's tolerance for ``dtype``."""
    q, k, v, dout = (np.asarray(x, dtype=np.float64) for x in host)
    ref = attention_backward(dout, q, k, v, **reference_options)
    names = ["dq", "dk", "dv"] + (["dsinks"] if ref.dsinks is not None else [])
    assert len(grads) == len(names)
    errors = {}
    for name, got in zip(names, grads, strict=True):
        got = np.asarray(got, dtype=np.float64)
        want = getattr(ref, name)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        assert np.isfinite(got).all(), f"non-finite {name} at {np.argwhere(~np.isfinite(got))[:5]}"
        errors[name] = relative_error(got, want)
    assert all(e <= OUT_TOLERANCE[dtype] for e in errors.values()), errors
    return errors


# ---- every backward spec of specs/ ---------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("path", BACKWARD_SPEC_PATHS, ids=lambda p: p.stem)
def test_backward_spec_on_gpu(path, case):
    """Every backward spec file, with its variants' and expressions' example values."""
    spec = load_any_spec(path)
    seed = zlib.crc32(f"{path.stem} {case}".encode())
    variants = example_variants(spec.variants, case.batch, case.heads, seed, window=(60, 7))
    expressions, hooks = example_expressions(spec, case, seed)
    host = make_inputs(case, spec.dtype, spec.head_dim, seed)
    grads = run_cupy(
        case, host, spec.dtype, spec.causal, spec, spec.deterministic, **variants, **expressions
    )
    errors = check(grads, host, spec.dtype, causal=spec.causal, **variants, **hooks)
    assert errors["dq"] > 0  # a real comparison, not two copies


# ---- the policy's default spec ---------------------------------------------------------------
DEFAULTS = [
    (dtype, head_dim, head_dim == 128, index % 2 == 0)  # (dtype, head dim, deterministic, causal)
    for index, (dtype, head_dim) in enumerate(
        (d, h) for d in ("float16", "bfloat16", "float32") for h in (64, 128, 256)
    )
]


@pytest.mark.parametrize(("dtype", "head_dim", "det", "causal"), DEFAULTS, ids=str)
def test_default_backward_spec_on_gpu(dtype, head_dim, det, causal):
    """attention_backward without a spec: the policy's default for every dtype and head dim."""
    case = Case(2, 4, 2, 77, 200)  # GQA, Sq < Sk
    host = make_inputs(case, dtype, head_dim, seed=head_dim + len(dtype))
    grads = run_cupy(case, host, dtype, causal, det=det)
    check(grads, host, dtype, causal=causal)


def test_backward_torch_tensors_in_torch_tensors_out():
    """torch CUDA tensors in, torch gradients out (same device and dtype), on torch's stream."""
    torch = pytest.importorskip("torch")
    case = Case(1, 4, 2, 100, 300)
    host = make_inputs(case, "bfloat16", 64, seed=5)
    q, k, v, dout = (torch.from_numpy(x).to("cuda", torch.bfloat16) for x in host)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out, lse = kernelgen.attention(q, k, v, causal=True, return_lse=True)
        grads = kernelgen.attention_backward(dout, q, k, v, out, lse, causal=True)
    side.synchronize()
    assert all(isinstance(g, torch.Tensor) for g in grads) and len(grads) == 3
    assert all(g.device == q.device and g.dtype == torch.bfloat16 for g in grads)
    check([g.float().cpu().numpy() for g in grads], host, "bfloat16", causal=True)


# ---- variants and expressions ------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags",
    [("window",), ("softcap",), ("alibi",), ("sinks",), ("window", "softcap", "alibi", "sinks")],
    ids="-".join,
)
def test_backward_variants_on_gpu(flags):
    """The built-in variants (docs/variants.md) and dsinks, fp16 d64, bshd, GQA, causal."""
    case = Case(2, 4, 2, 150, 300, layout="bshd")
    seed = zlib.crc32(" ".join(flags).encode())
    variants = example_variants(flags, case.batch, case.heads, seed, window=(90, 5))
    host = make_inputs(case, "float16", 64, seed)
    grads = run_cupy(case, host, "float16", True, **variants)
    errors = check(grads, host, "float16", causal=True, **variants)
    assert ("dsinks" in errors) == ("sinks" in flags)


def test_backward_expressions_on_gpu():
    """score_mod (a nonlinear one, its derivative compiled in) and mask_mod with mod inputs on
    the device (docs/expressions.md)."""
    from kernelgen.references.expressions import evaluate
    from kernelgen.specs.expression_grad import score_mod_grad_callable
    from kernelgen.specs.expressions import inputs_from_arrays, parse_mask_mod, parse_score_mod

    case = Case(2, 4, 2, 200, 200)
    rng = np.random.default_rng(3)
    inputs = {
        "doc": np.repeat(np.arange(4, dtype=np.int32), [30, 90, 20, 60])[None].repeat(2, 0),
        "bias": (0.3 * rng.standard_normal((4, 400))).astype(np.float32),
    }
    score_text = (
        "where(score > 0, 2 * tanh(score / 2), score * score / 4) + bias[h, q_idx - kv_idx + 200]"
    )
    mask_text = "doc[b, q_idx] == doc[b, kv_idx]"
    declared = inputs_from_arrays(inputs)
    score_mod, mask_mod = parse_score_mod(score_text, declared), parse_mask_mod(mask_text, declared)
    hooks = {
        "score_mod": lambda s, b, h, q, k: evaluate(
            score_mod, score=s, b=b, h=h, q_idx=q, kv_idx=k, inputs=inputs
        ),
        "score_mod_grad": score_mod_grad_callable(score_mod, inputs),
        "mask_mod": lambda b, h, q, k: evaluate(
            mask_mod, b=b, h=h, q_idx=q, kv_idx=k, inputs=inputs
        ),
    }
    host = make_inputs(case, "float16", 64, seed=11)
    grads = run_cupy(
        case, host, "float16", True, score_mod=score_text, mask_mod=mask_text, mod_inputs=inputs
    )
    check(grads, host, "float16", causal=True, **hooks)


# ---- determinism -----------------------------------------------------------------------------
def test_deterministic_gradients_are_bitwise_the_same_across_calls():
    """deterministic=True: dq, dk and dv bit for bit the same on every call; with atomics dk
    and dv still are (only dq is accumulated with atomics). Many key tiles and a GQA group add
    into each dq row, so an atomic order that changes would show."""
    import cupy

    case = Case(1, 8, 2, 64, 2048)
    host = make_inputs(case, "bfloat16", 128, seed=21)
    q, k, v, dout = (device_array(x, "bfloat16", "bhsd") for x in host)
    out, lse = kernelgen.attention(q, k, v, return_lse=True)

    def grads(det: bool) -> list[np.ndarray]:
        result = kernelgen.attention_backward(dout, q, k, v, out, lse, deterministic=det)
        cupy.cuda.Device().synchronize()
        return [g.get().view(np.uint16) for g in result]

    first, second = grads(True), grads(True)
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
    atomic, again = grads(False), grads(False)
    assert np.array_equal(atomic[1], again[1]) and np.array_equal(atomic[2], again[2])
    check([bf16_bits_to_float(g) for g in first], host, "bfloat16")
