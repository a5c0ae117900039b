"""The policy's log-probabilities and entropy: one definition, and the memory-saving way the update,
the warm start (warmstart/demos.py) and cross-scoring (mi.py) compute it, in a file below all
three so that each can import it.

    log pi(y_t | ids[:t]) = log softmax(logits_t / temperature)[y_t]            (tempered)
    H(pi_t)               = -sum_v pi_t(v) log pi_t(v)                          (entropy)

pi is the policy that sampled: its logits divided by the rollouts' temperature, as verl and TRL
divide them before every log-prob; the log-softmax in float64, as the sampler's sums
(generate.sample), so that what a reply was sampled with is what it scores. `token_logprobs` and
`token_entropy` are the definition over full logits [B, T, V]; `policy_logprobs` computes the same
numbers (tests hold them equal) with the transformer body run once and the output layer only on
the hidden states at the positions that matter, a chunk at a time (head_logprobs): no [B, T, V]
tensor, which for Qwen's 151,936-token vocabulary is most of a GPU's memory.
"""
import inspect

import torch
import torch.utils.checkpoint


# ------------------------------------------------------------------------------ the definition

def tempered(logits, temperature=1.0):
    """log pi = log softmax(logits / temperature) over the vocabulary [..., V], in float64: the
    one definition of the policy that the update scores and the diagnosis cross-scores (mi.py), and
    the sampler draws from (generate.sample: float32 tables, the same float64 sums).
    float64, because a float32 sum over a large vocabulary drifts with one sign, and a reply's
    score would stray from the log-prob it was sampled with.

    >>> tempered(torch.tensor([0.0, 2.0]), 2.0).exp()      # softmax([0, 1]) = [1, e] / (1 + e)
    tensor([0.2689, 0.7311], dtype=torch.float64)
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    return torch.log_softmax(logits.double() / temperature, dim=-1)


def entropy(table):
    """H(pi) = -sum_v pi_v log pi_v from a log-softmax table [..., V] -> [...]; a token of log-prob
    -inf adds 0 (0 log 0 = 0), a nan stays nan.

    >>> entropy(torch.tensor([0.0, -float("inf")])).item() == 0.0
    True
    """
    return -(table.exp() * table.clamp(min=torch.finfo(table.dtype).min)).sum(-1)


def token_logprobs(logits, tokens, temperature=1.0):
    """log pi(tokens[b, t]) under the tempered policy at logits[b, t] -> [B, T], float64. Logits
    and tokens must be aligned (pass logits[:, :-1] and ids[:, 1:]).

    >>> token_logprobs(torch.tensor([[[0., 1.0986123]]]), torch.tensor([[1]]))  # p = [1/4, 3/4]
    tensor([[-0.2877]], dtype=torch.float64)
    """
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} are not "
                         "aligned; pass logits[:, :-1] and ids[:, 1:]")
    return tempered(logits, temperature).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, T]


def token_entropy(logits, temperature=1.0):
    """The tempered policy's entropy at every position of logits [B, T, V] -> [B, T], float64.

    >>> token_entropy(torch.zeros(1, 1, 4))   # uniform over 4: log 4
    tensor([[1.3863]], dtype=torch.float64)
    """
    return entropy(tempered(logits, temperature))                               # [B, T]


# ------------------------------------------------------- the same numbers, without full logits


def policy_logprobs(model, input_ids, mask, with_entropy=False, temperature=1.0,
                    chunk_elements=2 ** 24, dtype=torch.float32, share_prefix=False):
    """log pi(ids[b, t+1] | ids[b, :t+1]) -- and the entropy of pi there -- only at the positions
    where mask[b, t] = 1 -> ([B, T-1], [B, T-1] or None) in `dtype`, 0 elsewhere. `input_ids`
    [B, T] is right-padded: a causal mask already hides the padding at the end from every real
    token, so no attention mask is passed (the fast kernel).

    pi is the policy that sampled (tempered, at the rollouts' temperature): scoring samples drawn
    at T = 0.7 with the T = 1 softmax would make the ratio, the entropy bonus and the KL those of
    another policy.

    share_prefix: rows that share their first tokens (prefix_cells) run them once
    (shared_prefix_hidden). That pays where many rows share a long prompt and go on briefly, as
    cross-scoring's reasonings under one prompt (mi.cross_scores); over whole transcripts (the
    update) one pass over all rows is faster (bench/README.md).

    The output layer is what costs memory: full logits are [B, T, V] floats (V = 151,936 for
    Qwen). Here the hidden states are gathered at the masked positions ([N, D]), and the output
    layer runs on them a chunk at a time (head_logprobs), so the backward pass keeps only the
    [N, D] inputs and recomputes one chunk's [n, V] logits at a time. Equal to token_logprobs and
    token_entropy on the full logits (tests check it). Works for peft models (the adapters stay
    active).
    """
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    at = mask.bool()                                                           # [B, T-1]
    logp = torch.zeros(at.shape, dtype=dtype, device=input_ids.device)         # [B, T-1]
    entropy = torch.zeros_like(logp) if with_entropy else None
    for rows, n in prefix_cells(input_ids, at, shared=share_prefix and not _drops_the_cache(lm)):
        hidden = shared_prefix_hidden(lm.get_decoder(), input_ids[rows], n)[:, :-1]  # [k, T-1-n, D]
        cell = at[rows, n:]                                                    # [k, T-1-n]
        out = head_logprobs(lm, hidden[cell], input_ids[rows, n + 1:][cell], with_entropy,
                            temperature, chunk_elements, dtype)                # [N_k] each
        zeros = torch.zeros(len(rows), at.shape[1], dtype=out[0].dtype, device=at.device)
        logp = logp.index_copy(0, rows, zeros.masked_scatter(at[rows], out[0]))
        if with_entropy:
            entropy = entropy.index_copy(0, rows, zeros.masked_scatter(at[rows], out[1]))
    return logp, entropy


def prefix_cells(input_ids, at, shared=True):
    """The rows with policy tokens, in cells of rows that share their first n tokens -> [(rows, n)]
    (rows: a LongTensor). Rows with the same prompt (the tokens before the first policy token: a
    group's rollouts) share all of it but its last token, whose hidden state predicts the first
    policy token; the rows whose prompt no other row has share what all of them share (the system
    prompt). shared=False: every row with policy tokens in one cell, n = 0.

    >>> ids = torch.tensor([[1, 2, 3, 9], [1, 2, 3, 8], [1, 5, 6, 7]])
    >>> at = torch.tensor([[0, 0, 1], [0, 0, 1], [0, 1, 1]])
    >>> [(rows.tolist(), n) for rows, n in prefix_cells(ids, at)]
    [([0, 1], 2), ([2], 1)]
    """
    with_tokens = at.any(1)                                                    # [B]
    first = at.float().argmax(1).tolist()  # position of each row's last prompt token
    if not shared:
        return [(with_tokens.nonzero()[:, 0], 0)] if with_tokens.any() else []
    by_prompt = {}
    for b in with_tokens.nonzero()[:, 0].tolist():
        by_prompt.setdefault(tuple(input_ids[b, :first[b]].tolist()), []).append(b)
    cells = [(rows, len(prompt)) for prompt, rows in by_prompt.items() if len(rows) > 1]
    alone = [(rows[0], prompt) for prompt, rows in by_prompt.items() if len(rows) == 1]
    if alone:
        cells.append(([b for b, _ in alone], common_prefix([prompt for _, prompt in alone])))
    return [(torch.tensor(rows, device=input_ids.device), n) for rows, n in cells]


def common_prefix(rows):
    """How many first tokens every row (a token-id sequence) shares.

    >>> common_prefix([[1, 2, 3], [1, 2, 4, 5]]), common_prefix([[1, 2]])
    (2, 2)
    """
    shortest = min(map(len, rows))
    return next((i for i in range(shortest) if len({row[i] for row in rows}) > 1), shortest)


def shared_prefix_hidden(decoder, ids, n):
    """The decoder's last hidden states at positions n.. of rows `ids` [k, T] whose first n tokens
    are the same -> [k, T-n, D]. The prefix runs once, on one row, and its keys and values are
    copied to every row (a copy autograd sums back: the prefix's gradient is the sum over the
    rows, exactly as if each row had run it; the idea of "Prefix Grouper", arXiv 2506.05433)."""
    if n == 0:
        return decoder(input_ids=ids, use_cache=False).last_hidden_state
    cache = cache_of(decoder(input_ids=ids[:1, :n], use_cache=True))
    cache.batch_repeat_interleave(len(ids))
    return decoder(input_ids=ids[:, n:], use_cache=True,
                   **{cache_keyword(decoder): cache}).last_hidden_state


def cache_keyword(module):
    """The name under which a Hugging Face model takes its key/value cache: `cache` from
    transformers 5.24, `past_key_values` before (and a `past_key_values` that 5.24 still reads).
    A peft model passes its keywords on to the model it wraps: that model's name."""
    module = module.get_base_model() if hasattr(module, "get_base_model") else module
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def cache_of(output):
    """The key/value cache a Hugging Face model's output holds, under either name."""
    cache = output.get("cache")
    return output.get("past_key_values") if cache is None else cache


def _drops_the_cache(lm):
    """Hugging Face layers under gradient checkpointing ignore a cache while training with
    gradients: a shared prefix would be lost, so every row then runs its whole transcript."""
    on = getattr(lm, "is_activation_checkpointing", None)  # transformers 5.24's name
    on = getattr(lm, "is_gradient_checkpointing", False) if on is None else on  # before it
    return on and lm.training and torch.is_grad_enabled()


def head_logprobs(lm, hidden, targets, with_entropy=False, temperature=1.0, chunk_elements=2 ** 24,
                  dtype=torch.float32):
    """log pi(targets) -- and the entropy of pi -- from hidden states [N, D] and targets [N] ->
    ([N], [N] or None) in `dtype`, pi = softmax(logits / temperature): `lm`'s output layer runs on
    chunk_elements / V positions at a time under torch.utils.checkpoint, so neither the forward nor
    the backward pass holds more than one chunk's [n, V] logits (in float64 for mi.cross_scores,
    whose sums over a reply's tokens are compared with the sampler's)."""
    size = max(1, chunk_elements // lm.get_output_embeddings().weight.shape[0])
    parts = [torch.utils.checkpoint.checkpoint(_head_logprobs, lm, h, y, with_entropy,
                                               temperature, dtype, use_reentrant=False)
             for h, y in zip(hidden.split(size), targets.split(size))]  # [n, D], [n] each
    out = [torch.cat([p[i] for p in parts]) if parts else hidden.new_zeros(0, dtype=dtype)
           for i in range(2 if with_entropy else 1)]                           # [N] each
    return out[0], out[1] if with_entropy else None


def _head_logprobs(lm, hidden, targets, with_entropy, temperature, dtype):
    table = tempered(output_logits(lm, hidden), temperature)                   # [n, V]
    logp = table.gather(1, targets[:, None])[:, 0].to(dtype)                   # [n]
    return (logp, entropy(table).to(dtype)) if with_entropy else (logp,)


def output_logits(lm, hidden):
    """The logits the model's own forward pass gives from its last hidden states [..., D] ->
    [..., V]: its output layer, then what that forward applies after it, read off its config --
    Cohere's logit_scale (a product), Granite's logits_scaling (a quotient), Gemma 2's and 3's
    soft cap (cap * tanh(logits / cap)). Scoring with the bare output layer would score another
    policy than the one that sampled (tests/test_train.py holds both equal for each of these
    layouts)."""
    logits = lm.get_output_embeddings()(hidden)                                # [..., V]
    cfg = lm.config.get_text_config()
    if getattr(cfg, "logit_scale", None) is not None:
        logits = logits * cfg.logit_scale
    if getattr(cfg, "logits_scaling", None) is not None:
        logits = logits / cfg.logits_scaling
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits

