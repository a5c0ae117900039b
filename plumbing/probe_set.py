"""The project's instruments beside the paper's diagnosis (mi.py), for a fixed probe set of held-out
prompts: the same metrics with their standard errors over the prompts (metrics_with_se); the
answer's dependence on its reasoning, I(Z; A | X), cross-scored within a prompt's samples
(action_dependence); and the work's MI, the reasoning scored after what it copies from its input
(work_scores). probe runs all three on one probe set; train.py's step 2 calls it beside
mi.diagnose. theory.md, Sec. 7 (beyond the paper), derives each.
"""
import functools
import math

import torch

from mi import _as_float64, _as_scores, collapse_metrics, cross_scores, logprob_diff, scored_ids, tokenize


def metrics_with_se(scores, owner, lengths=None, prompt_keys=None):
    """collapse_metrics' estimates on a fixed probe set, each with its standard error over the
    prompts: mi_estimate, conditional_entropy, reasoning_entropy (per token and _seq) and
    retrieval_acc, then retrieval_chance. A prompt's samples are not independent, so the error is
    the sample std of the per-prompt estimates (collapse_metrics on that prompt's samples against
    every prompt) over sqrt(prompts), nan with fewer than 2 prompts; exact for equal clusters, as
    the probe set has. The means are collapse_metrics' own.

    >>> out = metrics_with_se([[-1., -3.], [-1., -5.], [-4., -2.], [-6., -2.]], [0, 0, 1, 1])
    >>> round(out["mi_seq_estimate"], 4), round(out["mi_seq_estimate_se"], 4)   # gaps .5662 .6750
    (0.6206, 0.0)
    """
    scores, owner, lengths = _as_scores(scores, owner, lengths)
    whole = collapse_metrics(scores, owner, lengths, prompt_keys=prompt_keys)
    per_prompt = [collapse_metrics(scores[owner == p], owner[owner == p], lengths[owner == p],
                                   topk=(), prompt_keys=prompt_keys) for p in owner.unique()]
    out = {}
    for name in ("mi_estimate", "conditional_entropy", "reasoning_entropy", "mi_seq_estimate",
                 "conditional_entropy_seq", "reasoning_entropy_seq", "retrieval_acc"):
        means = torch.tensor([m[name] for m in per_prompt], dtype=torch.float64)     # [P]
        out[name] = whole[name]
        out[name + "_se"] = (means.std(correction=1).item() / math.sqrt(len(means))
                             if len(means) > 1 else math.nan)
    out["retrieval_chance"] = whole["retrieval_chance"]
    return out


def action_dependence(scores):
    """How much the answer depends on the reasoning, I(Z; A | X), by cross-scoring within each
    prompt's K samples (one step past the paper: a template can also live between the reasoning
    and the action). scores [P, K, K]: L[p, k, j] = log p(a_k | x_p, z_j), the k-th sampled answer
    scored after the j-th sampled reasoning of the same prompt x_p (summed over a_k's tokens).

        gap[p, k] = L[p, k, k] - logsumexp_j L[p, k, j] + log K
        estimate  = mean over p and k of gap                <= log K  (logsumexp >= its k-th term)

    0 when the answer ignores the reasoning (every column alike), log K when each answer is
    possible only after its own reasoning. With exact likelihoods this is the contrastive
    (InfoNCE) bound: its expectation lies below I(Z; A | X) and approaches it as K grows. Returns
    floats: action_mi, action_mi_se (over the P prompts; nan for P = 1), action_mi_upper_bound =
    log K.

    >>> abs(action_dependence([[[-1., -1.], [-2., -2.]]])["action_mi"]) < 1e-12  # answers ignore z
    True
    >>> out = action_dependence([[[0., -math.inf], [-math.inf, 0.]]])  # only its own z
    >>> round(out["action_mi"], 4), round(out["action_mi_upper_bound"], 4)
    (0.6931, 0.6931)
    """
    L = torch.as_tensor(_as_float64(scores))                               # [P, K, K]
    if L.ndim != 3 or L.shape[1] != L.shape[2] or 0 in L.shape:
        raise ValueError(f"scores must have shape [P prompts, K, K] with P, K >= 1, got "
                         f"{tuple(L.shape)}")
    own = torch.diagonal(L, dim1=1, dim2=2)                                # [P, K]
    if torch.isnan(L).any() or (L == math.inf).any() or not torch.isfinite(own).all():
        raise ValueError("scores must be log-likelihoods (no NaN, no +inf) with finite "
                         "L[p, k, k]: each answer was sampled after its own reasoning")
    log_k = math.log(L.shape[1])
    gap = own - torch.logsumexp(L, dim=2) + log_k                          # [P, K]
    per_prompt = gap.mean(1)                                               # [P]
    se = per_prompt.std(correction=1).item() / math.sqrt(len(gap)) if len(gap) > 1 else math.nan
    return {"action_mi": gap.mean().item(), "action_mi_se": se, "action_mi_upper_bound": log_k}


