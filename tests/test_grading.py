"""The grading tests of exercises.py: each test grades one exercise (@pytest.mark.exercise) and
calls no other exercise's code -- where a graded function calls one, the test puts a stand-in there
(mock.patch), so one unfinished exercise never fails another's grade. Expected values are closed
forms or numbers worked out by hand (in the comments), never a second implementation; a tensor
answer must have the expected shape too (same, not torch.allclose, which broadcasts). No fixtures:
tests/test_exercises.py calls these functions directly to check that each exercise fails alone.

    python -m course.exercises check            # all of them, one row per exercise
    python -m course.exercises check gae        # one exercise
"""
import json
import math
import os
from unittest import mock

import numpy as np
import pytest
import torch

import grpo
import logprobs
import mi
import ppo
import rollout
import snr_filter
from course import exercises
from plumbing import sampler
from warmstart import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG2, LOG3 = math.log(2.0), math.log(3.0)
GROUNDED = [[.5, .5, 0], [0, .5, .5], [.5, 0, .5]]  # theory.md Sec. 1: H(Z) = log 3, H(Z|X) = log 2
TEMPLATE = [[1 / 3] * 3] * 3                          # H(Z) = H(Z|X) = log 3


def close(a, b, tol=1e-6):
    return abs(float(a) - float(b)) <= tol


def same(actual, expected, **tolerance):
    """torch.allclose, for tensors of one shape: allclose alone broadcasts, so an answer of shape
    [1, B, T] would pass for one of shape [B, T]."""
    assert actual.shape == expected.shape, f"shape {list(actual.shape)}, not {list(expected.shape)}"
    return torch.allclose(actual, expected, **tolerance)


# ------------------------------------------------------------------------------------- chain_rule

@pytest.mark.exercise("chain_rule")
def test_chain_rule_closed_forms():
    assert close(mi.entropy([.5, .5, 0.]), LOG2)
    assert close(mi.entropy([.25] * 4), math.log(4))
    assert mi.entropy([1., 0.]) == 0.0, "0 log 0 counts as 0"
    assert close(mi.conditional_entropy(GROUNDED), LOG2)
    assert close(mi.mutual_information(GROUNDED), LOG3 - LOG2)
    assert close(mi.conditional_entropy(TEMPLATE), LOG3)
    assert close(mi.mutual_information(TEMPLATE), 0.0)


@pytest.mark.exercise("chain_rule")
def test_chain_rule_weights_each_input_by_its_prior():
    table, prior = [[1., 0.], [.5, .5]], [.75, .25]
    # H(Z|X) = .75 * 0 + .25 * log 2; p(z) = (.875, .125); I = H(Z) - H(Z|X)
    h_z = -(.875 * math.log(.875) + .125 * math.log(.125))
    assert close(mi.conditional_entropy(table, prior), .25 * LOG2)
    assert close(mi.mutual_information(table, prior), h_z - .25 * LOG2)
    # a one-to-one table: Z names X, so I(X;Z) = H(X)
    assert close(mi.mutual_information(np.eye(3), [.5, .25, .25]), mi.entropy([.5, .25, .25]))


@pytest.mark.exercise("chain_rule")
def test_chain_rule_holds_on_random_tables():
    rng = np.random.default_rng(0)
    for n, k in [(2, 3), (4, 2), (5, 6)]:
        table = rng.dirichlet(np.ones(k) * .5, size=n)                     # [N, K]
        prior = rng.dirichlet(np.ones(n))                                  # [N]
        h, h_cond, info = (mi.entropy(prior @ table), mi.conditional_entropy(table, prior),
                           mi.mutual_information(table, prior))
        assert close(h, h_cond + info, 1e-9), "H(Z) = H(Z|X) + I(X;Z)"
        assert -1e-12 <= info <= min(h, mi.entropy(prior)) + 1e-12


# ------------------------------------------------------------------------------------ mi_estimate

def no_retrieval(scores, owner, k=1, prompt_keys=None):
    """A stand-in for mi.retrieval_credit (another exercise): credit 0 for every sample."""
    return torch.zeros(len(owner), dtype=torch.float64)


