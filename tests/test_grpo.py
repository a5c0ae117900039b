"""grpo.py: group-relative advantages, and ppo.policy_loss as GRPO and Dr.GRPO use it, against known
values and exact expectations; DAPO's group filter and overlong penalty against plain loops and
their closed forms."""
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import snr_filter
from grpo import episode_advantages_to_tokens, group_advantages, has_spread, overlong_penalty
from logprobs import token_logprobs
from ppo import Coefficients, aggregate, kl_estimate, policy_loss


def grpo_loss(logp, old_logp, adv, mask, agg="seq-mean-token-mean", ref_logp=None, **coef):
    return policy_loss(logp, old_logp, adv, mask, Coefficients(agg=agg, **coef), ref_logp=ref_logp)


def test_group_advantages_known_values():
    adv = group_advantages(torch.tensor([[1., 0., 0., 0.], [2., 2., 2., 2.]]))
    # mean 0.25, unbiased std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
    want = torch.tensor([[1.5, -0.5, -0.5, -0.5], [0., 0., 0., 0.]])
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=0)
    assert (adv[1] == 0).all()


def test_group_advantages_matches_numpy_and_dr_grpo():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(5, 6, generator=g)
    x = r.numpy().astype(np.float64)
    centred = x - x.mean(1, keepdims=True)
    want = centred / (x.std(1, ddof=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(group_advantages(r).numpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(group_advantages(r, normalize_std=False).numpy(), centred,
                               rtol=1e-5, atol=1e-6)


def test_group_advantages_equal_groups_and_single_sample_are_exact_zero():
    r = torch.tensor([[0.1, 0.1, 0.1], [-0.3, -0.3, -0.3]])       # 0.1 has no exact float mean
    for norm in (True, False):
        assert (group_advantages(r, normalize_std=norm) == 0).all()
        assert (group_advantages(torch.tensor([[3.0], [-1.0]]), normalize_std=norm) == 0).all()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.sampled_from([-1.0, -0.1, 0.0, 0.1, 1.0, 10.0]), min_size=4,
                         max_size=4), min_size=1, max_size=5), st.booleans())
def test_group_advantages_never_nan_and_centred(rows, norm):
    adv = group_advantages(torch.tensor(rows), normalize_std=norm)
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv.sum(1), torch.zeros(len(rows)), atol=1e-4, rtol=0)


def test_group_advantages_bad_shape():
    with pytest.raises(ValueError, match="groups"):
        group_advantages(torch.zeros(4))


def test_episode_advantages_to_tokens_example():
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])
    got = episode_advantages_to_tokens(torch.tensor([2., -1.]), mask)
    assert got.tolist() == [[0., 2., 2.], [-1., 0., 0.]]


def test_grpo_loss_ratio_one_and_aggregation():
    z = torch.zeros(1, 2)
    loss, stats = grpo_loss(z, z, torch.tensor([[1., 3.]]), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-2.0) and "kl_loss" not in stats
    # seq-mean-token-mean weighs sequences equally; seq-mean-token-sum-norm (Dr.GRPO) sums their
    # tokens and divides by one constant, the longest response (here 3)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = episode_advantages_to_tokens(torch.tensor([1.0, -2.0]), mask)
    lp = torch.zeros(2, 3)
    assert grpo_loss(lp, lp, adv, mask)[0].item() == pytest.approx((-1 + 2) / 2)
    dr = grpo_loss(lp, lp, adv, mask, agg="seq-mean-token-sum-norm", norm_length=3)[0]
    assert dr.item() == pytest.approx((-3 + 2) / 2 / 3)


def test_grpo_loss_passes_the_dual_clip_through():
    logp, old = torch.log(torch.tensor([[4.0, 4.0]])), torch.zeros(1, 2)
    adv, mask = torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2)
    loss, stats = grpo_loss(logp, old, adv, mask)                  # max(4, 1.28) capped at c = 3
    assert loss.item() == pytest.approx((3.0 - 1.28) / 2)
    assert stats["clip_frac_lower"] == 0.5
    assert grpo_loss(logp, old, adv, mask, clip_c=None)[0].item() == pytest.approx((4 - 1.28) / 2)
    assert grpo_loss(logp, old, adv, mask, clip_c=2.0)[0].item() == pytest.approx((2 - 1.28) / 2)


