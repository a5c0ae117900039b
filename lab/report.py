"""Every table, figure and number of a grid, from its committed per-run archives alone
(results/<grid>/runs/<setting>-s<seed>.jsonl.gz).

What a stranger runs to check every number of RESULTS.md. It reads the archives and nothing else,
and writes results/<grid>/: table.md (means over seeds with 95% t intervals, the decision rules and
their verdicts, onsets, correlations, and beside each verdict the first report's, replication.csv),
the same as csv files, numbers.json (every number, and the manifest of the archives it was made
from), perseed.csv, gradients.csv (Fig. 4), search.csv (the regime search), curves.png, perseed.png,
scatter.png and, where the runs decomposed their gradients, fig4.png (Fig. 4 drawn as the paper does).

It never overwrites a committed report with less: when the archives are fewer, shorter or
unreadable compared with the manifest of the report in place, it refuses (ReportError: one line,
exit 2) unless forced; it writes into a scratch folder and moves the files in only once all of them
are written.
"""
import csv
import gzip
import hashlib
import json
import math
import os
import random
import shutil
import zlib

from lab import dials, matrix, reasonings, stats
from lab.stats import fmt, span
from plumbing import plots
from plumbing.defaults import GROUP_SIZE
from lab.grids import GRIDS, done, runs_of, world_of
from lab.protocol import (BUCKET, COMMON, DIAGNOSTICS, GROUNDED, METRICS, ONSET, PHASE, RESULTS,
                          TEMPLATE, WINDOW)

FIRST_REPORT = "round3"  # results/round3/<grid>/: the first report, whose archives were never kept


class ReportError(Exception):
    """What the user gets as one line and exit code 2."""


# ------------------------------------------------------------------------------------- the archives

def archive_path(name, folder, results=RESULTS):
    return os.path.join(results, name, "runs", os.path.basename(folder) + ".jsonl.gz")


def read_archive(path):
    """The records of one archive; a damaged or empty one is a ReportError, never a traceback."""
    try:
        with gzip.open(path, "rt") as f:
            records = [json.loads(line) for line in f if line.strip()]
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, ValueError) as e:
        raise ReportError(f"{path}: unreadable archive ({type(e).__name__}: {e})") from None
    if not records or not all(isinstance(r, dict) and "step" in r for r in records):
        raise ReportError(f"{path}: unreadable archive (it holds no records with a step)")
    return records


def load(name, results=RESULTS):
    """{(setting, seed): records} from the grid's archives, each record with the cumulative
    optimiser steps and trajectories trained on up to its step."""
    out = {}
    for setting, seed, folder, argv in runs_of(name):
        path = archive_path(name, folder, results)
        if not os.path.isfile(path):
            continue
        K = int(argv[argv.index("--group-size") + 1]) if "--group-size" in argv else GROUP_SIZE
        opt = trajectories = 0
        records = sorted(read_archive(path), key=lambda r: r["step"])
        for r in records:
            opt += r.get("optimizer_steps", 0) if not r.get("skipped") else 0
            trajectories += r.get("num_kept", 0) * K if not r.get("skipped") else 0
            r["optimizer_steps_total"], r["trajectories_total"] = opt, trajectories
        out[(setting, seed)] = records
    flags = next((a for *_, a in runs_of(name) if "--probe-samples" in a), None)
    if flags is None or "--probe-prompts" not in flags:
        return out
    return reasonings.relabel(name, out, int(flags[flags.index("--probe-prompts") + 1]),
                              int(flags[flags.index("--probe-samples") + 1]))


