"""CPU tier: kernelgen/ and bench/ import one way (docs/design.md: spec -> render -> compile ->
launch -> policy -> tune -> api -> cli). Every import counts, those inside functions too: a lazy
import hides a cycle from the interpreter, not from the design."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernelgen", "bench")


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of PACKAGES (packages by their __init__)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``path`` imports anywhere in its body (``from a import b``:
    the submodule a.b where there is one, else a itself)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                names.add(submodule if submodule in known else node.module)
    return names & known.keys()


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(path, known) - {name} for name, path in known.items()}


def test_the_graph_sees_lazy_and_from_imports():
    graph = import_graph()
    assert "kernelgen.tuning.gpu" in graph["kernelgen.tuning.autotune"]  # imported in a function
    assert "kernelgen.policy" in graph["kernelgen.tuning.candidates"]  # from a package import


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package):
    graph = {m: deps for m, deps in import_graph().items() if m.split(".")[0] == package}
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        pytest.fail(f"import cycle in {package}/: {' -> '.join(exc.args[1])}")


def test_the_tuner_sits_below_the_api():
    graph = import_graph()
    tuning = [m for m in graph if m.startswith("kernelgen.tuning")]
    assert not [m for m in tuning if "kernelgen.api" in graph[m]]
    assert "kernelgen.policy" in graph["kernelgen.api"]


def test_context_parallelism_sits_above_the_api():
    """kernelgen.distributed builds on attention() and attention_backward(); nothing else in
    kernelgen imports it (kernelgen never needs torch), and its shardings, block planner and
    cost model import no torch-side module (bench's --dry-run runs them without torch)."""
    graph = import_graph()
    package = {m for m in graph if m.startswith("kernelgen.distributed")}
    users = {m for m, deps in graph.items() if deps & package and m.startswith("kernelgen")}
    assert users <= package, sorted(users - package)
    assert "kernelgen.api" in graph["kernelgen.distributed.calls"]
    assert "kernelgen.backward_api" in graph["kernelgen.distributed.calls"]
    pure = ("kernelgen.distributed.sharding", "kernelgen.distributed.blocks",
            "kernelgen.distributed.cost")  # fmt: skip
    for name in pure:
        assert graph[name] <= {"kernelgen.errors", "kernelgen.distributed.sharding"}, name
        tree = ast.parse(modules()[name].read_text())
        top = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
               for a in n.names} | {n.module.split(".")[0] for n in ast.walk(tree)
                                    if isinstance(n, ast.ImportFrom) and n.module}  # fmt: skip
        assert "torch" not in top, name
