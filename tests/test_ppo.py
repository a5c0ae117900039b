"""ppo.py against closed forms, plain reference loops and exact expectations."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import ppo
from conftest import tiny_qwen2
from logprobs import token_logprobs
from ppo import (Coefficients, aggregate, clipped_policy_loss, gae, kl_estimate, masked_mean,
                 masked_whiten, policy_loss, value_loss)


# --------------------------------------------------------------------------------------- reductions

def test_masked_mean_example_dim_and_empty():
    assert masked_mean(torch.tensor([1., 2., 3.]), torch.tensor([1, 1, 0])).item() == 1.5
    x = torch.tensor([[1., 2., 3.], [4., 5., 6.]])
    m = torch.tensor([[1, 0, 1], [0, 0, 0]])
    assert masked_mean(x, m, dim=-1).tolist() == [2.0, 0.0]   # empty row -> 0, not NaN
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0


def test_masked_whiten_uses_the_unbiased_variance():
    # [1, 3]: mean 2, unbiased variance ((-1)^2 + 1^2) / (2 - 1) = 2 (the biased one would be 1)
    x, m = torch.tensor([1., 3., 99.]), torch.tensor([1, 1, 0])
    torch.testing.assert_close(masked_whiten(x, m), torch.tensor([-1., 1., 0.]) / math.sqrt(2.0))
    torch.testing.assert_close(masked_whiten(x, m, shift_mean=False),
                               torch.tensor([2. - 1 / math.sqrt(2), 2. + 1 / math.sqrt(2), 0.]))
    # against a plain float64 formula on random data: masked values never matter
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 9, generator=g, dtype=torch.float64) * 3 + 1
    m = torch.rand(4, 9, generator=g) > 0.4
    on = x[m]
    want = (x - on.mean()) / torch.sqrt(on.var(correction=1) + 1e-8)
    got = masked_whiten(x, m)
    torch.testing.assert_close(got[m], want[m])
    assert (got[~m] == 0).all()
    junk = torch.where(m, x, torch.full_like(x, 1e6))
    torch.testing.assert_close(masked_whiten(junk, m), got)
    assert got[m].mean().abs() < 1e-12 and got[m].var(correction=1) == pytest.approx(1.0, rel=1e-6)


def test_masked_whiten_single_and_empty_mask_are_finite():
    x = torch.tensor([5., 7.])
    assert masked_whiten(x, torch.tensor([1, 0])).tolist() == [0.0, 0.0]
    assert masked_whiten(x, torch.tensor([1, 0]), shift_mean=False).tolist() == [5.0, 0.0]
    assert masked_whiten(x, torch.tensor([0, 0])).tolist() == [0.0, 0.0]


def test_aggregate_hand_computed():
    loss = torch.tensor([[1., 2., 3.], [4., 0., 0.]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((6 / 3 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    # Dr.GRPO: every sequence's sum over one constant, the longest response (here 8)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", 8).item() == pytest.approx((6 + 4) / 2 / 8)


def test_dr_grpo_normaliser_is_a_constant_not_the_batch_length():
    """A longer response elsewhere in the batch (or more padding) changes neither a sequence's weight
    nor the scale: the loss is the token sums over a fixed budget, whatever the batch holds."""
    loss, mask = torch.tensor([[1., 2., 0., 0.]]), torch.tensor([[1, 1, 0, 0]])
    wider = torch.cat([loss, torch.zeros(1, 4)], 1), torch.cat([mask, torch.zeros(1, 4)], 1)
    one = aggregate(loss, mask, "seq-mean-token-sum-norm", norm_length=10)
    assert one.item() == pytest.approx(3 / 10)
    assert aggregate(*wider, "seq-mean-token-sum-norm", norm_length=10).item() == pytest.approx(3 / 10)
    with pytest.raises(ValueError, match="norm_length"):
        aggregate(loss, mask, "seq-mean-token-sum-norm")


def test_aggregate_ignores_masked_values_and_empty_rows():
    loss = torch.tensor([[1., 99., 3.], [-7., -7., -7.]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]])
    for mode, want in [("token-mean", 2.0), ("seq-mean-token-mean", 2.0),
                       ("seq-mean-token-sum", 4.0)]:
        assert aggregate(loss, mask, mode).item() == pytest.approx(want)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", 2).item() == pytest.approx(2.0)


def test_aggregate_bad_mode():
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "mean")


def test_policy_loss_is_the_clipped_loss_minus_the_entropy_bonus_plus_the_kl_term():
    """One loss for PPO, GRPO and Dr.GRPO: every term aggregated the same way, each term returned
    in the graph so that one can be differentiated alone."""
    g = torch.Generator().manual_seed(0)
    logp, old, ref, adv, entropy = (torch.randn(3, 5, generator=g) for _ in range(5))
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    logp.requires_grad_(True)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        kw = dict(norm_length=7) if agg.endswith("norm") else {}
        coef = Coefficients(agg=agg, entropy_coef=0.1, kl_coef=0.5, kl_kind="k2", **kw)
        loss, terms = policy_loss(logp, old, adv, mask, coef, entropy=entropy, ref_logp=ref)
        pg, stats = clipped_policy_loss(logp, old, adv, mask, Coefficients(agg=agg, **kw))
        want = (pg - 0.1 * aggregate(entropy, mask, agg, **kw)
                + 0.5 * aggregate(kl_estimate(logp, ref, "k2"), mask, agg, **kw))
        assert loss.item() == pytest.approx(want.item(), rel=1e-6)
        assert terms["pg_loss"].item() == pytest.approx(pg.item())
        assert terms["clip_frac"] == stats["clip_frac"] and terms["kl_loss"].requires_grad
    alone, terms = policy_loss(logp, old, adv, mask)
    assert set(terms) == {"pg_loss", "clip_frac", "clip_frac_lower", "approx_kl"}
    assert alone.item() == pytest.approx(clipped_policy_loss(logp, old, adv, mask)[0].item())
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, old, adv, mask, Coefficients(kl_coef=0.1))


# ------------------------------------------------------------------------------------ KL estimators

def test_kl_estimate_example():
    d = torch.tensor(math.log(2.0))
    got = [kl_estimate(d, torch.tensor(0.0), k).item() for k in ppo.KL_KINDS]
    want = [math.log(2), math.log(2) ** 2 / 2, 0.5 + math.log(2) - 1]
    assert got == pytest.approx(want, abs=1e-6)


@settings(max_examples=200, deadline=None)
@given(st.floats(-30, 30), st.floats(-30, 30))
def test_k3_nonnegative_zero_iff_equal(a, b):
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    k3 = kl_estimate(a, b, "k3").item()
    assert math.isfinite(k3) and k3 >= 0.0
    if a == b:
        assert k3 == 0.0
    elif abs(a - b) > 1e-6:                          # below ~1e-8, d^2 / 2 is lost in rounding d
        assert k3 > 0.0


def test_k3_is_clamped_for_wild_tokens():
    k3 = kl_estimate(torch.tensor([-1000.0, 1000.0]), torch.zeros(2), "k3")
    assert torch.isfinite(k3).all() and k3.max().item() <= 10.0


def test_kl_estimate_bad_kind():
    with pytest.raises(ValueError, match="k3"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_kl_estimators_unbiased_under_pi(kind):
    g = torch.Generator().manual_seed(2)
    logp = torch.log_softmax(torch.randn(5, generator=g, dtype=torch.float64), -1)
    ref_logp = torch.log_softmax(torch.randn(5, generator=g, dtype=torch.float64), -1)
    exact = (logp.exp() * (logp - ref_logp)).sum().item()           # KL(pi || ref)
    x = torch.multinomial(logp.exp(), 40_000, replacement=True, generator=g)
    k = kl_estimate(logp[x], ref_logp[x], kind)
    se = k.std().item() / math.sqrt(len(k))
    assert abs(k.mean().item() - exact) < 4 * se, (k.mean().item(), exact, se)


# ---------------------------------------------------------------------------------------- the actor

def test_ratio_one_gives_minus_mean_advantage():
    z = torch.zeros(1, 3)
    loss, stats = clipped_policy_loss(z, z, torch.tensor([[1., -1., 2.]]), torch.ones(1, 3))
    assert loss.item() == pytest.approx(-2 / 3)
    assert stats == {"clip_frac": 0.0, "clip_frac_lower": 0.0, "approx_kl": 0.0}
    g = torch.Generator().manual_seed(3)
    logp = torch.randn(4, 6, generator=g)
    adv = torch.randn(4, 6, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    loss, _ = clipped_policy_loss(logp, logp.clone(), adv, mask)
    assert loss.item() == pytest.approx(masked_mean(-adv, mask).item(), abs=1e-6)


def test_clip_higher_example():
    # r = 1.5 with A = 1 is clipped at 1 + 0.28; r = 0.5 with A = -1 at 1 - 0.2
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    loss, stats = clipped_policy_loss(logp, torch.zeros(1, 2), torch.tensor([[1., -1.]]),
                                      torch.ones(1, 2))
    assert loss.item() == pytest.approx((-1.28 + 0.8) / 2)
    for t, want in enumerate([-1.28, 0.8]):                        # each token on its own
        alone = clipped_policy_loss(logp, torch.zeros(1, 2), torch.tensor([[1., -1.]]),
                                    torch.eye(2)[t:t + 1])[0]
        assert alone.item() == pytest.approx(want)
    assert stats["clip_frac"] == 1.0 and stats["clip_frac_lower"] == 0.0
    want_kl = ((0.5 - math.log(1.5)) + (-0.5 - math.log(0.5))) / 2
    assert stats["approx_kl"] == pytest.approx(want_kl, abs=1e-6)


def test_dual_clip_caps_only_negative_advantages_past_c():
    """Per token: l = max(-A r, -A clip(r, 0.8, 1.28)), then min(l, -A c) where A < 0 (c = 3)."""
    r = torch.tensor([[4.0, 2.0, 4.0, 4.0, 0.5]])
    adv = torch.tensor([[-1.0, -1.0, 1.0, -2.0, -1.0]])
    # A = -1, r = 4: max(4, 1.28) = 4 capped at 3; r = 2 < c: 2; A = +1, r = 4: clipped at -1.28;
    # A = -2, r = 4: max(8, 2.56) = 8 capped at 6; A = -1, r = 0.5: max(0.5, 0.8) = 0.8
    want = [3.0, 2.0, -1.28, 6.0, 0.8]
    logp = torch.log(r).requires_grad_()
    old = torch.zeros_like(logp)
    per_token = []
    for t in range(5):
        m = torch.zeros(1, 5)
        m[0, t] = 1
        per_token.append(clipped_policy_loss(logp, old, adv, m)[0].item())
    assert per_token == pytest.approx(want, abs=1e-6)
    loss, stats = clipped_policy_loss(logp, old, adv, torch.ones(1, 5))
    assert stats["clip_frac_lower"] == pytest.approx(2 / 5)       # tokens 0 and 3
    assert stats["clip_frac"] == pytest.approx(2 / 5)             # tokens 2 and 4
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0].tolist() == pytest.approx([0.0, 2.0 / 5, 0.0, 0.0, 0.0])   # d(-A r)/dlog r
    # without the dual clip the two capped tokens cost -A r
    off, off_stats = clipped_policy_loss(logp, old, adv, torch.ones(1, 5), Coefficients(clip_c=None))
    assert off.item() == pytest.approx((4 + 2 - 1.28 + 8 + 0.8) / 5)
    assert off_stats["clip_frac_lower"] == 0.0
    with pytest.raises(ValueError, match="dual clip"):
        clipped_policy_loss(logp, old, adv, torch.ones(1, 5), Coefficients(clip_c=1.0))


def test_clipped_gradient_zero_exactly_where_clipped():
    g = torch.Generator().manual_seed(5)
    old = torch.randn(5, 8, generator=g, dtype=torch.float64)
    logp = (old + torch.randn(5, 8, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(5, 8, generator=g, dtype=torch.float64)
    mask = (torch.rand(5, 8, generator=g) > 0.25).double()
    loss, stats = clipped_policy_loss(logp, old, adv, mask, Coefficients(clip_low=0.2, clip_high=0.28))
    (grad,) = torch.autograd.grad(loss, logp)

    r = torch.exp(logp.detach() - old)
    capped = (adv < 0) & (r > 3.0)                                  # dual clip
    clipped = ((adv > 0) & (r > 1.28)) | ((adv < 0) & (r < 0.8))
    on = mask.bool()
    assert (capped & on).any() and (clipped & on).any() and (~(clipped | capped) & on).any()
    logp2 = logp.detach().clone().requires_grad_()
    unclipped_loss = masked_mean(-adv * torch.exp(logp2 - old), mask)
    (want,) = torch.autograd.grad(unclipped_loss, logp2)
    flat = clipped | capped
    assert (grad[flat] == 0).all()
    torch.testing.assert_close(grad[~flat], want[~flat])
    assert (grad[~on] == 0).all()
    assert stats["clip_frac"] == pytest.approx((clipped & on).sum().item() / on.sum().item())
    assert stats["clip_frac_lower"] == pytest.approx((capped & on).sum().item() / on.sum().item())


# ---------------------------------------------------------------------------------------------- GAE

def reference_gae(rewards, values, mask, gamma, lam):
    """Plain per-sequence loop: drop the masked positions, run textbook GAE, scatter back."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t]]
        a = 0.0
        for k in reversed(range(len(idx))):
            next_v = values[b, idx[k + 1]].item() if k + 1 < len(idx) else 0.0
            delta = rewards[b, idx[k]].item() + gamma * next_v - values[b, idx[k]].item()
            a = delta + gamma * lam * a
            adv[b, idx[k]] = a
    return adv


