"""The diagnosis: mutual information between prompt and reasoning, estimated by cross-scoring
(paper Sec. 2).

Entropy H(Z) of the reasoning Z cannot see template collapse, because it mixes two things
(Shannon's chain rule):

    H(Z) = H(Z | X) + I(X; Z)
           within-input diversity + input dependence

A collapsed policy keeps H(Z) high (fluent, varied text) while I(X; Z) falls to 0: the reasoning no
longer depends on the prompt X. The paper therefore tracks I(X; Z) online. For N prompts x_j and M
sampled reasonings z_m (owner[m] = the prompt that produced z_m) it scores every reasoning under
every prompt of the batch with the current policy:

    L[m, j] = log p(z_m | x_j)                       (teacher-forced, summed over z_m's tokens)
    matched_m  = L[m, owner[m]]
    marginal_m = logsumexp_j L[m, j] - log N         (p(z) = uniform mixture over the prompts)
    I(X; Z) ~= mean_m (matched_m - marginal_m)       (<= log N: logsumexp >= any single term)

Retrieval accuracy asks whether arg-max_j L[m, j] is owner[m] (or a prompt identical to it): near 1
when reasoning is grounded, chance level under collapse (paper Fig. 6b). The MI z-score divides the
MI estimate by the spread of the marginal (paper Fig. 9).

The project's own instruments beside these -- the same metrics on a fixed probe set with their
standard errors, the answer's dependence on the reasoning I(Z; A | X), the work's MI after a copied
input -- are in plumbing/probe_set.py.

Order: closed-form entropies -> metrics from a score matrix -> EMA smoothing -> cross-scoring a
causal LM (the definition, then each prompt run once) -> the diagnosis of a training step.
"""
import math

import numpy as np
import torch

import logprobs

# what a training run logs of collapse_metrics (and mi_zscore_ema): train.py and trl_ragen.py alike
DIAGNOSIS_KEYS = ("mi_estimate", "mi_seq_estimate", "mi_zscore", "mi_zscore_seq", "mi_zscore_ema",
                  "retrieval_acc", "retrieval_acc_top2", "conditional_entropy",
                  "reasoning_entropy", "conditional_entropy_seq", "reasoning_entropy_seq",
                  "retrieval_chance", "mi_upper_bound")

# --------------------------------------------------------------------------------------------------
# Closed form: discrete distributions, natural log (nats), 0 log 0 = 0


def _as_float64(x):
    """numpy array or torch tensor (any device / dtype) -> float64 numpy array."""
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _check_distribution(p, name, axis=-1):
    if not np.all(np.isfinite(p)) or np.any(p < 0):
        raise ValueError(f"{name} must hold finite non-negative probabilities")
    if not np.allclose(p.sum(axis=axis), 1.0, atol=1e-6):
        raise ValueError(f"{name} must sum to 1 along its last axis")


def _neg_xlogx(p):
    """-p log p elementwise with the limit 0 at p = 0."""
    # BEGIN SOLUTION chain_rule
    return -p * np.log(np.where(p > 0, p, 1.0))
    # END SOLUTION chain_rule


def _table_and_prior(p_z_given_x, p_x):
    table = _as_float64(p_z_given_x)
    if table.ndim != 2:
        raise ValueError(f"p_z_given_x must have shape [N inputs, K outputs], got {table.shape}")
    _check_distribution(table, "each row of p_z_given_x")
    prior = np.full(table.shape[0], 1.0 / table.shape[0]) if p_x is None else _as_float64(p_x)
    if prior.shape != (table.shape[0],):
        raise ValueError(f"p_x must have shape [{table.shape[0]}], got {prior.shape}")
    _check_distribution(prior, "p_x")
    return table, prior


def entropy(p):
    """H(Z) = -sum_z p(z) log p(z) in nats for a 1-D distribution.

    >>> round(entropy([0.5, 0.5, 0.0]), 4)     # log 2; the zero adds nothing
    0.6931
    """
    p = _as_float64(p)
    if p.ndim != 1:
        raise ValueError(f"entropy expects a 1-D distribution, got shape {p.shape}")
    _check_distribution(p, "p")
    # BEGIN SOLUTION chain_rule
    return float(_neg_xlogx(p).sum())
    # END SOLUTION chain_rule


