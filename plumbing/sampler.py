"""The faster layer under generate.py's plain sampler, for Llama-layout decoders (Llama, SmolLM2,
Qwen2 / 2.5, Qwen3; the tiny policy is a Qwen2): the same sampling law and the same loop of
identical steps (generate.sample, generate.decode), with a prefill and a step of its own, written as
gpt-fast writes a decoder (pytorch-labs/gpt-fast). Any other causal LM samples through
generate.own_forward. tests/test_sampler.py holds the two equal token for token.

The cache. Allocated once and written at positions: rows are episodes; every row writes its k-th
fed token into the same slot k, so the slot a step writes is one number the host knows without
asking the device. Where rows differ in length, slots hold holes (left padding, the steps after a
row stopped) that a boolean mask `valid` hides; every token gets its own transcript's position id,
so attention and RoPE see exactly what a fresh forward pass over the transcript sees. Each turn's
prompt is the last turn's transcript plus the reply and the new observation, so an episode keeps
its rows between turns and encodes only the new tokens (turn 5 of a 700-token Sokoban transcript
costs its ~100 new tokens, not 700). What the prompts share is encoded once: the system prompt on
one row, then each distinct prompt's rest, then the group's rows copied from it.

The step. `forward` calls the model's own norms, rotary tables and embedding but does the products
and the attention itself: the G query heads that share a key/value head are laid side by side as
G query rows of that head, so grouped keys and values are read as they are, never copied G times
(the trick of flash-decoding). The weights are made at every call from the live ones
(sampling_weights: q, k and v joined, gate and up joined, LoRA adapters merged, in autocast's
dtype, transposed where the CPU multiplies that layout faster). Nothing in a step asks the device
anything, so on a GPU the step -- the forward pass and the next token's sampling, sampling_step,
its uniform numbers drawn before it -- is captured once as a CUDA graph over the cache's tensors
and replayed (graphed_step), in the turns after too while the cache keeps its tensors: one launch
a token instead of hundreds, what torch.compile's "reduce-overhead" mode would record, without a
compiler.
"""
import dataclasses
import functools
import math

import torch
import torch.nn.functional as F

import generate
import logprobs
import rollout
from generate import sample, uniforms
from plumbing import hardware

