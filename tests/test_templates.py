"""templates.py: the pool (a full product of slots, short, its entropy matching the task reasoning's,
every word one token), exact labels, the quoted task-reasoning entropies recomputed, the closed-form
I(X;Z) = (1 - ALPHA) I_task against mi.mutual_information on explicit tables, and the capped
expectation of the cross-scoring estimate against collapse_metrics on exact likelihoods."""
import json
import math
import os
import random

import numpy as np
import pytest

import envs
import mi
from warmstart import demos, templates, tiny


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer(with_templates=True)


def test_each_pool_is_a_short_full_product_whose_entropy_matches_the_task_reasoning(tok):
    assert templates.POOL_SHAPE
    vocab = tok.get_vocab()
    for world, (a, b, c) in templates.POOL_SHAPE.items():
        if world == templates.COORDS_POOL:  # a real model's (tests/test_grounding.py)
            continue
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


# ------------------------------------------------------------------ surface-matched templates

def surface_table(alpha, eps=None):
    """The explicit p(z | x) of a toy world by brute force: four inputs (uniform) whose task
    reasonings f are A, A, B, C; the suffix " Try u." or " Try d." w.p. 0.1 each after A or B, one of
    them always after C (no plan); a template w.p. alpha is the reasoning of an independent input;
    then, with eps, every reasoning gets a filler enumerated over its 4^5 digit strings."""
    f = ["A", "A", "B", "C"]
    suffix = {g: ({"": 0.8, " Try u.": 0.1, " Try d.": 0.1} if g != "C" else
                  {" Try u.": 0.5, " Try d.": 0.5}) for g in "ABC"}
    task = [{g + s: q for s, q in suffix[g].items()} for g in f]
    rows = []
    for x in range(4):
        row = {}
        for z, q in task[x].items():
            row[z] = row.get(z, 0.0) + (1 - alpha) * q
        for other in range(4):
            for z, q in task[other].items():
                row[z] = row.get(z, 0.0) + alpha * q / 4
        rows.append(row)
    if eps is not None:
        import itertools
        digit = {"0": 1 - eps, **{d: eps / 3 for d in templates.FILLER_DIGITS}}
        fill = {" Think " + " ".join(ds) + ".": math.prod(digit[d] for d in ds)
                for ds in itertools.product("0123", repeat=templates.FILLER_SLOTS)}
        rows = [{z + t: p * q for z, p in row.items() for t, q in fill.items()} for row in rows]
    columns = sorted(set().union(*rows))
    h_s = 0.75 * (templates.binary_entropy(0.2) + 0.2 * math.log(2)) + 0.25 * math.log(2)
    return np.array([[row.get(z, 0.0) for z in columns] for row in rows]), [0.5, 0.25, 0.25], h_s


@pytest.mark.parametrize("eps", [None, 0.3])
def test_the_surface_closed_form_is_the_brute_force_table(eps):
    """I(X;Z), H(Z|X), H(Z) of the mixture from the law of f alone, against the enumerated
    table; H(Z) level in ALPHA, I(X;Z) from I_task to 0 and not linear."""
    found = []
    for alpha in (0.0, 0.25, 0.5, 0.75, 1.0):
        table, probs, h_s = surface_table(alpha, eps)
        closed = templates.surface_mixture(alpha, probs, h_s, eps)
        assert mi.mutual_information(table) == pytest.approx(closed["I_XZ"], abs=1e-9)
        assert mi.conditional_entropy(table) == pytest.approx(closed["H_Z_given_X"], abs=1e-9)
        assert mi.entropy(table.mean(0)) == pytest.approx(closed["H_Z"], abs=1e-9)
        found.append(closed)
    i_task = -sum(p * math.log(p) for p in probs)
    assert found[0]["I_XZ"] == pytest.approx(i_task) and found[-1]["I_XZ"] == pytest.approx(0)
    assert found[2]["I_XZ"] < 0.5 * i_task - 0.05  # not (1 - ALPHA) I_task
    assert max(r["H_Z"] for r in found) == pytest.approx(min(r["H_Z"] for r in found))


