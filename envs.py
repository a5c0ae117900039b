"""The worlds: Sokoban, FrozenLake, a two-armed Bandit, Countdown and arithmetic word problems as
text games for an LLM agent (RAGEN-2, Sec. 4.1 and its main table), and what sits above them: the
registry that names them, the reader of a model's replies and the worlds' baselines.

Every world is a class with a Gymnasium-style API and no Gymnasium dependency:

    obs, info = env.reset(seed, noise_seed=None)    # obs: the text grid; info["success"]: a bool
    obs, reward, terminated, truncated, info = env.step("Up")  # an action name (any case) or index

The layout (room, lake, which arm is which) depends only on `seed`; the transition noise (FrozenLake
slips, Bandit payouts) comes from its own generator seeded by `noise_seed` (default: `seed`), so the
rollouts of one prompt group can share a layout and still draw independent noise. `truncated` is
True when `max_steps` actions are used up without success. Stepping a finished episode, an unknown
action or a bad parameter raises ValueError.

Worlds (defaults as in the paper's main table), one file each:
- Sokoban (sokoban.py), 6x6 room, 1 box, 10 actions: rooms made as gym-sokoban makes them, each
  solvable within the budget. Reward -0.1 per action, +1 / -1 when a box reaches / leaves a target,
  +10 when all boxes are on targets.
- FrozenLake (frozenlake.py), 4x4: a random solvable map; a move slips to a perpendicular
  direction with prob. 1 - `success_rate` (1 by default: the paper's deterministic lake). Reward 1
  at the goal.
- Bandit (bandit.py), two arms: one always pays 0.1, the other 1 with prob. 0.25; which is which is
  drawn from `seed` and stated in the prompt.
- Countdown (countdown.py), 3 numbers of 1..9 and a target, one turn: the answer an arithmetic
  expression over the numbers. Reward 1 correct, 0.1 well-formed with exactly the numbers, else 0.
- Word problems (wordproblems.py), 2 steps of arithmetic, up to 3 answers: the math world that
  stands in for MetaMathQA. Reward 1 / 2^k for a correct answer at attempt k.

Countdown and the word problems are answer worlds (textenv.AnswerEnv): their action is the free
text of the answer block, not a name from a list.

Text the prompt uses: `env.rules` (one paragraph: goal, rules, reward), `env.legend` (the grid's
symbols, listed in each world's file) and the observation `env.render()`.

`parse_response` reads a model's reply `<think> ... </think> <answer> A || B </answer>` into
actions (in an answer world: the answer) and whether it keeps the format; `solve` (textenv.py) finds a shortest action list by
breadth-first search. Adding a new environment is one class (a `TextEnv` with `reset`, `render`,
`state`, `next_state` and `_apply`: textenv.py) plus one entry in `ENVS`.
"""
import inspect
import random
import re
from collections import Counter

from worlds.bandit import Bandit
from worlds.countdown import Countdown
from worlds.frozenlake import FrozenLake
from worlds.sokoban import Sokoban
from worlds.textenv import AnswerEnv, TextEnv, as_int, check, solve
from worlds.wordproblems import WordProblems

# ----------------------------------------------------------------------------------------- registry

ENVS: dict[str, type[TextEnv]] = {"sokoban": Sokoban, "frozenlake": FrozenLake, "bandit": Bandit,
                                  "countdown": Countdown, "wordproblems": WordProblems}
# the named actions of every world that has them (answer worlds have none: their answer is text)
ALL_ACTIONS = tuple(dict.fromkeys(a for cls in ENVS.values() for a in cls.actions or ()))


def make_env(name, **kwargs):
    """make_env("frozenlake", success_rate=1/3) -> FrozenLake; unknown names or keywords raise
    ValueError."""
    check(isinstance(name, str) and name.lower() in ENVS,
          f"unknown environment {name!r}; valid: {', '.join(sorted(ENVS))}")
    cls = ENVS[name.lower()]
    if kwargs:  # read the signature only when there is something to check: it is slow
        valid = [k for k in inspect.signature(cls).parameters]
        bad = sorted(set(kwargs) - set(valid))
        check(not bad, f"unknown parameter(s) {bad} for {name}; valid: {', '.join(valid)}")
    return cls(**kwargs)


# -------------------------------------------------------------------------- what a policy is shown

OBSERVATIONS = ("grid", "coords")  # --observation: the paper's bare grid, or with its coordinates
# the objects the coordinates line names, per world: (name, the grid symbols that show it)
COORDINATES = {"frozenlake": (("Player", "PX√"), ("goal", "G√"), ("holes", "OX")),
               "sokoban": (("Player", "PS"), ("box", "X√"), ("target", "O√S"))}


