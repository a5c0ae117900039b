"""The experiment: multi-turn PPO / GRPO / Dr.GRPO / DAPO on a text world, with SNR-aware filtering
and the MI diagnosis (RAGEN-2).

    python train.py --env sokoban --filter topp   # tiny on a CPU, Qwen2.5-0.5B-Instruct on a GPU

One training step, as `train` runs it (the right column names the code that runs it):
  1. rollouts     G prompt groups (one env seed each) x K rollouts, up to 5 turns,    rollout.play
                  in the prompts rollout.prompts chooses, each reply drawn by the     generate
                  sampling law and loop (Llama layouts: plumbing/sampler's faster
                  prefill and step, tested equal token for token)
  2. diagnosis    step 1 and every 5 steps, before filtering: cross-score each        mi.diagnose
                  first-turn reasoning under every prompt (the batch, a probe set)    probe_set
  3. filter       DAPO first refills the batch with groups that have spread;          dynamic_sampling
                  rank groups by reward std, keep Top-P / Top-K; dropped groups       snr_filter
                  never reach the advantages; nothing kept -> no update
  4. old / ref    log-probs of the sampled tokens before the update: in float32 the   generate
                  sampler's own (the same definition), else a forward pass; the       logprobs
                  reference's (the KL term); the critic's values
  5. advantages   PPO: GAE with the critic, whitened; GRPO / Dr.GRPO / DAPO: group-   ppo.gae, grpo
                  relative
  6. update       clipped loss - entropy bonus (+ KL), micro-batches, grad clip 1.0   ppo.policy_loss
  7. bookkeeping  metrics.jsonl line, validation every 10 steps, checkpoint, figures

What stands around the loop -- the flags (plumbing/flags.py), the run folder, resuming and
one-line errors (plumbing/runs.py), loading the models (plumbing/models.py), the faster sampling
layer (plumbing/sampler.py) -- a first reading may skip; what a policy knows before RL (its warm
start) is in warmstart/. A run folder shows the prompt its policy read (prompt.txt) and what ran
it (provenance.json).
"""
import dataclasses
import sys
import time

from plumbing import flags
from plumbing.flags import Args  # every flag, one line of help each (python train.py --help)

if __name__ == "__main__":  # before torch loads: a bad flag, --out or --model answers at once
    flags.before_torch(flags.parse_command, Args, sys.argv[1:])

import numpy as np  # noqa: E402
import torch  # noqa: E402

import grpo  # noqa: E402
import logprobs  # noqa: E402
import mi  # noqa: E402
import ppo  # noqa: E402
import rollout  # noqa: E402
import snr_filter  # noqa: E402
from plumbing import labels, lora, models, probe_set, runs, sampler  # noqa: E402
from plumbing.defaults import MAX_SKIPS, PROBE_SEED_BASE, VAL_SEED_BASE  # noqa: E402

ANALYSIS_KL_COEF = 1e-3  # Fig. 4's KL coefficient without --kl-coef (the paper's analysis runs)
AGGREGATION = {"ppo": "token-mean", "grpo": "seq-mean-token-mean",
               "drgrpo": "seq-mean-token-sum-norm", "dapo": "token-mean"}


# ----------------------------------------------------------------------------------------- the loop

