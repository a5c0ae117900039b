"""The paper's claims in miniature, as named grids of train.py runs (settings x seeds), each written
down with its decision rule before it runs, run side by side and resumable, and reported from
compact per-run logs committed under results/<grid>/runs/.

A new top-level file because it is a concept of its own: each grid below is one claim of RAGEN-2
(or a search for a regime, said to be one), with its exact train.py flags, seeds, steps and the
comparisons that decide it. Run folders go to runs/experiments/<grid>/<setting>-s<seed> (not
committed); a finished run is never run again, an interrupted one is resumed (train.py --resume).
When a run's process ends, its scalar metrics are copied, gzipped, to
results/<grid>/runs/<setting>-s<seed>.jsonl.gz; `report` reads nothing else. Every grid runs the
tiny policy, on a GPU machine too.

    python experiments.py list [GRID ...]        # the grids, their claims, rules and wall time
    python experiments.py run collapse-env --jobs 2   # run what is missing (1 thread each), report
    python experiments.py report collapse-env    # every table, figure and number from the logs

The report (results/<grid>/): table.md (means with 95% t intervals at n - 1 degrees of freedom over
seeds, the decision rules and their verdicts from paired differences over seeds, correlations
within runs and within worlds, pooled only as a footnote, and a lead-lag check), the same as csv
files and numbers.json, perseed.csv (each run's success, MI and entropies at the table's steps),
search.csv for the regime search (each run's numbers for its three criteria),
curves.png (against environment steps, optimiser steps and trajectories trained on),
perseed.png (each seed's MI and entropies) and scatter.png.
"""
import argparse
import csv
import gzip
import io
import json
import math
import os
import random
import subprocess
import sys
import time

from plots import read_jsonl

ROOT = os.path.dirname(os.path.abspath(__file__))
RUNS = os.path.join("runs", "experiments")
RESULTS = "results"
MAX_SKIPS = 5  # train.MAX_SKIPS (not imported: experiments.py stays light)
GROUP_SIZE = 16  # train.Args.group_size: trajectories a kept group contributes
WINDOW = 10  # per-step metrics in a table are the mean of the WINDOW steps ending at the table step
COMMON = ["--model", "tiny", "--mi-every", "5", "--val-every", "10", "--threads", "1", "--no-plot"]
FILTERS = {"none": ["--filter", "none"], "topp": ["--filter", "topp"], "topk": ["--filter", "topk"]}
CONTROLS = {"random": ["--filter", "random", "--control-of", "topk"],
            "bottom": ["--filter", "bottom", "--control-of", "topk"]}
SEEDS = [0, 1, 2, 3, 4]  # 5 seeds for every claim
# Wall-time model: seconds a training step of one run takes (one thread, two runs side by side on
# the 2-core machine; validation and diagnoses included), by world. Measured: collapse-env, 30 x
# 120 FrozenLake steps in 84 minutes (2.8 s); the main grid's first Sokoban runs, about 6 s. The
# larger Sokoban room is a guess.
SECONDS_PER_STEP = {"frozenlake": 3.0, "sokoban": 6.0, "sokoban-large": 8.0}

# ---------------------------------------------------------------------------------------- the grids
# Pre-registered: settings, seeds, steps and decision rules are fixed before the runs. A rule
# ("paired") compares a - b, paired over the seeds both have, at an environment step or at the
# validation whose cumulative optimiser steps are nearest a count; it holds when the 95% interval
# lies on the predicted side of 0, is contradicted on the other side, else undecided. "leadlag":
# the step at which `a` moves (falls / rises half-way) is before the step at which `b` does.
# "search": a single-seed run shows the regime (rule text says how).

