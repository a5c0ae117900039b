"""One training step, split into rollout / scoring / update: this code vs the plain path.

    python bench/bench_step.py                 # tiny warm-started policy, Sokoban, 8 groups x 16 rollouts, PPO, Top-P
    python bench/bench_step.py --model smollm2 # SmolLM2-135M-Instruct (pretrained), FrozenLake, 2 x 4, 2 turns of 32
    python bench/bench_step.py --quick         # a random tiny policy, small sizes, 1 repeat: proves the script runs

The plain path is what the loop did before it was made fast, implemented here for the comparison
only:
  rollout  model.generate, every turn's whole prompt encoded again, log-probs recorded by a logits processor;
  update   the ratio's old log-probs and entropies from a forward pass over the batch, every micro-batch (8
           transcripts) padded to the longest transcript of the batch, run with an attention mask, full-vocabulary
           logits at every position, then log-probs and entropies taken from them.
This code: sampler.hf_policy (an explicit sampling loop that keeps each episode's key/value cache
between turns, recording each token's log-prob and entropy) and train.update_policy (in float32 the
old log-probs and entropies are the sampler's; length-sorted micro-batches of their own width, causal
attention without a mask, the output layer only at policy tokens, 8 transcripts a micro-batch on
a CPU). Both update the same kept episodes from the same weights; both rollouts start from the same
random state, so they sample the same tokens (checked and printed). Scoring (MI diagnosis + filter)
is the same code on both sides. Sides take turns; medians over --repeats. This code's update also
runs a second time on the same episodes with the old log-probs recomputed by a forward pass (as for
a policy that records none), the two in turn: the saving of taking them from the sampler.

With --model smollm2 the sizes are small enough for 2 CPU cores, and --filter none keeps every group
(Top-P skips the update when no group has reward spread, likely for a model not taught the format).

Last line: RESULT step <plain step seconds / this code's step seconds> (higher is better).
"""

import contextlib
import copy
import dataclasses
import os
import statistics
import sys
import time

# as train.py: OpenMP threads that spin at barriers would take the shared cores from other work

import numpy as np  # noqa: E402
# the bench's siblings; arguments first: it lets OpenMP's threads sleep before torch loads
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arguments import Parser, at_least, parse, refuse, thread_count  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import envs  # noqa: E402
import generate  # noqa: E402
import logprobs  # noqa: E402
import rollout  # noqa: E402
import snr_filter  # noqa: E402
import train  # noqa: E402
from plumbing import defaults, models, runs, sampler  # noqa: E402
from plumbing.flags import UsageError, parse_args  # noqa: E402


def plain_policy(model, tokenizer, max_new_tokens, temperature=1.0, top_p=1.0):
    """The plain sampler: one model.generate call per turn on the whole left-padded prompts."""
    from transformers import LogitsProcessorList

    stop_ids, pad = rollout.end_of_turn_ids(tokenizer), rollout.pad_token_id(tokenizer)

    def policy(prompt_ids, env_list=None):
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for b, p in enumerate(prompt_ids):
            ids[b, width - len(p) :] = torch.tensor(p)
            attention[b, width - len(p) :] = 1
        tables = []

        # every step's log-softmax, for the sampled tokens' log-probs
        def record(input_ids, scores):
            tables.append(torch.log_softmax(scores / temperature, dim=-1))
            return scores / temperature

        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=attention,
                max_new_tokens=max_new_tokens,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                eos_token_id=stop_ids,
                pad_token_id=pad,
                logits_processor=LogitsProcessorList([record]),
            )
        new = out[:, width:]
        logprobs = torch.stack(tables, 1)[:, : new.shape[1]].gather(-1, new[..., None])[..., 0]
        return generate.as_generations(new.tolist(), logprobs.tolist(), stop_ids)

    return policy


def plain_attention(input_ids):
    """The attention mask of right-padded transcripts: every token up to a row's last one that is not the pad id
    (SmolLM2 pads with its end-of-turn token, which also stands inside transcripts; a row's own last one is then
    masked too, which changes no logit that is used)."""
    positions = torch.arange(input_ids.shape[1])                                            # [T]
    last = torch.where(input_ids != PAD[0], positions, 0).amax(1)                           # [b]
    return (positions <= last[:, None]).long()                                              # [b, T]


