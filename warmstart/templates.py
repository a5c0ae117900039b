"""The template prior: template collapse with ground truth, a warm start whose reasoning is, with
a known probability, a fluent sentence that says nothing about the input.

The prior gives the MI diagnosis a policy whose input dependence is known by construction. With
probability ALPHA a demonstration turn's reasoning is replaced by a sentence drawn uniformly from a
pool of boilerplate of the kind a pretrained model writes ("Let me plan ahead now."), the answer
still the solver's move (demos.py). The paper's templates are short preambles from a pool of phrases
(its Fig. 1) and its collapse shortens outputs (Fig. 8): these are 4 to 8 tokens, against about 9
(FrozenLake) and 27 (Sokoban) for the task reasoning.

The pool is a full product of three slots (opener x action x ending), so sampling it uniformly is
three independent uniform choices, which a 2-layer policy can learn; its size n is chosen per world
so that the template reasoning's entropy log n matches the task reasoning's H(Z_task) over the
demonstrations' first turns:

    world        I_task = H(f(X))   H(Z_task | X)   H(Z_task)   pool n        log n
    frozenlake   3.670              0.778           4.448       4 x 7 x 3     4.431
    sokoban      5.012              0.778           5.790       6 x 11 x 5    5.799
    bandit       0.693              0.639           1.332       2 x 2 x 1     1.386

in nats, over 40,000 first turns (plug-in estimates; TASK, checked by tests/test_templates.py). The
task reasoning is f(X), a function of the state (demos.describe), followed with probability 0.2 by
an independent "Try <move>." (demos.demonstration's noise), so I_task = H(f(X)) and
H(Z_task | X) = -0.8 log 0.8 - 0.2 log(0.2 / |moves|).

Ground truth. With disjoint supports (no template is a task reasoning), given X = x the reasoning
is the mixture ALPHA U(pool) + (1 - ALPHA) p_task(z | x); a pool sentence has the same probability
ALPHA / n under every input, so it adds nothing to I(X;Z), and on task sentences the factor
(1 - ALPHA) cancels in p(z|x) / p(z):

    I(X;Z)  = (1 - ALPHA) I_task
    H(Z|X)  = h(ALPHA) + ALPHA log n + (1 - ALPHA) H(Z_task | X),   h = the binary entropy
    H(Z)    = h(ALPHA) + ALPHA log n + (1 - ALPHA) H(Z_task)        (level when log n = H(Z_task))

The cross-scoring estimate over N prompts cannot exceed log N: under the demonstration distribution
a task sample's gap is log N - log c, c the number of the N prompts whose f equals its own, and a
template's is 0, so its expectation is (1 - ALPHA) G(N) with G(N) = sum_f p_f E[log N - log(1 + B)],
B ~ Binomial(N - 1, p_f) (capped_gap; theory.md, Sec. 7).
"""
import collections
import contextlib
import copy
import fcntl
import functools
import hashlib
import itertools
import json
import math
import os
import re
import sys

import envs
from warmstart import grounding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OPENERS = ("Let me", "I will", "I should", "I need to", "Now I will", "I want to", "Time to",
           "I must")
ACTIONS = ("think", "plan ahead", "focus", "be careful", "stay calm", "look closely",
           "think it through", "take it slow", "make a plan", "pick a move", "keep going",
           "do my best", "go step by step")
ENDINGS = (".", " now.", " first.", " here.", " again.")
# slots used per world: log(a * b * c) matches the world's H(Z_task) (module docstring)
POOL_SHAPE = {"frozenlake": (4, 7, 3), "sokoban": (6, 11, 5), "bandit": (2, 2, 1)}
NOISE = 0.2  # demos.imitate's default: the chance a turn tries a random move
# the task reasoning of the demonstrations' first turns (task_entropy on the first TASK_TURNS
# demonstration seeds, default settings): I_task = H(f(X)), H(Z_task | X), and the capped
# expectation G(N) at N = 8 and 32
TASK_TURNS = 40_000
TASK = {"frozenlake": {"i_task": 3.670, "h_given_x": 0.778, "gap": {8: 1.943, 32: 2.948}},
        "sokoban": {"i_task": 5.012, "h_given_x": 0.778, "gap": {8: 2.025, 32: 3.247}},
        "bandit": {"i_task": 0.693, "h_given_x": 0.639, "gap": {8: 0.626, 32: 0.677}}}


