"""plumbing/probe_set.py: the instruments beside the paper's diagnosis -- the probe set's standard
errors, I(Z; A | X) by cross-scoring within a prompt, the work's MI after a copied input -- against
closed forms, exact enumerations and the plain loop."""
import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mi
from plumbing import probe_set
from test_mi import PROMPTS, _sample_scores, tiny_lm  # noqa: F401 -- tiny_lm: a fixture


def test_the_work_is_scored_after_its_own_copy_as_a_plain_loop_scores_it(tiny_lm):
    """probe_set.work_scores over an LM (cross_scores bound to it) against the definition, one pass a
    pair: a reasoning that begins with its own prompt's copy is scored after the copy, each prompt
    with its own; one that does not (a template, another prompt's copy) is scored whole after each
    bare prompt."""
    model, tokenizer = tiny_lm
    ids = functools.partial(mi.tokenize, tokenizer)
    prompts, copies = ids(PROMPTS[:2]), ids([" a box.", " wall left,"])
    reasonings = ids([" a box. go up", " wall left, push", "r", " a box. no", " wall left, x"])
    owner = [0, 1, 0, 1, 1]  # the fourth copied prompt 0's cells, not its own
    score = functools.partial(mi.cross_scores, model)
    work, lengths, copied = probe_set.work_scores(score, prompts, copies, reasonings, owner)
    assert copied == [True, True, False, False, True]
    for m, (z, j) in enumerate(zip(reasonings, owner)):
        cut = len(copies[j]) if copied[m] else 0
        after = [x + c for x, c in zip(prompts, copies)] if copied[m] else prompts
        want = mi.cross_scores_plain(model, after, [z[cut:]])[0]
        torch.testing.assert_close(work[m], want, atol=1e-5, rtol=0)
        assert lengths[m] == len(z) - cut


def test_probe_metrics_equal_collapse_metrics_and_their_se_is_over_prompts():
    rng = np.random.default_rng(5)
    table = rng.dirichlet(np.full(6, 0.5), size=4)
    scores, owner = _sample_scores(table, 5, rng)
    lengths = rng.integers(1, 9, size=len(owner))
    out, plain = probe_set.metrics_with_se(scores, owner, lengths), mi.collapse_metrics(scores, owner, lengths)
    for key in ("mi_estimate", "mi_seq_estimate", "retrieval_acc", "conditional_entropy",
                "reasoning_entropy", "retrieval_chance"):
        assert out[key] == pytest.approx(plain[key])
    # plain loop: the per-prompt means of matched - marginal, their sample std / sqrt(prompts)
    per_token = scores / lengths[:, None]
    gaps = [per_token[m, owner[m]] - (np.logaddexp.reduce(per_token[m]) - math.log(4))
            for m in range(len(owner))]
    means = [np.mean([g for g, o in zip(gaps, owner) if o == p]) for p in range(4)]
    assert out["mi_estimate_se"] == pytest.approx(np.std(means, ddof=1) / 2)
    single = probe_set.metrics_with_se(scores[owner == 0], owner[owner == 0])  # one prompt: no SE
    assert math.isnan(single["mi_estimate_se"])


def test_action_dependence_closed_form_ends():
    K = 4
    ignore = np.tile(np.array([-1.0, -2.0, -3.0, -0.5])[:, None], (3, 1, K))  # L[k, j] = c_k
    assert probe_set.action_dependence(ignore)["action_mi"] == pytest.approx(0.0, abs=1e-12)
    own_only = np.where(np.eye(K, dtype=bool), 0.0, -np.inf)[None]  # a_k only after z_k
    out = probe_set.action_dependence(own_only)
    assert out["action_mi"] == pytest.approx(math.log(K)) == out["action_mi_upper_bound"]
    # two prompts with per-prompt means 0 and log K: SE = std(0, log K) / sqrt(2) = log K / 2
    both = probe_set.action_dependence(np.concatenate([ignore[:1], own_only]))
    assert both["action_mi"] == pytest.approx(math.log(K) / 2)
    assert both["action_mi_se"] == pytest.approx(math.log(K) / 2)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.data())
def test_action_dependence_never_exceeds_log_k(P, K, data):
    finite = st.floats(-1e4, 0.0, allow_nan=False)
    scores = np.array(data.draw(st.lists(st.lists(st.lists(finite, min_size=K, max_size=K),
                                                  min_size=K, max_size=K), min_size=P, max_size=P)))
    assert probe_set.action_dependence(scores)["action_mi"] <= math.log(K) + 1e-9


def test_action_dependence_expects_the_infonce_bound_below_exact_mi():
    """K = 2 samples (z, a) of one prompt, every pair enumerated with its probability: the
    estimator's expectation (vectorised) equals a plain loop, lies below the exact I(Z; A) and
    below log 2."""
    p_z = np.array([0.5, 0.3, 0.2])
    p_a_given_z = np.array([[0.8, 0.2], [0.3, 0.7], [0.5, 0.5]])
    exact = mi.mutual_information(p_a_given_z, p_z)
    expectation, plain = 0.0, 0.0
    for z1 in range(3):
        for a1 in range(2):
            for z2 in range(3):
                for a2 in range(2):
                    prob = p_z[z1] * p_a_given_z[z1, a1] * p_z[z2] * p_a_given_z[z2, a2]
                    zs, answers = (z1, z2), (a1, a2)
                    L = np.log([[p_a_given_z[zs[j], answers[k]] for j in range(2)] for k in range(2)])
                    expectation += prob * probe_set.action_dependence(L[None])["action_mi"]
                    plain += prob * np.mean([L[k, k] - np.log(np.exp(L[k]).sum()) + math.log(2)
                                             for k in range(2)])
    assert expectation == pytest.approx(plain)
    assert 0.0 < expectation < exact < math.log(2)


