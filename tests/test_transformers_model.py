"""A real client end to end: a small Llama-architecture transformers model (random weights,
nothing downloaded; GQA, 2 layers, head_dim 16) in float32 on the CPU with
``attn_implementation="kernelgen"`` (kernelgen.integrations.transformers: the emulator runs the
generated kernels) against ``"eager"``: logits of prefill with and without left padding, and
greedy ``generate()`` with the KV cache (decode steps)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
integration = pytest.importorskip("kernelgen.integrations.transformers")  # registers "kernelgen"

from kernelgen.reference import OUT_TOLERANCE  # noqa: E402

pytestmark = [
    pytest.mark.model,
    pytest.mark.emulate,
    pytest.mark.filterwarnings("ignore::kernelgen.errors.CPUBackendWarning"),
]


@pytest.fixture(scope="module")
def models():
    """The same random Llama twice: eager attention and kernelgen's."""
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    eager, ours = (
        transformers.LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=name)
        for name in ("eager", "kernelgen")
    )  # a config each: a model sets its attention implementation on its config
    ours.load_state_dict(eager.state_dict())
    assert eager.config._attn_implementation == "eager"
    assert ours.config._attn_implementation == "kernelgen"
    return eager.eval(), ours.eval()


@pytest.fixture
def calls(monkeypatch):
    """Each kernelgen call the model makes: (Sq, Sk, causal, mask given)."""
    made = []

    def counted(q, k, v, *, causal, scale, mask):
        made.append((q.shape[2], k.shape[2], causal, mask is not None))
        assert k.shape[1] == 2 and q.shape[1] == 4  # GQA reaches kernelgen unrepeated
        return attention(q, k, v, causal=causal, scale=scale, mask=mask)

    attention = integration.attention
    monkeypatch.setattr(integration, "attention", counted)
    return made


def batch(padded: bool) -> dict:
    """Two sequences of 9 tokens; with ``padded`` the second is 6 tokens left-padded by 3."""
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :3], mask[1, :3] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().numpy(), want.double().numpy()
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "left-padded"])
def test_prefill_logits_match_eager(models, calls, padded):
    eager, ours = models
    inputs = batch(padded)
    with torch.no_grad():
        want = eager(**inputs).logits
        got = ours(**inputs).logits
    real = inputs["attention_mask"].bool()  # padded positions' outputs are not compared
    error = relative_error(got[real], want[real])
    assert error <= OUT_TOLERANCE["float32"], f"logits relative error {error:.3g}"
    # no padding: no mask, kernelgen's causal flag; padding: transformers' mask, not causal
    assert calls == [(9, 9, not padded, padded)] * 2


def test_greedy_generate_with_the_kv_cache_gives_eager_tokens(models, calls):
    eager, ours = models
    inputs = batch(padded=True)
    options = dict(max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    want = eager.generate(**inputs, **options)
    got = ours.generate(**inputs, **options)
    assert want.shape == (2, 13)
    assert torch.equal(got, want), f"{got.tolist()} != {want.tolist()}"
    # prefill, then one query per step against the cache (2 layers each)
    assert [(sq, sk) for sq, sk, _, _ in calls] == [(9, 9)] * 2 + [
        (1, n) for n in (10, 11, 12) for _ in range(2)
    ]
