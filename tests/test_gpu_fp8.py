"""GPU tier: the fp8 (e4m3) wgmma forward on a compute capability 9.0 device, against the
float64 reference of the quantized inputs with the error bound that tests/test_emulated_fp8.py
derives and asserts on the emulator (docs/hopper.md, "fp8"). The kernel is launched through
its RuntimeKernel with the arguments the emulated run passes: e4m3 bit patterns, V as the V^T
operand (kernelgen.runtime.fp8.v_operand), fp32 descales per (batch, kv head), bf16 out; and
the autotuner timing the fp8 loops (kernelgen.tuning.fp8_bench) for a call that reads its
record.

One figure differs from the emulator's: the H100 accumulates the fp8 products of Q K^T with
fewer bits than fp32 (DeepSeek-V3's report measured about 14 kept bits on Hopper), so the
scores, and with them lse, carry an error that the emulator's exact fp32 accumulation does not
have (run 5 of 2026-11-26 measured lse up to 6.5e-3 from float64, the emulator 1e-4). The lse
check bounds each row's error by that of its largest score, 2^-9 (5 bits fewer than the
reported 14) of the score's products' absolute sum; the outputs keep the emulated bound, whose
2^-4 weight term dominates.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_emulated_fp8 import FP8_SPEC_PATHS, SHAPES, bound_ratio, fp8_spec, problem, reference
from test_emulated_fp8_dims import CASES as DIM_CASES
from test_emulated_fp8_loops import LOOPS
from test_gpu_attention import require_compute_capability_9_0

import kernelgen
from kernelgen.references.fp8 import fp8_reference
from kernelgen.runtime.fp8 import decode_e4m3, launch_problem, v_operand
from kernelgen.runtime.launch import runtime_kernel
from kernelgen.specs.forward import load_spec, spec_from_dict

pytestmark = pytest.mark.gpu


def run_on_gpu(spec, shape, seed):
    """The spec's kernel through its RuntimeKernel on an fp8 problem with descales (out and lse
    start as NaN), checked against the bound and the lse's."""
    import cupy

    batch, heads, _, seqlen_q, _ = shape
    d = spec.head_dim
    q, k, v, descales = problem(seed, *shape, head_dim=d)
    scale = d**-0.5
    v_t = v_operand(v)
    tensors = {
        "q": cupy.asarray(q),
        "k": cupy.asarray(k),
        "v": cupy.asarray(v_t),
        **{name: cupy.asarray(x) for name, x in descales.items()},
        "out": cupy.full((batch, heads, seqlen_q, d), 0xFFFF, dtype=cupy.uint16),  # NaN
        "lse": cupy.full((batch, heads, seqlen_q), np.nan, dtype=cupy.float32),
    }
    run = launch_problem(q, k, v_t)
    runtime_kernel(spec)(tensors, run, scale)
    bits = tensors["out"].get().astype(np.uint32) << 16
    out = bits.view(np.float32).astype(np.float64)
    ref, lse_ref, a, b = reference(q, k, v, descales, spec.causal, scale)
    assert np.isfinite(out).all()
    assert bound_ratio(out, ref, a, b) <= 1.0
    lse_error = np.abs(tensors["lse"].get() - lse_ref)  # NaN (never written) fails the test
    assert (lse_error <= score_error_bound(q, k, descales, scale)).all()


