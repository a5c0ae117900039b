"""The calibration's report: the MI diagnosis measured against ground truth, from its archives alone
(results/calibration/runs/).

Each run of report.py's grids is a training curve; each run here is one policy measured once -- a
warm start with a template prior ALPHA (templates.py), a build seed, a probe size -- whose input
dependence is known by construction, I(X;Z) = (1 - ALPHA) I_task. It reads and writes as report.py
does (the archives and their manifest, the refusal to overwrite a report with less, the scratch
folder), with its own tables.

Per policy, the step-1 diagnosis of train.py before its update (in-batch over 8 prompts, probe set
over 8 or 32) and the warm start's validation success at step 0, beside the closed forms. Over the
builds of a world, ALPHA and probe size: means with 95% t intervals (stats.interval). The rules
(grids.calibration_rules), each decided by intervals over builds:

    share         share - ALPHA at every ALPHA within +-tolerance
    proportional  (m - (1 - share) m0) / m0 at every ALPHA > 0 within +-tolerance, m0 = the builds'
                  mean of m at ALPHA = 0, share = the template share of the samples m was made from
    tracks        Spearman over the policies of m against (1 - ALPHA) I_task on the predicted side
                  of a threshold; its interval from resampling whole builds (stats.cluster_bootstrap)

An equivalence ("within") holds when every interval lies inside the band, is contradicted when one
lies wholly outside it, else undecided. The samples table answers how many samples tell ALPHA = 0.25
from 0.5: with d the difference of the builds' means and s = sqrt(se(0.25)^2 + se(0.5)^2) from the
probe's standard errors over prompts (one policy of each, K samples a prompt), M * (2.80 / (d / s))^2
samples give a 5% two-sided test 80% power at the same number of prompts N (the estimate's
expectation depends on N); the spread between builds, which no number of samples removes, beside it.
"""
import math
import os
import random

from lab import report, stats
from lab.grids import GRIDS
from lab.protocol import ALPHAS, RESULTS
from warmstart import templates

GROUPS = 8  # train.Args.groups: the in-batch estimate's prompts
POWER_Z = 1.96 + 0.84  # a 5% two-sided test with 80% power
POLICY = ["template_share", "mi_estimate", "mi_seq_estimate", "retrieval_acc", "retrieval_chance",
          "conditional_entropy_seq", "reasoning_entropy_seq", "probe_template_share",
          "probe_mi_estimate", "probe_mi_estimate_se", "probe_mi_seq_estimate",
          "probe_mi_seq_estimate_se", "probe_retrieval_acc", "probe_retrieval_acc_se",
          "probe_retrieval_chance", "probe_conditional_entropy", "probe_reasoning_entropy",
          "probe_conditional_entropy_seq", "probe_reasoning_entropy_seq", "probe_action_mi",
          "probe_action_mi_se", "token_entropy", "response_length", "diagnosis_logprob_diff",
          "probe_diagnosis_logprob_diff"]
TRUTH = ["I_XZ", "H_Z_given_X", "H_Z", "expected_mi_seq_batch", "expected_mi_seq_probe"]
SURFACE = ["expected_template_share", "expected_reasoning_entropy_seq_probe"]  # surface_truth's
SUMMARY = ["probe_template_share", "template_share", "mi_estimate", "mi_seq_estimate",
           "probe_mi_estimate", "probe_mi_seq_estimate", "probe_retrieval_acc",
           "probe_conditional_entropy_seq", "probe_reasoning_entropy_seq",
           "probe_conditional_entropy", "probe_reasoning_entropy", "token_entropy",
           "response_length", "probe_action_mi", "val_success"]
SHOWN = ["probe_template_share", "mi_estimate", "probe_mi_estimate", "probe_mi_seq_estimate",
         "probe_retrieval_acc", "probe_conditional_entropy_seq", "probe_reasoning_entropy_seq",
         "token_entropy", "response_length", "probe_action_mi", "val_success"]
SAMPLED = ["probe_mi_estimate", "probe_mi_seq_estimate", "probe_retrieval_acc"]
# the iso-entropy families: the per-token entropies too (a level rule names them), each against
# the exact I(X;Z), which is not linear in ALPHA there
FAMILY_SHOWN = SHOWN + ["probe_conditional_entropy", "probe_reasoning_entropy"]


# ------------------------------------------------------------------------------------ the policies