COLLAPSE = ["--env", "frozenlake", "--entropy-coef", "0.3"]
GRIDS = {
    # Estimate: 30 runs x 120 steps x 5 s / 2 at a time = 2.5 h (less: runs that lose all spread
    # stop early).
    "collapse-env": dict(
        claim="Sec. 2-3: with a regulariser that does not shrink with reward spread driving the "
              "update (an entropy bonus of 0.3 on FrozenLake: no filter lost its success by step "
              "60 before), Top-K / Top-P hold collapse off -- and not only because a filtered "
              "update takes fewer optimiser steps (2 for Top-K 0.5 against 4, at 32 trajectories "
              "a mini-batch): equal environment steps here, 120 steps so that Top-K reaches the "
              "240 optimiser steps no filter took to collapse; random and bottom keep Top-K's "
              "count.",
        flags=COLLAPSE, world="frozenlake",
        settings={**FILTERS, "topp-softmax-zero": ["--filter", "topp", "--filter-prob-mode",
                                                   "softmax", "--include-zero"], **CONTROLS},
        seeds=SEEDS, steps=120, table_steps=[0, 20, 40, 60, 80, 100, 120],
        decide=[
            dict(kind="paired", metric="val_success", a=("topk", "step", 60),
                 b=("none", "step", 60), sign=1,
                 text="Top-K beats no filter at step 60 (equal environment steps)"),
            dict(kind="paired", metric="val_success", a=("topk", "step", 60),
                 b=("random", "step", 60), sign=1,
                 text="Top-K beats a random subset of the same size at step 60: the choice of "
                      "groups matters, not only their number"),
            dict(kind="paired", metric="val_success", a=("topk", "optimizer_steps", 240),
                 b=("none", "optimizer_steps", 240), sign=1,
                 text="Top-K beats no filter at 240 optimiser steps (no filter's step 60)"),
            dict(kind="paired", metric="val_success", a=("bottom", "optimizer_steps", 240),
                 b=("none", "optimizer_steps", 240), sign=-1,
                 text="the lowest-spread groups do worse than no filter at equal optimiser "
                      "steps (the mechanism's prediction)"),
            dict(kind="paired", metric="val_success", a=("topp", "step", 60),
                 b=("none", "step", 60), sign=1, text="Top-P (linear) beats no filter at step 60"),
            dict(kind="paired", metric="probe_mi_estimate", a=("none", "step", 60),
                 b=("none", "step", 1), sign=-1,
                 text="without a filter the probe-set MI falls from step 1 to step 60"),
            dict(kind="leadlag", setting="none", a="probe_mi_estimate", b="val_success", sign=1,
                 text="the probe-set MI falls before success does (no filter)"),
            dict(kind="leadlag", setting="none", a="probe_mi_estimate",
                 b="probe_conditional_entropy", sign=1,
                 text="the probe-set MI falls before H(Z|X) rises (no filter)"),
        ]),
    # Estimate: 20 runs x 80 steps x 5 s / 2 = 1.1 h. No filter is not rerun: with 128 kept rows
    # --optimizer-steps 4 is exactly the default split (tests/test_train.py), so its runs are
    # collapse-env's.
    "collapse-opt": dict(
        claim="The collapse grid at equal optimiser steps: every update takes 4 optimiser steps "
              "(--optimizer-steps 4, no filter's count) whatever it keeps.",
        flags=COLLAPSE + ["--optimizer-steps", "4"], world="frozenlake",
        settings={"topk": FILTERS["topk"], "topp": FILTERS["topp"], **CONTROLS},
        seeds=SEEDS, steps=80, table_steps=[0, 20, 40, 60, 80],
        decide=[
            dict(kind="paired", metric="val_success", a=("topk", "step", 60),
                 b=("collapse-env/none", "step", 60), sign=1,
                 text="Top-K beats no filter at equal optimiser steps (step 60: 240 each)"),
            dict(kind="paired", metric="val_success", a=("topk", "step", 60),
                 b=("random", "step", 60), sign=1,
                 text="Top-K beats a random subset of the same size at equal optimiser steps"),
            dict(kind="paired", metric="val_success", a=("bottom", "step", 60),
                 b=("collapse-env/none", "step", 60), sign=-1,
                 text="the lowest-spread groups do worse than no filter"),
            dict(kind="paired", metric="val_success", a=("topp", "step", 60),
                 b=("collapse-env/none", "step", 60), sign=1,
                 text="Top-P beats no filter at equal optimiser steps"),
        ]),
    # Estimate: 2 x 200 x 8 s + 200 x 10 s + 2 x 200 x 5 s = 2.0 run-hours, 1.0 h at 2 at a time,
    # plus a warm start for each of the 3 new worlds (about 3 minutes each).
    "regime": dict(
        claim="A search, not a claim: is there a collapse regime at the official coefficients "
              "(entropy 0.001, a KL term k3 at the analysis runs' 0.001 and at 0.01) in worlds "
              "with many all-fail groups (two boxes, an 8x8 room; FrozenLake slipping 2/3 of "
              "moves), 200 steps, no filter, one seed each?",
        flags=["--entropy-coef", "0.001", "--filter", "none"], world=None,
        settings={
            "sokoban-2box-kl0.001": ["--env", "sokoban", "--num-boxes", "2", "--kl-coef", "0.001"],
            "sokoban-2box-kl0.01": ["--env", "sokoban", "--num-boxes", "2", "--kl-coef", "0.01"],
            "sokoban-8x8-kl0.001": ["--env", "sokoban", "--room-size", "8", "--kl-coef", "0.001"],
            "frozenlake-sr0.33-kl0.001": ["--env", "frozenlake", "--success-rate", "0.3333",
                                          "--kl-coef", "0.001"],
            "frozenlake-sr0.33-kl0.01": ["--env", "frozenlake", "--success-rate", "0.3333",
                                         "--kl-coef", "0.01"]},
        seeds=[0], steps=200, table_steps=[0, 50, 100, 150, 200],
        seconds={"sokoban-2box-kl0.001": 8.0, "sokoban-2box-kl0.01": 8.0,
                 "sokoban-8x8-kl0.001": SECONDS_PER_STEP["sokoban-large"]},
        decide=[dict(kind="search", text=(
            "a setting is a collapse regime when its run (1) had many all-fail groups "
            "(zero_var_fail_frac averaged over the run >= 0.5), (2) lost input dependence (the "
            "mean probe-set MI of the last two diagnoses <= half its step-1 value) and (3) lost "
            "success (the last validation >= 0.1 below the run's best). If one is found, a 5-seed "
            "none / Top-P / Top-K / random grid in it is the next pre-registration; if none is, "
            "that is the result: no collapse at the official coefficients in 200 steps."))]),
    # Estimate: 10 runs x 40 steps x 5 s / 2 = 0.3 h (a decomposition every 5 steps included).
    "gradients": dict(
        claim="Sec. 3, Fig. 4: the task gradient of a bucket of prompts grows with its reward "
              "spread and the regulariser's (entropy bonus + KL to the initial policy) does not, "
              "so where spread is low the regulariser drives the update. FrozenLake, no filter, "
              "the 8 groups of a step in 6 spread buckets, a decomposition every 5 steps; with the "
              "collapse grids' entropy bonus of 0.3, and at the official coefficients (entropy "
              "0.001, KL 0.001). Without a KL term in training the KL gradient is measured at "
              "0.001.",
        flags=["--env", "frozenlake", "--filter", "none", "--grad-decomp-every", "5"],
        world="frozenlake",
        settings={"entropy0.3": ["--entropy-coef", "0.3"],
                  "official": ["--entropy-coef", "0.001", "--kl-coef", "0.001"]},
        seeds=SEEDS, steps=40, table_steps=[0, 20, 40],
        decide=[
            dict(kind="gradients", setting=setting, stat="rho_task_minus_reg", sign=1,
                 text=f"{label}: the task gradient's norm rises with the bucket's reward spread "
                      f"more than the regulariser's (Spearman over the run's decompositions)")
            for setting, label in (("entropy0.3", "entropy bonus 0.3"),
                                   ("official", "official coefficients"))] + [
            dict(kind="gradients", setting="entropy0.3", stat="reg_share_low", sign=1,
                 text="entropy bonus 0.3: on the lowest-spread bucket with any spread the "
                      "regulariser's gradient is larger than the task's (its share of the two "
                      "norms minus 1/2)"),
            dict(kind="gradients", setting="official", stat="reg_share_high", sign=-1,
                 text="official coefficients: on the highest-spread bucket the task gradient is "
                      "larger than the regulariser's (its share of the two norms minus 1/2)")]),
    # Estimate: 20 runs x 50 steps x 8 s / 2 = 1.1 h.
    "main": dict(
        claim="The main command's world (Sokoban, default settings): Top-P and Top-K against no "
              "filter and a random subset of Top-P's size, 50 steps.",
        flags=["--env", "sokoban"], world="sokoban",
        settings={**FILTERS, "random": ["--filter", "random", "--control-of", "topp"]},
        seeds=SEEDS, steps=50, table_steps=[0, 10, 20, 30, 40, 50],
        decide=[
            dict(kind="paired", metric="val_success", a=("topp", "step", 50),
                 b=("none", "step", 50), sign=1, text="Top-P beats no filter at step 50"),
            dict(kind="paired", metric="val_success", a=("topp", "step", 50),
                 b=("random", "step", 50), sign=1,
                 text="Top-P beats a random subset of its size at step 50"),
            dict(kind="paired", metric="val_success", a=("topk", "step", 50),
                 b=("none", "step", 50), sign=1, text="Top-K beats no filter at step 50"),
        ]),
}
# Whole programme: 2.5 + 1.1 + 1.0 (+ 0.15 warm starts) + 0.3 + 1.1 = about 6.2 h of the 2-core
# machine (gradients was added after collapse-env had run, before its own runs).
# Cut to fit: no filter is not rerun at equal optimiser steps; the softmax Top-P variant only at
# equal environment steps; the regime search has one seed and two KL values; the main world runs
# 50 of the main command's 100 steps. The earlier 3-seed grids (on the tiny policy before its
# tokenizer changed, with no decision rules and no committed per-run logs) are not kept.

