"""Everything around the experiment that a first reading of train.py may skip: the command line
(the flags and their checks are in flags.py; here the checks that need the model), the run folder
(config, metrics log, checkpoints: checkpoints.py), resuming, and turning failures into one-line
errors.

A run folder holds config.json (the resolved settings), metrics.jsonl (one JSON object per step,
flushed as it is written), checkpoint/ (weights or LoRA adapters, tokenizer, critic, optimisers,
RNG states) and the figures. What a run guarantees:
- A kill at any moment (Ctrl-C, kill -9, a full disk) loses at most the step in flight, and
  `--resume` runs the lost step again from the same weights, optimiser and random streams: on a
  CPU exactly (tested), on a GPU within float rounding (its attention backward and cuBLAS
  reductions are not deterministic); a log damaged since the last checkpoint is rewritten from its
  copy, saying so (checkpoints.py).
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
import rollout
import snr_filter
from plumbing import flags, hardware, lora, models, sampler
from plumbing.checkpoints import (CheckpointError, atomic_write, checkpoint_every, checkpoint_step,
                                  drop_garbage, log_steps, recover_checkpoint, restore,
                                  restore_metrics, save_checkpoint)
from warmstart import tiny
from plumbing.defaults import VAL_SEED_BASE
from plumbing.flags import UsageError, env_kwargs, read_config

TINY_THREADS = 2  # --threads for the tiny policy on a CPU, whatever the machine: results depend on it
PHASES = {"collect_rollouts": "rollouts", "diagnose": "the MI diagnosis", "validate": "validation",
          "update_policy": "the update", "decompose_gradients": "the gradient decomposition"}


class Diverged(Exception):
    """A loss, gradient norm, log-prob or sampling distribution that is not finite (nan or inf) at
    `step`: the run stops there, before the update that would spread it into the weights."""

    def __init__(self, what, step):
        super().__init__(what)
        self.what, self.step = what, step


class NotExact(Exception):
    """The diagnosis's token-exactness check far off: a reasoning's score under its own prompt is
    not the log-prob it was sampled with, so the scorer and the sampler are two policies."""


EXACT = 1e-2  # nats a reasoning: float32 rounding gives ~1e-5 (SmolLM2's 30 layers: 1.2e-4)


def filter_of(a):
    """snr_filter.select's settings from the flags (train.py's, or trl_ragen's of the same names)."""
    return snr_filter.Filter(a.filter, a.top_p, a.top_k, a.include_zero, a.filter_prob_mode,
                             a.control_of)


def check_exact(run, what, diff):
    """Stop the run, naming the check, where `what` (a diagnosis_logprob_diff) exceeds EXACT: its
    MI and its update's ratio would score another policy than the one that sampled. Not with
    --retokenize, which scores re-tokenised text (the official way) and is off by design."""
    if diff is not None and diff > EXACT and not run.args.retokenize:
        raise NotExact(f"step {run.step + 1}: the diagnosis scores what was sampled {diff:.3g} nats away "
                       f"from the log-probs it was sampled with ({what} above {EXACT:g}): this "
                       f"model's forward pass computes its logits otherwise than the scorer "
                       f"(logprobs.output_logits), so neither its MI nor its update can be trusted")


@contextlib.contextmanager
def finite_sampling(step):
    """The sampler's error on a distribution that is not finite (generate.draw, as torch.multinomial
    says it), as Diverged at `step`."""
    try:
        yield
    except RuntimeError as e:
        if "probability tensor contains" not in str(e):
            raise
        raise Diverged("the sampling distribution", step) from None


def check_finite(step, named):
    """Diverged at `step`, naming the first value of `named` ({what: a number or a tensor}) with an
    element that is not finite; nothing when all are: the loop's one check before its update."""
    for what, value in named.items():
        if not bool(torch.isfinite(torch.as_tensor(value)).all()):
            raise Diverged(what, step)


