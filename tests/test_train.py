"""train.py: every env x algorithm x filter performs a real, filtered update; the update's fast path
equals the plain full-logits computation; the filter drops whole groups exactly; the gradient
decomposition sees reward spread; LoRA trains adapters only. The plumbing around the loop (flags,
resume, checkpoints) is tested in test_runs.py."""
import copy
import dataclasses
import json
import math
import os

import numpy as np
import pytest
import torch

import envs
import grpo
import logprobs
import ppo
import rollout
import snr_filter
import train
from conftest import CLOCK, tiny_qwen2
from plumbing import flags, models, runs, sampler
from warmstart import templates, tiny

SMALL = ["--model", "tiny", "--no-warm-start", "--groups", "3", "--group-size", "4", "--max-turns", "2",
         "--max-new-tokens", "8", "--val-seeds", "1", "--mi-samples", "6", "--no-plot",
         "--probe-prompts", "2", "--probe-samples", "2"]
EVERY_STEP = {"step", "train_success", "reward_mean", "reward_std", "kept_ratio", "zero_var_frac", "num_zero_var",
              "response_length", "skipped", "time_rollout", "time_scoring", "time_update", "time_step",
              "zero_var_success_frac", "zero_var_fail_frac"}
DIAGNOSIS = {"mi_estimate", "mi_seq_estimate", "mi_zscore", "mi_zscore_ema", "retrieval_acc", "conditional_entropy",
             "reasoning_entropy", "retrieval_chance", "template_share", "probe_template_share"}
UPDATE = {"pg_loss", "entropy_loss", "clip_frac", "clip_frac_lower", "approx_kl", "grad_norm", "token_entropy"}
CPU = torch.device("cpu")


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def finite(record):
    return all(math.isfinite(v) for v in record.values() if isinstance(v, float))