def plain_logprobs(model, input_ids, mask, with_entropy=False, temperature=1.0):
    """Full logits at every position, then log-probs and entropies from them (the plain update's forward)."""
    attention_mask = plain_attention(input_ids)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1] / temperature  # [b, T-1, V]
    table = torch.log_softmax(logits.float(), -1)  # float32, as the plain update it stands for
    logp = table.gather(-1, input_ids[:, 1:, None])[..., 0] * mask                          # [b, T-1]
    return logp, logprobs.entropy(table) * mask if with_entropy else None


PAD = [0]  # the pad id, set in main


def plain_critic_pass(run, input_ids, mask=None):
    with run.ctx:
        return run.critic(input_ids, plain_attention(input_ids))[:, :-1].float()


MICRO_BATCHES = train.micro_batches  # this code's


def plain_pieces(batch, rows, size, agg="token-mean"):
    """Micro-batches of 8 in the given order, each padded to the longest transcript of the whole batch."""
    full = torch.full_like(batch["lengths"], batch["input_ids"].shape[1])
    return MICRO_BATCHES({**batch, "lengths": full}, rows, 8, agg)


def make_run(flags, model=None, tokenizer=None):
    """A runs.Run from train.py flags (no run folder is created); with `model` and `tokenizer`
    given, the run uses them instead of loading --model. Settings train.py refuses, and a model
    that cannot load, are one line and exit code 2."""
    load_policy = models.load_policy
    if model is not None:
        models.load_policy = lambda *args: (model, tokenizer, {})
    try:
        a = parse_args(train.Args, flags + ["--out", "/dev/null/unused"])
        runs.resolve_defaults(a, torch.device("cpu"))
        return runs.load_run(a, torch.device("cpu"), a.model)
    except (UsageError, models.ModelError) as e:
        refuse(e)
    finally:
        models.load_policy = load_policy


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


SIZES = {  # train.py flags of each measured step
    "tiny": [],  # the main command's sizes and the cached warm start
    "smollm2": ["--no-warm-start", "--groups", "2", "--group-size", "4", "--max-turns", "2",
                "--max-new-tokens", "32", "--mi-samples", "8", "--filter", "none"],
    "quick": ["--no-warm-start", "--groups", "2", "--group-size", "4", "--max-turns", "2",
              "--max-new-tokens", "8", "--mi-samples", "8", "--filter", "none"],
}


def restore(run, start):
    """The policy, critic and optimisers as they were at the start: every side starts alike."""
    run.policy.load_state_dict(start[0])
    run.critic.load_state_dict(start[1])
    for opt, state in zip(run.optimizers, start[2]):
        opt.load_state_dict(state)


@contextlib.contextmanager
def plain_update(run):
    """The plain update's pieces in place of this code's, put back on exit."""
    saved = train.micro_batches, logprobs.policy_logprobs, run.args.micro_batch, train.critic_pass
    train.micro_batches, logprobs.policy_logprobs, run.args.micro_batch = plain_pieces, plain_logprobs, 8
    train.critic_pass = plain_critic_pass
    try:
        yield
    finally:
        train.micro_batches, logprobs.policy_logprobs, run.args.micro_batch, train.critic_pass = saved


def timed_update(run, start, episodes, rewards):
    """train.update_policy on `episodes` from the start's weights -> (its metrics, seconds)."""
    restore(run, start)
    return timed(lambda: train.update_policy(run, episodes, rewards, torch.Generator().manual_seed(0)))


