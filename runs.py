"""Everything around the experiment that a first reading of train.py may skip: the command line,
the run folder (config, metrics log, checkpoints: checkpoints.py), resuming, and turning failures
into one-line errors.

A run folder holds config.json (the resolved settings), metrics.jsonl (one JSON object per step,
flushed as it is written), checkpoint/ (weights or LoRA adapters, tokenizer, critic, optimisers,
RNG states) and the figures. What a run guarantees:
- A kill at any moment (Ctrl-C, kill -9, a full disk) loses at most the step in flight, and
  `--resume` runs the lost step again exactly; a log damaged since the last checkpoint is rewritten
  from its copy, saying so (checkpoints.py).
- `--resume DIR` continues with the run's own settings; only --steps (to extend), --val-every,
  --save-every, --plot, --threads and --report-to may be given anew. A finished run is left as it
  is; a run made with --save-every 0 has no checkpoint to extend it from. Two processes never
  share a folder.
- The same command gives the same result, whether the tiny warm start was built in this run or
  loaded (models are built before the random streams are seeded). Results do depend on the CPU and
  the thread count.
- Bad input (flags, settings that cannot run or fit the model's context, a flag the chosen filter
  or world would ignore, a damaged config or checkpoint, an --out that is not new, empty or a run)
  is one line on stderr and exit code 2. The run folder is made only once the models are loaded,
  and a failed start leaves no folder behind; running out of GPU memory is one line naming the
  phase, code 3. A loss, gradient norm, log-prob or sampling distribution that is not finite ends
  the run before its update, one line and code 2: the steps before it stay, logged and
  checkpointed; a run that completed no step leaves no folder.
- --report-to also writes every number of the log to TensorBoard (<out>/tensorboard), wandb or
  trackio (Tracker).
"""
import argparse
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import importlib.util
import json
import math
import os
import random
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch

import envs
import models
import rollout
import snr_filter
import tiny
from checkpoints import (CheckpointError, atomic_write, checkpoint_step, last_logged_step,
                         recover_checkpoint, restore, restore_metrics, save_checkpoint)

# what a resumed run may change
RESUMABLE = ("steps", "val_every", "save_every", "plot", "threads", "report_to")
REPORT_TO = ("none", "tensorboard", "wandb", "trackio")  # TRL's names for the trackers
# past these a run cannot finish or cannot fit: no step here takes under a second (10**7 s is four
# months), and a step holds all its episodes, transcripts included, in memory at once
TINY_THREADS = 2  # --threads for the tiny policy on a CPU, whatever the machine: results depend on it
MAX_STEPS = 10 ** 7
MAX_EPISODES = 2 ** 16
MAX_GROUP_SIZE = 1000  # rollouts of one prompt, rollout.play's own limit
# a diagnosis scores every sample under every prompt, each a forward pass over a reasoning of tens
# of tokens: 2**24 of them are 10**8 - 10**9 tokens through the model at every diagnosis
MAX_SCORED = 2 ** 24
# past these a run only diverges, stalls or hangs: a step of Adam moves every weight by about --lr
# (0.1 already swamps weights of size 0.02); the task term of the loss is of order 1, so a
# regulariser 10 times larger alone trains the policy; below a temperature of 0.001 sampling is
# greedy in effect and the log-probs of the tokens not chosen overflow; a map of 128 x 128 is a
# prompt of 16,384 cells a turn (the tiny policy's context is 4,096 tokens, Qwen2.5's 32,768)
MAX_EPOCHS = 100
MAX_LR = 0.1
MAX_COEF = 10.0
MIN_TEMPERATURE = 1e-3
MAX_MAP = 128
PHASES = {"collect_rollouts": "rollouts", "diagnose": "the MI diagnosis", "validate": "validation",
          "update_policy": "the update", "decompose_gradients": "the gradient decomposition"}


class UsageError(Exception):
    """Bad input from the user: one line on stderr, exit code 2."""


class Diverged(Exception):
    """A loss, gradient norm, log-prob or sampling distribution that is not finite (nan or inf) at
    `step`: the run stops there, before the update that would spread it into the weights."""

    def __init__(self, what, step):
        super().__init__(what)
        self.what, self.step = what, step


@contextlib.contextmanager
def finite_sampling(step):
    """torch.multinomial's error on a distribution that is not finite, as Diverged at `step`."""
    try:
        yield
    except RuntimeError as e:
        if "probability tensor contains" not in str(e):
            raise
        raise Diverged("the sampling distribution", step) from None


def finite(value, what, step):
    """`value` (a number or a tensor) if every element is finite; else Diverged at `step`."""
    if not bool(torch.isfinite(torch.as_tensor(value)).all()):
        raise Diverged(what, step)
    return value