def diverged(e, a, done, created):
    """The one line of a run that diverged at step e.step after `done` steps: its likely cause
    and what is kept. A new run that completed no step leaves its folder as it found it (as a
    failed start): the same command can run again."""
    said = (f"the run diverged at step {e.step}: {e.what} is not finite (nan or inf), most likely "
            f"from too large a --lr ({a.lr:g}), --temperature ({a.temperature:g}) or coefficient "
            f"(--entropy-coef {a.entropy_coef:g}, --kl-coef {a.kl_coef:g})")
    if not done and not getattr(a, "resume", None):
        unmake(a.out, created)
        gone = "removed" if created else "emptied"
        return f"{said}; no step was completed, so {a.out} is {gone}: run again with a lower --lr"
    ckpt = recover_checkpoint(a.out)
    kept = f" and the checkpoint of step {checkpoint_step(ckpt)}" if ckpt else ""
    again = "--resume keeps these settings, so start" if hasattr(a, "resume") else "Start"
    return (f"{said}; {a.out} keeps the log of step{'s 1-' if done > 1 else ' '}{done}{kept}. "
            f"{again} anew (another --out) with a lower --lr")


def unmake(out, created):
    """The folder of a new run that completed no step, as its start found it: removed when this
    process made it, else the empty folder it was given (check_folder), empty again."""
    shutil.rmtree(out, ignore_errors=True)
    if not created:
        os.makedirs(out)


def tracker_failed(kind, e):
    """The one line of a --report-to tracker that would not start (`e`: its exception)."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    what = ("; `wandb login` (or WANDB_API_KEY) lets it start, or WANDB_MODE=offline keeps the "
            "run on disk only" if kind == "wandb" else "")
    return f"--report-to {kind}: {kind} did not start ({first}){what}"


def failed(e, run):
    """The exit code of the exception `e` that stopped train.py, said in one line after the
    progress bar has ended its own; an exception it does not know is raised again."""
    close(run)
    if isinstance(e, (UsageError, CheckpointError, models.ModelError)):
        print(f"error: {e}", file=sys.stderr)
        return 2
    if isinstance(e, Diverged):
        print(f"error: {diverged(e, run.args, run.step, run.created)}", file=sys.stderr)
        return 2
    if isinstance(e, NotExact):  # (a start that failed so left its folder as it found it)
        if run is not None and not run.step and not run.args.resume:
            unmake(run.args.out, run.created)
        print(f"error: {e}", file=sys.stderr)
        return 2
    if isinstance(e, torch.OutOfMemoryError):
        frames = reversed(traceback.extract_tb(e.__traceback__))
        phase = next((PHASES[f.name] for f in frames if f.name in PHASES), "loading the models")
        print(f"error: out of GPU memory during {phase}; the last checkpoint is intact. Try "
              f"--micro-batch 1, --rollout-batch 16, --grad-checkpointing, --lora 16 or fewer "
              f"--max-new-tokens", file=sys.stderr)
        return 3
    fresh = run is not None and not run.step and not run.args.resume
    if fresh:  # a new run that completed no step: its folder as its start found it, so that the
        unmake(run.args.out, run.created)  # same command runs again
    if isinstance(e, KeyboardInterrupt):
        resume = "" if fresh or not run else f"; continue with: python train.py --resume {run.args.out}"
        print(f"\ninterrupted{resume}", file=sys.stderr)
        return 130
    raise e


# ------------------------------------------------------------------- the checks that need the model

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


def check_causal_lm(a):
    """A model folder that holds no causal language model (an encoder such as BERT, a
    sequence-to-sequence model) cannot run at all: one line before anything loads."""
    if not os.path.isdir(os.path.expanduser(a.model)):
        return
    try:
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig
        config = AutoConfig.from_pretrained(os.path.expanduser(a.model), local_files_only=True)
    except Exception:  # a folder without a readable config: models.load says why
        return
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UsageError(f"--model {a.model}: a {config.model_type} model is not a causal language "
                         f"model (transformers' AutoModelForCausalLM has no class for it); the "
                         f"policy must write its replies token by token")


def check_lora_targets(a, policy=None):
    """lora.check_lora before anything loads or is built: on `policy`, or (None) on a Hugging
    Face model of this machine, its layers built without weights; a model that cannot be read
    yet is checked when it loads (lora.add_lora)."""
    if not a.lora:
        return
    if policy is None:
        if os.path.isfile(os.path.join(a.model, "policy.json")):
            return  # a checkpoint: its adapters come with it
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
            config = AutoConfig.from_pretrained(a.model, local_files_only=True)
            with torch.device("meta"):
                policy = AutoModelForCausalLM.from_config(config)
        except Exception:  # a model that cannot be loaded (yet): models.load says why
            return
    lora.check_lora(policy, a)


# ------------------------------------------------------------------------------------------ the run

@dataclass
class Run:
    """One bundle for what the loop uses: settings, models, optimisers, the run folder and the
    loop's state."""
    args: object
    device: torch.device
    ctx: object  # autocast for the update's dtype (a no-op in float32)
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
    sample_ctx: object = field(default_factory=contextlib.nullcontext)  # the sampler's autocast
    sampling: dict = field(default_factory=dict)  # the path the sampler's self-check agreed on
    pending: dict = field(default_factory=dict)  # what the next log record adds (the self-check)


