"""Compile tier: every spec compiles offline for its architectures; ptxas facts as data.

Runs in CI and fails there (never skips) when NVRTC or the CUDA headers are missing.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest
from conftest import HEAD_DIM_SWEEP, ROOT, SPEC_PATHS, require_toolchain

from kernelgen.errors import CompileError
from kernelgen.kernels.compile import (
    compile_offline,
    cuobjdump_path,
    disassemble,
    function_sass,
    nvrtc_available,
    parse_ptxas_report,
    report_options,
    sass_instructions,
)
from kernelgen.kernels.render import (
    MAX_SPLITS,
    WGMMA_OPERAND,
    consumer_registers,
    producer_registers,
    render,
)
from kernelgen.specs.arch import ARCHS
from kernelgen.specs.forward import KernelSpec, load_spec

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module", autouse=True)
def _toolchain():
    require_toolchain(nvrtc_available(), "NVRTC (cuda-bindings, nvidia-cuda-nvrtc, headers)")


def tensor_core_instructions(spec) -> tuple[int, int]:
    """(HMMA, LDSM) of one key tile's code per warp, from the tile geometry: S = Q K^T is
    rows/16 x block_n/8 x head_dim/16 mma with one ldmatrix.x4 per A (per m16 tile and k-step)
    and per two n8 key tiles; O += P V is rows/16 x head_dim/8 x block_n/16 mma with one
    ldmatrix.x4.trans per two n8 output tiles. Equality with the SASS says the loop body exists
    once and every K/V fragment is read once per warp, shared by its m16 tiles."""
    m_tiles = spec.rows_per_warp // 16
    qk_steps, pv_steps = spec.head_dim_padded // 16, spec.block_n // 16
    s_tiles, o_tiles = spec.block_n // 8, spec.head_dim_padded // 8
    hmma = m_tiles * (s_tiles * qk_steps + o_tiles * pv_steps)
    ldsm = qk_steps * (m_tiles + s_tiles // 2) + pv_steps * o_tiles // 2
    return hmma, ldsm


@pytest.mark.parametrize("path", SPEC_PATHS, ids=lambda p: p.stem)
def test_spec_compiles_without_spills(path):
    assert_static_quality(load_spec(path))


@pytest.mark.parametrize("spec", HEAD_DIM_SWEEP, ids=lambda s: s.uri)
def test_every_head_dim_compiles_without_spills(spec):
    assert_static_quality(spec)


def assert_static_quality(spec) -> None:
    """The static checks on every architecture the spec lists: no spill or stack bytes,
    shared memory within the limit, and (with cuobjdump) tensor-core SASS without local memory."""
    source = render(spec)
    for arch in spec.archs:
        compiled = compile_offline(source, spec.uri, arch)
        resources = compiled.resources
        if spec.split_kv:  # the combine kernel lives in the same source
            combine = parse_ptxas_report(compiled.log, spec.combine_uri, arch)
            assert (combine.spill_store_bytes, combine.stack_bytes) == (0, 0), combine
        assert resources.arch == arch
        assert 0 < resources.registers <= 255
        assert resources.spill_store_bytes == 0, resources
        assert resources.spill_load_bytes == 0, resources
        assert resources.stack_bytes == 0, resources
        assert spec.smem_bytes + resources.static_smem_bytes <= ARCHS[arch].max_smem_per_block
        if cuobjdump_path():
            sass = resources.sass_instructions
            assert sass["LDL"] == 0 and sass["STL"] == 0, sass  # no local memory
            if spec.mma == "mma_sync":  # tensor cores fed by ldmatrix, not a CUDA-core fallback
                assert (sass["HMMA"], sass["LDSM"]) == tensor_core_instructions(spec), sass
            elif spec.mma == "wgmma":  # wgmma fed by TMA (counted in the test below)
                product = "QGMMA" if spec.fp8 else "HGMMA"  # fp8 or 16-bit operands
                assert sass[product] > 0 and sass["UTMALDG"] > 0 and sass["LDSM"] == 0, sass
            else:
                assert sass["HMMA"] == 0 and sass["LDS"] > 0 and sass["LDG"] > 0, sass


def test_specs_cover_the_tensor_core_matrix():
    """The issue's coverage: tensor-core prefill specs for head dims 64, 96, 128, 256, each in
    fp16 and bf16, causal and not, and at least two tile shapes (block_m x block_n) per head dim."""
    specs = [load_spec(p) for p in SPEC_PATHS]
    tc = [s for s in specs if s.mma == "mma_sync"]
    assert {s.head_dim for s in tc} >= {64, 96, 128, 256}
    assert {s.dtype for s in tc} == {"float16", "bfloat16"}
    assert {s.causal for s in tc} == {False, True}
    assert {s.smem_layout for s in tc} == {"padded", "swizzled"}
    prefill = [s for s in tc if not s.split_kv]
    for head_dim in (64, 96, 128, 256):
        covered = {(s.dtype, s.causal) for s in prefill if s.head_dim == head_dim}
        assert covered == {(d, c) for d in ("float16", "bfloat16") for c in (False, True)}, (
            head_dim,
            covered,
        )
        tiles = {(s.block_m, s.block_n) for s in prefill if s.head_dim == head_dim}
        assert len(tiles) >= 2, (head_dim, tiles)


def test_specs_cover_split_kv_decode():
    """Split-KV decode specs, causal and not, every dtype: packed GQA on the tensor
    cores (fp16, bf16), the CUDA-core kernel for the rest (fp32 included)."""
    split = [s for s in (load_spec(p) for p in SPEC_PATHS) if s.split_kv]
    tensor_cores = [s for s in split if s.mma == "mma_sync"]
    assert {s.dtype for s in tensor_cores} == {"float16", "bfloat16"}
    assert {s.causal for s in split} == {False, True}
    assert all(s.pack_gqa for s in tensor_cores) and {s.num_warps for s in tensor_cores} >= {1, 2}
    assert {s.dtype for s in split if s.mma == "simt"} == {"float32", "bfloat16"}


SPLIT_SPEC_PATHS = [p for p in SPEC_PATHS if load_spec(p).split_kv]


@cache
def disassembly(spec: KernelSpec, arch: str) -> str:
    """The SASS of ``spec``'s source (main kernel and combine) compiled offline for ``arch``."""
    compiled = compile_offline(render(spec), spec.uri, arch, sass=False)
    return disassemble(compiled.cubin) or ""


