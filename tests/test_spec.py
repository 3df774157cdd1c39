"""CPU tier: spec validation, canonical names, YAML loading, JSON Schema."""

from __future__ import annotations

import json

import pytest

from kernelgen.errors import SpecError
from kernelgen.specs.forward import KernelSpec, load_spec, spec_from_dict, spec_json_schema

BASE = dict(loop_order="v2", dtype="float16", head_dim=64, block_m=64, block_n=64, num_warps=4)


def problems_of(**changes) -> list[str]:
    with pytest.raises(SpecError) as info:
        spec_from_dict({**BASE, **changes})
    return info.value.problems


def test_every_shipped_spec_loads(spec_paths):
    assert len(spec_paths) >= 8
    specs = [load_spec(p) for p in spec_paths]
    assert {s.loop_order for s in specs} == {"v1", "v2"}
    assert {s.dtype for s in specs} == {"float32", "float16", "bfloat16", "float8_e4m3"}
    assert {64, 128} <= {s.head_dim for s in specs}
    assert {s.head_dim for s in specs} & {80, 96}
    assert {s.causal for s in specs} == {True, False}
    assert len({s.uri for s in specs}) == len(specs)


def test_uri_is_canonical_and_readable():
    spec = spec_from_dict(
        {**BASE, "dtype": "bfloat16", "head_dim": 128, "causal": True, "block_n": 32}
    )
    assert spec.uri == "fa_fwd_v2_bf16_d128_m64_n32_w4_p1_causal"
    same = KernelSpec(
        **{**BASE, "dtype": "bfloat16", "head_dim": 128, "causal": True, "block_n": 32}
    )
    assert same.canonical_json() == spec.canonical_json()


def test_spec_is_frozen():
    spec = spec_from_dict(BASE)
    with pytest.raises(ValueError):
        spec.block_m = 32  # type: ignore[misc]


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"block_m": 48}, "block_m=48 is not allowed with mma='simt'; use one of 16, 32, 64, 128"),
        ({"block_n": 48}, "block_n=48 is not allowed with mma='simt'; use one of 16, 32, 64, 128"),
        ({"block_m": 24}, "block_m=24 is not allowed; use one of 16, 32, 64, 128 (mma_sync: 16"),
        ({"block_m": 512}, "block_m=512 is not allowed"),
        ({"block_n": 40}, "block_n=40 is not allowed; use one of 16, 32, 64, 128 (mma_sync: any"),
        ({"block_n": 256}, "block_n=256 is not allowed"),
        ({"block_n": 8}, "block_n=8 is not allowed"),
        ({"head_dim": 100}, "head_dim=100 is not allowed; use a multiple of 8 from 8 to 256"),
        ({"head_dim": 264}, "head_dim=264 is not allowed"),
        ({"num_warps": 3}, "num_warps=3 is not allowed"),
        ({"dtype": "float64"}, "dtype='float64' is not allowed"),
        ({"loop_order": "v3"}, "loop_order='v3' is not allowed"),
        ({"smem_pad": 9}, "smem_pad=9 is not allowed; use 0 to 8"),
        ({"archs": ["sm_75"]}, "archs=['sm_75'] is not allowed"),
        ({"tile": 3}, "unknown field 'tile' (value 3)"),
        ({"num_warps": 1, "block_m": 64}, "fewer than block_m=64 rows"),
        ({"num_warps": 8, "block_m": 16, "block_n": 8}, "block_n=8 is not allowed"),
    ],
)
def test_invalid_values_name_field_value_and_allowed(changes, needle):
    problems = problems_of(**changes)
    assert any(needle in p for p in problems), problems


def test_missing_field_is_named():
    data = dict(BASE)
    del data["head_dim"]
    with pytest.raises(SpecError) as info:
        spec_from_dict(data)
    assert info.value.problems == ["missing required field 'head_dim'"]


def test_shared_memory_over_arch_limit():
    problems = problems_of(
        dtype="float32", head_dim=256, block_m=128, block_n=128, num_warps=8, archs=["sm_86"]
    )
    assert any("exceeds" in p and "sm_86" in p for p in problems), problems


