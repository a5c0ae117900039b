"""Checks for mi.py: closed-form entropies, the cross-score estimators against exact values, and
cross-scoring an LM."""
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mi
from conftest import tiny_qwen2

GROUNDED = [[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5]]
TEMPLATE = [[1 / 3] * 3] * 3


# -------------------------------------------------------------------------------------- closed form


def test_worked_example_same_entropy_different_mi():
    for table, h_cond, info in ((GROUNDED, math.log(2), math.log(1.5)),
                                (TEMPLATE, math.log(3), 0.0)):
        marginal = np.mean(table, axis=0)
        assert mi.entropy(marginal) == pytest.approx(math.log(3), abs=1e-12)   # the same H(Z)
        assert mi.conditional_entropy(table) == pytest.approx(h_cond, abs=1e-12)
        assert mi.mutual_information(table) == pytest.approx(info, abs=1e-12)
    assert mi.entropy([0.5, 0.5, 0.0]) == pytest.approx(math.log(2), abs=1e-12)   # 0 log 0 = 0


def test_known_values_and_chain_rule():
    n = 5
    assert mi.mutual_information(np.eye(n)) == pytest.approx(math.log(n))  # Z = X: I = log N
    assert mi.conditional_entropy(np.eye(n)) == 0.0
    independent = np.tile([0.2, 0.3, 0.5], (4, 1))
    assert mi.mutual_information(independent) == pytest.approx(0.0, abs=1e-15)
    rng = np.random.default_rng(0)
    for _ in range(20):
        table = rng.dirichlet(np.full(6, 0.3), size=4)
        table[0, :2] = 0.0  # zero probabilities: 0 log 0 = 0
        table[0] /= table[0].sum()
        prior = rng.dirichlet(np.ones(4))
        h_z = mi.entropy(prior @ table)
        chain = mi.conditional_entropy(table, prior) + mi.mutual_information(table, prior)
        assert h_z == pytest.approx(chain, abs=1e-12)
        assert 0.0 <= mi.mutual_information(table, prior) <= min(h_z, mi.entropy(prior)) + 1e-12


def test_closed_form_accepts_torch_and_rejects_bad_input():
    assert mi.mutual_information(torch.tensor(GROUNDED)) == pytest.approx(math.log(1.5), abs=1e-6)
    with pytest.raises(ValueError, match="sum to 1"):
        mi.entropy([0.5, 0.4])
    with pytest.raises(ValueError, match="non-negative"):
        mi.conditional_entropy([[1.5, -0.5]])
    with pytest.raises(ValueError, match="shape"):
        mi.mutual_information([0.5, 0.5])
    with pytest.raises(ValueError, match="p_x"):
        mi.mutual_information(GROUNDED, p_x=[0.5, 0.5])


# ------------------------------------------------------------------------------------------ metrics


def test_collapse_metrics_worked_example():
    scores = np.array([[-1.0, -3.0], [-4.0, -2.0], [-2.0, -2.0]])
    out = mi.collapse_metrics(scores, [0, 1, 0])
    assert all(type(v) is float for v in out.values())
    assert out["mi_seq_estimate"] == pytest.approx(0.3775, abs=1e-4) == out["mi_estimate"]
    assert out["conditional_entropy"] == pytest.approx(5 / 3)
    assert out["reasoning_entropy"] == pytest.approx(2.0441, abs=1e-4)
    assert out["retrieval_acc"] == pytest.approx(2.5 / 3)
    assert out["retrieval_chance"] == 0.5
    assert out["mi_upper_bound"] == pytest.approx(math.log(2))
    assert "retrieval_acc_top2" not in out                                 # k < N only
    # the same numbers from torch input
    from_torch = mi.collapse_metrics(torch.tensor(scores), torch.tensor([0, 1, 0]))
    assert from_torch == pytest.approx(out)


