"""Tests for snr_filter.py: reward spread, the sqrt(RV) bound, gradient decomposition, Top-P / Top-K selection."""
import copy
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen2Config, Qwen2ForCausalLM

from ppo import clipped_policy_loss, kl_estimate, token_logprobs
from snr_filter import (filter_stats, gradient_decomposition, group_scores, rv_buckets, select_groups,
                        task_gradient_bound)

finite = st.floats(-100, 100, allow_nan=False, allow_infinity=False)


# ------------------------------------------------------------------------------------------------ group_scores

def test_group_scores_closed_form():
    r = [[0.0, 1.0], [1.0, 1.0], [1.0, 2.0]]
    assert torch.allclose(group_scores(r), torch.tensor([math.sqrt(0.5), 0.0, math.sqrt(0.5)], dtype=torch.float64))
    assert group_scores(r, kind="var").tolist() == [0.5, 0.0, 0.5]
    # unbiased: (-1, 0, 2) has mean 1/3, squared deviations sum to 14/3, divided by K - 1 = 2
    assert group_scores([[-1.0, 0.0, 2.0]], kind="var").item() == pytest.approx(7 / 3)


def test_group_scores_flat_groups_are_exactly_zero_never_nan():
    r = np.array([[0.1, 0.1, 0.1], [-0.1, -0.1, -0.1], [10.0, 10.0, 10.0]])  # 0.1 * 3 / 3 is not 0.1 in floats
    assert group_scores(r).tolist() == [0.0, 0.0, 0.0]
    single = group_scores([[3.0], [-2.0]])                                     # K = 1: no spread to measure
    assert single.tolist() == [0.0, 0.0] and not torch.isnan(single).any()


def test_group_scores_matches_plain_loop_and_accepts_numpy():
    rng = np.random.default_rng(0)
    r = rng.normal(size=(7, 5))
    expect = [np.std(row, ddof=1) for row in r]
    assert np.allclose(group_scores(r).numpy(), expect)
    assert torch.equal(group_scores(r), group_scores(torch.tensor(r)))


@pytest.mark.parametrize("args", [([[1.0, 2.0]], "mad"), ([1.0, 2.0], "std"), ([[1.0, float("nan")]], "std")])
def test_group_scores_bad_input(args):
    with pytest.raises(ValueError):
        group_scores(*args)


# ------------------------------------------------------------------------------------------------ select_groups

def test_paper_worked_example_fig5():
    scores = [9.0, 1.0, 5.0]                                                   # A, B, C
    assert select_groups(scores, "topp", 0.9).tolist() == [True, False, True]  # target 13.49, A + C = 14
    assert select_groups(scores, "topp", 0.6).tolist() == [True, False, False]  # target 8.99, A = 9 suffices
    assert select_groups(scores, "topp", 1.0).tolist() == [True, True, True]   # target 14.99 needs B too
    assert select_groups(scores, "none").tolist() == [True, True, True]


def test_linear_target_includes_the_minus_0_01_slack():
    # total 10, p = 0.5: target 4.99; the best group alone (4.995) reaches it only because of the slack
    assert select_groups([4.995, 3.0, 2.005], "topp", 0.5).tolist() == [True, False, False]
    assert select_groups([4.98, 3.0, 2.02], "topp", 0.5).tolist() == [True, True, False]


def test_all_zero_batch_keeps_none():
    zeros = [0.0] * 5
    for mode, prob_mode in [("topp", "linear"), ("topp", "softmax"), ("topk", "linear")]:
        assert not select_groups(zeros, mode, 0.9, prob_mode=prob_mode).any()
    assert select_groups(zeros, "none").all()                                  # no filter: keep everything
    # a tiny but real spread is still kept: the 0.01 slack never empties the prefix
    assert select_groups([0.0, 0.004, 0.001], "topp", 0.9).tolist() == [False, True, False]   # target < 0


