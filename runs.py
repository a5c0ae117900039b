"""Everything around the experiment that a first reading of train.py may skip: the command line, loading the models,
the run folder (config, metrics log, checkpoints), resuming, and turning failures into one-line errors.

A run folder holds config.json (the resolved settings), metrics.jsonl (one JSON object per step, flushed as it is
written), checkpoint/ (weights or LoRA adapters, tokenizer, critic, optimisers, RNG states) and the figures. What a
run guarantees:
- A kill at any moment (Ctrl-C, kill -9, a full disk) loses at most the step in flight. A checkpoint is written to
  checkpoint.tmp, marked complete, then swapped in by renames; whatever moment a kill hits, the next start finds the
  newest complete checkpoint (recover_checkpoint) and `--resume` repeats the lost step exactly.
- `--resume DIR` continues with the run's own settings; only --steps (to extend), --val-every, --save-every,
  --plot and --threads may be given anew. A finished run is left as it is.
- Bad input (flags, a damaged config or checkpoint, an unusable --out) is one line on stderr and exit code 2, and a
  failed start leaves no folder behind; running out of GPU memory is one line naming the phase, exit code 3.
"""
import argparse
import contextlib
import dataclasses
import difflib
import errno
import fcntl
import json
import math
import os
import random
import shutil
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch

import envs
import rollout

RESUMABLE = ("steps", "val_every", "save_every", "plot", "threads")  # flags a resumed run may change
PHASES = {"collect_rollouts": "rollouts", "diagnose": "the MI diagnosis", "update_policy": "the update",
          "decompose_gradients": "the gradient decomposition", "validate": "validation"}


class UsageError(Exception):
    """Bad input from the user: one line on stderr, exit code 2."""


def main(Args, train, validate, argv):
    """Parse, start, train (or evaluate), finish; every failure becomes one line and an exit code."""
    run = None
    try:
        args = parse_args(Args, argv)
        run = start(args)
        if run is None:
            return 0
        if args.steps == 0:
            print(f"evaluating {args.model} on {args.env}: {args.val_seeds} held-out seeds, one rollout each, "
                  f"temperature {args.val_temperature}; results in {args.out}")
            record(run, {"step": 0, "val_success": validate(run)})
        else:
            if run.step == 0 and args.val_every:  # the starting point, to judge what training adds
                record(run, {"step": 0, "val_success": validate(run)})
            train(run)
        finish(run)
        return 0
    except UsageError as e:
        close(run)  # the progress bar ends its line first
        print(f"error: {e}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError as e:
        close(run)
        phase = next((PHASES[f.name] for f in reversed(traceback.extract_tb(e.__traceback__)) if f.name in PHASES),
                     "loading the models")
        print(f"error: out of GPU memory during {phase}; the last checkpoint is intact. Try --micro-batch 1, "
              f"--grad-checkpointing, --lora 16, fewer --groups / --group-size or --max-new-tokens", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        close(run)
        if run is not None and run.step > 0:
            print(f"\ninterrupted; continue with: python train.py --resume {run.args.out}", file=sys.stderr)
        else:
            print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        close(run)


# ------------------------------------------------------------------------------------------------ command line

def build_parser(Args, defaults=True):
    """One flag per Args field, one line of help each with the default in brackets; a boolean field is --name and
    --no-name (hidden). defaults=False leaves out the flags not given (for --resume). No abbreviations: --step is an error,
    not --steps."""
    class Parser(argparse.ArgumentParser):
        def error(self, message):  # argparse would print the usage too; one line is enough
            raise UsageError(message)

    parser = Parser(prog="train.py", usage="python train.py [flags]", allow_abbrev=False,
                    description="RAGEN-2 in miniature: PPO / GRPO with SNR-aware filtering and the MI diagnosis. "
                                "Defaults in brackets; every on/off flag also has a --no- form.",
                    argument_default=None if defaults else argparse.SUPPRESS,
                    formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=30, width=110))
    for f in dataclasses.fields(Args):
        flag, dest = "--" + f.name.replace("_", "-"), f.name
        default = f.default if defaults else argparse.SUPPRESS
        shown = "" if f.default is None else f" [{ {True: 'on', False: 'off'}.get(f.default, f.default)}]"
        if f.type is bool:
            parser.add_argument(flag, action="store_true", dest=dest, default=default,
                                help=f.metadata["help"] + shown)
            parser.add_argument("--no-" + flag[2:], action="store_false", dest=dest, help=argparse.SUPPRESS)
        else:
            choices = f.metadata.get("choices")
            listed = not choices or all(c in f.metadata["help"] for c in choices)
            text = f.metadata["help"] + ("" if listed else f": {', '.join(choices)}") + shown
            parser.add_argument(flag, type=f.type, dest=dest, default=default, choices=choices, help=text,
                                metavar=f.type.__name__.upper())
    return parser


def parse_args(Args, argv):
    """Args from the command line; with --resume, the run's saved settings with the allowed flags given on top."""
    args = Args(**vars(build_parser(Args).parse_args(argv)))
    if args.resume:
        given = vars(build_parser(Args, defaults=False).parse_args(argv))
        saved = read_config(args.resume, Args)
        if given.get("out") not in (None, args.resume):
            raise UsageError(f"--out {given['out']}: a resumed run stays in its folder {args.resume}")
        changed = sorted(k for k, v in given.items() if k not in ("resume", "out") and v != saved.get(k))
        fixed = [k for k in changed if k not in RESUMABLE]
        if fixed:
            k = fixed[0]
            raise UsageError(f"--{k.replace('_', '-')} {given[k]} differs from the run's {saved.get(k)}: a resumed "
                             f"run keeps its settings (it may change --{', --'.join(RESUMABLE).replace('_', '-')})")
        args = Args(**{**saved, **{k: given[k] for k in changed}, "resume": args.resume, "out": args.resume})
    check_args(args)
    return args


def read_config(folder, Args):
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise UsageError(f"--resume {folder}: no config.json there (not a run folder)")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"--resume {folder}: config.json is damaged ({e})") from None
    fields = {f.name: f for f in dataclasses.fields(Args)}
    if not isinstance(saved, dict) or set(saved) - set(fields):
        raise UsageError(f"--resume {folder}: config.json is not a run's config")
    for k, v in saved.items():
        kind = fields[k].type
        ok = v is None or (isinstance(v, kind) and not (kind is int and isinstance(v, bool))) or (
            kind is float and isinstance(v, int) and not isinstance(v, bool))
        if not ok:
            raise UsageError(f"--resume {folder}: config.json has {k} = {v!r}, not a {kind.__name__}")
    return {**saved, "resume": None}