def policy(name, setting):
    """(world, ALPHA, probe prompts, samples a prompt) of a setting, from its flags."""
    flags = GRIDS[name]["flags"] + GRIDS[name]["settings"][setting]

    def flag(f, default):
        return type(default)(flags[flags.index(f) + 1]) if f in flags else default

    return (flag("--env", "sokoban"), flag("--template-prior", 0.0), flag("--probe-prompts", 8),
            flag("--probe-samples", 8))


def template_of(name, setting):
    """(template kind, the filler's eps or None) of a setting, from its flags."""
    flags = GRIDS[name]["flags"] + GRIDS[name]["settings"][setting]
    kind = flags[flags.index("--template-kind") + 1] if "--template-kind" in flags else "pool"
    return kind, float(flags[flags.index("--filler") + 1]) if "--filler" in flags else None


def truth_of(world, alpha, prompts, kind="pool", eps=None):
    """The closed forms of a policy's demonstrations (templates.truth, or surface_truth with the
    expected cross-scored H(Z) beside them)."""
    if kind == "pool":
        truth = templates.truth(world, alpha)
        return {k: truth[k] for k in ("I_XZ", "H_Z_given_X", "H_Z")} | {
            "expected_mi_seq_batch": truth.get(f"mi_seq_estimate_N{GROUPS}"),
            "expected_mi_seq_probe": truth.get(f"mi_seq_estimate_N{prompts}")}
    truth = templates.surface_truth(world, alpha, eps, (GROUPS, prompts))
    return {k: truth[k] for k in ("I_XZ", "H_Z_given_X", "H_Z")} | {
        "expected_mi_seq_batch": truth[f"mi_seq_estimate_N{GROUPS}"],
        "expected_mi_seq_probe": truth[f"mi_seq_estimate_N{prompts}"],
        "expected_template_share": truth["template_share"],
        "expected_reasoning_entropy_seq_probe": truth[f"reasoning_entropy_seq_N{prompts}"]}


def policies(name, data):
    """One row per archived run: the policy, its step-1 diagnosis, its step-0 validation success
    and the closed forms of its demonstrations (templates.truth)."""
    rows = []
    for (setting, build), records in sorted(data.items()):
        world, alpha, prompts, samples = policy(name, setting)
        steps = {r["step"]: r for r in report.merged(records)}
        first = steps.get(1, {})
        row = {"setting": setting, "world": world, "alpha": alpha, "prompts": prompts,
               "samples": samples, "build": build,
               "val_success": steps.get(0, {}).get("val_success"),
               **{k: first.get(k) for k in POLICY},
               **truth_of(world, alpha, prompts, *template_of(name, setting))}
        rows.append(row)
    return sorted(rows, key=lambda r: (r["world"], r["prompts"], r["alpha"], r["build"]))


def cells(rows):
    """{(world, probe prompts, ALPHA): [rows]} in order."""
    out = {}
    for r in rows:
        out.setdefault((r["world"], r["prompts"], r["alpha"]), []).append(r)
    return out


def summary(rows):
    """Per world, probe size and ALPHA: each SUMMARY metric's mean over builds with its 95%
    interval, and the closed forms."""
    out = []
    for (world, prompts, alpha), group in cells(rows).items():
        row = {"world": world, "prompts": prompts, "alpha": alpha, "builds": len(group)}
        for key in SUMMARY:
            row[key], row[key + "_ci95"], _ = stats.interval([r[key] for r in group])
        row.update({k: group[0][k] for k in TRUTH + SURFACE if k in group[0]})
        out.append(row)
    return out


# ------------------------------------------------------------------------------------- the rules

def within(intervals, tolerance):
    """The equivalence verdict of [(mean, half-width)] against the band +-tolerance."""
    if not intervals:
        return "not run"
    if any(half is None for _, half in intervals):
        return f"fewer than {stats.MIN_RUNS} builds: no interval"
    if all(-tolerance <= m - h and m + h <= tolerance for m, h in intervals):
        return "holds"
    if any(m - h > tolerance or m + h < -tolerance for m, h in intervals):
        return "contradicted"
    return "undecided"


def decide(rule, rows, resamples=1000):
    """One rule's row: estimate, interval, n, the per-ALPHA (or per-build) values, verdict; no
    verdict while a registered ALPHA has not run (the rule is over all of them)."""
    mine = [r for r in rows if r["world"] == rule["world"] and r["prompts"] == rule.get("size", 32)]
    out = judge(rule, mine, resamples)
    ran = {r["alpha"] for r in mine}
    missing = [f"{a:g}" for a in ALPHAS if a not in ran]
    if ran and missing:
        out["verdict"] = f"incomplete: ALPHA {', '.join(missing)} not run"
    return out


