"""The smollm2-templates report: does the diagnosis see a real model's templates? From the grid's
archives alone (results/smollm2-templates/runs/).

Each run is one SmolLM2 warm start -- taught a template on a share ALPHA of its turns, of kind
`pool` (the whole reasoning a sentence of the grammar) or `borrowed` (the cells copied from the
input, the way another layout's), one build a share -- diagnosed once at train.py's step 1 on 16
probe prompts x 8 samples; a run a sampling seed. A run's truth is its probe's exact grounded
share (probe_grounded_share, warmstart/grounding.py); for the pool family also the share of pool
sentences, counted on the logged reasonings (templates.is_template).

Per family (ALPHA = 0 in both): each dial's mean over the seeds at each ALPHA with its 95% t
interval; the Spearman of each dial with the grounded share over the family's (policy, seed)
points, its 95% interval from resampling the seeds within each share (the builds are fixed, one a
share: the interval holds the sampling's spread, not the spread between builds); the registered
rules (real_grids.real_template_rules), decided by those intervals:

    tracks   the Spearman interval lies above REAL_TRACKS (0.8)
    falls    the Spearman interval lies below the rule's threshold (against ALPHA where it says)
    level    the change of the mean from ALPHA 0 to ALPHA 1, over the ALPHA-0 mean, has its 95%
             Welch interval (5 seeds each) inside +-REAL_CHANGE (10%); the Spearman beside it
             (amended before the first diagnosis: grids.py)

holds where the interval lies wholly on the predicted side, contradicted where it lies wholly on
the other, else undecided.
"""
import random

from lab import report, stats
from lab.grids import GRIDS
from lab.protocol import ALPHAS, RESULTS
from lab.real_grids import REAL_CHANGE, REAL_DIALS, REAL_KINDS, REAL_TRACKS
from warmstart import templates

TRUTH = ["probe_grounded_share", "probe_flipped_share", "probe_borrowed_share",
         "probe_ungrounded_share", "probe_template_share", "probe_work_copied_share"]
SHOWN = ["probe_grounded_share", "probe_template_share", "probe_mi_seq_estimate",
         "probe_work_mi_seq_estimate", "probe_retrieval_acc", "probe_work_retrieval_acc",
         "probe_reasoning_entropy_seq", "probe_conditional_entropy_seq", "token_entropy"]
RESAMPLES = 1000


def family_of(setting):
    """(kinds the setting belongs to, its ALPHA): s0 is in both families."""
    if setting == "s0":
        return REAL_KINDS, 0.0
    kind, alpha = setting.rsplit("-s", 1)
    return (kind,), float(alpha)


def runs(data):
    """One row per archived run: its family membership, ALPHA, seed, the step-1 diagnosis and
    the truth."""
    rows = []
    for (setting, seed), records in sorted(data.items()):
        kinds, alpha = family_of(setting)
        step = {r["step"]: r for r in report.merged(records)}.get(1, {})
        reasonings = step.get("probe_reasonings") or []
        row = {"setting": setting, "alpha": alpha, "seed": seed, "kinds": kinds,
               **{k: step.get(k) for k in list(REAL_DIALS) + TRUTH if k in step}}
        row["probe_template_share"] = templates.template_share(reasonings, templates.COORDS_POOL)
        rows.append(row)
    return rows


def spearman_interval(rows, metric, against, seed=0):
    """(rho, low, high): Spearman of `metric` with `against` over the rows, and its 95%
    percentile interval from resampling, within each ALPHA, its rows with replacement."""
    rows = [r for r in rows if r.get(metric) is not None and r.get(against) is not None]
    rho = stats.spearman([r[against] for r in rows], [r[metric] for r in rows])
    by_alpha = {}
    for r in rows:
        by_alpha.setdefault(r["alpha"], []).append(r)
    if rho is None or len(by_alpha) < 3 or min(map(len, by_alpha.values())) < stats.MIN_RUNS:
        return rho, None, None
    rng, boot = random.Random(seed), []
    for _ in range(RESAMPLES):
        drawn = [rng.choice(group) for group in by_alpha.values() for _ in group]
        value = stats.spearman([r[against] for r in drawn], [r[metric] for r in drawn])
        if value is not None:
            boot.append(value)
    boot.sort()
    if not boot:
        return rho, None, None
    return rho, boot[int(0.025 * len(boot))], boot[int(0.975 * len(boot)) - 1]


