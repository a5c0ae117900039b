"""The paper's claims in miniature, written down before they run: each grid below is one claim of
RAGEN-2 (or a search for a regime, said to be one) as train.py runs -- its exact flags, settings,
seeds and steps -- with the comparisons that decide it.

The tiny policy's grids are here, the real pretrained model's in real_grids.py (GRIDS holds both),
and what every grid shares in protocol.py. experiments.py runs what is written here, stats.py holds
the statistics the rules use, report.py turns the archived runs into tables and verdicts. A
registered grid is not changed once it has run: a re-run is a replication, and a changed grid gets
a new name.

A rule ("paired") compares a - b, paired over the seeds both have, at an environment step or at a
number of cumulative optimiser steps; it holds when the 95% interval over at least 5 seeds lies on
the predicted side of 0 (of its `margin`, where it has one), is contradicted on the other side,
else undecided. "leadlag": the step at
which `a` starts to move (stats.onset) comes before the step at which `b` does. "gradients": a Fig. 4
statistic per run (stats.gradient_stat) on the predicted side of 0. "search": a search's criteria
(stats.CRITERIA: a collapse regime, or a growing template share), run by run.
"""
import gzip
import json
import os

from lab.protocol import ALPHAS, COMMON, CONTROLS, FILTERS, RUNS, RESULTS, SEEDS
from lab.real_grids import REAL_GRIDS
from plumbing.defaults import MAX_SKIPS

# Wall-time model, only for the runner's estimate where a setting has no archived runs to measure
# (measured_seconds): seconds a training step of one run takes (one thread, two runs side by side
# on the 2-core machine; validation and diagnoses included), by world.
# From the archives' time_step: a healthy FrozenLake step 2.5-4 s (a collapsing one 15-45 s: an
# estimate cannot know), a Sokoban 6x6 step 12-15 s, an 8x8 room or two boxes 17-27 s.
SECONDS_PER_STEP = {"frozenlake": 4.0, "sokoban": 13.0, "sokoban-large": 25.0}


# ---------------------------------------------------------------------------------------- the grids
COLLAPSE = ["--env", "frozenlake", "--entropy-coef", "0.3"]
# The calibration: warm starts whose template share is known (templates.py), each diagnosed once
# (train.py's step 1, before its update) with the in-batch estimate over 8 prompts and the probe set
# over 8 or 32 (8 samples each). ALPHA = 0 with build seed 0 is the warm start every other grid uses.
PROBE_PROMPTS = (8, 32)
CALIBRATION_WORLDS = ("frozenlake", "sokoban")
# Wall time a run on 2 cores without other work: one step and two validations (about 30 s
# FrozenLake, 45 s Sokoban) and half a warm start (a build serves both probe sizes; 600 steps,
# about 90 s: README). Shared with other work (load 10-15) this machine was 5 to 10 times slower.
CALIBRATION_SECONDS = {"frozenlake": 30 + 90 / 2, "sokoban": 45 + 90 / 2}
MI_METRICS = ("mi_estimate", "probe_mi_estimate", "probe_mi_seq_estimate", "probe_retrieval_acc")
ENTROPY_METRICS = ("token_entropy", "probe_reasoning_entropy", "probe_conditional_entropy")


def calibration_settings():
    """{world-a<ALPHA>-p<probe prompts>: flags} for every world, ALPHA and probe size."""
    return {f"{world}-a{alpha:g}-p{p}": ["--env", world, "--template-prior", f"{alpha:g}",
                                         "--probe-prompts", str(p)]
            for world in CALIBRATION_WORLDS for alpha in ALPHAS for p in PROBE_PROMPTS}


def calibration_rules():
    """The calibration's predictions, per world (report.py's calibration section decides them)."""
    rules = []
    for w in CALIBRATION_WORLDS:
        rules.append(dict(kind="share", world=w, metric="probe_template_share", tolerance=0.1,
                          text=f"{w}: the warm start learns its prior: at every ALPHA the probe "
                               f"set's template share lies within 0.1 of ALPHA"))
        for metric, size in (("mi_estimate", 8), ("probe_mi_estimate", 8),
                             ("probe_mi_estimate", 32), ("probe_mi_seq_estimate", 32)):
            rules.append(dict(kind="proportional", world=w, metric=metric, size=size,
                              tolerance=0.15,
                              text=f"{w}: {metric} ({size} prompts) falls like (1 - template "
                                   f"share) times its ALPHA = 0 value: at every ALPHA > 0, "
                                   f"(value - (1 - share) x value at 0) / value at 0 within "
                                   f"+-0.15"))
        for metric in MI_METRICS + ENTROPY_METRICS + ("response_length",):
            sign = -1 if metric in ENTROPY_METRICS else 1
            rules.append(dict(kind="tracks", world=w, metric=metric, size=32, sign=sign,
                              threshold=0.8 if metric in MI_METRICS else 0.0,
                              text=f"{w}: Spearman of {metric} with the ground truth "
                                   f"(1 - ALPHA) I_task over the policies is "
                                   + ("above 0.8" if metric in MI_METRICS else
                                      "below 0: entropy rises as the truth falls"
                                      if sign < 0 else "above 0: templates are shorter")))
    return rules


