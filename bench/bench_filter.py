"""Filter savings: update time on the groups Top-P keeps vs on all groups, against the fraction of
episodes kept.

RAGEN-2 (Sec. 3.3, Fig. 5) drops the prompt groups with little reward spread before the update; it
reports 26-41% less compute per step. train.py removes the dropped groups before collation, so the
update (old log-probs, advantages, clipped loss, backward, optimiser steps; train.update_policy)
should cost in proportion to what is kept:

    time ratio = t(update on kept groups) / t(update on all groups)   ~   kept fraction = kept episodes / all episodes

Data: G groups x K episodes of tiny-policy transcripts (random tokens, 3 turns of template +
response, lengths varying by episode) with synthetic total rewards in the pattern the paper
describes (Fig. 11): a quarter of the groups without any spread (all failed with the same format
penalties, or all succeeded), the others spread from almost uniform to mixed. The filter is
snr_filter.select (Top-P, p = 0.9, linear), as in a training step.

Score (higher is better, 1 = the time saved equals the compute dropped):  1 - |time ratio - kept fraction|.
Target: time ratio within 0.1 of the kept fraction, i.e. score >= 0.9.

    python bench/bench_filter.py              # 16 groups x 8 episodes, GRPO update, tiny Qwen2
    python bench/bench_filter.py --quick      # tiny sizes, 1 repeat: proves the script still runs

Last line: RESULT filter <1 - |time ratio - kept fraction|>.
"""

import os
import sys

# the bench's siblings; arguments first: it lets OpenMP's threads sleep before torch loads
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arguments import Parser, at_least, multiple_of, parse, thread_count  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rollout  # noqa: E402
import snr_filter  # noqa: E402
import train  # noqa: E402
from plumbing import runs  # noqa: E402
from warmstart import tiny  # noqa: E402
from bench_cross_scores import median_seconds  # noqa: E402
from bench_step import make_run  # noqa: E402


def synthetic_rewards(groups, group_size, generator):
    """[G, K] total rewards: every fourth group has no spread, the others succeed (+10) with a
    per-group probability and pay a format penalty (-0.1) on 0..3 of their turns."""
    rewards = torch.zeros(groups, group_size)  # [G, K]
    for g in range(groups):
        if g % 4 == 3:
            rewards[g] = -0.3 if g % 8 == 3 else 10.0  # all failed alike / all succeeded
            continue
        p_success = (g + 1) / (groups + 1)
        success = torch.rand(group_size, generator=generator) < p_success  # [K]
        penalties = torch.randint(0, 4, (group_size,), generator=generator)  # [K]
        rewards[g] = 10.0 * success - 0.1 * penalties
    return rewards


def synthetic_episodes(rewards, turns, template_len, response_len, vocab, generator):
    """rollout.Episode records of random tokens: per turn template_len tokens (mask 0), then a
    response of response_len // 2 .. response_len tokens (mask 1); the total reward sits on the last
    response token."""
    episodes = []
    G, K = rewards.shape
    for g in range(G):
        for k in range(K):
            ids, mask = [], []
            for _ in range(turns):
                n = int(
                    torch.randint(response_len // 2, response_len + 1, (1,), generator=generator)
                )
                ids += torch.randint(1, vocab, (template_len + n,), generator=generator).tolist()
                mask += [0.0] * template_len + [1.0] * n
            episodes.append(
                rollout.Episode(
                    env=None,
                    group=g,
                    seed=g,
                    noise_seed=g * 1000 + k,
                    ids=ids,
                    policy_mask=mask,
                    logprobs=None,
                    prompt_text="",
                    turn_rewards=[float(rewards[g, k])],
                )
            )
    return episodes


def main():
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=thread_count, default=2, help="torch.set_num_threads")
    parser.add_argument("--groups", type=at_least(2), default=16)
    parser.add_argument("--group-size", type=at_least(2), default=8)
    parser.add_argument("--algo", default="grpo", choices=("ppo", "grpo", "drgrpo"))
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--turns", type=at_least(1), default=3)
    parser.add_argument("--template-len", type=at_least(1), default=40,
                        help="template tokens per turn")
    parser.add_argument("--response-len", type=at_least(1), default=48,
                        help="longest response per turn")
    parser.add_argument("--hidden", type=multiple_of(8), default=128)
    parser.add_argument("--layers", type=at_least(1), default=2)
    parser.add_argument("--repeats", type=at_least(1), default=7)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat")
    args = parse(parser, quick=dict(groups=4, group_size=2, turns=1, template_len=4,
                                    response_len=4, hidden=32, layers=1, repeats=1))
    torch.set_num_threads(args.threads)

    tokenizer = tiny.build_tokenizer()
    model = tiny.build_model(
        tokenizer,
        hidden_size=args.hidden,
        num_layers=args.layers,
        intermediate_size=2 * args.hidden,
    )
    run = make_run(
        [
            "--algo",
            args.algo,
            "--filter",
            "topp",
            "--top-p",
            str(args.top_p),
            "--groups",
            str(args.groups),
            "--group-size",
            str(args.group_size),
            "--threads",
            str(args.threads),
            "--model",
            "random-tiny",
        ],
        model,
        tokenizer,
    )
    generator = torch.Generator().manual_seed(0)
    rewards = synthetic_rewards(args.groups, args.group_size, generator)  # [G, K]
    episodes = synthetic_episodes(
        rewards, args.turns, args.template_len, args.response_len, len(tokenizer), generator
    )
    keep, stats = snr_filter.select(rewards, runs.filter_of(run.args))  # [G]
    everything = torch.ones_like(keep)  # [G]

    def update(groups_kept):
        kept = [e for e in episodes if groups_kept[e.group]]
        return train.update_policy(
            run, kept, rewards[groups_kept], torch.Generator().manual_seed(0)
        )

    update(everything)  # warm-up: optimiser state, allocator
    (t_kept, t_all), _ = median_seconds(
        [lambda: update(keep), lambda: update(everything)], args.repeats
    )
    # groups are equal-sized: the fraction of episodes too
    kept_fraction = int(keep.sum()) / len(keep)
    time_ratio = t_kept / t_all
    score = 1.0 - abs(time_ratio - kept_fraction)

    print(
        f"tiny Qwen2: hidden {args.hidden}, {args.layers} layers; torch threads {torch.get_num_threads()}; "
        f"{args.algo.upper()} update, {args.groups} groups x {args.group_size} episodes, {args.turns} turns of "
        f"{args.template_len} template + <= {args.response_len} response tokens; Top-P p = {args.top_p}; "
        f"median of {args.repeats}"
    )
    print(f"group reward std: {[round(s, 2) for s in snr_filter.group_scores(rewards).tolist()]}")
    print(
        f"zero-spread groups {stats['num_zero_var']}/{args.groups}, kept {stats['num_kept']}/{args.groups}"
    )
    print(f"{'update on':<28}{'seconds':>10}{'episodes':>10}")
    print(f"{'all groups':<28}{t_all:>10.3f}{len(episodes):>10d}")
    print(f"{'groups Top-P keeps':<28}{t_kept:>10.3f}{int(keep.sum()) * args.group_size:>10d}")
    print(
        f"time ratio {time_ratio:.3f}, kept fraction {kept_fraction:.3f} (compute saved {1 - time_ratio:.1%}; "
        f"target |difference| <= 0.1)"
    )
    print(f"RESULT filter {score:.3f}")


if __name__ == "__main__":
    main()