# The shipped fp8 specs and their TMA-store epilogue twins, where the head dim has one (d64's
# 64-byte Q rows have none: docs/hopper.md).
SPEC_EPILOGUES = [
    (path, epilogue)
    for path in FP8_SPEC_PATHS
    for epilogue in ("direct", "tma")
    if epilogue == "direct" or load_spec(path).qk_row_bytes == 128
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_h{}_hkv{}_sq{}_sk{}".format(*s))
@pytest.mark.parametrize(("path", "epilogue"), SPEC_EPILOGUES, ids=lambda x: getattr(x, "stem", x))
def test_fp8_wgmma_spec_on_gpu(path, shape, epilogue):
    """The shipped fp8 specs, and their TMA-store epilogue twins (docs/hopper.md)."""
    require_compute_capability_9_0()
    spec = spec_from_dict({**load_spec(path).model_dump(), "epilogue": epilogue})
    run_on_gpu(spec, shape, seed=len(path.stem) + shape[4])


@pytest.mark.parametrize("loop", LOOPS)
def test_fp8_loops_causal_on_gpu(loop):
    """Each loop of tests/test_emulated_fp8_loops.py (Q in registers, the overlap with and
    without it, ping-pong), causal with GQA, as the emulated test runs it."""
    require_compute_capability_9_0()
    run_on_gpu(fp8_spec(causal=True, **LOOPS[loop]), SHAPES[0], seed=7 + SHAPES[0][4])


@pytest.mark.parametrize("case", DIM_CASES)
def test_fp8_head_dims_causal_on_gpu(case):
    """tests/test_emulated_fp8_dims.py's causal cases at d64 (64-key tiles, Q in registers)
    and d256 (ping-pong), GQA with lengths off the tiles."""
    require_compute_capability_9_0()
    run_on_gpu(fp8_spec(causal=True, **DIM_CASES[case]), SHAPES[0], seed=5)


SCORE_ACCUMULATION = 2.0**-9  # relative to a score's products' absolute sum (see the top)


def score_error_bound(q, k, descales, scale: float) -> np.ndarray:
    """Per row (B, H, Sq): 2^-9 of the largest sum_d |q_d k_d| scale qd kd over the keys, plus
    1e-4 for the fp32 softmax (the emulated tolerance)."""
    group = q.shape[1] // k.shape[1]
    qf, kf = decode_e4m3(q), np.repeat(decode_e4m3(k), group, axis=1)
    factor = scale * np.ones(k.shape[:2])
    for name in ("q_descale", "k_descale"):
        if name in descales:
            factor = factor * descales[name]
    factor = np.repeat(factor, group, axis=1)[:, :, None, None]
    sums = np.abs(qf) @ np.abs(kf).transpose(0, 1, 3, 2) * factor
    return SCORE_ACCUMULATION * sums.max(-1) + 1e-4


# kernelgen.attention on torch CUDA float8_e4m3fn tensors: the same bound, through the public
# call (V^T built on the device by torch, descales as CUDA float32 tensors, bf16 out in the
# call's layout). (descales, causal, layout) per case, on both SHAPES.
API_CASES = [(True, False, "bhsd"), (True, True, "bshd"), (False, True, "bhsd")]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_h{}_hkv{}_sq{}_sk{}".format(*s))
@pytest.mark.parametrize(("with_descales", "causal", "layout"), API_CASES)
def test_fp8_through_kernelgen_attention_on_gpu(shape, with_descales, causal, layout):
    require_compute_capability_9_0()
    torch = pytest.importorskip("torch")

    q, k, v, descales = problem(7 + shape[4], *shape, descales=with_descales)
    scale = 128**-0.5

    def cuda_fp8(bits):
        tensor = torch.from_numpy(bits).cuda().view(torch.float8_e4m3fn)
        return tensor.transpose(1, 2) if layout == "bshd" else tensor  # (B, S, H, D) views

    scales = {name: torch.from_numpy(x).cuda() for name, x in descales.items()}
    out, lse = kernelgen.attention(
        *(cuda_fp8(x) for x in (q, k, v)),
        causal=causal,
        layout=layout,
        return_lse=True,
        **scales,
    )
    assert out.dtype == torch.bfloat16 and out.is_cuda and lse.dtype == torch.float32
    got = out.float().cpu().numpy().astype(np.float64)
    if layout == "bshd":
        got = got.transpose(0, 2, 1, 3)
    ref, lse_ref, a, b = reference(q, k, v, descales, causal, scale)
    assert np.isfinite(got).all()
    assert bound_ratio(got, ref, a, b) <= 1.0
    lse_error = np.abs(lse.cpu().numpy() - lse_ref)
    assert (lse_error <= score_error_bound(q, k, descales, scale)).all()


# The variants and seqlens_k (tests/test_emulated_fp8_variants.py's cases) on CUDA tensors:
# (spec fields, variants, seqlens_k or None, causal).
VARIANT_CASES = {
    "causal_window_softcap_sinks": (
        {"window": True, "softcap": True, "sinks": True},
        {"window_size": (9, 0), "softcap": 2.0, "sinks": np.linspace(3.0, 5.0, 4)},
        None,
        True,
    ),
    "seqlens_k_nan_rows_alibi": (
        {"alibi": True},
        {"alibi_slopes": np.array([0.2, 0.05, 0.1, 0.4])},
        [97, 133],
        False,
    ),
}


@pytest.mark.parametrize("case", VARIANT_CASES)
def test_fp8_variants_and_seqlens_k_on_gpu(case):
    """kernelgen.attention on CUDA fp8 tensors with the variants (device arrays) and an int32
    device seqlens_k whose rows past each length hold NaN in k and v (the V^T copy zeroes them
    on the device): the bound and the lse's, as above."""
    require_compute_capability_9_0()
    torch = pytest.importorskip("torch")
    fields, variants, lengths, causal = VARIANT_CASES[case]
    q, k, v, descales = problem(21, 2, 4, 2, 70, 160)
    clean_k = k.copy()
    for b, length in enumerate(lengths or []):
        k[b, :, length:] = v[b, :, length:] = 0x7F  # e4m3 NaN
        clean_k[b, :, length:] = 0
    variants = {n: x.astype(np.float32) if isinstance(x, np.ndarray) else x
                for n, x in variants.items()}  # fmt: skip
    scale = 128**-0.5
    on_gpu = {n: torch.from_numpy(x).cuda() if isinstance(x, np.ndarray) else x
              for n, x in {**descales, **variants}.items()}  # fmt: skip
    if lengths is not None:
        on_gpu["seqlens_k"] = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = kernelgen.attention(
        *(torch.from_numpy(x).cuda().view(torch.float8_e4m3fn) for x in (q, k, v)),
        causal=causal, return_lse=True, spec=fp8_spec(causal=causal, **fields), **on_gpu,
    )  # fmt: skip
    got = out.float().cpu().numpy().astype(np.float64)
    ref = fp8_reference(q, k, v, descales, causal=causal, scale=scale, seqlens_k=lengths,
                        **variants)  # fmt: skip
    assert np.isfinite(got).all()
    assert ref.bound_ratio(got) <= 1.0
    lse_error = np.abs(lse.cpu().numpy() - ref.lse)
    assert (lse_error <= score_error_bound(q, clean_k, descales, scale)).all()


def test_fp8_through_the_compiled_torch_op_on_gpu():
    """torch.ops.kernelgen.attention on CUDA float8_e4m3fn tensors inside
    torch.compile(fullgraph=True): the bound, as through kernelgen.attention."""
    require_compute_capability_9_0()
    torch = pytest.importorskip("torch")
    kt = pytest.importorskip("kernelgen.torch_ops")
    shape = SHAPES[0]
    q, k, v, descales = problem(17, *shape)
    scale = 128**-0.5
    inputs = [torch.from_numpy(x).cuda().view(torch.float8_e4m3fn) for x in (q, k, v)]
    scales = {name: torch.from_numpy(x).cuda() for name, x in descales.items()}

    def fn(q, k, v, q_descale, k_descale, v_descale):
        out, lse = kt.attention(
            q, k, v, causal=True, return_lse=True, q_descale=q_descale, k_descale=k_descale,
            v_descale=v_descale,
        )  # fmt: skip
        return out.float(), lse

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out, lse = compiled(*inputs, **scales)
    got = out.cpu().numpy().astype(np.float64)
    ref, lse_ref, a, b = reference(q, k, v, descales, True, scale)
    assert np.isfinite(got).all()
    assert bound_ratio(got, ref, a, b) <= 1.0
    lse_error = np.abs(lse.cpu().numpy() - lse_ref)
    assert (lse_error <= score_error_bound(q, k, descales, scale)).all()


def test_v_operand_built_on_the_device_matches_the_host_copy():
    """fp8.v_operand on a CUDA uint8 tensor (a strided (B, S, H, D) view's swap, as
    kernelgen.attention passes a bshd v) is byte for byte the NumPy one."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    rng = np.random.default_rng(8)
    v = rng.integers(0, 256, (2, 37, 3, 128), dtype=np.uint8)  # (B, Sk, Hkv, D)
    on_device = v_operand(torch.from_numpy(v).cuda().swapaxes(1, 2))
    assert on_device.is_cuda and on_device.is_contiguous()
    np.testing.assert_array_equal(on_device.cpu().numpy(), v_operand(v.transpose(0, 2, 1, 3)))


def assert_every_candidate_ran(candidates: list[dict]) -> None:
    """A tuning record's candidates all ran: timed in full, or timed in the short screen and
    left behind ("screened"); none failed or was rejected, and exactly one is the winner (a
    decode spec appears once per split count, so count over the list, not by URI)."""
    statuses = [c["status"] for c in candidates]
    assert set(statuses) <= {"winner", "timed", "screened"}, candidates
    assert statuses.count("winner") == 1, candidates


def test_fp8_tuning_on_gpu(tmp_path, monkeypatch):
    """The fp8 loops timed by the real Fp8Bench (torch e4m3 inputs, descales, V^T): every
    candidate runs and passes its check, the record holds the winner, and an fp8 call of the
    same bucket finds it (KERNELGEN_AUTOTUNE=offline: only a record can answer) and stays within
    the bound."""
    require_compute_capability_9_0()
    torch = pytest.importorskip("torch")
    from kernelgen.tuning import ProblemDesc, TuningDB, clear_memo, make_key, select_launch
    from kernelgen.tuning.candidates import valid_candidates
    from kernelgen.tuning.gpu import detect_device, detect_software

    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path))
    clear_memo()
    try:
        p = ProblemDesc("float8_e4m3", 2, 8, 4, 1024, 1024, 128, causal=True)
        device = detect_device()
        launch = select_launch(p, device, mode="on")
        record = TuningDB().load(make_key(p, device, detect_software()))
        assert record is not None and record.winner == launch.spec.model_dump(mode="json")
        uris = {s.uri for s in valid_candidates(p, device.target_arch)[0]}
        timed = {c["uri"] for c in record.candidates}
        # every valid candidate is timed or dropped by a static stage (the model keeps its best)
        assert timed | {d["uri"] for d in record.dropped} == uris and launch.spec.uri in timed
        assert_every_candidate_ran(record.candidates)
        assert record.winner_ms is not None and record.winner_ms > 0
        # a call of the same bucket (GQA 2, 1000 queries and keys) runs the recorded winner
        q, k, v, descales = problem(23, 2, 8, 4, 1000, 1000)
        monkeypatch.setenv("KERNELGEN_AUTOTUNE", "offline")
        out = kernelgen.attention(
            *(torch.from_numpy(x).cuda().view(torch.float8_e4m3fn) for x in (q, k, v)),
            causal=True,
            **{name: torch.from_numpy(x).cuda() for name, x in descales.items()},
        )
        got = out.float().cpu().numpy().astype(np.float64)
        ref, _, a, b = reference(q, k, v, descales, True, 128**-0.5)
        assert np.isfinite(got).all() and bound_ratio(got, ref, a, b) <= 1.0
    finally:
        clear_memo()


def test_fp8_paged_decode_tuning_on_gpu(tmp_path, monkeypatch):
    """The decode grid's fp8 forms timed by the real Fp8Bench on a paged problem of 48-key
    pages (row copies at both tiles): every launch kept runs and passes its check (split
    counts included), and the record's winner is an fp8 paged spec."""
    require_compute_capability_9_0()
    pytest.importorskip("torch")
    from kernelgen.tuning import ProblemDesc, TuningDB, clear_memo, make_key, select_launch
    from kernelgen.tuning.gpu import detect_device, detect_software

    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path))
    clear_memo()
    try:
        p = ProblemDesc("float8_e4m3", 4, 32, 8, 1, 4096, 128, page_size=48)
        device = detect_device()
        launch = select_launch(p, device, mode="on")
        record = TuningDB().load(make_key(p, device, detect_software()))
        assert record is not None and launch.spec.fp8 and launch.spec.paged_kv
        assert_every_candidate_ran(record.candidates)
    finally:
        clear_memo()


