"""Tests of sampler.py: sampling-time log-probs and entropies equal a recomputed forward pass
(tempered, inside the nucleus); a later turn encodes only its new tokens; the growing cache holds
what concatenation holds; greedy is the argmax, and a model trained on one of the loop's
transcripts replays it greedily; the from_pretrained path samples the same."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import DynamicLayer

import rollout
from plumbing import sampler
from test_rollout import DEVICES, LAKE, SYSTEM, make_model, make_tokenizer, scripted


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def test_bad_arguments_raise_value_error(tokenizer):
    with pytest.raises(ValueError, match="max_new_tokens"):
        sampler.hf_policy(None, tokenizer, 0)
    with pytest.raises(ValueError, match="top_p"):
        sampler.hf_policy(None, tokenizer, 4, top_p=0.0)


def test_a_later_turn_encodes_only_its_new_tokens(tokenizer):
    """hf_policy continues each episode's cached row: the second call feeds the model only the
    tokens added since the first (the sampled reply and the new observation)."""
    model, fed = make_model(tokenizer), []
    forward = model.forward

    def counting(*args, **kwargs):
        fed.append(kwargs["input_ids"].shape[1])
        return forward(*args, **kwargs)

    model.forward = counting
    policy = sampler.hf_policy(model, tokenizer, max_new_tokens=5)
    eps = rollout.play(policy, tokenizer, "frozenlake", [0], 2, env_kwargs=LAKE, max_turns=2,
                       system=SYSTEM)
    prompts = [n for n in fed if n > 1]  # the calls that encode prompts (the others: one new token)
    turn2_prompt = max(len(e.ids) - e.response_lengths[1] for e in eps)  # tokens before reply 2
    assert len(prompts) == 2
    assert prompts[1] <= turn2_prompt - prompts[0]  # the reply and the new template, not the transcript


def forward_logprobs(model, batch, temperature):
    """log softmax(logits / T) of every token given its prefix, from one forward pass over right-padded ids."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)  # [B, T-1, V]
    return logp, logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)  # [B, T-1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.5)])
def test_sampling_logprobs_equal_a_forward_pass(tokenizer, device, temperature, top_p):
    model = make_model(tokenizer).to(device)
    policy = sampler.hf_policy(model, tokenizer, max_new_tokens=40, temperature=temperature, top_p=top_p)
    torch.manual_seed(1)
    eps = rollout.play(policy, tokenizer, "frozenlake", [0, 1], 2, max_turns=3, system=SYSTEM)
    # both endings occur
    assert any(e.cut for e in eps) and any(n < 40 for e in eps for n in e.response_lengths)
    batch = {k: v.to(device) for k, v in rollout.collate(eps, rollout.pad_token_id(tokenizer)).items()}
    table, recomputed = forward_logprobs(model, batch, temperature)
    mask = batch["policy_mask"][:, 1:] == 1  # [B, T-1]
    assert batch["policy_mask"][:, 0].sum() == 0
    torch.testing.assert_close(batch["logprobs"][:, 1:][mask], recomputed[mask], atol=1e-4, rtol=0)
    # and the entropy of the tempered full distribution each token was drawn from (not the nucleus)
    probs = table.exp()
    entropy = -(probs * table).sum(-1)                                              # [B, T-1]
    torch.testing.assert_close(batch["entropies"][:, 1:][mask], entropy[mask], atol=1e-4, rtol=0)
    assert (batch["entropies"][:, 1:][~mask] == 0).all()
    # every sampled token lies in the top-p nucleus: less than top_p of the mass is on likelier
    # tokens
    chosen = probs.gather(-1, batch["input_ids"][:, 1:, None])  # [B, T-1, 1]
    above = (probs * (probs > chosen)).sum(-1)  # [B, T-1]
    assert (above[mask] < top_p + 1e-5).all()
    # every turn but the last ends with the end-of-turn token: sampled (mask 1) or appended (mask 0)
    for e in eps:
        ids, m = e.ids, e.policy_mask
        run_ends = [i for i in range(1, len(m)) if m[i - 1] == 1 and m[i] == 0]
        assert len(run_ends) == e.turns - 1
        assert all(tokenizer.eos_token_id in (ids[i - 1], ids[i]) for i in run_ends)


def test_growing_cache_holds_what_concatenation_holds():
    """GrowingLayer against Hugging Face's DynamicLayer: the same keys and values after a prefill,
    single tokens, a regrowth past its spare room and a batch selection (a row dropped, two
    reordered)."""
    grow, plain, spare = sampler.GrowingLayer(), DynamicLayer(), sampler.GrowingLayer.SPARE
    g = torch.Generator().manual_seed(0)
    for width, rows in [(7, 3), (1, 3), (spare + 3, 3), (1, 2), (5, 2)]:
        if grow.get_seq_length() and rows < grow.keys.shape[0]:
            for layer in (grow, plain):
                layer.batch_select_indices(torch.tensor([2, 0]))
        k, v = torch.randn(2, rows, 4, width, 8, generator=g)                 # [B, H, W, D] each
        for ours, theirs in zip(grow.update(k, v), plain.update(k, v)):
            assert torch.equal(ours, theirs)
    assert grow.get_seq_length() == 7 + 1 + spare + 3 + 1 + 5


