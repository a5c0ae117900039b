"""Token-level PPO for multi-turn LLM agents: the pieces of the loss, in the order the math uses
them, and the one actor objective (policy_loss) that PPO, GRPO and Dr.GRPO all train on.

A transcript is one token sequence [T] holding system prompt, observations and the policy's
replies; `mask` marks the policy's own tokens (the actions). Only those tokens are trained, so every
reduction below is a masked one.

The clipped surrogate (Schulman et al. 2017) with asymmetric "clip-higher" bounds (DAPO) and the
dual clip for negative advantages (Ye et al. 2020), per policy token t:

    r_t = pi(a_t | s_t) / pi_old(a_t | s_t)
    l_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))
    l_t = min(l_t, -A_t c)                                              only where A_t < 0

A_t comes from GAE over the policy tokens only (observation and padding tokens are skipped as if
absent), with the episode's total reward on its last policy token (rollout.collate, as the
reference does) and gamma = lambda = 1, then whitened over the batch's policy tokens as verl does
(RAGEN-2's training set-up: clip 0.2 / 0.28, c = 3, entropy coefficient 0.001, value clip 0.5). The
critic is a copy of the policy's transformer body with a linear value head, trained with the
clipped value loss. Optional KL penalty against a reference policy uses the k1 / k2 / k3 estimators
(Schulman, "Approximating KL divergence", 2020).
"""
import copy
from dataclasses import dataclass

import torch
from torch import nn

KL_KINDS = ("k1", "k2", "k3")  # the KL estimators (kl_estimate)
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


# --------------------------------------------------------------------------------------- reductions

def masked_mean(x, mask, dim=None):
    """sum(x * mask) / sum(mask), over all elements or along `dim`; an empty mask gives 0, not NaN.

    >>> masked_mean(torch.tensor([1., 2., 3.]), torch.tensor([1, 1, 0]))   # (1 + 2) / 2
    tensor(1.5000)
    """
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1e-8)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1e-8)


def masked_whiten(x, mask, shift_mean=True):
    """(x - mean) / sqrt(var + 1e-8) with the mean and the *unbiased* variance (divide by n - 1)
    of the n mask-1 elements -- how verl whitens PPO advantages. shift_mean=False adds the mean
    back, so only the scale changes. Mask-0 positions give 0. With n < 2 the variance is taken as 0
    (verl raises instead), so a single element whitens to 0 (or to itself, unshifted).

    >>> masked_whiten(torch.tensor([1., 3., 99.]), torch.tensor([1, 1, 0]))   # mean 2, var 2
    tensor([-0.7071,  0.7071,  0.0000])
    >>> masked_whiten(torch.tensor([1., 3., 99.]), torch.tensor([1, 1, 0]), shift_mean=False)
    tensor([1.2929, 2.7071, 0.0000])
    """
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    on = mask.bool()
    n = on.sum()
    mean = torch.where(on, x, 0.0).sum() / n.clamp_min(1)
    var = torch.where(on, (x - mean) ** 2, 0.0).sum() / (n - 1).clamp_min(1)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return torch.where(on, out, torch.zeros_like(out))


