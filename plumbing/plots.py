"""The paper's training-curve figures, drawn from the metrics.jsonl of one or several run folders.

train.py writes one JSON object per step; this file turns those into PNGs. Runs given the same label
(several seeds of one setting) are drawn as their mean with a band of +- one standard error; runs
with their own labels are overlaid in distinct styles.

    success.png   train success (smoothed over 5 steps), validation success from step 0 (Fig. 7)
    collapse.png  what healthy and collapsed reasoning look like (Fig. 1, 6, 8): the MI estimate
                  under its log N ceiling, retrieval accuracy over its chance level, H(Z) and
                  H(Z|X) (the MI is the gap between them), and the policy's token entropy -- what
                  entropy monitoring alone would see
    filter.png    kept ratio and zero-variance group fraction (Fig. 11a-b)
    length.png    response length per turn (Fig. 8)
    gradients.png with --grad-decomp-every: Fig. 4 as the paper draws it -- per reward-spread
                  bucket Q1 (lowest) .. Q6, the task and the regulariser (KL + entropy) gradient
                  norms as bars and the bucket's reward spread as a line, the mean over the run's
                  decompositions

    python -m plumbing.plots runs/topp                 # PNGs into the run folder (train.py writes them too)
    python -m plumbing.plots runs/topp runs/none       # an overlay: PNGs into runs/topp+none, printed
    python -m plumbing.plots RUN [RUN ...] --out figures/
"""

import json
import math
import os
import sys

if not __package__:  # run as a file (python plumbing/plots.py): imports from the root, as with -m
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import matplotlib

matplotlib.use("Agg")  # files only, no screen needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from plumbing.flags import Parser, UsageError  # noqa: E402

# figure -> panels: (keys drawn, title, y label, y range: (low, high) or None for automatic)
FIGURES = {
    "success": [
        (["train_success"], "train success (5-step mean)", "success rate", (0, 1.02)),
        (["val_success"], "validation success (step 0: before RL)", "success rate", (0, 1.02)),
    ],
    "collapse": [
        (["mi_estimate"], "MI estimate I(X;Z)  (dotted: log N ceiling)", "nats per token", "mi"),
        (
            ["retrieval_acc"],
            "retrieval accuracy  (dotted: chance)",
            "fraction retrieved",
            (0, 1.02),
        ),
        (
            ["reasoning_entropy", "conditional_entropy"],
            "H(Z) solid, H(Z|X) dashed",
            "nats per token",
            "zero",
        ),
        (["token_entropy"], "policy token entropy", "nats per token", "zero"),
    ],
    "filter": [
        (["kept_ratio"], "kept ratio (groups)", "fraction of groups", (0, 1.02)),
        (["zero_var_frac"], "zero-variance groups", "fraction of groups", (0, 1.02)),
    ],
    "length": [(["response_length"], "response length", "tokens per turn", "zero")],
}
REFERENCE = {"mi_estimate": "mi_upper_bound", "retrieval_acc": "retrieval_chance"}  # dotted lines
# why a panel can be empty: what the runs did not log, and the flag (a train.py setting) that
# turns it off -- named only where the runs have that flag (scaleout.trl_ragen never validates)
NO_DATA = {"val_success": ("no validation in these runs", "val_every"),
           "mi_estimate": ("no MI diagnosis in these runs", "mi_every"),
           "retrieval_acc": ("no MI diagnosis in these runs", "mi_every"),
           "reasoning_entropy": ("no MI diagnosis in these runs", "mi_every"),
           "token_entropy": ("no update in these runs (every step skipped)", None)}
# what a logged key is called in a figure, its unit after it; probe_<key> is <key> on the probe set
LABELS = {"train_success": "train success", "val_success": "validation success",
          "mi_estimate": "MI estimate (nats/token)", "mi_seq_estimate": "MI estimate (nats/reasoning)",
          "work_mi_seq_estimate": "MI of the work (nats/reasoning)",
          "retrieval_acc": "retrieval accuracy", "work_retrieval_acc": "retrieval of the work",
          "reasoning_entropy": "H(Z) (nats/token)", "reasoning_entropy_seq": "H(Z) (nats/reasoning)",
          "conditional_entropy": "H(Z|X) (nats/token)",
          "conditional_entropy_seq": "H(Z|X) (nats/reasoning)",
          "action_mi": "I(Z;A|X) (nats)", "token_entropy": "token entropy (nats/token)",
          "template_share": "template share", "grounded_share": "grounded share",
          "kept_ratio": "kept ratio (groups)", "zero_var_frac": "zero-spread groups",
          "zero_var_fail_frac": "zero-spread groups, all failed",
          "optimizer_steps_total": "optimiser steps so far", "response_length": "tokens per turn"}