@pytest.mark.exercise("mi_estimate")
def test_mi_estimate_matched_and_marginal_by_hand():
    table = torch.tensor([[-1., -3.], [-4., -2.]])
    matched, marginal = mi.matched_and_marginal(table, torch.tensor([0, 1]))
    assert same(matched, torch.tensor([-1., -2.]))
    by_hand = [math.log((math.exp(-1) + math.exp(-3)) / 2), math.log((math.exp(-4) + math.exp(-2)) / 2)]
    assert same(marginal, torch.tensor(by_hand))


@pytest.mark.exercise("mi_estimate")
def test_mi_estimate_worked_example():
    # theory.md Sec. 2: gaps log(2 / (1 + e^-2)) = 0.5662 twice and 0 (the tie) -> 0.3775
    with mock.patch.object(mi, "retrieval_credit", no_retrieval):
        out = mi.collapse_metrics([[-1., -3.], [-4., -2.], [-2., -2.]], [0, 1, 0])
    gap = math.log(2 / (1 + math.exp(-2)))
    assert close(out["mi_seq_estimate"], 2 * gap / 3) and close(out["mi_estimate"], 2 * gap / 3)
    assert close(out["conditional_entropy"], 5 / 3)                       # -(-1 - 2 - 2) / 3
    assert close(out["reasoning_entropy"], 5 / 3 + 2 * gap / 3)           # H(Z) = H(Z|X) + MI


@pytest.mark.exercise("mi_estimate")
def test_mi_estimate_ends_and_the_log_n_ceiling():
    with mock.patch.object(mi, "retrieval_credit", no_retrieval):
        separated = mi.collapse_metrics([[0., -math.inf], [-math.inf, 0.]], [0, 1])
        blind = mi.collapse_metrics([[-2., -2., -2.], [-5., -5., -5.]], [0, 2])
        rng = np.random.default_rng(1)
        estimates = []
        for boost in np.linspace(0., 30., 11):      # the owner's column raised by up to `boost`
            scores, owner = rng.normal(size=(6, 4)) * 3, rng.integers(0, 4, 6)
            scores[np.arange(6), owner] += rng.uniform(boost / 2, boost, 6)
            estimates.append(mi.collapse_metrics(scores, owner)["mi_seq_estimate"])
    assert close(separated["mi_seq_estimate"], LOG2)                      # every sample finds its own
    assert close(blind["mi_seq_estimate"], 0.0)                           # every prompt alike
    assert min(estimates) < 0 and math.log(4) - .3 < max(estimates) <= math.log(4) + 1e-12


@pytest.mark.exercise("mi_estimate")
def test_mi_estimate_per_token_matrix_and_zscore():
    scores, owner, lengths = [[-2., -6.], [-12., -4.], [-3., -3.]], [0, 1, 1], [2, 4, 1]
    with mock.patch.object(mi, "retrieval_credit", no_retrieval):
        out = mi.collapse_metrics(scores, owner, lengths)
    # per token: rows (-1, -3), (-3, -1), (-3, -3); gaps 0.5662, 0.5662, 0
    gap = math.log(2 / (1 + math.exp(-2)))
    marginal = [-1 - gap, -1 - gap, -3.0]
    mean = sum(marginal) / 3
    population_std = math.sqrt(sum((m - mean) ** 2 for m in marginal) / 3)
    assert close(out["mi_estimate"], 2 * gap / 3)
    assert close(out["conditional_entropy"], 5 / 3)
    assert close(out["mi_zscore"], (2 * gap / 3) / (population_std + 1e-3))
    assert close(out["marginal_std"], population_std)


# -------------------------------------------------------------------------------------- retrieval

@pytest.mark.exercise("retrieval")
def test_retrieval_a_clear_winner():
    scores = torch.tensor([[-1., -2., -3.], [-1., -2., -3.]])
    assert mi.retrieval_credit(scores, [0, 1]).tolist() == [1.0, 0.0]
    assert mi.retrieval_credit(scores, [0, 1], k=2).tolist() == [1.0, 1.0]
    assert mi.retrieval_credit(torch.tensor([[-math.inf, 0.]]), [1]).tolist() == [1.0]