def diverged(e, a, done, created):
    """The one line of a run that diverged at step e.step after `done` steps: its likely cause
    and what is kept. A new run that completed no step leaves its folder as it found it (as a
    failed start): the same command can run again."""
    said = (f"the run diverged at step {e.step}: {e.what} is not finite (nan or inf), most likely "
            f"from too large a --lr ({a.lr:g}), --temperature ({a.temperature:g}) or coefficient "
            f"(--entropy-coef {a.entropy_coef:g}, --kl-coef {a.kl_coef:g})")
    if not done and not getattr(a, "resume", None):
        shutil.rmtree(a.out, ignore_errors=True)
        if not created:  # an empty folder it was given (check_folder): empty again
            os.makedirs(a.out)
        gone = "removed" if created else "emptied"
        return f"{said}; no step was completed, so {a.out} is {gone}: run again with a lower --lr"
    ckpt = recover_checkpoint(a.out)
    kept = f" and the checkpoint of step {checkpoint_step(ckpt)}" if ckpt else ""
    again = "--resume keeps these settings, so start" if hasattr(a, "resume") else "Start"
    return (f"{said}; {a.out} keeps the log of step{'s 1-' if done > 1 else ' '}{done}{kept}. "
            f"{again} anew (another --out) with a lower --lr")


def main(Args, train, validate, argv):
    """Parse, start, train (or evaluate), finish; each failure becomes one line and an exit code."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # no loading bars of transformers between our lines
    run = None
    try:
        args = parse_args(Args, argv)
        run = start(args)
        if run is None:
            return 0
        if args.steps == 0:
            print(f"evaluating {args.model} on {args.env}: {args.val_seeds} held-out seeds, one "
                  f"rollout each, temperature {args.val_temperature}; results in {args.out}")
            record(run, {"step": 0, "val_success": validate(run)})
        else:
            if run.step == 0 and args.val_every:  # the starting point, to judge what training adds
                record(run, {"step": 0, "val_success": validate(run)})
            train(run)
        finish(run)
        return 0
    except (UsageError, CheckpointError, models.ModelError) as e:
        close(run)  # the progress bar ends its line first
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Diverged as e:
        close(run)
        print(f"error: {diverged(e, run.args, run.step, run.created)}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError as e:
        close(run)
        frames = reversed(traceback.extract_tb(e.__traceback__))
        phase = next((PHASES[f.name] for f in frames if f.name in PHASES), "loading the models")
        print(f"error: out of GPU memory during {phase}; the last checkpoint is intact. Try "
              f"--micro-batch 1, --rollout-batch 16, --grad-checkpointing, --lora 16 or fewer "
              f"--max-new-tokens", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        close(run)
        resume = (f"; continue with: python train.py --resume {run.args.out}"
                  if run and run.step else "")
        print(f"\ninterrupted{resume}", file=sys.stderr)
        return 130
    finally:
        close(run)


# ------------------------------------------------------------------------------------- command line

def build_parser(Args, defaults=True):
    """One flag per Args field, one line of help each with the default in brackets; a boolean
    field is --name and --no-name (hidden). defaults=False leaves out the flags not given (for
    --resume). No abbreviations: --step is an error, not --steps."""
    class Parser(argparse.ArgumentParser):
        def error(self, message):  # argparse would print the usage too; one line is enough
            raise UsageError(message)

    description = ("RAGEN-2 in miniature: PPO / GRPO with SNR-aware filtering and the MI "
                   "diagnosis. Defaults in brackets; every on/off flag has a --no- form too.")
    formatter = functools.partial(argparse.HelpFormatter, max_help_position=30, width=110)
    parser = Parser(prog="train.py", usage="python train.py [flags]", description=description,
                    allow_abbrev=False, argument_default=None if defaults else argparse.SUPPRESS,
                    formatter_class=formatter)
    for f in dataclasses.fields(Args):
        flag, dest = "--" + f.name.replace("_", "-"), f.name
        default = f.default if defaults else argparse.SUPPRESS
        # on / off for a boolean only: 1 == True, so a dict lookup would call --seed 0 "off"
        value = ("on" if f.default else "off") if f.type is bool else f.default
        shown = "" if f.default is None else f" [{value}]"
        if f.type is bool:
            parser.add_argument(flag, action="store_true", dest=dest, default=default,
                                help=f.metadata["help"] + shown)
            parser.add_argument("--no-" + flag[2:], action="store_false", dest=dest,
                                help=argparse.SUPPRESS)
        else:
            choices = f.metadata.get("choices")
            listed = not choices or all(c in f.metadata["help"] for c in choices)
            text = f.metadata["help"] + ("" if listed else f": {', '.join(choices)}") + shown
            parser.add_argument(flag, type=f.type, dest=dest, default=default, choices=choices,
                                help=text, metavar=f.type.__name__.upper())
    return parser


def parse_args(Args, argv):
    """Args from the command line; with --resume, the run's saved settings and the allowed flags
    given now."""
    args = Args(**vars(build_parser(Args).parse_args(argv)))
    given = vars(build_parser(Args, defaults=False).parse_args(argv))
    if args.resume:
        saved = read_config(args.resume, Args)
        if given.get("out") not in (None, args.resume):
            raise UsageError(f"--out {given['out']}: a resumed run stays in its folder "
                             f"{args.resume}")
        changed = sorted(k for k, v in given.items()
                         if k not in ("resume", "out") and v != saved.get(k))
        fixed = [k for k in changed if k not in RESUMABLE]
        if fixed:
            k, allowed = fixed[0], ", --".join(RESUMABLE).replace("_", "-")
            raise UsageError(f"--{k.replace('_', '-')} {given[k]} differs from the run's "
                             f"{saved.get(k)}: a resumed run keeps its settings (it may change "
                             f"--{allowed})")
        args = Args(**{**saved, **{k: given[k] for k in changed}, "resume": args.resume,
                       "out": args.resume})
    check_ignored(args, given)
    check_args(args)
    return args


def check_ignored(a, given):
    """A flag given on the command line (`given`: the flags given, as from build_parser with
    defaults=False) that the chosen filter or world would ignore: one line, not a silent no-op."""
    control = a.filter in snr_filter.CONTROLS
    counted = a.control_of if control else a.filter  # whose count is kept
    sets = "it sets what --filter {0} keeps (or a control's count, with --control-of {0})"
    filtering = {"control_of": (control, "it sets the count of a control (--filter random or "
                                         "bottom)"),
                 "top_p": (counted == "topp", sets.format("topp")),
                 "filter_prob_mode": (counted == "topp", sets.format("topp")),
                 "top_k": (counted == "topk", sets.format("topk")),
                 "include_zero": (a.filter != "none", "--filter none keeps every group")}
    worlds = {"room_size": "sokoban", "num_boxes": "sokoban", "lake_size": "frozenlake",
              "success_rate": "frozenlake", "high_prob": "bandit"}
    for k in given:
        world = worlds.get(k, a.env)
        ok, why = filtering.get(k) or (world == a.env, f"it is --env {world}'s")
        if not ok:
            value = "" if isinstance(given[k], bool) else f" {given[k]}"
            chosen = f"--filter {a.filter}" if k in filtering else f"--env {a.env}"
            raise UsageError(f"--{k.replace('_', '-')}{value} is ignored with {chosen}: {why}")


def read_config(folder, Args):
    """A run's config.json as a dict of Args fields; anything else is a one-line error."""
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
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if not (v is None or (kind is bool and isinstance(v, bool)) or (kind is float and number)
                or (kind is int and number and isinstance(v, int))
                or (kind is str and isinstance(v, str))):
            raise UsageError(f"--resume {folder}: config.json has {k} = {v!r}, "
                             f"not a {kind.__name__}")
    return {**saved, "resume": None}