def start(a, argv=()):
    """Resolve the defaults, open (or resume) the run folder, load the models, restore the
    checkpoint, record what runs it (`argv`: its command line). None: a finished run, nothing to
    do."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # no loading bars of transformers between our lines
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolve_defaults(a, device)
    check_folder(a)
    # as train.py's command line did before torch loaded; whether the hub has a model id is for
    # models.load to ask (a script may stand its own loader in for it: bench_gpu.py)
    flags.check_model(a.model, hub=False)
    if a.model == "tiny":  # before a warm start is built for a world whose prompts cannot fit
        policy, tokenizer = tiny.load_tiny(a.env, env_kwargs(a), warm_start=False)
        check_lora_targets(a, policy)
        check_fits(a, policy, tokenizer, rollout.prompts(a.env, tiny=True))
    else:
        check_causal_lm(a)
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
        if a.save_every is None:
            trained = sum(p.numel() for p in run.policy_params + run.critic_params)
            a.save_every = checkpoint_every(device, trained)
        if a.model != "tiny":
            check_fits(a, run.policy, run.tokenizer, run.prompt)
            if sampler.check_layout(run.policy) is None:
                kind = run.policy.config.model_type
                print(f"sampling: {kind} is not of the Llama layout the decode loop runs "
                      f"({', '.join(sampler.LLAMA_LAYOUT)}), so it samples through its own forward "
                      f"pass and cache: slower, the same sampling law")
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
        write_provenance(run, argv)
        check_sampler(run, write_prompt(run))
        run.log = open(os.path.join(a.out, "metrics.jsonl"), "a")
        run.tracker = None if a.report_to == "none" else Tracker(a, run.step)
        if a.steps > 0:
            from tqdm import tqdm
            run.bar = tqdm(total=a.steps, initial=run.step, desc=a.out, dynamic_ncols=True)
        else:
            print(f"evaluating {a.model} on {a.env}: {a.val_seeds} held-out seeds, one rollout "
                  f"each, temperature {a.val_temperature}; results in {a.out}")
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
    ctx, sample_ctx = (torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bfloat16"
                       else contextlib.nullcontext() for dtype in (a.dtype, a.sample_dtype))
    run = Run(args=a, device=device, ctx=ctx, sample_ctx=sample_ctx,
              **models.load(a, device, source, env_kwargs(a)))
    run.pad_id = rollout.pad_token_id(run.tokenizer)
    return run


def is_tiny(model):
    """The tiny policy, by name or as a checkpoint of it (its policy.json says so)."""
    try:
        with open(os.path.join(model, "policy.json")) as f:
            return json.load(f).get("prompt") == "tiny"
    except (OSError, ValueError, AttributeError):
        return model == "tiny"


def resolve_defaults(a, device):
    """Fill in the settings that depend on the machine and the model, and say what was chosen."""
    if a.model is None:
        a.model = "Qwen/Qwen2.5-0.5B-Instruct" if device.type == "cuda" else "tiny"
        why = "a GPU is present" if device.type == "cuda" else "no GPU found"
        print(f"model: {a.model} ({why}; --model chooses another)")
    tiny = is_tiny(a.model)
    if tiny and a.observation != "grid":
        raise UsageError(f"--observation {a.observation} is for a real model: the tiny policy (the "
                         f"default without a GPU) reads its own positions line; add --model smollm2")
    a.lr = a.lr or (1e-4 if tiny else 1e-6)
    a.critic_lr = a.critic_lr or (1e-3 if tiny else 1e-5)
    a.max_new_tokens = a.max_new_tokens or (64 if tiny else 400)
    if a.dtype is None:  # bfloat16 where the device computes it natively (plumbing/hardware.py)
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        a.dtype, why = hardware.default_dtype(device.type, tiny, hardware.cpu_flags(), capability)
        if a.dtype == "bfloat16" or device.type == "cuda":
            print(f"precision: {a.dtype} ({why}; --dtype chooses otherwise)")
    a.sample_dtype = a.sample_dtype or a.dtype
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
    flags.check_out(a.out, resumable=hasattr(a, "resume"))


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
    try:
        handle = open(os.path.join(out, ".lock"), "w")
    except OSError as e:  # a read-only disk, a folder in the way
        raise UsageError(f"{out}: cannot write its lock file ({e.strerror or e}); a run goes on "
                         f"only in a folder it can write") from None
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
    log = os.path.join(a.out, "metrics.jsonl")
    steps = log_steps(log)  # inf: a line that is no record
    logged = max((s for s in steps if s != float("inf")), default=0)
    saved = read_config(a.out, type(a))
    if not ckpt and saved["save_every"] == 0 and steps and set(steps) == {float("inf")}:
        raise CheckpointError(f"{log} is damaged (no line of it is a metrics record) and no "
                              f"checkpoint holds a copy of it (--save-every 0): repair the file, "
                              f"or start anew (another --out)")
    if not ckpt and logged and saved["save_every"] == 0:
        if logged == a.steps:  # no checkpoint to continue it from, nor a copy of its log
            drop_garbage(log, list(range(0 if saved["val_every"] else 1, logged + 1)))
            print(f"{a.out} is complete ({logged} of {a.steps} steps)")
            return True
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


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the code that runs


def code_commit(root=ROOT):
    """(the git commit of the code that runs, whether tracked files differ from it) -- (None,
    None) where the tree is no git checkout (a copied tree, the GPU image)."""
    import subprocess
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=30)
        changes = subprocess.run(["git", "-C", root, "status", "--porcelain",
                                  "--untracked-files=no"], capture_output=True, text=True,
                                 timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None, None
    if head.returncode or changes.returncode:
        return None, None
    return head.stdout.strip(), bool(changes.stdout.strip())


def weights_digest(model):
    """sha256 (16 hex digits) of a model's parameters as they are now, in their order: which warm
    start (with LoRA, which frozen base) a run trained from, whatever machine built it."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def write_provenance(run, argv):
    """<out>/provenance.json: one entry each time a process runs the folder (a start, each
    resume) -- the commit of the code, whether it had changes, the command line, the step it
    started after, the weights it started from and the machine -- so that an archive says what
    ran it (lab/experiments.py copies it beside the archive)."""
    import platform
    path = os.path.join(run.args.out, "provenance.json")
    entries = []
    with contextlib.suppress(OSError, ValueError):
        with open(path) as f:
            entries = [e for e in json.load(f) if isinstance(e, dict)]
    commit, dirty = code_commit()
    entries.append({"commit": commit, "dirty": dirty, "argv": list(argv), "after_step": run.step,
                    "weights_sha256": weights_digest(run.policy),
                    "machine": " ".join((platform.machine(), hardware.cpu_name(),
                                         torch.cuda.get_device_name() if run.device.type == "cuda"
                                         else "")).strip(),
                    "torch": torch.__version__})
    atomic_write(path, json.dumps(entries, indent=1))


