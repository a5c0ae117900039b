"""experiments.py: the grids' command lines, resuming, the archives, the report's intervals, decision
rules, correlations and lead-lag -- on small synthetic runs (no training here); and the committed
tables equal the ones regenerated from the committed per-run logs."""
import filecmp
import gzip
import json
import math
import os
import shutil

import pytest
from scipy.stats import t

import experiments
import train


def fake_run(folder, steps, success, mi, val=None, kept=4, opt=2):
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for s in range(0, steps + 1):
            r = {"step": s}
            if s:
                r.update(train_success=success, kept_ratio=0.5, num_kept=kept, num_zero_var=2,
                         zero_var_fail_frac=0.25, optimizer_steps=opt, time_step=1.0,
                         token_entropy=0.1 + 0.01 * s)
            if s % 10 == 0 and s:  # Fig. 4: the task norm = 2 x spread, the regulariser's 1
                r["grad_decomposition"] = [
                    {"bucket": b, "groups": [b], "mean_std": 0.1 * b, "mean_var": 0.01 * b * b,
                     "task_grad_norm": 0.2 * b, "kl_grad_norm": 0.0, "entropy_grad_norm": 1.0,
                     "reg_grad_norm": 1.0} for b in range(6)]
            if s % 5 == 0 and s:
                r.update(mi_estimate=mi(s), probe_mi_estimate=mi(s), probe_mi_estimate_se=0.01,
                         probe_reasoning_entropy=1.0, probe_conditional_entropy=1.0 - mi(s))
            if s % 10 == 0:
                r["val_success"] = val(s) if val else success
            f.write(json.dumps(r) + "\n")


@pytest.fixture
def grid(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(experiments.GRIDS, "toy", dict(
        claim="a toy grid", flags=["--env", "bandit"], world="bandit",
        settings={"a": ["--filter", "none"], "b": ["--filter", "topp"]},
        seeds=[0, 1, 2], steps=20, table_steps=[10, 20],
        decide=[dict(kind="paired", metric="val_success", a=("b", "step", 20), b=("a", "step", 20),
                     sign=1, text="b beats a"),
                dict(kind="paired", metric="val_success", a=("b", "optimizer_steps", 20),
                     b=("a", "optimizer_steps", 20), sign=1, text="b beats a at 20 optimiser steps"),
                dict(kind="leadlag", setting="a", a="probe_mi_estimate", b="val_success", sign=1,
                     text="MI falls first")]))
    return "toy"


def toy_runs(grid, successes=(0.2, 0.6, 0.4, 0.5, 0.9, 0.7)):
    for (setting, seed, folder, _), success in zip(experiments.runs_of(grid), successes):
        fake_run(folder, 20, success, lambda s: 0.1 * s, opt=4 if setting == "a" else 2)
        experiments.archive(folder, grid)


def test_every_setting_and_seed_has_its_command_line(grid):
    runs = experiments.runs_of(grid)
    assert [(s, seed) for s, seed, _, _ in runs][:4] == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]
    setting, seed, folder, argv = runs[4]
    assert folder == os.path.join("runs", "experiments", "toy", "b-s1")
    assert argv[:4] == ["--env", "bandit", "--filter", "topp"] and argv[-6:] == [
        "--seed", "1", "--steps", "20", "--out", folder]
    assert "--threads" in argv and argv[argv.index("--threads") + 1] == "1"  # side by side


def test_every_grid_parses_as_train_flags_and_claims_get_five_seeds():
    for name, g in experiments.GRIDS.items():
        for _, _, _, argv in experiments.runs_of(name)[:len(g["settings"]) * len(g["seeds"])]:
            args = train.runs.parse_args(train.Args, argv)  # every flag is a real train.py flag
            assert args.model == "tiny"
        if g["decide"] and g["decide"][0]["kind"] != "search":
            assert g["seeds"] == [0, 1, 2, 3, 4], name  # 5 seeds for every claim
        for rule in g["decide"]:
            for side in ("a", "b"):
                if rule["kind"] == "paired":
                    grid, _, setting = rule[side][0].rpartition("/")
                    assert setting in experiments.GRIDS[grid or name]["settings"]
        assert experiments.estimate_hours(name) > 0
    assert experiments.GROUP_SIZE == train.Args().group_size
    assert experiments.MAX_SKIPS == train.MAX_SKIPS


def test_a_finished_run_is_not_run_again(grid):
    _, _, folder, _ = experiments.runs_of(grid)[0]
    fake_run(folder, 20, 0.5, lambda s: 0.3)
    assert experiments.finished(folder, 20) and not experiments.finished(folder, 30)
    with open(os.path.join(folder, "metrics.jsonl"), "a") as f:  # then train.py stopped it: no spread
        for s in range(21, 21 + train.MAX_SKIPS):
            f.write(json.dumps({"step": s, "skipped": True}) + "\n")
    assert experiments.finished(folder, 30)


