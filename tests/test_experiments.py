"""experiments.py, grids.py, stats.py, report.py: the grids' command lines, resuming, the archives, the
statistics (intervals over seeds, values at a count of optimiser steps, onsets, correlations by
seed), the report's refusals -- on small synthetic runs (no training here); and the committed tables
equal the ones regenerated from the committed per-run archives."""
import csv
import filecmp
import gzip
import json
import math
import os
import re
import shutil
import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import t

import train
from lab import experiments, grids, protocol, real_grids, reasonings, report, stats
from plumbing import defaults, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTPUTS = ("table.md", "table.csv", "decisions.csv", "correlations.csv", "leadlag.csv", "numbers.json",
           "perseed.csv", "search.csv", "gradients.csv", "replication.csv", "policies.csv", "samples.csv",
           "dials.csv", "correlations-grounded.csv", "reasonings.csv")


def fake_run(folder, steps, success, mi, val=None, kept=4, opt=2, decomposition=True, template=None):
    """A metrics.jsonl whose metrics change over the steps: train success and token entropy drift,
    validation (every 10 steps) and the diagnoses (step 1, every 5) follow `val` and `mi`."""
    os.makedirs(folder)
    val = val or (lambda s: success)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for s in range(0, steps + 1):
            r = {"step": s}
            if s:
                r.update(train_success=success + 0.01 * s, kept_ratio=0.5, num_kept=kept, num_zero_var=2,
                         zero_var_fail_frac=0.25, optimizer_steps=opt, time_step=1.0,
                         token_entropy=0.1 + 0.01 * s)
            if s % 10 == 0 and s and decomposition:  # Fig. 4: the task norm = 2 x spread, the regulariser's 1
                r["grad_decomposition"] = [
                    {"bucket": b, "groups": [b], "mean_std": 0.1 * b, "mean_var": 0.01 * b * b,
                     "task_grad_norm": 0.2 * b, "kl_grad_norm": 0.0, "entropy_grad_norm": 1.0,
                     "reg_grad_norm": 1.0} for b in range(6)]
            if s % 5 == 0 and s or s == 1:
                r.update(mi_estimate=mi(s), probe_mi_estimate=mi(s), probe_mi_estimate_se=0.01,
                         probe_reasoning_entropy=1.0, probe_conditional_entropy=1.0 - mi(s))
                if template:
                    r["probe_template_share"] = template(s)
            if s % 10 == 0:
                r["val_success"] = val(s)
            f.write(json.dumps(r) + "\n")


