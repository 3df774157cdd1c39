"""fp8 (e4m3) through the torch custom operator ``torch.ops.kernelgen.attention``
(kernelgen.torch_ops): eager on CPU tensors (the emulator) and traced by
``torch.compile(fullgraph=True)`` through the fake implementation, against the float64 reference
of the quantized inputs with the element-wise bound of tests/test_emulated_fp8.py; the typed
errors of bad fp8 calls, eager and at trace time; no backward (docs/hopper.md, fp8)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import CPU_BACKEND_MARKS
from test_emulated_fp8 import bound_ratio, problem, reference

from kernelgen.errors import InputError, InputTypeError
from kernelgen.references.fp8 import FP8_LSE_TOLERANCE, P_RELATIVE

torch = pytest.importorskip("torch")
kt = pytest.importorskip("kernelgen.torch_ops")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this torch has no float8_e4m3fn", allow_module_level=True)

pytestmark = CPU_BACKEND_MARKS

SCALE = 128**-0.5
DESCALES = ("q_descale", "k_descale", "v_descale")


def fp8_tensors(bits: np.ndarray, layout: str):
    """e4m3 bit patterns (B, H, S, D) as a torch.float8_e4m3fn tensor in ``layout`` (bshd: a
    transposed view, strides not the contiguous ones)."""
    x = torch.from_numpy(bits).view(torch.float8_e4m3fn)
    return x.transpose(1, 2) if layout == "bshd" else x


def check_within_bound(out, lse, bits, descales, causal, layout):
    """out (bf16, ``layout``) and lse against float64 of the decoded inputs: the bound per
    element, the relative Frobenius error and the lse."""
    q, k, v = bits
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    got = out.float().double().numpy()
    if layout == "bshd":
        got = got.transpose(0, 2, 1, 3)
    assert got.shape == q.shape and tuple(lse.shape) == q.shape[:3]
    ref, lse_ref, a, b = reference(q, k, v, descales, causal, SCALE)
    ratio = bound_ratio(got, ref, a, b)
    relative = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    print(f"max error / bound {ratio:.3f}, relative Frobenius error {relative:.4f}")
    assert np.isfinite(got).all()
    assert ratio <= 1.0
    assert relative < P_RELATIVE
    np.testing.assert_allclose(lse.numpy(), lse_ref, rtol=0, atol=FP8_LSE_TOLERANCE)
    return ratio


# (layout, causal, descales, shape): GQA and MQA, lengths off the tiles and off 16
CASES = [
    ("bhsd", True, True, (2, 4, 2, 70, 150)),
    ("bshd", False, False, (1, 3, 1, 45, 131)),
]


@pytest.mark.parametrize(("layout", "causal", "with_descales", "shape"), CASES)
def test_the_operator_runs_fp8_eagerly(layout, causal, with_descales, shape):
    """The operator itself (positional, as a graph calls it) and the wrapper on CPU tensors;
    an fp8 q that requires grad is fine under torch.no_grad()."""
    bits = problem(21 + shape[4], *shape, descales=with_descales)
    q, k, v = (fp8_tensors(x, layout) for x in bits[:3])
    descales = [torch.from_numpy(bits[3][n]) if with_descales else None for n in DESCALES]
    out, lse = torch.ops.kernelgen.attention(
        q, k, v, None, causal, None, layout, None, None, None, None, None, None, False, *descales
    )
    check_within_bound(out, lse, bits[:3], bits[3], causal, layout)
    with torch.no_grad():
        again = kt.attention(
            q.detach().requires_grad_(), k, v, causal=causal, layout=layout,
            **dict(zip(DESCALES, descales, strict=True)),
        )  # fmt: skip
    torch.testing.assert_close(again, out, rtol=0, atol=0)


def test_torch_compile_fullgraph_traces_fp8():
    """A compiled function (fullgraph) around the operator, with torch ops before and after:
    the fake implementation gives bf16 out and fp32 lse of the right shapes, and the compiled
    results obey the bound."""
    bits = problem(31, 1, 4, 2, 64, 140)
    q, k, v = (fp8_tensors(x, "bhsd") for x in bits[:3])
    qd, kd, vd = (torch.from_numpy(bits[3][n]) for n in DESCALES)

    def fn(q, k, v, qd, kd, vd):
        out, lse = kt.attention(
            q, k, v, causal=True, return_lse=True, q_descale=qd * 1.0, k_descale=kd, v_descale=vd
        )
        return out.float() + 0.0, lse

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out, lse = compiled(q, k, v, qd, kd, vd)
    check_within_bound(out.to(torch.bfloat16), lse, bits[:3], bits[3], True, "bhsd")


def test_the_fp8_fake_implementation_passes_torch_library_checks():
    """The fake implementation against the eager results (torch.library.opcheck's
    test_faketensor): the fake's out is bfloat16, as the kernel's. (opcheck's test_schema cannot
    run on fp8 tensors: it multiplies them, which torch's CPU fp8 lacks; tests/test_torch_ops.py
    runs it on the same schema with float32 inputs.)"""
    bits = problem(41, 1, 2, 1, 20, 40)
    q, k, v = (fp8_tensors(x, "bhsd") for x in bits[:3])
    descales = [torch.from_numpy(bits[3][n]) for n in DESCALES]
    args = (q, k, v, None, False, None, "bhsd", None, None, None, None, None, None, False,
            *descales)  # fmt: skip
    torch.library.opcheck(
        torch.ops.kernelgen.attention.default, args, test_utils=("test_faketensor",)
    )


def test_the_descales_reach_the_kernel():
    """Mutation: the operator dropping v's descale (the bound fails)."""
    bits = problem(51, 1, 2, 1, 33, 130)
    q, k, v = (fp8_tensors(x, "bhsd") for x in bits[:3])
    descales = {n: torch.from_numpy(bits[3][n]) for n in DESCALES}
    kept = kt._fp8_arguments

    def dropped(*args):
        arguments = kept(*args)
        arguments["descales"] = {**arguments["descales"], "v_descale": None}
        return arguments

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kt, "_fp8_arguments", dropped)
        out = kt.attention(q, k, v, **descales)
    ref, _, a, b = reference(*bits, False, SCALE)
    assert bound_ratio(out.float().double().numpy(), ref, a, b) > 1.0