def manifest(name, data, results=RESULTS):
    """{run: records, last step, sha256 of the archive's bytes} of what a report is made from."""
    out = {}
    for setting, seed, folder, _ in runs_of(name):
        if (setting, seed) in data:
            with open(archive_path(name, folder, results), "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()[:16]
            records = data[setting, seed]
            out[f"{setting}-s{seed}"] = {"records": len(records), "last_step": records[-1]["step"],
                                         "sha256": digest}
    return out


def refuse_less(name, now, results=RESULTS):
    """ReportError when the report in place was made from an archive that is now missing or
    shorter."""
    path = os.path.join(results, name, "numbers.json")
    try:
        with open(path) as f:
            before = json.load(f).get("archives", {})
    except (OSError, ValueError, AttributeError):
        return
    for run, m in sorted(before.items()):
        have = now.get(run)
        why = ("is missing" if have is None else "is shorter" if
               (have["records"], have["last_step"]) < (m["records"], m["last_step"]) else None)
        if why:
            raise ReportError(f"{name}: the report in {os.path.dirname(path)} was made from "
                              f"{len(before)} archives and {run} {why}; refusing to overwrite it "
                              f"with less (--force reports what is there)")


# ---------------------------------------------------------------------------------------- decisions

def side(low, high, sign):
    """A rule's verdict from its 95% interval: "holds" when the whole interval lies on the predicted
    side of 0 (sign +1: above, -1: below), "contradicted" on the other side, else "undecided"."""
    if min(low * sign, high * sign) > 0:
        return "holds"
    if max(low * sign, high * sign) < 0:
        return "contradicted"
    return "undecided"


def decide(name, data, rule, results=RESULTS):
    """One rule's row: the estimate with its 95% interval over seeds, n, the per-seed values and the
    verdict (no interval, and so no verdict, from fewer than stats.MIN_RUNS seeds)."""
    if rule["kind"] == "search":
        return search(data, rule)
    if rule["kind"] == "incidence":
        return incidence(name, data, rule)
    if rule["kind"] == "followup":  # which cells get a control: from the cells' own rules
        rules = cell_rules(name)
        return matrix.followup(rule, rules, [decide(name, data, r, results) for r in rules])
    if rule["kind"] == "gradients":
        values = {seed: stats.gradient_stat(records, rule["stat"])
                  for (setting, seed), records in sorted(data.items()) if setting == rule["setting"]}
    elif rule["kind"] == "leadlag":
        values = {}
        for (setting, seed), records in sorted(data.items()):
            if setting == rule["setting"]:
                ta, tb = stats.onset(records, rule["a"]), stats.onset(records, rule["b"])
                values[seed] = tb - ta if ta is not None and tb is not None else None
    else:
        values = paired(data, rule, results)
    m, half, n = stats.interval(list(values.values()))
    if n == 0:
        verdict = "not run" if not values else "no values"
    elif rule["kind"] == "wilcoxon":  # the rank test decides; the t interval is shown beside
        verdict = rank_verdict(list(values.values()), rule["sign"])
    elif half is None:
        verdict = f"{n} runs: no interval"
    else:  # a rule with a margin predicts a - b beyond it, not only beyond 0
        margin = rule.get("margin", 0.0)
        verdict = side(m - half - margin, m + half - margin, rule["sign"])
    return {"rule": rule["text"], "estimate": m, "low": None if half is None else m - half,
            "high": None if half is None else m + half, "n": n, "verdict": verdict,
            "values": " ".join("-" if v is None else f"{v:.3f}" for v in values.values())}


def cell_rules(name):
    """The rules of a grid that decide a cell (a world and an algorithm: matrix.py)."""
    return [rule for rule in GRIDS[name]["decide"] if rule.get("cell")]


def controlled_cells(name, results=RESULTS):
    """The cells of grid `name` whose deciding interval excludes 0 (matrix.selected), from its
    archives: what its follow-up grid runs."""
    data = load(name, results)
    return matrix.selected(cell_rules(name), [decide(name, data, r, results)
                                              for r in cell_rules(name)])


def paired(data, rule, results=RESULTS):
    """{seed: a - b} of a rule's two sides, each (setting, axis, point) read by stats.value_on
    (a setting "grid/setting" from another grid's archives), None where either is missing."""
    sides = []
    for setting, axis, point in (rule["a"], rule["b"]):
        source = load(setting.split("/")[0], results) if "/" in setting else data
        setting = setting.split("/")[-1]
        sides.append({seed: stats.value_on(r, rule["metric"], axis, point)
                      for (s, seed), r in source.items() if s == setting})
    a, b = sides
    return {s: a[s] - b[s] if a[s] is not None and b[s] is not None else None
            for s in sorted(set(a) & set(b))}


def rank_verdict(diffs, sign):
    """A Wilcoxon rule's verdict: "holds" when the exact two-sided signed-rank test gives p < 0.05
    with the rank sum on the predicted side the larger, "contradicted" when on the other, else
    "undecided"; with p and the rank sums."""
    p, w_plus, w_minus, n = stats.signed_rank(diffs)
    ahead = (w_plus - w_minus) * sign
    verdict = "holds" if p < 0.05 and ahead > 0 else "contradicted" if p < 0.05 else "undecided"
    return f"{verdict} (p = {p:.4f}; W+ {w_plus:g}, W- {w_minus:g}, {n} non-zero)"


def incidence(name, data, rule):
    """How often a run ends above a threshold: per setting, the runs whose `metric` at `step` is
    at least `threshold`, out of the runs that logged it, with its 95% Clopper-Pearson interval;
    and the seeds above it in more than one setting (a seed's settings share its warm start and
    early batches: not independent events)."""
    above, parts = {}, []
    for setting in GRIDS[name]["settings"]:
        values = {seed: stats.value_at(r, rule["metric"], rule["step"])
                  for (s, seed), r in sorted(data.items()) if s == setting}
        values = {seed: v for seed, v in values.items() if v is not None}
        if not values:
            continue
        hits = [seed for seed, v in values.items() if v >= rule["threshold"]]
        for seed in hits:
            above.setdefault(seed, []).append(setting)
        low, high = stats.clopper_pearson(len(hits), len(values))
        parts.append(f"{setting} {len(hits)}/{len(values)} ({low:.3f} .. {high:.3f})")
    shared = [f"s{seed} ({', '.join(s)})" for seed, s in sorted(above.items()) if len(s) > 1]
    verdict = ("not run" if not parts else "; ".join(parts) + "; in more than one setting: "
               + (", ".join(shared) or "none"))
    return {"rule": rule["text"], "estimate": None, "low": None, "high": None,
            "n": sum(int(p.split()[1].split("/")[1]) for p in parts), "verdict": verdict,
            "values": " ".join(f"s{seed}" for seed in sorted(above))}


def search(data, rule):
    """The regime search's rule, run by run: which settings showed a collapse regime."""
    runs = stats.CRITERIA[rule.get("criteria", "collapse")](data)
    found = [f"{r['setting']}-s{r['seed']}" for r in runs if r["regime"]]
    verdict = ("not run" if not runs else
               f"regime found: {', '.join(found)}" if found else "no regime found")
    return {"rule": rule["text"], "estimate": len(found), "low": None, "high": None,
            "n": len(runs), "verdict": verdict, "values": ""}


def replication(name, decisions, results=RESULTS):
    """Each rule's verdict beside the first report's (matched by the rule's text): rows, or [] when
    there is no first report."""
    path = os.path.join(results, FIRST_REPORT, name, "numbers.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        old = {d["rule"]: d for d in json.load(f)["decisions"]}
    rows = []
    for d in decisions:
        o = old.get(d["rule"], {})
        rows.append({"rule": d["rule"], "old_estimate": o.get("estimate"), "old_low": o.get("low"),
                     "old_high": o.get("high"), "old_verdict": o.get("verdict"),
                     "new_estimate": d["estimate"], "new_low": d["low"], "new_high": d["high"],
                     "new_verdict": d["verdict"],
                     "replicated": "yes" if o.get("verdict") == d["verdict"] else "no"})
    return rows


# ------------------------------------------------------------------------------------------- tables

def table_rows(name, data):
    """Per setting and table step, each METRIC's mean over the seeds with its 95% interval."""
    g, rows = GRIDS[name], []
    metrics = METRICS + logged(data, TEMPLATE) + logged(data, GROUNDED)
    for setting in g["settings"]:
        runs = [r for (s, _), r in sorted(data.items()) if s == setting]
        complete = sum(done(r, g["steps"]) for r in runs)
        for step in g["table_steps"]:
            row = {"setting": setting, "step": step, "runs": len(runs), "finished": complete}
            for key in metrics:
                row[key], row[key + "_ci95"], _ = stats.interval(
                    [stats.value_at(r, key, step) for r in runs])
            rows.append(row)
    return rows


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
                row[key], row[key + "_ci95"], _ = stats.interval(
                    [sum(x[bucket][key] for x in d) / len(d) for d in runs])
            rows.append(row)
    return rows


def logged(data, keys):
    """The keys that some run logged: the template share exists only in runs with a template
    prior, and a grid without one keeps its tables as they were."""
    return [k for k in keys if any(k in r for records in data.values() for r in records)]


def merged(records):
    """One record per step (a step's diagnosis, update and validation may sit in one line)."""
    by_step = {}
    for r in records:
        by_step.setdefault(r["step"], {}).update(r)
    return [r for _, r in sorted(by_step.items())]


def correlations(name, data, target="val_success", resamples=1000, seed=0):
    """Spearman correlation of each diagnostic (the grid's `dials`, else DIAGNOSTICS) with `target`
    (validation success, at the validation steps), within each run, summarised as one number per
    seed (the mean over its runs) and then over seeds with a 95% t interval; within each world (all
    its runs' points; 95% interval from resampling whole seeds); in a grid of several worlds,
    pooled over them (a footnote: worlds differ in both)."""
    points = {key: [r for r in merged(records) if target in r] for key, records in data.items()}
    worlds = {}
    for key in points:
        worlds.setdefault(world_of(name, key[0]), []).append(key)
    within, world_rows = [], []
    rng = random.Random(seed)
    for diagnostic in GRIDS[name].get("dials", DIAGNOSTICS):
        xy = {k: ([r[diagnostic] for r in rs if diagnostic in r],  # each run's points, once
                  [r[target] for r in rs if diagnostic in r]) for k, rs in points.items()}

        def rho(keys):
            return stats.spearman([x for k in keys for x in xy[k][0]],
                                  [y for k in keys for y in xy[k][1]])

        m, half, n = stats.interval(stats.by_seed({k: rho([k]) for k in points}))
        within.append({"scope": "within runs, by seed", "world": "each", "diagnostic": diagnostic,
                       "rho": m, "low": None if half is None else m - half,
                       "high": None if half is None else m + half, "n": n})
        pooled = [("pooled (footnote)", sorted(points))] if len(worlds) > 1 else []
        for world, keys in sorted(worlds.items()) + pooled:
            low, high = stats.cluster_bootstrap(keys, rho, rng, resamples)
            world_rows.append({"scope": "within world" if world in worlds else "pooled",
                               "world": world, "diagnostic": diagnostic, "rho": rho(keys),
                               "low": low, "high": high, "n": len({s for _, s in keys})})
    return within, world_rows


def constant_dials(name, data):
    """{dial: value} of the dials logged with one value at every point of every run: a constant
    ranks nothing, so the correlation tables have no rho for it (and say why)."""
    constant = {}
    for diagnostic in GRIDS[name].get("dials", DIAGNOSTICS):
        values = {r[diagnostic] for records in data.values() for r in records if diagnostic in r}
        if len(values) == 1:
            constant[diagnostic] = values.pop()
    return constant


def constant_note(constant):
    """The line under a correlation table that names the constant dials."""
    if not constant:
        return []
    said = "; ".join(f"{d} is {fmt(v)}" for d, v in constant.items())
    return ["", f"No rho where a dial never moves: {said} at every point of every run, and a "
                f"constant ranks nothing."]


def onsets(data):
    """Per run: the step at which each ONSET series starts to move (stats.onset)."""
    keys = logged(data, ONSET)
    return [{"setting": setting, "seed": seed, **{k: stats.onset(records, k) for k in keys}}
            for (setting, seed), records in sorted(data.items())]


# ----------------------------------------------------------------------------------------- the report

def archived(name, results=RESULTS, force=False):
    """(records by run, the report's folder, the manifest) of a grid's archives; ReportError when
    there are none, or fewer or shorter ones than the report in place was made from (unless
    forced)."""
    data = load(name, results)
    out = os.path.join(results, name)
    if not data:
        raise ReportError(f"{name}: no archived runs in {out}/runs: nothing to report")
    archives = manifest(name, data, results)
    if not force:
        refuse_less(name, archives, results)
    return data, out, archives


def report(name, results=RESULTS, with_figures=True, force=False):
    """Every table, figure and number of the grid from results/<grid>/runs/ alone -> the table's
    rows. ReportError when there is nothing to report or less than the report in place had."""
    g = GRIDS[name]
    if g.get("kind") == "calibration":  # one policy a run, measured once: not training curves
        raise ReportError(f"{name}: a calibration; calibration.write_report writes its report")
    data, out, archives = archived(name, results, force)
    rows = table_rows(name, data)
    decisions = [decide(name, data, rule, results) for rule in g["decide"]]
    within, world_rows = correlations(name, data)
    leads = onsets(data)
    gradients = gradient_table(name, data)
    searched = [row for rule in g["decide"] if rule["kind"] == "search"
                for row in stats.CRITERIA[rule.get("criteria", "collapse")](data)]
    replicated = replication(name, decisions, results)
    grounded = (correlations(name, data, "probe_grounded_share")
                if logged(data, GROUNDED[:1]) else ([], []))
    per_prompt = samples_per_prompt(name)
    said = reasonings.rows(name, data, per_prompt)
    files = {"table.csv": rows, "decisions.csv": decisions, "leadlag.csv": leads,
             "correlations.csv": within + world_rows, "gradients.csv": gradients,
             "search.csv": searched, "replication.csv": replicated,
             "perseed.csv": [{"setting": setting, "seed": seed, "step": step,
                              **{k: stats.value_at(data[setting, seed], k, step)
                                 for k in ["val_success"] + PHASE + logged(data, TEMPLATE[:1])
                                 + logged(data, GROUNDED[:1])}}
                             for setting in g["settings"] for seed in g["seeds"]
                             if (setting, seed) in data for step in g["table_steps"]]}
    numbers = {"decisions": decisions, "correlations": within + world_rows, "leadlag": leads,
               "gradients": gradients, "search": searched, "replication": replicated,
               "archives": archives}
    constant = constant_dials(name, data)
    text = markdown(name, rows, decisions, within, world_rows, leads, gradients, searched,
                    replicated, constant)
    if g.get("matrix"):  # the paper's main table: its layout, the paper's numbers beside ours
        cells = [d for rule, d in zip(g["decide"], decisions) if rule.get("cell")]
        text += "\n".join(matrix.section(g, cell_rules(name), cells, data)) + "\n"
    if said:  # a real model's runs: the dials against the grounded share and how each moved,
        moved = dials.changes(name, data)  # then what the reasoning says
        files.update({"correlations-grounded.csv": sum(grounded, []), "reasonings.csv": said,
                      "dials.csv": moved})
        numbers.update(correlations_grounded=sum(grounded, []), dials=moved)
        text += "\n".join(grounded_section(*grounded) + constant_note(constant)
                          + dials.section(moved) + reasonings.section(said, per_prompt)
                          + reasonings.cap_and_suffix(data)) + "\n"
    publish(name, out, files, numbers, text,
            (lambda folder: figures(name, data, folder)) if with_figures else None)
    return rows


def samples_per_prompt(name):
    """--probe-samples of a grid (every setting runs the same probe set)."""
    flags = GRIDS[name]["flags"] + GRIDS[name].get("common", COMMON)
    return int(flags[flags.index("--probe-samples") + 1]) if "--probe-samples" in flags else 8


def grounded_section(within, world_rows):
    """table.md's lines on the dials against the exact grounded share."""
    lines = ["", "## Spearman correlation with the probe set's grounded share", "",
             "Which dial tracks whether the reasoning reads its input: at the diagnoses, within "
             "runs (one rho per run, averaged over each seed's runs, then over seeds) and within "
             "the world.", "",
             "| scope | world | diagnostic | rho | 95% interval | n |", "|---|---|---|---|---|---|"]
    for c in within + [c for c in world_rows if c["scope"] != "pooled"]:
        lines.append(f"| {c['scope']} | {c['world']} | {c['diagnostic']} | {fmt(c['rho'])} | "
                     f"{span(c['low'], c['high'])} | {c['n']} |")
    return lines


def publish(name, out, files, numbers, text, draw=None):
    """Write the csv files, numbers.json, table.md and (draw(folder)) the figures into a scratch
    folder beside `out`, then move them in: a failure leaves the report in place as it was."""
    scratch = os.path.join(os.path.dirname(out), f".{name}.new")
    try:
        shutil.rmtree(scratch, ignore_errors=True)
        os.makedirs(scratch)
        for file, table in files.items():
            if table:
                write_csv(os.path.join(scratch, file), table)
        with open(os.path.join(scratch, "numbers.json"), "w") as f:
            json.dump(rounded({k: v for k, v in numbers.items() if v}), f, indent=1,
                      sort_keys=True)
            f.write("\n")
        with open(os.path.join(scratch, "table.md"), "w") as f:
            f.write(text)
        if draw is not None:
            draw(scratch)
        for file in sorted(os.listdir(scratch)):  # only now: every file was written
            os.replace(os.path.join(scratch, file), os.path.join(out, file))
        os.rmdir(scratch)
    except OSError as e:
        raise ReportError(f"{name}: cannot write the report in {out}: {e.strerror or e}") from None
    runs = len(numbers.get("archives", {}))
    print(f"wrote {out}/table.md, csv files, numbers.json{' and figures' if draw else ''} "
          f"({runs} runs)")


def rounded(x):
    if isinstance(x, float):
        return None if math.isnan(x) else round(x, 4)
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v) for v in x]
    return x


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rounded(rows))


