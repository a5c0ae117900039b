"""Checks for envs.py: exact rewards on hand-built rooms, invariants over many generated rooms, slip frequencies
against their exact probabilities, the reply parser on any string, determinism and failure paths."""
import doctest
import math
import random

import pytest
from hypothesis import given, settings, strategies as st

import envs
from envs import Bandit, FrozenLake, Sokoban, make_env, parse_response, solve


def test_docstring_examples():
    assert doctest.testmod(envs).failed == 0


# ------------------------------------------------------------------------------------------ Sokoban: exact rewards

LINE = "#####\n#PXO#\n#####"
TWO = "#######\n#P√X_O#\n#######"  # a box already on a target, a second box beside it


def test_push_onto_target_solves():
    env = Sokoban(room=LINE)
    obs, info = env.reset()
    assert obs == LINE and info == {"success": False}
    obs, reward, terminated, truncated, info = env.step("Right")
    assert obs == "#####\n#_P√#\n#####"
    assert reward == pytest.approx(-0.1 + 1 + 10, abs=1e-12)
    assert (terminated, truncated, info["success"], info["boxes_on_target"]) == (True, False, True, 1)


def test_blocked_moves_cost_a_step_and_change_nothing():
    env = Sokoban(room=TWO)
    env.reset()
    obs, reward, *_, info = env.step("Right")  # box into a second box
    assert obs == TWO and reward == pytest.approx(-0.1) and not info["effective"]
    obs, reward, *_, info = env.step("Up")  # into a wall
    assert obs == TWO and reward == pytest.approx(-0.1) and not info["effective"]


def test_box_off_target_and_onto_target_without_solving():
    env = Sokoban(room="########\n#P√_X_O#\n########")
    env.reset()
    _, reward, terminated, *_ = env.step("Right")  # pushes the box off its target
    assert reward == pytest.approx(-0.1 - 1) and not terminated
    env = Sokoban(room="#######\n#PXO__#\n#__X_O#\n#######")
    env.reset()
    _, reward, terminated, *_, info = env.step("Right")  # first box onto a target, the second one still off
    assert reward == pytest.approx(-0.1 + 1) and not terminated and info["boxes_on_target"] == 1


def test_truncated_after_max_steps_and_no_step_after_the_end():
    env = Sokoban(room=LINE, max_steps=2)
    env.reset()
    assert env.step("Left")[2:4] == (False, False)
    assert env.step("Left")[2:4] == (False, True)
    with pytest.raises(ValueError, match="reset"):
        env.step("Left")


def test_action_names_and_indices():
    env = Sokoban(room=LINE)
    assert env.action_name(" rIgHt ") == "Right" == env.action_name(3) and env.action_name(0) == "Up"
    env.reset()
    assert env.step(3)[1] == pytest.approx(10.9)
    for bad in ("jump", 4, -1, 1.0, True, None):
        with pytest.raises(ValueError, match="valid: Up, Down, Left, Right"):
            env.action_name(bad)


@pytest.mark.parametrize("room", ["###\n#P#", "####\n#PX#\n####", "#####\n#PXO_\n#####", "#####\n#PXQ#\n#####",
                                  "#####\n#PPX#\n#O__#\n#####", "#####\n#PXO#\n####"])
def test_bad_rooms_raise(room):
    with pytest.raises(ValueError):
        Sokoban(room=room)
    assert Sokoban(room=LINE + "\n").reset()[0] == LINE  # surrounding whitespace is fine


# --------------------------------------------------------------------------------- Sokoban: generated rooms

def replay(env, plan):
    total = 0.0
    for action in plan:
        _, reward, terminated, truncated, info = env.step(action)
        total += reward
    return total, terminated, truncated, info


def test_every_generated_room_is_solvable_within_the_budget():
    env = Sokoban()
    for seed in range(400):
        obs, _ = env.reset(seed=seed)
        plan = solve(env)
        assert plan is not None and 1 <= len(plan) <= env.max_steps, (seed, obs)
        assert obs.count("X") == 1 and obs.count("O") + obs.count("S") == 1  # one box, off its target
        total, terminated, truncated, info = replay(env, plan)
        assert terminated and not truncated and info["success"]
        assert total == pytest.approx(-0.1 * len(plan) + 1 + 10)  # one box: net one arrival on a target