def conditional_entropy(p_z_given_x, p_x=None):
    """H(Z | X) = sum_x p(x) H(Z | X = x); p_z_given_x is [N inputs, K outputs], p_x defaults to
    uniform.

    >>> round(conditional_entropy([[.5, .5, 0], [0, .5, .5], [.5, 0, .5]]), 4)   # log 2
    0.6931
    """
    table, prior = _table_and_prior(p_z_given_x, p_x)
    # BEGIN SOLUTION chain_rule
    return float(prior @ _neg_xlogx(table).sum(axis=1))
    # END SOLUTION chain_rule


def mutual_information(p_z_given_x, p_x=None):
    """I(X; Z) = sum_x p(x) KL(p(z|x) || p(z)) with p(z) = sum_x p(x) p(z|x); equals
    H(Z) - H(Z | X).

    Three prompts, three possible reasonings, uniform prompts: two policies with the SAME entropy
    H(Z) = log 3 = 1.0986 nats, told apart only by mutual information.

    >>> grounded = [[.5, .5, 0], [0, .5, .5], [.5, 0, .5]]    # H(Z|X) = log 2
    >>> template = [[1 / 3] * 3] * 3                          # H(Z|X) = log 3
    >>> round(mutual_information(grounded), 4), round(mutual_information(template), 4)
    (0.4055, 0.0)
    """
    table, prior = _table_and_prior(p_z_given_x, p_x)
    # BEGIN SOLUTION chain_rule
    marginal = prior @ table                                               # [K]
    safe = np.where(marginal > 0, marginal, 1.0)                           # p(z|x) > 0 => p(z) > 0
    ratio = np.where(table > 0, table / safe, 1.0)                         # [N, K]
    return max(0.0, float(prior @ (table * np.log(ratio)).sum(axis=1)))   # clamp -1e-17 rounding
    # END SOLUTION chain_rule


# --------------------------------------------------------------------------------------------------
# From a cross-score matrix to the paper's metrics


def _as_scores(scores, owner, lengths):
    """Validate and convert to float64 / int64 torch tensors on the CPU."""
    scores = torch.as_tensor(_as_float64(scores))
    if scores.ndim != 2 or scores.shape[0] == 0 or scores.shape[1] == 0:
        raise ValueError(f"scores must have shape [M samples, N prompts] with M, N >= 1, got "
                         f"{tuple(scores.shape)}")
    if torch.isnan(scores).any() or (scores == math.inf).any():
        raise ValueError("scores must be log-likelihoods: no NaN and no +inf (-inf is allowed)")
    num_samples, num_prompts = scores.shape
    owner = torch.as_tensor(_as_float64(owner))
    bad = (owner != owner.round()) | (owner < 0) | (owner >= num_prompts)
    if owner.shape != (num_samples,) or bad.any():
        raise ValueError(f"owner must hold {num_samples} prompt indices in [0, {num_prompts})")
    owner = owner.long()
    if not torch.isfinite(scores.gather(1, owner[:, None])).all():
        raise ValueError("each sample's matched score scores[m, owner[m]] must be finite "
                         "(its owner produced it)")
    if lengths is None:
        lengths = torch.ones(num_samples, dtype=torch.float64)
    lengths = torch.as_tensor(_as_float64(lengths))
    if lengths.shape != (num_samples,) or (lengths < 0).any():
        raise ValueError(f"lengths must hold {num_samples} non-negative token counts")
    return scores, owner, lengths


def matched_and_marginal(table, owner):
    """Each sample's score under its own prompt and under the batch's uniform mixture of prompts:
    table [M, N] = log p(z_m | x_j) (summed or per token), owner [M] -> (matched [M], marginal [M])

        matched_m  = table[m, owner[m]]
        marginal_m = logsumexp_j table[m, j] - log N

    >>> matched_and_marginal(torch.tensor([[-1., -3.]]), torch.tensor([0]))  # log mean(e^-1, e^-3)
    (tensor([-1.]), tensor([-1.5662]))
    """
    # BEGIN SOLUTION mi_estimate
    matched = table.gather(1, owner[:, None])[:, 0]                        # [M]
    marginal = torch.logsumexp(table, dim=1) - math.log(table.shape[1])    # [M]
    return matched, marginal
    # END SOLUTION mi_estimate


