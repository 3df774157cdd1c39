"""Compile tier of the backward family: every backward spec and the policy's default at every
head dim compile offline for their architectures with no spill, stack or local memory, every
kernel of the source (preprocess, main, dQ) checked from the ptxas report."""

from __future__ import annotations

import pytest
from conftest import BACKWARD_SPEC_PATHS, require_toolchain

from kernelgen.arch import ARCHS
from kernelgen.compile import compile_offline, nvrtc_available, parse_ptxas_report
from kernelgen.families import backward, load_any_spec
from kernelgen.policy import default_backward_spec

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module", autouse=True)
def _toolchain():
    require_toolchain(nvrtc_available(), "NVRTC (cuda-bindings, nvidia-cuda-nvrtc, headers)")


def assert_backward_compiles_cleanly(spec, archs=None) -> None:
    source = backward.render(spec)
    for arch in archs or spec.archs:
        compiled = compile_offline(source, spec.uri, arch)
        for symbol in backward.symbols(spec):
            res = parse_ptxas_report(compiled.log, symbol, arch)
            assert 0 < res.registers <= 255, (symbol, res)
            assert (res.spill_store_bytes, res.spill_load_bytes, res.stack_bytes) == (0, 0, 0), (
                symbol,
                res,
            )
        assert spec.smem_bytes <= ARCHS[arch].max_smem_per_block
        sass = compiled.resources.sass_instructions
        if sass:
            assert sass["LDL"] == 0 and sass["STL"] == 0, sass


@pytest.mark.parametrize("path", BACKWARD_SPEC_PATHS, ids=lambda p: p.stem)
def test_backward_spec_compiles_without_spills(path):
    assert_backward_compiles_cleanly(load_any_spec(path))


@pytest.mark.parametrize("head_dim", [8, 40, 96, 128, 200, 256])
def test_default_backward_spec_compiles_at_every_head_dim(head_dim):
    spec = default_backward_spec(
        "bfloat16", head_dim, causal=True, variants=("window", "softcap", "alibi")
    )
    assert_backward_compiles_cleanly(spec, ["sm_80"])