def work_scores(score, prompt_ids, copy_ids, reasoning_ids, owner):
    """The reasoning's own work, cross-scored: L'[m, j] = log p(w_m | x_j, c_j), where c_j is
    what a reasoning of prompt j copies from it (copy_ids[j]; empty: nothing) and w_m is
    reasoning m after its own prompt's copy. A reasoning that does not begin with its own
    prompt's copy (a template that copies nothing, a wrong copy) is scored whole after each bare
    prompt: L'[m, j] = log p(z_m | x_j). -> (scores [M, N], lengths [M] of what was scored,
    copied [M] bool). `score(prompts, reasonings) -> (scores, lengths)` is cross_scores with its
    settings; each prompt runs once for each kind of reasoning.

    Why (theory.md, Sec. 7, the work's MI): with Z = (C, W) and the copy C a function of the input,
    I(X; Z) = I(X; W) + H(C | W): a reasoning that restates its input carries the copy's entropy
    whatever its work does, up to the log N cap of the plain estimate. Scored after each candidate
    prompt's own copy, the copy counts for nothing and the estimate is I(X; W)'s: what the work
    says about the input.

    >>> table = {(1, 5, 7): -0.1, (1, 5, 8): -2.4, (2, 6, 7): -2.4, (2, 6, 8): -0.1}
    >>> exact = lambda xs, zs: (torch.tensor([[table[tuple(x + z)] for x in xs] for z in zs],
    ...                                      dtype=torch.float64), torch.tensor([len(z) for z in zs]))
    >>> scores, lengths, copied = work_scores(exact, [[1], [2]], [[5], [6]], [[5, 7], [6, 7]], [0, 1])
    >>> scores.tolist(), copied    # reasoning 1 copied prompt 1's 6, then said 7: prompt 0's work
    ([[-0.1, -2.4], [-0.1, -2.4]], [True, True])
    """
    copied = [bool(copy_ids[j]) and z[:len(copy_ids[j])] == copy_ids[j]
              for z, j in zip(reasoning_ids, owner)]
    scores = torch.zeros(len(reasoning_ids), len(prompt_ids), dtype=torch.float64)  # [M, N]
    lengths = torch.zeros(len(reasoning_ids), dtype=torch.long)                     # [M]
    for kind, prompts in ((True, [x + c for x, c in zip(prompt_ids, copy_ids)]),
                          (False, prompt_ids)):
        rows = [m for m, c in enumerate(copied) if c == kind]
        if rows:
            tails = [reasoning_ids[m][len(copy_ids[owner[m]]) if kind else 0:] for m in rows]
            table, counts = score(prompts, tails)
            scores[rows], lengths[rows] = table.double(), counts.long()
    return scores, lengths, copied


def probe(model, samples, per_prompt, temperature=1.0, batch_size=None, pad_id=0,
          retokenize=None, copies=None):
    """The diagnosis on a fixed probe set: `samples` (rollout.FirstTurn) are P prompts x
    `per_prompt` first turns, group-major -> metrics_with_se, and on the same samples the answer's
    dependence on its reasoning (action_dependence: each answer a_k scored after every reasoning
    z_j of its prompt), with diagnosis_logprob_diff over both scorings. With `copies` (the token
    ids each prompt's reasoning copies from it), the same metrics of the work after the copy
    (work_scores), as work_<metric>, and the share of reasonings that began with their copy."""
    firsts, K = samples[::per_prompt], per_prompt
    owner = [i // K for i in range(len(samples))]
    xs, zs = scored_ids(firsts, samples, retokenize)
    scores, lengths = cross_scores(model, xs, zs, batch_size, temperature, pad_id)
    out = {}
    if copies is not None:
        score = functools.partial(cross_scores, model, batch_size=batch_size,
                                  temperature=temperature, pad_id=pad_id)
        work, work_lengths, copied = work_scores(score, xs, copies, zs, owner)
        keys = [p.prompt for p in firsts]
        out.update({f"work_{k}": v for k, v in
                    metrics_with_se(work, owner, work_lengths, prompt_keys=keys).items()})
        out["work_copied_share"] = sum(copied) / len(copied)
    diffs = [logprob_diff(scores, owner, [s.reasoning_logprob for s in samples])]
    actions = []  # [P, K, K]: L[k, j] = log p(a_k | x, z_j), within each prompt
    for g in range(len(firsts)):
        group = samples[g * K:(g + 1) * K]
        if retokenize is not None:
            contexts, answers = (tokenize(retokenize, list(t))
                                 for t in zip(*(s.split_answer() for s in group)))
        else:
            contexts = [s.prompt_ids + s.reasoning_ids for s in group]
            answers = [s.answer_ids for s in group]
        L = cross_scores(model, contexts, answers, batch_size, temperature, pad_id)[0]  # [K, K]
        actions.append(L)
        diffs.append(logprob_diff(L, list(range(K)), [s.answer_logprob for s in group]))
    out.update(metrics_with_se(scores, owner, lengths, prompt_keys=[p.prompt for p in firsts]))
    out.update(action_dependence(torch.stack(actions)))
    out["diagnosis_logprob_diff"] = None if None in diffs else max(diffs)
    return out