def check_args(a):
    """Every setting a run could not use, as one clear line."""
    def need(ok, message):
        if not ok:
            raise UsageError(message)

    numbers = [v for v in dataclasses.asdict(a).values() if isinstance(v, float)]
    need(all(math.isfinite(v) for v in numbers), "every number must be finite (no nan / inf)")
    need(0 <= a.seed <= 2 ** 32 - 1, f"--seed must be in 0..2**32-1, got {a.seed}")
    need(0 <= a.steps <= MAX_STEPS, f"--steps must be in 0..{MAX_STEPS:,}, got {a.steps} (at least "
         f"a second a step: {MAX_STEPS:,} steps take four months)")
    need(0 < a.top_p <= 1, f"--top-p must be in (0, 1], got {a.top_p}")
    need(0 < a.top_k <= 1, f"--top-k is a fraction of the groups in (0, 1], got {a.top_k}")
    need(a.groups >= 1 and a.group_size >= 1, "--groups and --group-size must be >= 1")
    need(a.group_size <= MAX_GROUP_SIZE,
         f"--group-size must be <= {MAX_GROUP_SIZE}, got {a.group_size}")
    need(max(a.groups * a.group_size, a.val_seeds) <= MAX_EPISODES,
         f"--groups x --group-size and --val-seeds must be <= {MAX_EPISODES} episodes (a step "
         f"holds them all in memory at once), got {a.groups} x {a.group_size}, {a.val_seeds}")
    # one rollout a group has no reward spread: the filter has nothing to rank and a group-relative
    # advantage is 0; plain PPO (critic, no filter) still learns from it
    why = (f"--filter {a.filter} has nothing to rank" if a.filter != "none" else
           f"--algo {a.algo}'s group-relative advantage is always 0")
    need(a.group_size >= 2 or (a.algo == "ppo" and a.filter == "none"),
         f"--group-size 1 gives every group zero reward spread: {why} (use --group-size 2 or "
         f"more, or --algo ppo --filter none)")
    need(a.max_turns >= 1 and a.max_actions_per_turn >= 1,
         "--max-turns and --max-actions-per-turn must be >= 1")
    need(a.mini_batch_size >= 1, "--mini-batch-size must be >= 1")
    need(1 <= a.epochs <= MAX_EPOCHS, f"--epochs must be in 1..{MAX_EPOCHS}, got {a.epochs} (the "
         f"paper's runs make 1; each pass moves the policy further from its samples)")
    batch = a.groups * a.group_size
    need(0 <= a.optimizer_steps <= batch,
         f"--optimizer-steps must be in 0..{batch}, got {a.optimizer_steps}: a mini-batch holds at "
         f"least one of the step's --groups x --group-size = {batch} trajectories")
    check_diagnosis(a, need)
    need(all(x is None or x >= 1 for x in (a.micro_batch, a.rollout_batch)),
         "--micro-batch and --rollout-batch must be >= 1")
    for name in ("lr", "critic_lr"):
        value = getattr(a, name)
        need(value is None or 0 < value <= MAX_LR, f"--{name.replace('_', '-')} must be in (0, "
             f"{MAX_LR}], got {value} (an Adam step moves every weight by about the rate)")
    need(0 <= a.lam <= 1, f"--lam must be in [0, 1], got {a.lam}")
    need(a.gamma == 1, f"--gamma {a.gamma}: only 1 is supported; the episode's rewards all sit on "
                       f"its last token, so a discount would count tokens, not turns")
    need(0 < a.clip_low < 1 and a.clip_high > 0, "need 0 < --clip-low < 1 and --clip-high > 0")
    need(a.clip_c == 0 or a.clip_c > 1, f"--clip-c must be > 1 (or 0 = off), got {a.clip_c}")
    need(a.value_clip > 0 and a.grad_clip > 0, "--value-clip and --grad-clip must be > 0")
    for name in ("kl_coef", "entropy_coef"):
        value = getattr(a, name)
        need(0 <= value <= MAX_COEF, f"--{name.replace('_', '-')} must be in [0, {MAX_COEF:g}], "
             f"got {value} (the task term is of order 1: a larger regulariser alone trains the "
             f"policy)")
    for name in ("temperature", "val_temperature"):
        value, greedy = getattr(a, name), name == "val_temperature"
        need(value >= MIN_TEMPERATURE or (greedy and value == 0),
             f"--{name.replace('_', '-')} {value:g}: below {MIN_TEMPERATURE:g} sampling is greedy "
             f"in effect and its log-probs overflow; use --{name.replace('_', '-')} "
             f"{MIN_TEMPERATURE:g} or more{' (or 0: greedy)' if greedy else ''}")
    need(0 < a.sample_top_p <= 1, f"--sample-top-p must be in (0, 1], got {a.sample_top_p}")
    need(a.max_new_tokens is None or a.max_new_tokens >= 1, "--max-new-tokens must be >= 1")
    need(a.val_seeds >= 1, "--val-seeds must be >= 1")
    for name in ("mi_every", "val_every", "grad_decomp_every", "save_every"):
        value = getattr(a, name)
        need(value >= 0, f"--{name.replace('_', '-')} must be >= 0 (0 = never), got {value}")
    need(a.lora >= 0 and (a.lora_alpha is None or a.lora_alpha > 0),
         "--lora must be >= 0, --lora-alpha > 0")
    need(a.report_to in REPORT_TO, f"--report-to must be one of {', '.join(REPORT_TO)}")
    need(a.report_to == "none" or importlib.util.find_spec(a.report_to),  # the package's name
         f"--report-to {a.report_to}: {a.report_to} is not installed (pip install "
         f"{a.report_to})")
    cores = os.cpu_count() or 1
    need(a.threads is None or 1 <= a.threads <= cores, f"--threads must be in 1..{cores}, the "
         f"machine's cores, got {a.threads} (more threads than cores only wait for each other)")
    need(0 <= a.template_prior <= 1 and a.warm_start_seed >= 0,
         "--template-prior must be in [0, 1] and --warm-start-seed >= 0")
    need(a.filler is None or 0 <= a.filler <= 0.75, "--filler must be in [0, 0.75] (0.75: the "
         "most entropy a filler digit can have)")
    prior = a.kl_template_prior
    need(prior is None or (0 <= prior <= 1 and a.model == "tiny" and not a.lora
                           and (prior > 0) == (a.template_prior > 0)),
         "--kl-template-prior must be in [0, 1], with --model tiny, no --lora, and > 0 "
         "exactly when --template-prior is (the two warm starts must share a vocabulary)")
    need(a.room_size <= MAX_MAP and a.lake_size <= MAX_MAP,
         f"--room-size and --lake-size must be <= {MAX_MAP}, got {a.room_size}, {a.lake_size} (a "
         f"larger map is a prompt of more than {MAX_MAP ** 2:,} cells a turn)")
    try:
        envs.make_env(a.env, **env_kwargs(a)).reset(seed=0)
    except ValueError as e:
        raise UsageError(f"--env {a.env}: {e}") from None