GRIDS = {
    # Estimate: 30 runs x 120 steps x 5 s / 2 at a time = 2.5 h (less: runs that lose all spread
    # stop early).
    "collapse-env": dict(
        claim="Sec. 2-3: with a regulariser that does not shrink with reward spread driving the "
              "update (an entropy bonus of 0.3 on FrozenLake: no filter lost its success by step "
              "60 before), Top-K / Top-P hold collapse off -- and not only because a filtered "
              "update takes fewer optimiser steps (2 for Top-K 0.5 against 4, at 32 trajectories "
              "a mini-batch): equal environment steps here, 120 steps so that Top-K reaches the "
              "240 optimiser steps no filter took to collapse; random and bottom keep Top-K's "
              "count.",
        flags=COLLAPSE, world="frozenlake",
        settings={**FILTERS, "topp-softmax-zero": ["--filter", "topp", "--filter-prob-mode",
                                                   "softmax", "--include-zero"], **CONTROLS},
        seeds=SEEDS, steps=120, table_steps=[0, 20, 40, 60, 80, 100, 120],
        decide=[
            dict(kind="paired", metric="val_success", a=("topk", "step", 60),
                 b=("none", "step", 60), sign=1,
                 text="Top-K beats no filter at step 60 (equal environment steps)"),
            dict(kind="paired", metric="val_success", a=("topk", "step", 60),
                 b=("random", "step", 60), sign=1,
                 text="Top-K beats a random subset of the same size at step 60: the choice of "
                      "groups matters, not only their number"),
            dict(kind="paired", metric="val_success", a=("topk", "optimizer_steps", 240),
                 b=("none", "optimizer_steps", 240), sign=1,
                 text="Top-K beats no filter at 240 optimiser steps (no filter's step 60)"),
            dict(kind="paired", metric="val_success", a=("bottom", "optimizer_steps", 240),
                 b=("none", "optimizer_steps", 240), sign=-1,
                 text="the lowest-spread groups do worse than no filter at equal optimiser "
                      "steps (the mechanism's prediction)"),
            dict(kind="paired", metric="val_success", a=("topp", "step", 60),
                 b=("none", "step", 60), sign=1, text="Top-P (linear) beats no filter at step 60"),
            dict(kind="paired", metric="probe_mi_estimate", a=("none", "step", 60),
                 b=("none", "step", 1), sign=-1,
                 text="without a filter the probe-set MI falls from step 1 to step 60"),
            dict(kind="leadlag", setting="none", a="probe_mi_estimate", b="val_success", sign=1,
                 text="the probe-set MI falls before success does (no filter)"),
            dict(kind="leadlag", setting="none", a="probe_mi_estimate",
                 b="probe_conditional_entropy", sign=1,
                 text="the probe-set MI falls before H(Z|X) rises (no filter)"),
        ]),
    # Estimate: 20 runs x 80 steps x 5 s / 2 = 1.1 h. No filter is not rerun: with 128 kept rows
    # --optimizer-steps 4 is exactly the default split (tests/test_train.py), so its runs are
    # collapse-env's.
    "collapse-opt": dict(
        claim="The collapse grid at equal optimiser steps: every update takes 4 optimiser steps "
              "(--optimizer-steps 4, no filter's count) whatever it keeps.",
        flags=COLLAPSE + ["--optimizer-steps", "4"], world="frozenlake",
        settings={"topk": FILTERS["topk"], "topp": FILTERS["topp"], **CONTROLS},
        seeds=SEEDS, steps=80, table_steps=[0, 20, 40, 60, 80],
        decide=[
            dict(kind="paired", metric="val_success", a=("topk", "step", 60),
                 b=("collapse-env/none", "step", 60), sign=1,
                 text="Top-K beats no filter at equal optimiser steps (step 60: 240 each)"),
            dict(kind="paired", metric="val_success", a=("topk", "step", 60),
                 b=("random", "step", 60), sign=1,
                 text="Top-K beats a random subset of the same size at equal optimiser steps"),
            dict(kind="paired", metric="val_success", a=("bottom", "step", 60),
                 b=("collapse-env/none", "step", 60), sign=-1,
                 text="the lowest-spread groups do worse than no filter"),
            dict(kind="paired", metric="val_success", a=("topp", "step", 60),
                 b=("collapse-env/none", "step", 60), sign=1,
                 text="Top-P beats no filter at equal optimiser steps"),
        ]),
    # Estimate: 2 x 200 x 8 s + 200 x 10 s + 2 x 200 x 5 s = 2.0 run-hours, 1.0 h at 2 at a time,
    # plus a warm start for each of the 3 new worlds (about 3 minutes each).
    "regime": dict(
        claim="A search, not a claim: is there a collapse regime at the official coefficients "
              "(entropy 0.001, a KL term k3 at the analysis runs' 0.001 and at 0.01) in worlds "
              "with many all-fail groups (two boxes, an 8x8 room; FrozenLake slipping 2/3 of "
              "moves), 200 steps, no filter, one seed each?",
        flags=["--entropy-coef", "0.001", "--filter", "none"], world=None,
        settings={
            "sokoban-2box-kl0.001": ["--env", "sokoban", "--num-boxes", "2", "--kl-coef", "0.001"],
            "sokoban-2box-kl0.01": ["--env", "sokoban", "--num-boxes", "2", "--kl-coef", "0.01"],
            "sokoban-8x8-kl0.001": ["--env", "sokoban", "--room-size", "8", "--kl-coef", "0.001"],
            "frozenlake-sr0.33-kl0.001": ["--env", "frozenlake", "--success-rate", "0.3333",
                                          "--kl-coef", "0.001"],
            "frozenlake-sr0.33-kl0.01": ["--env", "frozenlake", "--success-rate", "0.3333",
                                         "--kl-coef", "0.01"]},
        seeds=[0], steps=200, table_steps=[0, 50, 100, 150, 200],
        seconds={"sokoban-2box-kl0.001": 18.0, "sokoban-2box-kl0.01": 18.0,
                 "sokoban-8x8-kl0.001": SECONDS_PER_STEP["sokoban-large"]},
        decide=[dict(kind="search", text=(
            "a setting is a collapse regime when its run (1) had many all-fail groups "
            "(zero_var_fail_frac averaged over the run >= 0.5), (2) lost input dependence (the "
            "mean probe-set MI of the last two diagnoses <= half its step-1 value) and (3) lost "
            "success (the last validation >= 0.1 below the run's best). If one is found, a 5-seed "
            "none / Top-P / Top-K / random grid in it is the next pre-registration; if none is, "
            "that is the result: no collapse at the official coefficients in 200 steps."))]),
    # Estimate: 10 runs x 40 steps x 5 s / 2 = 0.3 h (a decomposition every 5 steps included).
    "gradients": dict(
        claim="Sec. 3, Fig. 4: the task gradient of a bucket of prompts grows with its reward "
              "spread and the regulariser's (entropy bonus + KL to the initial policy) does not, "
              "so where spread is low the regulariser drives the update. FrozenLake, no filter, "
              "the 8 groups of a step in 6 spread buckets, a decomposition every 5 steps; with the "
              "collapse grids' entropy bonus of 0.3, and at the official coefficients (entropy "
              "0.001, KL 0.001). Without a KL term in training the KL gradient is measured at "
              "0.001.",
        flags=["--env", "frozenlake", "--filter", "none", "--grad-decomp-every", "5"],
        world="frozenlake",
        settings={"entropy0.3": ["--entropy-coef", "0.3"],
                  "official": ["--entropy-coef", "0.001", "--kl-coef", "0.001"]},
        seeds=SEEDS, steps=40, table_steps=[0, 20, 40],
        decide=[
            dict(kind="gradients", setting=setting, stat="rho_task_minus_reg", sign=1,
                 text=f"{label}: the task gradient's norm rises with the bucket's reward spread "
                      f"more than the regulariser's (Spearman over the run's decompositions)")
            for setting, label in (("entropy0.3", "entropy bonus 0.3"),
                                   ("official", "official coefficients"))] + [
            dict(kind="gradients", setting="entropy0.3", stat="reg_share_low", sign=1,
                 text="entropy bonus 0.3: on the lowest-spread bucket with any spread the "
                      "regulariser's gradient is larger than the task's (its share of the two "
                      "norms minus 1/2)"),
            dict(kind="gradients", setting="official", stat="reg_share_high", sign=-1,
                 text="official coefficients: on the highest-spread bucket the task gradient is "
                      "larger than the regulariser's (its share of the two norms minus 1/2)")]),
    # Estimate: 20 runs x 50 steps x 8 s / 2 = 1.1 h.
    "main": dict(
        claim="The main command's world (Sokoban, default settings): Top-P and Top-K against no "
              "filter and a random subset of Top-P's size, 50 steps.",
        flags=["--env", "sokoban"], world="sokoban",
        settings={**FILTERS, "random": ["--filter", "random", "--control-of", "topp"]},
        seeds=SEEDS, steps=50, table_steps=[0, 10, 20, 30, 40, 50],
        decide=[
            dict(kind="paired", metric="val_success", a=("topp", "step", 50),
                 b=("none", "step", 50), sign=1, text="Top-P beats no filter at step 50"),
            dict(kind="paired", metric="val_success", a=("topp", "step", 50),
                 b=("random", "step", 50), sign=1,
                 text="Top-P beats a random subset of its size at step 50"),
            dict(kind="paired", metric="val_success", a=("topk", "step", 50),
                 b=("none", "step", 50), sign=1, text="Top-K beats no filter at step 50"),
        ]),
    # Estimate: 2 worlds x 10 settings x 5 builds, 24 new warm starts a world (ALPHA = 0, build 0
    # is cached): FrozenLake 50 x 75 s / 2 = 0.5 h, Sokoban 50 x 90 s / 2 = 0.6 h on idle cores.
    "calibration": dict(
        kind="calibration",
        claim="The diagnosis against ground truth. Warm starts taught to reason with an "
              "input-agnostic template on a share ALPHA of their turns (templates.py: I(X;Z) = "
              "(1 - ALPHA) I_task, H(Z) level by the pool's size). Prediction, written before "
              "measuring: a template carries no information about its prompt, so the "
              "cross-scoring estimate (at most log N over N prompts) falls like (1 - template "
              "share) times its value at ALPHA = 0, its expectation (1 - ALPHA) G(N) under the "
              "demonstrations; H(Z|X), token entropy and the cross-scored H(Z) rise (templates "
              "add log n of choice; the true H(Z) stays level, but the estimate sees only the "
              "capped part of I_task); response length falls (templates are shorter). Each "
              "policy is measured once, at train.py's step 1 before its update.",
        flags=["--filter", "none", "--probe-samples", "8", "--mi-samples", "64"], world=None,
        settings=calibration_settings(), seeds=SEEDS, seed_flags=["--warm-start-seed"],
        steps=1, table_steps=[1],
        seconds={s: CALIBRATION_SECONDS[s.split("-")[0]] for s in calibration_settings()},
        decide=calibration_rules()),
}
# The template-collapse search: from a warm start that reasons with a template on 10% of its turns,
# does RL make templates take over? The paper's mechanism names the knobs: where reward spread is
# low (FrozenLake slipping 2/3 of its moves: many zero-spread groups) the regularisers drive the
# update -- an entropy bonus, or a KL term pulling towards a template-rich reference (a warm start
# with ALPHA = 1, --kl-template-prior, once named --reference-template-prior). Not searched: how reliable the task reasoning is for the answer (the demonstrations'
# noise is fixed). Estimate: 8 runs x 100 steps, 3 s a step, 10 s with the entropy bonus of 0.3 (its
# collapse samples every token up to the limit), 2 at a time: 0.5 h, plus the warm starts at ALPHA
# 0.1 and 1 (about 5 minutes each).
TEMPLATE_KNOBS = {"ent0.001": [], "ent0.3": ["--entropy-coef", "0.3"],
                  "klref0.1": ["--kl-template-prior", "1", "--kl-coef", "0.1"],
                  "klref0.5": ["--kl-template-prior", "1", "--kl-coef", "0.5"]}
GRIDS["template-search"] = dict(
    claim="A search, not a claim: is there a regime in which RL makes reasoning templates take "
          "over (the probe set's template share grows) from a warm start with ALPHA = 0.1? "
          "FrozenLake, no filter, 100 steps, one seed; the official entropy bonus (0.001) or the "
          "collapse grids' 0.3, a KL term (k3) to a template-rich reference at 0.1 or 0.5, each "
          "on the plain lake and on one slipping 2/3 of its moves.",
    flags=["--env", "frozenlake", "--template-prior", "0.1", "--filter", "none"],
    world="frozenlake",
    settings={**TEMPLATE_KNOBS,
              **{f"slip-{k}": ["--success-rate", "0.3333"] + v for k, v in TEMPLATE_KNOBS.items()}},
    seeds=[0], steps=100, table_steps=[0, 25, 50, 75, 100],
    seconds={s: 10.0 for s in ("ent0.3", "slip-ent0.3")},
    decide=[dict(kind="search", criteria="template", text=(
        "a setting is a template-collapse regime when the probe set's template share of its "
        "last two diagnoses is at least 0.2 above its first diagnosis's (probe MI, H(Z) and "
        "validation shown beside it). If one is found, the next pre-registration is a 5-seed "
        "grid in it: none, Top-P, Top-K, the random control, and Top-K at equal optimiser "
        "steps, with template_share, MI and entropy curves and the onset of MI against that of "
        "validation success; if none is found, that is the result: no template collapse from "
        "ALPHA = 0.1 in 100 steps at these knobs."))])

# The confirmatory grid the search's rule names, registered when the search's first regime appeared
# (template-search klref0.1: the probe set's template share 0.109 -> 0.781 in 100 steps) and before
# any of its runs. The mechanism's prediction: the KL term's gradient does not shrink with reward
# spread, so an update made of high-spread groups is driven less by the pull towards templates.
# Estimate: 25 runs x 100 steps x 3.5 s / 2 = 1.2 h.
TEMPLATE_REGIME = ["--env", "frozenlake", "--template-prior", "0.1", "--kl-template-prior",
                   "1", "--kl-coef", "0.1"]
GRIDS["template-collapse"] = dict(
    claim="Sec. 2-3 in a template-collapse regime: with a KL term (0.1, k3) pulling a warm start "
          "that reasons with a template on 10% of its turns towards a template-only reference "
          "(FrozenLake, entropy bonus 0.001), keeping high reward-spread groups holds the "
          "templates off -- and not only because a filtered update takes fewer optimiser steps "
          "(Top-K at 4 optimiser steps an update, no filter's count) or keeps fewer groups (a "
          "random subset of Top-K's size).",
    flags=TEMPLATE_REGIME, world="frozenlake",
    settings={**FILTERS, "random": CONTROLS["random"],
              "topk-opt4": FILTERS["topk"] + ["--optimizer-steps", "4"]},
    seeds=SEEDS, steps=100, table_steps=[0, 25, 50, 75, 100],
    decide=[
        dict(kind="paired", metric="probe_template_share", a=("topk", "step", 100),
             b=("none", "step", 100), sign=-1,
             text="Top-K keeps the probe set's template share below no filter's at step 100"),
        dict(kind="paired", metric="probe_template_share", a=("topp", "step", 100),
             b=("none", "step", 100), sign=-1,
             text="Top-P keeps the probe set's template share below no filter's at step 100"),
        dict(kind="paired", metric="probe_template_share", a=("topk", "step", 100),
             b=("random", "step", 100), sign=-1,
             text="Top-K keeps the template share below a random subset of its size at step 100"),
        dict(kind="paired", metric="probe_template_share", a=("topk-opt4", "step", 100),
             b=("none", "step", 100), sign=-1,
             text="Top-K at equal optimiser steps keeps the template share below no filter's "
                  "at step 100"),
        dict(kind="paired", metric="probe_mi_estimate", a=("topk", "step", 100),
             b=("none", "step", 100), sign=1,
             text="Top-K keeps the probe-set MI above no filter's at step 100"),
        dict(kind="leadlag", setting="none", a="probe_mi_estimate", b="val_success", sign=1,
             text="the probe-set MI falls before success does (no filter; no verdict where "
                  "success does not fall)")])

# The iso-entropy families: where an entropy is level by construction, does the MI diagnosis still
# see the input dependence fall, and does the level entropy stay blind? Warm starts with
# surface-matched templates (templates.py: with probability ALPHA a first turn reasons with the
# demonstrator's reasoning for another, independently drawn layout; its words, length and law are
# the task reasoning's), so I(X;Z) falls from I_task to 0, not linearly in ALPHA. (a) H(Z) level;
# (b) H(Z|X) level -- and with it, at a constant length, the mean token entropy -- by a filler of 5
# digits whose entropy is I(X;Z) at each ALPHA (FILLER_EPS, from templates.filler_eps on the law of
# f(X) over 40,000 first turns). The chain rule forbids holding both. Each policy is measured once,
# as in the calibration, over a probe of 32 prompts x 8 samples.
ISO_WORLDS = {"iso-hz": ("frozenlake",), "iso-hzx": ("frozenlake", "sokoban")}
FILLER_EPS = {"frozenlake": (0.2056, 0.1034, 0.0470, 0.0134, 0.0),
              "sokoban": (0.3332, 0.1701, 0.0805, 0.0251, 0.0)}  # at each of ALPHAS
# what each family holds level: cross-scored H(Z) (summed), and minus its expectation under the
# demonstrations (the estimate over N prompts sees only the capped part of I_task: at 32 prompts
# its expectation rises 0.72 nats on FrozenLake as I(X;Z) falls, templates.surface_truth); H(Z|X)
# (summed and per token) and the token entropy
LEVEL = {"iso-hz": (("probe_reasoning_entropy_seq", None),
                    ("probe_reasoning_entropy_seq", "expected_reasoning_entropy_seq_probe")),
         "iso-hzx": (("token_entropy", None), ("probe_conditional_entropy_seq", None),
                     ("probe_conditional_entropy", None))}
ISO_TRACKS = 0.9  # the MI estimates' Spearman with the exact I(X;Z): at least this
ISO_BAND = 0.3  # a level entropy's |Spearman| with it: at most this
ISO_NOISE = 2.0  # and its change across the family within this many build standard deviations


def iso_settings(name):
    """{world-a<ALPHA>: flags} of a family: surface-matched templates at each ALPHA, the filler's
    eps beside it in family (b)."""
    out = {}
    for world in ISO_WORLDS[name]:
        for k, alpha in enumerate(ALPHAS):
            flags = ["--env", world, "--template-kind", "surface", "--template-prior",
                     f"{alpha:g}", "--probe-prompts", "32"]
            if name == "iso-hzx":
                flags += ["--filler", f"{FILLER_EPS[world][k]:g}"]
            out[f"{world}-a{alpha:g}"] = flags
    return out


def iso_rules(name):
    """A family's predictions, per world (calibration.py decides them): the MI estimates track
    the exact I(X;Z); the entropy held level does not."""
    rules = []
    for w in ISO_WORLDS[name]:
        rules += [dict(kind="tracks", world=w, metric=metric, size=32, sign=1,
                       threshold=ISO_TRACKS,
                       text=f"{w}: Spearman of {metric} with the exact I(X;Z) over the 25 "
                            f"policies is above {ISO_TRACKS}")
                  for metric in MI_METRICS]
        for metric, minus in LEVEL[name]:
            what = metric if minus is None else f"{metric} minus its expectation ({minus})"
            rules.append(dict(
                kind="level", world=w, metric=metric, minus=minus, size=32, band=ISO_BAND,
                noise=ISO_NOISE,
                text=f"{w}: {what}, level by construction, does not track the truth: |Spearman| "
                     f"with the exact I(X;Z) <= {ISO_BAND}, and its change from ALPHA 0 to 1 "
                     f"within {ISO_NOISE:g} standard deviations of its builds at one ALPHA"))
    return rules


ISO_CLAIM = (
    "The paper's claim made falsifiable: entropy cannot see template collapse, mutual information "
    "can. Warm starts taught surface-matched templates (another layout's task reasoning, "
    "templates.py) on a share ALPHA of their turns, so that I(X;Z) falls from I_task to 0 while "
    "{level}. Prediction, written before measuring: the MI estimates rank the policies by the exact "
    "I(X;Z) (Spearman >= 0.9) and {entropy} does not (|Spearman| <= 0.3, its change across the "
    "family within 2 build standard deviations). {note}Each policy is measured once, at train.py's "
    "step 1 before its update.")
for _name, _level, _entropy, _note in (
        ("iso-hz", "H(Z) stays exactly level (family a)", "the cross-scored H(Z)",
         "Known before measuring: the cross-scored H(Z) over 32 prompts is expected to rise 0.72 "
         "nats on FrozenLake from ALPHA 0 to 1 (it sees only the capped part of I_task), so its "
         "rule may fail for the estimator's cap, not the policy's entropy; the second H(Z) rule "
         "removes that expectation. H(Z|X) and the token entropy rise (not level here). "),
        ("iso-hzx", "H(Z|X), and at a constant length the token entropy, stay level (family b: "
                    "a filler of 5 digits carries I(X;Z)'s worth of within-input noise)",
         "neither the token entropy nor H(Z|X)", "H(Z) falls with I(X;Z) here. ")):
    # Estimate: 25 (FrozenLake) or 50 policies, a warm start each (ALPHA 0 of iso-hz is the
    # calibration's, cached), as the calibration's.
    GRIDS[_name] = dict(
        kind="calibration",
        claim=ISO_CLAIM.format(level=_level, entropy=_entropy, note=_note),
        flags=["--filter", "none", "--probe-samples", "8", "--mi-samples", "64"], world=None,
        settings=iso_settings(_name), seeds=SEEDS, seed_flags=["--warm-start-seed"],
        steps=1, table_steps=[1],
        seconds={s: CALIBRATION_SECONDS[s.split("-")[0]] for s in iso_settings(_name)},
        decide=iso_rules(_name))

# Does RL grow templates unforced? No template-rich reference: the KL term (k3, 0.001, the analysis
# runs' setting) pulls towards the initial policy only. A warm start with templates available but
# rare -- surface-matched at ALPHA 0.25, pool sentences at 0.1 (template-search's) -- on the lake
# that slips 2/3 of its moves (many zero-spread groups), 300 steps, no filter against Top-P.
# Estimate: 20 runs x 300 steps x 4 s / 2 = 3.3 h (plus 5 surface warm starts at ALPHA 0.25).
GROW = {"surface": ["--template-kind", "surface", "--template-prior", "0.25"],
        "pool": ["--template-prior", "0.1"]}
GRIDS["template-grow"] = dict(
    claim="Does RL make templates take over without being pushed? FrozenLake slipping 2/3 of its "
          "moves, the official entropy bonus (0.001) and a KL term (k3, 0.001) towards the initial "
          "policy only, a warm start whose templates are rare (surface-matched at ALPHA 0.25, or "
          "the pool's sentences at 0.1), no filter and Top-P, 300 steps. A clear null is a result.",
    flags=["--env", "frozenlake", "--success-rate", "0.3333", "--entropy-coef", "0.001",
           "--kl-coef", "0.001"], world=None,
    settings={f"{kind}-{f}": flags + FILTERS[f] for kind, flags in GROW.items()
              for f in ("none", "topp")},
    seeds=SEEDS, steps=300, table_steps=[0, 50, 100, 150, 200, 250, 300],
    decide=[rule for kind in GROW for rule in (
        dict(kind="paired", metric="probe_template_share", a=(f"{kind}-none", "step", 300),
             b=(f"{kind}-none", "step", 1), sign=1,
             text=f"{kind} templates: without a filter the probe set's template share grows from "
                  f"step 1 to step 300"),
        dict(kind="paired", metric="probe_template_share", a=(f"{kind}-topp", "step", 300),
             b=(f"{kind}-none", "step", 300), sign=-1,
             text=f"{kind} templates: Top-P keeps the template share below no filter's at step "
                  f"300"),
        dict(kind="paired", metric="probe_mi_estimate", a=(f"{kind}-none", "step", 300),
             b=(f"{kind}-none", "step", 1), sign=-1,
             text=f"{kind} templates: without a filter the probe-set MI falls from step 1 to "
                  f"step 300"),
        dict(kind="leadlag", setting=f"{kind}-none", a="probe_mi_estimate", b="val_success",
             sign=1, text=f"{kind} templates: the probe-set MI falls before success does (no "
                          f"filter; no verdict where success does not fall)"))])

# The control template-collapse lacked: a random subset of Top-K's size at Top-K's optimiser-step
# count. There Top-K took 165.4 optimiser steps by step 100 and random 172.4 (each update split
# into mini-batches of 32 of what it kept), and the pull towards the template reference grows
# with the count. Here every update takes 2 (Top-K's usual count) or 4 (no filter's) whatever it
# keeps. Estimate: 15 runs x 100 steps x 3.5 s / 2 = 0.7 h.
GRIDS["template-control"] = dict(
    claim="template-collapse's regime with a random subset of Top-K's size at equal optimiser "
          "steps: does keeping the high-spread groups hold templates off beyond making as many "
          "updates from as many groups?",
    flags=TEMPLATE_REGIME, world="frozenlake",
    settings={"topk-opt2": FILTERS["topk"] + ["--optimizer-steps", "2"],
              "random-opt2": CONTROLS["random"] + ["--optimizer-steps", "2"],
              "random-opt4": CONTROLS["random"] + ["--optimizer-steps", "4"]},
    seeds=SEEDS, steps=100, table_steps=[0, 25, 50, 75, 100],
    seconds={s: 3.5 for s in ("topk-opt2", "random-opt2", "random-opt4")},
    decide=[
        dict(kind="paired", metric="probe_template_share", a=("topk-opt2", "step", 100),
             b=("random-opt2", "step", 100), sign=-1,
             text="Top-K keeps the template share below a random subset of its size at equal "
                  "optimiser steps (2 an update) at step 100"),
        dict(kind="paired", metric="probe_template_share",
             a=("template-collapse/topk-opt4", "step", 100), b=("random-opt4", "step", 100),
             sign=-1, text="Top-K keeps the template share below a random subset of its size at "
                           "no filter's optimiser-step count (4 an update) at step 100"),
        dict(kind="paired", metric="probe_mi_estimate", a=("topk-opt2", "step", 100),
             b=("random-opt2", "step", 100), sign=1,
             text="Top-K keeps the probe-set MI above a random subset's at equal optimiser steps "
                  "at step 100")])

# Whole programme: 2.5 + 1.1 + 1.0 (+ 0.15 warm starts) + 0.3 + 1.1 = about 6.2 h of the 2-core
# machine (gradients was added after collapse-env had run, before its own runs).
# Cut to fit: no filter is not rerun at equal optimiser steps; the softmax Top-P variant only at
# equal environment steps; the regime search has one seed and two KL values; the main world runs
# 50 of the main command's 100 steps. The earlier 3-seed grids (on the tiny policy before its
# tokenizer changed, with no decision rules and no committed per-run logs) are not kept.

