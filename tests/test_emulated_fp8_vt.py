"""fp8 with V transposed in the kernel (``fp8_v_layout: kernel``; docs/hopper.md, "fp8", "V
transposed in the kernel") on the emulator.

The producer's warps 1-3 write each V^T slot from V as TMA copied it (K's layout) in the order
the host copy (kernelgen.runtime.fp8.v_operand) stores it, so both layouts run the same products
in the same order: out and lse must be equal bit for bit, and within the fp8 bound of the float64
reference (kernelgen.references.fp8). Mutations of the transpose (key order, either swizzle,
the zeros past seqlens_k) and of its synchronisation (the staging barrier's wait, the
fence.proxy.async before the V barrier) must be caught. Probes check the two emulator
constructs the transpose brought: ``__byte_perm`` and ld.shared's check of TMA-written bytes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from test_emulated_fp8 import fp8_spec, problem
from test_emulated_fp8_variants import NAN, assert_within_bound
from test_emulator_hopper import COMMON

import kernelgen
from kernelgen.calls.emulated import emulate_fp8_attention
from kernelgen.emulator import HazardError, build_kernel, encode_tensor_map_tiled
from kernelgen.errors import SpecError
from kernelgen.kernels.render import render
from kernelgen.references.fp8 import fp8_reference
from kernelgen.runtime.launch import Problem
from kernelgen.runtime.tensor_maps import tensor_map_layouts
from kernelgen.specs.forward import spec_from_dict

pytestmark = pytest.mark.emulate

GQA = (2, 4, 2, 70, 150)  # (batch, heads, kv heads, Sq, Sk): lengths off the tiles and off 16


def both_layouts(fields: dict, shape, seed: int, source: str | None = None, **kwargs):
    """(host result, kernel result, reference) of one causal problem; ``source`` replaces the
    kernel layout's CUDA (a mutation)."""
    q, k, v, descales = problem(seed, *shape, head_dim=fields["head_dim"])
    host = emulate_fp8_attention(fp8_spec(causal=True, **fields), q, k, v, **descales, **kwargs)
    spec = fp8_spec(causal=True, fp8_v_layout="kernel", **fields)
    kernel = emulate_fp8_attention(spec, q, k, v, source=source, **descales, **kwargs)
    scale = fields["head_dim"] ** -0.5
    ref = fp8_reference(q, k, v, descales, causal=True, scale=scale, **kwargs)
    return host, kernel, ref


@pytest.mark.parametrize(
    "fields",
    [
        {"head_dim": 128, "block_n": 128},  # 128-byte V and V^T rows
        {"head_dim": 64, "block_n": 64},  # 64-byte V rows and 64-byte V^T rows
    ],
    ids=["d128_n128", "d64_n64"],
)
def test_kernel_transpose_equals_the_host_copy_bit_for_bit(fields):
    """Causal GQA, Sq 70 and Sk 150 (off the tiles and off 16: TMA zero-fills the keys past
    Sk), descales: the same out and lse as the host copy, within the fp8 bound."""
    host, kernel, ref = both_layouts(fields, GQA, seed=11)
    np.testing.assert_array_equal(kernel.out, host.out)
    np.testing.assert_array_equal(kernel.lse, host.lse)
    assert_within_bound(kernel.out, kernel.lse, ref)


def test_seqlens_k_with_nan_rows_past_it_in_bshd_through_kernelgen_attention():
    """v passed as it is in bshd (the tensor map's strides, no copy), host lengths off the
    tiles and off 16 with NaN rows in k and v past them: the transpose stores zeros there."""
    lengths = [97, 133]
    q, k, v, descales = problem(5, len(lengths), 4, 2, 70, 160)
    for b, length in enumerate(lengths):
        k[b, :, length:] = NAN
        v[b, :, length:] = NAN
    spec = fp8_spec(causal=True, fp8_v_layout="kernel")
    bshd = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)).view(ml_dtypes.float8_e4m3fn)
            for x in (q, k, v)]  # fmt: skip
    out, lse = kernelgen.attention(
        *bshd, causal=True, spec=spec, layout="bshd", return_lse=True, seqlens_k=lengths,
        **descales,
    )  # fmt: skip
    ref = fp8_reference(q, k, v, descales, causal=True, scale=128**-0.5, seqlens_k=lengths)
    assert_within_bound(out.astype(np.float32).transpose(0, 2, 1, 3), lse, ref)


def kernel_source(**fields) -> str:
    return render(fp8_spec(causal=True, fp8_v_layout="kernel", **fields))


def mutated(old: str, new: str, **fields) -> str:
    source = kernel_source(**fields)
    assert source.count(old) == 1, old
    return source.replace(old, new)