def check_args(a):
    """Every setting a run could not use, as one clear line."""
    def need(ok, message):
        if not ok:
            raise UsageError(message)

    def finite(x):
        return x is None or math.isfinite(x)

    numbers = [v for v in dataclasses.asdict(a).values() if isinstance(v, float)]
    need(all(finite(v) for v in numbers), "every number must be finite (no nan / inf)")
    need(0 <= a.seed <= 2 ** 32 - 1, f"--seed must be in 0..2**32-1, got {a.seed}")
    need(a.steps >= 0, f"--steps must be >= 0, got {a.steps}")
    need(0 < a.top_p <= 1, f"--top-p must be in (0, 1], got {a.top_p}")
    need(0 < a.top_k <= 1, f"--top-k is a fraction of the groups in (0, 1], got {a.top_k}")
    need(a.groups >= 1 and a.group_size >= 1, "--groups and --group-size must be >= 1")
    need(a.max_turns >= 1 and a.max_actions_per_turn >= 1, "--max-turns and --max-actions-per-turn must be >= 1")
    need(a.mini_batch_size >= 1 and a.epochs >= 1, "--mini-batch-size and --epochs must be >= 1")
    need(all(x is None or x >= 1 for x in (a.micro_batch, a.rollout_batch)), "--micro-batch and --rollout-batch "
                                                                                "must be >= 1")
    need(all(x is None or x > 0 for x in (a.lr, a.critic_lr)), "learning rates must be > 0")
    need(0 <= a.gamma <= 1 and 0 <= a.lam <= 1, f"--gamma and --lam must be in [0, 1], got {a.gamma}, {a.lam}")
    need(0 < a.clip_low < 1 and a.clip_high > 0, "need 0 < --clip-low < 1 and --clip-high > 0")
    need(a.clip_c == 0 or a.clip_c > 1, f"--clip-c must be > 1 (or 0 = off), got {a.clip_c}")
    need(a.value_clip > 0 and a.grad_clip > 0, "--value-clip and --grad-clip must be > 0")
    need(a.kl_coef >= 0 and a.entropy_coef >= 0, "--kl-coef and --entropy-coef must be >= 0")
    need(a.temperature > 0 and a.val_temperature >= 0 and 0 < a.sample_top_p <= 1,
         "need --temperature > 0, --val-temperature >= 0, --sample-top-p in (0, 1]")
    need(a.max_new_tokens is None or a.max_new_tokens >= 1, "--max-new-tokens must be >= 1")
    need(a.mi_samples >= 1 and a.val_seeds >= 1, "--mi-samples and --val-seeds must be >= 1")
    need(min(a.mi_every, a.val_every, a.grad_decomp_every, a.save_every) >= 0, "--*-every must be >= 0")
    need(a.lora >= 0 and (a.lora_alpha is None or a.lora_alpha > 0), "--lora must be >= 0 and --lora-alpha > 0")
    need(a.threads is None or a.threads >= 1, "--threads must be >= 1")
    try:
        envs.make_env(a.env, **env_kwargs(a)).reset(seed=0)
    except ValueError as e:
        raise UsageError(f"--env {a.env}: {e}") from None