def kernel_opcodes(spec: KernelSpec, arch: str, symbol: str) -> list[str]:
    """SASS opcodes of the kernel ``symbol`` of ``spec``'s source on ``arch``."""
    require_toolchain(cuobjdump_path() is not None, "cuobjdump + nvdisasm wheels")
    return [i.opcode for i in sass_instructions(function_sass(disassembly(spec, arch), symbol))]


@pytest.mark.parametrize("path", SPLIT_SPEC_PATHS, ids=lambda p: p.stem)
def test_combine_moves_rows_in_16_byte_pieces(path):
    """The split-KV combine's global traffic is vectorised: one 16-byte store of the output
    per thread and one 4-byte store of the LSE, partial rows read 16 bytes at a time; the only
    narrow loads are the chunk LSEs (MAX_SPLITS / 32 per lane) and, with sinks, the row's sink."""
    spec = load_spec(path)
    for arch in spec.archs:
        opcodes = kernel_opcodes(spec, arch, spec.combine_uri)
        stores = sorted(op for op in opcodes if op.startswith("STG"))
        assert stores == ["STG.E", "STG.E.128"], (arch, stores)
        narrow_loads = [op for op in opcodes if op.startswith("LDG") and ".128" not in op]
        assert len(narrow_loads) == MAX_SPLITS // 32 + spec.sinks, (arch, narrow_loads)


TC_SPEC_PATHS = [p for p in SPEC_PATHS if load_spec(p).mma == "mma_sync"]


@pytest.mark.parametrize("path", TC_SPEC_PATHS, ids=lambda p: p.stem)
def test_tensor_core_kernels_move_tiles_in_16_byte_pieces(path):
    """128-bit global traffic in the main kernel's SASS: every Q/K/V copy is a
    16-byte cp.async (LDGSTS.128); the output leaves in 16-byte stores beside the 4-byte LSE
    store (split-KV: fp32 partial rows as 8-byte pairs, the fragment layout's natural width)."""
    spec = load_spec(path)
    for arch in spec.archs:
        opcodes = kernel_opcodes(spec, arch, spec.uri)
        copies = [op for op in opcodes if op.startswith("LDGSTS")]
        assert copies and all(op.endswith(".128") for op in copies), (arch, set(copies))
        stores = {op for op in opcodes if op.startswith("STG")}
        wide = "STG.E.64" if spec.split_kv else "STG.E.128"
        assert stores == {"STG.E", wide}, (arch, stores)