def test_register_budget():
    problems = problems_of(dtype="float32", head_dim=256, block_m=128, block_n=128, num_warps=4)
    assert any("accumulators per thread" in p for p in problems), problems


def test_several_problems_reported_together():
    assert len(problems_of(block_m=24, head_dim=7, num_warps=5)) == 3


def test_derived_geometry():
    spec = spec_from_dict(
        {**BASE, "dtype": "float16", "head_dim": 80, "block_m": 32, "block_n": 64}
    )
    assert spec.threads == 128
    assert spec.threads_per_row == 4
    assert spec.keys_per_thread == 16
    assert spec.cols_per_thread == 20
    assert spec.smem_row_elems == 82  # one 32-bit word of padding: an odd stride of 41 words
    assert spec.smem_bytes == (32 + 2 * 64) * 82 * 2 + 32 * 65 * 4


def test_load_yaml_errors_are_one_line_each(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("loop_order: v2\nblock_m: [1, 2\n")
    with pytest.raises(SpecError) as info:
        load_spec(bad)
    assert len(info.value.problems) == 1
    assert "invalid YAML" in info.value.problems[0]
    not_mapping = tmp_path / "list.yaml"
    not_mapping.write_text("- 1\n- 2\n")
    with pytest.raises(SpecError, match="expected a mapping"):
        load_spec(not_mapping)
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "absent.yaml")