def test_include_zero():
    # linear: zero-score groups add nothing to the cumulative sum, so only an all-zero batch reaches one
    for p in (0.5, 0.9, 1.0):
        assert torch.equal(select_groups([2.0, 0.0, 1.0], "topp", p),
                           select_groups([2.0, 0.0, 1.0], "topp", p, include_zero=True))
    assert select_groups([0.0] * 3, "topp", 0.9, include_zero=True).tolist() == [True, False, False]
    # topk: the zero-score groups fill the count only when allowed (stable: lower index first)
    assert select_groups([0.0, 0.0, 3.0, 1.0], "topk", 0.75).tolist() == [False, False, True, True]
    assert select_groups([0.0, 0.0, 3.0, 1.0], "topk", 0.75, include_zero=True).tolist() == [True, False, True, True]
    assert select_groups([0.0] * 4, "topk", 0.5, include_zero=True).tolist() == [True, True, False, False]
    # softmax: zero scores still carry mass exp(0) / Z
    assert select_groups([0.0, 0.0], "topp", 0.4, prob_mode="softmax", include_zero=True).tolist() == [True, False]


@pytest.mark.parametrize("k", [0.01, 0.1, 0.25, 0.5, 0.55, 0.99, 1.0])
def test_topk_counts(k):
    scores = np.random.default_rng(1).permutation(np.arange(1.0, 11.0))        # 10 distinct positive scores
    keep = select_groups(scores, "topk", k)
    n = max(1, int(k * 10))
    assert int(keep.sum()) == n
    assert set(scores[keep.numpy()]) == set(range(11 - n, 11))                 # exactly the n largest


def test_ties_break_towards_lower_index():
    assert select_groups([1.0] * 4, "topk", 0.5).tolist() == [True, True, False, False]
    assert select_groups([1.0] * 4, "topp", 0.5).tolist() == [True, True, False, False]   # target 1.99
    assert select_groups([1.0, 2.0, 1.0, 1.0], "topk", 0.5).tolist() == [True, True, False, False]


def test_softmax_mode_hand_computed():
    # softmax(0, ln 2, ln 3) = (1, 2, 3) / 6; ranked masses 1/2, 5/6, 1
    scores = [0.0, math.log(2.0), math.log(3.0)]
    assert select_groups(scores, "topp", 0.5, prob_mode="softmax").tolist() == [False, False, True]
    assert select_groups(scores, "topp", 0.51, prob_mode="softmax").tolist() == [False, True, True]
    assert select_groups(scores, "topp", 5 / 6, prob_mode="softmax").tolist() == [False, True, True]
    assert select_groups(scores, "topp", 0.9, prob_mode="softmax").tolist() == [False, True, True]  # zero dropped
    assert select_groups(scores, "topp", 0.9, prob_mode="softmax", include_zero=True).tolist() == [True, True, True]
    assert select_groups(scores, "topp", 1.0, prob_mode="softmax", include_zero=True).all()


def _linear_topp_loop(scores, p):
    """Plain-Python Top-P (linear), written from the definition."""
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    target, total, kept = p * sum(scores) - 0.01, 0.0, []
    for i in ranked:
        total += scores[i]
        kept.append(i)
        if total >= target:
            break
    return [i in kept and scores[i] > 0 for i in range(len(scores))]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]) | st.floats(0, 10), min_size=1, max_size=12),
       st.floats(0.01, 1.0))
def test_linear_topp_equals_plain_loop(scores, p):
    keep = select_groups(scores, "topp", p)
    assert keep.tolist() == _linear_topp_loop(scores, p)
    kept = [s for s, k in zip(scores, keep.tolist()) if k]
    if sum(scores) > 0:
        assert sum(kept) >= p * sum(scores) - 0.01 - 1e-9                    # the target is reached
        assert kept and min(kept) >= max([s for s, k in zip(scores, keep.tolist()) if not k], default=0.0)


