"""A real client end to end: a small Llama-architecture transformers model (random weights,
nothing downloaded; GQA, 2 layers, head_dim 16) in float32 on the CPU with
``attn_implementation="kernelgen"`` (kernelgen.integrations.transformers: the emulator runs the
generated kernels) against ``"eager"``: logits of prefill with and without left padding,
greedy ``generate()`` with the KV cache (decode steps), and a training step's loss and parameter
gradients (torch autograd through ``torch.ops.kernelgen.attention``'s backward)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
integration = pytest.importorskip("kernelgen.integrations.transformers")  # registers "kernelgen"

from kernelgen.references.attention import OUT_TOLERANCE  # noqa: E402

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


def training_batch(kind: str) -> dict:
    """A batch with labels: ``left-padded`` (the second sequence left-padded by 3, its padding
    and its first real token unlabelled: a padded query row sees no key, so its output, which
    predicts that token, differs between implementations by design), ``right-padded`` or
    ``packed`` (two documents in one row: without an attention_mask and a cache, transformers
    derives a block-diagonal causal mask from the restarting position_ids)."""
    if kind == "packed":
        ids = batch(padded=False)["input_ids"][:1]
        positions = torch.tensor([[*range(4), *range(5)]])
        # no cache: transformers looks for packed sequences only without one
        return {"input_ids": ids, "labels": ids, "position_ids": positions, "use_cache": False}
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    pads = slice(0, 3) if kind == "left-padded" else slice(6, 9)
    ids[1, pads], mask[1, pads] = 0, 0
    labels = ids.masked_fill(mask == 0, -100)
    if kind == "left-padded":
        labels[1, 3] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("kind", ["left-padded", "right-padded", "packed"])
def test_a_training_step_matches_eager(models, calls, kind):
    """One step of training (model.train(), loss.backward()): the same loss and the same
    gradient in every parameter (relative Frobenius error at fp32 tolerance)."""
    inputs = training_batch(kind)
    losses, grads = [], []
    for model in models:
        model.train()
        model.zero_grad(set_to_none=True)
        try:
            loss = model(**inputs).loss
            loss.backward()
        finally:
            model.eval()
        losses.append(loss.item())
        grads.append({name: p.grad for name, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    want, got = grads
    assert got.keys() == want.keys()
    assert abs(losses[1] - losses[0]) <= 1e-5 * abs(losses[0]), losses
    errors = {name: relative_error(got[name], want[name]) for name in want}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= OUT_TOLERANCE["float32"], f"{worst}: relative error {errors[worst]:.3g}"
    assert [c[3] for c in calls] == [True] * 2  # a mask (padding, documents) in every layer