@pytest.mark.exercise("retrieval")
def test_retrieval_ties_share_the_credit():
    two = torch.tensor([[-1., -1., -3.]])
    assert close(mi.retrieval_credit(two, [0])[0], .5)                    # a tie of two at the top
    assert close(mi.retrieval_credit(two, [0], k=2)[0], 1.)
    assert close(mi.retrieval_credit(torch.tensor([[-1., -1., -1.]]), [2], k=2)[0], 2 / 3)
    # one column above (g = 1), three tied below it (t = 3, one the owner's), k = 2:
    # 1 - C(2, 1) / C(3, 1) = 1/3
    assert close(mi.retrieval_credit(torch.tensor([[-1., -2., -2., -2.]]), [1], k=2)[0], 1 / 3)
    assert close(mi.retrieval_credit(torch.tensor([[-5.] * 4]), [3])[0], 1 / 4)   # collapsed: 1/N


@pytest.mark.exercise("retrieval")
def test_retrieval_identical_prompts_count_as_one_target():
    keys = ["x", "y", "x"]
    scores = torch.tensor([[-1., -3., -1.], [-4., -2., -4.], [-2., -2., -2.]])
    credit = mi.retrieval_credit(scores, [2, 1, 0], prompt_keys=keys)
    assert same(credit, torch.tensor([1., 1., 2 / 3], dtype=torch.float64))


# ------------------------------------------------------------------------------------------ bound

@pytest.mark.exercise("bound")
def test_bound_by_hand():
    assert snr_filter.task_gradient_bound([0., 2.], [[-1., 0.], [1., 0.]]) == pytest.approx((1., 1.))
    # rewards (1, 2, 4): centred (-4, -1, 5) / 3; gradient (1, 4) / 9; RV = 14 / 9; mean ||s||^2 = 4/3
    norm, bound = snr_filter.task_gradient_bound([1., 2., 4.], [[1., 0.], [0., 1.], [1., 1.]])
    assert close(norm, math.sqrt(17) / 9) and close(bound, math.sqrt(14 / 9 * 4 / 3))
    # the population variance: rewards (0, 1) give RV = 1/4, not the unbiased 1/2
    assert snr_filter.task_gradient_bound([0., 1.], [[1.], [1.]]) == pytest.approx((0., .5))


@pytest.mark.exercise("bound")
def test_bound_equal_rewards_give_nothing():
    assert snr_filter.task_gradient_bound([3., 3., 3.], [[1., 2.], [0., 1.], [5., 5.]]) == (0., 0.)


@pytest.mark.exercise("bound")
def test_bound_holds_and_is_tight_along_the_centred_rewards():
    rng = np.random.default_rng(2)
    for k, d in [(2, 1), (4, 3), (16, 5)]:
        for _ in range(10):
            norm, bound = snr_filter.task_gradient_bound(rng.normal(size=k), rng.normal(size=(k, d)))
            assert norm <= bound + 1e-12
        rewards, u = rng.normal(size=k), rng.normal(size=d)
        grads = 2.5 * (rewards - rewards.mean())[:, None] * u[None, :]     # s_k = c (r_k - rbar) u
        assert close(*snr_filter.task_gradient_bound(rewards, grads), tol=1e-9)


# ------------------------------------------------------------------------------------- topp, topk

def kept(scores, mode, value, **kw):
    return snr_filter.select_groups(scores, mode, value, **kw).tolist()


@pytest.mark.exercise("topp")
def test_topp_linear_fig5_and_the_slack():
    assert kept([9., 1., 5.], "topp", .9) == [True, False, True]         # 13.49: A + C = 14
    # target .5049 * 2 - 0.01 = 0.9998: the first group reaches it only with the slack
    assert kept([1., 1.], "topp", .5049) == [True, False]
    assert kept([1., 2., 2.], "topp", .4) == [False, True, False]        # ties: the lower index
    assert kept([3., 0., 1.], "topp", .99) == [True, False, True]


@pytest.mark.exercise("topp")
def test_topp_zero_spread_and_p_one():
    assert kept([0., 0., 0.], "topp", .9) == [False] * 3                  # nothing: skip the update
    assert kept([0., 0.], "topp", .9, include_zero=True) == [False] * 2  # zeros never in the sum
    assert kept([2., 0., 1.], "topp", 1.) == [True, False, True]
    assert kept([2., 0., 1.], "topp", 1., include_zero=True) == [True] * 3   # no filter at all


