"""Block masks (kernelgen/calls/block_mask.py, docs/expressions.md): the NumPy builder against a
brute force over every tile, the generated builder kernel (through the CPU emulator, and its device
path's arguments through the CuPy fake) against the NumPy builder, the tile counts the masks
must give, argument errors, and the builder's offline compile."""

from __future__ import annotations

import importlib
import itertools
import sys

import numpy as np
import pytest
from conftest import require_toolchain

import kernelgen
from kernelgen.calls.block_mask import (
    BlockMask,
    block_mask,
    block_mask_reference,
    builder_params,
    builder_source,
    kernel_name,
)
from kernelgen.errors import InputError, InputTypeError, SpecError
from kernelgen.references.expressions import evaluate_grid
from kernelgen.specs.expressions import ModInput, parse_mask_mod, parse_score_mod

block_mask_module = importlib.import_module(
    "kernelgen.calls.block_mask"
)  # kernelgen.block_mask: the function
LISTS = ("partial_counts", "partial_indices", "full_counts", "full_indices")


def brute_force_states(mask_mod, batch, heads, sq, sk, bm, bn, inputs=None) -> np.ndarray:
    """0 hidden / 1 partial / 2 full per (b, h, q tile, key tile), tile by tile."""
    dense = evaluate_grid(mask_mod, batch, heads, sq, sk, inputs=inputs)
    states = np.zeros((batch, heads, -(-sq // bm), -(-sk // bn)), dtype=np.int8)
    for b, h, m, n in np.ndindex(states.shape):
        tile = dense[b, h, m * bm : (m + 1) * bm, n * bn : (n + 1) * bn]
        states[b, h, m, n] = 2 if tile.all() else (1 if tile.any() else 0)
    return states


def assert_lists_are_the_states(mask: BlockMask, states: np.ndarray) -> None:
    """The lists hold exactly the partial (full) tiles, ascending, then -1."""
    for counts, indices, state in (
        (mask.partial_counts, mask.partial_indices, 1),
        (mask.full_counts, mask.full_indices, 2),
    ):
        counts, indices = np.asarray(counts), np.asarray(indices)
        assert counts.dtype == indices.dtype == np.int32
        for row in np.ndindex(states.shape[:3]):
            expected = np.flatnonzero(states[row] == state)
            assert counts[row] == expected.size
            np.testing.assert_array_equal(indices[row][: expected.size], expected)
            assert (indices[row][expected.size :] == -1).all()


DOCS = ModInput("doc", "int32", 2)


def four_documents(batch: int, length: int, seed: int) -> np.ndarray:
    """Document ids (batch, length): four documents of random lengths per batch entry."""
    rng = np.random.default_rng(seed)
    docs = np.zeros((batch, length), dtype=np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, length), size=3, replace=False))
        docs[b] = np.searchsorted(cuts, np.arange(length), side="right")
    return docs


def docs_of(batch: int, length: int) -> np.ndarray:
    return four_documents(batch, length, seed=3)


def widths(heads: int) -> np.ndarray:
    """Per-head window half-widths (int64)."""
    return np.array([0, 5, 40], np.int64)[:heads]


def ancestors(sq: int, sk: int) -> np.ndarray:
    """A tree-attention mask: query i sees a random subset of earlier keys and itself (bottom
    right aligned: key i + sk - sq)."""
    offset = sk - sq
    random = np.tril(np.random.default_rng(4).random((sq, sk)) < 0.2, offset)
    return random | np.eye(sq, sk, offset, dtype=bool)


# name -> (mask_mod, inputs(batch, heads, sq, sk) -> arrays)
MASKS = {
    "documents": ("doc[b, q_idx] == doc[b, kv_idx]", lambda b, h, sq, sk: {"doc": docs_of(b, sq)}),
    "prefix_lm": ("kv_idx < 21 or kv_idx <= q_idx + 7", lambda *_: {}),
    "causal_bottom_right": ("kv_idx <= q_idx + 7", lambda *_: {}),
    "head_window": ("abs(q_idx + 7 - kv_idx) <= width[h]", lambda _, h, *r: {"width": widths(h)}),
    "tree": ("anc[q_idx, kv_idx]", lambda b, h, sq, sk: {"anc": ancestors(sq, sk)}),
}  # fmt: skip
SIZES = {"documents": (2, 1, 70, 70), "head_window": (1, 3, 45, 52)}


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize(("bm", "bn"), [(16, 32), (32, 16)])
def test_the_numpy_builder_lists_what_a_brute_force_finds(name, bm, bn):
    text, make_inputs = MASKS[name]
    batch, heads, sq, sk = SIZES.get(name, (1, 1, 45, 52))
    inputs = make_inputs(batch, heads, sq, sk)
    mask = block_mask_reference(
        text, batch, heads, sq, sk, block_m=bm, block_n=bn, mod_inputs=inputs
    )
    states = brute_force_states(mask.mask_mod, batch, heads, sq, sk, bm, bn, inputs)
    assert_lists_are_the_states(mask, states)
    np.testing.assert_array_equal(mask.tile_states(), states)
    assert (states == 1).sum() > 0
    assert name == "tree" or (states == 2).sum() > 0


@pytest.mark.parametrize(("bm", "bn"), [(64, 176), (128, 256)])
def test_the_numpy_builder_takes_wgmma_key_tiles(bm, bn):
    """Key tiles wider than mma.sync's 128 (wgmma's block-sparse kernels take up to 256): the
    builders refused them until the fuzzer drew one (kernelgen.testing.fuzz, seed 1)."""
    text = MASKS["documents"][0]
    inputs = {"doc": four_documents(2, 300, seed=6)}
    mask = block_mask_reference(text, 2, 1, 300, 300, block_m=bm, block_n=bn, mod_inputs=inputs)
    states = brute_force_states(mask.mask_mod, 2, 1, 300, 300, bm, bn, inputs)
    assert_lists_are_the_states(mask, states)
    assert (mask.key_tiles, (states == 1).any()) == (-(-300 // bn), True)


def test_tile_counts_follow_the_masks_geometry():
    """Causal on square tiles: the diagonal partial, below it full, above it skipped. Four
    documents: exactly the tiles that meet a document's diagonal block are visited."""
    mask = block_mask_reference("q_idx >= kv_idx", 1, 1, 64, 64, block_m=16, block_n=16)
    m, n = np.indices((4, 4))
    np.testing.assert_array_equal(mask.tile_states()[0, 0], np.where(m == n, 1, 2 * (m > n)))
    assert mask.visited_tiles() == 10

    docs = four_documents(2, 100, seed=5)
    mask = block_mask_reference(
        "doc[b, q_idx] == doc[b, kv_idx]", 2, 1, 100, 100, block_m=16, block_n=16,
        mod_inputs={"doc": docs},
    )  # fmt: skip
    for b in range(2):
        expected = 0
        for m, n in itertools.product(range(7), range(7)):
            rows, keys = docs[b, m * 16 : m * 16 + 16], docs[b, n * 16 : n * 16 + 16]
            expected += bool(np.intersect1d(rows, keys).size)  # a shared document: visible
        visited = int(mask.partial_counts[b].sum() + mask.full_counts[b].sum())
        assert visited == expected < 7 * 7


# ---- the generated builder, through the emulator ----

EMULATED = [
    ("documents", 16, 32),
    ("prefix_lm", 32, 16),
    ("causal_bottom_right", 16, 16),
    ("head_window", 16, 32),
    ("tree", 32, 32),
]


@pytest.mark.emulate
@pytest.mark.parametrize(("name", "bm", "bn"), EMULATED)
def test_the_generated_builder_equals_the_numpy_builder(name, bm, bn):
    text, make_inputs = MASKS[name]
    batch, heads, sq, sk = SIZES.get(name, (1, 1, 45, 52))
    inputs = make_inputs(batch, heads, sq, sk)
    built = block_mask(text, batch, heads, sq, sk, block_m=bm, block_n=bn, mod_inputs=inputs)
    reference = block_mask_reference(
        text, batch, heads, sq, sk, block_m=bm, block_n=bn, mod_inputs=inputs
    )
    for name in LISTS:
        np.testing.assert_array_equal(getattr(built, name), getattr(reference, name), name)
    assert isinstance(built.partial_counts, np.ndarray)
    assert built.mask_mod.hash == reference.mask_mod.hash
    assert (built.batch, built.heads, built.q_tiles, built.key_tiles) == (
        batch, heads, -(-sq // bm), -(-sk // bn),
    )  # fmt: skip


@pytest.mark.emulate
def test_one_head_or_batch_entry_is_evaluated_at_zero_and_broadcasts():
    widths = {"width": np.array([3, 30], np.int64)}
    text = "abs(q_idx - kv_idx) <= width[h]"
    per_head = block_mask(text, 2, 2, 40, 40, block_m=16, block_n=16, mod_inputs=widths)
    shared = block_mask(text, 1, 1, 40, 40, block_m=16, block_n=16, mod_inputs=widths)
    assert shared.partial_counts.shape == (1, 1, 3)
    for name in LISTS:
        np.testing.assert_array_equal(getattr(shared, name)[0, 0], getattr(per_head, name)[1, 0])
    assert not np.array_equal(per_head.tile_states()[0, 0], per_head.tile_states()[0, 1])


@pytest.mark.emulate
def test_torch_cpu_inputs_give_torch_lists_and_like_picks_the_library():
    torch = pytest.importorskip("torch")
    docs = four_documents(1, 50, seed=6)
    text = "doc[b, q_idx] == doc[b, kv_idx]"
    built = block_mask(
        text, 1, 1, 50, 50, block_m=16, block_n=16, mod_inputs={"doc": torch.from_numpy(docs)}
    )
    reference = block_mask_reference(
        text, 1, 1, 50, 50, block_m=16, block_n=16, mod_inputs={"doc": docs}
    )
    assert isinstance(built.full_indices, torch.Tensor) and built.full_indices.dtype == torch.int32
    np.testing.assert_array_equal(built.tile_states(), reference.tile_states())
    like = block_mask("q_idx >= kv_idx", 1, 1, 20, 20, block_m=16, block_n=16, like=torch.zeros(1))
    assert isinstance(like.partial_counts, torch.Tensor)
    with pytest.raises(InputTypeError, match="like is object; pass a NumPy, CuPy or torch array"):
        block_mask("q_idx >= kv_idx", 1, 1, 50, 50, block_m=16, block_n=16, like=object())


def test_the_device_path_launches_the_builder_with_its_parameter_types(monkeypatch):
    """Through the CuPy fake (host memory behind its arrays): the device path's outputs,
    argument order and scalar types are the kernel's parameters, and its lists equal the NumPy
    builder's when the emulator runs the launch."""
    pytest.importorskip("kernelgen.emulator")
    from kernelgen.emulator.kernel import compiler_available
    from kernelgen.testing import fake_cupy

    require_toolchain(compiler_available(), "g++ (for the CUDA emulator)")
    cupy = fake_cupy.module(backed=True)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(block_mask_module, "_FUNCTIONS", {})
    launches = []

    def compile_functions(cupy_module, name, source, symbols):
        from kernelgen.emulator import build_kernel

        mask_mod = parse_mask_mod("doc[b, q_idx] == doc[b, kv_idx]", [DOCS])
        params = builder_params(mask_mod)
        assert source == builder_source(mask_mod, 16, 32) and symbols == [name]
        kernel = build_kernel(source, name, [(p.ctype, p.name) for p in params])
        casts = {"int": np.int32, "long long": np.int64}

        def launch(grid, block, args, shared_mem=0):
            assert len(args) == len(params)
            for param, arg in zip(params, args, strict=True):
                if param.ctype in casts:
                    assert type(arg) is casts[param.ctype], param.name
                else:
                    assert isinstance(arg, cupy.ndarray), param.name
            launches.append((grid, block))
            values = [a.host if isinstance(a, cupy.ndarray) else int(a) for a in args]
            kernel(grid=grid, block=block, shared_mem=shared_mem, args=values)

        return {name: launch}

    monkeypatch.setattr(block_mask_module, "compile_functions", compile_functions)
    docs = four_documents(2, 60, seed=7)
    built = block_mask(
        "doc[b, q_idx] == doc[b, kv_idx]", 2, 1, 60, 60, block_m=16, block_n=32,
        mod_inputs={"doc": fake_cupy.from_host(docs)},
    )  # fmt: skip
    reference = block_mask_reference(
        "doc[b, q_idx] == doc[b, kv_idx]", 2, 1, 60, 60, block_m=16, block_n=32,
        mod_inputs={"doc": docs},
    )  # fmt: skip
    assert launches == [((4, 1, 2), (128, 1, 1))]
    for name in LISTS:
        assert isinstance(getattr(built, name), cupy.ndarray)
        np.testing.assert_array_equal(getattr(built, name).host, getattr(reference, name))


# ---- errors ----


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"batch": 0}, InputError, "batch=0"),
        ({"seqlen_k": 2**31}, InputError, "seqlen_k=2147483648 is not allowed; use an integer"),
        ({"heads": True}, InputError, "heads=True"),
        ({"seqlen_q": 1.5}, InputError, "seqlen_q=1.5"),
        ({"block_m": 24}, InputError, "block_m=24 is not allowed; use one of 16, 32, 64, 128 (mma"),
        ({"block_n": 272}, InputError, "block_n=272 is not allowed; use one of"),
        ({"heads": 70000}, InputError, "over CUDA's limit"),
        ({"mask_mod": "q_idx - kv_idx"}, SpecError, "mask_mod must be boolean"),
        ({"mask_mod": "bias[q_idx] > 0"}, SpecError, "only declared inputs"),
        ({"mod_inputs": {"doc": np.zeros((1, 4))}}, InputTypeError, "dtype float64"),
        ({"mod_inputs": {"doc": np.zeros((1,) * 5, np.int32)}}, InputError, "1 to 4 dimensions"),
        ({"mod_inputs": {"__doc": np.zeros(4, np.int32)}}, InputError, "'__doc' is not allowed"),
        ({"mod_inputs": [np.zeros(4, np.int32)]}, InputTypeError, "dict of name -> array"),
        ({"mask_mod": parse_mask_mod("q_idx >= kv_idx", [DOCS])}, InputError, "checked against"),
        ({"mask_mod": parse_score_mod("score")}, InputError, "checked score_mod"),
    ],
)
def test_bad_arguments_are_typed_errors_naming_them(kwargs, error, named):
    arguments = {
        "mask_mod": "q_idx >= kv_idx",
        "batch": 1,
        "heads": 1,
        "seqlen_q": 8,
        "seqlen_k": 8,
    }
    arguments |= {"block_m": 16, "block_n": 16} | kwargs
    for build in (block_mask, block_mask_reference):
        with pytest.raises(error) as info:
            build(**arguments)
        assert named in str(info.value)


