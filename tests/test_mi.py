"""Checks for mi.py: closed-form entropies, the cross-score estimators against exact values, and cross-scoring an LM."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mi

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GROUNDED = [[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5]]
TEMPLATE = [[1 / 3] * 3] * 3


# ---------------------------------------------------------------------------------------------------- closed form


def test_worked_example_same_entropy_different_mi():
    for table, h_cond, info in ((GROUNDED, math.log(2), math.log(1.5)), (TEMPLATE, math.log(3), 0.0)):
        marginal = np.mean(table, axis=0)
        assert mi.entropy(marginal) == pytest.approx(math.log(3), abs=1e-12)  # 1.0986 for both policies
        assert mi.conditional_entropy(table) == pytest.approx(h_cond, abs=1e-12)
        assert mi.mutual_information(table) == pytest.approx(info, abs=1e-12)
    assert round(math.log(1.5), 4) == 0.4055 and round(math.log(2), 4) == 0.6931
    assert mi.entropy([0.5, 0.5, 0.0]) == pytest.approx(0.6931, abs=1e-4)


def test_known_values_and_chain_rule():
    n = 5
    assert mi.mutual_information(np.eye(n)) == pytest.approx(math.log(n))  # Z = X: I = H(X) = log N
    assert mi.conditional_entropy(np.eye(n)) == 0.0
    assert mi.mutual_information(np.tile([0.2, 0.3, 0.5], (4, 1))) == pytest.approx(0.0, abs=1e-15)  # independent
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


# ---------------------------------------------------------------------------------------------------- metrics


def test_collapse_metrics_worked_example():
    scores = np.array([[-1.0, -3.0], [-4.0, -2.0], [-2.0, -2.0]])
    out = mi.collapse_metrics(scores, [0, 1, 0])
    assert all(type(v) is float for v in out.values())
    assert out["mi_seq_estimate"] == pytest.approx(0.3775, abs=1e-4) == out["mi_estimate"]
    assert out["conditional_entropy"] == pytest.approx(5 / 3)
    assert out["reasoning_entropy"] == pytest.approx(2.0441, abs=1e-4)
    assert out["retrieval_acc"] == pytest.approx(2.5 / 3)
    assert out["mi_upper_bound"] == pytest.approx(math.log(2)) and "retrieval_acc_top2" not in out  # k < N only
    # the same numbers from torch input
    from_torch = mi.collapse_metrics(torch.tensor(scores), torch.tensor([0, 1, 0]))
    assert from_torch["mi_estimate"] == pytest.approx(out["mi_estimate"])


def test_per_token_matrix_divides_by_length_and_survives_empty_reasoning():
    scores = np.array([[-4.0, -8.0], [0.0, 0.0], [-9.0, -3.0]])  # sample 1 is empty: 0 tokens, score 0
    lengths = np.array([4, 0, 3])
    out = mi.collapse_metrics(scores, [0, 1, 1], lengths)
    per_token = mi.collapse_metrics(scores / np.maximum(lengths, 1)[:, None], [0, 1, 1])
    assert out["mi_estimate"] == pytest.approx(per_token["mi_seq_estimate"])
    assert out["conditional_entropy"] == pytest.approx(per_token["conditional_entropy_seq"])
    assert out["mi_seq_estimate"] == pytest.approx(mi.collapse_metrics(scores, [0, 1, 1])["mi_seq_estimate"])
    assert all(math.isfinite(v) for v in out.values())


def test_zscore_uses_population_std_of_marginal():
    rng = np.random.default_rng(1)
    scores, owner = rng.normal(size=(12, 4)), np.arange(12) % 4
    out = mi.collapse_metrics(scores, owner)
    marginal = np.log(np.exp(scores).sum(1)) - math.log(4)
    assert out["marginal_std_seq"] == pytest.approx(marginal.std())
    assert out["mi_zscore_seq"] == pytest.approx(out["mi_seq_estimate"] / (marginal.std() + 1e-3))


def test_retrieval_ties_share_credit():
    assert mi.retrieval_credit(torch.tensor([[-1.0, -1.0, -3.0]]), [0], k=1).item() == 0.5
    assert mi.retrieval_credit(torch.tensor([[-1.0, -1.0, -3.0]]), [0], k=2).item() == 1.0
    assert mi.retrieval_credit(torch.tensor([[-1.0, -1.0, -3.0]]), [2], k=2).item() == 0.0
    collapsed = np.full((7, 5), -2.5)
    out = mi.collapse_metrics(collapsed, np.arange(7) % 5)
    assert out["retrieval_acc"] == pytest.approx(1 / 5, abs=1e-12)  # exact up to the rounding of a float mean
    assert out["retrieval_acc_top2"] == pytest.approx(2 / 5, abs=1e-12)
    assert out["mi_estimate"] == pytest.approx(0.0, abs=1e-12)


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
    assert out["retrieval_acc"] == pytest.approx(1 / 8) and out["retrieval_acc_top5"] == pytest.approx(5 / 8)
    assert out["reasoning_entropy_seq"] == pytest.approx(out["conditional_entropy_seq"])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 8), st.data())
def test_estimate_never_exceeds_log_n(num_prompts, num_samples, data):
    finite = st.floats(-1e4, 0.0, allow_nan=False)
    scores = np.array(data.draw(st.lists(st.lists(finite, min_size=num_prompts, max_size=num_prompts),
                                         min_size=num_samples, max_size=num_samples)))
    owner = np.array(data.draw(st.lists(st.integers(0, num_prompts - 1), min_size=num_samples, max_size=num_samples)))
    lengths = np.array(data.draw(st.lists(st.integers(0, 50), min_size=num_samples, max_size=num_samples)))
    out = mi.collapse_metrics(scores, owner, lengths)
    for key in ("mi_estimate", "mi_seq_estimate"):
        assert out[key] <= math.log(num_prompts) + 1e-9
    assert 0.0 <= out["retrieval_acc"] <= out.get("retrieval_acc_top2", 1.0) <= 1.0


def test_ema_is_a_pure_state_update():
    assert mi.ema(None, 2.0) == 2.0 and mi.ema(2.0, 4.0) == pytest.approx(2.2)
    z1, state = mi.mi_zscore_ema({"mi_estimate": 0.2, "marginal_std": 0.5})
    z2, state = mi.mi_zscore_ema({"mi_estimate": 0.3, "marginal_std": 1.5}, state)
    assert z1 == pytest.approx(0.2 / 0.501) and state == pytest.approx(0.6) and z2 == pytest.approx(0.4992, abs=1e-4)
    with pytest.raises(ValueError, match="decay"):
        mi.ema(1.0, 2.0, decay=1.0)


# ---------------------------------------------------------------------------------------------------- cross-scoring


@pytest.fixture(scope="module")
def tiny_lm():
    """A random 2-layer Qwen2 and a character-level tokenizer with <think> as one token."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    chars = list("abcdefghijklmnopqrstuvwxyz .,|<>/")
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<unk>", "<think>", "</think>"] + chars)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                        additional_special_tokens=["<think>", "</think>"])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    return model, tokenizer


