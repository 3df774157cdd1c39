"""Serving inputs built elsewhere are checked before anything reads or writes them: block masks
(their lists' library, dtype, shapes and values), paged-cache appends (no write into a row any
entry reads, no page twice in a row) and the caches an append writes (no stride 0, no memory
shared with the other cache or with k_new/v_new). Every refused call leaves the caches
byte-identical. NumPy arrays and CPU torch tensors through the CPU backend, CuPy through its
fake."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from attention_cases import kvcache_data, kvcache_reference
from conftest import CPU_BACKEND_MARKS

import kernelgen
from kernelgen.calls.block_mask import BlockMask, block_mask_reference
from kernelgen.calls.kvcache_checks import PagedLayout, validate_on_device
from kernelgen.errors import InputError, InputTypeError

CAUSAL = "q_idx >= kv_idx"
_LISTS = ("partial_counts", "partial_indices", "full_counts", "full_indices")


def cpu_backend(test):
    """The CPU backend's marks (the emulator's compiler; nothing may reach a GPU or the tuner)
    on one test: the CuPy-fake test below runs without them."""
    for mark in CPU_BACKEND_MARKS:
        test = mark(test)
    return test


# ---- block masks ----


def _qkv(seqlen=40):
    rng = np.random.default_rng(0)
    return [rng.standard_normal((1, 2, seqlen, 32)).astype(np.float16) for _ in range(3)]


def _causal_mask() -> BlockMask:
    """40 x 40 causal in 32 x 16 tiles: query tile 0 lists key tiles 0, 1 as partial; query
    tile 1 lists tiles 0, 1 as full and 2 as partial."""
    mask = block_mask_reference(CAUSAL, 1, 1, 40, 40, block_m=32, block_n=16)
    assert mask.partial_counts.tolist() == [[[2, 1]]] and mask.full_counts.tolist() == [[[0, 2]]]
    return mask


def _tampered(mask: BlockMask, name: str, at: tuple[int, ...], value: int) -> BlockMask:
    array = getattr(mask, name).copy()
    array[at] = value
    return dataclasses.replace(mask, **{name: array})


TAMPERED = [
    pytest.param(
        "partial_counts", (0, 0, 1), 50,
        r"block_mask.partial_counts\[0, 0, 1\] is 50; allowed 0 to 3 \(the key tiles of "
        r"seqlen_k=40 in tiles of 16 keys\)",
        id="count-past-the-key-tiles",
    ),
    pytest.param(
        "full_counts", (0, 0, 0), -1, r"block_mask.full_counts\[0, 0, 0\] is -1; allowed 0 to 3",
        id="negative-count",
    ),
    pytest.param(
        "partial_indices", (0, 0, 0, 1), 5,
        r"block_mask.partial_indices\[0, 0, 0, 1\] is 5; the first 2 entries of that row "
        r"\(block_mask.partial_counts\[0, 0, 0\]\) must be key tiles from 0 to 2",
        id="index-past-the-key-tiles",
    ),
    pytest.param(
        "full_indices", (0, 0, 1, 0), -2,
        r"block_mask.full_indices\[0, 0, 1, 0\] is -2; the first 2 entries",
        id="negative-index",
    ),
    pytest.param(
        "partial_indices", (0, 0, 0, 1), 0,
        r"block_mask.partial_indices\[0, 0, 0, 1\] is 0 after 0; the first 2 entries of that "
        r"row \(block_mask.partial_counts\[0, 0, 0\]\) must be strictly ascending key tiles",
        id="repeated-tile",
    ),
    pytest.param(
        "full_indices", (0, 0, 1, 0), 2,
        r"block_mask.full_indices\[0, 0, 1, 1\] is 1 after 2; .* strictly ascending",
        id="descending",
    ),
    pytest.param(
        "partial_indices", (0, 0, 1, 0), 1,
        r"block_mask lists key tile 1 in both block_mask.partial_indices\[0, 0, 1\] and "
        r"block_mask.full_indices\[0, 0, 1\]; a tile is partly or fully visible, not both",
        id="partial-and-full",
    ),
]  # fmt: skip


@cpu_backend
@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize(("name", "at", "value", "match"), TAMPERED)
def test_tampered_block_mask_values_are_refused(library, name, at, value, match):
    """A host mask's values are checked on every call, by its own library (torch: the code
    that checks CUDA tensors with validate=True), before anything is compiled or launched."""
    q, k, v = _qkv()
    mask = _tampered(_causal_mask(), name, at, value)
    if library == "torch":
        torch = pytest.importorskip("torch")
        q, k, v = (torch.from_numpy(x) for x in (q, k, v))
        lists = {n: torch.from_numpy(getattr(mask, n)) for n in _LISTS}
        mask = dataclasses.replace(mask, **lists)
    with pytest.raises(InputError, match=match):
        kernelgen.attention(q, k, v, block_mask=mask)


def _reference(q, k, v, mask_mod):
    """float64 attention of (B, H, S, D) inputs with a boolean (Sq, Sk) visibility."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    scores = np.where(mask_mod, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