def test_a_mask_says_which_calls_it_fits():
    mask = block_mask_reference("q_idx >= kv_idx", 1, 4, 40, 50, block_m=16, block_n=32)
    mask.check_fits(8, 4, 40, 50, 16, 32)  # batch 1 broadcasts
    with pytest.raises(InputError) as info:
        mask.check_fits(8, 2, 40, 51, 16, 64)
    message = str(info.value)
    assert "heads 4 (the call has 2; 1 broadcasts)" in message
    assert "seqlen_k 50 (the call has 51)" in message
    assert "block_n 32 (the call has 64)" in message
    assert "batch" not in message.split("built for")[1] and "seqlen_q" not in message


def test_the_package_exports_the_block_mask_api():
    assert kernelgen.block_mask is block_mask
    assert kernelgen.BlockMask is BlockMask
    assert kernelgen.ModInput is ModInput
    assert kernelgen.parse_mask_mod is parse_mask_mod


@pytest.mark.compile
def test_the_builder_compiles_offline_without_spills():
    from kernelgen.kernels.compile import compile_offline, nvrtc_available

    require_toolchain(nvrtc_available(), "NVRTC (cuda-bindings, nvidia-cuda-nvrtc, headers)")
    inputs = [
        ModInput("rel", "bfloat16", 2),
        ModInput("gain", "float16", 1),
        ModInput("doc", "int64", 2),
        ModInput("keep", "bool", 2),
        ModInput("width", "int32", 1),
        ModInput("bias", "float32", 3),
    ]
    mask_mod = parse_mask_mod(
        "doc[b, q_idx] == doc[b, kv_idx] and keep[h, kv_idx] or rel[h, q_idx - kv_idx] * "
        "gain[h] > exp(bias[b, h, 0]) and abs(q_idx - kv_idx) // 3 % 2 <= width[h]",
        inputs,
    )
    for arch in ("sm_80", "sm_90"):
        compiled = compile_offline(
            builder_source(mask_mod, 64, 128), kernel_name(mask_mod, 64, 128), arch
        )
        assert compiled.resources.spill_store_bytes == compiled.resources.stack_bytes == 0


