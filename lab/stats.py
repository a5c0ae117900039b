"""The statistics that decide the grids' claims: intervals over seeds, a metric at a step or at a
number of optimiser steps, one onset rule for every series, correlations summarised per run and then
per seed, the Fig. 4 statistics and the regime search's criteria.

Not named `statistics`, which the standard library already is.

Intervals. A mean over runs gets the 95% t interval at n - 1 degrees of freedom,

    mean +- t(0.975, n - 1) * sd / sqrt(n),        sd with n - 1 in its denominator,

and only when n >= MIN_RUNS: with fewer runs the runs themselves are shown, never an interval.
Runs that share a seed share their prompts, so a comparison of two settings is a paired difference
per seed, and a statistic computed within each run is averaged over the runs of a seed first: the
seeds, not the runs, are the independent units.

Onset. A series (say the probe MI) is read at one common cadence, the validation steps; its first
BASELINE points give its level m0 and its noise s0 = max(their sd, a floor: the series' own logged
standard error, or a fixed resolution); the onset is the first later step at which
direction * (x - m0) / s0 >= THRESHOLD holds at SUSTAIN cadence points in a row. Every series is
judged in its own noise units by the same rule, so "MI moves before success" compares like with
like.
"""
import math

from lab.protocol import AT_THE_STEP, ONSET, WINDOW

MIN_RUNS = 5  # no interval from fewer runs
CADENCE = 10  # onset series at the validation steps (diagnoses every 5: every other one)
BASELINE = 3  # cadence points (the first logged step, 10, 20) that give a series' level and noise
THRESHOLD = 2.0  # a move: two noise units in the collapse's direction ...
SUSTAIN = 2  # ... at two cadence points in a row
OPT_GAP = 40  # optimiser steps: the validations around a count are at most this far apart


# ---------------------------------------------------------------------------------------- intervals

def interval(xs):
    """(mean, half-width of the 95% t interval at n - 1 degrees of freedom, n) of the values that
    are not None; the half-width is None for fewer than MIN_RUNS values, and mean None for none.

    >>> m, half, n = interval([0.1, 0.2, 0.3, 0.4, 0.5]); round(m, 3), round(half, 4), n
    (0.3, 0.1963, 5)
    >>> interval([1.0, 2.0])                     # two runs: a mean, no interval
    (1.5, None, 2)
    """
    from scipy.stats import t

    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None, 0
    m = sum(xs) / len(xs)
    if len(xs) < MIN_RUNS:
        return m, None, len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    return m, float(t.ppf(0.975, len(xs) - 1)) * sd / math.sqrt(len(xs)), len(xs)


def fmt(m, half=None, sign=""):
    """A mean (and its interval's half-width) as the reports show it, '-' for none; sign "+" keeps
    a change's sign.

    >>> fmt(0.3, 0.19634), fmt(-0.05, sign="+"), fmt(0.05, sign="+"), fmt(None)
    ('0.300 ± 0.196', '-0.050', '+0.050', '-')
    """
    if m is None:
        return "-"
    return f"{m:{sign}.3f}" + ("" if half is None else f" ± {half:.3f}")


def span(low, high):
    """An interval by its ends, '-' for none."""
    return "-" if low is None else f"{low:.3f} .. {high:.3f}"


def by_seed(values):
    """{(setting, seed): value} -> [the mean over each seed's runs], one number per seed (runs of a
    seed share its prompts: the seed is the independent unit)."""
    seeds = {}
    for (_, seed), v in sorted(values.items()):
        if v is not None:
            seeds.setdefault(seed, []).append(v)
    return [sum(vs) / len(vs) for _, vs in sorted(seeds.items())]


# ------------------------------------------------------------------------------ a metric at a point

def value_at(records, key, step):
    """A metric at a table step: validation, diagnoses and cumulative counts at the step itself,
    every other metric the mean of the WINDOW steps ending there; None when nothing was logged."""
    if key.startswith(AT_THE_STEP):
        exact = [r[key] for r in records if r.get("step") == step and key in r]
        return exact[-1] if exact else None
    values = [r[key] for r in records if step - WINDOW < r.get("step", -1) <= step and key in r]
    return sum(values) / len(values) if values else None


