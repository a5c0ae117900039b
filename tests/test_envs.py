"""Checks for the worlds (envs.py and the files it names: textenv.py, sokoban.py, frozenlake.py,
bandit.py, countdown.py, wordproblems.py): exact rewards on hand-built rooms, the room generator's
rules on hand-built rooms and against a plain recursion, invariants over many generated rooms and
puzzles, frequencies against their exact probabilities, the expression parser against expression
trees evaluated directly, the reply parser on any string, determinism and failure paths."""
import doctest
import itertools
import math
import random
import re
from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings, strategies as st

import envs
from envs import Bandit, Countdown, FrozenLake, Sokoban, WordProblems, make_env, parse_response, solve
from worlds import countdown, textenv, wordproblems


def test_docstring_examples():
    for module in (envs, countdown, wordproblems):
        assert doctest.testmod(module).failed == 0


# --------------------------------------------------------------------------- Sokoban: exact rewards

LINE = "#####\n#PXO#\n#####"
TWO = "#######\n#P√X_O#\n#######"  # a box already on a target, a second box beside it


def test_push_onto_target_solves():
    env = Sokoban(room=LINE)
    obs, info = env.reset()
    assert obs == LINE and info == {"success": False}
    obs, reward, terminated, truncated, info = env.step("Right")
    assert obs == "#####\n#_P√#\n#####"
    assert reward == pytest.approx(-0.1 + 1 + 10, abs=1e-12)
    assert (terminated, truncated) == (True, False)
    assert (info["success"], info["boxes_on_target"]) == (True, 1)


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
    _, reward, terminated, *_, info = env.step("Right")  # one box onto a target, one still off
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
    assert env.action_name(" rIgHt ") == "Right" == env.action_name(3)
    assert env.action_name(0) == "Up"
    env.reset()
    assert env.step(3)[1] == pytest.approx(10.9)
    for bad in ("jump", 4, -1, 1.0, True, None):
        with pytest.raises(ValueError, match="valid: Up, Down, Left, Right"):
            env.action_name(bad)


@pytest.mark.parametrize("room", ["###\n#P#", "####\n#PX#\n####", "#####\n#PXO_\n#####",
                                  "#####\n#PXQ#\n#####", "#####\n#PPX#\n#O__#\n#####",
                                  "#####\n#PXO#\n####"])
def test_bad_rooms_raise(room):
    with pytest.raises(ValueError):
        Sokoban(room=room)
    assert Sokoban(room=LINE + "\n").reset()[0] == LINE  # surrounding whitespace is fine


# ------------------------------------------------------------------------- Sokoban: generated rooms

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
        assert obs.count("X") == 1 and obs.count("O") + obs.count("S") == 1  # one box, off target
        total, terminated, truncated, info = replay(env, plan)
        assert terminated and not truncated and info["success"]
        assert total == pytest.approx(-0.1 * len(plan) + 1 + 10)  # one box: one arrival on target
    for kwargs in ({"max_steps": 3}, {"generator": "bfs"}, {"generator": "bfs", "max_steps": 4}):
        env = Sokoban(**kwargs)
        for seed in range(100):
            env.reset(seed=seed)
            assert 1 <= len(solve(env)) <= env.max_steps, (kwargs, seed)


def test_rooms_that_need_more_than_the_budget_are_drawn_again():
    """The same seed gives the same room with and without the budget, unless the room needs more
    than max_steps moves: then (and only then) the seed's stream draws another one."""
    budget, free = Sokoban(), Sokoban(max_steps=1000)
    redrawn = 0
    for seed in range(400):
        room = free.reset(seed=seed)[0]
        needed = len(solve(free))
        if needed <= budget.max_steps:
            assert budget.reset(seed=seed)[0] == room, seed
        else:
            redrawn += 1
            assert budget.reset(seed=seed)[0] != room and len(solve(budget)) <= budget.max_steps
    assert redrawn >= 1  # gym-sokoban's rooms need more than 10 moves about once in 170


# ----------------------------------------------------------------- Sokoban: gym-sokoban's generator

def reverse_play(text, search_depth=300):
    """Sokoban._reverse_dfs on a solved room (boxes on their targets): (score, the room picked)."""
    env = Sokoban(room=text, search_depth=search_depth)
    env.reset()
    score, env.player, boxes, moved = env._reverse_dfs(env.walls, sorted(env.targets), env.player)
    env.boxes = frozenset(boxes)
    return score, env.render()


