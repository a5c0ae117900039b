"""The paper's training-curve figures, drawn from the metrics.jsonl of one or several run folders.

A new top-level file because reading logs back is a concept of its own: train.py writes one JSON object per step,
this file turns those into PNGs, overlaying runs (for example Top-P filtering against no filtering):

    success.png      train success and validation success per step              (RAGEN-2 Fig. 7 / 11d)
    collapse.png     MI z-score and retrieval accuracy next to the entropies    (Fig. 6, 9, 13: MI moves, entropy does not)
    filter.png       kept ratio and zero-variance group fraction                (Fig. 11a-b)
    length.png       response length per turn                                   (Fig. 8)

    python plots.py runs/sokoban-ppo-topp-* runs/sokoban-ppo-none-*        # PNGs into the first run folder
    python plots.py RUN [RUN ...] --out figures/
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no screen needed
import matplotlib.pyplot as plt  # noqa: E402

FIGURES = {
    "success": [("train_success", "train success"), ("val_success", "validation success")],
    "collapse": [("mi_zscore", "MI z-score"), ("retrieval_acc", "retrieval accuracy"),
                 ("conditional_entropy", "conditional entropy H(Z|X) (nats/token)"),
                 ("reasoning_entropy", "reasoning entropy H(Z) (nats/token)")],
    "filter": [("kept_ratio", "kept ratio (groups)"), ("zero_var_frac", "zero-variance group fraction")],
    "length": [("response_length", "response length (tokens per turn)")],
}


def read_metrics(run_dir):
    """The list of per-step records of a run; a half-written last line (a killed run) is skipped, not fatal."""
    records = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def series(records, key):
    """(steps, values) of the records that hold `key` (diagnostics and validation are not logged every step)."""
    pairs = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_runs(run_dirs, out_dir, labels=None):
    """Write one PNG per figure of FIGURES into out_dir, every run overlaid; returns the paths written."""
    labels = labels or [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    runs = [(label, read_metrics(d)) for label, d in zip(labels, run_dirs)]
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, panels in FIGURES.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
        for ax, (key, title) in zip(axes[0], panels):
            for label, records in runs:
                steps, values = series(records, key)
                if steps:
                    ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=label)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description="Plot the paper's training curves from run folders.")
    parser.add_argument("runs", nargs="+", help="run folders holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="folder for the PNGs (default: the first run folder)")
    args = parser.parse_args(argv)
    missing = [d for d in args.runs if not os.path.isfile(os.path.join(d, "metrics.jsonl"))]
    if missing:
        print(f"error: no metrics.jsonl in {', '.join(missing)}", file=sys.stderr)
        return 2
    for path in plot_runs(args.runs, args.out or args.runs[0]):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