def value_on(records, key, axis, point, gap=OPT_GAP):
    """`key` at an environment step (axis "step": value_at), or at `point` cumulative optimiser steps
    (axis "optimizer_steps"): interpolated linearly between the last logged value at or below the
    count and the first at or above it (the mean of those logged exactly at it), None when the count
    lies outside the run or those two are more than `gap` optimiser steps apart.

    >>> rs = [{"step": s, "optimizer_steps_total": 4 * s, "v": s / 10} for s in (0, 10, 20)]
    >>> value_on(rs, "v", "optimizer_steps", 60), value_on(rs, "v", "optimizer_steps", 90)
    (1.5, None)
    """
    if axis == "step":
        return value_at(records, key, point)
    logged = sorted((r["optimizer_steps_total"], r["step"], r[key]) for r in records if key in r)
    exact = [v for x, _, v in logged if x == point]
    if exact:
        return sum(exact) / len(exact)
    below = [(x, v) for x, _, v in logged if x < point]
    above = [(x, v) for x, _, v in logged if x > point]
    if not below or not above or above[0][0] - below[-1][0] > gap:
        return None
    (x0, y0), (x1, y1) = below[-1], above[0]
    return y0 + (y1 - y0) * (point - x0) / (x1 - x0)


# -------------------------------------------------------------------------------------------- onset

def cadence(records, key):
    """[(step, value, standard error or None)] of a series at the common cadence: its first logged
    step, then every CADENCE-th step."""
    points = [(r["step"], r[key], r.get(key + "_se"))
              for r in sorted(records, key=lambda r: r["step"]) if key in r]
    return points[:1] + [p for p in points[1:] if p[0] % CADENCE == 0]


def onset(records, key):
    """The step at which a series starts to move in its collapse direction (ONSET), in its own noise
    units (module docstring), or None when it never does or has too few points.

    >>> flat = [{"step": s, "val_success": 0.8} for s in range(0, 61, 10)]
    >>> onset(flat[:4] + [{"step": 40, "val_success": 0.6}, {"step": 50, "val_success": 0.5}],
    ...       "val_success")                      # 0.2 / 0.0625 = 3.2 noise units, twice in a row
    40
    """
    direction, floor = ONSET[key]
    points = cadence(records, key)
    if len(points) < BASELINE + SUSTAIN:
        return None
    base = [v for _, v, _ in points[:BASELINE]]
    level = sum(base) / len(base)
    sd = math.sqrt(sum((v - level) ** 2 for v in base) / (len(base) - 1))
    errors = [se for _, _, se in points[:BASELINE] if se is not None]
    noise = max(sd, sum(errors) / len(errors) if errors else floor)
    moved = [direction * (v - level) / noise >= THRESHOLD for _, v, _ in points[BASELINE:]]
    for i in range(len(moved) - SUSTAIN + 1):
        if all(moved[i:i + SUSTAIN]):
            return points[BASELINE + i][0]
    return None


# ------------------------------------------------------------------------------ rank and count tests

def signed_rank(diffs):
    """The exact two-sided Wilcoxon signed-rank test of paired differences -> (p, W+, W-, n):
    zero differences dropped (Wilcoxon's rule), the rest ranked by size (ties share the mean of
    their ranks), W+ the sum of the positive ones' ranks; p = P(|W+ - n(n+1)/4| >= the observed
    distance) over all 2^n equally likely sign patterns under no effect, exact with ties too.
    n = 0: p = 1. With n = 5 the smallest p is 2/32 = 0.0625, so 6 non-zero differences are the
    fewest that can reach 5%.

    >>> signed_rank([0.4, 0.1, 0.2, 0.3, 0.05, 0.15, 0.25, 0.35])   # 8 of 8 positive: 2/256
    (0.0078125, 36.0, 0.0, 8)
    >>> signed_rank([0.1, -0.1, 0.0])                                 # the zero dropped
    (1.0, 1.5, 1.5, 2)
    """
    import itertools

    d = [x for x in diffs if x is not None and x != 0]
    if not d:
        return 1.0, 0.0, 0.0, 0
    r = ranks([abs(x) for x in d])
    w_plus = float(sum(ri for ri, x in zip(r, d) if x > 0))
    centre = len(d) * (len(d) + 1) / 4
    far = abs(w_plus - centre) - 1e-9
    hits = sum(bool(abs(sum(ri for ri, up in zip(r, signs) if up) - centre) >= far)
               for signs in itertools.product((False, True), repeat=len(d)))
    return float(hits / 2 ** len(d)), w_plus, float(r.sum()) - w_plus, len(d)