def _key_ids(prompt_keys, num_prompts):
    """One int per prompt column, equal for equal keys; None -> every column its own prompt."""
    if prompt_keys is None:
        return torch.arange(num_prompts)
    keys = list(prompt_keys)
    if len(keys) != num_prompts:
        raise ValueError(f"prompt_keys must hold one key per prompt column ({num_prompts}), got "
                         f"{len(keys)}")
    ids = {}
    return torch.tensor([ids.setdefault(key, len(ids)) for key in keys])


def retrieval_credit(scores, owner, k=1, prompt_keys=None):
    """Per-sample chance that one of the k best-scoring prompts is the sample's own, ties broken
    uniformly at random -> [M] float64.

    Columns with equal `prompt_keys` are identical prompts and count as one target (as in the
    official metric): any column with the owner's key is a hit. With s the best score among the
    owner's a columns, g columns scoring strictly above s, and t columns tied at s (a' of them the
    owner's), a uniformly random order of the tie puts an own column within the first k with
    probability

        1 - C(t - a', k - g) / C(t, k - g)        (0 when k <= g),

    which is clip((k - g) / t, 0, 1) when every prompt is distinct. A fully collapsed policy (all N
    scores equal) thus gets exactly c / N at k = 1, c = the number of columns with its prompt.

    >>> retrieval_credit(torch.tensor([[-1., -1., -3.]]), [0])         # a tie of two at the top
    tensor([0.5000], dtype=torch.float64)
    >>> retrieval_credit(torch.tensor([[-1., -1., -3.]]), [0], k=2)
    tensor([1.], dtype=torch.float64)
    >>> retrieval_credit(torch.tensor([[-1., -1., -3.]]), [0], prompt_keys=["a", "a", "b"])
    tensor([1.], dtype=torch.float64)
    """
    scores = torch.as_tensor(scores, dtype=torch.float64)                  # [M, N]
    owner = torch.as_tensor(owner).long()                                  # [M]
    key = _key_ids(prompt_keys, scores.shape[1])                           # [N]
    # BEGIN SOLUTION retrieval
    own = key[None, :] == key[owner][:, None]                              # [M, N] own prompt
    best_own = torch.where(own, scores, -math.inf).max(1).values[:, None]  # [M, 1]
    above = (scores > best_own).sum(1)                                     # [M] g
    tie = scores == best_own                                               # [M, N]
    tied, tied_own = tie.sum(1), (tie & own).sum(1)                        # [M] t, a' >= 1
    j = (k - above).clamp(min=0)                                           # [M] places left
    j = torch.minimum(j, tied - tied_own + 1)          # past this the ratio below is 0 anyway
    miss = torch.ones(scores.shape[0], dtype=torch.float64)                # C(t-a', j) / C(t, j)
    for i in range(int(j.max()) if len(j) else 0):
        factor = (tied - tied_own - i).double() / (tied - i).double()
        miss = torch.where(i < j, miss * factor, miss)
    return torch.where(j > 0, 1.0 - miss, torch.zeros_like(miss))
    # END SOLUTION retrieval


