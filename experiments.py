"""The paper's figures in miniature: named grids of train.py runs (settings x seeds), run side by
side and resumable, summarised into results/<grid>/ as tables (mean and standard error over seeds)
and figures.

A new top-level file because it is a concept of its own: each grid below is one claim of RAGEN-2,
with its exact train.py flags, fixed before its runs. Run folders go to
runs/experiments/<grid>/<setting>-s<seed> (not committed); a finished run is never run again, an
interrupted one is resumed (train.py --resume). Every grid runs the tiny policy, on a GPU machine
too: its settings (the entropy bonus of the collapse grid) were chosen for it.

    python experiments.py list                  # the grids, their claims and sizes
    python experiments.py run filters --jobs 2  # run what is missing (1 thread each), summarise
    python experiments.py summarize filters     # tables and figures from the runs that exist
    python experiments.py correlations collapse filters   # Sec. 5.1: MI / entropy vs success

Table metrics are averaged over a window of steps ending at each table step (WINDOW; validation and
diagnosis are taken at the step itself), then over seeds: mean +- standard error (sample std /
sqrt(seeds)).
"""
import argparse
import csv
import math
import os
import random
import subprocess
import sys
import time

import plots

ROOT = os.path.dirname(os.path.abspath(__file__))
RUNS = os.path.join("runs", "experiments")
RESULTS = "results"
MAX_SKIPS = 5  # train.MAX_SKIPS (not imported: experiments.py stays light)
WINDOW = 10  # per-step metrics in a table are the mean of the WINDOW steps ending at the table step
COMMON = ["--model", "tiny", "--mi-every", "5", "--val-every", "10", "--threads", "1", "--no-plot"]
FILTERS = {"none": ["--filter", "none"], "topp": ["--filter", "topp"], "topk": ["--filter", "topk"]}

# ---------------------------------------------------------------------------------------- the grids

GRIDS = {
    "pilot": dict(
        claim="Not a claim: the search for a collapse regime (FrozenLake, PPO, no filter, one "
              "seed, 60 steps). The official sweep's entropy coefficients 0.01, 0.03 and 0.1 moved "
              "nothing; 0.3 and 1.0 let the entropy bonus take over: entropy exploded, MI, "
              "retrieval and success fell. The collapse grid uses 0.3, the smaller of the two.",
        flags=["--env", "frozenlake", "--filter", "none"],
        settings={f"ent{c}": ["--entropy-coef", c] for c in ("0.01", "0.03", "0.1", "0.3", "1.0")},
        seeds=[0], steps=60, table_steps=[0, 20, 40, 60]),
    "collapse": dict(
        claim="Sec. 2 and 3, Fig. 6 / 8: when a regulariser that does not shrink with reward "
              "spread (here an entropy bonus of 0.3, the pilot's) drives the update, the reasoning "
              "loses its input dependence (MI and retrieval fall) while its entropy rises; the "
              "paper's remedy, Top-P or Top-K filtering, keeps the update on the groups with "
              "spread.",
        flags=["--env", "frozenlake", "--entropy-coef", "0.3", "--grad-decomp-every", "20"],
        settings=FILTERS, seeds=[0, 1, 2], steps=80, table_steps=[0, 20, 40, 60, 80]),
    "filters": dict(
        claim="Sec. 4.3, Fig. 7 / 11: Top-P and Top-K against no filter in the default regime "
              "(entropy 0.001): success, kept ratio, zero-spread groups and the compute of a step.",
        flags=["--env", "frozenlake", "--grad-decomp-every", "25"],
        settings=FILTERS, seeds=[0, 1, 2], steps=100, table_steps=[0, 25, 50, 100]),
    "sokoban": dict(
        claim="The main command's world: Top-P and Top-K against no filter on Sokoban, default "
              "settings.",
        flags=["--env", "sokoban"],
        settings=FILTERS, seeds=[0, 1, 2], steps=50, table_steps=[0, 25, 50]),
    "stochasticity": dict(
        claim="Sec. 5.2, Fig. 10: FrozenLake's slip rate raises reward noise; no filter against "
              "Top-P as moves go their way with probability 1, 0.6 and 1/3.",
        flags=["--env", "frozenlake"],
        settings={f"{f}-sr{sr}": ["--filter", f, "--success-rate", sr]
                  for sr in ("1.0", "0.6", "0.3333") for f in ("none", "topp")},
        seeds=[0, 1, 2], steps=60, table_steps=[0, 30, 60]),
}
METRICS = ["val_success", "train_success", "mi_estimate", "retrieval_acc", "reasoning_entropy",
           "conditional_entropy", "token_entropy", "kept_ratio", "num_zero_var", "response_length",
           "time_step"]