# ---------------------------------------------------------------------------------------- the pool

def sentences():
    """Every sentence of the grammar (all slots, every world's pool included): the words the tiny
    tokenizer learns when a warm start has a template prior."""
    return [f"{o} {a}{e}" for o, a, e in itertools.product(OPENERS, ACTIONS, ENDINGS)]


@functools.lru_cache(maxsize=None)
def pool(env_name):
    """The world's template pool: the first a openers x b actions x c endings (POOL_SHAPE).

    >>> pool("bandit")
    ('Let me think.', 'Let me plan ahead.', 'I will think.', 'I will plan ahead.')
    """
    if env_name not in POOL_SHAPE:
        raise ValueError(f"no template pool for world {env_name!r}: {', '.join(POOL_SHAPE)}")
    a, b, c = POOL_SHAPE[env_name]
    return tuple(f"{o} {x}{e}" for o, x, e in itertools.product(OPENERS[:a], ACTIONS[:b],
                                                                 ENDINGS[:c]))


@functools.lru_cache(maxsize=None)
def _members(env_name):
    """The world's pool as a set; a world without a pool (an answer world) has no templates."""
    return frozenset(pool(env_name)) if env_name in POOL_SHAPE else frozenset()


def is_template(reasoning, env_name):
    """Whether a sampled reasoning is exactly one of the world's pool sentences (the white space
    around it aside: Z starts with the space after "<think>").

    >>> is_template(" Let me think.", "bandit"), is_template(" Let me think. Try Up.", "bandit")
    (True, False)
    """
    return reasoning.strip() in _members(env_name)


def template_share(reasonings, env_name):
    """The fraction of `reasonings` that are pool sentences (None for none)."""
    reasonings = list(reasonings)
    if not reasonings:
        return None
    return sum(is_template(z, env_name) for z in reasonings) / len(reasonings)


# ------------------------------------------------------------------------------ the ground truth

def binary_entropy(p):
    """h(p) = -p log p - (1 - p) log(1 - p) in nats, 0 at 0 and 1."""
    return -sum(q * math.log(q) for q in (p, 1.0 - p) if q > 0)


def mixture(alpha, i_task, h_given_x, log_n):
    """I(X;Z), H(Z|X) and H(Z) of the demonstration distribution at template prior `alpha`, from
    the task reasoning's I_task and H(Z_task | X) and the pool's log n (module docstring).

    >>> {k: round(v, 4) for k, v in mixture(0.5, 2.0, 1.0, 3.0).items()}
    {'I_XZ': 1.0, 'H_Z_given_X': 2.6931, 'H_Z': 3.6931}
    """
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    given_x = binary_entropy(alpha) + alpha * log_n + (1 - alpha) * h_given_x
    return {"I_XZ": (1 - alpha) * i_task, "H_Z_given_X": given_x,
            "H_Z": given_x + (1 - alpha) * i_task}


def capped_gap(probs, n_prompts):
    """G(N) = sum_f p_f E[log N - log(1 + B)], B ~ Binomial(N - 1, p_f): the expected cross-scoring
    gap of a task sample among N prompts drawn from the demonstration distribution, whose task
    reasoning f has the distribution `probs` (a task sample scores alike under every prompt with its
    f and 0 under the others). At most log N; log N - G(N) is what the batch's repeated f cost.

    >>> round(capped_gap([0.5, 0.5], 2), 4)          # half the time the other prompt shares f
    0.3466
    """
    n = n_prompts
    total = 0.0
    for p in probs:
        expected = sum(math.comb(n - 1, k) * p ** k * (1 - p) ** (n - 1 - k) * math.log(1 + k)
                       for k in range(n))
        total += p * (math.log(n) - expected)
    return total


def noise_entropy(has_plan, moves, noise=NOISE):
    """H of the "Try <move>." suffix of one demonstration turn: with a plan, none with probability
    1 - noise, else one of `moves` moves uniformly; without one, always one of them."""
    if not has_plan:
        return math.log(moves)
    return binary_entropy(noise) + noise * math.log(moves) if noise > 0 else 0.0


