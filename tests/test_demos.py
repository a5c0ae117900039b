"""demos.py: what the tiny policy sees (grid + positions line), the demonstrations it is taught
(valid, the solver's moves, imperfect on purpose), and behaviour cloning (the loss over policy
tokens, length-sorted batches, a resumable schedule, tested through tiny.load_tiny in
test_tiny.py)."""
import random
import re

import pytest
import torch

import envs
import rollout
from warmstart import demos, templates, tiny


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer()


def small_model(tokenizer):
    return tiny.build_model(tokenizer, hidden_size=32, intermediate_size=64)


def test_the_user_turn_is_the_grid_and_the_positions_line(tok):
    assert envs.positions("sokoban", "######\n#P_XO#\n######") == (
        "Player (1,1), box (1,3), target (1,4). Box: 0 Down, 2 Right. Target: 0 Down, 1 Right. "
        "Around: Up wall, Down wall, Left wall, Right floor.")
    # two boxes: no ways
    assert envs.positions("sokoban", "######\n#PXXO#\n#O___#\n######").endswith(
        "target (1,4), (2,1). Around: Up wall, Down target, Left wall, Right box.")
    # off the grid is wall
    assert envs.around("P_") == "Around: Up wall, Down wall, Left wall, Right floor."
    assert rollout.prompts("bandit", tiny=True)["user"]("Phoenix: pays 0.1", 0.0, 1, 1) == "Phoenix: pays 0.1"
    text = rollout.prompts("frozenlake", tiny=True)["user"]("P_\n_G", 0.5, 7, 2)
    # no turn, reward or count text
    assert text == "P_\n_G\nPlayer (0,0), goal (1,1). Goal: 1 Down, 1 Right."
    # words, each with the space before it
    assert {"Player", " goal", " Goal", " Down"} <= set(tok.convert_ids_to_tokens(tok.encode(text)))
    env = envs.make_env("sokoban")
    lengths = set()
    # every turn of a world has the same shape: the line sits at a fixed distance
    for seed in range(20):
        obs, _ = env.reset(seed=seed)
        lengths.add(len(tok.encode(rollout.prompts("sokoban", tiny=True)["user"](obs, 0.0, 10, 1))))
    assert len(lengths) == 1
    episode = demos.demonstrations(tok, "frozenlake", [3])[0]
    # demonstrations use the same prompts
    assert "Goal: 2 Down, 1 Right.<|im_end|>" in tok.decode(episode.ids)


@pytest.mark.parametrize("world", ["countdown", "wordproblems"])
def test_an_answer_worlds_reasoning_works_the_solvers_arithmetic_out_step_by_step(world):
    """Every step "a op b = c" of the reasoning is right, each starts from the result before it,
    the last result is the answer, and the answer is the solver's, which the world rewards with 1;
    a noisy turn tries the world's random answer ("Try ..."), the reasoning still the task's."""
    env, rng, noisy = envs.make_env(world), random.Random(0), 0
    for seed in range(200):
        env.reset(seed=seed)
        (plan,) = envs.solve(env)
        text = demos.demonstration(env, rng, noise=0.2)
        think, (answer,), valid = envs.parse_response("<think>" + text, None)
        steps = re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)", think)
        assert valid and len(steps) == (env.count - 1 if world == "countdown" else env.operations)
        for k, (a, op, b, c) in enumerate(steps):
            assert int(c) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
            assert k == 0 or a == steps[k - 1][3]
        assert int(steps[-1][3]) == (env.target if world == "countdown" else env.answer)
        if think.endswith(f"Try {answer}."):
            noisy += 1
        else:
            assert answer == plan and env.step(answer)[1] == 1.0
    assert 20 < noisy < 70  # 0.2 of 200 turns try a random answer


