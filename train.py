"""The experiment: multi-turn PPO / GRPO on a text world, with SNR-aware filtering and the MI diagnosis (RAGEN-2).

    python train.py --env sokoban --filter topp       # the tiny CPU policy without a GPU, Qwen2.5-0.5B-Instruct with one

One training step, top to bottom in `main`:
  1. rollouts     G prompt groups (one env seed each) x K rollouts, up to 5 turns          rollout.play
  2. diagnosis    step 1 and every 5 steps, before filtering: cross-score first-turn       mi.cross_scores,
                  reasoning under every prompt of the batch                                mi.collapse_metrics
  3. filter       rank groups by reward std, keep Top-P / Top-K; dropped groups never     snr_filter.select_groups
                  reach the advantages; nothing kept -> skip the update (stop after 5)
  4. old / ref    log-probs of the sampled tokens before the update (+ critic values)     ppo.token_logprobs
  5. advantages   PPO: GAE with a critic; GRPO / Dr.GRPO: group-relative                  ppo.gae, grpo.group_advantages
  6. update       clipped loss - entropy bonus (+ KL) in micro-batches, grad clip 1.0     ppo.clipped_policy_loss
  7. bookkeeping  metrics.jsonl line, validation every 10 steps, checkpoint, plots at the end

Outputs in --out: config.json, metrics.jsonl (one JSON object per step, flushed), checkpoint/ (model + tokenizer via
save_pretrained, critic, optimisers, RNG states; replaced atomically), PNG figures (plots.py). Ctrl-C or a kill loses
at most the step in flight: `--resume DIR` continues from the checkpoint with the same RNG stream.
Evaluate a checkpoint: `python train.py --env sokoban --model runs/X/checkpoint --steps 0` (logs val_success).
"""
import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

import envs
import grpo
import mi
import plots
import ppo
import rollout
import snr_filter

VAL_SEED_BASE = 10_000_000  # validation seeds are 10_000_000 + i; training seeds are drawn below it


def arg(default, help, **kw):
    return field(default=default, metadata=dict(help=help, **kw))