def collapse_metrics(scores, owner, lengths=None, topk=(2, 4, 8), prompt_keys=None):
    """The paper's MI diagnostics from cross-scores (definitions in the module docstring).

    scores [M, N]: summed log-likelihoods log p(z_m | x_j); owner [M]: prompt index of each sample;
    lengths [M]: token counts of z_m (None = all 1), used for the per-token matrix
    scores / max(length, 1) (an empty reasoning scores 0); prompt_keys: one hashable per prompt
    column, equal keys for identical prompts (e.g. the prompt texts; None = all distinct).
    numpy or torch input. Returns plain floats:
      mi_estimate / mi_seq_estimate    mean(matched - marginal) on the per-token / summed matrix
      mi_zscore / mi_zscore_seq        that mean / (population std of marginal + 1e-3)
      marginal_std / marginal_std_seq  the std in that denominator (for mi_zscore_ema)
      conditional_entropy (_seq)       -mean(matched)
      reasoning_entropy (_seq)         -mean(marginal)
      retrieval_acc                    the best-scoring prompt is the owner's (retrieval_credit)
      retrieval_acc_top{k}             the owner's prompt is within the top k, for each k < N
      retrieval_chance                 retrieval_acc of a collapsed policy: mean over samples of
                                       (columns holding the owner's prompt) / N; 1/N if distinct
      mi_upper_bound = log N, num_samples = M, num_prompts = N
    The MI and entropy estimates use all N columns, identical ones included (the uniform mixture
    over the batch's prompt groups).

    >>> out = collapse_metrics([[-1., -3.], [-4., -2.], [-2., -2.]], [0, 1, 0])
    >>> names = "mi_seq_estimate", "conditional_entropy", "reasoning_entropy", "retrieval_acc"
    >>> [round(out[n], 4) for n in names]    # gaps (0.5662, 0.5662, 0); the last sample ties
    [0.3775, 1.6667, 2.0441, 0.8333]
    >>> keys = ["x", "y", "x"]                             # prompts 0 and 2: the same text
    >>> out = collapse_metrics([[-1., -3., -1.], [-4., -2., -4.]], [2, 1], prompt_keys=keys)
    >>> out["retrieval_acc"], out["retrieval_chance"]      # one target; chance (2/3 + 1/3) / 2
    (1.0, 0.5)
    """
    scores, owner, lengths = _as_scores(scores, owner, lengths)
    num_samples, num_prompts = scores.shape
    key = _key_ids(prompt_keys, num_prompts)                               # [N]
    log_n = math.log(num_prompts)
    out = {}
    per_token = scores / lengths.clamp(min=1.0)[:, None]                   # [M, N]
    for suffix, table in (("", per_token), ("_seq", scores)):
        matched, marginal = matched_and_marginal(table, owner)             # [M], [M]
        # BEGIN SOLUTION mi_estimate
        estimate = (matched - marginal).mean().item()
        spread = marginal.std(correction=0).item() if num_samples > 1 else 0.0
        out["mi_estimate" if not suffix else "mi_seq_estimate"] = estimate
        out["mi_zscore" + suffix] = estimate / (spread + 1e-3)
        out["marginal_std" + suffix] = spread
        out["conditional_entropy" + suffix] = -matched.mean().item()
        out["reasoning_entropy" + suffix] = -marginal.mean().item()
        # END SOLUTION mi_estimate
    # The ranking is the same on both matrices (one positive factor per row): use the summed one.
    out["retrieval_acc"] = retrieval_credit(scores, owner, 1, prompt_keys).mean().item()
    for k in topk:
        if k < num_prompts:
            credit = retrieval_credit(scores, owner, k, prompt_keys)
            out[f"retrieval_acc_top{k}"] = credit.mean().item()
    copies = (key[owner][:, None] == key[None, :]).sum(1).double()         # [M]
    out.update(retrieval_chance=(copies / num_prompts).mean().item(), mi_upper_bound=log_n,
               num_samples=float(num_samples), num_prompts=float(num_prompts))
    return out


# --------------------------------------------------------------------------------------------------
# Smoothing over training steps


def ema(previous, value, decay=0.9):
    """Exponential moving average, state in -> state out: None initialises with value.
    >>> ema(None, 2.0), round(ema(2.0, 4.0), 4)     # 0.9 * 2 + 0.1 * 4
    (2.0, 2.2)"""
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay}")
    return float(value) if previous is None else decay * previous + (1.0 - decay) * float(value)


