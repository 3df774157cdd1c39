"""The typed errors of an fp8 call of ``kernelgen.attention`` (docs/hopper.md, fp8), each raised
before anything is built or launched, and the spec choice: the policy's fp8 default is the
shipped fp8 spec, and the tuner takes no fp8 problem."""

from __future__ import annotations

import re
import types

import numpy as np
import pytest

import kernelgen
from kernelgen.errors import InputError, InputTypeError
from kernelgen.model.policy import default_spec, fp8_default_spec
from kernelgen.specs.forward import load_spec
from kernelgen.tuning.key import ProblemDesc

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this torch has no float8_e4m3fn", allow_module_level=True)

B, H, HKV, SQ, SK, D = 2, 4, 2, 8, 16, 128


def fp8_inputs(head_dim: int = D, library: str = "torch"):
    """q, k, v of zero bytes as fp8 (nothing runs: every case fails its checks)."""
    shapes = ((B, H, SQ, head_dim), (B, HKV, SK, head_dim), (B, HKV, SK, head_dim))
    bits = [np.zeros(shape, np.uint8) for shape in shapes]
    if library == "numpy":
        return [x.view(ml_dtypes.float8_e4m3fn) for x in bits]
    return [torch.from_numpy(x).view(torch.float8_e4m3fn) for x in bits]


def raises(error, message):
    return pytest.raises(error, match=re.escape(message))


@pytest.mark.parametrize(
    ("name", "value", "what"),
    [
        ("mask", np.zeros((SQ, SK), np.float32), "additive mask"),
        ("num_splits", 2, "split-KV form"),
    ],
)
def test_fp8_refuses_what_its_kernel_lacks(name, value, what):
    with raises(InputError, f"{name}=") as caught:
        kernelgen.attention(*fp8_inputs(), **{name: value})
    assert "is not allowed with fp8 inputs" in str(caught.value)
    assert what in str(caught.value)


def test_descales_need_fp8_inputs():
    q, k, v = (torch.zeros(shape, dtype=torch.bfloat16) for shape in ((1, 2, 8, 128),) * 3)
    with raises(InputTypeError, "q_descale is not allowed with non-fp8 inputs"):
        kernelgen.attention(q, k, v, q_descale=torch.ones(1, 2))


@pytest.mark.parametrize("other", ["k", "v"])
def test_fp8_q_with_non_fp8_k_or_v(other):
    q, k, v = fp8_inputs()
    named = {"q": q, "k": k, "v": v}
    named[other] = named[other].to(torch.bfloat16)
    with raises(InputTypeError, f"{other} has dtype bfloat16 but q has float8_e4m3fn"):
        kernelgen.attention(**named)


def test_non_fp8_q_with_fp8_v():
    q, k, v = fp8_inputs()
    with raises(InputTypeError, "q has dtype bfloat16 but v has float8_e4m3fn"):
        kernelgen.attention(q.to(torch.bfloat16), k.to(torch.bfloat16), v)


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_bytes_and_other_fp8_types_name_float8_e4m3fn(library):
    q, k, v = fp8_inputs(library=library)
    if library == "numpy":
        q, k, v = (x.view(np.uint8) for x in (q, k, v))
        message = "q has dtype uint8; fp8 attention takes float8_e4m3fn only"
    else:
        q, k, v = (x.view(torch.float8_e5m2) for x in (q, k, v))
        message = "q has dtype float8_e5m2; fp8 attention takes float8_e4m3fn only"
    with raises(InputTypeError, message) as caught:
        kernelgen.attention(q, k, v)
    assert "torch.float8_e4m3fn" in str(caught.value)
    assert "ml_dtypes.float8_e4m3fn" in str(caught.value)


def test_other_apis_refuse_fp8_naming_kernelgen_attention():
    """attention_varlen (packed (total, H, D) sequences) takes no fp8: its dtype error says where
    fp8 is taken."""
    q, k, v = (x[0].transpose(0, 1) for x in fp8_inputs())  # (S, H, D): one sequence
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32) for n in (SQ, SK))
    with raises(InputTypeError, "q has dtype float8_e4m3fn; allowed: float32, float16") as caught:
        kernelgen.attention_varlen(q, k, v, cu_q, cu_k, SQ, SK)
    assert "only in kernelgen.attention and attention_with_kvcache" in str(caught.value)


def test_fp8_head_dim_other_than_those_of_the_fp8_kernels():
    allowed = "use 64 or 96 or 128 or 192 or 256"
    with raises(InputError, f"head_dim=80 is not allowed with float8_e4m3 inputs; {allowed}"):
        kernelgen.attention(*fp8_inputs(head_dim=80))


def test_fp8_with_a_bf16_spec():
    spec = default_spec("bfloat16", D, False)
    with raises(InputError, "has dtype='bfloat16' but the call needs dtype='float8_e4m3'"):
        kernelgen.attention(*fp8_inputs(), spec=spec)