def test_reverse_play_pulls_the_box_as_far_as_it_goes():
    # every step away from the box pulls it: 1 right (score 1), 2 right (score 2), then walls
    corridor = "#######\n#_√P__#\n#######"
    assert reverse_play(corridor) == (2, "#######\n#_O_XP#\n#######")
    # search_depth=3 scores states at most 3 - 2 = 1 move deep (gym-sokoban's time-to-live)
    assert reverse_play(corridor, search_depth=3) == (1, "#######\n#_OXP_#\n#######")
    assert reverse_play("#####\n#√P##\n#####") == (0, "#####\n#√P##\n#####")  # nothing moves


def test_reverse_play_scores_swaps_times_displacement_and_zero_on_a_covered_target():
    # The player must pull box B (target 3,5) up first, walk round and pull box A (target 3,2)
    # right: B 1 off, A 1 off, 2 swaps (B, then A): score 2 x 2 = 4. One more pull of A would
    # score 2 x 3 = 6, but leaves the player on B's target: score 0.
    room = "#######\n###___#\n#___#P#\n#_√__√#\n#######"
    assert reverse_play(room) == (4, "#######\n###___#\n#___#X#\n#_OXPO#\n#######")


def test_reverse_play_ties_go_to_the_first_state_found():
    # pulling the box right scores 1; stepping up from there scores 1 again: the first one stays
    assert reverse_play("#####\n###_#\n#√P_#\n#####") == (1, "#####\n###_#\n#OXP#\n#####")


def reverse_play_by_recursion(text, search_depth=300):
    """gym-sokoban's reverse play written as its recursion on (row, col) cells, displacement
    recomputed at every state: the reference for the explicit stack of Sokoban._reverse_dfs."""
    rows = text.split("\n")
    width = len(rows[0])
    cells = {(r, c): ch for r, row in enumerate(rows) for c, ch in enumerate(row)}
    targets = sorted(cell for cell, ch in cells.items() if ch == "√")
    seen, best = set(), [(-1, None, None, 0)]

    def visit(player, boxes, pulled, swaps, last, ttl):
        ttl -= 1
        key = (player, frozenset(zip(boxes, pulled)))  # a pulled box is coded apart
        if ttl <= 0 or key in seen:
            return
        seen.add(key)
        moved = sum(abs(b[0] - t[0]) + abs(b[1] - t[1]) for b, t in zip(boxes, targets))
        covered = player in targets or any(b in targets for b in boxes)
        score = 0 if covered else swaps * moved
        if score > best[0][0]:
            best[0] = (score, player, boxes, moved)
        for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1)):  # Up, Down, Left, Right
            ahead, behind = (player[0] + dr, player[1] + dc), (player[0] - dr, player[1] - dc)
            if cells[ahead] == "#" or ahead in boxes:
                continue
            if behind in boxes:
                k = boxes.index(behind)
                visit(ahead, boxes[:k] + (player,) + boxes[k + 1:],
                      pulled[:k] + (True,) + pulled[k + 1:], swaps + (k != last), k, ttl)
            else:
                visit(ahead, boxes, pulled, swaps, last, ttl)

    start = next(cell for cell, ch in cells.items() if ch == "P")
    visit(start, tuple(targets), (False,) * len(targets), 0, -1, search_depth)
    score, player, boxes, moved = best[0]
    flat = lambda cell: cell[0] * width + cell[1]  # noqa: E731
    return score, flat(player), tuple(flat(b) for b in boxes), moved


@pytest.mark.parametrize("dim_room,num_boxes,search_depth,rooms", [
    ((6, 6), 1, 300, 200), ((7, 7), 2, 300, 60), ((8, 8), 3, 300, 20), ((7, 7), 2, 9, 60)])
def test_reverse_play_matches_the_recursion(dim_room, num_boxes, search_depth, rooms):
    env = Sokoban(dim_room=dim_room, num_boxes=num_boxes, search_depth=search_depth)
    positive = 0
    for seed in range(rooms):
        rng = random.Random(seed)
        walls = env._carve(rng)
        floor = sorted(set(range(env.height * env.width)) - walls)
        if len(floor) <= num_boxes + 1:
            continue
        player, *targets = rng.sample(floor, num_boxes + 1)
        grid = ["#" if i in walls else "_" for i in range(env.height * env.width)]
        for t in targets:
            grid[t] = "√"
        grid[player] = "P"
        text = "\n".join("".join(grid[r * env.width:(r + 1) * env.width])
                         for r in range(env.height))
        got = env._reverse_dfs(walls, sorted(targets), player)
        assert got == reverse_play_by_recursion(text, search_depth), text
        positive += got[0] > 0
    assert positive >= rooms // 4  # the comparison covers rooms that reverse play changes