def zeros(head_dim: int = 128, kv_heads: int = 2):
    """fp8 q, k, v of zero bytes (nothing runs: every case fails its checks)."""
    q = torch.zeros(2, 4, 8, head_dim).to(torch.float8_e4m3fn)
    k = torch.zeros(2, kv_heads, 16, head_dim).to(torch.float8_e4m3fn)
    return q, k, k.clone()


# (what changes, error, message): each names the argument, its value and what is allowed
BAD_CALLS = [
    ({"softcap": -3.0}, InputError, "softcap=-3.0 is not allowed; use a finite number > 0"),
    ({"window_size": (-4, 0)}, InputError, "window_size=(-4, 0): left=-4 is not allowed"),
    ({"sinks": torch.zeros(3)}, InputError, "sinks has shape (3,)"),
    ({"num_splits": 2}, InputError, "num_splits=2 is not allowed with fp8 inputs"),
    ({"deterministic": True}, InputError, "deterministic=True is not allowed with fp8 inputs"),
    ({"k_descale": torch.ones(2, 4)}, InputError, "k_descale has shape (2, 4); expected (2, 2)"),
    ({"v_descale": torch.ones(2, 2, dtype=torch.int32)}, InputTypeError,
     "v_descale has dtype int32; expected float32"),
    ({"head_dim": 80}, InputError, "head_dim=80 is not allowed with float8_e4m3 inputs"),
    ({"v": "bf16"}, InputTypeError, "v has dtype bfloat16 but q has float8_e4m3fn"),
    ({"bf16": True, "q_descale": torch.ones(2, 2)}, InputTypeError,
     "q_descale is not allowed with non-fp8 inputs"),
]  # fmt: skip


def bad_call(change: dict):
    """The operator's arguments for one of BAD_CALLS."""
    change = dict(change)
    q, k, v = zeros(change.pop("head_dim", 128))
    if change.pop("v", None):
        v = v.to(torch.bfloat16)
    if change.pop("bf16", False):
        q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    return (q, k, v), change


@pytest.mark.parametrize(("change", "error", "message"), BAD_CALLS, ids=lambda x: str(x)[:30])
def test_bad_fp8_calls_raise_typed_errors_eagerly_and_when_traced(change, error, message):
    """The eager wrapper, and the fake implementation under FakeTensorMode (what torch.compile
    runs), raise the same typed error."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    (q, k, v), keywords = bad_call(change)
    with pytest.raises(error, match=re.escape(message)):
        kt.attention(q, k, v, **keywords)
    with (
        FakeTensorMode(allow_non_fake_inputs=True) as mode,
        pytest.raises(error, match=re.escape(message)),
    ):
        fakes = {n: mode.from_tensor(x) for n, x in keywords.items() if torch.is_tensor(x)}
        kt.attention(*(mode.from_tensor(x) for x in (q, k, v)), **{**keywords, **fakes})


def test_a_bad_fp8_call_fails_when_compiled():
    """torch.compile runs the fake implementation's checks: dynamo reports the typed error's
    text (it wraps exceptions raised while tracing)."""
    q, k, v = zeros()

    def fn(q, k, v):
        return kt.attention(q, k, v, num_splits=2)

    with pytest.raises(Exception, match=re.escape("num_splits=2 is not allowed with fp8 inputs")):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)


def test_fp8_has_no_backward_through_the_operator():
    """An fp8 input that requires grad while autograd records: InputError from the operator's
    autograd context (eager) and when a compiled function traces it."""
    q, k, v = zeros()
    q.requires_grad_(True)
    message = "q requires grad, but fp8 attention has no backward pass"
    with pytest.raises(InputError, match=message):
        torch.ops.kernelgen.attention(q, k, v)
    with pytest.raises(Exception, match=message):
        torch.compile(kt.attention, fullgraph=True, backend="aot_eager")(q, k, v)
    sinks = torch.zeros(4, requires_grad=True)  # the sinks' gradient would be lost too
    with pytest.raises(Exception, match="sinks requires grad, but fp8 attention has no backward"):
        torch.compile(kt.attention, fullgraph=True, backend="aot_eager")(
            q.detach(), k, v, sinks=sinks
        )
