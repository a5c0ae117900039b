"""GRPO: PPO's clipped loss with a critic-free, group-relative advantage (Shao et al. 2024).

Each prompt (a seeded environment) is rolled out K times; episode i of group g gets

    A_gi = (R_gi - mean_g R) / (std_g R + eps)       (GRPO, unbiased std)
    A_gi =  R_gi - mean_g R                          (Dr.GRPO, Liu et al. 2025: no std division)

and every policy token of the episode shares A_gi. The loss is ppo.clipped_policy_loss (dual clip
included) with `seq-mean-token-mean` aggregation (`seq-mean-token-sum` for Dr.GRPO), plus an
optional KL penalty kl_coef * KL(pi || ref) (RAGEN-2's main table uses none; its analysis runs use
k3 at 0.001). Note the std division cancels the sqrt(Var(R|x)) scale of a group's task gradient
(RAGEN-2, Sec. 3.2): a low-spread group is amplified to the size of a high-spread one.
"""
import torch

from ppo import aggregate, clipped_policy_loss, kl_estimate


def group_advantages(rewards, normalize_std=True, eps=1e-6):
    """[G, K] episode rewards -> [G, K] advantages. A group whose rewards are all equal (K = 1
    included) gets exactly 0, never NaN: it carries no signal about which episode was better.

    >>> group_advantages(torch.tensor([[1., 0., 0., 0.], [2., 2., 2., 2.]]))   # mean 1/4, std 1/2
    tensor([[ 1.5000, -0.5000, -0.5000, -0.5000],
            [ 0.0000,  0.0000,  0.0000,  0.0000]])
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples]; got shape {tuple(rewards.shape)}")
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    flat = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)            # [G, 1] no spread
    centred = rewards - rewards.mean(dim=1, keepdim=True)                  # [G, K]
    if normalize_std and rewards.shape[1] > 1:
        centred = centred / (rewards.std(dim=1, keepdim=True) + eps)       # unbiased std
    return torch.where(flat, torch.zeros_like(centred), centred)


def episode_advantages_to_tokens(adv, mask):
    """Broadcast one advantage per episode [B] onto its policy tokens [B, T]; other positions get 0.

    >>> episode_advantages_to_tokens(torch.tensor([2., -1.]), torch.tensor([[0, 1, 1], [1, 0, 0]]))
    tensor([[ 0.,  2.,  2.],
            [-1.,  0.,  0.]])
    """
    adv = adv[:, None].expand(mask.shape)                                  # [B, T]
    return torch.where(mask.bool(), adv, torch.zeros_like(adv))            # [B, T]


def grpo_loss(logp, old_logp, adv_tokens, mask, ref_logp=None, kl_coef=0.0, kl_kind="k3",
              clip_low=0.2, clip_high=0.28, agg="seq-mean-token-mean", clip_c=3.0):
    """Clipped policy loss + kl_coef * agg(KL estimate vs. the reference policy) -> (loss, stats).

    clip_c is the dual clip of ppo.clipped_policy_loss (None: off). stats: "clip_frac",
    "clip_frac_lower", "approx_kl" (from ppo.clipped_policy_loss), "pg_loss", and "kl" when a KL
    term is used.

    >>> z = torch.zeros(1, 2)
    >>> grpo_loss(z, z, torch.tensor([[1., 3.]]), torch.ones(1, 2))[0]   # r = 1: -mean(A)
    tensor(-2.)
    """
    pg_loss, stats = clipped_policy_loss(logp, old_logp, adv_tokens, mask, clip_low, clip_high, agg,
                                         clip_c=clip_c)
    stats["pg_loss"] = pg_loss.item()
    if kl_coef == 0.0:
        return pg_loss, stats
    if ref_logp is None:
        raise ValueError("kl_coef != 0 needs ref_logp (log-probs of the reference policy)")
    kl = aggregate(kl_estimate(logp, ref_logp, kl_kind), mask, agg)
    stats["kl"] = kl.item()
    return pg_loss + kl_coef * kl, stats