def test_per_token_matrix_divides_by_length_and_survives_empty_reasoning():
    scores = np.array([[-4.0, -8.0], [0.0, 0.0], [-9.0, -3.0]])   # sample 1: 0 tokens, score 0
    lengths = np.array([4, 0, 3])
    out = mi.collapse_metrics(scores, [0, 1, 1], lengths)
    per_token = mi.collapse_metrics(scores / np.maximum(lengths, 1)[:, None], [0, 1, 1])
    assert out["mi_estimate"] == pytest.approx(per_token["mi_seq_estimate"])
    assert out["conditional_entropy"] == pytest.approx(per_token["conditional_entropy_seq"])
    summed = mi.collapse_metrics(scores, [0, 1, 1])["mi_seq_estimate"]
    assert out["mi_seq_estimate"] == pytest.approx(summed)
    assert all(math.isfinite(v) for v in out.values())


def test_zscore_uses_population_std_of_marginal():
    rng = np.random.default_rng(1)
    scores, owner = rng.normal(size=(12, 4)), np.arange(12) % 4
    out = mi.collapse_metrics(scores, owner)
    marginal = np.log(np.exp(scores).sum(1)) - math.log(4)
    assert out["marginal_std_seq"] == pytest.approx(marginal.std())
    assert out["mi_zscore_seq"] == pytest.approx(out["mi_seq_estimate"] / (marginal.std() + 1e-3))


def test_retrieval_ties_share_credit():
    tie = torch.tensor([[-1.0, -1.0, -3.0]])
    assert mi.retrieval_credit(tie, [0], k=1).item() == 0.5
    assert mi.retrieval_credit(tie, [0], k=2).item() == 1.0
    assert mi.retrieval_credit(tie, [2], k=2).item() == 0.0
    collapsed = np.full((7, 5), -2.5)
    out = mi.collapse_metrics(collapsed, np.arange(7) % 5)
    assert out["retrieval_acc"] == pytest.approx(1 / 5, abs=1e-12)   # up to a float mean's rounding
    assert out["retrieval_acc_top2"] == pytest.approx(2 / 5, abs=1e-12)
    assert out["mi_estimate"] == pytest.approx(0.0, abs=1e-12)


def _random_tiebreak_credit(row, own_col, k, keys):
    """Average over every order of the columns of: stable sort by score (so the order breaks the
    ties uniformly), is a column with the owner's key among the first k?"""
    n = len(row)
    hits = []
    for perm in itertools.permutations(range(n)):
        ranked = sorted(perm, key=lambda j: -row[j])
        hits.append(any(keys[j] == keys[own_col] for j in ranked[:k]))
    return sum(hits) / len(hits)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 5), st.data())
def test_retrieval_credit_equals_random_tiebreak_enumeration(n, data):
    row = data.draw(st.lists(st.sampled_from([-3.0, -2.0, -1.0]), min_size=n, max_size=n))
    keys = data.draw(st.lists(st.sampled_from("abc"), min_size=n, max_size=n))
    own = data.draw(st.integers(0, n - 1))
    for k in range(1, n + 1):
        got = mi.retrieval_credit(torch.tensor([row]), [own], k, prompt_keys=keys).item()
        assert got == pytest.approx(_random_tiebreak_credit(row, own, k, keys), abs=1e-12)
        plain = mi.retrieval_credit(torch.tensor([row]), [own], k).item()   # all distinct
        assert plain == pytest.approx(_random_tiebreak_credit(row, own, k, range(n)), abs=1e-12)


def test_repeated_prompts_count_as_one_target_as_the_official_metric():
    """Columns of identical prompts score identically; with keys, the official rule -- the arg-max
    column (first maximum) or any of the top k columns holds the owner's prompt -- is matched."""
    rng = np.random.default_rng(4)
    keys = ["a", "b", "c", "d", "a", "b", "c", "d"]                  # Bandit: 4 prompts, 8 groups
    distinct = rng.normal(size=(40, 4))
    scores = distinct[:, [0, 1, 2, 3, 0, 1, 2, 3]]                   # [M, 8] copies tie exactly
    owner = rng.integers(0, 8, size=40)
    out = mi.collapse_metrics(scores, owner, prompt_keys=keys, topk=(2, 4))
    key = np.array([ord(c) for c in keys])
    official = (key[np.argmax(scores, axis=1)] == key[owner]).mean()
    assert out["retrieval_acc"] == pytest.approx(official)
    for k in (2, 4):
        top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        hit = (key[top] == key[owner][:, None]).any(1).mean()
        assert out[f"retrieval_acc_top{k}"] == pytest.approx(hit)
    assert out["retrieval_chance"] == pytest.approx(2 / 8)           # each prompt twice
    # without keys a sample whose prompt wins splits the tie with its copy
    assert mi.collapse_metrics(scores, owner)["retrieval_acc"] == pytest.approx(official / 2)


def test_collapsed_policy_with_repeated_prompts_scores_the_chance_level():
    keys = ["a", "a", "a", "b", "c", "c"]                            # counts 3, 1, 2 of N = 6
    owner = np.arange(6)
    out = mi.collapse_metrics(np.full((6, 6), -4.0), owner, prompt_keys=keys, topk=(2,))
    chance = np.mean([3 / 6] * 3 + [1 / 6] + [2 / 6] * 2)
    assert out["retrieval_chance"] == pytest.approx(chance)
    assert out["retrieval_acc"] == pytest.approx(chance)
    # top 2 of 6 tied columns holds one of c own columns with probability 1 - C(6-c, 2) / C(6, 2)
    top2 = np.mean([1 - math.comb(6 - c, 2) / 15 for c in (3, 3, 3, 1, 2, 2)])
    assert out["retrieval_acc_top2"] == pytest.approx(top2)
    with pytest.raises(ValueError, match="prompt_keys"):
        mi.collapse_metrics(np.zeros((2, 2)), [0, 1], prompt_keys=["a"])


def test_single_prompt_gives_defined_values():
    out = mi.collapse_metrics([[-2.0], [-5.0]], [0, 0], lengths=[2, 5])
    assert out["mi_estimate"] == 0.0 and out["mi_seq_estimate"] == 0.0 == out["mi_upper_bound"]
    assert out["retrieval_acc"] == 1.0 == out["retrieval_chance"]
    assert out["conditional_entropy_seq"] == 3.5 == out["reasoning_entropy_seq"]
    assert out["conditional_entropy"] == 1.0 and out["marginal_std_seq"] == 1.5
    assert not any(k.startswith("retrieval_acc_top") for k in out)


def test_bad_metric_input_raises():
    with pytest.raises(ValueError, match="owner"):
        mi.collapse_metrics(np.zeros((2, 2)), [0, 2])
    with pytest.raises(ValueError, match="shape"):
        mi.collapse_metrics(np.zeros(3), [0, 0, 0])
    with pytest.raises(ValueError, match="NaN"):
        mi.collapse_metrics(np.array([[0.0, np.nan]]), [0])
    with pytest.raises(ValueError, match="matched"):
        mi.collapse_metrics(np.array([[-np.inf, 0.0]]), [0])
    with pytest.raises(ValueError, match="lengths"):
        mi.collapse_metrics(np.zeros((2, 2)), [0, 1], lengths=[1, -1])


def _sample_scores(table, per_prompt, rng):
    """Sample z ~ p(z|x_j) for every prompt; score each sample exactly under every prompt."""
    num_prompts = table.shape[0]
    owner = np.repeat(np.arange(num_prompts), per_prompt)
    z = np.array([rng.choice(table.shape[1], p=table[j]) for j in owner])
    with np.errstate(divide="ignore"):
        return np.log(table[:, z].T), owner  # [M, N]; -inf where p(z|x_j) = 0


def test_sampled_estimate_matches_exact_mi_and_bayes_retrieval():
    rng = np.random.default_rng(2)
    num_prompts, per_prompt = 6, 400
    table = rng.dirichlet(np.full(10, 0.4), size=num_prompts)
    scores, owner = _sample_scores(table, per_prompt, rng)
    out = mi.collapse_metrics(scores, owner)
    matched = scores[np.arange(len(owner)), owner]
    marginal = np.logaddexp.reduce(scores, axis=1) - math.log(num_prompts)
    se = (matched - marginal).std() / math.sqrt(len(owner))
    assert abs(out["mi_seq_estimate"] - mi.mutual_information(table)) < 4 * se
    bayes = table.max(axis=0).sum() / num_prompts  # sum_z max_x p(z|x) / N
    credit = mi.retrieval_credit(torch.tensor(scores), owner).numpy()
    assert abs(out["retrieval_acc"] - bayes) < 4 * credit.std() / math.sqrt(len(owner)) + 1e-9
    assert out["retrieval_acc"] > 2 / num_prompts  # a grounded table is well above chance