def check_diagnosis(a, need):
    """The MI diagnosis' settings: an MI over one prompt is 0 by construction (log 1), and so is
    the action MI over one sample of a prompt; the probe set's episodes are held in memory at once,
    like a step's, and each diagnosis scores every sample under every prompt."""
    need(a.mi_samples >= 1, "--mi-samples must be >= 1")
    need(a.groups >= 2 or not a.mi_every,
         "--groups 1: an MI over one prompt is 0 by construction; use --groups 2 or more, or "
         "--mi-every 0")
    need(a.probe_prompts != 1 and a.probe_prompts >= 0,
         f"--probe-prompts must be 0 (off) or >= 2, got {a.probe_prompts} (an MI over one prompt "
         f"is 0 by construction)")
    need(2 <= a.probe_samples <= MAX_GROUP_SIZE,
         f"--probe-samples must be in 2..{MAX_GROUP_SIZE}, got {a.probe_samples} (the action MI "
         f"compares each answer with the prompt's other reasonings)")
    need(a.probe_prompts * a.probe_samples <= MAX_EPISODES,
         f"--probe-prompts x --probe-samples must be <= {MAX_EPISODES} episodes (a diagnosis "
         f"holds them all in memory at once), got {a.probe_prompts} x {a.probe_samples}")
    in_batch = min(a.mi_samples, a.groups * a.group_size) * a.groups if a.mi_every else 0
    probe = a.probe_prompts * a.probe_samples * (a.probe_prompts + a.probe_samples)
    need(max(in_batch, probe) <= MAX_SCORED,
         f"a diagnosis would score {max(in_batch, probe):,} reasonings (every sample under every "
         f"prompt), more than {MAX_SCORED:,} (10**8 tokens or more at every diagnosis); use fewer "
         f"{'--mi-samples or --groups' if in_batch > probe else '--probe-prompts'}")