SMOOTH = {"train_success": 5}
STYLES = ["-", "--", "-.", ":"]
MARKERS = ["o", "s", "^", "D", "v", "P"]


def metric_label(key):
    """A logged key as a figure names it (LABELS; else its words).

    >>> metric_label("probe_mi_seq_estimate")
    'MI estimate, probe set (nats/reasoning)'
    >>> metric_label("val_success"), metric_label("mean_score_kept")
    ('validation success', 'mean score kept')
    """
    probe = key.startswith("probe_")
    name = key[len("probe_"):] if probe else key
    text = LABELS.get(name, name.replace("_", " "))
    if probe:
        head, unit = text.split(" (", 1) if " (" in text else (text, None)
        text = f"{head}, probe set" + (f" ({unit}" if unit else "")
    return text


def read_metrics(run_dir):
    """The list of per-step records of a run (read_jsonl of its metrics.jsonl)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return read_jsonl(f)


def read_jsonl(lines):
    """Records from JSON lines; a half-written line (a killed writer's last) is skipped, not
    fatal. experiments.py reads its gzipped archives with it too."""
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def series(records, key, smooth=1):
    """(steps, values) of the records that hold `key` (diagnostics and validation are not logged
    every step); smooth > 1 averages each value with the smooth - 1 before it.

    >>> series([{"step": 1, "a": 1.0}, {"step": 2}, {"step": 3, "a": 3.0}], "a", smooth=2)
    ([1, 3], [1.0, 2.0])
    """
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    steps, values = [p[0] for p in pairs], [p[1] for p in pairs]
    if smooth > 1:
        values = [
            sum(values[max(0, i - smooth + 1) : i + 1])
            / len(values[max(0, i - smooth + 1) : i + 1])
            for i in range(len(values))
        ]
    return steps, values


def mean_and_se(runs, key, smooth=1):
    """Over runs (lists of records), at the steps every run logged `key`: (steps, means, standard
    errors).

    >>> mean_and_se([[{"step": 1, "a": 1.0}], [{"step": 1, "a": 3.0}]], "a")
    ([1], [2.0], [1.0])
    """
    per_run = [dict(zip(*series(r, key, smooth))) for r in runs]
    steps = sorted(set.intersection(*(set(d) for d in per_run))) if per_run else []
    means, ses = [], []
    for s in steps:
        xs = [d[s] for d in per_run]
        m = sum(xs) / len(xs)
        sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
        means.append(m)
        ses.append(sd / math.sqrt(len(xs)))
    return steps, means, ses


def draw_panel(ax, groups, keys, title, ylabel, yrange, settings=None, span=None):
    """One panel: every label's mean (+- SE band when it holds several runs) for each key,
    references dotted; a panel without data says why (naming the flag that turns the key off
    when every run's config.json, `settings`, has it; None: no config to tell). The step axis
    spans `span` (first, last) when given, the figure's runs' whole range, at least one step
    wide: one point alone would get ticks of fractional steps around it."""
    top, drawn = 0.0, False
    for i, (label, runs) in enumerate(groups.items()):
        color = f"C{i % 10}"
        for k, key in enumerate(keys):
            steps, means, ses = mean_and_se(runs, key, SMOOTH.get(key, 1))
            if not steps:
                continue
            drawn = True
            style = STYLES[k] if len(keys) > 1 else STYLES[i % len(STYLES)]
            ax.plot(
                steps,
                means,
                style,
                color=color,
                marker=MARKERS[i % len(MARKERS)] if len(steps) < 40 else None,
                markersize=3,
                label=label if k == 0 else None,
                alpha=0.9,
            )
            if len(runs) > 1:
                ax.fill_between(
                    steps,
                    [m - s for m, s in zip(means, ses)],
                    [m + s for m, s in zip(means, ses)],
                    color=color,
                    alpha=0.15,
                    linewidth=0,
                )
            top = max(top, max(m + s for m, s in zip(means, ses)))
            if key in REFERENCE:
                ref_steps, refs, _ = mean_and_se(runs, REFERENCE[key])
                if ref_steps:
                    ax.plot(ref_steps, refs, ":", color=color, linewidth=1)
                    top = max(top, max(refs))
    if not drawn:
        why, flag = NO_DATA.get(keys[0], (f"no {keys[0]} in these runs", None))
        if flag and (settings is None or flag in settings):
            why += f" (--{flag.replace('_', '-')} 0)"
        ax.text(0.5, 0.5, why.replace(" (", "\n("), ha="center", va="center",
                transform=ax.transAxes, fontsize=8, color="0.4")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if span is not None:
        first, last = span[0], max(span[1], span[0] + 1)
        pad = 0.04 * (last - first)
        ax.set_xlim(first - pad, last + pad)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if isinstance(yrange, tuple):
        ax.set_ylim(*yrange)
    elif top > 0:  # "zero" and "mi": from 0, so small noise does not look like a trend
        ax.set_ylim(0, 1.1 * top)
    ax.grid(alpha=0.3)


def plot_runs(run_dirs, out_dir, labels=None, figures=FIGURES, title=None):
    """One PNG per figure into out_dir, titled with the runs drawn (`title`, else their folders);
    runs sharing a label are averaged. Returns the paths written."""
    labels = labels or [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    groups = {}
    for label, d in zip(labels, run_dirs):
        groups.setdefault(label, []).append(read_metrics(d))
    every = [r["step"] for runs in groups.values() for records in runs for r in records
             if isinstance(r.get("step"), (int, float))]
    span = (min(every), max(every)) if every else None
    settings = run_settings(run_dirs)
    title = title or run_title(run_dirs)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, panels in figures.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(4.0 * len(panels), 3.3), squeeze=False)
        for ax, panel in zip(axes[0], panels):
            draw_panel(ax, groups, *panel, settings=settings, span=span)
        labelled = [ax for ax in axes[0] if ax.get_legend_handles_labels()[0]]
        if labelled:
            labelled[0].legend(fontsize=7)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    gradients = plot_gradients(groups, out_dir, title)
    return paths + ([gradients] if gradients else [])


def bucket_means(decompositions):
    """Fig. 4's numbers from several gradient decompositions (each a list of bucket dicts,
    lowest spread first, as train.py logs them): per bucket the mean of mean_std, task_grad_norm
    and reg_grad_norm -> [{"mean_std", "task_grad_norm", "reg_grad_norm"}], as many buckets as the
    fewest any decomposition has.

    >>> bucket_means([[{"mean_std": 0., "task_grad_norm": 1., "reg_grad_norm": 2.}],
    ...               [{"mean_std": 1., "task_grad_norm": 3., "reg_grad_norm": 2.}]])
    [{'mean_std': 0.5, 'task_grad_norm': 2.0, 'reg_grad_norm': 2.0}]
    """
    n = min(len(d) for d in decompositions)
    keys = ("mean_std", "task_grad_norm", "reg_grad_norm")
    return [{k: sum(d[b][k] for d in decompositions) / len(decompositions) for k in keys}
            for b in range(n)]


def draw_buckets(ax, buckets, title, errors=None):
    """Fig. 4 on one axis: per bucket Q1.. the task and regulariser gradient norms as bars
    (`errors`: their half-widths, [{"task_grad_norm", "reg_grad_norm"}]), the reward spread as a
    line on its own axis."""
    x = range(len(buckets))
    for i, (key, label) in enumerate((("task_grad_norm", "task gradient"),
                                      ("reg_grad_norm", "regulariser gradient (KL + entropy)"))):
        ax.bar([j + (i - 0.5) * 0.38 for j in x], [b[key] for b in buckets], width=0.38,
               label=label, yerr=None if errors is None else [e[key] for e in errors],
               capsize=2, color=("tab:blue", "tab:orange")[i])
    ax.set_xticks(list(x), [f"Q{j + 1}" for j in x])
    ax.set_xlabel("reward-spread bucket (Q1 lowest)")
    tallest = [max(b[k] for b in buckets) for k in ("task_grad_norm", "reg_grad_norm")]
    if min(tallest) > 0 and max(tallest) > 20 * min(tallest):  # one would be invisible
        ax.set_yscale("log")
    ax.set_ylabel("gradient norm" + (" (log scale)" if ax.get_yscale() == "log" else ""))
    ax.set_title(title, fontsize=9)
    spread = ax.twinx()
    spread.plot(list(x), [b["mean_std"] for b in buckets], "k.-", label="reward std")
    spread.set_ylabel("mean reward std of the bucket")
    spread.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()[0] + spread.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="upper left")


def plot_gradients(groups, out_dir, title=""):
    """gradients.png: Fig. 4 for each label of `groups` ({label: [records of a run]}) whose runs
    logged a gradient decomposition, titled `title`; None when none did."""
    drawn = {label: [r["grad_decomposition"] for records in runs for r in records
                     if r.get("grad_decomposition")] for label, runs in groups.items()}
    drawn = {label: d for label, d in drawn.items() if d}
    if not drawn:
        return None
    fig, axes = plt.subplots(1, len(drawn), figsize=(5.0 * len(drawn), 3.6), squeeze=False)
    for ax, (label, decompositions) in zip(axes[0], drawn.items()):
        draw_buckets(ax, bucket_means(decompositions),
                     f"{label}: Fig. 4, mean of {len(decompositions)} decompositions")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, "gradients.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_settings(run_dirs):
    """The settings (config.json's keys) that every one of the runs has, or None where a run has
    no readable config.json (a log alone says nothing of its flags)."""
    found = []
    for d in run_dirs:
        try:
            with open(os.path.join(d, "config.json")) as f:
                config = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict):
            return None
        found.append(set(config))
    return set.intersection(*found) if found else None


def run_title(run_dirs, most=100):
    """A figure's title: the run folders drawn, as given, shortened past `most` characters.

    >>> run_title(["runs/topp", "runs/none/"])
    'runs/topp, runs/none'
    >>> run_title([f"runs/seed{i}" for i in range(20)], most=30)
    'runs/seed0 and 19 more runs'
    """
    names = [os.path.normpath(d) for d in run_dirs]
    joined = ", ".join(names)
    return joined if len(joined) <= most else f"{names[0]} and {len(names) - 1} more runs"


def overlay_folder(run_dirs):
    """Where an overlay of several runs goes by default: a new folder beside the first run, named
    after the runs, so that no run's own figures are replaced.

    >>> overlay_folder(["runs/topp", "runs/none/"])
    'runs/topp+none'
    """
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    name = "+".join(names) if len("+".join(names)) <= 100 else f"{names[0]}+{len(names) - 1}-more"
    return os.path.join(os.path.dirname(os.path.normpath(run_dirs[0])), name)


def main(argv=None):
    parser = Parser(description="Plot the paper's training curves from run folders.")
    parser.add_argument("runs", nargs="+", help="run folders holding metrics.jsonl")
    parser.add_argument(
        "--out", default=None, help="folder for the PNGs (default: the run folder for one run; "
        "for several, a new folder beside the first, named after them: A+B)"
    )
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    missing = [d for d in args.runs if not os.path.isfile(os.path.join(d, "metrics.jsonl"))]
    if missing:
        print(f"error: no metrics.jsonl in {', '.join(missing)}", file=sys.stderr)
        return 2
    empty = [d for d in args.runs if not read_metrics(d)]
    if empty:  # nothing to draw: blank figures would look like a run that logged nothing
        logs = ", ".join(os.path.join(d, "metrics.jsonl") for d in empty)
        print(f"error: no step records in {logs} (empty or damaged; python train.py --resume RUN "
              f"restores a run's log from its checkpoint)", file=sys.stderr)
        return 2
    out = args.out or (args.runs[0] if len(args.runs) == 1 else overlay_folder(args.runs))
    refused = refuse_out(out, args.runs)
    if refused:
        print(f"error: --out {out}: {refused}", file=sys.stderr)
        return 2
    try:
        paths = plot_runs(args.runs, out)
    except OSError as e:
        print(f"error: --out {out}: cannot write there ({e.strerror or e})", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def refuse_out(out, run_dirs):
    """Why the figures of `run_dirs` may not go into `out`, or None: a file, or the folder of a
    run other than the one drawn (an overlay never goes into a run's folder: it would replace
    that run's own figures)."""
    if os.path.exists(out) and not os.path.isdir(out):
        return "a file is there, not a folder"
    own = len(run_dirs) == 1 and os.path.isdir(out) and os.path.samefile(out, run_dirs[0])
    if not own and any(os.path.isfile(os.path.join(out, f)) for f in ("metrics.jsonl",
                                                                       "config.json")):
        return ("the folder of a run, whose own figures these would replace; choose another "
                "folder (or none: an overlay goes to a new one named after the runs)")
    return None


if __name__ == "__main__":
    sys.exit(main())