def judge(rule, mine, resamples):
    """decide's row from the rule's world and probe size's policies that ran."""
    picked = [r for r in mine if r.get(rule["metric"]) is not None]
    out = {"rule": rule["text"], "estimate": None, "low": None, "high": None,
           "n": len({r["build"] for r in picked}), "verdict": "not run", "values": ""}
    if not picked:
        return out
    if rule["kind"] == "level":
        return level(rule, picked, out, resamples)
    if rule["kind"] == "tracks":
        by = {(r["setting"], r["build"]): r for r in picked}

        def rho(keys):
            return stats.spearman([by[k][rule["metric"]] for k in keys],
                                  [by[k]["I_XZ"] for k in keys])

        low, high = stats.cluster_bootstrap(list(by), rho, random.Random(0), resamples)
        t = rule["threshold"]
        verdict = "no interval" if low is None else report.side(low - t, high - t, rule["sign"])
        out.update(estimate=rho(list(by)), low=low, high=high, verdict=verdict)
        return out
    share = "template_share" if not rule["metric"].startswith("probe_") else "probe_template_share"
    by_alpha = {}
    for r in picked:
        by_alpha.setdefault(r["alpha"], []).append(r)
    base = stats.interval([r[rule["metric"]] for r in by_alpha.get(0.0, [])])[0]
    deviations = {}
    for alpha, group in sorted(by_alpha.items()):
        if rule["kind"] == "share":
            deviations[alpha] = [r[share] - alpha for r in group]
        elif alpha > 0 and base:
            deviations[alpha] = [(r[rule["metric"]] - (1 - r[share]) * base) / base for r in group]
    intervals = {alpha: stats.interval(d)[:2] for alpha, d in deviations.items()}
    worst = max(intervals.values(), key=lambda mh: abs(mh[0]), default=(None, None))
    out.update(estimate=worst[0], verdict=within(list(intervals.values()), rule["tolerance"]),
               values=" ".join(f"{a:g}: {m:.3f}" + ("" if h is None else f" ± {h:.3f}")
                               for a, (m, h) in intervals.items()))
    return out


def level(rule, picked, out, resamples):
    """A level rule's row: Spearman of the metric (less rule["minus"], a closed form, if named)
    with the exact I(X;Z) over the policies, its interval from resampling whole builds, and the
    change of the builds' mean from the largest I(X;Z) to the smallest against the builds' standard
    deviation at one ALPHA (pooled). Holds when |rho| <= band and |change| <= noise x sd; is
    contradicted when both fail; else undecided."""
    def value(r):
        return r[rule["metric"]] - (r[rule["minus"]] if rule.get("minus") else 0.0)

    by = {(r["setting"], r["build"]): r for r in picked}

    def rho(keys):
        return stats.spearman([value(by[k]) for k in keys], [by[k]["I_XZ"] for k in keys])

    groups = {}
    for r in picked:
        groups.setdefault(r["I_XZ"], []).append(value(r))
    means = {i: sum(v) / len(v) for i, v in groups.items()}
    spread = [variance(v) for v in groups.values() if len(v) > 1]
    low, high = stats.cluster_bootstrap(list(by), rho, random.Random(0), resamples)
    out.update(estimate=rho(list(by)), low=low, high=high,
               values=" ".join(f"{i:.3f}: {m:.3f}" for i, m in sorted(means.items(), reverse=True)))
    if len(groups) < 2 or not spread:
        out["verdict"] = "no interval"
        return out
    sd = math.sqrt(sum(spread) / len(spread))
    change = means[min(means)] - means[max(means)]
    out["values"] += f" (change {change:.3f}, build sd {sd:.3f})"
    flat, still = abs(out["estimate"]) <= rule["band"], abs(change) <= rule["noise"] * sd
    out["verdict"] = "holds" if flat and still else "contradicted" if not (flat or still) else \
        "undecided"
    return out


