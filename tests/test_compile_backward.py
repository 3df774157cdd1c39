"""Compile tier of the backward family: every backward spec and the policy's default at every
head dim compile offline for their architectures with no spill, stack or local memory, every
kernel of the source (preprocess, main, dQ) checked from the ptxas report; tensor-core specs
issue HMMA and LDSM (and the transposing LDSM.T); the default at head dim 128 meets its static
targets per 64 x 64 unit (docs/performance-model.md, "Backward")."""

from __future__ import annotations

import pytest
from conftest import BACKWARD_SPEC_PATHS, require_toolchain

from kernelgen.families import backward, load_any_spec
from kernelgen.kernels.compile import (
    compile_offline,
    disassemble,
    function_sass,
    nvrtc_available,
    parse_ptxas_report,
    sass_instructions,
)
from kernelgen.model.perfmodel import (
    BACKWARD_ROLES,
    FA2_BWD_D128,
    backward_interior_loop,
    model_backward_spec,
)
from kernelgen.model.policy import default_backward_spec
from kernelgen.specs.arch import ARCHS

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
        if spec.mma == "mma_sync":
            assert_tensor_core_sass(spec, compiled)


def assert_tensor_core_sass(spec, compiled) -> None:
    """The main kernel (and the deterministic dQ kernel) issue mma.sync and ldmatrix, including
    the transposing form (the B operands of dV, dK and dQ)."""
    text = disassemble(compiled.cubin)
    if text is None:  # no cuobjdump/nvdisasm: the ptxas checks above still ran
        return
    kernels = [spec.uri] + ([f"{spec.uri}_dq"] if spec.deterministic else [])
    for name in kernels:
        opcodes = {row.opcode for row in sass_instructions(function_sass(text, name))}
        assert any(op.startswith("HMMA.16816") for op in opcodes), (name, opcodes)
        assert any(op.startswith("LDSM.16.M88") for op in opcodes), (name, opcodes)
        assert any(op.startswith("LDSM.16.MT88") for op in opcodes), (name, opcodes)
        assert any(op.startswith("LDGSTS") for op in opcodes), (name, opcodes)


@pytest.mark.parametrize("path", BACKWARD_SPEC_PATHS, ids=lambda p: p.stem)
def test_backward_spec_compiles_without_spills(path):
    assert_backward_compiles_cleanly(load_any_spec(path))


@pytest.mark.parametrize("head_dim", [8, 40, 96, 128, 200, 256])
def test_default_backward_spec_compiles_at_every_head_dim(head_dim):
    spec = default_backward_spec(
        "bfloat16", head_dim, causal=True, variants=("window", "softcap", "alibi")
    )
    assert_backward_compiles_cleanly(spec, ["sm_80"])


@pytest.mark.parametrize(
    ("head_dim", "fields"),
    [(64, {}), (40, {"causal": True}), (128, {"causal": True}), (128, {"deterministic": True}),
     (256, {"causal": True}),
     (128, {"additive_mask": True}), (144, {"causal": True, "deterministic": True})],
)  # fmt: skip
def test_default_tensor_core_backward_compiles_cleanly(head_dim, fields):
    spec = default_backward_spec(
        "float16",
        head_dim,
        causal=fields.get("causal", False),
        deterministic=fields.get("deterministic", False),
        additive_mask=fields.get("additive_mask", False),
    )
    if fields.get("additive_mask"):
        spec = spec.with_additive_mask()
    assert spec.mma == "mma_sync"
    assert_backward_compiles_cleanly(spec)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_default_d128_backward_meets_its_static_targets(arch):
    """Per 64 x 64 x 128 unit of the main loop (the split-roles default, each role's loop counted
    and averaged): the five products' 1280 HMMA, at most 3200 instructions (FA2's backward:
    3540), one fp32 atomic per dQ element and key block of 128, no spill or stack, and at most
    256 KiB of ldmatrix plus cp.async traffic (FA2's: 320 KiB): 224, as the tiling says (per unit,
    in KiB: S^T 32 K + 16 Q, dP^T 32 V + 16 dO, dV^T 32 dO, dK^T 32 Q, dQ 32 dS + 16 K, copies
    16)."""
    spec = default_backward_spec("bfloat16", 128, causal=False)
    assert spec.split_roles
    report = model_backward_spec(spec, arch)
    unit = report.unit
    assert (report.spill_bytes, report.stack_bytes) == (0, 0)
    assert unit.count("HMMA") == FA2_BWD_D128.count("HMMA") == 1280
    assert unit.instructions <= 3200, unit.by_class
    assert unit.count("RED") == 128
    assert unit.count("LDSM") == 416 and unit.count("LDGSTS") == 32
    assert unit.ldsm_ldgsts_bytes == 224 * 1024 <= 256 * 1024 < FA2_BWD_D128.smem_bytes
    assert "atomics" in report.summary()


@pytest.mark.parametrize("engine", ["mma_sync", "simt"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_block_sparse_backward_compiles_cleanly(engine, deterministic):
    """The block-sparse kernels (a document mask_mod, causal; the bench's document case at head
    dim 128 on the tensor cores): their list walks fit without spills on either arch."""
    import numpy as np

    from kernelgen.calls.expression_inputs import check_expressions

    expressions = check_expressions(
        score_mod=None, mask_mod="doc[b, q_idx] == doc[b, kv_idx]",
        mod_inputs={"doc": np.zeros((2, 64), np.int32)}, block_mask=None, batch=2, heads=1,
        seqlen_q=64, seqlen_k=64,
    )  # fmt: skip
    spec = default_backward_spec(
        "bfloat16", 128 if engine == "mma_sync" else 64, causal=True, expressions=expressions,
        deterministic=deterministic, tensor_cores=engine == "mma_sync",
    )  # fmt: skip
    assert spec.block_sparse and spec.mma == engine
    assert_backward_compiles_cleanly(spec)


def test_split_roles_model_counts_each_role_once():
    """The model counts each role's loop (the role fixed) and takes their mean: each role has a
    loop of its own in the kernel, and the largest alone would stand for every warp."""
    spec = default_backward_spec("bfloat16", 128, causal=False)
    p_loop, ds_loop = (backward_interior_loop(spec, "sm_80", role) for role in BACKWARD_ROLES)
    # per warp and query tile: P warps 64 x 32 x 128 S^T, dV^T and dQ; dS warps dP^T and dK^T
    assert (p_loop.counts["HMMA"], ds_loop.counts["HMMA"]) == (384, 256)
    assert p_loop.counts.get("RED", 0) + p_loop.counts.get("REDG", 0) == 64
    assert ds_loop.counts.get("RED", 0) + ds_loop.counts.get("REDG", 0) == 0
    assert ds_loop.counts.get("MUFU", 0) == 0 and p_loop.counts["MUFU"] == 64
    largest = backward_interior_loop(spec, "sm_80")
    assert largest.counts["HMMA"] == 384  # the P warps' loop: 1.2 times the mean's HMMA
    assert model_backward_spec(spec, "sm_80").unit.count("HMMA") == 1280
