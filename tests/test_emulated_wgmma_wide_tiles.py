"""Key tiles of any multiple of 16 on the wgmma kernel (docs/hopper.md, "A spec"): 176 at head
dim 128 (FlashAttention 3's non-causal tile), 80 at head dim 256 (its d256 tile) and 144 with Q
in registers at 128 (168 accumulators each), and widths that are no power of two (80, 240),
against float64, with the loops and forms that compose with them; the limits are typed
errors (mma_sync stays at 128, and accumulators plus P's registers past what compiles without
spilling are refused)."""

from __future__ import annotations

import zlib

import pytest
from attention_cases import Case, assert_matches, make_case
from test_emulated_kernels import run_emulated

from kernelgen.specs.forward import spec_from_dict, spec_json_schema

BASE = dict(loop_order="v2", mma="wgmma", dtype="bfloat16")

WIDE_CASES = [
    # (spec fields, case): lengths that are no multiple of the tile (a partial last tile, keys
    # past a 176-row tile zeroed and masked), causal with the diagonal inside a tile, a cluster
    # with ping-pong, the TMA epilogue, the largest tile that fits at d64
    (dict(head_dim=128, block_m=128, block_n=176), Case(1, 2, 1, 150, 400)),
    (dict(head_dim=128, block_m=128, block_n=176, causal=True), Case(1, 2, 2, 300, 300, "bshd")),
    (
        dict(head_dim=128, block_m=128, block_n=176, cluster_m=2, pingpong=True),
        Case(1, 2, 1, 130, 177),
    ),
    (dict(head_dim=64, block_m=64, block_n=80, epilogue="tma"), Case(2, 2, 1, 70, 161)),
    (dict(head_dim=64, block_m=128, block_n=240), Case(1, 2, 1, 100, 500)),
    # 168 accumulators: d256 at 80 keys (causal, the diagonal inside a tile, lengths off both
    # tiles) and with the TMA epilogue; d128 at 144 keys with Q in registers, causal
    (dict(head_dim=256, block_m=128, block_n=80, causal=True), Case(1, 1, 1, 150, 170)),
    (dict(head_dim=256, block_m=128, block_n=80, epilogue="tma"), Case(1, 1, 1, 130, 250)),
    (
        dict(head_dim=128, block_m=128, block_n=144, q_in_registers=True, causal=True),
        Case(1, 2, 1, 200, 200, "bshd"),
    ),
]


@pytest.mark.emulate
@pytest.mark.parametrize(("fields", "case"), WIDE_CASES, ids=lambda x: str(x)[:60])
def test_wide_key_tiles_match_float64(fields, case):
    spec = spec_from_dict({**BASE, **fields})
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, zlib.crc32(spec.uri.encode()))
    out, lse = run_emulated(spec, case, data)
    assert_matches(out, lse, data, spec.dtype)


def test_the_176_key_tile_is_named_and_sized():
    spec = spec_from_dict({**BASE, "head_dim": 128, "block_m": 128, "block_n": 176})
    assert spec.uri == "fa_fwd_v2_wg_bf16_d128_m128_n176_w12_s2"
    assert spec.accumulators_per_thread == 152 and spec.live_registers_per_thread == 196
    # Q 32 KiB, two stages of 44 KiB K and V tiles, 8 barriers, the 1024-byte alignment
    assert spec.smem_bytes == 128 * 256 + 2 * 2 * 176 * 256 + 8 * 8 + 1024


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(block_n=264), "block_n=264 is not allowed"),
        (dict(block_n=72), "block_n=72 is not allowed"),
        (dict(head_dim=64, block_n=256), "more than 212 together spill"),
        (dict(block_n=176, q_in_registers=True), "need 184 fp32 accumulators"),
        (
            dict(block_n=96, overlap=True, q_in_registers=True, stages=3),
            "needs 168 fp32 accumulators per thread; at most 160 fit with both",
        ),
        (
            dict(mma="mma_sync", block_m=64, num_warps=4, block_n=176, archs=("sm_80",)),
            "block_n=176 is not allowed with mma='mma_sync'; use a multiple of 16 up to 128",
        ),
        (
            dict(mma="simt", block_m=64, num_warps=4, block_n=176, archs=("sm_80",)),
            "block_n=176 is not allowed with mma='simt'",
        ),
    ],
)
def test_key_tiles_past_each_paths_limit_are_refused(fields, message):
    with pytest.raises(ValueError, match="block_n") as raised:
        spec_from_dict({**BASE, "head_dim": 128, "block_m": 128, **fields})
    assert message in str(raised.value)


def test_the_schema_allows_wgmma_key_tiles():
    rules = spec_json_schema()["properties"]["block_n"]
    assert rules["maximum"] == 256 and rules["multipleOf"] == 16