@cpu_backend
def test_a_valid_mask_runs_and_entries_past_the_counts_are_free():
    """The checks refuse only what the kernel relies on: entries past a row's count may hold
    anything (here 99), and the output is causal attention's."""
    q, k, v = _qkv()
    mask = _causal_mask()
    padded = dataclasses.replace(
        mask,
        partial_indices=np.where(mask.partial_indices < 0, 99, mask.partial_indices),
        full_indices=np.where(mask.full_indices < 0, 99, mask.full_indices).astype(np.int32),
    )
    padded = dataclasses.replace(padded, partial_indices=padded.partial_indices.astype(np.int32))
    out = kernelgen.attention(q, k, v, block_mask=padded)
    visible = np.arange(40)[:, None] >= np.arange(40)[None, :]
    error = np.abs(out.astype(np.float64) - _reference(q, k, v, visible)).max()
    assert error < 2e-3


def _list_changes():
    mask = _causal_mask()
    return [
        pytest.param(
            {"partial_indices": mask.partial_indices.astype(np.int64)},
            InputTypeError,
            "block_mask.partial_indices has dtype int64; expected int32",
            id="int64-indices",
        ),
        pytest.param(
            {"full_indices": np.full((1, 1, 2, 4), -1, np.int32)},
            InputError,
            r"block_mask.full_indices has shape \(1, 1, 2, 4\); expected \(1, 1, 2, 3\) \(\(batch, "
            r"heads, query tiles, key tiles\): seqlen_q=40, seqlen_k=40 in 32 x 16 tiles\)",
            id="indices-shape",
        ),
        pytest.param(
            {"full_counts": np.zeros((1, 2), np.int32)},
            InputError,
            r"block_mask.full_counts has shape \(1, 2\); expected \(1, 1, 2\)",
            id="counts-shape",
        ),
        pytest.param(
            {"partial_counts": np.zeros(2, np.int32)},
            InputError,
            r"block_mask.partial_counts has shape \(2,\); expected \(batch, heads, query tiles\)",
            id="counts-rank",
        ),
        pytest.param(
            {"partial_indices": np.zeros((1, 1, 3, 2), np.int32).transpose(0, 1, 3, 2)},
            InputError,
            r"block_mask.partial_indices has strides \(6, 6, 1, 2\) \(elements\); expected a "
            r"C-contiguous array, strides \(6, 6, 3, 1\)",
            id="not-contiguous",
        ),
        pytest.param(
            {"full_counts": [[[0, 2]]]},
            InputTypeError,
            "block_mask.full_counts has type list; expected an int32 array",
            id="list",
        ),
        pytest.param(
            {"block_n": 16.0},
            InputError,
            r"block_mask.block_n is 16.0; expected an integer",
            id="float-tile",
        ),
        pytest.param(
            {"mask_mod": CAUSAL},
            InputTypeError,
            "block_mask.mask_mod has type str; expected a checked mask_mod",
            id="text-mask-mod",
        ),
    ]


@cpu_backend
@pytest.mark.parametrize(("changes", "error", "match"), _list_changes())
def test_block_mask_lists_are_checked_on_metadata(changes, error, match):
    q, k, v = _qkv()
    mask = dataclasses.replace(_causal_mask(), **changes)
    with pytest.raises(error, match=match):
        kernelgen.attention(q, k, v, block_mask=mask)


