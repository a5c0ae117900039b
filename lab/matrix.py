"""The paper's main table in miniature (grids.py: main-table): its follow-up rule -- which cells
get the random control -- and its report laid out as the paper's matrix, the paper's numbers
beside ours.

A cell is a world and an algorithm. Its deciding comparison is Top-P's gain in validation
success at the last step over no filter, paired by seed, with its 95% t interval: a "paired" rule
that names its `cell` (report.decide). The follow-up rule, registered with the grid before any
run: for every cell whose interval excludes 0 -- a verdict of "holds" or "contradicted" -- a
random subset of Top-P's count is its control (the grid main-table-control, which runs those
cells only: experiments.run), decided by its own paired rule, Top-P minus the random subset at
the same step. A cell whose interval holds 0 gets no control: there is no gain to explain.

The paper's cells are a success rate (%) and, in brackets, Top-P's change over no filter (a
FrozenLake cell of 16.0 (+53.5) can only read so); ours are shown alike: no filter's validation
success and Top-P's gain with its interval's half-width, in percentage points.
"""
from lab.stats import by_seed, interval, value_at

EXCLUDES_ZERO = ("holds", "contradicted")  # report.side's verdicts of an interval off 0


def selected(rules, decisions):
    """The cells whose deciding rule's interval excludes 0, in the rules' order: the cells the
    follow-up rule gives a control."""
    return [rule["cell"] for rule, d in zip(rules, decisions)
            if rule.get("cell") and d["verdict"] in EXCLUDES_ZERO]


def followup(rule, rules, decisions):
    """The follow-up rule's row: which cells get the random control (estimate: how many)."""
    cells = selected(rules, decisions)
    decided = [d for r, d in zip(rules, decisions) if r.get("cell") and d["n"]]
    verdict = ("not run" if not decided else
               f"control to run ({rule['grid']}): {', '.join(cells)}" if cells else
               "no cell's interval excludes 0: no control to run")
    return {"rule": rule["text"], "estimate": len(cells), "low": None, "high": None,
            "n": len(decided), "verdict": verdict, "values": " ".join(cells)}


def section(g, rules, decisions, data):
    """table.md's matrix: one row an algorithm, one column a world; the paper's cell beside ours."""
    worlds, step = g["matrix"]["worlds"], g["steps"]
    lines = ["", "## The paper's matrix beside ours", "",
             f"Each cell: no filter's validation success and, in brackets, Top-P's change over it, "
             f"in percentage points; ours at step {step} over the seeds, the change paired by seed "
             f"± the half-width of its 95% t interval; the paper's: {g['matrix']['source']}.", "",
             "| algorithm | " + " | ".join(g["matrix"]["columns"][w] for w in worlds) + " |",
             "|---|" + "---|" * len(worlds)]
    found = {rule["cell"]: d for rule, d in zip(rules, decisions) if rule.get("cell")}
    for algo, paper in g["matrix"]["paper"].items():
        cells = []
        for world, (base, gain) in zip(worlds, paper):
            none = by_seed({key: value_at(r, "val_success", step) for key, r in data.items()
                            if key[0] == f"{world}-{algo}-none"})
            ours = cell_text(interval(none)[0], found.get(f"{world}-{algo}", {}))
            cells.append(f"{ours}; paper {base:.1f} ({gain:+.1f})")
        lines.append(f"| {algo} | " + " | ".join(cells) + " |")
    return lines


def cell_text(none_mean, decision):
    """Our cell: no filter's mean success and Top-P's paired change (± its half-width), in
    percentage points; "-" before any run.

    >>> cell_text(0.25, {"estimate": 0.05, "low": 0.01, "high": 0.09}), cell_text(None, {})
    ('25.0 (+5.0 ± 4.0)', '-')
    """
    if none_mean is None:
        return "-"
    gain = decision.get("estimate")
    if gain is None:
        return f"{100 * none_mean:.1f}"
    half = "" if decision.get("low") is None else f" ± {100 * (decision['high'] - gain):.1f}"
    return f"{100 * none_mean:.1f} ({100 * gain:+.1f}{half})"
