"""Emulation tier: the block-sparse backward (docs/backward.md, "Block sparsity").

A backward call with a ``mask_mod`` (or the forward's ``block_mask``) visits only the tiles the
mask leaves partly or fully visible: the main kernel per key tile its query tiles, the
deterministic dQ kernel per query tile its key tiles (kernelgen.calls.backward_mask). Checked here
on both engines, atomic and deterministic dQ, against the float64 gradients of
``kernelgen.references.attention.attention_backward``: documents not aligned to tiles, per-head
masks with GQA, a query row that sees no key, a forward block mask; the transposed builder against
the NumPy lists; the tiles the kernels copy counted in the emulator (sparse against dense, causal
and window bounds on top); mutations of the lists (a partly visible tile dropped, or called full)
that the gradients must catch."""

from __future__ import annotations

import numpy as np
import pytest

import kernelgen
from kernelgen.calls import backward as backward_api
from kernelgen.calls.backward_mask import TileLists, tile_lists, tile_lists_reference
from kernelgen.calls.block_mask import block_mask_reference
from kernelgen.errors import SpecError
from kernelgen.families import backward
from kernelgen.references.attention import OUT_TOLERANCE, attention_backward, relative_error
from kernelgen.references.expressions import evaluate
from kernelgen.specs.backward import BackwardSpec
from kernelgen.specs.expressions import inputs_from_arrays, parse_mask_mod

pytestmark = pytest.mark.emulate

DOC = "doc[b, q_idx] == doc[b, kv_idx]"
# Per-head lists: even heads see their document, odd heads only its causal part.
HEAD_DOC = "doc[b, q_idx] == doc[b, kv_idx] and (h % 2 == 0 or kv_idx <= q_idx)"
HOLE_ROW = 70  # a query that no key is visible to
HOLE_DOC = f"doc[b, q_idx] == doc[b, kv_idx] and q_idx != {HOLE_ROW}"
SEQLEN = 150
CUTS = ((37, 90, 121), (20, 64, 100))  # document starts per batch entry, not on tile edges

ENGINES = {  # tiles other than the forward's and than each other's
    "simt": {"mma": "simt", "block_m": 32, "block_n": 16, "num_warps": 4},
    "tc": {"mma": "mma_sync", "block_m": 64, "block_n": 32, "num_warps": 4, "stages": 2},
    "tc-split": {  # the split_roles layout (P warps and dS warps) walking the lists
        "mma": "mma_sync",
        "block_m": 64,
        "block_n": 64,
        "num_warps": 4,
        "stages": 2,
        "split_roles": True,
    },
}


def documents(batch: int = 2, seqlen: int = SEQLEN) -> dict[str, np.ndarray]:
    doc = np.zeros((batch, seqlen), np.int32)
    for b in range(batch):
        for cut in CUTS[b % len(CUTS)]:
            doc[b, cut:] += 1
    return {"doc": doc}


def spec_for(engine: str, mask_mod: str, inputs: dict, **fields) -> BackwardSpec:
    declared = tuple(i.signature for i in inputs_from_arrays(inputs))
    return BackwardSpec(
        family="backward", dtype="float16", head_dim=32, mask_mod=mask_mod, mod_inputs=declared,
        **{"block_sparse": True, **ENGINES[engine], **fields},
    )  # fmt: skip


def draw(shape: tuple[int, ...], seed: int) -> tuple[np.ndarray, ...]:
    """q, k, v, dout in float16 for (B, H, Hkv, Sq, Sk, D)."""
    batch, heads, kv_heads, seqlen_q, seqlen_k, dim = shape
    rng = np.random.default_rng(seed)
    sizes = [(batch, heads, seqlen_q, dim), (batch, kv_heads, seqlen_k, dim)]
    sizes += [sizes[1], sizes[0]]
    return tuple(rng.standard_normal(s).astype(np.float16) for s in sizes)


def reference(tensors, mask_mod: str, inputs: dict, **options):
    q, k, v, dout = (np.asarray(x, np.float64) for x in tensors)
    expression = parse_mask_mod(mask_mod, inputs_from_arrays(inputs))

    def hook(b, h, q_idx, kv_idx):
        return evaluate(expression, b=b, h=h, q_idx=q_idx, kv_idx=kv_idx, inputs=inputs)

    return attention_backward(dout, q, k, v, mask_mod=hook, **options)


