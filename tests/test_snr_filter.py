"""Tests for snr_filter.py: reward spread, the sqrt(RV) bound, gradient decomposition, Top-P / Top-K
selection."""
import copy
import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conftest import tiny_qwen2
from logprobs import token_logprobs
from grpo import group_advantages
from ppo import Coefficients, clipped_policy_loss, kl_estimate
from snr_filter import (filter_stats, gradient_decomposition, group_scores, rv_buckets,
                        select_groups, task_gradient_bound)

finite = st.floats(-100, 100, allow_nan=False, allow_infinity=False)


# ------------------------------------------------------------------------------------- group_scores

def test_group_scores_closed_form():
    r = [[0.0, 1.0], [1.0, 1.0], [1.0, 2.0]]
    want = torch.tensor([math.sqrt(0.5), 0.0, math.sqrt(0.5)], dtype=torch.float64)
    assert torch.allclose(group_scores(r), want)
    assert group_scores(r, kind="var").tolist() == [0.5, 0.0, 0.5]
    # unbiased: (-1, 0, 2) has mean 1/3, squared deviations sum to 14/3, divided by K - 1 = 2
    assert group_scores([[-1.0, 0.0, 2.0]], kind="var").item() == pytest.approx(7 / 3)


def test_group_scores_flat_groups_are_exactly_zero_never_nan():
    r = np.array([[0.1, 0.1, 0.1], [-0.1, -0.1, -0.1], [10.0, 10.0, 10.0]])  # 0.1*3/3 != 0.1
    assert group_scores(r).tolist() == [0.0, 0.0, 0.0]
    single = group_scores([[3.0], [-2.0]])                                 # K = 1: no spread
    assert single.tolist() == [0.0, 0.0] and not torch.isnan(single).any()


def test_group_scores_matches_plain_loop_and_accepts_numpy():
    rng = np.random.default_rng(0)
    r = rng.normal(size=(7, 5))
    expect = [np.std(row, ddof=1) for row in r]
    assert np.allclose(group_scores(r).numpy(), expect)
    assert torch.equal(group_scores(r), group_scores(torch.tensor(r)))


@pytest.mark.parametrize("args", [([[1.0, 2.0]], "mad"), ([1.0, 2.0], "std"),
                                  ([[1.0, float("nan")]], "std")])
def test_group_scores_bad_input(args):
    with pytest.raises(ValueError):
        group_scores(*args)


# ------------------------------------------------------------------------------------ select_groups

def test_paper_worked_example_fig5():
    scores = [9.0, 1.0, 5.0]                                               # A, B, C
    assert select_groups(scores, "topp", 0.9).tolist() == [True, False, True]   # 13.49; A + C = 14
    assert select_groups(scores, "topp", 0.6).tolist() == [True, False, False]  # 8.99; A = 9
    assert select_groups(scores, "topp", 0.95).tolist() == [True, True, True]   # 14.24 needs B
    assert select_groups(scores, "none").tolist() == [True, True, True]


def test_linear_target_includes_the_minus_0_01_slack():
    # total 10, p = 0.5: target 4.99; the best group alone (4.995) reaches it only with the slack
    assert select_groups([4.995, 3.0, 2.005], "topp", 0.5).tolist() == [True, False, False]
    assert select_groups([4.98, 3.0, 2.02], "topp", 0.5).tolist() == [True, True, False]


def test_all_zero_batch_keeps_none():
    zeros = [0.0] * 5
    for mode, prob_mode in [("topp", "linear"), ("topp", "softmax"), ("topk", "linear")]:
        assert not select_groups(zeros, mode, 0.9, prob_mode=prob_mode).any()
    assert not select_groups(zeros, "topp", 1.0).any()                    # p = 1: every group
    assert not select_groups(zeros, "topp", 0.9, include_zero=True).any()   # that has spread
    assert select_groups(zeros, "none").all()                              # no filter at all


def test_tiny_total_spread_keeps_the_best_group():
    # target 0.9 * 0.005 - 0.01 < 0: the official loop stops before the first group and keeps
    # nothing; here the slack only absorbs round-off, so the best group with spread is kept
    assert select_groups([0.0, 0.004, 0.001], "topp", 0.9).tolist() == [False, True, False]