def markdown(name, rows, decisions, within, world_rows, leads, gradients, searched, replicated,
             constant):
    """table.md: the tables above, in the order a reader checks a claim."""
    g = GRIDS[name]
    shown = ["val_success"] + [k for k in TEMPLATE[:1] + GROUNDED[:1] if k in rows[0]] + [
        "probe_mi_estimate", "probe_reasoning_entropy", "probe_conditional_entropy",
        "probe_action_mi", "token_entropy", "kept_ratio", "zero_var_fail_frac",
        "optimizer_steps_total"]
    moving = [k for k in ONSET if leads and k in leads[0]]
    lines = [f"# {name}", "", g["claim"], "",
             f"Flags: `{' '.join(g['flags'] + g.get('common', COMMON))}`; seeds {g['seeds']}; "
             f"{g['steps']} steps. "
             f"Mean ± half-width of the 95% t interval over seeds (n - 1 degrees of freedom; no "
             f"interval from fewer than {stats.MIN_RUNS} runs: each run is in perseed.csv); "
             f"per-step metrics averaged over the {WINDOW} steps ending at the step. All columns: "
             f"table.csv.", "",
             "| setting | step | runs (finished) | " + " | ".join(shown) + " |",
             "|---|---|---|" + "---|" * len(shown)]
    for row in rows:
        cells = " | ".join(fmt(row[k], row[k + "_ci95"]) for k in shown)
        lines.append(f"| {row['setting']} | {row['step']} | {row['runs']} ({row['finished']}) | "
                     f"{cells} |")
    lines += ["", "## Decision rules (written before the runs)", "",
              "| rule | estimate (a - b) | 95% interval | n | per seed | verdict |",
              "|---|---|---|---|---|---|"]
    for d in decisions:
        lines.append(f"| {d['rule']} | {fmt(d['estimate'])} | {span(d['low'], d['high'])} | "
                     f"{d['n']} | {d['values']} | {d['verdict']} |")
    if replicated:
        lines += ["", "## Replication: each verdict beside the first report's", "",
                  f"The first report: results/{FIRST_REPORT}/{name} (its archives were never "
                  f"kept). Estimates with their 95% intervals.", "",
                  "| rule | first report | verdict | this report | verdict | same verdict |",
                  "|---|---|---|---|---|---|"]
        for r in replicated:
            lines.append(f"| {r['rule']} | {fmt(r['old_estimate'])} "
                         f"({span(r['old_low'], r['old_high'])}) | {r['old_verdict'] or '-'} | "
                         f"{fmt(r['new_estimate'])} ({span(r['new_low'], r['new_high'])}) | "
                         f"{r['new_verdict']} | {r['replicated']} |")
    if searched:
        keys = [k for k in searched[0] if k not in ("setting", "seed", "regime")]
        note = (" (train_success: the run's mean, for how often rollouts failed whatever their "
                "rewards' spread)" if "train_success" in keys else "")
        lines += ["", f"The search's criteria, run by run{note}:", "",
                  "| setting | seed | " + " | ".join(keys) + " | regime |",
                  "|---|---|" + "---|" * (len(keys) + 1)]
        for r in searched:
            lines.append(f"| {r['setting']} | {r['seed']} | "
                         + " | ".join(fmt(r[k]) for k in keys) + f" | {r['regime']} |")
    lines += ["", "## Spearman correlation with validation success", "",
              "Within runs: one rho per run, averaged over each seed's runs, then over seeds (n = "
              "seeds). Within a world: all its runs' points, the interval from resampling whole "
              "seeds.", "",
              "| scope | world | diagnostic | rho | 95% interval | n |", "|---|---|---|---|---|---|"]
    for c in within + [c for c in world_rows if c["scope"] != "pooled"]:
        lines.append(f"| {c['scope']} | {c['world']} | {c['diagnostic']} | {fmt(c['rho'])} | "
                     f"{span(c['low'], c['high'])} | {c['n']} |")
    lines += constant_note(constant)
    pooled = ", ".join(f"{c['diagnostic']} {fmt(c['rho'])}" for c in world_rows
                       if c["scope"] == "pooled")
    if pooled:
        lines += ["", f"Footnote, pooled over worlds (worlds differ in both, so this mixes them): "
                      f"{pooled}."]
    lines += ["", "## Onsets: the step at which each series starts to move", "",
              f"Each series at the validation steps, in units of its own early noise (its first "
              f"{stats.BASELINE} points); the onset is the first step {stats.THRESHOLD:g} units "
              f"away in the collapse's direction at {stats.SUSTAIN} points in a row (stats.onset; "
              f"-: never).", "",
              "| setting | seed | " + " | ".join(moving) + " |", "|---|---|" + "---|" * len(moving)]
    for r in leads:
        lines.append(f"| {r['setting']} | {r['seed']} | " + " | ".join(
            "-" if r[k] is None else str(r[k]) for k in moving) + " |")
    if gradients:
        lines += ["", "## Gradient norms by reward-spread bucket (Fig. 4)", "",
                  "Buckets from the lowest spread (1) to the highest; each run's mean over its "
                  "decompositions, then the mean over runs ± the 95% t interval.", "",
                  "| setting | bucket | runs | " + " | ".join(BUCKET) + " |",
                  "|---|---|---|" + "---|" * len(BUCKET)]
        for row in gradients:  # norms span four decades: significant digits, not decimals
            cells = " | ".join(f"{row[k]:.3g}" + ("" if row[k + "_ci95"] is None else
                                                  f" ± {row[k + '_ci95']:.2g}") for k in BUCKET)
            lines.append(f"| {row['setting']} | {row['bucket']} | {row['runs']} | {cells} |")
    return "\n".join(lines) + "\n"


