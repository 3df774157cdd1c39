"""CPU tier: kernelgen/ and bench/ import one way (docs/design.md: spec -> render -> compile ->
launch -> policy -> tune -> api -> cli). Every import counts, those inside functions too: a lazy
import hides a cycle from the interpreter, not from the design."""

from __future__ import annotations

import ast
import re
import sys
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
    assert "kernelgen.model.policy" in graph["kernelgen.tuning.candidates"]  # from a package import


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
    assert not [m for m in tuning if "kernelgen.calls.attention" in graph[m]]
    assert "kernelgen.model.policy" in graph["kernelgen.calls.attention"]


# ---- the stage order of docs/design.md ("From spec to launch") ---------------------------------
STAGES = ("spec", "render", "compile", "launch", "policy", "tuning", "api", "cli")
# The emulator runs CUDA on the CPU and needs nothing of kernelgen's flow: what runs kernelgen's
# specs and calls on it sits in the launch and api stages (runtime/emulated_launch.py,
# calls/emulated.py).
EMULATOR_MAY_IMPORT = ("kernelgen.errors", "kernelgen.fileio")


def in_emulator(module: str) -> bool:
    return module == "kernelgen.emulator" or module.startswith("kernelgen.emulator.")


def design_stages() -> dict[str, int]:
    """Module (or package prefix ending in '.') -> its stage index, read from the module table
    of docs/design.md."""
    text = (ROOT / "docs" / "design.md").read_text()
    stages = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] not in STAGES:
            continue
        for name in re.findall(r"`([^`]+)`", cells[1]):
            if name.endswith(".j2"):
                continue
            dotted = "kernelgen." + name.removesuffix(".py").replace("/", ".")
            dotted = dotted.removesuffix(".__init__")
            stages[dotted] = STAGES.index(cells[0])
    return stages


def stage_of(module: str, stages: dict[str, int]) -> int | None:
    if module in stages:
        return stages[module]
    for name, stage in stages.items():
        if name.endswith(".") and module.startswith(name):
            return stage
    return None


def test_design_table_is_read():
    stages = design_stages()
    assert stages["kernelgen.specs.forward"] == 0 and stages["kernelgen.cli"] == STAGES.index("cli")
    assert stage_of("kernelgen.tuning.autotune", stages) == STAGES.index("tuning")
    assert stages["kernelgen.families"] == STAGES.index("launch")


def test_modules_import_only_earlier_stages():
    stages = design_stages()
    graph = import_graph()
    wrong = []
    for module, deps in graph.items():
        own = stage_of(module, stages)
        for dep in deps:
            theirs = stage_of(dep, stages)
            if own is not None and theirs is not None and theirs > own:
                wrong.append(f"{module} ({STAGES[own]}) imports {dep} ({STAGES[theirs]})")
    assert not wrong, wrong


def test_the_emulator_needs_nothing_of_the_flow():
    """Every module of kernelgen/emulator/ imports only the emulator's own, errors.py and
    fileio.py (docs/design.md): no exceptions."""
    graph = import_graph()
    emulator = [m for m in graph if in_emulator(m)]
    assert "kernelgen.emulator.kernel" in emulator
    wrong = {
        m: sorted(outside)
        for m in emulator
        if (outside := {d for d in graph[m] if not in_emulator(d) and d not in EMULATOR_MAY_IMPORT})
    }
    assert not wrong, wrong


def test_the_emulator_check_catches_a_planted_violation(monkeypatch):
    """The emulator's kernel.py importing the launch stage (written into a copy of the graph)
    is reported."""
    graph = import_graph()
    graph["kernelgen.emulator.kernel"] = graph["kernelgen.emulator.kernel"] | {
        "kernelgen.runtime.launch"
    }
    monkeypatch.setattr(sys.modules[__name__], "import_graph", lambda: graph)
    with pytest.raises(
        AssertionError, match=r"'kernelgen\.emulator\.kernel': \['kernelgen\.runtime\.launch'\]"
    ):
        test_the_emulator_needs_nothing_of_the_flow()


def test_every_module_is_named_in_the_design():
    text = (ROOT / "docs" / "design.md").read_text()
    unnamed = [
        path.relative_to(ROOT / "kernelgen").as_posix()
        for path in (ROOT / "kernelgen").rglob("*.py")
        if path.name != "__init__.py" or _holds_code(path)
        if path != ROOT / "kernelgen" / "__init__.py"  # the public surface: README.md
        if not _named(path, text)
    ]
    assert not unnamed, f"modules docs/design.md does not name: {unnamed}"


def _holds_code(path: Path) -> bool:
    """A package's __init__.py that is more than its docstring (families/, cli/)."""
    body = ast.parse(path.read_text()).body
    return len(body) > 1 or (bool(body) and not isinstance(body[0], ast.Expr))


def _named(path: Path, text: str) -> bool:
    relative = path.relative_to(ROOT / "kernelgen")
    if relative.parts[0] in ("emulator", "testing", "tuning", "integrations", "distributed"):
        return f"`{relative.parts[0]}/`" in text
    return f"`{relative.as_posix()}`" in text


def test_the_stage_check_catches_a_planted_violation(monkeypatch, tmp_path):
    """A spec-stage module importing the api (written into a copy of the graph) is reported."""
    stages = design_stages()
    graph = import_graph()
    graph["kernelgen.specs.forward"] = graph["kernelgen.specs.forward"] | {
        "kernelgen.calls.attention"
    }
    monkeypatch.setattr(sys.modules[__name__], "import_graph", lambda: graph)
    planted = re.escape("kernelgen.specs.forward (spec) imports kernelgen.calls.attention")
    with pytest.raises(AssertionError, match=planted):
        test_modules_import_only_earlier_stages()
    assert stages  # the table was read


def test_context_parallelism_sits_above_the_api():
    """kernelgen.distributed builds on attention() and attention_backward(); nothing else in
    kernelgen imports it (kernelgen never needs torch), and its shardings, block planner and
    cost model import no torch-side module (bench's --dry-run runs them without torch)."""
    graph = import_graph()
    package = {m for m in graph if m.startswith("kernelgen.distributed")}
    users = {m for m, deps in graph.items() if deps & package and m.startswith("kernelgen")}
    assert users <= package, sorted(users - package)
    assert "kernelgen.calls.attention" in graph["kernelgen.distributed.calls"]
    assert "kernelgen.calls.backward" in graph["kernelgen.distributed.calls"]
    pure = ("kernelgen.distributed.sharding", "kernelgen.distributed.blocks",
            "kernelgen.distributed.cost")  # fmt: skip
    for name in pure:
        assert graph[name] <= {"kernelgen.errors", "kernelgen.distributed.sharding"}, name
        tree = ast.parse(modules()[name].read_text())
        top = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
               for a in n.names} | {n.module.split(".")[0] for n in ast.walk(tree)
                                    if isinstance(n, ast.ImportFrom) and n.module}  # fmt: skip
        assert "torch" not in top, name
