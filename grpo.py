"""GRPO: a critic-free, group-relative advantage for PPO's clipped loss (Shao et al. 2024), and the
variants built on it: Dr.GRPO and DAPO.

Each prompt (a seeded environment) is rolled out K times; episode i of group g gets

    A_gi = (R_gi - mean_g R) / (std_g R + eps)       (GRPO, unbiased std)
    A_gi =  R_gi - mean_g R                          (Dr.GRPO, Liu et al. 2025: no std division)

and every policy token of the episode shares A_gi. This file holds only these advantages: the loss
is ppo.policy_loss, the same as PPO's (dual clip, entropy bonus, optional KL penalty
kl_coef * KL(pi || ref); RAGEN-2's main table uses none, its analysis runs k3 at 0.001), with
`seq-mean-token-mean` aggregation for GRPO and `seq-mean-token-sum-norm` for Dr.GRPO (each
sequence's token sum divided by one constant, the longest response). Note the std division
cancels the sqrt(Var(R|x)) scale of a group's task gradient (RAGEN-2, Sec. 3.2): a low-spread
group is amplified to the size of a high-spread one.

DAPO (Yu et al. 2025) keeps GRPO's advantages and changes the rest: `token-mean` aggregation
(every token of the batch alike), clip-higher (0.2 below, 0.28 above), no KL term, and two pieces
here. Dynamic sampling (verl's filter_groups): a group whose rewards have no spread is dropped
(`has_spread`) and further groups are drawn until the batch is full, at most a set number of
draws (train.py's dynamic_sampling). The soft overlong penalty: a reply longer than L - B tokens,
L the token limit and B the buffer, loses (n - (L - B)) / B of reward, 1 at the limit
(`overlong_penalty`).
"""
import torch


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
    # BEGIN SOLUTION grpo
    flat = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)            # [G, 1] no spread
    centred = rewards - rewards.mean(dim=1, keepdim=True)                  # [G, K]
    if normalize_std and rewards.shape[1] > 1:
        centred = centred / (rewards.std(dim=1, keepdim=True) + eps)       # unbiased std
    return torch.where(flat, torch.zeros_like(centred), centred)
    # END SOLUTION grpo


def episode_advantages_to_tokens(adv, mask):
    """Broadcast one advantage per episode [B] onto its policy tokens [B, T]; other positions get 0.

    >>> episode_advantages_to_tokens(torch.tensor([2., -1.]), torch.tensor([[0, 1, 1], [1, 0, 0]]))
    tensor([[ 0.,  2.,  2.],
            [-1.,  0.,  0.]])
    """
    adv = adv[:, None].expand(mask.shape)                                  # [B, T]
    return torch.where(mask.bool(), adv, torch.zeros_like(adv))            # [B, T]


def has_spread(rewards):
    """[G, K] episode rewards -> [G] bool: the groups dynamic sampling keeps, those whose rewards
    are not all equal (verl's filter_groups also keeps a group of one rollout; flags refuse a
    group size of 1 for every group-relative algorithm).

    >>> has_spread(torch.tensor([[1., 0.], [0.1, 0.1], [0., 0.]]))
    tensor([ True, False, False])
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples]; got shape {tuple(rewards.shape)}")
    return (rewards != rewards[:, :1]).any(dim=1)                          # [G]


def overlong_penalty(length, max_length, buffer, factor=1.0):
    """DAPO's soft overlong penalty of one reply of `length` tokens under a limit of `max_length`:
    0 up to max_length - buffer tokens, then falling linearly to -factor at the limit; buffer 0
    switches it off.

    >>> [overlong_penalty(n, 64, 16) for n in (40, 48, 56, 64)]
    [0.0, 0.0, -0.5, -1.0]
    """
    if buffer <= 0:
        return 0.0
    return min(-(length - (max_length - buffer)) / buffer * factor, 0.0)
