"""What every world shares: the TextEnv base class (a Gymnasium-style API), its two seeded random
streams, and the breadth-first solver that plans in any world through the world's own next_state.

Each world (sokoban.py, frozenlake.py, bandit.py, countdown.py, wordproblems.py) builds on it;
envs.py, the registry that names the worlds, sits above them all.

A world sets `name`, `actions`, `rules`, `legend`, `max_steps` and implements five things:

    reset(seed, noise_seed=None) -> (obs, info)      calls _start(); obs is the text the agent reads
    render() -> str                                   the state as text
    state() -> a hashable snapshot
    next_state(state, action) -> (state, terminated, success)   the move when nothing random happens
    _apply(action) -> (reward, terminated, info)      the move as it happens (with any noise)

and inherits `step(action) -> (obs, reward, terminated, truncated, info)`, with the step budget,
action names in any case (or an index) and the episode's bookkeeping. The layout depends only on
`seed`; the transition noise has its own generator seeded by `noise_seed` (rngs). `solve` searches
breadth-first with next_state, so any world that implements it can be solved and can have its
generated layouts checked for a solution.

A world whose action is a free-text answer (an arithmetic expression, a number) is an `AnswerEnv`:
its `actions` is None, the reply's whole answer block is the one action of a turn
(envs.parse_response), it states a worked `example` of a reply for the system prompt, and it plans
itself (`plan`: its own solver, where a search over named actions has nothing to enumerate).
Every world draws a uniformly random action with `random_action` (the random baselines).
"""
import operator
import random

DIRECTIONS = ("Up", "Down", "Left", "Right")
MOVES = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}


def rngs(seed, noise_seed):
    """Two generators: the layout one from `seed`, the noise one from `noise_seed` (default `seed`);
    None = fresh."""
    seed, noise_seed = as_int(seed, "seed"), as_int(noise_seed, "noise_seed")
    noise_seed = seed if noise_seed is None else noise_seed
    # a string seed gives the noise stream its own sequence even when noise_seed == seed
    return random.Random(seed), random.Random(None if noise_seed is None else f"noise/{noise_seed}")


def as_int(value, label):
    """None, or an int-like value (numpy ints too) as int; anything else is a ValueError."""
    if value is None:
        return None
    check(hasattr(value, "__index__") and not isinstance(value, bool),
          f"{label} must be an int or None, got {value!r}")
    return operator.index(value)


def check(ok, message):
    if not ok:
        raise ValueError(message)


# ----------------------------------------------------------------------------------- the base class

class TextEnv:
    """The base of every world: action lookup, the step budget and the episode's bookkeeping
    (`step`); a world implements `reset`, `render`, `state`, `next_state` and `_apply` (the module
    docstring says what each returns)."""
    name, actions, rules, legend, max_steps = "", (), "", "", 1
    example = ""  # a worked example of a reply, for the system prompt (answer worlds)
    turn_limit = None  # the most turns an episode may take whatever the loop allows (None: no own)

    def _start(self):
        self.steps, self.done, self.success = 0, False, False
        return self.render(), {"success": False}

    def action_name(self, action):
        """Canonical name of an action given by name (any case, spaces ignored) or index:
        'up' -> 'Up', 3 -> 'Right'."""
        if isinstance(action, str):
            for name in self.actions:
                if name.lower() == action.strip().lower():
                    return name
        elif (hasattr(action, "__index__") and not isinstance(action, bool)
              and 0 <= action < len(self.actions)):
            return self.actions[operator.index(action)]
        raise ValueError(f"unknown action {action!r}; valid: {', '.join(self.actions)} "
                         f"or 0..{len(self.actions) - 1}")

    def random_action(self, rng):
        """One action drawn uniformly from `actions` with the random.Random `rng`."""
        return rng.choice(self.actions)

    def plan(self):
        """A shortest list of actions from the current state to success, or None: breadth-first
        search with next_state (an answer world has its own solver)."""
        return search(self, self.state())

    def step(self, action):
        check(not self.done, "the episode is over; call reset()")
        reward, terminated, info = self._apply(self.action_name(action))
        self.steps += 1
        self.success = info["success"]
        truncated = not terminated and self.steps >= self.max_steps
        self.done = terminated or truncated
        return self.render(), reward, terminated, truncated, info


class AnswerEnv(TextEnv):
    """A world answered in free text: `actions` is None and any string is an action (its spaces
    stripped), so a reply that is no answer at all is data the world scores, never an error; a
    world implements `reset`, `render`, `_apply`, `plan` (its solver) and `random_action`."""
    actions = None

    def action_name(self, action):
        check(isinstance(action, str), f"an answer is a string, got {action!r}")
        return action.strip()


# ------------------------------------------------------------------------------------------ solving

def solve(env):
    """Shortest list of action names from the env's current state to success (breadth-first search),
    or None.

    The search uses `env.next_state`, i.e. moves that go as intended: exact for Sokoban and for
    FrozenLake with success_rate=1; for a slippery lake it is the shortest plan if nothing slips;
    for Bandit it is the better arm; an answer world (AnswerEnv) gives its solver's answer, [answer].
    Returns [] when the episode has already succeeded and None when success cannot be reached.
    >>> from worlds.sokoban import Sokoban
    >>> env = Sokoban(room="#####\\n#PXO#\\n#####"); _ = env.reset(); solve(env)
    ['Right']
    """
    if env.success:
        return []
    if env.done:
        return None
    return env.plan()


def search(env, start, limit=None):
    """Breadth-first search with env.next_state from `start`: a shortest action list to success, or
    None (also when every plan needs more than `limit` actions)."""
    parent, frontier, depth = {start: None}, [start], 0
    while frontier and (limit is None or depth < limit):
        depth, nxt = depth + 1, []
        for state in frontier:
            for action in env.actions:
                new, terminated, success = env.next_state(state, action)
                if success:
                    path = [action]
                    while parent[state] is not None:
                        state, action = parent[state]
                        path.append(action)
                    return path[::-1]
                if new not in parent:
                    parent[new] = (state, action)
                    if not terminated:
                        nxt.append(new)
        frontier = nxt
    return None