def change_interval(rows, metric):
    """(change, low, high): the mean at ALPHA 1 less the mean at ALPHA 0, over the mean at 0,
    with its 95% Welch interval (the ALPHA-0 mean's own spread counted in the difference only)."""
    from scipy.stats import t

    ends = [[r[metric] for r in rows if r["alpha"] == a and r.get(metric) is not None]
            for a in (0.0, 1.0)]
    if min(map(len, ends)) < stats.MIN_RUNS:
        return None, None, None
    means = [sum(x) / len(x) for x in ends]
    variances = [sum((v - m) ** 2 for v in x) / (len(x) - 1) / len(x) for x, m in zip(ends, means)]
    se = sum(variances) ** 0.5
    df = se ** 4 / sum(v ** 2 / (len(x) - 1) for v, x in zip(variances, ends)) if se else 1
    half = t.ppf(0.975, df) * se
    scale = abs(means[0]) or 1.0
    change = (means[1] - means[0]) / scale
    return change, change - half / scale, change + half / scale


def verdict(kind, low, high, threshold=None):
    """holds / contradicted / undecided of an interval against a rule of `kind` (for level: the
    interval of the relative change)."""
    if low is None:
        return "undecided"
    if kind == "tracks":
        return "holds" if low > REAL_TRACKS else "contradicted" if high < REAL_TRACKS else \
            "undecided"
    if kind == "level":
        inside = -REAL_CHANGE < low and high < REAL_CHANGE
        outside = low > REAL_CHANGE or high < -REAL_CHANGE
        return "holds" if inside else "contradicted" if outside else "undecided"
    return "holds" if high < threshold else "contradicted" if low > threshold else "undecided"


def decide(rule, rows, decisions):
    """A registered rule's verdict, with the Spearman and its interval it rests on."""
    if rule["kind"] == "verdict":
        def held(kind, metric, family):
            return next((d["verdict"] for d in decisions if d.get("metric") == metric
                         and d.get("family") == family and d["kind"] == kind), "undecided")
        needed = [held("tracks", "probe_work_mi_estimate", k) for k in REAL_KINDS]
        needed.append(held("level", "probe_mi_estimate", "borrowed"))
        out = ("holds" if all(v == "holds" for v in needed) else
               "contradicted" if "contradicted" in needed else "undecided")
        return {"kind": "verdict", "text": rule["text"], "verdict": out}
    mine = [r for r in rows if rule["family"] in r["kinds"]]
    against = "alpha" if rule.get("against") == "alpha" else "probe_grounded_share"
    rho, low, high = spearman_interval(mine, rule["metric"], against)
    out = {"kind": rule["kind"], "family": rule["family"], "metric": rule["metric"],
           "against": against, "rho": rho, "low": low, "high": high, "runs": len(mine),
           "verdict": verdict(rule["kind"], low, high, rule.get("threshold")),
           "text": rule["text"]}
    if rule["kind"] == "level":
        out["change"], out["change_low"], out["change_high"] = change_interval(mine,
                                                                               rule["metric"])
        out["verdict"] = verdict("level", out["change_low"], out["change_high"])
    return out


def summary(rows):
    """Per family and ALPHA: each shown and truth metric's mean over the seeds, with its 95% t
    interval."""
    out = []
    for kind in REAL_KINDS:
        for alpha in ALPHAS:
            group = [r for r in rows if kind in r["kinds"] and r["alpha"] == alpha]
            if not group:
                continue
            row = {"family": kind, "alpha": alpha, "runs": len(group)}
            for key in dict.fromkeys(TRUTH + SHOWN + list(REAL_DIALS)):
                row[key], row[key + "_ci95"], _ = stats.interval([r.get(key) for r in group])
            out.append(row)
    return out


def dials(rows):
    """Per family, every dial's Spearman with the grounded share and its interval, and its
    relative change from ALPHA 0 to 1 with its interval: which track the share, which stay
    level."""
    out = []
    for kind in REAL_KINDS:
        mine = [r for r in rows if kind in r["kinds"]]
        for metric in REAL_DIALS:
            rho, low, high = spearman_interval(mine, metric, "probe_grounded_share")
            change, c_low, c_high = change_interval(mine, metric)
            out.append({"family": kind, "metric": metric, "rho": rho, "low": low, "high": high,
                        "change": change, "change_low": c_low, "change_high": c_high,
                        "level": verdict("level", c_low, c_high) == "holds"})
    return out


