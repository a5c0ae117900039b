"""The diagnosis's numbers scored in float32 and in bfloat16, on the same sampled reasonings: how far
bfloat16 moves the MI estimate, its z-score, retrieval and the work's MI, beside the effects
RESULTS.md reads.

    python bench/diagnosis_precision.py            # SmolLM2 pretrained and its cached warm starts, 5 seeds
    python bench/diagnosis_precision.py --quick    # pretrained only, 1 seed, 2 prompts x 1

For each policy -- SmolLM2-135M-Instruct pretrained, its coordinates warm start and the template
warm start of smollm2-grow (pool, ALPHA 0.25), each where built on this machine -- and each seed,
the probe set of the README's SmolLM2 command (8 FrozenLake prompts read with coordinates, 4
samples each of at most 40 tokens, temperature 1, sampled in float32) is cross-scored twice: in float32 and under
bfloat16 autocast (as a run scored on a GPU or an AVX512-BF16 CPU would be without
train.py's float32 diagnosis). Per metric: its float32 value, the difference bfloat16 - float32
per seed, their mean with a 95% t interval over the seeds, and the largest |difference|; then the
seconds each scoring took (on a CPU without AVX512-BF16 bfloat16 is emulated: its time there says
nothing about a machine that computes it).

Last line: RESULT precision <the largest |mean difference| of the per-token MI estimate over the
policies, in nats>.
"""
import functools
import math
import os
import statistics
import sys
import time

# the bench's siblings; arguments first: it lets OpenMP's threads sleep before torch loads
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arguments import Parser, at_least, parse, thread_count  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mi  # noqa: E402
import train  # noqa: E402
from plumbing import labels, models, probe_set, runs  # noqa: E402
from plumbing.defaults import PROBE_SEED_BASE  # noqa: E402

POLICIES = {"pretrained": None, "coords warm start": {},
            "template warm start (pool 0.25)": dict(template_prior=0.25, template_kind="pool")}
METRICS = ("mi_estimate", "mi_seq_estimate", "mi_zscore", "retrieval_acc",
           "conditional_entropy_seq", "work_mi_estimate", "work_mi_seq_estimate")


def load(name, threads, max_new_tokens):
    """The run of a policy of POLICIES, or None where its warm start is not built here."""
    template = POLICIES[name]
    if template is not None:
        folder, _ = models.smollm2_warm_start_folder("frozenlake", {}, observation="coords",
                                                     **template)
        if not os.path.isfile(os.path.join(folder, "warm_start.json")):
            return None
    a = train.Args(model="smollm2", warm_start=template is not None, observation="coords",
                   env="frozenlake", dtype="float32", threads=threads, out="unused",
                   max_new_tokens=max_new_tokens,
                   **(template or {}))
    runs.resolve_defaults(a, torch.device("cpu"))
    return runs.load_run(a, torch.device("cpu"), a.model)


def scored(run, firsts, per_prompt, copies, bfloat16):
    """The probe's metrics (mi.collapse_metrics, the work's as work_*) in one precision ->
    (metrics, seconds)."""
    xs, zs = mi.scored_ids(firsts[::per_prompt], firsts)
    owner = [i // per_prompt for i in range(len(firsts))]
    keys = [f.prompt for f in firsts[::per_prompt]]
    score = functools.partial(mi.cross_scores, run.policy, temperature=1.0, pad_id=run.pad_id)
    began = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bfloat16):
        table, lengths = score(xs, zs)
        work, work_lengths, _ = probe_set.work_scores(score, xs, copies, zs, owner)
    seconds = time.perf_counter() - began
    out = mi.collapse_metrics(table, owner, lengths, prompt_keys=keys)
    out.update({f"work_{k}": v for k, v in
                mi.collapse_metrics(work, owner, work_lengths, prompt_keys=keys).items()})
    return out, seconds


def interval(values):
    """mean and the half-width of its 95% t interval (n - 1 degrees of freedom; nan for one)."""
    from scipy import stats

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan")
    return mean, stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5


def main():
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=thread_count, default=2, help="torch.set_num_threads")
    parser.add_argument("--seeds", type=at_least(1), default=5, help="sampling seeds a policy")
    parser.add_argument("--prompts", type=at_least(2), default=8, help="probe prompts")
    parser.add_argument("--samples", type=at_least(1), default=4, help="samples a prompt")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=40,
                        help="a reply's most tokens (the README's SmolLM2 command's)")
    parser.add_argument("--quick", action="store_true",
                        help="the pretrained model, 1 seed, 2 prompts x 1 sample of 4 tokens")
    args = parse(parser, quick=dict(seeds=1, prompts=2, samples=1, max_new_tokens=4))
    worst = 0.0
    for name in list(POLICIES)[:1] if args.quick else POLICIES:
        run = load(name, args.threads, args.max_new_tokens)
        if run is None:
            print(f"{name}: not built on this machine (its warm start is not cached): skipped")
            continue
        seeds = [PROBE_SEED_BASE + i for i in range(args.prompts)]
        copies = labels.copies(run, seeds)
        rows, times = [], [[], []]
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            episodes = train.collect_rollouts(run, seeds, args.samples, temperature=1.0,
                                              max_turns=1)
            firsts = [e.first for e in episodes]
            pair = [scored(run, firsts, args.samples, copies, bf16) for bf16 in (False, True)]
            rows.append([m for m, _ in pair])
            for i, (_, seconds) in enumerate(pair):
                times[i].append(seconds)
        print(f"\n{name}: {args.prompts} prompts x {args.samples} samples, {args.seeds} seeds, "
              f"{args.threads} threads; the MI ceiling log N = {math.log(args.prompts):.3f}")
        print(f"{'metric':<26}{'float32':>10}{'bf16 - f32':>12}{'95% CI':>20}{'max |diff|':>12}"
              f"   per seed")
        for key in METRICS:
            diffs = [b[key] - f[key] for f, b in rows]
            mean, half = interval(diffs)
            print(f"{key:<26}{statistics.fmean(f[key] for f, _ in rows):>10.4f}{mean:>12.4f}"
                  f"{f'{mean - half:.4f} .. {mean + half:.4f}':>20}"
                  f"{max(map(abs, diffs)):>12.4f}   " + " ".join(f"{d:+.4f}" for d in diffs))
            if key == "mi_estimate":
                worst = max(worst, abs(mean))
        print(f"scoring seconds (median): float32 {statistics.median(times[0]):.1f}, bfloat16 "
              f"{statistics.median(times[1]):.1f}")
    print(f"RESULT precision {worst:.4f}")


if __name__ == "__main__":
    main()
