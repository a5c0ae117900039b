"""Sampling many episodes at once: a Hugging Face causal LM as the policy that rollout.play calls,
decoded the way gpt-fast decodes (pytorch-labs/gpt-fast): a prefill, then a loop of identical
steps over a key/value cache that is allocated once and written at positions.

Apart from the agent-environment loop: rollout.play needs only some policy(prompt_ids, envs) ->
list[rollout.Generation] (tests and demos pass scripted ones), while what is here is what makes a
real model's rollouts run at the hardware's pace, and the tiny policy's fast on a CPU.

The sampling law. Each new token is drawn from softmax(logits / temperature) (or its top-p
nucleus), and the drawn token's tempered full-vocabulary log-prob and that distribution's entropy
are recorded -- what a training forward pass recomputes (tests check it; in float32 the update
takes them from here). With top_p < 1 the log-prob of the renormalised nucleus is not what is
recorded: training compares against the tempered full policy.

The cache. Rows are episodes; every row writes its k-th fed token into the same slot k, so the
slot a step writes is one number the host knows without asking the device. Where rows differ in
length, slots hold holes (left padding, the steps after a row stopped) that a boolean mask `valid`
hides; every token gets its own transcript's position id, so attention and RoPE see exactly what a
fresh forward pass over the transcript sees. Each turn's prompt is the last turn's transcript plus
the reply and the new observation, so an episode keeps its rows between turns and encodes only the
new tokens (turn 5 of a 700-token Sokoban transcript costs its ~100 new tokens, not 700). What the
prompts share is encoded once: the system prompt on one row, then each distinct prompt's rest,
then the group's rows copied from it.

The step. Llama-layout decoders (Llama, SmolLM2, Qwen2 / 2.5, Qwen3: the tiny policy is a Qwen2)
run through `forward`, which calls the model's own layers (LoRA adapters included) but does the
attention itself: the G query heads that share a key/value head are laid side by side as G query
rows of that head, so grouped keys and values are read as they are, never copied G times (the
trick of flash-decoding). Nothing in a step asks the device anything: stopped rows are masked on
the device, and whether every row has stopped, or a distribution stopped being finite, is read
every `check_every` steps (each a wait for the device on a GPU, free on a CPU). So on a GPU a
turn's step, its cache's shapes fixed until the turn ends, is captured once as a CUDA graph and
replayed (graphed_step): one launch a token instead of hundreds, what torch.compile's
"reduce-overhead" mode would record, without a compiler. Weights are read from copies kept for
sampling (project): in autocast's dtype, and on a CPU transposed, where that multiplies faster.
"""
import dataclasses
import functools
import weakref

import torch
import torch.nn.functional as F

import logprobs
import rollout

LLAMA_LAYOUT = ("llama", "qwen2", "qwen3")  # decoders `forward` runs; others are refused
ROOM = 256  # the cache grows by this many slots at a time: few reallocations, few shapes


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