def test_yaml_is_loaded_safely(tmp_path):
    evil = tmp_path / "evil.yaml"
    evil.write_text("!!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(SpecError, match="invalid YAML"):
        load_spec(evil)


def test_yaml_round_trip(tmp_path):
    spec = spec_from_dict({**BASE, "causal": True})
    path = tmp_path / "s.yaml"
    path.write_text(spec.to_yaml())
    assert load_spec(path) == spec


def test_json_schema_describes_fields():
    schema = spec_json_schema()
    json.dumps(schema)
    assert {"loop_order", "dtype", "head_dim", "block_m", "block_n"} <= set(schema["properties"])
    assert schema["additionalProperties"] is False


TC = {**BASE, "mma": "mma_sync"}


def test_tensor_core_defaults_are_explicit_in_the_spec():
    spec = spec_from_dict(TC)
    assert (spec.stages, spec.smem_layout, spec.smem_pad) == (2, "padded", 4)
    assert spec.uri == "fa_fwd_v2_tc_f16_d64_m64_n64_w4_s2_pad"
    swizzled = spec_from_dict({**TC, "smem_layout": "swizzled", "stages": 3, "causal": True})
    assert (swizzled.smem_pad, swizzled.uri) == (0, "fa_fwd_v2_tc_f16_d64_m64_n64_w4_s3_swz_causal")
    # The dump holds the resolved values, so it reloads to the same kernel.
    assert spec_from_dict(swizzled.model_dump()).canonical_json() == swizzled.canonical_json()
    simt = spec_from_dict(BASE)
    assert (simt.mma, simt.stages, simt.smem_pad) == ("simt", 1, 1)


def test_split_kv_and_packed_gqa_names():
    spec = spec_from_dict({**TC, "block_m": 16, "num_warps": 1, "pack_gqa": True, "split_kv": True})
    assert spec.uri == "fa_fwd_v2_tc_f16_d64_m16_n64_w1_s2_pad_gqa_split"
    assert spec.combine_uri == spec.uri + "_combine"
    causal = spec_from_dict({**TC, "causal": True, "split_kv": True})
    assert causal.uri.endswith("_causal_split")


def test_paged_kv_names_and_refusals():
    """paged_kv: part of the name and the schema; v2 only (both mma paths)."""
    tc = spec_from_dict({**TC, "block_m": 16, "num_warps": 1, "split_kv": True, "paged_kv": True})
    assert tc.uri == "fa_fwd_v2_tc_f16_d64_m16_n64_w1_s2_pad_split_paged"
    assert spec_from_dict({**BASE, "loop_order": "v2", "paged_kv": True}).uri.endswith("_paged")
    assert "paged_kv" in spec_json_schema()["properties"]
    assert spec_from_dict(TC).paged_kv is False
    with pytest.raises(SpecError) as info:
        spec_from_dict({**BASE, "loop_order": "v1", "paged_kv": True})
    problems = info.value.problems
    assert any("paged_kv=true is not allowed with loop_order='v1'" in p for p in problems)


def test_tensor_core_geometry():
    spec = spec_from_dict({**TC, "head_dim": 40, "block_n": 32})
    assert spec.head_dim_padded == 48
    assert spec.smem_row_elems == 56  # 48 + one 16-byte chunk: 7 chunks, an odd stride
    assert spec.threads_per_row == 4
    # Q tile + 2 stages of K and V, 2-byte elements
    assert spec.smem_bytes == (64 + 2 * 2 * 32) * 56 * 2
    assert spec.accumulators_per_thread == (32 + 48) // 2
    assert spec.rows_per_warp == 16


def test_tensor_core_two_m_tiles_per_warp():
    """block_m = 32 * num_warps: each warp owns two m16 tiles, twice the accumulators."""
    wide = spec_from_dict({**TC, "head_dim": 128, "block_m": 128, "block_n": 32})
    assert (wide.rows_per_warp, wide.accumulators_per_thread) == (32, 32 * (32 + 128) // 32)
    assert wide.smem_bytes == (128 + 2 * 2 * 32) * (128 + 8) * 2
    with pytest.raises(SpecError) as info:  # 32 x (64 + 128) / 32 = 192 accumulators
        spec_from_dict({**TC, "head_dim": 128, "block_m": 128, "block_n": 64})
    assert any("need 192 fp32 accumulators" in p for p in info.value.problems)
    # 8 warps of 32 rows and 48-key tiles: 32 x (48 + 128) / 32 = 176 accumulators
    widest = spec_from_dict({**TC, "head_dim": 128, "block_m": 256, "block_n": 48, "num_warps": 8})
    assert (widest.rows_per_warp, widest.accumulators_per_thread) == (32, 176)
    assert widest.smem_bytes == (256 + 2 * 2 * 48) * (128 + 8) * 2
    assert widest.uri.startswith("fa_fwd_v2_tc_f16_d128_m256_n48_w8_")
    with pytest.raises(SpecError) as info:  # 256 rows need 8 warps of 32
        spec_from_dict({**TC, "head_dim": 128, "block_m": 256, "block_n": 48})
    assert any("use block_m=64 or 128" in p for p in info.value.problems), info.value.problems
    with pytest.raises(SpecError) as info:  # 64 rows per warp: not 16 or 32
        spec_from_dict({**TC, "block_m": 128, "num_warps": 2})
    assert any("use block_m=32 or 64" in p for p in info.value.problems), info.value.problems


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"dtype": "float32"}, "dtype='float32' is not allowed with mma='mma_sync'"),
        ({"loop_order": "v1"}, "loop_order='v1' is not allowed with mma='mma_sync'; use v2"),
        ({"block_m": 32}, "block_m=32 is not allowed with num_warps=4 and mma='mma_sync'"),
        ({"stages": 1}, "stages=1 is not allowed with mma='mma_sync'; use one of 2, 3, 4"),
        ({"stages": 5}, "stages=5 is not allowed"),
        ({"smem_pad": 1}, "smem_pad=1 is not allowed with mma='mma_sync'"),
        ({"smem_layout": "swizzled", "head_dim": 96}, "smem_layout='swizzled' is not allowed"),
        ({"mma": "tcgen05"}, "mma='tcgen05' is not allowed"),
        ({"head_dim": 256, "block_n": 128}, "accumulators per thread"),
    ],
)
def test_invalid_tensor_core_specs(changes, needle):
    with pytest.raises(SpecError) as info:
        spec_from_dict({**TC, **changes})
    assert any(needle in p for p in info.value.problems), info.value.problems


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"stages": 2}, "stages=2 is not allowed with mma='simt'; use 1"),
        ({"smem_layout": "swizzled"}, "smem_layout='swizzled' is not allowed with mma='simt'"),
        (
            {"split_kv": True, "loop_order": "v1"},
            "split_kv=true is not allowed with loop_order='v1'; use v2",
        ),
        ({"pack_gqa": True}, "pack_gqa=true is not allowed with mma='simt'"),
    ],
)
def test_simt_rejects_tensor_core_fields(changes, needle):
    problems = problems_of(**changes)
    assert any(needle in p for p in problems), problems