def test_collapsed_table_gives_zero_mi_and_chance_retrieval():
    rng = np.random.default_rng(3)
    table = np.tile(rng.dirichlet(np.ones(10)), (8, 1))  # every prompt has the same p(z|x)
    out = mi.collapse_metrics(*_sample_scores(table, 50, rng))
    assert out["mi_seq_estimate"] == pytest.approx(0.0, abs=1e-12)
    assert out["retrieval_acc"] == pytest.approx(1 / 8) == out["retrieval_chance"]
    assert out["retrieval_acc_top4"] == pytest.approx(4 / 8)
    assert out["reasoning_entropy_seq"] == pytest.approx(out["conditional_entropy_seq"])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 8), st.data())
def test_estimate_never_exceeds_log_n(num_prompts, num_samples, data):
    finite = st.floats(-1e4, 0.0, allow_nan=False)
    rows = st.lists(finite, min_size=num_prompts, max_size=num_prompts)
    scores = np.array(data.draw(st.lists(rows, min_size=num_samples, max_size=num_samples)))
    owner = np.array(data.draw(st.lists(st.integers(0, num_prompts - 1), min_size=num_samples,
                                        max_size=num_samples)))
    lengths = np.array(data.draw(st.lists(st.integers(0, 50), min_size=num_samples,
                                          max_size=num_samples)))
    out = mi.collapse_metrics(scores, owner, lengths)
    for key in ("mi_estimate", "mi_seq_estimate"):
        assert out[key] <= math.log(num_prompts) + 1e-9
    assert 0.0 <= out["retrieval_acc"] <= out.get("retrieval_acc_top2", 1.0) <= 1.0


def test_ema_is_a_pure_state_update():
    assert mi.ema(None, 2.0) == 2.0 and mi.ema(2.0, 4.0) == pytest.approx(2.2)
    z1, state = mi.mi_zscore_ema({"mi_estimate": 0.2, "marginal_std": 0.5})
    z2, state = mi.mi_zscore_ema({"mi_estimate": 0.3, "marginal_std": 1.5}, state)
    assert z1 == pytest.approx(0.2 / 0.501) and state == pytest.approx(0.6)
    assert z2 == pytest.approx(0.3 / 0.601)
    seq, _ = mi.mi_zscore_ema({"mi_seq_estimate": 2.0, "marginal_std_seq": 4.0}, seq=True)
    assert seq == pytest.approx(2.0 / 4.001)
    with pytest.raises(ValueError, match="decay"):
        mi.ema(1.0, 2.0, decay=1.0)


# ------------------------------------------------------------------------------------ cross-scoring