def aggregate(loss, mask, mode, norm_length=None):
    """Reduce a per-token loss [B, T] to a scalar. With m the mask, S the sequences holding >= 1
    policy token and L = norm_length a constant:

        token-mean:              sum_{b,t} m l / sum_{b,t} m              (every token alike; PPO)
        seq-mean-token-mean:     1/|S| sum_{b in S} (sum_t m l / sum_t m) (every sequence; GRPO)
        seq-mean-token-sum:      1/|S| sum_{b in S} sum_t m l             (no length norm.)
        seq-mean-token-sum-norm: 1/|S| sum_{b in S} sum_t m l / L         (Dr.GRPO)

    Dr.GRPO (Liu et al. 2025) divides every sequence's token sum by one constant, the longest
    response the sampler allows, so a sequence's weight does not depend on its own length nor does
    the loss scale grow with it (verl's agg_loss: seq-mean-token-sum-norm; TRL: loss_type dr_grpo).

    >>> l = torch.tensor([[1., 2., 3.], [4., 0., 0.]]); m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    >>> [aggregate(l, m, k, norm_length=4).item() for k in AGG_MODES]   # 10/4, 6/2, 10/2, 10/2/4
    [2.5, 3.0, 5.0, 1.25]
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {AGG_MODES}")
    # BEGIN SOLUTION grpo
    if mode == "token-mean":
        return masked_mean(loss, mask)
    has_tokens = mask.sum(-1) > 0                                 # [B] rows with a policy token
    if mode == "seq-mean-token-mean":
        per_seq = masked_mean(loss, mask, dim=-1)                 # [B]
    else:
        per_seq = (loss * mask.to(loss.dtype)).sum(-1)            # [B]
    if mode == "seq-mean-token-sum-norm":
        if not (norm_length and norm_length > 0):
            raise ValueError(f"{mode} needs norm_length > 0 (the longest response); got "
                             f"{norm_length!r}")
        per_seq = per_seq / norm_length                           # [B]
    return masked_mean(per_seq, has_tokens)
    # END SOLUTION grpo


# ------------------------------------------------------------------------------------ the KL term

def kl_estimate(logp, ref_logp, kind):
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi, delta = logp - ref_logp:

        k1 = delta                        unbiased, can be negative
        k2 = delta^2 / 2                  biased, low variance
        k3 = exp(-delta) + delta - 1      unbiased (E_pi[exp(-delta)] = 1) and always >= 0

    k3 is computed as expm1(-delta) + delta, which keeps its tiny values for delta -> 0 accurate.
    Safety clamps, k3 only: delta is clamped to [-20, 20] before exp (no overflow), and the result
    to [0, 10] (the upper bound as verl does, so one wild token cannot dominate); values for
    -2.5 < delta < 11 are left exact.

    >>> d = torch.tensor(0.6931472)
    >>> [round(kl_estimate(d, torch.tensor(0.), k).item(), 4) for k in KL_KINDS]
    [0.6931, 0.2402, 0.1931]
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {KL_KINDS}")
    delta = logp - ref_logp                                                # [B, T]
    if kind == "k1":
        return delta
    if kind == "k2":
        return 0.5 * delta ** 2
    delta = delta.clamp(-20.0, 20.0)
    return (torch.expm1(-delta) + delta).clamp(0.0, 10.0)


# ---------------------------------------------------------------------------------------- the actor

@dataclass(frozen=True)
class Coefficients:
    """The actor objective's settings, with the reference's defaults (clip 0.2 / 0.28, the dual
    clip c = 3, as verl names them): how its per-token terms aggregate (`agg`, and Dr.GRPO's
    constant `norm_length`: aggregate), the clip's bounds and the dual clip `clip_c` (None: off),
    the entropy bonus's coefficient, and the KL term's coefficient and estimator (kl_estimate)."""
    agg: str = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float = 3.0
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    norm_length: int = None


def clipped_policy_loss(logp, old_logp, adv, mask, coef=Coefficients()):
    """PPO's clipped surrogate with the dual clip, aggregated by coef.agg (aggregate) -> (loss,
    stats):

        l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high));   l = min(l, -A c) where A < 0.

    The dual clip caps the loss of a negative-advantage token whose ratio has grown past c (> 1), so
    one stale token cannot dominate the update; clip_c=None switches it off.

    stats are Python floats over the policy tokens (token-mean, whatever `agg`), named as verl's:
      clip_frac        fraction of tokens where the clip branch is larger (verl's pg_clipfrac);
      clip_frac_lower  fraction where the dual-clip cap binds (A < 0 and l > -A c; verl's
                       pg_clipfrac_lower; 0.0 with clip_c=None). The gradient is exactly 0 on both.
      approx_kl        k3 estimate of KL(pi_old || pi) = mean(r - 1 - log r), tokens from pi_old
                       (verl reports the k1 estimate mean(-log r) of the same KL).
    log r is clamped to [-20, 20] before exp so a stale token cannot overflow.

    >>> z = torch.zeros(1, 3); adv = torch.tensor([[1., -1., 2.]]); m = torch.ones(1, 3)
    >>> clipped_policy_loss(z, z, adv, m)[0]   # r = 1: loss = -mean(A) = -2/3
    tensor(-0.6667)
    >>> r4 = torch.log(torch.tensor([[4.]])); a = torch.tensor([[-1.]])
    >>> clipped_policy_loss(r4, torch.zeros(1, 1), a, torch.ones(1, 1))[0]   # min(max(4, 0.8), 3)
    tensor(3.)
    """
    clip_low, clip_high, clip_c = coef.clip_low, coef.clip_high, coef.clip_c
    if clip_c is not None and not clip_c > 1.0:
        raise ValueError(f"the dual clip c must be > 1 (or None); got {clip_c!r}")
    # BEGIN SOLUTION clip_loss
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)                       # [B, T]
    ratio = torch.exp(log_ratio)                                           # [B, T]
    unclipped = -adv * ratio                                               # [B, T]
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)          # [B, T]
    per_token = torch.maximum(unclipped, clipped)                          # [B, T]
    capped = torch.zeros_like(per_token, dtype=torch.bool)                 # [B, T]
    if clip_c is not None:
        cap = -adv * clip_c                                                # [B, T]
        capped = (adv < 0) & (per_token > cap)
        per_token = torch.where(capped, cap, per_token)
    # END SOLUTION clip_loss
    loss = aggregate(per_token, mask, coef.agg, coef.norm_length)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((clipped > unclipped).float(), mask).item(),
            "clip_frac_lower": masked_mean(capped.float(), mask).item(),
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask).item(),
        }
    return loss, stats


def policy_loss(logp, old_logp, advantages, mask, coef=Coefficients(), entropy=None,
                ref_logp=None):
    """The actor's objective, the one PPO, GRPO and Dr.GRPO train on (they differ only in their
    advantages and coef.agg) -> (loss, terms):

        loss = agg(clipped surrogate) - entropy_coef * agg(entropy) + kl_coef * agg(KL estimate)

    logp, old_logp, advantages, mask, entropy, ref_logp: [B, T] per policy token. Every term is
    aggregated the same way (coef.agg, coef.norm_length: aggregate). The entropy bonus needs
    `entropy` (the policy's token entropy, with its gradient); the KL term, when kl_coef != 0,
    needs `ref_logp`, the reference policy's log-probs (kl_estimate of kind coef.kl_kind).

    terms: "pg_loss", and "entropy_loss" (the aggregated entropy) with `entropy` given, and
    "kl_loss" with kl_coef != 0: 0-d tensors still in the graph, so that
    snr_filter.gradient_decomposition can differentiate each alone; and the clip statistics
    "clip_frac", "clip_frac_lower", "approx_kl" (floats, from clipped_policy_loss).

    >>> z = torch.zeros(1, 2); m = torch.ones(1, 2); h = torch.tensor([[1., 3.]])
    >>> policy_loss(z, z, torch.tensor([[1., 3.]]), m, Coefficients(entropy_coef=0.5), h)[0]
    tensor(-3.)
    """
    pg_loss, terms = clipped_policy_loss(logp, old_logp, advantages, mask, coef)
    terms["pg_loss"], loss = pg_loss, pg_loss
    if entropy is not None:
        terms["entropy_loss"] = aggregate(entropy, mask, coef.agg, coef.norm_length)
        loss = loss - coef.entropy_coef * terms["entropy_loss"]
    if coef.kl_coef != 0.0:
        if ref_logp is None:
            raise ValueError("kl_coef != 0 needs ref_logp (log-probs of the reference policy)")
        kl = kl_estimate(logp, ref_logp, coef.kl_kind)                         # [B, T]
        terms["kl_loss"] = aggregate(kl, mask, coef.agg, coef.norm_length)
        loss = loss + coef.kl_coef * terms["kl_loss"]
    return loss, terms


# --------------------------------------------------------------------------------------- advantages

def gae(rewards, values, mask, gamma=1.0, lam=1.0, whiten=True):
    """Generalised advantage estimation over the policy tokens of [B, T] transcripts
    -> (advantages, returns).

    Policy tokens (mask 1) are the steps; the others are skipped as if absent, so for consecutive
    policy tokens t < t' (t' the next one, V(t') = 0 after the last: the episode ends)

        delta_t = r_t + gamma V(t') - V(t),  A_t = delta_t + gamma lam A_t',  returns_t = A_t + V(t)

    whiten=True (verl's PPO) then whitens the advantages over all policy tokens of the batch with
    masked_whiten (mean 0, unbiased variance 1); the returns, the critic's targets, stay raw.
    Outputs are 0 at mask-0 positions. A reward on a mask-0 position would be lost: ValueError.

    >>> r = torch.tensor([[0., 0., 1.]]); v = torch.tensor([[0.2, 9., 0.6]])
    >>> m = torch.tensor([[1, 0, 1]])
    >>> gae(r, v, m, whiten=False)   # gamma = lam = 1: A = return-to-go - V
    (tensor([[0.8000, 0.0000, 0.4000]]), tensor([[1., 0., 1.]]))
    >>> gae(r, v, m)[0]              # (A - 0.6) / sqrt(0.08)
    tensor([[ 0.7071,  0.0000, -0.7071]])
    """
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError(f"rewards, values and mask must all be [B, T]; got "
                         f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}")
    on = mask.bool()                                                       # [B, T]
    if (rewards[~on] != 0).any():
        raise ValueError("non-zero reward on a mask-0 position; put each reward on a policy token")
    dtype = torch.promote_types(values.dtype, torch.float32)
    values, rewards = values.detach().to(dtype), rewards.to(dtype)    # no gradient to the critic
    # BEGIN SOLUTION gae
    B, T = rewards.shape
    advantages = torch.zeros_like(values)                                  # [B, T]
    next_value = torch.zeros_like(values[:, 0])                            # [B] V at next step
    next_adv = torch.zeros_like(values[:, 0])                              # [B] A at next step
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]          # [B]
        adv_t = delta + gamma * lam * next_adv                             # [B]
        # a skipped position carries the running quantities over unchanged
        next_adv = torch.where(on[:, t], adv_t, next_adv)
        next_value = torch.where(on[:, t], values[:, t], next_value)
        advantages[:, t] = torch.where(on[:, t], adv_t, torch.zeros_like(adv_t))
    returns = (advantages + values) * on                                   # [B, T]
    # END SOLUTION gae
    if whiten:
        advantages = masked_whiten(advantages, on)                         # [B, T]
    return advantages, returns


# --------------------------------------------------------------------------------------- the critic

def value_loss(values, old_values, returns, mask, clip=0.5):
    """Clipped value loss: 0.5 * token-mean of max((V - R)^2, (V_clip - R)^2) with
    V_clip = V_old + clip(V - V_old, -clip, clip) (verl's default clip: 0.5). The clip keeps the
    critic close to the values the advantages were computed from.

    >>> one = torch.ones(1, 1)
    >>> value_loss(2.0 * one, one, 3.0 * one, one)   # V_clip = 1.5: 0.5 * (3 - 1.5)^2
    tensor(1.1250)
    """
    clipped = old_values + (values - old_values).clamp(-clip, clip)        # [B, T]
    err = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2) # [B, T]
    return 0.5 * masked_mean(err, mask)


class Critic(nn.Module):
    """V(prefix): a causal transformer body + a linear head, one value per position.

    As in the paper's PPO the critic is a separate model initialised from the policy's checkpoint
    (its transformer body, deep-copied, so the two never share weights); the head is float32 (values
    need more precision than a bf16 body gives) and starts at zero, so the first values are 0.
    """

    def __init__(self, body, hidden_size):
        super().__init__()
        self.body = body
        # A body without weights of its own (LoRA's adapter view) puts the head on the CPU.
        device = next(body.parameters(), torch.empty(0)).device
        self.head = nn.Linear(hidden_size, 1, device=device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask):
        out = self.body(input_ids=input_ids, attention_mask=attention_mask)
        hidden = out.last_hidden_state                                     # [B, T, H]
        return self.head(hidden.float()).squeeze(-1)                       # [B, T]


def explained_variance(values, returns, mask):
    """1 - Var(returns - values) / Var(returns) over the mask-1 positions: 1 when the critic
    predicts every return, 0 when it predicts no better than their mean, below 0 when worse --
    the first number to read when PPO misbehaves (cleanrl and verl log it). nan for returns
    without spread.

    >>> mask = torch.tensor([1, 1, 0])          # residuals 0, 1: variance 1/4; returns 1, 3: 1
    >>> explained_variance(torch.tensor([1., 2., 0.]), torch.tensor([1., 3., 5.]), mask)
    tensor(0.7500)
    """
    on = mask.bool()
    residual, target = (returns - values)[on].float(), returns[on].float()
    return 1 - residual.var(correction=0) / target.var(correction=0)


def make_critic(policy_model):
    """A Critic from a Hugging Face causal LM: a deep copy of `policy_model.get_decoder()` (e.g.
    Qwen2Model) + a zero-initialised head."""
    body = copy.deepcopy(policy_model.get_decoder())
    return Critic(body, policy_model.config.get_text_config().hidden_size)


def critic_values(critic, input_ids, attention_mask):
    """Values [B, T]; values[:, t] scores the prefix ids[:, :t+1], i.e. the state before token t+1
    is produced -- the same alignment as logits, so pair values[:, :-1] with
    logprobs.token_logprobs(logits[:, :-1], ids[:, 1:])."""
    return critic(input_ids, attention_mask)