def test_the_walk_stamps_gym_sokobans_masks_from_a_start_that_may_lie_on_the_border():
    """One walk step in a 5x5 room: the exact distribution of the floor, by enumerating the start
    (rows and columns 1..4), the heading and the mask, against 4000 seeded walks."""
    masks = ("000/111/000", "010/010/010", "000/110/010", "000/110/110", "000/011/010")
    exact = Counter()
    for r0, c0, (dr, dc), mask in itertools.product(range(1, 5), range(1, 5), textenv.MOVES.values(),
                                                    masks):
        r, c = min(max(r0 + dr, 1), 3), min(max(c0 + dc, 1), 3)
        floor = frozenset((r - 1 + i) * 5 + c - 1 + j for i, line in enumerate(mask.split("/"))
                          for j, bit in enumerate(line)
                          if bit == "1" and 0 < r - 1 + i < 4 and 0 < c - 1 + j < 4)
        exact[floor] += 1 / (16 * 4 * 5)
    env, n = Sokoban(dim_room=(5, 5), num_gen_steps=1), 4000
    seen = Counter(frozenset(range(25)) - env._carve(random.Random(seed)) for seed in range(n))
    assert set(seen) <= set(exact)
    for floor, prob in exact.items():
        assert abs(seen[floor] / n - prob) <= 4.5 * math.sqrt(prob * (1 - prob) / n), sorted(floor)


@pytest.mark.parametrize("room,moved,exact", [
    # a corridor to the right: no walk with prob. 0.2 (displacement 1) or 0.5, else 1, 2 or 3
    # cells with prob. 1/2, 1/4, 1/4
    ("#########\n#XP___O_#\n#########", 1, {2: 0.2, 3: 0.4, 4: 0.2, 5: 0.2}),
    ("#########\n#XP___O_#\n#########", 2, {2: 0.5, 3: 0.25, 4: 0.125, 5: 0.125}),
    # a dead end on the left: one step, and the walk never goes back
    ("######\n#_PXO#\n######", 1, {1: 0.8, 2: 0.2}),
])
def test_the_player_wanders_with_the_exact_probabilities(room, moved, exact):
    env, n = Sokoban(room=room), 4000
    env.reset()
    ends = Counter(env._wander(env.walls, env.boxes, env.player, moved, random.Random(k))
                   % env.width for k in range(n))
    assert set(ends) <= set(exact)
    for col, prob in exact.items():
        assert abs(ends[col] / n - prob) <= 4.5 * math.sqrt(prob * (1 - prob) / n), (col, ends)


def test_rooms_are_as_hard_as_gym_sokobans():
    """Seeds 0..999 against RAGEN's generator run on 20000 seeds: mean optimal length 4.08 among
    rooms of at most 10 moves (standard error 0.015), the player beside the box in 58.7% of rooms
    (0.011, 2000 seeds). The breadth-first farthest-box rooms average about 5 moves."""
    env, n = Sokoban(), 1000
    lengths, beside = [], 0
    for seed in range(n):
        env.reset(seed=seed)
        lengths.append(len(solve(env)))
        beside += env._distance(env.player, next(iter(env.boxes))) == 1
    mean = sum(lengths) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in lengths) / (n - 1) / n)
    assert abs(mean - 4.08) <= 4.5 * math.hypot(se, 0.015), mean
    share = beside / n
    assert abs(share - 0.587) <= 4.5 * math.hypot(math.sqrt(share * (1 - share) / n), 0.011)


@pytest.mark.parametrize("dim_room,num_boxes", [((6, 6), 1), ((7, 8), 2), ((5, 5), 1)])
def test_random_play_invariants(dim_room, num_boxes):
    """Walls stay, boxes are conserved and never in walls, the player never in a wall or box,
    reward accounting."""
    env = Sokoban(dim_room=dim_room, num_boxes=num_boxes, max_steps=30)
    pick = random.Random(0)
    for seed in range(60):
        obs, _ = env.reset(seed=seed)
        walls, targets = env.walls, env.targets
        rows = obs.split("\n")
        assert len(rows) == dim_room[0] and all(len(r) == dim_room[1] for r in rows)
        assert len(env.boxes) == num_boxes and not env.boxes & targets  # every box off target
        total, on = 0.0, len(env.boxes & targets)
        while not env.done:
            obs, reward, *_ = env.step(pick.randrange(4))
            total += reward
            assert env.walls == walls and env.targets == targets and len(env.boxes) == num_boxes
            assert not (env.boxes & walls) and env.player not in walls | env.boxes
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
    # the box goes 2 right and 1 down: walk to its left (2), push right twice (2), go round above
    # it (2), push down (1)
    assert len(plan) == 7
    assert replay(env, plan)[1]
    stuck = Sokoban(room="#####\n#PX_#\n#__O#\n#####")  # a box in a corner can never leave it
    stuck.reset()
    stuck.step("Right")
    assert solve(stuck) is None