def task_entropy(env_name, seeds=None, env_kwargs=None, noise=NOISE, prompts=(8, 32)):
    """The task reasoning of the demonstrations' first turns over `seeds` (the first TASK_TURNS
    demonstration seeds) -> {i_task: the plug-in H(f(X)), h_given_x: mean H(Z_task | X = x),
    h_task: their sum, gap: {N: G(N)}, support: the number of distinct f, samples}."""
    from warmstart import demos  # here: the report reads TASK and the pools without torch

    seeds = range(demos.DEMO_SEEDS, demos.DEMO_SEEDS + TASK_TURNS) if seeds is None else seeds
    counts, h_given_x = collections.Counter(), 0.0
    for seed in seeds:
        env = envs.make_env(env_name, **(env_kwargs or {}))
        env.reset(seed=seed)
        plan = envs.solve(env) or []
        counts[demos.describe(env, plan)] += 1
        h_given_x += noise_entropy(bool(plan), len(env.actions), noise)
    total = sum(counts.values())
    if not total:
        raise ValueError("task_entropy needs at least one seed")
    probs = [counts[f] / total for f in sorted(counts)]
    i_task = -sum(p * math.log(p) for p in probs)
    return {"i_task": i_task, "h_given_x": h_given_x / total,
            "h_task": i_task + h_given_x / total,
            "gap": {n: capped_gap(probs, n) for n in prompts}, "support": len(counts),
            "samples": total, "probs": probs}


def truth(env_name, alpha):
    """The closed-form numbers of `env_name`'s demonstrations at template prior `alpha`, from the
    quoted TASK: I(X;Z), H(Z|X), H(Z), and the capped expectation of the cross-scoring estimate
    (mi_seq_estimate) at each N of TASK."""
    task = TASK[env_name]
    out = mixture(alpha, task["i_task"], task["h_given_x"], math.log(len(pool(env_name))))
    out.update({f"mi_seq_estimate_N{n}": (1 - alpha) * g for n, g in task["gap"].items()})
    return out


# ------------------------------------------------------------------ surface-matched templates
#
# A template whose surface is a task reasoning: with probability ALPHA a first turn's reasoning is
# the demonstrator's reasoning for another layout of the same world, drawn independently (its own
# "Try <move>." noise included), the answer still the solver's move for the true layout. Its
# length, words and distribution are the task reasoning's, so H(Z) stays exactly level while I(X;Z)
# falls. The task reasoning is G = f(X) followed by a suffix S whose law q_g depends on g alone
# (with a plan: none w.p. 1 - noise, else "Try <move>."; "Stuck.": always "Try <move>."), p_f the
# law of f(X). Given X = x (f = f(x)) the reasoning's G is f w.p. 1 - ALPHA + ALPHA p_f and g != f
# w.p. ALPHA p_g; the marginal of Z is the task's, and q_g cancels in p(z|x) / p(z):
#
#   I(X;Z)  = sum_f p_f [(1 - a + a p_f) log((1 - a + a p_f) / p_f) + a (1 - p_f) log a]
#   H(Z)    = H(f(X)) + H(S|G) = I_task + H(Z_task|X)                          (level)
#   H(Z|X)  = H(Z) - I(X;Z)
#
# (a = ALPHA; I is I_task at 0, 0 at 1, and not linear between.) Family (b) appends to every
# reasoning (task or template) a filler " Think d d d d d." of FILLER_SLOTS digits, each "0" w.p.
# 1 - eps, else one of "1", "2", "3": independent of X and of the reasoning, it adds
# FILLER_SLOTS * (h(eps) + eps log 3) to H(Z|X) and H(Z) and nothing to I(X;Z). Choosing that to
# be I(X;Z) at each ALPHA (filler_eps) holds H(Z|X) = I_task + H(Z_task|X) level, and with it, at
# a constant length, the reasoning's mean token entropy, while I(X;Z) falls and H(Z) with it.

FILLER_SLOTS = 5
FILLER_DIGITS = "123"  # the random digits; "0" otherwise
FILLER = re.compile(r" Think(?: [0-3]){%d}\.$" % FILLER_SLOTS)
TEMPLATE_KINDS = ("pool", "surface")


def task_reasoning(env, rng, noise=NOISE):
    """The demonstrator's reasoning for the env's current state, as demos.demonstration writes it
    (the solver's plan described, then w.p. `noise` -- always without a plan -- "Try <move>.")."""
    from warmstart import demos

    plan = envs.solve(env) or []
    if not plan or rng.random() < noise:
        return f"{demos.describe(env, plan)} Try {rng.choice(env.actions)}."
    return demos.describe(env, plan)


