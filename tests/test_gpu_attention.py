"""GPU tier (`pytest -m gpu`): every spec through kernelgen.attention on a CUDA device against
float64 NumPy, outputs poisoned with NaN before the run. Skipped where there is no device."""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest
from attention_cases import (
    Case,
    assert_matches,
    example_expressions,
    example_variants,
    make_case,
)
from conftest import POINTER_SPEC_PATHS, WGMMA_SPEC_PATHS
from test_emulated_wide_tiles import MATRIX as WIDE_MATRIX

import kernelgen
import kernelgen.calls.attention
from kernelgen.references.attention import naive_attention
from kernelgen.specs.forward import load_spec, spec_from_dict

pytestmark = pytest.mark.gpu

# Paged-KV specs read K/V through a block table, which only attention_with_kvcache passes:
# their GPU test is test_gpu_serving.py's test_paged_specs_on_gpu.
SPEC_PATHS = [p for p in POINTER_SPEC_PATHS if not load_spec(p).paged_kv]

CASES = [
    Case(1, 1, 1, 1, 1),
    Case(2, 4, 2, 17, 17),  # batch > 1, GQA
    Case(1, 8, 1, 128, 1000, mask="broadcast"),  # MQA, Sq != Sk, empty rows
    Case(2, 2, 2, 1000, 128, layout="bshd"),  # Sq > Sk (causal: empty rows)
    Case(1, 4, 4, 1000, 1000, mask="full", scale=0.2),
    Case(1, 2, 1, 300, 2000, key_growth=6.0),  # row maxima keep moving: the rescale path
    Case(1, 2, 2, 200, 700, scale=-0.2),  # a negative scale: no tile keeps raw dot products
]


@pytest.fixture(autouse=True)
def poisoned_outputs():
    """Every output and scratch buffer of kernelgen, CuPy or torch, starts as NaN."""
    from kernelgen.testing.poison import poisoned_outputs

    with poisoned_outputs():
        yield


def device_array(x: np.ndarray, dtype: str, layout: str):
    """``x`` (values of ``dtype``, as float32) on the device as ``dtype`` in ``layout``."""
    import cupy

    from kernelgen.tuning.gpu import upload

    if layout == "bshd":
        x = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    return upload(cupy, x, dtype)


def host_float32(array) -> np.ndarray:
    """A device array of any element type as a float32 NumPy array."""
    import cupy

    from kernelgen.tuning.gpu import as_float32

    return as_float32(cupy, array).get()


def run(spec, case: Case, data, want_lse: bool = True, **options):
    q, k, v = (device_array(getattr(data, n), spec.dtype, case.layout) for n in "qkv")
    mask = None if data.mask is None else __import__("cupy").asarray(data.mask)
    result = kernelgen.attention(
        q,
        k,
        v,
        causal=spec.causal,
        scale=case.scale,
        mask=mask,
        spec=spec,
        return_lse=want_lse,
        layout=case.layout,
        **options,
    )
    out, lse = result if want_lse else (result, None)
    out = host_float32(out)
    if case.layout == "bshd":
        out = out.transpose(0, 2, 1, 3)
    return out, None if lse is None else lse.get()


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("path", SPEC_PATHS, ids=lambda p: p.stem)
def test_spec_on_gpu(path, case):
    """Every spec; one compiled with variants runs them with example values (docs/variants.md)."""
    spec = load_spec(path)
    seed = zlib.crc32(f"{path.stem} {case}".encode())
    variants = example_variants(spec.variants, case.batch, case.heads, seed, window=(100, 7))
    expressions, hooks = example_expressions(spec, case, seed)  # docs/expressions.md
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed, {**variants, **hooks})
    out, lse = run(spec, case, data, **device_variants({**variants, **expressions}))
    assert_matches(out, lse, data, spec.dtype)


def device_variants(variants: dict) -> dict:
    """attention()'s variant and expression arguments with their arrays (slopes, sinks, mod
    inputs) on the device; a host block mask is rebuilt there by the generated builder."""
    import cupy

    def device(x):
        return cupy.asarray(x) if isinstance(x, np.ndarray) else x

    result = {k: device(x) for k, x in variants.items()}
    if "mod_inputs" in result:
        result["mod_inputs"] = {n: device(x) for n, x in result["mod_inputs"].items()}
    mask = result.get("block_mask")
    if mask is not None:
        result["block_mask"] = kernelgen.block_mask(
            mask.mask_mod, mask.batch, mask.heads, mask.seqlen_q, mask.seqlen_k,
            block_m=mask.block_m, block_n=mask.block_n, mod_inputs=result["mod_inputs"],
        )  # fmt: skip
    return result