# ------------------------------------------------------------------------------ the sampling law

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
    number a row, scaled to the row's total, looked up in its running sum -> ([B] tokens, [B]
    whether the row was finite). The same law as torch.multinomial, which draws an exponential for
    every entry of the row (with a 49,152-token vocabulary, most of a step's sampling time); this
    draws one number. A token of probability 0 is never drawn. A row that is not finite (nan and
    inf run on into its total) draws a meaningless token; the caller reads the flags when it next
    checks, without a wait for the device here.

    >>> draw(torch.tensor([[0.0, 2.0, 0.0], [1.0, 0.0, 0.0]]))[0].tolist()
    [1, 0]
    """
    cdf = probs.cumsum(-1)                                                     # [B, V]
    u = torch.rand(len(probs), 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]  # [B, 1]
    token = torch.searchsorted(cdf, u, right=True)[:, 0].clamp_max(probs.shape[-1] - 1)
    return token, torch.isfinite(cdf[:, -1])


def sample(logits, temperature, top_p):
    """The next token of each row from its logits [B, V] -> (token [B], its log-prob [B], the
    distribution's entropy [B], finite [B]), all of the tempered full distribution; temperature 0
    is greedy (the log-probs then at temperature 1). The same float64 table logprobs.py scores
    with (logprobs.tempered)."""
    table = logprobs.tempered(logits, temperature or 1.0)                      # [B, V]
    probs = table.exp()                                                        # [B, V]
    if temperature == 0:
        token, finite = table.argmax(-1), torch.isfinite(table).all(-1)        # [B]
    else:
        token, finite = draw(probs if top_p == 1.0 else nucleus(probs, top_p))  # [B]
    return token, table.gather(1, token[:, None])[:, 0], logprobs.entropy(table), finite


# --------------------------------------------------------------------- the cache and the decoder

@dataclasses.dataclass
class Cache:
    """Keys and values of every layer, [B, H_kv, S, D] each, S slots allocated at once; `valid`
    [B, S] marks the slots holding a real token of the row, `position` [B] the position id the
    row's next token gets, `slot` the first free slot (the same for every row)."""
    keys: list
    values: list
    valid: torch.Tensor
    position: torch.Tensor
    slot: int = 0


def new_cache(lm, rows, device):
    """An empty cache of `rows` rows for `lm`'s layers (allocated at the first write)."""
    layers = len(lm.get_decoder().layers)
    return Cache([None] * layers, [None] * layers, torch.zeros(rows, 0, dtype=torch.bool,
                                                               device=device),
                 torch.zeros(rows, dtype=torch.long, device=device))


def ensure(cache, slots):
    """Room for `slots` slots in every row: a new allocation (ROOM slots at a time) and one copy
    of what is filled, only when they do not fit."""
    room = cache.valid.shape[1]
    if slots <= room:
        return
    size = -(-slots // ROOM) * ROOM
    valid = cache.valid.new_zeros(len(cache.valid), size)                      # [B, S]
    valid[:, :room] = cache.valid
    cache.valid = valid
    for store in (cache.keys, cache.values):
        for i, old in enumerate(store):
            if old is not None:
                store[i] = old.new_zeros(*old.shape[:2], size, old.shape[-1])  # [B, H, S, d]
                store[i][:, :, :room] = old


def select(cache, index):
    """Keep, reorder or copy the cache's rows: row b becomes old row index[b]."""
    for store in (cache.keys, cache.values):
        store[:] = [None if x is None else x[index] for x in store]
    cache.valid, cache.position = cache.valid[index], cache.position[index]


def check_layout(model):
    """The model's decoder, if `forward` can run it (the Llama layout, no sliding window) -> its
    base causal LM; otherwise a ValueError naming what can."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = lm.config
    kind = getattr(cfg, "model_type", None)
    windowed = getattr(cfg, "use_sliding_window", False) or (
        kind not in ("qwen2", "qwen3") and getattr(cfg, "sliding_window", None))
    if kind not in LLAMA_LAYOUT or windowed:
        raise ValueError(f"the sampler decodes models of the Llama layout without a sliding window "
                         f"({', '.join(LLAMA_LAYOUT)}); this model is {kind!r}")
    return lm


def rotate(x, cos, sin):
    """RoPE on [B, H, W, D] with cos, sin [B, W, D] (the halves convention of Llama and Qwen)."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)                # [B, H, W, D]
    return x * cos[:, None] + turned * sin[:, None]


def forward(lm, cache, ids, positions, slots, end):
    """Feed `ids` [B, W] at positions [B, W] into slots `slots` [W] (a tensor, so a captured step
    reads the slot it is given) -> the last hidden state of each row [B, D] (the output layer is
    the caller's). Each query attends to the valid slots up to its own among the first `end` (and
    to itself, so a padding query attends somewhere). The G query heads of a key/value head go in
    as G x W query rows of that head: grouped keys and values are never repeated."""
    body = lm.get_decoder()
    B, W = ids.shape
    x = body.embed_tokens(ids)                                                 # [B, W, D]
    cos, sin = body.rotary_emb(x, positions)                                   # [B, W, d]
    upto = torch.arange(end, device=ids.device)                                # [S]
    mask = (cache.valid[:, None, :end] & (upto <= slots[:, None])) | (upto == slots[:, None])
    for i, layer in enumerate(body.layers):                                    # (mask [B, W, S])
        attn = layer.self_attn
        d = attn.head_dim
        h = layer.input_layernorm(x)                                           # [B, W, D]
        q = project(attn.q_proj, h).view(B, W, -1, d)                          # [B, W, H, d]
        k = project(attn.k_proj, h).view(B, W, -1, d)                          # [B, W, H_kv, d]
        v = project(attn.v_proj, h).view(B, W, -1, d).transpose(1, 2)          # [B, H_kv, W, d]
        if hasattr(attn, "q_norm"):  # Qwen3 normalises each head's queries and keys
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = rotate(q.transpose(1, 2), cos, sin)                                # [B, H, W, d]
        k = rotate(k.transpose(1, 2), cos, sin)                                # [B, H_kv, W, d]
        ensure_layer(cache, i, k)
        cache.keys[i].index_copy_(2, slots, k.to(cache.keys[i].dtype))
        cache.values[i].index_copy_(2, slots, v.to(cache.values[i].dtype))
        H, H_kv = q.shape[1], k.shape[1]
        g = H // H_kv
        q = q.reshape(B, H_kv, g * W, d)                                       # [B, H_kv, gW, d]
        rows = mask[:, None, None].expand(B, 1, g, W, end).reshape(B, 1, g * W, end)
        out = F.scaled_dot_product_attention(q, cache.keys[i][:, :, :end],
                                             cache.values[i][:, :, :end], attn_mask=rows,
                                             scale=attn.scaling)               # [B, H_kv, gW, d]
        out = out.reshape(B, H, W, d).transpose(1, 2).reshape(B, W, H * d)     # [B, W, H d]
        x = x + project(attn.o_proj, out)
        h, mlp = layer.post_attention_layernorm(x), layer.mlp                  # SwiGLU:
        x = x + project(mlp.down_proj,
                        mlp.act_fn(project(mlp.gate_proj, h)) * project(mlp.up_proj, h))
    return body.norm(x[:, -1])                                                 # [B, D]


COPIES = weakref.WeakKeyDictionary()  # {nn.Linear: (its weight's version, the sampling copy)}


def project(module, x):
    """module(x) for a linear layer (nn.Linear, or a peft LoRA layer around one), its weight read
    from a copy kept for sampling, made again when the weight changes (an optimiser step): in
    autocast's dtype, so no step casts the weights again (a CUDA graph must not), and on a CPU as
    a contiguous W^T -- with a decode step's few rows, F.linear(x, W) ran at a fifth of the speed
    of x @ W^T on a 2-core Intel Xeon (bench/README.md). The same numbers up to the order of a
    sum."""
    base = getattr(module, "base_layer", module)
    if not isinstance(base, torch.nn.Linear) or any(getattr(module, "use_dora", {}).values()):
        return module(x)
    w, kind = base.weight, x.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else w.dtype
    version, copy = COPIES.get(base, (None, None))
    if version != (w._version, w.data_ptr(), dtype):
        copy = w.detach().to(dtype)                                            # [out, in]
        copy = copy.t().contiguous() if kind == "cpu" else copy                # CPU: [in, out]
        COPIES[base] = ((w._version, w.data_ptr(), dtype), copy)
    x = x.to(dtype)
    bias = None if base.bias is None else base.bias.to(dtype)
    out = F.linear(x, copy, bias) if kind != "cpu" else (
        x @ copy if bias is None else torch.addmm(bias, x.flatten(0, -2), copy).view(
            *x.shape[:-1], -1))
    if base is not module and not module.disable_adapters and not module.merged:
        for name in module.active_adapters:  # peft's LoRA: B(A(dropout(x))) x scaling, added
            if name in module.lora_A:
                lora = project(module.lora_B[name], project(module.lora_A[name],
                                                            module.lora_dropout[name](x)))
                out = out + lora * module.scaling[name]
    return out


def ensure_layer(cache, i, k):
    """Allocate layer i's keys and values at its first write, in the dtype attention will read
    them in (under autocast its dtype, not the float32 that RoPE's tables give)."""
    if cache.keys[i] is None:
        dtype = (torch.get_autocast_dtype(k.device.type)
                 if torch.is_autocast_enabled(k.device.type) else k.dtype)
        shape = (len(cache.valid), k.shape[1], cache.valid.shape[1], k.shape[-1])
        cache.keys[i], cache.values[i] = (k.new_zeros(shape, dtype=dtype) for _ in range(2))


def decode_step(lm, cache, token, running, slot, end):
    """One step of the loop: each row's last token goes into slot `slot` [1] (real for the rows
    still running, a hole for the others), attending over the first `end` slots -> the next
    token's logits [B, V]. On a GPU `end` is the whole cache: the same shapes at every step of a
    turn, one CUDA graph (graphed_step); on a CPU only the filled slots."""
    cache.valid.index_copy_(1, slot, running[:, None])
    hidden = forward(lm, cache, token[:, None], cache.position[:, None], slot, end)  # [B, D]
    cache.position += running.long()
    return project(lm.get_output_embeddings(), hidden)                         # [B, V]


def graphed_step(lm, cache, rows):
    """decode_step for this turn, captured as one CUDA graph over its cache (whose shapes hold
    until the loop ends): each step copies its inputs into the graph's own and replays it, one
    launch instead of the hundreds of kernels a step of a 24-layer model is. The capture runs the
    step on rows that are not running at the slot the loop writes first, so what it writes is
    written over. None where it cannot be captured (the loop then runs the step eagerly)."""
    device = cache.valid.device
    token = torch.zeros(rows, dtype=torch.long, device=device)
    running = torch.zeros(rows, dtype=torch.bool, device=device)
    slot = torch.tensor([cache.slot], device=device)
    end = cache.valid.shape[1]
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # a first run outside the capture: copies, lazy set-ups
            decode_step(lm, cache, token, running, slot, end)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = decode_step(lm, cache, token, running, slot, end)
    except RuntimeError as e:
        print(f"the decode step runs eagerly: capturing it as a CUDA graph failed "
              f"({str(e).splitlines()[0]})")
        return None

    def step(cache_, token_, running_, slot_, end_):
        token.copy_(token_)
        running.copy_(running_)
        slot.copy_(slot_)
        graph.replay()
        return logits
    return step


# ------------------------------------------------------------------------------------- the policy

def hf_policy(model, tokenizer, max_new_tokens, temperature=1.0, top_p=1.0, check_every=None):
    """A Hugging Face causal LM as a policy(prompt_ids, envs) -> list[Generation]: one batched call
    for all prompts, each stopping at an end-of-turn token or after max_new_tokens; temperature 0
    means greedy (log-probs then at temperature 1). Sampling settings are explicit, so a
    checkpoint's generation_config (e.g. Qwen's repetition penalty and top_k) cannot change the
    distribution. Runs on the model's device in its current mode and dtype (sample in eval mode:
    no dropout; under autocast, in its dtype). `check_every`: steps between two looks at whether
    every row has stopped (default 8 on a GPU, 1 on a CPU, where a look costs nothing).

    The policy remembers the cache of its last call, one row per prompt. A prompt that continues a
    remembered row (the row's tokens are a prefix of it) reuses the row and encodes only its new
    tokens; otherwise the whole batch is encoded afresh, each token once (module docstring).
    """
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    stop_ids, pad = rollout.end_of_turn_ids(tokenizer), rollout.pad_token_id(tokenizer)
    lm = check_layout(model) if model is not None else None
    last = {"rows": {}}  # the last call's cache and {key: (row, tokens in the cache)}

    @torch.no_grad()
    def policy(prompt_ids, env_list=None):  # the environments are not needed to sample
        device, B = model.device, len(prompt_ids)
        keys = [id(env) for env in env_list] if env_list is not None else list(range(B))
        every = check_every or (8 if device.type == "cuda" else 1)

        def encode(prompt_ids, known):
            """Feed the cache's rows what is new in their prompts, left-padded to the longest new
            piece, into the next free slots -> the logits of each prompt's last token [B, V]."""
            B = len(prompt_ids)
            # BEGIN SOLUTION silent_bug
            new = [p[k:] for p, k in zip(prompt_ids, known)]
            # END SOLUTION silent_bug
            width = max(len(n) for n in new)
            ids = torch.full((B, width), pad, dtype=torch.long)                # [B, W]
            real = torch.zeros((B, width), dtype=torch.bool)                   # [B, W]
            for b, n in enumerate(new):
                ids[b, width - len(n):] = torch.tensor(n, dtype=torch.long)
                real[b, width - len(n):] = True
            ids, real = ids.to(device), real.to(device)
            positions = cache.position[:, None] + (real.cumsum(1) - 1).clamp(min=0)  # [B, W]
            slots = torch.arange(cache.slot, cache.slot + width, device=device)  # [W]
            ensure(cache, cache.slot + width + max_new_tokens)
            cache.valid[:, cache.slot:cache.slot + width] = real
            cache.position += real.sum(1)
            hidden = forward(lm, cache, ids, positions, slots, cache.slot + width)  # [B, D]
            cache.slot += width
            return project(lm.get_output_embeddings(), hidden)                 # [B, V]

        rows = _continued_rows(last["rows"], prompt_ids, keys)
        if rows is None:  # start afresh: what prompts share is encoded once, then copied
            distinct = [list(p) for p in dict.fromkeys(map(tuple, prompt_ids))]
            # the system prompt, the template's first tokens: all but each prompt's last token
            shared = min(logprobs.common_prefix(distinct), min(map(len, distinct)) - 1)
            cache = new_cache(lm, 1, device)
            if shared:
                encode([distinct[0][:shared]], [0])
            select(cache, torch.zeros(len(distinct), dtype=torch.long, device=device))
            logits = encode(distinct, [shared] * len(distinct))                # [U, V]
            # a group's rollouts share their first prompt: its cache is copied to each of them
            index = torch.tensor([distinct.index(list(p)) for p in prompt_ids], device=device)
            select(cache, index)
            logits = logits[index]                                             # [B, V]
        else:  # keep the rows of the prompts that continue, in the new order
            cache = last["cache"]
            select(cache, torch.tensor(rows, device=device))
            logits = encode(prompt_ids, [len(last["rows"][key][1]) for key in keys])  # [B, V]

        # ---- the loop of identical steps: sample, record, feed; a stopped row is fed padding
        # into a hole. Every `every` steps one look at the device: has every row stopped?
        step = graphed_step(lm, cache, B) if device.type == "cuda" else None
        step = step or functools.partial(decode_step, lm)
        tokens = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=device)  # [B, N]
        logps = torch.zeros(B, max_new_tokens, dtype=torch.float64, device=device)  # [B, N]
        entropies = torch.zeros(B, max_new_tokens, dtype=torch.float64, device=device)  # [B, N]
        fed = torch.zeros(B, max_new_tokens, dtype=torch.bool, device=device)  # [B, N]
        running = torch.ones(B, dtype=torch.bool, device=device)               # [B]
        finite = torch.ones(B, dtype=torch.bool, device=device)                # [B]
        stop = torch.tensor(stop_ids, device=device)
        slot = torch.tensor([cache.slot], device=device)  # [1], moved on the device
        for t in range(max_new_tokens):
            token, logps[:, t], entropies[:, t], ok = sample(logits, temperature, top_p)
            tokens[:, t] = torch.where(running, token, pad)
            finite &= ok | ~running
            fed[:, t] = running  # this token enters the cache for the rows that were running
            still = running & ~torch.isin(tokens[:, t], stop)
            if t == max_new_tokens - 1 or (t + 1) % every == 0 and not looks_alive(still, finite):
                break
            end = cache.valid.shape[1] if device.type == "cuda" else cache.slot + 1
            logits = step(cache, tokens[:, t], running, slot, end)
            cache.slot += 1
            slot += 1
            running = still
        n = t + 1
        if not finite.all():  # nan and inf would run on into the totals of the next turns
            raise RuntimeError("probability tensor contains a number that is not finite")
        fed[:, n - 1] = False  # the last token sampled was not fed (the loop ends before it)
        tokens, fed = tokens[:, :n].cpu().tolist(), fed[:, :n].cpu().tolist()  # [B, n]
        logps = logps[:, :n].cpu().tolist()  # [B, n], float64 as mi.cross_scores
        entropies = entropies[:, :n].float().cpu().tolist()                    # [B, n]
        last.update(cache=cache, rows={
            key: (b, p + [t for t, f in zip(row, on) if f])
            for b, (key, p, row, on) in enumerate(zip(keys, prompt_ids, tokens, fed))})
        return as_generations(tokens, logps, stop_ids, entropies)

    return policy


def looks_alive(still, finite):
    """The loop's one look at the device: some row still running and every distribution finite
    (a non-finite one ends the loop and is raised after it)."""
    return bool(still.any() & finite.all())


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