@pytest.mark.parametrize("mode, value, prob_mode", [
    ("topp", 0.0, "linear"), ("topp", 1.5, "linear"), ("topk", -0.1, "linear"), ("topk", 2, "linear"),
    ("topp", None, "linear"), ("topp", float("nan"), "linear"), ("top_p", 0.9, "linear"), ("topp", 0.9, "cubic"),
])
def test_select_groups_invalid_values(mode, value, prob_mode):
    with pytest.raises(ValueError):
        select_groups([1.0, 2.0], mode, value, prob_mode=prob_mode)


def test_select_groups_invalid_scores_and_message():
    with pytest.raises(ValueError, match="none.*topp.*topk"):
        select_groups([1.0], "random", 0.5)
    with pytest.raises(ValueError):
        select_groups([1.0, -0.5], "topp", 0.9)
    with pytest.raises(ValueError):
        select_groups([1.0, float("inf")], "topp", 0.9)


def test_select_groups_numpy_equals_torch():
    s = np.array([0.3, 0.0, 1.2, 0.7, 0.7])
    for mode, prob_mode in [("topp", "linear"), ("topp", "softmax"), ("topk", "linear")]:
        assert torch.equal(select_groups(s, mode, 0.6, prob_mode=prob_mode),
                           select_groups(torch.tensor(s, dtype=torch.float32), mode, 0.6, prob_mode=prob_mode))


# ------------------------------------------------------------------------------------------------ filter_stats

def test_filter_stats():
    st_ = filter_stats([9.0, 1.0, 5.0, 0.0], [True, False, True, False])
    assert st_ == {"kept_ratio": 0.5, "num_kept": 2, "num_zero_var": 1, "zero_var_frac": 0.25,
                   "mean_score_kept": 7.0, "mean_score_dropped": 0.5}
    none = filter_stats([0.0, 0.0], select_groups([0.0, 0.0], "topp", 0.9))
    assert none["kept_ratio"] == 0.0 and none["mean_score_kept"] == 0.0 and none["zero_var_frac"] == 1.0
    assert filter_stats([1.0], [True])["mean_score_dropped"] == 0.0
    with pytest.raises(ValueError):
        filter_stats([1.0, 2.0], [True])


# ------------------------------------------------------------------------------------------------ rv_buckets

def test_rv_buckets_closed_form():
    assert [b.tolist() for b in rv_buckets([3.0, 0.0, 2.0, 0.0, 1.0], n_buckets=3)] == [[1, 3], [4, 2], [0]]
    assert [b.tolist() for b in rv_buckets([1.0, 0.0], n_buckets=3)] == [[1], [0], []]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 5), min_size=1, max_size=40), st.integers(1, 8))
def test_rv_buckets_partition_equal_count_lowest_first(scores, n):
    buckets = rv_buckets(scores, n)
    assert len(buckets) == n
    assert sorted(i for b in buckets for i in b.tolist()) == list(range(len(scores)))
    sizes = [len(b) for b in buckets]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    for lo, hi in zip(buckets, buckets[1:]):
        if len(lo) and len(hi):
            assert max(scores[i] for i in lo.tolist()) <= min(scores[i] for i in hi.tolist())


def test_rv_buckets_bad_n():
    with pytest.raises(ValueError):
        rv_buckets([1.0, 2.0], 0)


# ------------------------------------------------------------------------------------------- task_gradient_bound

@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 5), st.data())
def test_bound_holds_for_every_finite_group(K, D, data):
    r = data.draw(st.lists(finite, min_size=K, max_size=K))
    s = data.draw(st.lists(st.lists(finite, min_size=D, max_size=D), min_size=K, max_size=K))
    norm, bound = task_gradient_bound(r, s)
    assert norm <= bound * (1 + 1e-9) + 1e-9
    # the norm is the group-mean-baseline gradient, written as a plain loop
    rbar = sum(r) / K
    g = [sum((r[k] - rbar) * s[k][d] for k in range(K)) / K for d in range(D)]
    assert norm == pytest.approx(math.sqrt(sum(x * x for x in g)), rel=1e-9, abs=1e-9)