def samples(rows):
    """How many samples tell ALPHA = 0.25 from 0.5, per world, probe size and metric (module
    docstring)."""
    out, by_cell = [], cells(rows)
    for (world, prompts, alpha), group in by_cell.items():
        other = by_cell.get((world, prompts, 0.5))
        if alpha != 0.25 or not other:
            continue
        for metric in SAMPLED:
            a = [r for r in group if r.get(metric) is not None and r.get(metric + "_se")]
            b = [r for r in other if r.get(metric) is not None and r.get(metric + "_se")]
            if not a or not b:
                continue
            diff = stats.interval([r[metric] for r in a])[0] - stats.interval(
                [r[metric] for r in b])[0]
            se = math.sqrt(sum(r[metric + "_se"] ** 2 for r in a) / len(a)
                           + sum(r[metric + "_se"] ** 2 for r in b) / len(b))
            z = diff / se
            n = prompts * group[0]["samples"]
            spread = (math.sqrt(variance([r[metric] for r in a]) + variance([r[metric] for r in b]))
                      if len(a) > 1 and len(b) > 1 else None)
            out.append({"world": world, "prompts": prompts, "samples": n, "metric": metric,
                        "difference": diff, "se_difference": se, "z": z,
                        "samples_needed": math.ceil(n * (POWER_Z / z) ** 2) if z else None,
                        "build_sd_difference": spread,
                        "z_builds": diff / spread if spread else None})
    return out


def variance(xs):
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


# ------------------------------------------------------------------------------------ the report

def write_report(name, results=RESULTS, with_figures=True, force=False):
    """The calibration's tables, numbers and figure from its archives alone (report.archived,
    report.publish) -> the summary rows."""
    data, out, archives = report.archived(name, results, force)
    files, numbers, text, draw = tables(name, data)
    report.publish(name, out, files, {**numbers, "archives": archives}, text,
                   draw if with_figures else None)
    return numbers["table"]


def tables(name, data):
    """(files {csv name: rows}, numbers, table.md text, draw(folder)) of the calibration; the
    summary rows come first in numbers."""
    rows = policies(name, data)
    table = summary(rows)
    decisions = [decide(rule, rows) for rule in GRIDS[name]["decide"]]
    needed = samples(rows)
    files = {"table.csv": table, "policies.csv": rows, "decisions.csv": decisions,
             "samples.csv": needed}
    numbers = {"decisions": decisions, "samples": needed, "table": table,
               "task": {w: templates.TASK[w] for w in sorted({r["world"] for r in rows})}}
    return files, numbers, markdown(name, table, decisions, needed), lambda out: figure(rows, out)


