"""The fp8 (e4m3) wgmma forward at head dims 64, 96, 192 and 256 (docs/hopper.md, "fp8"). At
d64 the Q and K tile rows are 64 bytes (TMA's 64-byte swizzle, descriptor mode 2, 512-byte 8-row
groups, two k32 steps per row); at d256 Q and K rows are two 128-byte column blocks and the
64-key tiles' V^T rows are 64 bytes; d96's Q and K rows are one 128-byte row (its last 32 bytes
zero-filled by TMA) and d192's two column blocks (the second half-filled), while their V^T
tiles hold just the head dim's rows, so a V ring slot is smaller than a K one. A probe of the
emulator's 64-byte swizzled K-major 8-bit operand read from inside a row (the kernels' second
k-step), then the kernels against the float64 reference of the quantized inputs within the
bound of tests/test_emulated_fp8.py, and mutations of the new layouts that the bound or the
emulator's TMA hazard check catches. The spec files specs/v2_wg_e4m3_d64_* and _d256_* run in
test_emulated_fp8.py's spec-file test (d96 and d192 ship none: their cases are below)."""

from __future__ import annotations

import numpy as np
import pytest
from test_emulated_fp8 import bound_ratio, fp8_spec, problem, reference
from test_emulator_hopper import decode, swizzle
from test_emulator_hopper_fp8 import FP8, descriptor, fp8_kernel, fp8_values  # noqa: F401

from kernelgen.calls.emulated import emulate_fp8_attention
from kernelgen.errors import HazardError
from kernelgen.kernels.render import render
from kernelgen.references.fp8 import P_RELATIVE
from kernelgen.specs.forward import WGMMA_ROW_BYTES

pytestmark = pytest.mark.emulate

SPAN = 64  # bytes of one swizzled row


def place_rows(image: np.ndarray, base: int, mat: np.ndarray) -> int:
    """Write ``mat`` (rows of SPAN bytes, K-major) at ``base`` as TMA's 64-byte swizzle lays a
    box of 64-byte rows: byte k of row mn at offset mn * SPAN + k, then Swizzle<2,4,3> (the
    PTX ISA's swizzled K-major layout ((8,m),SPAN):((SPAN,SBO),1) with SBO = 8 SPAN). Returns
    the SBO."""
    for mn in range(mat.shape[0]):
        for k in range(SPAN):
            image[base + swizzle(mn * SPAN + k, SPAN)] = mat[mn, k]
    return 8 * SPAN


def test_wgmma_reads_a_64_byte_swizzled_k_major_fp8_operand_from_its_second_k_step(fp8_kernel):  # noqa: F811
    """m64n32k32 e4m3 with both operands 64-byte rows in the 64-byte swizzle (Swizzle<2,4,3>
    of the PTX ISA's canonical K-major layout, 8-row groups 512 bytes apart) and descriptors
    that start 32 bytes into the rows: D = A[:, 32:] @ B[32:, :], exactly."""
    rng = np.random.default_rng(11)
    a = fp8_values(rng, "e4m3", (64, SPAN))  # two k32 steps per row
    b = fp8_values(rng, "e4m3", (SPAN, 32))
    image = np.full(16384, 0xFF, np.uint8)
    descs = [descriptor(0x400 + 32, 16, place_rows(image, 0, a), SPAN)]
    descs.append(descriptor(0x400 + 8192 + 32, 16, place_rows(image, 8192, b.T.copy()), SPAN))
    out = np.zeros((128, 16), np.uint32)
    args = [image, 16384, np.array(descs, np.uint64), np.zeros((128, 4), np.uint32)]
    zeros = np.zeros((128, 16), np.uint32)  # C
    fp8_kernel(grid=1, block=128, shared_mem=16384, args=[*args, zeros, out, 0])
    a_val, b_val = (x.view(FP8["e4m3"]).astype(np.float64) for x in (a[:, 32:], b[32:]))
    want = (a_val @ b_val).astype(np.float32).astype(np.float64)
    got = decode(out.view(np.float32).astype(np.float64), 32)
    np.testing.assert_array_equal(got, want)


def run(spec, shape, seed, source=None):
    """(max error / bound, relative Frobenius error, lse error) of the kernel on an fp8
    problem of ``shape`` with descales."""
    q, k, v, descales = problem(seed, *shape, head_dim=spec.head_dim)
    result = emulate_fp8_attention(spec, q, k, v, source=source, **descales)
    ref, lse, a, b = reference(q, k, v, descales, spec.causal, spec.head_dim**-0.5)
    ratio = bound_ratio(result.out, ref, a, b)
    relative = float(np.linalg.norm(result.out - ref) / np.linalg.norm(ref))
    print(f"{spec.uri}: max error / bound {ratio:.3f}, relative Frobenius error {relative:.4f}")
    return ratio, relative, float(np.max(np.abs(result.lse - lse)))


def test_d96_and_d192_store_k_in_whole_column_blocks_and_v_transposed_unpadded():
    """The layout the kernels and the shared-memory size share (KernelSpec): Q/K rows of whole
    128-byte swizzled column blocks, V^T tiles of head-dim rows of block_n keys."""
    for head_dim, blocks in ((96, 1), (192, 2)):
        for block_n in (128, 64):
            spec = fp8_spec(head_dim=head_dim, block_n=block_n)
            assert (spec.qk_row_bytes, spec.column_blocks) == (WGMMA_ROW_BYTES, blocks)
            assert spec.k_tile_bytes == block_n * blocks * WGMMA_ROW_BYTES
            assert spec.v_tile_bytes == block_n * head_dim < spec.k_tile_bytes
            assert spec.v_row_bytes == block_n
            ring = spec.stages * (spec.k_tile_bytes + spec.v_tile_bytes)
            q_tile = spec.block_m * blocks * WGMMA_ROW_BYTES
            assert spec.smem_bytes == q_tile + ring + (2 + 3 * spec.stages) * 8 + 1024