WG = dict(loop_order="v2", mma="wgmma", dtype="bfloat16", head_dim=128, block_m=128, block_n=128)


def test_wgmma_defaults_target_sm90a_with_a_producer_warpgroup():
    spec = spec_from_dict(WG)
    assert spec.archs == ("sm_90a",)
    assert (spec.num_warps, spec.threads, spec.consumer_warpgroups) == (12, 384, 2)
    assert (spec.smem_layout, spec.smem_pad, spec.stages) == ("swizzled", 0, 2)
    assert spec.uri == "fa_fwd_v2_wg_bf16_d128_m128_n128_w12_s2"
    assert spec.threads_per_row == 4 and spec.rows_per_warp == 16
    assert spec.accumulators_per_thread == (128 + 128) // 2
    # Q (128 rows) and 2 stages of K and V (128 rows each), 2 column blocks of 128 bytes a row,
    # 8 barriers of 8 bytes (Q; K, V, free per slot; the last V tile staged), 1024 bytes to align
    # the base to the swizzle atom.
    assert spec.smem_bytes == (128 + 4 * 128) * 2 * 128 + 8 * 8 + 1024
    one = spec_from_dict({**WG, "block_m": 64, "head_dim": 96, "dtype": "float16"})
    assert (one.num_warps, one.column_blocks, one.head_dim_padded) == (8, 2, 96)
    assert spec_from_dict(one.model_dump()) == one  # a dumped spec loads back unchanged


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"archs": ["sm_90"]}, "archs=['sm_90'] is not allowed with mma='wgmma'"),
        ({"archs": ["sm_80", "sm_90a"]}, "exist only on sm_90a"),
        ({"dtype": "float32"}, "dtype='float32' is not allowed with mma='wgmma'"),
        ({"loop_order": "v1"}, "loop_order='v1' is not allowed with mma='wgmma'; use v2"),
        ({"head_dim": 80}, "head_dim=80 is not allowed with mma='wgmma'; use one of 64, 96"),
        ({"block_m": 32}, "block_m=32 is not allowed with mma='wgmma'"),
        ({"num_warps": 8}, "num_warps=8 is not allowed with mma='wgmma' and block_m=128; use 12"),
        ({"block_n": 16}, "block_n=16 is not allowed with mma='wgmma'"),
        ({"stages": 1}, "stages=1 is not allowed with mma='wgmma'"),
        ({"smem_layout": "padded"}, "always 128-byte swizzled"),
        ({"head_dim": 256}, "(lower block_n)"),
        ({"stages": 4}, "exceeds the 232448-byte limit of sm_90a"),
        # the overlap keeps a tile's fp32 weights beside P: with Q in registers as well, 128
        # keys at head dim 128 are more than ptxas can pipeline (it serializes the products)
        ({"overlap": True, "q_in_registers": True}, "need 192 fp32 accumulators per thread"),
    ],
)
def test_invalid_wgmma_specs(changes, needle):
    with pytest.raises(SpecError) as info:
        spec_from_dict({**WG, **changes})
    assert any(needle in p for p in info.value.problems), info.value.problems


def test_wgmma_takes_the_decode_fields_and_names_them():
    """split_kv, pack_gqa and paged_kv on the wgmma engine (docs/hopper.md, "Decode and
    serving"); what they need of a call (page size, GQA group) is checked at launch."""
    spec = spec_from_dict({**WG, "block_m": 64, "pack_gqa": True, "split_kv": True,
                           "paged_kv": True})  # fmt: skip
    assert spec.uri == "fa_fwd_v2_wg_bf16_d128_m64_n128_w8_s2_gqa_split_paged"
    assert spec.combine_uri.startswith(spec.uri)


def test_the_overlap_is_wgmma_only_and_named():
    spec = spec_from_dict({**WG, "block_n": 64, "overlap": True})
    assert spec.uri == "fa_fwd_v2_wg_bf16_d128_m128_n64_w12_s2_ovl"
    assert '"overlap":true' in spec.canonical_json()
    assert "overlap" not in spec_from_dict(WG).canonical_json()  # off: left out, like variants
    # the new tile's fp32 weights beside the 16-bit ones of the tile in flight: one P buffer
    assert spec.accumulators_per_thread == (64 + 128) // 2 + 64 // 4
    problems = problems_of(overlap=True)
    assert any("overlap=true is not allowed with mma='simt'" in p for p in problems), problems