def test_function_sass_picks_the_named_kernel():
    sass = (
        "\tcode for sm_90\n\t\tFunction : first\n        /*0000*/  STG.E [R2], R0 ;\n"
        "\t\tFunction : second\n        /*0000*/  STG.E.128 [R2], R4 ;\n"
    )
    assert [i.opcode for i in sass_instructions(function_sass(sass, "second"))] == ["STG.E.128"]
    assert [i.opcode for i in sass_instructions(function_sass(sass, "first"))] == ["STG.E"]
    assert function_sass(sass, "third") == ""


def test_sass_tools_are_installed_in_ci():
    require_toolchain(cuobjdump_path() is not None, "cuobjdump + nvdisasm wheels")


def test_compile_error_carries_log_and_saved_source(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELGEN_FAILED_DIR", str(tmp_path))
    broken = 'extern "C" __global__ void broken(float* x) { x[0] = undeclared_name; }'
    with pytest.raises(CompileError) as info:
        compile_offline(broken, "broken", "sm_80")
    assert "undeclared_name" in info.value.log
    assert info.value.source_path is not None
    assert Path(info.value.source_path).read_text() == broken


def test_parse_ptxas_report_picks_the_named_kernel():
    log = (
        "ptxas info    : Compiling entry function 'other' for 'sm_90'\n"
        "ptxas info    : Function properties for other\n"
        "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 1 barriers, 512 bytes smem\n"
        "ptxas info    : Compiling entry function 'mine' for 'sm_90'\n"
        "ptxas info    : Function properties for mine\n"
        "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 128 registers, used 1 barriers\n"
    )
    r = parse_ptxas_report(log, "mine", "sm_90")
    assert (r.registers, r.stack_bytes, r.spill_store_bytes, r.static_smem_bytes) == (128, 0, 0, 0)
    other = parse_ptxas_report(log, "other", "sm_90")
    assert (other.registers, other.stack_bytes, other.static_smem_bytes) == (40, 8, 512)
    with pytest.raises(ValueError):
        parse_ptxas_report(log, "absent", "sm_90")


def test_nvrtc_with_a_compile_cache_is_told_to_skip_it_when_the_report_is_needed():
    """NVRTC >= 12.9 answers a repeated compile from its cache without running ptxas, so
    without --no-cache the second compile of a source has no resource report (seen on an
    H100: every wgmma launch and every tuner candidate after the first failed on it)."""
    assert report_options((12, 8)) == ["--ptxas-options=-v"]
    for version in ((12, 9), (13, 0), (13, 5)):
        assert report_options(version) == ["--ptxas-options=-v", "--no-cache"]


def test_the_same_source_compiled_twice_reports_its_resources_both_times():
    spec = load_spec(SPEC_PATHS[0])
    source = render(spec)
    first, second = (
        compile_offline(source, spec.uri, "sm_80", sass=False, cache=False) for _ in range(2)
    )
    assert first.resources == second.resources and first.resources is not None


def test_a_launch_compile_needs_no_report():
    """The launch path (report=False) gets the cubin only: no ptxas -v, resources None."""
    spec = load_spec(SPEC_PATHS[0])
    compiled = compile_offline(
        render(spec), spec.uri, "sm_80", sass=False, report=False, cache=False
    )
    assert compiled.resources is None and compiled.cubin[:4] == b"\x7fELF"
    assert "Used" not in compiled.log


def test_interior_loop_of_a_tensor_core_spec_issues_its_tile_hmmas():
    from bench.sass_loop import analyse

    require_toolchain(cuobjdump_path() is not None, "cuobjdump + nvdisasm wheels")
    path = ROOT / "specs" / "v2_tc_f16_d64_m64_n64_s2_swz.yaml"
    row = analyse(path, "sm_90")
    hmma, ldsm = tensor_core_instructions(load_spec(path))
    assert (row["HMMA"], row["LDSM"]) == (hmma, ldsm)  # the loop is the whole key-tile body
    assert row["issued"] == sum(
        row[c]
        for c in ("HMMA", "LDSM", "FMUL", "FFMA", "FADD", "FMNMX", "MUFU", "SHFL", "BAR", "other")
    )
    assert row["BAR"] == 1  # one block barrier per key tile (the refill follows the wait's)


WGMMA_SPEC_PATHS = [p for p in SPEC_PATHS if load_spec(p).mma == "wgmma"]


def test_specs_cover_the_wgmma_matrix():
    """Hopper specs for head dims 64, 128 and 256 in bf16, fp16 and fp8 (e4m3) too, causal and
    not."""
    specs = [load_spec(p) for p in WGMMA_SPEC_PATHS]
    assert {s.head_dim for s in specs if s.dtype == "bfloat16"} >= {64, 128, 256}
    assert {s.dtype for s in specs} == {"float16", "bfloat16", "float8_e4m3"}
    assert {s.causal for s in specs} == {False, True}
    assert {s.consumer_warpgroups for s in specs} == {1, 2}
    assert all(s.archs == ("sm_90a",) for s in specs)


def highest_register(instructions) -> int:
    """The highest general register (R0..R254) the instructions name (-1: none)."""
    found = [int(r) for i in instructions for r in re.findall(r"\bR(\d+)\b", i.operands)]
    return max(found, default=-1)


@pytest.mark.parametrize("path", WGMMA_SPEC_PATHS, ids=lambda p: p.stem)
def test_wgmma_kernels_use_hopper_instructions_within_their_register_budgets(path):
    """Each product is one HGMMA in the SASS (head_dim / 16 for S = Q K^T, block_n / 16 for
    O += P V, once per loop body: the plain loop is unrolled by the ring's depth, the
    overlapped one by two), the tiles
    arrive by TMA (UTMALDG; no LDSM, no cp.async), and the register reallocation holds: the
    producer's code after its setmaxnreg.dec names no register past its budget, the consumers'
    none past theirs."""
    spec = load_spec(path)
    (arch,) = spec.archs
    compiled = compile_offline(render(spec), spec.uri, arch)
    sass = compiled.resources.sass_instructions
    require_toolchain(bool(sass), "cuobjdump + nvdisasm wheels")
    k = WGMMA_OPERAND[spec.dtype].k  # 16, or 32 for fp8 (whose products are QGMMA)
    family = "QGMMA" if spec.fp8 else "HGMMA"
    products = (spec.head_dim_padded + spec.block_n) // k  # of one key tile
    if spec.overlap:  # prologue, the loop unrolled by two, its odd tail and two epilogues
        assert sass[family] >= 2 * products, sass
    else:  # the loop unrolled by the ring's depth: one body per slot
        assert sass[family] == products * spec.stages, sass
    assert sass["UTMALDG"] > 0 and sass["LDSM"] == sass["HMMA"] == 0, sass
    # cp.async only where pages that are no multiple of block_n are copied row by row
    assert (sass["LDGSTS"] > 0) == spec.paged_kv, sass
    assert "setmaxnreg" not in compiled.log  # ptxas would say it ignored it
    rows = sass_instructions(function_sass(disassembly(spec, arch), spec.uri))
    opcodes = [i.opcode for i in rows]
    dealloc = opcodes.index("USETMAXREG.DEALLOC.CTAPOOL")
    producer = producer_registers(spec)
    assert f"0x{producer:x}" in rows[dealloc].operands
    # the producer's code: from its setmaxnreg.dec to the kernel's last EXIT (the out-of-line
    # wait loops ptxas places after it serve both roles)
    end = max(i for i, r in enumerate(rows) if r.opcode == "EXIT")
    assert highest_register(rows[dealloc:end]) < producer
    alloc = opcodes.index("USETMAXREG.TRY_ALLOC.CTAPOOL")
    assert f"0x{consumer_registers(spec):x}" in rows[alloc].operands
    assert highest_register(rows) < consumer_registers(spec)
    # the entry allocation funds the reallocation: (entry - producer) frees what consumers add
    entry = compiled.resources.registers
    warpgroups = spec.consumer_warpgroups
    assert entry - producer >= warpgroups * (consumer_registers(spec) - entry)


@pytest.mark.parametrize(
    "variants", [(), ("window", "softcap", "alibi", "sinks")], ids=["plain", "all-variants"]
)
@pytest.mark.parametrize(
    ("head_dim", "causal"),
    [(64, True), (96, True), (128, True), (128, False), (256, True)],
    ids=["d64", "d96", "d128", "d128-noncausal", "d256"],
)
def test_hopper_defaults_compile_without_spills(head_dim, causal, variants):
    """What an untuned prefill call runs on a 9.0 device
    (kernelgen.model.policy.hopper_default_spec), with every built-in variant or none, causal
    (and at d128 without causality, where the default holds Q in registers): no spill, no
    stack."""
    from kernelgen.model.policy import hopper_default_spec

    spec = hopper_default_spec("bfloat16", head_dim, causal, variants)
    assert spec is not None and spec.mma == "wgmma"
    res = compile_offline(render(spec), spec.uri, "sm_90a", sass=False).resources
    assert (res.spill_store_bytes, res.spill_load_bytes, res.stack_bytes) == (0, 0, 0), spec.uri
