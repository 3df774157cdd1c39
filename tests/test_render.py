"""CPU tier: rendering (names, header, parameter contract, shared online-softmax piece)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kernelgen.kernels.render import folder_hash, kernel_params, render, template_dir, template_hash
from kernelgen.specs.forward import load_spec, spec_from_dict

ROOT = Path(__file__).resolve().parent.parent
BASE = dict(loop_order="v2", dtype="float16", head_dim=64, block_m=64, block_n=64, num_warps=4)


@pytest.mark.parametrize("loop_order", ["v1", "v2"])
def test_source_is_named_after_spec_and_starts_with_it(loop_order):
    spec = spec_from_dict({**BASE, "loop_order": loop_order})
    source = render(spec)
    assert source.startswith(f"// {spec.uri}:")
    header = source[: source.index("#include")]
    for line in spec.to_yaml().splitlines():
        assert f"//   {line}" in header
    assert "kernelgen 0.1.0" in header
    assert f'extern "C" __global__ void __launch_bounds__({spec.threads}, 1) {spec.uri}(' in source


def test_parameter_list_matches_the_contract():
    for loop_order in ("v1", "v2"):
        spec = spec_from_dict({**BASE, "loop_order": loop_order, "dtype": "bfloat16"})
        source = render(spec)
        signature = source[
            source.index(f"{spec.uri}(") : source.index(") {", source.index(spec.uri + "("))
        ]
        names = re.findall(r"(\w+)(?:,|$)", signature.replace("\n", ","))
        assert names == [p.name for p in kernel_params(spec)]
        assert ("workspace" in names) == (loop_order == "v1")
        assert "const __nv_bfloat16* __restrict__ q" in signature


@pytest.mark.parametrize("mma", ["simt", "mma_sync"])
def test_paged_kernels_take_the_block_table_and_contiguous_ones_do_not(mma):
    fields = {**BASE, "loop_order": "v2", "paged_kv": True}
    if mma == "mma_sync":
        fields.update(mma="mma_sync", dtype="float16", block_m=64)
    paged = spec_from_dict(fields)
    contiguous = spec_from_dict({**fields, "paged_kv": False})
    extra = [p for p in kernel_params(paged) if p not in kernel_params(contiguous)]
    assert [(p.name, p.ctype) for p in extra] == [
        ("block_table", "const int*"), ("page_size", "int"), ("block_table_stride_b", "long long")
    ]  # fmt: skip
    assert "block_table" in render(paged) and "block_table" not in render(contiguous)


@pytest.mark.parametrize(
    ("dtype", "ctype", "header"),
    [
        ("float32", "float", None),
        ("float16", "__half", "cuda_fp16.h"),
        ("bfloat16", "__nv_bfloat16", "cuda_bf16.h"),
    ],
)
def test_dtype_spellings(dtype, ctype, header):
    source = render(spec_from_dict({**BASE, "dtype": dtype}))
    assert f"typedef {ctype} elem_t;" in source
    assert ("#include" in source) == (header is not None)
    if header:
        assert f"#include <{header}>" in source


def test_online_softmax_update_is_written_once():
    """Both loop orders fold tiles through the one shared device function."""
    (shared,) = [
        p for p in template_dir().glob("*.j2") if "online_softmax_fold(float" in p.read_text()
    ]
    assert shared.name == "online_softmax.cuh.j2"
    for loop_order in ("v1", "v2"):
        source = render(spec_from_dict({**BASE, "loop_order": loop_order}))
        assert source.count("online_softmax_fold(float") == 1  # defined once
        assert source.count("online_softmax_fold(scores, 1.f, m, l)") == 1  # used by the kernel
        assert "exp2f(" in source


def test_geometry_constants_come_from_the_spec():
    spec = spec_from_dict({**BASE, "head_dim": 80, "block_m": 32, "causal": True})
    source = render(spec)
    assert "constexpr int HEAD_DIM = 80;" in source
    assert "constexpr int THREADS_PER_ROW = 4;" in source
    assert f"constexpr int SMEM_ROW = {spec.smem_row_elems};" in source
    assert "constexpr bool CAUSAL = true;" in source


def test_render_is_deterministic_and_hash_stable(spec_paths):
    spec = load_spec(spec_paths[0])
    assert render(spec) == render(spec)
    assert len(template_hash()) == 64


TC = {**BASE, "mma": "mma_sync", "dtype": "bfloat16", "head_dim": 128}


@pytest.mark.parametrize("layout", ["padded", "swizzled"])
def test_tensor_core_source(layout):
    spec = spec_from_dict({**TC, "smem_layout": layout, "stages": 3})
    source = render(spec)
    assert source.startswith(f"// {spec.uri}:")
    assert "tensor cores" in source.splitlines()[1]
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in source
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];" in source
    assert "cp.async.cg.shared.global [%0], [%1], 16, %2;" in source
    assert "__floats2bfloat162_rn(lo, hi)" in source
    assert "constexpr int STAGES = 3;" in source
    assert f"constexpr bool SWIZZLED = {'true' if layout == 'swizzled' else 'false'};" in source
    assert not re.search(r"\{%[\s-]|\{\{|\{#", source)  # no unrendered Jinja (PTX has {%0, ...})
    # The one online-softmax fold serves the tensor-core path too.
    assert source.count("online_softmax_fold(float") == 1
    fold_call = "online_softmax_fold<true>(row, score_scale, m[mt][half], l[mt][half])"
    assert source.count(fold_call) == 1  # l as lane shares, added up once after the last tile


def test_tensor_core_parameters_match_v2():
    simt = spec_from_dict({**BASE, "dtype": "float16"})
    tc = spec_from_dict({**TC, "dtype": "float16", "head_dim": 64})
    assert kernel_params(tc) == kernel_params(simt)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in render(tc)


@pytest.fixture
def reread_templates():
    """template_dir, template_hash and the Jinja environment read the folder once per process:
    the returned function forgets it (and it is forgotten again afterwards)."""
    import importlib

    render_module = importlib.import_module(
        "kernelgen.kernels.render"
    )  # the package exports render()

    def forget() -> None:
        for cached in (template_dir, template_hash, render_module.environment):
            cached.cache_clear()

    forget()
    yield forget
    forget()


def test_template_dir_override_renders_from_that_folder(tmp_path, monkeypatch, reread_templates):
    import shutil

    own_hash = template_hash()
    copy = tmp_path / "templates"
    shutil.copytree(template_dir(), copy)
    marked = copy / "fa_fwd_base.cu.j2"  # every kernel extends it
    marked.write_text(marked.read_text() + "// rendered from the copy\n")
    monkeypatch.setenv("KERNELGEN_TEMPLATE_DIR", str(copy))
    reread_templates()
    spec = load_spec(ROOT / "specs" / "v2_tc_f16_d64_m64_n64_s2_swz.yaml")
    assert template_dir() == copy
    assert render(spec).endswith("// rendered from the copy\n")
    assert template_hash() != own_hash  # so compile and tuning caches never mix the versions


def test_template_hash_covers_every_piece_a_kernel_loads(tmp_path, monkeypatch, reread_templates):
    """The mma.sync forward composes pieces by concern (engine, K/V source, tile schedule,
    epilogues): every file a render loads is hashed, so editing any changes every cache key."""
    import shutil

    import jinja2

    copy = tmp_path / "templates"
    shutil.copytree(template_dir(), copy)
    monkeypatch.setenv("KERNELGEN_TEMPLATE_DIR", str(copy))
    reread_templates()
    loaded: set[str] = set()
    get_source = jinja2.FileSystemLoader.get_source

    def recording(self, environment, name):
        loaded.add(name)
        return get_source(self, environment, name)

    monkeypatch.setattr(jinja2.FileSystemLoader, "get_source", recording)
    for name in ("gqa_split_paged", "causal_docmask_bsparse"):
        (path,) = (ROOT / "specs").glob(f"v2_tc_*_s2_swz_{name}.yaml")
        render(load_spec(path))
    pieces = {"kv", "paged_kv", "schedule", "epilogue"}
    assert {f"fwd_tc_{piece}.cuh.j2" for piece in pieces} <= loaded
    assert {"mma_sync_tile.cuh.j2", "mma_sync_gemm.cuh.j2"} <= loaded
    for name in sorted(loaded):
        before = folder_hash(copy)
        (copy / name).write_text((copy / name).read_text() + "{# edited #}\n")
        assert folder_hash(copy) != before, name


def test_template_dir_override_must_hold_the_entry_templates(
    tmp_path, monkeypatch, reread_templates
):
    from kernelgen.errors import SettingError

    (tmp_path / "fa_fwd_v1.cu.j2").write_text("")
    monkeypatch.setenv("KERNELGEN_TEMPLATE_DIR", str(tmp_path))
    with pytest.raises(
        SettingError, match=r"KERNELGEN_TEMPLATE_DIR=.*missing fa_fwd_v2.cu.j2, fa_fwd_v2_tc.cu.j2"
    ):
        template_dir()


# ---- user text reaches the source only inside the expression functions ----

EXPRESSION_BASE = {**BASE, "mma": "mma_sync"}
# Attempts to break out of an expression, a comment or a name, through every field that takes
# user text: each is refused, or renders a source that differs from a benign expression's only
# inside the expression functions (and the hash in the kernel's name).
INJECTIONS = [
    {"score_mod": "score; } __global__ void evil() { return 0;"},
    {"score_mod": "score + 1 /* */"},
    {"score_mod": "score  # */ } int x; /*"},
    {"score_mod": "score\n+ 1"},  # a line break inside the text: the canonical text has none
    {"score_mod": "score + 1e400"},
    {"score_mod": "score + __import__('os').getpid()"},
    {"mask_mod": "q_idx >= kv_idx or '*/'"},
    {"mask_mod": "q_idx >= kv_idx\\\n"},
    {"mask_mod": "doc[b, q_idx] > 0", "mod_inputs": ["doc*/:int32[2]"]},
    {"mask_mod": "doc[b, q_idx] > 0", "mod_inputs": ["doc\n:int32[2]"]},
    {"mask_mod": "doc[b, q_idx] > 0", "mod_inputs": ["doc:int32[2]; int x"]},
    {"mask_mod": "doc[b, q_idx] > 0", "mod_inputs": ["doc:int32[2]", "doc:int64[2]"]},
    {"mask_mod": "kg_read_doc[b] > 0", "mod_inputs": ["kg_read_doc:int32[1]"]},
]


def _skeleton(source: str) -> str:
    """The source without the spec header, the expression functions and the hashes."""
    source = re.sub(r"\n// (score_mod|mask_mod) [0-9a-f]{12}:.*?\n}\n", "\n", source, flags=re.S)
    source = re.sub(r"(smod|mmod)[0-9a-f]{12}", "HASH", source)
    lines = []
    for line in source.splitlines():
        if line.startswith(("//   score_mod: ", "//   mask_mod: ")):  # the spec header's copy
            assert re.fullmatch(r"[A-Za-z0-9_ .,:+\-*/%<>=!()\[\]']*", line), line
            continue
        lines.append(line)
    return "\n".join(lines)


@pytest.mark.parametrize("fields", INJECTIONS, ids=lambda f: repr(f)[:50])
def test_user_text_cannot_change_the_code_outside_the_expression_functions(fields):
    from kernelgen.errors import SpecError

    try:
        spec = spec_from_dict({**EXPRESSION_BASE, **fields})
    except SpecError:
        return  # refused, before anything is rendered
    benign = {
        "score_mod": "score + 1.0" if "score_mod" in fields else None,
        "mask_mod": "q_idx >= 0" if "mask_mod" in fields else None,
    }
    baseline = spec_from_dict({**EXPRESSION_BASE, **fields, **benign})
    assert _skeleton(render(spec)) == _skeleton(render(baseline))


def test_the_skeleton_comparison_sees_a_change_outside_the_functions():
    spec = spec_from_dict({**EXPRESSION_BASE, "score_mod": "score * 2"})
    source = render(spec)
    assert _skeleton(source) != _skeleton(source.replace("constexpr int UNBOUNDED", "int X"))
    definition = "__device__ __forceinline__ float kg_score_mod("
    assert definition in source and definition not in _skeleton(source)
