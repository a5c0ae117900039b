"""calibration.py and the calibration grid: the rules on synthetic policies whose answers are known
(proportional, share, tracks, the samples needed), and the whole measurement end to end on a toy
registration -- warm starts of a few steps with and without a template prior, train.py's step-1
diagnosis, the archives, and the report regenerated from them alone."""
import csv
import filecmp
import json
import math
import os
import shutil

import pytest

import train
from lab import calibration, experiments, grids, protocol, report
from warmstart import demos, templates, tiny


def row(alpha, build, share, mi, se=0.05, prompts=32, world="frozenlake"):
    return {"setting": f"{world}-a{alpha:g}-p{prompts}", "world": world, "alpha": alpha,
            "prompts": prompts, "samples": 8, "build": build, "probe_template_share": share,
            "probe_mi_estimate": mi, "probe_mi_estimate_se": se,
            "I_XZ": templates.truth(world, alpha)["I_XZ"]}


BUILDS = range(5)
JITTER = (-0.02, -0.01, 0.0, 0.01, 0.02)  # share around alpha, the same for every alpha


def policies(mi, learnt=1.0):
    """Five builds at each alpha; the share is learnt x alpha + a jitter, the estimate
    mi(alpha, share)."""
    shares = {(a, b): min(1.0, max(0.0, learnt * a + JITTER[b])) for a in protocol.ALPHAS for b in BUILDS}
    return [row(a, b, shares[a, b], mi(a, shares[a, b])) for a, b in shares]


def rule(kind, **kw):
    return {"kind": kind, "world": "frozenlake", "metric": "probe_mi_estimate", "size": 32, "text": kind, **kw}


def test_an_estimate_falling_like_one_minus_the_share_holds_and_a_flat_one_is_contradicted():
    assert protocol.ALPHAS
    exact = policies(lambda a, share: 2.0 * (1 - share))
    assert calibration.decide(rule("proportional", tolerance=0.15), exact)["verdict"] == "holds"
    # the share the policy learnt, not its prior: a policy that learnt 0.8 of it falls less
    short = policies(lambda a, share: 2.0 * (1 - share), learnt=0.8)
    assert calibration.decide(rule("proportional", tolerance=0.15), short)["verdict"] == "holds"
    flat = policies(lambda a, share: 2.0 - 0.1 * share)  # an estimate blind to the templates
    assert calibration.decide(rule("proportional", tolerance=0.15), flat)["verdict"] == "contradicted"
    assert calibration.decide(dict(rule("share", tolerance=0.1), metric="probe_template_share"),
                              exact)["verdict"] == "holds"
    off = [dict(r, probe_template_share=r["alpha"] / 2) for r in exact]  # learnt half its prior
    assert calibration.decide(dict(rule("share", tolerance=0.1), metric="probe_template_share"),
                              off)["verdict"] == "contradicted"
    three = [r for r in exact if r["build"] < 3]  # no interval from fewer than five builds
    assert "no interval" in calibration.decide(rule("proportional", tolerance=0.15), three)["verdict"]
    part = [r for r in exact if r["alpha"] < 1]  # a registered ALPHA still to run: no verdict yet
    decided = calibration.decide(rule("proportional", tolerance=0.15), part)
    assert decided["verdict"] == "incomplete: ALPHA 1 not run" and decided["estimate"] is not None
    other_size = part + [dict(r, prompts=8) for r in exact if r["alpha"] == 1]  # not this rule's
    assert calibration.decide(rule("proportional", tolerance=0.15), other_size)["verdict"] == decided["verdict"]


def test_tracking_is_a_spearman_over_policies_with_a_build_bootstrap():
    falling = policies(lambda a, share: 2.0 * (1 - share))
    decided = calibration.decide(rule("tracks", sign=1, threshold=0.8), falling, resamples=200)
    assert decided["estimate"] == pytest.approx(1.0, abs=0.05) and decided["verdict"] == "holds"
    rising = policies(lambda a, share: 1.0 + share)  # an entropy: up as the truth goes down
    decided = calibration.decide(rule("tracks", sign=-1, threshold=0.0), rising, resamples=200)
    assert decided["estimate"] < -0.9 and decided["verdict"] == "holds"
    assert calibration.decide(rule("tracks", sign=1, threshold=0.8), rising,
                              resamples=200)["verdict"] == "contradicted"
    assert calibration.decide(dict(rule("tracks", sign=1, threshold=0.8), world="sokoban"),
                              rising)["verdict"] == "not run"