def figures(name, data, out):
    """curves.png: validation success, the probe template share (where logged), probe MI, H(Z) and
    token entropy against environment steps, optimiser steps and trajectories trained on (each seed
    a thin line, the setting's mean over seeds a thick one against environment steps);
    perseed.png: every seed's probe MI, H(Z), H(Z|X) and token entropy, a row per setting;
    scatter.png: diagnostics against success."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from plumbing.plots import metric_label

    settings = list(GRIDS[name]["settings"])
    colors = {s: plt.cm.tab10(i % 10) for i, s in enumerate(settings)}
    keys = ["val_success"] + logged(data, TEMPLATE[:1]) + ["probe_mi_estimate",
                                                           "probe_reasoning_entropy", "token_entropy"]
    axes_x = [("step", "environment steps"), ("optimizer_steps_total", "optimiser steps"),
              ("trajectories_total", "trajectories trained on")]
    fig, axes = plt.subplots(len(keys), len(axes_x), figsize=(13, 2.75 * len(keys)),
                             squeeze=False)
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
                    means = [stats.interval([stats.value_at(rs, key, s) for rs in runs])[0]
                             for s in steps]
                    ax.plot(steps, means, color=colors[setting], lw=2, label=setting)
            ax.set_xlabel(label)
            ax.set_ylabel(metric_label(key), fontsize=8)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{name}: each seed (thin) and the setting's mean (thick)", fontsize=10)
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
            ax.set_title(f"{setting}: {metric_label(key)}", fontsize=8)
            ax.set_xlabel("step", fontsize=8)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"{name}: every seed", fontsize=10)
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
        ax.set_xlabel(metric_label(key))
        ax.set_ylabel("validation success")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"{name}: the diagnosis against success (a point: one seed at one step)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "scatter.png"), dpi=100)
    plt.close(fig)
    fig4(name, data, out)


def fig4(name, data, out):
    """fig4.png, where the runs logged gradient decompositions: Fig. 4 as the paper draws it, a
    panel per setting -- per reward-spread bucket, the task and regulariser gradient norms (bars:
    the mean over seeds of each seed's mean over its decompositions, with the 95% t half-width
    over the seeds) and the bucket's reward spread (a line)."""
    import matplotlib.pyplot as plt

    by_setting = {}
    for (setting, seed), records in sorted(data.items()):
        decompositions = [r["grad_decomposition"] for r in records if r.get("grad_decomposition")]
        if decompositions:
            by_setting.setdefault(setting, []).append(plots.bucket_means(decompositions))
    if not by_setting:
        return
    fig, axes = plt.subplots(1, len(by_setting), figsize=(5.0 * len(by_setting), 3.6),
                             squeeze=False)
    for ax, (setting, seeds) in zip(axes[0], by_setting.items()):
        n = min(map(len, seeds))
        keys = ("mean_std", "task_grad_norm", "reg_grad_norm")
        cells = [{k: stats.interval([s[b][k] for s in seeds]) for k in keys} for b in range(n)]
        means = [{k: c[k][0] for k in keys} for c in cells]
        errors = [{k: c[k][1] or 0.0 for k in keys} for c in cells]
        plots.draw_buckets(ax, means, f"{name} / {setting}: Fig. 4, {len(seeds)} seeds", errors)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "fig4.png"), dpi=100)
    plt.close(fig)