@pytest.mark.exercise("topp")
def test_topp_softmax_by_hand():
    # softmax over the groups with spread only: (3, 2) -> (0.731, 0.269)
    assert kept([3., 2., 0., 0.], "topp", .7, prob_mode="softmax") == [True, False, False, False]
    assert kept([1., 1., 0.], "topp", .6, prob_mode="softmax") == [True, True, False]
    # softmax of (1, 0.5, 0.2, 0.1): (0.406, 0.246, 0.183, 0.165), prefix masses .406 .652 .835
    assert kept([1., .5, .2, .1], "topp", .6, prob_mode="softmax") == [True, True, False, False]
    assert kept([1., .5, .2, .1], "topp", .7, prob_mode="softmax") == [True, True, True, False]


@pytest.mark.exercise("topk")
def test_topk_counts_every_group_but_keeps_only_groups_with_spread():
    assert kept([0., 0., 3., 1.], "topk", .75) == [False, False, True, True]   # int(3), 2 eligible
    scores = [4., 1., 3., 2., 5., 0., 6., 7.]                            # int(.5 * 8) = 4 best
    assert kept(scores, "topk", .5) == [True, False, False, False, True, False, True, True]
    assert kept([1., 2., 3., 4.], "topk", .1) == [False, False, False, True]   # at least one
    assert kept([1., 0., 3.], "topk", 1.) == [True, False, True]


# -------------------------------------------------------------------------------------------- gae

@pytest.mark.exercise("gae")
def test_gae_skips_observation_tokens():
    r, v, m = torch.tensor([[0., 0., 1.]]), torch.tensor([[.2, 9., .6]]), torch.tensor([[1, 0, 1]])
    adv, ret = ppo.gae(r, v, m, whiten=False)
    assert same(adv, torch.tensor([[.8, 0., .4]])) and same(ret, torch.tensor([[1., 0., 1.]]))
    # lambda = 0.5: A_2 = 1 - .6 = .4; A_0 = (0 + .6 - .2) + .5 * .4 = .6
    assert same(ppo.gae(r, v, m, lam=.5, whiten=False)[0], torch.tensor([[.6, 0., .4]]))
    assert same(ppo.gae(r, v, m)[0], torch.tensor([[.7071068, 0., -.7071068]]))


@pytest.mark.exercise("gae")
def test_gae_discounts():
    # gamma .9: A_1 = 1 - .5 = .5; A_0 = (0 + .9 * .5 - .5) + .9 * .5 = .4
    adv, ret = ppo.gae(torch.tensor([[0., 1.]]), torch.tensor([[.5, .5]]), torch.ones(1, 2),
                       gamma=.9, whiten=False)
    assert same(adv, torch.tensor([[.4, .5]])) and same(ret, torch.tensor([[.9, 1.]]))


