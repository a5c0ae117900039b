"""Sampling: how a language model becomes the policy that rollout.play calls. A prefill of the
prompts, then a loop of identical steps -- each feeds every row's last token through the model with
its key/value cache and draws the next token by the sampling law -- until every row has ended its
turn or reached the token limit (gpt-fast's generate.py is the model: pytorch-labs/gpt-fast).

The sampling law. Each new token is drawn from softmax(logits / temperature), or from its top-p
nucleus, and the drawn token's tempered full-vocabulary log-prob and that distribution's entropy
are recorded: logprobs.tempered's numbers, what the update and the diagnosis recompute (in float32
the update takes them from here). With top_p < 1 the renormalised nucleus's log-prob is not what is
recorded: training compares against the tempered full policy.

The loop. A row that has stopped is fed padding and masked out; every `every` steps the loop looks
at the device (has every row stopped? is every distribution finite?) -- on a CPU at every step, on
a GPU every 8, since a look is a wait for the device there.

This plain sampler runs any Hugging Face causal LM through its own forward pass and cache
(own_forward): it is what runs wherever no faster layer applies. plumbing/sampler.py is the faster
layer for Llama-layout decoders (Llama, SmolLM2, Qwen2 / 2.5, Qwen3; the tiny policy is a Qwen2):
weights merged and laid out for the hardware, the cache kept across turns, on a GPU the step
captured as one CUDA graph. It replaces the prefill and the step only -- the law and the loop are
these -- and the tests hold its tokens equal to this sampler's, token for token.

Shapes: B rows (episodes), V the vocabulary, N the most tokens a reply may have.
"""
from dataclasses import dataclass

import torch

import logprobs
import rollout


# ------------------------------------------------------------------------------ the sampling law

def sample(logits, temperature, top_p, forced=None, u=None):
    """The next token of each row from its logits [B, V] -> (token [B], its log-prob [B], the
    distribution's entropy [B], finite [B]), all of the tempered full distribution; temperature 0
    is greedy (the log-probs then at temperature 1); `forced` [B]: these tokens instead, scored as
    if drawn (a replay of given replies); `u`: draw's uniform numbers, where drawn before.

    The tables are float32 -- x = logits / temperature, x less its row's largest, and its exp --
    and only the sums over the vocabulary are float64 (a float32 sum over 150,000 terms drifts
    with one sign): log pi(token) = x_token - max - log(sum exp(x - max)) and the entropy
    log(sum) - sum(exp(x - max)(x - max)) / sum. So the recorded log-prob is logprobs.tempered's
    float64 one up to the float32 rounding of x, ~1e-7 of |x|, at a third of a float64 table's
    bytes. A row is finite when x holds no nan and its largest entry is finite: a token masked to
    -inf is a legitimate zero (0 log 0 = 0)."""
    x = logits.float() / (temperature or 1.0)                                  # [B, V]
    top = x.amax(-1, keepdim=True)                                             # [B, 1]
    shifted = x - top                                                          # [B, V]
    e = shifted.exp()                                                          # [B, V]
    total = e.sum(-1, dtype=torch.float64)                                     # [B]
    if forced is not None:
        token = forced                                                         # [B]
    elif temperature == 0:
        token = x.argmax(-1)                                                   # [B]
    else:
        token = draw(e if top_p == 1.0 else nucleus(e, top_p), u)[0]          # [B]
    logp = (x.gather(1, token[:, None])[:, 0].double() - top[:, 0].double()) - total.log()
    spread = (e * shifted.clamp(min=torch.finfo(x.dtype).min)).sum(-1, dtype=torch.float64)
    finite = ~x.isnan().any(-1) & torch.isfinite(top[:, 0])                    # [B]
    return token, logp, total.log() - spread / total, finite


def nucleus(probs, top_p):
    """Top-p filtering of unnormalised probabilities [B, V]: zero every token whose likelier tokens
    already hold top_p of the row's mass -> [B, V] (unnormalised; draw does not need the sum to be
    1). The most likely token always stays. The running sums in float64.

    >>> nucleus(torch.tensor([[0.2, 1.2, 0.6]]), 0.7)
    tensor([[0.0000, 1.2000, 0.6000]])
    """
    ranked, order = probs.sort(dim=-1, descending=True)                        # [B, V]
    running = ranked.cumsum(-1, dtype=torch.float64)                           # [B, V]
    drop = running - ranked >= top_p * running[:, -1:]                         # [B, V]
    return torch.zeros_like(probs).scatter(-1, order, ranked.masked_fill(drop, 0.0))


