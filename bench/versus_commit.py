"""A step's seconds: this code against an earlier commit of it, side by side.

    python bench/versus_commit.py 1acd888                  # the main command (tiny, Sokoban)
    python bench/versus_commit.py 8c11bab --model smollm2  # SmolLM2 at the README's sizes, and its warm start

Each version runs from its own copy (`git archive` of the commit into a temporary folder), with 2
threads. Runs alternate, old then new, so a change in the machine's load hits both; the median over
repeats is compared.

- tiny: `train.py --env sokoban --filter topp --steps 5`, warm-started by its own code (the first
  run of each builds its warm start; a build is not a step, so it is not timed). train.py's own
  time_rollout, time_update and time_step, the mean over steps 2-4 (step 1 and step 5 also
  cross-score, and step 5 validates).
- smollm2: the README's SmolLM2 sizes (4 groups x 4 rollouts, 2 turns of at most 40 tokens, GRPO,
  LoRA 16) without the warm start and without a filter, so that every step updates and replies run
  near the token limit, 3 steps, no diagnosis or validation: time_rollout and time_update, the mean
  over steps 2-3. Then the warm start (behaviour cloning on the bare grid's demonstrations, the
  same settings in both versions but 4 steps instead of 40): its seconds a step, from the build's
  own record.

It needs git and the repository's history (a clone, not an archive). Not named bench_*.py, so
run_all.py leaves it out: it takes minutes.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))  # its siblings, however loaded
from arguments import Parser, at_least, parse  # noqa: E402

STEPS = {"tiny": (2, 3, 4), "smollm2": (2, 3)}
SMOLLM2 = ["--env", "frozenlake", "--model", "smollm2", "--algo", "grpo", "--lora", "16", "--groups",
           "4", "--group-size", "4", "--max-turns", "2", "--max-new-tokens", "40", "--no-warm-start",
           "--filter", "none", "--mi-every", "0", "--val-every", "0", "--steps", "3"]
PHASES = ("time_rollout", "time_update", "time_step")
WARM_START = 4  # steps of the warm start timed
BUILD = ("import json, os, sys, time; sys.path.insert(0, os.getcwd()); from plumbing import models; "
         "models.smollm2_warm_start('frozenlake', {{'size': 4, 'success_rate': 1.0}}, "
         "cache_dir={cache!r}, steps={steps})")


def export(commit, folder):
    """The commit's files in `folder`."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", commit], capture_output=True)
    if archive.returncode:
        sys.exit(f"error: git archive {commit}: {archive.stderr.decode().strip()}")
    os.makedirs(folder)
    subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)


def run(cmd, code):
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, cwd=code, capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"error: {' '.join(cmd)} in {code} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def seconds_per_step(code, model, out, cache):
    """{phase: mean seconds over STEPS} of one run of the code in `code`."""
    if model == "tiny":
        cmd = ["--env", "sokoban", "--filter", "topp", "--steps", "5", "--tiny-cache", cache]
    else:
        cmd = SMOLLM2 + ["--threads", "2"]
    stdout = run([sys.executable, "train.py"] + cmd + ["--out", out, "--no-plot"], code)
    for line in stdout.splitlines():  # the first run of each version builds its warm start
        if line.startswith("warm start built in"):
            print(f"  {line} ({os.path.basename(code)})", flush=True)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = {m["step"]: m for m in map(json.loads, f) if "time_step" in m}
    return {k: statistics.mean(steps[s][k] for s in STEPS[model]) for k in PHASES}


def warm_start_seconds(code, cache):
    """Seconds a step of SmolLM2's warm start built by the code in `code` (its own record)."""
    run([sys.executable, "-c", BUILD.format(cache=cache, steps=WARM_START)], code)
    (folder,) = [f for f in os.listdir(cache) if f.startswith("frozenlake-")]
    with open(os.path.join(cache, folder, "warm_start.json")) as f:
        return json.load(f)["seconds"] / WARM_START


def main():
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("commit", help="the earlier commit (e.g. 1acd888)")
    p.add_argument("--model", default="tiny", choices=("tiny", "smollm2"))
    p.add_argument("--repeats", type=at_least(1), default=2)
    a = parse(p)
    times = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        old = os.path.join(tmp, "old")
        export(a.commit, old)
        if a.model == "smollm2":  # the de-quantised model, as the new copy has it
            subprocess.run(["cp", "-r", os.path.join(ROOT, ".cache"), old], check=True)
        for r in range(a.repeats):
            for name, code in (("old", old), ("new", ROOT)):
                t = seconds_per_step(code, a.model, os.path.join(tmp, f"{name}-{r}"),
                                     os.path.join(tmp, f"cache-{name}"))
                if a.model == "smollm2":
                    t["warm_start_step"] = warm_start_seconds(code, os.path.join(tmp,
                                                                                 f"ws-{name}-{r}"))
                times[name].append(t)
                print(f"repeat {r}: {name:3s} " + ", ".join(f"{k} {v:.2f} s" for k, v in t.items()),
                      flush=True)
    median = {name: {k: statistics.median(t[k] for t in runs) for k in runs[0]}
              for name, runs in times.items()}
    for k in median["old"]:
        print(f"{a.model}: {k}: {a.commit} {median['old'][k]:.2f} s, this code "
              f"{median['new'][k]:.2f} s: {median['old'][k] / median['new'][k]:.2f}x faster")
    print(f"RESULT commit {median['old']['time_step'] / median['new']['time_step']:.3f}")


if __name__ == "__main__":
    main()
