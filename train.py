"""The experiment: multi-turn PPO / GRPO on a text world, with SNR-aware filtering and the MI
diagnosis (RAGEN-2).

    python train.py --env sokoban --filter topp   # tiny on a CPU, Qwen2.5-0.5B-Instruct on a GPU

One training step, as `train` below runs it (the right column names the code):
  1. rollouts     G prompt groups (one env seed each) x K rollouts, up to 5 turns     rollout.play
  2. diagnosis    step 1 and every 5 steps, before filtering: cross-score each        mi
                  first-turn reasoning under every prompt of the batch                mi
  3. filter       rank groups by reward std, keep Top-P / Top-K; dropped groups       snr_filter
                  never reach the advantages; nothing kept -> no update
  4. old / ref    log-probs of the sampled tokens before the update, critic values    logprobs
  5. advantages   PPO: GAE with the critic, whitened; GRPO / Dr.GRPO: group-relative  ppo.gae, grpo
  6. update       clipped loss - entropy bonus (+ KL), micro-batches, grad clip 1.0   ppo.policy_loss
  7. bookkeeping  metrics.jsonl line, validation every 10 steps, checkpoint, figures

The flags and their checks are in plumbing/flags.py, step 2's sampling and cross-scoring in
plumbing/diagnosis.py; everything else around the loop -- the run folder, resuming, one-line
errors -- is in plumbing/runs.py (its checkpoints in plumbing/checkpoints.py), and loading the
models in plumbing/models.py; a first reading may skip them (plumbing/README.md).
"""
import os
import sys
import time

from plumbing import flags
from plumbing.flags import Args  # every flag, one line of help each (python train.py --help)

if __name__ == "__main__":  # a bad flag is refused now, in about a second, before torch loads
    flags.refuse_now(flags.parse_args, Args, sys.argv[1:])

# OpenMP threads that spin at every barrier take shared cores from other work (the tiny warm start
# beside one busy process on 2 cores: 73 s -> 1387 s); passive waiting lets them sleep. OpenMP
# reads it once, when torch loads it: set before anything imports torch (bench_shared_cores.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import grpo  # noqa: E402
import logprobs  # noqa: E402
import ppo  # noqa: E402
import rollout  # noqa: E402
import snr_filter  # noqa: E402
from plumbing import models, runs, sampler  # noqa: E402
from plumbing.defaults import MAX_SKIPS, VAL_SEED_BASE  # noqa: E402
from plumbing.diagnosis import diagnose, probe  # noqa: E402

ANALYSIS_KL_COEF = 1e-3  # Fig. 4's KL coefficient without --kl-coef (the paper's analysis runs)
AGGREGATION = {"ppo": "token-mean", "grpo": "seq-mean-token-mean",
               "drgrpo": "seq-mean-token-sum-norm"}


# ----------------------------------------------------------------------------------------- the loop

def train(run):
    """Steps 1-7 until a.steps; `run` (runs.start) holds the models, optimisers, run folder and the
    loop's state."""
    a = run.args
    for step in range(run.step + 1, a.steps + 1):
        m = {"step": step}
        t0 = time.time()
        rng = np.random.default_rng([a.seed, step])  # this step's seeds and shuffling, alone

        # 1. rollouts: G groups (env seeds) x K samples
        seeds = rng.integers(0, VAL_SEED_BASE, a.groups).tolist()
        episodes = collect_rollouts(run, seeds, a.group_size, a.temperature, a.sample_top_p)
        rewards = torch.tensor([e.total_reward for e in episodes]).view(a.groups, -1)  # [G, K]
        m.update(rollout_stats(episodes, rewards), time_rollout=time.time() - t0)

        # 2. diagnosis, before filtering: does the reasoning still depend on its prompt?
        t1 = time.time()
        if a.mi_every and (step == 1 or step % a.mi_every == 0):
            m.update(diagnose(run, episodes, np.random.default_rng([a.seed, step, 1])))
            m.update(probe(run))
        if a.grad_decomp_every and step % a.grad_decomp_every == 0:
            m["grad_decomposition"] = decompose_gradients(run, episodes, rewards)

        # 3. the filter: whole groups, before any advantage is computed
        keep, stats = snr_filter.select(a, rewards, step)                                   # [G]
        m.update(stats, time_scoring=time.time() - t1, skipped=not keep.any())
        m.update(snr_filter.zero_spread_split(rewards, [e.success for e in episodes]))

        # 4-6. the update, on the kept groups only
        t2 = time.time()
        if keep.any():
            run.state["skips"] = 0
            kept = [e for e in episodes if keep[e.group]]
            shuffle = torch.Generator().manual_seed(int(rng.integers(2 ** 62)))
            m.update(update_policy(run, kept, rewards[keep], shuffle))
        else:
            run.state["skips"] += 1
        m["time_update"] = time.time() - t2

        # 7. bookkeeping
        if a.val_every and (step % a.val_every == 0 or step == a.steps):
            m["val_success"] = validate(run)
        m["time_step"] = time.time() - t0
        runs.record(run, m)  # metrics.jsonl line, checkpoint, progress bar
        if run.state["skips"] >= MAX_SKIPS:
            print(f"stopping: no group had any reward spread for {MAX_SKIPS} steps (step {step})")
            break