def test_the_archive_is_trimmed_gzipped_and_reproducible(grid):
    _, _, folder, _ = experiments.runs_of(grid)[0]
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
    assert records[5]["probe_mi_estimate"] == float(f"{0.5 / 3:.6g}")
    assert experiments.archive(os.path.join("runs", "nowhere"), grid) is None


def test_the_table_is_a_t_interval_over_seeds(grid):
    toy_runs(grid)
    rows = {(r["setting"], r["step"]): r for r in experiments.report(grid)}
    a = rows[("a", 20)]
    assert a["train_success"] == pytest.approx(0.4) and a["runs"] == 3 and a["finished"] == 3
    # sd of (0.2, 0.6, 0.4) = 0.2; half-width t(0.975, 2) * 0.2 / sqrt(3) = 4.303 * 0.1155
    assert a["train_success_ci95"] == pytest.approx(t.ppf(0.975, 2) * 0.2 / math.sqrt(3))
    assert a["probe_mi_estimate"] == pytest.approx(2.0)  # the diagnosis at the step itself
    assert a["optimizer_steps_total"] == 80 and rows[("b", 20)]["optimizer_steps_total"] == 40
    assert a["trajectories_total"] == 20 * 4 * experiments.GROUP_SIZE
    text = open(os.path.join("results", "toy", "table.md")).read()
    assert "| a | 20 | 3 (3) | 0.400 ± 0.497 |" in text
    for name in ("curves", "perseed", "scatter"):
        assert os.path.isfile(os.path.join("results", "toy", f"{name}.png"))


def test_decision_rules_are_paired_differences_over_seeds(grid):
    toy_runs(grid)
    data = experiments.load(grid)
    rules = experiments.GRIDS[grid]["decide"]
    d = experiments.decide(grid, data, rules[0])
    # b - a per seed: 0.5 - 0.2, 0.9 - 0.6, 0.7 - 0.4 = 0.3 each: zero spread, the interval is 0 wide
    assert d["estimate"] == pytest.approx(0.3) and d["n"] == 3 and d["verdict"] == "holds"
    # at 20 optimiser steps: a (4 a step) is at step 5 -- no validation there -- its nearest
    # validation is step 10 (40 steps); b (2 a step) at step 10 (20 steps)
    assert experiments.value_on(data[("a", 0)], "val_success", "optimizer_steps", 20) == 0.2
    assert experiments.decide(grid, data, rules[1])["estimate"] == pytest.approx(0.3)
    flipped = dict(rules[0], sign=-1)
    assert experiments.decide(grid, data, flipped)["verdict"] == "contradicted"
    assert experiments.decide(grid, {}, rules[0])["verdict"] == "not run"


def test_lead_lag_finds_which_series_moves_first(grid):
    records = [{"step": s, "probe_mi_estimate": 0.8 if s < 20 else 0.2,
                "val_success": 0.9 if s < 40 else 0.1} for s in range(0, 61, 10)]
    assert experiments.event_step(records, "probe_mi_estimate") == 20
    assert experiments.event_step(records, "val_success") == 40
    flat = [{"step": s, "val_success": 0.5 + 0.01 * (s % 20 == 0)} for s in range(0, 61, 10)]
    assert experiments.event_step(flat, "val_success") is None  # moved less than 0.2: no event
    data = {("a", seed): records for seed in range(3)}
    d = experiments.decide(grid, data, experiments.GRIDS[grid]["decide"][2])
    assert d["estimate"] == 20 and d["n"] == 3


def test_fig4_statistics_from_the_gradient_decompositions(grid):
    toy_runs(grid)
    data = experiments.load(grid)
    records = data[("a", 0)]
    # the task norm rises with spread exactly (rho 1), the regulariser's is constant (0)
    assert experiments.gradient_stat(records, "rho_task_minus_reg") == pytest.approx(1.0)
    # the lowest bucket with spread: task 0.2, regulariser 1 -> share 1 / 1.2; the highest: 1.0
    # against 1 -> share 1/2 (the bucket without spread, task 0, is not the one compared)
    assert experiments.gradient_stat(records, "reg_share_low") == pytest.approx(1 / 1.2 - 0.5)
    assert experiments.gradient_stat(records, "reg_share_high") == pytest.approx(0.0)
    assert experiments.gradient_stat([{"step": 1}], "reg_share_low") is None
    rule = dict(kind="gradients", setting="b", stat="reg_share_low", sign=1, text="reg wins")
    d = experiments.decide(grid, data, rule)
    assert (d["n"], d["estimate"], d["verdict"]) == (3, pytest.approx(1 / 1.2 - 0.5), "holds")
    rows = experiments.gradient_table(grid, data)
    assert [(r["setting"], r["bucket"]) for r in rows][:2] == [("a", 1), ("a", 2)]
    assert rows[5]["task_grad_norm"] == pytest.approx(1.0) and rows[5]["runs"] == 3
    assert rows[5]["task_grad_norm_ci95"] == pytest.approx(0.0)


