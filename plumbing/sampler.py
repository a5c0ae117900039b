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
run through `forward`, which calls the model's own norms, rotary tables and embedding but does the
products and the attention itself: the G query heads that share a key/value head are laid side by
side as G query rows of that head, so grouped keys and values are read as they are, never copied
G times (the trick of flash-decoding). The weights are made at every call from the live ones
(sampling_weights: q, k and v joined, gate and up joined, LoRA adapters merged, in autocast's
dtype, transposed where the CPU multiplies that layout faster). Nothing in a step asks the device
anything: stopped rows are masked on the device, and whether every row has stopped, or a
distribution stopped being finite, is read every `check_every` steps (each a wait for the device
on a GPU, free on a CPU). So on a GPU the step -- the forward pass and the next token's sampling,
sampling_step, its uniform numbers drawn before it -- is captured once as a CUDA graph over the
cache's tensors and replayed (graphed_step), in the turns after too while the cache keeps its
tensors: one launch a token instead of hundreds, what torch.compile's "reduce-overhead" mode would
record, without a compiler. Any other causal LM samples through its own forward pass and cache
(own_forward): slower, the same law.
"""
import dataclasses
import functools

import torch
import torch.nn.functional as F

import logprobs
import rollout
from plumbing import hardware

LLAMA_LAYOUT = ("llama", "qwen2", "qwen3")  # decoders `forward` runs; others: own_forward
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


def sample(logits, temperature, top_p, forced=None, u=None):
    """The next token of each row from its logits [B, V] -> (token [B], its log-prob [B], the
    distribution's entropy [B], finite [B]), all of the tempered full distribution; temperature 0
    is greedy (the log-probs then at temperature 1); `forced` [B]: these tokens instead, scored as
    if drawn (a replay of given replies); `u`: draw's uniform numbers, where drawn before.

    The tables are float32 -- x = logits / temperature, x less its row's largest, and its exp --
    and only the sums over the vocabulary are float64 (a float32 sum over 150,000 terms drifts
    with one sign): log pi(token) = x_token - max - log(sum exp(x - max)) and the entropy
    log(sum) - sum(exp(x - max)(x - max)) / sum. So the recorded log-prob is logprobs.tempered's
    float64 one (what the update and the diagnosis score) up to the float32 rounding of x, ~1e-7
    of |x|, at a third of a float64 table's bytes. A row is finite when x holds no nan and its
    largest entry is finite: a token masked to -inf is a legitimate zero (0 log 0 = 0)."""
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
    """Keep, reorder or copy the cache's rows: row b becomes old row index[b], a layer at a time
    (one layer more than the cache, not twice it). As many rows as before: written in place, so
    a step captured over the cache's tensors runs on in the next turn."""
    def chosen(x):
        return x.copy_(x[index]) if len(x) == len(index) else x[index]
    for store in (cache.keys, cache.values):
        for i, x in enumerate(store):
            store[i] = None if x is None else chosen(x)
    cache.valid, cache.position = chosen(cache.valid), chosen(cache.position)


def check_layout(model):
    """The model's base causal LM if the decode loop can run it -- the Llama layout without a
    sliding window, LoRA adapters (not DoRA) -- else None: such a model samples through its own
    forward pass and cache (own_forward)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = lm.config
    kind = getattr(cfg, "model_type", None)
    windowed = getattr(cfg, "use_sliding_window", False) or (
        kind not in ("qwen2", "qwen3") and getattr(cfg, "sliding_window", None))
    dora = any(any(getattr(m, "use_dora", {}).values()) for m in model.modules())
    return None if kind not in LLAMA_LAYOUT or windowed or dora else lm


def rotate(x, cos, sin):
    """RoPE on [B, H, W, D] with cos, sin [B, W, D] (the halves convention of Llama and Qwen)."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)                # [B, H, W, D]
    return x * cos[:, None] + turned * sin[:, None]


def sampling_weights(lm, dtype, transposed, into=None):
    """What the decode loop multiplies by, made from the live weights at every call of the policy
    (so any optimiser step, a fused one included, is sampled from at the next call): each layer's
    q, k and v projections as one matrix and the MLP's gate and up as one (fewer, larger
    products), LoRA adapters merged in (W + B A x scaling, as peft merges them), in `dtype`,
    transposed where that multiplies faster (plumbing/hardware.py) -> {"layers": [{"qkv", "o",
    "gate_up", "down"}], "head", "heads": (H, H_kv, d)}, each weight a (W, bias, transposed).
    `into`: an earlier call's weights, whose tensors are written over where they fit (the ones a
    captured step reads; one weight made at a time beside them, not a second copy of all)."""
    def joined(old, *modules):
        pairs = [merged(m) for m in modules]
        w = pairs[0][0] if len(pairs) == 1 else torch.cat([w for w, _ in pairs])  # [out, in]
        b = None
        if any(b is not None for _, b in pairs):
            b = torch.cat([w.new_zeros(len(w)) if b is None else b for w, b in pairs]).to(dtype)
        w = w.to(dtype)
        w = w.t().contiguous() if transposed else w
        if old is not None and (old[0].shape, old[0].dtype, old[1] is None, old[2]) == (
                w.shape, w.dtype, b is None, transposed):
            old[0].copy_(w)
            if b is not None:
                old[1].copy_(b)
            return old
        return w, b, transposed

    cfg = lm.config
    H = cfg.num_attention_heads
    decoder_layers = lm.get_decoder().layers
    before = into["layers"] if into else [{}] * len(decoder_layers)
    layers = [dict(qkv=joined(old.get("qkv"), layer.self_attn.q_proj, layer.self_attn.k_proj,
                              layer.self_attn.v_proj),
                   o=joined(old.get("o"), layer.self_attn.o_proj),
                   gate_up=joined(old.get("gate_up"), layer.mlp.gate_proj, layer.mlp.up_proj),
                   down=joined(old.get("down"), layer.mlp.down_proj))
              for layer, old in zip(decoder_layers, before)]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    return dict(layers=layers, head=joined(into and into["head"], lm.get_output_embeddings()),
                heads=(H, getattr(cfg, "num_key_value_heads", None) or H, head_dim))


def merged(module):
    """A linear layer's weight [out, in] (its active LoRA adapters added in) and bias."""
    base = getattr(module, "base_layer", module)
    w, b = base.weight.detach(), None if base.bias is None else base.bias.detach()
    if base is not module and not module.disable_adapters and not module.merged:
        with torch.autocast(w.device.type, enabled=False):  # the sum in the weights' dtype
            for name in module.active_adapters:
                if name in module.lora_A:
                    w = w + module.get_delta_weight(name)
    return w, b


def linear(x, weight):
    """x W^T (+ b) for a weight of sampling_weights."""
    w, b, transposed = weight
    x = x.to(w.dtype)
    out = x @ w if transposed else F.linear(x, w)
    return out if b is None else out + b


def forward(lm, weights, cache, ids, positions, slots, end):
    """Feed `ids` [B, W] at positions [B, W] into slots `slots` [W] (a tensor, so a captured step
    reads the slot it is given) -> the last hidden state of each row [B, D] (the output layer is
    the caller's). Each query attends to the valid slots up to its own among the first `end` (and
    to itself, so a padding query attends somewhere). The G query heads of a key/value head go in
    as G x W query rows of that head: grouped keys and values are never repeated."""
    body = lm.get_decoder()
    B, W = ids.shape
    H, H_kv, d = weights["heads"]
    x = body.embed_tokens(ids)                                                 # [B, W, D]
    cos, sin = body.rotary_emb(x, positions)                                   # [B, W, d]
    upto = torch.arange(end, device=ids.device)                                # [S]
    mask = (cache.valid[:, None, :end] & (upto <= slots[:, None])) | (upto == slots[:, None])
    for i, (layer, w) in enumerate(zip(body.layers, weights["layers"])):       # (mask [B, W, S])
        attn = layer.self_attn
        h = layer.input_layernorm(x)                                           # [B, W, D]
        q, k, v = linear(h, w["qkv"]).split([H * d, H_kv * d, H_kv * d], -1)
        q, k = q.view(B, W, H, d), k.view(B, W, H_kv, d)                       # [B, W, H(_kv), d]
        v = v.view(B, W, H_kv, d).transpose(1, 2)                              # [B, H_kv, W, d]
        if hasattr(attn, "q_norm"):  # Qwen3 normalises each head's queries and keys
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = rotate(q.transpose(1, 2), cos, sin)                                # [B, H, W, d]
        k = rotate(k.transpose(1, 2), cos, sin)                                # [B, H_kv, W, d]
        ensure_layer(cache, i, k)
        cache.keys[i].index_copy_(2, slots, k.to(cache.keys[i].dtype))
        cache.values[i].index_copy_(2, slots, v.to(cache.values[i].dtype))
        g = H // H_kv
        q = q.reshape(B, H_kv, g * W, d)                                       # [B, H_kv, gW, d]
        rows = mask[:, None, None].expand(B, 1, g, W, end).reshape(B, 1, g * W, end)
        out = F.scaled_dot_product_attention(q, cache.keys[i][:, :, :end],
                                             cache.values[i][:, :, :end], attn_mask=rows,
                                             scale=attn.scaling)               # [B, H_kv, gW, d]
        out = out.reshape(B, H, W, d).transpose(1, 2).reshape(B, W, H * d)     # [B, W, H d]
        x = x + linear(out, w["o"])
        gate, up = linear(layer.post_attention_layernorm(x), w["gate_up"]).chunk(2, -1)
        x = x + linear(layer.mlp.act_fn(gate) * up, w["down"])                 # SwiGLU
    return body.norm(x[:, -1])                                                 # [B, D]


def ensure_layer(cache, i, k):
    """Allocate layer i's keys and values at its first write, in the dtype attention will read
    them in (under autocast its dtype, not the float32 that RoPE's tables give)."""
    if cache.keys[i] is None:
        dtype = (torch.get_autocast_dtype(k.device.type)
                 if torch.is_autocast_enabled(k.device.type) else k.dtype)
        shape = (len(cache.valid), k.shape[1], cache.valid.shape[1], k.shape[-1])
        cache.keys[i], cache.values[i] = (k.new_zeros(shape, dtype=dtype) for _ in range(2))


def decode_step(lm, weights, cache, token, running, slot, end):
    """One step of the loop: each row's last token goes into slot `slot` [1] (real for the rows
    still running, a hole for the others), attending over the first `end` slots -> the next
    token's logits [B, V]. Captured, `end` is the whole cache: the same shapes at every step of a
    turn, one graph (graphed_step); eager, only the filled slots."""
    cache.valid.index_copy_(1, slot, running[:, None])
    hidden = forward(lm, weights, cache, token[:, None], cache.position[:, None], slot, end)
    cache.position += running.long()
    return linear(hidden, weights["head"])                                     # [B, V]


def sampling_step(lm, weights, temperature, top_p, cache, token, running, slot, end, u=None,
                  forced=None):
    """The loop's step as one function of tensors: decode_step's forward pass of each row's last
    token, then the next token sampled from those logits (sample; `u` [B, 1] its uniform numbers,
    drawn before the step where the step is captured, or `forced` [B]) -> (token, its log-prob,
    the entropy, finite), each [B]. Captured on a GPU whole: the forward pass and the sampling's
    passes over [B, V] in one graph."""
    logits = decode_step(lm, weights, cache, token, running, slot, end)        # [B, V]
    return sample(logits, temperature, top_p, forced, u)


# ------------------------------------------------------ one graph over a cache's tensors (a GPU)

def graphed_step(step, cache, rows, capture):
    """`step` (sampling_step with its model, weights and settings) captured once over the cache's
    tensors, whose shapes and storage hold while it is neither grown nor given other rows (turns
    that continue their rows keep it: select writes in place): each call copies its inputs into
    the graph's own and replays it, returning the graph's output tensors, written again at every
    replay (a caller reads them before the next). `capture(run) -> replay` records `run`
    (cuda_graph on a GPU; tests drive a stand-in with its semantics on a CPU). The capture runs the
    step on rows that are not running at the slot the loop writes first, so what it writes is
    written over. Raises what the capture raises."""
    device = cache.valid.device
    token = torch.zeros(rows, dtype=torch.long, device=device)                 # [B]
    running = torch.zeros(rows, dtype=torch.bool, device=device)               # [B]
    slot = torch.tensor([cache.slot], device=device)                           # [1]
    u = torch.zeros(rows, 1, dtype=torch.float64, device=device)             # [B, 1]
    replay = capture(lambda: step(cache, token, running, slot, cache.valid.shape[1], u))

    def replayed(token_, running_, slot_, u_):
        token.copy_(token_)
        running.copy_(running_)
        slot.copy_(slot_)
        if u_ is not None:  # greedy draws nothing
            u.copy_(u_)
        return replay()
    return replayed


def cuda_graph(run):
    """`run` captured as one CUDA graph -> replay(), which runs it again and returns the tensor
    the capture returned (its values new): one launch instead of the hundreds of kernels a step of
    a 24-layer model is. A first run on a side stream, outside the capture, does the lazy set-ups.
    The stream in use before is in use after, whatever fails."""
    before = torch.cuda.current_stream()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(before)
        with torch.cuda.stream(side):
            run()
        before.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
    finally:
        torch.cuda.set_stream(before)

    def replay():
        graph.replay()
        return out
    return replay


# -------------------------------------------------------- any other model: its own forward

def own_forward(model, prompt_ids, pad, device):
    """A model the decode loop cannot run (another architecture: GPT-2, Gemma, Phi...) through its
    own forward pass and key/value cache: the prompts left-padded and encoded whole, then one token
    a step, a stopped row fed a hole -> (the first logits [B, V], advance(token, running) -> the
    next logits). Slower: nothing is kept across turns, and the model's own layers run."""
    B, width = len(prompt_ids), max(map(len, prompt_ids))
    ids = torch.full((B, width), pad, dtype=torch.long)                        # [B, W]
    mask = torch.zeros((B, width), dtype=torch.long)                           # [B, W]
    for b, p in enumerate(prompt_ids):
        ids[b, width - len(p):], mask[b, width - len(p):] = torch.tensor(p, dtype=torch.long), 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(1) - 1).clamp(min=0)                              # [B, W]
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    state = dict(cache=logprobs.cache_of(out), mask=mask, position=positions[:, -1] + 1)

    def advance(token, running):
        state["mask"] = torch.cat([state["mask"], running[:, None].long()], 1)  # [B, W + t]
        out = model(input_ids=token[:, None], attention_mask=state["mask"],
                    position_ids=state["position"][:, None], use_cache=True,
                    **{logprobs.cache_keyword(model): state["cache"]})
        state["cache"] = logprobs.cache_of(out)
        state["position"] = state["position"] + running.long()
        return out.logits[:, -1]
    return out.logits[:, -1], advance


