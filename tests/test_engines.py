"""CPU tier: the engine table (kernelgen/specs/engines.py) is where engine facts live, and no other
module decides by comparing a spec's engine name with a literal (docs/design.md, "Families and
engines")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import ROOT

from kernelgen.specs.engines import ENGINES, engine_of
from kernelgen.specs.forward import KernelSpec

TABLE = Path("kernelgen/specs/engines.py")


def engine_name_comparisons(source: str) -> list[int]:
    """Lines of ``source`` where something named ``mma`` (an attribute, a name, or a mapping's
    ``"mma"`` entry) is compared with a string literal or a collection of them."""

    def is_mma(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr == "mma"
        if isinstance(node, ast.Name):
            return node.id == "mma"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            return node.func.attr == "get" and any(
                isinstance(a, ast.Constant) and a.value == "mma" for a in node.args
            )
        if isinstance(node, ast.Subscript):
            return isinstance(node.slice, ast.Constant) and node.slice.value == "mma"
        return False

    def is_literal(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return bool(node.elts) and all(is_literal(e) for e in node.elts)
        return False

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(is_mma(s) for s in sides) and any(is_literal(s) for s in sides):
                lines.append(node.lineno)
    return lines


def test_no_module_but_the_table_compares_engine_names():
    found = {
        str(path.relative_to(ROOT)): lines
        for path in sorted((ROOT / "kernelgen").rglob("*.py"))
        if path.relative_to(ROOT) != TABLE
        if (lines := engine_name_comparisons(path.read_text()))
    }
    assert not found, f"engine decisions outside kernelgen/specs/engines.py (ask the row): {found}"


@pytest.mark.parametrize(
    "planted",
    [
        'if spec.mma == "wgmma":\n    pass\n',
        'ok = spec.mma in ("mma_sync", "wgmma")\n',
        'ok = data.get("mma") != "simt"\n',
        'ok = "simt" == mma\n',
    ],
)
def test_the_check_catches_a_planted_comparison(planted):
    assert engine_name_comparisons(planted) == [1 + planted.count("\n", 0, planted.index("mma"))]


def test_a_table_lookup_is_not_a_comparison():
    assert engine_name_comparisons("x = TABLE[spec.mma]\ny = spec.engine.tensor_cores\n") == []


def test_engine_rows():
    assert set(ENGINES) == {"simt", "mma_sync", "wgmma"}
    for name, engine in ENGINES.items():
        assert engine.name == name
        assert engine.tensor_cores == bool(engine.chunk_bytes) == bool(engine.required_sass)
        assert engine.exact_capability is None or engine.exact_capability >= engine.min_capability
        assert (engine.arch_target is None) == (engine.exact_capability is None)
    assert ENGINES["wgmma"].warp_specialized and not ENGINES["mma_sync"].warp_specialized
    assert [e.name for e in ENGINES.values() if e.block_sparse] == ["mma_sync", "wgmma"]


def test_specs_ask_their_row():
    wgmma = KernelSpec(loop_order="v2", mma="wgmma", dtype="bfloat16", head_dim=128,
                       block_m=128, block_n=128)  # fmt: skip
    assert engine_of(wgmma) is wgmma.engine is ENGINES["wgmma"]
    assert wgmma.compile_arch("sm_90") == "sm_90a" and "_wg_" in wgmma.uri
    simt = KernelSpec(loop_order="v2", dtype="float32", head_dim=64, block_m=64, block_n=32)
    assert simt.compile_arch("sm_86") == "sm_86" and simt.stages == 1
    tc = KernelSpec(loop_order="v2", mma="mma_sync", dtype="float16", head_dim=64, block_m=64,
                    block_n=64)  # fmt: skip
    assert tc.stages == ENGINES["mma_sync"].default_stages and "_tc_" in tc.uri