def random_episode(seed, B=4, T=12, p_on=0.6):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) < p_on).long()
    rewards = torch.randn(B, T, generator=g) * mask
    values = torch.randn(B, T, generator=g)
    return rewards, values, mask


def test_gae_example():
    r, v = torch.tensor([[0., 0., 1.]]), torch.tensor([[0.2, 9., 0.6]])
    m = torch.tensor([[1, 0, 1]])
    adv, ret = gae(r, v, m, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.8, 0.0, 0.4]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 0.0, 1.0]]))
    # whitened over the two policy tokens: mean 0.6, unbiased variance 0.08; returns stay raw
    white, ret_w = gae(r, v, m)
    torch.testing.assert_close(white, torch.tensor([[0.2, 0.0, -0.2]]) / math.sqrt(0.08 + 1e-8))
    torch.testing.assert_close(ret_w, ret)


@pytest.mark.parametrize("seed", range(3))
def test_gae_whitens_over_all_policy_tokens_of_the_batch(seed):
    rewards, values, mask = random_episode(seed)
    raw, ret = gae(rewards, values, mask, 0.9, 0.8, whiten=False)
    white, ret_w = gae(rewards, values, mask, 0.9, 0.8)
    on = mask.bool()
    a = raw[on].double()
    want = (a - a.mean()) / torch.sqrt(a.var(correction=1) + 1e-8)   # one batch-wide mean, scale
    torch.testing.assert_close(white[on].double(), want, atol=1e-5, rtol=1e-5)
    assert (white[~on] == 0).all()
    torch.testing.assert_close(ret_w, ret)