# The paper's main table in miniature (the project page's results matrix), registered
# 2026-12-01 before any of its runs: the four worlds of its columns -- Sokoban, FrozenLake, the
# arithmetic word problems standing in for MetaMathQA, Countdown -- by the four algorithms of its
# rows, without a filter and with Top-P 0.9 (linear, zero-spread groups excluded: the paper's
# definition and this code's default; the official main-table runs use the softmax mode with
# zero-spread groups included), 5 seeds paired, the tiny policy, every world at its defaults
# (Countdown one turn, the word problems up to 3 answers). DAPO is verl's recipe (GRPO's
# advantages, token-mean, clip-higher, no KL, dynamic sampling up to 3 draws, the overlong
# penalty); its "no filter" is dynamic sampling alone, its Top-P ranks the refilled batch.
# Size: the paper's batch (8 groups x 16 rollouts: the filter ranks 8 groups, each spread from 16
# rewards; a smaller group estimates each spread worse) and the main command's 100 steps, which
# the measured step times (MAIN_CPU below) fit into about 7.4 hours two at a time on the 2-core
# machine (the follow-up at most 3.5 more, if every cell needs its control). Sokoban is most of
# it (about 45%). The times are those of the first 10 steps: a policy whose replies grow, or
# DAPO once most groups have no spread (up to 3 draws a step), can take longer.
# The deciding comparison per cell: Top-P's gain in validation success at the last step over no
# filter, paired by seed, its 95% t interval (16 intervals: about one may exclude 0 by chance);
# the follow-up rule (lab/matrix.py): every cell whose interval excludes 0 gets a random subset of
# Top-P's count as its control (main-table-control, registered with it, runs those cells only).
MAIN_WORLDS = ("sokoban", "frozenlake", "wordproblems", "countdown")
MAIN_ALGOS = ("ppo", "dapo", "grpo", "drgrpo")
MAIN_STEPS = 100
# CPU seconds a step (user + system, /usr/bin/time) of 10-step runs from the warm start at these
# flags, less a 0-step run's start-up and first validation: the wall time of a run with a core of
# its own (one thread, the 2-core Intel Xeon, seed 0, this commit's code). Dr.GRPO's are GRPO's
# (the same work); GRPO's Top-P, not measured, is its no filter scaled as PPO's Top-P to no filter.
MAIN_CPU = {"sokoban": {"ppo-none": 7.37, "ppo-topp": 6.53, "grpo-none": 5.73, "dapo-none": 6.29,
                        "dapo-topp": 5.31},
            "frozenlake": {"ppo-none": 2.38, "ppo-topp": 2.19, "grpo-none": 1.99,
                           "dapo-none": 2.52, "dapo-topp": 3.34},
            "wordproblems": {"ppo-none": 2.45, "ppo-topp": 2.06, "grpo-none": 0.98,
                             "dapo-none": 2.25, "dapo-topp": 0.93},
            "countdown": {"ppo-none": 0.95, "ppo-topp": 1.03, "grpo-none": 1.38, "dapo-none": 0.64,
                          "dapo-topp": 0.90}}
# wall over CPU time for two runs side by side on the 2 cores (shared caches and memory): the main
# grid's archived Sokoban PPO steps (no filter 12.24 s, Top-P 5.51 s) were 1.66 and 0.84 times this
# code's CPU time at its first 10 steps; their mean
SIDE_BY_SIDE = 1.25


def main_seconds(world, algo, filt):
    """The registered wall seconds a step of a main-table setting, from MAIN_CPU (a random subset
    of Top-P's count trains on as many groups as Top-P)."""
    cpu, algo = MAIN_CPU[world], "grpo" if algo == "drgrpo" else algo
    filt = "topp" if filt == "random" else filt
    own = cpu.get(f"{algo}-{filt}") or cpu[f"{algo}-none"] * cpu["ppo-topp"] / cpu["ppo-none"]
    return round(SIDE_BY_SIDE * own, 2)


# the paper's cells (Qwen2.5-3B): no filter's validation success (%) and Top-P's change
PAPER_MATRIX = {"ppo": ((12.9, 16.0), (67.0, 10.9), (92.6, 0.6), (97.9, 0.0)),
                "dapo": ((16.2, 5.1), (66.8, 2.1), (90.8, 2.8), (95.7, 1.6)),
                "grpo": ((12.1, 9.0), (70.9, 2.3), (91.2, 1.2), (95.7, 2.2)),
                "drgrpo": ((12.1, -0.4), (23.2, 0.6), (91.2, 1.4), (96.5, 1.4))}


def main_table_cells():
    """{world-algo: its flags}, the table's cells in its order (rows, then columns)."""
    return {f"{w}-{a}": ["--env", w, "--algo", a] for a in MAIN_ALGOS for w in MAIN_WORLDS}


def main_table_rules():
    """One paired rule a cell, Top-P minus no filter at the last step, and the follow-up rule."""
    rules = [dict(kind="paired", metric="val_success", cell=cell, sign=1,
                  a=(f"{cell}-topp", "step", MAIN_STEPS), b=(f"{cell}-none", "step", MAIN_STEPS),
                  text=f"{cell}: Top-P's gain in validation success over no filter at step "
                       f"{MAIN_STEPS}")
             for cell in main_table_cells()]
    return rules + [dict(kind="followup", grid="main-table-control", text=(
        "follow-up: every cell whose interval excludes 0 gets a random subset of Top-P's count "
        "as its control (main-table-control: Top-P minus the random subset at step "
        f"{MAIN_STEPS}, paired by seed)"))]