def errors(grads, ref) -> dict[str, float]:
    found = {}
    for name, got in zip(("dq", "dk", "dv"), grads, strict=True):
        got = np.asarray(got, np.float64)
        assert np.isfinite(got).all(), name
        found[name] = relative_error(got, getattr(ref, name))
    return found


def forward(tensors, mask_mod, inputs, **options):
    q, k, v, _ = tensors
    return kernelgen.attention(q, k, v, mask_mod=mask_mod, mod_inputs=inputs, return_lse=True,
                               **options)  # fmt: skip


def backward_call(tensors, out, lse, mask_mod, inputs, **options):
    q, k, v, dout = tensors
    return kernelgen.attention_backward(dout, q, k, v, out, lse, mask_mod=mask_mod,
                                        mod_inputs=inputs, **options)  # fmt: skip


# ---- gradients ----------------------------------------------------------------------------------
MASKS = {  # mask_mod, forward/backward options
    "documents-causal": (DOC, {"causal": True}),
    "per-head-gqa": (HEAD_DOC, {}),
    "row-without-keys": (HOLE_DOC, {"causal": True}),
}


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("engine", ["simt", "tc"])
@pytest.mark.parametrize("case", MASKS)
def test_sparse_backward_matches_the_float64_gradients(case, engine, deterministic):
    mask_mod, options = MASKS[case]
    inputs = documents()
    tensors = draw((2, 4, 2, SEQLEN, SEQLEN, 32), seed=len(case))
    out, lse = forward(tensors, mask_mod, inputs, **options)
    if case == "row-without-keys":
        assert np.isneginf(lse[:, :, HOLE_ROW]).all()
    spec = spec_for(engine, mask_mod, inputs, causal=options.get("causal", False),
                    deterministic=deterministic)  # fmt: skip
    grads = backward_call(
        tensors, out, lse, mask_mod, inputs, spec=spec, deterministic=deterministic, **options
    )
    ref = reference(tensors, mask_mod, inputs, **options)
    found = errors(grads, ref)
    assert all(e <= OUT_TOLERANCE["float16"] for e in found.values()), found
    assert found["dq"] > 0
    if case == "row-without-keys":
        assert not np.asarray(grads[0])[:, :, HOLE_ROW].any()  # zero, not NaN


def test_the_default_backward_of_a_mask_mod_is_block_sparse():
    """Without a spec a mask_mod call takes the policy's default, block-sparse (bfloat16, the
    tensor-core engine, documents per batch entry)."""
    inputs = documents()
    tensors = tuple(x.astype(np.float32) for x in draw((2, 2, 1, SEQLEN, SEQLEN, 32), seed=5))
    import ml_dtypes

    tensors = tuple(x.astype(ml_dtypes.bfloat16) for x in tensors)
    out, lse = forward(tensors, DOC, inputs, causal=True)
    used = []
    original = backward_api._backward_masks

    def recorded(spec, call, q):
        used.append(spec)
        return original(spec, call, q)

    backward_api._backward_masks = recorded
    try:
        grads = backward_call(tensors, out, lse, DOC, inputs, causal=True)
    finally:
        backward_api._backward_masks = original
    assert len(used) == 1 and used[0].block_sparse and used[0].mma == "mma_sync"
    found = errors(grads, reference(tensors, DOC, inputs, causal=True))
    assert all(e <= OUT_TOLERANCE["bfloat16"] for e in found.values()), found