def test_emulate_counts_the_key_tiles_of_unequal_k_and_v_slots():
    """`kernelgen emulate`'s key-tile row divides the TMA bytes past the Q tiles by one K plus
    one V^T tile: d192 n128, B=1 H=2 Sq=100 Sk=160 (the emulated run read 294,912 bytes: two Q
    tiles of 128 x 256 bytes, four key tiles of 128 x 256 K and 192 x 128 V^T bytes)."""
    from kernelgen.cli.emulate_table import tma_rows

    spec = fp8_spec(head_dim=192, epilogue="tma")
    read = 2 * 128 * 256 + 4 * (128 * 256 + 192 * 128)
    assert read == 294912
    (_, tiles) = tma_rows(spec, read, 1, (1, 2, 1, 100, 160))
    assert (tiles.value, tiles.ok) == ("4", True)


# Causal with GQA and lengths off the tiles: d64 with 64-key tiles (V^T rows of 64 bytes too)
# and Q in registers (its fragments read through the 64-byte swizzle); d256 in ping-pong; d128
# with 64-key tiles (64-byte V^T rows beside 128-byte Q and K rows) in the overlapped loop; d96
# in the overlap with Q in registers (three k32 steps of each 128-byte Q row); d192 at 128-key
# tiles (a 24 KiB V^T slot beside a 32 KiB K slot) with the TMA store (out's three column blocks
# staged in Q's two and one more); d256 in the overlapped loop (168 accumulators: 128 of O, 32
# of S and 8 of the overlap's extra P, the engine's budget since 2026-11-27).
CASES = {
    "d64_n64_qr": {"head_dim": 64, "block_n": 64, "q_in_registers": True},
    "d256_n64_pp": {"head_dim": 256, "block_n": 64, "pingpong": True},
    "d128_n64_ovl": {"head_dim": 128, "block_n": 64, "overlap": True, "stages": 3},
    "d96_n128_ovl_qr": {"head_dim": 96, "overlap": True, "q_in_registers": True, "stages": 3},
    "d192_n128_tma": {"head_dim": 192, "epilogue": "tma"},
    "d256_n64_ovl": {"head_dim": 256, "block_n": 64, "overlap": True, "stages": 3},
}


@pytest.mark.parametrize("case", CASES)
def test_fp8_head_dims_causal_within_the_stated_bound(case):
    spec = fp8_spec(causal=True, **CASES[case])
    ratio, relative, lse_error = run(spec, (2, 4, 2, 70, 150), seed=5)
    assert ratio <= 1.0
    assert relative < P_RELATIVE
    assert lse_error <= 1e-4


# Mutations the tests catch. Read with the 128-byte layout, d64's 64-byte Q and K rows (or its
# 1024-byte 8-row stride) reach past each tile into ring bytes no TMA copy has written yet, and
# so do d256's 64-byte V^T rows: the emulator's TMA hazard check stops them (on a GPU they read
# stale data). d64's Q fragments read through the 128-byte swizzle break the bound, and so does
# d96's P V reading the V^T ring at the K ring's slot stride: tile 1's V^T rows are read from
# the wrong place (rows 32-95 of slot 1, then the unwritten slot 2).
UNWRITTEN = "is read before its TMA write completed"
MUTATIONS = {
    "d64: Q and K descriptors in the 128-byte swizzle": (
        {"head_dim": 64},
        "constexpr unsigned QK_SWIZZLE = DESC_SWIZZLE_64B;",
        "constexpr unsigned QK_SWIZZLE = DESC_SWIZZLE_128B;",
        UNWRITTEN,
    ),
    "d64: descriptor stride of 128-byte rows": (
        {"head_dim": 64},
        "constexpr int ATOM_BYTES = 8 * ROW_BYTES;",
        "constexpr int ATOM_BYTES = 8 * 128;",
        UNWRITTEN,
    ),
    "d256: V^T descriptor in the 128-byte swizzle": (
        {"head_dim": 256, "block_n": 64},
        "constexpr unsigned V_SWIZZLE = DESC_SWIZZLE_64B;",
        "constexpr unsigned V_SWIZZLE = DESC_SWIZZLE_128B;",
        UNWRITTEN,
    ),
    "d96: V^T slots at the K tile's stride": (
        {"head_dim": 96, "overlap": True, "stages": 3},
        "const unsigned slot_offset = slot * V_TILE_BYTES;",
        "const unsigned slot_offset = slot * KV_TILE_BYTES;",
        None,  # the bound
    ),
    "d64: Q fragments through the 128-byte swizzle": (
        {"head_dim": 64, "q_in_registers": True},
        "return (row * ROW_BYTES / 128) % (ROW_BYTES / 16);",
        "return row % 8;",
        None,  # the bound
    ),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_fp8_head_dim_mutations_are_caught(mutation):
    fields, old, new, hazard = MUTATIONS[mutation]
    spec = fp8_spec(**fields)
    source = render(spec)
    assert old in source
    mutated = source.replace(old, new)
    if hazard is not None:
        with pytest.raises(HazardError, match=hazard):
            run(spec, (1, 2, 1, 64, 140), seed=3, source=mutated)
        return
    ratio, _, _ = run(spec, (1, 2, 1, 64, 140), seed=3, source=mutated)
    print(f"{mutation}: max error / bound {ratio:.2f}")
    assert ratio > 1.0