PROMPTS = ["a box. go up <think>", "wall left, goal far right below <think>", "x<think>"]
REASONINGS = ["go up", "i should push the box right", "", "r", "left left", "down then up"]


def _plain_loop(model, tokenizer, prompts, reasonings):
    """One un-batched forward pass per (prompt, reasoning) pair, no cache."""
    scores = torch.zeros(len(reasonings), len(prompts), dtype=torch.float64)
    for m, z in enumerate(reasonings):
        z_ids = tokenizer(z, add_special_tokens=False)["input_ids"]
        for j, x in enumerate(prompts):
            ids = torch.tensor([tokenizer(x, add_special_tokens=False)["input_ids"] + z_ids])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)  # [T - 1, V]
            per_token = logp.gather(1, ids[0, 1:, None])[:, 0]  # logits[t] predicts token t + 1
            scores[m, j] = per_token[per_token.shape[0] - len(z_ids):].sum()
    return scores


def test_tokenizer_keeps_think_as_one_token(tiny_lm):
    _, tokenizer = tiny_lm
    assert tokenizer("x<think>", add_special_tokens=False)["input_ids"] == [tokenizer.convert_tokens_to_ids("x"), 2]


def test_cross_scores_equal_plain_loop_and_ignore_padding(tiny_lm):
    model, tokenizer = tiny_lm
    model.train()  # cross_scores must switch dropout off itself and restore the mode
    scores, lengths = mi.cross_scores(model, tokenizer, PROMPTS, REASONINGS, batch_size=4)
    assert model.training and scores.shape == (6, 3) and scores.dtype == torch.float32
    assert lengths.tolist() == [len(z) for z in REASONINGS]  # one character = one token
    assert torch.allclose(scores.double(), _plain_loop(model, tokenizer, PROMPTS, REASONINGS), atol=1e-4)
    assert (scores[2] == 0).all()  # empty reasoning
    assert (scores[[0, 1, 3, 4, 5]] < 0).all()
    one_at_a_time, _ = mi.cross_scores(model, tokenizer, PROMPTS, REASONINGS, batch_size=1)
    all_at_once, _ = mi.cross_scores(model, tokenizer, PROMPTS, REASONINGS, batch_size=64)
    assert torch.allclose(one_at_a_time, scores, atol=1e-5) and torch.allclose(all_at_once, scores, atol=1e-5)
    metrics = mi.collapse_metrics(scores, [0, 1, 2, 0, 1, 2], lengths)
    assert all(math.isfinite(v) for v in metrics.values())


def test_identical_prompts_give_zero_mi_and_chance_retrieval(tiny_lm):
    model, tokenizer = tiny_lm
    prompts = ["same board <think>"] * 4
    scores, lengths = mi.cross_scores(model, tokenizer, prompts, REASONINGS[:4] * 2, batch_size=3)
    out = mi.collapse_metrics(scores, np.arange(8) % 4, lengths)
    assert abs(out["mi_estimate"]) < 1e-6 and abs(out["mi_seq_estimate"]) < 1e-6
    assert out["retrieval_acc"] == pytest.approx(0.25, abs=1e-12)  # every sample ties all 4 prompts
    assert out["retrieval_acc_top2"] == pytest.approx(0.5, abs=1e-12)


def test_cross_scores_rejects_bad_input(tiny_lm):
    model, tokenizer = tiny_lm
    with pytest.raises(ValueError, match="batch_size"):
        mi.cross_scores(model, tokenizer, PROMPTS, REASONINGS, batch_size=0)
    with pytest.raises(ValueError, match="at least one token"):
        mi.cross_scores(model, tokenizer, ["", "a"], REASONINGS)
    with pytest.raises(ValueError, match="list of strings"):
        mi.cross_scores(model, tokenizer, "a <think>", REASONINGS)


def test_bench_quick_mode_runs():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_cross_scores.py"), "--quick"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1].split()
    assert last[:2] == ["RESULT", "cross_scores"] and float(last[2]) > 0