METRICS = ["val_success", "train_success", "probe_mi_estimate", "probe_retrieval_acc",
           "probe_reasoning_entropy", "probe_conditional_entropy", "probe_action_mi",
           "mi_estimate", "token_entropy", "kept_ratio", "zero_var_success_frac",
           "zero_var_fail_frac", "optimizer_steps_total", "trajectories_total"]
AT_THE_STEP = ("val_success", "mi_estimate", "retrieval_acc", "reasoning_entropy",
               "conditional_entropy", "probe_", "optimizer_steps_total", "trajectories_total")
BUCKET = ["mean_std", "task_grad_norm", "kl_grad_norm", "entropy_grad_norm", "reg_grad_norm"]
DIAGNOSTICS = ["probe_mi_estimate", "probe_retrieval_acc", "probe_reasoning_entropy",
               "probe_conditional_entropy", "probe_action_mi", "mi_estimate", "token_entropy"]
PHASE = ["probe_mi_estimate", "probe_reasoning_entropy", "probe_conditional_entropy",
         "token_entropy"]  # the MI-versus-entropy phase, run by run
MOVES = {"probe_mi_estimate": (-1, 0.1), "val_success": (-1, 0.2),  # direction, least change
         "probe_conditional_entropy": (1, 0.1), "token_entropy": (1, 0.1)}


def runs_of(name):
    """[(setting, seed, folder, argv)] of a grid: every setting x seed, with its train.py flags."""
    g = GRIDS[name]
    out = []
    for setting, flags in g["settings"].items():
        for seed in g["seeds"]:
            folder = os.path.join(RUNS, name, f"{setting}-s{seed}")
            argv = g["flags"] + flags + COMMON + ["--seed", str(seed), "--steps", str(g["steps"]),
                                                 "--out", folder]
            out.append((setting, seed, folder, argv))
    return out


def estimate_hours(name, jobs=2):
    """The grid's wall-time estimate: steps x SECONDS_PER_STEP of its world, `jobs` at a time."""
    g = GRIDS[name]
    total = 0.0
    for setting, _, _, argv in runs_of(name):
        world = argv[argv.index("--env") + 1] if "--env" in argv else "sokoban"
        total += g["steps"] * g.get("seconds", {}).get(setting, SECONDS_PER_STEP[world])
    return total / jobs / 3600


