"""Sampling many episodes at once: a Hugging Face causal LM as the policy that rollout.play calls,
one explicit decode loop whose key/value cache is kept across an episode's turns.

Apart from the agent-environment loop: rollout.play needs only some policy(prompt_ids, envs) ->
list[rollout.Generation] (tests and demos pass scripted ones), while what is here -- the decode
loop, the nucleus, a cache layer that subclasses transformers internals -- is what makes the tiny
policy's rollouts fast on a CPU and a real model's fit on one GPU.

The loop: one forward pass per new token with a key/value cache, then
log softmax(logits / temperature), a draw from it (or from its top-p nucleus), and the drawn token's
tempered full-vocabulary log-prob and that distribution's entropy recorded -- what a training
forward pass recomputes (tests check it; in float32 the update takes them from here). Every turn's
prompt is the last turn's prompt plus the tokens sampled plus the new observation, so the policy
keeps each episode's cache between turns and encodes only the new tokens: turn 5 of a 700-token
Sokoban transcript costs its ~100 new tokens, not 700. With top_p < 1 the log-prob of the
renormalised nucleus is not what is recorded: training compares against the tempered full policy.
"""
import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer

import rollout


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


def nucleus(probs, top_p):
    """Top-p filtering: zero every token whose likelier tokens already hold top_p of the mass -> [B,
    V] (unnormalised; draw does not need the sum to be 1). The most likely token always
    stays.

    >>> nucleus(torch.tensor([[0.1, 0.6, 0.3]]), 0.7)
    tensor([[0.0000, 0.6000, 0.3000]])
    """
    ranked, order = probs.sort(dim=-1, descending=True)                        # [B, V]
    drop = ranked.cumsum(-1) - ranked >= top_p                                 # [B, V]
    return torch.zeros_like(probs).scatter(-1, order, ranked.masked_fill(drop, 0.0))


def draw(probs):
    """One token a row from unnormalised probabilities [B, V], by inverse transform: a uniform
    number a row, scaled to the row's total, looked up in its running sum -> [B]. The same law as
    torch.multinomial, which draws an exponential for every entry of the row (with a 49,152-token
    vocabulary, most of a decode step's sampling time); this draws one number. A token of
    probability 0 is never drawn; a row that is not finite is an error, as in torch.multinomial
    (runs.finite_sampling reads it as a diverged run).

    >>> draw(torch.tensor([[0.0, 2.0, 0.0], [1.0, 0.0, 0.0]])).tolist()
    [1, 0]
    """
    cdf = probs.cumsum(-1)                                                     # [B, V]
    if not torch.isfinite(cdf[:, -1]).all():  # nan and inf run on into the row's total
        raise RuntimeError("probability tensor contains a number that is not finite")
    u = torch.rand(len(probs), 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]  # [B, 1]
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp_max(probs.shape[-1] - 1)


class GrowingLayer(DynamicLayer):
    """One layer's key/value cache that writes new tokens into spare room: Hugging Face's
    DynamicLayer concatenates, which copies the whole cache at every sampled token (on a CPU a
    large share of the tiny policy's rollout time). The room grows by SPARE tokens when full, and
    attention reads a view of its filled part: the same numbers, no copy."""

    SPARE = 256  # tokens; on a GPU at most this many tokens' keys and values a row are unused

    def update(self, key_states, value_states, *args, **kwargs):
        n = self.get_seq_length()
        end = n + key_states.shape[-2]
        if n == 0 or end > self.room[0].shape[-2]:  # (re)allocate and copy the filled part once
            room = [x.new_empty(*x.shape[:2], end + self.SPARE, x.shape[-1])
                    for x in (key_states, value_states)]                       # [B, H, W, D]
            if n:
                room[0][:, :, :n], room[1][:, :, :n] = self.keys, self.values
            self.room, self.is_initialized = room, True
            self.dtype, self.device = key_states.dtype, key_states.device
        self.room[0][:, :, n:end], self.room[1][:, :, n:end] = key_states, value_states
        self.keys, self.values = self.room[0][:, :, :end], self.room[1][:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices):
        n = self.get_seq_length()
        if n:
            self.room = [x[indices] for x in self.room]
            self.keys, self.values = self.room[0][:, :, :n], self.room[1][:, :, :n]