def env_kwargs(a):
    return {"sokoban": dict(dim_room=(a.room_size, a.room_size), num_boxes=a.num_boxes),
            "frozenlake": dict(size=a.lake_size, success_rate=a.success_rate),
            "bandit": dict(high_prob=a.high_prob)}.get(a.env, {})


# ------------------------------------------------------------------------------------------------ the run

@dataclass
class Run:
    """One bundle for what the loop uses: settings, models, optimisers, the run folder and the loop's state."""
    args: object
    device: torch.device
    ctx: object  # autocast context for the run's dtype (a no-op in float32)
    policy: torch.nn.Module
    tokenizer: object
    prompt: dict  # rollout.play's `system` / `user` pieces for the tiny policy, else {}
    critic: torch.nn.Module  # PPO only, else None
    reference_model: torch.nn.Module  # a frozen copy of the initial policy when --kl-coef > 0 (without LoRA)
    optimizers: list
    policy_params: list
    critic_params: list
    pad_id: int
    step: int = 0  # steps done
    state: dict = field(default_factory=lambda: {"skips": 0, "std_ema": None})
    last: dict = field(default_factory=dict)  # the newest value of every metric, for the summary and progress
    log: object = None
    bar: object = None
    lock: object = None


def start(a):
    """Resolve the defaults, load the models, open (or resume) the run folder. None: a finished run, nothing to do."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolve_defaults(a, device)
    created = open_folder(a)
    lock = None
    try:
        lock = lock_folder(a.out)
        if a.resume and finished(a):
            lock.close()
            return None
        run = load(a, device)
        run.lock = lock
        seed_everything(a.seed)  # after building the models: whether a warm start was built or loaded, the same run
        ckpt = recover_checkpoint(a.out) if a.resume else None
        if ckpt:
            run.step, run.state = restore(run, ckpt)
            print(f"resuming {a.out} after step {run.step}")
        elif a.resume:
            print(f"{a.out} has no checkpoint yet: starting it from step 0")
        truncate_metrics(os.path.join(a.out, "metrics.jsonl"), run.step if ckpt else -1)
        run.last = last_metrics(os.path.join(a.out, "metrics.jsonl"))
        write_config(a)
        run.log = open(os.path.join(a.out, "metrics.jsonl"), "a")
        if a.steps > 0:
            from tqdm import tqdm
            run.bar = tqdm(total=a.steps, initial=run.step, desc=a.out, dynamic_ncols=True, leave=True)
        return run
    except BaseException:
        if lock is not None:
            lock.close()
        if created:
            shutil.rmtree(a.out, ignore_errors=True)  # a failed start leaves nothing behind
        raise


def resolve_defaults(a, device):
    """Fill in the settings that depend on the machine and the model, and say what was chosen."""
    if a.model is None:
        a.model = "Qwen/Qwen2.5-0.5B-Instruct" if device.type == "cuda" else "tiny"
        print(f"model: {a.model} ({'a GPU is present' if device.type == 'cuda' else 'no GPU found'}; "
              f"--model chooses another)")
    tiny_model = a.model == "tiny"
    a.lr = a.lr or (1e-4 if tiny_model else 1e-6)
    a.critic_lr = a.critic_lr or (1e-3 if tiny_model else 1e-5)
    a.max_new_tokens = a.max_new_tokens or (64 if tiny_model else 400)
    a.dtype = a.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    a.lora_alpha = a.lora_alpha or (2.0 * a.lora if a.lora else None)
    if a.threads is None and device.type == "cpu":
        a.threads = 1 if tiny_model else (os.cpu_count() or 1)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.micro_batch is None and device.type == "cpu":
        a.micro_batch = a.mini_batch_size  # memory is not the limit here; fewer, larger passes are faster
    if a.steps == 0 and a.out is None:  # evaluating a model
        name = os.path.basename(os.path.normpath(a.model)) if a.model != "tiny" else "tiny"
        a.out = os.path.join("runs", f"eval-{a.env}-{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    a.out = a.out or os.path.join("runs", f"{a.env}-{a.algo}-{a.filter}-{time.strftime('%Y%m%d-%H%M%S')}")


# ------------------------------------------------------------------------------------------------ loading models

def load(a, device):
    """Policy, tokenizer and prompt; with LoRA the adapters; the critic (PPO), the reference (--kl-coef) and the
    optimisers. GPU memory settings not given are chosen here (gpu_memory_settings)."""
    source = os.path.join(a.out, "checkpoint") if a.resume and recover_checkpoint(a.out) else a.model
    policy, tokenizer, prompt = load_policy(a, source, device)
    if a.lora and not hasattr(policy, "disable_adapter"):
        policy = add_lora(policy, a)
    if device.type == "cuda" and None in (a.micro_batch, a.grad_checkpointing, a.rollout_batch):
        gpu_memory_settings(a, policy, device)
    if a.grad_checkpointing:
        enable = getattr(policy, "activation_checkpointing_enable", None) or policy.gradient_checkpointing_enable
        enable()
    critic, critic_params = None, []
    if a.algo == "ppo":
        critic = make_lora_critic(policy) if a.lora else __import__("ppo").make_critic(policy)
        critic = critic.to(device)
        critic_params = [p for p in critic.parameters() if p.requires_grad] + (
            lora_params(policy, "critic") if a.lora else [])
    reference_model = None
    if a.kl_coef > 0 and not a.lora:  # the reference is the initial policy, loaded again from its source
        reference_model = load_policy(a, a.model, device)[0].eval().requires_grad_(False)
    policy_params = lora_params(policy, "default") if a.lora else [p for p in policy.parameters()]
    optimizers = [torch.optim.AdamW(policy_params, lr=a.lr, weight_decay=0.0)]
    if critic is not None:
        optimizers.append(torch.optim.AdamW(critic_params, lr=a.critic_lr, weight_decay=0.0))
    ctx = (torch.autocast(device.type, dtype=torch.bfloat16) if a.dtype == "bfloat16"
           else contextlib.nullcontext())
    return Run(args=a, device=device, ctx=ctx, policy=policy, tokenizer=tokenizer, prompt=prompt, critic=critic,
               reference_model=reference_model, optimizers=optimizers, policy_params=policy_params,
               critic_params=critic_params, pad_id=rollout.pad_token_id(tokenizer))


def load_policy(a, source, device):
    """(model, tokenizer, prompt) from 'tiny', a checkpoint of ours, a local folder or a Hugging Face hub id."""
    if source == "tiny":
        import tiny
        model, tokenizer = tiny.load_tiny(a.env, env_kwargs(a), cache_dir=a.tiny_cache, rebuild=a.rebuild_tiny,
                                          warm_start=a.warm_start)
        return model.to(device), tokenizer, tiny.prompts(a.env)
    folder = os.path.expanduser(source)
    saved = {}  # what a checkpoint of ours adds: prompt, attention kernel, LoRA base
    if os.path.isfile(os.path.join(folder, "policy.json")):
        with open(os.path.join(folder, "policy.json")) as f:
            saved = json.load(f)
    if saved.get("lora_base") is not None:  # LoRA adapters: the base model first, then the adapters on it
        from peft import PeftModel
        base, tokenizer, prompt = load_policy(a, saved["lora_base"], device)
        model = PeftModel.from_pretrained(base, folder, is_trainable=True)
        if a.algo == "ppo" and os.path.isdir(os.path.join(folder, "critic")):
            model.load_adapter(os.path.join(folder, "critic"), adapter_name="critic", is_trainable=True)
        model.set_adapter("default")
        return model.to(device), tokenizer, prompt
    model, tokenizer = load_hf(source, saved.get("attn_implementation"))
    if saved.get("prompt") == "tiny":
        import tiny
        return model.to(device), tokenizer, tiny.prompts(a.env)
    return model.to(device), tokenizer, {}


def load_hf(source, attn_implementation=None):
    """A Hugging Face causal LM and tokenizer from a folder or hub id; fails fast (no retries) without a network."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
    folder = os.path.expanduser(source)
    local = source.startswith((".", "/", "~")) or os.path.exists(folder)
    if local and not os.path.isdir(folder):
        raise UsageError(f"--model {source}: no such folder")
    if not local:
        close = difflib.get_close_matches(source, ["tiny"], n=1, cutoff=0.6)
        if close:
            raise UsageError(f"--model {source}: not a folder or hub id; did you mean --model tiny?")
        if not hub_reachable():
            try:  # a hub id is usable without a network when it is in the local cache
                return load_hf_files(source, attn_implementation, local_files_only=True)
            except (OSError, ValueError):
                raise UsageError(f"--model {source}: not in the local Hugging Face cache, and the hub cannot be "
                                 f"reached (no network, or HF_HUB_OFFLINE is set)") from None
    try:
        return load_hf_files(folder if local else source, attn_implementation)
    except Exception as e:  # a missing, truncated or foreign file: whatever the loader raises, one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"--model {source}: cannot load it ({first})") from None


