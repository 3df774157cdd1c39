"""What a new user runs into first: the CLI's arch, emulate, model, build --check and tune
paths, the torch operator's defaults, gradients, BlockMask's repr and the JSON Schema."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
from conftest import ROOT
from rich.console import Console
from typer.testing import CliRunner

from kernelgen.cli import app
from kernelgen.cli.console import plural

runner = CliRunner()
WGMMA_SPEC = ROOT / "specs" / "v2_wg_bf16_d128_m128_n64_s2_ovl.yaml"
SIMT_SPEC = ROOT / "specs" / "v2_f16_d64.yaml"
TREE_MASK_SPEC = ROOT / "specs" / "v2_f32_d64_m64_n32_alibi_tree_mask.yaml"
GOOD = "loop_order: v2\ndtype: float16\nhead_dim: 64\nblock_m: 64\nblock_n: 32\nnum_warps: 4\n"


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    return lines[0]


# ---- --arch a spec cannot target -------------------------------------------------------------
@pytest.mark.parametrize("command", ["build", "check", "model"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_an_arch_a_wgmma_spec_cannot_target_is_an_input_error(command, arch, tmp_path):
    """The same refusal as the arch in the YAML: one line, exit 2, nothing compiled or written."""
    out = tmp_path / "out"
    extra = ["-o", out] if command == "build" else []
    result = run(command, WGMMA_SPEC, "--arch", arch, *extra)
    assert result.exit_code == 2, result.output
    line = one_line(result)
    assert line.startswith(f"{WGMMA_SPEC}: --arch {arch}: ")
    yaml_spec = tmp_path / "s.yaml"
    yaml_spec.write_text(WGMMA_SPEC.read_text() + f"archs: [{arch}]\n")
    from_yaml = run(command, yaml_spec, *extra)
    assert from_yaml.exit_code == 2
    assert line.split(f"--arch {arch}: ")[1] == one_line(from_yaml).split(": ", 1)[1]
    assert not out.exists()


def test_an_arch_whose_shared_memory_a_spec_exceeds_is_an_input_error(tmp_path):
    spec = tmp_path / "big.yaml"
    spec.write_text(
        "loop_order: v2\ndtype: bfloat16\nhead_dim: 256\nblock_m: 128\nblock_n: 64\n"
        "num_warps: 8\nmma: mma_sync\nstages: 2\narchs: [sm_90]\n"
    )
    result = run("check", spec, "--arch", "sm_86")
    assert result.exit_code == 2, result.output
    assert "limit of sm_86" in one_line(result)


# ---- emulate ------------------------------------------------------------------------------------
def test_emulate_refuses_a_negative_seed():
    result = run("emulate", SIMT_SPEC, "--seed", "-1")
    assert result.exit_code == 2
    assert one_line(result) == "--seed -1: use an integer from 0 to 9223372036854775807"


@pytest.mark.emulate
def test_emulate_runs_a_shipped_spec_with_user_expressions():
    """The tree-mask spec's example input, checked against float64 with the mask applied."""
    result = run("emulate", TREE_MASK_SPEC, "--shape", "1,2,1,40,70")
    assert result.exit_code == 0, result.output
    assert "out: relative Frobenius error" in result.stdout
    assert "FAIL" not in result.stdout


def test_emulate_reads_mod_inputs_from_npy_files(tmp_path):
    """A --mod-input array reaches the call: one of the wrong rank is the call's refusal."""
    flat = tmp_path / "anc.npy"
    np.save(flat, np.ones(5, dtype=bool))
    result = run("emulate", TREE_MASK_SPEC, "--mod-input", f"anc={flat}")
    assert result.exit_code == 2, result.output
    assert "anc" in one_line(result)
    result = run("emulate", TREE_MASK_SPEC, "--mod-input", f"other={flat}")
    assert result.exit_code == 2
    assert "declares no input 'other'; its inputs: anc" in one_line(result)
    result = run("emulate", TREE_MASK_SPEC, "--mod-input", f"anc={tmp_path / 'missing.npy'}")
    assert result.exit_code == 2
    assert "cannot read" in one_line(result)


