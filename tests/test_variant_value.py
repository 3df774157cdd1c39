"""CPU tier: the variants travel as one value (kernelgen.calls.variant_inputs): every variant the
device piece (templates/variants.cuh.j2) compiles has its argument in VariantArgs, its checked
value in CallVariants and its kernel arguments from it; a variant added on one side only fails
here, and so do planted omissions."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from kernelgen.calls.attention import CheckedCall, check_inputs, describe, plan
from kernelgen.calls.variant_inputs import (
    EXPRESSION_ARGUMENTS,
    VARIANT_ARGUMENTS,
    CallVariants,
    VariantArgs,
)
from kernelgen.kernels.render import VARIANT_OFF, VARIANT_PARAMS, kernel_params, template_dir
from kernelgen.runtime.host import NumpyArrays
from kernelgen.runtime.launch import kernel_arguments
from kernelgen.specs.forward import EXPRESSION_FIELDS, VARIANT_FLAGS, KernelSpec

BATCH, HEADS, SEQ_Q, SEQ_K, DIM = 2, 4, 5, 9, 64
# The expressions' arguments beside score_mod and mask_mod: no device flag of their own.
EXPRESSION_INPUTS = ("mod_inputs", "block_mask")
# One call per built-in variant: its arguments, and the kernel arguments they must give (written
# from docs/variants.md, not from the code under test).
SLOPES = np.linspace(0.25, 2.0, BATCH * HEADS, dtype=np.float32).reshape(BATCH, HEADS)
SINKS = np.linspace(-1.0, 1.0, HEADS, dtype=np.float32)
EXAMPLES = {
    "window": ({"window_size": (4, 2)}, {"window_left": 4, "window_right": 2}),
    "softcap": ({"softcap": 30}, {"softcap": 30.0}),
    "alibi": ({"alibi_slopes": SLOPES}, {"alibi_slopes": SLOPES, "alibi_stride_b": HEADS}),
    "sinks": ({"sinks": SINKS}, {"sinks": SINKS}),
}
_FLAG_LINE = re.compile(r'constexpr bool \w+ = \{\{ "true" if spec\.(\w+)')


def device_variants(piece: str) -> list[str]:
    """The spec fields the device piece compiles a variant for (its constexpr flags)."""
    return _FLAG_LINE.findall(piece)


def coverage_problems(
    piece: str,
    args_type: type = VariantArgs,
    arguments: dict[str, str] | None = None,
    flags: tuple[str, ...] = VARIANT_FLAGS,
) -> list[str]:
    """What the Python value lacks for the device piece's variants, and the reverse."""
    arguments = {**VARIANT_ARGUMENTS, **EXPRESSION_ARGUMENTS} if arguments is None else arguments
    device = device_variants(piece)
    problems = []
    builtin = tuple(name for name in device if name not in EXPRESSION_FIELDS)
    if builtin != flags:
        problems.append(f"device flags {builtin} != VARIANT_FLAGS {flags}")
    fields = [f.name for f in dataclasses.fields(args_type)]
    for name in device:
        if arguments.get(name) not in fields:
            problems.append(f"device variant {name!r} has no field in {args_type.__name__}")
    served = {arguments[name] for name in device if name in arguments}
    for name in fields:
        if name not in served and name not in EXPRESSION_INPUTS:
            problems.append(f"{args_type.__name__}.{name} has no device variant")
    return problems


def _piece() -> str:
    return (template_dir() / "variants.cuh.j2").read_text()


def test_the_value_carries_every_variant_of_the_device_piece():
    piece = _piece()
    assert device_variants(piece) == [*VARIANT_FLAGS, "score_mod", "mask_mod"]
    assert coverage_problems(piece) == []