def finished(folder, steps):
    """The run did its steps, or train.py stopped it: MAX_SKIPS steps in a row without spread."""
    path = os.path.join(folder, "metrics.jsonl")
    records = read_jsonl(open(path)) if os.path.isfile(path) else []
    return done(records, steps)


def done(records, steps):
    records = [r for r in records if r.get("step")]
    stopped = len(records) >= MAX_SKIPS and all(r.get("skipped") for r in records[-MAX_SKIPS:])
    return stopped or any(r["step"] == steps for r in records)


# ------------------------------------------------------------------------------------------ running

def run(name, jobs):
    """Every run of the grid that has not finished, `jobs` processes at a time; each run's log is
    archived when its process ends (finished or not); then the report."""
    todo = [r for r in runs_of(name) if not finished(r[2], GRIDS[name]["steps"])]
    print(f"{name}: {len(runs_of(name)) - len(todo)} runs finished, {len(todo)} to go, {jobs} at "
          f"a time (estimate {estimate_hours(name, jobs):.1f} h for the whole grid)")
    started, running = time.time(), []
    while todo or running:
        while todo and len(running) < jobs:
            setting, seed, folder, argv = todo.pop(0)
            resume = os.path.isfile(os.path.join(folder, "config.json"))
            flags = ["--resume", folder, "--steps", str(GRIDS[name]["steps"])] if resume else argv
            os.makedirs(os.path.dirname(folder), exist_ok=True)
            log = open(folder + ".log", "a")
            process = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py")] + flags,
                                       stdout=log, stderr=subprocess.STDOUT)
            running.append((folder, process, log))
            print(f"  {'resuming' if resume else 'starting'} {folder}", flush=True)
        time.sleep(2)
        for item in [r for r in running if r[1].poll() is not None]:
            folder, process, log = item
            log.close()
            running.remove(item)
            archive(folder, name)
            minutes = (time.time() - started) / 60
            print(f"  {folder}: exit {process.returncode} ({minutes:.1f} min into this call)",
                  flush=True)
    for _, _, folder, _ in runs_of(name):  # runs finished by an earlier call, archived again
        archive(folder, name)
    report(name)


def archive(folder, name, results=RESULTS):
    """A run's metrics.jsonl, every scalar metric and the gradient decomposition's BUCKET numbers,
    floats to 6 significant digits, gzipped without a time stamp
    (the same log gives the same bytes) to results/<grid>/runs/<run>.jsonl.gz, written atomically.
    No log: nothing."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    lines = []
    for r in read_jsonl(open(path)):
        kept = {k: six_digits(v) for k, v in r.items() if not isinstance(v, (list, dict))}
        if "grad_decomposition" in r:
            kept["grad_decomposition"] = [{k: six_digits(b[k]) for k in BUCKET}
                                          for b in r["grad_decomposition"]]
        lines.append(json.dumps(kept) + "\n")
    out = os.path.join(results, name, "runs", os.path.basename(folder) + ".jsonl.gz")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, filename="") as f:
        f.write("".join(lines).encode())
    with open(out + ".tmp", "wb") as f:
        f.write(buffer.getvalue())
    os.replace(out + ".tmp", out)
    return out


def six_digits(v):
    return float(f"{v:.6g}") if isinstance(v, float) else v


def load(name, results=RESULTS):
    """{(setting, seed): records} from the grid's archived logs, each record with the cumulative
    optimiser steps and trajectories trained on up to its step."""
    out = {}
    for setting, seed, folder, argv in runs_of(name):
        path = os.path.join(results, name, "runs", os.path.basename(folder) + ".jsonl.gz")
        if not os.path.isfile(path):
            continue
        with gzip.open(path, "rt") as f:
            records = read_jsonl(f)
        K = int(argv[argv.index("--group-size") + 1]) if "--group-size" in argv else GROUP_SIZE
        opt = trajectories = 0
        for r in sorted(records, key=lambda r: r["step"]):
            opt += r.get("optimizer_steps", 0) if not r.get("skipped") else 0
            trajectories += r.get("num_kept", 0) * K if not r.get("skipped") else 0
            r["optimizer_steps_total"], r["trajectories_total"] = opt, trajectories
        out[(setting, seed)] = records
    return out


# ------------------------------------------------------------------------------------- statistics

def interval(xs):
    """(mean, half-width of the 95% t interval at n - 1 degrees of freedom, n) of the values that
    are not None; the half-width is nan for one value."""
    from scipy.stats import t

    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None, 0
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, math.nan, 1
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    return m, t.ppf(0.975, len(xs) - 1) * sd / math.sqrt(len(xs)), len(xs)


def value_at(records, key, step):
    """A metric at a table step: validation, diagnoses and cumulative counts at the step itself,
    every other metric the mean of the WINDOW steps ending there; None when nothing was logged."""
    if key.startswith(AT_THE_STEP):
        exact = [r[key] for r in records if r.get("step") == step and key in r]
        return exact[-1] if exact else None
    values = [r[key] for r in records if step - WINDOW < r.get("step", -1) <= step and key in r]
    return sum(values) / len(values) if values else None


def value_on(records, key, axis, point):
    """`key` at an environment step (axis "step"), or at the logged step whose cumulative optimiser
    steps are nearest `point` (axis "optimizer_steps"; ties to the earlier step)."""
    if axis == "step":
        return value_at(records, key, point)
    logged = [r for r in records if key in r]
    if not logged:
        return None
    return min(logged, key=lambda r: (abs(r["optimizer_steps_total"] - point), r["step"]))[key]


def event_step(records, key):
    """The step at which a series moves half-way from its first value to its extreme in the
    direction MOVES gives (fall or rise), or None when it moves less than MOVES' least change."""
    direction, least = MOVES[key]
    points = [(r["step"], r[key]) for r in sorted(records, key=lambda r: r["step"]) if key in r]
    if len(points) < 2:
        return None
    start = points[0][1]
    extreme = (min if direction < 0 else max)(v for _, v in points)
    if abs(extreme - start) < least:
        return None
    half = start + (extreme - start) / 2
    return next(s for s, v in points if (v - half) * direction >= 0)