@cpu_backend
def test_block_masks_and_mod_inputs_must_be_of_qs_library():
    """NumPy q with CPU torch lists or mod inputs (or the reverse) is refused, as the docs say;
    block_mask() builds in like's library, every input of it too."""
    torch = pytest.importorskip("torch")
    q, k, v = _qkv()
    mask = _causal_mask()
    torch_mask = dataclasses.replace(
        mask, **{n: torch.from_numpy(getattr(mask, n)) for n in _LISTS}
    )
    doc = np.zeros((1, 40), np.int32)
    doc_mask = "doc[b, q_idx] == doc[b, kv_idx]"
    calls = [
        (
            lambda: kernelgen.attention(q, k, v, block_mask=torch_mask),
            "block_mask.partial_counts is a torch tensor but q is a NumPy array; build the "
            "block mask in q's library",
        ),
        (
            lambda: kernelgen.attention(*(torch.from_numpy(x) for x in (q, k, v)), block_mask=mask),
            "block_mask.partial_counts is a NumPy array but q is a torch tensor",
        ),
        (
            lambda: kernelgen.attention(
                q, k, v, mask_mod=doc_mask, mod_inputs={"doc": torch.from_numpy(doc)}
            ),
            "mod_inputs['doc'] is a torch tensor but q is a NumPy array; pass mod inputs of q's "
            "library",
        ),
        (
            lambda: kernelgen.block_mask(
                doc_mask,
                1,
                1,
                40,
                40,
                block_m=32,
                block_n=16,
                mod_inputs={"doc": torch.from_numpy(doc)},
                like=q,
            ),
            "like is a NumPy array but mod_inputs['doc'] is a torch tensor; every array of the "
            "call must be of one library",
        ),
    ]
    for call, message in calls:
        with pytest.raises(InputTypeError, match=re.escape(message)):
            call()


def test_device_masks_are_checked_on_metadata_and_read_only_with_validate(
    fake_runtime, monkeypatch
):
    """CuPy (its fake): int64 lists, which a kernel would read as int32 pairs, are refused
    before any launch; the values of device lists are read only with validate=True."""
    import cupy

    q, k, v = (cupy.asarray(x) for x in _qkv())
    mask = _causal_mask()
    device = {n: cupy.asarray(getattr(mask, n)) for n in _LISTS}
    wide = dataclasses.replace(
        mask, **{**device, "full_indices": cupy.empty((1, 1, 2, 3), np.int64)}
    )
    with pytest.raises(InputTypeError, match=r"block_mask\.full_indices has dtype int64"):
        kernelgen.attention(q, k, v, block_mask=wide)
    read = []
    monkeypatch.setattr(BlockMask, "check_values", lambda self: read.append(self))
    device_mask = dataclasses.replace(mask, **device)
    kernelgen.attention(q, k, v, block_mask=device_mask)
    assert read == []
    kernelgen.attention(q, k, v, block_mask=device_mask, validate=True)
    assert read == [device_mask]


# ---- paged appends ----


def _paged(table, lengths, new_len=1, num_pages=4, seed=3):
    """Pools of num_pages 16-key pages (random), q and new rows for len(lengths) entries."""
    rng = np.random.default_rng(seed)
    batch = len(lengths)
    k_pool, v_pool = (
        rng.standard_normal((num_pages, 16, 1, 32)).astype(np.float16) for _ in range(2)
    )
    q = rng.standard_normal((batch, new_len, 2, 32)).astype(np.float16)
    k_new, v_new = (
        rng.standard_normal((batch, new_len, 1, 32)).astype(np.float16) for _ in range(2)
    )
    arguments = {"q": q, "k_cache": k_pool, "v_cache": v_pool, "cache_seqlens": list(lengths)}
    return arguments | {"block_table": np.array(table, np.int32), "k_new": k_new, "v_new": v_new}


def _refused(error, match, arguments, memory=()):
    """The call raises ``error`` and leaves the caches' memory byte-identical (``memory``: the
    contiguous arrays under strided or expanded caches; default the caches)."""
    memory = memory or [arguments[n] for n in ("k_cache", "v_cache")]
    before = [_bytes(m) for m in memory]
    with pytest.raises(error, match=match):
        kernelgen.attention_with_kvcache(**arguments)
    assert [_bytes(m) for m in memory] == before


def _bytes(array) -> bytes:
    if type(array).__module__.startswith("torch"):
        array = array.numpy()
    assert array.flags.c_contiguous
    return array.tobytes()