def test_spearman_is_scipys_with_ties():
    from scipy.stats import spearmanr

    xs, ys = [1, 2, 2, 3, 5, 5, 5, 0], [0.3, 0.1, 0.1, 0.9, 0.4, 0.8, 0.8, 0.2]
    assert experiments.spearman(xs, ys) == pytest.approx(spearmanr(xs, ys).statistic, abs=1e-12)
    assert experiments.spearman([1, 1, 1], [1, 2, 3]) is None


def test_correlations_within_runs_within_worlds(grid):
    # MI rises with success inside every run; across runs the offsets are unrelated
    for i, (_, _, folder, _) in enumerate(experiments.runs_of(grid)):
        fake_run(folder, 40, 0.5, lambda s, i=i: 0.01 * s + 0.1 * (i % 2),
                 val=lambda s, i=i: 0.02 * s + 0.2 * ((i + 1) % 3))
        experiments.archive(folder, grid)
    within, worlds = experiments.correlations(grid, experiments.load(grid), resamples=50)
    run_mi = next(c for c in within if c["diagnostic"] == "probe_mi_estimate")
    assert run_mi["rho"] == pytest.approx(1.0) and run_mi["n"] == 6
    cond = next(c for c in within if c["diagnostic"] == "probe_conditional_entropy")
    assert cond["rho"] == pytest.approx(-1.0)
    scopes = {(c["scope"], c["world"]) for c in worlds}
    assert scopes == {("within world", "bandit")}  # one world: nothing to pool
    const = next(c for c in within if c["diagnostic"] == "probe_reasoning_entropy")
    assert const["rho"] is None  # a constant ranks nothing


def test_report_regenerates_the_same_tables_from_the_archives_alone(grid, tmp_path):
    toy_runs(grid)
    experiments.report(grid)
    shutil.rmtree("runs")  # the run folders are not committed: the report needs only the archives
    shutil.copytree(os.path.join("results", grid), tmp_path / "again" / grid)
    experiments.report(grid, results=str(tmp_path / "again"))
    for name in ("table.md", "table.csv", "decisions.csv", "correlations.csv", "leadlag.csv",
                 "numbers.json"):
        assert filecmp.cmp(os.path.join("results", grid, name), tmp_path / "again" / grid / name,
                           shallow=False), name


def test_committed_tables_equal_the_regenerated_ones(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    committed = [name for name in experiments.GRIDS
                 if os.path.isdir(os.path.join(root, "results", name, "runs"))]
    for name in committed:  # every grid first: a rule may compare with another grid's runs
        shutil.copytree(os.path.join(root, "results", name), tmp_path / name)
    for name in committed:  # the figures are not compared
        experiments.report(name, results=str(tmp_path), with_figures=False)
        for file in ("table.md", "table.csv", "decisions.csv", "numbers.json", "perseed.csv",
                     "search.csv"):
            if file == "search.csv" and not os.path.isfile(tmp_path / name / file):
                continue  # only the regime search writes one
            assert filecmp.cmp(os.path.join(root, "results", name, file), tmp_path / name / file,
                               shallow=False), (name, file)


def test_command_line_help_list_and_errors(capsys):
    with pytest.raises(SystemExit):
        experiments.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "reported from compact per-run logs committed under results/<grid>/runs/." in text
    assert experiments.main(["list", "main"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("main:") and "collapse-env" not in out and "rule: Top-P beats" in out
    assert experiments.main(["list", "nope"]) == 2
    assert "unknown grid 'nope'" in capsys.readouterr().err


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
    rows = {r["setting"]: r for r in experiments.search_criteria(data)}
    assert [s for s, r in rows.items() if r["regime"]] == ["regime"]
    assert rows["regime"]["probe_mi_first"] == 1.0 and rows["regime"]["probe_mi_last_two"] == 0.5
    assert rows["easy"]["zero_var_fail_frac"] == pytest.approx(0.4)
    assert rows["kept-success"]["val_best"] == 0.8 and rows["kept-success"]["val_last"] == 0.71
    assert rows["regime"]["train_success"] == pytest.approx(0.1)
    decision = experiments.search("toy", data, {"text": "rule"})
    assert decision["verdict"] == "regime found: regime-s0" and decision["n"] == 4
    assert experiments.search("toy", {}, {"text": "rule"})["verdict"] == "not run"