@dataclass
class Args:
    # the world
    env: str = arg("sokoban", "environment", choices=tuple(envs.ENVS))
    room_size: int = arg(6, "sokoban: the room is room_size x room_size")
    num_boxes: int = arg(1, "sokoban: number of boxes")
    lake_size: int = arg(4, "frozenlake: the map is lake_size x lake_size")
    success_rate: float = arg(1.0, "frozenlake: probability a move goes the intended way (1 = deterministic, 1/3 = Gymnasium)")
    high_prob: float = arg(0.25, "bandit: probability that the risky arm pays")
    max_turns: int = arg(5, "turns per episode")
    max_actions_per_turn: int = arg(2, "actions the policy may take per turn")
    # the algorithm
    algo: str = arg("ppo", "ppo (critic + GAE), grpo (group-normalised), drgrpo (no std division)",
                    choices=("ppo", "grpo", "drgrpo"))
    filter: str = arg("topp", "SNR-aware filter on the groups' reward std", choices=snr_filter.MODES)
    top_p: float = arg(0.9, "topp: keep the best groups until this fraction of the summed reward std")
    top_k: float = arg(0.5, "topk: keep max(1, int(top_k * groups)) best groups")
    filter_prob_mode: str = arg("linear", "topp: on the std itself (linear) or on its softmax", choices=snr_filter.PROB_MODES)
    include_zero: bool = arg(False, "let zero-spread groups be kept (they carry no task gradient)")
    groups: int = arg(8, "prompt groups (env seeds) per step")
    group_size: int = arg(16, "rollouts per group")
    steps: int = arg(100, "training steps")
    lr: float = arg(None, "actor learning rate (default 1e-6; tiny: 1e-4)")
    critic_lr: float = arg(None, "critic learning rate (default 1e-5; tiny: 1e-3)")
    clip_low: float = arg(0.2, "PPO ratio clip below 1")
    clip_high: float = arg(0.28, "PPO ratio clip above 1")
    value_clip: float = arg(0.2, "critic value clip")
    kl_coef: float = arg(0.0, "coefficient of the KL penalty to the initial policy (0 = no reference model)")
    kl_kind: str = arg("k3", "KL estimator", choices=ppo.KL_KINDS)
    entropy_coef: float = arg(0.001, "entropy bonus coefficient")
    gamma: float = arg(1.0, "GAE discount")
    lam: float = arg(1.0, "GAE lambda")
    mini_batch_size: int = arg(32, "trajectories per optimiser step")
    micro_batch: int = arg(8, "trajectories per forward/backward pass (memory knob; the result does not change)")
    epochs: int = arg(1, "passes over the kept batch per step")
    grad_clip: float = arg(1.0, "gradient norm clip")
    # generation
    temperature: float = arg(1.0, "sampling temperature of the rollouts")
    sample_top_p: float = arg(1.0, "nucleus sampling of the rollouts (1 = off)")
    max_new_tokens: int = arg(None, "token limit per turn (default 128; tiny: 64)")
    # the model
    model: str = arg(None, "Hugging Face id or local folder; 'tiny' for the embedded CPU policy "
                           "(default: Qwen/Qwen2.5-0.5B-Instruct with a GPU, tiny without)")
    dtype: str = arg(None, "compute dtype: bfloat16 (autocast, fp32 weights; GPU default) or float32",
                     choices=("float32", "bfloat16"))
    grad_checkpointing: bool = arg(False, "trade compute for activation memory")
    rebuild_tiny: bool = arg(False, "tiny: redo the supervised warm start instead of using the cache")
    warm_start: bool = arg(True, "tiny: warm-start on solver demonstrations (off = random network, for tests)")
    tiny_cache: str = arg(".cache/tiny", "tiny: folder of warm-started models")
    # diagnosis, validation, output
    mi_every: int = arg(5, "cross-scoring diagnosis at step 1 and every N steps (0 = off)")
    mi_samples: int = arg(64, "samples cross-scored per diagnosis")
    grad_decomp_every: int = arg(0, "task / KL / entropy gradient norms per reward-std bucket every N steps (0 = off)")
    val_every: int = arg(10, "validation every N steps and at the end")
    val_seeds: int = arg(64, "held-out validation seeds (one rollout each)")
    val_temperature: float = arg(0.5, "validation sampling temperature")
    save_every: int = arg(1, "checkpoint every N steps (1: an interruption loses at most the step in flight)")
    seed: int = arg(0, "seed of env seeds, sampling and shuffling")
    out: str = arg(None, "run folder (default runs/<env>-<algo>-<filter>-<time>)")
    resume: str = arg(None, "run folder to continue from its checkpoint (its config is used; --steps may extend)")
    plot: bool = arg(True, "write PNG figures at the end")


# ------------------------------------------------------------------------------------------------ command line

class UsageError(Exception):
    """Bad input from the user: one line on stderr, exit code 2."""


def build_parser(defaults=True):
    """One flag per Args field, its help the field's; defaults=False leaves out the flags not given (for --resume)."""
    class Parser(argparse.ArgumentParser):
        def error(self, message):  # argparse would print the usage too; one line is enough
            raise UsageError(message)

    parser = Parser(description=__doc__.split("\n")[0], argument_default=None if defaults else argparse.SUPPRESS)
    for f in dataclasses.fields(Args):
        flag, default = "--" + f.name.replace("_", "-"), f.default if defaults else argparse.SUPPRESS
        if f.type is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=f.metadata["help"])
        else:
            parser.add_argument(flag, type=f.type, default=default,
                                choices=f.metadata.get("choices"), help=f.metadata["help"])
    return parser


def parse_args(argv):
    args = Args(**vars(build_parser().parse_args(argv)))
    if args.resume:  # the run's own config, with the flags given now on top (e.g. more --steps)
        path = os.path.join(args.resume, "config.json")
        if not os.path.isfile(path):
            raise UsageError(f"--resume {args.resume}: no config.json there")
        with open(path) as f:
            saved = json.load(f)
        given = vars(build_parser(defaults=False).parse_args(argv))
        args = Args(**{**saved, **given, "out": args.resume})
    check_args(args)
    return args