def test_topp_at_one_keeps_every_remaining_group():
    scores = [5.0, 0.004, 0.0, 2.0]                  # the 0.004 tail is below the 0.01 slack
    for prob_mode in ("linear", "softmax"):
        keep = select_groups(scores, "topp", 1.0, prob_mode=prob_mode)
        assert keep.tolist() == [True, True, False, True]
        everything = select_groups(scores, "topp", 1.0, include_zero=True, prob_mode=prob_mode)
        assert everything.all()                      # the official no-filter baseline
    assert select_groups([0.0] * 3, "topp", 1.0, include_zero=True).all()


def test_include_zero():
    # linear, p < 1: zero scores add nothing to the cumulative sum, so they are never kept
    for p in (0.5, 0.9, 0.99):
        assert torch.equal(select_groups([2.0, 0.0, 1.0], "topp", p),
                           select_groups([2.0, 0.0, 1.0], "topp", p, include_zero=True))
    # topk: the zero-score groups fill the count only when allowed (lower index first)
    assert select_groups([0.0, 0.0, 3.0, 1.0], "topk", 0.75).tolist() == [False, False, True, True]
    with_zero = select_groups([0.0, 0.0, 3.0, 1.0], "topk", 0.75, include_zero=True)
    assert with_zero.tolist() == [True, False, True, True]
    zeros = select_groups([0.0] * 4, "topk", 0.5, include_zero=True)
    assert zeros.tolist() == [True, True, False, False]
    # softmax: zero scores then carry mass exp(0) / Z each
    both = select_groups([0.0, 0.0], "topp", 0.4, prob_mode="softmax", include_zero=True)
    assert both.tolist() == [True, False]


def test_softmax_drops_zero_spread_groups_before_the_softmax():
    scores = [3.0, 2.0] + [0.0] * 6
    # over the two groups with spread: softmax(3, 2) = (0.731, 0.269), the first reaches 0.7
    keep = select_groups(scores, "topp", 0.7, prob_mode="softmax")
    assert keep.tolist() == [True] + [False] * 7
    # over all eight: e^3 / (e^3 + e^2 + 6) = 0.600 < 0.7, so the second group is needed too
    with_zero = select_groups(scores, "topp", 0.7, prob_mode="softmax", include_zero=True)
    assert with_zero.tolist() == [True, True] + [False] * 6
    # the official test cases (zero groups excluded)
    for s, p, kept in [([10.0, 1.0, 0.0, 0.0], 0.9, [0]), ([4.0, 2.0, 0.0, 0.0], 0.9, [0, 1]),
                       ([1.0, 1.0, 1.0, 0.0], 0.6, [0, 1])]:
        keep = select_groups(s, "topp", p, prob_mode="softmax")
        assert keep.nonzero()[:, 0].tolist() == kept


@pytest.mark.parametrize("k", [0.01, 0.1, 0.25, 0.5, 0.55, 0.99, 1.0])
def test_topk_counts(k):
    scores = np.random.default_rng(1).permutation(np.arange(1.0, 11.0))    # 10 distinct scores
    keep = select_groups(scores, "topk", k)
    n = max(1, int(k * 10))
    assert int(keep.sum()) == n
    assert set(scores[keep.numpy()]) == set(range(11 - n, 11))             # exactly the n largest


def test_ties_break_towards_lower_index():
    assert select_groups([1.0] * 4, "topk", 0.5).tolist() == [True, True, False, False]
    assert select_groups([1.0] * 4, "topp", 0.5).tolist() == [True, True, False, False]   # 1.99
    assert select_groups([1.0, 2.0, 1.0, 1.0], "topk", 0.5).tolist() == [True, True, False, False]


def test_softmax_mode_hand_computed():
    # with the zero group: softmax(0, ln 2, ln 3) = (1, 2, 3) / 6, ranked masses 1/2, 5/6, 1
    scores = [0.0, math.log(2.0), math.log(3.0)]
    for p, want in [(0.5, [False, False, True]), (0.51, [False, True, True]),
                    (5 / 6, [False, True, True]), (0.9, [True, True, True])]:
        keep = select_groups(scores, "topp", p, prob_mode="softmax", include_zero=True)
        assert keep.tolist() == want, p
    # without it: softmax(ln 2, ln 3) = (2, 3) / 5, ranked masses 3/5, 1
    for p, want in [(0.5, [False, False, True]), (0.6, [False, False, True]),
                    (0.61, [False, True, True]), (0.99, [False, True, True])]:
        assert select_groups(scores, "topp", p, prob_mode="softmax").tolist() == want, p