def main():
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=thread_count, default=2, help="torch.set_num_threads")
    parser.add_argument("--model", default="tiny", choices=("tiny", "smollm2"))
    parser.add_argument("--env", default=None, choices=tuple(envs.ENVS),
                        help="the world (tiny: sokoban; smollm2: frozenlake)")
    parser.add_argument("--repeats", type=at_least(1), default=None,
                        help="tiny: 3; smollm2: 1 (5 minutes each)")
    parser.add_argument(
        "--quick", action="store_true", help="a random policy, small sizes, 1 repeat"
    )
    args = parse(parser)
    args.env = args.env or ("sokoban" if args.model == "tiny" else "frozenlake")
    flags = ["--env", args.env, "--model", args.model, "--threads", str(args.threads)]
    run = make_run(flags + SIZES["quick" if args.quick else args.model])
    args.repeats = args.repeats or (1 if args.quick else 3 if args.model == "tiny" else 1)
    a = run.args
    PAD[0] = run.pad_id
    start = copy.deepcopy(
        (run.policy.state_dict(), run.critic.state_dict(), [o.state_dict() for o in run.optimizers])
    )
    rows = {"plain": [], "this code": []}
    saving = []  # (update with the forward pass, from the sampler, their mean |log-prob diff|)
    same_samples = True
    hf_policy = sampler.hf_policy
    for repeat in range(args.repeats):
        seeds = torch.Generator().manual_seed(repeat)
        seeds = torch.randint(0, defaults.VAL_SEED_BASE, (a.groups,), generator=seeds).tolist()
        tokens = {}
        for side in ("plain", "this code"):
            restore(run, start)
            torch.manual_seed(repeat)
            sampler.hf_policy = plain_policy if side == "plain" else hf_policy
            try:
                episodes, t_rollout = timed(
                    lambda: train.collect_rollouts(run, seeds, a.group_size, 1.0, 1.0)
                )
            finally:
                sampler.hf_policy = hf_policy
            tokens[side] = [e.ids for e in episodes]
            rewards = torch.tensor([e.total_reward for e in episodes]).view(a.groups, a.group_size)

            def scoring():
                train.diagnose(run, episodes, np.random.default_rng(0))
                return snr_filter.select(rewards, runs.filter_of(a))[0]

            keep, t_scoring = timed(scoring)
            kept = [e for e in episodes if keep[e.group]]
            if side == "plain":  # its episodes carry no entropies: the forward pass runs
                with plain_update(run):
                    _, t_update = timed_update(run, start, kept, rewards[keep])
            else:  # the same update with and without the old log-probs' forward pass, in turn
                forward = [dataclasses.replace(e, entropies=None) for e in kept]
                order = [("sampler", kept), ("forward", forward)][:: 1 if repeat % 2 else -1]
                t = {name: timed_update(run, start, eps, rewards[keep]) for name, eps in order}
                t_update = t["sampler"][1]
                saving.append((t["forward"][1], t_update, t["forward"][0]["rollout_logprob_diff"]))
            rows[side].append(
                (
                    t_rollout,
                    t_scoring,
                    t_update,
                    keep.float().mean().item(),
                    sum(sum(e.response_lengths) for e in episodes),
                )
            )
        same_samples &= tokens["plain"] == tokens["this code"]

    policy = {"tiny": "tiny policy", "smollm2": "SmolLM2-135M-Instruct"}[args.model]
    weights = "warm-started" if a.warm_start else "random" if args.model == "tiny" else "pretrained"
    print(
        f"{policy} ({weights}), {args.env}, {a.groups} groups x {a.group_size} rollouts, {a.max_turns} turns of "
        f"<= {a.max_new_tokens} tokens, {a.algo}, filter {a.filter}; torch threads {torch.get_num_threads()}; "
        f"median of {args.repeats}; both sides sampled the same tokens: {same_samples}"
    )
    print(
        f"{'path':<12}{'rollout s':>11}{'scoring s':>11}{'update s':>10}{'step s':>9}{'kept':>7}{'tokens':>8}"
    )
    medians = {}
    for side, values in rows.items():
        m = [statistics.median(column) for column in zip(*values)]
        medians[side] = m[0] + m[1] + m[2]
        print(
            f"{side:<12}{m[0]:>11.2f}{m[1]:>11.2f}{m[2]:>10.2f}{medians[side]:>9.2f}{m[3]:>7.2f}{int(m[4]):>8d}"
        )
    forward, sampled, diff = (statistics.median(column) for column in zip(*saving))
    print(
        f"this code's update with the old log-probs from a forward pass {forward:.2f} s, from the sampler "
        f"{sampled:.2f} s: {forward - sampled:.2f} s saved ({(forward - sampled) / forward:.0%}); the two "
        f"differ by {diff:.1e} nats a token (mean)"
    )
    print(f"RESULT step {medians['plain'] / medians['this code']:.3f}")


if __name__ == "__main__":
    main()