@pytest.mark.parametrize("seed", range(5))
def test_gae_lambda_one_is_return_to_go_minus_value(seed):
    rewards, values, mask = random_episode(seed)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    to_go = rewards.flip(-1).cumsum(-1).flip(-1)                    # sum of rewards at t' >= t
    torch.testing.assert_close(adv, (to_go - values) * mask)
    torch.testing.assert_close(ret, to_go * mask)


@pytest.mark.parametrize("seed", range(5))
def test_gae_lambda_zero_is_one_step_td(seed):
    rewards, values, mask = random_episode(seed)
    gamma = 0.9
    adv, _ = gae(rewards, values, mask, gamma=gamma, lam=0.0, whiten=False)
    B, T = mask.shape
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                assert adv[b, t] == 0
                continue
            later = [u for u in range(t + 1, T) if mask[b, u]]
            next_v = values[b, later[0]] if later else 0.0
            td = (rewards[b, t] + gamma * next_v - values[b, t]).item()
            assert adv[b, t].item() == pytest.approx(td, abs=1e-5)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.floats(0.05, 0.95))
def test_gae_equals_reference_loop(seed, gamma, lam, p_on):
    rewards, values, mask = random_episode(seed, p_on=p_on)
    adv, ret = gae(rewards, values, mask, gamma, lam, whiten=False)
    want = reference_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, (adv + values) * mask)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.lists(st.integers(0, 12), min_size=1, max_size=6))