def test_demonstrations_are_valid_and_imperfect(tok):
    env = envs.make_env("frozenlake")
    env.reset(seed=3)
    rng = random.Random(1)
    plan = envs.solve(env)
    for _ in range(20):
        text = demos.demonstration(env, rng, noise=0.0)
        think, actions, valid = envs.parse_response("<think>" + text, env.actions)
        assert valid and actions == plan[:len(actions)] and 1 <= len(actions) <= 2
        # the way from the player at (1,0) to the goal at (3,1)
        assert think == "Goal: 2 Down, 1 Right."
    noisy = [envs.parse_response("<think>" + demos.demonstration(env, rng, noise=1.0), env.actions)
             for _ in range(40)]
    assert all(t.endswith(f"Try {a[0]}.") and len(a) == 1 for t, a, _ in noisy)
    assert len({a[0] for _, a, _ in noisy}) > 1  # random moves, not the plan
    episodes = demos.demonstrations(tok, "frozenlake", range(30), noise=0.0)
    # the solver's moves, one or two a turn, reach the goal in 5 turns
    assert all(e.success for e in episodes)
    assert all(e.turn_rewards.count(rollout.FORMAT_PENALTY) == 0 for e in episodes)
    stuck = envs.Sokoban(room="#####\n#X_O#\n#P__#\n#####")  # the box sits in a corner: no solution
    stuck.reset()
    assert envs.solve(stuck) is None and demos.describe(stuck, []) == "Stuck."


def test_a_template_prior_replaces_the_reasoning_and_keeps_the_solvers_answer(tok):
    """With probability ALPHA a turn reasons with a pool sentence and still plays the solver's next
    1 or 2 moves; without a prior the random stream, and so every demonstration, is as before."""
    pool = templates.pool("frozenlake")
    env = envs.make_env("frozenlake")
    env.reset(seed=3)
    plan = envs.solve(env)
    rng = random.Random(2)
    for _ in range(50):
        think, actions, valid = envs.parse_response(
            "<think>" + demos.demonstration(env, rng, noise=1.0, template_prior=1.0, pool=pool),
            env.actions)
        assert think in pool and valid and actions == plan[:len(actions)] and len(actions) in (1, 2)
    turns = [demos.demonstration(env, rng, template_prior=0.3, pool=pool) for _ in range(2000)]
    share = templates.template_share([t.split(" </think>")[0] for t in turns], "frozenlake")
    assert abs(share - 0.3) < 4 * (0.3 * 0.7 / 2000) ** 0.5
    assert len({t.split(" </think>")[0] for t in turns} & set(" " + z for z in pool)) > 40
    # no prior: the draws of the demonstrations before the prior existed (pinned from that code)
    rng = random.Random(7)
    answers = [demos.demonstration(env, rng, template_prior=0.0, pool=pool).split("<answer> ")[1][:-10]
               for _ in range(12)]
    assert answers == ["Down", "Down", "Up", "Down", "Down", "Right", "Down", "Right", "Up", "Down",
                       "Down || Down", "Down"]
    taught = demos.demonstrations(tok, "frozenlake", range(6), template_prior=1.0, pool=pool)
    assert all(e.first.reasoning.strip() in pool for e in taught)


def test_demo_loss_equals_plain_loop_over_policy_tokens(tok):
    model = small_model(tok).eval()
    batch = rollout.collate(demos.demonstrations(tok, "bandit", range(3)), tok.pad_token_id)
    with torch.no_grad():
        # [B, T, V]
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        total, count = 0.0, 0
        for b in range(len(batch["input_ids"])):
            for t in range(1, batch["input_ids"].shape[1]):
                if batch["policy_mask"][b, t] > 0:  # only the policy's own tokens are scored
                    total -= torch.log_softmax(logits[b, t - 1], -1)[batch["input_ids"][b, t]].item()
                    count += 1
        assert demos.demo_loss(model, batch).item() == pytest.approx(total / count, rel=1e-5)


def test_short_warm_start_lowers_demonstration_loss(tok):
    model = small_model(tok)
    # short episodes
    held_out = rollout.collate(demos.demonstrations(tok, "bandit", range(8)), tok.pad_token_id)
    with torch.no_grad():
        before = demos.demo_loss(model, held_out).item()
    losses = demos.imitate(model, tok, "bandit", steps=12, batch_size=4, lr=1e-2)
    with torch.no_grad():
        after = demos.demo_loss(model, held_out).item()
    assert len(losses) == 12 and after < 0.8 * before


def test_warm_start_batches_are_cut_from_length_sorted_rounds(tok, monkeypatch):
    seen, demo_loss = [], demos.demo_loss

    def recording_loss(model, batch):
        seen.append(batch["attention_mask"].sum(1).tolist())  # [B] episode lengths
        return demo_loss(model, batch)

    monkeypatch.setattr(demos, "demo_loss", recording_loss)
    demos.imitate(small_model(tok), tok, "frozenlake", steps=demos.ROUND, batch_size=3)
    assert [len(b) for b in seen] == [3] * demos.ROUND
    spans = sorted((min(b), max(b)) for b in seen)
    # cut from one sorted list: no overlap
    assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:]))
