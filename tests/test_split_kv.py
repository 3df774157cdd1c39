"""Split-KV decode kernels (pack_gqa, split_kv, seqlens_k) on the CPU emulator vs float64.

The combined output must match naive attention whatever the split count (1 chunk, some chunks,
more chunks than key tiles); each chunk's partial must match the NumPy model of that chunk, and
chunks that see no key must be exactly the identity (out 0, lse -inf).
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest
from attention_cases import LSE_TOLERANCE, OUT_TOLERANCE, Case, assert_matches, make_case
from test_emulated_kernels import run_emulated

from kernelgen.references.attention import naive_attention, relative_error, split_kv_partials
from kernelgen.runtime.launch import MAX_SPLITS
from kernelgen.specs.forward import KernelSpec

pytestmark = pytest.mark.emulate


def tc_spec(dtype: str, head_dim: int, warps: int, block_n: int, **fields) -> KernelSpec:
    return KernelSpec(
        loop_order="v2",
        mma="mma_sync",
        dtype=dtype,
        head_dim=head_dim,
        block_m=16 * warps,
        block_n=block_n,
        num_warps=warps,
        **fields,
    )


DECODE = tc_spec("float16", 64, 1, 32, smem_layout="swizzled", pack_gqa=True, split_kv=True)
DECODE_CAUSAL = tc_spec("bfloat16", 40, 2, 16, stages=3, causal=True, pack_gqa=True, split_kv=True)
SPLIT_ONLY = tc_spec("float16", 64, 4, 32, smem_layout="swizzled", causal=True, split_kv=True)
PACK_ONLY = tc_spec("bfloat16", 64, 1, 64, smem_layout="swizzled", pack_gqa=True)
# CUDA cores (every dtype, fp32 included): split-KV without packing
SIMT_SPLIT = KernelSpec(
    loop_order="v2", dtype="float32", head_dim=40, block_m=16, block_n=32, num_warps=4,
    split_kv=True,
)  # fmt: skip
SIMT_SPLIT_CAUSAL = KernelSpec(
    loop_order="v2", dtype="bfloat16", head_dim=64, block_m=32, block_n=16, num_warps=4,
    causal=True, split_kv=True,
)  # fmt: skip
SPECS = [DECODE, DECODE_CAUSAL, SPLIT_ONLY, PACK_ONLY, SIMT_SPLIT, SIMT_SPLIT_CAUSAL]

RUNS = [  # (case, split counts)
    (Case(2, 8, 2, 1, 150), (1, 3, 12)),  # decode, GQA 4: more chunks than key tiles at 12
    (Case(1, 4, 1, 5, 77, mask="full"), (2,)),  # MQA, a few queries per head
    (Case(2, 6, 3, 16, 129, layout="bshd", mask="broadcast"), (4,)),  # rows span 2 tiles
    (Case(1, 2, 1, 1, 4096), (MAX_SPLITS,)),  # 128+ key tiles: every chunk in both combine rounds
]


def _data(spec: KernelSpec, case: Case, tag: str = ""):
    seed = zlib.crc32(f"{spec.uri} {case} {tag}".encode())
    return make_case(case, spec.dtype, spec.head_dim, spec.causal, seed)


def _splits(spec: KernelSpec, wanted: tuple[int, ...]) -> tuple[int, ...]:
    return wanted if spec.split_kv else (1,)


@pytest.mark.parametrize(("case", "splits"), RUNS, ids=[str(c) for c, _ in RUNS])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.uri)
def test_combined_output_matches_float64(spec, case, splits):
    data = _data(spec, case)
    for num_splits in _splits(spec, splits):
        out, lse = run_emulated(spec, case, data, num_splits=num_splits)
        assert_matches(out, lse, data, spec.dtype)


@pytest.mark.parametrize("mask", [None, "full"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.uri)
def test_seqlens_k_with_zeros_and_ones(spec, mask):
    """Per-sequence key lengths, alone and under an additive mask (a key past its sequence's
    length is hidden whatever the mask says)."""
    case = Case(4, 4, 2, 2, 96, mask=mask)
    lengths = np.array([0, 1, 96, 45], dtype=np.int32)
    data = _data(spec, case, "seqlens")
    ref_out, ref_lse = naive_attention(
        data.q, data.k, data.v, causal=spec.causal, mask=data.mask, seqlens_k=lengths
    )
    data = dataclasses.replace(data, ref_out=ref_out, ref_lse=ref_lse)
    for num_splits in _splits(spec, (1, 3)):
        out, lse = run_emulated(spec, case, data, num_splits=num_splits, seqlens_k=lengths)
        assert_matches(out, lse, data, spec.dtype)
        assert np.isneginf(lse[0]).all() and np.all(out[0] == 0.0)


@pytest.mark.parametrize(
    "spec", [DECODE, DECODE_CAUSAL, SIMT_SPLIT, SIMT_SPLIT_CAUSAL], ids=lambda s: s.uri
)
def test_each_partial_is_its_chunk_and_empty_chunks_are_the_identity(spec):
    case, num_splits = Case(1, 4, 2, 3, 70, mask="broadcast"), 6  # 6 chunks, some empty
    data = _data(spec, case, "partials")
    arrays: dict = {}
    run_emulated(spec, case, data, num_splits=num_splits, keep=arrays)
    partials = split_kv_partials(
        data.q,
        data.k,
        data.v,
        num_splits=num_splits,
        block_n=spec.block_n,
        causal=spec.causal,
        scale=case.scale,
        mask=data.mask,
    )
    shape = (num_splits, *data.q.shape)
    o_partial = arrays["o_partial"].reshape(shape)
    lse_partial = arrays["lse_partial"].reshape(shape[:-1])
    assert not np.isnan(o_partial).any() and not np.isnan(lse_partial).any()
    empty_chunks = 0
    for split, (ref_out, ref_lse) in enumerate(partials):
        empty = np.isneginf(ref_lse)
        empty_chunks += int(empty.all())
        assert np.array_equal(np.isneginf(lse_partial[split]), empty), f"chunk {split}"
        assert np.all(o_partial[split][empty] == 0.0), f"chunk {split}: identity out is 0"
        if (~empty).any():
            error = relative_error(o_partial[split], ref_out)
            assert error <= OUT_TOLERANCE[spec.dtype], f"chunk {split}: {error:.3g}"
            lse_error = np.abs(lse_partial[split][~empty] - ref_lse[~empty]).max()
            assert lse_error <= LSE_TOLERANCE, f"chunk {split}: lse error {lse_error:.3g}"
    assert empty_chunks > 0, "the case should hold empty chunks"