PAGED_REFUSALS = [
    pytest.param(
        [[0, 1], [0, 2]], [10, 20], 1,
        r"block_table: entry b=0 would write key 10 of k_new/v_new into page 0, row 10, which "
        r"holds key 10 of entry b=1 \(cache_seqlens\[1\] = 20\); appends go to rows no entry reads",
        id="into-another-entrys-keys",
    ),
    pytest.param(
        [[3, 1], [3, 2]], [16, 14], 3,
        r"entry b=1 would write key 14 of k_new/v_new into page 3, row 14, which holds key 14 "
        r"of entry b=0 \(cache_seqlens\[0\] = 16\)",
        id="shared-full-page",
    ),
    pytest.param(
        [[0, 0]], [16], 1,
        r"block_table\[0, 1\] is 0, as is block_table\[0, 0\]; entry b=0 reads 17 keys, so its "
        r"first 2 entries must be distinct pages",
        id="own-page-twice",
    ),
    pytest.param(
        [[2, 1, 2]], [20], 16,
        r"block_table\[0, 2\] is 2, as is block_table\[0, 0\]; entry b=0 reads 36 keys",
        id="page-twice-in-the-new-rows",
    ),
]  # fmt: skip


@cpu_backend
@pytest.mark.parametrize(("table", "lengths", "new_len", "match"), PAGED_REFUSALS)
def test_appends_into_rows_that_are_read_are_refused(table, lengths, new_len, match):
    _refused(InputError, match, _paged(table, lengths, new_len))


@cpu_backend
def test_a_page_twice_in_a_row_is_refused_without_appending():
    arguments = _paged([[1, 1], [0, 2]], [32, 3])
    del arguments["k_new"], arguments["v_new"]
    arguments["q"] = arguments["q"][:, :1]
    _refused(InputError, r"block_table\[0, 1\] is 1, as is block_table\[0, 0\]", arguments)


@cpu_backend
@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_validate_refuses_a_page_twice_with_the_arrays_library(library):
    """validate=True's device check, run here by NumPy and by torch on CPU tensors: a repeated
    page among the entries a sequence uses is refused; unused entries may repeat."""
    if library == "torch":
        torch = pytest.importorskip("torch")
        convert = torch.from_numpy
    else:
        convert = np.asarray
    layout = PagedLayout(4, 16, 3, None, np.zeros((2, 3), np.int32), 3)
    table = convert(np.array([[1, 3, 1], [2, 2, 0]], np.int32))
    validate_on_device(convert(np.array([32, 16], np.int32)), 0, 48, layout, table)
    with pytest.raises(InputError, match=r"block_table\[0, 2\] is 1, as is block_table\[0, 0\]"):
        validate_on_device(convert(np.array([33, 16], np.int32)), 0, 48, layout, table)
    with pytest.raises(InputError, match=r"block_table\[1, 1\] is 2, as is block_table\[1, 0\]"):
        validate_on_device(convert(np.array([0, 16], np.int32)), 1, 48, layout, table)


@cpu_backend
def test_appending_into_a_page_after_a_shared_prefix_is_correct():
    """Entries 0 and 1 share page 0 (16 keys each); each appends into its own second page,
    whose rows past its keys no entry reads: accepted, written there, and attention over the
    concatenation."""
    arguments = _paged([[0, 1], [0, 2]], [16, 16], new_len=2)
    k_pool, v_pool = (arguments[n].copy() for n in ("k_cache", "v_cache"))
    out = kernelgen.attention_with_kvcache(**arguments, causal=True)
    for pool, new, before in (
        (arguments["k_cache"], arguments["k_new"], k_pool),
        (arguments["v_cache"], arguments["v_new"], v_pool),
    ):
        before[1, :2], before[2, :2] = new[0, :, :], new[1, :, :]
        assert np.array_equal(pool, before)
    logical = [np.stack([pool[0], pool[0]]) for pool in (k_pool, v_pool)]  # the shared page
    reference, _ = kvcache_reference(
        arguments["q"], *logical, arguments["k_new"], arguments["v_new"], [16, 16], True
    )
    assert np.abs(out.astype(np.float64) - reference).max() < 2e-3


# ---- caches an append writes ----


def _contiguous(lengths=(3, 5), new_len=1, seed=4):
    data = kvcache_data(len(lengths), new_len, new_len, 16, 2, 1, "float16", seed)
    q, k_cache, v_cache, k_new, v_new = (x.astype(np.float16) for x in data)
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": list(lengths)} | {
        "k_new": k_new,
        "v_new": v_new,
    }


