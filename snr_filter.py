"""SNR-aware filtering: reward spread bounds the task gradient, so update only on the prompt groups
that have it.

The mechanism (RAGEN-2, Sec. 3.1-3.2, Fig. 4). For a prompt x, a sampled reasoning-and-answer z
with total reward R and the baseline b = E[R | x], the task gradient is

    g_task(x) = E_z[(R - b) grad log pi(z|x)]
    ||g_task(x)|| <= sqrt(Var(R|x)) * sqrt(E_z ||grad log pi(z|x)||^2)            (Cauchy-Schwarz)

so a prompt whose rollouts all earn the same reward gives no task signal, while the KL and entropy
terms of the loss push with a force that does not depend on rewards at all. On low-spread prompts
the regulariser drives the update (low signal-to-noise ratio) towards input-agnostic templates.

The remedy (Sec. 3.3, Fig. 5). Score each prompt group by the spread of its K rollouts' total
rewards (format penalties included) and update only on the best groups; dropped groups never reach
the advantage computation. Zero-spread groups are set aside first (unless include_zero), then:

    Top-P linear:  rank groups by score (descending), keep the smallest prefix whose summed score
                   reaches p * total - 0.01
    Top-P softmax: the same prefix rule on the softmax of the remaining scores, the prefix's
                   probability mass reaching p
    Top-P, p = 1:  every remaining group (with include_zero: every group, the no-filter baseline)
    Top-K:         keep the max(1, int(k * G)) best remaining groups

Two controls (not remedies; select_control), each keeping as many groups as a named filter would:
    random:        that many groups drawn uniformly from all G (a seeded generator): does it
                   matter WHICH groups the filter keeps, or only how many?
    bottom:        that many of the lowest-spread remaining groups: the mechanism predicts worse
                   than no filter (the regulariser drives the update)

Worked example (Fig. 5): A = 9, B = 1, C = 5, p = 0.9: target 0.9 * 15 - 0.01 = 13.49, and
A + C = 14 >= 13.49, so A and C are kept and B is dropped. Paper recommendation: p = 0.9;
[0.8, 0.98] works best; <= 0.6 is too aggressive.

Shapes: G prompt groups, K rollouts per group, B = G * K sequences stored group-major (rows
g*K .. g*K + K - 1 belong to group g), T tokens, D parameters. Inputs may be numpy arrays, lists or
torch tensors; outputs are torch tensors.

Order of the file: the remedy first (select_groups, filter_stats, group_scores), then the
mechanism it rests on (the bound, the spread buckets, the gradient decomposition), then the
controls (select_control, zero_spread_split), and last `select`: what train.py's --filter flags
mean (Filter), decided here once for train.py and scaleout/trl_ragen.py.
"""
import dataclasses
import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

import logprobs
from grpo import group_advantages
from ppo import Coefficients, kl_estimate, policy_loss

MODES = ("none", "topp", "topk")  # the filters (select_groups)
CONTROLS = ("random", "bottom")  # controls for the filter's claims, not remedies (select_control)
PROB_MODES = ("linear", "softmax")  # Top-P on the spread itself or on its softmax
SCORE_KINDS = ("std", "var")
CONTROL_STREAM = 1  # the random control's draws: np.random.default_rng([seed, step, 1])


def _finite_float64(x, name):
    x = torch.as_tensor(x, dtype=torch.float64)
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} must be finite (no NaN / inf)")
    return x


# --------------------------------------------------------------------------------------- the filter