@pytest.mark.parametrize("dim_room,num_boxes", [((6, 6), 1), ((7, 8), 2), ((5, 5), 1)])
def test_random_play_invariants(dim_room, num_boxes):
    """Walls stay, boxes are conserved and never in walls, the player never in a wall or box, reward accounting."""
    env = Sokoban(dim_room=dim_room, num_boxes=num_boxes, max_steps=30)
    pick = random.Random(0)
    for seed in range(60):
        obs, _ = env.reset(seed=seed)
        walls, targets = env.walls, env.targets
        assert len(obs.split("\n")) == dim_room[0] and all(len(r) == dim_room[1] for r in obs.split("\n"))
        assert len(env.boxes) == num_boxes and env.boxes != targets
        total, on = 0.0, len(env.boxes & targets)
        while not env.done:
            obs, reward, *_ = env.step(pick.randrange(4))
            total += reward
            assert env.walls == walls and env.targets == targets and len(env.boxes) == num_boxes
            assert not (env.boxes & walls) and env.player not in walls and env.player not in env.boxes
            assert obs == env.render() and obs.count("P") + obs.count("S") == 1
            assert obs.count("X") + obs.count("√") == num_boxes
            assert obs.count("O") + obs.count("√") + obs.count("S") == num_boxes
        arrivals = len(env.boxes & targets) - on
        assert total == pytest.approx(-0.1 * env.steps + arrivals + 10 * env.success)


def test_solve_finds_the_shortest_plan_on_a_hand_built_room():
    room = "#######\n#P____#\n#__X__#\n#____O#\n#######"
    env = Sokoban(room=room, max_steps=20)
    env.reset()
    plan = solve(env)
    # the box must go 2 right and 1 down: walk to its left (2), push right twice (2), go round above it (2), push down (1)
    assert len(plan) == 7
    assert replay(env, plan)[1]
    stuck = Sokoban(room="#####\n#PX_#\n#__O#\n#####")  # box pushed into a corner can never leave it
    stuck.reset()
    stuck.step("Right")
    assert solve(stuck) is None


def test_same_seed_same_room_and_same_trajectory():
    a, b = Sokoban(), Sokoban()
    rooms = set()
    for seed in range(40):
        assert a.reset(seed=seed) == b.reset(seed=seed)
        rooms.add(a.render())
        for action in ["Up", "Left", "Down", "Right", "Right"]:
            if a.done:
                break
            assert a.step(action) == b.step(action)
    assert len(rooms) >= 35  # seeds give different rooms


def test_constructor_checks():
    for kwargs in ({"dim_room": (4, 6)}, {"num_boxes": 0}, {"max_steps": 0}, {"dim_room": (6,)}, {"num_boxes": 9}):
        with pytest.raises(ValueError):
            Sokoban(**kwargs)
    with pytest.raises(ValueError, match="seed"):
        Sokoban().reset(seed="a")


# ---------------------------------------------------------------------------------------------------- FrozenLake

OPEN = ["FFFF", "FSFF", "FFFF", "FFFG"]


@pytest.mark.parametrize("success_rate", [1 / 3, 0.8, 1.0])
def test_slip_frequencies_match_the_exact_probabilities(success_rate):
    env = FrozenLake(desc=OPEN, success_rate=success_rate)
    n = 3000
    counts = {}
    for k in range(n):
        env.reset(seed=0, noise_seed=k)
        pos = env.step("Right")[4]["pos"]
        counts[pos] = counts.get(pos, 0) + 1
    side = (1 - success_rate) / 2
    exact = {(1, 2): success_rate, (0, 1): side, (2, 1): side}  # never backwards to (1, 0)
    assert set(counts) <= {p for p, q in exact.items() if q > 0}
    for pos, prob in exact.items():
        se = math.sqrt(prob * (1 - prob) / n)
        assert abs(counts.get(pos, 0) / n - prob) <= 4.5 * se + 1e-12, (pos, counts)


def test_moving_off_the_grid_stays_in_place():
    env = FrozenLake(desc=["SF", "FG"], success_rate=1 / 3)
    n, stay = 3000, 0
    for k in range(n):
        env.reset(seed=0, noise_seed=k)
        stay += env.step("Up")[4]["pos"] == (0, 0)  # Up and Left leave the grid, Right does not
    se = math.sqrt(2 / 9 / n)
    assert abs(stay / n - 2 / 3) <= 4.5 * se