def test_action_dependence_approaches_exact_mi_with_many_samples():
    rng = np.random.default_rng(0)
    p_z = rng.dirichlet(np.ones(5))
    p_a_given_z = rng.dirichlet(np.full(3, 0.7), size=5)
    exact = mi.mutual_information(p_a_given_z, p_z)
    P, K = 20, 300
    z = rng.choice(5, size=(P, K), p=p_z)
    a = np.array([[rng.choice(3, p=p_a_given_z[zz]) for zz in row] for row in z])
    L = np.log(p_a_given_z[z[:, None, :], a[:, :, None]])  # [P, K, K]: L[p, k, j] = log p(a_k | z_j)
    out = probe_set.action_dependence(L)
    # the bound's bias shrinks like 1/K; 4 standard errors plus 0.02 for it
    assert out["action_mi"] <= exact + 4 * out["action_mi_se"]
    assert abs(out["action_mi"] - exact) < 4 * out["action_mi_se"] + 0.02


def test_action_dependence_bad_input():
    with pytest.raises(ValueError, match=r"\[P prompts, K, K\]"):
        probe_set.action_dependence(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="finite"):
        probe_set.action_dependence(np.array([[[-np.inf, 0.0], [0.0, 0.0]]]))


# ---------------------------------------------------------------------------- the work's MI
# A toy reader with exact likelihoods: input x in 0..3 (one token), whose reasoning copies a cell
# c(x) = 4 + x // 2 and then works out w = g(c) in {6, 7} from the copy; with probability a the
# whole reasoning is instead a template 8 or 9 (copies nothing), and with probability b the work
# is a coin instead of g(c) (a borrowed way). Its exact log-likelihood of any continuation:

def toy_logp(a, b, prefix, z):
    x, total, seq = prefix[0], 0.0, list(prefix[1:]) + list(z)
    for i, token in enumerate(seq):
        if i == 0:  # after the bare prompt: the copy, or a template
            p = (1 - a) * (token == 4 + x // 2) + (a / 2) * (token in (8, 9))
        else:  # after the copy: the work
            p = (1 - b / 2) if token == 6 + (seq[0] - 4) else b / 2
        if i >= len(prefix) - 1:
            total += math.log(p) if p > 0 else -math.inf
    return total


@pytest.mark.parametrize("a, b", [(0.0, 0.0), (0.0, 0.5), (0.0, 1.0), (0.5, 0.0), (0.5, 0.5),
                                  (1.0, 0.0)])
def test_the_work_mi_is_the_input_dependence_of_what_follows_the_copy(a, b):
    """Every reasoning of every input, each as often as its probability (x 8), so the estimates
    are their expectations exactly: the plain estimate is I(X; Z) and the work's is (1 - a)
    I(X; W), both from mi.mutual_information on the exact tables. Copying restates the input, so
    in the borrowed family (a = 0) the plain estimate stays at H(C) = log 2 whatever b does, while
    the work's falls from log 2 to 0: I(X; Z) = I(X; W) + H(C | W)."""
    reasonings = [[c, w] for c in (4, 5) for w in (6, 7)] + [[8], [9]]
    table = torch.tensor([[math.exp(toy_logp(a, b, [x], z)) for z in reasonings] for x in range(4)])
    samples = [(x, z) for x in range(4) for z, p in zip(reasonings, table[x]) for _ in range(round(8 * p.item()))]
    assert len(samples) == 32
    zs, owner = [z for _, z in samples], [x for x, _ in samples]

    def exact(prompts, rs):
        return (torch.tensor([[toy_logp(a, b, x, z) for x in prompts] for z in rs], dtype=torch.float64),
                torch.tensor([len(z) for z in rs]))

    prompts, copies = [[x] for x in range(4)], [[4 + x // 2] for x in range(4)]
    plain, lengths = exact(prompts, zs)
    work, work_lengths, copied = probe_set.work_scores(exact, prompts, copies, zs, owner)
    assert sum(copied) == round(32 * (1 - a)) and work_lengths.tolist() == [1] * 32
    ways = torch.tensor([[1 - b / 2, b / 2] if x // 2 == 0 else [b / 2, 1 - b / 2] for x in range(4)])
    i_xz, i_xw = mi.mutual_information(table), mi.mutual_information(ways)
    assert mi.collapse_metrics(plain, owner, lengths)["mi_seq_estimate"] == pytest.approx(i_xz, abs=1e-9)
    assert mi.collapse_metrics(work, owner, work_lengths)["mi_seq_estimate"] == pytest.approx((1 - a) * i_xw,
                                                                                           abs=1e-9)
    if a == 0:  # I(X; W) = I(C; W) = log 2 - h(b / 2), and H(C | W) = h(b / 2) makes up the rest
        h = -sum(q * math.log(q) for q in (b / 2, 1 - b / 2) if q > 0)
        assert i_xz == pytest.approx(math.log(2), abs=1e-9)
        assert i_xw == pytest.approx(math.log(2) - h, abs=1e-9)