def test_twelve_warps_are_wgmma_only():
    problems = problems_of(num_warps=12, block_m=128)
    assert any("num_warps=12 is not allowed with mma='simt'" in p for p in problems), problems


def test_cuda_core_v2_splits_keys_for_every_dtype():
    for dtype in ("float32", "float16", "bfloat16"):
        spec = spec_from_dict({**BASE, "dtype": dtype, "block_m": 16, "split_kv": True})
        assert spec.mma == "simt" and spec.uri.endswith("_p1_split")


def test_several_mode_problems_are_separate_lines():
    with pytest.raises(SpecError) as info:
        spec_from_dict({**TC, "dtype": "float32", "loop_order": "v1", "stages": 9})
    assert len(info.value.problems) == 3


def test_default_spec_takes_the_short_dtype_names():
    """default_spec reads dtype names through the one alias table (also the tuner's)."""
    import kernelgen
    from kernelgen.errors import InputError
    from kernelgen.specs.forward import DTYPE_ALIASES
    from kernelgen.tuning.key import DTYPE_ALIASES as TUNER_ALIASES

    assert TUNER_ALIASES is DTYPE_ALIASES
    for short, full in [
        ("bf16", "bfloat16"),
        ("fp16", "float16"),
        ("f16", "float16"),
        ("half", "float16"),
        ("fp32", "float32"),
        ("f32", "float32"),
        ("float", "float32"),
        ("BF16", "bfloat16"),
    ]:
        assert kernelgen.default_spec(short, 128, True, "sm_90") == kernelgen.default_spec(
            full, 128, True, "sm_90"
        ), short
    assert kernelgen.default_spec("bf16", 64, False).dtype == "bfloat16"
    with pytest.raises(InputError, match=r"dtype='fp8' is not allowed; use one of .*bf16"):
        kernelgen.default_spec("fp8", 128, True)


def test_pyproject_extras_pin_what_the_runtime_needs():
    """cuda: NumPy >= 2.1.2 (CuPy 14 enables bfloat16 only from it); bench: torch >= 2.4; dev:
    torch pinned to the CPU build, never a range; integrations: transformers."""
    tomllib = pytest.importorskip("tomllib")
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    extras = tomllib.loads(text)["project"]["optional-dependencies"]
    assert "numpy>=2.1.2" in extras["cuda"]
    assert "cuda-bindings>=13" in extras["cuda"]  # wgmma's tensor maps (driver API)
    assert "torch>=2.4" in extras["bench"]
    # dev (what CI installs) pins torch to the CPU build CI has as a local wheel: a range would
    # pull a multi-GB GPU build no CPU test needs
    assert [req for req in extras["dev"] if req.startswith("torch")] == ["torch==2.13.0"]
    assert "transformers>=4.50" in extras["dev"]
    assert extras["integrations"] == ["transformers>=4.50"]
    assert not any("bench" in req for req in extras["dev"])


def test_a_spec_that_is_not_utf8_is_one_typed_error(tmp_path):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"# caf\xe9\nloop_order: v2\n")
    with pytest.raises(SpecError) as info:
        load_spec(latin1)
    assert info.value.problems == ["not UTF-8 text: byte 0xe9 at line 1; save the file as UTF-8"]
    assert str(latin1) in str(info.value)
    utf16 = tmp_path / "utf16.yaml"
    utf16.write_text("loop_order: v2\n", encoding="utf-16")
    with pytest.raises(SpecError, match="not UTF-8 text"):
        load_spec(utf16)


def test_yaml_aliases_and_huge_files_are_refused(tmp_path):
    laughs = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    laughs += [
        f"{b}: &{b} [{', '.join(['*' + a] * 9)}]"
        for a, b in zip("abcdefgh", "bcdefghi", strict=True)
    ]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(laughs) + "\n")
    with pytest.raises(SpecError) as info:
        load_spec(bomb)
    assert len(info.value.problems) == 1
    assert "anchors (&name) are not allowed" in info.value.problems[0]
    alias = tmp_path / "alias.yaml"
    alias.write_text("head_dim: *d\n")  # an alias without its anchor is refused as well
    with pytest.raises(SpecError, match="invalid YAML"):
        load_spec(alias)
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(SpecError, match="larger than 1048576 bytes"):
        load_spec(big)


def test_values_in_messages_are_truncated():
    (line,) = problems_of(colour="x" * 2_000_000)
    allowed = ", ".join(KernelSpec.model_fields)  # the message lists the fields
    assert len(line) < 200 + len(allowed)
    assert "xxx..." in line
    (line,) = problems_of(dtype="y" * 10_000)
    assert len(line) < 400


def test_duplicate_keys_are_an_error_naming_the_key(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(
        "loop_order: v2\ndtype: float16\nhead_dim: 64\nblock_m: 64\nblock_n: 64\nhead_dim: 128\n"
    )
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.problems == [
        "invalid YAML: line 6: duplicate key 'head_dim' (first at line 3)"
    ]


@pytest.mark.parametrize(
    "field", ["head_dim", "block_m", "block_n", "num_warps", "stages", "smem_pad"]
)
@pytest.mark.parametrize("value", [True, False, 64.0])
def test_integer_fields_refuse_booleans_and_floats(field, value):
    problems = problems_of(**{field: value})
    assert any(p.startswith(f"{field}={value!r} is not allowed; use an integer") for p in problems)


BOOLEAN_FIELDS = [
    "causal", "pack_gqa", "split_kv", "paged_kv", "window", "softcap", "alibi", "sinks",
    "block_sparse", "overlap", "pingpong", "q_in_registers", "additive_mask",
]  # fmt: skip


def test_every_boolean_field_is_in_the_list():
    """A new boolean field joins BOOLEAN_FIELDS (and so the strictness test below)."""
    from kernelgen.specs.forward import KernelSpec

    booleans = {n for n, f in KernelSpec.model_fields.items() if f.annotation is bool}
    assert booleans == set(BOOLEAN_FIELDS)


@pytest.mark.parametrize("field", BOOLEAN_FIELDS)
@pytest.mark.parametrize("value", [1, 0, "yes"])
def test_boolean_fields_refuse_other_values(field, value):
    problems = problems_of(**{field: value})
    assert any(
        p.startswith(f"{field}={value!r} is not allowed; use true or false") for p in problems
    )


# ---- user expressions (docs/expressions.md) ----

TC_BASE = dict(mma="mma_sync")


def test_expressions_are_stored_canonical_and_named_by_their_hash():
    spelled = spec_from_dict(
        {**BASE, **TC_BASE, "mask_mod": "(doc[b,q_idx]==doc[b, kv_idx])",
         "mod_inputs": ["doc : int32 [2]"]}
    )  # fmt: skip
    canonical = spec_from_dict(
        {**BASE, **TC_BASE, "mask_mod": "doc[b, q_idx] == doc[b, kv_idx]",
         "mod_inputs": ["doc:int32[2]"]}
    )  # fmt: skip
    assert spelled == canonical and spelled.uri == canonical.uri
    assert canonical.mask_mod == "doc[b, q_idx] == doc[b, kv_idx]"
    assert canonical.mod_inputs == ("doc:int32[2]",)
    (_, mask_mod) = canonical.expressions
    assert canonical.uri.endswith(f"_mmod{mask_mod.hash}")
    other = spec_from_dict(
        {**BASE, **TC_BASE, "mask_mod": "doc[b, q_idx] == doc[b, kv_idx]",
         "mod_inputs": ["doc:int64[2]"]}
    )  # fmt: skip
    assert other.uri != canonical.uri  # the inputs' signature is part of the hash
    # a round trip through YAML keeps every field
    assert load_spec_text(canonical.to_yaml()) == canonical
    # a spec without expressions keeps its identity (no new keys in its dump)
    plain = spec_from_dict({**BASE, **TC_BASE})
    assert "mask_mod" not in plain.canonical_json() and "block_sparse" not in plain.to_yaml()


def load_spec_text(text: str) -> KernelSpec:
    from kernelgen.specs.forward import parse_spec_yaml

    return spec_from_dict(parse_spec_yaml(text))


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"mask_mod": "q_idx.real"}, "attribute access"),
        ({"score_mod": "score + x[q_idx]"}, "only declared inputs"),
        ({"score_mod": 3}, "score_mod=3 is not allowed; use a string"),
        ({"mask_mod": "q_idx > 0", "mod_inputs": ["doc"]}, "write name:dtype[rank]"),
        ({"mask_mod": "q_idx > 0", "mod_inputs": "doc:int32[1]"}, "use a list"),
        ({"mask_mod": "q_idx > 0", "mod_inputs": ["d:int8[1]"]}, "dtype 'int8' is not allowed"),
        ({"mod_inputs": ["doc:int32[1]"]}, "no score_mod or mask_mod"),
        ({"block_sparse": True}, "block_sparse=true needs a mask_mod"),
        ({"block_sparse": True, "mask_mod": "q_idx >= kv_idx"}, "use mma_sync or wgmma"),
        (
            {**TC_BASE, "block_m": 16, "num_warps": 1, "split_kv": True, "block_sparse": True,
             "mask_mod": "q_idx >= kv_idx"},
            "block_sparse=true is not allowed with split_kv=true",
        ),
    ],
)  # fmt: skip
def test_invalid_expression_fields(changes, needle):
    problems = problems_of(**changes)
    assert any(needle in p for p in problems), problems