def write_prompt(run):
    """<out>/prompt.txt: the turn-1 prompt of the first validation seed's layout as the policy
    reads it -- its token ids decoded, special tokens and the "<think>" it ends on included --
    with the prompt pieces rollout.prompts chose for this run."""
    a = run.args
    how = rollout.Turns(env_kwargs=env_kwargs(a), max_turns=a.max_turns,
                        max_actions_per_turn=a.max_actions_per_turn, **run.prompt)
    episode = rollout.start(run.tokenizer, a.env, 0, VAL_SEED_BASE, 0, how)
    atomic_write(os.path.join(a.out, "prompt.txt"),
                 run.tokenizer.decode(episode.ids, skip_special_tokens=False))
    return episode.ids


def check_sampler(run, prompt_ids):
    """The sampler's self-check on the prompt of prompt.txt (sampler.self_check), in the
    sampler's precision: its figures go into a new run's first log record, the path that agreed
    into run.sampling; where no path agreed, NotExact (one line, exit 2)."""
    a = run.args
    with run.sample_ctx:
        check = sampler.self_check(run.policy, run.tokenizer, prompt_ids,
                                   min(a.max_new_tokens, 16), a.temperature, a.sample_dtype)
    if not check["agreed"]:
        raise NotExact(f"the sampler's self-check: even the model's own forward pass samples "
                       f"log-probs {check['selfcheck_plain_diff']:.3g} nats a token from a plain "
                       f"forward pass over the same tokens (tolerance {check['tolerance']:g}): "
                       f"nothing here samples the policy the update scores")
    run.sampling = {"capture": check["capture"], "plain": check["plain"],
                    "failures": run.state.setdefault("failures", {})}
    if run.step == 0:  # a resumed run checks again (another machine?) but logs as it did
        run.pending.update({k: v for k, v in check.items() if k.startswith("selfcheck_")
                            and v is not None})