def test_hole_and_goal():
    env = FrozenLake(desc=["SHG", "FFF"])
    obs, info = env.reset()
    assert obs == "POG\n___" and info["pos"] == (0, 0)
    obs, reward, terminated, truncated, info = env.step("Right")
    assert obs == "_XG\n___" and (reward, terminated, truncated, info["success"]) == (0.0, True, False, False)
    assert solve(env) is None
    env.reset()
    assert solve(env) == ["Down", "Right", "Right", "Up"]
    rewards = [env.step(a)[1] for a in ["Down", "Right", "Right", "Up"]]
    assert rewards == [0.0, 0.0, 0.0, 1.0] and env.success and env.render() == "_O√\n___"


def test_random_maps_are_solvable_and_well_formed():
    env = FrozenLake()
    for seed in range(400):
        obs, info = env.reset(seed=seed)
        grid = env.grid
        assert len(grid) == 4 and all(len(r) == 4 for r in grid) and set("".join(grid)) <= set("SFHG")
        assert "".join(grid).count("S") == 1 and "".join(grid).count("G") == 1
        assert obs.count("P") == 1 and obs[info["pos"][0] * 5 + info["pos"][1]] == "P"
        plan = solve(env)
        assert plan is not None and len(plan) >= 1
        total = sum(env.step(a)[1] for a in plan)
        assert total == 1.0 and env.success


def test_layout_from_seed_noise_from_noise_seed():
    env = FrozenLake(success_rate=1 / 3, max_steps=10)
    layouts, moves = set(), set()
    for noise in range(30):
        layouts.add(env.reset(seed=5, noise_seed=noise)[0])
        moves.add(env.step("Down")[4]["direction"])
    assert len(layouts) == 1 and moves == {"Down", "Left", "Right"}
    runs = []
    for _ in range(2):
        env.reset(seed=5, noise_seed=7)
        runs.append([env.step(a) for a in ["Down", "Right"] if not env.done])
    assert runs[0] == runs[1]


def test_truncation_and_checks():
    env = FrozenLake(desc=["SFG"], max_steps=2)
    env.reset()
    assert env.step("Left")[2:4] == (False, False) and env.step("Left")[2:4] == (False, True)
    for kwargs in ({"p": 1.5}, {"success_rate": -0.1}, {"size": 1}, {"desc": ["SF", "FF"]}, {"desc": ["SFX", "FFG"]},
                   {"desc": ["SFG", "FF"]}):
        with pytest.raises(ValueError):
            FrozenLake(**kwargs)


# --------------------------------------------------------------------------------------------------------- Bandit

def test_bandit_payouts_and_success():
    env = Bandit()
    n, wins, roles = 4000, 0, set()
    for seed in range(n):
        obs, _ = env.reset(seed=seed)
        roles.add(env.risky)
        assert f"{env.risky}: pays 1 with probability 0.25" in obs and f"{env.safe}: pays 0.1 every time" in obs
        _, reward, terminated, truncated, info = env.step(env.risky)
        assert terminated and not truncated and info["success"] and reward in (0.0, 1.0)
        wins += reward
    assert roles == {"Phoenix", "Dragon"}
    assert abs(wins / n - 0.25) <= 4.5 * math.sqrt(0.25 * 0.75 / n)
    env.reset(seed=0)
    _, reward, *_, info = env.step(env.safe)
    assert reward == pytest.approx(0.1) and not info["success"]
    env.reset(seed=0)
    assert solve(env) == [env.risky]
    safe_better = Bandit(low_reward=0.5)  # 0.5 > 0.25: now the safe arm is the better one
    safe_better.reset(seed=0)
    assert solve(safe_better) == [safe_better.safe]
    with pytest.raises(ValueError):
        Bandit(high_prob=2)


# ------------------------------------------------------------------------------------------------------- parsing

@pytest.mark.parametrize("text,expected", [
    ("<think>go up</think><answer>Up</answer>", ("go up", ["Up"], True)),
    (" plan first </think>\n<answer> left||LEFT || down </answer>", ("plan first", ["Left", "Left", "Down"], True)),
    ("<THINK>x</THINK> <Answer>Right.</ANSWER>", ("x", ["Right"], True)),
    ("<think>a</think><answer>jump || fly</answer>", ("a", [], False)),
    ("<think>a</think><answer>Up", ("a", [], False)),  # unclosed answer
    ("<think>still thinking", ("still thinking", [], False)),  # unclosed think
    ("<answer>Up</answer>", ("", [], False)),  # no think block
    ("<think>x <answer>Down</answer></think><answer>Up</answer><answer>Left</answer>", ("x <answer>Down</answer>",
                                                                                        ["Up"], True)),
    ("<think><think>nested</think></think><answer>Dragon</answer>", ("nested", ["Dragon"], True)),
    ("", ("", [], False)),
])
def test_parse_worked_examples(text, expected):
    assert parse_response(text) == expected


