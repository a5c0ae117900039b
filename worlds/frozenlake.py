"""FrozenLake for an LLM agent (RAGEN-2, Sec. 4.1; its slip rate is the stochasticity of Sec. 5.2):
a 4x4 map by default. Each cell is frozen with prob. `p`, else a hole; start and goal are random;
the map is drawn again until a path joins them. A move goes the intended way with prob.
`success_rate`, otherwise to one of the two perpendicular directions with equal prob., never
backwards; moving off the grid stays in place. Reward 1 and success at the goal; a hole ends the
episode with reward 0. `success_rate=1` (default) is the paper's deterministic lake, 1/3 is
Gymnasium's slippery one.

Symbols: `_` frozen, `O` hole, `G` goal, `P` player, `X` player in a hole, `√` player on the goal.
"""
from worlds.textenv import DIRECTIONS, MOVES, TextEnv, check, rngs

PERPENDICULAR = {"Up": ("Left", "Right"), "Down": ("Left", "Right"),
                 "Left": ("Up", "Down"), "Right": ("Up", "Down")}


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
        check(isinstance(size, int) and size >= 2, f"size must be an int >= 2, got {size!r}")
        check(0 <= p <= 1, f"p must be in [0, 1], got {p!r}")
        check(0 <= success_rate <= 1, f"success_rate must be in [0, 1], got {success_rate!r}")
        check(isinstance(max_steps, int) and max_steps >= 1,
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
        check(rows and len({len(r) for r in rows}) == 1 and len(rows[0]) >= 1,
              "desc rows must be non-empty and of equal length")
        cells = "".join(rows)
        check(set(cells) <= set("SFHG"),
              f"desc symbols must be S, F, H or G, got {sorted(set(cells) - set('SFHG'))}")
        check(cells.count("S") == 1 and cells.count("G") >= 1,
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
        rng, self.noise = rngs(seed, noise_seed)
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