def draw(probs, u=None):
    """One token a row from unnormalised probabilities [B, V], by inverse transform: a uniform
    number a row (`u` [B, 1], drawn here when not given), scaled to the row's total, looked up in
    its running sum (float64: a float32 sum over a large vocabulary drifts) -> ([B] tokens, [B]
    whether the row was finite). The same law as torch.multinomial, which draws an exponential for
    every entry of the row (with a 49,152-token vocabulary, most of a step's sampling time); this
    draws one number. A token of probability 0 is never drawn. A row that is not finite (nan and
    inf run on into its total) draws a meaningless token; the caller reads the flags when it next
    checks, without a wait for the device here.

    >>> draw(torch.tensor([[0.0, 2.0, 0.0], [1.0, 0.0, 0.0]]))[0].tolist()
    [1, 0]
    """
    cdf = probs.cumsum(-1, dtype=torch.float64)                                # [B, V]
    if u is None:
        u = uniforms(len(probs), cdf.device)
    token = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]         # [B]
    return token.clamp_max(probs.shape[-1] - 1), torch.isfinite(cdf[:, -1])


def uniforms(rows, device):
    """The uniform numbers `draw` looks up, [rows, 1], from torch's global generator."""
    return torch.rand(rows, 1, dtype=torch.float64, device=device)


# ------------------------------------------------------------------------------------- the loop

@dataclass
class Sampling:
    """What a reply is drawn by: at most `max_new_tokens` tokens, from softmax(logits /
    `temperature`) (0: greedy) or its `top_p` nucleus, looking at the device every `every` steps."""
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    every: int = 1

    def __post_init__(self):
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, "
                             f"{self.top_p}")


def decode(logits, advance, law, stop_ids, pad, forced=None):
    """The loop of identical steps from the prompts' last logits [B, V]: sample, record, feed (a
    stopped row is fed `pad` into a hole), until every row has sampled an id of `stop_ids` or
    law.max_new_tokens tokens. `advance(token [B], running [B], forced [B] or None)` feeds each
    row's token and returns sample's four outputs for the next one. `forced`: one list of token ids
    a row, scored instead of sampled (each row runs its own length). -> (tokens, log-probs,
    entropies, fed), each a list of B rows of n entries (n: the steps run; `fed`: whether the token
    went into the cache, False for the last and after a row stopped)."""
    B, device = len(logits), logits.device
    n_max = law.max_new_tokens if forced is None else max(1, max(map(len, forced)))
    lengths = torch.full((B,), n_max, device=device)                           # [B]
    if forced is not None:
        lengths = torch.tensor([len(f) for f in forced], device=device)
        forced = torch.tensor([list(f) + [pad] * (n_max - len(f)) for f in forced],
                              dtype=torch.long, device=device)                 # [B, N]
    tokens = torch.full((B, n_max), pad, dtype=torch.long, device=device)      # [B, N]
    logps = torch.zeros(B, n_max, dtype=torch.float64, device=device)          # [B, N]
    entropies = torch.zeros(B, n_max, dtype=torch.float64, device=device)      # [B, N]
    fed = torch.zeros(B, n_max, dtype=torch.bool, device=device)               # [B, N]
    running = torch.ones(B, dtype=torch.bool, device=device)                   # [B]
    finite = torch.ones(B, dtype=torch.bool, device=device)                    # [B]
    stop = torch.tensor(stop_ids, device=device)
    drawn = sample(logits, law.temperature, law.top_p, None if forced is None else forced[:, 0])
    for t in range(n_max):
        token, logps[:, t], entropies[:, t], ok = drawn
        tokens[:, t] = torch.where(running, token, pad)
        finite &= ok | ~running
        fed[:, t] = running  # this token enters the cache for the rows that were running
        still = running & ~torch.isin(tokens[:, t], stop) & (t + 1 < lengths)
        if t == n_max - 1 or (t + 1) % law.every == 0 and not looks_alive(still, finite):
            break
        drawn = advance(tokens[:, t], running, None if forced is None else forced[:, t + 1])
        running = still
    if not finite.all():  # nan and inf would run on into the totals of the next turns
        raise RuntimeError("probability tensor contains a number that is not finite")
    n = t + 1
    fed[:, n - 1] = False  # the last token sampled was not fed (the loop ends before it)
    return (tokens[:, :n].cpu().tolist(), logps[:, :n].cpu().tolist(),
            entropies[:, :n].float().cpu().tolist(), fed[:, :n].cpu().tolist())


def looks_every(model):
    """Steps between two looks at the device: 8 on a GPU, where a look is a wait for it; 1 on a
    CPU, where it costs nothing."""
    return 8 if model is not None and model.device.type == "cuda" else 1