def test_wgmma_takes_variants_expressions_and_block_sparsity():
    wgmma = dict(
        mma="wgmma", dtype="bfloat16", head_dim=128, block_m=128, block_n=64,
        mask_mod="q_idx >= kv_idx",
    )  # fmt: skip
    spec = spec_from_dict({**BASE, **wgmma, "window": True, "sinks": True, "num_warps": 12})
    assert spec.uri.startswith("fa_fwd_v2_wg_") and "_win_sink_mmod" in spec.uri
    sparse = spec_from_dict({**BASE, **wgmma, "num_warps": 12, "block_sparse": True})
    assert sparse.uri.endswith("_bsparse")
    # per ring slot the index of its key tile (8 bytes each, beside the barriers)
    dense = spec_from_dict({**BASE, **wgmma, "num_warps": 12})
    assert sparse.smem_bytes == dense.smem_bytes + 8 * sparse.stages


def test_wgmma_schedule_options_and_their_limits():
    """pingpong needs two consumers (on the plain or the overlapped loop); q_in_registers the
    registers for head_dim / 4 more 32-bit values per thread, the overlap block_n / 4 more."""
    base = dict(loop_order="v2", mma="wgmma", dtype="bfloat16", head_dim=128, block_n=64)
    both = spec_from_dict({**base, "block_m": 128, "pingpong": True, "q_in_registers": True})
    assert both.uri == "fa_fwd_v2_wg_bf16_d128_m128_n64_w12_s2_pp_qr"
    assert both.accumulators_per_thread == 16 * (64 + 128) // 32 + 128 // 4
    pipelined = spec_from_dict({**base, "block_m": 128, "overlap": True, "q_in_registers": True})
    assert pipelined.uri == "fa_fwd_v2_wg_bf16_d128_m128_n64_w12_s2_ovl_qr"
    assert pipelined.accumulators_per_thread == 16 * (64 + 128) // 32 + 64 // 4 + 128 // 4
    turns = spec_from_dict({**base, "block_m": 128, "overlap": True, "pingpong": True})
    assert turns.uri == "fa_fwd_v2_wg_bf16_d128_m128_n64_w12_s2_ovl_pp"
    assert turns.accumulators_per_thread == 16 * (64 + 128) // 32 + 64 // 4  # as the overlap
    for bad in (
        {"block_m": 64, "pingpong": True},  # one consumer: no one to take turns with
        {"block_m": 128, "head_dim": 256, "q_in_registers": True},  # 160 + 64 registers
    ):
        with pytest.raises(SpecError):
            spec_from_dict({**base, **bad})
    with pytest.raises(SpecError, match="pingpong=true is not allowed with mma='mma_sync'"):
        spec_from_dict({**TC, "head_dim": 64, "block_m": 64, "block_n": 64, "pingpong": True})