@pytest.mark.parametrize("named", [True, False], ids=["shipped-spec", "default-spec"])
def test_fp8_block_sparse_document_mask_on_gpu(named):
    """kernelgen.attention on CUDA fp8 tensors with a causal document mask and its block mask
    built on the device (tests/test_emulated_fp8_block_sparse.py's case: partly, fully and not
    visible tiles, GQA): the shipped spec, and without a spec the default fp8 spec made
    block-sparse in the mask's 128 x 128 tiles; the bound and the lse's, as above."""
    from test_emulated_expressions import _callables
    from test_emulated_fp8_block_sparse import DOC_SHAPE, DOCS, SPEC

    require_compute_capability_9_0()
    torch = pytest.importorskip("torch")
    batch, heads, kv_heads, seqlen = DOC_SHAPE
    q, k, v, descales = problem(21, batch, heads, kv_heads, seqlen, seqlen)
    inputs = {"doc": torch.from_numpy(DOCS).cuda()}
    mask = kernelgen.block_mask(SPEC.mask_mod, batch, 1, seqlen, seqlen, block_m=128,
                                block_n=128, mod_inputs=inputs)  # fmt: skip
    out, lse = kernelgen.attention(
        *(torch.from_numpy(x).cuda().view(torch.float8_e4m3fn) for x in (q, k, v)),
        causal=True, return_lse=True, spec=SPEC if named else None, mask_mod=SPEC.mask_mod,
        mod_inputs=inputs, block_mask=mask,
        **{n: torch.from_numpy(x).cuda() for n, x in descales.items()},
    )  # fmt: skip
    scale = 128**-0.5
    hooks = _callables(None, SPEC.mask_mod, {"doc": DOCS})
    ref = fp8_reference(q, k, v, descales, causal=True, scale=scale, **hooks)
    got = out.float().cpu().numpy().astype(np.float64)
    assert np.isfinite(got).all()
    assert ref.bound_ratio(got) <= 1.0
    lse_error = np.abs(lse.cpu().numpy() - ref.lse)
    assert (lse_error <= score_error_bound(q, k, descales, scale)).all()