def test_grpo_loss_kl_term():
    g = torch.Generator().manual_seed(1)
    logp, old, ref = (torch.randn(3, 5, generator=g) * 0.1 for _ in range(3))
    adv = torch.randn(3, 5, generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    base, _ = grpo_loss(logp, old, adv, mask)
    loss, stats = grpo_loss(logp, old, adv, mask, ref_logp=ref, kl_coef=0.5)
    kl = aggregate(kl_estimate(logp, ref, "k3"), mask, "seq-mean-token-mean")
    assert loss.item() == pytest.approx(base.item() + 0.5 * kl.item(), abs=1e-6)
    assert stats["kl_loss"].item() == pytest.approx(kl.item())
    assert stats["pg_loss"].item() == pytest.approx(base.item())
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, old, adv, mask, kl_coef=0.1)


def test_dr_grpo_group_gradient_exact_enumeration():
    """Softmax bandit, groups of K samples, Dr.GRPO advantage R_i - mean(R): enumerating all n^K
    groups, E[-grad loss] = (1 - 1/K) sum_a pi_a (R_a - Rbar)(e_a - pi) (the sample's own reward
    sits in its baseline)."""
    n, K = 3, 3
    g = torch.Generator().manual_seed(2)
    theta = torch.randn(n, generator=g, dtype=torch.float64)
    R = torch.tensor([0.0, 1.0, 0.25], dtype=torch.float64)
    pi = torch.softmax(theta, -1)
    rbar = (pi * R).sum()

    th = theta.clone().requires_grad_()
    expected_loss = 0.0
    for group in itertools.product(range(n), repeat=K):   # every group of K single-token episodes
        a = torch.tensor(group)
        prob = pi[a].prod()
        adv = group_advantages(R[a].view(1, K), normalize_std=False).view(K, 1)
        logp = token_logprobs(th.view(1, 1, n).expand(K, 1, n), a.view(K, 1))      # [K, 1]
        loss, _ = grpo_loss(logp, logp.detach(), adv, torch.ones(K, 1), agg="seq-mean-token-sum-norm",
                            norm_length=1)
        expected_loss = expected_loss + prob * loss
    (grad,) = torch.autograd.grad(-expected_loss, th)

    eye = torch.eye(n, dtype=torch.float64)
    analytic = sum(pi[a] * (R[a] - rbar) * (eye[a] - pi) for a in range(n))
    torch.testing.assert_close(grad, (1 - 1 / K) * analytic)


# --------------------------------------------------------------------------------------------- DAPO

@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 0.1, 1.0, -0.1]), min_size=2, max_size=2), min_size=1,
                max_size=8), st.integers(1, 6))
def test_has_spread_equals_a_plain_loop(groups, repeat):
    """A group is kept when its rewards are not all equal (verl's std > 0), as a loop over each
    group's values says, and as the filter's exact spread does (snr_filter.group_scores) -- not a
    float32 std, which eight times 0.1 leaves above 0."""
    r = torch.tensor([row * repeat for row in groups])                                  # [G, K]
    want = [len(set(row)) > 1 for row in groups]
    assert has_spread(r).tolist() == want == (snr_filter.group_scores(r) > 0).tolist()
    assert torch.tensor([0.1] * 8).std() > 0 and not has_spread(torch.tensor([[0.1] * 8]))
    with pytest.raises(ValueError, match="groups, samples"):
        has_spread(torch.zeros(4))


def test_the_overlong_penalty_is_verls_linear_ramp():
    """0 up to L - B tokens, -(n - (L - B)) / B x factor past it: -factor at the limit L."""
    for length in range(0, 65):
        want = min(-(length - 48) / 16, 0.0)
        assert overlong_penalty(length, 64, 16) == pytest.approx(want, abs=1e-12)
        assert overlong_penalty(length, 64, 16, factor=0.5) == pytest.approx(want / 2, abs=1e-12)
        assert overlong_penalty(length, 64, 0) == 0.0  # no buffer: off
    assert overlong_penalty(64, 64, 16) == -1.0 and overlong_penalty(48, 64, 16) == 0.0