def select_groups(scores, mode, value=None, include_zero=False, prob_mode="linear"):
    """Which groups to train on -> bool mask [G].

    Zero-score groups (no task gradient) are set aside first unless include_zero=True; the others
    are ranked by score, descending, ties to the lower index (deterministic), and the mode keeps a
    prefix of that ranking: "none" every group (`value` ignored), "topp" topp_count's, "topk"
    topk_count's. value must lie in (0, 1] for "topp" and "topk". An all-False mask means the
    caller skips the update (an all-zero batch gives it in every mode but "none" and topp at 1
    with include_zero).

    >>> select_groups([9., 1., 5.], "topp", 0.9)           # Fig. 5: target 13.49, A + C = 14
    tensor([ True, False,  True])
    >>> select_groups([0., 0., 3., 1.], "topk", 0.75)      # int(0.75 * 4) = 3, only two have spread
    tensor([False, False,  True,  True])
    >>> select_groups([3., 2., 0., 0., 0., 0., 0., 0.], "topp", 0.7, prob_mode="softmax")
    tensor([ True, False, False, False, False, False, False, False])
    """
    if mode not in MODES:
        raise ValueError(f"unknown filter mode {mode!r}; choose one of {MODES}")
    if prob_mode not in PROB_MODES:
        raise ValueError(f"unknown prob_mode {prob_mode!r}; choose one of {PROB_MODES}")
    s = _finite_float64(scores, "scores")                                      # [G]
    if s.dim() != 1 or (s < 0).any():
        raise ValueError(f"scores must be a [G] vector of non-negative spreads; got shape "
                         f"{tuple(s.shape)}")
    G = s.shape[0]
    if mode == "none":
        return torch.ones(G, dtype=torch.bool, device=s.device)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < value <= 1.0:
        raise ValueError(f"{mode} value must be a number in (0, 1]; got {value!r}")
    candidates = torch.ones_like(s, dtype=torch.bool) if include_zero else s > 0      # [G]
    idx = candidates.nonzero()[:, 0]                                       # [E] ascending index
    order = idx[torch.sort(s[idx], descending=True, stable=True).indices]  # [E] best first
    ranked = s[order]                                                      # [E]
    n_keep = (topk_count(len(ranked), value, G) if mode == "topk"
              else topp_count(ranked, value, prob_mode))
    keep = torch.zeros(G, dtype=torch.bool, device=s.device)               # [G]
    keep[order[:n_keep]] = True
    return keep


def topp_count(ranked, value, prob_mode="linear"):
    """Top-P: how many of the ranked groups' scores [E] (best first) to keep. value = 1: every
    ranked group. "linear": the smallest prefix whose summed score reaches value * total - 0.01;
    zero scores add nothing, so they are never part of it (the 0.01 slack only absorbs round-off:
    the best group with spread is always kept, however small the total; the official code keeps
    nothing when value * total <= 0.01). "softmax": the same on the softmax of the ranked scores,
    the prefix's mass reaching value.

    >>> topp_count(torch.tensor([9., 5., 1.], dtype=torch.float64), 0.9)   # 14 >= 13.49
    2
    """
    # BEGIN SOLUTION topp
    if value >= 1.0:
        return len(ranked)
    if prob_mode == "linear":
        reached = (ranked.cumsum(0) >= value * ranked.sum() - 0.01).nonzero()     # prefixes
        n_keep = int(reached[0]) + 1 if len(reached) else len(ranked)
        return min(n_keep, int((ranked > 0).sum()))  # zero scores: never part of it
    mass = torch.softmax(ranked, 0).cumsum(0)                              # [E]
    reached = (mass >= value - 1e-12).nonzero()                            # mass 1 may round below
    return int(reached[0]) + 1 if len(reached) else len(ranked)
    # END SOLUTION topp


def topk_count(n_ranked, value, G):
    """Top-K: max(1, int(value * G)) of the groups (G counts every group), at most the n_ranked
    eligible ones.

    >>> topk_count(2, 0.75, 4)                            # int(0.75 * 4) = 3, two eligible
    2
    """
    # BEGIN SOLUTION topk
    return min(n_ranked, max(1, int(value * G)))
    # END SOLUTION topk