def looks_alive(still, finite):
    """The loop's one look at the device: some row still running and every distribution finite
    (a non-finite one ends the loop and is raised after it)."""
    return bool(still.any() & finite.all())


# ------------------------------------------------------------------- the prefill and the step

def own_forward(model, prompt_ids, pad, law):
    """The prefill and the step through the model's own forward pass and key/value cache: the
    prompts left-padded and encoded whole, then one token a step, a stopped row fed a hole ->
    (the prompts' last logits [B, V], advance(token, running, forced) -> sample's outputs for the
    next token). Position ids count each row's real tokens, so a left-padded row sees what a
    forward pass over its own prompt sees."""
    device, B, width = model.device, len(prompt_ids), max(map(len, prompt_ids))
    ids = torch.full((B, width), pad, dtype=torch.long)                        # [B, W]
    mask = torch.zeros((B, width), dtype=torch.long)                           # [B, W]
    for b, p in enumerate(prompt_ids):
        ids[b, width - len(p):], mask[b, width - len(p):] = torch.tensor(p, dtype=torch.long), 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(1) - 1).clamp(min=0)                              # [B, W]
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    state = dict(cache=logprobs.cache_of(out), mask=mask, position=positions[:, -1] + 1)

    def advance(token, running, forced):
        state["mask"] = torch.cat([state["mask"], running[:, None].long()], 1)  # [B, W + t]
        out = model(input_ids=token[:, None], attention_mask=state["mask"],
                    position_ids=state["position"][:, None], use_cache=True,
                    **{logprobs.cache_keyword(model): state["cache"]})
        state["cache"] = logprobs.cache_of(out)
        state["position"] = state["position"] + running.long()
        return sample(out.logits[:, -1], law.temperature, law.top_p, forced)
    return out.logits[:, -1], advance


# ----------------------------------------------------------------------------------- the policy

def policy(model, tokenizer, max_new_tokens, temperature=1.0, top_p=1.0, every=None):
    """A Hugging Face causal LM as a policy(prompt_ids, envs) -> list[rollout.Generation]: one
    batched call for all prompts, each reply ending at an end-of-turn token (stop_ids) or after
    max_new_tokens, sampled through the model's own forward pass (own_forward) in its current mode
    and dtype. Sampling settings are explicit, so a checkpoint's generation_config (Qwen's
    repetition penalty and top_k) cannot change the distribution. `every`: steps between two looks
    at the device (default 8 on a GPU, 1 on a CPU). `policy(prompt_ids, forced=replies)` scores
    given replies (lists of token ids) instead of sampling."""
    law = Sampling(max_new_tokens, temperature, top_p, every or looks_every(model))
    stop, pad = stop_ids(model, tokenizer), rollout.pad_token_id(tokenizer)

    @torch.no_grad()
    def play(prompt_ids, env_list=None, forced=None):  # the environments are not needed
        logits, advance = own_forward(model, prompt_ids, pad, law)
        tokens, logps, entropies, _ = decode(logits, advance, law, stop, pad, forced)
        return as_generations(tokens, logps, stop, entropies)
    return play


def stop_ids(model, tokenizer):
    """The ids that end a reply: the chat template's end-of-turn token and the tokenizer's eos
    (rollout.end_of_turn_ids), and every end id the model's generation config names (Qwen2.5's
    names <|endoftext|> beside <|im_end|>: a reply that writes it ends there, not at the token
    limit)."""
    ids = list(rollout.end_of_turn_ids(tokenizer))
    named = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for i in [named] if isinstance(named, int) else named or []:
        if i not in ids:
            ids.append(i)
    return ids


def as_generations(tokens, logprobs, stop_ids, entropies=None):
    """Sampled rows [B][N], their log-probs (and the entropies [B][N] of the distributions they
    were drawn from, if given) as Generations, each ending after its first end-of-turn token; a
    row without one was cut by the token limit. Rows sampled together run to the same length, so
    what follows a row's stop is dropped here.

    >>> out = as_generations([[5, 9, 0], [5, 6, 7]], [[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]], [9])
    >>> [(g.token_ids, g.logprobs, g.cut) for g in out]
    [([5, 9], [-1.0, -2.0], False), ([5, 6, 7], [-1.0, -1.0, -1.0], True)]
    """
    out = []
    for b, (row, lp) in enumerate(zip(tokens, logprobs)):
        end = next((i + 1 for i, t in enumerate(row) if t in stop_ids), None)
        out.append(rollout.Generation(row[:end], lp[:end], cut=end is None,
                                      entropies=None if entropies is None else entropies[b][:end]))
    return out
