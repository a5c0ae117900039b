"""What a model does before any training: the MI diagnosis of its reasoning, its answer format and
its success, on each world, written as a per-world archive and a table regenerated from the
archives.

    python bench/zero_shot.py --model smollm2                  # FrozenLake, Sokoban, Bandit,
                                                               # Countdown, word problems; about
                                                               # 20 minutes a world on 2 idle cores
    python bench/zero_shot.py --report                         # the table again, from the archives
    python bench/zero_shot.py --model smollm2 --warm-start     # after train.py's warm start
    python bench/zero_shot.py --model smollm2 --warm-start --observation coords --worlds frozenlake
                                                               # the grid read with coordinates
    python bench/zero_shot.py --model smollm2 --quick          # small sizes, to prove it runs

Per world, all at sampling temperature 1 (the training temperature) and at most --max-new-tokens a
turn:
- validation: --val-seeds held-out seeds (train.py's), one whole episode each: success against the
  uniformly random policy's (envs.baselines), the share of replies in the required format
  (envs.parse_response: closed think and answer blocks, every kept piece an action; in an answer
  world a non-empty answer block), reply length,
  the share of replies cut at the token limit and of distinct first replies;
- the in-batch diagnosis on G groups x K first turns (train.diagnose: MI estimate, retrieval
  accuracy, H(Z) and H(Z|X) per token) and the token entropy of the policy on those replies;
- the probe set (train.probe: 8 held-out prompts x 8 reasonings: MI with its standard error over
  the prompts, and I(Z;A|X)).
Intervals: a 95% Wilson interval for the shares, +-1.96 standard errors for the probe MI.
Archives: results/zero-shot/<model>-<world>.json (the numbers and the first few replies);
results/zero-shot/README.md is the table, made from them alone.
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import scipy.stats
# the bench's siblings; arguments first: it lets OpenMP's threads sleep before torch loads
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arguments import Parser, at_least, parse, refuse, thread_count  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import envs  # noqa: E402
import ppo  # noqa: E402
import train  # noqa: E402
from plumbing import defaults, models, runs  # noqa: E402
from plumbing.checkpoints import atomic_write  # noqa: E402
from plumbing.flags import UsageError, check_args  # noqa: E402


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "results", "zero-shot")
WORLDS = ("frozenlake", "sokoban", "bandit", "countdown", "wordproblems")
GROUPS, GROUP_SIZE = 8, 8  # the in-batch diagnosis: 64 first turns cross-scored over 8 prompts


def worlds(text):
    """An argparse type: comma-separated worlds of envs.py."""
    names = text.split(",")
    unknown = [n for n in names if n not in envs.ENVS]
    if unknown:
        raise argparse.ArgumentTypeError(f"no world {unknown[0]!r}; the worlds: "
                                         f"{', '.join(envs.ENVS)}")
    return names


def measure(model, world, val_seeds, groups, group_size, probe, max_new_tokens, threads, seed=0,
            warm_start=False, observation="grid"):
    started = time.time()
    a = train.Args(model=model, warm_start=warm_start, env=world, observation=observation,
                   temperature=1.0, val_temperature=1.0,
                   max_new_tokens=max_new_tokens, threads=threads, groups=groups,
                   group_size=group_size, mi_samples=groups * group_size, val_seeds=val_seeds,
                   probe_prompts=probe, probe_samples=probe, seed=seed, out="runs/zero-shot")
    check_args(a)  # e.g. --observation coords for a world without a grid: one line
    runs.resolve_defaults(a, torch.device("cpu"))
    run = runs.load_run(a, torch.device("cpu"), a.model)
    torch.manual_seed(seed)

    # validation: whole episodes on held-out seeds
    episodes = train.collect_rollouts(run, [defaults.VAL_SEED_BASE + i for i in range(val_seeds)], 1,
                                      1.0, 1.0)
    actions = envs.make_env(world, **runs.env_kwargs(a)).actions
    valid = [envs.parse_response(r, actions, a.max_actions_per_turn)[2]
             for e in episodes for r in e.responses]
    wins = sum(e.success for e in episodes)
    lengths = [n for e in episodes for n in e.response_lengths]
    cut = [n >= max_new_tokens for n in lengths]
    out = {"model": model + (" (warm start)" if warm_start else ""),
           "world": world + (f" ({observation})" if observation != "grid" else ""),
           "max_new_tokens": max_new_tokens, "seed": seed,
           "val_seeds": val_seeds, "success": wins / val_seeds,
           "random_success": envs.baselines(world, **runs.env_kwargs(a))[1],
           "replies": len(valid), "format_rate": float(np.mean(valid)),
           "reply_length": float(np.mean(lengths)),
           "cut_frac": float(np.mean(cut)),
           "distinct_first": len({e.responses[0] for e in episodes}) / val_seeds,
           "examples": [e.responses[0] for e in episodes[:4]]}

    # the in-batch diagnosis on first turns of G groups x K samples, and the token entropy there
    a.max_turns = 1
    rng = np.random.default_rng([seed, 1])
    firsts = train.collect_rollouts(run, rng.integers(0, defaults.VAL_SEED_BASE, groups).tolist(),
                                    group_size, 1.0, 1.0)
    out.update(train.diagnose(run, firsts, rng))
    batch = train.rollout_batch(run, firsts)
    _, entropy = train.over_batch(run, batch, train.policy_pass, with_entropy=True)
    out["token_entropy"] = ppo.masked_mean(entropy, batch["policy_mask"][:, 1:]).item()
    out.update(train.probe(run))
    out.pop("template_share", None)  # the tiny policy's template pool: no meaning here
    out.pop("probe_template_share", None)
    out["seconds"] = time.time() - started
    return out


def share(k_share, n):
    """A share of n samples with its 95% Wilson interval (scipy's), as text."""
    ci = scipy.stats.binomtest(round(k_share * n), n).proportion_ci(0.95, method="wilson")
    return f"{k_share:.3f} ({ci.low:.3f}-{ci.high:.3f})"


ROWS = [  # (label, how to show it from an archive); | in a label is escaped for the table
    ("success (95% CI)", lambda r: share(r["success"], r["val_seeds"])),
    ("uniformly random policy's success", lambda r: f"{r['random_success']:.3f}"),
    ("replies in the required format (95% CI)", lambda r: share(r["format_rate"], r["replies"])),
    ("reply length, tokens (share cut at the limit)",
     lambda r: f"{r['reply_length']:.1f} ({r['cut_frac']:.2f})"),
    ("distinct first replies", lambda r: f"{r['distinct_first']:.2f}"),
    ("MI estimate, in-batch: nats a token, a reply", lambda r: f"{r['mi_estimate']:.3f}, "
                                                               f"{r['mi_seq_estimate']:.2f}"),
    ("retrieval accuracy, in-batch (95% CI; chance)",
     lambda r: f"{share(r['retrieval_acc'], GROUPS * GROUP_SIZE)}; {r['retrieval_chance']:.3f}"),
    ("H(Z), H(Z\\|X) a token", lambda r: f"{r['reasoning_entropy']:.3f}, "
                                          f"{r['conditional_entropy']:.3f}"),
    ("token entropy", lambda r: f"{r['token_entropy']:.3f}"),
    ("probe MI: a token, a reply (+-1.96 se)",
     lambda r: f"{r['probe_mi_estimate']:.3f} +- {1.96 * r['probe_mi_estimate_se']:.3f}, "
               f"{r['probe_mi_seq_estimate']:.2f} +- {1.96 * r['probe_mi_seq_estimate_se']:.2f}"),
    ("probe retrieval accuracy (+-1.96 se)",
     lambda r: f"{r['probe_retrieval_acc']:.3f} +- {1.96 * r['probe_retrieval_acc_se']:.3f}"),
    ("I(Z;A\\|X), probe (+-1.96 se)",
     lambda r: f"{r['probe_action_mi']:.3f} +- {1.96 * r['probe_action_mi_se']:.3f}"),
    ("diagnosis_logprob_diff (in-batch, probe)",
     lambda r: f"{r['diagnosis_logprob_diff']:.1e}, {r['probe_diagnosis_logprob_diff']:.1e}"),
]


def table(folder=OUT):
    """The markdown table of every archive in `folder`, one column a (model, world)."""
    names = sorted(f for f in os.listdir(folder) if f.endswith(".json"))
    if not names:
        raise SystemExit(f"no archives in {folder}")
    archives = [json.load(open(os.path.join(folder, f))) for f in names]
    head = [f"{r['model']}, {r['world']}" for r in archives]
    lines = ["| | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(show(r) for r in archives) + " |"
              for label, show in ROWS]
    sizes = {(r["val_seeds"], r["max_new_tokens"]) for r in archives}
    note = "; ".join(f"{v} validation seeds, at most {t} tokens a turn" for v, t in sorted(sizes))
    return ("# Before RL\n\nMade by `python bench/zero_shot.py --report` from the "
            f"archives beside this file ({note}; temperature 1).\n\n" + "\n".join(lines) + "\n")


def main():
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--worlds", type=worlds, default=",".join(WORLDS),
                        help=f"comma-separated, of {', '.join(envs.ENVS)}")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=64)
    parser.add_argument("--threads", type=thread_count, default=2)
    parser.add_argument("--warm-start", action="store_true",
                        help="the model after its warm start (train.py's), not as pretrained")
    parser.add_argument("--observation", choices=envs.OBSERVATIONS, default="grid",
                        help="the bare grid, or with its coordinates (train.py's --observation)")
    parser.add_argument("--quick", action="store_true", help="small sizes; writes nothing")
    parser.add_argument("--report", action="store_true", help="only the table, from the archives")
    args = parse(parser, quick=dict(max_new_tokens=8))
    if not args.report:
        for world in args.worlds:
            sizes = (4, 2, 2, 2) if args.quick else (64, GROUPS, GROUP_SIZE, 8)
            try:
                row = measure(args.model, world, *sizes, args.max_new_tokens, args.threads,
                              warm_start=args.warm_start, observation=args.observation)
            except (models.ModelError, UsageError) as e:  # e.g. a model not on this machine
                refuse(e)
            print(json.dumps({k: v for k, v in row.items() if k != "examples"}))
            if not args.quick:
                os.makedirs(OUT, exist_ok=True)
                name = os.path.basename(os.path.normpath(args.model)) + (
                    "-warm-start" if args.warm_start else "") + f"-{world}" + (
                    f"-{args.observation}" if args.observation != "grid" else "")
                atomic_write(os.path.join(OUT, f"{name}.json"), json.dumps(row, indent=1))
            print(f"RESULT zero_shot_format_rate_{world} {row['format_rate']:.4f}")
    if not args.quick:
        text = table()
        atomic_write(os.path.join(OUT, "README.md"), text)
        print(text)


if __name__ == "__main__":
    main()