def clopper_pearson(k, n, level=0.95):
    """The exact (Clopper-Pearson) interval of a binomial proportion k / n -> (low, high).

    >>> [round(x, 4) for x in clopper_pearson(0, 8)], [round(x, 4) for x in clopper_pearson(4, 8)]
    ([0.0, 0.3694], [0.157, 0.843])
    """
    from scipy.stats import beta

    tail = (1 - level) / 2
    low = 0.0 if k == 0 else float(beta.ppf(tail, k, n - k + 1))
    high = 1.0 if k == n else float(beta.ppf(1 - tail, k + 1, n - k))
    return low, high


# ------------------------------------------------------------------------------------- correlations

def ranks(xs):
    """Ranks 1..n, tied values sharing the mean of their ranks (scipy's rankdata 'average').

    >>> ranks([0.5, 0.1, 0.5, 0.9]).tolist()
    [2.5, 1.0, 2.5, 4.0]
    """
    import numpy as np

    x = np.asarray(xs, dtype=float)
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    first = np.ones(len(x), dtype=bool)  # [n] a new value starts here in sorted order
    first[1:] = sorted_x[1:] != sorted_x[:-1]
    starts = np.flatnonzero(first)
    ends = np.append(starts[1:], len(x))
    out = np.empty(len(x))
    out[order] = ((starts + ends + 1) / 2)[np.cumsum(first) - 1]  # mean of ranks start+1 .. end
    return out


def spearman(xs, ys):
    """Spearman's rho: the Pearson correlation of the tie-averaged ranks. Written out rather than
    scipy.stats.spearmanr because the bootstrap calls it thousands of times and that one's input
    checks cost more than the arithmetic."""
    import numpy as np

    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None  # a constant ranks nothing
    rx, ry = ranks(xs), ranks(ys)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float(rx @ ry / np.sqrt((rx @ rx) * (ry @ ry)))


def cluster_bootstrap(keys, statistic, rng, resamples=1000):
    """95% percentile interval of statistic(keys) over resamples that draw whole seeds with
    replacement (keys are (setting, seed); a drawn seed brings all its runs) -> (low, high), or
    (None, None) with fewer than MIN_RUNS seeds."""
    seeds = sorted({seed for _, seed in keys})
    if len(seeds) < MIN_RUNS:
        return None, None
    runs = {s: [k for k in keys if k[1] == s] for s in seeds}
    boot = sorted(r for r in (statistic([k for _ in seeds for k in runs[rng.choice(seeds)]])
                              for _ in range(resamples)) if r is not None)
    if not boot:
        return None, None
    return boot[int(0.025 * len(boot))], boot[int(0.975 * len(boot)) - 1]


# ------------------------------------------------------------------------------------------- Fig. 4

