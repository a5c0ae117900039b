"""One training step of the main command, split into rollout / scoring / update: this code vs the
plain path.

    python bench/bench_step.py                 # tiny warm-started policy, Sokoban, 8 groups x 16 rollouts, PPO, Top-P
    python bench/bench_step.py --quick         # a random tiny policy, small sizes, 1 repeat: proves the script runs

The plain path is what the loop did before it was made fast, implemented here for the comparison
only:
  rollout  model.generate, every turn's whole prompt encoded again, log-probs recorded by a logits processor;
  update   every micro-batch (8 transcripts) padded to the longest transcript of the batch, run with an attention
           mask, full-vocabulary logits at every position, then log-probs and entropies taken from
           them.
This code: sampler.hf_policy (an explicit sampling loop that keeps each episode's key/value cache
between turns) and train.update_policy (length-sorted micro-batches of their own width, causal
attention without a mask, the output layer only at policy tokens, 8 transcripts a micro-batch on
a CPU). Both update the same kept episodes from the same weights; both rollouts start from the same
random state, so they sample the same tokens (checked and printed). Scoring (MI diagnosis + filter)
is the same code on both sides. Sides take turns; medians over --repeats.

Last line: RESULT step <plain step seconds / this code's step seconds> (higher is better).
"""

import argparse
import copy
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import logprobs  # noqa: E402
import models  # noqa: E402
import ppo  # noqa: E402
import rollout  # noqa: E402
import runs  # noqa: E402
import sampler  # noqa: E402
import train  # noqa: E402


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
        return sampler.as_generations(new.tolist(), logprobs.tolist(), stop_ids)

    return policy


def plain_logprobs(model, input_ids, mask, with_entropy=False, temperature=1.0):
    """Full logits at every position, then log-probs and entropies from them (the plain update's forward)."""
    attention_mask = (input_ids != PAD[0]).long()
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1] / temperature  # [b, T-1, V]
    logp = ppo.token_logprobs(logits, input_ids[:, 1:]) * mask
    return logp, ppo.entropy_from_logits(logits) * mask if with_entropy else None


PAD = [0]  # the pad id, set in main


def plain_critic_pass(run, mb):
    with run.ctx:
        return run.critic(mb["input_ids"], (mb["input_ids"] != PAD[0]).long())[:, :-1].float()


def plain_pieces(batch, rows, size):
    """Micro-batches of 8 in the given order, each padded to the longest transcript of the whole batch."""
    return [(sub, batch["input_ids"].shape[1]) for sub in rows.split(8)]


def make_run(flags, model=None, tokenizer=None):
    """A runs.Run from train.py flags (no run folder is created); with `model` and `tokenizer`
    given, the run uses them instead of loading --model."""
    a = runs.parse_args(train.Args, flags + ["--out", "/dev/null/unused"])
    runs.resolve_defaults(a, torch.device("cpu"))
    if model is None:
        return runs.load_run(a, torch.device("cpu"), a.model)
    load_policy = models.load_policy
    models.load_policy = lambda *args: (model, tokenizer, {})
    try:
        return runs.load_run(a, torch.device("cpu"), a.model)
    finally:
        models.load_policy = load_policy


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--env", default="sokoban")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--quick", action="store_true", help="a random tiny policy, small sizes, 1 repeat"
    )
    args = parser.parse_args()
    flags = ["--env", args.env, "--model", "tiny", "--threads", str(args.threads)]
    if args.quick:
        flags += [
            "--no-warm-start",
            "--groups",
            "2",
            "--group-size",
            "4",
            "--max-turns",
            "2",
            "--max-new-tokens",
            "8",
            "--mi-samples",
            "8",
            "--filter",
            "none",
        ]
        args.repeats = 1
    run = make_run(flags)
    a = run.args
    PAD[0] = run.pad_id
    start = copy.deepcopy(
        (run.policy.state_dict(), run.critic.state_dict(), [o.state_dict() for o in run.optimizers])
    )
    rows = {"plain": [], "this code": []}
    same_samples = True
    for repeat in range(args.repeats):
        seeds = torch.Generator().manual_seed(repeat)
        seeds = torch.randint(0, train.VAL_SEED_BASE, (a.groups,), generator=seeds).tolist()
        tokens = {}
        for side in ("plain", "this code"):
            run.policy.load_state_dict(start[0])
            run.critic.load_state_dict(start[1])
            for opt, state in zip(run.optimizers, start[2]):
                opt.load_state_dict(state)
            torch.manual_seed(repeat)
            policy_fn = plain_policy if side == "plain" else sampler.hf_policy
            original = (
                sampler.hf_policy,
                train.micro_batches,
                logprobs.policy_logprobs,
                a.micro_batch,
                train.critic_pass,
            )
            sampler.hf_policy = policy_fn
            episodes, t_rollout = timed(
                lambda: train.collect_rollouts(run, seeds, a.group_size, 1.0, 1.0)
            )
            sampler.hf_policy = original[0]
            tokens[side] = [e.ids for e in episodes]
            rewards = torch.tensor([e.total_reward for e in episodes]).view(a.groups, a.group_size)

            def scoring():
                train.diagnose(run, episodes, np.random.default_rng(0))
                return train.select(a, rewards)[0]

            keep, t_scoring = timed(scoring)
            kept = [e for e in episodes if keep[e.group]]
            if side == "plain":
                train.micro_batches, logprobs.policy_logprobs, a.micro_batch = plain_pieces, plain_logprobs, 8
                train.critic_pass = plain_critic_pass
            try:
                _, t_update = timed(
                    lambda: train.update_policy(
                        run, kept, rewards[keep], torch.Generator().manual_seed(0)
                    )
                )
            finally:
                train.micro_batches, logprobs.policy_logprobs, a.micro_batch = (
                    original[1],
                    original[2],
                    original[3],
                )
                train.critic_pass = original[4]
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

    print(
        f"tiny policy ({'random' if args.quick else 'warm-started'}), {args.env}, {a.groups} groups x "
        f"{a.group_size} rollouts, {a.algo}, filter {a.filter}; torch threads {torch.get_num_threads()}; "
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
    print(f"RESULT step {medians['plain'] / medians['this code']:.3f}")


if __name__ == "__main__":
    main()