def test_emulate_asks_for_an_input_it_has_no_example_of(tmp_path):
    spec = tmp_path / "own.yaml"
    spec.write_text(GOOD + "mask_mod: keep[b] > 0\nmod_inputs: ['keep:int32[1]']\n")
    result = run("emulate", spec)
    assert result.exit_code == 2
    assert one_line(result).endswith("pass --mod-input keep=FILE.npy")


# ---- model --------------------------------------------------------------------------------------
def test_model_of_a_cuda_core_spec_says_it_covers_tensor_core_specs_only():
    result = run("model", SIMT_SPEC)
    assert result.exit_code == 2
    assert "covers tensor-core specs only" in one_line(result)


# ---- build --check with a subset of the specs ------------------------------------------------
def _generated(tmp_path):
    """Two specs in one folder and their generated/ (written without compiling)."""
    from kernelgen.kernels.build import BuiltKernel, write_generated
    from kernelgen.kernels.render import render
    from kernelgen.specs.forward import load_spec

    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "a.yaml").write_text(GOOD)
    (specs / "b.yaml").write_text(GOOD.replace("head_dim: 64", "head_dim: 32"))
    out = tmp_path / "gen"
    built = [BuiltKernel(s, render(s)) for s in map(load_spec, sorted(specs.glob("*.yaml")))]
    write_generated(built, out)
    return specs, out


def test_build_check_of_a_subset_checks_only_its_files(tmp_path):
    specs, out = _generated(tmp_path)
    subset = run("build", specs / "a.yaml", "-o", out, "--check")
    assert subset.exit_code == 0, subset.output
    assert f"{out}/ is up to date with 1 spec\n" in subset.stdout
    assert "orphaned files not checked: 1 other spec in the same folders" in subset.stdout
    assert run("build", specs / "a.yaml", specs / "b.yaml", "-o", out, "--check").exit_code == 0
    (specs / "b.yaml").unlink()  # now a.yaml is the whole set: b's source is an orphan
    whole = run("build", specs / "a.yaml", "-o", out, "--check")
    assert whole.exit_code == 1
    assert "no spec produces it" in whole.stderr


def test_counts_are_singular_for_one():
    assert [plural(n, "kernel") for n in (0, 1, 2)] == ["0 kernels", "1 kernel", "2 kernels"]


# ---- tune and cache ------------------------------------------------------------------------------
@pytest.fixture
def tuning(tuning_sandbox, monkeypatch):
    from test_tuning_fakes import fake_compile

    from kernelgen.tuning import candidates

    monkeypatch.setattr(candidates, "offline_resources", fake_compile())
    monkeypatch.setenv("COLUMNS", "250")


@pytest.mark.parametrize(
    ("arch", "sms"), [("sm_80", 108), ("sm_86", 84), ("sm_90", 132), ("sm_90a", 132)]
)
def test_tune_dry_run_assumes_the_arch_reference_sm_count(tuning, arch, sms):
    shape = "1,8,8,512,512,64"
    result = run("tune", "--shape", shape, "--dtype", "fp16", "--dry-run", "--arch", arch)
    assert result.exit_code == 0, result.output
    assert f", {sms} SMs;" in result.stdout.splitlines()[0]
    forced = run(
        "tune", "--shape", shape, "--dtype", "fp16", "--dry-run", "--arch", arch, "--sms", "7"
    )
    assert ", 7 SMs;" in forced.stdout.splitlines()[0]


def test_tune_dry_run_refuses_an_unknown_arch(tuning):
    result = run("tune", "--shape", "1,8,8,512,512,64", "--dry-run", "--arch", "sm_75")
    assert result.exit_code == 2
    assert one_line(result).startswith("--arch sm_75: unknown architecture")


def test_tune_dry_run_models_wgmma_candidates(tuning):
    result = run("tune", "--shape", "2,16,16,2048,2048,64", "--dtype", "fp16", "--dry-run")
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.stdout.splitlines() if "_wg_" in line]
    rows = [r for r in rows if r[0].startswith("fa_fwd")]
    assert rows, result.stdout
    assert all(r[-1].isdigit() for r in rows), rows  # a predicted cost, not "-"