def check_args(a):
    def need(ok, message):
        if not ok:
            raise UsageError(message)
    need(a.steps >= 0, f"--steps must be >= 0, got {a.steps}")
    need(0 < a.top_p <= 1, f"--top-p must be in (0, 1], got {a.top_p}")
    need(0 < a.top_k <= 1, f"--top-k is a fraction of the groups in (0, 1], got {a.top_k}")
    need(a.groups >= 1 and a.group_size >= 1, "--groups and --group-size must be >= 1")
    need(a.max_turns >= 1 and a.max_actions_per_turn >= 1, "--max-turns and --max-actions-per-turn must be >= 1")
    need(a.mini_batch_size >= 1 and a.micro_batch >= 1 and a.epochs >= 1, "batch sizes and --epochs must be >= 1")
    need(a.temperature > 0 and a.val_temperature >= 0 and 0 < a.sample_top_p <= 1,
         "need --temperature > 0, --val-temperature >= 0, --sample-top-p in (0, 1]")
    need(min(a.mi_every, a.val_every, a.grad_decomp_every, a.save_every) >= 0 and a.val_seeds >= 1,
         "--*-every must be >= 0 and --val-seeds >= 1")
    try:
        envs.make_env(a.env, **env_kwargs(a)).reset(seed=0)
    except ValueError as e:
        raise UsageError(f"--env {a.env}: {e}") from None


def env_kwargs(a):
    return {"sokoban": dict(dim_room=(a.room_size, a.room_size), num_boxes=a.num_boxes),
            "frozenlake": dict(size=a.lake_size, success_rate=a.success_rate),
            "bandit": dict(high_prob=a.high_prob)}.get(a.env, {})


# ------------------------------------------------------------------------------------------------ the policy

def load_policy(a, device, source):
    """(model, tokenizer, prompt): prompt holds rollout.play's `system` / `user` pieces for the tiny policy, else
    nothing (rollout's own prompt). `source` is a.model, or the run's checkpoint folder on resume."""
    if source == "tiny":
        import tiny
        model, tokenizer = tiny.load_tiny(a.env, env_kwargs(a), cache_dir=a.tiny_cache, rebuild=a.rebuild_tiny,
                                          warm_start=a.warm_start, seed=a.seed)
        return model.to(device), tokenizer, tiny.prompts(a.env)
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
    looks_local = source.startswith((".", "/", "~")) or os.path.exists(source)
    if looks_local and not os.path.isdir(os.path.expanduser(source)):
        raise UsageError(f"--model {source}: no such folder")
    source = os.path.expanduser(source)
    saved = {}  # what a checkpoint of ours adds: which prompt and attention kernel the policy was trained with
    if os.path.isfile(os.path.join(source, "policy.json")):
        with open(os.path.join(source, "policy.json")) as f:
            saved = json.load(f)
    try:
        tokenizer = (PreTrainedTokenizerFast if _plain_fast_tokenizer(source) else AutoTokenizer).from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32,
                                                     attn_implementation=saved.get("attn_implementation"))
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"--model {source}: cannot load it (not a model folder, or no network for a hub id): "
                         f"{first}") from None
    if saved.get("prompt") == "tiny":
        import tiny
        return model.to(device), tokenizer, tiny.prompts(a.env)
    return model.to(device), tokenizer, {}


def _plain_fast_tokenizer(folder):
    """True for a folder saved from a plain PreTrainedTokenizerFast (the tiny policy's; transformers 5 names its class
    TokenizersBackend): next to a qwen2 config.json, AutoTokenizer would rebuild it as Qwen2's byte-level tokenizer,
    which splits text differently."""
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return json.load(f).get("tokenizer_class") in ("PreTrainedTokenizerFast", "TokenizersBackend")


def sequence_logprobs(model, batch, rows, autocast, with_entropy=False):
    """log pi of every token given its prefix, for the sequences `rows`: ([b, T-1], entropy [b, T-1] or None)."""
    ids = batch["input_ids"][rows]                                                     # [b, T]
    with autocast():
        logits = model(input_ids=ids, attention_mask=batch["attention_mask"][rows]).logits[:, :-1]  # [b, T-1, V]
    logp = ppo.token_logprobs(logits, ids[:, 1:])                                      # [b, T-1]
    return logp, ppo.entropy_from_logits(logits) if with_entropy else None