def test_parse_respects_the_action_set():
    assert parse_response("<think></think><answer>Up || Phoenix</answer>", ("Up", "Down", "Left", "Right")) == \
        ("", ["Up"], True)
    assert parse_response(None) == ("", [], False)


@settings(max_examples=300, deadline=None)
@given(st.text() | st.lists(st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", "||", "up", "LEFT",
                                             " ", "\n", "x", "√", "Ⅷ", "İ"])).map("".join))
def test_parse_never_raises(text):
    think, actions, valid = parse_response(text)
    assert isinstance(think, str) and set(actions) <= set(envs.ALL_ACTIONS) and valid == bool(actions)


def test_parse_huge_input():
    text = "<think>" + "a" * 1_000_000 + "</think><answer>" + "Up || " * 10_000 + "</answer>"
    think, actions, valid = parse_response(text)
    assert len(think) == 1_000_000 and actions == ["Up"] * 10_000 and valid


# ------------------------------------------------------------------------------------------------------ registry

def test_make_env_and_errors():
    assert isinstance(make_env("SOKOBAN"), Sokoban)
    assert make_env("frozenlake", success_rate=1 / 3).success_rate == 1 / 3
    with pytest.raises(ValueError, match="valid: bandit, frozenlake, sokoban"):
        make_env("chess")
    with pytest.raises(ValueError, match="valid: size, p, success_rate, desc, max_steps"):
        make_env("frozenlake", slip=0.2)
    for name, cls in envs.ENVS.items():
        env = make_env(name)
        obs, info = env.reset(seed=3)
        assert env.name == name and obs == env.render() and info["success"] is False and env.rules
        assert isinstance(env.legend, str) and set(env.actions) <= set(envs.ALL_ACTIONS)


def test_a_new_world_is_one_class_and_one_entry(monkeypatch):
    class Corridor(envs.TextEnv):
        """Walk right to the end of a corridor of length 3."""
        name, actions, max_steps, rules, legend = "corridor", ("Left", "Right"), 5, "Reach the end.", "P you"

        def reset(self, seed=None, noise_seed=None):
            self.pos = 0
            return self._start()

        def render(self):
            return "".join("P" if i == self.pos else "_" for i in range(3))

        def state(self):
            return self.pos

        def next_state(self, state, action):
            pos = max(0, min(2, state + (1 if action == "Right" else -1)))
            return pos, pos == 2, pos == 2

        def _apply(self, action):
            self.pos, done, success = self.next_state(self.pos, action)
            return float(success), done, {"success": success}

    monkeypatch.setitem(envs.ENVS, "corridor", Corridor)
    env = make_env("corridor")
    env.reset()
    assert solve(env) == ["Right", "Right"]
    assert [env.step("right")[1] for _ in range(2)] == [0.0, 1.0] and env.success


# ----------------------------------------------------------------------------------------------------- baselines

def test_random_policy_baseline_matches_the_exact_probability():
    """P(random walk reaches G within max_steps), by dynamic programming over (cell, steps left), vs `baselines`."""
    desc, max_steps = ["SFF", "FHF", "FFG"], 6
    env = FrozenLake(desc=desc)
    env.reset()

    def reach(pos, left):
        cell = desc[pos[0]][pos[1]]
        if cell in "GH" or left == 0:
            return float(cell == "G")
        return sum(reach(env.next_state(pos, a)[0], left - 1) for a in env.actions) / 4

    exact, n = reach((0, 0), max_steps), 3000
    lengths, rate, se = envs.baselines("frozenlake", episodes=n, desc=desc, max_steps=max_steps)
    assert lengths == {4: n}
    assert abs(rate - exact) <= 4.5 * math.sqrt(exact * (1 - exact) / n) and se == pytest.approx(
        math.sqrt(rate * (1 - rate) / n))
    lengths, rate, _ = envs.baselines("bandit", episodes=n)
    assert lengths == {1: n} and abs(rate - 0.5) <= 4.5 * math.sqrt(0.25 / n)
