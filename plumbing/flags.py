"""The flags of train.py (Args: one line of help each) and their checks, which trl_ragen.py
shares; light on purpose: a script parses its command line with this module before it loads
torch, so that a refused flag answers in about a second (refuse_now).

Bad input is a UsageError: train.main (runs.failed) and trl_ragen.main print it as one line on
stderr and exit with code 2.
"""
import argparse
import ast
import dataclasses
import difflib
import errno
import importlib.util
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass, field

import envs
from plumbing.defaults import GROUP_SIZE


def paper_names(module, *names):
    """Module-level names of one of the paper's modules, read from its source (ast.literal_eval),
    not imported: they import torch, and a refused flag answers before torch loads. The
    vocabulary stays where its math is.

    >>> paper_names("ppo", "KL_KINDS")
    [('k1', 'k2', 'k3')]
    """
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), module + ".py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
             for target in node.targets if isinstance(target, ast.Name)}
    return [ast.literal_eval(found[name]) for name in names]


MODES, CONTROLS, PROB_MODES = paper_names("snr_filter", "MODES", "CONTROLS", "PROB_MODES")
(KL_KINDS,) = paper_names("ppo", "KL_KINDS")
# what a resumed run may change
RESUMABLE = ("steps", "val_every", "save_every", "plot", "threads", "report_to")
REPORT_TO = ("none", "tensorboard", "wandb", "trackio")  # TRL's names for the trackers
# past these a run cannot finish or cannot fit: no step here takes under a second (10**7 s is four
# months), and a step holds all its episodes, transcripts included, in memory at once
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