def test_tune_dry_run_says_when_resources_were_not_checked(tuning_sandbox, monkeypatch):
    from kernelgen.errors import ToolchainMissingError
    from kernelgen.tuning import candidates

    def no_nvrtc(spec, arch):
        raise ToolchainMissingError("NVRTC is not installed")

    monkeypatch.setattr(candidates, "offline_resources", no_nvrtc)
    monkeypatch.setenv("COLUMNS", "250")
    result = run("tune", "--shape", "1,8,8,512,512,64", "--dtype", "fp16", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "resources not checked: no offline NVRTC" in result.stdout
    assert "(registers and spills unchecked)" in result.stdout


def test_cache_list_title_does_not_wrap(tuning_sandbox, monkeypatch):
    from kernelgen.cli import tune as cli_tune

    narrow = Console(file=io.StringIO(), width=30, force_terminal=True, color_system=None)
    monkeypatch.setattr(cli_tune, "out_console", narrow)
    assert run("cache", "list").exit_code == 0
    from kernelgen.tuning import TuningDB

    assert f"tuning records in {TuningDB().dir}\n" in narrow.file.getvalue()


# ---- torch ------------------------------------------------------------------------------------
def test_torch_op_schema_has_defaults():
    torch = pytest.importorskip("torch")
    import kernelgen.torch_ops  # noqa: F401

    schema = torch.ops.kernelgen.attention.default._schema
    assert [a.name for a in schema.arguments if not a.has_default_value()] == ["q", "k", "v"]


@pytest.mark.emulate
def test_torch_op_runs_with_only_causal(recwarn):
    torch = pytest.importorskip("torch")
    import kernelgen.torch_ops  # noqa: F401
    from kernelgen.references.attention import (
        LSE_TOLERANCE,
        OUT_TOLERANCE,
        naive_attention,
        relative_error,
    )

    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, n, 32)).astype(np.float32) for n in (20, 30, 30))
    out, lse = torch.ops.kernelgen.attention(*map(torch.from_numpy, (q, k, v)), causal=True)
    ref_out, ref_lse = naive_attention(q, k, v, causal=True)
    assert relative_error(out.numpy(), ref_out) <= OUT_TOLERANCE["float32"]
    assert np.max(np.abs(lse.numpy() - ref_lse)) <= LSE_TOLERANCE


@pytest.mark.emulate
def test_a_call_that_cannot_differentiate_warns_once(monkeypatch):
    """Inputs that require grad: kernelgen.attention differentiates, but calls with seqlens_k
    (and kernelgen.calls.attention.attention, the forward alone) warn once and return detached
    outputs."""
    torch = pytest.importorskip("torch")
    import kernelgen
    from kernelgen.calls import attention as api

    monkeypatch.setattr(api, "_warned_no_backward", False)
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 1, 16, 32)).astype(np.float32) for _ in range(3))
    qt = torch.from_numpy(q).requires_grad_()
    kt, vt = torch.from_numpy(k), torch.from_numpy(v)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():  # autograd off: nothing to warn about
            kernelgen.attention(qt, kt, vt, seqlens_k=[12])
        assert kernelgen.attention(qt, kt, vt).requires_grad  # differentiable: no warning
        out = kernelgen.attention(qt, kt, vt, seqlens_k=[12])
        kernelgen.attention(qt, kt, vt, seqlens_k=[12])
        api.attention(qt, kt, vt)
    grad = [w for w in caught if "no backward pass" in str(w.message)]
    assert len(grad) == 1 and grad[0].category is UserWarning
    assert "seqlens_k" in str(grad[0].message) and grad[0].filename == __file__
    assert "output carries no gradient" in str(grad[0].message)
    assert not out.requires_grad
    monkeypatch.setattr(api, "_warned_no_backward", False)
    with pytest.warns(UserWarning, match="forward pass only"):
        api.attention(qt, kt, vt)


# ---- BlockMask and the schema -------------------------------------------------------------------
def test_block_mask_repr_is_short():
    from kernelgen.calls.block_mask import block_mask_reference

    doc = np.repeat(np.arange(4, dtype=np.int32), 250)[None].repeat(2, 0)
    text = "doc[b, q_idx] == doc[b, kv_idx]"
    mask = block_mask_reference(
        text, 2, 1, 1000, 1000, block_m=64, block_n=64, mod_inputs={"doc": doc}
    )
    shown = repr(mask)
    assert len(shown) < 200, shown
    visited = mask.visited_tiles() / (2 * 16 * 16)
    assert shown.startswith("BlockMask(shape=(2, 1, 1000, 1000), block=64x64, ")
    assert f"density={visited:.3g})" in shown and text in shown


