"""The GPU memory plan: --micro-batch, --grad-checkpointing and --rollout-batch, when not given,
chosen from the model's shapes and the GPU's memory before the critic and the reference are made
and any rollout starts. A run that cannot fit is refused in one line that names what would
(cannot_fit). The plan keeps both

    resident (weights, gradients, AdamW) + one micro-batch's activations  <= budget x GPU memory
    resident + the sampler's weights + the episodes sampled at once       <= budget x GPU memory
"""

import dataclasses

import torch

from plumbing import sampler
from plumbing.flags import UsageError


def gpu_memory_settings(a, policy, device):
    """--micro-batch, --grad-checkpointing and --rollout-batch when not given, for the GPU's
    memory, said aloud; a run that cannot fit is refused here, before the critic and the
    reference are made and any rollout starts (memory_plan)."""
    total = torch.cuda.get_device_properties(device).total_memory
    n_all = sum(p.numel() for p in policy.parameters())
    n_train = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    plan = memory_plan(a, policy.config.get_text_config(), n_all, n_train, total)
    a.micro_batch, a.grad_checkpointing, a.rollout_batch, longest = plan
    ckpt = " --grad-checkpointing" if a.grad_checkpointing else ""
    print(f"memory: {total / 2 ** 30:.0f} GiB GPU; chose --micro-batch {a.micro_batch}{ckpt} "
          f"--rollout-batch {a.rollout_batch} for transcripts up to {longest} tokens")


def resident_bytes(a, n_all, n_train):
    """What stays in GPU memory through a run: the fp32 weights (a second copy for PPO's critic
    and for a KL reference, unless LoRA lets both share the base), and the gradients and AdamW's
    two moments of what trains (the critic's too)."""
    models = 2 if a.algo == "ppo" else 1
    copies = 1 if a.lora else models + (1 if a.kl_coef or a.grad_decomp_every else 0)
    return 4 * n_all * copies + models * 12 * n_train