class UsageError(Exception):
    """Bad input from the user: one line on stderr, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse with a refused flag as a UsageError: one line, where argparse prints its usage too
    (every command line of the project parses with it); its usage line names the command as it
    was run (invoked) unless given a prog, and --help fits the terminal's width."""
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("prog", invoked())
        kwargs.setdefault("formatter_class", help_formatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UsageError(message)


def invoked():
    """The command this process was started as: 'python -m plumbing.plots' or 'python
    plumbing/plots.py' (argparse alone says 'plots.py' either way)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:  # python -m NAME
        return "python -m " + spec.name.removesuffix(".__main__")
    script = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c") else None
    return f"python {os.path.relpath(script)}" if script else "python"


def help_formatter(prog):
    """argparse's layout at the terminal's width (COLUMNS, else the terminal's, else 80 columns):
    a help line never wraps on the screen it is read on."""
    width = shutil.get_terminal_size().columns
    return argparse.HelpFormatter(prog, max_help_position=min(30, width // 3), width=width - 2)


def arg(default, help, **kw):
    return field(default=default, metadata=dict(help=help, **kw))


@dataclass
class Args:
    """Every flag of train.py (python train.py --help lists them with their defaults)."""
    # the world
    env: str = arg("sokoban", "environment", choices=tuple(envs.ENVS))
    room_size: int = arg(6, "sokoban: the room is room_size x room_size")
    num_boxes: int = arg(1, "sokoban: number of boxes")
    lake_size: int = arg(4, "frozenlake: the map is lake_size x lake_size")
    success_rate: float = arg(1.0, "frozenlake: chance a move goes its way (Gymnasium's: 1/3)")
    high_prob: float = arg(0.25, "bandit: chance that the risky arm pays")
    countdown_numbers: int = arg(3, "countdown: how many numbers (2..6) make the target")
    attempts: int = arg(3, "wordproblems: answers an episode may give (a wrong one retries)")
    max_turns: int = arg(5, "turns per episode")
    max_actions_per_turn: int = arg(2, "actions the policy may take per turn")
    # the algorithm
    algo: str = arg("ppo", "ppo: critic + GAE; grpo: group-normalised; drgrpo: no std division; "
                    "dapo",
                    choices=("ppo", "grpo", "drgrpo", "dapo"))  # train.AGGREGATION's keys
    max_draws: int = arg(3, "dapo: most draws of --groups groups a step to fill the batch")
    overlong_buffer: int = arg(None, "dapo: penalty ramp over the last N tokens of a turn (1/4 of "
                               "the limit; 0: off)")
    filter: str = arg("topp", "filter (random / bottom: controls)", choices=MODES + CONTROLS)
    control_of: str = arg("topk", "random / bottom only: keep as many groups as this would keep",
                          choices=("topk", "topp"))
    top_p: float = arg(0.9, "topp: keep the best groups until this fraction of the summed std")
    top_k: float = arg(0.5, "topk: keep max(1, int(top_k * groups)) best groups")
    filter_prob_mode: str = arg("linear", "topp: on the std itself or on its softmax",
                                choices=PROB_MODES)
    include_zero: bool = arg(False, "let zero-spread groups be kept (no task gradient)")
    groups: int = arg(8, "prompt groups (env seeds) per step")
    group_size: int = arg(GROUP_SIZE, "rollouts per group")
    steps: int = arg(100, "training steps")
    lr: float = arg(None, "actor learning rate, <= 0.1 (1e-6; tiny: 1e-4)")
    critic_lr: float = arg(None, "critic learning rate, <= 0.1 (1e-5; tiny: 1e-3)")
    clip_low: float = arg(0.2, "PPO ratio clip below 1")
    clip_high: float = arg(0.28, "PPO ratio clip above 1")
    clip_c: float = arg(3.0, "dual clip: loss cap for negative advantages, times -A (0 = off)")
    value_clip: float = arg(0.5, "critic value clip")
    kl_coef: float = arg(0.0, "KL penalty to the initial policy, <= 10 (0 = none)")
    kl_kind: str = arg("k3", "KL estimator", choices=KL_KINDS)
    entropy_coef: float = arg(0.001, "entropy bonus coefficient, <= 10")
    gamma: float = arg(1.0, "GAE discount (only 1: each reward sits on the episode's last token)")
    lam: float = arg(1.0, "GAE lambda")
    mini_batch_size: int = arg(32, "trajectories per optimiser step")
    epochs: int = arg(1, "passes over the kept batch per step, <= 100")
    optimizer_steps: int = arg(0, "N mini-batches per update (fewer if fewer kept; 0: by size)")
    grad_clip: float = arg(1.0, "gradient norm clip")
    # generation
    temperature: float = arg(1.0, "sampling temperature of the rollouts, >= 0.001")
    sample_top_p: float = arg(1.0, "nucleus sampling of the rollouts (1 = off)")
    max_new_tokens: int = arg(None, "token limit per turn (400; tiny: 64)")
    # the model, memory and speed
    model: str = arg(None, "HF id, folder, tiny or smollm2 (GPU: Qwen2.5-0.5B-Instruct, else tiny)")
    dtype: str = arg(None, "bfloat16 (GPU; real models on AVX512-BF16 / AMX) or float32",
                     choices=("float32", "bfloat16"))
    sample_dtype: str = arg(None, "the rollouts' (--dtype's; if not, the update rescores)",
                            choices=("float32", "bfloat16"))
    lora: int = arg(0, "LoRA rank: train adapters instead of all weights (0 = off)")
    lora_alpha: float = arg(None, "LoRA alpha (2 x rank)")
    lora_targets: str = arg("all-linear", "LoRA targets: all-linear or comma-separated names")
    micro_batch: int = arg(None, "trajectories per forward/backward (CPU: 8; GPU: by memory)")
    rollout_batch: int = arg(None, "episodes sampled at once (all; GPU: by memory)")
    grad_checkpointing: bool = arg(None, "recompute activations in backward (GPU: by memory)")
    threads: int = arg(None, "CPU threads for torch, <= cores (tiny: 2, else all cores)")
    rebuild_tiny: bool = arg(False, "tiny: redo the warm start instead of using the cache")
    warm_start: bool = arg(True, "tiny, smollm2: warm-start on demonstrations (off: as built)")
    tiny_cache: str = arg(".cache/tiny", "tiny: folder of warm-started models")
    warm_start_seed: int = arg(0, "tiny, smollm2: the warm start's build seed (weights, demos)")
    observation: str = arg("grid", "real models: the bare grid, or with its coordinates (coords)",
                           choices=envs.OBSERVATIONS)
    template_prior: float = arg(0.0, "tiny, smollm2: share of warm-start turns reasoning with a "
                                "template")
    kl_template_prior: float = arg(
        None, "tiny: template share of the KL reference's warm start (default: the policy's)")
    template_kind: str = arg("pool", "pool, surface (tiny), borrowed (smollm2: another's way)",
                             choices=("pool", "surface", "borrowed"))
    filler: float = arg(None, "tiny: 5 digits end each demo reasoning, random w.p. FILLER")
    # diagnosis, validation, output
    mi_every: int = arg(5, "cross-scoring diagnosis at step 1 and every N steps (0 = off)")
    mi_samples: int = arg(64, "samples cross-scored per diagnosis")
    retokenize: bool = arg(False, "diagnosis: score re-tokenised text (the official way), not sampled ids")
    probe_prompts: int = arg(8, "fixed held-out prompts diagnosed at every diagnosis (0: off)")
    probe_samples: int = arg(8, "first-turn reasonings sampled per probe prompt (>= 2)")
    grad_decomp_every: int = arg(0, "task / KL-to-start / entropy gradient norms per spread bucket, "
                                 "every N")
    val_every: int = arg(10, "validation before training, every N steps, at the end (0 = never)")
    val_seeds: int = arg(64, "held-out validation seeds (one rollout each)")
    val_temperature: float = arg(0.5, "validation sampling temperature, >= 0.001 or 0 (greedy)")
    save_every: int = arg(None, "checkpoint every N steps (1; a GPU's over 2 GB: 10; 0: never)")
    seed: int = arg(0, "seed of env seeds, sampling and shuffling")
    out: str = arg(None, "run folder (runs/<env>-<algo>-<filter>-<time>)")
    resume: str = arg(None, "run folder to continue from its checkpoint (--steps may extend it)")
    plot: bool = arg(True, "write PNG figures at the end")
    report_to: str = arg("none", "metrics also to none, tensorboard (<out>/tensorboard), wandb, "
                         "trackio", choices=REPORT_TO)


# ------------------------------------------------------------------------------------- command line

def build_parser(Args, defaults=True):
    """One flag per Args field, one line of help each with the default in brackets; a boolean
    field is --name and --no-name (hidden). defaults=False leaves out the flags not given (for
    --resume). No abbreviations: --step is an error, not --steps."""
    description = ("RAGEN-2 in miniature: PPO / GRPO with SNR-aware filtering and the MI "
                   "diagnosis. Defaults in brackets; every on/off flag has a --no- form too.")
    parser = Parser(prog="train.py", usage="python train.py [flags]", description=description,
                    allow_abbrev=False, argument_default=None if defaults else argparse.SUPPRESS)
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
    check_named(given)
    if args.resume is not None:
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


def parse_command(Args, argv):
    """parse_args, then what the command names outside itself (check_start): what train.py checks
    before torch loads."""
    a = parse_args(Args, argv)
    check_start(a)
    return a


def check_start(a):
    """What a command line names on this machine, checked before anything loads (and again when a
    run starts, runs.start): --model can be loaded here, and a new run's --out can hold it. Apart
    from check_args, which checks what the flags mean wherever they run (a grid's registered
    runs, a README's commands)."""
    check_model(a.model)
    if not getattr(a, "resume", None) and a.out is not None:
        check_out(a.out, resumable=hasattr(a, "resume"))


def check_model(model, hub=True):
    """A --model folder that holds no model (neither a Hugging Face model's config.json nor a
    checkpoint's policy.json), a name close to tiny (a typo), and (hub) a hub id that the local
    cache lacks while HF_HUB_OFFLINE forbids the network: one line, before transformers would say
    so in its own words."""
    if model in (None, "tiny", "smollm2"):
        return
    folder = os.path.expanduser(model)
    if os.path.isdir(folder):
        if not any(os.path.isfile(os.path.join(folder, f)) for f in ("config.json", "policy.json")):
            raise UsageError(f"--model {model}: this folder holds no model (neither a Hugging "
                             f"Face model's config.json nor a checkpoint's policy.json)")
        return
    if model.startswith((".", "/", "~")) or os.path.exists(folder):
        return  # check_args and models.load say what is wrong with it
    if difflib.get_close_matches(model, ["tiny"], n=1, cutoff=0.6):
        raise UsageError(f"--model {model}: not a folder or hub id; did you mean --model tiny?")
    if not hub:
        return
    from huggingface_hub import constants, try_to_load_from_cache  # light: no torch
    if constants.HF_HUB_OFFLINE and not isinstance(
            try_to_load_from_cache(model, "config.json"), str):
        raise UsageError(f"--model {model}: not in the local Hugging Face cache "
                         f"({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE is set: unset it to "
                         f"fetch it, or give a local folder")


def check_out(out, resumable=True):
    """--out of a new run: new, or an empty folder, where this process can create files; not a
    run (resumable: say how to continue it), not a file, not a folder of other files."""
    if any(os.path.isfile(os.path.join(out, f)) for f in ("config.json", "metrics.jsonl")):
        again = f"continue it with --resume {out}, or " if resumable else ""
        raise UsageError(f"--out {out} already holds a run: {again}choose another --out")
    if os.path.isdir(out) and set(os.listdir(out)) - {".lock"}:
        raise UsageError(f"--out {out} is a folder with other files in it, not a run: choose a "
                         f"new or empty folder")
    parent = os.path.abspath(out)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    why = "not a folder" if not os.path.isdir(parent) else unwritable(parent)
    if why:
        raise UsageError(f"--out {out}: cannot write there ({why}: {parent})")


def unwritable(folder):
    """Why this process cannot create files in `folder`, in the kernel's words, or None: a
    read-only file system (EROFS; no permission helps there, not even root's), else no
    permission (EACCES)."""
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return os.strerror(errno.EROFS)
    return None if os.access(folder, os.W_OK | os.X_OK) else os.strerror(errno.EACCES)


def check_named(given):
    """A flag that names something (a folder, a model, layers) given an empty name: one line,
    not the default it would fall back to (`--resume ""` is no run to continue, `--out ""` no
    folder)."""
    for k, v in given.items():
        if isinstance(v, str) and not v.strip():
            raise UsageError(f"--{k.replace('_', '-')} {v!r}: an empty name names nothing; give "
                             f"one, or leave the flag out")


def check_ignored(a, given):
    """A flag given on the command line (`given`: the flags given, as from build_parser with
    defaults=False) that the chosen filter or world would ignore: one line, not a silent no-op."""
    control = a.filter in CONTROLS
    counted = a.control_of if control else a.filter  # whose count is kept
    sets = "it sets what --filter {0} keeps (or a control's count, with --control-of {0})"
    filtering = {"control_of": (control, "it sets the count of a control (--filter random or "
                                         "bottom)"),
                 "top_p": (counted == "topp", sets.format("topp")),
                 "filter_prob_mode": (counted == "topp", sets.format("topp")),
                 "top_k": (counted == "topk", sets.format("topk")),
                 "include_zero": (a.filter != "none", "--filter none keeps every group")}
    worlds = {"room_size": "sokoban", "num_boxes": "sokoban", "lake_size": "frozenlake",
              "success_rate": "frozenlake", "high_prob": "bandit", "countdown_numbers": "countdown",
              "attempts": "wordproblems"}
    algorithms = {"max_draws": "dapo", "overlong_buffer": "dapo"}
    algo = getattr(a, "algo", None)  # scaleout.trl_ragen has no --algo (nor DAPO's flags)
    for k in given:
        world, wanted = worlds.get(k, a.env), algorithms.get(k, algo)
        ok, why = filtering.get(k) or ((False, f"it is --algo {wanted}'s") if wanted != algo
                                       else (world == a.env, f"it is --env {world}'s"))
        if not ok:
            value = "" if isinstance(given[k], bool) else f" {given[k]}"
            chosen = (f"--filter {a.filter}" if k in filtering else
                      f"--algo {algo}" if k in algorithms else f"--env {a.env}")
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
    if not isinstance(saved, dict):
        raise UsageError(f"--resume {folder}: config.json is not a run's config")
    unknown = sorted(set(saved) - set(fields))
    if unknown:
        raise UsageError(f"--resume {folder}: config.json has {unknown[0]!r}, which is no setting "
                         f"of train.py (a scaleout.trl_ragen run, or another version's), so it "
                         f"is not a run train.py can continue")
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

    for name, value in dataclasses.asdict(a).items():
        need(not isinstance(value, float) or math.isfinite(value),
             f"--{name.replace('_', '-')} {value}: a number must be finite (not nan or inf)")
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
    check_dapo(a, need)
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
        need(value is None or value >= 0, f"--{name.replace('_', '-')} must be >= 0 (0 = never), "
             f"got {value}")
    need(a.lora >= 0 and (a.lora_alpha is None or a.lora_alpha > 0),
         "--lora must be >= 0, --lora-alpha > 0")
    need(a.report_to in REPORT_TO, f"--report-to must be one of {', '.join(REPORT_TO)}")
    need(a.report_to == "none" or importlib.util.find_spec(a.report_to),  # the package's name
         f"--report-to {a.report_to}: {a.report_to} is not installed (pip install "
         f"{a.report_to})")
    folder = os.path.expanduser(a.model or "")
    need(not (a.model or "").startswith((".", "/", "~")) or os.path.isdir(folder),
         f"--model {a.model}: no such folder")
    cores = os.cpu_count() or 1
    need(a.threads is None or 1 <= a.threads <= cores, f"--threads must be in 1..{cores}, the "
         f"machine's cores, got {a.threads} (more threads than cores only wait for each other)")
    need(not (a.template_prior or a.kl_template_prior) or envs.ENVS[a.env].actions is not None,
         f"--template-prior with --env {a.env}: the template pools are the action worlds' "
         f"(sokoban, frozenlake, bandit)")
    need(0 <= a.template_prior <= 1 and a.warm_start_seed >= 0,
         "--template-prior must be in [0, 1] and --warm-start-seed >= 0")
    need(a.filler is None or 0 <= a.filler <= 0.75, "--filler must be in [0, 0.75] (0.75: the "
         "most entropy a filler digit can have)")
    need(a.observation == "grid" or (a.model != "tiny" and a.env in envs.COORDINATES),
         f"--observation {a.observation} is for a real model in a grid world (frozenlake, "
         f"sokoban): " + ("the tiny policy reads its own positions line" if a.model == "tiny"
                          else f"--env {a.env} has no grid"))
    need(a.template_kind != "borrowed" or a.model == "smollm2", "--template-kind borrowed is "
         "SmolLM2's: reading FrozenLake's coordinates (--model smollm2 --observation coords)")
    need(a.model in (None, "tiny") or not a.template_prior
         or (a.model == "smollm2" and a.observation == "coords" and a.env == "frozenlake"
             and a.template_kind != "surface" and a.filler is None),
         f"--template-prior with --model {a.model}: a real model's templates are taught to "
         f"SmolLM2 reading FrozenLake's coordinates (--model smollm2 --observation coords --env "
         f"frozenlake), of kind pool or borrowed, without --filler")
    prior = a.kl_template_prior
    need(prior is None or (0 <= prior <= 1 and a.model == "tiny" and not a.lora
                           and (prior > 0) == (a.template_prior > 0)),
         "--kl-template-prior must be in [0, 1], with --model tiny, no --lora, and > 0 "
         "exactly when --template-prior is (the two warm starts must share a vocabulary)")
    for name in ("room_size", "lake_size"):
        value = getattr(a, name)
        need(value <= MAX_MAP, f"--{name.replace('_', '-')} must be <= {MAX_MAP}, got {value} (a "
             f"larger map is a prompt of more than {MAX_MAP ** 2:,} cells a turn)")
    try:
        envs.make_env(a.env, **env_kwargs(a)).reset(seed=0)
    except ValueError as e:
        raise UsageError(f"--env {a.env}: {e}") from None


def check_dapo(a, need):
    """DAPO's settings: its objective has no KL term, a draw is at least one, and the overlong
    buffer lies inside the token limit."""
    need(a.algo != "dapo" or a.kl_coef == 0, f"--kl-coef {a.kl_coef} with --algo dapo: DAPO's "
         f"objective has no KL term (use --algo grpo for GRPO with one)")
    need(a.max_draws >= 1, f"--max-draws must be >= 1 (the step's own draw), got {a.max_draws}")
    limit, buffer = a.max_new_tokens, a.overlong_buffer
    need(buffer is None or (buffer >= 0 and (limit is None or buffer < limit)),
         f"--overlong-buffer must be >= 0 and below --max-new-tokens ({limit}), got {buffer}")


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


def env_kwargs(a):
    return {"sokoban": dict(dim_room=(a.room_size, a.room_size), num_boxes=a.num_boxes),
            "frozenlake": dict(size=a.lake_size, success_rate=a.success_rate),
            "bandit": dict(high_prob=a.high_prob), "countdown": dict(count=a.countdown_numbers),
            "wordproblems": dict(attempts=a.attempts)}.get(a.env, {})


def polite_threads():
    """Let OpenMP's threads sleep while they wait instead of spinning, which takes shared cores
    from other work (the tiny warm start beside one busy process on 2 cores: 73 s -> 1387 s;
    bench/bench_shared_cores.py). OpenMP reads OMP_WAIT_POLICY once, when torch loads it: every
    entry point calls this first. A policy the user set is kept; an empty one is no policy
    (OpenMP then spins), so it counts as unset."""
    if not os.environ.get("OMP_WAIT_POLICY", "").strip():
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def before_torch(parse, *args):
    """What an entry point does before it loads torch: polite_threads, and refuse a bad flag at
    once (refuse_now)."""
    polite_threads()
    return refuse_now(parse, *args)


def refuse_now(parse, *args):
    """parse(*args), or its UsageError as one line on stderr and exit code 2: what a script runs
    before it imports torch, so that a refused flag answers at once (its main parses again)."""
    try:
        return parse(*args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def response_budget(args):
    """The most tokens the policy can write in an episode: Dr.GRPO's constant normaliser."""
    return args.max_turns * args.max_new_tokens


def overlong_buffer(args):
    """DAPO's overlong buffer in tokens: --overlong-buffer, by default a quarter of the token
    limit (verl's DAPO recipe: 4,096 of 20,480 tokens, a fifth)."""
    return args.max_new_tokens // 4 if args.overlong_buffer is None else args.overlong_buffer
