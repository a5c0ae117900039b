"""What the tiny policy is shown and taught: its prompts, the solver's demonstrations, and behaviour
cloning on them.

A random network never writes a valid action, so every turn would earn the format penalty and RL
would see no reward spread (RAGEN-2, Sec. 3: no variance, no task gradient). The tiny policy
(tiny.py) is therefore first trained on demonstrations, played through rollout.play so that the data
is token for token the transcript the RL loop produces, by minimising the cross-entropy of the
policy's own tokens (mask m = policy_mask):

    L(theta) = - sum_{b,t} m[b,t] log pi_theta(y[b,t] | y[b,<t]) / sum_{b,t} m[b,t]

What the tiny policy sees (`user_turn`). Its user turn is the grid and a line that names where the
objects are and how far apart ("Player (1,0), goal (3,1). Goal: 2 Down, 1 Right."); Sokoban's line
also says what lies next to the player ("Around: Up wall, Down floor, Left box, Right floor."). This
is a perception aid: a 2-layer network trained for minutes reads neither coordinates off a grid nor
their differences. Which way to go, where to stand to push and when to take two moves is left to the
policy.

What it is taught to say (`describe`, `demonstration`). Its reasoning restates the way (FrozenLake),
or copies the ways to the box and target and then names the solver's next push and the way to the
cell it is pushed from (Sokoban: "Box 1 Down, 1 Right. Target 0 Down, 1 Left. Push Left from 1 Down,
2 Right."), so each number it works out sits a few tokens after the ones it is worked out from; the
answer gives the solver's next moves. Countdown and the word problems have no grid and no line:
the policy reads the puzzle or the question as it stands, and its reasoning works the solver's
arithmetic out one step at a time, each result the next step's start ("5 + 8 = 13, 13 - 6 = 7."),
the answer the solver's expression or number. Demonstrations are imperfect on purpose -- with probability
`noise` a turn tries a random move, and a turn plays one or two moves (a fair coin) -- so the
warm-started policy stays far from always succeeding and RL has room to improve. With a template
prior (templates.py) a share of the turns reason with an input-agnostic sentence instead, the
answer still the solver's: a warm start whose template share is known.
"""
import math
import os
import random

import torch

import envs
import logprobs
import ppo
import rollout

# demonstrations use seeds from here on, away from the small seeds used for validation
DEMO_SEEDS = 1_000_000
ROUND = 4  # batches of demonstrations played at once, then cut by length


# -------------------------------------------------------------------------------- what it is taught

def _next_push(env, plan):
    """(direction, (row, col) the player pushes from) of the first move of `plan` that moves a
    box, or None."""
    state = env.state()
    for action in plan:
        nxt, _, _ = env.next_state(state, action)
        if nxt[1] != state[1]:
            return action, divmod(state[0], env.width)
        state = nxt
    return None


def describe(env, plan):
    """Reasoning for the current state and what `plan` (the solver's moves to come) does.

    >>> env = envs.Sokoban(room="######\\n#P_XO#\\n######"); _ = env.reset()
    >>> describe(env, ["Right", "Right"])
    'Box 0 Down, 2 Right. Target 0 Down, 1 Right. Push Right from 0 Down, 1 Right.'
    """
    if env.name == "sokoban":
        push = _next_push(env, plan)
        if not push:  # the solver found no plan: the box is stuck, and the turn tries a random move
            return "Stuck."
        player, boxes, targets = envs.object_cells(env.name, env.render())
        ways = (f"Box {envs.way_between(player[0], boxes[0])}. "
                f"Target {envs.way_between(boxes[0], targets[0])}. "
                if len(boxes) == len(targets) == 1 else "")
        return f"{ways}Push {push[0]} from {envs.way_between(player[0], push[1])}."
    if env.name == "frozenlake":
        (player,), (goal,) = envs.object_cells(env.name, env.render())
        return f"Goal: {envs.way_between(player, goal)}."
    if env.name == "bandit":
        expected = env.high_reward * env.high_prob
        return f"{env.risky} expects {expected:g}, {env.safe} pays {env.low_reward:g}."
    if env.name == "countdown":  # the solver's expression, worked out left to right
        if not plan:
            return "Stuck."
        terms = plan[0].split()
        return chain(int(terms[0]), [(op, int(n)) for op, n in zip(terms[1::2], terms[2::2])])
    if env.name == "wordproblems":  # the question's steps in order
        return chain(env.start, env.ops)
    raise ValueError(f"no demonstrations for world {env.name!r}: {', '.join(envs.ENVS)}")


