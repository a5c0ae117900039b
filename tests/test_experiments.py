"""experiments.py: the grids' command lines, resuming, the tables' means and standard errors over seeds, and the
Spearman correlations -- on small fake run folders (no training here)."""
import json
import math
import os

import pytest

import experiments
import train


def fake_run(folder, steps, success, mi, val=None):
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for s in range(0, steps + 1):
            r = {"step": s}
            if s:
                r.update(train_success=success, kept_ratio=0.5, num_zero_var=2, time_step=1.0)
            if s % 5 == 0 and s:
                r.update(mi_estimate=mi(s), retrieval_acc=0.5, reasoning_entropy=1.0,
                         conditional_entropy=1.0 - mi(s), mi_zscore_ema=mi(s), token_entropy=0.1)
            if s % 10 == 0:
                r["val_success"] = val(s) if val else success
            f.write(json.dumps(r) + "\n")


@pytest.fixture
def grid(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(experiments.GRIDS, "toy", dict(
        claim="a toy grid", flags=["--env", "bandit"], settings={"a": ["--filter", "none"],
                                                                   "b": ["--filter", "topp"]},
        seeds=[0, 1], steps=20, table_steps=[10, 20]))
    return "toy"


def test_every_setting_and_seed_has_its_command_line(grid):
    runs = experiments.runs_of(grid)
    assert [(s, seed) for s, seed, _, _ in runs] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    setting, seed, folder, argv = runs[3]
    assert folder == os.path.join("runs", "experiments", "toy", "b-s1")
    assert argv[:4] == ["--env", "bandit", "--filter", "topp"] and argv[-6:] == [
        "--seed", "1", "--steps", "20", "--out", folder]
    assert "--threads" in argv and argv[argv.index("--threads") + 1] == "1"  # side by side, no oversubscription


def test_a_finished_run_is_not_run_again(grid):
    _, _, folder, _ = experiments.runs_of(grid)[0]
    fake_run(folder, 20, 0.5, lambda s: 0.3)
    assert experiments.finished(folder, 20) and not experiments.finished(folder, 30)
    with open(os.path.join(folder, "metrics.jsonl"), "a") as f:  # then train.py stopped it: no spread
        for s in range(21, 21 + train.MAX_SKIPS):
            f.write(json.dumps({"step": s, "skipped": True}) + "\n")
    assert experiments.finished(folder, 30) and experiments.MAX_SKIPS == train.MAX_SKIPS


def test_the_table_is_mean_and_standard_error_over_seeds(grid):
    for (setting, seed, folder, _), success in zip(experiments.runs_of(grid), (0.2, 0.6, 0.5, 0.5)):
        fake_run(folder, 20, success, lambda s: 0.1 * s)
    rows = {(r["setting"], r["step"]): r for r in experiments.summarize(grid)}
    a = rows[("a", 20)]
    assert a["train_success"] == pytest.approx(0.4) and a["train_success_se"] == pytest.approx(0.2)
    assert rows[("b", 20)]["train_success_se"] == pytest.approx(0.0)
    assert a["mi_estimate"] == pytest.approx(2.0)  # the diagnosis at the step itself, not a window mean
    assert a["runs"] == 2 and a["finished"] == 2
    text = open(os.path.join("results", "toy", "table.md")).read()
    assert "| a | 20 | 2 (2) | 0.400 +- 0.200 |" in text
    for name in ("success", "collapse", "filter", "length"):
        assert os.path.isfile(os.path.join("results", "toy", f"{name}.png"))


def test_correlations_rank_diagnostics_against_success(grid):
    # MI rises with validation success in every run; the conditional entropy falls with it
    for i, (_, _, folder, _) in enumerate(experiments.runs_of(grid)):
        fake_run(folder, 20, 0.5, lambda s, i=i: 0.01 * s + 0.1 * i, val=lambda s, i=i: 0.02 * s + 0.2 * i)
    rows = {key: (rho, low, high, n) for key, rho, low, high, n in experiments.correlations([grid])}
    rho, low, high, n = rows["mi_estimate"]
    assert rho == pytest.approx(1.0) and n == 8 and low <= rho <= high
    assert rows["conditional_entropy"][0] == pytest.approx(-1.0)
    assert math.isnan(rows["token_entropy"][0])  # constant: no ranking
    assert os.path.isfile(os.path.join("results", "correlations", "scatter.png"))