def test_a_forward_block_mask_serves_the_backward():
    """The forward's block mask (batch and heads broadcast, its own tiles): the deterministic
    dQ kernel reads its lists where the tiles agree (64 x 64 here), the main kernel's lists are
    derived once and cached on the mask."""
    inputs = {"doc": documents(1)["doc"]}
    tensors = draw((1, 4, 2, SEQLEN, SEQLEN, 32), seed=7)
    mask = kernelgen.block_mask(DOC, 1, 1, SEQLEN, SEQLEN, block_m=64, block_n=64,
                                mod_inputs=inputs)  # fmt: skip
    q, k, v, dout = tensors
    out, lse = kernelgen.attention(q, k, v, block_mask=mask, mod_inputs=inputs, return_lse=True)
    spec = spec_for("tc", DOC, inputs, deterministic=True)
    assert (spec.dq_block_m, spec.dq_block_n) == (64, 64)
    for _ in range(2):
        grads = kernelgen.attention_backward(
            dout, q, k, v, out, lse, block_mask=mask, mod_inputs=inputs, spec=spec,
            deterministic=True,
        )  # fmt: skip
    assert list(mask.derived) == [(True, 64, 32)]  # the transposed lists, built once
    found = errors(grads, reference(tensors, DOC, inputs))
    assert all(e <= OUT_TOLERANCE["float16"] for e in found.values()), found


# ---- the lists ----------------------------------------------------------------------------------
@pytest.mark.parametrize("transposed", [True, False])
def test_the_builder_lists_match_the_numpy_lists(transposed):
    inputs = documents()
    sizes = (2, 4, SEQLEN, 130)
    expression = parse_mask_mod(HEAD_DOC, inputs_from_arrays(inputs))
    built = tile_lists(expression, sizes, 32, 16, inputs, None, transposed=transposed)
    want = tile_lists_reference(HEAD_DOC, sizes, 32, 16, inputs, transposed=transposed)
    assert built.shape == ((2, 4, 9, 5) if transposed else (2, 4, 5, 9))
    for name in ("partial_counts", "partial_indices", "full_counts", "full_indices"):
        np.testing.assert_array_equal(getattr(built, name), getattr(want, name), err_msg=name)
    forward = block_mask_reference(HEAD_DOC, *sizes, block_m=32, block_n=16, mod_inputs=inputs)
    states = forward.tile_states()
    np.testing.assert_array_equal(
        built.tile_states(), states.swapaxes(2, 3) if transposed else states
    )
    assert all((states == state).any() for state in (0, 1, 2))  # hidden, partial and full


def test_block_sparse_is_refused_with_split_roles():
    """The split_roles loops walk every query tile: a spec asking for both is refused, naming
    the fields (the policy never pairs them: split_roles is its default without a mask_mod)."""
    with pytest.raises((SpecError, ValueError), match=r"split_roles=True .* block_sparse=True"):
        spec_for("tc", DOC, documents(), block_n=64, split_roles=True)


def test_block_sparse_needs_a_mask_mod():
    with pytest.raises((SpecError, ValueError), match="block_sparse=true needs a mask_mod"):
        BackwardSpec(family="backward", dtype="float16", head_dim=32, block_sparse=True)
    spec = spec_for("tc", DOC, documents())
    assert spec.uri.endswith("_bsparse") and "block_sparse: true" in spec.to_yaml()


# ---- tiles visited ----------------------------------------------------------------------------
def _band(seqlen_q: int, seqlen_k: int, causal: bool, window) -> np.ndarray:
    """(Sq, Sk) pairs causal and the window leave (bottom-right aligned)."""
    i = np.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q
    j = np.arange(seqlen_k)[None, :]
    band = np.ones((seqlen_q, seqlen_k), bool)
    if causal:
        band &= j <= i
    if window is not None:
        left, right = window
        band &= (j >= i - left) & (j <= i + right)
    return band