def test_gae_inserting_masked_positions_changes_nothing(seed, where):
    rewards, values, mask = random_episode(seed, B=3, T=12)
    adv, ret = gae(rewards, values, mask, 0.95, 0.9)
    r2, v2, m2, keep = rewards, values, mask, torch.arange(12)
    for w in sorted(where, reverse=True):                    # insert an observation token before w
        junk_v = torch.full((3, 1), 123.0)
        r2 = torch.cat([r2[:, :w], torch.zeros(3, 1), r2[:, w:]], 1)
        v2 = torch.cat([v2[:, :w], junk_v, v2[:, w:]], 1)
        m2 = torch.cat([m2[:, :w], torch.zeros(3, 1, dtype=m2.dtype), m2[:, w:]], 1)
        keep = torch.where(keep >= w, keep + 1, keep)
    adv2, ret2 = gae(r2, v2, m2, 0.95, 0.9)
    torch.testing.assert_close(adv2[:, keep], adv)
    torch.testing.assert_close(ret2[:, keep], ret)
    assert (adv2[m2 == 0] == 0).all()


def test_gae_reward_on_masked_position_raises():
    with pytest.raises(ValueError, match="mask-0"):
        gae(torch.tensor([[1.0, 0.0]]), torch.zeros(1, 2), torch.tensor([[0, 1]]))


