"""Countdown (TinyZero's task, a column of RAGEN-2's main table): a list of numbers and a target;
one turn; the answer an arithmetic expression that uses every number of the list exactly once and
equals the target.

    Target: 4, nums: [5, 2, 3]        ->   5 + 2 - 3

Instances come from the seed alone (no dataset): `count` numbers drawn uniformly from
1..`max_number`, a sign drawn for each, the target their signed sum, drawn again until it is at
least 1 -- so every instance is solvable by the official rule (some choice of + and - between the
numbers reaches the target: RAGEN keeps only the dataset's instances that pass it).

Reward, as the official env: 1 for a correct expression; 0.1 for a well-formed one that uses
exactly the given numbers (as a multiset) but misses the target; 0 otherwise. The expression is
read by a small parser (`evaluate`; never Python's eval): integers, + - * /, unary minus and
parentheses, computed exactly with fractions; a division by zero is well-formed and has no value
(wrong, 0.1). Where the official env differs: it checks the numbers with a regular expression and
computes with eval, so a reply that is no expression but holds the right digits ("5 2 + 3 -")
scores 0.1 there and 0 here. Success = a correct expression.
"""
import itertools
import re
from fractions import Fraction

from worlds.textenv import AnswerEnv, check, rngs

REWARD, FORMAT_REWARD = 1.0, 0.1
MAX_DEPTH = 16  # nested parentheses the parser follows; deeper is not an expression here
_TOKEN = re.compile(r"\s*(?:(\d+)|(.))")
OPERATORS = ("+", "-", "*", "/")


# ------------------------------------------------------------------------------------------- parse

def tokens(text):
    """The expression's tokens: ints and one-character symbols (spaces dropped).

    >>> tokens("12*(3 -4)")
    [12, '*', '(', 3, '-', 4, ')']
    """
    out = []
    for number, symbol in _TOKEN.findall(text.strip()):
        out.append(int(number) if number else symbol)
    return out


def evaluate(text):
    """(value, numbers used) of an arithmetic expression, or None when it does not parse; value
    is a Fraction, or None after a division by zero.

        expr   = term (("+" | "-") term)*
        term   = factor (("*" | "/") factor)*
        factor = "-" factor | integer | "(" expr ")"

    >>> evaluate("5 + 2 - 3"), evaluate("(1 + 2) / 0"), evaluate("5 +"), evaluate("2 ** 3")
    ((Fraction(4, 1), [5, 2, 3]), (None, [1, 2, 0]), None, None)
    """
    if not isinstance(text, str) or not text.strip():
        return None
    items, used = tokens(text), []
    value, rest = _expr(items, used, 0)
    if rest != len(items) or value is _BAD:
        return None
    return value, used


_BAD = object()  # a parse failure, carried up the recursion


def _expr(items, used, at, depth=0):
    value, at = _term(items, used, at, depth)
    while value is not _BAD and at < len(items) and items[at] in ("+", "-"):
        op, (right, at) = items[at], _term(items, used, at + 1, depth)
        value = _BAD if right is _BAD else _combine(op, value, right)
    return value, at


def _term(items, used, at, depth):
    value, at = _factor(items, used, at, depth)
    while value is not _BAD and at < len(items) and items[at] in ("*", "/"):
        op, (right, at) = items[at], _factor(items, used, at + 1, depth)
        value = _BAD if right is _BAD else _combine(op, value, right)
    return value, at


def _factor(items, used, at, depth):
    if at >= len(items) or depth > MAX_DEPTH:
        return _BAD, at
    item = items[at]
    if item == "-":
        value, at = _factor(items, used, at + 1, depth + 1)
        return (value if value is _BAD or value is None else -value), at
    if isinstance(item, int):
        used.append(item)
        return Fraction(item), at + 1
    if item == "(":
        value, at = _expr(items, used, at + 1, depth + 1)
        if value is _BAD or at >= len(items) or items[at] != ")":
            return _BAD, at
        return value, at + 1
    return _BAD, at


def _combine(op, a, b):
    """a op b, exact; None (no value) after a division by zero, here or further in."""
    if a is None or b is None or (op == "/" and b == 0):
        return None
    return a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a / b