def test_same_seed_same_room_and_same_trajectory():
    for kwargs in ({}, {"generator": "bfs"}, {"dim_room": (7, 7), "num_boxes": 2, "max_steps": 30}):
        a, b = Sokoban(**kwargs), Sokoban(**kwargs)
        rooms = set()
        for seed in range(40):
            assert a.reset(seed=seed) == b.reset(seed=seed)
            rooms.add(a.render())
            for action in ["Up", "Left", "Down", "Right", "Right"]:
                if a.done:
                    break
                assert a.step(action) == b.step(action)
        assert len(rooms) >= 35  # seeds give different rooms
    assert Sokoban().reset(seed=7) == Sokoban().reset(seed=7, noise_seed=3)  # no noise in Sokoban


def test_constructor_checks():
    for kwargs in ({"dim_room": (4, 6)}, {"num_boxes": 0}, {"max_steps": 0}, {"dim_room": (6,)},
                   {"num_boxes": 9}, {"generator": "random"}, {"search_depth": 2},
                   {"generator": "bfs", "search_depth": 0}, {"num_gen_steps": 0}):
        with pytest.raises(ValueError):
            Sokoban(**kwargs)
    assert Sokoban(generator="bfs").search_depth == 10 and Sokoban().search_depth == 300
    with pytest.raises(ValueError, match="seed"):
        Sokoban().reset(seed="a")


# --------------------------------------------------------------------------------------- FrozenLake

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
    assert obs == "_XG\n___"
    assert (reward, terminated, truncated, info["success"]) == (0.0, True, False, False)
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
        assert len(grid) == 4 and all(len(r) == 4 for r in grid)
        assert set("".join(grid)) <= set("SFHG")
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
    for kwargs in ({"p": 1.5}, {"success_rate": -0.1}, {"size": 1}, {"desc": ["SF", "FF"]},
                   {"desc": ["SFX", "FFG"]},
                   {"desc": ["SFG", "FF"]}):
        with pytest.raises(ValueError):
            FrozenLake(**kwargs)


# ------------------------------------------------------------------------------------------- Bandit

def test_bandit_payouts_and_success():
    env = Bandit()
    n, wins, roles = 4000, 0, set()
    for seed in range(n):
        obs, _ = env.reset(seed=seed)
        roles.add(env.risky)
        assert f"{env.risky}: pays 1 with probability 0.25" in obs
        assert f"{env.safe}: pays 0.1 every time" in obs
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


# ---------------------------------------------------------------------------------------- Countdown

def tree_text_and_value(tree):
    """(text, exact value or None) of an expression tree built by `trees`, evaluated directly."""
    if isinstance(tree, int):
        return str(tree), Fraction(tree)
    if tree[0] == "neg":
        text, value = tree_text_and_value(tree[1])
        return f"-({text})", None if value is None else -value
    op, (lt, lv), (rt, rv) = tree[0], tree_text_and_value(tree[1]), tree_text_and_value(tree[2])
    if lv is None or rv is None or (op == "/" and rv == 0):
        value = None
    else:
        value = {"+": lv + rv, "-": lv - rv, "*": lv * rv, "/": lv / rv if rv else None}[op]
    return f"({lt} {op} {rt})", value


def numbers_of(tree):
    return [tree] if isinstance(tree, int) else [n for t in tree[1:] for n in numbers_of(t)]


trees = st.recursive(st.integers(0, 12), lambda sub: st.tuples(st.sampled_from("+-*/"), sub, sub)
                     | st.tuples(st.just("neg"), sub), max_leaves=6)


@settings(max_examples=300, deadline=None)
@given(trees)
def test_the_parser_computes_what_the_expression_tree_does(tree):
    """Fully parenthesised trees, evaluated exactly by a plain recursion: the parser finds the same
    value (None: a division by zero somewhere) and the numbers in their order."""
    text, value = tree_text_and_value(tree)
    assert countdown.evaluate(text) == (value, numbers_of(tree))
    assert countdown.evaluate(text.replace(" ", "")) == (value, numbers_of(tree))