def write_report(name, results=RESULTS, with_figures=True, force=False):
    """The report's tables, numbers and figure from the archives alone (report.archived,
    report.publish) -> the summary rows."""
    data, out, archives = report.archived(name, results, force)
    rows = runs(data)
    table, spread = summary(rows), dials(rows)
    decisions = []
    for rule in GRIDS[name]["decide"]:
        decisions.append(decide(rule, rows, decisions))
    columns = list(dict.fromkeys(k for d in decisions for k in d))
    decisions = [{k: d.get(k) for k in columns} for d in decisions]  # one set of csv columns
    files = {"table.csv": table, "runs.csv": [{**r, "kinds": "+".join(r["kinds"])} for r in rows],
             "dials.csv": spread, "decisions.csv": decisions}
    numbers = {"table": table, "dials": spread, "decisions": decisions, "archives": archives}
    report.publish(name, out, files, numbers, markdown(name, table, spread, decisions),
                   (lambda folder: figure(rows, folder)) if with_figures else None)
    return table


def markdown(name, table, spread, decisions):
    g, s = stats.fmt, stats.span
    lines = [f"# {name}", "", GRIDS[name]["claim"], "",
             f"Flags: `{' '.join(GRIDS[name]['flags'] + GRIDS[name]['common'])}`; sampling seeds "
             f"{GRIDS[name]['seeds']}; one build a share.", "",
             "## Each policy: the truth and the dials (mean ± 95% t half-width over the seeds)", ""]
    head = ["family", "ALPHA", "runs"] + [k.replace("probe_", "") for k in TRUTH + SHOWN[2:]]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        cells = [r["family"], f"{r['alpha']:g}", str(r["runs"])]
        cells += [g(r[k], r[k + "_ci95"]) for k in TRUTH + SHOWN[2:]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Every dial against the grounded share (Spearman, 95% interval from "
              "resampling seeds within each share) and its change from ALPHA 0 to 1 (over its "
              "value at 0, 95% Welch interval)", "",
              "| family | dial | Spearman | interval | change 0 -> 1 | interval | level (±10%) |",
              "|---|---|---|---|---|---|---|"]
    for d in spread:
        lines.append(f"| {d['family']} | {d['metric']} | {g(d['rho'])} | {s(d['low'], d['high'])} "
                     f"| {g(d['change'])} | {s(d['change_low'], d['change_high'])} | "
                     f"{'yes' if d['level'] else 'no'} |")
    lines += ["", "## The registered rules", "",
              "| rule | Spearman | interval | change 0 -> 1 | interval | verdict |",
              "|---|---|---|---|---|---|"]
    for d in decisions:
        lines.append(f"| {d['text']} | {g(d.get('rho'))} | {s(d.get('low'), d.get('high'))} | "
                     f"{g(d.get('change'))} | {s(d.get('change_low'), d.get('change_high'))} | "
                     f"{d['verdict']} |")
    return "\n".join(lines) + "\n"


def figure(rows, out):
    """real-templates.png: each shown metric against ALPHA, a colour per family (each run a dot,
    the seeds' mean a line)."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from plumbing.plots import metric_label

    fig, axes = plt.subplots(3, 3, figsize=(12, 10), squeeze=False)
    for ax, key in zip(axes.flat, SHOWN):
        for k, kind in enumerate(REAL_KINDS):
            group = [r for r in rows if kind in r["kinds"] and r.get(key) is not None]
            if not group:
                continue
            color = plt.cm.tab10(k)
            ax.scatter([r["alpha"] for r in group], [r[key] for r in group], s=10, color=color,
                       alpha=0.5)
            xs = sorted({r["alpha"] for r in group})
            ax.plot(xs, [stats.interval([r[key] for r in group if r["alpha"] == x])[0]
                         for x in xs], color=color, label=kind)
        ax.set_title(metric_label(key), fontsize=9)
        ax.set_xlabel("ALPHA (taught template share)", fontsize=8)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "real-templates.png"), dpi=80)
    plt.close(fig)