def test_the_surface_estimates_are_their_expectation_over_every_batch():
    """E[mi_seq_estimate] and E[reasoning_entropy_seq] of collapse_metrics with exact likelihoods,
    over every batch of N = 3 prompts drawn from the toy's 4 inputs, every owner and every
    reasoning, against surface_estimates; at large N they reach the truth."""
    import itertools
    N = 3
    for alpha in (0.0, 0.4, 1.0):
        table, probs, h_s = surface_table(alpha)
        mi_sum = hz_sum = 0.0
        for batch in itertools.product(range(4), repeat=N):
            for owner in range(N):
                for z in np.nonzero(table[batch[owner]])[0]:
                    weight = table[batch[owner], z] / 4 ** N / N
                    with np.errstate(divide="ignore"):
                        scores = np.log(table[list(batch), z])[None, :]                 # [1, N]
                    out = mi.collapse_metrics(scores, [owner])
                    mi_sum += weight * out["mi_seq_estimate"]
                    hz_sum += weight * out["reasoning_entropy_seq"]
        expected = templates.surface_estimates(alpha, probs, N)
        assert mi_sum == pytest.approx(expected["mi_seq"], abs=1e-9)
        assert hz_sum == pytest.approx(expected["hz_seq"] + h_s, abs=1e-9)
    assert templates.surface_estimates(0.0, probs, N)["mi_seq"] == pytest.approx(
        templates.capped_gap(probs, N))
    assert templates.surface_estimates(0.4, probs, 400)["mi_seq"] == pytest.approx(
        templates.surface_mi(0.4, probs), abs=0.01)


def test_the_filler_holds_the_entropy_it_is_given():
    for target in (0.0, 0.4, 3.67, 5.01):
        eps = templates.filler_eps(target)
        assert templates.filler_entropy(eps) == pytest.approx(target, abs=1e-9) and eps <= 0.75
    with pytest.raises(ValueError, match="a filler holds"):
        templates.filler_eps(7.0)  # more than 5 log 4
    rng = random.Random(0)
    assert templates.filler(0.0)(rng) == " Think 0 0 0 0 0." and rng.random() == random.Random(
        0).random()  # no draw at eps = 0
    texts = [templates.filler(0.5)(rng) for _ in range(2000)]
    assert all(templates.FILLER.fullmatch(t) for t in texts)
    digits = [d for t in texts for d in t.split()[1:]]
    assert abs(sum(d.rstrip(".") != "0" for d in digits) / len(digits) - 0.5) < 0.03
    vocab = tiny.build_tokenizer().get_vocab()  # a digit a token: the length is constant
    assert {" Think", " 0", " 1", " 2", " 3"} <= set(vocab)


def test_surface_templates_are_labelled_exactly(tok):
    """A demonstration turn is labelled a template exactly when its reasoning is not one its own
    layout's demonstrator could write: every task turn unlabelled, a template labelled unless its
    layout has the true one's f; share_of reads the same from played episodes."""
    draw, rng = templates.surface_template(), random.Random(1)
    for world in ("frozenlake", "sokoban"):
        for seed in range(40):
            env = envs.make_env(world)
            env.reset(seed=seed)
            own = demos.describe(env, envs.solve(env) or [])
            task = demos.demonstration(env, rng, template_prior=0.0, filler=templates.filler(0.3))
            z = task.split(" </think>")[0]
            assert not templates.is_surface_template(z, env)
            other = draw(rng, env)
            assert templates.is_surface_template(" " + other, env) == (
                other.split(" Try ")[0] != own.split(" Try ")[0])
            assert demos.describe(env, envs.solve(env) or []) == own  # env untouched
    seeds = range(30)
    played = demos.demonstrations(tok, "frozenlake", seeds, seed=3, max_turns=1,
                                  template_prior=0.5, pool=templates.surface_template())
    labels = [templates.is_surface_template(e.first.reasoning, templates.first_state(e))
              for e in played]
    assert 0 < sum(labels) < len(labels)
    assert templates.share_of(played, "frozenlake", "surface") == sum(labels) / len(labels)
    assert templates.share_of(played, "frozenlake") == 0.0  # no pool sentence among them
    with pytest.raises(ValueError, match="template kind"):
        templates.share_of(played, "frozenlake", "other")


def test_the_families_levels_are_the_closed_forms():
    """grids.FILLER_EPS holds H(Z|X) level: at each ALPHA the filler's entropy is I(X;Z) (the law
    of f over the 40,000 first turns, task_probs: the eps quoted to 4 decimals)."""
    from lab import grids, protocol
    for world, eps in grids.FILLER_EPS.items():
        probs = templates.task_probs(world)
        for alpha, e in zip(protocol.ALPHAS, eps):
            assert templates.filler_eps(templates.surface_mi(alpha, probs)) == pytest.approx(
                e, abs=1e-4), (world, alpha)