def chain(start, steps):
    """Arithmetic worked out one step at a time, each result the next step's start (Countdown's
    and the word problems' reasoning):

    >>> chain(5, [("+", 2), ("-", 3), ("*", 2)])
    '5 + 2 = 7, 7 - 3 = 4, 4 * 2 = 8.'
    """
    parts, total = [], start
    for op, n in steps:
        new = total + n if op == "+" else total - n if op == "-" else total * n
        parts.append(f"{total} {op} {n} = {new}")
        total = new
    return ", ".join(parts) + "."


def work_out(env, plan):
    """Reasoning that works the way out from the coordinates a real model reads with
    --observation coords (envs.coordinates): FrozenLake restates the player's and the goal's cells,
    then the way between them, so each number it computes sits just after the ones it comes from;
    the other worlds reason as `describe`.

    >>> env = envs.FrozenLake(desc=["SF", "FG"]); _ = env.reset()
    >>> work_out(env, ["Down", "Right"])
    'From (0,0) to (1,1): 1 Down, 1 Right.'
    """
    if env.name != "frozenlake":
        return describe(env, plan)
    (player,), (goal,) = envs.object_cells(env.name, env.render())
    way = envs.way_between(player, goal)
    return f"From ({player[0]},{player[1]}) to ({goal[0]},{goal[1]}): {way}."


def demonstration(env, rng, noise=0.2, max_actions=2, template_prior=0.0, pool=(), filler=None,
                  reason=describe):
    """One demonstration turn for the env's current state, continuing a prompt that ends with
    "<think>": with prob. `noise` one random move ("Try Left."), else the solver's next 1 or
    `max_actions` moves (a fair coin). With prob. `template_prior` the reasoning is instead a
    sentence drawn uniformly from `pool` (templates.py), the answer the solver's next 1 or
    `max_actions` moves; at 0 no draw is made, so the stream is the one without a prior. A
    callable `pool` draws the template itself, pool(rng, env) (templates.surface_template: another
    layout's task reasoning); `filler(rng)`, when given, is appended to every reasoning
    (templates.filler); `reason(env, plan)` writes the task reasoning (describe, or work_out).

    >>> env = envs.Sokoban(room="#####\\n#PXO#\\n#####"); _ = env.reset()
    >>> demonstration(env, random.Random(0), noise=0.0)
    ' Box 0 Down, 1 Right. Target 0 Down, 1 Right. Push Right from 0 Down, 0 Right. </think>
    <answer> Right </answer>'
    """
    plan = envs.solve(env) or []
    if template_prior and rng.random() < template_prior:
        reasoning = pool(rng, env) if callable(pool) else rng.choice(pool)
        moves = plan[:rng.choice((1, max_actions))] or [env.random_action(rng)]
    elif not plan or rng.random() < noise:
        moves = [env.random_action(rng)]
        reasoning = f"{reason(env, plan)} Try {moves[0]}."
    else:
        moves = plan[:rng.choice((1, max_actions))]
        reasoning = reason(env, plan)
    if filler is not None:
        reasoning += filler(rng)
    return f" {reasoning} </think> <answer> {' || '.join(moves)} </answer>"


def demo_policy(tokenizer, noise=0.2, max_actions=2, seed=0, template_prior=0.0, pool=(),
                filler=None, reason=describe):
    """A scripted policy for rollout.play: looks at each env, writes `demonstration(...)` and the
    end-of-turn token."""
    rng = random.Random(seed)
    end = rollout.end_of_turn_ids(tokenizer)[0]

    def policy(prompt_ids, worlds):
        texts = [demonstration(env, rng, noise, max_actions, template_prior, pool, filler, reason)
                 for env in worlds]
        return [rollout.Generation(tokenizer.encode(text, add_special_tokens=False) + [end])
                for text in texts]

    return policy


def demonstrations(tokenizer, env_name, seeds, env_kwargs=None, noise=0.2, seed=0, max_turns=5,
                   max_actions_per_turn=2, template_prior=0.0, pool=(), prompt=None,
                   filler=None, reason=describe):
    """Demonstration episodes (rollout.Episode) on `seeds`, one each, in the tiny policy's
    prompts, or in `prompt`'s (rollout.play's system / user pieces; {}: a real model's), their
    reasoning written by `reason`."""
    policy = demo_policy(tokenizer, noise=noise, max_actions=max_actions_per_turn, seed=seed,
                         template_prior=template_prior, pool=pool, filler=filler, reason=reason)
    return rollout.play(policy, tokenizer, env_name, seeds, 1, env_kwargs=env_kwargs,
                        max_turns=max_turns, max_actions_per_turn=max_actions_per_turn,
                        **(rollout.prompts(env_name, tiny=True) if prompt is None else prompt))