def test_bound_is_tight_when_grads_are_proportional_to_centred_rewards():
    rng = np.random.default_rng(2)
    r = rng.normal(size=6)
    u = rng.normal(size=4)
    s = -2.5 * (r - r.mean())[:, None] * u[None, :]                           # grad log pi(z_k) = c (r_k - rbar) u
    norm, bound = task_gradient_bound(r, s)
    assert norm == pytest.approx(bound, rel=1e-12) and norm > 0
    assert task_gradient_bound([0.0, 2.0], [[-1.0, 0.0], [1.0, 0.0]]) == (1.0, 1.0)   # docstring example


def test_bound_is_zero_when_rewards_are_equal():
    s = np.random.default_rng(3).normal(size=(5, 3))
    assert task_gradient_bound([0.7] * 5, s) == (0.0, 0.0)


def test_bound_bad_shapes():
    with pytest.raises(ValueError):
        task_gradient_bound([1.0, 2.0], [[1.0], [2.0], [3.0]])


# --------------------------------------------------------------------------- softmax bandit: exact gradients

def test_softmax_bandit_closed_form():
    """pi = softmax(theta) over arms with rewards R. Exact task gradient g = E_pi[(R - E_pi R) grad log pi]
    = pi * (R - rbar); with grad log pi(a) = e_a - pi, E||grad log pi||^2 = 1 - sum pi^2, so the bound reads
    ||g|| <= sqrt(Var_pi R) * sqrt(1 - sum pi^2). The entropy bonus gradient -pi (log pi + H) has no R in it."""
    theta = torch.tensor([0.3, -1.0, 0.8, 0.1], dtype=torch.float64)
    base = torch.tensor([1.0, 0.0, 0.2, 0.5], dtype=torch.float64)
    task_norms, entropy_norms = [], []
    for c in (0.0, 0.5, 1.0, 2.0, 4.0):                                         # reward spread grows with c
        R = 0.3 + c * base
        t = theta.clone().requires_grad_(True)
        pi = torch.softmax(t, 0)
        (g,) = torch.autograd.grad((pi * R).sum(), t)
        pid = pi.detach()
        rbar = (pid * R).sum()
        assert torch.allclose(g, pid * (R - rbar))
        # the same g as the exact expectation over arms of (R - b) grad log pi
        score = torch.eye(4, dtype=torch.float64) - pid                        # [arm, theta] grad log pi(a)
        assert torch.allclose(g, (pid[:, None] * (R - rbar)[:, None] * score).sum(0))
        var = (pid * (R - rbar) ** 2).sum()
        assert (pid[:, None] * score ** 2).sum() == pytest.approx(1 - (pid ** 2).sum().item())
        assert g.norm() <= var.sqrt() * (1 - (pid ** 2).sum()).sqrt() + 1e-15
        t2 = theta.clone().requires_grad_(True)
        p2 = torch.softmax(t2, 0)
        (h,) = torch.autograd.grad(-(p2 * p2.log()).sum(), t2)
        H = -(pid * pid.log()).sum()
        assert torch.allclose(h, -pid * (pid.log() + H))
        task_norms.append(g.norm().item())
        entropy_norms.append(h.norm().item())
    assert task_norms[0] < 1e-15                                               # round-off of the softmax backward
    assert all(a < b for a, b in zip(task_norms, task_norms[1:]))              # grows with reward variance
    assert task_norms[-1] == pytest.approx(4.0 * task_norms[2])                # linearly in sqrt(Var)
    assert len(set(entropy_norms)) == 1                                       # independent of rewards


# ----------------------------------------------------------------------------------- gradient_decomposition