def surface_template(noise=NOISE):
    """draw(rng, env) -> the task reasoning of another layout of env's world, drawn independently
    (a copy of env reset with a seed from `rng`; env itself is untouched)."""
    def draw(rng, env):
        other = copy.deepcopy(env)
        other.reset(seed=rng.randrange(2 ** 31))
        return task_reasoning(other, rng, noise)
    return draw


def filler(eps):
    """draw(rng) -> the filler appended to a reasoning: " Think" and FILLER_SLOTS digits, each a
    random one of FILLER_DIGITS w.p. `eps`, else "0" (eps = 0: no draw, a constant text)."""
    if not 0 <= eps <= 1:
        raise ValueError(f"the filler's eps must be in [0, 1], got {eps}")

    def draw(rng):
        digits = [rng.choice(FILLER_DIGITS) if eps and rng.random() < eps else "0"
                  for _ in range(FILLER_SLOTS)]
        return " Think " + " ".join(digits) + "."
    return draw


def filler_entropy(eps):
    """The filler's entropy in nats: FILLER_SLOTS * (h(eps) + eps log 3); at most log 4 a slot."""
    return FILLER_SLOTS * (binary_entropy(eps) + eps * math.log(len(FILLER_DIGITS)))


def filler_eps(target):
    """The eps in [0, 3/4] whose filler_entropy is `target` (bisection; it rises on [0, 3/4])."""
    if not 0 <= target <= filler_entropy(0.75) + 1e-12:
        raise ValueError(f"a filler holds 0 .. {filler_entropy(0.75):.3f} nats, not {target}")
    low, high = 0.0, 0.75
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if filler_entropy(mid) < target else (low, mid)
    return (low + high) / 2


def surface_mi(alpha, probs):
    """I(X;Z) at surface-matched template prior `alpha`, from the law `probs` of f(X).

    >>> round(surface_mi(0.5, [0.5, 0.5]), 4)     # (3/4) log(3/2) + (1/4) log(1/2)
    0.1308
    """
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    a = alpha
    return sum(p * ((1 - a + a * p) * math.log((1 - a + a * p) / p)
                    + (a * (1 - p) * math.log(a) if 0 < a < 1 else 0.0)) for p in probs)


def surface_mixture(alpha, probs, h_given_x, eps=None):
    """I(X;Z), H(Z|X), H(Z) of the first turns at surface-matched prior `alpha`, from the law of
    f(X), the suffix's H(S|G) = H(Z_task|X), and the filler's eps (None: no filler)."""
    i_task = -sum(p * math.log(p) for p in probs if p > 0)
    extra = 0.0 if eps is None else filler_entropy(eps)
    i_xz = surface_mi(alpha, probs)
    h_z = i_task + h_given_x + extra
    return {"I_XZ": i_xz, "H_Z_given_X": h_z - i_xz, "H_Z": h_z}


def surface_share(alpha, probs):
    """The expected share of first turns labelled templates (is_surface_template): a template
    whose layout has the true layout's f is the true layout's reasoning, so ALPHA (1 - sum p_f^2)."""
    return alpha * (1 - sum(p * p for p in probs))


def surface_estimates(alpha, probs, n_prompts):
    """The expectations of the cross-scoring estimates under the demonstrations at surface-matched
    prior `alpha`, N = n_prompts prompts drawn from them, exact likelihoods: {mi_seq: E[mean(matched
    - marginal)], hz_seq: E[-mean(marginal)] less H(S|G) and the filler's entropy (both cancel in
    the MI and add to H(Z) alike)}. With c the batch's prompts whose f is g (B ~ Binomial(N - 1,
    p_g) others), a sample from the first prompt scores (1 - a) [g = f_1] + a p_g and its marginal
    (1 - a) c / N + a p_g (theory.md, Sec. 7). At N -> infinity mi_seq -> surface_mi and hz_seq ->
    H(f(X)); at ALPHA = 0 mi_seq is capped_gap."""
    a, n = alpha, n_prompts
    mi = hz = 0.0
    for p in probs:
        binomial = [math.comb(n - 1, k) * p ** k * (1 - p) ** (n - 1 - k) for k in range(n)]
        own = (1 - a) + a * p  # P(G = g | f_1 = g): the own reasoning, or a template that matches
        for k, b in enumerate(binomial):
            if b == 0:
                continue
            cases = [(p * own, math.log(own), (1 - a) * (1 + k) / n + a * p)]
            if a > 0 and p < 1:  # a template of another f: g != f_1, c = k
                cases.append((a * p * (1 - p), math.log(a * p), (1 - a) * k / n + a * p))
            for weight, matched, marginal in cases:
                mi += weight * b * (matched - math.log(marginal))
                hz -= weight * b * math.log(marginal)
    return {"mi_seq": mi, "hz_seq": hz}