AT_THE_STEP = ("val_success", "mi_estimate", "retrieval_acc", "reasoning_entropy",
               "conditional_entropy")  # logged every 5 or 10 steps: taken at the step, not averaged


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


def finished(folder, steps):
    """The run did its steps, or train.py stopped it: MAX_SKIPS steps in a row without spread."""
    path = os.path.join(folder, "metrics.jsonl")
    records = plots.read_metrics(folder) if os.path.isfile(path) else []
    records = [r for r in records if r.get("step")]
    stopped = len(records) >= MAX_SKIPS and all(r.get("skipped") for r in records[-MAX_SKIPS:])
    return stopped or any(r["step"] == steps for r in records)


# ------------------------------------------------------------------------------------------ running

def run(name, jobs):
    """Every run of the grid that has not finished, `jobs` processes at a time; then the summary."""
    todo = [r for r in runs_of(name) if not finished(r[2], GRIDS[name]["steps"])]
    print(f"{name}: {len(runs_of(name)) - len(todo)} runs finished, {len(todo)} to go, {jobs} at "
          f"a time")
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
            minutes = (time.time() - started) / 60
            print(f"  {folder}: exit {process.returncode} ({minutes:.1f} min)", flush=True)
    summarize(name)


# ---------------------------------------------------------------------------------------- summaries

def value_at(records, key, step):
    """A metric at a table step: validation and diagnosis at the step itself (the nearest diagnosis
    within 5 steps before it), every other metric the mean of the WINDOW steps ending there; None
    when nothing was logged."""
    window = 5 if key in AT_THE_STEP else WINDOW
    exact = [r[key] for r in records if r.get("step") == step and key in r]
    if key in AT_THE_STEP and (exact or key == "val_success"):
        return exact[-1] if exact else None
    values = [r[key] for r in records if step - window < r.get("step", -1) <= step and key in r]
    return sum(values) / len(values) if values else None


