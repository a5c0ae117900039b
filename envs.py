"""The worlds: Sokoban, FrozenLake and a two-armed Bandit as text games for an LLM agent (RAGEN-2,
Sec. 4.1).

Every world is a class with a Gymnasium-style API and no Gymnasium dependency:

    obs, info = env.reset(seed, noise_seed=None)    # obs: the text grid; info["success"]: a bool
    obs, reward, terminated, truncated, info = env.step("Up")  # an action name (any case) or index

The layout (room, lake, which arm is which) depends only on `seed`; the transition noise (FrozenLake
slips, Bandit payouts) comes from its own generator seeded by `noise_seed` (default: `seed`), so the
rollouts of one prompt group can share a layout and still draw independent noise. `truncated` is
True when `max_steps` actions are used up without success. Stepping a finished episode, an unknown
action or a bad parameter raises ValueError.

Worlds (defaults as in the paper's main table):
- Sokoban, 6x6 room, 1 box, 10 actions. Rooms are made as gym-sokoban makes them (RAGEN's
  ragen/env/sokoban/utils.py, generate_room). A random walk stamps floor into a walled room; the
  player and the targets go on random floor cells, each box on its target. Play then runs backwards
  from that solved room, depth-first over every reachable state (at most `search_depth` - 2 = 298
  moves deep): the player steps Up, Down, Left or Right (tried in that order) and pulls the box
  behind it, if any. A state is scored box swaps (how often the pulled box changed; 1 for one box
  once it has moved) x box displacement (Manhattan distances of the boxes from their own targets),
  or 0 when a box or the player covers a target; the first state reached with the highest score is
  the room, and a best score of 0 draws the room again. Last, with prob. 0.8 (displacement 1) or
  0.5 the player walks 1-3 random cells away (each further step with prob. 0.5), so it need not
  start beside the box. Over 20000 seeds the optimal solutions average 4.14 moves (RAGEN's own
  generator: 4.13; 3.93 over its seeds 0-399), and about 1 room in 170 needs 11-15 moves: such a
  room is drawn again from the seed's own stream, so every room is solvable within `max_steps`
  (mean 4.08). The rooms follow RAGEN's distribution but are not its rooms: the layout comes from
  our own `random.Random(seed)`, not from numpy's seeded generator. `generator="bfs"` makes harder
  rooms instead (mean 4.9 moves): reverse play breadth-first to `max_steps` moves, pulling or not,
  and the box farthest from its target.
  Reward: -0.1 per action, +1 when a box reaches a target, -1 when a box leaves one, +10 when all
  boxes are on targets (which ends the episode: success). Walking into a wall, or pushing a box into
  a wall or another box, does not move.
- FrozenLake, 4x4. Each cell is frozen with prob. `p`, else a hole; start and goal are random; the
  map is drawn again until a path joins them. A move goes the intended way with prob.
  `success_rate`, otherwise to one of the two perpendicular directions with equal prob., never
  backwards; moving off the grid stays in place. Reward 1 and success at the goal; a hole ends the
  episode with reward 0. `success_rate=1` (default) is the paper's deterministic lake, 1/3 is
  Gymnasium's slippery one.
- Bandit, two arms named Phoenix and Dragon. The safe arm always pays `low_reward` (0.1); the risky
  arm pays `high_reward` (1) with prob. `high_prob` (0.25), else 0. Which name is the risky arm,
  and the order in which the arms are described, are drawn from `seed`, so the right choice depends
  on reading the prompt. One pull ends the episode; success means pulling the arm with the higher
  expected payout (the risky one by default: 0.25 > 0.1).

Text the prompt uses: `env.rules` (one paragraph: goal, rules, reward), `env.legend` (grid symbols)
and the observation `env.render()`. Sokoban: `#` wall, `_` floor, `O` target, `X` box, `√` box on
target, `P` player, `S` player on target. FrozenLake: `_` frozen, `O` hole, `G` goal, `P` player,
`X` player in a hole, `√` player on the goal.

`parse_response` reads a model's reply `<think> ... </think> <answer> A || B </answer>` into
actions and whether it keeps the format; `solve` finds a shortest action list by breadth-first
search. Adding a new environment is one class (a `TextEnv` with `reset`, `render`, `state`,
`next_state` and `_apply`) plus one entry in `ENVS`.
"""
import inspect
import operator
import random
import re
from collections import Counter