def scripted(tokenizer, group_size, solves=lambda i, group: group > 0 and i % 2 == 0):
    """A stand-in for the sampled policy with known reward spread: rollout i of group `group` plays
    the solver's moves when solves(i, group), else writes garbage (every garbage reply earns the
    same format penalties). By default group 0 writes garbage (zero spread) and in the other groups
    the even rollouts solve and the odd ones do not. Roles are fixed at the first call, where play
    passes the episodes group by group."""
    end = rollout.end_of_turn_ids(tokenizer)[0]
    good = {}

    def policy(prompt_ids, env_list):
        if not good:
            good.update({id(env): solves(i, i // group_size) for i, env in enumerate(env_list)})
        out = []
        for env in env_list:
            plan = envs.solve(env) or [env.actions[0]]
            text = f" go </think> <answer> {' || '.join(plan[:2])} </answer>" if good[id(env)] else " ?? </think>"
            out.append(rollout.Generation(tokenizer.encode(text, add_special_tokens=False) + [end]))
        return out
    return policy


@pytest.fixture
def scripted_rollouts(monkeypatch):
    """train's rollouts come from `scripted` (the model still scores them, trains on them and is diagnosed)."""
    monkeypatch.setattr(train.sampler, "hf_policy", lambda model, tokenizer, *args, **kwargs: scripted(tokenizer, 4))


def load_checkpoint(out):
    """The policy a run's checkpoint holds."""
    return models.load_policy(train.Args(), os.path.join(out, "checkpoint"), CPU, {})[0].state_dict()


def make_run(tmp_path, **settings):
    """A runs.Run around the random tiny model, without a run folder: for calling train's steps directly."""
    a = train.Args(**{"model": "tiny", "warm_start": False, "out": str(tmp_path / "run"), "max_turns": 2,
                      "max_new_tokens": 8, **settings})
    runs.resolve_defaults(a, CPU)
    return runs.load_run(a, CPU, a.model)


# ----------------------------------------------------------------------------------- the whole loop

@pytest.mark.parametrize("env", sorted(envs.ENVS))
@pytest.mark.parametrize("algo", ["ppo", "grpo", "drgrpo"])
@pytest.mark.parametrize("filt", ["none", "topp", "topk"])
def test_every_combination_performs_a_real_filtered_update(tmp_path, scripted_rollouts, env, algo, filt):
    out = str(tmp_path / "run")
    # no entropy bonus: every gradient is the task's (ratio 1 and zero-mean advantages make the loss
    # itself 0); Top-P 0.5: the best group alone reaches half of the summed spread, so p decides
    # (0.9 keeps both groups with spread)
    top_p = ["--top-p", "0.5"] if filt == "topp" else []  # a flag the filter ignores is refused
    assert train.main(SMALL + ["--env", env, "--algo", algo, "--filter", filt, "--steps", "2", "--out", out,
                               "--entropy-coef", "0"] + top_p) == 0
    start, first, last = records(out)
    # the warm start's score, before training
    checked = {k for k in start if k.startswith("selfcheck_")}  # the sampler's self-check's
    assert checked == {"selfcheck_fast_diff", "selfcheck_plain_diff"}
    assert {k: v for k, v in start.items() if k not in checked} == {
        "step": 0, "val_success": start["val_success"]}
    assert first["step"] == 1 and last["step"] == 2 and "val_success" in last
    assert DIAGNOSIS <= set(first)
    for r in (first, last):
        assert EVERY_STEP <= set(r) and finite(r)
        assert r["num_zero_var"] >= 1  # group 0 never has spread
        assert not r["skipped"] and UPDATE <= set(r) and ("value_loss" in r) == (algo == "ppo")
        assert r["grad_norm"] > 0  # a real task gradient
        # none keeps all 3 groups; Top-P 0.5 the one with the larger spread (of at most two); Top-K 0.5
        # keeps int(1.5) = 1 group
        assert r["num_kept"] == {"none": 3, "topp": 1, "topk": 1}[filt]
    before = tiny.build_model(tiny.build_tokenizer()).state_dict()
    after = load_checkpoint(out)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the weights moved


def test_zero_spread_batches_skip_the_update_and_stop_after_five(tmp_path, capsys):
    # A random network never writes a valid action: every rollout earns the same format penalties,
    # no group has spread, Top-P keeps nothing, and the run stops after MAX_SKIPS skipped steps in a
    # row -- without NaN.
    out = str(tmp_path / "run")
    before = tiny.build_model(tiny.build_tokenizer()).state_dict()
    assert train.main(SMALL + ["--filter", "topp", "--steps", "8", "--out", out, "--mi-every", "0",
                               "--val-every", "0"]) == 0
    rs = records(out)
    assert [r["step"] for r in rs] == list(range(1, train.MAX_SKIPS + 1))
    assert all(r["skipped"] and r["kept_ratio"] == 0 and r["zero_var_frac"] == 1 and finite(r) for r in rs)
    assert "no group had any reward spread" in capsys.readouterr().out
    after = load_checkpoint(out)
    assert all(torch.equal(before[k], after[k]) for k in before)  # no update ever happened


# --------------------------------------------------------------------------------------- the update

def play_scripted(run, seeds, group_size=4):
    return rollout.play(scripted(run.tokenizer, group_size), run.tokenizer, run.args.env, seeds, group_size,
                        max_turns=run.args.max_turns, **run.prompt)


def test_policy_logprobs_equal_the_full_logits_and_their_gradient(tmp_path):
    run = make_run(tmp_path, env="frozenlake")
    batch = train.rollout_batch(run, play_scripted(run, [3, 5]))
    ids, mask = batch["input_ids"], batch["policy_mask"][:, 1:]  # right-padded [B, T], [B, T-1]
    # plain: [B, T-1, V]
    logits = run.policy(input_ids=ids, attention_mask=batch["attention_mask"]).logits[:, :-1]
    plain = logprobs.token_logprobs(logits, ids[:, 1:]).float() * mask  # the definition
    plain_entropy = logprobs.token_entropy(logits).float() * mask
    (plain.sum() + plain_entropy.sum()).backward()
    plain_grads = [p.grad.clone() for p in run.policy.parameters()]
    run.policy.zero_grad()
    for chunk in (2 ** 25, 7 * len(run.tokenizer)):  # one chunk, and chunks of 7 positions
        logp, entropy = logprobs.policy_logprobs(run.policy, ids, mask, with_entropy=True, chunk_elements=chunk)
        torch.testing.assert_close(logp, plain, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(entropy, plain_entropy, atol=1e-5, rtol=1e-5)
        (logp.sum() + entropy.sum()).backward()
        for p, g in zip(run.policy.parameters(), plain_grads):
            torch.testing.assert_close(p.grad, g, atol=1e-4, rtol=1e-4)
        run.policy.zero_grad()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prefixes_run_once_and_change_nothing(tmp_path, checkpointing):
    """Two groups' rollouts share their prompts, lone episodes share only the system prompt, one
    row has no policy token: prefix_cells runs each group's prompt (but its last token) once and the
    lone rows' common part once; the log-probs, entropies and their gradient are the plain forward
    pass's. Under gradient checkpointing Hugging Face drops a cache while training, so every row
    then runs whole: the same numbers."""
    run = make_run(tmp_path, env="frozenlake", grad_checkpointing=checkpointing)
    episodes = play_scripted(run, [3, 5], group_size=3) + play_scripted(run, [7, 9, 11], group_size=1)
    batch = train.rollout_batch(run, episodes)
    ids, mask = batch["input_ids"], batch["policy_mask"][:, 1:].clone()         # [B, T-1]
    mask[-1] = 0  # a row with no policy token: scored 0, no gradient
    prompt = [len(e.first.prompt_ids) for e in episodes]  # its last token predicts the reply
    cells = [(rows.tolist(), n) for rows, n in logprobs.prefix_cells(ids, mask.bool())]
    assert cells[:2] == [([0, 1, 2], prompt[0] - 1), ([3, 4, 5], prompt[3] - 1)]
    assert cells[2][0] == [6, 7] and 0 < cells[2][1] < prompt[6] - 1  # what lone rows share
    run.policy.train()
    logits = run.policy(input_ids=ids, attention_mask=batch["attention_mask"]).logits[:, :-1]
    plain = logprobs.token_logprobs(logits, ids[:, 1:]).float() * mask
    plain_entropy = logprobs.token_entropy(logits).float() * mask
    (plain.sum() + plain_entropy.sum()).backward()
    plain_grads = [p.grad.clone() for p in run.policy.parameters()]
    run.policy.zero_grad()
    logp, entropy = logprobs.policy_logprobs(run.policy, ids, mask, with_entropy=True, share_prefix=True)
    torch.testing.assert_close(logp, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, plain_entropy, atol=1e-5, rtol=1e-5)
    (logp.sum() + entropy.sum()).backward()
    for p, g in zip(run.policy.parameters(), plain_grads):
        torch.testing.assert_close(p.grad, g, atol=1e-4, rtol=1e-4)


def test_policy_logprobs_score_the_policy_at_its_sampling_temperature(tmp_path):
    """Episodes sampled at T = 0.7: logprobs.policy_logprobs at that temperature recomputes the
    sampler's own log-probs (and the tempered entropy); scoring them at T = 1 -- what the update
    did before it divided by T -- is another policy, far off."""
    run = make_run(tmp_path, env="frozenlake")
    torch.manual_seed(0)
    policy = sampler.hf_policy(run.policy, run.tokenizer, 8, temperature=0.7)
    batch = train.rollout_batch(run, rollout.play(policy, run.tokenizer, "frozenlake", [3, 5], 2,
                                                  max_turns=2, **run.prompt))
    ids, mask = batch["input_ids"], batch["policy_mask"][:, 1:]
    sampled = batch["logprobs"][:, 1:]
    with torch.no_grad():
        logp, entropy = logprobs.policy_logprobs(run.policy, ids, mask, True, temperature=0.7)
        at_one, _ = logprobs.policy_logprobs(run.policy, ids, mask)
        logits = run.policy(input_ids=ids, attention_mask=batch["attention_mask"]).logits[:, :-1]
    assert ppo.masked_mean((logp - sampled).abs(), mask) < 1e-4
    assert ppo.masked_mean((at_one - sampled).abs(), mask) > 0.05
    torch.testing.assert_close(entropy, logprobs.token_entropy(logits, 0.7).float() * mask, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model, groups, turns", [("tiny", 2, 2), ("smollm2", 1, 1)])
def test_the_sampler_records_the_old_logprobs_and_entropies_of_a_forward_pass(tmp_path, model, groups, turns):
    """What the update takes from the sampler in float32 (train.old_policy) is what a forward pass over the
    batch computes: the log-probs of the sampled tokens and the entropy of the tempered policy there, at
    temperatures 1 and 0.7; on the random tiny policy within 1e-5 at every policy token. On SmolLM2 within
    1e-5 on average and 3e-5 at every token: float32's own rounding through 30 layers, not a bias (measured:
    up to 1.7e-5, while the forward pass differs from itself by up to 1.3e-5 with micro-batches of 1 and 8)."""
    a = train.Args(model=model, warm_start=False, env="frozenlake", max_turns=turns, max_new_tokens=8, threads=1,
                   out=str(tmp_path / "run"), dtype="float32")  # the float32 branch (bfloat16: test_hardware.py)
    runs.resolve_defaults(a, CPU)
    run = runs.load_run(a, CPU, a.model)
    for temperature in (1.0, 0.7):
        run.args.temperature = temperature
        torch.manual_seed(0)
        batch = train.rollout_batch(run, train.collect_rollouts(run, [3, 5][:groups], 2, temperature, 1.0))
        mask = batch["policy_mask"][:, 1:].bool()                                        # [B, T-1]
        old_logp, old_entropy, checks = train.old_policy(run, batch)
        assert checks == {} and torch.equal(old_logp, batch["logprobs"][:, 1:])  # the sampler's, no forward pass
        forward = train.over_batch(run, batch, train.policy_pass, with_entropy=True)
        for sampled, recomputed in zip((old_logp, old_entropy), forward):
            diff = (sampled - recomputed)[mask].abs()
            assert diff.max() < (1e-5 if model == "tiny" else 3e-5) and diff.mean() < 1e-5
            assert (sampled[~mask] == 0).all()


@pytest.mark.parametrize("dtype, sample_dtype", [("float32", "float32"), ("bfloat16", "bfloat16"),
                                                 ("float32", "bfloat16")])
def test_a_run_at_temperature_07_logs_the_sampler_and_the_update_agreeing(tmp_path, monkeypatch, dtype,
                                                                          sample_dtype):
    """At T = 0.7 in float32 a run's update takes the ratio's old log-probs and the token entropy from the
    sampler -- no forward pass of the policy over the batch before the update (the critic's values still need
    one) -- and its one mini-batch's ratio is 1 (approx_kl ~ 0): the update scores the policy that sampled.
    Under bf16 autocast, and with a bfloat16 sampler before a float32 update, the forward pass runs, so the
    ratio still starts at 1, and the log says how far the sampler's log-probs are from it."""
    passes, over_batch = [], train.over_batch
    monkeypatch.setattr(train, "over_batch", lambda run, batch, fn, **kw: passes.append(fn) or over_batch(
        run, batch, fn, **kw))
    out = str(tmp_path / "run")
    assert train.main(SMALL + ["--env", "frozenlake", "--filter", "none", "--temperature", "0.7", "--steps", "1",
                               "--mi-every", "0", "--val-every", "0", "--dtype", dtype, "--sample-dtype",
                               sample_dtype, "--out", out]) == 0
    (step,) = records(out)
    assert UPDATE <= set(step) and finite(step) and step["optimizer_steps"] == 1 and step["approx_kl"] < 1e-6
    if dtype == sample_dtype == "float32":
        assert passes == [train.critic_pass] and "rollout_logprob_diff" not in step
    else:
        assert passes == [train.policy_pass, train.critic_pass] and 0 < step["rollout_logprob_diff"] < 0.05


def test_the_update_trains_on_policy_loss_and_drgrpo_divides_by_the_budget(tmp_path, monkeypatch):
    """The loss the README points to is the one that runs: every micro-batch's loss is
    ppo.policy_loss. Dr.GRPO's at ratio 1 is -mean_b(A_b n_b) / L, n_b the episode's policy tokens
    and L = max_turns x max_new_tokens, the most an episode can write (a constant, as Dr.GRPO's)."""
    calls, original = [], ppo.policy_loss

    def counted(*args, **kw):
        calls.append(args[4].agg)  # the coefficients' aggregation
        return original(*args, **kw)

    monkeypatch.setattr(ppo, "policy_loss", counted)
    run = make_run(tmp_path, env="sokoban", algo="drgrpo", mini_batch_size=16, micro_batch=3, entropy_coef=0.0)
    episodes = play_scripted(run, [3, 5], group_size=4)
    rewards = torch.tensor([e.total_reward for e in episodes]).view(2, 4)
    stats = train.update_policy(run, episodes, rewards, torch.Generator().manual_seed(0))
    assert calls == ["seq-mean-token-sum-norm"] * 3  # 8 episodes in micro-batches of 3
    tokens = torch.tensor([sum(e.policy_mask) for e in episodes])
    adv = grpo.group_advantages(rewards, normalize_std=False).reshape(-1)
    assert stats["pg_loss"] == pytest.approx(-(adv * tokens).mean().item() / (2 * 8), abs=1e-6)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batch_weights_recompose_the_mini_batchs_aggregate(agg):
    """Summing weight x aggregate(micro-batch) over the micro-batches of a mini-batch -- one of
    several in the batch -- gives the mini-batch's aggregate (a sequence without tokens counts in
    neither)."""
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(12, 9, generator=g) < 0.6).float()                             # [B, T]
    mask[4] = 0
    values = torch.randn(12, 9, generator=g)                                          # [B, T]
    mini_batch = [1, 4, 6, 7, 10]  # the batch's other rows are other mini-batches
    micro = [[1, 4], [6], [7, 10]]
    parts = sum(train.micro_batch_weight(mask, mini_batch, rows, agg)
                * ppo.aggregate(values[rows], mask[rows], agg) for rows in micro)
    assert float(parts) == pytest.approx(float(ppo.aggregate(values[mini_batch], mask[mini_batch], agg)),
                                         abs=1e-6)


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_the_update_equals_a_plain_full_batch_step(tmp_path, algo):
    """update_policy (length-sorted micro-batches of their own width, no attention mask, log-probs
    only at policy tokens, gradient accumulation) takes the same optimiser step as one plain
    full-logits pass over the batch."""
    runs_ = [make_run(tmp_path, env="sokoban", algo=algo, mini_batch_size=16, micro_batch=m, lr=1e-2,
                      critic_lr=1e-2) for m in (3, 16)]
    episodes = play_scripted(runs_[0], [3, 5, 8, 13], group_size=4)
    rewards = torch.tensor([e.total_reward for e in episodes]).view(4, 4)
    a, b = runs_
    # plain SGD: the step is the gradient itself (Adam's first step, g / |g|, magnifies noise)
    for run in runs_:
        run.optimizers = [torch.optim.SGD(ps, lr=1.0) for ps in (run.policy_params, run.critic_params) if ps]
    if algo == "ppo":
        b.critic.load_state_dict(a.critic.state_dict())
    stats = train.update_policy(a, episodes, rewards, torch.Generator().manual_seed(0))

    # the plain step on run b: one pass, full logits, attention mask, the same loss terms
    batch = rollout.collate(episodes, b.pad_id)
    ids, mask = batch["input_ids"], batch["policy_mask"][:, 1:]
    agg = train.AGGREGATION[algo]
    with torch.no_grad():
        logits = b.policy(input_ids=ids, attention_mask=batch["attention_mask"]).logits[:, :-1]
        old = logprobs.token_logprobs(logits, ids[:, 1:]).float()
        if algo == "ppo":
            values = b.critic(ids, batch["attention_mask"])[:, :-1]
            adv, returns = ppo.gae(batch["token_rewards"][:, 1:], values, mask)
        else:
            adv = grpo.episode_advantages_to_tokens(grpo.group_advantages(rewards).reshape(-1), mask)
    logits = b.policy(input_ids=ids, attention_mask=batch["attention_mask"]).logits[:, :-1]
    logp = logprobs.token_logprobs(logits, ids[:, 1:]).float()
    pg_loss, _ = ppo.clipped_policy_loss(logp, old, adv, mask, ppo.Coefficients(agg=agg))
    loss = pg_loss - b.args.entropy_coef * ppo.aggregate(logprobs.token_entropy(logits).float(), mask, agg)
    loss.backward()
    if algo == "ppo":
        ppo.value_loss(b.critic(ids, batch["attention_mask"])[:, :-1], values, returns, mask, 0.5).backward()
        torch.nn.utils.clip_grad_norm_(b.critic_params, 1.0)
    torch.nn.utils.clip_grad_norm_(b.policy_params, 1.0)
    for opt in b.optimizers:
        opt.step()

    assert stats["optimizer_steps"] == 1 and stats["pg_loss"] == pytest.approx(pg_loss.item(), abs=1e-5)
    for p, q in zip(a.policy.parameters(), b.policy.parameters()):
        torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4)
    if algo == "ppo":
        for p, q in zip(a.critic.parameters(), b.critic.parameters()):
            torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_grad_checkpointing_really_recomputes_in_the_update(tmp_path, algo):
    """--grad-checkpointing saves memory only if the layers recompute in backward, which Hugging Face
    does only in training mode: the rollouts leave the policy in eval mode (and a critic copied from
    a loaded policy starts so), so the update must switch both back. Recomputation shows as a second
    call of each model's attention for every call of its body with gradients."""
    ratios = {}
    for ckpt in (False, True):
        run = make_run(tmp_path, env="sokoban", algo=algo, grad_checkpointing=ckpt)
        episodes = play_scripted(run, [3, 5], group_size=4)
        rewards = torch.tensor([e.total_reward for e in episodes]).view(2, 4)
        bodies = [run.policy.get_decoder()] + ([run.critic.body] if run.critic is not None else [])
        seen = []

        def training_pass(module, *_):  # a pass with gradients: one that trains
            if torch.is_grad_enabled():
                seen.append(module)

        for body in bodies:
            body.eval()
            body.register_forward_hook(training_pass)
            body.layers[0].self_attn.register_forward_hook(training_pass)
        train.update_policy(run, episodes, rewards, torch.Generator().manual_seed(0))
        ratios[ckpt] = [seen.count(body.layers[0].self_attn) / seen.count(body) for body in bodies]
    assert ratios == {False: [1.0] * len(bodies), True: [2.0] * len(bodies)}


def test_later_mini_batches_compare_against_the_policy_before_the_update(tmp_path):
    """The ratio's old log-probs are the sampling policy's: after the first mini-batch's optimiser
    step, the second mini-batch sees ratios away from 1 (approx_kl > 0), while the first sees
    exactly 1 -- old log-probs taken from the moving policy would give 0 for both."""
    run = make_run(tmp_path, env="sokoban", algo="grpo", mini_batch_size=8, lr=1e-2)
    episodes = play_scripted(run, [3, 5, 8, 13], group_size=4)
    rewards = torch.tensor([e.total_reward for e in episodes]).view(4, 4)
    stats = train.update_policy(run, episodes, rewards, torch.Generator().manual_seed(0))
    assert stats["optimizer_steps"] == 2
    assert stats["approx_kl"] > 1e-6  # the mean over the two mini-batches: the second one moved


def test_update_on_kept_groups_equals_an_update_on_a_batch_without_the_dropped_ones(tmp_path):
    for algo in ("ppo", "grpo"):
        results = []
        # of the first list, seed 0's group has no spread and seed 8's the least: Top-P 0.9 drops both
        # (the spreads are 0.69, 0, 0.12, 0.10: 0.69 + 0.12 reaches 0.9 of their sum, p = 1 would keep seed 8)
        for seeds in ([3, 0, 5, 8], [3, 5]):
            run = make_run(tmp_path, env="frozenlake", algo=algo, group_size=4, micro_batch=3, mini_batch_size=5,
                           lr=1e-3, critic_lr=1e-3, top_p=0.9)
            # the group of seed 0 all solve (zero spread); of seed 8 one rollout; in the others the even ones
            policy = scripted(run.tokenizer, 4, solves=lambda i, group: seeds[group] == 0 or i % (
                4 if seeds[group] == 8 else 2) == 0)
            episodes = rollout.play(policy, run.tokenizer, "frozenlake", seeds, 4, max_turns=2, **run.prompt)
            rewards = torch.tensor([e.total_reward for e in episodes]).view(len(seeds), 4)
            keep, _ = snr_filter.select(rewards, runs.filter_of(run.args))
            assert keep.tolist() == [s in (3, 5) for s in seeds]
            kept = [e for e in episodes if keep[e.group]]
            stats = train.update_policy(run, kept, rewards[keep], torch.Generator().manual_seed(1))
            results.append((stats, run.policy.state_dict()))
        (s1, w1), (s2, w2) = results
        for k in ("pg_loss", "entropy_loss", "grad_norm", "token_entropy"):
            assert s1[k] == pytest.approx(s2[k], abs=1e-6), k
        assert all(torch.allclose(w1[k], w2[k], atol=1e-6) for k in w1)
        initial = tiny.build_model(tiny.build_tokenizer()).state_dict()
        assert any(not torch.equal(w1[k], initial[k]) for k in w1)  # it learned


def test_the_diagnosis_scores_the_sampled_ids_at_any_temperature(tmp_path):
    """At temperature 2.5 the random tiny policy writes token sequences that its tokenizer does not
    give back from their text; scored as sampled, each sample's score under its own prompt is its
    sampling log-prob (in the batch, on the probe set, and the answers of I(Z; A | X)); scored as
    re-tokenised text (--retokenize, the official way) it is not."""
    run = make_run(tmp_path, env="frozenlake", groups=3, group_size=4, mi_samples=12, temperature=2.5,
                   probe_prompts=2, probe_samples=3)
    torch.manual_seed(0)  # the sampler draws from torch's global generator: not from what ran before
    episodes = train.collect_rollouts(run, [3, 4, 5], 4, 2.5, 1.0)
    text = [rollout._encode(run.tokenizer, e.first.reasoning) for e in episodes]
    assert sum(t != e.first.reasoning_ids for t, e in zip(text, episodes)) >= 3  # they do not come back
    assert train.diagnose(run, episodes, None)["diagnosis_logprob_diff"] < 1e-4
    assert train.probe(run)["probe_diagnosis_logprob_diff"] < 1e-4
    run.args.retokenize = True
    assert train.diagnose(run, episodes, None)["diagnosis_logprob_diff"] > 1e-2
    assert train.probe(run)["probe_diagnosis_logprob_diff"] > 1e-2


def test_the_diagnosis_counts_identical_prompts_as_one_target(tmp_path):
    """Two groups of the same layout have the same prompt: as in the official metric, a reasoning is
    retrieved when its best prompt is identical to its own, and chance is count / N (here 1)."""
    run = make_run(tmp_path, env="frozenlake", groups=2, group_size=4, mi_samples=8)
    same = train.diagnose(run, play_scripted(run, [5, 5]), None)
    assert same["retrieval_chance"] == 1.0 and same["retrieval_acc"] == 1.0
    assert abs(same["mi_estimate"]) < 1e-6  # identical prompts: the reasoning cannot tell them apart
    different = train.diagnose(run, play_scripted(run, [5, 6]), None)
    assert different["retrieval_chance"] == 0.5


def test_the_diagnosis_samples_every_prompt_alike(tmp_path, monkeypatch):
    """The estimate's marginal mixes all N prompts of the batch, so each must be as likely to own a
    sample: with fewer samples than groups they are drawn uniformly over the groups (not the first
    groups only), one per group; with more, every group gives the same number."""
    run = make_run(tmp_path, env="frozenlake", groups=4, group_size=2, mi_samples=2)
    episodes = play_scripted(run, [1, 2, 3, 4], group_size=2)
    owners = []
    monkeypatch.setattr(train.mi, "cross_scores", lambda model, prompts, reasonings, *args: (
        torch.zeros(len(reasonings), len(prompts)), torch.ones(len(reasonings))))
    monkeypatch.setattr(train.mi, "collapse_metrics", lambda scores, owner, *args, **kw: (
        owners.append(owner) or {"mi_estimate": 0.0, "marginal_std": 0.0}))
    for seed in range(400):
        train.diagnose(run, episodes, np.random.default_rng(seed))
    assert all(len(set(o)) == 2 for o in owners)
    counts = np.bincount(np.concatenate(owners), minlength=4)  # 200 expected each, sd 12
    assert counts.min() > 150 and counts.max() < 250
    run.args.mi_samples = 7  # one from every group: three more would make three prompts likelier
    owners.clear()
    train.diagnose(run, episodes, None)
    assert owners == [[0, 1, 2, 3]]


def test_template_share_labels_every_diagnosed_reasoning_exactly(tmp_path, monkeypatch):
    """Rollouts that reason with a pool sentence, a near miss and a task reasoning: the share of pool
    sentences among the diagnosed reasonings, in the batch and on the probe set, is exact."""
    pool = templates.pool("frozenlake")
    texts = [pool[0], pool[3], pool[0] + " Try Up.", "Goal: 1 Down, 0 Right."]  # two templates of four

    def writer(tokenizer):
        end, count = rollout.end_of_turn_ids(tokenizer)[0], iter(range(10 ** 6))
        return lambda prompt_ids, env_list: [rollout.Generation(tokenizer.encode(
            f" {texts[next(count) % 4]} </think> <answer> Up </answer>", add_special_tokens=False) + [end])
            for _ in env_list]

    run = make_run(tmp_path, env="frozenlake", groups=2, group_size=4, mi_samples=8, probe_prompts=2,
                   probe_samples=4)
    episodes = rollout.play(writer(run.tokenizer), run.tokenizer, "frozenlake", [3, 5], 4, max_turns=1,
                            **run.prompt)
    assert train.diagnose(run, episodes, None)["template_share"] == 0.5
    monkeypatch.setattr(train.sampler, "hf_policy", lambda model, tokenizer, *args, **kwargs: writer(tokenizer))
    assert train.probe(run)["probe_template_share"] == 0.5


# ------------------------------------------------------------------------------------------- Fig. 4

def test_gradient_decomposition_task_norm_grows_with_real_spread(tmp_path):
    """Three groups with identical transcripts and rewards scaled 0, 1, 3: with Dr.GRPO's advantages
    (r - group mean, what its update trains on) the task gradient norm is 0, then positive and
    proportional to the spread; the entropy gradient does not depend on the rewards."""
    run = make_run(tmp_path, env="frozenlake", groups=3, group_size=4, grad_decomp_every=1, algo="drgrpo")
    played = play_scripted(run, [2, 5], group_size=4)[4:]  # group 1: half solve, half write garbage
    base = torch.tensor([e.total_reward for e in played])
    assert base.std() > 0
    episodes = [copy.copy(e) for _ in range(3) for e in played]
    for i, e in enumerate(episodes):
        e.group = i // 4
    rewards = torch.stack([0 * base, base, 3 * base])  # [G, K] spreads 0, s, 3s
    buckets = train.decompose_gradients(run, episodes, rewards)
    # three groups: three buckets, lowest spread first
    assert [b["n_groups"] for b in buckets] == [1, 1, 1]
    task = [b["task_grad_norm"] for b in buckets]
    assert task[0] == 0.0 and task[1] > 0
    assert task[2] == pytest.approx(3 * task[1], rel=1e-4)
    assert len({round(b["entropy_grad_norm"], 6) for b in buckets}) == 1
    # no optimiser step, no gradient left behind
    assert all(p.grad is None for p in run.policy.parameters())


def test_the_decomposition_trains_on_the_advantages_of_the_update(tmp_path):
    """PPO's task term is the gradient of the update's clipped loss on its whitened GAE advantages
    (the critic's baseline, not the group mean): computed here by hand for one group, and unlike the
    group-mean version, which a zero-spread group would give 0."""
    run = make_run(tmp_path, env="frozenlake", groups=1, group_size=4, grad_decomp_every=1, temperature=0.7)
    episodes = play_scripted(run, [2, 5], group_size=4)[4:]  # half solve, half write garbage
    for e in episodes:
        e.group = 0
    rewards = torch.tensor([e.total_reward for e in episodes]).view(1, 4)
    with torch.no_grad():  # a critic whose values are not 0
        for p in run.critic.parameters():
            p.add_(0.1 * torch.randn_like(p))
    (bucket,) = train.decompose_gradients(run, episodes, rewards)
    batch = train.rollout_batch(run, episodes)
    mask = batch["policy_mask"][:, 1:]
    values = train.over_batch(run, batch, train.critic_pass)
    advantages, _ = ppo.gae(batch["token_rewards"][:, 1:], values, mask, 1.0, 1.0)
    logp = logprobs.policy_logprobs(run.policy, batch["input_ids"], mask, temperature=0.7)[0]
    _, terms = ppo.policy_loss(logp, logp.detach(), advantages, mask)
    grads = torch.autograd.grad(terms["pg_loss"], [p for p in run.policy.parameters() if p.requires_grad])
    by_hand = torch.sqrt(sum(g.double().pow(2).sum() for g in grads)).item()
    assert bucket["task_grad_norm"] == pytest.approx(by_hand, rel=1e-4)
    plain = {"input_ids": batch["input_ids"], "mask": batch["mask"]}  # no advantages: group means
    group_mean = snr_filter.gradient_decomposition(run.policy, plain, rewards, temperature=0.7,
                                                   n_buckets=1)[0]["task_grad_norm"]
    assert abs(group_mean - by_hand) > 1e-3 * by_hand


def test_fig4_kl_is_measured_against_the_initial_policy_without_a_kl_term(tmp_path):
    """Without --kl-coef the decomposition still has a reference, the initial policy (for the tiny
    policy its warm start): once the policy has moved, the KL gradient is not 0 -- with the policy
    as its own reference it would be 0 by construction."""
    # at a temperature other than 1: the policy and its reference are both scored at the sampling
    # temperature, else their KL is not 0 at the start
    run = make_run(tmp_path, env="frozenlake", groups=2, group_size=4, grad_decomp_every=1, temperature=0.7)
    assert run.reference_model is not None
    episodes = play_scripted(run, [2, 5], group_size=4)
    rewards = torch.tensor([e.total_reward for e in episodes]).view(2, 4)
    assert all(b["kl_grad_norm"] < 1e-6 for b in train.decompose_gradients(run, episodes, rewards))
    with torch.no_grad():
        for p in run.policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    assert all(b["kl_grad_norm"] > 1e-4 for b in train.decompose_gradients(run, episodes, rewards))


@pytest.mark.parametrize("reference_prior, built", [(None, [0.1, 0.1]), (1.0, [0.1, 1.0])])
def test_the_kl_reference_is_the_warm_start_with_the_template_share_asked_for(tmp_path, monkeypatch,
                                                                              reference_prior, built):
    """--kl-template-prior: the KL term pulls towards a warm start of its own (a template-rich
    reference), else towards the policy's own warm start."""
    load_tiny, priors = tiny.load_tiny, []

    def recording(*args, **kwargs):
        priors.append(kwargs["template_prior"])
        return load_tiny(*args, **kwargs)

    monkeypatch.setattr(tiny, "load_tiny", recording)
    run = make_run(tmp_path, env="frozenlake", kl_coef=0.1, template_prior=0.1,
                   kl_template_prior=reference_prior)
    assert priors == built and run.reference_model is not run.policy


# --------------------------------------------------------------------------------------------- LoRA

def test_lora_trains_only_adapters_and_its_reference_is_the_base(tmp_path, scripted_rollouts):
    out = str(tmp_path / "run")
    argv = SMALL + ["--env", "frozenlake", "--algo", "ppo", "--filter", "none", "--lora", "4", "--kl-coef", "0.01",
                    "--out", out]
    assert train.main(argv + ["--steps", "2"]) == 0
    (start, first, second) = records(out)
    # LoRA's B starts at 0: the policy is its base
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-7)
    assert not first["skipped"] and first["grad_norm"] > 0 and "value_loss" in first
    ckpt = os.path.join(out, "checkpoint")
    assert os.path.isfile(os.path.join(ckpt, "adapter_model.safetensors"))
    # adapters only, not a copy of the base
    assert not os.path.exists(os.path.join(ckpt, "model.safetensors"))
    loaded = models.load_policy(train.Args(env="frozenlake", algo="ppo", warm_start=False), ckpt, CPU, {})[0]
    base = tiny.build_model(tiny.build_tokenizer()).state_dict()
    with loaded.disable_adapter():
        merged = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                  for k, v in loaded.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(base[k], merged[k]) for k in base)  # the base did not move
    lora = {k: v for k, v in loaded.state_dict().items() if "lora_B" in k and ".default." in k}
    assert lora and any(v.abs().sum() > 0 for v in lora.values())  # the policy's adapters did
    critic = {k: v for k, v in loaded.state_dict().items() if "lora_B" in k and ".critic." in k}
    # and so did the critic's (from step 2 on: its head starts at 0, so at step 1 no gradient
    # reaches the body)
    assert critic and any(v.abs().sum() > 0 for v in critic.values())
    assert train.main(["--resume", out, "--steps", "3"]) == 0  # a LoRA run resumes
    assert [r["step"] for r in records(out)] == [0, 1, 2, 3]


# ------------------------------------------------------------ controls: optimiser steps, random groups

@pytest.mark.parametrize("n_rows,size,steps", [(128, 32, 0), (64, 32, 0), (70, 32, 0), (64, 32, 4),
                                               (70, 32, 4), (5, 32, 8), (128, 32, 4)])
def test_mini_batches_cover_every_row_once_in_near_equal_parts(n_rows, size, steps):
    parts = train.mini_batches(n_rows, size, steps, torch.Generator().manual_seed(0))
    assert sorted(torch.cat(parts).tolist()) == list(range(n_rows))  # every row once
    sizes = [len(p) for p in parts]
    if steps:  # N parts whatever the batch size (never an empty one), sizes within one row
        assert len(parts) == min(steps, n_rows) and max(sizes) - min(sizes) <= 1
    else:  # fixed size: ceil(n / size) steps, as verl's split -- fewer for a filtered batch
        assert len(parts) == math.ceil(n_rows / size) and sizes[:-1] == [size] * (len(parts) - 1)
    # the order is the epoch's randperm: the default is the update's former shuffling exactly
    order = torch.randperm(n_rows, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.cat(parts), order)


def test_optimizer_steps_fix_the_number_of_steps_whatever_is_kept(tmp_path):
    run = make_run(tmp_path, env="sokoban", algo="grpo", mini_batch_size=32, optimizer_steps=3)
    episodes = play_scripted(run, [3, 5, 8, 13], group_size=4)  # 16 rows: 1 step of 32 by default
    rewards = torch.tensor([e.total_reward for e in episodes]).view(4, 4)
    assert train.update_policy(run, episodes, rewards, torch.Generator().manual_seed(0))[
        "optimizer_steps"] == 3
    run.args.optimizer_steps, run.args.epochs = 0, 2
    assert train.update_policy(run, episodes, rewards, torch.Generator().manual_seed(0))[
        "optimizer_steps"] == 2  # one a pass


def test_random_control_keeps_the_filters_count_reproducibly_per_step(tmp_path):
    a = snr_filter.Filter(mode="random", control_of="topk", top_k=0.5)
    rewards = torch.tensor([[0.0, 1.0]] * 6 + [[1.0, 1.0]] * 2)  # 8 groups, 2 without spread
    picks = [snr_filter.select(rewards, a, 0, step)[0] for step in range(1, 30)]
    assert all(int(p.sum()) == 4 for p in picks)  # Top-K 0.5 of 8
    assert any(p[6:].any() for p in picks)  # random: zero-spread groups can be drawn
    assert torch.equal(picks[3], snr_filter.select(rewards, a, 0, 4)[0])  # same seed and step, same choice
    assert len({tuple(p.tolist()) for p in picks}) > 5
    a = snr_filter.Filter(mode="bottom", control_of="topk", top_k=0.375)
    keep = snr_filter.select(torch.tensor([[0.0, s] for s in (1.0, 4.0, 2.0, 3.0)] + [[1.0, 1.0]] * 4), a, 0, 1)[0]
    assert keep.tolist() == [True, False, True, True] + [False] * 4  # int(0.375 * 8) = 3 lowest with spread


# ---------------------------------------------------------------------------------- the probe set

def test_the_probe_set_leaves_training_unchanged_and_repeats_itself(tmp_path):
    flags = SMALL + ["--env", "frozenlake", "--filter", "none", "--steps", "2", "--mi-every", "2"]
    logs = []
    for probe_prompts in ("0", "2"):
        out = str(tmp_path / f"run{probe_prompts}")
        assert train.main(flags + ["--out", out, "--probe-prompts", probe_prompts, "--probe-samples", "3"]) == 0
        logs.append(records(out))
    off, on = logs
    probes = [r for r in on if "probe_mi_estimate" in r]
    assert [r["step"] for r in probes] == [1, 2]
    for r in probes:
        for key in ("mi_estimate", "retrieval_acc", "reasoning_entropy", "conditional_entropy", "action_mi"):
            assert math.isfinite(r["probe_" + key]) and "probe_" + key + "_se" in r
        assert r["probe_action_mi"] <= math.log(3) + 1e-9
    # the probe samples on a forked stream: everything else is logged exactly as without it
    for r_off, r_on in zip(off, on):
        assert {k: v for k, v in r_on.items() if not k.startswith(("probe_",) + CLOCK)} == {
            k: v for k, v in r_off.items() if not k.startswith(CLOCK)}
    # the same prompts and the same sampling noise at every diagnosis: an unchanged policy gives
    # the same numbers, even after the training stream has moved on between two diagnoses
    run = make_run(tmp_path, env="frozenlake", probe_prompts=2, probe_samples=3)
    first = train.probe(run)
    torch.rand(1000)
    assert train.probe(run) == first


def test_split_answer_cuts_after_the_reasoning():
    first = rollout.FirstTurn("Q<think>", " go", [], [], [], reply=" go </think> <answer> Up </answer>")
    assert first.split_answer() == ("Q<think> go </think>", " <answer> Up </answer>")
    first.reply = " unclosed"
    assert first.split_answer() == ("Q<think> unclosed", "")


def test_the_algorithms_are_those_the_loop_aggregates():
    """--algo's choices (flags.py, without torch) are the keys of train.AGGREGATION."""
    algo = next(f for f in dataclasses.fields(flags.Args) if f.name == "algo")
    assert algo.metadata["choices"] == tuple(train.AGGREGATION)



def test_a_ppo_run_logs_what_practitioners_read_first(tmp_path):
    """Every updated step's record holds the critic's explained variance, the values', returns'
    and advantages' mean and spread over the policy tokens (from the batch the update used), the
    tokens sampled a second and the update's model-FLOPs utilisation against this machine's own
    matrix products (a share: between 0 and 1)."""
    out = str(tmp_path / "run")
    assert train.main(SMALL + ["--env", "frozenlake", "--filter", "none", "--steps", "1", "--mi-every", "0",
                               "--val-every", "0", "--out", out]) == 0
    (step,) = records(out)
    keys = ["explained_variance", "tokens_per_s", "mfu", "tokens_sampled", "tokens_trained"]
    keys += [f"{x}_{s}" for x in ("value", "return", "advantage") for s in ("mean", "std")]
    assert set(keys) <= set(step), set(keys) - set(step)
    assert step["explained_variance"] is None or step["explained_variance"] <= 1
    assert 0 < step["mfu"] < 1 and step["tokens_per_s"] > 0
    assert step["tokens_sampled"] == round(step["response_length"] * step["turns"] * 12)  # 3 x 4 episodes


def test_the_update_flops_are_the_stated_count():
    """runs.update_flops on a model with a tied output layer (V x D = 97 x 64) and the same one
    untied: the body's N excludes the embedding (a lookup) and the output layer, which counts only
    at the scored tokens; 6N a token for PPO's policy and again for its full critic, plus 2N for the
    critic's values before the update; 4N for LoRA's; 2N more for a KL reference and for old
    log-probs rescored under bfloat16."""
    import types
    for tied in (True, False):
        policy = tiny_qwen2(97, hidden_size=64, tie_word_embeddings=tied)
        total = sum(p.numel() for p in policy.parameters())
        n, h = total - 97 * 64 * (1 if tied else 2), 97 * 64
        run = types.SimpleNamespace(policy=policy, critic=object(),
                                    args=flags.Args(dtype="float32", sample_dtype="float32"))
        assert runs.update_flops(run, 10, 3) == (6 + 8) * n * 10 + 6 * h * 3
        run.args = flags.Args(dtype="bfloat16", sample_dtype="bfloat16", lora=4, kl_coef=0.1)
        assert runs.update_flops(run, 10, 3) == (4 + 2 + 2 + 6) * n * 10 + (4 + 2 + 2) * h * 3
        run.critic = None
        assert runs.update_flops(run, 1, 1) == (4 + 2 + 2) * (n + h)


# --------------------------------------------------------------------------------------------- DAPO

def countdown_policy(tokenizer, spread=lambda env: env.target % 2 == 0, calls=None):
    """A stand-in on Countdown with known spread: in a group whose puzzle `spread` picks, the even
    rollouts answer the solver's expression (reward 1) and the odd ones write garbage (the format
    penalty); every other group writes garbage only (no spread). `calls` counts the draws."""
    end = rollout.end_of_turn_ids(tokenizer)[0]

    def policy(prompt_ids, env_list):
        if calls is not None:
            calls.append(len(env_list))
        seen, out = {}, []
        for env in env_list:
            key = (env.target, tuple(env.numbers))
            k = seen[key] = seen.get(key, -1) + 1
            good = spread(env) and k % 2 == 0
            text = f" go </think> <answer> {envs.solve(env)[0]} </answer>" if good else " ?? </think>"
            out.append(rollout.Generation(tokenizer.encode(text, add_special_tokens=False) + [end]))
        return out
    return policy


def dapo_run(tmp_path, monkeypatch, calls=None, spread=lambda env: env.target % 2 == 0, **settings):
    run = make_run(tmp_path, **{"env": "countdown", "algo": "dapo", "groups": 4, "group_size": 4,
                                "max_new_tokens": 64, **settings})
    monkeypatch.setattr(train.sampler, "hf_policy",
                        lambda *args, **kw: countdown_policy(run.tokenizer, spread, calls))
    return run


def first_draw(run, step=1):
    seeds = np.random.default_rng([run.args.seed, step]).integers(0, 2 ** 30, run.args.groups).tolist()
    episodes = train.collect_rollouts(run, seeds, run.args.group_size)
    return episodes, train.episode_rewards(run, episodes)


def test_dynamic_sampling_refills_the_batch_with_groups_that_have_spread(tmp_path, monkeypatch):
    """verl's filter_groups: the zero-spread groups are dropped, more draws of --groups groups follow
    until --groups groups with spread are kept; the batch is the first of them in draw order,
    renumbered, whole groups of one puzzle each, and the draws are counted as made."""
    calls = []
    run = dapo_run(tmp_path, monkeypatch, calls, max_draws=50)
    episodes, rewards = first_draw(run)
    before = [g for g in range(4) if grpo.has_spread(rewards)[g]]
    assert len(before) < 4  # something to refill (the seeds of step 1 give odd targets)
    calls.clear()
    out, out_rewards, drawn = train.dynamic_sampling(run, episodes, rewards, step=1)
    assert out_rewards.shape == (4, 4) and grpo.has_spread(out_rewards).all()
    assert drawn["dynamic_draws"] == len(calls) + 1 <= 50
    assert drawn["dynamic_groups_drawn"] == 4 * drawn["dynamic_draws"]
    assert drawn["dynamic_groups_kept"] >= 4
    assert [e.group for e in out] == [g for g in range(4) for _ in range(4)]
    assert len({(e.env.target, tuple(e.env.numbers)) for e in out[:4]}) == 1
    kept_first = [e for e in episodes if e.group in range(len(before))]  # renumbered from the front
    assert out[:4 * len(before)] == kept_first
    torch.testing.assert_close(out_rewards.view(-1), torch.tensor([e.total_reward for e in out]))


def test_dynamic_sampling_respects_the_draw_bound(tmp_path, monkeypatch):
    """No group ever has spread: exactly --max-draws draws are made and nothing is kept -- the
    step has nothing to update (verl raises instead)."""
    calls = []
    run = dapo_run(tmp_path, monkeypatch, calls, spread=lambda env: False, max_draws=3)
    episodes, rewards = first_draw(run)
    calls.clear()
    out, out_rewards, drawn = train.dynamic_sampling(run, episodes, rewards, step=1)
    assert len(calls) == 2 and drawn["dynamic_draws"] == 3 and drawn["dynamic_groups_kept"] == 0
    assert out == [] and out_rewards.shape == (0, 4)
    keep, stats = snr_filter.select(out_rewards, runs.filter_of(run.args), run.args.seed, 1)
    assert not keep.any() and stats["num_kept"] == 0


def test_dynamic_sampling_draws_nothing_more_when_every_group_has_spread(tmp_path, monkeypatch):
    calls = []
    run = dapo_run(tmp_path, monkeypatch, calls, spread=lambda env: True)
    episodes, rewards = first_draw(run)
    calls.clear()
    out, out_rewards, drawn = train.dynamic_sampling(run, episodes, rewards, step=1)
    assert calls == [] and drawn["dynamic_draws"] == 1 and out == episodes
    assert torch.equal(out_rewards, rewards)


def test_dapos_loss_is_grpos_token_mean_loss_when_nothing_is_dropped(tmp_path, monkeypatch):
    """DAPO = GRPO's advantages (std-normalised) under token-mean: at ratio 1 its policy loss is
    -sum_b A_b n_b / sum_b n_b (n_b the episode's policy tokens), what ppo.policy_loss gives with
    GRPO's advantages and token-mean, not GRPO's own sequence mean."""
    run = dapo_run(tmp_path, monkeypatch, spread=lambda env: True, mini_batch_size=16, micro_batch=3,
                   entropy_coef=0.0)
    episodes, rewards = first_draw(run)
    episodes, rewards, _ = train.dynamic_sampling(run, episodes, rewards, step=1)
    stats = train.update_policy(run, episodes, rewards, torch.Generator().manual_seed(0))
    adv = grpo.group_advantages(rewards).reshape(-1)
    tokens = torch.tensor([sum(e.policy_mask) for e in episodes])
    want = -(adv * tokens).sum() / tokens.sum()
    assert stats["pg_loss"] == pytest.approx(want.item(), abs=1e-6)
    seq_mean = -adv.mean()  # GRPO's aggregate would weigh each episode alike
    assert abs(want - seq_mean) > 1e-3


def test_the_overlong_penalty_lowers_a_dapo_episodes_reward_per_turn(tmp_path, monkeypatch):
    """Under DAPO an episode's reward is its turns' rewards plus, per reply, the linear penalty past
    --max-new-tokens - --overlong-buffer; other algorithms leave the reward as the world gave it."""
    run = dapo_run(tmp_path, monkeypatch, spread=lambda env: True, max_new_tokens=16, overlong_buffer=8)
    episodes, rewards = first_draw(run)
    for e, r in zip(episodes, rewards.view(-1)):
        (n,) = e.response_lengths
        assert r.item() == pytest.approx(sum(e.turn_rewards) + min(-(n - 8) / 8, 0.0), abs=1e-6)
    assert any(e.shaping < 0 for e in episodes) and any(e.shaping == 0 for e in episodes)
    run.args.algo = "grpo"  # only DAPO shapes
    episodes, rewards = first_draw(run)
    assert rewards.view(-1).tolist() == pytest.approx([sum(e.turn_rewards) for e in episodes])
    assert all(e.shaping == 0 for e in episodes)


@pytest.mark.parametrize("filt", ["none", "topp"])
def test_a_dapo_run_refills_then_filters_and_logs_its_draws(tmp_path, monkeypatch, filt):
    """The paper's DAPO row: Top-P ranks the refilled batch (no zero-spread group reaches it)."""
    monkeypatch.setattr(train.sampler, "hf_policy",
                        lambda model, tokenizer, *args, **kw: countdown_policy(tokenizer))
    out = str(tmp_path / "run")
    assert train.main(SMALL + ["--env", "countdown", "--algo", "dapo", "--filter", filt, "--steps", "2",
                               "--groups", "4", "--max-draws", "20", "--out", out]) == 0
    documented = set(open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "plumbing",
                              "README.md")).read().split("### What is logged", 1)[1].split("###")[0].split("`"))
    for r in records(out)[1:]:
        assert {k for k in r if k.startswith(("dynamic_", "time_dynamic"))} <= documented
        assert r["dynamic_groups_kept"] >= 4 and 1 <= r["dynamic_draws"] <= 20
        assert r["dynamic_groups_drawn"] == 4 * r["dynamic_draws"]
        assert r["num_zero_var"] == 0 and not r["skipped"] and r["grad_norm"] > 0
        assert r["num_kept"] == 4 if filt == "none" else 1 <= r["num_kept"] <= 4