@pytest.mark.parametrize("case", [CASES[2], CASES[4], CASES[5]], ids=str)
@pytest.mark.parametrize("spec", [spec for spec, _ in WIDE_MATRIX], ids=lambda s: s.uri)
def test_wide_and_odd_tiles_on_gpu(spec, case):
    """The emulator's matrix of 8-warp 32-row tilings and odd key tiles
    (test_emulated_wide_tiles.py) at GPU sizes."""
    seed = zlib.crc32(f"{spec.uri} {case}".encode())
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed)
    out, lse = run(spec, case, data)
    assert_matches(out, lse, data, spec.dtype)


@pytest.mark.parametrize("case", CASES[1:3], ids=str)
@pytest.mark.parametrize("path", SPEC_PATHS, ids=lambda p: p.stem)
def test_spec_without_lse_on_gpu(path, case):
    """Without return_lse the kernels get a null lse (no allocation) and skip that store."""
    spec = load_spec(path)
    seed = zlib.crc32(path.stem.encode())
    variants = example_variants(spec.variants, case.batch, case.heads, seed)
    expressions, hooks = example_expressions(spec, case, seed)
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed, {**variants, **hooks})
    out, lse = run(spec, case, data, want_lse=False, **device_variants({**variants, **expressions}))
    assert lse is None
    assert_matches(out, None, data, spec.dtype)


def require_compute_capability_9_0() -> None:
    """The wgmma specs are sm_90a code: they run on compute capability 9.0 only."""
    import cupy

    capability = cupy.cuda.Device().compute_capability
    if capability != "90":
        pytest.skip(f"wgmma (sm_90a) needs compute capability 9.0; this device is {capability}")


# paged wgmma specs: test_gpu_serving.py's test_paged_specs_on_gpu; fp8 ones (e4m3 bit patterns
# and descales): test_gpu_fp8.py
WGMMA_CONTIGUOUS_PATHS = [
    p for p in WGMMA_SPEC_PATHS if not load_spec(p).paged_kv and not load_spec(p).fp8
]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("path", WGMMA_CONTIGUOUS_PATHS, ids=lambda p: p.stem)
def test_wgmma_spec_on_gpu(path, case):
    """The Hopper kernels (TMA tensor maps built by the driver, wgmma) on the same cases."""
    require_compute_capability_9_0()
    spec = load_spec(path)
    seed = zlib.crc32(path.stem.encode())
    variants = example_variants(spec.variants, case.batch, case.heads, seed, window=(100, 7))
    expressions, hooks = example_expressions(spec, case, seed)
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed, {**variants, **hooks})
    options = device_variants({**variants, **expressions})
    out, lse = run(spec, case, data, **options)
    assert_matches(out, lse, data, spec.dtype)
    # same buffers' maps reused; null lse
    out, lse = run(spec, case, data, want_lse=False, **options)
    assert lse is None
    assert_matches(out, None, data, spec.dtype)


# The TMA-store epilogue's decode forms (docs/hopper.md; emulated in
# tests/test_emulated_wgmma_tma_store_gqa.py and ..._split.py): packed rows through a 5-d
# out_map, split-KV's fp32 partials through a map of o_partial.
TMA_DECODE_FIELDS = [
    dict(dtype="bfloat16", head_dim=128, block_m=64, block_n=128, pack_gqa=True),
    dict(dtype="bfloat16", head_dim=128, block_m=64, block_n=128, pack_gqa=True, split_kv=True),
    dict(dtype="float16", head_dim=64, block_m=128, block_n=64, split_kv=True, causal=True),
]
TMA_DECODE_CASES = [
    Case(2, 8, 2, 3, 300),
    Case(1, 16, 2, 21, 2000),  # group 8: the last row tile holds 5 of its 8 queries
    Case(1, 8, 1, 16, 1000, layout="bshd"),
]


@pytest.mark.parametrize("case", TMA_DECODE_CASES, ids=str)
@pytest.mark.parametrize("fields", TMA_DECODE_FIELDS, ids=lambda f: "-".join(sorted(f))[:40])
def test_tma_store_decode_forms_on_gpu(fields, case):
    require_compute_capability_9_0()
    spec = spec_from_dict({"loop_order": "v2", "mma": "wgmma", "epilogue": "tma", **fields})
    seed = zlib.crc32(f"{spec.uri} {case}".encode())
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed)
    for num_splits in (3, 64) if spec.split_kv else (None,):
        out, lse = run(spec, case, data, num_splits=num_splits)
        assert_matches(out, lse, data, spec.dtype)


