"""What a real model's reasoning says over a run, read from its archives alone: the probe set's
first reasonings, which train.py logs as text (probe_reasonings, prompt by prompt) at every
diagnosis.

For each setting: a few probe prompts' reasonings at the first and at the last diagnosis, side by
side with their exact labels (warmstart/grounding.py: grounded, flipped, borrowed, ungrounded); how many
distinct reasonings each probe prompt gets from its samples (template collapse makes them fewer or
alike across prompts); and how often the phrases of a pretrained model's chat, which the
demonstrations never write, appear ("Let me ...", "step by step").
"""
import math
import re

from lab.grids import GRIDS
from plumbing.defaults import PROBE_SEED_BASE
from plumbing.flags import Args, env_kwargs, parse_args
from warmstart import grounding

# generic phrases of a chat model's reasoning, none of which the demonstrations write (lower case)
GENERIC = ("let me", "let's", "step by step", "i need to", "i will", "i'll", "first,", "okay",
           "we need", "think about", "the answer is")
SHOWN = 3  # probe prompts shown side by side
WIDTH = 70  # characters of a reasoning shown


def probe_ways(name, setting, prompts):
    """The way of each probe prompt's input, from the grid's flags (its world and map)."""
    g = GRIDS[name]
    a = parse_args(Args, g["flags"] + g["settings"][setting] + ["--out", "unused"])
    return {p: grounding.input_way(a.env, env_kwargs(a), PROBE_SEED_BASE + p)
            for p in range(prompts)}


def rows(name, data, samples_per_prompt):
    """One row a probe reasoning of every run's first and last diagnosis: setting, seed, step,
    prompt, its label and its text."""
    out = []
    for (setting, seed), records in sorted(data.items()):
        texts = [(r["step"], r["probe_reasonings"]) for r in records if r.get("probe_reasonings")]
        if not texts:
            continue
        prompts = len(texts[0][1]) // samples_per_prompt
        ways = probe_ways(name, setting, prompts)
        for step, flat in (texts[0], texts[-1]):
            for i, text in enumerate(flat):
                p = i // samples_per_prompt
                others = {w for q, w in ways.items() if q != p}
                out.append({"setting": setting, "seed": seed, "step": step, "prompt": p,
                            "label": grounding.label(text, ways[p], others), "text": text})
    return out


def relabel(name, data, prompts, samples_per_prompt):
    """Every archived diagnosis's probe label shares (probe_<label>_share) counted again from its
    logged reasonings (all `prompts` x `samples_per_prompt` of them) by the labels as they are
    now, so that a report reads one definition whatever the code that ran (a sign flip of the own
    way was called `borrowed` before it was split off as `flipped`); the records changed in
    place."""
    known = {}
    for (setting, _), records in data.items():
        for r in records:
            texts = r.get("probe_reasonings")
            if not texts or len(texts) != prompts * samples_per_prompt:
                continue
            if (setting, prompts) not in known:
                known[setting, prompts] = probe_ways(name, setting, prompts)
            ways = known[setting, prompts]
            counts = dict.fromkeys(grounding.LABELS, 0)
            for i, text in enumerate(texts):
                p = i // samples_per_prompt
                counts[grounding.label(text, ways[p], {w for q, w in ways.items() if q != p})] += 1
            r.update({f"probe_{k}_share": n / len(texts) for k, n in counts.items()})
    return data


SUFFIX = re.compile(r"\bTry (?:Up|Down|Left|Right)\.")  # the sentence, not "Trying ..."