def test_dumps_without_defaults_leave_out_what_is_off():
    """model_dump(exclude_defaults=True) works (the unused-variant filter once raised KeyError
    on the expression fields it had already left out) and loads back to the same spec."""
    spec = KernelSpec(
        loop_order="v2", mma="mma_sync", dtype="float16", head_dim=64, block_m=64, block_n=64,
        causal=True,
    )  # fmt: skip
    data = spec.model_dump(exclude_defaults=True)
    assert data["causal"] is True and "score_mod" not in data and "softcap" not in data
    assert spec_from_dict(data) == spec


def test_the_tma_epilogue_is_named_and_refused_where_not_built():
    """epilogue: tma (wgmma) adds the tag _tma after the loop's; the default (direct) is left
    out of dumps, so existing identities stay. Packed GQA, fp8 and split-KV take it (the name
    keeps the tags' order: ..._tma_gqa, ..._tma_split)."""
    spec = spec_from_dict({**WG, "epilogue": "tma", "q_in_registers": True, "block_n": 64})
    assert spec.uri == "fa_fwd_v2_wg_bf16_d128_m128_n64_w12_s2_qr_tma"
    assert '"epilogue":"tma"' in spec.canonical_json()
    direct = spec_from_dict({**WG, "epilogue": "direct"})
    assert direct == spec_from_dict(WG) and "epilogue" not in direct.canonical_json()
    assert direct.uri == spec_from_dict(WG).uri
    assert spec_from_dict(spec.model_dump()) == spec
    packed = spec_from_dict({**WG, "block_m": 64, "pack_gqa": True, "epilogue": "tma"})
    assert packed.uri == "fa_fwd_v2_wg_bf16_d128_m64_n128_w8_s2_tma_gqa"
    fp8 = spec_from_dict({**WG, "dtype": "float8_e4m3", "epilogue": "tma"})
    assert fp8.uri == "fa_fwd_v2_wg_e4m3_d128_m128_n128_w12_s2_tma"
    split = spec_from_dict({**WG, "split_kv": True, "epilogue": "tma"})
    assert split.uri == "fa_fwd_v2_wg_bf16_d128_m128_n128_w12_s2_tma_split"
    # fp32 partials at head dim 256: 8 column blocks of staging, 4 past the Q tile's (64 KiB)
    with pytest.raises(SpecError, match="shared memory 263232 bytes exceeds"):
        spec_from_dict({**WG, "head_dim": 256, "block_n": 64, "split_kv": True, "epilogue": "tma"})
    refused = {
        "mma='mma_sync'": {**TC, "head_dim": 64, "block_m": 64, "block_n": 64},
    }
    for field, fields in refused.items():
        with pytest.raises(SpecError) as info:
            spec_from_dict({**fields, "epilogue": "tma"})
        wanted = f"epilogue='tma' is not allowed with {field}"
        assert any(p.startswith(wanted) and "use epilogue: direct" in p
                   for p in info.value.problems), info.value.problems  # fmt: skip
    with pytest.raises(SpecError, match="epilogue"):
        spec_from_dict({**WG, "epilogue": "stmatrix"})


@pytest.mark.parametrize(
    ("fields", "pinned"),
    [
        ({}, True),  # the plain d128 loop
        ({"q_in_registers": True}, True),
        ({"head_dim": 64}, True),
        ({"overlap": True, "stages": 3}, False),  # ptxas moves uniform work into the window
        ({"head_dim": 256, "block_n": 64}, False),
        ({"dtype": "float8_e4m3"}, False),
        ({"mma": "mma_sync", "block_m": 64, "block_n": 64, "num_warps": 4}, False),
    ],
)
def test_which_specs_pin_v_descriptors(fields, pinned):
    """V's wgmma descriptors are built once before the loop for 16-bit operands outside the
    overlapped loops up to head dim 128 (docs/hopper.md, "K's descriptors")."""
    base = {"loop_order": "v2", "mma": "wgmma", "dtype": "bfloat16", "head_dim": 128,
            "block_m": 128, "block_n": 128, "archs": ["sm_90a"]}  # fmt: skip
    spec = spec_from_dict({**base, **fields})
    assert spec.pins_v_descriptors is pinned