def lora_count(cfg, rank):
    """The parameters of rank-`rank` LoRA adapters on every linear layer of a Llama-layout
    decoder (q, k, v, o, gate, up, down), from its shapes: rank x (inputs + outputs) each."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    return cfg.num_hidden_layers * rank * (4 * h + 2 * (h + kv) + 3 * (h + i))


def memory_plan(a, cfg, n_all, n_train, total, budget=0.85):
    """(micro_batch, grad_checkpointing, rollout_batch, longest) for `budget` of `total` bytes at
    the worst-case transcript length `longest`, estimated from the model's shapes; settings the user
    gave are kept. A UsageError when nothing fits: what would (cannot_fit).

    Always resident: resident_bytes. The update adds the bf16 activations of one micro-batch: the
    largest micro-batch (up to the mini-batch) that fits, without checkpointing when 4 sequences fit
    that way (checkpointing costs ~30% more compute). Rollouts add the bf16 key/value cache of the
    episodes sampled at once: as many whole groups as fit.
    """
    free = budget * total - resident_bytes(a, n_all, n_train)
    # prompt + turns x (reply + observation), tokens
    longest = 400 + a.max_turns * (a.max_new_tokens + 300)
    micro, ckpt = a.micro_batch, a.grad_checkpointing
    per_seq = update_bytes(cfg, longest)
    for option in [ckpt] if ckpt is not None else [False, True]:
        fit = int(free // per_seq[option])
        if fit >= min(4, a.mini_batch_size) or micro is not None or option or ckpt is not None:
            micro, ckpt = micro or max(1, min(fit, a.mini_batch_size)), option
            break
    # what the user chose is theirs to try; what the plan chooses must fit
    if free < 0 or a.micro_batch is None and free < micro * per_seq[ckpt]:
        raise UsageError(cannot_fit(a, cfg, n_all, n_train, total, budget))
    copies, per_episode = rollout_bytes(a, cfg, n_all, longest)
    episodes = a.groups * a.group_size
    fit = min(episodes, int((free - copies) // per_episode))
    at_once = a.rollout_batch or max(a.group_size, fit // a.group_size * a.group_size)
    if a.rollout_batch is None and free - copies < at_once * per_episode:
        raise UsageError(cannot_fit(a, cfg, n_all, n_train, total, budget))
    return micro, ckpt, at_once, longest


def update_bytes(cfg, longest):
    """{checkpointing: bytes one sequence of `longest` tokens keeps for the backward pass}. A
    layer keeps, per token under bf16 autocast, 32h + 8i bytes: the fp32 residual stream and two
    norms' inputs and outputs (8h each in and out of the two norms, 24h with the residual), the
    bf16 inputs of the seven projections and attention's q, k, v and output (about 8h), and the
    MLP's bf16 gate, up and activation (8i with the product); with checkpointing only each
    layer's fp32 input stays, and one layer's activations are rebuilt at a time."""
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    per_token = 32 * h + 8 * i
    return {False: layers * longest * per_token, True: longest * (layers * h * 4 + per_token)}


def rollout_bytes(a, cfg, n_all, longest):
    """(the sampler's weights, bytes an episode holds while the rollouts sample): the weights the
    decode loop multiplies by, made at each call (sampler.sampling_weights: 2 bytes a weight in
    bfloat16, 4 in float32, q/k/v and gate/up joined); an episode's key/value cache, every turn's
    slots with room rounded up to sampler.ROOM, in the sampling dtype, and its key/value layer a
    second time while `select` moves the rows; a prefill's attention mask over the widest new
    piece of a prompt (the first prompt, or a reply and the next observation) against every slot,
    the G query heads of a key/value head side by side, as bools and as the additive bias attention
    makes of them (1 + the sampling dtype's bytes each); and a step's tables over the vocabulary
    (generate.sample): the float32 tempered logits, less their largest, its exp and their product
    for the entropy (4 x 4 bytes) and draw's float64 running sum (8), and with --sample-top-p < 1
    the nucleus' sorted float32 table, its int64 order, its float64 running sum and two float32
    tables it makes (28 more)."""
    size = 4 if (a.sample_dtype or a.dtype) == "float32" else 2
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    slots = (longest + sampler.ROOM) * 2 * kv_heads * head_dim * size
    widest = max(400, a.max_new_tokens + 300)
    mask = cfg.num_attention_heads // kv_heads * widest * longest * (1 + size)
    tables = (24 + (28 if a.sample_top_p < 1 else 0)) * cfg.vocab_size
    return size * n_all, slots * (cfg.num_hidden_layers + 1) + mask + tables


def cannot_fit(a, cfg, n_all, n_train, total, budget):
    """The line that refuses a run whose weights, optimiser state and one sequence's update or
    one group's rollouts do not fit `budget` of the GPU: what it needs, and what would fit."""
    need = resident_bytes(a, n_all, n_train)
    options = []
    for flag, change, trained in (("--lora 16", dict(lora=16), lora_count(cfg, 16)),
                                  ("--algo grpo (no critic)", dict(algo="grpo"), n_train),
                                  ("--lora 16 --algo grpo", dict(lora=16, algo="grpo"),
                                   lora_count(cfg, 16))):
        other = dataclasses.replace(a, **change, micro_batch=None, grad_checkpointing=None,
                                    rollout_batch=None)
        if (a.lora, a.algo) != (other.lora, other.algo):
            try:
                memory_plan(other, cfg, n_all, trained, total, budget)
                options.append(flag)
            except UsageError:
                pass
    options = [o for o in options if o.count("--") == 1] or options  # one change, if one does
    fits = (f"what fits: {' or '.join(options)}" if options else
            "neither --lora 16 nor --algo grpo fits: a smaller model")
    return (f"{n_all / 1e9:.1f}B parameters, --algo {a.algo}{f' --lora {a.lora}' if a.lora else ''}: "
            f"{need / 2 ** 30:.0f} GiB stay resident (weights, gradients, AdamW), and with one "
            f"sequence of the update and one group of rollouts this does not fit {budget:.0%} of "
            f"the GPU's {total / 2 ** 30:.0f} GiB; {fits}")