def test_a_level_entropy_holds_and_one_that_tracks_the_truth_is_contradicted():
    """The iso-entropy families' rule: |Spearman| with the exact I(X;Z) <= band and the change
    from the largest truth to the smallest within noise x the builds' sd at one ALPHA."""
    level = dict(rule("level", band=0.3, noise=2.0), metric="token_entropy")
    noise = (0.01, -0.02, 0.015, -0.005, 0.0)  # build jitter, shuffled across ALPHAs
    flat = [dict(r, token_entropy=0.3 + noise[(r["build"] + k) % 5])
            for k, a in enumerate(protocol.ALPHAS) for r in policies(lambda a, s: 1.0) if r["alpha"] == a]
    decided = calibration.decide(level, flat, resamples=200)
    assert abs(decided["estimate"]) <= 0.3 and decided["verdict"] == "holds", decided
    tracking = [dict(r, token_entropy=0.3 + 0.1 * (1 - r["alpha"]) + noise[r["build"]])
                for r in flat]  # 0.1 over the family against a build sd of about 0.014
    decided = calibration.decide(level, tracking, resamples=200)
    assert decided["estimate"] > 0.8 and decided["verdict"] == "contradicted"
    assert "change -0.100" in decided["values"]
    # level once its expectation is removed: the rule's `minus` names a closed-form column
    capped = [dict(r, expected=0.1 * (1 - r["alpha"])) for r in tracking]
    assert calibration.decide(dict(level, minus="expected"), capped,
                              resamples=200)["verdict"] == "holds"
    one = [r for r in flat if r["build"] == 0]  # one build an ALPHA: no spread between builds
    assert calibration.decide(level, one, resamples=50)["verdict"] == "no interval"
    assert calibration.decide(level, flat[:5], resamples=50)["verdict"].startswith("incomplete")


def test_the_families_policies_carry_the_surface_closed_forms():
    """A surface-matched setting's truth is templates.surface_truth's: the exact I(X;Z), H(Z)
    level in family (a), H(Z|X) level in family (b), the capped expectations beside them; every
    rule names a metric the policies carry and a closed form they hold (on the law of f over its
    40,000 first turns, templates.task_probs)."""
    rows = {}
    for name in ("iso-hz", "iso-hzx"):
        for setting in grids.GRIDS[name]["settings"]:
            world, alpha, prompts, _ = calibration.policy(name, setting)
            kind, eps = calibration.template_of(name, setting)
            assert kind == "surface" and (eps is None) == (name == "iso-hz") and prompts == 32
            rows[name, setting] = calibration.truth_of(world, alpha, prompts, kind, eps)
        for r in grids.GRIDS[name]["decide"]:
            assert r["metric"] in calibration.POLICY and r["kind"] in ("tracks", "level")
            assert r.get("minus") in (None, *next(iter(rows.values())))
    fl = [rows["iso-hz", f"frozenlake-a{a:g}"] for a in protocol.ALPHAS]
    assert [r["I_XZ"] for r in fl] == pytest.approx([3.670, 2.231, 1.207, 0.429, 0.0], abs=0.03)
    assert max(r["H_Z"] for r in fl) - min(r["H_Z"] for r in fl) < 1e-9
    for world in ("frozenlake", "sokoban"):
        b = [rows["iso-hzx", f"{world}-a{a:g}"] for a in protocol.ALPHAS]
        assert max(r["H_Z_given_X"] for r in b) - min(r["H_Z_given_X"] for r in b) < 0.06
        assert b[0]["expected_mi_seq_probe"] == pytest.approx(templates.TASK[world]["gap"][32],
                                                              abs=0.06)
    rise = fl[-1]["expected_reasoning_entropy_seq_probe"] - fl[0]["expected_reasoning_entropy_seq_probe"]
    assert rise == pytest.approx(0.72, abs=0.03)  # the cap the iso-hz claim quotes