# --------------------------------------------------------------------------------------- the critic

def test_value_loss_example_and_unclipped_case():
    one = torch.ones(1, 1)
    assert value_loss(2.0 * one, one, 3.0 * one, one).item() == pytest.approx(0.5 * 1.5 ** 2)
    assert value_loss(1.5 * one, one, 2.0 * one, one, clip=0.2).item() == pytest.approx(0.32)
    v, old = torch.tensor([[1.1, 0.5]]), torch.tensor([[1.0, 0.6]])
    ret = torch.tensor([[2.0, 0.0]])
    want = 0.5 * ((v - ret) ** 2).mean()                           # inside the clip: plain half-MSE
    assert value_loss(v, old, ret, torch.ones(1, 2)).item() == pytest.approx(want.item())


def test_critic_separate_causal_and_trainable():
    policy = tiny_qwen2(32, layers=1)
    critic = ppo.make_critic(policy)
    policy_ptrs = {p.data_ptr() for p in policy.parameters()}
    assert not any(p.data_ptr() in policy_ptrs for p in critic.parameters())   # own weights
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    am = torch.ones(2, 6, dtype=torch.long)
    v = ppo.critic_values(critic, ids, am)
    assert v.shape == (2, 6) and (v == 0).all()                     # zero-initialised head

    opt = torch.optim.Adam(critic.parameters(), lr=1e-2)
    for _ in range(20):                                             # fit returns of 1 (loss 0.5)
        v = ppo.critic_values(critic, ids, am)
        loss = value_loss(v, torch.zeros(2, 6), torch.ones(2, 6), am, clip=10.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    v = ppo.critic_values(critic, ids, am)
    assert ((v - 1) ** 2).mean().item() < 0.05

    later = ids.clone()
    later[:, 4:] = (later[:, 4:] + 1) % 32                      # values before t=4 cannot see it
    v2 = ppo.critic_values(critic, later, am)
    torch.testing.assert_close(v2[:, :4], v[:, :4])
    assert not torch.allclose(v2[:, 4:], v[:, 4:])
    padded = ppo.critic_values(critic, torch.cat([ids, torch.zeros(2, 2, dtype=ids.dtype)], 1),
                               torch.cat([am, torch.zeros(2, 2, dtype=am.dtype)], 1))
    torch.testing.assert_close(padded[:, :6], v, atol=1e-5, rtol=1e-5)   # right padding: same


# ---------------------------------------------------------------- exact policy gradient on a bandit

def test_softmax_bandit_gradient_exact_enumeration():
    """E_a[-grad loss_a] with A = R_a - E[R] equals sum_a pi_a (R_a - Rbar)(e_a - pi), which is
    grad E_pi[R]."""
    g = torch.Generator().manual_seed(5)
    theta = torch.randn(4, generator=g, dtype=torch.float64)
    R = torch.tensor([0.1, 1.0, -0.5, 0.3], dtype=torch.float64)
    pi = torch.softmax(theta, -1)
    rbar = (pi * R).sum()

    grad = torch.zeros(4, dtype=torch.float64)
    for a in range(4):                                     # one single-token episode per arm
        th = theta.clone().requires_grad_()
        logp = token_logprobs(th.view(1, 1, 4), torch.tensor([[a]]))
        loss, _ = clipped_policy_loss(logp, logp.detach(), (R[a] - rbar).view(1, 1),
                                      torch.ones(1, 1), Coefficients(agg="seq-mean-token-mean"))
        (d,) = torch.autograd.grad(loss, th)
        grad += pi[a] * -d

    eye = torch.eye(4, dtype=torch.float64)
    analytic = sum(pi[a] * (R[a] - rbar) * (eye[a] - pi) for a in range(4))
    th = theta.clone().requires_grad_()
    (true,) = torch.autograd.grad((torch.softmax(th, -1) * R).sum(), th)
    torch.testing.assert_close(grad, analytic)
    torch.testing.assert_close(grad, true)