def _topp_loop(scores, p, prob_mode, include_zero):
    """Plain-Python Top-P, written from the definition."""
    pool = [i for i in range(len(scores)) if include_zero or scores[i] > 0]
    ranked = sorted(pool, key=lambda i: (-scores[i], i))
    if p >= 1:
        return [i in ranked for i in range(len(scores))]
    if prob_mode == "linear":
        weights, target = [scores[i] for i in ranked], p * sum(scores) - 0.01
    else:
        z = sum(math.exp(scores[i]) for i in ranked)
        weights, target = [math.exp(scores[i]) / z for i in ranked], p
    total, kept = 0.0, []
    for i, w in zip(ranked, weights):
        total += w
        kept.append(i)
        if total >= target:
            break
    if prob_mode == "linear":
        kept = [i for i in kept if scores[i] > 0]
    return [i in kept for i in range(len(scores))]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]) | st.floats(0, 10), min_size=1, max_size=12),
       st.floats(0.01, 1.0), st.sampled_from(["linear", "softmax"]), st.booleans())
def test_topp_equals_plain_loop(scores, p, prob_mode, include_zero):
    if prob_mode == "softmax":                       # keep away from ties of mass and target
        pool = sorted((s for s in scores if include_zero or s > 0), reverse=True)
        z = sum(math.exp(s) for s in pool)
        masses = np.cumsum([math.exp(s) / z for s in pool])
        assume(all(abs(m - p) > 1e-9 for m in masses))
    keep = select_groups(scores, "topp", p, include_zero=include_zero, prob_mode=prob_mode)
    assert keep.tolist() == _topp_loop(scores, p, prob_mode, include_zero)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]) | st.floats(0, 10), min_size=1, max_size=12),
       st.floats(0.01, 1.0))
def test_linear_topp_equals_plain_loop(scores, p):
    keep = select_groups(scores, "topp", p)
    assert keep.tolist() == _topp_loop(scores, p, "linear", False)
    kept = [s for s, k in zip(scores, keep.tolist()) if k]
    dropped = [s for s, k in zip(scores, keep.tolist()) if not k]
    if sum(scores) > 0:
        assert sum(kept) >= p * sum(scores) - 0.01 - 1e-9                 # the target is reached
        assert kept and min(kept) >= max(dropped, default=0.0)            # by the best groups


