"""Against TRL: one GRPO step of train.py beside one step of trl_ragen.py (TRL's GRPOTrainer with
the filter and the diagnosis), same tiny model, worlds, seeds and settings, side by side.

One step, both sides: G groups x K multi-turn Sokoban episodes sampled by rollout.play, the
filter on the groups' reward spread, GRPO advantages (r - mean) / std, one clipped-loss update
(clip 0.2 / 0.28, grad clip 1.0, AdamW, constant lr, no KL, no entropy bonus, sequence-mean of
token-means). Each side runs as its own command in a fresh process, the two taking turns for
--rounds rounds; the steps' times come from the metrics.jsonl each writes (train.py: rollout +
scoring + update, without its checkpoint and validation; trl_ragen.py: the whole TRL step, its
update being what follows the rollouts and the scoring). The first step of a run is a warm-up and
is left out.

Random tiny weights (--no-warm-start) reach no reward spread, so the default filter is none: every
group is trained on both sides and the step does the same work. --filter topp with a warm-started
model (--warm-start) measures the filtered step instead.

    python bench/bench_trl.py            # G = 4 x K = 4, 2 turns, 16 new tokens a turn, 4 steps
    python bench/bench_trl.py --quick    # tiny sizes, 2 steps: proves the script still runs

Last line: RESULT trl <TRL step seconds / train.py step seconds> (above 1: train.py is faster).
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its siblings, however loaded
from arguments import Parser, at_least, parse, thread_count  # noqa: E402


def step_seconds(script, flags, out, threads):
    """Run `script` with `flags` into `out`; (step, rollout, update) seconds of each step after
    the first, and the metrics lines."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    command = ["-m", script[:-3].replace("/", ".")] if "/" in script else [script]
    done = subprocess.run([sys.executable, *command, *flags, "--out", out],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"{script} failed:\n{done.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if '"step": 0' not in line]
    if script == "train.py":
        times = [(r["time_rollout"] + r["time_scoring"] + r["time_update"], r["time_rollout"],
                  r["time_update"]) for r in lines]
    else:  # TRL's step: rollouts (in time_rollout), our scoring, then its loss and update
        times = [(r["time_step"], r["time_rollout"],
                  r["time_step"] - r["time_rollout"] - r["time_scoring"]) for r in lines]
    return times[1:], lines


def main():
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=thread_count, default=2,
                        help="torch threads of each side")
    parser.add_argument("--groups", type=at_least(2), default=4, help="G prompt groups per step")
    parser.add_argument("--group-size", type=at_least(2), default=4, help="K episodes per group")
    parser.add_argument("--max-turns", type=at_least(1), default=2)
    parser.add_argument("--max-new-tokens", type=at_least(1), default=16, help="per turn")
    parser.add_argument("--steps", type=at_least(1), default=4,
                        help="timed steps, after a warm-up step")
    parser.add_argument("--rounds", type=at_least(1), default=2,
                        help="rounds the sides take turns in")
    parser.add_argument("--filter", default="none", choices=("none", "topp", "topk"))
    parser.add_argument("--warm-start", action="store_true", help="the warm-started tiny policy")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 timed step")
    a = parse(parser, quick=dict(groups=2, group_size=2, max_turns=1, max_new_tokens=4, steps=1,
                                 rounds=1))
    shared = ["--env", "sokoban", "--model", "tiny", "--filter", a.filter,
              "--groups", str(a.groups), "--group-size", str(a.group_size),
              "--max-turns", str(a.max_turns), "--max-new-tokens", str(a.max_new_tokens),
              "--steps", str(1 + a.steps), "--lr", "1e-4", "--clip-low", "0.2",
              "--clip-high", "0.28", "--grad-clip", "1.0", "--kl-coef", "0",
              "--entropy-coef", "0", "--mi-every", "0", "--seed", "0",
              "--warm-start" if a.warm_start else "--no-warm-start"]
    ours = shared + ["--algo", "grpo", "--mini-batch-size", str(a.groups * a.group_size),
                     "--threads", str(a.threads), "--val-every", "0", "--val-seeds", "1",
                     "--save-every", "0", "--no-plot"]
    trl = shared + ["--loss-type", "grpo", "--scale-rewards", "group"]
    sides = {"train.py": ("train.py", ours), "trl_ragen.py (TRL)": ("scaleout/trl_ragen.py", trl)}
    times, lines = {name: [] for name in sides}, {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):  # the sides take turns: a change in a shared machine's load
            for name, (script, flags) in sides.items():  # hits both alike
                t, records = step_seconds(script, flags, os.path.join(tmp, f"{name[:5]}-{r}"),
                                          a.threads)
                times[name] += t
                lines[name] += records
    import trl as trl_package
    print(f"tiny policy ({'warm-started' if a.warm_start else 'random weights'}); Sokoban, "
          f"G = {a.groups} x K = {a.group_size}, <= {a.max_turns} turns of <= {a.max_new_tokens} "
          f"tokens; filter {a.filter}; torch threads {a.threads}; TRL {trl_package.__version__}; "
          f"median of {a.rounds} rounds x {a.steps} steps, each after a warm-up step")
    print(f"{'one GRPO step':<24}{'seconds':>9}{'rollout':>9}{'update':>9}{'kept ratio':>12}"
          f"{'reward mean':>13}")
    median = {name: [statistics.median(x) for x in zip(*t)] for name, t in times.items()}
    for name, (step, roll, update) in median.items():
        kept = statistics.mean(r["kept_ratio"] for r in lines[name])
        reward = statistics.mean(r["reward_mean"] for r in lines[name])
        print(f"{name:<24}{step:>9.3f}{roll:>9.3f}{update:>9.3f}{kept:>12.2f}{reward:>13.3f}")
    print(f"RESULT trl {median['trl_ragen.py (TRL)'][0] / median['train.py'][0]:.3f}")


if __name__ == "__main__":
    main()