DIRECTIONS = ("Up", "Down", "Left", "Right")
MOVES = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}
PERPENDICULAR = {"Up": ("Left", "Right"), "Down": ("Left", "Right"),
                 "Left": ("Up", "Down"), "Right": ("Up", "Down")}

STEP_REWARD = -0.1      # every Sokoban action
BOX_ON_TARGET = 1.0     # a push puts a box onto a target
BOX_OFF_TARGET = -1.0   # a push takes a box off a target
SOLVED_REWARD = 10.0    # all boxes on targets


def _rngs(seed, noise_seed):
    """Two generators: the layout one from `seed`, the noise one from `noise_seed` (default `seed`);
    None = fresh."""
    seed, noise_seed = _as_int(seed, "seed"), _as_int(noise_seed, "noise_seed")
    noise_seed = seed if noise_seed is None else noise_seed
    # a string seed gives the noise stream its own sequence even when noise_seed == seed
    return random.Random(seed), random.Random(None if noise_seed is None else f"noise/{noise_seed}")


def _as_int(value, label):
    """None, or an int-like value (numpy ints too) as int; anything else is a ValueError."""
    if value is None:
        return None
    _check(hasattr(value, "__index__") and not isinstance(value, bool),
           f"{label} must be an int or None, got {value!r}")
    return operator.index(value)


def _check(ok, message):
    if not ok:
        raise ValueError(message)


# ---------------------------------------------------------------------------------- the shared part

class TextEnv:
    """What every world shares: action lookup, the step budget and episode bookkeeping.

    A world sets `name`, `actions`, `rules`, `legend`, `max_steps` and implements `reset` (which
    calls `_start`), `render`, `state()` (a hashable snapshot), `next_state(state, action) ->
    (state, terminated, success)` (the move when nothing random happens; `solve` searches with it)
    and `_apply(action) -> (reward, terminated, info)`.
    """
    name, actions, rules, legend, max_steps = "", (), "", "", 1

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

    def step(self, action):
        _check(not self.done, "the episode is over; call reset()")
        reward, terminated, info = self._apply(self.action_name(action))
        self.steps += 1
        self.success = info["success"]
        truncated = not terminated and self.steps >= self.max_steps
        self.done = terminated or truncated
        return self.render(), reward, terminated, truncated, info


# ------------------------------------------------------------------------------------------ Sokoban

# gym-sokoban's carving stamps: the cells, relative to the walker, that one step turns into floor
_MASKS = (((0, -1), (0, 0), (0, 1)), ((-1, 0), (0, 0), (1, 0)), ((0, -1), (0, 0), (1, 0)),
          ((0, -1), (0, 0), (1, -1), (1, 0)), ((0, 0), (0, 1), (1, 0)))
_HEADINGS = tuple(MOVES.values())
_MAX_EXPLORED = 300_000  # gym-sokoban stops reverse play after this many states