def load_hf_files(source, attn_implementation, local_files_only=False):
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
    plain = _plain_fast_tokenizer(source)
    tokenizer = (PreTrainedTokenizerFast if plain else AutoTokenizer).from_pretrained(
        source, local_files_only=local_files_only)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, local_files_only=local_files_only,
                                                 attn_implementation=attn_implementation)
    return model, tokenizer


def hub_reachable(timeout=3.0):
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _plain_fast_tokenizer(folder):
    """True for a folder saved from a plain PreTrainedTokenizerFast (the tiny policy's; transformers 5 names its class
    TokenizersBackend): next to a qwen2 config.json, AutoTokenizer would rebuild it as Qwen2's byte-level tokenizer,
    which splits text differently."""
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return json.load(f).get("tokenizer_class") in ("PreTrainedTokenizerFast", "TokenizersBackend")


# ------------------------------------------------------------------------------------------------ LoRA

def add_lora(model, a):
    """Wrap the policy in LoRA adapters (peft): only the adapters train; the base stays frozen and serves as the
    reference (adapters switched off) and as the critic's body (through a second adapter)."""
    from peft import LoraConfig, get_peft_model
    targets = a.lora_targets if a.lora_targets == "all-linear" else a.lora_targets.split(",")
    config = dict(r=a.lora, lora_alpha=a.lora_alpha, target_modules=targets, lora_dropout=0.0, bias="none",
                  task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, LoraConfig(**config))
    if a.algo == "ppo":
        peft_model.add_adapter("critic", LoraConfig(**config))
    peft_model.set_adapter("default")
    return peft_model


