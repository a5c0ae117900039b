"""Which dial saw a change, and which first: in a grid of training runs with `dials` (the truth,
such as the template or grounded share, beside the diagnosis's estimates and the entropies), each
dial's change from the first diagnosis (step 1) to each later table step, paired within each run,

    change(s) = mean over seeds of [dial(run, s) - dial(run, 1)],   a 95% t interval (n - 1 df),

and the first step at which that interval lies off 0. A dial is read as stats.value_at reads it:
the diagnosis's numbers at the step itself, a per-step number (the token entropy, the length) the
mean of the WINDOW steps ending there. Descriptive: one interval a step and dial, nothing corrected
for how many there are; a grid's registered rules decide its claims.
"""
from lab import stats
from lab.grids import GRIDS

START = 1  # the first diagnosis: before the first update changed anything


def changes(name, data, start=START):
    """[{setting, dial, n, at_start, change_<s>, ci95_<s> for each later table step s,
    first_moved}] of a grid's archived runs `data` ({(setting, seed): records})."""
    g, rows = GRIDS[name], []
    later = [s for s in g["table_steps"] if s > start]
    for setting in g["settings"]:
        runs = [records for (s, _), records in sorted(data.items()) if s == setting]
        for dial in g.get("dials", []):
            mean, _, n = stats.interval([stats.value_at(r, dial, start) for r in runs])
            row = {"setting": setting, "dial": dial, "n": n, "at_start": mean}
            moved = None
            for step in later:
                m, half, _ = stats.interval([paired(r, dial, step, start) for r in runs])
                row[f"change_{step}"], row[f"ci95_{step}"] = m, half
                if moved is None and half is not None and abs(m) > half:
                    moved = step
            rows.append({**row, "first_moved": moved})
    return rows


def paired(records, dial, step, start):
    """dial at `step` minus dial at `start` in one run; None where either was not logged."""
    a, b = stats.value_at(records, dial, step), stats.value_at(records, dial, start)
    return None if a is None or b is None else a - b


def section(rows, start=START):
    """table.md's lines: each dial's value at `start` and its change to each later step."""
    if not rows:
        return []
    steps = [int(k.split("_")[1]) for k in rows[0] if k.startswith("change_")]
    lines = ["", f"## How each dial moved from step {start}", "",
             f"Per setting, each dial's change from step {start} to each table step, paired within "
             f"each run: mean ± 95% t half-width over the seeds; 'first' is the first step whose "
             f"interval lies off 0 (one interval a cell, none corrected for their number).", "",
             f"| setting | dial | n | step {start} | " + " | ".join(f"change to {s}" for s in steps)
             + " | first |", "|---|---|---|---|" + "---|" * len(steps) + "---|"]
    for r in rows:
        cells = [stats.fmt(r[f"change_{s}"], r[f"ci95_{s}"], "+") for s in steps]
        lines.append(f"| {r['setting']} | {r['dial']} | {r['n']} | {stats.fmt(r['at_start'])} | "
                     + " | ".join(cells) + f" | {r['first_moved'] or '-'} |")
    return lines