def last_metrics(path):
    last = {}
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                with contextlib.suppress(json.JSONDecodeError, TypeError, AttributeError):
                    last.update({k: v for k, v in json.loads(line).items()
                                 if not isinstance(v, list)})
    return last


def record(run, m):
    """Step 7's bookkeeping: the metrics line (flushed), a checkpoint when due, the progress bar."""
    failed = run.state.get("failures", {}).get("capture", 0)
    if failed or run.device.type == "cuda":  # the captures that failed so far (said at the end)
        m["capture_failures"] = failed
    m.update(run.pending)
    run.pending = {}
    if run.device.type == "cuda":  # this step's peak, not the run's so far
        m["gpu_peak_gb"] = torch.cuda.max_memory_allocated() / 2 ** 30
        torch.cuda.reset_peak_memory_stats()
    m.update(throughput(run, m))
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


def throughput(run, m):
    """A step's speed as practitioners read it: tokens sampled a second over the rollouts, and
    the update's model-FLOPs utilisation (mfu): its model FLOPs (update_flops) a second over
    what a large matrix product reaches on this device in the update's dtype (peak_flops)."""
    out = {}
    if m.get("tokens_sampled") and m.get("time_rollout"):
        out["tokens_per_s"] = m["tokens_sampled"] / m["time_rollout"]
    if m.get("tokens_trained") and m.get("time_update"):
        peak = peak_flops(run.device.type, run.args.dtype, torch.get_num_threads())
        flops = update_flops(run, m["tokens_trained"], m.get("tokens_scored", 0))
        out["mfu"] = flops / m["time_update"] / peak
    return out