def chunks(rows, size):
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def share(mask, rows, sub, agg):
    """Weight of micro-batch `sub` inside mini-batch `rows`, so that summing weight * aggregate(micro) gives exactly
    aggregate(mini): its share of the tokens (token-mean) or of the sequences with tokens (seq-mean-*)."""
    if agg == "token-mean":
        return float(mask[sub].sum() / mask[rows].sum().clamp_min(1))
    return float((mask[sub].sum(-1) > 0).sum() / (mask[rows].sum(-1) > 0).sum().clamp_min(1))


# ------------------------------------------------------------------------------------------------ filter, update

def select(a, rewards):
    """Step 3: which groups to train on, from the spread (unbiased std) of their total rewards [G, K]."""
    scores = snr_filter.group_scores(rewards)                                          # [G]
    value = a.top_p if a.filter == "topp" else a.top_k
    keep = snr_filter.select_groups(scores, a.filter, value, a.include_zero, a.filter_prob_mode)  # [G]
    return keep, snr_filter.filter_stats(scores, keep)


def learn(a, model, critic, optimizers, ref_model, episodes, rewards, keep, pad_id, autocast, generator, device):
    """Steps 4-6 on the kept groups: the dropped ones are removed before collation, so nothing of them (padding
    width, advantages, normalisers) reaches the update."""
    kept = [e for e in episodes if keep[e.group]]
    batch = {k: v.to(device) for k, v in rollout.collate(kept, pad_id).items()}
    return update(a, model, critic, optimizers, ref_model, batch, rewards[keep], autocast, generator)