# where task_probs keeps the laws it computed, and the code they come from: a change to any of
# these files (the worlds, their solver, what a demonstration says) makes the law anew
LAW_CACHE = os.path.join(ROOT, ".cache", "task-law")
LAW_SOURCES = ("envs.py", "worlds", "warmstart/demos.py", "warmstart/templates.py")


@functools.lru_cache(maxsize=None)
def task_probs(env_name):
    """The law of f(X) over the first TASK_TURNS demonstration seeds (task_entropy's). It takes
    40,000 resets of the world (Sokoban's rooms: about half a minute), so it is kept in
    .cache/task-law/ under a key of the code that makes it (law_key) and read back exactly (JSON
    keeps every float's digits). One process computes it while others wait for its file (a test
    suite's workers); a cache that cannot be read or written is computed around."""
    path = os.path.join(LAW_CACHE, f"{env_name}-{law_key()}.json")
    probs = _read_law(path)
    if probs:
        return probs
    try:
        os.makedirs(LAW_CACHE, exist_ok=True)
        lock = open(path + ".lock", "w")
    except OSError:  # a read-only checkout: computed each time
        return tuple(task_entropy(env_name, prompts=())["probs"])
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its process ends
        probs = _read_law(path)  # written while this one waited
        if probs:
            return probs
        probs = tuple(task_entropy(env_name, prompts=())["probs"])
        with contextlib.suppress(OSError):
            with open(path + ".tmp", "w") as f:
                json.dump(probs, f)
            os.replace(path + ".tmp", path)  # whole or not at all
    return probs


def _read_law(path):
    """The law kept at `path`, or None: none there, or not a law (cut short, damaged)."""
    try:
        with open(path) as f:
            probs = tuple(float(p) for p in json.load(f))
    except (OSError, ValueError, TypeError):
        return None
    return probs if probs and all(p > 0 for p in probs) and abs(sum(probs) - 1) < 1e-9 else None


def law_key():
    """A hash of LAW_SOURCES' text (every .py file of a folder named), TASK_TURNS and the
    Python version (its random module draws the rooms): what task_probs' law depends on."""
    files = []
    for name in LAW_SOURCES:
        path = os.path.join(ROOT, name)
        files += ([os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".py")]
                  if os.path.isdir(path) else [path])
    digest = hashlib.sha256(f"{TASK_TURNS} {sys.version_info[:2]}".encode())
    for path in files:
        with open(path, "rb") as f:
            digest.update(os.path.relpath(path, ROOT).encode() + b"\0" + f.read())
    return digest.hexdigest()[:16]


def surface_truth(env_name, alpha, eps=None, n_prompts=(8, 32)):
    """templates.truth for surface-matched templates: the closed forms from the world's task_probs
    and TASK's H(Z_task|X), the expected labelled share, and the expected estimates at each N
    (mi_seq_estimate_N<n>, reasoning_entropy_seq_N<n>: hz_seq + H(S|G) + the filler's)."""
    probs = task_probs(env_name)
    h_s = TASK[env_name]["h_given_x"]
    out = surface_mixture(alpha, probs, h_s, eps)
    out["template_share"] = surface_share(alpha, probs)
    extra = 0.0 if eps is None else filler_entropy(eps)
    for n in n_prompts:
        est = surface_estimates(alpha, probs, n)
        out[f"mi_seq_estimate_N{n}"] = est["mi_seq"]
        out[f"reasoning_entropy_seq_N{n}"] = est["hz_seq"] + h_s + extra
    return out


def own_reasonings(env):
    """Every reasoning the demonstrator can write for the env's current state (task_reasoning's
    support)."""
    from warmstart import demos

    plan = envs.solve(env) or []
    said = demos.describe(env, plan)
    tries = {f"{said} Try {m}." for m in env.actions}
    return tries | {said} if plan else tries


