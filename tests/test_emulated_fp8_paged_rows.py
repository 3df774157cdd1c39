"""fp8 decode on paged caches whose pages are no multiple of block_n (docs/hopper.md, "fp8
decode"): the producer's 128 threads copy K rows and the staged V rows (K's layout) with
cp.async, one row per page lookup, and warps 1-3 transpose the staged V into V^T as on the TMA
path. Against the float64 reference of the quantized inputs (kernelgen.references.fp8), and
bit for bit against the TMA path (pages of a multiple of block_n) on the same data.

Cases: 128-key tiles on pages of 16 and 48 keys (tiles straddling pages), GQA 4 packed,
split-KV in 3 chunks, shuffled pages with NaN in the spare pages and past the lengths
(169 and 258: past a page, off the tiles); the default decode spec (64-key tiles) at d64 on
16-key pages (64-byte rows: a thread's rows 32 keys apart, two pages on), MQA with a group of 3
(not packed), 2 new tokens appended; the d128 default (3 stages, 64-key tiles) on 16-key pages
in one chunk of up to 300 keys, so that each block's ring of 3 slots wraps. Mutations: a row's
offset in its page taken from the tile's first key, not its page's; the transposers not waiting
for the row copies; the copies not waiting for a free slot (only a wrapped ring shows it).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from test_emulated_fp8 import problem
from test_emulated_fp8_decode import NAN, bshd, cache_case, paged_pool

import kernelgen
from kernelgen.errors import EmulatorError, InputError
from kernelgen.kernels.render import render
from kernelgen.model.policy import fp8_decode_spec
from kernelgen.references.fp8 import fp8_mismatches, fp8_reference
from kernelgen.runtime.emulated_launch import recording
from kernelgen.specs.forward import KernelSpec

pytestmark = [
    pytest.mark.emulate,
    pytest.mark.filterwarnings("ignore::kernelgen.errors.CPUBackendWarning"),
]

F8 = ml_dtypes.float8_e4m3fn
# The d128 paged decode spec at 128-key tiles: pages of 16 and 48 keys straddle its tiles.
N128 = KernelSpec(**{**fp8_decode_spec(128, True, 4, paged_kv=True).model_dump(), "block_n": 128})
LENGTHS = [169, 258]


def paged_step(page_size: int, source: str | None = None):
    """One decode step of N128 on :func:`cache_case` 8 (GQA 4, one query) as shuffled pages of
    ``page_size`` keys, 3 chunks: (out as (B, H, Sq, D) float32, lse, reference)."""
    q, k, v, descales = cache_case(8, LENGTHS, 8, 2, 1)
    k_pool, v_pool, table = paged_pool(k, v, page_size, seed=page_size)
    with recording(source) as recorded:
        out, lse = kernelgen.attention_with_kvcache(
            bshd(q), k_pool.view(F8), v_pool.view(F8), LENGTHS, block_table=table, causal=True,
            return_lse=True, num_splits=3, spec=N128, **descales,
        )  # fmt: skip
    assert recorded.problem.page_size == page_size and N128.uri in recorded.stats
    ref = fp8_reference(q, k, v, descales, causal=True, scale=128**-0.5, seqlens_k=LENGTHS)
    return out.astype(np.float32).transpose(0, 2, 1, 3), lse, ref


def test_row_copies_at_128_key_tiles_match_the_tma_path_and_float64():
    tma_out, tma_lse, _ = paged_step(128)  # one TMA copy per tile
    for page_size in (16, 48):
        out, lse, ref = paged_step(page_size)
        assert fp8_mismatches(out, lse, ref).failed == ()
        np.testing.assert_array_equal(out, tma_out)
        np.testing.assert_array_equal(lse, tma_lse)


def test_default_decode_spec_at_d64_on_16_key_pages_with_appending():
    lengths = [100, 41]
    q, k, v, descales = problem(6, 2, 3, 1, 2, 120, head_dim=64)
    _, k_new, v_new, _ = problem(7, 2, 1, 1, 2, 2, descales=False, head_dim=64)
    for b, length in enumerate(lengths):
        k[b, :, length:] = NAN
        v[b, :, length:] = NAN
    k_pool, v_pool, table = paged_pool(k, v, 16, seed=5)
    with recording(None) as recorded:
        out, lse = kernelgen.attention_with_kvcache(
            bshd(q), k_pool.view(F8), v_pool.view(F8), lengths, block_table=table,
            k_new=bshd(k_new), v_new=bshd(v_new), causal=True, return_lse=True, num_splits=2,
            **descales,
        )  # fmt: skip
    spec = fp8_decode_spec(64, True, 3, paged_kv=True)
    assert spec.block_n == 64 and not spec.pack_gqa and spec.uri in recorded.stats
    for b, length in enumerate(lengths):
        k[b, :, length : length + 2] = k_new[b]
        v[b, :, length : length + 2] = v_new[b]
        page, row = table[b, (length + 1) // 16], (length + 1) % 16
        np.testing.assert_array_equal(v_pool[page, row], v_new[b, :, 1])
    new_lengths = [n + 2 for n in lengths]
    ref = fp8_reference(q, k, v, descales, causal=True, scale=64**-0.5, seqlens_k=new_lengths)
    found = fp8_mismatches(out.astype(np.float32).transpose(0, 2, 1, 3), lse, ref)
    assert found.failed == ()


# The d128 paged default: 64-key tiles, 3 stages (kernelgen.model.policy.fp8_decode_spec).
DEFAULT = fp8_decode_spec(128, True, 4, paged_kv=True)
RING_LENGTHS = [300, 233]  # 5 and 4 tiles in one chunk: the 3-slot ring wraps


def ring_step(page_size: int, source: str | None = None):
    """One decode step of DEFAULT on :func:`cache_case` 9 (GQA 4, one query, NaN past the
    lengths) as shuffled pages of ``page_size`` keys, one chunk: (out as (B, H, Sq, D)
    float32, lse, reference)."""
    q, k, v, descales = cache_case(9, RING_LENGTHS, 8, 2, 1)
    k_pool, v_pool, table = paged_pool(k, v, page_size, seed=page_size + 1)
    with recording(source) as recorded:
        out, lse = kernelgen.attention_with_kvcache(
            bshd(q), k_pool.view(F8), v_pool.view(F8), RING_LENGTHS, block_table=table,
            causal=True, return_lse=True, num_splits=1, spec=DEFAULT, **descales,
        )  # fmt: skip
    assert recorded.problem.page_size == page_size and DEFAULT.uri in recorded.stats
    ref = fp8_reference(q, k, v, descales, causal=True, scale=128**-0.5, seqlens_k=RING_LENGTHS)
    return out.astype(np.float32).transpose(0, 2, 1, 3), lse, ref


def test_the_paged_default_wraps_its_ring_on_row_copies_as_on_tma_pages():
    assert DEFAULT.stages == 3 and DEFAULT.block_n == 64
    tma_out, tma_lse, _ = ring_step(64)  # one TMA copy per tile
    out, lse, ref = ring_step(16)
    assert fp8_mismatches(out, lse, ref).failed == ()
    np.testing.assert_array_equal(out, tma_out)
    np.testing.assert_array_equal(lse, tma_lse)


def test_pages_off_the_16_key_steps_are_refused_before_the_cache_is_written():
    lengths = [40]
    q, k, v, descales = cache_case(2, lengths, 2, 1, 1)
    _, k_new, v_new, _ = problem(3, 1, 1, 1, 1, 1, descales=False)
    k_pool, v_pool, table = paged_pool(k, v, 40, seed=2)
    before = k_pool.copy()
    with pytest.raises(InputError, match=r"page_size 40 .*positive multiple of 16"):
        kernelgen.attention_with_kvcache(
            bshd(q), k_pool.view(F8), v_pool.view(F8), lengths, block_table=table,
            k_new=bshd(k_new), v_new=bshd(v_new), **descales,
        )  # fmt: skip
    np.testing.assert_array_equal(k_pool, before)


MUTATIONS = {
    "a row's offset counted from the tile's first key, not its page's": (
        "r.row_in_page * stride_row + chunk",
        "(first_row + i * ROW_STEP) * stride_row + chunk",
    ),
    "the transposers not waiting for the row copies": (
        "mbarrier_wait(v_landed + 8 * slot, (t / STAGES) & 1);",
        "if (!copy_rows) mbarrier_wait(v_landed + 8 * slot, (t / STAGES) & 1);",
    ),
}


RING_MUTATION = (
    "mbarrier_wait(kv_empty + 8 * slot, ((t / STAGES) & 1) ^ 1);  // as on the TMA path",
    "if (t < STAGES) mbarrier_wait(kv_empty + 8 * slot, ((t / STAGES) & 1) ^ 1);",
)


def test_row_copies_into_a_slot_still_in_use_fail():
    """The copies of tile t not waiting for tile t - 3's release: they overwrite K and the
    staged V while the consumers and transposers still read them."""
    old, new = RING_MUTATION
    source = render(DEFAULT)
    assert source.count(old) == 1, old
    with pytest.raises((EmulatorError, AssertionError)):
        out, lse, ref = ring_step(16, source.replace(old, new))
        assert fp8_mismatches(out, lse, ref).failed == ()


@pytest.mark.parametrize("name", MUTATIONS)
def test_mutated_fp8_row_copies_fail(name):
    """Each mutation makes the run fail: a hazard or deadlock the emulator reports, or a result
    out of the fp8 bound."""
    old, new = MUTATIONS[name]
    source = render(N128)
    assert source.count(old) == 1, old
    with pytest.raises((EmulatorError, AssertionError)):
        out, lse, ref = paged_step(48, source.replace(old, new))
        assert fp8_mismatches(out, lse, ref).failed == ()