def test_wgmma_spec_on_another_gpu_is_a_typed_error():
    """On a device other than compute capability 9.0 a wgmma spec is refused before launch."""
    import cupy

    if cupy.cuda.Device().compute_capability == "90":
        pytest.skip("this device runs wgmma")
    spec = load_spec(WGMMA_SPEC_PATHS[0])
    data = make_case(Case(1, 1, 1, 8, 8), spec.dtype, spec.head_dim, spec.causal, seed=1)
    with pytest.raises(kernelgen.InputError, match=r"compute capability 9\.0"):
        run(spec, Case(1, 1, 1, 8, 8), data)


@pytest.mark.parametrize(
    "stem",
    [
        "v2_f16_d64_causal",  # CUDA cores: 2048 x 66 = 135168 (batch, head) pairs
        "v2_tc_f16_d64_m64_n64_s2_swz",  # tensor cores, one block per row tile and query head
        "v2_tc_f16_d64_m32_n64_s3_swz_gqa_split",  # 2048 x 33 K/V heads, split over keys
    ],
)
def test_more_than_65535_heads_in_a_batch(stem):
    """batch x heads past gridDim.y's limit of 65535: the heads are on gridDim.x
    (runtime/launch.py)."""
    spec = load_spec(next(p for p in SPEC_PATHS if p.stem == stem))
    case = Case(2048, 66, 33, 2, 17)
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed=zlib.crc32(stem.encode()))
    out, lse = run(spec, case, data)
    assert_matches(out, lse, data, spec.dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize(
    "flags", [("window",), ("softcap",), ("alibi",), ("sinks",), ("window", "alibi", "sinks")]
)
def test_variants_with_the_default_spec_on_gpu(dtype, flags, monkeypatch):
    """attention() picks a spec with the call's variant flags (docs/variants.md); prefill and a
    decode step (the packed split-KV kernel, whose combine adds the sinks)."""
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "0")
    for case in (Case(2, 8, 2, 300, 700, layout="bshd"), Case(3, 8, 2, 1, 900)):
        seed = zlib.crc32(f"{dtype} {flags} {case}".encode())
        variants = example_variants(flags, case.batch, case.heads, seed, window=(200, 5))
        data = make_case(case, dtype, 64, True, seed, variants)
        q, k, v = (device_array(getattr(data, n), dtype, case.layout) for n in "qkv")
        out, lse = kernelgen.attention(
            q, k, v, causal=True, layout=case.layout, return_lse=True, **device_variants(variants)
        )
        out = host_float32(out)
        if case.layout == "bshd":
            out = out.transpose(0, 2, 1, 3)
        assert_matches(out, lse.get(), data, dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_expressions_with_the_default_spec_on_gpu(dtype, monkeypatch):
    """attention() compiles the call's score_mod / mask_mod into the default spec, per element
    and block-sparse from a block mask built on the GPU (docs/expressions.md)."""
    import cupy

    from kernelgen.references.expressions import evaluate
    from kernelgen.specs.expressions import inputs_from_arrays, parse_mask_mod, parse_score_mod

    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "0")
    case = Case(2, 8, 2, 700, 700)
    rng = np.random.default_rng(3)
    doc = np.repeat(np.arange(4, dtype=np.int32), [100, 250, 50, 300])[None].repeat(2, 0)
    bias = (0.3 * rng.standard_normal((8, 1400))).astype(np.float32)
    inputs = {"doc": doc, "bias": bias}
    score_text = "score + bias[h, q_idx - kv_idx + 700]"
    mask_text = "doc[b, q_idx] == doc[b, kv_idx] and kv_idx <= q_idx"
    declared = inputs_from_arrays(inputs)
    score_mod, mask_mod = parse_score_mod(score_text, declared), parse_mask_mod(mask_text, declared)
    hooks = {
        "score_mod": lambda s, b, h, q, k: evaluate(
            score_mod, score=s, b=b, h=h, q_idx=q, kv_idx=k, inputs=inputs
        ),
        "mask_mod": lambda b, h, q, k: evaluate(
            mask_mod, b=b, h=h, q_idx=q, kv_idx=k, inputs=inputs
        ),
    }
    data = make_case(case, dtype, 64, False, 5, hooks)
    q, k, v = (device_array(getattr(data, n), dtype, "bhsd") for n in "qkv")
    device_inputs = {name: cupy.asarray(x) for name, x in inputs.items()}
    out, lse = kernelgen.attention(
        q, k, v, score_mod=score_text, mask_mod=mask_text, mod_inputs=device_inputs,
        return_lse=True,
    )  # fmt: skip
    assert_matches(host_float32(out), lse.get(), data, dtype)
    tiles = kernelgen.default_spec(dtype, 64, False)
    block_mask = kernelgen.block_mask(
        mask_text, 2, 1, 700, 700, block_m=tiles.block_m, block_n=tiles.block_n,
        mod_inputs=device_inputs,
    )  # fmt: skip
    out, lse = kernelgen.attention(
        q, k, v, score_mod=score_text, block_mask=block_mask, mod_inputs=device_inputs,
        return_lse=True,
    )  # fmt: skip
    assert_matches(host_float32(out), lse.get(), data, dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_default_spec_on_gpu(dtype, head_dim, monkeypatch):
    import cupy

    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "0")  # the heuristic default (tuning: below)
    case = Case(2, 4, 2, 77, 200)
    data = make_case(case, dtype, head_dim, True, seed=head_dim)
    q, k, v = (device_array(getattr(data, n), dtype, "bhsd") for n in "qkv")
    out, lse = kernelgen.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, cupy.ndarray) and out.dtype == q.dtype
    assert_matches(host_float32(out), lse.get(), data, dtype)


