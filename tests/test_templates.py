"""templates.py: the pool (a full product of slots, short, its entropy matching the task reasoning's,
every word one token), exact labels, the quoted task-reasoning entropies recomputed, the closed-form
I(X;Z) = (1 - ALPHA) I_task against mi.mutual_information on explicit tables, and the capped
expectation of the cross-scoring estimate against collapse_metrics on exact likelihoods."""
import math
import random

import numpy as np
import pytest

import demos
import envs
import mi
import templates
import tiny


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer(with_templates=True)


def test_each_pool_is_a_short_full_product_whose_entropy_matches_the_task_reasoning(tok):
    assert templates.POOL_SHAPE
    vocab = tok.get_vocab()
    for world, (a, b, c) in templates.POOL_SHAPE.items():
        pool = templates.pool(world)
        assert len(set(pool)) == len(pool) == a * b * c  # uniform over it: three uniform slots
        task = templates.TASK[world]
        assert abs(math.log(len(pool)) - (task["i_task"] + task["h_given_x"])) < 0.06, world
        for sentence in pool:
            pieces = tok.convert_ids_to_tokens(tok.encode(" " + sentence))
            assert 4 <= len(pieces) <= 8 and all(p in vocab for p in pieces), sentence
            assert len(pieces) == len(sentence.split()) + 1  # a token a word, and the full stop
    # without a prior the vocabulary is today's: the templates' words are new
    assert " me" in vocab and " me" not in tiny.build_tokenizer().get_vocab()


def test_a_reasoning_is_labelled_exactly():
    pool = templates.pool("frozenlake")
    assert templates.is_template(pool[5], "frozenlake")
    assert templates.is_template(" " + pool[5] + " ", "frozenlake")  # Z begins after "<think>"
    for near in (pool[5].rstrip("."), pool[5] + " Try Up.", pool[5].lower(), "Let me  think.",
                 "Goal: 2 Down, 1 Right.", ""):
        assert not templates.is_template(near, "frozenlake"), near
    outside = [s for s in templates.sentences() if s not in pool]
    assert outside and not any(templates.is_template(s, "frozenlake") for s in outside)
    # each world its own pool
    assert templates.is_template("Now I will think.", "sokoban")
    assert not templates.is_template("Now I will think.", "frozenlake")
    assert templates.template_share([pool[0], "Goal: 1 Up, 0 Right.", pool[1], "x"],
                                    "frozenlake") == 0.5
    assert templates.template_share([], "frozenlake") is None
    with pytest.raises(ValueError, match="no template pool"):
        templates.pool("chess")


@pytest.mark.parametrize("world, seeds", [("frozenlake", 4000), ("sokoban", 3000), ("bandit", 500)])
def test_the_quoted_task_reasoning_entropies_are_the_worlds(world, seeds):
    """TASK's numbers were computed on 40,000 first turns; a tenth of them (bias-corrected: the
    plug-in entropy of a sample is low by about (support - 1) / 2n) agrees, and H(Z_task | X) is
    the closed form of the noise: a plan exists on every first turn."""
    found = templates.task_entropy(world, seeds=range(demos.DEMO_SEEDS, demos.DEMO_SEEDS + seeds))
    assert seeds < templates.TASK_TURNS
    quoted = templates.TASK[world]
    corrected = found["i_task"] + (found["support"] - 1) / (2 * found["samples"])
    assert abs(corrected - quoted["i_task"]) < 0.05
    moves = len(envs.make_env(world).actions)
    assert found["h_given_x"] == pytest.approx(templates.noise_entropy(True, moves), abs=1e-9)
    assert quoted["h_given_x"] == pytest.approx(found["h_given_x"], abs=5e-4)
    for n, gap in quoted["gap"].items():
        assert abs(found["gap"][n] - gap) < 0.06 and gap <= math.log(n)