def spearman(xs, ys):
    """Spearman's rho: the Pearson correlation of the (tie-averaged) ranks. Written out rather than
    scipy.stats.spearmanr because the bootstrap calls it thousands of times and that one's input
    checks cost more than the arithmetic."""
    import numpy as np
    from scipy.stats import rankdata

    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None  # a constant ranks nothing
    return float(np.corrcoef(rankdata(xs), rankdata(ys))[0, 1])


# ----------------------------------------------------------------------------------------- decisions

def decide(name, data, rule, results=RESULTS):
    """One rule's row: what it compares, the estimate with its 95% interval, n, the verdict."""
    if rule["kind"] == "search":
        return search(name, data, rule)
    if rule["kind"] == "gradients":
        diffs = [gradient_stat(records, rule["stat"])
                 for (setting, _), records in sorted(data.items()) if setting == rule["setting"]]
    elif rule["kind"] == "leadlag":
        lags = []
        for (setting, _), records in sorted(data.items()):
            if setting == rule["setting"]:
                ta, tb = event_step(records, rule["a"]), event_step(records, rule["b"])
                lags.append(tb - ta if ta is not None and tb is not None else None)
        diffs = lags
    else:
        sides = []
        for setting, axis, point in (rule["a"], rule["b"]):
            source = load(setting.split("/")[0], results) if "/" in setting else data
            setting = setting.split("/")[-1]
            sides.append({seed: value_on(r, rule["metric"], axis, point)
                          for (s, seed), r in source.items() if s == setting})
        a, b = sides
        diffs = [a[s] - b[s] for s in sorted(set(a) & set(b))
                 if a[s] is not None and b[s] is not None]
    m, half, n = interval(diffs)
    if n < 2:
        verdict = "not run" if n == 0 else "one seed: undecided"
    elif (m - half) * rule["sign"] > 0 and (m + half) * rule["sign"] > 0:
        verdict = "holds"
    elif (m - half) * rule["sign"] < 0 and (m + half) * rule["sign"] < 0:
        verdict = "contradicted"
    else:
        verdict = "undecided"
    return {"rule": rule["text"], "estimate": m, "low": None if m is None else m - half,
            "high": None if m is None else m + half, "n": n, "verdict": verdict}


def gradient_stat(records, stat):
    """One run's Fig. 4 statistic over its gradient decompositions (None without any):
    rho_task_minus_reg: Spearman(bucket spread, task norm) - Spearman(spread, regulariser norm),
    every bucket of every decomposition a point (a constant ranks nothing: 0);
    reg_share_low / reg_share_high: on the lowest / highest-spread bucket that has any spread (a
    bucket without has no task gradient at all: there the regulariser is all there is), the mean
    over decompositions of reg / (reg + task) - 1/2, > 0 where the regulariser's gradient is
    larger."""
    decompositions = [r["grad_decomposition"] for r in records if r.get("grad_decomposition")]
    if not decompositions:
        return None
    if stat == "rho_task_minus_reg":
        points = [b for d in decompositions for b in d]
        spread = [b["mean_std"] for b in points]
        task, reg = ([b[k] for b in points] for k in ("task_grad_norm", "reg_grad_norm"))
        return (spearman(spread, task) or 0.0) - (spearman(spread, reg) or 0.0)
    with_spread = [[b for b in d if b["mean_std"] > 0] for d in decompositions]
    picked = [d[0 if stat == "reg_share_low" else -1] for d in with_spread if d]
    pairs = [(b["reg_grad_norm"], b["task_grad_norm"]) for b in picked]
    shares = [reg / (reg + task) - 0.5 for reg, task in pairs if reg + task > 0]
    return sum(shares) / len(shares) if shares else None


def gradient_table(name, data):
    """Fig. 4 in numbers: per setting and spread bucket, each BUCKET number's mean over a run's
    decompositions, then over runs with its 95% t interval."""
    rows = []
    for setting in GRIDS[name]["settings"]:
        runs = [[r["grad_decomposition"] for r in records if r.get("grad_decomposition")]
                for (s, _), records in sorted(data.items()) if s == setting]
        runs = [d for d in runs if d]
        for bucket in range(max((len(d[0]) for d in runs), default=0)):
            row = {"setting": setting, "bucket": bucket + 1, "runs": len(runs)}
            for key in BUCKET:
                m, half, _ = interval([sum(x[bucket][key] for x in d) / len(d) for d in runs])
                row[key], row[key + "_ci95"] = m, half
            rows.append(row)
    return rows