# ------------------------------------------------------------------------------------- the policy

def hf_policy(model, tokenizer, max_new_tokens, temperature=1.0, top_p=1.0, check_every=None,
              capture=None, transposed=None):
    """A Hugging Face causal LM as a policy(prompt_ids, envs) -> list[Generation]: one batched call
    for all prompts, each stopping at an end-of-turn token or after max_new_tokens; temperature 0
    means greedy (log-probs then at temperature 1). Sampling settings are explicit, so a
    checkpoint's generation_config (e.g. Qwen's repetition penalty and top_k) cannot change the
    distribution. Runs on the model's device in its current mode and dtype (sample in eval mode:
    no dropout; under autocast, in its dtype). `check_every`: steps between two looks at whether
    every row has stopped (default 8 on a GPU, 1 on a CPU, where a look costs nothing).
    `capture`: how the sampling step is captured (graphed_step): None, as a CUDA graph on a GPU and
    not on a CPU; False, never; or a function (cuda_graph's contract). A capture that fails is said
    once, and the turns after it run eagerly. `transposed`: the weights' layout (None: by the
    hardware, plumbing/hardware.py).

    The policy remembers the cache of its last call, one row per prompt. A prompt that continues a
    remembered row (the row's tokens are a prefix of it) reuses the row and encodes only its new
    tokens; otherwise the whole batch is encoded afresh, each token once (module docstring).
    `policy(prompt_ids, forced=replies)` scores given replies instead of sampling (each a list of
    token ids): their log-probs and entropies as the loop computes them, nothing remembered.
    """
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    stop_ids, pad = rollout.end_of_turn_ids(tokenizer), rollout.pad_token_id(tokenizer)
    lm = check_layout(model) if model is not None else None
    flags = hardware.cpu_flags()
    last = {"rows": {}, "capture": capture}  # the last call's cache, {key: (row, its tokens)}

    @torch.no_grad()
    def policy(prompt_ids, env_list=None, forced=None):  # the environments are not needed
        device, B = model.device, len(prompt_ids)
        keys = [id(env) for env in env_list] if env_list is not None else list(range(B))
        every = check_every or (8 if device.type == "cuda" else 1)
        n_max = max_new_tokens if forced is None else max(1, max(map(len, forced)))
        lengths = torch.full((B,), n_max, device=device)                       # [B]
        if forced is not None:
            lengths = torch.tensor([len(f) for f in forced], device=device)
            forced = torch.tensor([list(f) + [pad] * (n_max - len(f)) for f in forced],
                                  dtype=torch.long, device=device)             # [B, N]
        if lm is None:
            logits, forward_of = own_forward(model, prompt_ids, pad, device)

            def advance(token, running, forced_next):
                return sample(forward_of(token, running), temperature, top_p, forced_next)
        else:
            logits, advance = start(prompt_ids, keys, device, forced is None, n_max)

        # ---- the loop of identical steps: sample, record, feed; a stopped row is fed padding
        # into a hole. Every `every` steps one look at the device: has every row stopped?
        tokens = torch.full((B, n_max), pad, dtype=torch.long, device=device)  # [B, N]
        logps = torch.zeros(B, n_max, dtype=torch.float64, device=device)     # [B, N]
        entropies = torch.zeros(B, n_max, dtype=torch.float64, device=device)  # [B, N]
        fed = torch.zeros(B, n_max, dtype=torch.bool, device=device)          # [B, N]
        running = torch.ones(B, dtype=torch.bool, device=device)               # [B]
        finite = torch.ones(B, dtype=torch.bool, device=device)                # [B]
        stop = torch.tensor(stop_ids, device=device)
        drawn = sample(logits, temperature, top_p, None if forced is None else forced[:, 0])
        for t in range(n_max):
            token, logps[:, t], entropies[:, t], ok = drawn
            tokens[:, t] = torch.where(running, token, pad)
            finite &= ok | ~running
            fed[:, t] = running  # this token enters the cache for the rows that were running
            still = running & ~torch.isin(tokens[:, t], stop) & (t + 1 < lengths)
            if t == n_max - 1 or (t + 1) % every == 0 and not looks_alive(still, finite):
                break
            drawn = advance(tokens[:, t], running, None if forced is None else forced[:, t + 1])
            running = still
        n = t + 1
        if not finite.all():  # nan and inf would run on into the totals of the next turns
            raise RuntimeError("probability tensor contains a number that is not finite")
        fed[:, n - 1] = False  # the last token sampled was not fed (the loop ends before it)
        tokens, fed = tokens[:, :n].cpu().tolist(), fed[:, :n].cpu().tolist()  # [B, n]
        logps = logps[:, :n].cpu().tolist()  # [B, n], float64 as mi.cross_scores
        entropies = entropies[:, :n].float().cpu().tolist()                    # [B, n]
        if lm is not None and forced is None:
            last["rows"] = {key: (b, p + [t for t, f in zip(row, on) if f])
                            for b, (key, p, row, on) in enumerate(zip(keys, prompt_ids, tokens,
                                                                      fed))}
        return as_generations(tokens, logps, stop_ids, entropies)

    def start(prompt_ids, keys, device, remember, n_max):
        """The decode loop's start: the cache (the remembered one where every prompt continues a
        row of it), the prompts' new tokens encoded -> (the first logits [B, V],
        advance(token, running, forced) -> sampling_step's next token, log-prob, entropy, finite).
        Sampling (`remember`) on a GPU, the step is captured, or the last call's capture replayed
        where the cache's and the weights' tensors are the same."""
        dtype = (torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type)
                 else next(model.parameters()).dtype)
        layout = transposed if transposed is not None else hardware.transposed_weights(
            device.type, str(dtype).removeprefix("torch."), flags)
        capture_with = last["capture"]
        if capture_with is None and device.type == "cuda":
            capture_with = cuda_graph
        capture_with = capture_with if remember else False  # a replay of given replies: eager
        if capture_with:  # this call's values in the tensors the last capture reads
            weights = last["weights"] = sampling_weights(lm, dtype, layout, last.get("weights"))
        else:
            weights = sampling_weights(lm, dtype, layout)

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
            ensure(cache, cache.slot + width + n_max)
            cache.valid[:, cache.slot:cache.slot + width] = real
            cache.position += real.sum(1)
            hidden = forward(lm, weights, cache, ids, positions, slots, cache.slot + width)
            cache.slot += width
            return linear(hidden, weights["head"])                             # [B, V]

        rows = _continued_rows(last["rows"], prompt_ids, keys) if remember else None
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
        if remember:
            last["cache"] = cache

        step = functools.partial(sampling_step, lm, weights, temperature, top_p)
        B = len(prompt_ids)
        if capture_with:
            over = [B] + [x.data_ptr() for x in cache.keys + cache.values + [
                cache.valid, cache.position] + [w[0] for layer in weights["layers"]
                                                for w in layer.values()] + [weights["head"][0]]]
            if last.get("graph", (None,))[0] != over:
                last.pop("graph", None)  # the old graph's memory let go before the new capture
                try:
                    last["graph"] = over, graphed_step(step, cache, B, capture_with)
                except RuntimeError as e:  # said once; the turns after this run eagerly
                    print(f"the decode step runs eagerly: capturing it failed "
                          f"({str(e).splitlines()[0]})")
                    last["capture"], capture_with = False, None
        slot = torch.tensor([cache.slot], device=device)  # [1], moved on the device

        def advance(token, running, forced):
            if capture_with:
                drawn = last["graph"][1](token, running, slot,
                                         uniforms(B, device) if temperature else None)
            else:
                drawn = step(cache, token, running, slot, cache.slot + 1, forced=forced)
            cache.slot += 1
            slot.add_(1)
            return drawn
        return logits, advance

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