def train(run):
    """Steps 1-7 until --steps; `run` (plumbing/runs.py) holds the flags, models, optimisers, run
    folder and the loop's state."""
    a = run.args
    for step in range(run.step + 1, a.steps + 1):
        m, t0 = {"step": step}, time.time()
        rng = np.random.default_rng([a.seed, step])  # this step's seeds and shuffling, alone

        # 1. rollouts: G groups (env seeds) x K samples
        seeds = rng.integers(0, VAL_SEED_BASE, a.groups).tolist()
        episodes = collect_rollouts(run, seeds, a.group_size)
        rewards = episode_rewards(run, episodes)                                          # [G, K]
        m.update(rollout_stats(episodes, rewards), time_rollout=time.time() - t0)
        m.update(snr_filter.zero_spread_split(rewards, [e.success for e in episodes]))

        # 2. diagnosis, before filtering: does the reasoning still depend on its prompt?
        t1 = time.time()
        if a.mi_every and (step == 1 or step % a.mi_every == 0):
            m.update(diagnose(run, episodes, np.random.default_rng([a.seed, step, 1])))
            m.update(probe(run))
        if a.grad_decomp_every and step % a.grad_decomp_every == 0:
            m["grad_decomposition"] = decompose_gradients(run, episodes, rewards)

        # 3. the filter: whole groups, before any advantage is computed (DAPO: refilled first)
        if a.algo == "dapo":
            episodes, rewards, drawn = dynamic_sampling(run, episodes, rewards, step)
            m.update(drawn)
        keep, stats = snr_filter.select(rewards, runs.filter_of(a), a.seed, step)         # [G]
        m.update(stats, time_scoring=time.time() - t1, skipped=not keep.any())

        # 4-6. the update, on the kept groups only
        t2 = time.time()
        run.state["skips"] = 0 if keep.any() else run.state["skips"] + 1
        if keep.any():
            shuffle = torch.Generator().manual_seed(int(rng.integers(2 ** 62)))
            m.update(update_policy(run, [e for e in episodes if keep[e.group]], rewards[keep],
                                   shuffle))
        m["time_update"] = time.time() - t2

        # 7. bookkeeping
        if a.val_every and (step % a.val_every == 0 or step == a.steps):
            m["val_success"] = validate(run)
        m["time_step"] = time.time() - t0
        runs.record(run, m)  # metrics.jsonl line, checkpoint, progress bar
        if run.state["skips"] >= MAX_SKIPS:
            print(f"stopping: no group had any reward spread for {MAX_SKIPS} steps (step {step})")
            break


def update_policy(run, episodes, rewards, shuffle):
    """Steps 4-6 on the kept episodes (`rewards` [G_kept, K]), the dropped groups removed before
    collation: nothing of them (padding width, advantages, normalisers) reaches the update. Each
    mini-batch is one optimiser step, its gradient summed over micro-batches weighted to add up to
    the mini-batch's loss; the logged numbers are the mini-batches' mean."""
    a, coef = run.args, coefficients(run.args)
    batch = before_update(run, episodes, rewards)  # 4-5: old log-probs, reference, advantages
    train_mode(run)
    logs = {}
    for _ in range(a.epochs):
        for mini_batch in mini_batches(len(batch["mask"]), a.mini_batch_size, a.optimizer_steps,
                                       shuffle):
            zero_grad(run)
            terms = {}
            for mb in micro_batches(batch, mini_batch, a.micro_batch, coef.agg):      # [b, w-1]
                logp, entropy = policy_pass(run, mb["input_ids"], mb["mask"], with_entropy=True)
                loss, parts = ppo.policy_loss(logp, mb["old_logp"], mb["advantages"], mb["mask"],
                                              coef, entropy, mb.get("ref_logp"))
                (mb["weight"] * loss).backward()
                parts["loss"] = loss
                if run.critic is not None:
                    parts["value_loss"] = critic_loss(run, mb)
                add_terms(terms, parts, mb["weight"], mb["token_weight"])
            for k, v in optimizer_step(run, terms).items():
                logs.setdefault(k, []).append(v)
    zero_grad(run)  # no gradients kept while the next rollouts sample
    out = {k: float(np.mean(v)) for k, v in logs.items() if k != "loss"}
    out["token_entropy"] = ppo.masked_mean(batch["old_entropy"], batch["mask"]).item()
    out["optimizer_steps"] = len(logs["grad_norm"])  # one grad_norm per optimiser step
    out["tokens_trained"] = a.epochs * int(batch["lengths"].sum())  # through the model, per pass
    out["tokens_scored"] = a.epochs * int(batch["mask"].sum())  # through its output layer
    return {**out, **batch["checks"]}


def coefficients(a):
    """The loss's settings from the flags: the algorithm's aggregation, the clip (--clip-c 0: no
    dual clip), the entropy bonus, the KL term, Dr.GRPO's constant normaliser."""
    return ppo.Coefficients(AGGREGATION[a.algo], a.clip_low, a.clip_high, a.clip_c or None,
                            a.entropy_coef, a.kl_coef, a.kl_kind, flags.response_budget(a))


