"""Sokoban for an LLM agent (RAGEN-2, Sec. 4.1): a 6x6 room, 1 box, 10 actions by default.

Rooms are made as gym-sokoban makes them (RAGEN's ragen/env/sokoban/utils.py, generate_room). A
random walk stamps floor into a walled room; the player and the targets go on random floor cells,
each box on its target. Play then runs backwards from that solved room, depth-first over every
reachable state (at most `search_depth` - 2 = 298 moves deep): the player steps Up, Down, Left or
Right (tried in that order) and pulls the box behind it, if any. A state is scored box swaps (how
often the pulled box changed; 1 for one box once it has moved) x box displacement (Manhattan
distances of the boxes from their own targets), or 0 when a box or the player covers a target; the
first state reached with the highest score is the room, and a best score of 0 draws the room again.
Last, with prob. 0.8 (displacement 1) or 0.5 the player walks 1-3 random cells away (each further
step with prob. 0.5), so it need not start beside the box. Over 20000 seeds the optimal solutions
average 4.14 moves (RAGEN's own generator: 4.13; 3.93 over its seeds 0-399), and about 1 room in 170
needs 11-15 moves: such a room is drawn again from the seed's own stream, so every room is solvable
within `max_steps` (mean 4.08). The rooms follow RAGEN's distribution but are not its rooms: the
layout comes from our own `random.Random(seed)`, not from numpy's seeded generator.
`generator="bfs"` makes harder rooms instead (mean 4.9 moves): reverse play breadth-first to
`max_steps` moves, pulling or not, and the box farthest from its target.
Reward: -0.1 per action, +1 when a box reaches a target, -1 when a box leaves one, +10 when all
boxes are on targets (which ends the episode: success). Walking into a wall, or pushing a box into
a wall or another box, does not move.

Symbols: `#` wall, `_` floor, `O` target, `X` box, `√` box on target, `P` player, `S` player on
target.
"""
from worlds.textenv import DIRECTIONS, MOVES, TextEnv, check, rngs, search

STEP_REWARD = -0.1      # every Sokoban action
BOX_ON_TARGET = 1.0     # a push puts a box onto a target
BOX_OFF_TARGET = -1.0   # a push takes a box off a target
SOLVED_REWARD = 10.0    # all boxes on targets

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
        check(isinstance(max_steps, int) and max_steps >= 1,
              f"max_steps must be an int >= 1, got {max_steps!r}")
        check(generator in ("dfs", "bfs"), f"generator must be 'dfs' or 'bfs', got {generator!r}")
        self.max_steps, self.generator = max_steps, generator
        if search_depth is None:
            search_depth = 300 if generator == "dfs" else max_steps
        least = 3 if generator == "dfs" else 1  # "dfs" scores states up to search_depth - 2 deep
        check(isinstance(search_depth, int) and search_depth >= least,
              f"search_depth must be an int >= {least}, got {search_depth!r}")
        self.search_depth = search_depth
        self.room = None if room is None else self._parse_room(room)
        if self.room is not None:
            (self.height, self.width), self.num_boxes = self.room[0], len(self.room[2])
        else:
            check(len(tuple(dim_room)) == 2 and all(isinstance(d, int) and d >= 5
                                                    for d in dim_room),
                  f"dim_room must be two ints >= 5 (rows, cols), got {dim_room!r}")
            self.height, self.width = dim_room
            most = (self.height - 2) * (self.width - 2) // 3
            check(isinstance(num_boxes, int) and 1 <= num_boxes <= most,
                  f"num_boxes must be an int in 1..{most}, got {num_boxes!r}")
            self.num_boxes = num_boxes
        # gym-sokoban's default walk length: 1.7 * (rows + cols)
        self.num_gen_steps = (int(1.7 * (self.height + self.width)) if num_gen_steps is None
                              else num_gen_steps)
        check(isinstance(self.num_gen_steps, int) and self.num_gen_steps >= 1,
              f"num_gen_steps must be an int >= 1, got {num_gen_steps!r}")
        self._steps = tuple(dr * self.width + dc for dr, dc in MOVES.values())  # Up Down Left Right

    @classmethod
    def _parse_room(cls, text):
        """Text grid -> ((rows, cols), walls, targets, boxes, player), cells as r * cols + c."""
        rows = str(text).strip().split("\n")
        check(len({len(r) for r in rows}) == 1, "room rows must all have the same length")
        width, cells = len(rows[0]), "".join(rows)
        bad = set(cells) - set(cls.SYMBOLS)
        check(not bad, f"unknown room symbols {sorted(bad)}; valid: {' '.join(cls.SYMBOLS)}")
        border = rows[0] + rows[-1] + "".join(r[0] + r[-1] for r in rows)
        check(set(border) == {"#"}, "the room must be enclosed by walls (#)")
        at = lambda symbols: frozenset(i for i, ch in enumerate(cells)  # noqa: E731
                                       if ch in symbols)
        players, boxes, targets = at("PS"), at("X√"), at("O√S")
        check(len(players) == 1,
              f"the room needs exactly one player (P or S), found {len(players)}")
        check(len(boxes) == len(targets) >= 1,
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
            if search(self, (player, frozenset(boxes)), self.max_steps) is not None:
                return walls, frozenset(targets), frozenset(boxes), player
        raise RuntimeError(f"could not generate a {self.height}x{self.width} room with "
                           f"{self.num_boxes} boxes solvable in {self.max_steps} moves")

    # -- play --------------------------------------------------------------------------------------

    def reset(self, seed=None, noise_seed=None):
        rng, _ = rngs(seed, noise_seed)  # Sokoban has no noise
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