def test_torch_tensors_in_torch_tensors_out():
    torch = pytest.importorskip("torch")
    case = Case(1, 2, 2, 33, 65)
    data = make_case(case, "bfloat16", 64, False, seed=5)
    q, k, v = (torch.from_numpy(getattr(data, n)).to("cuda", torch.bfloat16) for n in "qkv")
    out, lse = kernelgen.attention(q, k, v, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert_matches(out.float().cpu().numpy(), lse.cpu().numpy(), data, "bfloat16")


def _torch_inputs(torch, data, dtype):
    return [torch.from_numpy(getattr(data, n)).to("cuda", getattr(torch, dtype)) for n in "qkv"]


@pytest.mark.parametrize(
    "case, num_splits",
    [(Case(1, 4, 2, 64, 300), None), (Case(2, 8, 2, 1, 3000), 8)],
    ids=["prefill", "split-decode"],
)
def test_torch_calls_run_on_torchs_stream_and_in_a_cuda_graph(case, num_splits, monkeypatch):
    """A torch call launches on torch's current stream (a side stream here, no synchronisation
    with the default one) and allocates with torch, so a torch CUDA graph captures it: replayed
    on new inputs copied into the captured tensors, it gives their attention."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "0")
    first, second = (make_case(case, "float16", 64, True, seed=s) for s in (1, 2))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q, k, v = _torch_inputs(torch, first, "float16")
        out, lse = kernelgen.attention(q, k, v, causal=True, return_lse=True, num_splits=num_splits)
    side.synchronize()
    assert out.device == q.device and out.dtype == torch.float16
    assert_matches(out.float().cpu().numpy(), lse.cpu().numpy(), first, "float16")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_out, captured_lse = kernelgen.attention(
            q, k, v, causal=True, return_lse=True, num_splits=num_splits
        )
    for tensor, fresh in zip((q, k, v), _torch_inputs(torch, second, "float16"), strict=True):
        tensor.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(
        captured_out.float().cpu().numpy(), captured_lse.cpu().numpy(), second, "float16"
    )


def test_bad_input_launches_nothing():
    import cupy

    q = cupy.ones((1, 2, 4, 64), dtype=cupy.float16)
    k = cupy.ones((1, 3, 4, 64), dtype=cupy.float16)
    with pytest.raises(kernelgen.InputError, match="not divisible"):
        kernelgen.attention(q, k, k)
    # host q (the CPU backend) with device k and v: one device or the other, never a mix
    kv = cupy.ones((1, 2, 4, 64), dtype=cupy.float16)
    with pytest.raises(kernelgen.InputTypeError, match="k is on CUDA device 0 but q is on the CPU"):
        kernelgen.attention(q.get(), kv, kv)


def test_misaligned_inputs_on_the_tensor_cores(monkeypatch):
    import cupy

    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "0")
    case = Case(1, 2, 2, 40, 70)
    data = make_case(case, "float16", 64, False, seed=11)
    k, v = (device_array(getattr(data, n), "float16", "bhsd") for n in "kv")
    # q one element past a 16-byte boundary: same values, a pointer cp.async cannot use
    buffer = cupy.empty(data.q.size + 1, dtype=cupy.float16)
    q = buffer[1:].reshape(data.q.shape)
    q[...] = device_array(data.q, "float16", "bhsd")
    spec = kernelgen.default_spec("float16", 64, causal=False)
    assert spec.mma == "mma_sync"
    with pytest.raises(kernelgen.InputError, match="not 16-byte aligned"):
        kernelgen.attention(q, k, v, spec=spec)
    out, lse = kernelgen.attention(q, k, v, return_lse=True)  # default: CUDA-core fallback
    assert_matches(host_float32(out), lse.get(), data, "float16")


# The foundation's cases, each with a (dtype, head dim, causal) of its own: one tuning each.
TUNED = [
    (case, *kernel)
    for case, kernel in zip(
        [Case(2, 4, 2, 300, 300), *CASES],
        [("bfloat16", 128, True), ("float16", 64, False), ("bfloat16", 96, True)] * 3,
        strict=False,
    )
]


@pytest.mark.parametrize(("case", "dtype", "head_dim", "causal"), TUNED, ids=str)
def test_tuned_attention_is_correct(case, dtype, head_dim, causal, monkeypatch, tmp_path):
    """attention() without a spec tunes (fresh cache), records the winner, and is correct:
    masks, both layouts, GQA/MQA, odd lengths and scales, fp16 and bf16."""
    import cupy

    import kernelgen.tuning

    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "1")
    kernelgen.tuning.clear_memo()
    data = make_case(case, dtype, head_dim, causal, seed=case.seqlen_q + head_dim)
    q, k, v = (device_array(getattr(data, n), dtype, case.layout) for n in "qkv")
    mask = None if data.mask is None else cupy.asarray(data.mask)
    out, lse = kernelgen.attention(
        q, k, v, causal=causal, scale=case.scale, mask=mask, layout=case.layout, return_lse=True
    )
    out = host_float32(out)
    if case.layout == "bshd":
        out = out.transpose(0, 2, 1, 3)
    assert_matches(out, lse.get(), data, dtype)
    assert list(tmp_path.rglob("*.json")), "the tuning record was not written"


def test_tuned_attention_with_every_variant_is_correct(monkeypatch, tmp_path):
    """attention() with every built-in variant and no spec tunes: the bench runs each
    candidate with the variants' values (the per-head sinks and slopes once went to the kernels
    as null pointers) and checks it against float64; the winner is correct with the call's."""
    import kernelgen.tuning

    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "1")
    kernelgen.tuning.clear_memo()
    case = Case(2, 4, 2, 300, 333)
    flags = ("window", "softcap", "alibi", "sinks")
    variants = example_variants(flags, case.batch, case.heads, 11, window=(100, 7))
    data = make_case(case, "bfloat16", 128, True, 11, variants)
    q, k, v = (device_array(getattr(data, n), "bfloat16", "bhsd") for n in "qkv")
    out, lse = kernelgen.attention(
        q, k, v, causal=True, return_lse=True, **device_variants(variants)
    )
    assert_matches(host_float32(out), lse.get(), data, "bfloat16")
    (record,) = [r for _, r in kernelgen.tuning.TuningDB(tmp_path).records()]
    assert record is not None and record.winner.get("sinks") and record.winner.get("alibi")