def lora_params(model, adapter):
    return [p for n, p in model.named_parameters() if f".{adapter}." in n and "lora_" in n]


@contextlib.contextmanager
def adapter(model, name):
    """Run with LoRA adapter `name` active (peft makes only the active adapter trainable), then switch back."""
    before = model.active_adapter
    model.set_adapter(name)
    try:
        yield model
    finally:
        model.set_adapter(before)
        for p in lora_params(model, "critic"):  # keep the critic's adapter trainable for its own optimiser
            p.requires_grad_(True)


class AdapterBody(torch.nn.Module):
    """The critic's body under LoRA: the policy's frozen base seen through its "critic" adapter. The base is not a
    submodule here, so the critic's own parameters are its head (and the adapter, passed to its optimiser)."""

    def __init__(self, peft_model):
        super().__init__()
        object.__setattr__(self, "peft_model", peft_model)

    def forward(self, input_ids, attention_mask=None):
        with adapter(self.peft_model, "critic"):
            decoder = self.peft_model.get_base_model().get_decoder()
            return decoder(input_ids=input_ids, attention_mask=attention_mask)


def make_lora_critic(peft_model):
    import ppo
    return ppo.Critic(AdapterBody(peft_model), peft_model.config.get_text_config().hidden_size)


@contextlib.contextmanager
def reference(run):
    """The reference policy for the KL term: the frozen copy, or under LoRA the base with its adapters off."""
    if run.reference_model is not None:
        yield run.reference_model
    else:
        with run.policy.disable_adapter():
            yield run.policy