def _schema_allows(rule: dict, value) -> bool:
    """The JSON Schema keywords the spec schema uses, for one value."""
    import re

    if "anyOf" in rule:
        return any(_schema_allows(r, value) for r in rule["anyOf"])
    kind = rule.get("type")
    if kind == "null":
        return value is None
    if kind == "integer" and (type(value) is not int):
        return False
    if kind == "string" and not isinstance(value, str):
        return False
    if kind == "array":
        if not isinstance(value, list) or len(value) < rule.get("minItems", 0):
            return False
        if len(value) > rule.get("maxItems", len(value)):
            return False
        return all(_schema_allows(rule.get("items", {}), x) for x in value)
    if "enum" in rule and value not in rule["enum"]:
        return False
    if "minimum" in rule and value < rule["minimum"]:
        return False
    if "maximum" in rule and value > rule["maximum"]:
        return False
    if "multipleOf" in rule and value % rule["multipleOf"]:
        return False
    if "pattern" in rule and not re.search(rule["pattern"], value):
        return False
    return not ("maxLength" in rule and len(value) > rule["maxLength"])


FIELD_VALUES = {
    "head_dim": [0, 4, 7, 8, 12, 64, 96, 256, 264],
    "block_m": [0, 8, 16, 24, 48, 128, 256, 272],
    "block_n": [0, 8, 16, 24, 48, 128, 144],
    "num_warps": [0, 1, 3, 4, 6, 8, 12, 16],
    "stages": [0, 1, 2, 4, 5, None],
    "smem_pad": [-1, 0, 8, 9, None],
    "archs": [[], ["sm_75"], ["sm_80"], ["sm_90a", "sm_100"]],
    "mod_inputs": [["doc:int32[2]"], ["doc:int32[0]"], ["doc:float64[1]"], ["1x:bool[1]"]],
}


# One valid spec per path: a value that every one of them refuses is refused on any path.
PATH_BASES = [
    {"loop_order": "v2", "dtype": "float16", "head_dim": 64, "block_m": 64, "block_n": 32},
    {"loop_order": "v2", "dtype": "bfloat16", "head_dim": 64, "block_m": 64, "block_n": 64,
     "num_warps": 4, "mma": "mma_sync"},
    {"loop_order": "v2", "dtype": "bfloat16", "head_dim": 128, "block_m": 128, "block_n": 64,
     "mma": "wgmma"},
]  # fmt: skip


def _validator_verdicts(field: str, value) -> tuple[bool, bool]:
    """(refused by the field's own check, refused on every path)."""
    from pydantic import ValidationError

    from kernelgen.errors import SpecError
    from kernelgen.specs.forward import KernelSpec, spec_expressions

    if field == "mod_inputs":  # checked entry by entry, before the spec's expressions
        try:
            spec_expressions(None, None, value)
        except SpecError:
            return True, True
        return False, False
    own, everywhere = False, True
    for base in PATH_BASES:
        try:
            KernelSpec.model_validate({**base, field: value})
            everywhere = False
        except ValidationError as exc:
            own |= any(e["loc"] == (field,) for e in exc.errors())
    return own, everywhere


@pytest.mark.parametrize("field", sorted(FIELD_VALUES))
def test_schema_is_as_strict_as_each_field_check(field):
    """The schema refuses what a field's own check refuses, and nothing that some path takes
    (rules between fields, e.g. mma_sync's block_m, stay the validator's)."""
    from kernelgen.specs.forward import spec_json_schema

    rule = spec_json_schema()["properties"][field]
    for value in FIELD_VALUES[field]:
        own, everywhere = _validator_verdicts(field, value)
        allowed = _schema_allows(rule, value)
        if own:
            assert not allowed, (field, value, "the field check refuses it")
        if not allowed:
            assert everywhere, (field, value, "a spec takes it")