@pytest.mark.parametrize(
    ("descale", "error", "message"),
    [
        (np.ones((B, H), np.float32), InputError, f"k_descale has shape ({B}, {H}); expected "),
        (
            np.ones((B, HKV), np.int32),
            InputTypeError,
            "k_descale has dtype int32; expected float32",
        ),
    ],
)
def test_descale_shape_and_dtype(descale, error, message):
    with raises(error, message):
        kernelgen.attention(*fp8_inputs(library="numpy"), k_descale=descale)


def test_descales_on_another_device_than_q():
    q, k, v = fp8_inputs(library="numpy")
    with raises(InputTypeError, "v_descale is on"):
        kernelgen.attention(q, k, v, v_descale=_CudaLike())


class _CudaLike:
    """A float32 (B, Hkv) array that says it lives on CUDA device 0 (nothing reads it)."""

    shape, dtype = (B, HKV), np.dtype(np.float32)
    __module__ = "torch"
    device = types.SimpleNamespace(type="cuda", index=0)

    def detach(self):
        return self

    def to(self, dtype):
        return self

    def contiguous(self):
        return self

    is_cuda = True

    def get_device(self):
        return 0


def test_fp8_inputs_that_require_grad():
    q, k, v = fp8_inputs()
    q.requires_grad_(True)
    with raises(InputError, "q requires grad, but fp8 attention has no backward pass"):
        kernelgen.attention(q, k, v)
    sinks = torch.zeros(H, requires_grad=True)  # the sinks' gradient would be lost too
    with raises(InputError, "sinks requires grad, but fp8 attention has no backward pass"):
        kernelgen.attention(*fp8_inputs(), sinks=sinks)


def test_the_fp8_default_is_the_shipped_spec_and_the_tuner_takes_only_what_fp8_runs():
    for causal, path in ((False, "specs/v2_wg_e4m3_d128_m128_n128_s2.yaml"),
                         (True, "specs/v2_wg_e4m3_d128_m128_n128_s2_causal.yaml")):  # fmt: skip
        assert fp8_default_spec(D, causal) == load_spec(path)
        assert default_spec("float8_e4m3", D, causal) == load_spec(path)
    with raises(InputError, "split_kv=True is not allowed with dtype='float8_e4m3'"):
        default_spec("float8_e4m3", D, False, split_kv=True)
    assert ProblemDesc("float8_e4m3", B, H, HKV, SQ, SK, D).fp8  # tests/test_tuning_fp8.py
    for d, path in ((64, "specs/v2_wg_e4m3_d64_m128_n128_s2.yaml"),
                    (256, "specs/v2_wg_e4m3_d256_m128_n64_s2.yaml")):  # fmt: skip
        assert fp8_default_spec(d, False) == load_spec(path)
        assert ProblemDesc("float8_e4m3", B, H, HKV, SQ, SK, d).fp8
    allowed = "use 64 or 96 or 128 or 192 or 256"
    with raises(InputError, f"head_dim=80 is not allowed with dtype='float8_e4m3'; {allowed}"):
        ProblemDesc("float8_e4m3", B, H, HKV, SQ, SK, 80)


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"softcap": -1.0}, "softcap=-1.0 is not allowed; use a finite number > 0"),
        ({"window_size": (4,)}, "window_size=(4,) is not allowed; use a pair (left, right)"),
        ({"sinks": np.zeros(H + 1, np.float32)}, "sinks has shape (5,)"),
        ({"seqlens_k": [SK + 1, SK]}, f"seqlens_k holds {SK + 1}; allowed 0 to {SK}"),
    ],
)
@pytest.mark.filterwarnings("ignore::kernelgen.errors.CPUBackendWarning")
def test_fp8_variants_and_seqlens_k_are_checked_as_for_16_bit_calls(keywords, message):
    """The variants and seqlens_k an fp8 call takes get the 16-bit calls' typed errors, before
    anything is built (NumPy inputs: the emulator would build the kernel)."""
    with raises(InputError, message):
        kernelgen.attention(*fp8_inputs(library="numpy"), **keywords)


def test_a_named_fp8_spec_must_have_the_calls_variants():
    spec = fp8_default_spec(D, False)
    with raises(InputError, f"spec {spec.uri} is compiled with variants [none] but the call "
                "needs [softcap]"):  # fmt: skip
        kernelgen.attention(*fp8_inputs(), softcap=5.0, spec=spec)


def test_the_fp8_default_spec_has_the_calls_variants():
    spec = fp8_default_spec(D, True, ("window", "softcap", "sinks"))
    assert spec.variants == ("window", "softcap", "sinks") and spec.fp8 and spec.causal
    assert default_spec("float8_e4m3", D, True, variants=("alibi",)).variants == ("alibi",)
    with raises(InputError, "additive_mask=True is not allowed with dtype='float8_e4m3'"):
        default_spec("float8_e4m3", D, True, additive_mask=True)