def mi_zscore_ema(metrics, std_ema=None, decay=0.9, seq=False):
    """mi_zscore with the denominator's std smoothed across steps: returns (zscore, new std_ema).
    metrics is a collapse_metrics dict; pass the returned std_ema back at the next step. The EMA is
    updated before it divides, and starts at the first step's std (as the reference does).

    >>> z, s = mi_zscore_ema({"mi_estimate": 0.2, "marginal_std": 0.5})
    >>> round(z, 4), s                                     # 0.2 / (0.5 + 1e-3)
    (0.3992, 0.5)
    >>> z, s = mi_zscore_ema({"mi_estimate": 0.3, "marginal_std": 1.5}, s)
    >>> round(z, 4), round(s, 4)                           # s = 0.9 * 0.5 + 0.1 * 1.5
    (0.4992, 0.6)
    """
    suffix = "_seq" if seq else ""
    std_ema = ema(std_ema, metrics["marginal_std" + suffix], decay)
    estimate = metrics["mi_seq_estimate" if seq else "mi_estimate"]
    return estimate / (std_ema + 1e-3), std_ema


# --------------------------------------------------------------------------------------------------
# Cross-scoring a causal language model: L[m, j] = log p(z_m | x_j) for every (reasoning, prompt)


def _as_id_lists(ids, what):
    if isinstance(ids, (list, tuple)) and all(isinstance(row, (list, tuple)) and all(
            isinstance(t, int) for t in row) for row in ids):
        return [list(row) for row in ids]
    raise ValueError(f"{what} must be a list of token-id lists")


def tokenize(tokenizer, texts):
    """Texts -> token-id lists, without added special tokens (a prompt already carries what the chat
    template put there). Scoring re-tokenised text is the official code's way; it is not what was
    sampled: at a high temperature many sampled reasonings tokenise back differently
    (bench/bench_retokenize.py measures how many, and what that does to the scores)."""
    if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts must be a list of strings")
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def cross_scores_plain(model, prompt_ids, reasoning_ids, temperature=1.0):
    """The definition, one forward pass a pair: L[m, j] = sum_t log p(z_m,t | x_j, z_m,<t) under
    `model` at the sampling temperature (p = softmax(logits / temperature), teacher forcing) ->
    [M, N] float64 on the CPU; an empty reasoning scores 0. M x N passes over prompt and
    reasoning: cross_scores computes the same with each prompt run once (a test checks that they
    agree)."""
    scores = torch.zeros(len(reasoning_ids), len(prompt_ids), dtype=torch.float64)  # [M, N]
    device = next(model.parameters()).device
    with torch.inference_mode():
        for m, z in enumerate(reasoning_ids):
            for j, x in enumerate(prompt_ids):
                ids = torch.tensor([list(x) + list(z)], device=device)            # [1, P + R]
                logits = model(input_ids=ids).logits[0, len(x) - 1:-1]            # [R, V]
                logp = logprobs.tempered(logits, temperature)                      # [R, V]
                scores[m, j] = logp.gather(1, ids[0, len(x):, None]).sum().cpu()
    return scores


@torch.inference_mode()
def cross_scores(model, prompt_ids, reasoning_ids, batch_size=None, temperature=1.0, pad_id=0):
    """cross_scores_plain's L[m, j] = log p(z_m | x_j) for every pair, each prompt run once ->
    (scores_sum [M, N] float64, lengths [M] int64), on the CPU. Prompts and reasonings are
    token-id lists, the ids that were sampled (rollout.FirstTurn), so a sample's score under its
    own prompt is its sampling log-prob; float64 from the log-softmax on, as the sampler's (a
    float32 sum over a 64-token reply is itself rounded by ~1e-5). An empty reasoning scores 0
    with length 0; `pad_id` fills padding that no real token attends to.

    For each prompt, up to `batch_size` reasonings (all by default) are appended to it as the
    rows of one batch, right-padded; logprobs.policy_logprobs runs the prompt they share once
    (shared_prefix_hidden) and the output layer only on the reasonings' tokens, so the work grows
    with N x (reasoning tokens), not N x (prompt + reasoning tokens).
    """
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    prompt_ids = _as_id_lists(prompt_ids, "prompt_ids")
    reasoning_ids = _as_id_lists(reasoning_ids, "reasoning_ids")
    if any(len(ids) == 0 for ids in prompt_ids):
        raise ValueError("every prompt must have at least one token (its last position predicts "
                         "the reasoning)")
    device = next(model.parameters()).device
    lengths = torch.tensor([len(ids) for ids in reasoning_ids], dtype=torch.long)   # [M]
    scores = torch.zeros(len(reasoning_ids), len(prompt_ids), dtype=torch.float64)  # [M, N]
    # reasonings of similar length batched together (less padding); empty ones keep score 0
    order = sorted((m for m in range(len(reasoning_ids)) if reasoning_ids[m]),
                   key=lambda m: len(reasoning_ids[m]))
    size = batch_size or max(1, len(order))
    was_training = model.training
    model.eval()  # no dropout while scoring
    try:
        for j, x in enumerate(prompt_ids):
            for batch in (order[k:k + size] for k in range(0, len(order), size)):
                rows = [x + reasoning_ids[m] for m in batch]
                ids = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
                mask = torch.zeros(len(rows), ids.shape[1] - 1)          # [b, T-1] z's tokens
                for r, row in enumerate(rows):
                    ids[r, :len(row)] = torch.tensor(row)
                    mask[r, len(x) - 1:len(row) - 1] = 1
                logp, _ = logprobs.policy_logprobs(model, ids.to(device), mask.to(device),
                                                   temperature=temperature, dtype=torch.float64,
                                                   share_prefix=True)                # [b, T-1]
                scores[batch, j] = logp.sum(1).cpu()
    finally:
        model.train(was_training)
    return scores, lengths