def mean_se(xs):
    """(mean, standard error, count) of the values that are not None; SE is nan for one value."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None, 0
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, math.nan, len(xs)
    se = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))
    return m, se, len(xs)


def summarize(name):
    """results/<name>/table.md and table.csv (mean +- SE over seeds at the table steps) and the
    figures of plots.py, seeds of a setting averaged."""
    g = GRIDS[name]
    out = os.path.join(RESULTS, name)
    os.makedirs(out, exist_ok=True)
    done = [(s, folder) for s, _, folder, _ in runs_of(name)
            if os.path.isfile(os.path.join(folder, "metrics.jsonl"))]
    rows = []
    for setting in g["settings"]:
        folders = [f for s, f in done if s == setting]
        records = [plots.read_metrics(f) for f in folders]
        complete = sum(finished(f, g["steps"]) for f in folders)
        for step in g["table_steps"]:
            row = {"setting": setting, "step": step, "runs": len(folders), "finished": complete}
            for key in METRICS:
                row[key], row[key + "_se"], _ = mean_se([value_at(r, key, step) for r in records])
            rows.append(row)
    with open(os.path.join(out, "table.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(f"# {name}\n\n{g['claim']}\n\nFlags: `{' '.join(g['flags'] + COMMON)}`; seeds "
                f"{g['seeds']}; {g['steps']} steps. Mean +- standard error over seeds; per-step "
                f"metrics averaged over the {WINDOW} steps ending at the step.\n\n")
        f.write("| setting | step | runs (finished) | " + " | ".join(METRICS) + " |\n")
        f.write("|---|---|---|" + "---|" * len(METRICS) + "\n")
        for row in rows:
            cells = " | ".join(fmt(row[k], row[k + "_se"]) for k in METRICS)
            f.write(f"| {row['setting']} | {row['step']} | {row['runs']} ({row['finished']}) | "
                    f"{cells} |\n")
    if done:
        plots.plot_runs([f for _, f in done], out, labels=[s for s, _ in done])
    print(f"wrote {out}/table.md, table.csv and figures ({len(done)} runs)")
    return rows


def fmt(m, se):
    if m is None:
        return "-"
    return f"{m:.3f}" if se is None or math.isnan(se) else f"{m:.3f} +- {se:.3f}"


# ----------------------------------------------------------------------------------------- Sec. 5.1

DIAGNOSTICS = ["mi_zscore_ema", "mi_estimate", "retrieval_acc", "conditional_entropy",
               "reasoning_entropy", "token_entropy"]


def correlations(names, resamples=2000, seed=0):
    """Spearman correlation of each diagnostic with validation success over every (run, step) where
    both were logged, across the grids' runs, with a 95% interval from resampling whole runs (the
    steps of one run are not independent). Writes results/correlations/table.md and scatter.png."""
    from scipy.stats import spearmanr

    points = {}  # run folder -> [(that step's record, its validation success)]
    for name in names:
        for _, _, folder, _ in runs_of(name):
            if os.path.isfile(os.path.join(folder, "metrics.jsonl")):
                by_step = {}
                for r in plots.read_metrics(folder):
                    by_step.setdefault(r["step"], {}).update(r)
                points[folder] = [(r, r["val_success"]) for _, r in sorted(by_step.items())
                                  if "val_success" in r and "mi_estimate" in r]
    folders = [f for f in points if points[f]]
    rng = random.Random(seed)
    rows = []
    for key in DIAGNOSTICS:
        def rho(chosen):
            pairs = [(p[0][key], p[1]) for f in chosen for p in points[f] if key in p[0]]
            xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
            if len(set(xs)) < 2 or len(set(ys)) < 2:
                return math.nan  # a constant ranks nothing
            return spearmanr(xs, ys).statistic

        resampled = (rho([rng.choice(folders) for _ in folders]) for _ in range(resamples))
        boot = sorted(r for r in resampled if not math.isnan(r))
        low, high = (boot[int(0.025 * len(boot))], boot[int(0.975 * len(boot)) - 1]) if boot else (
            None, None)
        n = sum(key in p[0] for f in folders for p in points[f])
        rows.append((key, rho(folders), low, high, n))
    out = os.path.join(RESULTS, "correlations")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(f"# Spearman correlation with validation success\n\nGrids: {', '.join(names)}; "
                f"{len(folders)} runs; points: every step with both a diagnosis and a validation. "
                f"95% interval: {resamples} resamples of whole runs.\n\n"
                f"| diagnostic | Spearman rho | 95% interval | points |\n|---|---|---|---|\n")
        for key, r, low, high, n in rows:
            interval = f"{low:.3f} .. {high:.3f}" if low is not None else "-"
            f.write(f"| {key} | {r:.3f} | {interval} | {n} |\n")
    scatter(points, out)
    print(f"wrote {out}/table.md and scatter.png ({len(folders)} runs)")
    return rows


def scatter(points, out):
    import matplotlib.pyplot as plt

    keys = ["mi_zscore_ema", "mi_estimate", "conditional_entropy", "token_entropy"]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.3), squeeze=False)
    for ax, key in zip(axes[0], keys):
        pairs = [(p[0][key], p[1]) for ps in points.values() for p in ps if key in p[0]]
        ax.scatter([x for x, _ in pairs], [y for _, y in pairs], s=8, alpha=0.5)
        ax.set_xlabel(key)
        ax.set_ylabel("validation success")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "scatter.png"), dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------- command line

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("list", "run", "summarize", "correlations"))
    parser.add_argument("grids", nargs="*", help=f"grid names: {', '.join(GRIDS)}")
    parser.add_argument("--jobs", type=int, default=2, help="train.py processes at a time")
    args = parser.parse_args(argv)
    unknown = [g for g in args.grids if g not in GRIDS]
    if unknown:
        print(f"error: unknown grid {unknown[0]!r}; valid: {', '.join(GRIDS)}", file=sys.stderr)
        return 2
    if args.command == "list":
        for name, g in GRIDS.items():
            print(f"{name}: {len(g['settings']) * len(g['seeds'])} runs x {g['steps']} steps. "
                  f"{g['claim']}")
    elif args.command == "correlations":
        correlations(args.grids or [g for g in GRIDS if g != "pilot"])
    else:
        for name in args.grids:
            run(name, args.jobs) if args.command == "run" else summarize(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