def search(name, data, rule):
    """The regime search's rule, run by run: which settings showed a collapse regime."""
    runs = search_criteria(data)
    found = [f"{r['setting']}-s{r['seed']}" for r in runs if r["regime"]]
    verdict = ("not run" if not runs else
               f"regime found: {', '.join(found)}" if found else "no regime found")
    return {"rule": rule["text"], "estimate": len(found), "low": None, "high": None,
            "n": len(runs), "verdict": verdict}


def search_criteria(data):
    """Each run's numbers for the regime search's three criteria, and the mean train success (how
    often its rollouts failed, whatever their rewards' spread) -> rows. A zero-spread group is
    all-fail only if its failing rollouts got equal rewards."""
    rows = []
    for (setting, seed), records in sorted(data.items()):
        records = sorted(records, key=lambda r: r["step"])
        probes = [r["probe_mi_estimate"] for r in records if "probe_mi_estimate" in r]
        vals = [r["val_success"] for r in records if "val_success" in r]
        fails = [r["zero_var_fail_frac"] for r in records if "zero_var_fail_frac" in r]
        train = [r["train_success"] for r in records if "train_success" in r]
        if len(probes) < 3 or not vals or not fails:
            continue
        row = {"setting": setting, "seed": seed, "zero_var_fail_frac": sum(fails) / len(fails),
               "probe_mi_first": probes[0], "probe_mi_last_two": sum(probes[-2:]) / 2,
               "val_best": max(vals), "val_last": vals[-1],
               "train_success": sum(train) / len(train)}
        row["regime"] = (row["zero_var_fail_frac"] >= 0.5
                         and row["probe_mi_last_two"] <= row["probe_mi_first"] / 2
                         and row["val_last"] <= row["val_best"] - 0.1)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------- the report

def report(name, results=RESULTS, with_figures=True):
    """Every table, figure and number of the grid from results/<grid>/runs/ alone."""
    g = GRIDS[name]
    data = load(name, results)
    out = os.path.join(results, name)
    if not data:
        print(f"{name}: no archived runs in {out}/runs: nothing to report")
        return None
    rows = []
    for setting in g["settings"]:
        runs = [r for (s, _), r in sorted(data.items()) if s == setting]
        complete = sum(done(r, g["steps"]) for r in runs)
        for step in g["table_steps"]:
            row = {"setting": setting, "step": step, "runs": len(runs), "finished": complete}
            for key in METRICS:
                m, half, _ = interval([value_at(r, key, step) for r in runs])
                row[key], row[key + "_ci95"] = m, half
            rows.append(row)
    decisions = [decide(name, data, rule, results) for rule in g["decide"]]
    within, world_rows = correlations(name, data)
    leads = leadlag(data)
    gradients = gradient_table(name, data)
    searched = search_criteria(data) if any(r["kind"] == "search" for r in g["decide"]) else []
    write_csv(os.path.join(out, "table.csv"), rows)
    write_csv(os.path.join(out, "decisions.csv"), decisions)
    write_csv(os.path.join(out, "correlations.csv"), within + world_rows)
    write_csv(os.path.join(out, "leadlag.csv"), leads)
    write_csv(os.path.join(out, "perseed.csv"), [
        {"setting": setting, "seed": seed, "step": step,
         **{k: value_at(data[setting, seed], k, step) for k in ["val_success"] + PHASE}}
        for setting in g["settings"] for seed in g["seeds"] if (setting, seed) in data
        for step in g["table_steps"]])
    numbers = {"decisions": decisions, "correlations": within + world_rows, "leadlag": leads}
    if gradients:
        write_csv(os.path.join(out, "gradients.csv"), gradients)
        numbers["gradients"] = gradients
    if searched:
        write_csv(os.path.join(out, "search.csv"), searched)
        numbers["search"] = searched
    with open(os.path.join(out, "numbers.json"), "w") as f:
        json.dump(rounded(numbers), f, indent=1, sort_keys=True)
        f.write("\n")
    write_markdown(name, out, rows, decisions, within, world_rows, leads, gradients,
                   searched)
    if with_figures:
        figures(name, data, out)
    print(f"wrote {out}/table.md, csv files, numbers.json{' and figures' if with_figures else ''} "
          f"({len(data)} runs)")
    return rows


def world_of(name, setting):
    """The world a setting runs in: its env flags (a grid's `world`, else from the flags)."""
    if GRIDS[name].get("world"):
        return GRIDS[name]["world"]
    flags = GRIDS[name]["flags"] + GRIDS[name]["settings"][setting]
    names = ("--env", "--num-boxes", "--room-size", "--success-rate", "--lake-size")
    return " ".join(f"{flags[i]} {flags[i + 1]}" for i in range(len(flags) - 1)
                    if flags[i] in names)