def filter_stats(scores, mask):
    """Statistics of one filtering step, as Python numbers for logging (Fig. 11's kept ratio and
    zero-variance count): kept_ratio, num_kept, num_zero_var, zero_var_frac, mean_score_kept,
    mean_score_dropped. An empty side has mean 0.0 (never NaN).

    >>> filter_stats([9., 1., 5., 0.], [True, False, True, False])["mean_score_dropped"]   # 1/2
    0.5
    """
    s = _finite_float64(scores, "scores")                                      # [G]
    keep = torch.as_tensor(mask, dtype=torch.bool, device=s.device)        # [G]
    if s.dim() != 1 or keep.shape != s.shape:
        raise ValueError(f"scores and mask must both be [G]; got {tuple(s.shape)} and "
                         f"{tuple(keep.shape)}")
    G = max(s.shape[0], 1)
    zero = int((s == 0).sum())
    return {
        "kept_ratio": int(keep.sum()) / G,
        "num_kept": int(keep.sum()),
        "num_zero_var": zero,
        "zero_var_frac": zero / G,
        "mean_score_kept": s[keep].mean().item() if keep.any() else 0.0,
        "mean_score_dropped": s[~keep].mean().item() if (~keep).any() else 0.0,
    }


# ------------------------------------------------------------------------------------ reward spread

def group_scores(rewards, kind="std"):
    """Spread of each group's total rewards [G, K] -> [G] float64: the unbiased std (`kind="std"`,
    the reference's score) or the unbiased variance (`kind="var"`). A group whose rewards are all
    equal -- including K = 1 -- scores exactly 0 (never NaN, never float round-off), so
    "zero-variance group" is an exact test.

    >>> group_scores([[0., 1.], [1., 1.]])                # std of (0, 1) = sqrt(1/2)
    tensor([0.7071, 0.0000], dtype=torch.float64)
    >>> group_scores([[0., 1.], [1., 1.]], kind="var")
    tensor([0.5000, 0.0000], dtype=torch.float64)
    """
    if kind not in SCORE_KINDS:
        raise ValueError(f"unknown score kind {kind!r}; choose one of {SCORE_KINDS}")
    r = _finite_float64(rewards, "rewards")                                    # [G, K]
    if r.dim() != 2 or r.shape[1] == 0:
        raise ValueError(f"rewards must be [G, K] with K >= 1; got shape {tuple(r.shape)}")
    constant = (r.max(1).values == r.min(1).values)                        # [G] no spread at all
    if r.shape[1] == 1 or r.shape[0] == 0:  # one rollout, or no group: no spread to measure
        var = torch.zeros(r.shape[0], dtype=torch.float64, device=r.device)  # [G]
    else:
        var = r.var(dim=1, correction=1)                                   # [G]
    var = torch.where(constant, torch.zeros_like(var), var)
    return var.sqrt() if kind == "std" else var


# ------------------------------------------------------------------------------- the sqrt(RV) bound

def task_gradient_bound(rewards, score_grads):
    """For one group of K samples with rewards [K] and score-function gradients grad log pi(z_k)
    [K, D], returns (norm, bound) as floats:

        norm  = || 1/K sum_k (r_k - rbar) grad log pi(z_k) ||     (group-mean-baseline gradient)
        bound = sqrt(RV) * sqrt(1/K sum_k ||grad log pi(z_k)||^2),   RV = 1/K sum_k (r_k - rbar)^2

    RV is the population variance (divide by K), which makes norm <= bound exactly Cauchy-Schwarz
    on the finite sums, with equality when every grad log pi(z_k) = c (r_k - rbar) u for one vector
    u. Equal rewards give (0, 0).

    >>> task_gradient_bound([0., 2.], [[-1., 0.], [1., 0.]])   # tight: grads along r - rbar
    (1.0, 1.0)
    """
    r = _finite_float64(rewards, "rewards")                                    # [K]
    s = _finite_float64(score_grads, "score_grads")                            # [K, D]
    if r.dim() != 1 or s.dim() != 2 or s.shape[0] != r.shape[0] or r.numel() == 0:
        raise ValueError(f"need rewards [K] and score_grads [K, D]; got {tuple(r.shape)} and "
                         f"{tuple(s.shape)}")
    # BEGIN SOLUTION bound
    centred = r - r.mean()                                                 # [K]
    grad = (centred[:, None] * s).mean(0)                                  # [D]
    rv = (centred ** 2).mean()                                             # population variance
    bound = rv.sqrt() * (s ** 2).sum(1).mean().sqrt()
    return grad.norm().item(), bound.item()
    # END SOLUTION bound