def where(grid, symbols):
    """(row, col) of every cell of a rendered grid holding one of `symbols`.

    >>> where("#P\\nX_", "PS")
    [(0, 1)]
    """
    return [(r, c) for r, row in enumerate(grid.split("\n")) for c, ch in enumerate(row)
            if ch in symbols]


def coordinates(name, grid):
    """The line under the grid with --observation coords: the zero-indexed (row, col) of each
    object, as RAGEN's grid_coord observation lists them (its CoordFrozenLake, CoordSokoban) --
    where things are, not the way from one to the other.

    >>> coordinates("frozenlake", "P_O\\n__G")
    'Player (0,0), goal (1,2), holes (0,2).'
    """
    check(name in COORDINATES, f"{name} has no grid to give coordinates of")
    return ", ".join(f"{label} " + (", ".join(f"({r},{c})" for r, c in where(grid, symbols))
                                    or "none")
                     for label, symbols in COORDINATES[name]) + "."


# The tiny policy's observation line (rollout.tiny_user): where the objects are and the way between
# them, a perception aid (a 2-layer network trained for minutes reads neither coordinates off a grid
# nor their differences); which way to go is still the policy's to choose.
# the objects the tiny policy's positions line names, per world: (name, grid symbols that show
# it); the coordinates line's but FrozenLake's holes, which the tiny policy is not told
OBJECTS = {"sokoban": COORDINATES["sokoban"], "frozenlake": COORDINATES["frozenlake"][:2]}
NEIGHBOURS = (("Up", -1, 0), ("Down", 1, 0), ("Left", 0, -1), ("Right", 0, 1))


def object_cells(env_name, grid):
    """The cells of each object OBJECTS names, in its order:
    object_cells("frozenlake", "P_\\n_G") == [[(0, 0)], [(1, 1)]]."""
    return [where(grid, symbols) for _, symbols in OBJECTS[env_name]]


def way_between(frm, to):
    """How far cell `to` lies from `frm`, rows then columns, always both:
    way_between((0, 2), (1, 1)) == '1 Down, 1 Left'."""
    (dr, dc) = (to[0] - frm[0], to[1] - frm[1])
    return f"{abs(dr)} {'Up' if dr < 0 else 'Down'}, {abs(dc)} {'Left' if dc < 0 else 'Right'}"


def positions(env_name, obs):
    """Where the objects of a grid are, and how far apart, as text (a way is always rows, then
    columns):

    >>> positions("frozenlake", "P_\\n_G")
    'Player (0,0), goal (1,1). Goal: 1 Down, 1 Right.'

    Sokoban adds the way from the player to the box and from the box to the target (one-box rooms),
    then what lies next to the player (`around`).
    """
    cells = object_cells(env_name, obs)
    at = [", ".join(f"({r},{c})" for r, c in found) or "none" for found in cells]
    text = ", ".join(f"{name} {where}" for (name, _), where in zip(OBJECTS[env_name], at)) + "."
    one_each = all(len(found) == 1 for found in cells)
    if env_name == "frozenlake":
        return text + f" Goal: {way_between(cells[0][0], cells[1][0])}." if one_each else text
    if one_each:
        text += (f" Box: {way_between(cells[0][0], cells[1][0])}. "
                 f"Target: {way_between(cells[1][0], cells[2][0])}.")
    return text + f" {around(obs)}" if len(cells[0]) == 1 else text


def around(obs):
    """What lies next to the Sokoban player; outside the grid counts as wall.

    >>> around("###\\n#PX\\n#_#")
    'Around: Up wall, Down floor, Left wall, Right box.'
    """
    rows = obs.split("\n")
    (r, c), = where(obs, "PS")

    def cell(rr, cc):
        inside = 0 <= rr < len(rows) and 0 <= cc < len(rows[rr])
        return Sokoban.SYMBOLS[rows[rr][cc]] if inside else "wall"

    ways = ", ".join(f"{name} {cell(r + dr, c + dc)}" for name, dr, dc in NEIGHBOURS)
    return f"Around: {ways}."


# ---------------------------------------------------------------------------- reading model replies

_TAG = {t: re.compile(re.escape(t), re.IGNORECASE)
        for t in ("<think>", "</think>", "<answer>", "</answer>")}
_PUNCT = " \t\r\n.,;:!?'\"`*()[]{}<>"