def score(answer, numbers, target):
    """(reward, correct) of an answer: REWARD when it uses exactly `numbers` and equals `target`,
    FORMAT_REWARD when it uses exactly them but does not, else 0.

    >>> score("5 + 2 - 3", [5, 2, 3], 4), score("5 + 2 + 3", [5, 2, 3], 4), score("5 + 2", [5, 2, 3], 4)
    ((1.0, True), (0.1, False), (0.0, False))
    """
    parsed = evaluate(answer)
    if parsed is None or sorted(parsed[1]) != sorted(numbers):
        return 0.0, False
    if parsed[0] is not None and parsed[0] == target:
        return REWARD, True
    return FORMAT_REWARD, False


# ------------------------------------------------------------------------------------------ solve

def signed_solution(numbers, target):
    """An expression of `numbers` joined by + and - that equals `target` (the official
    solvability rule), its positive terms first, each group in the list's order; None if there is
    none. The sign patterns are tried with more + first.

    >>> signed_solution([3, 5, 2], 4), signed_solution([3, 5, 2], 1)
    ('5 + 2 - 3', None)
    """
    for signs in itertools.product((1, -1), repeat=len(numbers)):
        if sum(s * n for s, n in zip(signs, numbers)) == target and 1 in signs:
            plus = [n for s, n in zip(signs, numbers) if s > 0]
            minus = [n for s, n in zip(signs, numbers) if s < 0]
            return " + ".join(map(str, plus)) + "".join(f" - {n}" for n in minus)
    return None


# -------------------------------------------------------------------------------------- the world

class Countdown(AnswerEnv):
    """Write an expression with every number of the list exactly once that equals the target.

    >>> env = Countdown(); print(env.reset(seed=0)[0])
    Target: 7, nums: [5, 8, 6]
    >>> env.step("8 - 6 + 5")[1:3], env.success
    ((1.0, True), True)
    """
    name, legend, max_steps = "countdown", "", 1
    turn_limit = 1  # one turn, as the official config: a reply that is no answer ends it too
    rules = ("Use every number of the list exactly once, with + - * / and parentheses, to write an "
             "expression equal to the target. Reward: 1 for a correct expression, 0.1 for one that "
             "uses exactly the given numbers but misses the target, 0 otherwise.")
    example = ("Target: 9, nums: [4, 7, 2] -> <think> 7 + 4 = 11, 11 - 2 = 9. </think> <answer> "
               "7 + 4 - 2 </answer>")

    def __init__(self, count=3, max_number=9):
        check(isinstance(count, int) and 2 <= count <= 6, f"count must be an int in 2..6, got "
                                                          f"{count!r}")
        check(isinstance(max_number, int) and 1 <= max_number <= 999,
              f"max_number must be an int in 1..999, got {max_number!r}")
        self.count, self.max_number = count, max_number

    def reset(self, seed=None, noise_seed=None):
        rng, _ = rngs(seed, noise_seed)
        self.target = 0
        while self.target < 1:  # one positive sign at least, and a positive total
            self.numbers = [rng.randint(1, self.max_number) for _ in range(self.count)]
            signs = [rng.choice((1, -1)) for _ in range(self.count)]
            self.target = sum(s * n for s, n in zip(signs, self.numbers))
        self.result = None
        return self._start()

    def render(self):
        text = f"Target: {self.target}, nums: [{', '.join(map(str, self.numbers))}]"
        if self.result is None:
            return text
        return text + f"\nYou answered {self.result[0]}: {self.result[1]:g} points."

    def plan(self):
        solution = signed_solution(self.numbers, self.target)
        return None if solution is None else [solution]

    def random_action(self, rng):
        """The numbers in a random order joined by random operators of + - * /."""
        numbers = rng.sample(self.numbers, len(self.numbers))
        ops = [rng.choice(OPERATORS) for _ in numbers[1:]]
        return " ".join([str(numbers[0])] + [f"{op} {n}" for op, n in zip(ops, numbers[1:])])

    def _apply(self, action):
        reward, correct = score(action, self.numbers, self.target)
        self.result = (action, reward)
        return reward, True, {"success": correct, "action": action}