@pytest.mark.parametrize("page_size", [0, 64, 16], ids=["contiguous", "paged64", "paged16"])
def test_fp8_serving_decode_through_attention_with_kvcache_on_gpu(page_size, monkeypatch):
    """attention_with_kvcache on CUDA e4m3 caches (bshd, rows past each length NaN) with
    descales: the fp8 decode default (split-KV, packed GQA, V transposed in the kernel; untuned),
    the cache read in place; contiguous, and paged in shuffled 64-key pages (one TMA copy per
    tile) and 16-key pages (cp.async row copies). The bound and the lse's, as above."""
    require_compute_capability_9_0()
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "0")  # the default spec, not the tuner's
    torch = pytest.importorskip("torch")
    lengths = [170, 259]
    q, k, v, descales = problem(4, 2, 8, 2, 1, 320)
    clean_k = k.copy()
    for b, length in enumerate(lengths):
        k[b, :, length:] = v[b, :, length:] = 0x7F  # e4m3 NaN
        clean_k[b, :, length:] = 0

    def cuda_bshd(x):  # (B, H, S, D) bytes -> (B, S, H, D) float8_e4m3fn on the GPU
        rows = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
        return torch.from_numpy(rows).cuda().view(torch.float8_e4m3fn)

    k_cache, v_cache = cuda_bshd(k), cuda_bshd(v)
    extra = {}
    if page_size:  # 320 keys per entry in pages of page_size, in shuffled order
        page, pages = page_size, 320 // page_size
        order = np.random.default_rng(3).permutation(2 * pages)
        table = order.reshape(2, pages).astype(np.int32)
        pool_k = torch.empty((2 * pages, page, 2, 128), dtype=torch.uint8, device="cuda")
        pool_v = torch.empty_like(pool_k)
        for b in range(2):
            for j in range(pages):
                rows = slice(j * page, (j + 1) * page)
                pool_k[table[b, j]] = k_cache[b, rows].view(torch.uint8)
                pool_v[table[b, j]] = v_cache[b, rows].view(torch.uint8)
        k_cache, v_cache = (x.view(torch.float8_e4m3fn) for x in (pool_k, pool_v))
        extra["block_table"] = torch.from_numpy(table).cuda()
    on_gpu = {n: torch.from_numpy(x).cuda() for n, x in descales.items()}
    out, lse = kernelgen.attention_with_kvcache(
        cuda_bshd(q), k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32, device="cuda"),
        causal=True, return_lse=True, **extra, **on_gpu,
    )  # fmt: skip
    assert out.dtype == torch.bfloat16
    got = out.float().cpu().numpy().transpose(0, 2, 1, 3).astype(np.float64)
    scale = 128**-0.5
    ref = fp8_reference(q, k, v, descales, causal=True, scale=scale, seqlens_k=lengths)
    assert np.isfinite(got).all()
    assert ref.bound_ratio(got) <= 1.0
    lse_error = np.abs(lse.cpu().numpy() - ref.lse)
    assert (lse_error <= score_error_bound(q, clean_k, descales, scale)).all()