GRIDS["main-table"] = dict(
    claim="The paper's main table in miniature: does Top-P 0.9 raise validation success over no "
          "filter in each world (Sokoban, FrozenLake, word problems for MetaMathQA, Countdown) "
          f"under each algorithm (PPO, DAPO, GRPO, Dr.GRPO)? The tiny policy, {MAIN_STEPS} steps "
          "of 8 groups x 16 rollouts, 5 seeds paired; Top-P linear, zero-spread groups excluded "
          "(the official main table: softmax, zero-spread included); DAPO verl's recipe. 16 "
          "intervals at 95%: about one may exclude 0 by chance. A clear null in a cell is a "
          "result.",
    flags=[], world=None,
    settings={f"{cell}-{f}": flags + FILTERS[f] for cell, flags in main_table_cells().items()
              for f in ("none", "topp")},
    seeds=SEEDS, steps=MAIN_STEPS, table_steps=[0, MAIN_STEPS // 2, MAIN_STEPS],
    seconds={f"{cell}-{f}": main_seconds(*cell.split("-"), f) for cell in main_table_cells()
             for f in ("none", "topp")},
    decide=main_table_rules(),
    matrix=dict(worlds=MAIN_WORLDS, paper=PAPER_MATRIX,
                columns={"sokoban": "Sokoban", "frozenlake": "FrozenLake",
                         "wordproblems": "word problems (paper: MetaMathQA)",
                         "countdown": "Countdown"},
                source="the project page's results matrix, Qwen2.5-3B, validation success at the "
                       "checkpoint (paper/project-page.txt)"))
GRIDS["main-table-control"] = dict(
    claim="The main table's follow-up, registered with it: in every cell whose Top-P gain's "
          "interval excludes 0, is it which groups Top-P keeps or only how few? A random subset "
          "of Top-P's count (from all the groups, its own seeded stream) at the same step, paired "
          "by seed; only the cells main-table's rule selects are run.",
    flags=[], world=None, followup_of="main-table",
    settings={f"{cell}-random": flags + ["--filter", "random", "--control-of", "topp"]
              for cell, flags in main_table_cells().items()},
    cell_of={f"{cell}-random": cell for cell in main_table_cells()},
    seconds={f"{cell}-random": main_seconds(*cell.split("-"), "random")
             for cell in main_table_cells()},
    seeds=SEEDS, steps=MAIN_STEPS, table_steps=[0, MAIN_STEPS // 2, MAIN_STEPS],
    decide=[dict(kind="paired", metric="val_success", sign=1,
                 a=(f"main-table/{cell}-topp", "step", MAIN_STEPS),
                 b=(f"{cell}-random", "step", MAIN_STEPS),
                 text=f"{cell}: Top-P's gain over a random subset of its count at step "
                      f"{MAIN_STEPS} (run only where main-table's interval excludes 0)")
            for cell in main_table_cells()])

# The grids on the real pretrained model (SmolLM2), registered as these are: lab/real_grids.py.
GRIDS.update(REAL_GRIDS)



def runs_of(name):
    """[(setting, seed, folder, argv)] of a grid: every setting x seed, with its train.py flags."""
    g = GRIDS[name]
    out = []
    pairs = [(setting, seed) for setting in g["settings"] for seed in g["seeds"]]
    if g.get("seed_major"):  # a cut grid leaves whole pairs of seeds
        pairs.sort(key=lambda p: g["seeds"].index(p[1]))
    for setting, seed in pairs:
        folder = os.path.join(RUNS, name, f"{setting}-s{seed}")
        # a seed flag may be the policy's build seed too
        argv = g["flags"] + g["settings"][setting] + g.get("common", COMMON)
        argv += [x for flag in g.get("seed_flags", []) for x in (flag, str(seed))]
        argv += ["--seed", str(seed), "--steps", str(g["steps"]), "--out", folder]
        out.append((setting, seed, folder, argv))
    return out


def estimate_hours(name, jobs=2, results=RESULTS):
    """The grid's wall-time estimate, `jobs` at a time: steps x the mean step time its archived
    runs of the setting measured (measured_seconds), else the registered seconds of the setting
    or SECONDS_PER_STEP of its world. A calibration's wall time is its warm starts and
    validations, which time_step does not hold: its registered seconds alone."""
    g = GRIDS[name]
    measured = {} if g.get("kind") == "calibration" else measured_seconds(name, results)
    total = 0.0
    for setting, _, _, argv in runs_of(name):
        world = argv[argv.index("--env") + 1] if "--env" in argv else "sokoban"
        slowest = max(SECONDS_PER_STEP.values())  # a world not measured yet: as the slowest
        registered = g.get("seconds", {}).get(setting, SECONDS_PER_STEP.get(world, slowest))
        total += g["steps"] * measured.get(setting, registered)
    return total / jobs / 3600


def measured_seconds(name, results=RESULTS):
    """{setting: mean seconds a step} over the time_step of the grid's archived runs
    (results/<grid>/runs/), the settings archived. The mean, not the median: a collapsing run's
    slow steps (15-45 s against 3 s) count in full, as they do in the wall time."""
    times = {}
    for setting, _, folder, _ in runs_of(name):
        path = os.path.join(results, name, "runs", os.path.basename(folder) + ".jsonl.gz")
        if os.path.isfile(path):
            with gzip.open(path, "rt") as f:
                records = [json.loads(line) for line in f if line.strip()]
            times.setdefault(setting, []).extend(
                r["time_step"] for r in records if isinstance(r.get("time_step"), (int, float)))
    return {setting: sum(t) / len(t) for setting, t in times.items() if t}


def done(records, steps):
    """A run's records reach its last step, or train.py stopped it: MAX_SKIPS steps in a row
    without reward spread."""
    records = [r for r in records if r.get("step")]
    stopped = len(records) >= MAX_SKIPS and all(r.get("skipped") for r in records[-MAX_SKIPS:])
    return stopped or any(r["step"] == steps for r in records)


def world_of(name, setting):
    """The world a setting runs in: its env flags (a grid's `world`, else from the flags)."""
    if GRIDS[name].get("world"):
        return GRIDS[name]["world"]
    flags = GRIDS[name]["flags"] + GRIDS[name]["settings"][setting]
    names = ("--env", "--num-boxes", "--room-size", "--success-rate", "--lake-size")
    given = {}  # a setting's flag overrides the grid's, as on train.py's command line
    for flag, value in zip(flags, flags[1:]):
        if flag in names:
            given[flag] = value
    return " ".join(f"{flag} {value}" for flag, value in given.items())


def describe(name):
    """The grid's size, wall-time estimate, claim and rules, for `experiments.py list`."""
    g = GRIDS[name]
    measured = "" if g.get("kind") == "calibration" or not measured_seconds(name) else \
        ", from its archived runs' step times"
    lines = [f"{name}: {len(g['settings']) * len(g['seeds'])} runs x {g['steps']} steps, "
             f"about {estimate_hours(name):.1f} h on 2 cores (2 at a time{measured}). "
             f"{g['claim']}"]
    lines += [f"  {g['closed']}"] if g.get("closed") else []
    lines += [f"  rule: {rule['text']}" for rule in g["decide"]]
    return "\n".join(lines)