@pytest.mark.parametrize("text, expected", [
    ("2 + 3 * 4", 14), ("(2 + 3) * 4", 20), ("8 / 4 / 2", 1), ("8 - 4 - 2", 2), ("-3 + 5", 2),
    ("7 / 2", Fraction(7, 2)), ("--3", 3), ("2 * -3", -6)])
def test_precedence_and_associativity(text, expected):
    assert countdown.evaluate(text)[0] == expected


@pytest.mark.parametrize("text", ["", "   ", "2 +", "(2 + 3", "2 + 3)", "2 ** 3", "2 3", "2.5 + 1",
                                  "x + 1", "2 = 2", "()", "+2", "2 + + 3", "(" * 30 + "1" + ")" * 30])
def test_what_is_no_expression_parses_to_none(text):
    assert countdown.evaluate(text) is None


def test_countdown_rewards_as_the_official_env():
    """1 correct, 0.1 well-formed with exactly the given numbers, else 0 -- a division by zero is
    well-formed and wrong; a number used twice, left out or not given is not the numbers."""
    nums, target = [5, 2, 3], 4
    cases = {"5 + 2 - 3": 1.0, "(5 - 3) * 2": 1.0, "2 * (5 - 3)": 1.0, "5 - 3 + 2": 1.0,
             "5 + 2 + 3": 0.1, "5 / (2 - 2) + 3": 0.0, "5 / 2 * 3": 0.1, "5 + 2": 0.0,
             "5 + 2 - 3 + 3": 0.0, "5 + 2 - 4": 0.0, "5 +": 0.0, "": 0.0, "4": 0.0}
    for answer, reward in cases.items():
        assert countdown.score(answer, nums, target) == (reward, reward == 1.0), answer
        env = Countdown()
        env.reset(seed=0)
        env.numbers, env.target = nums, target
        _, got, terminated, truncated, info = env.step(answer)
        assert (got, terminated, truncated, info["success"]) == (reward, True, False, reward == 1.0)
    assert countdown.score("4 / (2 - 2)", [4, 2, 2], 4) == (0.1, False)  # no value: wrong


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60) | st.lists(st.sampled_from(["5", "2", "3", "+", "-", "*", "/", "(",
                                                          ")", " ", "--", "0"])).map("".join))
def test_any_answer_is_scored_never_raised(answer):
    reward, correct = countdown.score(answer, [5, 2, 3], 4)
    assert reward in (0.0, 0.1, 1.0) and correct == (reward == 1.0)


def official_rule(numbers, target):
    """RAGEN's has_solution as a plain loop: some +/- before each number (padded to 4) hits it."""
    padded = list(numbers) + [0] * (4 - len(numbers))
    return any(sum(s * n for s, n in zip(signs, padded)) == target
               for signs in itertools.product((1, -1), repeat=4))


@pytest.mark.parametrize("count, max_number", [(3, 9), (2, 5), (4, 20)])
def test_every_puzzle_is_solvable_by_the_official_rule_and_the_solver_solves_it(count, max_number):
    env, targets = Countdown(count=count, max_number=max_number), Counter()
    for seed in range(300):
        obs, _ = env.reset(seed=seed)
        assert obs == f"Target: {env.target}, nums: {env.numbers}"  # the official rendering
        assert len(env.numbers) == count and all(1 <= n <= max_number for n in env.numbers)
        assert env.target >= 1 and official_rule(env.numbers, env.target)
        (plan,) = solve(env)
        assert env.step(plan)[1] == 1.0 and env.success
        targets[env.target] += 1
    assert len(targets) > 5  # not one target for every seed


def test_the_random_countdown_answer_matches_its_exact_probability():
    """The random policy (the numbers in a random order, random operators) succeeds with
    probability mean over seeds of (orders x operator lists that hit the target) / all of them,
    enumerated exactly, against `baselines`."""
    env, exact, n = Countdown(), [], 1500
    for seed in range(n):
        env.reset(seed=seed)
        outcomes = [countdown.score(" ".join([str(p[0])] + [f"{o} {x}" for o, x in zip(ops, p[1:])]),
                                    env.numbers, env.target)[1]
                    for p in itertools.permutations(env.numbers)
                    for ops in itertools.product(countdown.OPERATORS, repeat=len(p) - 1)]
        exact.append(sum(outcomes) / len(outcomes))
    p = sum(exact) / n
    lengths, rate, _ = envs.baselines("countdown", episodes=n)
    assert lengths == {1: n} and abs(rate - p) <= 4.5 * math.sqrt(p * (1 - p) / n)