def main(argv=None):
    """Parse the flags, start the run (None: it is finished), validate the starting point, train,
    finish; a failure ends in one line and an exit code (runs.failed)."""
    run = None
    try:
        argv = sys.argv[1:] if argv is None else argv
        run = runs.start(flags.parse_args(Args, argv), argv)
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

def collect_rollouts(run, seeds, group_size, temperature=None, top_p=None, max_turns=None):
    """Step 1: len(seeds) groups x group_size episodes, sampled in eval mode (no dropout) in the
    sampler's dtype (--sample-dtype), at most --rollout-batch episodes at a time (on a GPU their key/value caches fill
    the memory); the rollouts' temperature and nucleus unless given."""
    a = run.args
    run.policy.eval()
    per_call = max(1, (a.rollout_batch or len(seeds) * group_size) // group_size)  # whole groups
    episodes = []
    for first in range(0, len(seeds), per_call):
        policy = sampler.hf_policy(run.policy, run.tokenizer, a.max_new_tokens,
                                   a.temperature if temperature is None else temperature,
                                   a.sample_top_p if top_p is None else top_p, **run.sampling)
        with run.sample_ctx, runs.finite_sampling(run.step + 1):
            played = rollout.play(policy, run.tokenizer, a.env, seeds[first:first + per_call],
                                  group_size, env_kwargs=runs.env_kwargs(a),
                                  max_turns=max_turns or a.max_turns,
                                  max_actions_per_turn=a.max_actions_per_turn, **run.prompt)
        for e in played:
            e.group += first
        episodes += played
    return episodes


def episode_rewards(run, episodes):
    """The episodes' total rewards as [G, K], group by group; under DAPO each reply first loses its
    soft overlong penalty (grpo.overlong_penalty at --max-new-tokens and --overlong-buffer, summed
    over the episode's turns) into the episode's reward shaping."""
    a = run.args
    if a.algo == "dapo":
        buffer = flags.overlong_buffer(a)
        for e in episodes:
            e.shaping = sum(grpo.overlong_penalty(n, a.max_new_tokens, buffer)
                            for n in e.response_lengths)
    return torch.tensor([e.total_reward for e in episodes]).view(-1, a.group_size)   # [G, K]


def dynamic_sampling(run, episodes, rewards, step):
    """DAPO's dynamic sampling, as verl's filter_groups: drop the groups whose rewards have no
    spread (grpo.has_spread), draw --groups more groups on fresh seeds and keep theirs that have
    spread, until --groups are kept or --max-draws draws (the step's own included) are used; the
    batch is the first --groups kept (verl aligns it so). At the bound the update trains on the
    kept groups, however few (verl stops the run with an error instead); with none the step has
    nothing to update. The extra draws' seeds come from their own stream of (seed, step) ->
    (episodes renumbered group by group, rewards [G', K], what it drew)."""
    a = run.args
    more = np.random.default_rng([a.seed, step, 2])  # the step's other streams stay as they were
    kept, draws, t0 = [], 1, time.time()
    while True:
        spread = grpo.has_spread(rewards)                                                # [G]
        kept += [[e for e in episodes if e.group == g] for g in range(len(spread)) if spread[g]]
        if len(kept) >= a.groups or draws >= a.max_draws:
            break
        episodes = collect_rollouts(run, more.integers(0, VAL_SEED_BASE, a.groups).tolist(),
                                    a.group_size)
        rewards, draws = episode_rewards(run, episodes), draws + 1
    batch = kept[:a.groups]
    for g, group in enumerate(batch):
        for e in group:
            e.group = g
    out = [e for group in batch for e in group]
    drawn = {"dynamic_draws": draws, "dynamic_groups_drawn": draws * a.groups,
             "dynamic_groups_kept": len(kept), "time_dynamic_sampling": time.time() - t0}
    return out, torch.tensor([e.total_reward for e in out]).view(-1, a.group_size), drawn


def rollout_stats(episodes, rewards):
    return {"train_success": float(np.mean([e.success for e in episodes])),
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
            "response_length": float(np.mean([n for e in episodes for n in e.response_lengths])),
            "turns": float(np.mean([e.turns for e in episodes])),
            "cut_frac": float(np.mean([e.cut for e in episodes])),
            "tokens_sampled": int(sum(sum(e.response_lengths) for e in episodes))}


def diagnose(run, episodes, rng):
    """Step 2 on the batch (Sec. 2.3): up to --mi-samples first-turn reasonings, as many from
    every group (mi.mi_sample), cross-scored under every group's first prompt (mi.diagnose), the
    z-score's EMA carried across steps, and what the reasonings are (labels)."""
    a = run.args
    picked = [episodes[i] for i in mi.mi_sample(a.groups, a.group_size, a.mi_samples, rng)]
    prompts = [next(e for e in episodes if e.group == g).first for g in range(a.groups)]
    samples, gap = sampled_in_float32(run, [e.first for e in picked])
    out = mi.diagnose(run.policy, prompts, samples, [e.group for e in picked], **scoring(run))
    out["mi_zscore_ema"], run.state["std_ema"] = mi.mi_zscore_ema(out, run.state["std_ema"])
    keys = mi.DIAGNOSIS_KEYS + ("diagnosis_logprob_diff",)
    runs.check_exact(run, "diagnosis_logprob_diff", out.get("diagnosis_logprob_diff"))
    return {**{k: out[k] for k in keys if k in out}, **gap, **labels.labels(run, picked, episodes)}


def probe(run):
    """Step 2 on a fixed probe set: --probe-prompts held-out prompts (seeds PROBE_SEED_BASE + i),
    one first turn sampled --probe-samples times each, on a forked RNG seeded alike every time (the
    training stream is unchanged and the curve moves only when the policy does); probe_set.probe's
    metrics with their standard errors over the prompts, as probe_<metric>; where a reasoning
    copies its input (FrozenLake read with coordinates), also the work's MI after the copy."""
    a = run.args
    if not a.probe_prompts:
        return {}
    seeds = [PROBE_SEED_BASE + i for i in range(a.probe_prompts)]
    with torch.random.fork_rng(devices=[run.device] if run.device.type == "cuda" else []):
        torch.manual_seed(a.seed)
        episodes = collect_rollouts(run, seeds, a.probe_samples, max_turns=1)
    samples, gap = sampled_in_float32(run, [e.first for e in episodes])
    out = probe_set.probe(run.policy, samples, a.probe_samples, copies=labels.copies(run, seeds),
                   **scoring(run))
    runs.check_exact(run, "probe_diagnosis_logprob_diff", out["diagnosis_logprob_diff"])
    out.update(gap, **labels.labels(run, episodes, episodes), **labels.texts(run, episodes))
    return {"probe_" + k: v for k, v in out.items() if not k.endswith("upper_bound")}


def sampled_in_float32(run, firsts):
    """The diagnosis scores in float32 whatever the run's precision (bfloat16 moves its numbers:
    bench/README.md), and checks that it scores the very tokens sampled by comparing each
    reasoning's score under its own prompt with the log-prob it was sampled with
    (diagnosis_logprob_diff, ~1e-5 in float32). Rollouts sampled in bfloat16 carry bfloat16's
    rounding in those log-probs: here their replies are replayed through the sampler's loop in
    float32 (each token given), so that the check compares like with like, and the gap between
    the two records is logged apart -> (the first turns with the float32 replay's log-probs,
    {"sampling_precision_gap": the largest gap over reasonings and answers, in nats}; as they were
    and {} when sampled in float32)."""
    if run.args.sample_dtype == "float32" or any(f.reasoning_logprob is None for f in firsts):
        return firsts, {}
    replies = [f.reasoning_ids + f.answer_ids for f in firsts]
    policy = sampler.hf_policy(run.policy, run.tokenizer, max(1, max(map(len, replies))),
                               run.args.temperature)
    replayed = policy([f.prompt_ids for f in firsts], forced=replies)
    out, gap = [], 0.0
    for f, g, reply in zip(firsts, replayed, replies):  # a reply cut by the token limit: its own
        lp = g.logprobs[:len(reply)]                      # tokens, not the padding after them
        z, rest = float(sum(lp[:len(f.reasoning_ids)])), float(sum(lp[len(f.reasoning_ids):]))
        gap = max(gap, abs(z - f.reasoning_logprob), abs(rest - f.answer_logprob))
        out.append(dataclasses.replace(f, reasoning_logprob=z, answer_logprob=rest))
    return out, {"sampling_precision_gap": gap}


def scoring(run):
    """How the diagnosis scores: at the rollouts' temperature, every reasoning of a prompt in one
    batch (no gradients: no memory to save), the ids as sampled or, with --retokenize, the decoded
    texts tokenised again."""
    a = run.args
    return dict(temperature=a.temperature, batch_size=None, pad_id=run.pad_id,
                retokenize=run.tokenizer if a.retokenize else None)


def decompose_gradients(run, episodes, rewards):
    """Fig. 4 on this batch: task / KL / entropy gradient norms per reward-spread bucket, no
    optimiser step. The task term trains on the advantages an update of the whole batch would
    (PPO's whitened GAE, GRPO's group-relative ones), aggregated as the update aggregates. The KL
    is measured against the initial policy (the warm start; with LoRA the base), the run's
    --kl-kind at its --kl-coef or, without one, at the analysis runs' 0.001."""
    a = run.args
    batch = before_update(run, episodes, rewards, reference=True)
    coef = dataclasses.replace(coefficients(a), kl_coef=a.kl_coef or ANALYSIS_KL_COEF)
    with run.ctx:
        buckets = snr_filter.gradient_decomposition(run.policy, batch, rewards, coef, a.temperature)
    run.policy.zero_grad(set_to_none=True)
    return [{k: v for k, v in b.items() if k != "groups"} for b in buckets]


def validate(run):
    """Success on the fixed held-out seeds, one rollout each, at the validation temperature. Its
    sampling runs on a forked RNG, so validating does not change the training stream."""
    a = run.args
    with torch.random.fork_rng(devices=[run.device] if run.device.type == "cuda" else []):
        torch.manual_seed(a.seed)
        seeds = [VAL_SEED_BASE + i for i in range(a.val_seeds)]
        episodes = collect_rollouts(run, seeds, 1, temperature=a.val_temperature, top_p=1.0)
    return float(np.mean([e.success for e in episodes]))


# ----------------------------------------------------------------------- the update's pieces (4-6)

def before_update(run, episodes, rewards, reference=False):
    """Steps 4-5 -> the batch (rollout_batch) with, over the policy tokens [B, T-1]: the ratio's
    `old_logp` and `old_entropy`, the reference's `ref_logp` (with --kl-coef, or
    `reference`), the critic's `old_values` and `returns` (PPO), the `advantages`, and the
    `checks` to log."""
    a = run.args
    batch = rollout_batch(run, episodes)
    batch["old_logp"], batch["old_entropy"], batch["checks"] = old_policy(run, batch)
    runs.check_finite(run.step + 1, {"a log-prob of the sampled tokens":
                                     batch["old_logp"][batch["mask"].bool()]})
    if a.kl_coef or reference:
        batch["ref_logp"] = over_batch(run, batch, reference_pass)                    # [B, T-1]
    if run.critic is not None:
        batch["old_values"] = over_batch(run, batch, critic_pass)                     # [B, T-1]
        batch["advantages"], batch["returns"] = ppo.gae(
            batch["token_rewards"][:, 1:], batch["old_values"], batch["mask"], a.gamma, a.lam)
    else:  # GRPO / Dr.GRPO / DAPO: each episode's group-relative advantage on all its tokens
        per_episode = grpo.group_advantages(rewards, normalize_std=a.algo != "drgrpo").reshape(-1)
        batch["advantages"] = grpo.episode_advantages_to_tokens(
            per_episode.to(batch["mask"].device), batch["mask"])
    batch["checks"].update(value_stats(batch))
    return batch


def value_stats(batch):
    """What practitioners read first when PPO misbehaves, over the policy tokens: the advantages'
    mean and spread and, with a critic, its values', the returns' and the share of the returns'
    variance the values explain (ppo.explained_variance)."""
    on, out = batch["mask"].bool(), {}
    for name, key in (("advantage", "advantages"), ("value", "old_values"), ("return", "returns")):
        if key in batch:
            x = batch[key][on].float()
            out[f"{name}_mean"], out[f"{name}_std"] = x.mean().item(), x.std(correction=0).item()
    if "returns" in batch:
        out["explained_variance"] = ppo.explained_variance(batch["old_values"], batch["returns"],
                                                           batch["mask"]).item()
    return out


def old_policy(run, batch):
    """Step 4's log-probs of the sampled tokens and the policy's entropy there, before the update
    -> ([B, T-1], [B, T-1], metrics). When sampler and update both run in float32 the sampler
    recorded the same numbers (both take the log-softmax in float64; they agree within 1e-5 nats
    a token, tests/test_train.py), so they are taken from it: no forward pass over the batch.
    Under bf16 autocast, in either, they differ (bf16's rounding; the sampler's one-token passes
    over a cache round otherwise than a pass over whole transcripts), and a scripted policy
    records none: then the update's own forward pass gives them, so the ratio compares the
    update's policy with itself (exactly 1 before its first optimiser step), and the log says how
    far the sampler's log-probs are from it (rollout_logprob_diff; far from 0 means the rollouts
    came from a policy other than the one the update scores)."""
    exact = run.args.dtype == run.args.sample_dtype == "float32"
    if exact and "logprobs" in batch and "entropies" in batch:
        return batch["logprobs"][:, 1:], batch["entropies"][:, 1:], {}
    old_logp, old_entropy = over_batch(run, batch, policy_pass, with_entropy=True)     # [B, T-1]
    if "logprobs" not in batch:
        return old_logp, old_entropy, {}
    diff = ppo.masked_mean((batch["logprobs"][:, 1:] - old_logp).abs(), batch["mask"])
    return old_logp, old_entropy, {"rollout_logprob_diff": diff.item()}


def train_mode(run):
    """Hugging Face layers recompute activations (--grad-checkpointing) only in training mode; the
    models here have no dropout, so nothing else changes."""
    run.policy.train()
    if run.critic is not None:
        run.critic.train()


def critic_loss(run, mb):
    """PPO's clipped value loss on a micro-batch, backward with its token weight -> its value.
    The backward runs in the critic's scope too: checkpointing recomputes the forward there, and
    a LoRA critic recomputed outside its adapter would get the policy's (lora.critic_scope)."""
    a = run.args
    with lora.critic_scope(run.critic):
        loss = ppo.value_loss(critic_pass(run, mb["input_ids"]), mb["old_values"], mb["returns"],
                              mb["mask"], a.value_clip)
        (mb["token_weight"] * loss).backward()
    return loss


def add_terms(terms, parts, weight, token_weight):
    """Add a micro-batch's loss terms into the mini-batch's: the policy loss's terms (which add up
    with its weight) and token means (with its tokens' share)."""
    for k, v in parts.items():
        w = weight if k in ("loss", "pg_loss", "entropy_loss", "kl_loss") else token_weight
        terms[k] = terms.get(k, 0.0) + w * (v.item() if torch.is_tensor(v) else v)


def optimizer_step(run, terms):
    """The mini-batch's optimiser step: gradients clipped to --grad-clip, and nothing applied that
    is not finite (the run stops, naming it: runs.check_finite) -> its terms and grad_norm."""
    a = run.args
    terms["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(run.policy_params, a.grad_clip))
    critic_norm = (float(torch.nn.utils.clip_grad_norm_(run.critic_params, a.grad_clip))
                   if run.critic is not None else 0.0)
    runs.check_finite(run.step + 1, {"the policy loss": terms["loss"],
                                     "the critic's loss": terms.get("value_loss", 0.0),
                                     "the gradient norm": terms["grad_norm"],
                                     "the critic's gradient norm": critic_norm})
    for opt in run.optimizers:
        opt.step()
    return terms


def zero_grad(run):
    for opt in run.optimizers:
        opt.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------------------ batches

def rollout_batch(run, episodes):
    """The episodes as right-padded tensors on the run's device (rollout.collate), with their
    lengths and the `mask` of the trained tokens, aligned with the log-probs."""
    batch = {k: v.to(run.device) for k, v in rollout.collate(episodes, run.pad_id).items()}
    batch["lengths"] = batch["attention_mask"].sum(1)                                      # [B]
    batch["mask"] = batch["policy_mask"][:, 1:]                                       # [B, T-1]
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


SHIFTED = ("mask", "old_logp", "advantages", "ref_logp", "old_values", "returns")  # [B, T-1]


def micro_batches(batch, rows, size, agg="token-mean"):
    """The micro-batches of the given rows -> dicts of their `rows`, `input_ids` [b, w] and SHIFTED
    [b, w-1] slices, w the width of the micro-batch's longest transcript (rows sorted by length
    first, so short transcripts are not padded to the longest of the batch), with their `weight`
    in the mini-batch's `agg` aggregate and `token_weight` in its token mean."""
    rows = rows[torch.argsort(batch["lengths"][rows].cpu(), descending=True, stable=True)]
    for sub in rows.split(size):
        w = int(batch["lengths"][sub].max())
        mb = {k: batch[k][sub, :w - 1] for k in SHIFTED if k in batch}              # [b, w-1]
        mb.update(rows=sub, input_ids=batch["input_ids"][sub, :w],                      # [b, w]
                  weight=micro_batch_weight(batch["mask"], rows, sub, agg),
                  token_weight=micro_batch_weight(batch["mask"], rows, sub, "token-mean"))
        yield mb


def micro_batch_weight(mask, mini_batch, rows, agg):
    """Weight of the micro-batch `rows` inside `mini_batch`, so that summing weight x
    aggregate(micro-batch) gives exactly aggregate(mini-batch): its share of the tokens
    (token-mean) or of the sequences with tokens (seq-mean-*)."""
    if agg == "token-mean":
        return float(mask[rows].sum() / mask[mini_batch].sum().clamp_min(1))
    return float((mask[rows].sum(-1) > 0).sum()
                 / (mask[mini_batch].sum(-1) > 0).sum().clamp_min(1))


@torch.no_grad()
def over_batch(run, batch, fn, **kw):
    """fn(run, input_ids [b, w], mask [b, w-1], **kw) -> [b, w-1] tensor (or a tuple of them),
    run over the whole batch micro-batch by micro-batch without gradients, put back as [B, T-1]
    tensors: the values before the update."""
    B, T = batch["input_ids"].shape
    outs = None
    for mb in micro_batches(batch, torch.arange(B), run.args.micro_batch):
        results = fn(run, mb["input_ids"], mb["mask"], **kw)
        results = results if isinstance(results, tuple) else (results,)
        if outs is None:
            outs = [torch.zeros(B, T - 1, device=run.device) for _ in results]
        for out, r in zip(outs, results):
            out[mb["rows"], :r.shape[1]] = r.float()
    return outs if len(outs) > 1 else outs[0]


def policy_pass(run, input_ids, mask, with_entropy=False):
    """log pi and (optionally) its entropy at the policy tokens (mask [b, w-1]) -> [b, w-1] each, 0
    elsewhere; pi at the rollouts' temperature, the policy that sampled them."""
    with run.ctx:
        logp, entropy = logprobs.policy_logprobs(run.policy, input_ids, mask, with_entropy,
                                                 run.args.temperature)
    return (logp, entropy) if with_entropy else logp


def reference_pass(run, input_ids, mask):
    """log pi_ref at the policy tokens: the initial policy (with LoRA: the base, adapters off)."""
    with run.ctx, models.reference(run) as ref:
        return logprobs.policy_logprobs(ref, input_ids, mask,
                                        temperature=run.args.temperature)[0]


def critic_pass(run, input_ids, mask=None):
    """V at every position of a micro-batch, aligned with the log-probs -> [b, w-1]."""
    with run.ctx:
        return ppo.critic_values(run.critic, input_ids, None)[:, :-1].float()


if __name__ == "__main__":
    sys.exit(main())