# ---- split-KV decode -----------------------------------------------------------------------

SPLIT_PATHS = [p for p in SPEC_PATHS if load_spec(p).split_kv]
DECODE_CASES = [
    Case(2, 8, 8, 1, 1000),  # MHA decode
    Case(3, 32, 8, 1, 16384 + 77),  # GQA 4, a length that is no multiple of any tile
    Case(1, 16, 1, 4, 5000, mask="full"),  # MQA, 4 new tokens (causal specs: a diagonal)
    Case(2, 8, 2, 16, 777, layout="bshd"),  # 16 queries x GQA 4 = 64 packed rows
    Case(1, 4, 4, 1, 1),
]


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
@pytest.mark.parametrize("path", SPLIT_PATHS, ids=lambda p: p.stem)
def test_split_kv_decode_on_gpu(path, case, num_splits):
    spec = load_spec(path)
    seed = zlib.crc32(f"{path.stem} {case}".encode())
    data, options = decode_case(spec, case, seed)
    out, lse = run(spec, case, data, num_splits=num_splits, **options)
    assert_matches(out, lse, data, spec.dtype)


def decode_case(spec, case: Case, seed: int):
    """The case's data and the variant arguments a split spec compiled with variants needs
    (example values; the reference applies them)."""
    variants = example_variants(spec.variants, case.batch, case.heads, seed, window=(100, 7))
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed, variants)
    return data, device_variants(variants)