def hf_policy(model, tokenizer, max_new_tokens, temperature=1.0, top_p=1.0):
    """A Hugging Face causal LM as a policy(prompt_ids, envs) -> list[Generation]: one batched call
    for all prompts, left-padded, each stopping at an end-of-turn token or after max_new_tokens;
    temperature 0 means greedy (log-probs then at temperature 1). Sampling settings are explicit, so
    a checkpoint's generation_config (e.g. Qwen's repetition penalty and top_k) cannot change the
    distribution. Runs on the model's device in its current mode (sample in eval mode: no dropout).

    The policy remembers the key/value cache of its last call, one row per prompt. A prompt that
    continues a remembered row (the row's tokens are a prefix of it) reuses the row and encodes only
    its new tokens; otherwise the whole batch is encoded afresh, each token once: what every prompt
    shares (the system prompt), then each distinct prompt's rest, its cache copied to the rows that
    share it (a group's rollouts). The cache holds holes -- padding,
    and the steps after a row stopped, with attention mask 0 -- and every token gets its true
    position id, so attention and RoPE see exactly the tokens of its own transcript, as a fresh
    forward pass does.
    """
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    stop_ids, pad = rollout.end_of_turn_ids(tokenizer), rollout.pad_token_id(tokenizer)
    # the last call's cache, attention [B, W], positions [B] and {key: (row, tokens)}
    last = {"rows": {}}

    @torch.no_grad()
    def policy(prompt_ids, env_list=None):  # the environments are not needed to sample
        device, B = model.device, len(prompt_ids)
        keys = [id(env) for env in env_list] if env_list is not None else list(range(B))
        state = {}  # the cache, attention [B, W] and positions [B] of the rows being encoded

        def select(index):  # keep, reorder or copy the cache's rows: row b becomes old row index[b]
            state["cache"].batch_select_indices(index)
            state["attention"], state["position"] = (state["attention"][index],
                                                     state["position"][index])

        def encode(prompt_ids, known):
            """Feed the cache's rows what is new in their prompts, left-padded to the longest new
            piece -> the logits of each prompt's last token [B, V]."""
            B = len(prompt_ids)
            # BEGIN SOLUTION silent_bug
            new = [p[k:] for p, k in zip(prompt_ids, known)]
            # END SOLUTION silent_bug
            width = max(len(n) for n in new)
            ids = torch.full((B, width), pad, dtype=torch.long)                # [B, W]
            real = torch.zeros((B, width), dtype=torch.long)                   # [B, W]
            for b, n in enumerate(new):
                ids[b, width - len(n):] = torch.tensor(n, dtype=torch.long)
                real[b, width - len(n):] = 1
            ids, real = ids.to(device), real.to(device)
            positions = state["position"][:, None] + (real.cumsum(1) - 1).clamp(min=0)  # [B, W]
            state["attention"] = torch.cat([state["attention"], real], dim=1)  # [B, W_cache + W]
            state["position"] = state["position"] + real.sum(1)                # [B]
            return model(input_ids=ids, attention_mask=state["attention"], position_ids=positions,
                         cache=state["cache"], use_cache=True, logits_to_keep=1).logits[:, -1]

        rows = _continued_rows(last["rows"], prompt_ids, keys)
        if rows is None:  # start afresh: what prompts share is encoded once, then copied
            distinct = [list(p) for p in dict.fromkeys(map(tuple, prompt_ids))]
            shared = _shared_prefix(distinct)  # the system prompt, the template's first tokens
            state.update(cache=Cache(layer_class_to_replicate=GrowingLayer),
                         attention=torch.zeros(1, 0, dtype=torch.long, device=device),
                         position=torch.zeros(1, dtype=torch.long, device=device))
            if shared:
                encode([distinct[0][:shared]], [0])
            select(torch.zeros(len(distinct), dtype=torch.long, device=device))
            logits = encode(distinct, [shared] * len(distinct))                # [U, V]
            # a group's rollouts share their first prompt: its cache is copied to each of them
            index = torch.tensor([distinct.index(list(p)) for p in prompt_ids], device=device)
            select(index)
            logits = logits[index]                                             # [B, V]
        else:  # keep the rows of the prompts that continue, in the new order
            state.update(cache=last["cache"], attention=last["attention"],
                         position=last["position"])
            select(torch.tensor(rows, device=device))
            logits = encode(prompt_ids, [len(last["rows"][key][1]) for key in keys])  # [B, V]
        cache, attention, position = state["cache"], state["attention"], state["position"]

        # ---- sample token by token; a row that stopped is fed padding, attention 0, until all rows
        # stopped
        tokens, logprobs, entropies, fed = [], [], [], []
        running = torch.ones(B, dtype=torch.bool, device=device)               # [B]
        stop = torch.tensor(stop_ids, device=device)
        for step in range(max_new_tokens):
            # float64, as logprobs.py scores: float32 sums over a large vocabulary drift
            table = torch.log_softmax(logits.double() / (temperature or 1.0), dim=-1)  # [B, V]
            probs = table.exp()                                                # [B, V]
            if temperature == 0:
                token = table.argmax(-1)                                       # [B]
            else:
                token = draw(probs if top_p == 1.0 else nucleus(probs, top_p))         # [B]
            token = torch.where(running, token, pad)
            tokens.append(token)
            logprobs.append(table.gather(1, token[:, None])[:, 0])
            entropies.append(-(probs * table).sum(-1))  # of the tempered policy, as the update's
            still = running & ~torch.isin(token, stop)
            if step == max_new_tokens - 1 or not still.any():
                break
            fed.append(running)  # this token enters the cache for the rows that were still running
            attention = torch.cat([attention, running.long()[:, None]], dim=1)
            logits = model(
                input_ids=token[:, None],
                attention_mask=attention,
                position_ids=position[:, None],
                cache=cache,
                use_cache=True,
            ).logits[:, -1]
            position = position + running.long()
            running = still

        tokens = torch.stack(tokens, 1).cpu().tolist()                         # [B, N]
        logprobs = torch.stack(logprobs, 1).cpu().tolist()  # [B, N], float64 as mi.cross_scores
        entropies = torch.stack(entropies, 1).float().cpu().tolist()           # [B, N]
        fed = torch.stack(fed, 1).cpu().tolist() if fed else [[] for _ in range(B)]  # [B, N-1]
        last.update(cache=cache, attention=attention, position=position, rows={
            key: (b, p + [t for t, f in zip(row, on) if f])
            for b, (key, p, row, on) in enumerate(zip(keys, prompt_ids, tokens, fed))})
        return as_generations(tokens, logprobs, stop_ids, entropies)

    return policy


def _shared_prefix(prompts):
    """How many first tokens every prompt shares, leaving each at least one of its own (its last
    token's logits are the first reply token's distribution): _shared_prefix([[1, 2, 3], [1, 2,
    4, 5]]) == 2, _shared_prefix([[1, 2]]) == 1."""
    shortest = min(len(p) for p in prompts)
    same = next((i for i in range(shortest) if len({p[i] for p in prompts}) > 1), shortest)
    return min(same, shortest - 1)


def _continued_rows(remembered, prompt_ids, keys):
    """For each prompt the remembered row it continues, or None when some prompt continues none. A
    row is found by the prompt's key (its environment object; its index when none is given) and must
    hold a proper prefix of the prompt: _continued_rows({"a": (0, [1, 2]), "b": (1, [3])}, [[3, 4],
    [1, 2, 5]], ["b", "a"]) == [1, 0]."""
    rows = []
    for prompt, key in zip(prompt_ids, keys):
        row, tokens = remembered.get(key, (None, None))
        if row is None or len(tokens) >= len(prompt) or prompt[:len(tokens)] != tokens:
            return None
        rows.append(row)
    return rows
