"""Arithmetic word problems with retries: the math world of RAGEN-2's main table, standing in for
MetaMathQA's column (no dataset is reachable here, so the questions are generated).

    Ava has 7 apples. Ava buys 4 more. Then Ava gives 3 to Ben. How many apples does Ava have now?
                                                                                     ->   8

A question is a start amount and `operations` steps, each one of: buy / find / be given n more
(+ n), give away / lose / sell n (- n, never down to 0), double or triple them (* 2, * 3); the
numbers n are drawn from 1..`max_number`, the names and things from fixed lists, all from the
seed. The answer is the exact integer.

Retries, as the official MetaMathQA env: a wrong answer is told "Incorrect. Please think again."
and the episode goes on, up to `attempts` answers; a correct answer at attempt k (k = 0, 1, ...)
earns 1 / 2^k and ends it. Answers are compared after normalisation, the official one (lower
case, white space removed) and a trailing full stop dropped, and as numbers where both are ("8.0"
is 8). Where the official env differs: its next observation is the feedback alone (the question
stays in the conversation); here the question is shown again under it, so every turn states the
whole problem, as the grid worlds show their whole state. Success = a correct answer.
"""
from fractions import Fraction

from worlds.textenv import AnswerEnv, check, rngs

NAMES = ("Ava", "Ben", "Cara", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jill")
THINGS = ("apples", "stamps", "marbles", "books", "coins", "shells", "cards", "pens")
# (symbol, how a step says it); {n} the amount, {name} the owner, {friend} someone else
ADD = ("{name} buys {n} more.", "{name} finds {n} more.", "{friend} gives {name} {n} more.")
SUBTRACT = ("{name} gives {n} to {friend}.", "{name} loses {n}.", "{name} sells {n}.")
MULTIPLY = {2: "{name} doubles them.", 3: "{name} triples them."}
INCORRECT = "Incorrect. Please think again."


def normalise(answer):
    """An answer as compared: lower case, no white space, no trailing full stop; a number as its
    exact value.

    >>> normalise(" 8. "), normalise("8.0"), normalise("Eight")
    ('8', '8', 'eight')
    """
    text = "".join(str(answer).lower().split()).rstrip(".")
    try:
        return str(Fraction(text))
    except (ValueError, ZeroDivisionError):
        return text


class WordProblems(AnswerEnv):
    """Answer an arithmetic word problem; a wrong answer may try again, for half the reward.

    >>> env = WordProblems(); print(env.reset(seed=2)[0])
    Ava has 6 stamps. Ava finds 5 more. Then Ava sells 4. How many stamps does Ava have now?
    >>> env.step("6")[1:3], env.step("7.")[1:3], env.success   # the second attempt: 1/2
    ((0.0, False), (0.5, True), True)
    """
    name, legend = "wordproblems", ""
    example = ("Ben has 5 pens. Ben buys 3 more. How many pens does Ben have now? -> <think> 5 + 3 "
               "= 8. </think> <answer> 8 </answer>")

    def __init__(self, operations=2, max_number=9, attempts=3):
        for label, value, top in (("operations", operations, 6), ("max_number", max_number, 999),
                                  ("attempts", attempts, 10)):
            check(isinstance(value, int) and 1 <= value <= top,
                  f"{label} must be an int in 1..{top}, got {value!r}")
        self.operations, self.max_number, self.max_steps = operations, max_number, attempts
        self.rules = ("Solve the word problem and answer with the number alone. Reward: 1 for a "
                      "correct answer; a wrong one is told so and may try again, up to "
                      f"{attempts} answers, each later correct answer earning half as much as "
                      "the one before (1/2, 1/4, ...).")

    def reset(self, seed=None, noise_seed=None):
        rng, _ = rngs(seed, noise_seed)
        name, friend = rng.sample(NAMES, 2)
        things = rng.choice(THINGS)
        self.start = self.answer = rng.randint(1, self.max_number)
        sentences, self.ops = [f"{name} has {self.start} {things}."], []
        for k in range(self.operations):
            symbol, n, phrase = self._operation(rng, self.answer)
            self.ops.append((symbol, n))  # the steps in order, for the demonstrations' reasoning
            self.answer = self.answer + n if symbol == "+" else (
                self.answer - n if symbol == "-" else self.answer * n)
            sentences.append(("Then " if k else "") + phrase.format(name=name, friend=friend, n=n))
        sentences.append(f"How many {things} does {name} have now?")
        self.question, self.wrong = " ".join(sentences), 0
        return self._start()

    def _operation(self, rng, current):
        """One step: (symbol, amount, how it is said), never taking the amount below 1."""
        kinds = ["+", "*"] + (["-"] if current > 1 else [])
        symbol = rng.choice(kinds)
        if symbol == "*":
            n = rng.choice(tuple(MULTIPLY))
            return symbol, n, MULTIPLY[n]
        n = rng.randint(1, self.max_number if symbol == "+" else min(self.max_number, current - 1))
        return symbol, n, rng.choice(ADD if symbol == "+" else SUBTRACT)

    def render(self):
        return self.question if not self.wrong else f"{INCORRECT}\n{self.question}"

    def plan(self):
        return [str(self.answer)]

    def random_action(self, rng):
        """One of the numbers the question states, drawn uniformly."""
        return str(rng.choice([self.start] + [n for s, n in self.ops if s != "*"]))

    def _apply(self, action):
        correct = normalise(action) == normalise(self.answer)
        reward = 1.0 / 2 ** self.steps if correct else 0.0  # steps: the attempts before this one
        self.wrong += not correct
        return reward, correct, {"success": correct, "action": action}