def test_the_warm_start_takes_the_surface_kind():
    """A surface-matched warm start needs no new words (its templates are task reasonings); an
    unknown kind is refused before anything is built."""
    _, tok = tiny.load_tiny("frozenlake", warm_start=False, template_prior=0.5,
                            template_kind="surface", filler=0.2)
    assert " me" not in tok.get_vocab()
    with pytest.raises(ValueError, match="template_kind must be one of pool, surface"):
        tiny.load_tiny("frozenlake", warm_start=False, template_kind="shuffled")


def test_the_law_of_f_is_kept_under_a_key_of_the_code_and_read_back_exactly(tmp_path, monkeypatch):
    """task_probs computes the law once and reads it back from .cache/task-law/ the same floats;
    another key (the code changed) or a damaged file computes it anew; a cache it cannot write
    still gives the law."""
    computed = []

    def law(world, prompts=()):
        computed.append(world)
        return {"probs": [0.1, 0.2, 1 / 3, 1 - 0.1 - 0.2 - 1 / 3]}

    monkeypatch.setattr(templates, "task_entropy", law)
    monkeypatch.setattr(templates, "LAW_CACHE", str(tmp_path / "law"))
    templates.task_probs.cache_clear()
    try:
        first = templates.task_probs("frozenlake")
        templates.task_probs.cache_clear()
        assert templates.task_probs("frozenlake") == first and computed == ["frozenlake"]
        (path,) = (tmp_path / "law").glob("*.json")  # beside it, the lock its maker held
        assert path.name == f"frozenlake-{templates.law_key()}.json"
        path.write_text("[0.5, 0.")  # a write cut short
        templates.task_probs.cache_clear()
        assert templates.task_probs("frozenlake") == first and len(computed) == 2
        monkeypatch.setattr(templates, "law_key", lambda: "other")
        templates.task_probs.cache_clear()
        assert templates.task_probs("frozenlake") == first and len(computed) == 3
        monkeypatch.setattr(templates, "LAW_CACHE", str(path / "not-a-folder"))
        templates.task_probs.cache_clear()
        assert templates.task_probs("frozenlake") == first and len(computed) == 4
    finally:
        templates.task_probs.cache_clear()  # the real law for the tests after this one


def test_one_process_computes_the_law_while_another_waits_for_it(tmp_path, monkeypatch):
    """While another process holds the law's lock (computing it), task_probs waits and then reads
    what that one wrote, computing nothing itself (whether it reached the lock before the file
    was written or after)."""
    import fcntl
    import threading

    monkeypatch.setattr(templates, "task_entropy", lambda *a, **k: pytest.fail("computed twice"))
    monkeypatch.setattr(templates, "LAW_CACHE", str(tmp_path))
    path = tmp_path / f"sokoban-{templates.law_key()}.json"
    lock = open(f"{path}.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # the other process is computing it
    templates.task_probs.cache_clear()
    got = {}
    try:
        waiter = threading.Thread(target=lambda: got.update(law=templates.task_probs("sokoban")))
        waiter.start()
        path.write_text(json.dumps([0.25, 0.75]))  # what it wrote
        lock.close()
        waiter.join()
        assert got["law"] == (0.25, 0.75)
    finally:
        templates.task_probs.cache_clear()  # the real law for the tests after this one


def test_the_laws_key_is_the_code_that_makes_the_demonstrations(tmp_path, monkeypatch):
    """law_key changes with any of LAW_SOURCES' files, and only with them."""
    for name in ("envs.py", "worlds/sokoban.py", "warmstart/demos.py", "warmstart/templates.py",
                 "warmstart/tiny.py", "README.md"):
        os.makedirs(tmp_path / os.path.dirname(name), exist_ok=True)
        (tmp_path / name).write_text("a")
    monkeypatch.setattr(templates, "ROOT", str(tmp_path))
    key = templates.law_key()
    (tmp_path / "warmstart" / "tiny.py").write_text("b")
    (tmp_path / "README.md").write_text("b")
    assert templates.law_key() == key
    for name in ("envs.py", "worlds/sokoban.py", "warmstart/demos.py", "warmstart/templates.py"):
        (tmp_path / name).write_text(name)
        assert templates.law_key() != key, name
        key = templates.law_key()