G, K, T, PROMPT = 6, 4, 12, 5


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ref = Qwen2ForCausalLM(cfg).eval()
    policy = copy.deepcopy(ref)
    with torch.no_grad():                                                      # the policy has moved off its reference,
        for p in policy.parameters():                                          # else the k3 gradient is exactly 0
            p.add_(0.05 * torch.randn_like(p))
    return policy, ref


def _batch(same_tokens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 48, (K if same_tokens else G * K, T), generator=gen)
    if same_tokens:
        ids = ids.repeat(G, 1)                                                 # every group sees the same sequences
    attention = torch.ones(G * K, T, dtype=torch.long)
    attention[1::K, -2:] = 0                                                   # some right padding
    policy_mask = torch.zeros(G * K, T, dtype=torch.long)
    policy_mask[:, PROMPT:] = 1
    return ids, attention, policy_mask


def _rising_rewards(G_):
    base = torch.tensor([0.0, 1.0, 0.5, -1.0], dtype=torch.float64)
    return 1.0 + torch.arange(G_, dtype=torch.float64)[:, None] * base         # [G, K] spread proportional to g


def test_decomposition_task_norm_scales_with_spread_regulariser_flat(models):
    policy, ref = models
    ids, att, pm = _batch(same_tokens=True)
    out = gradient_decomposition(policy, ids, att, pm, _rising_rewards(G), ref_model=ref, n_buckets=6)
    assert [d["bucket"] for d in out] == list(range(6)) and [d["groups"] for d in out] == [[g] for g in range(6)]
    task = [d["task_grad_norm"] for d in out]
    assert task[0] == 0.0                                                      # zero spread: no task gradient
    for g in range(1, 6):                                                      # same tokens: exactly prop. to sqrt(RV)
        assert task[g] == pytest.approx(g * task[1], rel=1e-4)
    assert [d["mean_std"] for d in out] == pytest.approx([g * out[1]["mean_std"] for g in range(6)])
    for key in ("kl_grad_norm", "entropy_grad_norm", "reg_grad_norm"):
        vals = [d[key] for d in out]
        assert vals[0] > 0 and vals == pytest.approx([vals[0]] * 6, rel=1e-5)
    # GRPO's std normalisation removes the sqrt(RV) scaling for every group with spread
    norm = gradient_decomposition(policy, ids, att, pm, _rising_rewards(G), ref_model=ref, normalize_std=True)
    normed = [d["task_grad_norm"] for d in norm]
    assert normed[0] == 0.0 and normed[1:] == pytest.approx([normed[1]] * 5, rel=1e-4)