def markdown(name, table, decisions, needed):
    g = stats.fmt
    surface = SURFACE[0] in table[0]  # an iso-entropy family: surface-matched templates
    lines = [f"# {name}", "", GRIDS[name]["claim"], "",
             f"Flags: `{' '.join(GRIDS[name]['flags'])}` and the settings' (world, "
             f"`--template-prior`, `--probe-prompts`); builds {GRIDS[name]['seeds']} "
             f"(`--warm-start-seed` = `--seed`). Mean ± half-width of the 95% t interval over "
             f"builds; every policy in policies.csv. " + (
                 "Closed forms (warmstart/templates.py, surface_truth) of the demonstrations, not "
                 "the policies: I(X;Z), H(Z|X), H(Z) of the mixture of the task reasoning and, "
                 "with probability ALPHA, another layout's (not linear in ALPHA); E[share]: the "
                 "share of their reasonings that are not their own input's (below ALPHA: another "
                 "layout can share the reasoning; a policy's errors count as templates too); "
                 "E[mi_seq], E[H(Z) seq]: the probe's expected estimates at N prompts."
                 if surface else
                 "Closed forms (warmstart/templates.py): I(X;Z) = (1 - ALPHA) I_task; E[probe "
                 "mi_seq] = (1 - ALPHA) G(N) under the demonstrations; H(Z|X), H(Z) of the "
                 "demonstrations."), ""]
    shown = FAMILY_SHOWN if surface else SHOWN
    extra = ["E[share]", "E[H(Z) seq]"] if surface else []
    for world in sorted({r["world"] for r in table}):
        task = templates.TASK[world]
        rows = [r for r in table if r["world"] == world]
        what = (f"templates: another layout's task reasoning{filler_note(name, world)}."
                if surface else f"pool of {len(templates.pool(world))} (log n = "
                f"{math.log(len(templates.pool(world))):.3f}) nats.")
        lines += [f"## {world}", "",
                  f"I_task = {task['i_task']:.3f}, H(Z_task|X) = {task['h_given_x']:.3f}"
                  + (" nats; " if surface else ", ") + what, "",
                  "| N | ALPHA | builds | I(X;Z) | E[mi_seq] | H(Z\\|X) | H(Z) | "
                  + "".join(f"{e} | " for e in extra) + " | ".join(shown) + " |",
                  "|---" * (7 + len(extra) + len(shown)) + "|"]
        for row in rows:
            lines.append(f"| {row['prompts']} | {row['alpha']:g} | {row['builds']} | "
                         f"{g(row['I_XZ'])} | {g(row['expected_mi_seq_probe'])} | "
                         f"{g(row['H_Z_given_X'])} | {g(row['H_Z'])} | "
                         + "".join(f"{g(row[k])} | " for k in (SURFACE if surface else []))
                         + " | ".join(g(row[k], row[k + "_ci95"]) for k in shown) + " |")
        lines.append("")
    lines += ["## Predictions (written before measuring)", "",
              "| rule | estimate | 95% interval | builds | per ALPHA | verdict |",
              "|---|---|---|---|---|---|"]
    for d in decisions:
        lines.append(f"| {d['rule']} | {g(d['estimate'])} | {stats.span(d['low'], d['high'])} | "
                     f"{d['n']} | {d['values']} | {d['verdict']} |")
    lines += ["", "## Telling ALPHA = 0.25 from 0.5", "",
              "difference: the builds' means at 0.25 minus 0.5; se: from the probe's standard "
              "errors over prompts (one policy of each); needed: samples (at N prompts) for a 5% "
              "two-sided test with 80% power; the spread between builds beside it (z_builds: the "
              "difference over it).", "",
              "| world | N | samples | metric | difference | se | z | needed | build sd | "
              "z_builds |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in needed:
        lines.append(f"| {s['world']} | {s['prompts']} | {s['samples']} | {s['metric']} | "
                     f"{g(s['difference'])} | {g(s['se_difference'])} | {g(s['z'])} | "
                     f"{s['samples_needed'] or '-'} | {g(s['build_sd_difference'])} | "
                     f"{g(s['z_builds'])} |")
    return "\n".join(lines) + "\n"


def filler_note(name, world):
    """The filler a family's settings add, said in a few words ("" without one)."""
    eps = sorted({template_of(name, setting)[1] for setting in GRIDS[name]["settings"]
                  if policy(name, setting)[0] == world} - {None}, reverse=True)
    return f"; a filler of 5 digits, eps {', '.join(f'{e:g}' for e in eps)}" if eps else ""


def figure(rows, out):
    """calibration.png: each shown metric against ALPHA -- for an iso-entropy family against the
    exact I(X;Z), which is not linear in ALPHA there -- a colour per world and a line style per
    probe size (each build a dot, the builds' mean a line), with the closed form or prediction
    where there is one (thin black)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from plumbing.plots import metric_label

    surface = SURFACE[0] in rows[0]
    x, shown = ("I_XZ", FAMILY_SHOWN) if surface else ("alpha", SHOWN)
    truths = {"probe_template_share": SURFACE[0] if surface else "alpha",
              "probe_mi_seq_estimate": "expected_mi_seq_probe",
              "probe_conditional_entropy_seq": "H_Z_given_X",
              "probe_reasoning_entropy_seq": SURFACE[1] if surface else "H_Z"}
    worlds = sorted({r["world"] for r in rows})
    fig, axes = plt.subplots(4 if surface else 3, 4, figsize=(15, 13 if surface else 10),
                             squeeze=False)
    for ax, key in zip(axes.flat, shown):
        for w, world in enumerate(worlds):
            for prompts, style in zip(sorted({r["prompts"] for r in rows}), ("-", "--", ":")):
                group = [r for r in rows if r["world"] == world and r["prompts"] == prompts
                         and r.get(key) is not None]
                if not group:
                    continue
                color = plt.cm.tab10(w % 10)
                ax.scatter([r[x] for r in group], [r[key] for r in group], s=10,
                           color=color, alpha=0.5)
                xs = sorted({r[x] for r in group})
                means = [stats.interval([r[key] for r in group if r[x] == v])[0] for v in xs]
                ax.plot(xs, means, style, color=color, label=f"{world}, N={prompts}")
                if key in truths:
                    ax.plot(xs, [next(r for r in group if r[x] == v)[truths[key]] for v in xs],
                            style, color="black", lw=0.8)
        ax.set_title(metric_label(key), fontsize=9)
        ax.set_xlabel("exact I(X;Z) of the demonstrations (nats)" if surface
                      else "template prior ALPHA")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "calibration.png"), dpi=90)
    plt.close(fig)