def update(a, model, critic, optimizers, ref_model, batch, rewards, autocast, generator):
    """Steps 4-6 on the kept episodes (`batch` from rollout.collate, `rewards` [G_kept, K]); returns metrics."""
    device = batch["input_ids"].device
    B = batch["input_ids"].shape[0]
    mask = batch["policy_mask"][:, 1:]                                                 # [B, T-1] trained tokens
    agg = {"ppo": "token-mean", "grpo": "seq-mean-token-mean", "drgrpo": "seq-mean-token-sum"}[a.algo]
    everything = torch.arange(B, device=device)

    # 4. log-probs before the update (the "old" policy of the ratio), reference log-probs, critic values
    with torch.no_grad():
        old_logp, ref_logp, entropy, values = [], [], [], []
        for rows in chunks(everything, a.micro_batch):
            lp, ent = sequence_logprobs(model, batch, rows, autocast, with_entropy=True)
            old_logp.append(lp)
            entropy.append(ent)
            if ref_model is not None:
                ref_logp.append(sequence_logprobs(ref_model, batch, rows, autocast)[0])
            if critic is not None:
                with autocast():
                    values.append(critic(batch["input_ids"][rows], batch["attention_mask"][rows])[:, :-1].float())
        old_logp, entropy = torch.cat(old_logp), torch.cat(entropy)                    # [B, T-1]
        ref_logp = torch.cat(ref_logp) if ref_model is not None else None             # [B, T-1]

    # 5. advantages
    if a.algo == "ppo":
        values = torch.cat(values)                                                     # [B, T-1]
        adv, returns = ppo.gae(batch["token_rewards"][:, 1:], values, mask, a.gamma, a.lam)  # [B, T-1]
    else:
        episode_adv = grpo.group_advantages(rewards, normalize_std=a.algo == "grpo").reshape(-1)  # [B]
        adv = grpo.episode_advantages_to_tokens(episode_adv.to(device), mask)         # [B, T-1]

    # 6. the update: each mini-batch one optimiser step, accumulated over micro-batches
    logs = {"pg_loss": [], "entropy_loss": [], "kl_loss": [], "value_loss": [], "clip_frac": [], "approx_kl": [],
            "grad_norm": []}
    for _ in range(a.epochs):
        order = everything[torch.randperm(B, generator=generator).to(device)]
        for rows in chunks(order, a.mini_batch_size):
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            for sub in chunks(rows, a.micro_batch):
                w = share(mask, rows, sub, agg)
                logp, ent = sequence_logprobs(model, batch, sub, autocast, with_entropy=True)
                pg_loss, stats = ppo.clipped_policy_loss(logp, old_logp[sub], adv[sub], mask[sub],
                                                         a.clip_low, a.clip_high, agg)
                entropy_loss = ppo.aggregate(ent, mask[sub], agg)
                loss = pg_loss - a.entropy_coef * entropy_loss
                if ref_logp is not None:
                    kl_loss = ppo.aggregate(ppo.kl_estimate(logp, ref_logp[sub], a.kl_kind), mask[sub], agg)
                    loss = loss + a.kl_coef * kl_loss
                    logs["kl_loss"].append(kl_loss.item())
                (w * loss).backward()
                if critic is not None:
                    with autocast():
                        v = critic(batch["input_ids"][sub], batch["attention_mask"][sub])[:, :-1].float()
                    v_loss = ppo.value_loss(v, values[sub], returns[sub], mask[sub], a.value_clip)
                    (share(mask, rows, sub, "token-mean") * v_loss).backward()
                    logs["value_loss"].append(v_loss.item())
                logs["pg_loss"].append(pg_loss.item())
                logs["entropy_loss"].append(entropy_loss.item())
                logs["clip_frac"].append(stats["clip_frac"])
                logs["approx_kl"].append(stats["approx_kl"])
            logs["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)))
            if critic is not None:
                torch.nn.utils.clip_grad_norm_(critic.parameters(), a.grad_clip)
            for opt in optimizers:
                opt.step()
    out = {k: float(np.mean(v)) for k, v in logs.items() if v}
    out["token_entropy"] = ppo.masked_mean(entropy, mask).item()
    out["optimizer_steps"] = a.epochs * len(chunks(everything, a.mini_batch_size))
    return out


# ------------------------------------------------------------------------------------------------ diagnosis

def diagnose(model, tokenizer, episodes, a, mi_state):
    """Cross-score up to mi_samples first-turn reasonings under every group's first prompt (RAGEN-2 Sec. 2.3)."""
    per_group = max(1, a.mi_samples // a.groups)
    picked = [e for i, e in enumerate(episodes) if i % a.group_size < per_group][:a.mi_samples]
    prompts = [next(e.first_prompt for e in episodes if e.group == g) for g in range(a.groups)]
    scores, lengths = mi.cross_scores(model, tokenizer, prompts, [e.first_reasoning for e in picked],
                                      batch_size=a.micro_batch)
    metrics = mi.collapse_metrics(scores, [e.group for e in picked], lengths)
    metrics["mi_zscore_ema"], mi_state["std_ema"] = mi.mi_zscore_ema(metrics, mi_state.get("std_ema"))
    keep = ("mi_estimate", "mi_seq_estimate", "mi_zscore", "mi_zscore_seq", "mi_zscore_ema", "retrieval_acc",
            "retrieval_acc_top2", "conditional_entropy", "reasoning_entropy", "conditional_entropy_seq",
            "reasoning_entropy_seq", "retrieval_chance", "mi_upper_bound")
    return {k: metrics[k] for k in keep if k in metrics}


def validate(model, tokenizer, prompt, a, device):
    """Success on the fixed held-out seeds, one rollout each, at the validation temperature. Its sampling runs on a
    forked RNG so that validating does not change the training stream (resume stays exact)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(a.seed)
        return rollout.validate(model, tokenizer, a.env, [VAL_SEED_BASE + i for i in range(a.val_seeds)],
                                env_kwargs(a), temperature=a.val_temperature, max_new_tokens=a.max_new_tokens,
                                max_turns=a.max_turns, max_actions_per_turn=a.max_actions_per_turn, **prompt)


# ------------------------------------------------------------------------------------------------ checkpoints

def save_checkpoint(out, step, model, tokenizer, prompt, critic, optimizers, state):
    """Everything needed to continue exactly, written to a temporary folder first and then swapped in, so a kill
    in the middle leaves the previous checkpoint intact."""
    tmp, final = os.path.join(out, "checkpoint.tmp"), os.path.join(out, "checkpoint")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "policy.json"), "w") as f:
        json.dump({"prompt": "tiny" if prompt else None, "attn_implementation": model.config._attn_implementation}, f)
    torch.save({"step": step, "state": state, "critic": critic.state_dict() if critic is not None else None,
                "optimizers": [o.state_dict() for o in optimizers],
                "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}},
               os.path.join(tmp, "trainer_state.pt"))
    old = final + ".old"
    if os.path.isdir(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def restore_checkpoint(out, critic, optimizers):
    ckpt = torch.load(os.path.join(out, "checkpoint", "trainer_state.pt"), weights_only=False)
    if critic is not None:
        critic.load_state_dict(ckpt["critic"])
    for opt, s in zip(optimizers, ckpt["optimizers"]):
        opt.load_state_dict(s)
    torch.set_rng_state(ckpt["rng"]["torch"])
    np.random.set_state(ckpt["rng"]["numpy"])
    random.setstate(ckpt["rng"]["python"])
    if ckpt["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])
    return ckpt["step"], ckpt["state"]


def truncate_metrics(path, step):
    """Keep the lines of steps <= step: the steps after the checkpoint are run again, not logged twice."""
    if not os.path.isfile(path):
        return
    kept = [line for line in open(path) if line.strip() and _step_of(line) <= step]
    with open(path, "w") as f:
        f.writelines(kept)


def _step_of(line):
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError):
        return float("inf")  # a half-written line of a killed run


# ------------------------------------------------------------------------------------------------ main

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run(parse_args(argv))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(a):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.model is None:
        a.model = "Qwen/Qwen2.5-0.5B-Instruct" if device.type == "cuda" else "tiny"
        print(f"model: {a.model} ({'a GPU is present' if device.type == 'cuda' else 'no GPU found'}; "
              f"--model chooses another)")
    is_tiny = a.model == "tiny"
    a.lr = a.lr if a.lr is not None else (1e-4 if is_tiny else 1e-6)
    a.critic_lr = a.critic_lr if a.critic_lr is not None else (1e-3 if is_tiny else 1e-5)
    a.max_new_tokens = a.max_new_tokens if a.max_new_tokens is not None else (64 if is_tiny else 128)
    a.dtype = a.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    a.out = a.out or os.path.join("runs", f"{a.env}-{a.algo}-{a.filter}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(a.out, exist_ok=True)
    random.seed(a.seed)
    np.random.seed(a.seed)
    torch.manual_seed(a.seed)

    ckpt_dir = os.path.join(a.out, "checkpoint")
    resuming = a.resume is not None and os.path.isdir(ckpt_dir)
    model, tokenizer, prompt = load_policy(a, device, ckpt_dir if resuming else a.model)
    if a.grad_checkpointing:
        model.gradient_checkpointing_enable()
    ref_model = None
    if a.kl_coef > 0:  # the reference is the initial policy, loaded again from its source
        ref_model = load_policy(a, device, a.model)[0].eval().requires_grad_(False)
    critic = ppo.make_critic(model).to(device) if a.algo == "ppo" else None
    optimizers = [torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)]
    if critic is not None:
        optimizers.append(torch.optim.AdamW(critic.parameters(), lr=a.critic_lr, weight_decay=0.0))
    compute = torch.bfloat16 if a.dtype == "bfloat16" else None
    autocast = lambda: torch.autocast(device.type, dtype=compute, enabled=compute is not None)  # noqa: E731
    pad_id = rollout.pad_token_id(tokenizer)

    metrics_path = os.path.join(a.out, "metrics.jsonl")
    start, state = 0, {"skips": 0, "std_ema": None}
    if resuming:
        start, state = restore_checkpoint(a.out, critic, optimizers)
        truncate_metrics(metrics_path, start)
        print(f"resuming {a.out} after step {start}")
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump({k: v for k, v in dataclasses.asdict(a).items() if k not in ("resume",)}, f, indent=1)

    from tqdm import tqdm
    bar = tqdm(range(start + 1, a.steps + 1), initial=start, total=a.steps, desc=a.out, dynamic_ncols=True)
    log = open(metrics_path, "a")
    last = {"step": start}
    try:
        if a.steps == 0 or start == a.steps:  # evaluation only
            last = {"step": start, "val_success": validate(model, tokenizer, prompt, a, device)}
            log.write(json.dumps(last) + "\n")
            log.flush()
        for step in bar:
            m = {"step": step}
            t0 = time.time()
            # 1. rollouts: G groups (env seeds) x K samples
            seeds = np.random.default_rng([a.seed, step]).integers(0, VAL_SEED_BASE, a.groups).tolist()
            policy = rollout.hf_policy(model, tokenizer, a.max_new_tokens, a.temperature, a.sample_top_p)
            model.eval()
            with autocast():
                episodes = rollout.play(policy, tokenizer, a.env, seeds, a.group_size, env_kwargs(a), a.max_turns,
                                        a.max_actions_per_turn, **prompt)
            rewards = torch.tensor([e.total_reward for e in episodes]).view(a.groups, a.group_size)  # [G, K]
            m.update(train_success=float(np.mean([e.success for e in episodes])),
                     reward_mean=rewards.mean().item(), reward_std=rewards.std().item() if rewards.numel() > 1 else 0.0,
                     response_length=float(np.mean([n for e in episodes for n in e.response_lengths])),
                     turns=float(np.mean([e.turns for e in episodes])),
                     cut_frac=float(np.mean([e.cut for e in episodes])))
            m["time_rollout"] = time.time() - t0

            # 2. diagnosis, before filtering
            t1 = time.time()
            if a.mi_every and (step == 1 or step % a.mi_every == 0):
                m.update(diagnose(model, tokenizer, episodes, a, state))
            if a.grad_decomp_every and step % a.grad_decomp_every == 0:
                batch = {k: v.to(device) for k, v in rollout.collate(episodes, pad_id).items()}
                m["grad_decomposition"] = [{k: v for k, v in b.items() if k != "groups"} for b in
                                           snr_filter.gradient_decomposition(
                                               model, batch["input_ids"], batch["attention_mask"],
                                               batch["policy_mask"], rewards, ref_model=ref_model,
                                               kl_coef=max(a.kl_coef, 1e-3), entropy_coef=a.entropy_coef)]
                model.zero_grad(set_to_none=True)

            # 3. the filter: whole groups, before any advantage is computed
            keep, stats = select(a, rewards)                                           # [G]
            m.update(stats)
            m["time_scoring"] = time.time() - t1

            # 4-6. the update on the kept groups only
            t2 = time.time()
            m["skipped"] = not keep.any()
            if keep.any():
                state["skips"] = 0
                model.train()
                generator = torch.Generator().manual_seed(a.seed * 100_003 + step)
                m.update(learn(a, model, critic, optimizers, ref_model, episodes, rewards, keep, pad_id, autocast,
                               generator, device))
            else:
                state["skips"] += 1
            m["time_update"] = time.time() - t2

            # 7. bookkeeping
            if (a.val_every and step % a.val_every == 0) or step == a.steps:
                m["val_success"] = validate(model, tokenizer, prompt, a, device)
            m["time_step"] = time.time() - t0
            if device.type == "cuda":
                m["gpu_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
            log.write(json.dumps(m) + "\n")
            log.flush()
            if a.save_every and (step % a.save_every == 0 or step == a.steps):
                save_checkpoint(a.out, step, model, tokenizer, prompt, critic, optimizers, state)
            bar.set_postfix(success=f"{m['train_success']:.2f}", kept=f"{m['kept_ratio']:.2f}",
                            mi=f"{m.get('mi_zscore_ema', last.get('mi_zscore_ema', float('nan'))):.2f}")
            last = {**last, **m}
            if state["skips"] >= 5:
                print(f"stopping: no group had any reward spread for 5 steps in a row (step {step})")
                break
    except KeyboardInterrupt:
        print(f"\ninterrupted; continue with: python train.py --resume {a.out}", file=sys.stderr)
        return 130
    finally:
        log.close()
        bar.close()
    if a.plot and a.steps > 0:
        plots.plot_runs([a.out], a.out)
    summary = {k: last[k] for k in ("step", "train_success", "val_success", "kept_ratio", "mi_zscore_ema") if k in last}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
