"""The policy's log-probabilities at the tokens that matter, without full logits: what the warm
start (demos.py), the update (train.py) and cross-scoring (mi.py) all compute, in a file below all
three so that each can import it.

    log pi(y_t | ids[:t]) = log softmax(W h_t / temperature)[y_t]      only where mask[t] = 1

(the log-softmax in float64, as sampler.py's: what a reply was sampled with is what it scores.)

The transformer body runs once; the output layer W runs only on the hidden states h_t at the
positions that matter, a chunk at a time (policy_logprobs, head_logprobs): no [B, T, V] tensor.
"""
import torch
import torch.utils.checkpoint

import ppo


def policy_logprobs(model, input_ids, mask, with_entropy=False, temperature=1.0,
                    chunk_elements=2 ** 24):
    """log pi(ids[b, t+1] | ids[b, :t+1]) -- and the entropy of pi there -- only at the positions
    where mask[b, t] = 1 -> ([B, T-1], [B, T-1] or None), 0 elsewhere. `input_ids` [B, T] is
    right-padded: a causal mask already hides the padding at the end from every real token, so no
    attention mask is passed (the fast kernel).

    pi is the policy that sampled: softmax(logits / temperature), the rollouts' temperature (as
    verl and TRL divide the logits before every log-prob). Scoring samples drawn at T = 0.7 with
    the T = 1 softmax would make the ratio, the entropy bonus and the KL those of another policy.

    The output layer is what costs memory: full logits are [B, T, V] floats (V = 151,936 for Qwen).
    Here the transformer body runs once, its hidden states are gathered at the masked positions
    ([N, D]), and the output layer runs on them a chunk at a time (head_logprobs), so the backward
    pass keeps only the [N, D] inputs and recomputes one chunk's [n, V] logits at a time. Equal to
    ppo.token_logprobs and ppo.entropy_from_logits on the full tempered logits (tests check it).
    Works for peft models (the adapters stay active).
    """
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = lm.get_decoder()(input_ids=input_ids).last_hidden_state[:, :-1]  # [B, T-1, D]
    at = mask.bool()                                                           # [B, T-1]
    logp, entropy = head_logprobs(lm, hidden[at], input_ids[:, 1:][at], with_entropy,
                                  temperature, chunk_elements)                 # [N] each
    zeros = torch.zeros(at.shape, dtype=logp.dtype, device=logp.device)        # [B, T-1]
    return zeros.masked_scatter(at, logp), (zeros.masked_scatter(at, entropy) if with_entropy
                                            else None)


def head_logprobs(lm, hidden, targets, with_entropy=False, temperature=1.0, chunk_elements=2 ** 24,
                  dtype=torch.float32):
    """log pi(targets) -- and the entropy of pi -- from hidden states [N, D] and targets [N] ->
    ([N], [N] or None) in `dtype`, pi = softmax(logits / temperature): `lm`'s output layer runs on
    chunk_elements / V positions at a time under torch.utils.checkpoint, so neither the forward nor
    the backward pass holds more than one chunk's [n, V] logits. mi.cross_scores uses it too
    (without gradients, in float64: its sums over a reply's tokens are compared with the sampler's)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    head = lm.get_output_embeddings()
    size = max(1, chunk_elements // head.weight.shape[0])
    parts = [torch.utils.checkpoint.checkpoint(_head_logprobs, head, h, y, with_entropy,
                                               temperature, dtype, use_reentrant=False)
             for h, y in zip(hidden.split(size), targets.split(size))]  # [n, D], [n] each
    out = [torch.cat([p[i] for p in parts]) if parts else hidden.new_zeros(0, dtype=dtype)
           for i in range(2 if with_entropy else 1)]                           # [N] each
    return out[0], out[1] if with_entropy else None


def _head_logprobs(head, hidden, targets, with_entropy, temperature, dtype):
    # the log-softmax in float64, as the sampler's: in float32 the sum over a real vocabulary
    # (SmolLM2's 49,152 tokens, logits up to ~35) is off by ~1e-5 nats a token, with one sign, so a
    # reply's score would drift 1e-4 from the log-prob it was sampled with
    logits = head(hidden).double() / temperature                               # [n, V]
    logp = ppo.token_logprobs(logits, targets).to(dtype)                        # [n]
    return (logp, ppo.entropy_from_logits(logits).to(dtype)) if with_entropy else (logp,)