LLAMA_LAYOUT = ("llama", "qwen2", "qwen3")  # decoders `forward` runs; others: generate.py
ROOM = 256  # the cache grows by this many slots at a time: few reallocations, few shapes


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
    forward pass and cache (generate.own_forward)."""
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


# ------------------------------------------------------------------------------------- the policy

def hf_policy(model, tokenizer, max_new_tokens, temperature=1.0, top_p=1.0, check_every=None,
              capture=None, transposed=None, failures=None, plain=False):
    """generate.policy, faster where the model has the Llama layout (check_layout): the same
    policy(prompt_ids, envs) -> list[Generation] and the same law and loop, with this module's
    prefill and step. `check_every`: steps between two looks at the device (default 8 on a GPU, 1
    on a CPU, where a look costs nothing). `capture`: how the sampling step is captured
    (graphed_step): None, as a CUDA graph on a GPU and not on a CPU; False, never; or a function
    (cuda_graph's contract). A capture that fails is said once, and the turns after it run
    eagerly; `failures`: a dict whose "capture" count each failed capture adds to (the run's
    log). `transposed`: the weights' layout (None: by the hardware, plumbing/hardware.py). A
    model of another layout samples through generate.policy, and so does any model with `plain`
    (where a run's self-check found the decode loop off: self_check).

    The policy remembers the cache of its last call, one row per prompt. A prompt that continues a
    remembered row (the row's tokens are a prefix of it) reuses the row and encodes only its new
    tokens; otherwise the whole batch is encoded afresh, each token once (module docstring).
    `policy(prompt_ids, forced=replies)` scores given replies instead of sampling (each a list of
    token ids): their log-probs and entropies as the loop computes them, nothing remembered.
    """
    law = generate.Sampling(max_new_tokens, temperature, top_p,
                            check_every or generate.looks_every(model))
    lm = check_layout(model) if model is not None and not plain else None
    if lm is None:
        plain = generate.policy(model, tokenizer, max_new_tokens, temperature, top_p, check_every)

        def policy(*args, **kwargs):  # the model's own masked attention, on chosen kernels
            with hardware.masked_attention(model.device.type):
                return plain(*args, **kwargs)
        return policy
    stop_ids, pad = generate.stop_ids(model, tokenizer), rollout.pad_token_id(tokenizer)
    flags = hardware.cpu_flags()
    last = {"rows": {}, "capture": capture}  # the last call's cache, {key: (row, its tokens)}

    @torch.no_grad()
    def policy(prompt_ids, env_list=None, forced=None):  # the environments are not needed
        device, B = model.device, len(prompt_ids)
        keys = [id(env) for env in env_list] if env_list is not None else list(range(B))
        n_max = max_new_tokens if forced is None else max(1, max(map(len, forced)))
        with hardware.masked_attention(device.type):  # forward's masked attention, on purpose
            logits, advance = start(prompt_ids, keys, device, forced is None, n_max)
            tokens, logps, entropies, fed = generate.decode(logits, advance, law, stop_ids, pad,
                                                            forced)
        if forced is None:
            last["rows"] = {key: (b, p + [t for t, f in zip(row, on) if f])
                            for b, (key, p, row, on) in enumerate(zip(keys, prompt_ids, tokens,
                                                                      fed))}
        return generate.as_generations(tokens, logps, stop_ids, entropies)

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
                    if failures is not None:
                        failures["capture"] = failures.get("capture", 0) + 1
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


decode_loop = hf_policy  # the sampler itself, for its self-check, whatever stands in for it


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


# --------------------------------------------------------- a run's first check of the fast path

SELF_CHECK_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1}  # nats a token, the mean |difference|


def self_check(model, tokenizer, prompt_ids, max_new_tokens, temperature, dtype, capture=None):
    """Before a run trusts its fast path, one prompt's reply is sampled through it and scored
    three other ways, each compared with it as the mean |log-prob difference| a token:
      capture  the captured step (where there is one: `capture`, or a CUDA graph on a GPU) against
               the eager decode loop from the same random numbers: the same tokens, the same
               log-probs;
      fast     the decode loop's log-probs against a plain teacher-forced forward pass over prompt
               and reply (logprobs.policy_logprobs);
      plain    generate.py's own-forward sampler scoring the same reply, against that pass.
    Within SELF_CHECK_TOLERANCE[dtype] a path is kept; outside it the run says so in one line
    and takes the path that agreed (capture -> the eager loop -> the model's own forward); where
    even that one disagrees, "agreed" is False (the run stops: runs.start). The random streams are
    forked: a run's training draws are the same with and without the check. ->
    {"selfcheck_capture_diff", "selfcheck_fast_diff", "selfcheck_plain_diff" (None where not
    run), "capture": None (as configured) or False (off), "plain": whether to sample through the
    model's own forward, "agreed", "tolerance"}."""
    tolerance = SELF_CHECK_TOLERANCE[dtype]
    out = {"selfcheck_capture_diff": None, "selfcheck_fast_diff": None, "capture": capture,
           "plain": check_layout(model) is None}
    devices = [model.device] if model.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        def sampled(policy):
            torch.manual_seed(0)
            return policy([prompt_ids], None)[0]
        if not out["plain"]:
            eager = sampled(decode_loop(model, tokenizer, max_new_tokens, temperature,
                                        capture=False))
            if capture or (capture is None and model.device.type == "cuda"):
                graphed = sampled(decode_loop(model, tokenizer, max_new_tokens, temperature,
                                              capture=capture))
                same = graphed.token_ids == eager.token_ids
                out["selfcheck_capture_diff"] = gap(graphed.logprobs or [], eager.logprobs or []) \
                    if same else math.inf
                if out["selfcheck_capture_diff"] > tolerance:
                    print(f"the decode step runs eagerly: its captured step sampled "
                          f"{'other tokens' if not same else 'log-probs'} than the eager step on "
                          f"the same inputs (mean difference {out['selfcheck_capture_diff']:.3g} "
                          f"nats a token, tolerance {tolerance:g})")
                    out["capture"] = False
            reply = eager
        else:
            reply = sampled(generate.policy(model, tokenizer, max_new_tokens, temperature))
        forward = teacher_forced(model, prompt_ids, reply.token_ids, temperature)
        plain = generate.policy(model, tokenizer, max_new_tokens, temperature)(
            [prompt_ids], forced=[reply.token_ids])[0]
        out["selfcheck_plain_diff"] = gap(plain.logprobs, forward)
        if not out["plain"] and reply.logprobs is not None:  # (a scripted policy records none)
            out["selfcheck_fast_diff"] = gap(reply.logprobs, forward)
            if out["selfcheck_fast_diff"] > tolerance:
                print(f"sampling through the model's own forward pass: the decode loop's "
                      f"log-probs are {out['selfcheck_fast_diff']:.3g} nats a token from a plain "
                      f"forward pass's (tolerance {tolerance:g})")
                out["plain"] = True
    out.update(agreed=out["selfcheck_plain_diff"] <= tolerance, tolerance=tolerance)
    return out


def teacher_forced(model, prompt_ids, reply_ids, temperature):
    """The reply's log-probs [n] from one forward pass over prompt and reply."""
    ids = torch.tensor([list(prompt_ids) + list(reply_ids)], device=model.device)  # [1, T]
    mask = torch.zeros(1, ids.shape[1] - 1, device=model.device)                   # [1, T-1]
    mask[0, len(prompt_ids) - 1:] = 1
    logp, _ = logprobs.policy_logprobs(model, ids, mask, temperature=temperature,
                                       dtype=torch.float64)
    return logp[0, len(prompt_ids) - 1:].tolist()


def gap(a, b):
    """The mean |a - b| over two lists of log-probs (0 for none)."""
    return sum(abs(x - y) for x, y in zip(a, b)) / max(1, len(a))
