"""A two-armed bandit for an LLM agent (RAGEN-2's stochastic world for the filter): arms named
Phoenix and Dragon. The safe arm always pays `low_reward` (0.1); the risky arm pays `high_reward`
(1) with prob. `high_prob` (0.25), else 0. Which name is the risky arm, and the order in which the
arms are described, are drawn from `seed`, so the right choice depends on reading the prompt. One
pull ends the episode; success means pulling the arm with the higher expected payout (the risky one
by default: 0.25 > 0.1).
"""
from worlds.textenv import TextEnv, check, rngs


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
        check(0 <= high_prob <= 1, f"high_prob must be in [0, 1], got {high_prob!r}")
        self.low_reward, self.high_reward = float(low_reward), float(high_reward)
        self.high_prob = float(high_prob)

    def reset(self, seed=None, noise_seed=None):
        rng, self.noise = rngs(seed, noise_seed)
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