def test_countdown_checks_and_determinism():
    for bad in (dict(count=1), dict(count=7), dict(max_number=0), dict(count=2.5)):
        with pytest.raises(ValueError):
            Countdown(**bad)
    a, b = Countdown(), Countdown()
    assert a.reset(seed=11) == b.reset(seed=11) and a.reset(seed=11) != a.reset(seed=12)
    with pytest.raises(ValueError, match="answer is a string"):
        a.step(3)
    a.step("1 + 2 + 3")
    with pytest.raises(ValueError, match="episode is over"):
        a.step("1")


# ------------------------------------------------------------------------------------ Word problems

STEP = {r"(\w+) buys (\d+) more": "+", r"(\w+) finds (\d+) more": "+", r"\w+ gives (\w+) (\d+) more": "+",
        r"(\w+) gives (\d+) to \w+": "-", r"(\w+) loses (\d+)": "-", r"(\w+) sells (\d+)": "-"}


def answer_from_the_text(question):
    """The answer worked out from the question's words alone, by a reader independent of the
    generator: the start amount, then each sentence's step."""
    sentences = [t.strip() for t in question.rstrip("?").split(".")]
    total = int(re.fullmatch(r"\w+ has (\d+) \w+", sentences[0]).group(1))
    for sentence in sentences[1:-1]:
        sentence = sentence.removeprefix("Then ")
        if sentence.endswith(("doubles them", "triples them")):
            total *= 2 if sentence.endswith("doubles them") else 3
            continue
        (pattern, op), = [(p, o) for p, o in STEP.items() if re.fullmatch(p, sentence)]
        n = int(re.fullmatch(pattern, sentence).group(2))
        total = total + n if op == "+" else total - n
        assert total >= 1  # never down to nothing
    return total


@pytest.mark.parametrize("operations", [1, 2, 3])
def test_every_question_states_the_arithmetic_of_its_answer(operations):
    env, answers = WordProblems(operations=operations), Counter()
    for seed in range(300):
        question, _ = env.reset(seed=seed)
        assert question.endswith("have now?") and question.count(".") == operations + 1
        assert answer_from_the_text(question) == env.answer
        assert solve(env) == [str(env.answer)]
        answers[env.answer] += 1
    assert len(answers) > 10


def test_retries_earn_half_as_much_each_and_the_question_stays_in_view():
    env = WordProblems(attempts=3)
    question, _ = env.reset(seed=2)
    assert env.answer == 7
    obs, reward, terminated, truncated, _ = env.step("6")
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert obs == f"{wordproblems.INCORRECT}\n{question}"
    assert env.step("seven")[1:4] == (0.0, False, False)
    assert env.step(" 7.0 ")[1:4] == (0.25, True, False) and env.success  # third attempt: 1/4
    env.reset(seed=2)
    assert env.step("7")[1:4] == (1.0, True, False)
    env.reset(seed=2)
    for k in range(3):  # three wrong answers use the attempts up
        assert env.step("0")[1:4] == (0.0, False, k == 2)
    assert env.done and not env.success


@pytest.mark.parametrize("answer, same", [("8", True), (" 8 ", True), ("8.", True), ("8.0", True),
                                          ("08", True), ("16/2", True), ("8 apples", False),
                                          ("eight", False), ("", False), ("-8", False)])
def test_answers_are_compared_after_normalisation(answer, same):
    assert (wordproblems.normalise(answer) == wordproblems.normalise(8)) == same


def test_the_random_word_problem_answer_matches_its_exact_probability():
    """The random policy answers one of the question's numbers, uniformly, at each attempt: with m
    of the n numbers equal to the answer it succeeds within A attempts with 1 - (1 - m/n)^A."""
    env, exact, n = WordProblems(), [], 1500
    for seed in range(n):
        env.reset(seed=seed)
        stated = [env.start] + [x for op, x in env.ops if op != "*"]
        exact.append(1 - (1 - stated.count(env.answer) / len(stated)) ** env.max_steps)
    p = sum(exact) / n
    _, rate, _ = envs.baselines("wordproblems", episodes=n)
    assert abs(rate - p) <= 4.5 * math.sqrt(p * (1 - p) / n)


def test_word_problem_checks():
    for bad in (dict(operations=0), dict(attempts=0), dict(max_number=0), dict(attempts=1.5)):
        with pytest.raises(ValueError):
            WordProblems(**bad)


# ------------------------------------------------------------------------------------------ parsing