@pytest.fixture
def grid(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(grids.GRIDS, "toy", dict(
        claim="a toy grid", flags=["--env", "bandit"], world="bandit",
        settings={"a": ["--filter", "none"], "b": ["--filter", "topp"]},
        seeds=[0, 1, 2, 3, 4], steps=20, table_steps=[10, 20],
        decide=[dict(kind="paired", metric="val_success", a=("b", "step", 20), b=("a", "step", 20),
                     sign=1, text="b beats a"),
                dict(kind="paired", metric="val_success", a=("b", "optimizer_steps", 20),
                     b=("a", "optimizer_steps", 20), sign=1, text="b beats a at 20 optimiser steps"),
                dict(kind="leadlag", setting="a", a="probe_mi_estimate", b="val_success", sign=1,
                     text="MI falls first")]))
    return "toy"


SUCCESS = (0.2, 0.6, 0.4, 0.5, 0.3, 0.5, 0.9, 0.7, 0.8, 0.6)  # a's five seeds, then b's: b - a = 0.3


def toy_runs(grid, steps=20):
    for (setting, seed, folder, _), success in zip(grids.runs_of(grid), SUCCESS):
        # validation rises by 0.01 a step from the run's level: at 20 steps it is level + 0.2
        fake_run(folder, steps, success, lambda s: 1.0 - 0.02 * s, val=lambda s, v=success: v + 0.01 * s,
                 opt=4 if setting == "a" else 2)
        experiments.archive(folder, grid)


# ------------------------------------------------------------------------------------------- grids

def test_every_setting_and_seed_has_its_command_line(grid):
    runs = grids.runs_of(grid)
    assert [(s, seed) for s, seed, _, _ in runs][:6] == [("a", 0), ("a", 1), ("a", 2), ("a", 3), ("a", 4), ("b", 0)]
    setting, seed, folder, argv = runs[6]
    assert folder == os.path.join("runs", "experiments", "toy", "b-s1")
    assert argv[:4] == ["--env", "bandit", "--filter", "topp"] and argv[-6:] == [
        "--seed", "1", "--steps", "20", "--out", folder]
    assert "--threads" in argv and argv[argv.index("--threads") + 1] == "1"  # side by side


def test_every_grid_parses_as_train_flags_and_claims_get_five_seeds():
    assert grids.GRIDS
    for name, g in grids.GRIDS.items():
        for _, _, _, argv in grids.runs_of(name):
            args = flags.parse_args(train.Args, argv)  # every flag is a real train.py flag
            assert args.model == ("smollm2" if name.startswith("smollm2") else "tiny")  # never by machine
        if g["decide"] and g["decide"][0]["kind"] != "search":  # at least 5 seeds for a claim,
            assert len(g["seeds"]) >= 5 and len(set(g["seeds"])) == len(g["seeds"]), name
            assert g["seeds"] == [0, 1, 2, 3, 4] or not set(g["seeds"]) & {0, 1, 2, 3, 4}, name
        for rule in g["decide"]:  # new seeds for a replication: never mixed with the old
            for side in ("a", "b"):
                if rule["kind"] in ("paired", "wilcoxon"):
                    other, _, setting = rule[side][0].rpartition("/")
                    assert setting in grids.GRIDS[other or name]["settings"]
        assert grids.estimate_hours(name) > 0


def test_the_registrations_before_measuring_are_well_formed():
    """The iso-entropy families, template-grow and template-control: their flags are train.py's
    (the template kind and the filler read back), every rule reads a metric a run logs, and each
    grid asks what it claims: five levels of ALPHA a world, no template-rich KL reference in
    template-grow, equal optimiser steps in template-control."""
    from lab import calibration
    for name in ("iso-hz", "iso-hzx"):
        g = grids.GRIDS[name]
        assert g["kind"] == "calibration" and g["seed_flags"] == ["--warm-start-seed"]
        for setting, _, _, argv in grids.runs_of(name):
            a = flags.parse_args(train.Args, argv)
            assert a.template_kind == "surface" and a.probe_prompts == 32
            assert (a.filler is None) == (name == "iso-hz")
            assert a.template_prior in protocol.ALPHAS
        worlds = grids.ISO_WORLDS[name]
        assert len(g["settings"]) == 5 * len(worlds)
        kinds = [r["kind"] for r in g["decide"]]
        assert kinds.count("tracks") == len(grids.MI_METRICS) * len(worlds)
        assert kinds.count("level") == len(grids.LEVEL[name]) * len(worlds)
        assert all(r["metric"] in calibration.POLICY and r["world"] in worlds for r in g["decide"])
    levels = {r["metric"] for r in grids.GRIDS["iso-hzx"]["decide"] if r["kind"] == "level"}
    assert {"token_entropy", "probe_conditional_entropy_seq"} <= levels
    with pytest.raises(flags.UsageError, match="--filler must be in"):
        flags.parse_args(train.Args, ["--filler", "0.9"])
    for _, _, _, argv in grids.runs_of("template-grow"):
        a = flags.parse_args(train.Args, argv)
        assert a.kl_template_prior is None and a.kl_coef > 0 and a.success_rate < 1
        assert 0.1 <= a.template_prior <= 0.25 and a.steps == 300
    steps = {s: flags.parse_args(train.Args, argv).optimizer_steps
             for s, _, _, argv in grids.runs_of("template-control")}
    assert steps == {"topk-opt2": 2, "random-opt2": 2, "random-opt4": 4}
    for name in ("template-grow", "template-control"):
        for r in grids.GRIDS[name]["decide"]:
            metrics = [r["metric"]] if r["kind"] == "paired" else [r["a"], r["b"]]
            assert all(m in protocol.ONSET or m in protocol.TEMPLATE + protocol.METRICS for m in metrics)


def test_the_estimate_comes_from_the_archived_step_times(grid):
    """A grid whose runs are archived is estimated from their measured time_step (the toy's fake
    runs: 1 s a step), a setting not archived from the registered seconds (a world not measured,
    the bandit: the slowest)."""
    registered = grids.estimate_hours(grid)
    assert registered == pytest.approx(10 * 20 * max(grids.SECONDS_PER_STEP.values()) / 2 / 3600)
    toy_runs(grid)
    assert grids.estimate_hours(grid) == pytest.approx(10 * 20 * 1.0 / 2 / 3600)
    assert "from its archived runs' step times" in grids.describe(grid)
    for seed in grids.GRIDS[grid]["seeds"]:  # setting b not archived: its 5 runs as registered
        os.remove(os.path.join(protocol.RESULTS, grid, "runs", f"b-s{seed}.jsonl.gz"))
    assert grids.estimate_hours(grid) == pytest.approx((registered + 10 * 20 / 2 / 3600) / 2)


def test_a_finished_run_is_not_run_again(grid):
    _, _, folder, _ = grids.runs_of(grid)[0]
    fake_run(folder, 20, 0.5, lambda s: 0.3)
    assert experiments.finished(folder, 20) and not experiments.finished(folder, 30)
    with open(os.path.join(folder, "metrics.jsonl"), "a") as f:  # then train.py stopped it: no spread
        for s in range(21, 21 + train.MAX_SKIPS):
            f.write(json.dumps({"step": s, "skipped": True}) + "\n")
    assert experiments.finished(folder, 30)


def test_the_archive_keeps_every_scalar_gzipped_and_reproducible(grid):
    _, _, folder, _ = grids.runs_of(grid)[0]
    fake_run(folder, 20, 0.5, lambda s: 0.1 * s / 3)
    path = experiments.archive(folder, grid)
    first = open(path, "rb").read()
    assert experiments.archive(folder, grid) == path and open(path, "rb").read() == first
    records = [json.loads(line) for line in gzip.open(path, "rt")]
    assert [r["step"] for r in records] == list(range(21))
    assert "grad_decomposition" not in records[5] and "probe_mi_estimate_se" in records[5]
    assert records[10]["grad_decomposition"][1] == {  # trimmed to the numbers Fig. 4 needs
        "mean_std": 0.1, "task_grad_norm": 0.2, "kl_grad_norm": 0.0, "entropy_grad_norm": 1.0,
        "reg_grad_norm": 1.0}
    assert records[5]["probe_mi_estimate"] == float(f"{0.5 / 3:.6g}") and records[5]["time_step"] == 1.0
    assert experiments.archive(os.path.join("runs", "nowhere"), grid) is None
    assert not os.path.exists(path.replace(".jsonl.gz", ".provenance.json"))  # a run without one


def test_the_archive_says_what_ran_it(grid):
    """Beside the archive: each process's commit, command line and starting weights as the run
    folder recorded them, and its settings."""
    _, _, folder, _ = grids.runs_of(grid)[0]
    fake_run(folder, 20, 0.5, lambda s: 0.1)
    ran = [{"commit": "f" * 40, "dirty": False, "argv": ["--seed", "0"], "after_step": 0,
            "weights_sha256": "0" * 16}]
    json.dump(ran, open(os.path.join(folder, "provenance.json"), "w"))
    json.dump({"seed": 0}, open(os.path.join(folder, "config.json"), "w"))
    path = experiments.archive(folder, grid).replace(".jsonl.gz", ".provenance.json")
    assert json.load(open(path)) == {"provenance": ran, "config": {"seed": 0}}


def real_model_run(folder, ways, own_share):
    """A real model's metrics.jsonl: validation every 10 steps rising, at the diagnoses (step 1,
    every 5) the probe set's three prompts' reasonings as text -- the share own_share(s) stating
    their own input's way, the rest another's -- with the grounded share and an MI that follow it
    (the first two prompts' inputs have the same way: the third's is the other way they state)."""
    os.makedirs(folder)
    say = lambda w: f" {abs(w[0])} {'Up' if w[0] < 0 else 'Down'}, {abs(w[1])} {'Left' if w[1] < 0 else 'Right'}."
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for s in range(0, 21):
            r = {"step": s}
            if s:
                r.update(train_success=0.5, time_step=1.0, token_entropy=0.5, response_length=20.0,
                         optimizer_steps=1)
            if s % 5 == 0 and s or s == 1:
                own = round(own_share(s) * 4)  # of each prompt's 4 samples
                other = [ways[2], ways[2], ways[0]]
                texts = [say(ways[p] if k < own else other[p]) for p in range(3) for k in range(4)]
                r.update(probe_reasonings=texts, probe_grounded_share=own / 4, probe_mi_estimate=own / 40,
                         mi_zscore=own / 4, probe_retrieval_acc=0.5, probe_reasoning_entropy=1.0,
                         probe_conditional_entropy=1.0)
            if s % 10 == 0:
                r["val_success"] = 0.3 + 0.01 * s
            f.write(json.dumps(r) + "\n")


def test_a_real_models_report_reads_its_grounded_share_and_what_its_reasoning_says(tmp_path, monkeypatch):
    """A grid of a real model reading coordinates: the archives keep the probe reasonings (text),
    the report correlates the grid's dials with the grounded share, labels every reasoning of the
    first and last diagnosis exactly (reasonings.csv), and decides a rule with a margin."""
    from warmstart import grounding
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(grids.GRIDS, "real", dict(
        claim="a real model", flags=real_grids.SMOLLM2_COORDS[:-4] + ["--probe-prompts", "3", "--probe-samples", "4"],
        common=grids.GRIDS["smollm2-coords"]["common"], world="frozenlake",
        settings={"none": ["--filter", "none"]}, seeds=[0, 1, 2, 3, 4], steps=20, table_steps=[0, 20],
        dials=["probe_mi_estimate", "mi_zscore", "token_entropy"],
        decide=[dict(kind="paired", metric="val_success", a=("none", "step", 20), b=("none", "step", 0),
                     sign=1, margin=0.1, text="rises by more than 0.1"),
                dict(kind="paired", metric="val_success", a=("none", "step", 20), b=("none", "step", 0),
                     sign=1, margin=0.3, text="rises by more than 0.3")]))
    ways = [grounding.input_way("frozenlake", {"size": 4, "success_rate": 1.0}, defaults.PROBE_SEED_BASE + p)
            for p in range(3)]
    assert ways[0] == ways[1] != ways[2]
    for _, seed, folder, _ in grids.runs_of("real"):
        real_model_run(folder, ways, lambda s: 1.0 - 0.025 * s)  # the grounded share falls
        experiments.archive(folder, "real")
    records = [json.loads(line) for line in gzip.open(report.archive_path("real", folder), "rt")]
    assert len(records[1]["probe_reasonings"]) == 12  # the texts are archived
    report.report("real", with_figures=False)
    text = open(os.path.join("results", "real", "table.md")).read()
    verdicts = [line.rsplit("|", 2)[1].strip() for line in text.splitlines() if line.startswith("| rises")]
    assert verdicts == ["holds", "contradicted"]  # + 0.2 exactly, every seed alike
    assert "## Spearman correlation with the probe set's grounded share" in text
    with open(os.path.join("results", "real", "correlations-grounded.csv")) as f:
        rows = {r["diagnostic"]: r for r in csv.DictReader(f) if r["scope"] == "within runs, by seed"}
    assert float(rows["probe_mi_estimate"]["rho"]) == pytest.approx(1.0)  # it tracks the share
    with open(os.path.join("results", "real", "reasonings.csv")) as f:
        said = list(csv.DictReader(f))
    first, last = ([r for r in said if r["seed"] == "0" and r["step"] == s] for s in ("1", "20"))
    assert [r["label"] for r in first] == ["grounded"] * 12  # step 1: every reasoning its own way
    assert [r["label"] for r in last] == (["grounded"] * 2 + ["borrowed"] * 2) * 3
    assert "## What the reasoning looks like" in text and "| none | 0 |" in text


# --------------------------------------------------------------------------------------- statistics

def test_no_interval_from_fewer_than_five_runs():
    m, half, n = stats.interval([0.1, 0.5, 0.3, 0.2, 0.4, None])
    sd = math.sqrt(sum((x - 0.3) ** 2 for x in (0.1, 0.5, 0.3, 0.2, 0.4)) / 4)
    assert (m, n) == (pytest.approx(0.3), 5) and half == pytest.approx(t.ppf(0.975, 4) * sd / math.sqrt(5))
    assert stats.interval([0.1, 0.5, 0.3, 0.2]) == (pytest.approx(0.275), None, 4)
    assert stats.interval([None]) == (None, None, 0)
    # runs that share a seed count once: the seed's mean
    assert stats.by_seed({("a", 0): 1.0, ("b", 0): 3.0, ("a", 1): 5.0, ("b", 1): None}) == [2.0, 5.0]


def test_a_value_at_a_count_of_optimiser_steps_is_interpolated_within_a_limit():
    # validation every 10 steps of 3 optimiser steps, success changing at each one
    records = [{"step": s, "optimizer_steps_total": 3 * s, "val_success": 0.1 * s / 10} for s in (0, 10, 20, 30)]
    assert stats.value_on(records, "val_success", "optimizer_steps", 30) == pytest.approx(0.1)  # exactly at one
    assert stats.value_on(records, "val_success", "optimizer_steps", 45) == pytest.approx(0.15)  # half-way
    assert stats.value_on(records, "val_success", "optimizer_steps", 40) == pytest.approx(0.1 + 0.1 / 3)
    assert stats.value_on(records, "val_success", "optimizer_steps", 91) is None  # past the run
    assert stats.value_on(records, "val_success", "optimizer_steps", 45, gap=20) is None  # 30 apart
    # two validations at the same count (skipped steps take no optimiser step): their mean, not the earlier
    tied = records + [{"step": 40, "optimizer_steps_total": 90, "val_success": 0.5}]
    assert stats.value_on(tied, "val_success", "optimizer_steps", 90) == pytest.approx(0.4)
    # at an environment step: validation at the step itself, a per-step metric averaged over the window
    steps = [{"step": s, "token_entropy": float(s)} for s in range(1, 21)]
    assert stats.value_on(steps, "token_entropy", "step", 20) == pytest.approx(15.5)  # mean of 11..20


def test_the_onset_is_a_sustained_move_in_the_series_own_noise_units():
    def run(mi, val):
        return [{"step": s, "val_success": val[s // 10]} for s in range(0, 71, 10)] + [
            {"step": s, "probe_mi_estimate": mi[i], "probe_mi_estimate_se": 0.05}
            for i, s in enumerate([1, 10, 20, 30, 40, 50, 60, 70])]
    mi = [0.80, 0.78, 0.82, 0.79, 0.60, 0.50, 0.40, 0.40]  # moves at 40 (4+ units of its se 0.05)
    val = [0.80, 0.90, 0.70, 0.80, 0.80, 0.30, 0.20, 0.20]  # noisy start (sd 0.1): moves at 50
    records = run(mi, val)
    assert stats.onset(records, "probe_mi_estimate") == 40
    assert stats.onset(records, "val_success") == 50
    blip = run([0.80, 0.78, 0.82, 0.79, 0.60, 0.79, 0.80, 0.40], val)  # one point alone is no onset
    assert stats.onset(blip, "probe_mi_estimate") is None
    # the diagnosis every 5 steps is read at the validation cadence only
    assert [p[0] for p in stats.cadence(records + [{"step": 45, "probe_mi_estimate": 0.0}],
                                        "probe_mi_estimate")] == [1, 10, 20, 30, 40, 50, 60, 70]


def test_spearman_is_scipys_with_ties():
    from scipy.stats import spearmanr

    xs, ys = [1, 2, 2, 3, 5, 5, 5, 0], [0.3, 0.1, 0.1, 0.9, 0.4, 0.8, 0.8, 0.2]
    assert stats.spearman(xs, ys) == pytest.approx(spearmanr(xs, ys).statistic, abs=1e-12)
    assert stats.spearman([1, 1, 1], [1, 2, 3]) is None


@given(st.lists(st.integers(0, 5), min_size=1, max_size=40))
def test_ranks_are_scipys_average_ranks(xs):
    from scipy.stats import rankdata

    assert stats.ranks(xs).tolist() == rankdata(xs).tolist()  # few values: many ties


# ---------------------------------------------------------------------------------------- decisions

def test_decision_rules_are_paired_differences_over_seeds(grid):
    toy_runs(grid)
    data = report.load(grid)
    rules = grids.GRIDS[grid]["decide"]
    d = report.decide(grid, data, rules[0])
    # b - a per seed at step 20: 0.3 each: zero spread, the interval is 0 wide
    assert d["estimate"] == pytest.approx(0.3) and d["n"] == 5 and d["verdict"] == "holds"
    assert d["values"] == "0.300 0.300 0.300 0.300 0.300"
    # at 20 optimiser steps: a (4 a step) is half-way between its validations at steps 0 and 10
    # (0 and 40 optimiser steps): level + 0.05; b (2 a step) at its step 10: level + 0.1
    assert stats.value_on(data[("a", 0)], "val_success", "optimizer_steps", 20) == pytest.approx(0.25)
    assert report.decide(grid, data, rules[1])["estimate"] == pytest.approx(0.3 + 0.05)
    assert report.decide(grid, data, dict(rules[0], sign=-1))["verdict"] == "contradicted"
    assert report.decide(grid, {}, rules[0])["verdict"] == "not run"
    few = {k: v for k, v in data.items() if k[1] < 3}  # three seeds: the estimate, no verdict
    d = report.decide(grid, few, rules[0])
    assert d["n"] == 3 and d["low"] is None and d["verdict"] == "3 runs: no interval"


def test_smollm2_grows_registered_rules_read_its_template_share_on_runs_whose_answer_is_known():
    """R1 and R2 as registered, on made-up runs: the template share of the probe at step 1 and at
    step 40 (exact at the step: a step-39 or step-41 record never stands in), paired by seed."""
    rules = {rule["text"][:2]: rule for rule in grids.GRIDS["smollm2-grow"]["decide"]}
    assert set(rules) == {"R1", "R2"}

    def runs(rise, below):
        data = {}
        for seed in range(5):
            start = 0.2 + 0.01 * seed  # the seed's step-1 probe, the same sample under both rules
            for setting, end in (("none", start + rise + 0.01 * seed),
                                 ("topp", start + rise + 0.01 * seed - below - 0.005 * seed)):
                data[setting, seed] = [{"step": s, "probe_template_share": v} for s, v in
                                       ((1, start), (10, 0.9), (39, 0.9), (40, end), (41, 0.9))]
        return data

    r1, r2 = (report.decide("smollm2-grow", runs(0.2, 0.1), rules[k]) for k in ("R1", "R2"))
    assert (r1["estimate"], r1["n"], r1["verdict"]) == (pytest.approx(0.22), 5, "holds")
    assert (r2["estimate"], r2["n"], r2["verdict"]) == (pytest.approx(-0.11), 5, "holds")
    r1, r2 = (report.decide("smollm2-grow", runs(-0.1, -0.1), rules[k]) for k in ("R1", "R2"))
    assert r1["verdict"] == "contradicted" and r2["verdict"] == "contradicted"
    assert report.decide("smollm2-grow", {k: v for k, v in runs(0.2, 0.1).items() if k[1] < 4},
                         rules["R1"])["verdict"] == "4 runs: no interval"


def test_smollm2_grow_2s_registered_rules_decide_by_rank_on_runs_whose_answer_is_known():
    """R2r, R3 and incidence as registered, on made-up runs of seeds 5-12: the exact signed-rank
    test decides (one large difference does not), the t interval stands beside it, a take-over
    is a step-40 share of at least 0.5, and a seed above it in two arms is named."""
    rules = {rule["text"].split(":")[0]: rule for rule in grids.GRIDS["smollm2-grow-2"]["decide"]}
    assert set(rules) == {"R2r", "R3", "incidence"}
    assert grids.GRIDS["smollm2-grow-2"]["seeds"] == list(range(5, 13))

    def runs(topp_minus_none, topp_minus_random):
        data = {}
        for i, seed in enumerate(range(5, 13)):
            none = 0.1 + 0.01 * i
            ends = {"none": none, "topp": none + topp_minus_none[i],
                    "random": none + topp_minus_none[i] - topp_minus_random[i]}
            for setting, end in ends.items():
                data[setting, seed] = [{"step": s, "probe_template_share": v} for s, v in
                                       ((1, 0.25), (39, 0.9), (40, end), (41, 0.9))]
        return data

    up = [0.05, 0.1, 0.02, 0.08, 0.06, 0.03, 0.07, 0.04]  # 8 of 8 above: p = 2/256
    one_big = [0.8, -0.01, -0.02, -0.03, 0.01, -0.04, -0.05, 0.0]  # mean above 0, ranks not
    data = runs(up, one_big)
    r2r, r3 = (report.decide("smollm2-grow-2", data, rules[k]) for k in ("R2r", "R3"))
    assert r2r["verdict"].startswith("holds (p = 0.0078") and r2r["n"] == 8
    assert r2r["estimate"] == pytest.approx(sum(up) / 8) and r2r["low"] > 0
    assert r3["verdict"].startswith("undecided") and "7 non-zero" in r3["verdict"]
    assert r3["estimate"] > 0  # the mean says more than the ranks: the rank test decides
    down = report.decide("smollm2-grow-2", runs([-x for x in up], up), rules["R2r"])
    assert down["verdict"].startswith("contradicted (p = 0.0078")
    data["topp", 5][2]["probe_template_share"] = 0.5  # seed 5 takes over under Top-P and random
    data["random", 5][2]["probe_template_share"] = 0.7
    data["none", 6][2]["probe_template_share"] = 0.49  # just below: no take-over
    verdict = report.decide("smollm2-grow-2", data, rules["incidence"])["verdict"]
    assert verdict == ("none 0/8 (0.000 .. 0.369); topp 1/8 (0.003 .. 0.527); random 1/8 "
                       "(0.003 .. 0.527); in more than one setting: s5 (topp, random)")
    assert report.decide("smollm2-grow-2", {}, rules["incidence"])["verdict"] == "not run"


def main_table_runs(gains, control=None):
    """Made-up main-table runs: no filter's validation success at the last step 0.3 + 0.01 x seed
    in every cell, Top-P's that plus gains[cell][seed] (0 where a cell is not named), and a random
    control's Top-P's minus control[cell][seed]; archived as the runner archives them."""
    steps = grids.MAIN_STEPS
    for setting, seed, folder, _ in grids.runs_of("main-table") + grids.runs_of("main-table-control"):
        cell, _, kind = setting.rpartition("-")
        base = 0.3 + 0.01 * seed
        end = {"none": base, "topp": base + gains.get(cell, [0.0] * 5)[seed],
               "random": base + gains.get(cell, [0.0] * 5)[seed] - (control or {}).get(cell, [0.0] * 5)[seed]}
        if kind == "random" and cell not in (control or {}):
            continue  # a control not run
        fake_run(folder, steps, 0.5, lambda s: 0.5, val=lambda s, v=end[kind]: v if s == steps else 0.2,
                 decomposition=False)
        experiments.archive(folder, "main-table-control" if kind == "random" else "main-table")


def test_the_main_tables_rules_and_follow_up_decide_on_made_up_runs(tmp_path, monkeypatch, capsys):
    """main-table as registered: one paired rule a cell (16: four worlds by four algorithms), Top-P
    minus no filter at the last step; the follow-up names the cells whose interval excludes 0 --
    a gain in every seed, a loss in every seed -- and not one whose seeds disagree; its control
    grid runs those cells only and decides Top-P against the random subset of its count."""
    monkeypatch.chdir(tmp_path)
    g, steps = grids.GRIDS["main-table"], grids.MAIN_STEPS
    cells = list(grids.main_table_cells())
    assert len(cells) == 16 and len(g["settings"]) == 32 and g["seeds"] == [0, 1, 2, 3, 4]
    assert {c.split("-")[0] for c in cells} == {"sokoban", "frozenlake", "wordproblems", "countdown"}
    assert {c.split("-")[1] for c in cells} == {"ppo", "dapo", "grpo", "drgrpo"}
    for setting, _, _, argv in grids.runs_of("main-table") + grids.runs_of("main-table-control"):
        a = flags.parse_args(train.Args, argv)  # each run is what its name says
        assert setting == f"{a.env}-{a.algo}-{a.filter}" and a.model == "tiny" and a.steps == steps
        assert (a.groups, a.group_size, a.kl_coef, a.top_p) == (8, 16, 0.0, 0.9)
        assert a.filter != "random" or a.control_of == "topp"
    assert grids.estimate_hours("main-table") == pytest.approx(8, abs=1.5)  # the grid's size
    gains = {"sokoban-ppo": [0.10, 0.12, 0.08, 0.11, 0.09],       # holds
             "frozenlake-grpo": [-0.05, -0.06, -0.04, -0.05, -0.07],  # contradicted
             "countdown-dapo": [0.2, -0.2, 0.1, -0.1, 0.05]}         # undecided
    control = {"sokoban-ppo": [0.05, 0.06, 0.04, 0.05, 0.05],     # Top-P beats its random subset
               "frozenlake-grpo": [0.0, 0.01, -0.01, 0.02, -0.02]}  # it does not
    main_table_runs(gains, control)
    data = report.load("main-table")
    rows = {r.get("cell", r["kind"]): report.decide("main-table", data, r) for r in g["decide"]}
    assert rows["sokoban-ppo"]["verdict"] == "holds" and rows["sokoban-ppo"]["estimate"] == pytest.approx(0.1)
    assert rows["frozenlake-grpo"]["verdict"] == "contradicted" and rows["countdown-dapo"]["verdict"] == "undecided"
    assert rows["countdown-ppo"]["estimate"] == pytest.approx(0.0) and rows["countdown-ppo"]["verdict"] == "undecided"
    assert rows["followup"]["verdict"] == "control to run (main-table-control): sokoban-ppo, frozenlake-grpo"
    assert report.controlled_cells("main-table") == ["sokoban-ppo", "frozenlake-grpo"]
    chosen = experiments.selected_runs("main-table-control")
    assert sorted((s, seed) for s, seed, _, _ in chosen) == sorted(
        (f"{c}-random", seed) for c in ("frozenlake-grpo", "sokoban-ppo") for seed in range(5))
    assert "the cells main-table's rule selects: sokoban-ppo, frozenlake-grpo" in capsys.readouterr().out
    control_data = report.load("main-table-control")
    verdicts = {r["b"][0]: report.decide("main-table-control", control_data, r)["verdict"]
                for r in grids.GRIDS["main-table-control"]["decide"]}
    assert verdicts["sokoban-ppo-random"] == "holds" and verdicts["frozenlake-grpo-random"] == "undecided"
    assert verdicts["countdown-dapo-random"] == "not run"
    empty = report.decide("main-table", {}, g["decide"][-1])
    assert empty["verdict"] == "not run"
    flat = {key: r for key, r in data.items() if key[0].startswith(("wordproblems", "countdown-ppo"))}
    assert report.decide("main-table", flat, g["decide"][-1])["verdict"].startswith("no cell's interval")
    report.report("main-table", with_figures=False)
    table = open(os.path.join("results", "main-table", "table.md")).read()
    assert "## The paper's matrix beside ours" in table
    ppo_row = next(line for line in table.splitlines() if line.startswith("| ppo |"))
    assert "32.0 (+10.0 ± " in ppo_row and "paper 12.9 (+16.0)" in ppo_row  # no filter 0.3 + 0.01 x 2


def test_the_signed_rank_test_equals_scipys_exact_one_and_counts_ties_exactly():
    from scipy.stats import wilcoxon
    for d in ([0.3, -0.1, 0.2, 0.4, 0.5, -0.6, 0.7, 0.8], [1, 2, 3, -4, 5, 6], [0.1] * 3 + [-0.2]):
        if len(set(abs(x) for x in d)) == len(d):
            assert stats.signed_rank(d)[0] == pytest.approx(wilcoxon(d, method="exact").pvalue)
    # ties: |d| = 1, 1, 2 -> ranks 1.5, 1.5, 3; W+ = 3 + 1.5 = 4.5 of 6, centre 3: the 8 sign
    # patterns give W+ in {0, 1.5, 1.5, 3, 3, 4.5, 4.5, 6}: |W+ - 3| >= 1.5 in 6 of them
    assert stats.signed_rank([1, -1, 2]) == (6 / 8, 4.5, 1.5, 3)


def test_a_verdict_needs_the_whole_interval_on_one_side():
    """A rule predicting a fall (sign -1) once read an interval across 0 as "holds"."""
    assert report.side(-0.18, 0.57, -1) == report.side(-0.18, 0.57, 1) == "undecided"
    assert report.side(-0.47, -0.16, -1) == "holds" and report.side(-0.47, -0.16, 1) == "contradicted"
    assert report.side(0.05, 0.66, 1) == "holds" and report.side(0.05, 0.66, -1) == "contradicted"


def test_lead_lag_compares_the_onsets_run_by_run(grid):
    def records(mi_drop, val_drop):
        return [{"step": s, "val_success": 0.9 if s < val_drop else 0.1} for s in range(0, 101, 10)] + [
            {"step": s, "probe_mi_estimate": 0.8 if s < mi_drop else 0.2} for s in [1] + list(range(10, 101, 10))]
    data = {("a", seed): records(40, 40 + 10 * seed) for seed in range(5)}
    d = report.decide(grid, data, grids.GRIDS[grid]["decide"][2])
    assert d["values"] == "0.000 10.000 20.000 30.000 40.000" and d["estimate"] == pytest.approx(20)
    assert d["verdict"] == "holds"
    data[("a", 4)] = records(40, 200)  # success never moves: no lag for that run
    assert report.decide(grid, data, grids.GRIDS[grid]["decide"][2])["n"] == 4


def test_fig4_statistics_from_the_gradient_decompositions(grid):
    toy_runs(grid)
    data = report.load(grid)
    records = data[("a", 0)]
    # the task norm rises with spread exactly (rho 1), the regulariser's is constant (0)
    assert stats.gradient_stat(records, "rho_task_minus_reg") == pytest.approx(1.0)
    # the lowest bucket with spread: task 0.2, regulariser 1 -> share 1 / 1.2; the highest: 1.0
    # against 1 -> share 1/2 (the bucket without spread, task 0, is not the one compared)
    assert stats.gradient_stat(records, "reg_share_low") == pytest.approx(1 / 1.2 - 0.5)
    assert stats.gradient_stat(records, "reg_share_high") == pytest.approx(0.0)
    assert stats.gradient_stat([{"step": 1}], "reg_share_low") is None
    rule = dict(kind="gradients", setting="b", stat="reg_share_low", sign=1, text="reg wins")
    d = report.decide(grid, data, rule)
    assert (d["n"], d["estimate"], d["verdict"]) == (5, pytest.approx(1 / 1.2 - 0.5), "holds")
    rows = report.gradient_table(grid, data)
    assert [(r["setting"], r["bucket"]) for r in rows][:2] == [("a", 1), ("a", 2)]
    assert rows[5]["task_grad_norm"] == pytest.approx(1.0) and rows[5]["runs"] == 5
    assert rows[5]["task_grad_norm_ci95"] == pytest.approx(0.0)


def test_correlations_by_seed_within_worlds_and_pooled(grid, monkeypatch):
    """MI rises with success inside every run; between runs the offsets are unrelated. A second world
    (setting b) brings the within-world rows and the pooled footnote."""
    monkeypatch.setitem(grids.GRIDS[grid], "world", None)
    monkeypatch.setitem(grids.GRIDS[grid]["settings"], "b", ["--env", "frozenlake", "--filter", "topp"])
    for i, (_, _, folder, _) in enumerate(grids.runs_of(grid)):
        fake_run(folder, 40, 0.5, lambda s, i=i: 0.01 * s + 0.1 * (i % 2),
                 val=lambda s, i=i: 0.02 * s + 0.2 * ((i + 1) % 3))
        experiments.archive(folder, grid)
    within, worlds = report.correlations(grid, report.load(grid), resamples=50)
    run_mi = next(c for c in within if c["diagnostic"] == "probe_mi_estimate")
    assert run_mi["rho"] == pytest.approx(1.0) and run_mi["n"] == 5  # five seeds, not ten runs
    assert run_mi["low"] == pytest.approx(1.0) and run_mi["high"] == pytest.approx(1.0)
    cond = next(c for c in within if c["diagnostic"] == "probe_conditional_entropy")
    assert cond["rho"] == pytest.approx(-1.0)
    const = next(c for c in within if c["diagnostic"] == "probe_reasoning_entropy")
    assert const["rho"] is None  # a constant ranks nothing, and the report says which one it was
    assert report.constant_dials(grid, report.load(grid)) == {"probe_reasoning_entropy": 1.0}
    rows = {(c["scope"], c["world"]): c for c in worlds if c["diagnostic"] == "probe_mi_estimate"}
    assert set(rows) == {("within world", "--env bandit"), ("within world", "--env frozenlake"),
                         ("pooled", "pooled (footnote)")}
    # within a world the runs' offsets mix in: their points together, not rho 1
    for key in (("within world", "--env bandit"), ("pooled", "pooled (footnote)")):
        assert 0.3 < rows[key]["rho"] < 1.0 and rows[key]["low"] <= rows[key]["rho"] <= rows[key]["high"]
    assert rows[("within world", "--env bandit")]["n"] == 5


def test_the_regime_search_needs_all_three_criteria_and_shows_them_run_by_run():
    """A run is a regime only with zero-spread all-fail groups >= 0.5 on average, the last two probe
    MIs at most half the first, and the last validation 0.1 below the best; each run's numbers are
    the report's search table."""
    def records(fail, mi_last, val_last):
        out = [{"step": 0, "val_success": 0.8}]
        for s in range(1, 21):
            r = {"step": s, "zero_var_fail_frac": fail, "train_success": 0.1}
            if s % 5 == 0 or s == 1:
                r["probe_mi_estimate"] = 1.0 if s < 15 else mi_last
            if s % 10 == 0:
                r["val_success"] = 0.8 if s < 20 else val_last
            out.append(r)
        return out
    data = {("regime", 0): records(0.6, 0.5, 0.7), ("easy", 0): records(0.4, 0.5, 0.7),
            ("kept-mi", 0): records(0.6, 0.51, 0.7), ("kept-success", 0): records(0.6, 0.5, 0.71)}
    rows = {r["setting"]: r for r in stats.search_criteria(data)}
    assert [s for s, r in rows.items() if r["regime"]] == ["regime"]
    assert rows["regime"]["probe_mi_first"] == 1.0 and rows["regime"]["probe_mi_last_two"] == 0.5
    assert rows["easy"]["zero_var_fail_frac"] == pytest.approx(0.4)
    assert rows["kept-success"]["val_best"] == 0.8 and rows["kept-success"]["val_last"] == 0.71
    assert rows["regime"]["train_success"] == pytest.approx(0.1)
    decision = report.search(data, {"text": "rule"})
    assert decision["verdict"] == "regime found: regime-s0" and decision["n"] == 4
    assert report.search({}, {"text": "rule"})["verdict"] == "not run"


def test_the_template_search_asks_for_a_growth_of_the_template_share():
    """A run is a template-collapse regime when the probe set's template share of its last two
    diagnoses is at least 0.2 above its first diagnosis's; MI, H(Z) and validation stand beside it."""
    def records(last, mi_last=1.0):
        out = [{"step": 0, "val_success": 0.8}]
        for s in range(1, 21):
            r = {"step": s, "zero_var_success_frac": 0.3, "zero_var_fail_frac": 0.2}
            if s % 5 == 0 or s == 1:
                late = s >= 15
                r.update(probe_template_share=last if late else 0.1,
                         probe_mi_estimate=mi_last if late else 1.0, probe_reasoning_entropy=2.0)
            if s % 10 == 0:
                r["val_success"] = 0.7
            out.append(r)
        return out
    data = {("grew", 0): records(0.3, mi_last=0.4), ("short", 0): records(0.29)}
    rows = {r["setting"]: r for r in stats.template_criteria(data)}
    assert [s for s, r in rows.items() if r["regime"]] == ["grew"]
    assert rows["grew"]["probe_mi_last_two"] == 0.4 and rows["grew"]["zero_var_frac"] == 0.5
    assert rows["short"]["template_last_two"] == 0.29 and rows["short"]["val_best"] == 0.8
    rule = {"text": "rule", "criteria": "template"}
    assert report.search(data, rule)["verdict"] == "regime found: grew-s0"
    assert report.search(data, {"text": "rule"})["verdict"] == "no regime found"  # the collapse search's


# ------------------------------------------------------------------------------------------ the report

def test_the_table_is_a_t_interval_over_seeds(grid):
    toy_runs(grid)
    rows = {(r["setting"], r["step"]): r for r in report.report(grid)}
    a = rows[("a", 20)]
    # train success: the run's level + 0.01 a step, averaged over steps 11..20: level + 0.155
    levels = SUCCESS[:5]
    assert a["train_success"] == pytest.approx(sum(levels) / 5 + 0.155) and a["runs"] == a["finished"] == 5
    sd = math.sqrt(sum((x - sum(levels) / 5) ** 2 for x in levels) / 4)
    assert a["train_success_ci95"] == pytest.approx(t.ppf(0.975, 4) * sd / math.sqrt(5))
    assert a["val_success"] == pytest.approx(sum(levels) / 5 + 0.2)  # at the step itself
    assert a["probe_mi_estimate"] == pytest.approx(0.6)
    assert a["optimizer_steps_total"] == 80 and rows[("b", 20)]["optimizer_steps_total"] == 40
    assert a["trajectories_total"] == 20 * 4 * defaults.GROUP_SIZE
    text = open(os.path.join("results", "toy", "table.md")).read()
    assert f"| a | 20 | 5 (5) | {a['val_success']:.3f} ± {a['val_success_ci95']:.3f} |" in text
    # the toy runs' H(Z) never moves: no rho, and the line under the table says why
    assert "probe_reasoning_entropy is 1.000 at every point of every run" in text
    assert "probe_mi_estimate is" not in text
    for name in ("curves", "perseed", "scatter", "fig4"):  # the toy runs decompose their gradients
        assert os.path.isfile(os.path.join("results", "toy", f"{name}.png"))


def test_the_template_share_is_reported_only_where_runs_logged_it(grid):
    toy_runs(grid)
    report.report(grid, with_figures=False)
    text = open(os.path.join("results", grid, "table.md")).read()
    assert "probe_mi_estimate" in text and "template_share" not in text
    shutil.rmtree("runs")
    shutil.rmtree(os.path.join("results", grid))
    for setting, seed, folder, _ in grids.runs_of(grid):  # level until step 20, then +0.02 a step
        fake_run(folder, 40, 0.5, lambda s: 0.5, template=lambda s: 0.1 + 0.02 * max(0, s - 20))
        experiments.archive(folder, grid)
    rows = report.report(grid, with_figures=False)
    assert rows[-1]["probe_template_share"] == pytest.approx(0.1)  # b at step 20
    text = open(os.path.join("results", grid, "table.md")).read()
    assert "| val_success | probe_template_share | probe_mi_estimate |" in text
    leads = json.load(open(os.path.join("results", grid, "numbers.json")))["leadlag"]
    # the baseline (steps 1, 10, 20) is level, so the noise is the floor 0.0625: 0.2 at step 30 is
    # 3.2 units, and 0.4 at step 40 keeps it there; the MI never moves
    assert [r["probe_template_share"] for r in leads] == [30] * 10
    assert all(r["probe_mi_estimate"] is None for r in leads)


def test_report_regenerates_the_same_tables_from_the_archives_alone(grid, tmp_path):
    toy_runs(grid)
    report.report(grid, with_figures=False)
    shutil.rmtree("runs")  # the run folders are not committed: the report needs only the archives
    again = tmp_path / "again"
    shutil.copytree(os.path.join("results", grid, "runs"), again / grid / "runs")  # the archives only
    report.report(grid, results=str(again), with_figures=False)
    written = sorted(f for f in os.listdir(again / grid) if f != "runs")
    assert {"table.md", "numbers.json", "decisions.csv", "table.csv"} <= set(written)
    for name in written:
        assert filecmp.cmp(os.path.join("results", grid, name), again / grid / name, shallow=False), name


def test_the_report_never_overwrites_a_report_with_less(grid, capsys):
    toy_runs(grid)
    report.report(grid, with_figures=False)
    out = os.path.join("results", grid)
    before = {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out) if f != "runs"}
    archives = sorted(os.listdir(os.path.join(out, "runs")))
    first = os.path.join(out, "runs", archives[0])
    kept = open(first, "rb").read()

    def refused(message):
        assert experiments.main(["report", grid]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and "Traceback" not in err
        assert {f: open(os.path.join(out, f), "rb").read() for f in before} == before

    open(first, "wb").close()  # an empty archive
    refused("unreadable archive")
    with open(first, "wb") as f:  # random bytes
        f.write(os.urandom(300))
    refused("unreadable archive")
    with gzip.open(first, "wt") as f:  # a valid but shorter log
        f.write("".join(json.dumps({"step": s}) + "\n" for s in range(3)))
    refused("a-s0 is shorter")
    os.remove(first)
    refused("a-s0 is missing")
    assert experiments.main(["report", grid, "--force"]) == 0  # asked explicitly: what is there
    assert json.load(open(os.path.join(out, "numbers.json")))["archives"].keys() == {
        a[:-len(".jsonl.gz")] for a in archives[1:]}
    with open(first, "wb") as f:
        f.write(kept)
    open(os.path.join("results", f".{grid}.new"), "w").close()  # the scratch folder cannot be made
    assert experiments.main(["report", grid]) == 2
    assert "cannot write the report" in capsys.readouterr().err


def test_each_dials_change_from_step_1_is_paired_within_runs_and_first_moves_where_its_interval_leaves_0(
        monkeypatch):
    """dials.changes on made-up runs whose answer is known: a dial that rises alike in every seed
    moves (an interval of width 0) at the first step, one whose seeds' changes are 0.1 .. 0.5 only
    at step 20 (0.3 ± t(0.975, 4) x 0.158 / sqrt 5), one whose changes cancel never; a per-step dial
    is the mean of the WINDOW steps ending at the step; a seed without the dial leaves 4 runs, too
    few for an interval."""
    from lab import dials
    monkeypatch.setitem(grids.GRIDS, "toy-dials", dict(
        settings={"a": [], "b": []}, seeds=[0, 1, 2, 3, 4], table_steps=[0, 10, 20],
        dials=["probe_up", "probe_late", "probe_cancels", "token_entropy", "probe_patchy"]))
    data = {}
    for setting in ("a", "b"):
        for seed in range(5):
            records = [{"step": s, "token_entropy": 0.01 * s} for s in range(1, 21)]
            for r in records:
                if r["step"] in (1, 10, 20):
                    late = 0.1 * (seed + 1) if r["step"] == 20 else 0.0
                    r.update(probe_up=seed + 0.01 * r["step"], probe_late=seed + late,
                             probe_cancels=(seed - 2) * 0.1 * (r["step"] == 20))
                    if seed:
                        r["probe_patchy"] = 1.0 + r["step"]
            data[setting, seed] = [{"step": 0}] + records
    rows = {(r["setting"], r["dial"]): r for r in dials.changes("toy-dials", data)}
    assert len(rows) == 2 * 5 and {r["n"] for r in rows.values()} == {5, 4}
    up, late, cancels = rows["a", "probe_up"], rows["a", "probe_late"], rows["b", "probe_cancels"]
    assert up["at_start"] == pytest.approx(2.01)
    assert (up["change_10"], up["ci95_10"], up["first_moved"]) == (
        pytest.approx(0.09), pytest.approx(0.0, abs=1e-12), 10)
    assert (late["change_10"], late["ci95_10"]) == (0.0, 0.0)
    half = t.ppf(0.975, 4) * math.sqrt(0.025) / math.sqrt(5)
    assert (late["change_20"], late["ci95_20"]) == (pytest.approx(0.3), pytest.approx(half))
    assert late["first_moved"] == 20 and cancels["first_moved"] is None
    entropy = rows["a", "token_entropy"]  # steps 11 .. 20 against step 1
    assert entropy["change_20"] == pytest.approx(0.155 - 0.01) and entropy["first_moved"] == 10
    patchy = rows["b", "probe_patchy"]
    assert patchy["n"] == 4 and patchy["change_20"] == pytest.approx(19.0)
    assert patchy["ci95_20"] is None and patchy["first_moved"] is None
    lines = dials.section(list(rows.values()))
    assert lines[1] == "## How each dial moved from step 1" and len(lines) == 7 + 10
    assert lines[-1] == "| b | probe_patchy | 4 | 2.000 | +9.000 | +19.000 | - |"


REPORTED = [name for name in grids.GRIDS if os.path.isfile(os.path.join(ROOT, "results", name, "table.md"))]


def test_some_grids_have_committed_reports():
    assert REPORTED  # the next test runs once for each


@pytest.fixture(scope="module")
def archives(tmp_path_factory):
    """Every reported grid's archives and manifest, copied once (a rule may compare with another
    grid's runs), and the first report: what a report may be made from, and nothing else."""
    folder = tmp_path_factory.mktemp("results")
    experiments.scratch_copy(str(folder), os.path.join(ROOT, "results"))  # report --into's copy
    for grid in REPORTED:
        assert (folder / grid / "runs").is_dir() and (folder / grid / "numbers.json").is_file()
    return folder


@pytest.mark.parametrize("name", REPORTED)
def test_committed_tables_equal_the_regenerated_ones(name, archives):
    """A registered grid with a committed report has its archives, all that the report was made
    from (a missing or shorter one fails), and regenerating from them alone gives every file byte
    for byte."""
    manifest = json.load(open(archives / name / "numbers.json"))["archives"]
    runs = [f for f in os.listdir(archives / name / "runs") if f.endswith(".jsonl.gz")]
    assert manifest and len(runs) == len(manifest)
    experiments.write_report(name, results=str(archives), with_figures=False)  # refuses a missing archive
    for file in OUTPUTS:
        if os.path.isfile(os.path.join(ROOT, "results", name, file)):
            assert filecmp.cmp(os.path.join(ROOT, "results", name, file), archives / name / file,
                               shallow=False), file


def test_every_committed_archive_is_tracked_by_git():
    """An ignore rule once kept every archive out of git while the disk had them all."""
    tracked = subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode:
        pytest.skip("not a git checkout")
    listed = set(tracked.stdout.split())
    on_disk = [os.path.relpath(os.path.join(d, f), ROOT) for d, _, files in os.walk(os.path.join(ROOT, "results"))
               for f in files if f.endswith(".jsonl.gz")]
    assert all(path in listed for path in on_disk), sorted(set(on_disk) - listed)[:3]
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", "results/main/runs/none-s0.jsonl.gz"],
                             cwd=ROOT)
    assert ignored.returncode == 1  # not ignored


def test_every_number_results_md_quotes_is_in_a_generated_file():
    """RESULTS.md quotes results with three or more decimals; each such number must appear in a file
    the report wrote (results/**: tables, csv, numbers.json), so none is typed by hand."""
    text = open(os.path.join(ROOT, "RESULTS.md")).read()
    quoted = set(re.findall(r"(?<![\w.])[-+]?\d+\.\d{3,}(?![\d])", text))
    assert quoted
    generated = []
    for folder, _, files in os.walk(os.path.join(ROOT, "results")):
        generated += [open(os.path.join(folder, f)).read() for f in files if f.endswith((".md", ".csv", ".json"))]
    values = {float(x) for x in re.findall(r"[-+]?\d+\.\d+(?:e[-+]?\d+)?", "\n".join(generated))}
    missing = [q for q in sorted(quoted) if float(q) not in values]  # 0.300 is 0.3, 0.812 is not 0.8124
    assert not missing, missing[:10]


# ----------------------------------------------------------------------------------- command line

def test_command_line_help_list_and_errors(grid, capsys):
    with pytest.raises(SystemExit):
        experiments.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "archive each finished run's metrics under results/<grid>/runs/" in text
    assert experiments.main(["list", "main"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("main:") and "collapse-env" not in out and "rule: Top-P beats" in out
    assert experiments.main(["list", "nope"]) == 2
    assert "unknown grid 'nope'" in capsys.readouterr().err
    assert experiments.main(["run"]) == 2  # hours of work: only when named
    assert "name the grids to run" in capsys.readouterr().err
    assert experiments.main(["run", "toy", "--only", "nosuch"]) == 2  # before anything runs
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--only nosuch: no setting of toy" in err, err
    assert experiments.main(["report"]) == 0  # every grid; none has run here
    assert "toy: not run yet" in capsys.readouterr().out
    assert experiments.main(["report", "toy"]) == 2
    assert "nothing to report" in capsys.readouterr().err
    for argv in (["frob"], ["report", "--jobs", "x"]):  # argparse's refusals: one line, no usage
        assert experiments.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: argument"), err


def test_ctrl_c_stops_the_runs_and_archives_only_what_finished(grid, monkeypatch, capsys):
    toy_runs(grid)
    runs = grids.runs_of(grid)
    shutil.rmtree(os.path.join("results", grid))
    with open(os.path.join(runs[1][2], "metrics.jsonl"), "w") as f:  # a-s1 stopped half-way
        f.write("".join(json.dumps({"step": s}) + "\n" for s in range(8)))
    open(os.path.join(runs[1][2], "config.json"), "w").close()
    killed = []

    class Process:  # train.py stand-in: never ends by itself
        returncode = None

        def __init__(self, argv, **kw):
            self.folder = argv[argv.index("--resume") + 1]

        def poll(self):
            return None

        def terminate(self):
            killed.append(self.folder)

        def wait(self):
            self.returncode = -15

    monkeypatch.setattr(experiments.subprocess, "Popen", Process)
    monkeypatch.setattr(experiments.time, "sleep", lambda s: (_ for _ in ()).throw(KeyboardInterrupt))
    assert experiments.main(["run", grid]) == 130
    out, err = capsys.readouterr()
    assert killed == [runs[1][2]] and "not finished: not archived" in out
    assert "interrupted" in err and "Traceback" not in err
    assert not os.path.exists(os.path.join("results", grid, "runs", "a-s1.jsonl.gz"))


def test_report_into_a_scratch_folder_regenerates_there_and_leaves_results_alone(tmp_path, capsys):
    """`report GRID --into DIR`: the archives copied into DIR and the report made there, equal to
    the committed one; results/ untouched; a folder with files in it refused in one line."""
    grid = "smollm2-coords"
    before = {f: os.path.getmtime(os.path.join(ROOT, "results", grid, f))
              for f in os.listdir(os.path.join(ROOT, "results", grid))}
    into = tmp_path / "scratch"
    assert experiments.main(["report", grid, "--into", str(into)]) == 0
    assert f"diff -r results {into}" in capsys.readouterr().out
    assert filecmp.cmp(os.path.join(ROOT, "results", grid, "table.md"), into / grid / "table.md",
                       shallow=False)
    assert before == {f: os.path.getmtime(os.path.join(ROOT, "results", grid, f)) for f in before}
    assert experiments.main(["report", grid, "--into", str(into)]) == 2
    assert "not an empty folder" in capsys.readouterr().err


def test_the_real_templates_report_decides_its_rules_on_archives_whose_answer_is_known(tmp_path,
                                                                                      monkeypatch):
    """lab/real_templates.py on made-up archives of the registered smollm2-templates grid: a plain
    MI that falls with the grounded share in the pool family and stays level (noise only) in the
    borrowed one, a work MI that falls in both, H(Z|X) that rises in the borrowed one. Every rule
    holds, and the decision to log the work MI everywhere follows; with the work MI flat in one
    family that decision is not 'holds'."""
    import random as rnd
    from lab import real_templates
    monkeypatch.setattr(real_templates, "RESAMPLES", 200)  # the intervals of a test, not a report

    def write(results, flat_work):
        rng = rnd.Random(0)
        for setting, seed, folder, _ in grids.runs_of("smollm2-templates"):
            _, alpha = real_templates.family_of(setting)
            borrowed = setting.startswith("borrowed")
            grounded = 0.9 * (1 - alpha) + rng.gauss(0, 0.02)
            noise = rng.gauss(0, 0.05)
            work = 0.1 + noise if flat_work and borrowed else 2.0 * grounded + noise
            plain = 1.0 if borrowed else grounded / 0.9  # 1 at ALPHA 0, level where borrowed
            record = {"step": 1, "probe_grounded_share": grounded,
                      "probe_mi_estimate": 2.5 * plain + noise, "probe_mi_seq_estimate": 2.7 * plain + noise,
                      "probe_retrieval_acc": 0.95 * plain + noise / 10,
                      "probe_work_mi_estimate": work, "probe_work_mi_seq_estimate": work,
                      "probe_work_retrieval_acc": work / 2,
                      "probe_reasoning_entropy_seq": 6.0 + noise,
                      "probe_conditional_entropy_seq": 4.0 - 3 * grounded + noise,
                      "probe_reasonings": [" Let me think."] * 4}
            path = report.archive_path("smollm2-templates", folder, str(results))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with gzip.open(path, "wt") as f:
                f.write(json.dumps(record) + "\n")

    write(tmp_path / "known", flat_work=False)
    experiments.write_report("smollm2-templates", results=str(tmp_path / "known"), with_figures=False)
    numbers = json.load(open(tmp_path / "known" / "smollm2-templates" / "numbers.json"))
    verdicts = {d["text"]: d["verdict"] for d in numbers["decisions"]}
    assert len(verdicts) == len(grids.GRIDS["smollm2-templates"]["decide"])
    assert set(verdicts.values()) == {"holds"}, verdicts
    assert "| pool | 0.5 |" in open(tmp_path / "known" / "smollm2-templates" / "table.md").read()
    write(tmp_path / "flat", flat_work=True)
    experiments.write_report("smollm2-templates", results=str(tmp_path / "flat"), with_figures=False)
    numbers = json.load(open(tmp_path / "flat" / "smollm2-templates" / "numbers.json"))
    last = numbers["decisions"][-1]
    assert last["kind"] == "verdict" and last["verdict"] != "holds"


def test_the_suffix_share_counts_the_demonstrations_sentence_not_the_substring():
    """"Try <move>." is the demonstrations' random suffix; "Trying the way ..." or "Try again" is
    not it, and the share once counted them."""
    texts = [" go 1 Down. Try Left.", " Trying the way down.", " Try again.", " Try Up.",
             " Try Down. Then right."]
    record = {"step": 1, "probe_reasonings": texts, "probe_mi_seq_estimate": 1.0,
              "probe_retrieval_chance": 0.25, "probe_retrieval_acc": 0.5,
              "probe_conditional_entropy_seq": 2.0}
    lines = reasonings.cap_and_suffix({("none", 0): [record]})
    assert "| 1 | 0.600 | 2.000 |" in lines
