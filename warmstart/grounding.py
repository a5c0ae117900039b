"""The exact label of input dependence for a real model's reasoning: does a sampled reasoning state
its own input's way, another input's way, or neither?

The tiny policy reads its way in its prompt (envs.positions) and its template share is known by
construction (templates.py). A real model reading the coordinates (--observation coords) is taught
to work the way out from them (demos.work_out: "From (1,0) to (3,1): 2 Down, 1 Right."), so on
FrozenLake a reasoning can be labelled exactly by the first way it states, rows then columns:

    grounded    its own input's way: the reasoning read its input
    flipped     its own input's step counts with a direction wrong ("2 Up" for "2 Down"): the
                input read, the work gone wrong -- not a template, whatever other input it matches
    borrowed    not its own nor a flip of it, but the way of another input of the diagnosed set:
                input-agnostic in effect, as a template is
    ungrounded  no way, or one that no input of the set has

A flip is checked before a borrowing: on a 4x4 lake the ways are few, so a flip often equals
another probe input's way by chance (before the split, 50 of the 52 reasonings labelled borrowed
at smollm2-templates' ALPHA 0 were such flips).

The shares over the diagnosed reasonings are logged beside the MI (grounded_share, flipped_share,
borrowed_share, ungrounded_share; probe_ on the probe set): a real model's analogue of template_share. Only
FrozenLake has a way to label.
"""
import re

import envs

WAY = re.compile(r"(\d+) (Up|Down), (\d+) (Left|Right)")
LABELS = ("grounded", "flipped", "borrowed", "ungrounded")


def stated_way(text):
    """The first way a text states -> (rows down, columns right), or None. A level axis reads the
    same either way ("0 Up" is "0 Down").

    >>> stated_way(" From (1,0) to (0,1): 1 Up, 1 Right. Try Up.")
    (-1, 1)
    >>> stated_way(" 0 Up, 2 Left.") == stated_way(" 0 Down, 2 Left."), stated_way(" Go left.")
    (True, None)
    """
    found = WAY.search(text)
    if found is None:
        return None
    rows, down, cols, right = found.groups()
    return (int(rows) * (1 if down == "Down" else -1), int(cols) * (1 if right == "Right" else -1))


def input_way(env_name, env_kwargs, seed):
    """The way of the input an episode of layout `seed` starts from: player to goal in rows and
    columns (FrozenLake), or None in a world without one."""
    if env_name != "frozenlake":
        return None
    grid, _ = envs.make_env(env_name, **(env_kwargs or {})).reset(seed=seed)
    player_goal = envs.COORDINATES[env_name][:2]
    (player,), (goal,) = (envs.where(grid, symbols) for _, symbols in player_goal)
    return goal[0] - player[0], goal[1] - player[1]


def copied_cells(env):
    """What a reasoning that works the way out (demos.work_out) copies from its input first: the
    player's and the goal's cells, 'From (r,c) to (r,c):' (FrozenLake).

    >>> env = envs.FrozenLake(desc=["SF", "FG"]); _ = env.reset()
    >>> copied_cells(env)
    'From (0,0) to (1,1):'
    """
    player_goal = envs.COORDINATES[env.name][:2]
    (player,), (goal,) = (envs.where(env.render(), symbols) for _, symbols in player_goal)
    return f"From ({player[0]},{player[1]}) to ({goal[0]},{goal[1]}):"


def copy_ids(tokenizer, env_name, env_kwargs, seeds):
    """For each input (a layout seed) the token ids of what its reasoning copies from it (the
    reasoning begins with the space after "<think>"): what plumbing/probe_set.py's work MI scores each
    reasoning's work after. Only FrozenLake read with coordinates has such a copy."""
    out = []
    for seed in seeds:
        env = envs.make_env(env_name, **(env_kwargs or {}))
        env.reset(seed=seed)
        out.append(tokenizer.encode(" " + copied_cells(env), add_special_tokens=False))
    return out


def label(reasoning, own, others):
    """grounded, flipped, borrowed or ungrounded (module docstring): `own` the reasoning's input's
    way, `others` the ways of the other inputs of the diagnosed set.

    >>> label(" From (1,0) to (3,1): 2 Down, 1 Right.", (2, 1), {(1, 1)})
    'grounded'
    >>> label(" From (1,0) to (3,1): 2 Up, 1 Right.", (2, 1), {(-2, 1)})
    'flipped'
    >>> label(" From (1,0) to (3,1): 1 Down, 1 Right.", (2, 1), {(1, 1)})
    'borrowed'
    >>> label(" From (1,0) to (3,1): 3 Up, 1 Left.", (2, 1), {(1, 1)})
    'ungrounded'
    """
    stated = stated_way(reasoning)
    if stated is None:
        return "ungrounded"
    if stated == own:
        return "grounded"
    if tuple(map(abs, stated)) == tuple(map(abs, own)):
        return "flipped"
    return "borrowed" if stated in others else "ungrounded"


def shares(episodes, ways):
    """The share of the episodes' first reasonings with each label -> {grounded_share,
    flipped_share, borrowed_share, ungrounded_share}; `ways`: {group: the way of that group's input}, the
    diagnosed set's inputs."""
    counts = dict.fromkeys(LABELS, 0)
    for e in episodes:
        others = {w for g, w in ways.items() if g != e.group}
        counts[label(e.first.reasoning, ways[e.group], others)] += 1
    return {f"{name}_share": n / max(1, len(episodes)) for name, n in counts.items()}
