"""Step 2 of train.py, the MI diagnosis on a run (RAGEN-2 Sec. 2.3): which sampled first-turn
reasonings are cross-scored under which prompts, in the batch (diagnose) and on a fixed held-out
probe set (probe), and how far the scores are from the log-probs the samples were drawn with.
The estimator itself -- the MI estimate, its z-score, retrieval accuracy -- is mi.py's.
"""
import torch

import mi
import rollout
from plumbing import runs, sampler, templates
from plumbing.defaults import PROBE_SEED_BASE


def diagnose(run, episodes, rng):
    """Step 2: cross-score up to mi_samples first-turn reasonings under every group's first prompt
    (Sec. 2.3). Identical prompts (Bandit repeats its 4 layouts; rooms can repeat) count as one.
    diagnosis_logprob_diff: the largest |a sample's score under its own prompt - its sampling
    log-prob|, 0 up to float rounding when the sampled ids are scored; template_share: the share of
    those reasonings that are templates of --template-kind (templates.share_of), exact."""
    a = run.args
    picked = [episodes[i] for i in mi_sample(a.groups, a.group_size, a.mi_samples, rng)]
    firsts = [next(e for e in episodes if e.group == g) for g in range(a.groups)]
    scores, lengths = cross_score(run, firsts, picked)
    prompts = [e.first_prompt for e in firsts]
    metrics = mi.collapse_metrics(scores, [e.group for e in picked], lengths, prompt_keys=prompts)
    metrics["mi_zscore_ema"], run.state["std_ema"] = mi.mi_zscore_ema(metrics, run.state["std_ema"])
    out = {k: metrics[k] for k in mi.DIAGNOSIS_KEYS if k in metrics}
    out["diagnosis_logprob_diff"] = logprob_diff(scores, [e.group for e in picked],
                                                 [e.first_reasoning_logprob for e in picked])
    out["template_share"] = templates.share_of(picked, a.env, a.template_kind)
    return out


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


def cross_score(run, prompt_episodes, episodes):
    """mi.cross_scores of the episodes' first reasonings under the first prompts of
    `prompt_episodes`: the ids as sampled, or with --retokenize the decoded texts tokenised again
    (the official code's way)."""
    a = run.args
    if a.retokenize:
        prompts = mi.tokenize(run.tokenizer, [e.first_prompt for e in prompt_episodes])
        reasonings = mi.tokenize(run.tokenizer, [e.first_reasoning for e in episodes])
    else:
        prompts = [e.first_prompt_ids for e in prompt_episodes]
        reasonings = [e.first_reasoning_ids for e in episodes]
    with run.ctx:
        return mi.cross_scores(run.policy, prompts, reasonings, batch_size=a.micro_batch,
                               temperature=a.temperature, pad_id=run.pad_id)


def logprob_diff(scores, owner, sampled):
    """max_m |scores[m, owner[m]] - sampled[m]|: how far the diagnosis' own-prompt scores are from
    the log-probs the samples were drawn with (None when the policy gave none)."""
    if any(lp is None for lp in sampled):
        return None
    own = scores[torch.arange(len(owner)), torch.tensor(owner)].double()               # [M]
    return (own - torch.tensor(sampled, dtype=torch.float64)).abs().max().item()


def probe(run):
    """Step 2 on a fixed probe set: the diagnosis on the same held-out prompts at every diagnosis
    (seeds PROBE_SEED_BASE + i, one first turn sampled probe_samples times each, on a forked RNG
    seeded alike every time: the training stream is unchanged and the curve moves only when the
    policy does). Logged as probe_<metric> with probe_<metric>_se over the prompts, and, on the
    same samples, the answer's dependence on the reasoning, probe_action_mi (mi.action_dependence:
    each answer a_k -- the rest of the first reply after the reasoning -- scored after every
    reasoning z_j of its prompt); probe_diagnosis_logprob_diff over both scorings;
    probe_template_share."""
    a = run.args
    if not a.probe_prompts:
        return {}
    seeds = [PROBE_SEED_BASE + i for i in range(a.probe_prompts)]
    K = a.probe_samples
    with torch.random.fork_rng(devices=[run.device] if run.device.type == "cuda" else []):
        torch.manual_seed(a.seed)
        run.policy.eval()
        policy = sampler.hf_policy(run.policy, run.tokenizer, a.max_new_tokens, a.temperature,
                                   a.sample_top_p)
        with run.ctx:
            episodes = rollout.play(policy, run.tokenizer, a.env, seeds, K, runs.env_kwargs(a), 1,
                                    a.max_actions_per_turn, **run.prompt)
    firsts = episodes[::K]
    owner = [e.group for e in episodes]
    scores, lengths = cross_score(run, firsts, episodes)
    diff = logprob_diff(scores, owner, [e.first_reasoning_logprob for e in episodes])
    actions = []  # [P, K, K]: L[k, j] = log p(a_k | x, z_j), within each prompt
    for g in range(a.probe_prompts):
        group = episodes[g * K:(g + 1) * K]
        if a.retokenize:
            turns = [split_answer(e) for e in group]
            contexts, answers = (mi.tokenize(run.tokenizer, list(t)) for t in zip(*turns))
        else:
            contexts = [e.first_prompt_ids + e.first_reasoning_ids for e in group]
            answers = [e.first_answer_ids for e in group]
        with run.ctx:
            L = mi.cross_scores(run.policy, contexts, answers, batch_size=a.micro_batch,
                                temperature=a.temperature, pad_id=run.pad_id)[0]      # [K, K]
        actions.append(L)
        step = logprob_diff(L, list(range(K)), [e.first_answer_logprob for e in group])
        diff = None if diff is None or step is None else max(diff, step)
    out = mi.metrics_with_se(scores, owner, lengths, prompt_keys=[e.first_prompt for e in firsts])
    out.update(mi.action_dependence(torch.stack(actions)))
    out["diagnosis_logprob_diff"] = diff
    out["template_share"] = templates.share_of(episodes, a.env, a.template_kind)
    return {"probe_" + k: v for k, v in out.items() if not k.endswith("upper_bound")}


def split_answer(episode):
    """(X + Z + "</think>", the answer after it) of an episode's first reply as text, for
    --retokenize; an unclosed think gives an empty answer (it scores 0 under every reasoning: no
    dependence)."""
    full = episode.prompt_text + episode.responses[0]
    cut = full.find("</think>", len(episode.first_prompt))
    if cut < 0:
        return full, ""
    cut += len("</think>")
    return full[:cut], full[cut:]