@cpu_backend
def test_an_expanded_torch_cache_is_refused_before_any_write():
    """v_cache made with .expand() (stride 0 along the batch): refused, k_cache untouched."""
    torch = pytest.importorskip("torch")
    arguments = {n: torch.from_numpy(x) for n, x in _contiguous().items() if n != "cache_seqlens"}
    v_memory = arguments["v_cache"]
    arguments["v_cache"] = v_memory[:1].expand(2, -1, -1, -1)
    arguments["cache_seqlens"] = [3, 5]
    _refused(
        InputError,
        r"v_cache has shape \(2, 16, 1, 32\) and strides \(0, 32, 32, 1\): stride 0 along "
        r"dimension 0 \(size 2\) repeats its elements; the call writes k_new/v_new into it in "
        "place",
        arguments,
        [arguments["k_cache"], v_memory],
    )


@cpu_backend
@pytest.mark.parametrize("lengths", [(3, 3), (3, 5)])
def test_a_numpy_cache_with_stride_zero_is_refused(lengths):
    arguments = _contiguous(lengths)
    k_memory = arguments["k_cache"]
    arguments["k_cache"] = np.lib.stride_tricks.as_strided(
        k_memory, (2, 16, 1, 32), (0, *k_memory.strides[1:])
    )
    match = r"k_cache has shape .* stride 0 along dimension 0"
    _refused(InputError, match, arguments, [k_memory, arguments["v_cache"]])


@cpu_backend
def test_strides_that_overlap_are_refused():
    """Strides that do not nest (row stride 16 over 32-element rows): elements overlap."""
    arguments = _contiguous()
    v_memory = np.zeros(2 * 16 * 32, np.float16)
    arguments["v_cache"] = np.lib.stride_tricks.as_strided(
        v_memory, (2, 16, 1, 32), (16 * 32 * 2, 16 * 2, 32 * 2, 2)
    )
    match = r"v_cache has shape .* stride 16 along dimension 1 lands inside"
    _refused(InputError, match, arguments, [arguments["k_cache"], v_memory])


def _shared(arguments, name):
    """``arguments`` with the array called ``name`` replaced by memory of another."""
    if name == "same-cache":
        return arguments | {"v_cache": arguments["k_cache"]}
    if name == "k_new-in-k_cache":
        return arguments | {"k_new": arguments["k_cache"][:, 8:9]}
    if name == "v_new-in-k_cache":
        return arguments | {"v_new": arguments["k_cache"][:, 10:11]}
    return arguments | {"k_new": arguments["v_cache"][:, 12:13]}  # k_new in v_cache


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("same-cache", "k_cache shares memory with v_cache"),
        ("k_new-in-k_cache", "k_new shares memory with k_cache"),
        ("v_new-in-k_cache", "v_new shares memory with k_cache"),
        ("k_new-in-v_cache", "k_new shares memory with v_cache"),
    ],
)
@cpu_backend
def test_caches_sharing_memory_are_refused(name, match):
    _refused(InputError, match + "; the call writes k_new/v_new", _shared(_contiguous(), name))


@cpu_backend
def test_paged_pools_sharing_memory_are_refused():
    arguments = _paged([[0, 1], [2, 3]], [3, 5])
    arguments["v_cache"] = arguments["k_cache"]
    _refused(InputError, "k_cache shares memory with v_cache", arguments)


@cpu_backend
def test_k_and_v_interleaved_in_one_buffer_are_accepted():
    """k_cache and v_cache as the two halves of one (B, S, 2, Hkv, D) buffer share no element:
    the exact overlap test lets them through, and the append and attention are correct."""
    arguments = _contiguous((3, 5))
    kv = np.stack([arguments["k_cache"], arguments["v_cache"]], axis=2)  # (B, S, 2, Hkv, D)
    k_before, v_before = kv[:, :, 0].copy(), kv[:, :, 1].copy()
    out = kernelgen.attention_with_kvcache(
        **arguments | {"k_cache": kv[:, :, 0], "v_cache": kv[:, :, 1]}
    )
    reference, _ = kvcache_reference(
        arguments["q"], k_before, v_before, arguments["k_new"], arguments["v_new"], [3, 5], False
    )
    assert np.abs(out.astype(np.float64) - reference).max() < 2e-3
    for b, length in enumerate((3, 5)):
        assert np.array_equal(kv[b, length, 0], arguments["k_new"][b, 0])
        assert np.array_equal(kv[b, length, 1], arguments["v_new"][b, 0])