def correlations(name, data, resamples=1000, seed=0):
    """Spearman correlation of each diagnostic with validation success, at the steps with both:
    within each run (mean over runs with a 95% t interval), within each world (all its runs'
    points, 95% interval from resampling whole runs), and, in a grid of several worlds, pooled
    over them (a footnote: worlds differ in both)."""
    points = {}  # (setting, seed) -> [record with val_success]
    for key, records in data.items():
        by_step = {}
        for r in records:
            by_step.setdefault(r["step"], {}).update(r)
        points[key] = [r for _, r in sorted(by_step.items()) if "val_success" in r]
    worlds = {}
    for key in points:
        worlds.setdefault(world_of(name, key[0]), []).append(key)
    within, world_rows = [], []
    rng = random.Random(seed)
    for diagnostic in DIAGNOSTICS:
        def rho(keys):
            pairs = [(r[diagnostic], r["val_success"]) for k in keys for r in points[k]
                     if diagnostic in r]
            return spearman([x for x, _ in pairs], [y for _, y in pairs])

        per_run = [rho([k]) for k in sorted(points)]
        m, half, n = interval(per_run)
        within.append({"scope": "within runs", "world": "each", "diagnostic": diagnostic,
                       "rho": m, "low": None if m is None else m - half,
                       "high": None if m is None else m + half, "n": n})
        pooled = [("pooled (footnote)", sorted(points))] if len(worlds) > 1 else []
        for world, keys in sorted(worlds.items()) + pooled:
            boot = sorted(r for r in (rho([rng.choice(keys) for _ in keys])
                                      for _ in range(resamples)) if r is not None)
            low, high = (boot[int(0.025 * len(boot))], boot[int(0.975 * len(boot)) - 1]) if (
                boot) else (None, None)
            world_rows.append({"scope": "within world" if world in worlds else "pooled",
                               "world": world, "diagnostic": diagnostic, "rho": rho(keys),
                               "low": low, "high": high, "n": len(keys)})
    return within, world_rows


def leadlag(data):
    """Per run: the step at which the probe MI falls, success falls, H(Z|X) and token entropy rise
    (event_step); resolution: diagnoses every 5 steps, validation every 10."""
    rows = []
    for (setting, seed), records in sorted(data.items()):
        row = {"setting": setting, "seed": seed}
        for key in MOVES:
            row[key] = event_step(records, key)
        rows.append(row)
    return rows


def rounded(x):
    if isinstance(x, float):
        return None if math.isnan(x) else round(x, 4)
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v) for v in x]
    return x