def demonstration_table(alpha, seeds=range(300)):
    """The explicit p(z | x) of FrozenLake's first demonstration turn at template prior alpha:
    one row per sampled layout (uniform p(x)), one column per reasoning text: the task's
    f(x) alone (1 - noise), f(x) + " Try d." (noise / 4 each), or a pool sentence (1 / n)."""
    rows = []
    for seed in seeds:
        env = envs.make_env("frozenlake")
        env.reset(seed=seed)
        task = demos.describe(env, envs.solve(env))
        probs = {task: (1 - alpha) * (1 - templates.NOISE)}
        probs.update({f"{task} Try {d}.": (1 - alpha) * templates.NOISE / 4 for d in env.actions})
        probs.update({z: alpha / len(templates.pool("frozenlake"))
                      for z in templates.pool("frozenlake")})
        rows.append(probs)
    columns = sorted(set().union(*rows))
    return np.array([[row.get(z, 0.0) for z in columns] for row in rows]), rows


def test_closed_form_is_the_mi_of_the_explicit_table():
    _, rows = demonstration_table(0.0)
    f = [next(iter(row)) for row in rows]  # each layout's task reasoning, its first key
    counts = np.unique(f, return_counts=True)[1] / len(f)
    i_task = -(counts * np.log(counts)).sum()  # H(f(X)) over these layouts
    h_noise = templates.noise_entropy(True, 4)
    log_n = math.log(len(templates.pool("frozenlake")))
    for alpha in (0.0, 0.25, 0.5, 0.75, 1.0):
        table, _ = demonstration_table(alpha)
        closed = templates.mixture(alpha, i_task, h_noise, log_n)
        assert mi.mutual_information(table) == pytest.approx(closed["I_XZ"], abs=1e-9)
        assert mi.mutual_information(table) == pytest.approx((1 - alpha) * i_task, abs=1e-9)
        assert mi.conditional_entropy(table) == pytest.approx(closed["H_Z_given_X"], abs=1e-9)
        assert mi.entropy(table.mean(0)) == pytest.approx(closed["H_Z"], abs=1e-9)
    # a toy table by hand: two inputs with different task reasonings, a pool of two, alpha 1/2
    toy = [[0.5, 0.0, 0.25, 0.25], [0.0, 0.5, 0.25, 0.25]]
    assert mi.mutual_information(toy) == pytest.approx(0.5 * math.log(2))


def test_the_capped_gap_is_the_expected_estimate_under_the_demonstrations():
    """N prompts drawn from a distribution of task reasonings f, each sample a template (prob
    alpha, one of n) or its prompt's f; scored with the exact likelihoods, collapse_metrics'
    mi_seq_estimate averages to (1 - alpha) G(N)."""
    probs, alpha, n, N = [0.5, 0.3, 0.2], 0.4, 6, 4
    rng = random.Random(0)
    estimates = []
    for _ in range(3000):
        fs = rng.choices(range(3), probs, k=N)
        owner = rng.randrange(N)
        z = ("template", rng.randrange(n)) if rng.random() < alpha else ("task", fs[owner])
        like = [alpha / n if z[0] == "template" else (1 - alpha) * (f == z[1]) for f in fs]
        with np.errstate(divide="ignore"):
            scores = np.log([like])                                                   # [1, N]
        estimates.append(mi.collapse_metrics(scores, [owner])["mi_seq_estimate"])
    mean, se = np.mean(estimates), np.std(estimates) / math.sqrt(len(estimates))
    expected = (1 - alpha) * templates.capped_gap(probs, N)
    assert abs(mean - expected) < 3 * se and expected < math.log(N)
    assert templates.capped_gap([1.0], 8) == pytest.approx(0.0)  # one f: no prompt stands out
    assert templates.capped_gap([1 / 64] * 64, 8) < math.log(8)


def test_truth_holds_the_closed_forms_of_the_quoted_numbers():
    out = templates.truth("frozenlake", 0.25)
    task = templates.TASK["frozenlake"]
    assert out["I_XZ"] == pytest.approx(0.75 * task["i_task"])
    assert out["mi_seq_estimate_N8"] == pytest.approx(0.75 * task["gap"][8])
    level = [templates.truth("sokoban", a)["H_Z"] - templates.binary_entropy(a)
             for a in (0, 0.5, 1)]
    assert max(level) - min(level) < 0.02  # log n matches H(Z_task): H(Z) level but for h(alpha)
    with pytest.raises(ValueError):
        templates.mixture(1.5, 1.0, 1.0, 1.0)