# Each mutation of the transpose, and how much of the bound it breaks by (at least).
WRONG_BYTES = {
    # the keys in their natural order (no KEY_ORDER): 2q + j instead of 2q + j % 2 + 8 (j / 2)
    "key_order": ("const int k = 2 * q + j % 2 + 8 * (j / 2);", "const int k = 4 * q + j;"),
    # the staged V read without its swizzle
    "source_swizzle": ("((chunk ^ swizzle_phase(k)) * 16)", "(chunk * 16)"),
    # V^T written without its swizzle
    "v_t_swizzle": ("((group ^ phase) * 16)", "(group * 16)"),
}


@pytest.mark.parametrize("mutation", WRONG_BYTES)
def test_transpose_mutations_break_the_bound(mutation):
    old, new = WRONG_BYTES[mutation]
    fields = {"head_dim": 128, "block_n": 128}
    _, kernel, ref = both_layouts(fields, (1, 2, 1, 70, 150), 3, mutated(old, new, **fields))
    assert ref.bound_ratio(np.asarray(kernel.out, np.float64)) > 2.0


def test_keys_past_seqlens_k_not_zeroed_give_nan():
    """The last tile through the unchecked step: its NaN rows reach P V (0 * NaN)."""
    source = mutated(
        "if (seqlen_k - key0 >= BLOCK_N)  // every key of the tile is the entry's",
        "if (true)",
    )
    q, k, v, descales = problem(5, 1, 2, 1, 70, 160)
    v[:, :, 97:] = NAN
    k[:, :, 97:] = NAN
    spec = fp8_spec(causal=True, fp8_v_layout="kernel")
    result = emulate_fp8_attention(spec, q, k, v, source=source, seqlens_k=[97], **descales)
    assert np.isnan(result.out).any()


SYNC_MUTATIONS = {
    # the transposers read the staging slot before its TMA copy completed
    "no_staging_wait": (
        "mbarrier_wait(v_landed + 8 * slot, (t / STAGES) & 1);",
        "",
        "before its TMA write completed",
    ),
    # generic-proxy stores read by wgmma (the async proxy) without the fence
    "no_proxy_fence": (
        "fence_proxy_async();\n      mbarrier_arrive(v_full + 8 * slot);",
        "mbarrier_arrive(v_full + 8 * slot);",
        "no fence.proxy.async after the write",
    ),
}


@pytest.mark.parametrize("mutation", SYNC_MUTATIONS)
def test_transpose_synchronisation_mutations_are_caught(mutation):
    """A hazard, or for the missing staging wait a wrong result: a transposer that runs before
    thread 0 has even issued the slot's copy reads the slot's earlier bytes, which no TMA write
    is pending on (the emulator copies at issue), so only the numbers show it. Which of the two
    happens depends on how the emulator's threads interleave, which the machine's load moves."""
    old, new, message = SYNC_MUTATIONS[mutation]
    q, k, v, descales = problem(3, 1, 2, 1, 70, 150)
    spec = fp8_spec(causal=True, fp8_v_layout="kernel")
    try:
        result = emulate_fp8_attention(spec, q, k, v, source=mutated(old, new), **descales)
    except HazardError as error:
        assert message in str(error)
        return
    assert mutation == "no_staging_wait", "the missing fence went unreported"
    ref = fp8_reference(q, k, v, descales, causal=True, scale=128**-0.5)
    ratio = ref.bound_ratio(np.asarray(result.out, np.float64))
    assert not np.isfinite(ratio) or ratio > 2.0  # NaN: the emulator's garbage fill was read


# ---- spec, layout and call path (no emulated run) ---------------------------------------------
def test_spec_field_name_and_shared_memory():
    host = fp8_spec(causal=True)
    spec = fp8_spec(causal=True, fp8_v_layout="kernel")
    assert spec.uri == "fa_fwd_v2_wg_e4m3_d128_m128_n128_w12_s2_vk_causal"
    # a K-shaped staging tile and one barrier per stage more
    assert spec.smem_bytes - host.smem_bytes == 2 * (128 * 128 + 8)
    assert spec.v_tile_bytes == host.v_tile_bytes == 128 * 128


def test_kernel_layout_is_refused_without_fp8():
    with pytest.raises(SpecError, match=r"fp8_v_layout='kernel' is not allowed with dtype="):
        spec_from_dict(
            {"loop_order": "v2", "dtype": "bfloat16", "head_dim": 128, "block_m": 128,
             "block_n": 128, "mma": "wgmma", "fp8_v_layout": "kernel"}
        )  # fmt: skip


