"""What scoring re-tokenised text (the official code's way) does to the MI diagnosis, against scoring
the token ids that were sampled (train.py's way), side by side on the same rollouts.

    python bench/bench_retokenize.py            # warm-started tiny policies, FrozenLake and Sokoban
    python bench/bench_retokenize.py --quick    # a random tiny policy, small sizes
    python bench/bench_retokenize.py --model smollm2   # the pretrained SmolLM2, 4 x 8 rollouts
    python bench/bench_retokenize.py --model smollm2 --world frozenlake --float64   # rounding out

For each world and sampling temperature: one batch of G groups x K rollouts of the warm-started tiny
policy, then train.diagnose and train.probe twice -- on the sampled ids and with --retokenize --
printing how many first reasonings do not tokenise back to their sampled ids, the largest |score of a
sample under its own prompt - its sampling log-prob| (diagnosis_logprob_diff; 0 up to rounding when
the sampled ids are scored), and the MI estimate, retrieval accuracy and I(Z;A|X) each way. With
--float64 the policy samples and scores in float64: what is left of diagnosis_logprob_diff is then
not float32's rounding (which grows with the reply's length and the model's depth).
RESULT: the share of reasonings that do not come back at the highest temperature (a measurement,
not a speed: higher means re-tokenising mis-scores more samples).
"""
import os
import sys

import numpy as np
# the bench's siblings; arguments first: it lets OpenMP's threads sleep before torch loads
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arguments import Parser, parse, thread_count  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rollout  # noqa: E402
import train  # noqa: E402
from plumbing import defaults, runs  # noqa: E402


def measure(world, temperature, groups, group_size, warm_start, threads, seed=0, model="tiny",
            max_new_tokens=None, float64=False):
    a = train.Args(model=model, env=world, warm_start=warm_start, temperature=temperature,
                   max_new_tokens=max_new_tokens,
                   threads=threads,
                   groups=groups, group_size=group_size, mi_samples=groups * group_size,
                   probe_prompts=groups, probe_samples=min(group_size, 8), out="runs/bench")
    runs.resolve_defaults(a, torch.device("cpu"))
    run = runs.load_run(a, torch.device("cpu"), a.model)
    if float64:
        run.policy.double()
    torch.manual_seed(seed)
    seeds = np.random.default_rng(seed).integers(0, defaults.VAL_SEED_BASE, groups).tolist()
    episodes = train.collect_rollouts(run, seeds, group_size, temperature, 1.0)
    back = [rollout._encode(run.tokenizer, e.first.reasoning) == e.first.reasoning_ids
            for e in episodes]
    row = {"world": world, "T": temperature, "differ": 1 - float(np.mean(back))}
    for way, retokenize in (("ids", False), ("text", True)):
        a.retokenize = retokenize
        run.state["std_ema"] = None
        d, p = train.diagnose(run, episodes, None), train.probe(run)
        row.update({f"{way}_diff": d["diagnosis_logprob_diff"], f"{way}_mi": d["mi_estimate"],
                    f"{way}_retrieval": d["retrieval_acc"], f"{way}_action_mi":
                        p["probe_action_mi"], f"{way}_probe_diff": p["probe_diagnosis_logprob_diff"]})
    return row


def main():
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a random tiny policy, small sizes")
    parser.add_argument("--threads", type=thread_count, default=2)
    parser.add_argument("--model", default="tiny", choices=("tiny", "smollm2"),
                        help="smollm2: the pretrained SmolLM2 (no warm start), 4 x 8 rollouts of "
                             "at most 64 tokens")
    parser.add_argument("--world", choices=("frozenlake", "sokoban"), help="one world only")
    parser.add_argument("--float64", action="store_true", help="sample and score in float64")
    args = parse(parser)
    torch.set_num_threads(args.threads)
    worlds, temperatures = [args.world] if args.world else ["frozenlake", "sokoban"], [1.0, 2.5]
    groups, group_size, tokens = 8, 16, None
    if args.model == "smollm2":
        groups, group_size, tokens = 4, 8, 64
    if args.quick:
        worlds, temperatures, groups, group_size = ["frozenlake"], [2.5], 2, 4
    # the tiny policy warm-started (random weights in quick mode); SmolLM2 as pretrained
    warm = not args.quick and args.model == "tiny"
    rows = [measure(w, T, groups, group_size, warm, args.threads, model=args.model,
                    max_new_tokens=tokens, float64=args.float64)
            for w in worlds for T in temperatures]
    policy = f"{'warm-started' if warm else 'untrained'} tiny policy" if args.model == "tiny" else (
        "pretrained SmolLM2-135M-Instruct")
    print(f"torch threads {torch.get_num_threads()}; {groups} groups x {group_size} rollouts, "
          f"{policy} in {'float64' if args.float64 else 'float32'}; probe: {groups} prompts")
    keys = ["differ", "ids_diff", "text_diff", "ids_probe_diff", "text_probe_diff", "ids_mi",
            "text_mi", "ids_retrieval", "text_retrieval", "ids_action_mi", "text_action_mi"]
    print(f"{'world':<11}{'T':>5}" + "".join(f"{k:>16}" for k in keys))
    for r in rows:
        print(f"{r['world']:<11}{r['T']:>5}" + "".join(f"{r[k]:>16.4g}" for k in keys))
    print(f"RESULT retokenize {rows[-1]['differ']:.3f}")


if __name__ == "__main__":
    main()