def test_a_templates_folder_without_the_builder_is_a_setting_error(tmp_path, monkeypatch):
    """KERNELGEN_TEMPLATE_DIR at an older copy of templates/ (no block_mask.cu.j2)."""
    from conftest import ROOT, templates_at

    from kernelgen.errors import SettingError
    from kernelgen.kernels.render import ENTRY_TEMPLATE

    for name in ENTRY_TEMPLATE.values():
        (tmp_path / name).write_text((ROOT / "templates" / name).read_text())
    with (
        templates_at(monkeypatch, tmp_path),
        pytest.raises(SettingError, match=r"has no block_mask\.cu\.j2"),
    ):
        builder_source(parse_mask_mod("q_idx >= kv_idx"), 16, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("library", ["cupy", "torch"])
def test_the_builder_on_a_gpu_equals_the_numpy_builder(library):
    """GPU tier: the same lists from CuPy arrays and CUDA torch tensors (torch's stream)."""
    docs = four_documents(3, 300, seed=8)
    if library == "cupy":
        cupy = pytest.importorskip("cupy")
        device_docs = cupy.asarray(docs)
    else:
        torch = pytest.importorskip("torch")
        device_docs = torch.from_numpy(docs).cuda()
    text = "doc[b, q_idx] == doc[b, kv_idx] and kv_idx <= q_idx"
    for bm, bn in ((64, 64), (128, 32)):
        built = block_mask(
            text, 3, 1, 300, 300, block_m=bm, block_n=bn, mod_inputs={"doc": device_docs}
        )
        reference = block_mask_reference(
            text, 3, 1, 300, 300, block_m=bm, block_n=bn, mod_inputs={"doc": docs}
        )
        assert type(built.full_counts).__module__.split(".")[0] == library
        for name in LISTS:
            np.testing.assert_array_equal(
                block_mask_module.to_host(getattr(built, name)), getattr(reference, name)
            )