@pytest.fixture(scope="module")
def tiny_lm():
    """A random 2-layer Qwen2 and a character-level tokenizer with <think> as one token."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list("abcdefghijklmnopqrstuvwxyz .,|<>/")
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<unk>", "<think>", "</think>"] + chars)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                        additional_special_tokens=["<think>", "</think>"])
    return tiny_qwen2(len(vocab)), tokenizer


PROMPTS = ["a box. go up <think>", "wall left, goal far right below <think>", "x<think>"]
REASONINGS = ["go up", "i should push the box right", "", "r", "left left", "down then up"]


def _plain_loop(model, tokenizer, prompts, reasonings, temperature=1.0):
    """One un-batched forward pass per (prompt, reasoning) pair, no cache."""
    scores = torch.zeros(len(reasonings), len(prompts), dtype=torch.float64)
    for m, z in enumerate(reasonings):
        z_ids = tokenizer(z, add_special_tokens=False)["input_ids"]
        for j, x in enumerate(prompts):
            ids = torch.tensor([tokenizer(x, add_special_tokens=False)["input_ids"] + z_ids])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, :-1].double()
            per_token = torch.log_softmax(logits / temperature, -1).gather(1, ids[0, 1:, None])[:, 0]
            scores[m, j] = per_token[per_token.shape[0] - len(z_ids):].sum()   # z's tokens only
    return scores


def _scores(model, tokenizer, prompts, reasonings, **kw):
    """cross_scores of texts, tokenised as the plain loop does."""
    return mi.cross_scores(model, mi.tokenize(tokenizer, prompts), mi.tokenize(tokenizer, reasonings),
                           pad_id=tokenizer.pad_token_id or 0, **kw)


def test_cross_scores_equal_plain_loop_and_ignore_padding(tiny_lm):
    model, tokenizer = tiny_lm
    model.train()  # cross_scores must switch dropout off itself and restore the mode
    scores, lengths = _scores(model, tokenizer, PROMPTS, REASONINGS, batch_size=4)
    model.eval()
    assert scores.shape == (6, 3) and scores.dtype == torch.float64
    assert lengths.tolist() == [len(z) for z in REASONINGS]  # one character = one token
    want = _plain_loop(model, tokenizer, PROMPTS, REASONINGS)
    assert torch.allclose(scores.double(), want, atol=1e-4)
    plain = mi.cross_scores_plain(model, mi.tokenize(tokenizer, PROMPTS), mi.tokenize(tokenizer, REASONINGS))
    assert torch.allclose(plain, want, atol=1e-9)  # the module's definition is this loop
    assert (scores[2] == 0).all()  # empty reasoning
    assert (scores[[0, 1, 3, 4, 5]] < 0).all()
    one_at_a_time, _ = _scores(model, tokenizer, PROMPTS, REASONINGS, batch_size=1)
    all_at_once, _ = _scores(model, tokenizer, PROMPTS, REASONINGS, batch_size=64)
    assert torch.allclose(one_at_a_time, scores, atol=1e-5)
    assert torch.allclose(all_at_once, scores, atol=1e-5)


def test_cross_scores_score_under_the_sampling_temperature(tiny_lm):
    """Reasonings sampled at temperature T were written by softmax(logits / T): that is the p(z | x)
    the estimate needs, not the T = 1 softmax."""
    model, tokenizer = tiny_lm
    scores, _ = _scores(model, tokenizer, PROMPTS, REASONINGS, batch_size=4, temperature=0.5)
    want = _plain_loop(model, tokenizer, PROMPTS, REASONINGS, temperature=0.5)
    assert torch.allclose(scores.double(), want, atol=1e-4)
    assert not torch.allclose(want, _plain_loop(model, tokenizer, PROMPTS, REASONINGS), atol=1e-2)


def test_cross_scores_restores_training_mode(tiny_lm):
    model, tokenizer = tiny_lm
    for mode in (True, False):
        model.train(mode)
        _scores(model, tokenizer, PROMPTS[:1], REASONINGS[:1])
        assert model.training is mode
    model.eval()


def test_identical_prompts_give_zero_mi_and_chance_retrieval(tiny_lm):
    model, tokenizer = tiny_lm
    prompts = ["same board <think>"] * 4
    scores, lengths = _scores(model, tokenizer, prompts, REASONINGS[:4] * 2, batch_size=3)
    out = mi.collapse_metrics(scores, np.arange(8) % 4, lengths)
    assert abs(out["mi_estimate"]) < 1e-6 and abs(out["mi_seq_estimate"]) < 1e-6
    assert out["retrieval_acc"] == pytest.approx(0.25, abs=1e-12)  # each ties all 4 prompts
    assert out["retrieval_acc_top2"] == pytest.approx(0.5, abs=1e-12)
    # keyed by their text the four prompts are one target: always retrieved, and so is chance
    keyed = mi.collapse_metrics(scores, np.arange(8) % 4, lengths, prompt_keys=prompts)
    assert keyed["retrieval_acc"] == 1.0 and keyed["retrieval_chance"] == 1.0


def test_cross_scores_rejects_bad_input(tiny_lm):
    model, tokenizer = tiny_lm
    with pytest.raises(ValueError, match="batch_size"):
        _scores(model, tokenizer, PROMPTS, REASONINGS, batch_size=0)
    with pytest.raises(ValueError, match="at least one token"):
        _scores(model, tokenizer, ["", "a"], REASONINGS)
    with pytest.raises(ValueError, match="list of strings"):
        mi.tokenize(tokenizer, "a <think>")
    with pytest.raises(ValueError, match="token-id lists"):
        mi.cross_scores(model, "a <think>", [[1, 2]])
    with pytest.raises(ValueError, match="token-id lists"):
        mi.cross_scores(model, [[1, 2]], [[1, "2"]])


# ----------------------------------------------------------------- the probe set: standard errors


# ------------------------------------------------------------ reasoning -> action: I(Z; A | X)