# -------------------------------------------------------------------------------- behaviour cloning

def demo_loss(model, batch):
    """Mean cross-entropy of the policy's tokens (policy_mask) under teacher forcing; batch from
    rollout.collate. Only the positions whose next token the policy wrote go through the output
    layer (logprobs.policy_logprobs)."""
    mask = batch["policy_mask"][:, 1:]                                                 # [B, T-1]
    logp, _ = logprobs.policy_logprobs(model, batch["input_ids"], mask)                # [B, T-1]
    return -ppo.masked_mean(logp, mask)


def schedule(step, steps):
    """The learning-rate factor: linear warm-up over the first 10% of steps, then cosine decay to
    0.1.

    >>> [round(schedule(s, 100), 3) for s in (0, 9, 10, 55, 99)]
    [0.1, 1.0, 1.0, 0.55, 0.1]
    """
    warmup = max(1, steps // 10)
    return min((step + 1) / warmup, 0.1 + 0.45 * (1 + math.cos(math.pi * max(0, step - warmup) /
                                                                max(1, steps - warmup))))


def imitate(model, tokenizer, env_name, env_kwargs=None, steps=600, batch_size=16, lr=1e-2,
            noise=0.2, seed=0, turns=5, start=0, state=None, on_step=None, template_prior=0.0,
            pool=(), prompt=None, filler=None, reason=describe):
    """Behaviour cloning: `steps` AdamW steps, each on `batch_size` fresh demonstrations (a share
    `template_prior` of their turns reasoning with a sentence of `pool`); returns the loss per
    step.

    Whole episodes of up to `turns` turns (a network taught first turns only writes garbage from the
    third on), played ROUND batches at a time and cut into batches after sorting by length (less
    padding to compute). To continue an interrupted run, pass `start` (a multiple of ROUND) and the
    optimiser `state`; on_step(step, loss, optimizer) is called after every step. `prompt`: the
    prompts the demonstrations are played in (demonstrations; default the tiny policy's); `reason`:
    what their reasoning says (describe; work_out for a real model reading coordinates).
    """
    pad = rollout.pad_token_id(tokenizer)
    device = next(model.parameters()).device  # the demonstrations go where the model is
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    if state is not None:
        optimizer.load_state_dict(state)
    model.train()
    losses = []
    for step in range(start, steps):
        if step % ROUND == 0 or step == start:  # play ROUND batches at once and cut them by length
            # fresh layouts every round
            first = DEMO_SEEDS + (seed * steps + step - step % ROUND) * batch_size
            seeds = range(first, first + ROUND * batch_size)
            played = demonstrations(tokenizer, env_name, seeds, env_kwargs, noise, seed=first,
                                    max_turns=turns, template_prior=template_prior, pool=pool,
                                    prompt=prompt, filler=filler, reason=reason)
            played.sort(key=lambda e: len(e.ids))
            batches = [played[k:k + batch_size] for k in range(0, len(played), batch_size)]
            random.Random(first).shuffle(batches)
        for group in optimizer.param_groups:
            group["lr"] = lr * schedule(step, steps)
        batch = rollout.collate(batches[step % ROUND], pad)
        loss = demo_loss(model, {k: v.to(device) for k, v in batch.items()})
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1], optimizer)
    model.eval()
    return losses


def saved_progress(partial, model, fresh):
    """The progress a stopped build kept in the file `partial` (keep_progress), loaded into `model`
    -> (model, step to continue at, optimiser state, losses so far); no file: (model, 0, None, []).
    A damaged file is said in one line and the build starts over on fresh(), a new model: a load
    that failed part way may have written some of the weights."""
    if os.path.isfile(partial):
        try:
            saved = torch.load(partial, weights_only=False)
            model.load_state_dict(saved["model"])
            return model, saved["step"], saved["optimizer"], saved["losses"]
        except Exception as e:  # noqa: BLE001 -- whatever a damaged file raises: start over
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            print(f"the saved progress of the warm start, {partial}, is damaged ({why}); "
                  f"building it from the start")
            model = fresh()
    return model, 0, None, []


def keep_progress(partial, model, optimizer, step, losses):
    """Save a build's progress after `step` steps for saved_progress: written aside, then moved
    over the last, so a kill leaves one whole file."""
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "losses": losses}, partial + ".tmp")
    os.replace(partial + ".tmp", partial)