def check_fits(a, policy, tokenizer, prompt):
    """Refuse an episode that cannot fit the model's context window: the first prompt, then each
    turn the state again (the room or lake size sets its length) and a reply of up to
    --max-new-tokens."""
    context = getattr(policy.config.get_text_config(), "max_position_embeddings", None)
    if context is None:
        return
    if a.max_new_tokens >= context:
        raise UsageError(f"--max-new-tokens {a.max_new_tokens}: a reply cannot be longer than the "
                         f"model's context of {context} tokens")
    env = envs.make_env(a.env, **env_kwargs(a))
    obs, _ = env.reset(seed=0)
    system = prompt.get("system") or rollout.system_prompt(env, a.max_actions_per_turn)
    user = prompt.get("user", rollout.user_message)(obs, 0.0, env.max_steps, 1)
    messages = [{"role": "system", "content": system(env) if callable(system) else system},
                {"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    count = lambda t: len(tokenizer.encode(t, add_special_tokens=False, verbose=False))  # noqa
    first = count(text)
    longest = first + (a.max_turns - 1) * count(user) + a.max_turns * a.max_new_tokens
    if longest > context:
        size = {"sokoban": ", --room-size sets it", "frozenlake": ", --lake-size sets it"}
        raise UsageError(f"an episode of --max-turns {a.max_turns} can reach {longest} tokens "
                         f"(a first prompt of {first}{size.get(a.env, '')}, replies of up to "
                         f"--max-new-tokens {a.max_new_tokens}), more than the model's context "
                         f"of {context} tokens")


def check_lora_targets(a, policy=None):
    """--lora-targets names modules of the policy that LoRA can adapt (peft matches a name to the
    end of a module's); `policy` None: a Hugging Face model, its layers built without weights."""
    if not a.lora or a.lora_targets == "all-linear":
        return
    if policy is None:
        if os.path.isfile(os.path.join(a.model, "policy.json")):
            return  # a checkpoint: its adapters come with it
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
            with torch.device("meta"):
                policy = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(a.model))
        except Exception:  # a model that cannot be loaded: models.load says why
            return
    names = [n for n, m in policy.named_modules()
             if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
    missing = [t for t in a.lora_targets.split(",")
               if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        known = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise UsageError(f"--lora-targets {a.lora_targets}: the policy has no layer named "
                         f"{', '.join(missing)}; its layers: {', '.join(known[:8])} (or "
                         f"all-linear)")


def env_kwargs(a):
    return {"sokoban": dict(dim_room=(a.room_size, a.room_size), num_boxes=a.num_boxes),
            "frozenlake": dict(size=a.lake_size, success_rate=a.success_rate),
            "bandit": dict(high_prob=a.high_prob)}.get(a.env, {})


# ------------------------------------------------------------------------------------------ the run

@dataclass
class Run:
    """One bundle for what the loop uses: settings, models, optimisers, the run folder and the
    loop's state."""
    args: object
    device: torch.device
    ctx: object  # autocast for the run's dtype (a no-op in float32)
    policy: torch.nn.Module
    tokenizer: object
    prompt: dict  # rollout.play's `system` / `user` pieces for the tiny policy, else {}
    critic: torch.nn.Module  # PPO only, else None
    reference_model: torch.nn.Module  # a frozen initial policy for --kl-coef (not with LoRA)
    optimizers: list
    policy_params: list
    critic_params: list
    pad_id: int = 0
    step: int = 0  # steps done
    state: dict = field(default_factory=lambda: {"skips": 0, "std_ema": None})
    last: dict = field(default_factory=dict)  # every metric's newest value: summary, progress bar
    log: object = None
    bar: object = None
    lock: object = None
    created: bool = False  # this process made the run folder
    tracker: object = None  # --report-to's (Tracker), or None


def start(a):
    """Resolve the defaults, open (or resume) the run folder, load the models, restore the
    checkpoint. None: a finished run, nothing to do."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolve_defaults(a, device)
    check_folder(a)
    if a.model == "tiny":  # before a warm start is built for a world whose prompts cannot fit
        policy, tokenizer = tiny.load_tiny(a.env, env_kwargs(a), warm_start=False)
        check_lora_targets(a, policy)
        check_fits(a, policy, tokenizer, tiny.prompts(a.env))
    else:
        check_lora_targets(a)
    created, lock, ckpt = False, None, None
    try:
        if a.resume:
            lock = lock_folder(a.out)
            ckpt = recover_checkpoint(a.out)
            if finished(a, ckpt):
                lock.close()
                return None
        run = load_run(a, device, ckpt or a.model)
        if a.model != "tiny":
            check_fits(a, run.policy, run.tokenizer, run.prompt)
        if not a.resume:  # made only now: a start killed while the models load leaves no folder
            created = open_folder(a)
            lock = lock_folder(a.out)
        run.lock, run.created = lock, created
        seed_everything(a.seed)  # after the models: whether a warm start was built or loaded
        if ckpt:
            run.step, run.state = restore(run, ckpt)
            print(f"resuming {a.out} after step {run.step}")
        elif a.resume:
            print(f"{a.out} has no checkpoint yet: starting it from step 0")
        restore_metrics(os.path.join(a.out, "metrics.jsonl"), ckpt)
        run.last = last_metrics(os.path.join(a.out, "metrics.jsonl"))
        write_config(a)
        run.log = open(os.path.join(a.out, "metrics.jsonl"), "a")
        run.tracker = None if a.report_to == "none" else Tracker(a, run.step)
        if a.steps > 0:
            from tqdm import tqdm
            run.bar = tqdm(total=a.steps, initial=run.step, desc=a.out, dynamic_ncols=True)
        return run
    except BaseException:
        if lock is not None:
            lock.close()
        if created:
            shutil.rmtree(a.out, ignore_errors=True)  # a failed start leaves nothing behind
        raise


def load_run(a, device, source):
    """A Run around the models loaded from `source`, without a run folder (start uses it; so can
    a script)."""
    bf16 = a.dtype == "bfloat16"
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    run = Run(args=a, device=device, ctx=ctx, **models.load(a, device, source, env_kwargs(a)))
    run.pad_id = rollout.pad_token_id(run.tokenizer)
    return run


def resolve_defaults(a, device):
    """Fill in the settings that depend on the machine and the model, and say what was chosen."""
    if a.model is None:
        a.model = "Qwen/Qwen2.5-0.5B-Instruct" if device.type == "cuda" else "tiny"
        why = "a GPU is present" if device.type == "cuda" else "no GPU found"
        print(f"model: {a.model} ({why}; --model chooses another)")
    tiny = a.model == "tiny"
    a.lr = a.lr or (1e-4 if tiny else 1e-6)
    a.critic_lr = a.critic_lr or (1e-3 if tiny else 1e-5)
    a.max_new_tokens = a.max_new_tokens or (64 if tiny else 400)
    a.dtype = a.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    a.lora_alpha = a.lora_alpha or (2.0 * a.lora if a.lora else None)
    if a.threads is None and device.type == "cpu":
        a.threads = min(TINY_THREADS, os.cpu_count() or 1) if tiny else (os.cpu_count() or 1)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.micro_batch is None and device.type == "cpu":
        # memory is not the limit, padding is: 8 length-sorted transcripts a pass pad less than a
        # whole mini-batch
        a.micro_batch = min(8, a.mini_batch_size)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if a.steps == 0 and a.out is None:  # evaluating a model
        name = os.path.basename(os.path.normpath(a.model))
        if os.path.isfile(os.path.join(a.model, "policy.json")):  # a checkpoint: named by its run
            name = os.path.basename(os.path.dirname(os.path.abspath(a.model)))
        a.out = os.path.join("runs", f"eval-{a.env}-{name}-{stamp}")
    a.out = a.out or os.path.join("runs", f"{a.env}-{a.algo}-{a.filter}-{stamp}")


# ----------------------------------------------------------------------------------- the run folder

def check_folder(a):
    """Before anything loads: the folder of a resumed run exists; --out of a new run is new or
    empty and could be made (it is made only once the models are loaded: open_folder)."""
    if getattr(a, "resume", None):  # trl_ragen.py's runs are never resumed
        if not os.path.isdir(a.out):
            raise UsageError(f"--resume {a.out}: no such run folder")
        return
    if any(os.path.isfile(os.path.join(a.out, f)) for f in ("config.json", "metrics.jsonl")):
        again = f"continue it with --resume {a.out}, or " if hasattr(a, "resume") else ""
        raise UsageError(f"--out {a.out} already holds a run: {again}choose another --out")
    if os.path.isdir(a.out) and set(os.listdir(a.out)) - {".lock"}:
        raise UsageError(f"--out {a.out} is a folder with other files in it, not a run: choose a "
                         f"new or empty folder")
    parent = os.path.abspath(a.out)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        why = "not a folder" if not os.path.isdir(parent) else "no permission"
        raise UsageError(f"--out {a.out}: cannot write there ({why}: {parent})")


def open_folder(a):
    """Create --out for a new run: True when this made it. A new run never writes into a folder
    that already holds a run."""
    check_folder(a)
    existed = os.path.isdir(a.out)
    try:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, ".write-test"), "w") as f:
            f.write("ok")
        os.remove(os.path.join(a.out, ".write-test"))
    except OSError as e:
        if not existed:
            shutil.rmtree(a.out, ignore_errors=True)
        raise UsageError(f"--out {a.out}: cannot write there ({e.strerror or e})") from None
    return not existed


def lock_folder(out):
    """An exclusive lock on the run folder for the life of the process: two runs never share one."""
    handle = open(os.path.join(out, ".lock"), "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise UsageError(f"{out} is in use by another running process") from None
    return handle


def finished(a, ckpt):
    """A resumed run (its newest checkpoint `ckpt`, or None) that already did its steps: say so and
    leave it as it is, its log repaired if damaged (restore_metrics). A run made with
    --save-every 0 that logged steps has no checkpoint to continue from: complete, or refused."""
    done = checkpoint_step(ckpt) if ckpt else 0
    if a.steps < done:
        raise UsageError(f"--steps {a.steps} is below the {done} steps this run has done")
    logged = last_logged_step(os.path.join(a.out, "metrics.jsonl"))
    if not ckpt and logged and read_config(a.out, type(a))["save_every"] == 0:
        if logged == a.steps:
            print(f"{a.out} is complete ({logged} of {a.steps} steps)")
            return True  # no checkpoint to repair its log from, nor to continue it from
        raise UsageError(f"--resume {a.out}: its {logged} steps ran with --save-every 0, so no "
                         f"checkpoint holds their weights to continue from; start anew (another "
                         f"--out) with --save-every 1 or more")
    if ckpt and done == a.steps:
        restore_metrics(os.path.join(a.out, "metrics.jsonl"), ckpt)
        print(f"{a.out} is complete ({done} of {a.steps} steps); give --steps N to extend it")
        return True
    return False


def write_config(a):
    settings = {k: v for k, v in dataclasses.asdict(a).items() if k != "resume"}
    atomic_write(os.path.join(a.out, "config.json"), json.dumps(settings, indent=1))


def last_metrics(path):
    last = {}
    if os.path.isfile(path):
        for line in open(path):
            with contextlib.suppress(json.JSONDecodeError, TypeError, AttributeError):
                last.update({k: v for k, v in json.loads(line).items() if not isinstance(v, list)})
    return last


def record(run, m):
    """Step 7's bookkeeping: the metrics line (flushed), a checkpoint when due, the progress bar."""
    if run.device.type == "cuda":
        m["gpu_peak_gb"] = torch.cuda.max_memory_allocated() / 2 ** 30
    run.log.write(json_line(m) + "\n")
    run.log.flush()
    if run.tracker is not None:
        run.tracker.log(m)
    run.last.update({k: v for k, v in m.items() if not isinstance(v, list)})
    if m["step"] == 0:
        return
    run.step = m["step"]
    if run.args.save_every and (run.step % run.args.save_every == 0 or run.step == run.args.steps):
        save_checkpoint(run, run.step)
    if run.bar is not None:
        run.bar.update(1)
        run.bar.set_postfix_str(progress(run.last))


def json_line(record):
    """A metrics record as one line of strict JSON: a number that could not be measured (a float
    that is nan or infinite, at any depth) is written as null, never as a bare NaN, which JSON does
    not have and strict readers refuse.

    >>> json_line({"step": 1, "mi_estimate": float("nan"), "buckets": [{"norm": float("inf")}]})
    '{"step": 1, "mi_estimate": null, "buckets": [{"norm": null}]}'
    """
    def strict(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: strict(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [strict(x) for x in v]
        return v
    return json.dumps(strict(record), allow_nan=False)


def progress(last):
    """The progress bar's newest values; one not measured yet (no validation or diagnosis so far,
    or a diagnosis without reasoning to score) is left out, not shown as nan.

    >>> progress({"train_success": 0.5, "kept_ratio": 1.0, "mi_estimate": float("nan")})
    'success=0.50 kept=1.00'
    """
    shown = [("success", "train_success", ""), ("val", "val_success", ""),
             ("kept", "kept_ratio", ""), ("mi", "mi_estimate", " nats")]
    return " ".join(f"{name}={last[k]:.2f}{unit}" for name, k, unit in shown
                    if isinstance(last.get(k), (int, float)) and math.isfinite(last[k]))


def finish(run):
    if run.bar is not None:
        run.bar.close()
    if run.args.plot and run.args.steps > 0:
        import plots
        plots.plot_runs([run.args.out], run.args.out)
    keys = ("step", "train_success", "val_success", "kept_ratio", "mi_estimate", "retrieval_acc")
    print(json_line({k: run.last[k] for k in keys if k in run.last}))


def close(run):
    if run is not None:
        for handle in (run.bar, run.log, run.tracker, run.lock):
            if handle is not None:
                handle.close()
        run.bar = run.log = run.tracker = run.lock = None


class Tracker:
    """--report-to: every number of a metrics record under its key at its step, as TRL names the
    trackers: TensorBoard event files in <out>/tensorboard, or a wandb / trackio run (project
    ragen2, named after the folder). A resumed run continues the same curves: TensorBoard hides
    the events of the steps after the checkpoint, which run again."""

    def __init__(self, a, step):
        self.kind = a.report_to
        if self.kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(os.path.join(a.out, "tensorboard"),
                                        purge_step=step + 1 if step else None)
            return
        self.module = importlib.import_module(self.kind)
        folder = os.path.abspath(a.out)
        ids = {"id": hashlib.sha1(folder.encode()).hexdigest()[:16], "dir": a.out}
        self.module.init(project="ragen2", name=os.path.basename(folder), resume="allow",
                         config=dataclasses.asdict(a), **(ids if self.kind == "wandb" else {}))

    def log(self, record):
        numbers = scalars(record)
        if self.kind == "tensorboard":
            for k, v in numbers.items():
                self.writer.add_scalar(k, v, record["step"])
        else:
            self.module.log(numbers, step=record["step"])

    def close(self):
        if self.kind == "tensorboard":
            self.writer.close()
        else:
            self.module.finish()


def scalars(record, prefix=""):
    """The numbers of a metrics record by key, a nested dict's keys joined with '/'; lists, text
    and numbers not measured (null) are left out.

    >>> scalars({"step": 3, "skipped": False, "mi": None, "probe": {"acc": 0.5}, "kept": [1]})
    {'step': 3.0, 'skipped': 0.0, 'probe/acc': 0.5}
    """
    out = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(scalars(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and math.isfinite(v):
            out[prefix + k] = float(v)
    return out


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