def test_planted_omissions_fail_the_coverage_check():
    piece = _piece()
    # a variant added on the device side only
    extra = piece + '\nconstexpr bool DROPOUT = {{ "true" if spec.dropout else "false" }};\n'
    problems = coverage_problems(extra)
    assert any("'dropout' has no field in VariantArgs" in p for p in problems), problems
    # the Python value missing a variant's field
    fields = [(f.name, object, None) for f in dataclasses.fields(VariantArgs) if f.name != "sinks"]
    without_sinks = dataclasses.make_dataclass("VariantArgs", fields, frozen=True)
    assert coverage_problems(piece, without_sinks) == [
        "device variant 'sinks' has no field in VariantArgs"
    ]
    # a variant's argument without its flag in the table, and a Python-only field
    arguments = {**VARIANT_ARGUMENTS, **EXPRESSION_ARGUMENTS}
    del arguments["softcap"]
    assert coverage_problems(piece, arguments=arguments) == [
        "device variant 'softcap' has no field in VariantArgs",
        "VariantArgs.softcap has no device variant",
    ]
    assert coverage_problems(piece, flags=VARIANT_FLAGS[:-1])[0].startswith("device flags")


def _checked(**variants) -> CheckedCall:
    rng = np.random.default_rng(7)
    q = rng.standard_normal((BATCH, HEADS, SEQ_Q, DIM)).astype(np.float16)
    k = rng.standard_normal((BATCH, 2, SEQ_K, DIM)).astype(np.float16)
    infos = [describe(x, n) for x, n in ((q, "q"), (k, "k"), (k, "v"))]
    return check_inputs(*infos, None, layout="bhsd", scale=None, spec=None, causal=False,
                        variants=VariantArgs(**variants))  # fmt: skip


def _shown(value) -> str:
    """A kernel argument in a problem's text: None (null), "array", or the number as a float."""
    if value is None or isinstance(value, np.ndarray):
        return "array" if value is not None else "None"
    return repr(float(value))


def launch_problems(flag: str, call: CheckedCall) -> list[str]:
    """Each kernel parameter of ``flag`` that the launch of ``call`` (its plan, its arrays, the
    argument packing) does not give the value EXAMPLES expects."""
    spec = KernelSpec(loop_order="v2", mma="mma_sync", dtype="float16", head_dim=DIM,
                      block_m=64, block_n=64, **{flag: True})  # fmt: skip
    params = kernel_params(spec)
    problem, _ = plan(call, "bhsd")
    values = kernel_arguments(params, problem, call.variants.tensors(NumpyArrays), 1.0, None)
    args = dict(zip([p.name for p in params], values, strict=True))
    expected = EXAMPLES[flag][1]
    problems = []
    for param in VARIANT_PARAMS[flag]:
        got, want = args[param.name], expected[param.name]
        if isinstance(want, np.ndarray):
            same = isinstance(got, np.ndarray) and np.array_equal(got, want)
        else:
            same = got is not None and float(got) == want
        if not same:
            problems.append(f"{param.name}: {_shown(got)}, expected {_shown(want)}")
    return problems


@pytest.mark.parametrize("flag", VARIANT_FLAGS)
def test_each_variant_reaches_its_kernel_arguments(flag):
    call = _checked(**EXAMPLES[flag][0])
    assert call.variants.flags == (flag,)
    assert launch_problems(flag, call) == []
    # the same kernel run without the variant gets the values that turn it off
    plain = launch_problems(flag, _checked())
    assert len(plain) == len(VARIANT_PARAMS[flag])
    for param in VARIANT_PARAMS[flag]:
        off = _shown(VARIANT_OFF.get(param.name))  # pointers: null
        assert any(p.startswith(f"{param.name}: {off},") for p in plain), (param, plain)


def test_a_dropped_kernel_argument_fails_the_launch_check(monkeypatch):
    scalars = CallVariants.scalars

    def without_softcap(self):
        return tuple((n, x) for n, x in scalars(self) if n != "softcap")

    monkeypatch.setattr(CallVariants, "scalars", without_softcap)
    assert launch_problems("softcap", _checked(softcap=30)) == ["softcap: 0.0, expected 30.0"]
    tensors = CallVariants.tensors
    monkeypatch.setattr(
        CallVariants, "tensors", lambda self, arrays: {**tensors(self, arrays), "sinks": None}
    )
    assert launch_problems("sinks", _checked(sinks=SINKS)) == ["sinks: None, expected array"]


def test_the_checked_value_holds_the_expressions():
    call = _checked(score_mod="score * 0.5", window_size=(3, -1))
    assert call.variants.window == (3, -1) and call.expressions is call.variants.expressions
    assert call.expressions.score_mod is not None and call.variants.flags == ("window",)
    assert dict(call.variants.scalars()) == {"window_left": 3, "window_right": -1}