def parse_response(text, actions=ALL_ACTIONS, max_actions=None):
    """Reply -> (think, actions, valid), as RAGEN reads it; never raises on any `text`.
    `actions=None` reads an answer world's reply: the answer block's whole text, stripped, is the
    one action, and the reply is valid when it is not empty (RAGEN's worlds without an action list
    take the raw pieces).

    think: the text before the first `</think>`, after the last `<think>` before it (the opening
    tag may be missing: the prompt can end with it). The answer is the first `<answer> ...
    </answer>` after `</think>`, split on `||`; pieces that are empty after stripping spaces are
    dropped, and only the first `max_actions` of the others are kept (None: all of them).
    actions: the kept pieces that, stripped of spaces and punctuation, name one of `actions` (any
    case), in canonical case. valid: there is a closed think block, then a closed answer block
    with at least one kept piece, and every kept piece is an action. RAGEN executes `actions` and
    gives a reply that is not valid the format penalty (ragen/llm_agent: ctx_manager.py caps the
    pieces, es_manager.py penalises). Lenient where RAGEN is strict: tags in any case, punctuation
    around action names, text between the two blocks.
    >>> parse_response("<think> box left of me </think> <answer>right || UP. || jump</answer>")
    ('box left of me', ['Right', 'Up'], False)
    >>> parse_response("<think>box</think> <answer>right || UP. || jump ||</answer>", max_actions=2)
    ('box', ['Right', 'Up'], True)
    >>> parse_response("<think> 5 + 2 = 7 </think> <answer> 5 + 2 </answer>", actions=None)
    ('5 + 2 = 7', ['5 + 2'], True)
    """
    cap = as_int(max_actions, "max_actions")
    check(cap is None or cap >= 1, f"max_actions must be None or an int >= 1, got {max_actions!r}")
    if not isinstance(text, str):
        return "", [], False
    close = _TAG["</think>"].search(text)
    if close is None:
        opens = list(_TAG["<think>"].finditer(text))
        return (text[opens[-1].end():] if opens else "").strip(), [], False
    head, rest = text[:close.start()], text[close.end():]
    opens = list(_TAG["<think>"].finditer(head))
    think = (head[opens[-1].end():] if opens else head).strip()
    start = _TAG["<answer>"].search(rest)
    end = _TAG["</answer>"].search(rest, start.end()) if start else None
    if end is None:
        return think, [], False
    if actions is None:  # an answer world: the whole block, one action
        answer = rest[start.end():end.start()].strip()
        return think, [answer] if answer else [], bool(answer)
    pieces = [piece for piece in rest[start.end():end.start()].split("||") if piece.strip()]
    kept = pieces[:cap]  # the cap comes first: an invalid piece past it is never seen
    lookup = {a.lower(): a for a in actions}
    found = [lookup[p] for p in (piece.strip(_PUNCT).lower() for piece in kept) if p in lookup]
    return think, found, bool(kept) and len(found) == len(kept)


# ---------------------------------------------------------------------------------------- baselines

def baselines(name, episodes=500, **kwargs):
    """Optimal solution lengths (from `solve`) and a uniformly random policy's success rate, with
    its standard error, over seeds 0..episodes-1. The random policy takes env.random_action each
    step: a uniformly random action name, or an answer world's random answer (its file says
    which)."""
    env, lengths, wins = make_env(name, **kwargs), Counter(), 0
    for seed in range(episodes):
        env.reset(seed=seed)
        plan = solve(env)
        lengths[None if plan is None else len(plan)] += 1
        env.reset(seed=seed)
        pick = random.Random(10_000 + seed)
        while not env.done:
            env.step(env.random_action(pick))
        wins += env.success
    rate = wins / episodes
    return lengths, rate, (rate * (1 - rate) / episodes) ** 0.5


def solver_success(name, episodes=500, **kwargs):
    """The share of seeds 0..episodes-1 that the solver's plan, played out, succeeds on (1 for
    every world whose layouts are solvable by construction and deterministic)."""
    env, wins = make_env(name, **kwargs), 0
    for seed in range(episodes):
        env.reset(seed=seed)
        for action in solve(env) or []:
            if not env.done:
                env.step(action)
        wins += env.success
    return wins / episodes


if __name__ == "__main__":
    print("Default settings, seeds 0..499: optimal plan length -> count (solve), and a uniformly "
          "random policy")
    for world in ENVS:
        lengths, rate, se = baselines(world)
        solved = {k: v for k, v in lengths.items() if k is not None}
        mean = sum(k * v for k, v in solved.items()) / max(1, sum(solved.values()))
        print(f"{world:12s} lengths {dict(sorted(solved.items()))}, unsolvable {lengths[None]}, "
              f"mean {mean:.2f}; random policy success {rate:.3f} +- {se:.3f}; solver success "
              f"{solver_success(world):.3f}")