def test_decomposition_regulariser_ignores_rewards(models):
    policy, ref = models
    ids, att, pm = _batch(same_tokens=False, seed=1)
    rewards = torch.randn(G, K, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    rewards[0] = 0.3                                                           # two zero-spread groups: lowest bucket
    rewards[4] = -1.0
    kw = dict(ref_model=ref, n_buckets=3)
    out = gradient_decomposition(policy, ids, att, pm, rewards, **kw)
    assert out[0]["groups"] == [0, 4] and out[0]["task_grad_norm"] == 0.0 and out[0]["mean_std"] == 0.0
    assert all(d["task_grad_norm"] > 0 for d in out[1:])
    scaled = gradient_decomposition(policy, ids, att, pm, 3.0 * rewards + 7.0, **kw)   # same buckets, 3x spread
    permuted = gradient_decomposition(policy, ids, att, pm, rewards[:, [2, 0, 3, 1]], **kw)
    for other in (scaled, permuted):
        assert [d["groups"] for d in other] == [d["groups"] for d in out]
        for key in ("kl_grad_norm", "entropy_grad_norm", "reg_grad_norm"):
            assert [d[key] for d in other] == [d[key] for d in out]
    assert [d["task_grad_norm"] for d in scaled] == pytest.approx([3 * d["task_grad_norm"] for d in out], rel=1e-4)
    # padding tokens change nothing
    ids2 = ids.clone()
    ids2[att == 0] = 7
    padded = gradient_decomposition(policy, ids2, att, pm, rewards, **kw)
    for key in ("task_grad_norm", "kl_grad_norm", "entropy_grad_norm"):
        assert [d[key] for d in padded] == pytest.approx([d[key] for d in out], rel=1e-5)


def test_decomposition_equals_plain_backward_loop(models):
    """One bucket by hand: three losses, loss.backward() with model.zero_grad() between."""
    policy, ref = models
    ids, att, pm = _batch(same_tokens=False, seed=2)
    rewards = _rising_rewards(G)
    out = gradient_decomposition(policy, ids, att, pm, rewards, ref_model=ref, n_buckets=2, kl_coef=0.5)
    groups = out[1]["groups"]                                                  # the high-spread half
    rows = [g * K + k for g in groups for k in range(K)]
    adv = (rewards - rewards.mean(1, keepdim=True))[groups].reshape(-1).float()
    m = (pm[rows, 1:] * att[rows, 1:]).float()
    norms = []
    for term in ("task", "kl", "entropy"):
        policy.zero_grad()
        logits = policy(input_ids=ids[rows], attention_mask=att[rows]).logits[:, :-1]
        logp = token_logprobs(logits, ids[rows, 1:])
        if term == "task":
            loss, _ = clipped_policy_loss(logp, logp.detach(), adv[:, None].expand_as(logp), m)
        elif term == "kl":
            with torch.no_grad():
                ref_logp = token_logprobs(ref(input_ids=ids[rows], attention_mask=att[rows]).logits[:, :-1],
                                          ids[rows, 1:])
            loss = 0.5 * (kl_estimate(logp, ref_logp, "k3") * m).sum() / m.sum()
        else:
            logq = torch.log_softmax(logits.float(), -1)
            loss = ((logq.exp() * logq).sum(-1) * m).sum() / m.sum()           # -entropy, token mean
        loss.backward()
        norms.append(math.sqrt(sum(p.grad.pow(2).sum().item() for p in policy.parameters() if p.grad is not None)))
    policy.zero_grad(set_to_none=True)
    got = [out[1]["task_grad_norm"], out[1]["kl_grad_norm"], out[1]["entropy_grad_norm"]]
    assert got == pytest.approx(norms, rel=1e-4)


def test_decomposition_reference_choices_and_no_side_effects(models):
    policy, ref = models
    ids, att, pm = _batch(same_tokens=False, seed=3)
    rewards = _rising_rewards(G)
    before = [p.detach().clone() for p in policy.parameters()]
    alone = gradient_decomposition(policy, ids, att, pm, rewards, n_buckets=2)
    assert all(d["kl_grad_norm"] == 0.0 for d in alone)                        # policy == reference: k3 at its minimum
    with torch.no_grad():
        ref_logp = token_logprobs(ref(input_ids=ids, attention_mask=att).logits[:, :-1], ids[:, 1:])
    by_model = gradient_decomposition(policy, ids, att, pm, rewards, ref_model=ref, n_buckets=2)
    by_logp = gradient_decomposition(policy, ids, att, pm, rewards, ref_logp=ref_logp, n_buckets=2)
    assert [d["kl_grad_norm"] for d in by_logp] == pytest.approx([d["kl_grad_norm"] for d in by_model], rel=1e-4)
    assert all(p.grad is None for p in policy.parameters())                     # .grad untouched, no optimiser step
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))


def test_decomposition_bad_shapes(models):
    policy, _ = models
    ids, att, pm = _batch(same_tokens=False)
    with pytest.raises(ValueError, match="G \\* K"):
        gradient_decomposition(policy, ids, att, pm, torch.zeros(G, K + 1))
    with pytest.raises(ValueError):
        gradient_decomposition(policy, ids, att, pm, torch.zeros(G, K), kl_kind="k4")