# ------------------------------------------------------------------------------------------------ GPU memory

def gpu_memory_settings(a, policy, device):
    """--micro-batch, --grad-checkpointing and --rollout-batch when not given, for the GPU's memory (memory_plan)."""
    total = torch.cuda.get_device_properties(device).total_memory
    n_all = sum(p.numel() for p in policy.parameters())
    n_train = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    plan = memory_plan(a, policy.config.get_text_config(), n_all, n_train, total)
    a.micro_batch, a.grad_checkpointing, a.rollout_batch, longest = plan
    print(f"memory: {total / 2 ** 30:.0f} GiB GPU; chose --micro-batch {a.micro_batch}"
          f"{' --grad-checkpointing' if a.grad_checkpointing else ''} --rollout-batch {a.rollout_batch} "
          f"for transcripts up to {longest} tokens")


def memory_plan(a, cfg, n_all, n_train, total, budget=0.85):
    """(micro_batch, grad_checkpointing, rollout_batch, longest) for `budget` of `total` bytes at the worst-case
    transcript length `longest`, estimated from the model's shapes; settings the user gave are kept.
    Always resident: fp32 weights and AdamW state of what trains (x2 for PPO's critic, + a reference copy).
    Update: + gradients + bf16 activations of one micro-batch; the largest micro-batch (up to the mini-batch)
    that fits, without checkpointing when 4 sequences fit that way. Rollouts: + the bf16 key/value cache of the episodes sampled
    at once; as many whole groups as fit."""
    models = 2 if a.algo == "ppo" else 1
    resident = models * (4 * n_all + 8 * n_train) + (4 * n_all if a.kl_coef and not a.lora else 0)
    free = budget * total - resident
    longest = 400 + a.max_turns * (a.max_new_tokens + 300)  # prompt + turns x (reply + observation), in tokens
    # bytes a layer keeps for backward per token under bf16 autocast: the fp32 residual stream and norms, the bf16
    # inputs of every projection, attention's q, k, v and output, the MLP's gate, up and activation
    per_token = 24 * cfg.hidden_size + 8 * cfg.intermediate_size
    per_seq = {False: cfg.num_hidden_layers * longest * per_token,  # every layer's activations
               True: longest * (cfg.num_hidden_layers * cfg.hidden_size * 4 + per_token)}  # layer inputs only
    grads = models * 4 * n_train
    micro, ckpt = a.micro_batch, a.grad_checkpointing
    for option in [ckpt] if ckpt is not None else [False, True]:
        fit = int((free - grads) // per_seq[option])
        # without checkpointing only when a few sequences fit: it saves ~30% compute, not worth a 1-2 micro-batch
        if fit >= min(4, a.mini_batch_size) or micro is not None or option or ckpt is not None:
            micro, ckpt = micro or max(1, min(fit, a.mini_batch_size)), option
            break
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    kv_per_seq = longest * cfg.num_hidden_layers * 2 * kv_heads * head_dim * 2 + 4 * cfg.vocab_size
    episodes = a.groups * a.group_size
    fit = min(episodes, int((free - 2 * n_all) // kv_per_seq))  # the bf16 weights autocast caches: 2 n_all
    rollout = a.rollout_batch or max(a.group_size, fit // a.group_size * a.group_size)
    return micro, ckpt, rollout, longest


# ------------------------------------------------------------------------------------------------ the run folder

def open_folder(a):
    """Create --out for a new run (True), or check the folder of a resumed one (False). A new run never writes into
    a folder that already holds a run."""
    if a.resume:
        if not os.path.isdir(a.out):
            raise UsageError(f"--resume {a.out}: no such run folder")
        return False
    if os.path.isfile(os.path.join(a.out, "config.json")) or os.path.isfile(os.path.join(a.out, "metrics.jsonl")):
        raise UsageError(f"--out {a.out} already holds a run: continue it with --resume {a.out}, or choose another "
                         f"--out")
    existed = os.path.isdir(a.out)
    try:
        os.makedirs(a.out, exist_ok=True)
        probe = os.path.join(a.out, ".write-test")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        if not existed:
            shutil.rmtree(a.out, ignore_errors=True)
        raise UsageError(f"--out {a.out}: cannot write there ({e.strerror or e})") from None
    return not existed


def lock_folder(out):
    """Hold an exclusive lock on the run folder for the life of the process: two runs never share one folder."""
    handle = open(os.path.join(out, ".lock"), "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise UsageError(f"{out} is in use by another running process") from None
    return handle


def finished(a):
    """A resumed run that already did its steps: say so and leave it as it is."""
    ckpt = recover_checkpoint(a.out)
    done = checkpoint_step(ckpt) if ckpt else 0
    if a.steps < done:
        raise UsageError(f"--steps {a.steps} is below the {done} steps this run has done")
    if ckpt and done == a.steps:
        print(f"{a.out} is complete ({done} of {a.steps} steps); give --steps N to extend it")
        return True
    return False


def write_config(a):
    atomic_write(os.path.join(a.out, "config.json"),
                 json.dumps({k: v for k, v in dataclasses.asdict(a).items() if k != "resume"}, indent=1))


def atomic_write(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def truncate_metrics(path, step):
    """Keep the lines of steps <= step: the steps after the checkpoint run again, and are not logged twice."""
    if not os.path.isfile(path):
        return
    kept = [line for line in open(path) if line.strip() and _step_of(line) <= step]
    atomic_write(path, "".join(kept))


def _step_of(line):
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")  # a half-written line of a killed run


def last_metrics(path):
    last = {}
    if os.path.isfile(path):
        for line in open(path):
            with contextlib.suppress(json.JSONDecodeError, TypeError):
                last.update({k: v for k, v in json.loads(line).items() if not isinstance(v, list)})
    return last


def record(run, m):
    """Step 7's bookkeeping: the metrics line (flushed), a checkpoint when due, the progress bar."""
    a = run.args
    if run.device.type == "cuda":
        m["gpu_peak_gb"] = torch.cuda.max_memory_allocated() / 2 ** 30
    run.log.write(json.dumps(m) + "\n")
    run.log.flush()
    run.last.update({k: v for k, v in m.items() if not isinstance(v, list)})
    step = m["step"]
    if step == 0:
        return
    run.step = step
    if a.save_every and (step % a.save_every == 0 or step == a.steps):
        save_checkpoint(run, step)
    if run.bar is not None:
        last = run.last
        run.bar.update(1)
        run.bar.set_postfix_str(f"success={last.get('train_success', float('nan')):.2f} "
                                f"val={last.get('val_success', float('nan')):.2f} "
                                f"kept={last.get('kept_ratio', float('nan')):.2f} "
                                f"mi={last.get('mi_estimate', float('nan')):.2f}nats")


def finish(run):
    a = run.args
    if run.bar is not None:
        run.bar.close()
    if a.plot and a.steps > 0:
        import plots
        plots.plot_runs([a.out], a.out)
    keys = ("step", "train_success", "val_success", "kept_ratio", "mi_estimate", "retrieval_acc")
    print(json.dumps({k: run.last[k] for k in keys if k in run.last}))


def close(run):
    if run is None:
        return
    for handle in (run.bar, run.log, run.lock):
        if handle is not None:
            handle.close()
    run.bar = run.log = run.lock = None


# ------------------------------------------------------------------------------------------------ checkpoints

def save_checkpoint(run, step):
    """Everything needed to continue exactly. Written to checkpoint.tmp, marked complete by its last file, then
    swapped in: checkpoint -> checkpoint.old, checkpoint.tmp -> checkpoint, remove checkpoint.old."""
    out = run.args.out
    final, tmp, old = (os.path.join(out, name) for name in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
    recover_checkpoint(out)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        save_policy(run, tmp)
        torch.save({"step": step, "state": run.state,
                    "critic": critic_state(run) if run.critic is not None else None,
                    "optimizers": [o.state_dict() for o in run.optimizers],
                    "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                            "python": random.getstate(),
                            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}},
                   os.path.join(tmp, "trainer_state.pt"))
        atomic_write(os.path.join(tmp, "complete"), json.dumps({"step": step}))
    except (OSError, RuntimeError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        full = isinstance(e, OSError) and e.errno == errno.ENOSPC or "write" in str(e).lower() and (
            shutil.disk_usage(out).free < 2 ** 26)
        reason = "no space left on the device" if full else str(e).strip().splitlines()[0]
        raise UsageError(f"cannot write the checkpoint of step {step} to {out}: {reason}; the previous one is "
                         f"intact") from None
    if os.path.isdir(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def save_policy(run, folder):
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar between our lines
    policy = run.policy
    if hasattr(policy, "disable_adapter"):  # LoRA: the adapters, and where their base comes from
        policy.save_pretrained(folder, selected_adapters=["default"])
        if "critic" in policy.peft_config:
            policy.save_pretrained(os.path.join(folder, "critic"), selected_adapters=["critic"])
            _flatten_adapter_folder(os.path.join(folder, "critic"), "critic")
        base = run.args.model
        info = {"prompt": "tiny" if run.prompt else None, "lora_base": base}
    else:
        policy.save_pretrained(folder)
        info = {"prompt": "tiny" if run.prompt else None, "attn_implementation": policy.config._attn_implementation}
    run.tokenizer.save_pretrained(folder)
    with open(os.path.join(folder, "policy.json"), "w") as f:
        json.dump(info, f)


def _flatten_adapter_folder(folder, name):
    """peft saves a non-default adapter into folder/<name>/; move its files up so the folder loads directly."""
    inner = os.path.join(folder, name)
    if os.path.isdir(inner):
        for f in os.listdir(inner):
            os.replace(os.path.join(inner, f), os.path.join(folder, f))
        os.rmdir(inner)


def critic_state(run):
    return {k: v for k, v in run.critic.state_dict().items()}


def recover_checkpoint(out):
    """The folder of the newest complete checkpoint after whatever a kill left behind, or None. A complete
    checkpoint.tmp is newer than checkpoint and checkpoint.old; checkpoint is complete by construction (it is only
    ever renamed into place); checkpoint.old stands in when checkpoint is missing. Leftovers are removed."""
    final, tmp, old = (os.path.join(out, name) for name in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
    if os.path.isfile(os.path.join(tmp, "complete")) and not os.path.isdir(final):
        os.replace(tmp, final)
    if not os.path.isdir(final) and os.path.isfile(os.path.join(old, "complete")):
        os.replace(old, final)
    for leftover in (tmp, old):
        if os.path.isdir(final):
            shutil.rmtree(leftover, ignore_errors=True)
    return final if os.path.isfile(os.path.join(final, "complete")) else None


def checkpoint_step(folder):
    try:
        with open(os.path.join(folder, "complete")) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"{folder} is damaged: no readable step") from None


def restore(run, folder):
    try:
        ckpt = torch.load(os.path.join(folder, "trainer_state.pt"), weights_only=False)
        if run.critic is not None:
            run.critic.load_state_dict(ckpt["critic"])
        for opt, s in zip(run.optimizers, ckpt["optimizers"]):
            opt.load_state_dict(s)
    except (OSError, RuntimeError, KeyError, ValueError, EOFError, TypeError) as e:
        raise UsageError(f"cannot resume: {folder} is damaged ({str(e).strip().splitlines()[0]})") from None
    torch.set_rng_state(ckpt["rng"]["torch"])
    np.random.set_state(ckpt["rng"]["numpy"])
    random.setstate(ckpt["rng"]["python"])
    if ckpt["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])
    return ckpt["step"], ckpt["state"]


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