@pytest.mark.parametrize("path", SPLIT_PATHS, ids=lambda p: p.stem)
def test_every_split_count_from_1_to_64_on_gpu(path):
    """Split counts 1..64, every one: a causal 3-query step on 2011 keys (32 or 63
    key tiles, so the larger counts leave chunks empty)."""
    spec = load_spec(path)
    case = Case(1, 8, 2, 3, 2011)
    data, options = decode_case(spec, case, seed=len(path.stem))
    for num_splits in range(1, 65):
        out, lse = run(spec, case, data, num_splits=num_splits, **options)
        assert_matches(out, lse, data, spec.dtype)


@pytest.mark.parametrize("host", [True, False], ids=["host-list", "device-int32"])
@pytest.mark.parametrize("path", SPLIT_PATHS, ids=lambda p: p.stem)
def test_seqlens_k_with_zeros_and_ones_on_gpu(path, host):
    import cupy

    spec = load_spec(path)
    case = Case(5, 8, 2, 2, 3000)
    lengths = [0, 1, 3000, 2999, 65]
    seed = len(path.stem)
    variants = example_variants(spec.variants, case.batch, case.heads, seed, window=(100, 7))
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed, variants)
    ref = naive_attention(data.q, data.k, data.v, causal=spec.causal, seqlens_k=lengths, **variants)
    data = dataclasses.replace(data, ref_out=ref[0], ref_lse=ref[1])
    seqlens = lengths if host else cupy.asarray(lengths, dtype=cupy.int32)
    for num_splits in (1, 5, 64):
        out, lse = run(
            spec, case, data, num_splits=num_splits, seqlens_k=seqlens, **device_variants(variants)
        )
        assert_matches(out, lse, data, spec.dtype)


def test_decode_at_128k_keys():
    spec = load_spec(next(p for p in SPLIT_PATHS if load_spec(p).head_dim == 128))
    case = Case(1, 8, 2, 1, 131072)
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed=128)
    out, lse = run(spec, case, data)  # the heuristic split count
    assert_matches(out, lse, data, spec.dtype)


@pytest.mark.parametrize(
    "case",
    [Case(4, 32, 8, 1, 8192 + 5), Case(1, 32, 1, 16, 5000)],  # the second: 512 packed rows
    ids=["gqa4-sq1", "mqa-sq16"],
)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_default_decode_path_on_gpu(dtype, case, monkeypatch):
    """Without a spec, a decode shape gets a split-KV kernel (packed on the tensor cores, in
    several 64-row tiles past 64 rows; the CUDA-core one for float32) and a heuristic count."""
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "0")
    data = make_case(case, dtype, 128, False, seed=9)
    q, k, v = (device_array(getattr(data, n), dtype, "bhsd") for n in "qkv")
    out, lse = kernelgen.attention(q, k, v, return_lse=True)
    assert_matches(host_float32(out), lse.get(), data, dtype)
    out, lse = kernelgen.attention(q, k, v, return_lse=True, num_splits=16)
    assert_matches(host_float32(out), lse.get(), data, dtype)


def test_tuned_decode_is_correct(monkeypatch, tmp_path):
    """attention() tunes a decode shape (split counts among the candidates) and is correct."""
    import kernelgen.tuning

    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "1")
    kernelgen.tuning.clear_memo()
    case = Case(1, 32, 8, 1, 32768)
    data = make_case(case, "float16", 128, False, seed=32)
    q, k, v = (device_array(getattr(data, n), "float16", "bhsd") for n in "qkv")
    out, lse = kernelgen.attention(q, k, v, return_lse=True)
    assert_matches(host_float32(out), lse.get(), data, "float16")
    # 8 K/V heads cannot fill the GPU unsplit: the winner is a split-KV launch with its count
    (record,) = [r for _, r in kernelgen.tuning.TuningDB(tmp_path).records()]
    assert record is not None and record.winner["split_kv"] and record.winner_splits > 1


def test_selfcheck_passes(capsys):
    """`python -m kernelgen.selfcheck` (what compute-sanitizer runs) passes on this GPU."""
    from kernelgen.selfcheck import main

    assert main([]) == 0, capsys.readouterr().out
