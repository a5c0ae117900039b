"""logprobs.py: the one definition of the policy's log-probs and entropy (tempered, float64) --
closed forms, stability, the temperature -- and the chunked computation every caller uses, equal to
it on each model layout, the ones whose forward changes the logits after the output layer among
them."""
import math

import pytest
import torch

import logprobs
from logprobs import token_entropy, token_logprobs


def test_token_logprobs_example_and_reference():
    lp = token_logprobs(torch.tensor([[[0.0, math.log(3.0)]]]), torch.tensor([[1]]))
    assert lp.item() == pytest.approx(math.log(0.75), abs=1e-6)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g)
    tokens = torch.randint(0, 7, (3, 5), generator=g)
    want = torch.log(torch.softmax(logits, -1)).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(token_logprobs(logits, tokens), want.double())


def test_token_logprobs_stable_at_large_scale():
    logits = torch.tensor([[[1e4, 0.0, -1e4]]])
    lp = token_logprobs(logits, torch.tensor([[1]]))
    assert lp.item() == pytest.approx(-1e4)   # exactly 0 - 1e4; a naive softmax would give -inf


def test_token_logprobs_misaligned_raises():
    with pytest.raises(ValueError, match="aligned"):
        token_logprobs(torch.zeros(1, 4, 5), torch.zeros(1, 3, dtype=torch.long))


def test_entropy_closed_form():
    assert token_entropy(torch.zeros(1, 1, 4)).item() == pytest.approx(math.log(4))
    g = torch.Generator().manual_seed(1)
    p = torch.rand(2, 3, 6, generator=g, dtype=torch.float64) + 0.01
    p = p / p.sum(-1, keepdim=True)
    logits = torch.log(p) + 5.0                   # any shift gives the same softmax
    want = -(p * torch.log(p)).sum(-1)
    torch.testing.assert_close(token_entropy(logits), want, atol=1e-10, rtol=1e-10)
    # peaked distributions stay finite and accurate (exact value from the float64 probabilities)
    for z in (20.0, 100.0):
        q = torch.softmax(torch.tensor([z, 0.0, 0.0], dtype=torch.float64), -1)
        exact = -(q * torch.log(q)).sum().item()
        h = token_entropy(torch.tensor([[[z, 0.0, 0.0]]])).item()
        assert math.isfinite(h) and h == pytest.approx(exact, abs=1e-6)


def test_the_temperature_divides_the_logits_and_must_be_positive():
    g = torch.Generator().manual_seed(2)
    logits, tokens = torch.randn(2, 3, 5, generator=g), torch.randint(0, 5, (2, 3), generator=g)
    torch.testing.assert_close(token_logprobs(logits, tokens, 0.5), token_logprobs(2 * logits, tokens))
    torch.testing.assert_close(token_entropy(logits, 0.5), token_entropy(2 * logits))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(logits, tokens, 0.0)


def softcapped_or_scaled(kind):
    """A tiny random model of a layout whose forward changes the logits after its output layer,
    with weights large enough that the change matters (logits of tens, as trained models have)."""
    import transformers
    small = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 max_position_embeddings=64)
    config = {"gemma2": lambda: transformers.Gemma2Config(**small, final_logit_softcapping=5.0),
              "gemma3": lambda: transformers.Gemma3TextConfig(**small, final_logit_softcapping=5.0),
              "cohere": lambda: transformers.CohereConfig(**small, logit_scale=0.25),
              "granite": lambda: transformers.GraniteConfig(**small, logits_scaling=4.0)}[kind]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(60.0)
    return model


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "cohere", "granite"])
def test_the_chunks_score_what_the_models_own_forward_gives(kind):
    """The update and the diagnosis score through the output layer in chunks (head_logprobs); a
    model whose forward soft-caps or scales the logits after it was once scored with the bare
    layer: 130 nats off on a Gemma 2 with logits of a realistic size, silently. Here every
    position's log-prob and entropy equal the definition on the model's own logits, with and
    without a temperature, and would not without the change (the bare layer is far off)."""
    model = softcapped_or_scaled(kind)
    ids = torch.randint(1, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8)
    with torch.no_grad():
        full = model(input_ids=ids).logits[:, :-1]                             # [2, 8, V]
        bare = model.get_output_embeddings()(model.get_decoder()(input_ids=ids)
                                             .last_hidden_state)[:, :-1]
        for temperature in (1.0, 0.7):
            logp, ent = logprobs.policy_logprobs(model, ids, mask, True, temperature,
                                                 chunk_elements=40 * 3, dtype=torch.float64)
            want = token_logprobs(full, ids[:, 1:], temperature)
            torch.testing.assert_close(logp, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ent, token_entropy(full, temperature), atol=1e-5, rtol=1e-5)
    assert (token_logprobs(bare, ids[:, 1:]) - want).abs().max() > 0.5  # the change matters here
