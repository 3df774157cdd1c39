"""Every ```python example of README.md and docs/*.md, run.

On the CPU each example runs as written with NumPy arrays (the CPU backend and its emulator),
after a setup that gives names the text leaves to the reader (``q``, ``slopes``, ...) small
NumPy values. Examples written for CuPy (``import cupy as cp``, GPU sizes) are listed in
:data:`GPU_ONLY`: on the CPU their syntax is compiled, on a GPU (``-m gpu``) they run. The few
that cannot run anywhere here (a model download, a signature sketch) are in :data:`COMPILE_ONLY`
with the reason. A new example runs on the CPU by default: add a setup or list it here.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import ROOT

from kernelgen.references.attention import (
    LSE_TOLERANCE,
    OUT_TOLERANCE,
    naive_attention,
    relative_error,
)

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks() -> dict[str, str]:
    """``"<file>#<n>"`` (the n-th python block of the file, from 1) -> its code."""
    blocks = {}
    for path in DOCS:
        for number, match in enumerate(_BLOCK.finditer(path.read_text()), start=1):
            blocks[f"{path.relative_to(ROOT)}#{number}"] = match.group(1)
    return blocks


BLOCKS = python_blocks()

# Written for CuPy at GPU sizes: compiled here, run on a GPU.
GPU_ONLY = {
    "README.md#1": "the usage tour: CuPy arrays, (2, 16, 1000, 128) inputs",
    "docs/expressions.md#1": "CuPy arrays, (1, 8, 1024, 128) inputs",
    "docs/expressions.md#3": "CUDA torch tensors, (1, 8, 1024, 128) inputs",
}
# Cannot run in a test at all: compiled only.
COMPILE_ONLY = {
    "docs/emulator.md#4": "loads a Hugging Face model by a name the reader chooses (a download)",
    "docs/expressions.md#2": "the signature of block_mask, with placeholders",
    "docs/distributed.md#1": "spawns two processes: tests/test_distributed.py runs it as a script",
}
# Names an example leaves to the reader, as small NumPy values.
_ATTENTION_INPUTS = """
import numpy as np
rng = np.random.default_rng(0)
q = rng.standard_normal((1, 2, 24, 32)).astype(np.float16)
k = rng.standard_normal((1, 2, 40, 32)).astype(np.float16)
v = rng.standard_normal((1, 2, 40, 32)).astype(np.float16)
slopes = np.asarray([0.25, 0.0625], dtype=np.float32)
sinks = np.asarray([0.5, -1.0], dtype=np.float32)
"""
SETUP = {
    "docs/variants.md#1": _ATTENTION_INPUTS,
    "docs/emulator.md#5": "import numpy as np\nq = np.zeros((1000, 128), dtype=np.uint16)\n",
}
# An example that fails until its text is fixed: block -> the reason (removed once it passes).
KNOWN_FAILING: dict[str, str] = {}  # name -> why it fails (none today)


def test_every_listed_example_exists():
    """The lists name real blocks (a doc edit that moves a block must update them)."""
    listed = {*GPU_ONLY, *COMPILE_ONLY, *SETUP, *KNOWN_FAILING}
    assert listed <= set(BLOCKS), sorted(listed - set(BLOCKS))
    assert not set(GPU_ONLY) & set(COMPILE_ONLY)


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_example_compiles(name):
    compile(SETUP.get(name, "") + BLOCKS[name], name, "exec")


# Attention examples whose last call is checked: block -> that call's arguments for the float64
# reference, from the example's names.
REFERENCE_ARGUMENTS = {
    "docs/emulator.md#2": lambda names: {"causal": True},
    "docs/variants.md#1": lambda names: {
        "causal": True,
        "window_size": (127, 0),
        "sinks": names["sinks"],
    },
}
CPU_BLOCKS = sorted(set(BLOCKS) - set(GPU_ONLY) - set(COMPILE_ONLY))


@pytest.mark.emulate
@pytest.mark.parametrize("name", CPU_BLOCKS)
def test_example_runs_on_the_cpu(name, recwarn):
    if name in KNOWN_FAILING:
        pytest.xfail(KNOWN_FAILING[name])
    namespace: dict = {"__name__": "docs_example"}
    exec(compile(SETUP.get(name, "") + BLOCKS[name], name, "exec"), namespace)
    if name in REFERENCE_ARGUMENTS:  # the last call's out and lse against float64
        q, k, v = (namespace[n].astype(np.float32) for n in "qkv")
        ref_out, ref_lse = naive_attention(q, k, v, **REFERENCE_ARGUMENTS[name](namespace))
        assert relative_error(namespace["out"], ref_out) <= OUT_TOLERANCE["float16"]
        assert np.max(np.abs(namespace["lse"] - ref_lse)) <= LSE_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_ONLY))
def test_gpu_example_runs(name):
    if name in KNOWN_FAILING:
        pytest.xfail(KNOWN_FAILING[name])
    exec(compile(BLOCKS[name], name, "exec"), {"__name__": "docs_example"})


def test_readme_says_where_emulator_builds_live():
    """The README names the emulator's build folder and how to clear it."""
    text = (ROOT / "README.md").read_text()
    assert "~/.cache/kernelgen/emulator" in text
    assert "rm -rf ~/.cache/kernelgen/emulator" in text


def test_no_doc_cites_a_missing_page():
    """Every docs/<page>.md that the package, README or docs cite exists."""
    cited = set()
    for path in [*DOCS, *sorted((ROOT / "kernelgen").rglob("*.py"))]:
        cited |= set(re.findall(r"docs/[A-Za-z0-9_-]+\.md", path.read_text()))
    missing = sorted(page for page in cited if not (ROOT / page).exists())
    assert not missing, missing