@pytest.mark.parametrize("text,expected", [
    ("<think>go up</think><answer>Up</answer>", ("go up", ["Up"], True)),
    (" plan first </think>\n<answer> left||LEFT || down </answer>",
     ("plan first", ["Left", "Left", "Down"], True)),
    ("<THINK>x</THINK> <Answer>Right.</ANSWER>", ("x", ["Right"], True)),
    ("<think>a</think> so: <answer>**Up**</answer>", ("a", ["Up"], True)),  # text between blocks
    ("<think>a</think><answer>jump || fly</answer>", ("a", [], False)),
    ("<think>a</think><answer> Up || Jump </answer>", ("a", ["Up"], False)),  # one bad piece
    ("<think>a</think><answer>Jump || Up</answer>", ("a", ["Up"], False)),
    ("<think>a</think><answer>Up ||</answer>", ("a", ["Up"], True)),  # empty pieces are dropped
    ("<think>a</think><answer>|| Up || \n || Down</answer>", ("a", ["Up", "Down"], True)),
    ("<think>a</think><answer>Up || .</answer>", ("a", ["Up"], False)),  # "." is a piece
    ("<think>a</think><answer> || </answer>", ("a", [], False)),  # no piece at all
    ("<think>a</think><answer>Up Down</answer>", ("a", [], False)),  # not separated by ||
    ("<think>a</think><answer>Up", ("a", [], False)),  # unclosed answer
    ("<think>still thinking", ("still thinking", [], False)),  # unclosed think
    ("<answer>Up</answer>", ("", [], False)),  # no think block
    ("<think>x <answer>Down</answer></think><answer>Up</answer><answer>Left</answer>",
     ("x <answer>Down</answer>", ["Up"], True)),
    ("<think><think>nested</think></think><answer>Dragon</answer>", ("nested", ["Dragon"], True)),
    ("", ("", [], False)),
])
def test_parse_worked_examples(text, expected):
    assert parse_response(text) == expected


@pytest.mark.parametrize("answer,max_actions,expected", [
    ("Up || Down || Jump", 2, (["Up", "Down"], True)),  # the cap comes first: Jump is never seen
    ("Up || Down || Jump", 3, (["Up", "Down"], False)),
    ("Up || Down || Jump", None, (["Up", "Down"], False)),
    ("Jump || Up || Down", 2, (["Up"], False)),  # the cap keeps Jump and Up, not Up and Down
    ("Jump || Up", 1, ([], False)),
    ("Up || Left || Down", 1, (["Up"], True)),
    (" || Up || || Left ||", 2, (["Up", "Left"], True)),  # empty pieces do not count to the cap
])
def test_parse_caps_the_pieces_before_checking_them(answer, max_actions, expected):
    text = f"<think>t</think><answer>{answer}</answer>"
    assert parse_response(text, max_actions=max_actions) == ("t", *expected)


def test_parse_respects_the_action_set():
    text = "<think></think><answer>Up || Phoenix</answer>"
    assert parse_response(text, ("Up", "Down", "Left", "Right")) == ("", ["Up"], False)
    assert parse_response(text) == ("", ["Up", "Phoenix"], True)  # every world's actions
    assert parse_response(None) == ("", [], False)
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="max_actions"):
            parse_response(text, max_actions=bad)


@settings(max_examples=300, deadline=None)
@given(st.text() | st.lists(st.sampled_from([
    "<think>", "</think>", "<answer>", "</answer>", "||", "up", "LEFT", "jump", " ", "\n", "x", "√",
    "Ⅷ", "İ"])).map("".join), st.integers(1, 4))
def test_parse_never_raises_and_the_cap_only_shortens(text, cap):
    """Capping keeps a prefix of the uncapped actions; a valid reply stays valid under any cap;
    a valid capped reply has exactly its first `cap` actions."""
    think, actions, valid = parse_response(text)
    assert isinstance(think, str) and set(actions) <= set(envs.ALL_ACTIONS)
    assert not valid or actions
    assert parse_response(text, max_actions=10 ** 9) == (think, actions, valid)
    _, capped, capped_valid = parse_response(text, max_actions=cap)
    assert len(capped) <= cap and capped == actions[:len(capped)]
    assert capped_valid >= valid and (not capped_valid or capped == actions[:cap])


@pytest.mark.parametrize("text, expected", [
    ("<think> 5 + 2 = 7 </think> <answer> 5 + 2 || 3 </answer>", ("5 + 2 = 7", ["5 + 2 || 3"], True)),
    ("<think>a</think><answer>  </answer>", ("a", [], False)),
    ("<think>a</think> 8", ("a", [], False)),
    ("<answer> 8 </answer>", ("", [], False)),
    ("<think></think><answer>Up</answer>", ("", ["Up"], True))])