def is_surface_template(reasoning, env):
    """Whether a first-turn reasoning (a filler at its end removed) is not one its own input's
    demonstrator could write, for the env at that input's state: a surface-matched template whose
    layout differs in f (or anything else that is not its input's reasoning).

    >>> env = envs.make_env("frozenlake"); _ = env.reset(seed=0)
    >>> own = sorted(own_reasonings(env))[0]
    >>> is_surface_template(" " + own + " Think 0 0 2 0 0.", env), is_surface_template(" Goal.", env)
    (False, True)
    """
    core = FILLER.sub("", reasoning.rstrip()).strip()
    return core not in own_reasonings(env)


def first_state(episode):
    """A copy of an episode's world at its first turn (reset with the episode's layout seed)."""
    env = copy.deepcopy(episode.env)
    env.reset(seed=episode.seed)
    return env


def share_of(episodes, env_name, kind="pool"):
    """The share of the episodes' first reasonings that are templates of `kind` (None for none):
    pool sentences (template_share), or surface-matched templates (is_surface_template against
    each episode's own first state)."""
    episodes = list(episodes)
    if kind == "pool":
        return template_share([e.first.reasoning for e in episodes], env_name)
    if kind != "surface":
        raise ValueError(f"template kind must be one of {', '.join(TEMPLATE_KINDS)}, got {kind!r}")
    if not episodes:
        return None
    return sum(is_surface_template(e.first.reasoning, first_state(e)) for e in episodes) / len(
        episodes)


# ------------------------------------------------------------------ a real model's templates
#
# SmolLM2 reading FrozenLake's coordinates (--observation coords) is taught to work the way out
# from them (demos.work_out): "From (1,0) to (3,1): 2 Down, 1 Right." is C, the cells copied from
# its input, then W, the way worked out from them, then (w.p. NOISE) S, "Try <move>.". Over the
# first TASK_TURNS demonstration seeds C takes 240 values, H(C) = 5.477 nats (= I_task: W is a
# function of C), H(W) = 3.670, and H(Z_task) = H(C) + H(S) = 6.255. Two kinds of template, on a
# share ALPHA of the demonstration turns (the answer still the solver's move):
#
#   pool      the whole reasoning a sentence of the full grammar (no cells copied): 8 x 13 x 5 =
#             520 sentences, log 520 = 6.254, so H(Z) stays level as in the tiny policy's prior:
#             I(X;Z) = (1 - ALPHA) H(C), H(Z) = h(ALPHA) + ALPHA log n + (1 - ALPHA) H(Z_task)
#   borrowed  the cells restated from the input, the way another layout's (drawn independently,
#             its own S): I(X;Z) = H(C) at every ALPHA -- the copy carries all of it -- while the
#             work's dependence on the input, I(X;W) = surface_mi(ALPHA, law of W), falls to 0
#
# so a whole-reasoning MI sees family `pool` fall and family `borrowed` stay level: copying the
# input hides a template there (theory.md, Sec. 7: the work's MI; grounding.copied_cells is the
# copy).
COORDS_POOL = "frozenlake-coords"  # the pool's key: a real model reading FrozenLake's coordinates
POOL_SHAPE[COORDS_POOL] = (len(OPENERS), len(ACTIONS), len(ENDINGS))
COORDS_TASK = {"h_copy": 5.477, "h_way": 3.670, "h_given_x": 0.778}  # over TASK_TURNS, in nats
REAL_TEMPLATE_KINDS = ("pool", "borrowed")


def borrowed_template(noise=NOISE):
    """draw(rng, env) -> env's own cells restated, then the way (and "Try <move>." noise) of
    another layout drawn independently; env itself is untouched."""
    from warmstart import demos

    def draw(rng, env):
        other = copy.deepcopy(env)
        other.reset(seed=rng.randrange(2 ** 31))
        way = demos.work_out(other, []).split(":", 1)[1]
        if rng.random() < noise:
            way += f" Try {rng.choice(env.actions)}."
        return grounding.copied_cells(env) + way
    return draw


def real_template(kind):
    """The `pool` (the full grammar) or `borrowed` template a real model reading FrozenLake's
    coordinates is taught on a share of its turns (demos.demonstration's `pool`)."""
    if kind not in REAL_TEMPLATE_KINDS:
        raise ValueError(f"a real model's template kind must be one of "
                         f"{', '.join(REAL_TEMPLATE_KINDS)}, got {kind!r}")
    return pool(COORDS_POOL) if kind == "pool" else borrowed_template()