class Sokoban(TextEnv):
    """Push every box onto a target; generated rooms are solvable within `max_steps` actions.

    `room` (a text grid) fixes the room instead of generating one. `generator` is "dfs" (default:
    gym-sokoban's rooms, as RAGEN uses them; a room that needs more than `max_steps` moves is drawn
    again) or "bfs" (harder rooms: the box farthest from its target within `search_depth` moves);
    `search_depth` defaults to 300 ("dfs", as RAGEN's config) or `max_steps` ("bfs").
    >>> env = Sokoban(room="#####\\n#PXO#\\n#####")
    >>> env.reset()[0].splitlines()[1], env.step("Right")[1]   # push onto the target: -0.1 + 1 + 10
    ('#PXO#', 10.9)
    """
    name, actions = "sokoban", DIRECTIONS
    legend = ("# wall, _ floor, O target, X box, √ box on target, P you, "
              "S you standing on a target")
    rules = ("You are a Sokoban player in a walled room. Push every box (X) onto a target (O). "
             "Walking into a box pushes it one cell; you cannot pull boxes, and a box cannot be "
             "pushed into a wall or another box. Reward: -0.1 per action, +1 when a box reaches a "
             "target, -1 when a box leaves a target, +10 when every box is on a target, which ends "
             "the game.")
    SYMBOLS = {"#": "wall", "_": "floor", "O": "target", "X": "box", "√": "box on target",
               "P": "player", "S": "player on target"}

    def __init__(self, dim_room=(6, 6), num_boxes=1, max_steps=10, num_gen_steps=None,
                 search_depth=None, generator="dfs", room=None):
        _check(isinstance(max_steps, int) and max_steps >= 1,
               f"max_steps must be an int >= 1, got {max_steps!r}")
        _check(generator in ("dfs", "bfs"), f"generator must be 'dfs' or 'bfs', got {generator!r}")
        self.max_steps, self.generator = max_steps, generator
        if search_depth is None:
            search_depth = 300 if generator == "dfs" else max_steps
        least = 3 if generator == "dfs" else 1  # "dfs" scores states up to search_depth - 2 deep
        _check(isinstance(search_depth, int) and search_depth >= least,
               f"search_depth must be an int >= {least}, got {search_depth!r}")
        self.search_depth = search_depth
        self.room = None if room is None else self._parse_room(room)
        if self.room is not None:
            (self.height, self.width), self.num_boxes = self.room[0], len(self.room[2])
        else:
            _check(len(tuple(dim_room)) == 2 and all(isinstance(d, int) and d >= 5
                                                     for d in dim_room),
                   f"dim_room must be two ints >= 5 (rows, cols), got {dim_room!r}")
            self.height, self.width = dim_room
            most = (self.height - 2) * (self.width - 2) // 3
            _check(isinstance(num_boxes, int) and 1 <= num_boxes <= most,
                   f"num_boxes must be an int in 1..{most}, got {num_boxes!r}")
            self.num_boxes = num_boxes
        # gym-sokoban's default walk length: 1.7 * (rows + cols)
        self.num_gen_steps = (int(1.7 * (self.height + self.width)) if num_gen_steps is None
                              else num_gen_steps)
        _check(isinstance(self.num_gen_steps, int) and self.num_gen_steps >= 1,
               f"num_gen_steps must be an int >= 1, got {num_gen_steps!r}")
        self._steps = tuple(dr * self.width + dc for dr, dc in MOVES.values())  # Up Down Left Right

    @classmethod
    def _parse_room(cls, text):
        """Text grid -> ((rows, cols), walls, targets, boxes, player), cells as r * cols + c."""
        rows = str(text).strip().split("\n")
        _check(len({len(r) for r in rows}) == 1, "room rows must all have the same length")
        width, cells = len(rows[0]), "".join(rows)
        bad = set(cells) - set(cls.SYMBOLS)
        _check(not bad, f"unknown room symbols {sorted(bad)}; valid: {' '.join(cls.SYMBOLS)}")
        border = rows[0] + rows[-1] + "".join(r[0] + r[-1] for r in rows)
        _check(set(border) == {"#"}, "the room must be enclosed by walls (#)")
        at = lambda symbols: frozenset(i for i, ch in enumerate(cells)  # noqa: E731
                                       if ch in symbols)
        players, boxes, targets = at("PS"), at("X√"), at("O√S")
        _check(len(players) == 1,
               f"the room needs exactly one player (P or S), found {len(players)}")
        _check(len(boxes) == len(targets) >= 1,
               f"the room needs as many targets as boxes (>= 1), found {len(targets)} targets "
               f"and {len(boxes)} boxes")
        return (len(rows), width), at("#"), targets, boxes, next(iter(players))

    # -- generation: carve, place, play backwards from the solved room, let the player wander ------

    def _carve(self, rng):
        """gym-sokoban's topology: a random walk stamping masks of floor; returns the wall cells."""
        h, w = self.height, self.width
        floor = set()
        r, c = rng.randint(1, h - 1), rng.randint(1, w - 1)  # the first step clamps it inside
        dr, dc = rng.choice(_HEADINGS)
        for _ in range(self.num_gen_steps):
            if rng.random() < 0.35:  # gym-sokoban's p_change_directions
                dr, dc = rng.choice(_HEADINGS)
            r, c = min(max(r + dr, 1), h - 2), min(max(c + dc, 1), w - 2)
            floor.update((r + i) * w + c + j for i, j in rng.choice(_MASKS)
                         if 0 < r + i < h - 1 and 0 < c + j < w - 1)
        return frozenset(range(h * w)) - floor

    def _distance(self, a, b):
        return abs(a // self.width - b // self.width) + abs(a % self.width - b % self.width)

    def _reverse_dfs(self, walls, targets, player):
        """gym-sokoban's reverse play: depth-first from the solved room, every move a pull.

        Boxes start on their targets (box i on targets[i]). The player steps Up, Down, Left, Right
        (in that order) onto any cell free of walls and boxes, and a box right behind it follows (a
        pull). Each state is entered once (the first path to reach it scores it) and scored
            box swaps x box displacement,
        swaps = how often the pulled box changed along the path (the first pull counts: with one
        box it is 1 once the box has moved), displacement = sum over boxes of the Manhattan
        distance to their own target; 0 when a box or the player covers a target. A state is
        scored when at most search_depth - 2 moves deep (gym-sokoban's time-to-live counting).
        Returns (score, player, boxes, displacement) of the first state with the highest score.
        """
        on_target = frozenset(targets)
        best, seen = (-1, None, None, 0), set()
        # entries: player, boxes, pulled-at-least-once flags, swaps, last pulled box, displacement,
        # time to live; children pushed in reverse order come off the stack in the recursion's order
        stack = [(player, tuple(targets), (False,) * len(targets), 0, -1, 0, self.search_depth)]
        while stack:
            p, boxes, pulled, swaps, last, moved, ttl = stack.pop()
            ttl -= 1
            # the state as gym-sokoban hashes it: a pulled box is coded apart from an unmoved one
            key = (p, frozenset(zip(boxes, pulled)))
            if ttl <= 0 or len(seen) >= _MAX_EXPLORED or key in seen:
                continue
            seen.add(key)
            covered = p in on_target or not on_target.isdisjoint(boxes)
            score = 0 if covered else swaps * moved
            if score > best[0]:  # strictly greater: the first state found wins ties
                best = (score, p, boxes, moved)
            for d in self._steps[::-1]:
                q = p + d
                if q in walls or q in boxes:
                    continue
                if p - d in boxes:  # pull: the box behind the player moves onto its old cell
                    k = boxes.index(p - d)
                    t = targets[k]
                    stack.append((q, boxes[:k] + (p,) + boxes[k + 1:],
                                  pulled[:k] + (True,) + pulled[k + 1:], swaps + (k != last), k,
                                  moved + self._distance(p, t) - self._distance(p - d, t), ttl))
                else:
                    stack.append((q, boxes, pulled, swaps, last, moved, ttl))
        return best

    def _wander(self, walls, boxes, player, moved, rng):
        """RAGEN's addition (add_random_player_movement): with prob. 0.8 when the displacement is 1,
        else 0.5, the player walks 1-3 cells, so it need not start beside the box.

        Each step goes to a random free cell next to it that this walk has not visited; after each
        step the walk goes on with prob. 0.5 (so 1, 2, 3 steps with prob. 1/2, 1/4, 1/4 when the
        room leaves space).
        """
        if rng.random() >= (0.8 if moved == 1 else 0.5):
            return player
        visited = [player]
        while len(visited) <= 3:
            free = [player + d for d in self._steps if player + d not in walls
                    and player + d not in boxes and player + d not in visited]
            if not free:
                break
            player = rng.choice(free)
            visited.append(player)
            if len(visited) > 3 or rng.random() >= 0.5:
                break
        return player

    def _reverse_bfs(self, walls, targets, player, rng):
        """The "bfs" generator: reverse play breadth-first to search_depth moves, where each step
        may pull or not; the state whose boxes lie farthest (summed Manhattan) from their own
        targets wins, ties broken by `rng`. Returns (player, boxes), or None when no box can move.
        """
        start = (player, tuple(targets))
        seen, frontier = {start: None}, [start]
        for _ in range(self.search_depth):
            nxt = []
            for p, boxes in frontier:
                for d in self._steps:
                    q = p + d
                    if q in walls or q in boxes:
                        continue
                    children = [(q, boxes)]
                    if p - d in boxes:  # pull: the box behind the player follows it
                        children.append((q, tuple(p if b == p - d else b for b in boxes)))
                    for child in children:
                        if child not in seen:
                            seen[child] = None
                            nxt.append(child)
            frontier = nxt
        scored = [(sum(self._distance(b, t) for b, t in zip(boxes, targets)), (p, boxes))
                  for p, boxes in seen if set(boxes) != set(targets)]
        best = max((score for score, _ in scored), default=0)
        if best == 0:
            return None
        return rng.choice([s for score, s in scored if score == best])

    def _generate(self, rng):
        """Draw rooms from `rng` until one has a positive score and a plan of at most max_steps
        moves (RAGEN has no such check: about 1 room in 170 needs 11-15 moves there)."""
        for _ in range(10_000):
            walls = self._carve(rng)
            floor = sorted(frozenset(range(self.height * self.width)) - walls)
            if len(floor) <= self.num_boxes + 1:  # gym-sokoban raises here; RAGEN draws again
                continue
            player, *targets = rng.sample(floor, self.num_boxes + 1)
            if self.generator == "bfs":
                found = self._reverse_bfs(walls, targets, player, rng)
                if found is None:
                    continue
                player, boxes = found
            else:
                score, player, boxes, moved = self._reverse_dfs(walls, targets, player)
                if score <= 0:  # gym-sokoban's retries, then RAGEN's reset with another seed
                    continue
                player = self._wander(walls, boxes, player, moved, rng)
            self.walls, self.targets = walls, frozenset(targets)  # next_state reads these
            if _search(self, (player, frozenset(boxes)), self.max_steps) is not None:
                return walls, frozenset(targets), frozenset(boxes), player
        raise RuntimeError(f"could not generate a {self.height}x{self.width} room with "
                           f"{self.num_boxes} boxes solvable in {self.max_steps} moves")

    # -- play --------------------------------------------------------------------------------------

    def reset(self, seed=None, noise_seed=None):
        rng, _ = _rngs(seed, noise_seed)  # Sokoban has no noise
        if self.room is None:
            self.walls, self.targets, self.boxes, self.player = self._generate(rng)
        else:
            _, self.walls, self.targets, self.boxes, self.player = self.room
        return self._start()

    def render(self):
        grid = ["#" if i in self.walls else "_" for i in range(self.height * self.width)]
        for i in self.targets:
            grid[i] = "O"
        for i in self.boxes:
            grid[i] = "√" if i in self.targets else "X"
        grid[self.player] = "S" if self.player in self.targets else "P"
        w = self.width
        return "\n".join("".join(grid[r * w:(r + 1) * w]) for r in range(self.height))

    def state(self):
        return self.player, self.boxes

    def next_state(self, state, action):
        player, boxes = state
        dr, dc = MOVES[action]
        d = dr * self.width + dc
        q = player + d
        if q in self.walls or (q in boxes and (q + d in self.walls or q + d in boxes)):
            return state, False, False  # blocked: nobody moves
        if q in boxes:
            boxes = (boxes - {q}) | {q + d}
        solved = boxes == self.targets
        return (q, boxes), solved, solved

    def _apply(self, action):
        before = len(self.boxes & self.targets)
        old = self.state()
        (self.player, self.boxes), solved, _ = self.next_state(old, action)
        after = len(self.boxes & self.targets)
        reward = STEP_REWARD + (BOX_ON_TARGET if after > before else
                                BOX_OFF_TARGET if after < before else 0.0)
        reward += SOLVED_REWARD if solved else 0.0
        return reward, solved, {"success": solved, "action": action,
                                "effective": self.state() != old, "boxes_on_target": after}


# --------------------------------------------------------------------------------------- FrozenLake

class FrozenLake(TextEnv):
    """Walk from the start to the goal without falling into a hole; moves slip with prob.
    1 - success_rate.

    >>> env = FrozenLake(desc=["SF", "HG"])
    >>> env.reset(seed=0)[0], env.step("Right")[1:4], env.step("Down")[1:4]
    ('P_\\nOG', (0.0, False, False), (1.0, True, False))
    """
    name, actions = "frozenlake", DIRECTIONS
    legend = "_ frozen ice, O hole, G goal, P you, X you in a hole, √ you on the goal"

    def __init__(self, size=4, p=0.9, success_rate=1.0, desc=None, max_steps=10):
        _check(isinstance(size, int) and size >= 2, f"size must be an int >= 2, got {size!r}")
        _check(0 <= p <= 1, f"p must be in [0, 1], got {p!r}")
        _check(0 <= success_rate <= 1, f"success_rate must be in [0, 1], got {success_rate!r}")
        _check(isinstance(max_steps, int) and max_steps >= 1,
               f"max_steps must be an int >= 1, got {max_steps!r}")
        self.size, self.p, self.success_rate, self.max_steps = size, p, success_rate, max_steps
        self.desc = None if desc is None else self._parse_desc(desc)
        slip = ("The ice is not slippery: every move goes where you intend." if success_rate == 1
                else f"The ice is slippery: a move goes where you intend with probability "
                     f"{success_rate:.2g}, otherwise sideways (never backwards).")
        self.rules = ("You are walking on a frozen lake. Reach the goal (G) without falling into "
                      f"a hole (O). {slip} Walking off the edge keeps you in place. Reward: 1 for "
                      "reaching the goal, 0 otherwise; reaching the goal or falling into a hole "
                      "ends the game.")

    @staticmethod
    def _parse_desc(desc):
        rows = [row.strip() for row in (desc.strip().split("\n") if isinstance(desc, str)
                                        else desc)]
        _check(rows and len({len(r) for r in rows}) == 1 and len(rows[0]) >= 1,
               "desc rows must be non-empty and of equal length")
        cells = "".join(rows)
        _check(set(cells) <= set("SFHG"),
               f"desc symbols must be S, F, H or G, got {sorted(set(cells) - set('SFHG'))}")
        _check(cells.count("S") == 1 and cells.count("G") >= 1,
               "desc needs exactly one S and at least one G")
        return tuple(rows)

    @staticmethod
    def _random_map(size, p, rng):
        """Cells frozen with prob. p, random distinct start and goal, drawn again until a path joins
        them."""
        while True:
            grid = [["F" if rng.random() < p else "H" for _ in range(size)] for _ in range(size)]
            start, goal = rng.sample(range(size * size), 2)
            grid[start // size][start % size], grid[goal // size][goal % size] = "S", "G"
            grid = tuple("".join(row) for row in grid)
            if _reachable(grid, divmod(start, size), divmod(goal, size)):
                return grid

    def reset(self, seed=None, noise_seed=None):
        rng, self.noise = _rngs(seed, noise_seed)
        self.grid = self.desc if self.desc is not None else self._random_map(self.size, self.p, rng)
        self.pos = next((r, c) for r, row in enumerate(self.grid) for c, ch in enumerate(row)
                        if ch == "S")
        obs, info = self._start()
        return obs, {**info, "pos": self.pos}

    def render(self):
        rows = [list(row.replace("F", "_").replace("S", "_").replace("H", "O"))
                for row in self.grid]
        r, c = self.pos
        rows[r][c] = {"O": "X", "G": "√"}.get(rows[r][c], "P")
        return "\n".join("".join(row) for row in rows)

    def state(self):
        return self.pos

    def next_state(self, state, action):
        (r, c), (dr, dc) = state, MOVES[action]
        if 0 <= r + dr < len(self.grid) and 0 <= c + dc < len(self.grid[0]):
            r, c = r + dr, c + dc
        cell = self.grid[r][c]
        return (r, c), cell in "HG", cell == "G"

    def _apply(self, action):
        u = self.noise.random()
        side_a, side_b = PERPENDICULAR[action]
        rest = (1 - self.success_rate) / 2
        moved = (action if u < self.success_rate else
                 side_a if u < self.success_rate + rest else side_b)
        self.pos, terminated, success = self.next_state(self.pos, moved)
        return float(success), terminated, {"success": success, "action": action,
                                            "direction": moved, "pos": self.pos}


def _reachable(grid, start, goal):
    """Is there a path of non-hole cells from start to goal (4-neighbourhood)?"""
    seen, todo = {start}, [start]
    while todo:
        r, c = todo.pop()
        if (r, c) == goal:
            return True
        for dr, dc in MOVES.values():
            q = (r + dr, c + dc)
            inside = 0 <= q[0] < len(grid) and 0 <= q[1] < len(grid[0])
            if inside and grid[q[0]][q[1]] != "H" and q not in seen:
                seen.add(q)
                todo.append(q)
    return False


# ------------------------------------------------------------------------------------------- Bandit

class Bandit(TextEnv):
    """Two arms, one pull: the safe arm pays `low_reward`; the risky one `high_reward` with prob.
    `high_prob`, else 0.

    The seed decides which name is the risky arm. Success = pulling the arm with the higher
    expected payout.
    >>> env = Bandit(); print(env.reset(seed=0)[0])
    Dragon: pays 1 with probability 0.25, otherwise 0.
    Phoenix: pays 0.1 every time.
    >>> env.step("phoenix")[1:3], env.success   # safe: 0.1 for sure, below Dragon's 0.25 expected
    ((0.1, True), False)
    """
    name, actions, legend, max_steps = "bandit", ("Phoenix", "Dragon"), "", 1
    rules = ("There are two slot machines, Phoenix and Dragon, and you pull one of them once. One "
             "machine always pays a small amount; the other pays more, but only sometimes. The "
             "description says which is which. Reward: the payout. Pick the machine with the "
             "higher expected payout.")

    def __init__(self, low_reward=0.1, high_reward=1.0, high_prob=0.25):
        _check(0 <= high_prob <= 1, f"high_prob must be in [0, 1], got {high_prob!r}")
        self.low_reward, self.high_reward = float(low_reward), float(high_reward)
        self.high_prob = float(high_prob)

    def reset(self, seed=None, noise_seed=None):
        rng, self.noise = _rngs(seed, noise_seed)
        self.risky = rng.choice(self.actions)
        self.safe = next(a for a in self.actions if a != self.risky)
        self.order = tuple(rng.sample(self.actions, 2))  # the order of the description lines
        mean_risky, mean_safe = self.high_reward * self.high_prob, self.low_reward
        self.best = {a for a, m in ((self.risky, mean_risky), (self.safe, mean_safe))
                     if m >= max(mean_risky, mean_safe)}
        self.result = None
        return self._start()

    def render(self):
        lines = {self.safe: f"{self.safe}: pays {self.low_reward:g} every time.",
                 self.risky: f"{self.risky}: pays {self.high_reward:g} with probability "
                             f"{self.high_prob:g}, otherwise 0."}
        text = "\n".join(lines[a] for a in self.order)
        if self.result is None:
            return text
        return text + f"\nYou pulled {self.result[0]} and got {self.result[1]:g}."

    def state(self):
        return self.result is not None

    def next_state(self, state, action):
        return True, True, action in self.best

    def _apply(self, action):
        u = self.noise.random()
        reward = (self.low_reward if action == self.safe else
                  self.high_reward if u < self.high_prob else 0.0)
        self.result = (action, reward)
        success = action in self.best
        return reward, True, {"success": success, "action": action, "risky": action == self.risky}


# ----------------------------------------------------------------------------------------- registry

ENVS = {"sokoban": Sokoban, "frozenlake": FrozenLake, "bandit": Bandit}
ALL_ACTIONS = tuple(dict.fromkeys(a for cls in ENVS.values() for a in cls.actions))


def make_env(name, **kwargs):
    """make_env("frozenlake", success_rate=1/3) -> FrozenLake; unknown names or keywords raise
    ValueError."""
    _check(isinstance(name, str) and name.lower() in ENVS,
           f"unknown environment {name!r}; valid: {', '.join(sorted(ENVS))}")
    cls = ENVS[name.lower()]
    valid = [k for k in inspect.signature(cls).parameters]
    bad = sorted(set(kwargs) - set(valid))
    _check(not bad, f"unknown parameter(s) {bad} for {name}; valid: {', '.join(valid)}")
    return cls(**kwargs)


# ---------------------------------------------------------------------------- reading model replies

_TAG = {t: re.compile(re.escape(t), re.IGNORECASE)
        for t in ("<think>", "</think>", "<answer>", "</answer>")}
_PUNCT = " \t\r\n.,;:!?'\"`*()[]{}<>"


def parse_response(text, actions=ALL_ACTIONS, max_actions=None):
    """Reply -> (think, actions, valid), as RAGEN reads it; never raises on any `text`.

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
    """
    cap = _as_int(max_actions, "max_actions")
    _check(cap is None or cap >= 1, f"max_actions must be None or an int >= 1, got {max_actions!r}")
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
    pieces = [piece for piece in rest[start.end():end.start()].split("||") if piece.strip()]
    kept = pieces[:cap]  # the cap comes first: an invalid piece past it is never seen
    lookup = {a.lower(): a for a in actions}
    found = [lookup[p] for p in (piece.strip(_PUNCT).lower() for piece in kept) if p in lookup]
    return think, found, bool(kept) and len(found) == len(kept)


# ------------------------------------------------------------------------------------------ solving

def solve(env):
    """Shortest list of action names from the env's current state to success (breadth-first search),
    or None.

    The search uses `env.next_state`, i.e. moves that go as intended: exact for Sokoban and for
    FrozenLake with success_rate=1; for a slippery lake it is the shortest plan if nothing slips;
    for Bandit it is the better arm. Returns [] when the episode has already succeeded and None
    when success cannot be reached.
    >>> env = Sokoban(room="#####\\n#PXO#\\n#####"); _ = env.reset(); solve(env)
    ['Right']
    """
    if env.success:
        return []
    if env.done:
        return None
    return _search(env, env.state())


def _search(env, start, limit=None):
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


# ---------------------------------------------------------------------------------------- baselines

def baselines(name, episodes=500, **kwargs):
    """Optimal solution lengths (from `solve`) and a uniformly random policy's success rate, with
    its standard error, over seeds 0..episodes-1."""
    env, lengths, wins = make_env(name, **kwargs), Counter(), 0
    for seed in range(episodes):
        env.reset(seed=seed)
        plan = solve(env)
        lengths[None if plan is None else len(plan)] += 1
        env.reset(seed=seed)
        pick = random.Random(10_000 + seed)
        while not env.done:
            env.step(pick.randrange(len(env.actions)))
        wins += env.success
    rate = wins / episodes
    return lengths, rate, (rate * (1 - rate) / episodes) ** 0.5


if __name__ == "__main__":
    print("Default settings, seeds 0..499: optimal plan length -> count (solve), and a uniformly "
          "random policy")
    for world in ENVS:
        lengths, rate, se = baselines(world)
        solved = {k: v for k, v in lengths.items() if k is not None}
        mean = sum(k * v for k, v in solved.items()) / max(1, sum(solved.values()))
        print(f"{world:10s} lengths {dict(sorted(solved.items()))}, unsolvable {lengths[None]}, "
              f"mean {mean:.2f}; random policy success {rate:.3f} +- {se:.3f}")
