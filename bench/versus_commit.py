"""The main command's seconds a step: this code against an earlier commit of it, side by side.

    python bench/versus_commit.py 1acd888           # Sokoban, the main command's flags, 2 repeats

Each version runs `train.py --env sokoban --filter topp --steps 5` from its own copy (`git archive` of
the commit into a temporary folder), warm-started by its own code (the first run of each builds its
warm start; a build is not a step, so it is not timed), with 2 threads. Runs alternate, old then
new, so a change in the machine's load hits both. A step's time is train.py's own `time_step`; the
number compared is the mean over steps 2-4 (step 1 and step 5 also cross-score, and step 5
validates), the median over repeats. It needs git and the repository's history (a clone, not an
archive). Not named bench_*.py, so run_all.py leaves it out: it builds two warm starts (minutes).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = (2, 3, 4)


def export(commit, folder):
    """The commit's files in `folder`."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", commit], capture_output=True)
    if archive.returncode:
        sys.exit(f"error: git archive {commit}: {archive.stderr.decode().strip()}")
    os.makedirs(folder)
    subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)


def seconds_per_step(code, env, out, cache):
    """Mean time_step over STEPS of one main-command run of the code in `code`."""
    cmd = [sys.executable, "train.py", "--env", env, "--filter", "topp", "--steps", "5",
           "--out", out, "--tiny-cache", cache, "--no-plot"]
    run = subprocess.run(cmd, cwd=code, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"})
    if run.returncode:
        sys.exit(f"error: {' '.join(cmd)} in {code} failed:\n{run.stderr[-2000:]}")
    for line in run.stdout.splitlines():  # the first run of each version builds its warm start
        if line.startswith("warm start built in"):
            print(f"  {line} ({os.path.basename(code)})", flush=True)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        times = {m["step"]: m["time_step"] for m in map(json.loads, f) if "time_step" in m}
    return statistics.mean(times[s] for s in STEPS)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("commit", help="the earlier commit (e.g. 1acd888)")
    p.add_argument("--env", default="sokoban", choices=("sokoban", "frozenlake"))
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = os.path.join(tmp, "old")
        export(a.commit, old)
        times = {"old": [], "new": []}
        for r in range(a.repeats):
            for name, code in (("old", old), ("new", ROOT)):
                t = seconds_per_step(code, a.env, os.path.join(tmp, f"{name}-{r}"),
                                     os.path.join(tmp, f"cache-{name}"))
                times[name].append(t)
                print(f"repeat {r}: {name:3s} {t:6.2f} s a step (steps 2-4)", flush=True)
    old_s, new_s = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"{a.env}, main command: {a.commit} {old_s:.2f} s a step, this code {new_s:.2f} s: "
          f"{old_s / new_s:.2f}x faster")
    print(f"RESULT commit {old_s / new_s:.3f}")


if __name__ == "__main__":
    main()