def cap_and_suffix(data):
    """table.md's lines on two things a reading of the probe MI needs beside it: the summed MI
    against its cap, log N (a reasoning that restates its input's cells finds its prompt whatever
    follows), and, by diagnosis step, the share of probe reasonings that carry the demonstrations'
    random "Try <move>." suffix and the summed H(Z|X), means over every run."""
    points = [r for records in data.values() for r in records
              if r.get("probe_reasonings") and r.get("probe_mi_seq_estimate") is not None]
    if not points:
        return []
    summed = [r["probe_mi_seq_estimate"] for r in points]
    cap = math.log(1 / points[0]["probe_retrieval_chance"])
    retrieval = sorted({r["probe_retrieval_acc"] for r in points})
    lines = ["", "## The probe MI against its cap, and the demonstrations' random suffix", "",
             f"Over all {len(points)} probe diagnoses of all runs the summed probe MI lies in "
             f"{min(summed):.3f} .. {max(summed):.3f} nats, against its cap log N = {cap:.3f}; "
             f"retrieval in {retrieval[0]:.3f} .. {retrieval[-1]:.3f}. By diagnosis step, mean "
             f"over the runs:", "",
             "| step | share with \"Try <move>.\" | summed H(Z\\|X) |", "|---|---|---|"]
    for step in sorted({r["step"] for r in points}):
        at = [r for r in points if r["step"] == step]
        tried = [sum(bool(SUFFIX.search(t)) for t in r["probe_reasonings"])
                 / len(r["probe_reasonings"]) for r in at]
        entropy = [r["probe_conditional_entropy_seq"] for r in at]
        lines.append(f"| {step} | {sum(tried) / len(tried):.3f} | "
                     f"{sum(entropy) / len(entropy):.3f} |")
    return lines


def section(table, samples_per_prompt):
    """table.md's lines on what the reasoning looks like, from rows()."""
    if not table:
        return []
    lines = ["", "## What the reasoning looks like", "",
             f"The probe set's first reasonings at the first and the last diagnosis (seed "
             f"{table[0]['seed']}: the first {SHOWN} prompts, their first sample) with their "
             f"exact labels; every probe reasoning of every run's first and last diagnosis is in "
             f"reasonings.csv.", "",
             "| setting | prompt | first diagnosis | label | last diagnosis | label |",
             "|---|---|---|---|---|---|"]
    for setting in dict.fromkeys(r["setting"] for r in table):
        runs = [r for r in table if r["setting"] == setting]
        seed = runs[0]["seed"]
        steps = sorted({r["step"] for r in runs if r["seed"] == seed})
        for p in range(SHOWN):
            ends = [next((r for r in runs if (r["seed"], r["step"], r["prompt"]) == (seed, s, p)),
                         None) for s in (steps[0], steps[-1])]
            if None in ends:
                continue
            cells = " | ".join(f"`{clip(r['text'])}` | {r['label']}" for r in ends)
            lines.append(f"| {setting} | {p} | {cells} |")
    lines += ["", "Distinct reasonings a probe prompt gets from its "
              f"{samples_per_prompt} samples, and the share of reasonings with a chat model's "
              f"generic phrase ({', '.join(repr(g) for g in GENERIC[:4])}, ...), mean over the "
              f"prompts and seeds, at the first and the last diagnosis:", "",
              "| setting | distinct (first) | distinct (last) | generic (first) | generic (last) |",
              "|---|---|---|---|---|"]
    for setting in dict.fromkeys(r["setting"] for r in table):
        cells = []
        for measure in (distinct, generic):
            for end in (min, max):
                values = []
                for seed in sorted({r["seed"] for r in table if r["setting"] == setting}):
                    runs = [r for r in table if (r["setting"], r["seed"]) == (setting, seed)]
                    step = end(r["step"] for r in runs)
                    values.append(measure([r for r in runs if r["step"] == step]))
                cells.append(f"{sum(values) / len(values):.2f}")
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    return lines


def distinct(rows_of_a_diagnosis):
    """Mean over the probe prompts of the number of distinct reasonings among their samples."""
    prompts = {}
    for r in rows_of_a_diagnosis:
        prompts.setdefault(r["prompt"], set()).add(r["text"].strip())
    return sum(len(texts) for texts in prompts.values()) / max(1, len(prompts))


def generic(rows_of_a_diagnosis):
    """Share of the reasonings that hold one of the GENERIC phrases."""
    hits = [any(g in r["text"].lower() for g in GENERIC) for r in rows_of_a_diagnosis]
    return sum(hits) / max(1, len(hits))


def clip(text):
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= WIDTH else text[:WIDTH - 3] + "..."