def write_csv(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", newline="") as f:
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows(rounded(rows))


def fmt(m, half=None):
    if m is None:
        return "-"
    if half is None or (isinstance(half, float) and math.isnan(half)):
        return f"{m:.3f}"
    return f"{m:.3f} ± {half:.3f}"


def write_markdown(name, out, rows, decisions, within, world_rows, leads, gradients,
                   searched=()):
    g = GRIDS[name]
    shown = ["val_success", "probe_mi_estimate", "probe_reasoning_entropy",
             "probe_conditional_entropy", "probe_action_mi", "token_entropy", "kept_ratio",
             "zero_var_fail_frac", "optimizer_steps_total"]
    lines = [f"# {name}", "", g["claim"], "",
             f"Flags: `{' '.join(g['flags'] + COMMON)}`; seeds {g['seeds']}; {g['steps']} steps. "
             f"Mean ± half-width of the 95% t interval over seeds (n - 1 degrees of freedom); "
             f"per-step metrics averaged over the {WINDOW} steps ending at the step. All columns: "
             f"table.csv.", "",
             "| setting | step | runs (finished) | " + " | ".join(shown) + " |",
             "|---|---|---|" + "---|" * len(shown)]
    for row in rows:
        cells = " | ".join(fmt(row[k], row[k + "_ci95"]) for k in shown)
        lines.append(f"| {row['setting']} | {row['step']} | {row['runs']} ({row['finished']}) | "
                     f"{cells} |")
    lines += ["", "## Decision rules (written before the runs)", "",
              "| rule | estimate (a - b) | 95% interval | n | verdict |", "|---|---|---|---|---|"]
    for d in decisions:
        span = f"{d['low']:.3f} .. {d['high']:.3f}" if d["low"] is not None and not math.isnan(
            d["low"]) else "-"
        lines.append(f"| {d['rule']} | {fmt(d['estimate'])} | {span} | {d['n']} | "
                     f"{d['verdict']} |")
    if searched:
        keys = ["zero_var_fail_frac", "probe_mi_first", "probe_mi_last_two", "val_best",
                "val_last", "train_success"]
        lines += ["", "The search's criteria, run by run (train_success: the run's mean, for how "
                      "often rollouts failed whatever their rewards' spread):", "",
                  "| setting | seed | " + " | ".join(keys) + " | regime |",
                  "|---|---|" + "---|" * (len(keys) + 1)]
        for r in searched:
            lines.append(f"| {r['setting']} | {r['seed']} | "
                         + " | ".join(fmt(r[k]) for k in keys) + f" | {r['regime']} |")
    lines += ["", "## Spearman correlation with validation success", "",
              "| scope | world | diagnostic | rho | 95% interval | n |", "|---|---|---|---|---|---|"]
    for c in within + [c for c in world_rows if c["scope"] != "pooled"]:
        span = f"{c['low']:.3f} .. {c['high']:.3f}" if c["low"] is not None and not math.isnan(
            c["low"]) else "-"
        lines.append(f"| {c['scope']} | {c['world']} | {c['diagnostic']} | {fmt(c['rho'])} | "
                     f"{span} | {c['n']} |")
    pooled = ", ".join(f"{c['diagnostic']} {fmt(c['rho'])}" for c in world_rows
                       if c["scope"] == "pooled")
    if pooled:  # only a grid of several worlds
        lines += ["", f"Footnote, pooled over worlds (worlds differ in both, so this mixes them): "
                      f"{pooled}."]
    least = ", ".join(f"{k} {v[1]}" for k, v in MOVES.items())
    lines += ["", "## Lead-lag: the step at which each series moves half-way", "",
              f"(-: the series moved less than its least change: {least}.)", "",
              "| setting | seed | " + " | ".join(MOVES) + " |", "|---|---|" + "---|" * len(MOVES)]
    for r in leads:
        lines.append(f"| {r['setting']} | {r['seed']} | " + " | ".join(
            "-" if r[k] is None else str(r[k]) for k in MOVES) + " |")
    if gradients:
        lines += ["", "## Gradient norms by reward-spread bucket (Fig. 4)", "",
                  "Buckets from the lowest spread (1) to the highest; each run's mean over its "
                  "decompositions, then the mean over runs ± the 95% t interval.", "",
                  "| setting | bucket | runs | " + " | ".join(BUCKET) + " |",
                  "|---|---|---|" + "---|" * len(BUCKET)]
        for g in gradients:  # norms span four decades: significant digits, not decimals
            cells = " | ".join(f"{g[k]:.3g} ± {g[k + '_ci95']:.2g}" for k in BUCKET)
            lines.append(f"| {g['setting']} | {g['bucket']} | {g['runs']} | {cells} |")
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def figures(name, data, out):
    """curves.png: validation success, probe MI, H(Z) and token entropy against environment steps,
    optimiser steps and trajectories trained on (each seed a thin line, the setting's mean over
    seeds a thick one against environment steps); perseed.png: every seed's probe MI, H(Z),
    H(Z|X) and token entropy, a row per setting; scatter.png: diagnostics against success."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(GRIDS[name]["settings"])
    colors = {s: plt.cm.tab10(i % 10) for i, s in enumerate(settings)}
    keys = ["val_success", "probe_mi_estimate", "probe_reasoning_entropy", "token_entropy"]
    axes_x = [("step", "environment steps"), ("optimizer_steps_total", "optimiser steps"),
              ("trajectories_total", "trajectories trained on")]
    fig, axes = plt.subplots(len(keys), len(axes_x), figsize=(13, 11), squeeze=False)
    for i, key in enumerate(keys):
        for j, (x, label) in enumerate(axes_x):
            ax = axes[i][j]
            for (setting, seed), records in sorted(data.items()):
                pts = [(r[x], r[key]) for r in sorted(records, key=lambda r: r["step"]) if key in r]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[setting], lw=0.6,
                        alpha=0.5)
            if x == "step":
                for setting in settings:
                    runs = [r for (s, _), r in data.items() if s == setting]
                    steps = sorted({r["step"] for rs in runs for r in rs if key in r})
                    means = [interval([value_at(rs, key, s) for rs in runs])[0] for s in steps]
                    ax.plot(steps, means, color=colors[setting], lw=2, label=setting)
            ax.set_xlabel(label)
            ax.set_ylabel(key)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "curves.png"), dpi=90)
    plt.close(fig)

    # the MI-versus-entropy phase: per seed, then as a scatter against success
    fig, axes = plt.subplots(len(settings), len(PHASE), figsize=(13, 2.6 * len(settings)),
                             squeeze=False)
    for i, setting in enumerate(settings):
        for j, key in enumerate(PHASE):
            ax = axes[i][j]
            for (s, seed), records in sorted(data.items()):
                if s == setting:
                    pts = [(r["step"], r[key]) for r in sorted(records, key=lambda r: r["step"])
                           if key in r]
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"seed {seed}")
            ax.set_title(f"{setting}: {key}", fontsize=8)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "perseed.png"), dpi=80)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(PHASE), figsize=(4 * len(PHASE), 3.3),
                             squeeze=False)
    worlds = sorted({world_of(name, s) for s, _ in data})
    for ax, key in zip(axes[0], PHASE):
        for w, world in enumerate(worlds):
            pairs = [(r[key], r["val_success"]) for (s, _), rs in data.items()
                     if world_of(name, s) == world for r in merged(rs)
                     if key in r and "val_success" in r]
            ax.scatter([x for x, _ in pairs], [y for _, y in pairs], s=8, alpha=0.5,
                       color=plt.cm.tab10(w % 10), label=world)
        ax.set_xlabel(key)
        ax.set_ylabel("validation success")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "scatter.png"), dpi=100)
    plt.close(fig)


def merged(records):
    by_step = {}
    for r in records:
        by_step.setdefault(r["step"], {}).update(r)
    return [r for _, r in sorted(by_step.items())]


# ------------------------------------------------------------------------------------- command line

def describe(name):
    g = GRIDS[name]
    lines = [f"{name}: {len(g['settings']) * len(g['seeds'])} runs x {g['steps']} steps, "
             f"about {estimate_hours(name):.1f} h on 2 cores (2 at a time). {g['claim']}"]
    lines += [f"  rule: {rule['text']}" for rule in g["decide"]]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="experiments.py", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("command", choices=("list", "run", "report"))
    parser.add_argument("grids", nargs="*", help=f"grid names: {', '.join(GRIDS)}")
    parser.add_argument("--jobs", type=int, default=2, help="train.py processes at a time")
    args = parser.parse_args(argv)
    unknown = [g for g in args.grids if g not in GRIDS]
    if unknown:
        print(f"error: unknown grid {unknown[0]!r}; valid: {', '.join(GRIDS)}", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print("error: --jobs must be >= 1", file=sys.stderr)
        return 2
    if args.command == "list":
        for name in args.grids or GRIDS:
            print(describe(name))
    else:
        for name in args.grids:
            run(name, args.jobs) if args.command == "run" else report(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