def update_flops(run, tokens, scored):
    """Model FLOPs of an update that passes `tokens` tokens through the model (the kept
    transcripts, every epoch), `scored` of them policy tokens, the only ones the output layer runs
    on (logprobs.policy_logprobs). N, the body's weights: the policy's parameters but its input
    embedding (a lookup) and its output layer H (V x D, the embedding itself where they are tied).
    A token through the body: 2N forward, 4N forward and backward where only LoRA's adapters train
    (the frozen weights need no gradient of their own), 6N where every weight trains; the same
    again for PPO's critic (a value head, no output layer), and 2N for each pass without gradients
    before it (old log-probs where the sampler's cannot be taken, the KL reference, the critic's
    values). A scored token adds the policy's multiples of H. Attention's own products (about
    12 L d T a token) are left out, as in the usual count."""
    a = run.args
    lm = run.policy.get_base_model() if hasattr(run.policy, "get_base_model") else run.policy
    embed, head = lm.get_input_embeddings().weight, lm.get_output_embeddings().weight
    n = sum(p.numel() for p in run.policy.parameters()) - embed.numel()
    n -= 0 if head is embed else head.numel()
    policy = (4 if a.lora else 6) + 2 * (a.dtype != "float32" or a.sample_dtype != "float32") \
        + 2 * bool(a.kl_coef)
    critic = (4 if a.lora else 6) + 2 if run.critic is not None else 0
    return (policy + critic) * n * tokens + policy * head.numel() * scored


@functools.lru_cache(maxsize=None)
def peak_flops(device_type, dtype, threads):
    """FLOPs a second one large matrix product reaches on this device in `dtype`, timed from the
    host (the best of 3): the measure MFU is read against, measured once a process, not a
    datasheet's peak (a GPU's sustained product, or a CPU's with these threads)."""
    size = 4096 if device_type == "cuda" else 768
    kind = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    x = torch.full((size, size), 0.5, device=device_type, dtype=kind)  # no draw: the run's
    # random streams must not depend on when this is first measured
    best = float("inf")
    for _ in range(3):
        if device_type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        x @ x
        if device_type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * size ** 3 / best


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
    paths = []
    if run.args.plot and run.args.steps > 0:
        from plumbing import plots
        paths = plots.plot_runs([run.args.out], run.args.out)
    failed = run.state.get("failures", {}).get("capture", 0)
    if failed:
        print(f"the decode step ran eagerly after {failed} failed capture"
              f"{'s' if failed > 1 else ''} (capture_failures in {run.args.out}/metrics.jsonl)")
    keys = ("step", "train_success", "val_success", "kept_ratio", "mi_estimate", "retrieval_acc")
    print(json_line({k: run.last[k] for k in keys if k in run.last}))
    if paths:  # the last line: where to look next
        print(f"figures in {run.args.out}: {' '.join(os.path.basename(p) for p in paths)}")


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
        try:  # wandb without an API key, for one, refuses here before any network
            self.module.init(project="ragen2", name=os.path.basename(folder), resume="allow",
                             config=dataclasses.asdict(a), **(ids if self.kind == "wandb" else {}))
        except Exception as e:  # noqa: BLE001 -- whatever the tracker raises: one line
            raise UsageError(tracker_failed(self.kind, e)) from None

    def log(self, record):
        numbers = scalars(record)
        if self.kind == "tensorboard":
            for k, v in numbers.items():
                self.writer.add_scalar(k, v, record["step"])
        else:  # the step is wandb's and trackio's own axis (trackio renames a "step" key)
            self.module.log({k: v for k, v in numbers.items() if k != "step"}, step=record["step"])

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