def gradient_stat(records, stat):
    """One run's Fig. 4 statistic over its gradient decompositions (None without any):
    rho_task_minus_reg: Spearman(bucket spread, task norm) - Spearman(spread, regulariser norm),
    every bucket of every decomposition a point (a constant ranks nothing: 0);
    reg_share_low / reg_share_high: on the lowest / highest-spread bucket that has any spread (a
    bucket without has no group-mean task gradient: there the regulariser is all there is), the mean
    over decompositions of reg / (reg + task) - 1/2, > 0 where the regulariser's gradient is
    larger."""
    decompositions = [r["grad_decomposition"] for r in records if r.get("grad_decomposition")]
    if not decompositions:
        return None
    if stat == "rho_task_minus_reg":
        points = [b for d in decompositions for b in d]
        spread = [b["mean_std"] for b in points]
        task, reg = ([b[k] for b in points] for k in ("task_grad_norm", "reg_grad_norm"))
        return (spearman(spread, task) or 0.0) - (spearman(spread, reg) or 0.0)
    with_spread = [[b for b in d if b["mean_std"] > 0] for d in decompositions]
    picked = [d[0 if stat == "reg_share_low" else -1] for d in with_spread if d]
    pairs = [(b["reg_grad_norm"], b["task_grad_norm"]) for b in picked]
    shares = [reg / (reg + task) - 0.5 for reg, task in pairs if reg + task > 0]
    return sum(shares) / len(shares) if shares else None


# ------------------------------------------------------------------------------ the regime search

def search_criteria(data):
    """Each run's numbers for the regime search's three criteria, and the mean train success (how
    often its rollouts failed, whatever their rewards' spread) -> rows. A zero-spread group is
    all-fail only if its failing rollouts got equal rewards."""
    rows = []
    for (setting, seed), records in sorted(data.items()):
        records = sorted(records, key=lambda r: r["step"])
        probes = [r["probe_mi_estimate"] for r in records if "probe_mi_estimate" in r]
        vals = [r["val_success"] for r in records if "val_success" in r]
        fails = [r["zero_var_fail_frac"] for r in records if "zero_var_fail_frac" in r]
        train = [r["train_success"] for r in records if "train_success" in r]
        if len(probes) < 3 or not vals or not fails:
            continue
        row = {"setting": setting, "seed": seed, "zero_var_fail_frac": sum(fails) / len(fails),
               "probe_mi_first": probes[0], "probe_mi_last_two": sum(probes[-2:]) / 2,
               "val_best": max(vals), "val_last": vals[-1],
               "train_success": sum(train) / len(train) if train else None}
        row["regime"] = (row["zero_var_fail_frac"] >= 0.5
                         and row["probe_mi_last_two"] <= row["probe_mi_first"] / 2
                         and row["val_last"] <= row["val_best"] - 0.1)
        rows.append(row)
    return rows


def template_criteria(data, growth=0.2):
    """Each run's numbers for the template-collapse search: the probe set's template share at the
    first diagnosis and over the last two (a regime when it grew by at least `growth`), with the
    probe MI, H(Z) and validation beside it, and the mean share of zero-spread groups -> rows."""
    rows = []
    for (setting, seed), records in sorted(data.items()):
        records = sorted(records, key=lambda r: r["step"])
        series = {k: [r[k] for r in records if k in r] for k in
                  ("probe_template_share", "probe_mi_estimate", "probe_reasoning_entropy",
                   "val_success", "zero_var_success_frac", "zero_var_fail_frac")}
        if len(series["probe_template_share"]) < 3 or not series["val_success"]:
            continue
        row = {"setting": setting, "seed": seed}
        for key, name in (("probe_template_share", "template"), ("probe_mi_estimate", "probe_mi"),
                          ("probe_reasoning_entropy", "probe_H_Z")):
            row[f"{name}_first"] = series[key][0] if series[key] else None
            row[f"{name}_last_two"] = sum(series[key][-2:]) / 2 if series[key] else None
        zero = [a + b for a, b in zip(series["zero_var_success_frac"], series["zero_var_fail_frac"])]
        row.update(val_best=max(series["val_success"]), val_last=series["val_success"][-1],
                   zero_var_frac=sum(zero) / len(zero) if zero else None)
        row["regime"] = row["template_last_two"] - row["template_first"] >= growth - 1e-9
        rows.append(row)
    return rows


CRITERIA = {"collapse": search_criteria, "template": template_criteria}  # a search rule's criteria