# ------------------------------------------------------------------------ buckets and decomposition

def rv_buckets(scores, n_buckets=6):
    """Split groups into equal-count buckets by score, lowest first (Fig. 4's Q1..Q6) -> list of
    index tensors. As in the official gradient analysis there are n = min(n_buckets, G) buckets of
    G // n groups each, the remainder G % n going to the last (highest-spread) bucket: no bucket is
    empty, and fewer groups than buckets give one bucket per group. Sorting is stable (ties keep
    index order).

    >>> [b.tolist() for b in rv_buckets([3., 0., 2., 0., 1.], n_buckets=3)]
    [[1], [3], [4, 2, 0]]
    >>> [len(b) for b in rv_buckets(list(range(8)))]            # 8 groups in 6 buckets
    [1, 1, 1, 1, 1, 3]
    """
    s = _finite_float64(scores, "scores")                                      # [G]
    if s.dim() != 1:
        raise ValueError(f"scores must be [G]; got shape {tuple(s.shape)}")
    if isinstance(n_buckets, bool) or not isinstance(n_buckets, int) or n_buckets < 1:
        raise ValueError(f"n_buckets must be a positive int; got {n_buckets!r}")
    order = torch.sort(s, stable=True).indices                             # [G] ascending
    G = len(order)
    n = min(n_buckets, G)
    if n == 0:
        return []
    size = G // n
    return list(torch.split(order, [size] * (n - 1) + [G - size * (n - 1)]))


def _grad_norm_and_grads(loss, params):
    """One backward pass of `loss` into fresh gradient tensors (the parameters' .grad untouched)."""
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
    return math.sqrt(sum(g.double().pow(2).sum() for g in grads).item()), grads


def gradient_decomposition(model, batch, rewards, coef=Coefficients(entropy_coef=1.0, kl_coef=1.0),
                           temperature=1.0, n_buckets=6):
    """Norms of the task, KL and entropy gradients per reward-spread bucket -- the data of Fig. 4.

    Inputs: a Hugging Face causal LM; `batch` as train.py's: input_ids [B, T], right-padded; mask
    [B, T-1] over ids[:, 1:], 1 at the policy's own tokens; optionally ref_logp [B, T-1], the
    reference's log-probs (absent: the policy itself at this moment, so the KL term sits at its
    minimum and its gradient is exactly 0, as at step 1 of training), and advantages [B, T-1], the
    token advantages an update trains on (absent: each trajectory's r - mean_g(r), the group-mean
    baseline, so the sqrt(RV) scaling shows; GRPO's std division would remove it for every group
    with spread); rewards [G, K], the total reward of each trajectory, B = G * K in group-major
    order; `coef` the loss's settings (ppo.Coefficients: its aggregation, the KL estimator and
    both coefficients). The ratio's old log-probs are the current ones (the first PPO epoch: ratio
    1, so no clip binds). Every log-prob is the sampling policy's, at `temperature`, as in
    training.

    Per bucket of groups (rv_buckets on the std of rewards): bucket_gradients. Returns one dict per
    bucket (lowest spread first): bucket, groups, n_groups, mean_std, mean_var, task_grad_norm,
    kl_grad_norm, entropy_grad_norm, reg_grad_norm (the norm of the KL + entropy gradient).
    theory.md Sec. 3 has the pseudocode.
    """
    r = _finite_float64(rewards, "rewards")                                    # [G, K]
    if r.dim() != 2:
        raise ValueError(f"rewards must be [G, K]; got shape {tuple(r.shape)}")
    G, K = r.shape
    ids, mask = batch["input_ids"], batch["mask"]
    B, T = ids.shape
    if B != G * K or mask.shape != (B, T - 1):
        raise ValueError(f"need input_ids [B, T] and mask [B, T - 1] with B = G * K = {G * K}; got "
                         f"{tuple(ids.shape)} and {tuple(mask.shape)}")
    kl_estimate(torch.zeros(1), torch.zeros(1), coef.kl_kind)  # an unknown estimator: refused now
    std = group_scores(r, "std")                                           # [G]
    advantages = batch.get("advantages")
    if advantages is None:  # each trajectory's r - mean_g(r) on all its tokens
        adv = group_advantages(r, normalize_std=False).reshape(B, 1)                   # [B, 1]
        advantages = adv.float().to(ids.device).expand(B, T - 1)                       # [B, T-1]
    results = []
    for i, groups in enumerate(rv_buckets(std, n_buckets)):
        rows = (groups[:, None] * K + torch.arange(K)).reshape(-1).to(ids.device)      # [b]
        part = {"input_ids": ids[rows], "mask": mask[rows].float(),
                "advantages": advantages[rows].float(),
                "ref_logp": None if batch.get("ref_logp") is None else batch["ref_logp"][rows]}
        results.append({"bucket": i, "groups": groups.tolist(), "n_groups": len(groups),
                        "mean_std": std[groups].mean().item(),
                        "mean_var": (std[groups] ** 2).mean().item(),
                        **bucket_gradients(model, part, coef, temperature)})
    return results