def test_the_samples_needed_follow_from_the_difference_and_its_standard_error():
    rows = policies(lambda a, share: 2.0 * (1 - a) + 0.01 * share)
    out = {s["metric"]: s for s in calibration.samples(rows)}["probe_mi_estimate"]
    d = 2.0 * 0.25 + 0.01 * (sum(0.25 + j for j in JITTER) - sum(0.5 + j for j in JITTER)) / 5
    se = math.sqrt(2) * 0.05
    assert out["difference"] == pytest.approx(d) and out["se_difference"] == pytest.approx(se)
    assert out["samples"] == 32 * 8 and out["z"] == pytest.approx(d / se)
    assert out["samples_needed"] == math.ceil(256 * (calibration.POWER_Z * se / d) ** 2)


# ----------------------------------------------------------------------------------- end to end

SMALL = ["--groups", "2", "--group-size", "2", "--max-turns", "1", "--max-new-tokens", "12",
         "--val-seeds", "1", "--mi-samples", "4", "--probe-samples", "2"]


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The calibration on FrozenLake at ALPHA 0 and 1, one build, warm starts of 2 steps."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tiny, "WARM_START_STEPS", 2)
    monkeypatch.setattr(demos, "ROUND", 1)  # a batch of demonstrations played a step
    settings = {f"frozenlake-a{a:g}-p2": ["--env", "frozenlake", "--template-prior", f"{a:g}",
                                          "--probe-prompts", "2"] for a in (0.0, 1.0)}
    monkeypatch.setitem(grids.GRIDS, "toy-calibration", dict(
        grids.GRIDS["calibration"], flags=["--filter", "none", "--tiny-cache", "cache"] + SMALL,
        settings=settings, seeds=[3],
        decide=[rule("proportional", tolerance=0.15, size=2), rule("tracks", sign=1, threshold=0.8, size=2)]))
    return "toy-calibration"


def test_the_calibration_runs_end_to_end_and_reports_from_its_archives_alone(toy, tmp_path):
    runs = grids.runs_of(toy)
    assert [argv[argv.index("--warm-start-seed") + 1] for _, _, _, argv in runs] == ["3", "3"]
    for _, _, folder, argv in runs:
        assert train.main(argv) == 0
        records = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
        first = next(r for r in records if r["step"] == 1)
        assert {"template_share", "probe_template_share", "mi_estimate", "probe_action_mi",
                "token_entropy", "response_length"} <= set(first)
        experiments.archive(folder, toy)
    assert len(os.listdir("cache")) >= 2  # a warm start per prior
    table = experiments.write_report(toy, with_figures=False)
    assert [(r["alpha"], r["builds"]) for r in table] == [(0.0, 1), (1.0, 1)]
    policies = list(csv.DictReader(open(os.path.join("results", toy, "policies.csv"))))
    assert [p["setting"] for p in policies] == list(grids.GRIDS[toy]["settings"])
    task = templates.TASK["frozenlake"]
    assert [float(p["I_XZ"]) for p in policies] == [round(task["i_task"], 4), 0.0]
    assert float(policies[0]["expected_mi_seq_batch"]) == round(task["gap"][8], 4)
    logged = {r["setting"]: r for r in calibration.policies(toy, report.load(toy))}
    for p in policies:
        assert float(p["probe_template_share"]) == round(logged[p["setting"]]["probe_template_share"], 4)
    numbers = json.load(open(os.path.join("results", toy, "numbers.json")))
    assert len(numbers["archives"]) == 2 and "I_task = 3.670" in open(
        os.path.join("results", toy, "table.md")).read()
    # the run folders are not committed: the archives alone give the same files
    shutil.rmtree("runs")
    again = tmp_path / "again"
    shutil.copytree(os.path.join("results", toy, "runs"), again / toy / "runs")
    experiments.write_report(toy, results=str(again), with_figures=False)
    for name in sorted(os.listdir(os.path.join("results", toy))):
        if name != "runs":
            assert filecmp.cmp(os.path.join("results", toy, name), again / toy / name, shallow=False), name