@pytest.mark.parametrize("mode, value, prob_mode", [
    ("topp", 0.0, "linear"), ("topp", 1.5, "linear"), ("topk", -0.1, "linear"),
    ("topk", 2, "linear"), ("topp", None, "linear"), ("topp", float("nan"), "linear"),
    ("top_p", 0.9, "linear"), ("topp", 0.9, "cubic"),
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
        as_torch = torch.tensor(s, dtype=torch.float32)
        assert torch.equal(select_groups(s, mode, 0.6, prob_mode=prob_mode),
                           select_groups(as_torch, mode, 0.6, prob_mode=prob_mode))


# ------------------------------------------------------------------------------------- filter_stats

def test_filter_stats():
    st_ = filter_stats([9.0, 1.0, 5.0, 0.0], [True, False, True, False])
    assert st_ == {"kept_ratio": 0.5, "num_kept": 2, "num_zero_var": 1, "zero_var_frac": 0.25,
                   "mean_score_kept": 7.0, "mean_score_dropped": 0.5}
    none = filter_stats([0.0, 0.0], select_groups([0.0, 0.0], "topp", 0.9))
    assert none["kept_ratio"] == 0.0 and none["mean_score_kept"] == 0.0
    assert none["zero_var_frac"] == 1.0
    assert filter_stats([1.0], [True])["mean_score_dropped"] == 0.0
    with pytest.raises(ValueError):
        filter_stats([1.0, 2.0], [True])


# --------------------------------------------------------------------------------------- rv_buckets

def test_rv_buckets_closed_form():
    buckets = rv_buckets([3.0, 0.0, 2.0, 0.0, 1.0], n_buckets=3)           # sizes 1, 1, 1 + 2
    assert [b.tolist() for b in buckets] == [[1], [3], [4, 2, 0]]
    assert [len(b) for b in rv_buckets(np.arange(8.0), 6)] == [1, 1, 1, 1, 1, 3]
    assert [b.tolist() for b in rv_buckets([1.0, 0.0], n_buckets=3)] == [[1], [0]]   # 2 buckets
    assert rv_buckets([], 6) == []


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 5), min_size=1, max_size=40), st.integers(1, 8))
def test_rv_buckets_partition_equal_count_lowest_first(scores, n):
    buckets = rv_buckets(scores, n)
    G, nb = len(scores), min(n, len(scores))
    assert len(buckets) == nb
    assert sorted(i for b in buckets for i in b.tolist()) == list(range(G))
    assert [len(b) for b in buckets] == [G // nb] * (nb - 1) + [G // nb + G % nb]
    for lo, hi in zip(buckets, buckets[1:]):
        assert max(scores[i] for i in lo.tolist()) <= min(scores[i] for i in hi.tolist())


def test_rv_buckets_bad_n():
    with pytest.raises(ValueError):
        rv_buckets([1.0, 2.0], 0)


# ------------------------------------------------------------------------------ task_gradient_bound

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
    s = -2.5 * (r - r.mean())[:, None] * u[None, :]                 # grad log pi = c (r - rbar) u
    norm, bound = task_gradient_bound(r, s)
    assert norm == pytest.approx(bound, rel=1e-12) and norm > 0
    tight = task_gradient_bound([0.0, 2.0], [[-1.0, 0.0], [1.0, 0.0]])     # docstring example
    assert tight == (1.0, 1.0)


def test_bound_is_zero_when_rewards_are_equal():
    s = np.random.default_rng(3).normal(size=(5, 3))
    assert task_gradient_bound([0.7] * 5, s) == (0.0, 0.0)


def test_bound_bad_shapes():
    with pytest.raises(ValueError):
        task_gradient_bound([1.0, 2.0], [[1.0], [2.0], [3.0]])


# --------------------------------------------------------------------- softmax bandit: exact values

@pytest.mark.parametrize("counts", [(2, 1, 1), (3, 3, 1, 1), (1, 4, 2, 1)])
def test_softmax_bandit_closed_form(counts):
    """pi = softmax(theta) with rational probabilities counts / K: a group listing arm a counts[a]
    times is the exact distribution, so task_gradient_bound on it (rewards R[a], scores
    grad log pi(a) = e_a - pi) must return the exact population values

        norm  = ||E_pi[(R - E_pi R)(e_a - pi)]|| = ||grad_theta E_pi[R]||  (autograd, independent)
        bound = sqrt(Var_pi R) * sqrt(E_pi ||e_a - pi||^2) = sqrt(Var_pi R) * sqrt(1 - sum pi^2),

    both linear in the reward scale (sqrt(Var) scales with it), both 0 for equal rewards."""
    n, K = len(counts), sum(counts)
    pi = torch.tensor(counts, dtype=torch.float64) / K
    arms = [a for a in range(n) for _ in range(counts[a])]                 # the group, K samples
    score = torch.eye(n, dtype=torch.float64) - pi                         # [arm, theta]
    base = torch.tensor([1.0, 0.0, 0.2, 0.5][:n], dtype=torch.float64)
    results = []
    for c in (0.0, 0.5, 2.0):
        R = 0.3 + c * base                                                 # spread grows with c
        norm, bound = task_gradient_bound(R[arms], score[arms])
        theta = pi.log().requires_grad_()
        (g,) = torch.autograd.grad((torch.softmax(theta, 0) * R).sum(), theta)
        var = (pi * (R - (pi * R).sum()) ** 2).sum()
        assert norm == pytest.approx(g.norm().item(), rel=1e-9, abs=1e-12)
        assert bound == pytest.approx((var * (1 - (pi ** 2).sum())).sqrt().item(), rel=1e-9,
                                      abs=1e-12)
        results.append((norm, bound))
    assert results[0] == (0.0, 0.0)                                        # no spread, no gradient
    assert results[2][0] == pytest.approx(4 * results[1][0], rel=1e-9)     # linear in sqrt(Var)
    assert results[2][1] == pytest.approx(4 * results[1][1], rel=1e-9)
    assert results[2][0] < results[2][1]                                   # strict: not all tight


# --------------------------------------------------------------------------- gradient_decomposition

G, K, T, PROMPT = 6, 4, 12, 5


@pytest.fixture(scope="module")
def models():
    ref = tiny_qwen2(48, max_position_embeddings=64)
    policy = copy.deepcopy(ref)
    with torch.no_grad():                             # the policy has moved off its reference,
        for p in policy.parameters():                 # else the k3 gradient is exactly 0
            p.add_(0.05 * torch.randn_like(p))
    return policy, ref


def _batch(same_tokens, seed=0):
    """ids [B, T] with some right padding, and the mask [B, T-1] of the policy's tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 48, (K if same_tokens else G * K, T), generator=gen)
    if same_tokens:
        ids = ids.repeat(G, 1)                          # every group sees the same sequences
    attention = torch.ones(G * K, T, dtype=torch.long)
    attention[1::K, -2:] = 0                            # some right padding
    mask = torch.zeros(G * K, T - 1)
    mask[:, PROMPT - 1:] = 1                            # ids[:, PROMPT:] are the policy's
    return ids, mask * attention[:, 1:]


def _ref_logp(ref, ids, temperature=1.0):
    with torch.no_grad():
        return token_logprobs(ref(input_ids=ids).logits[:, :-1], ids[:, 1:], temperature).float()


def decompose(policy, ids, mask, rewards, ref_logp=None, advantages=None, temperature=1.0,
              n_buckets=6, **coef):
    """gradient_decomposition on a batch of these tensors, ppo.Coefficients from `coef` (both
    coefficients 1 unless given)."""
    batch = {"input_ids": ids, "mask": mask, "ref_logp": ref_logp, "advantages": advantages}
    coef = Coefficients(**{"entropy_coef": 1.0, "kl_coef": 1.0, **coef})
    return gradient_decomposition(policy, batch, rewards, coef, temperature, n_buckets)


def _rising_rewards(G_):
    base = torch.tensor([0.0, 1.0, 0.5, -1.0], dtype=torch.float64)
    return 1.0 + torch.arange(G_, dtype=torch.float64)[:, None] * base     # [G, K] spread ~ g


def test_decomposition_task_norm_scales_with_spread_regulariser_flat(models):
    policy, ref = models
    ids, mask = _batch(same_tokens=True)
    rewards = _rising_rewards(G)
    out = decompose(policy, ids, mask, rewards, _ref_logp(ref, ids), n_buckets=6)
    assert [d["bucket"] for d in out] == list(range(6))
    assert [d["groups"] for d in out] == [[g] for g in range(6)]
    task = [d["task_grad_norm"] for d in out]
    assert task[0] == 0.0                               # zero spread: no task gradient
    for g in range(1, 6):                               # same tokens: exactly prop. to sqrt(RV)
        assert task[g] == pytest.approx(g * task[1], rel=1e-4)
    assert [d["mean_std"] for d in out] == pytest.approx([g * out[1]["mean_std"] for g in range(6)])
    for key in ("kl_grad_norm", "entropy_grad_norm", "reg_grad_norm"):
        vals = [d[key] for d in out]
        assert vals[0] > 0 and vals == pytest.approx([vals[0]] * 6, rel=1e-5)
    # GRPO's std normalisation removes the sqrt(RV) scaling for every group with spread
    grpo = group_advantages(rewards, normalize_std=True).reshape(-1, 1).float()       # [B, 1]
    norm = decompose(policy, ids, mask, rewards, _ref_logp(ref, ids), grpo.expand_as(mask))
    normed = [d["task_grad_norm"] for d in norm]
    assert normed[0] == 0.0 and normed[1:] == pytest.approx([normed[1]] * 5, rel=1e-4)


def test_decomposition_regulariser_ignores_rewards(models):
    policy, ref = models
    ids, mask = _batch(same_tokens=False, seed=1)
    rewards = torch.randn(G, K, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    rewards[0] = 0.3                                    # two zero-spread groups: lowest bucket
    rewards[4] = -1.0
    kw = dict(ref_logp=_ref_logp(ref, ids), n_buckets=3)
    out = decompose(policy, ids, mask, rewards, **kw)
    assert out[0]["groups"] == [0, 4] and out[0]["task_grad_norm"] == 0.0
    assert out[0]["mean_std"] == 0.0
    assert all(d["task_grad_norm"] > 0 for d in out[1:])
    scaled = decompose(policy, ids, mask, 3.0 * rewards + 7.0, **kw)   # 3x spread
    permuted = decompose(policy, ids, mask, rewards[:, [2, 0, 3, 1]], **kw)
    for other in (scaled, permuted):
        assert [d["groups"] for d in other] == [d["groups"] for d in out]
        for key in ("kl_grad_norm", "entropy_grad_norm", "reg_grad_norm"):
            assert [d[key] for d in other] == [d[key] for d in out]
    tripled = [3 * d["task_grad_norm"] for d in out]
    assert [d["task_grad_norm"] for d in scaled] == pytest.approx(tripled, rel=1e-4)
    # padding tokens change nothing
    ids2 = ids.clone()
    ids2[1::K, -2:] = 7
    padded = decompose(policy, ids2, mask, rewards, **kw)
    for key in ("task_grad_norm", "kl_grad_norm", "entropy_grad_norm"):
        assert [d[key] for d in padded] == pytest.approx([d[key] for d in out], rel=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_decomposition_equals_plain_backward_loop(models, temperature):
    """One bucket by hand: three losses, loss.backward() with model.zero_grad() between; the policy
    and the reference at the sampling temperature, softmax(logits / T)."""
    policy, ref = models
    ids, mask = _batch(same_tokens=False, seed=2)
    rewards = _rising_rewards(G)
    out = decompose(policy, ids, mask, rewards, _ref_logp(ref, ids, temperature),
                    n_buckets=2, kl_coef=0.5, temperature=temperature)
    groups = out[1]["groups"]                           # the high-spread half
    rows = [g * K + k for g in groups for k in range(K)]
    adv = (rewards - rewards.mean(1, keepdim=True))[groups].reshape(-1).float()
    m = mask[rows]
    norms = []
    for terms in (["task"], ["kl"], ["entropy"], ["kl", "entropy"]):   # the last: the regulariser
        policy.zero_grad()
        logits = policy(input_ids=ids[rows]).logits[:, :-1] / temperature
        logp = token_logprobs(logits, ids[rows, 1:])
        loss = 0.0
        if "task" in terms:
            loss, _ = clipped_policy_loss(logp, logp.detach(), adv[:, None].expand_as(logp), m)
        if "kl" in terms:
            ref_logp = _ref_logp(ref, ids[rows], temperature)
            loss = loss + 0.5 * (kl_estimate(logp, ref_logp, "k3") * m).sum() / m.sum()
        if "entropy" in terms:
            logq = torch.log_softmax(logits.float(), -1)
            loss = loss + ((logq.exp() * logq).sum(-1) * m).sum() / m.sum()   # -entropy
        loss.backward()
        grads = [p.grad for p in policy.parameters() if p.grad is not None]
        norms.append(math.sqrt(sum(g.pow(2).sum().item() for g in grads)))
    policy.zero_grad(set_to_none=True)
    keys = ["task_grad_norm", "kl_grad_norm", "entropy_grad_norm", "reg_grad_norm"]
    assert [out[1][k] for k in keys] == pytest.approx(norms, rel=1e-4)


def test_decomposition_reference_choices_and_no_side_effects(models):
    policy, ref = models
    ids, mask = _batch(same_tokens=False, seed=3)
    rewards = _rising_rewards(G)
    before = [p.detach().clone() for p in policy.parameters()]
    alone = decompose(policy, ids, mask, rewards, n_buckets=2)
    assert all(d["kl_grad_norm"] == 0.0 for d in alone)   # policy == reference: k3 at its minimum
    by_ref = decompose(policy, ids, mask, rewards, _ref_logp(ref, ids), n_buckets=2)
    assert all(d["kl_grad_norm"] > 0 for d in by_ref)
    assert all(p.grad is None for p in policy.parameters())   # .grad untouched, no optimiser step
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))


def test_decomposition_bad_shapes(models):
    policy, _ = models
    ids, mask = _batch(same_tokens=False)
    with pytest.raises(ValueError, match="G \\* K"):
        decompose(policy, ids, mask, torch.zeros(G, K + 1))
    with pytest.raises(ValueError):
        decompose(policy, ids, mask, torch.zeros(G, K), kl_kind="k4")


# ------------------------------------------------------------------------------------- the controls

from snr_filter import select_control, zero_spread_split  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]), min_size=1, max_size=12),
       st.sampled_from(["topp", "topk"]), st.sampled_from([0.3, 0.5, 0.9, 1.0]),
       st.booleans(), st.sampled_from(["linear", "softmax"]), st.integers(0, 2 ** 31))
def test_controls_keep_exactly_the_named_filters_count(scores, of, value, include_zero, prob_mode,
                                                       seed):
    n = int(select_groups(scores, of, value, include_zero, prob_mode).sum())
    generator = torch.Generator().manual_seed(seed)
    random_keep = select_control(scores, "random", of, value, include_zero, prob_mode, generator)
    assert int(random_keep.sum()) == n
    bottom = select_control(scores, "bottom", of, value, include_zero, prob_mode)
    assert int(bottom.sum()) == n  # the named filter only keeps eligible groups: as many exist
    # bottom keeps the lowest eligible scores: nothing eligible it dropped scores below what it kept
    s = torch.tensor(scores, dtype=torch.float64)
    eligible = torch.ones_like(bottom) if include_zero else s > 0
    if bottom.any() and (eligible & ~bottom).any():
        assert s[bottom].max() <= s[eligible & ~bottom].min()
    assert not (bottom & ~eligible).any()


def test_bottom_keeps_the_lowest_spread_groups_closed_form():
    scores = [0.0, 4.0, 1.0, 3.0, 0.0, 2.0, 5.0, 6.0]
    # Top-K 0.5 keeps int(0.5 * 8) = 4: bottom keeps the 4 lowest with spread, 1 2 3 4
    assert select_control(scores, "bottom", "topk", 0.5).nonzero()[:, 0].tolist() == [1, 2, 3, 5]
    # with include_zero the two zero-spread groups are the lowest
    assert select_control(scores, "bottom", "topk", 0.5, include_zero=True).nonzero()[:, 0].tolist() == [
        0, 2, 4, 5]
    # Top-P 0.9 linear: 6 + 5 + 4 + 3 = 18 < 0.9 * 21 - 0.01 = 18.89, + 2 = 20: five groups
    assert select_control(scores, "bottom", "topp", 0.9).nonzero()[:, 0].tolist() == [1, 2, 3, 5, 6]


def test_random_control_is_uniform_and_reproducible():
    G, n, trials = 8, 4, 4000
    scores = [0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # the choice must ignore the scores
    counts = torch.zeros(G)
    pairs = torch.zeros(G, G)
    for seed in range(trials):
        keep = select_control(scores, "random", "topk", 0.5,
                              generator=torch.Generator().manual_seed(seed)).double()
        counts += keep
        pairs += keep[:, None] * keep[None, :]
    # each group is kept with probability n / G; a binomial count's sd is sqrt(T p (1 - p))
    p = n / G
    tolerance = 4.5 * math.sqrt(trials * p * (1 - p))  # 4.5 sd on each of 8 counts
    assert (counts - trials * p).abs().max() < tolerance
    # and each pair together with probability n (n - 1) / (G (G - 1)): a uniform n-subset
    q = n * (n - 1) / (G * (G - 1))
    off = ~torch.eye(G, dtype=torch.bool)
    assert (pairs[off] - trials * q).abs().max() < 4.5 * math.sqrt(trials * q * (1 - q))
    same = [select_control(scores, "random", "topk", 0.5,
                           generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(*same)


def test_controls_bad_input():
    with pytest.raises(ValueError, match="unknown control"):
        select_control([1.0], "top", "topk", 0.5)
    with pytest.raises(ValueError, match="takes its count from topp or topk"):
        select_control([1.0], "random", "none")


def test_zero_spread_split_counts_too_easy_and_too_hard():
    rewards = [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 1.0], [-0.2, -0.2, -0.2], [0.5, 0.5, 0.5]]
    success = [[1, 1, 1], [0, 0, 0], [0, 1, 1], [0, 0, 0], [1, 0, 1]]
    out = zero_spread_split(rewards, success)
    assert out == {"zero_var_success_frac": 1 / 5, "zero_var_fail_frac": 2 / 5}
    # the two fractions never exceed the zero-spread fraction
    assert sum(out.values()) <= filter_stats(group_scores(rewards), [True] * 5)["zero_var_frac"]