# --------------------------------------------------------------------------------------------------
# The diagnosis of a training step (train.py's step 2): which samples; are the ids scored those sampled?


def mi_sample(groups, group_size, num_samples, rng):
    """Which episodes (indices, group-major) the diagnosis cross-scores: the same number from
    every group, min(group_size, num_samples // groups), as the estimate's uniform mixture over the
    prompts assumes. Fewer samples than groups: one from each of num_samples groups drawn uniformly
    without replacement (`rng`), so every prompt is equally likely to own a sample.

    >>> mi_sample(3, 4, 7, None)                    # 2 from each group; the 7th would skew owners
    [0, 1, 4, 5, 8, 9]
    """
    per_group = min(group_size, num_samples // groups)
    if per_group == 0:
        return sorted(int(g) * group_size for g in rng.choice(groups, num_samples, replace=False))
    return [g * group_size + k for g in range(groups) for k in range(per_group)]


def logprob_diff(scores, owner, sampled):
    """max_m |scores[m, owner[m]] - sampled[m]|: the own-prompt scores against the log-probs the
    samples were drawn with (float32's, train.sampled_in_float32; None when the policy gave none)."""
    if any(lp is None for lp in sampled):
        return None
    own = scores[torch.arange(len(owner)), torch.as_tensor(owner)].double()           # [M]
    return (own - torch.tensor(sampled, dtype=torch.float64)).abs().max().item()


def scored_ids(prompts, samples, retokenize=None):
    """The prompts' and the reasonings' token ids as sampled (rollout.FirstTurn records), or their
    texts tokenised again by `retokenize` (the official code's way) -> (xs, zs)."""
    if retokenize is None:
        return [p.prompt_ids for p in prompts], [s.reasoning_ids for s in samples]
    return (tokenize(retokenize, [p.prompt for p in prompts]),
            tokenize(retokenize, [s.reasoning for s in samples]))


def diagnose(model, prompts, samples, owner, temperature=1.0, batch_size=None, pad_id=0,
             retokenize=None):
    """Sec. 2.3 on one step: every sample's first reasoning cross-scored under every prompt's
    first turn (rollout.FirstTurn records; owner[m]: the prompt of samples[m]) -> collapse_metrics,
    identical prompt texts counting as one target, and diagnosis_logprob_diff (logprob_diff: 0 up
    to float rounding when the ids sampled are scored). `retokenize`: a tokenizer, to score the
    decoded texts tokenised again instead (the official code's way)."""
    xs, zs = scored_ids(prompts, samples, retokenize)
    scores, lengths = cross_scores(model, xs, zs, batch_size, temperature, pad_id)
    out = collapse_metrics(scores, owner, lengths, prompt_keys=[p.prompt for p in prompts])
    out["diagnosis_logprob_diff"] = logprob_diff(scores, owner,
                                                 [s.reasoning_logprob for s in samples])
    return out


