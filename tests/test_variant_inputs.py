"""CPU tier: the variant arguments of attention() (docs/variants.md) are checked on metadata,
before anything is compiled or launched, with typed errors naming the argument; the spec a call
runs carries the variant flags, and a user-given spec must match them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from test_api_inputs import FakeDeviceArray, infos

import kernelgen
from kernelgen.calls import attention as api
from kernelgen.calls.attention import check_inputs, describe
from kernelgen.calls.variant_inputs import VariantArgs, check_variants
from kernelgen.errors import InputError, InputTypeError, SpecError
from kernelgen.kernels.render import kernel_params, render
from kernelgen.model.policy import default_spec
from kernelgen.specs.forward import KernelSpec, spec_from_dict, spec_json_schema
from kernelgen.tuning.key import DeviceInfo, ProblemDesc, SoftwareInfo, TuningKey

BATCH, HEADS = 2, 8  # infos()' q is (2, 8, 17, 64)


def fp32(shape, typestr="<f4", name="alibi_slopes"):
    return describe(FakeDeviceArray(shape, typestr), name)


def check(spec=None, causal=False, **variants):
    arrays, mask = infos()
    return check_inputs(
        *arrays, mask, layout="bhsd", scale=None, spec=spec, causal=causal,
        variants=VariantArgs(**variants),
    )  # fmt: skip


def test_window_is_normalised_and_causal_narrows_its_right_side():
    assert check(window_size=(5, 3)).variants.window == (5, 3)
    assert check(window_size=(5, 3), causal=True).variants.window == (5, 0)
    assert check(window_size=(5, -1), causal=True).variants.window == (5, 0)
    # unbounded on the left within causal is causal itself; (-1, -1) is no window
    assert check(window_size=(-1, 4), causal=True).variants.window is None
    assert check(window_size=(-1, -1)).variants.window is None
    assert check(window_size=(np.int64(2), 0)).variants.flags == ("window",)


@pytest.mark.parametrize(
    ("variants", "error", "needle"),
    [
        ({"window_size": (-2, 0)}, InputError, "window_size=(-2, 0): left=-2 is not allowed"),
        ({"window_size": (0, -5)}, InputError, "right=-5 is not allowed"),
        ({"window_size": 4}, InputError, "window_size=4 is not allowed; use a pair"),
        ({"window_size": (1, 2, 3)}, InputError, "use a pair (left, right)"),
        ({"window_size": (1.5, 0)}, InputTypeError, "left has type float"),
        ({"window_size": (True, 0)}, InputTypeError, "left has type bool"),
        ({"softcap": 0.0}, InputError, "softcap=0.0 is not allowed; use a finite number > 0"),
        ({"softcap": -2}, InputError, "softcap=-2 is not allowed"),
        ({"softcap": math.nan}, InputError, "softcap=nan is not allowed"),
        ({"softcap": math.inf}, InputError, "softcap=inf is not allowed"),
        ({"softcap": "30"}, InputTypeError, "softcap has type str"),
        ({"alibi_slopes": fp32((HEADS + 1,))}, InputError, "alibi_slopes has shape (9,)"),
        ({"alibi_slopes": fp32((BATCH, HEADS, 1))}, InputError, "expected (8,) or (2, 8)"),
        ({"alibi_slopes": fp32((HEADS,), "<f2")}, InputTypeError, "alibi_slopes has dtype"),
        ({"alibi_slopes": fp32((HEADS,), "<f8")}, InputTypeError, "expected float32"),
        ({"sinks": fp32((BATCH, HEADS), name="sinks")}, InputError, "sinks has shape (2, 8)"),
        ({"sinks": fp32((HEADS,), "<i4", name="sinks")}, InputTypeError, "sinks has dtype int32"),
        (
            {"sinks": describe(FakeDeviceArray((HEADS,), "<f4", strides=(8,)), "sinks")},
            InputError,
            "sinks has stride 2",
        ),
    ],
)
def test_bad_variants_raise_typed_errors_naming_the_argument(variants, error, needle):
    with pytest.raises(error) as excinfo:
        check(**variants)
    assert needle in str(excinfo.value)
    assert "\n" not in str(excinfo.value)


def test_bad_variants_fail_before_any_compile_or_launch(monkeypatch):
    """attention() on host arrays (the emulator backend) refuses them before building a kernel."""

    def no_kernel(*_):
        raise AssertionError("a kernel was built for a call with bad arguments")

    monkeypatch.setattr(api, "emulated_kernel", no_kernel)
    q = np.zeros((1, 2, 5, 16), np.float32)
    with pytest.raises(InputError, match="window_size"):
        kernelgen.attention(q, q, q, window_size=(-3, 1))
    with pytest.raises(InputError, match="softcap"):
        kernelgen.attention(q, q, q, softcap=0)
    with pytest.raises(InputError, match="alibi_slopes has shape"):
        kernelgen.attention(q, q, q, alibi_slopes=np.ones(3, np.float32))
    with pytest.raises(InputTypeError, match="sinks has dtype float64"):
        kernelgen.attention(q, q, q, sinks=np.ones(2))


def test_alibi_batch_stride():
    per_head, per_batch = (
        check_variants(
            VariantArgs(alibi_slopes=FakeDeviceArray(shape, "<f4")), describe=describe,
            causal=False,
            batch=BATCH, heads=HEADS, seqlen_q=17, seqlen_k=17,
        )
        for shape in ((HEADS,), (BATCH, HEADS))
    )  # fmt: skip
    assert (per_head.alibi_stride_b, per_batch.alibi_stride_b) == (0, HEADS)


def test_a_given_spec_must_have_the_calls_variants():
    plain = default_spec("float16", 64, False, "sm_90")
    with pytest.raises(InputError, match=r"compiled with variants \[none\] but the call needs"):
        check(spec=plain, softcap=30.0)
    windowed = default_spec("float16", 64, False, "sm_90", variants=("window", "sinks"))
    with pytest.raises(InputError, match=r"\[window, sinks\] but the call needs \[window\]"):
        check(spec=windowed, window_size=(8, 8))
    sinks = fp32((HEADS,), name="sinks")
    assert check(spec=windowed, window_size=(8, 8), sinks=sinks).variants.flags == (
        "window",
        "sinks",
    )
    # a window kernel serves calls without a window too (unbounded on both sides)
    assert check(spec=windowed, sinks=sinks).variants.window is None


def test_spec_flags_name_the_kernel_and_add_its_parameters():
    base = dict(loop_order="v2", mma="mma_sync", dtype="bfloat16", head_dim=64, block_m=64)
    plain = KernelSpec(**base, block_n=64)
    every = KernelSpec(**base, block_n=64, window=True, softcap=True, alibi=True, sinks=True)
    assert every.uri == plain.uri + "_win_cap_alibi_sink"
    added = [p.name for p in kernel_params(every)][len(kernel_params(plain)) :]
    assert added == [
        "window_left",
        "window_right",
        "softcap",
        "alibi_slopes",
        "alibi_stride_b",
        "sinks",
    ]
    # a plain spec's dump (and so its cache identity) has no variant fields
    assert "window" not in plain.canonical_json() and '"sinks":true' in every.canonical_json()
    source = render(every)
    assert "constexpr bool WINDOW = true;" in source and "tanhf(" in source
    assert "constexpr bool WINDOW = false;" in render(plain)
    # split-KV: the sinks go to the combine kernel, not the main one
    decode = {**base, "block_m": 16, "num_warps": 1}
    split = KernelSpec(**decode, block_n=64, split_kv=True, sinks=True)
    assert "sinks" not in [p.name for p in kernel_params(split)]


def test_variant_flags_in_the_schema_and_strict_booleans():
    properties = spec_json_schema()["properties"]
    assert {"window", "softcap", "alibi", "sinks"} <= set(properties)
    base = dict(loop_order="v2", dtype="float32", head_dim=64, block_m=64, block_n=32)
    with pytest.raises(SpecError) as excinfo:
        spec_from_dict({**base, "softcap": 30})
    assert excinfo.value.problems == ["softcap=30 is not allowed; use true or false"]


def test_default_and_tuned_specs_carry_the_flags():
    spec = default_spec("bfloat16", 128, True, "sm_90", variants=("window", "sinks"))
    assert spec.variants == ("window", "sinks") and spec.mma == "mma_sync"
    decode = default_spec("float16", 64, False, "sm_90", decode_rows=4, variants=("alibi",))
    assert decode.split_kv and decode.alibi
    problem = ProblemDesc("float16", 1, 8, 8, 512, 512, 64, variants=("softcap",))
    plain = ProblemDesc("float16", 1, 8, 8, 512, 512, 64)
    assert problem.bucket() != plain.bucket()
    assert problem.bucket().label.startswith("softcap_")
    device = DeviceInfo("GPU", "9.0", 132)
    software = SoftwareInfo("0", "hash")
    plain_key = TuningKey(plain.bucket(), device, software)
    variant_key = TuningKey(problem.bucket(), device, software)
    assert "variants" not in plain_key.as_dict()["problem"]  # the key it had before variants
    assert variant_key.as_dict()["problem"]["variants"] == ["softcap"]
    for key in (plain_key, variant_key):
        assert TuningKey.from_dict(json.loads(json.dumps(key.as_dict()))) == key


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("window: 1", "window=1 is not allowed; use true or false"),
        ("sinks: 'yes'", "sinks='yes' is not allowed; use true or false"),
        ("sink: true", "unknown field 'sink' (value True); allowed fields:"),
    ],
)
def test_cli_refuses_bad_variant_fields_in_one_line(tmp_path, line, message):
    from typer.testing import CliRunner

    from kernelgen.cli import app

    path = tmp_path / "bad.yaml"
    path.write_text(
        f"loop_order: v2\ndtype: float16\nhead_dim: 64\nblock_m: 64\nblock_n: 32\n{line}\n"
    )
    result = CliRunner().invoke(app, ["show", str(path)])
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def test_templates_without_variants_refuse_a_variant_spec(tmp_path, monkeypatch):
    """An older templates folder (e.g. one a benchmark swaps in) would drop the variants
    silently: rendering a variant spec from it is an error naming the reason."""
    import importlib
    import shutil

    from kernelgen.errors import SettingError

    render_module = importlib.import_module(
        "kernelgen.kernels.render"
    )  # the package exports render()
    old = tmp_path / "templates"
    shutil.copytree(render_module.template_dir(), old)
    (old / render_module.VARIANT_PIECE).unlink()
    monkeypatch.setattr(render_module, "template_dir", lambda: old)
    spec = default_spec("float16", 64, True, "sm_90", variants=("window",))
    with pytest.raises(SettingError, match="predate the attention variants"):
        render(spec)


def test_split_counts_follow_the_windows_keys_not_the_cache():
    """A decode step with a 1024-key window over a 32768-key cache: the heuristic's chunks cut
    the window's 16 key tiles (more would only add empty chunks)."""
    import dataclasses

    from kernelgen.runtime.launch import Problem, default_num_splits, window_keys

    spec = default_spec("float16", 128, True, "sm_90", decode_rows=4, variants=("window",))
    plain = Problem(4, 32, 8, 1, 32768, 128, (0, 0, 0), (0, 0, 0), (0, 0, 0), (0, 0, 0))
    windowed = dataclasses.replace(
        plain, variant_scalars=(("window_left", 1023), ("window_right", 0))
    )
    assert window_keys(spec, plain) == 32768 and window_keys(spec, windowed) == 1024
    assert default_num_splits(spec, windowed, 132) <= 1024 // spec.block_n
    unbounded_right = dataclasses.replace(
        plain, variant_scalars=(("window_left", 1023), ("window_right", -1))
    )
    assert window_keys(spec.model_copy(update={"causal": False}), unbounded_right) == 32768