def bucket_gradients(model, part, coef, temperature):
    """One bucket's rows (`part`: input_ids, mask, advantages and ref_logp as
    gradient_decomposition's batch): one forward pass (logprobs.policy_logprobs), then three
    backward passes (torch.autograd.grad: no optimiser step, the parameters and their .grad left
    as they were), each a term of ppo.policy_loss:
      task     the clipped loss with the bucket's advantages
      kl       kl_coef * aggregate(kl_estimate(logp, ref_logp, kl_kind))
      entropy  -entropy_coef * aggregate(token entropy) (the bonus enters the loss with a minus)
    -> {task_grad_norm, kl_grad_norm, entropy_grad_norm, reg_grad_norm}."""
    m = part["mask"]                                                           # [b, T-1]
    logp, entropy = logprobs.policy_logprobs(model, part["input_ids"], m, with_entropy=True,
                                             temperature=temperature)          # [b, T-1]
    ref = logp.detach() if part["ref_logp"] is None else part["ref_logp"]      # [b, T-1]
    # the training loss, its three terms taken apart (each coefficient 1 there, applied here)
    alone = dataclasses.replace(coef, entropy_coef=1.0, kl_coef=1.0)
    _, terms = policy_loss(logp, logp.detach(), part["advantages"], m, alone, entropy, ref)
    params = [p for p in model.parameters() if p.requires_grad]
    task_norm, _ = _grad_norm_and_grads(terms["pg_loss"], params)
    kl_norm, kl_grads = _grad_norm_and_grads(coef.kl_coef * terms["kl_loss"], params)
    entropy_norm, entropy_grads = _grad_norm_and_grads(-coef.entropy_coef * terms["entropy_loss"],
                                                       params)
    reg_sq = sum((k.double() + e.double()).pow(2).sum() for k, e in zip(kl_grads, entropy_grads))
    return {"task_grad_norm": task_norm, "kl_grad_norm": kl_norm,
            "entropy_grad_norm": entropy_norm, "reg_grad_norm": math.sqrt(reg_sq.item())}


# ------------------------------------------------------------------------------------- the controls

