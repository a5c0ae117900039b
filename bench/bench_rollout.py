"""Rollout throughput: the multi-turn loop (rollout.play + sampler.hf_policy) vs plain
model.generate on the same calls.

The loop (RAGEN-2, Sec. 4.1: prompt groups of K rollouts, up to 5 turns) adds work around each
model.generate call: rendering the chat template, tokenizing the environment's reply, parsing the
response, stepping the worlds, and recording each sampled token's log-prob. To measure only that
overhead, the plain side replays the very prompts the loop fed to the policy -- the same batch size,
the same (growing) prompt lengths turn by turn, the same token limit, the same number of calls --
through a bare model.generate with the same stop token. Both count the tokens actually produced (up
to and including the end-of-turn token), so the ratio is generated tokens per second, loop over
plain.

The loop keeps each episode's key/value cache between turns and encodes only the new tokens; the
plain replay encodes every turn's whole prompt, as a bare generate call must. The policy has random
weights: it never writes a valid action, so every episode takes the format penalty each turn and
runs all max_turns turns, and it rarely emits the end-of-turn token, so most turns run to the token
limit. On a GPU, --qwen 0.5b uses Qwen2.5-0.5B's shapes (bench_gpu.qwen_shaped) in bfloat16
autocast.

    python bench/bench_rollout.py              # tiny Qwen2, 4 groups x 8 rollouts, 5 turns, 48 tokens per turn
    python bench/bench_rollout.py --qwen 0.5b --groups 8 --group-size 16 --max-new-tokens 128   # on a GPU
    python bench/bench_rollout.py --quick      # tiny sizes, 1 repeat: proves the script still runs

Last line: RESULT rollout <loop tokens/s / plain generate tokens/s> (target >= 0.8).
"""

import os
import sys

# the bench's siblings; arguments first: it lets OpenMP's threads sleep before torch loads
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arguments import Parser, at_least, multiple_of, parse, thread_count  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import envs  # noqa: E402
import rollout  # noqa: E402
from plumbing import sampler  # noqa: E402
from warmstart import tiny  # noqa: E402
from bench_cross_scores import median_seconds  # noqa: E402


def recording(policy, calls):
    """The policy, also keeping a copy of every batch of prompts it is given (for the plain replay)."""

    def wrapped(prompt_ids, env_list=None):
        calls.append([list(p) for p in prompt_ids])
        return policy(prompt_ids, env_list)

    return wrapped


def produced(rows, stop_ids):
    """Tokens produced per row of a [B, N] generate output: up to and including the first stop token."""
    return sum(
        next((i + 1 for i, t in enumerate(row) if t in stop_ids), len(row)) for row in rows.tolist()
    )


@torch.no_grad()
def plain_generate(model, calls, max_new_tokens, stop_ids, pad):
    """Replay the loop's prompts through a bare, sampling model.generate; returns the tokens produced."""
    tokens = 0
    for prompt_ids in calls:
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)  # [B, P], left padded
        attention = torch.zeros_like(ids)  # [B, P]
        for b, p in enumerate(prompt_ids):
            ids[b, width - len(p) :] = torch.tensor(p)
            attention[b, width - len(p) :] = 1
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=attention.to(model.device),
            max_new_tokens=max_new_tokens,
            do_sample=True,
            top_k=0,
            eos_token_id=stop_ids,
            pad_token_id=pad,
        )
        tokens += produced(out[:, width:], stop_ids)
    return tokens


def plain_in(ctx, *args):
    with ctx:
        return plain_generate(*args)


def main():
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=thread_count, default=2, help="torch.set_num_threads")
    parser.add_argument("--env", default="sokoban", choices=tuple(envs.ENVS))
    parser.add_argument("--groups", type=at_least(1), default=4)
    parser.add_argument("--group-size", type=at_least(1), default=8)
    parser.add_argument("--turns", type=at_least(1), default=5)
    parser.add_argument("--max-new-tokens", type=at_least(1), default=48,
                        help="token limit per turn")
    parser.add_argument("--hidden", type=multiple_of(8), default=128)
    parser.add_argument("--layers", type=at_least(1), default=2)
    parser.add_argument("--repeats", type=at_least(1), default=5)
    parser.add_argument(
        "--qwen", default=None, choices=("0.5b", "1.5b", "3b"),
        help="Qwen2.5 shapes instead of the tiny model"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat")
    args = parse(parser, quick=dict(groups=1, group_size=2, turns=2, max_new_tokens=4, hidden=32,
                                    layers=1, repeats=1))
    torch.set_num_threads(args.threads)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.qwen:
        from bench_gpu import qwen_shaped

        model, tokenizer = qwen_shaped(args.qwen, device)
        model.eval()
    else:
        tokenizer = tiny.build_tokenizer()
        model = (
            tiny.build_model(
                tokenizer,
                hidden_size=args.hidden,
                num_layers=args.layers,
                intermediate_size=2 * args.hidden,
            )
            .eval()
            .to(device)
        )
    ctx = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    policy = sampler.hf_policy(model, tokenizer, args.max_new_tokens)
    stop_ids, pad = rollout.end_of_turn_ids(tokenizer), rollout.pad_token_id(tokenizer)
    seeds = list(range(args.groups))
    calls = []

    def loop():
        calls.clear()
        with ctx:
            episodes = rollout.play(
                recording(policy, calls),
                tokenizer,
                args.env,
                seeds,
                args.group_size,
                max_turns=args.turns,
                system=rollout.TINY_SYSTEM,
            )
        return sum(sum(e.response_lengths) for e in episodes)

    torch.manual_seed(0)
    loop()  # warm-up; also fills `calls` for the first plain replay
    (t_loop, t_plain), (loop_tokens, plain_tokens) = median_seconds(
        [loop, lambda: plain_in(ctx, model, calls, args.max_new_tokens, stop_ids, pad)],
        args.repeats,
    )
    loop_rate, plain_rate = loop_tokens / t_loop, plain_tokens / t_plain
    prompt_lengths = [len(c[0]) for c in calls]

    print(
        f"{'Qwen2.5-' + args.qwen + ' shapes' if args.qwen else f'tiny Qwen2: hidden {args.hidden}, {args.layers} layers'}"
        f" (random weights) on {device}, vocab {len(tokenizer)}; "
        f"torch threads {torch.get_num_threads()}; {args.env}, {args.groups} groups x {args.group_size} rollouts, "
        f"{len(calls)} calls of <= {args.max_new_tokens} new tokens, prompt lengths {prompt_lengths}; "
        f"median of {args.repeats}"
    )
    print(f"{'method':<44}{'seconds':>10}{'tokens':>9}{'tokens/s':>11}")
    for name, seconds, tokens in (
        ("multi-turn loop (rollout.play + hf_policy)", t_loop, loop_tokens),
        ("plain model.generate, same calls", t_plain, plain_tokens),
    ):
        print(f"{name:<44}{seconds:>10.3f}{tokens:>9d}{tokens / seconds:>11.1f}")
    print(f"RESULT rollout {loop_rate / plain_rate:.3f}")


if __name__ == "__main__":
    main()