@pytest.mark.exercise("gae")
def test_gae_each_row_ends_its_own_episode():
    # row 0 ends at its second token (padding after it); row 1 is another episode: nothing flows
    # from row 1 into row 0
    rewards = torch.tensor([[0., 1., 0.], [0., 0., 2.]])
    values = torch.tensor([[.5, .5, 0.], [3., 1., 1.]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv, ret = ppo.gae(rewards, values, mask, whiten=False)
    assert same(adv, torch.tensor([[.5, .5, 0.], [-1., 1., 1.]]))   # return-to-go - V
    assert same(ret, torch.tensor([[1., 1., 0.], [2., 2., 2.]]))


# -------------------------------------------------------------------------------------- clip_loss

RATIO = torch.tensor([[1., 4., 4., .5, .5, 2., 1.1]])
ADV = torch.tensor([[1., 1., -1., 1., -1., -1., 1.]])


def per_token_loss(logp, adv, **kw):
    """clipped_policy_loss's per-token loss, seen through a stand-in for ppo.aggregate (another
    exercise) that sums it -> (per-token loss [B, T], stats)."""
    seen = {}

    def summed(loss, mask, mode, norm_length=None):
        seen["loss"] = loss
        return loss.sum()

    with mock.patch.object(ppo, "aggregate", summed):
        _, stats = ppo.clipped_policy_loss(logp, torch.zeros_like(logp), adv, torch.ones_like(adv),
                                           ppo.Coefficients(**kw))
    return seen["loss"], stats


@pytest.mark.exercise("clip_loss")
def test_clip_loss_by_hand():
    loss, stats = per_token_loss(RATIO.log(), ADV)
    # r 1: -1; r 4, A 1: -1.28 (clip high); r 4, A -1: 4 capped at 3; r .5, A 1: -.5;
    # r .5, A -1: .8 (clip low); r 2, A -1: 2 (below the cap); r 1.1: -1.1
    expected = torch.tensor([[-1., -1.28, 3., -.5, .8, 2., -1.1]])
    assert same(loss, expected, atol=1e-6)
    assert close(stats["clip_frac"], 2 / 7) and close(stats["clip_frac_lower"], 1 / 7)
    no_cap, _ = per_token_loss(RATIO.log(), ADV, clip_c=None)
    assert same(no_cap[0, 2], torch.tensor(4.))


@pytest.mark.exercise("clip_loss")
def test_clip_loss_other_clip_values():
    loss, _ = per_token_loss(RATIO.log(), ADV, clip_low=.1, clip_high=.5, clip_c=1.5)
    # r 4, A 1: -1.5; r 4, A -1: 4 capped at 1.5; r .5, A -1: .9; r 2, A -1: 2 capped at 1.5
    expected = torch.tensor([[-1., -1.5, 1.5, -.5, .9, 1.5, -1.1]])
    assert same(loss, expected, atol=1e-6)


@pytest.mark.exercise("clip_loss")
def test_clip_loss_gradient_is_zero_exactly_where_clipped():
    logp = RATIO.log().clone().requires_grad_(True)
    loss, _ = per_token_loss(logp, ADV)
    loss.sum().backward()
    # d(-A r)/d log r = -A r where unclipped; 0 where a clip or the cap binds
    expected = torch.tensor([[-1., 0., 0., -.5, 0., 2., -1.1]])
    assert same(logp.grad, expected, atol=1e-6)


# ------------------------------------------------------------------------------------------- grpo

@pytest.mark.exercise("grpo")
def test_grpo_group_advantages_by_hand():
    adv = grpo.group_advantages(torch.tensor([[1., 0., 0., 0.], [2., 2., 2., 2.]]))
    # mean 1/4, unbiased std 1/2: (3/4, -1/4) / (1/2 + 1e-6)
    assert same(adv[0], torch.tensor([1.5, -.5, -.5, -.5]), atol=1e-5)
    assert torch.equal(adv[1], torch.zeros(4)), "no spread: exactly 0, never NaN"
    two = grpo.group_advantages(torch.tensor([[0., 1.]]))                 # unbiased std 0.7071
    assert same(two, torch.tensor([[-.7071063, .7071063]]), atol=1e-6)
    dr = grpo.group_advantages(torch.tensor([[1., 0., 0., 0.], [5., 5., 5., 5.]]),
                               normalize_std=False)
    assert same(dr, torch.tensor([[.75, -.25, -.25, -.25], [0., 0., 0., 0.]]))
    assert torch.equal(grpo.group_advantages(torch.tensor([[3.], [7.]])), torch.zeros(2, 1))


@pytest.mark.exercise("grpo")
def test_grpo_aggregation_by_hand():
    loss = torch.tensor([[1., 2., 3.], [4., 0., 0.]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # token-mean 10/4; seq-mean-token-mean (2 + 4)/2; seq-mean-token-sum (6 + 4)/2;
    # Dr.GRPO: every row's sum over one constant, 4: (6/4 + 4/4)/2 -- not over its own length
    for mode, value in zip(ppo.AGG_MODES, [2.5, 3., 5., 1.25]):
        assert close(ppo.aggregate(loss, mask, mode, norm_length=4), value), mode


@pytest.mark.exercise("grpo")
def test_grpo_aggregation_ignores_masked_values_and_empty_rows():
    loss = torch.tensor([[1., 2., 3.], [4., 99., 99.], [7., 7., 7.]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    for mode, value in zip(ppo.AGG_MODES, [2.5, 3., 5., 1.25]):
        assert close(ppo.aggregate(loss, mask, mode, norm_length=4), value), mode


# ------------------------------------------------------------------------------------- experiment

def experiment_runs():
    """{name: (config, records)} of the experiment's two runs: from $EXERCISE_RUNS, else
    runs/exercise, else the reference runs committed with the solution."""
    folder = os.environ.get("EXERCISE_RUNS") or next(
        (p for p in (os.path.join(ROOT, "runs", "exercise"),
                     os.path.join(ROOT, "results", "exercises", "experiment")) if os.path.isdir(p)),
        None)
    assert folder, "no runs: run the experiment's two commands (EXERCISES.md) into runs/exercise"
    out = {}
    for name in exercises.EXPERIMENT_RUNS:
        path = os.path.join(folder, name)
        assert os.path.isfile(os.path.join(path, "metrics.jsonl")), f"no run in {path}"
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(path, "metrics.jsonl")) as f:
            out[name] = config, [json.loads(line) for line in f if line.strip()]
    return out


@pytest.mark.exercise("experiment")
def test_experiment_runs_are_topk_and_its_random_control():
    runs = experiment_runs()
    (filtered, f_rows), (control, c_rows) = runs["topk"], runs["random"]
    assert filtered["filter"] == "topk", "runs/exercise/topk must be a --filter topk run"
    assert control["filter"] == "random" and control["control_of"] == "topk"
    same = ("env", "seed", "steps", "groups", "group_size", "algo", "top_k", "model", "temperature")
    assert all(filtered[k] == control[k] for k in same), f"the two runs must share {same}"
    for config, rows in runs.values():
        steps = [r for r in rows if r["step"] >= 1]
        assert len(steps) == config["steps"] >= 5 and "val_success" in rows[-1]
        # the rule each run's count follows, whatever its batches: as many as Top-K keeps
        n = max(1, int(config["top_k"] * config["groups"]))
        assert all(r["num_kept"] == min(n, config["groups"] - r["num_zero_var"]) for r in steps)


@pytest.mark.exercise("experiment")
def test_experiment_answers_are_read_off_the_runs():
    runs = experiment_runs()
    f_rows, c_rows = runs["topk"][1], runs["random"][1]
    answers = exercises.experiment_answers(f_rows, c_rows)
    f1, c1 = f_rows[[r["step"] for r in f_rows].index(1)], c_rows[[r["step"] for r in c_rows].index(1)]
    assert answers["same_first_batch"] == (
        (f1["train_success"], f1["reward_mean"], f1["reward_std"])
        == (c1["train_success"], c1["reward_mean"], c1["reward_std"]))
    ratios = [r["kept_ratio"] for r in f_rows if "kept_ratio" in r]
    assert close(answers["kept_ratio"], np.mean(ratios), 1e-9)
    assert close(answers["kept_spread_gap"], f1["mean_score_kept"] - c1["mean_score_kept"], 1e-9)
    vals = [[r["val_success"] for r in rows if "val_success" in r][-1] for rows in (f_rows, c_rows)]
    assert close(answers["val_difference"], vals[0] - vals[1], 1e-9)
    assert answers["verdict"] == "undecided", "one seed each cannot decide (5 seeds for a claim)"


# ------------------------------------------------------------------------------------- silent_bug

# Its name, its check="..." and its assertion are what `check` can print, so none says what it
# compares: finding the defect is the exercise (tests/test_exercises.py, which no student copy
# holds, says what it checks).
@pytest.mark.exercise("silent_bug", check="the property the MI diagnosis relies on")
def test_silent_bug_is_fixed():
    tokenizer = tiny.build_tokenizer()
    model = tiny.build_model(tokenizer, seed=3)
    torch.manual_seed(0)
    policy = sampler.hf_policy(model, tokenizer, max_new_tokens=6)
    episodes = rollout.play(policy, tokenizer, "frozenlake", [11, 12, 13], 2, max_turns=1,
                            **rollout.prompts("frozenlake", tiny=True))
    batch = rollout.collate(episodes, rollout.pad_token_id(tokenizer))
    mask = batch["policy_mask"][:, 1:]                                     # [B, T-1]
    with torch.no_grad():
        logp = logprobs.policy_logprobs(model, batch["input_ids"], mask)[0]  # [B, T-1]
    gap = ((logp - batch["logprobs"][:, 1:]).abs() * mask).amax(1)        # [B]
    assert len({e.first.prompt for e in episodes}) == 3
    assert gap.max() < 1e-4