def main(argv=None):
    """Parse the flags, start the run (None: it is finished), validate the starting point, train,
    finish; a failure ends in one line and an exit code (runs.failed)."""
    run = None
    try:
        run = runs.start(flags.parse_args(Args, sys.argv[1:] if argv is None else argv))
        if run is not None:
            if run.step == 0 and (run.args.val_every or run.args.steps == 0):  # what training adds
                runs.record(run, {"step": 0, "val_success": validate(run)})
            train(run)
            runs.finish(run)
        return 0
    except BaseException as e:  # noqa: B036 -- runs.failed raises again what it does not know
        return runs.failed(e, run)
    finally:
        runs.close(run)


# ---------------------------------------------------------------------------------------- the steps

def collect_rollouts(run, seeds, group_size, temperature, top_p):
    """Step 1: len(seeds) groups x group_size episodes, sampled in eval mode (no dropout) under the
    run's dtype, at most --rollout-batch episodes at a time (on a GPU their key/value caches fill
    the memory)."""
    a = run.args
    run.policy.eval()
    per_call = max(1, (a.rollout_batch or len(seeds) * group_size) // group_size)  # whole groups
    episodes = []
    for first in range(0, len(seeds), per_call):
        policy = sampler.hf_policy(run.policy, run.tokenizer, a.max_new_tokens, temperature, top_p)
        with run.ctx, runs.finite_sampling(run.step + 1):
            played = rollout.play(policy, run.tokenizer, a.env, seeds[first:first + per_call],
                                  group_size, runs.env_kwargs(a), a.max_turns,
                                  a.max_actions_per_turn, **run.prompt)
        for e in played:
            e.group += first
        episodes += played
    return episodes


def rollout_stats(episodes, rewards):
    return {"train_success": float(np.mean([e.success for e in episodes])),
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
            "response_length": float(np.mean([n for e in episodes for n in e.response_lengths])),
            "turns": float(np.mean([e.turns for e in episodes])),
            "cut_frac": float(np.mean([e.cut for e in episodes]))}


def decompose_gradients(run, episodes, rewards):
    """Fig. 4 on this batch: task / KL / entropy gradient norms per reward-spread bucket, no
    optimiser step. The task term trains on the advantages an update of the whole batch would
    (compute_advantages: PPO's whitened GAE, GRPO's group-relative ones), aggregated as the update
    aggregates. The KL is measured against the initial policy (the warm start; with LoRA the base),
    the run's --kl-kind at its --kl-coef or, without one, at the analysis runs' 0.001."""
    a = run.args
    batch = rollout_batch(run, episodes)
    ref = over_batch(run, batch, reference_pass)                                        # [B, T-1]
    values = over_batch(run, batch, critic_pass) if run.critic is not None else None
    advantages, _ = compute_advantages(run, batch, rewards, values)                     # [B, T-1]
    with run.ctx:
        buckets = snr_filter.gradient_decomposition(
            run.policy, batch["input_ids"], batch["attention_mask"], batch["policy_mask"], rewards,
            ref_logp=ref, kl_coef=a.kl_coef or ANALYSIS_KL_COEF, kl_kind=a.kl_kind,
            entropy_coef=a.entropy_coef, temperature=a.temperature, advantages=advantages,
            agg=AGGREGATION[a.algo], norm_length=flags.response_budget(a))
    run.policy.zero_grad(set_to_none=True)
    return [{k: v for k, v in b.items() if k != "groups"} for b in buckets]


def update_policy(run, episodes, rewards, shuffle):
    """Steps 4-6 on the kept episodes (`rewards` [G_kept, K]). The dropped groups were removed
    before collation: nothing of them (padding width, advantages, normalisers) reaches the
    update."""
    args = run.args
    batch = rollout_batch(run, episodes)
    mask = batch["policy_mask"][:, 1:]                                 # [B, T-1] the trained tokens

    # 4. before the update: the ratio's old log-probs, the reference's, the critic's values
    old_logp, old_entropy, checks = old_policy(run, batch)                              # [B, T-1]
    step = run.step + 1  # a loss, gradient norm or log-prob that is not finite stops the run here
    runs.finite(old_logp[mask.bool()], "a log-prob of the sampled tokens", step)
    ref_logp = over_batch(run, batch, reference_pass) if args.kl_coef else None         # [B, T-1]
    old_values = over_batch(run, batch, critic_pass) if run.critic is not None else None

    # 5. advantages
    advantages, returns = compute_advantages(run, batch, rewards, old_values)           # [B, T-1]

    # 6. the update: each mini-batch one optimiser step; every logged number is the mini-batch's,
    # averaged over the mini-batches
    targets = dict(mask=mask, old_logp=old_logp, advantages=advantages, ref_logp=ref_logp,
                   old_values=old_values, returns=returns)                      # [B, T-1] or None
    # Hugging Face layers recompute activations (--grad-checkpointing) only in training mode; the
    # models here have no dropout, so nothing else changes
    run.policy.train()
    if run.critic is not None:
        run.critic.train()
    logs = {}
    for _ in range(args.epochs):
        for mini_batch in mini_batches(len(mask), args.mini_batch_size, args.optimizer_steps,
                                       shuffle):
            for k, v in optimizer_step(run, batch, targets, mini_batch).items():
                logs.setdefault(k, []).append(v)
    for opt in run.optimizers:  # no gradients kept while the next rollouts sample
        opt.zero_grad(set_to_none=True)
    out = {k: float(np.mean(v)) for k, v in logs.items()}
    out["token_entropy"] = ppo.masked_mean(old_entropy, mask).item()
    out["optimizer_steps"] = len(logs["grad_norm"])  # one grad_norm per optimiser step
    return {**out, **checks}


def optimizer_step(run, batch, targets, mini_batch):
    """One optimiser step on the rows `mini_batch`, its gradient summed over micro-batches weighted
    so that they add up to the mini-batch's loss -> the mini-batch's numbers: the loss's terms
    (the policy loss's add up with its weight, token means with the tokens') and grad_norm."""
    a, step = run.args, run.step + 1
    mask = targets["mask"]
    for opt in run.optimizers:
        opt.zero_grad(set_to_none=True)
    stats = {}
    for rows, width in micro_batches(batch, mini_batch, a.micro_batch):
        micro = {k: v[rows, :width] for k, v in batch.items() if v.dim() == 2}         # [b, w]
        sliced = {k: v[rows, :width - 1] for k, v in targets.items() if v is not None}  # [b, w-1]
        weight = micro_batch_weight(mask, mini_batch, rows, AGGREGATION[a.algo])
        token_weight = micro_batch_weight(mask, mini_batch, rows, "token-mean")
        for k, v in micro_batch_backward(run, micro, sliced, weight, token_weight).items():
            w = weight if k in ("pg_loss", "entropy_loss", "kl_loss") else token_weight
            v = v.item() if torch.is_tensor(v) else v  # terms in the graph: no grad
            stats[k] = stats.get(k, 0.0) + w * v
    stats["grad_norm"] = runs.finite(float(torch.nn.utils.clip_grad_norm_(
        run.policy_params, a.grad_clip)), "the gradient norm", step)
    if run.critic is not None:
        runs.finite(torch.nn.utils.clip_grad_norm_(run.critic_params, a.grad_clip),
                    "the critic's gradient norm", step)
    for opt in run.optimizers:
        opt.step()
    return stats


def micro_batch_backward(run, micro, t, weight, token_weight):
    """Step 6's loss on one micro-batch (`t`: its slices of the targets [b, w-1]), each part
    backward with its weight in the mini-batch -> the loss's terms: ppo.policy_loss's clipped
    policy loss - entropy bonus (+ KL) and, with a critic, the clipped value loss."""
    a, step = run.args, run.step + 1
    logp, entropy = policy_pass(run, micro, with_entropy=True)                          # [b, w-1]
    loss, terms = ppo.policy_loss(
        logp, t["old_logp"], t["advantages"], t["mask"], AGGREGATION[a.algo], entropy=entropy,
        entropy_coef=a.entropy_coef, ref_logp=t.get("ref_logp"), kl_coef=a.kl_coef,
        kl_kind=a.kl_kind, clip_low=a.clip_low, clip_high=a.clip_high, clip_c=a.clip_c or None,
        norm_length=flags.response_budget(a))
    (weight * runs.finite(loss, "the policy loss", step)).backward()
    if run.critic is not None:
        value_loss = ppo.value_loss(critic_pass(run, micro), t["old_values"], t["returns"],
                                    t["mask"], a.value_clip)
        (token_weight * runs.finite(value_loss, "the critic's loss", step)).backward()
        terms["value_loss"] = value_loss.item()
    return terms


def old_policy(run, batch):
    """Step 4's log-probs of the sampled tokens and the policy's entropy there, before the update
    -> ([B, T-1], [B, T-1], metrics). In float32 the sampler recorded the same numbers (both take
    the log-softmax in float64; they agree within 1e-5 nats a token, tests/test_train.py), so they
    are taken from it: no forward pass over the batch. Under bf16 autocast they differ (the
    sampler's one-token passes over a cache round otherwise than a pass over whole transcripts),
    and a scripted policy records none: then the forward pass, and how far the sampler's own
    log-probs are from it (rollout_logprob_diff; far from 0 means off-policy scoring)."""
    if run.args.dtype == "float32" and "logprobs" in batch and "entropies" in batch:
        return batch["logprobs"][:, 1:], batch["entropies"][:, 1:], {}
    old_logp, old_entropy = over_batch(run, batch, policy_pass, with_entropy=True)      # [B, T-1]
    if "logprobs" not in batch:
        return old_logp, old_entropy, {}
    diff = ppo.masked_mean((batch["logprobs"][:, 1:] - old_logp).abs(), batch["policy_mask"][:, 1:])
    return old_logp, old_entropy, {"rollout_logprob_diff": diff.item()}


def compute_advantages(run, batch, rewards, values):
    """Step 5 -> (advantages, returns) [B, T-1] over the policy tokens: PPO's GAE on the critic's
    `values`, whitened over the batch (returns: the critic's targets); GRPO / Dr.GRPO's group-relative
    advantage of each episode on all its tokens (returns None)."""
    a = run.args
    mask = batch["policy_mask"][:, 1:]                                                  # [B, T-1]
    if run.critic is not None:
        return ppo.gae(batch["token_rewards"][:, 1:], values, mask, a.gamma, a.lam)
    per_episode = grpo.group_advantages(rewards, normalize_std=a.algo == "grpo").reshape(-1)
    return grpo.episode_advantages_to_tokens(per_episode.to(mask.device), mask), None


def validate(run):
    """Success on the fixed held-out seeds, one rollout each, at the validation temperature. Its
    sampling runs on a forked RNG, so validating does not change the training stream."""
    a = run.args
    with torch.random.fork_rng(devices=[run.device] if run.device.type == "cuda" else []):
        torch.manual_seed(a.seed)
        seeds = [VAL_SEED_BASE + i for i in range(a.val_seeds)]
        episodes = collect_rollouts(run, seeds, 1, temperature=a.val_temperature, top_p=1.0)
    return float(np.mean([e.success for e in episodes]))


# ------------------------------------------------------------------------------------------ batches

def rollout_batch(run, episodes):
    """The episodes as right-padded tensors on the run's device (rollout.collate), with lengths."""
    batch = {k: v.to(run.device) for k, v in rollout.collate(episodes, run.pad_id).items()}
    batch["lengths"] = batch["attention_mask"].sum(1)                                       # [B]
    return batch


def mini_batches(n_rows, size, optimizer_steps, generator):
    """The rows of one epoch in a random order (torch.randperm on `generator`), cut into
    mini-batches, one optimiser step each -> list of row tensors covering every row once:
    optimizer_steps = 0: mini-batches of `size` rows, the last one shorter (as verl does: a
    filtered batch then takes fewer optimiser steps); optimizer_steps = N: N mini-batches of
    near-equal size (differing by at most one row) whatever n_rows (at most n_rows of them), so
    that runs with and without a filter can be compared at equal optimiser steps."""
    order = torch.randperm(n_rows, generator=generator)                                    # [B]
    if optimizer_steps:
        return list(order.tensor_split(min(optimizer_steps, n_rows)))
    return list(order.split(size))


def micro_batches(batch, rows, size):
    """Micro-batches of at most `size` of the given rows, each with the width of its longest
    transcript: rows are sorted by length first, so short transcripts are not padded to the longest
    of the whole batch."""
    rows = rows[torch.argsort(batch["lengths"][rows].cpu(), descending=True, stable=True)]
    return [(sub, int(batch["lengths"][sub].max())) for sub in rows.split(size)]


@torch.no_grad()
def over_batch(run, batch, fn, **kw):
    """fn(run, micro-batch, **kw) -> [b, w-1] tensor (or a tuple of them), run over the whole batch
    micro-batch by micro-batch without gradients, put back as [B, T-1] tensors: the values before
    the update."""
    B, T = batch["input_ids"].shape
    outs = None
    for rows, width in micro_batches(batch, torch.arange(B), run.args.micro_batch):
        results = fn(run, {k: v[rows, :width] for k, v in batch.items() if v.dim() == 2}, **kw)
        results = results if isinstance(results, tuple) else (results,)
        if outs is None:
            outs = [torch.zeros(B, T - 1, device=run.device) for _ in results]
        for out, r in zip(outs, results):
            out[rows, :width - 1] = r.float()
    return outs if len(outs) > 1 else outs[0]


def policy_pass(run, mb, with_entropy=False):
    """log pi and (optionally) its entropy at the policy tokens of a micro-batch -> [b, w-1] each,
    0 elsewhere; pi at the rollouts' temperature, the policy that sampled them."""
    with run.ctx:
        logp, entropy = logprobs.policy_logprobs(run.policy, mb["input_ids"],
                                                 mb["policy_mask"][:, 1:], with_entropy,
                                                 run.args.temperature)
    return (logp, entropy) if with_entropy else logp


def reference_pass(run, mb):
    """log pi_ref at the policy tokens: the initial policy (with LoRA: the base, adapters off)."""
    with run.ctx, models.reference(run) as ref:
        return logprobs.policy_logprobs(ref, mb["input_ids"], mb["policy_mask"][:, 1:],
                                        temperature=run.args.temperature)[0]


def critic_pass(run, mb):
    """V at every position of a micro-batch, aligned with the log-probs -> [b, w-1]."""
    with run.ctx:
        return ppo.critic_values(run.critic, mb["input_ids"], None)[:, :-1].float()


def micro_batch_weight(mask, mini_batch, rows, agg):
    """Weight of the micro-batch `rows` inside `mini_batch`, so that summing weight x
    aggregate(micro-batch) gives exactly aggregate(mini-batch): its share of the tokens
    (token-mean) or of the sequences with tokens (seq-mean-*)."""
    if agg == "token-mean":
        return float(mask[rows].sum() / mask[mini_batch].sum().clamp_min(1))
    return float((mask[rows].sum(-1) > 0).sum()
                 / (mask[mini_batch].sum(-1) > 0).sum().clamp_min(1))


if __name__ == "__main__":
    sys.exit(main())