def select_control(scores, control, of, value=None, include_zero=False, prob_mode="linear",
                   generator=None):
    """A control for a filter claim -> bool mask [G] with exactly as many groups as
    select_groups(scores, of, value, include_zero, prob_mode) keeps (n below):

      "random"  n groups drawn uniformly at random from all G groups, zero-spread ones included
                (torch.randperm on `generator`: seed it from the step's seed and the choice is
                reproducible); every n-subset is equally likely
      "bottom"  the n lowest-scoring eligible groups (zero-spread ones only with include_zero),
                ties to the lower index; fewer if fewer are eligible

    A control is not a remedy: it answers a sceptic. Random at the filter's count separates "which
    groups" from "how many" (fewer groups also mean fewer optimiser steps at a fixed mini-batch
    size); bottom tests the mechanism's prediction that low-spread groups hand the update to the
    regulariser. (The official filter has the same second mode: rollout_filter_type: smallest.)

    >>> select_control([0., 3., 1., 2.], "bottom", "topk", 0.5)    # n = int(0.5 * 4) = 2
    tensor([False, False,  True,  True])
    >>> int(select_control([0., 3., 1., 2.], "random", "topk", 0.5,
    ...                    generator=torch.Generator().manual_seed(0)).sum())
    2
    """
    if control not in CONTROLS:
        raise ValueError(f"unknown control {control!r}; choose one of {CONTROLS}")
    if of not in ("topp", "topk"):
        raise ValueError(f"a control takes its count from topp or topk, not {of!r}")
    s = _finite_float64(scores, "scores")                                      # [G]
    n = int(select_groups(s, of, value, include_zero, prob_mode).sum())
    G = s.shape[0]
    keep = torch.zeros(G, dtype=torch.bool, device=s.device)               # [G]
    if control == "random":
        keep[torch.randperm(G, generator=generator)[:n].to(s.device)] = True
        return keep
    idx = (torch.ones_like(s, dtype=torch.bool) if include_zero else s > 0).nonzero()[:, 0]
    order = idx[torch.sort(s[idx], stable=True).indices]                   # [E] lowest first
    keep[order[:n]] = True
    return keep


def zero_spread_split(rewards, success):
    """The zero-spread groups of a step split by what their rollouts did: every rollout succeeded
    (too easy) or none did (too hard) -> fractions of all G groups, as floats. The filter drops both
    alike; they call for different answers (a harder prompt, or a hint). A zero-spread group with
    mixed success (equal rewards, different outcomes) counts in neither.

    >>> zero_spread_split([[1., 1.], [0., 0.], [0., 1.], [0., 0.]],
    ...                   [[True, True], [False, False], [False, True], [False, False]])
    {'zero_var_success_frac': 0.25, 'zero_var_fail_frac': 0.5}
    """
    r = _finite_float64(rewards, "rewards")                                    # [G, K]
    ok = torch.as_tensor(success, dtype=torch.bool).reshape(r.shape)       # [G, K]
    zero = group_scores(r) == 0                                            # [G]
    G = max(r.shape[0], 1)
    return {"zero_var_success_frac": int((zero & ok.all(1)).sum()) / G,
            "zero_var_fail_frac": int((zero & ~ok.any(1)).sum()) / G}


# -------------------------------------------------------------------------------- the step

@dataclass(frozen=True)
class Filter:
    """Which groups an update keeps (train.py's --filter flags): `mode`, a filter (MODES) or a
    control (CONTROLS) that keeps as many groups as `control_of` would; the filters' `top_p` and
    `top_k`; `include_zero` and `prob_mode` as select_groups reads them."""
    mode: str = "topp"
    top_p: float = 0.9
    top_k: float = 0.5
    include_zero: bool = False
    prob_mode: str = "linear"
    control_of: str = "topk"


def select(rewards, how=Filter(), seed=0, step=0):
    """train.py's step 3 -> (keep [G], filter_stats): which groups to train on, from the spread
    (unbiased std) of their total rewards [G, K], as `how` says. The random control draws from
    its own stream of (seed, step): the same choice on a resume."""
    scores = group_scores(rewards)                                               # [G]
    named = how.control_of if how.mode in CONTROLS else how.mode  # whose count is kept
    value = how.top_p if named == "topp" else how.top_k
    if how.mode in CONTROLS:
        draw = int(np.random.default_rng([seed, step, CONTROL_STREAM]).integers(2 ** 62))
        keep = select_control(scores, how.mode, named, value, how.include_zero, how.prob_mode,
                              torch.Generator().manual_seed(draw))
    else:
        keep = select_groups(scores, how.mode, value, how.include_zero, how.prob_mode)
    return keep, filter_stats(scores, keep)