def test_greedy_picks_the_argmax(tokenizer):
    model = make_model(tokenizer)
    policy = sampler.hf_policy(model, tokenizer, max_new_tokens=10, temperature=0)
    (e,) = rollout.play(policy, tokenizer, "frozenlake", [2], 1, max_turns=2, system=SYSTEM)
    table, recomputed = forward_logprobs(model, rollout.collate([e], 0), 1.0)
    mask = torch.tensor(e.policy_mask[1:]) == 1
    assert (table[0].argmax(-1)[mask] == torch.tensor(e.ids[1:])[mask]).all()
    torch.testing.assert_close(torch.tensor(e.logprobs[1:])[mask], recomputed[0][mask], atol=1e-4, rtol=0)


def test_from_pretrained_round_trip_is_identical(tokenizer, tmp_path):
    model = make_model(tokenizer, seed=3)
    model.save_pretrained(tmp_path / "model")
    # its own folder: next to a qwen2 config.json, AutoTokenizer would build Qwen's byte-level
    # tokenizer instead
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    loaded_model = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    loaded_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    assert loaded_tokenizer.chat_template == tokenizer.chat_template
    runs = []
    for m, t in ((model, tokenizer), (loaded_model, loaded_tokenizer)):
        torch.manual_seed(0)
        policy = sampler.hf_policy(m, t, max_new_tokens=16, temperature=0.9, top_p=0.95)
        runs.append(rollout.play(policy, t, "sokoban", [5, 6], 2, max_turns=2, system=SYSTEM))
    for a, b in zip(*runs):
        assert a.ids == b.ids and a.responses == b.responses
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))


def greedy_success(model, tokenizer, seeds, max_new_tokens):
    """Success rate of the model's greedy rollouts (temperature 0), one per seed, on the easy lake."""
    policy = sampler.hf_policy(model, tokenizer, max_new_tokens, temperature=0)
    episodes = rollout.play(policy, tokenizer, "frozenlake", seeds, 1, env_kwargs=LAKE, system=SYSTEM)
    return sum(e.success for e in episodes) / len(episodes)


def test_greedy_sampling_replays_a_learned_transcript(tokenizer):
    """A model trained on the loop's own transcripts (one scripted winning episode) solves the easy lake
    when sampled greedily."""
    episodes = rollout.play(scripted(tokenizer, [["go</think><answer>Right || Right</answer>"]]),
                            tokenizer, "frozenlake", [0], 1, env_kwargs=LAKE, system=SYSTEM)
    assert episodes[0].success and episodes[0].turns == 2
    model = make_model(tokenizer, seed=4)
    assert greedy_success(model, tokenizer, [0, 1], max_new_tokens=40) == 0.0
    batch = rollout.collate(episodes, 0)
    mask = batch["policy_mask"][:, 1:] > 0                                       # [1, T-1]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    # Train until every demonstrated token has probability > 0.9 given its prefix: it is then the
    # argmax, and greedy decoding on the same (fixed) lake replays the winning transcript token for
    # token. A bound on the worst token, not a step count: it does not depend on the trajectory.
    for _ in range(1000):
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1]              # [1, T-1, V]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["input_ids"][:, 1:],
                                                reduction="none")[mask]          # [N]
        if nll.max().item() < -math.log(0.9):
            break
        optimizer.zero_grad()
        nll.mean().backward()
        optimizer.step()
    assert nll.max().item() < -math.log(0.9)
    model.eval()
    assert greedy_success(model, tokenizer, [0, 1], max_new_tokens=60) == 1.0


def test_draw_follows_the_probabilities_and_refuses_what_is_not_finite():
    """sampler.draw's inverse transform has torch.multinomial's law: over 40,000 draws a row, each
    token's frequency lies within 4 standard errors of its probability (the probabilities
    unnormalised, one row with zeros that are never drawn); a row with a nan or inf is the error
    runs.finite_sampling reads as a diverged run."""
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.0, 3.0, 0.0, 1.0]], dtype=torch.float64)
    torch.manual_seed(0)
    draws = sampler.draw(probs.repeat(40_000, 1)).view(40_000, 2)                    # [n, 2]
    p = probs / probs.sum(-1, keepdim=True)
    freq = torch.stack([torch.bincount(draws[:, b], minlength=4) for b in range(2)]) / 40_000
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / 40_000).sqrt() + 1e-12).all(), freq
    assert freq[1, 0] == freq[1, 2] == 0
    for bad in (math.nan, math.inf):
        with pytest.raises(RuntimeError, match="probability tensor contains"):
            sampler.draw(torch.tensor([[0.5, bad]]))