@pytest.mark.parametrize("head_dim, block_n", [(128, 128), (64, 64), (96, 128)])
def test_v_map_is_k_shaped(head_dim, block_n):
    """v's tensor map is k's (keys x head dim, K's swizzle and box), not V^T's."""
    spec = fp8_spec(head_dim=head_dim, block_n=block_n, fp8_v_layout="kernel")
    strides = (2 * 150 * head_dim, 150 * head_dim, head_dim)
    shape = Problem(2, 4, 2, 70, 150, head_dim, strides, strides, strides, strides)
    layouts = tensor_map_layouts(spec, shape)
    k_map, v_map = layouts["k_map"], layouts["v_map"]
    assert (v_map.dims, v_map.box, v_map.swizzle) == (k_map.dims, k_map.box, k_map.swizzle)
    assert v_map.dims[:2] == (head_dim, 150)


def test_no_v_t_copy_is_made(monkeypatch):
    """The call passes v as it is: kernelgen.runtime.fp8.v_operand is never called."""
    import kernelgen.calls.fp8 as calls_fp8

    def refuse(*args, **kwargs):
        raise AssertionError("v_operand called with fp8_v_layout: kernel")

    monkeypatch.setattr(calls_fp8, "v_operand", refuse)
    q, k, v, _ = problem(2, 1, 2, 1, 20, 40)
    spec = fp8_spec(fp8_v_layout="kernel")
    out = emulate_fp8_attention(spec, q, k, v).out
    ref = fp8_reference(q, k, v, {}, causal=False, scale=128**-0.5)
    assert ref.bound_ratio(np.asarray(out, np.float64)) <= 1.0


# ---- probes of the emulator constructs the transpose uses -------------------------------------
PROBE_SRC = (
    COMMON
    + r"""
extern "C" __global__ void probe(const __grid_constant__ CUtensorMap tmap, const unsigned* x,
                                 const unsigned* y, const unsigned* s, unsigned* out, int wait) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t tile = smem_u32(smem), bar = tile + 1024;
  out[threadIdx.x] = __byte_perm(x[threadIdx.x], y[threadIdx.x], s[threadIdx.x]);
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar));
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 1024;" :: "r"(bar));
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {0, 0}], [%2];" :: "r"(tile), "l"(&tmap), "r"(bar) : "memory");
  }
  __syncthreads();
  if (wait) wait_phase(bar, 0);
  unsigned v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(tile + 4 * threadIdx.x) : "memory");
  out[32 + threadIdx.x] = v;
}
"""
)


@pytest.fixture(scope="module")
def probe_kernel():
    return build_kernel(
        PROBE_SRC,
        "probe",
        [
            ("const __grid_constant__ CUtensorMap", "tmap"),
            ("const unsigned*", "x"),
            ("const unsigned*", "y"),
            ("const unsigned*", "s"),
            ("unsigned*", "out"),
            ("int", "wait"),
        ],
    )


def run_probe(kernel, x, y, s, tile: np.ndarray, wait: int) -> np.ndarray:
    tmap = encode_tensor_map_tiled("uint8", 2, tile, (128, 8), (128,), (128, 8), (1, 1))
    out = np.zeros(64, np.uint32)
    kernel(grid=1, block=32, shared_mem=1024 + 8, args=[tmap, x, y, s, out, wait])
    return out


def byte_perm_reference(x, y, s) -> np.ndarray:
    """CUDA's documented __byte_perm: byte n of the result is byte s<4n+2:4n> of {y, x}."""
    eight = (y.astype(np.uint64) << np.uint64(32)) | x.astype(np.uint64)
    out = np.zeros_like(x)
    for n in range(4):
        index = (s >> np.uint32(4 * n)) & np.uint32(7)
        byte = (eight >> (np.uint64(8) * index.astype(np.uint64))) & np.uint64(0xFF)
        out |= byte.astype(np.uint32) << np.uint32(8 * n)
    return out


def test_byte_perm_and_ld_shared_after_the_tma_wait(probe_kernel):
    """__byte_perm on random words and selectors (nibble top bits and the upper half set at
    random: unused), and ld.shared of bytes a TMA wrote, read after the mbarrier wait."""
    rng = np.random.default_rng(9)
    x, y, s = (rng.integers(0, 2**32, 32, dtype=np.uint64).astype(np.uint32) for _ in range(3))
    s[:4] = [0x5140, 0x7362, 0x5410, 0x7632]  # the transpose's selectors
    tile = rng.integers(0, 256, (8, 128), dtype=np.uint8)
    out = run_probe(probe_kernel, x, y, s, tile, wait=1)
    np.testing.assert_array_equal(out[:32], byte_perm_reference(x, y, s))
    np.testing.assert_array_equal(out[32:], tile.reshape(-1)[:128].view(np.uint32))


def test_ld_shared_before_the_tma_wait_is_a_hazard(probe_kernel):
    z = np.zeros(32, np.uint32)
    tile = np.ones((8, 128), np.uint8)
    with pytest.raises(HazardError, match="before its TMA write completed"):
        run_probe(probe_kernel, z, z, z, tile, wait=0)