def test_an_answer_world_reads_the_whole_answer_block(text, expected):
    """actions=None: the block's text is one action whatever it holds (the world scores it); an
    empty block or no closed blocks is a malformed reply."""
    assert parse_response(text, actions=None) == expected
    assert parse_response(text, actions=None, max_actions=1) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", "||", "5 + 2", " ",
                                 "x", "\n"])).map("".join))
def test_an_answer_reply_never_raises_and_is_valid_exactly_with_an_answer(text):
    think, answer, valid = parse_response(text, actions=None)
    assert isinstance(think, str) and len(answer) <= 1 and valid == bool(answer)
    assert all(a == a.strip() and a for a in answer)


def test_parse_huge_input():
    text = "<think>" + "a" * 1_000_000 + "</think><answer>" + "Up || " * 10_000 + "</answer>"
    think, actions, valid = parse_response(text)
    assert len(think) == 1_000_000 and actions == ["Up"] * 10_000 and valid
    assert parse_response(text, max_actions=2)[1:] == (["Up", "Up"], True)


# ----------------------------------------------------------------------------------------- registry

def test_make_env_and_errors():
    assert isinstance(make_env("SOKOBAN"), Sokoban)
    assert make_env("frozenlake", success_rate=1 / 3).success_rate == 1 / 3
    with pytest.raises(ValueError, match="valid: bandit, countdown, frozenlake, sokoban, wordproblems"):
        make_env("chess")
    with pytest.raises(ValueError, match="valid: size, p, success_rate, desc, max_steps"):
        make_env("frozenlake", slip=0.2)
    for name, cls in envs.ENVS.items():
        env = make_env(name)
        obs, info = env.reset(seed=3)
        assert env.name == name and obs == env.render() and info["success"] is False and env.rules
        assert isinstance(env.legend, str)
        if env.actions is None:  # an answer world: its worked example, no action names
            assert isinstance(env, textenv.AnswerEnv) and "<answer>" in env.example
        else:
            assert set(env.actions) <= set(envs.ALL_ACTIONS)


def test_a_new_world_is_one_class_and_one_entry(monkeypatch):
    class Corridor(envs.TextEnv):
        """Walk right to the end of a corridor of length 3."""
        name, actions, max_steps = "corridor", ("Left", "Right"), 5
        rules, legend = "Reach the end.", "P you"

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


# ---------------------------------------------------------------------------------------- baselines

def test_random_policy_baseline_matches_the_exact_probability():
    """P(random walk reaches G within max_steps), by dynamic programming over (cell, steps left),
    vs `baselines`."""
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


def test_the_coordinates_line_names_every_object_where_the_world_holds_it():
    """--observation coords' line (envs.coordinates) lists the player, the goal and every hole of a
    FrozenLake map, and the player, boxes and targets of a Sokoban room, at the cells the world
    holds them in (row, column, zero-indexed), and nothing else."""
    def holes_of(line):  # the (row, col) pairs the line lists after "holes"
        pairs = line.split("holes ", 1)[1].rstrip(".")
        return [] if pairs == "none" else sorted(tuple(map(int, p.strip("()").split(",")))
                                                 for p in pairs.split(", "))
    seen_holes = 0
    for seed in range(30):
        lake = FrozenLake()
        grid, _ = lake.reset(seed=seed)
        line = envs.coordinates("frozenlake", grid)
        holes = [(r, c) for r, row in enumerate(lake.grid) for c, ch in enumerate(row) if ch == "H"]
        goal = [(r, c) for r, row in enumerate(lake.grid) for c, ch in enumerate(row) if ch == "G"]
        assert line.startswith(f"Player ({lake.pos[0]},{lake.pos[1]}), goal ({goal[0][0]},{goal[0][1]}), holes ")
        assert holes_of(line) == sorted(holes)
        seen_holes += len(holes)
        room = Sokoban()
        grid, _ = room.reset(seed=seed)
        line = envs.coordinates("sokoban", grid)
        player, boxes = divmod(room.player, room.width), [divmod(b, room.width) for b in room.boxes]
        targets = [divmod(t, room.width) for t in room.targets]
        assert line == (f"Player ({player[0]},{player[1]}), box " + ", ".join(f"({r},{c})" for r, c in boxes)
                        + ", target " + ", ".join(f"({r},{c})" for r, c in targets) + ".")
    assert seen_holes > 10
    with pytest.raises(ValueError, match="no grid"):
        envs.coordinates("bandit", "")