def _tiles_any(pairs: np.ndarray, block_m: int, block_n: int) -> np.ndarray:
    """(q tiles, key tiles): whether the tile holds a true pair."""
    rows = -(-pairs.shape[0] // block_m) * block_m
    cols = -(-pairs.shape[1] // block_n) * block_n
    padded = np.zeros((rows, cols), bool)
    padded[: pairs.shape[0], : pairs.shape[1]] = pairs
    return padded.reshape(rows // block_m, block_m, cols // block_n, block_n).any(axis=(1, 3))


def _launches(monkeypatch) -> list:
    recorded: list = []
    original = backward_api._BackwardKernels.launch

    def launch(self, problem, tensors, scale):
        stats = original(self, problem, tensors, scale)
        recorded.append(stats)
        return stats

    monkeypatch.setattr(backward_api._BackwardKernels, "launch", launch)
    return recorded


@pytest.mark.parametrize("bounds", ["causal", "window"])
def test_the_kernels_copy_exactly_the_listed_tiles(monkeypatch, bounds):
    """Q tiles the main kernel copies (per key tile, over every query head of its group) and K
    tiles the dQ kernel copies (per query tile), counted in the emulator: the dense kernel's
    counts are the tiles the causal/window band reaches, the sparse kernel's those that the
    mask_mod lists as well, far fewer."""
    causal, window = (True, None) if bounds == "causal" else (False, (40, 10))
    options = {"causal": causal} if causal else {"window_size": window}
    inputs = documents()
    batch, heads = 2, 4
    tensors = draw((batch, heads, 2, SEQLEN, SEQLEN, 32), seed=11)
    out, lse = forward(tensors, DOC, inputs, **options)
    band = _band(SEQLEN, SEQLEN, causal, window)
    counts = {}
    for sparse in (False, True):
        spec = spec_for("tc", DOC, inputs, causal=causal, window=window is not None,
                        deterministic=True, block_sparse=sparse)  # fmt: skip
        recorded = _launches(monkeypatch)
        grads = backward_call(
            tensors, out, lse, DOC, inputs, spec=spec, deterministic=True, **options
        )
        found = errors(grads, reference(tensors, DOC, inputs, **options))
        assert all(e <= OUT_TOLERANCE["float16"] for e in found.values()), found
        (stats,) = recorded
        chunks = spec.head_dim_padded // 8  # 16-byte copies per row
        main = stats[spec.uri].cp_async_copies_by_arg["q"] / (spec.block_m * chunks)
        dq = stats[f"{spec.uri}_dq"].cp_async_copies_by_arg["k"] / (spec.dq_block_n * chunks)
        counts[sparse] = (main, dq)
        expected = []
        for tiles, transposed in (((spec.block_m, spec.block_n), True),
                                  ((spec.dq_block_m, spec.dq_block_n), False)):  # fmt: skip
            reach = _tiles_any(band, *tiles)  # (q tiles, key tiles) the band reaches
            if sparse:
                lists = tile_lists_reference(DOC, (batch, 1, SEQLEN, SEQLEN), *tiles, inputs,
                                             transposed=transposed)  # fmt: skip
                states = lists.tile_states()[:, 0]
                states = states.swapaxes(1, 2) if transposed else states
                expected.append(heads * int(((states > 0) & reach).sum()))
            else:
                expected.append(batch * heads * int(reach.sum()))
        assert (main, dq) == tuple(expected)
    assert all(s < d for s, d in zip(counts[True], counts[False], strict=True)), counts


# ---- mutations of the lists ---------------------------------------------------------------------
def _mutated(lists: TileLists, how: str) -> TileLists:
    """``lists`` (host) with the first partly visible tile of the first row that has one dropped
    (``drop``) or listed as fully visible (``full``)."""
    arrays = {n: np.array(getattr(lists, n)) for n in
              ("partial_counts", "partial_indices", "full_counts", "full_indices")}  # fmt: skip
    row = tuple(np.argwhere(arrays["partial_counts"] > 0)[0])
    count = int(arrays["partial_counts"][row])
    tile = int(arrays["partial_indices"][row][0])
    arrays["partial_indices"][row][: count - 1] = arrays["partial_indices"][row][1:count]
    arrays["partial_indices"][row][count - 1] = -1
    arrays["partial_counts"][row] -= 1
    if how == "full":
        full_count = int(arrays["full_counts"][row])
        listed = sorted([*arrays["full_indices"][row][:full_count].tolist(), tile])
        arrays["full_indices"][row][: full_count + 1] = listed
        arrays["full_counts"][row] += 1
    return TileLists(**arrays)


@pytest.mark.parametrize(
    "engine, deterministic, kernel, how",
    [
        ("tc", False, "main", "drop"),
        ("tc", False, "main", "full"),
        ("tc", True, "dq", "drop"),
        ("tc", True, "dq", "full"),
        ("simt", False, "main", "drop"),
        ("simt", True, "main", "full"),
        ("simt", True, "dq", "full"),
    ],
)
def test_mutated_lists_are_caught(monkeypatch, engine, deterministic, kernel, how):
    """A partly visible tile left out of a kernel's lists loses its gradient; one called fully
    visible skips the mask_mod and lets hidden keys through: the gradients must notice."""
    inputs = documents(1)
    tensors = draw((1, 2, 1, SEQLEN, SEQLEN, 32), seed=13)
    out, lse = forward(tensors, DOC, inputs)
    spec = spec_for(engine, DOC, inputs, deterministic=deterministic)
    ref = reference(tensors, DOC, inputs)
    original = backward_api.backward_masks

    def masks(*args):
        found = original(*args)
        if kernel == "main":
            return type(found)(_mutated(found.queries, how), found.keys)
        return type(found)(found.queries, _mutated(found.keys, how))

    grads = backward_call(tensors, out, lse, DOC, inputs, spec=spec, deterministic=deterministic)
    good = errors(grads, ref)
    assert all(e <= OUT_TOLERANCE["float16"] for e in good.values()), good
    monkeypatch.setattr(backward_api, "backward_masks", masks)
    grads = backward_call(tensors, out, lse, DOC, inputs, spec=spec, deterministic=deterministic)
    bad = errors(grads, ref)
    assert max(bad.values()) > 10 * OUT_TOLERANCE["float16"], bad


SPARSE_MUTATIONS = {  # name: (engine, original, mutated)
    # every query head of a GQA group walks the first head's lists (per-head masks)
    "lists-of-one-head-simt": ("simt", "row_b + h * stride_h", "row_b"),
    "lists-of-one-head-tc": ("tc", "row_b + h * stride_h", "row_b"),
    # the walker stops before the group's last query head
    "walker-drops-last-head": ("tc", "head + 1 < head_end) {", "head + 2 < head_end) {"),
}


@pytest.mark.parametrize("name", SPARSE_MUTATIONS)
def test_sparse_template_mutations_are_caught(name, monkeypatch):
    engine, original, mutated = SPARSE_MUTATIONS[name]
    inputs = documents(1)
    tensors = draw((1, 4, 2, SEQLEN, SEQLEN, 32), seed=17)
    out, lse = forward(tensors, HEAD_DOC, inputs)
    spec = spec_for(engine, HEAD_DOC, inputs)
    render = backward.render
    assert original in render(spec), name  # the mutation applies to the kernel under test
    monkeypatch.setattr(backward, "render", lambda s: render(s).replace(original, mutated))
    monkeypatch.setattr(backward_api, "_KERNELS", {})  # built from the mutated source
    grads = backward_call(tensors, out, lse, HEAD_DOC, inputs, spec=spec)
    bad = errors(grads, reference(tensors, HEAD_DOC, inputs))
    assert max(bad.values()) > 10 * OUT_TOLERANCE["float16"], bad


def test_a_kernel_without_the_range_cut_copies_more_tiles(monkeypatch):
    """The lists are cut to the query tiles causal leaves (tile_run): without the cut the main
    kernel copies the listed tiles above the diagonal too (its gradients stay right: those tiles
    take the exact path), which the count catches."""
    inputs = documents(1)
    tensors = draw((1, 2, 1, SEQLEN, SEQLEN, 32), seed=19)
    out, lse = forward(tensors, DOC, inputs, causal=True)
    spec = spec_for("tc", DOC, inputs, causal=True)
    render = backward.render
    cut = "while (first < count && list[first] < begin) ++first;"
    assert cut in render(spec)
    copied = {}
    for source in (render, lambda s: render(s).replace(cut, "")):
        monkeypatch.setattr(backward, "render", source)
        monkeypatch.setattr(backward_api, "_KERNELS", {})
        recorded = _launches(monkeypatch)
        backward_call(tensors, out, lse, DOC, inputs, spec=spec, causal=True)
        copied[source is render] = recorded[0][spec.uri].cp_async_copies_by_arg["q"]
    assert copied[False] > copied[True]
