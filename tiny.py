"""The embedded tiny policy: a small Qwen2 LM and a tokenizer built in code, warm-started on solver demonstrations.

A new top-level file because it holds one concept of its own: the policy that lets the main job run, and learn, on a
laptop CPU with no download. The rest of the code treats it exactly like a Qwen2.5 model.

Tokenizer. Word-level: text is cut into pieces -- the tags <think> </think> <answer> </answer> ||, words, numbers, runs
of white space, any other single character -- and every piece seen in the worlds' prompts is one token, so a grid cell
is one token. An unseen piece falls back to its longest known prefixes, down to single characters (every printable
ASCII character and every character of the prompts is a token), and decoding concatenates the pieces, so
decode(encode(s)) == s and no prompt meets <unk>. Chat template: ChatML as Qwen2.5 writes it.

Warm start (behaviour cloning). A random network never writes a valid action, so every turn would earn the format
penalty and RL would see no reward spread (RAGEN-2, Sec. 3: no variance, no task gradient). The first use per world
therefore trains the network on demonstrations, played through rollout.play so that the data is token for token the
transcript the RL loop produces, by minimising the cross-entropy on the policy's own tokens (mask m = policy_mask):

    L(theta) = - sum_{b,t} m[b,t] log pi_theta(y[b,t] | y[b,<t]) / sum_{b,t} m[b,t]

What the tiny policy sees and says (`user_turn`, `describe`). Its user turn is the grid and a line that names where
the objects are and how far apart ("Player (1,0), goal (3,1). Goal: 2 Down, 1 Right."): a perception aid, because a
2-layer network trained for minutes reads neither coordinates off a grid nor their differences; Sokoban's line also
says what lies next to the player ("Around: Up wall, Down floor, Left box, Right floor."). Its reasoning restates the
way (FrozenLake), or copies the ways to the box and target and then names the solver's next push and the way to the
cell it is pushed from (Sokoban: "Box 1 Down, 1 Right. Target 0 Down, 1 Left. Push Left from 1 Down, 2 Right."); then
the answer gives the solver's next moves. Demonstrations are imperfect on purpose -- with probability `noise` a turn
tries a random move, and a turn plays one or two moves (a fair coin) -- so the warm-started policy stays far from
always succeeding and RL has room to improve. They are whole episodes of up to 5 turns, played in rounds of 4 batches
and cut by length (40% fewer tokens to compute on FrozenLake, 17% on Sokoban, than unsorted batches). The result is
cached on disk, keyed by world and settings, and reused.
"""
import hashlib
import json
import math
import os
import random
import re
import string
import time

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

import envs
import rollout

FORMAT_VERSION = 5  # bump when demonstrations, tokenizer or default sizes / training settings change: no stale cache
TINY_SYSTEM = "Reach the goal. Think in <think> </think>, then act in <answer> </answer>."
TAGS = ("<think>", "</think>", "<answer>", "</answer>", "||")
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen2.5's: pad, turn start, turn end (= eos)
UNK = "<unk>"
# a piece: a word (capitalised or lower case: grid rows such as "_PX#" fall apart into cells), a number, white space,
# or one other character
PIECE = r"[A-Za-z][a-z]+|-?\d+(?:\.\d+)?|\s+|."
# Qwen2.5's ChatML template without tool calls; like Qwen's it writes a default system message when none is given
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n" + TINY_SYSTEM + "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


# ---------------------------------------------------------------------------------------------------- demonstrations

def _where(grid, symbols):
    """(row, col) of every cell holding one of `symbols`: _where("#P\\nX_", "PS") == [(0, 1)]."""
    return [(r, c) for r, row in enumerate(grid.split("\n")) for c, ch in enumerate(row) if ch in symbols]


def _at(cells):
    return ", ".join(f"({r},{c})" for r, c in cells) or "none"


def _next_push(env, plan):
    """(direction, (row, col) the player pushes from) of the first move of `plan` that moves a box, or None."""
    state = env.state()
    for action in plan:
        nxt, _, _ = env.next_state(state, action)
        if nxt[1] != state[1]:
            return action, divmod(state[0], env.width)
        state = nxt
    return None


def _way(frm, to):
    """How far cell `to` lies from `frm`, rows then columns, always both: _way((0, 2), (1, 1)) == '1 Down, 1 Left'."""
    (dr, dc) = (to[0] - frm[0], to[1] - frm[1])
    return f"{abs(dr)} {'Up' if dr < 0 else 'Down'}, {abs(dc)} {'Left' if dc < 0 else 'Right'}"


# the objects a position line names, per world: (name, grid symbols that show it)
OBJECTS = {"sokoban": (("Player", "PS"), ("box", "X√"), ("target", "O√S")),
           "frozenlake": (("Player", "PX√"), ("goal", "G√"))}


def _cells(env_name, grid):
    """The cells of each object OBJECTS names, in its order: _cells("frozenlake", "P_\\n_G") == [[(0, 0)], [(1, 1)]]."""
    return [_where(grid, symbols) for _, symbols in OBJECTS[env_name]]


def positions(env_name, obs):
    """Where the objects of a grid are, and how far apart, as text (a way is always rows, then columns):

    >>> positions("frozenlake", "P_\\n_G")
    'Player (0,0), goal (1,1). Goal: 1 Down, 1 Right.'

    Sokoban adds the way from the player to the box and from the box to the target (one-box rooms), then what lies
    next to the player (`around`).
    """
    cells = _cells(env_name, obs)
    text = ", ".join(f"{name} {_at(at)}" for (name, _), at in zip(OBJECTS[env_name], cells)) + "."
    one_each = all(len(at) == 1 for at in cells)
    if env_name == "frozenlake":
        return text + f" Goal: {_way(cells[0][0], cells[1][0])}." if one_each else text
    if one_each:
        text += f" Box: {_way(cells[0][0], cells[1][0])}. Target: {_way(cells[1][0], cells[2][0])}."
    return text + f" {around(obs)}" if len(cells[0]) == 1 else text


NEIGHBOURS = (("Up", -1, 0), ("Down", 1, 0), ("Left", 0, -1), ("Right", 0, 1))


def around(obs):
    """What lies next to the Sokoban player: around("###\\n#PX\\n#_#") == 'Around: Up wall, Down floor, Left wall,
    Right box.' Outside the grid counts as wall."""
    rows = obs.split("\n")
    (r, c), = _where(obs, "PS")

    def cell(rr, cc):
        inside = 0 <= rr < len(rows) and 0 <= cc < len(rows[rr])
        return envs.Sokoban.SYMBOLS[rows[rr][cc]] if inside else "wall"

    return "Around: " + ", ".join(f"{name} {cell(r + dr, c + dc)}" for name, dr, dc in NEIGHBOURS) + "."


def user_turn(env_name):
    """The tiny policy's user turn: the grid, then (Sokoban, FrozenLake) the positions line.

    >>> user_turn("frozenlake")("P_\\n_G", 0.0, 10, 1)
    'P_\\n_G\\nPlayer (0,0), goal (1,1). Goal: 1 Down, 1 Right.'

    This is a perception aid: a 2-layer, 64-wide network warm-started for minutes reads neither 2-D coordinates off a
    row-major grid (measured: its reasoning stayed input-agnostic, retrieval at chance) nor the difference of two
    coordinates (measured: it learned to copy the positions, but its moves ignored them). The line gives both, and in
    Sokoban the four cells next to the player (walls are otherwise only in the grid); what to do with them -- which
    way to go, where to stand to push, when to take two moves -- is left to the policy. And
    nothing else is in the turn, so every turn of a world has the same shape and the newest line sits at a fixed
    distance before the reasoning that reads it. Real models get rollout.user_message and the plain grid.
    """
    if env_name not in OBJECTS:
        return lambda obs, turn_reward, actions_left, turn: obs
    return lambda obs, turn_reward, actions_left, turn: obs + "\n" + positions(env_name, obs)


def prompts(env_name):
    """The prompt pieces rollout.play takes for the tiny policy: its system prompt and its user turns."""
    return {"system": TINY_SYSTEM, "user": user_turn(env_name)}


def describe(env, plan):
    """Reasoning for the current state and what `plan` (the solver's moves to come) does.

    >>> env = envs.Sokoban(room="######\\n#P_XO#\\n######"); _ = env.reset(); describe(env, ["Right", "Right"])
    'Box 0 Down, 2 Right. Target 0 Down, 1 Right. Push Right from 0 Down, 1 Right.'

    Sokoban first copies the two ways of the positions line and then works out the push and the way to the cell it is
    pushed from: each step of the arithmetic then reads numbers a few tokens back rather than a line above.
    """
    if env.name == "sokoban":
        push = _next_push(env, plan)
        if not push:  # the solver found no plan: the box is stuck, and the turn tries a random move
            return "Stuck."
        player, boxes, targets = _cells(env.name, env.render())
        ways = (f"Box {_way(player[0], boxes[0])}. Target {_way(boxes[0], targets[0])}. "
                if len(boxes) == len(targets) == 1 else "")
        return f"{ways}Push {push[0]} from {_way(player[0], push[1])}."
    if env.name == "frozenlake":
        (player,), (goal,) = _cells(env.name, env.render())
        return f"Goal: {_way(player, goal)}."
    if env.name == "bandit":
        return f"{env.risky} expects {env.high_reward * env.high_prob:g}, {env.safe} pays {env.low_reward:g}."
    raise ValueError(f"no demonstrations for world {env.name!r}; valid: sokoban, frozenlake, bandit")


def demonstration(env, rng, noise=0.2, max_actions=2):
    """One demonstration turn for the env's current state: ' <reasoning> </think> <answer> A || B </answer>'.

    With prob. `noise` the turn tries one random move ("Try Left."), else it plays the solver's next 1 or
    `max_actions` moves (a fair coin): imperfect on purpose. The text continues a prompt that ends with "<think>".
    >>> env = envs.Sokoban(room="#####\\n#PXO#\\n#####"); _ = env.reset()
    >>> demonstration(env, random.Random(0), noise=0.0)
    ' Box 0 Down, 1 Right. Target 0 Down, 1 Right. Push Right from 0 Down, 0 Right. </think> <answer> Right </answer>'
    """
    plan = envs.solve(env) or []
    if not plan or rng.random() < noise:
        moves = [rng.choice(env.actions)]
        reasoning = f"{describe(env, plan)} Try {moves[0]}."
    else:
        moves = plan[:rng.choice((1, max_actions))]
        reasoning = describe(env, plan)
    return f" {reasoning} </think> <answer> {' || '.join(moves)} </answer>"


def demo_policy(tokenizer, noise=0.2, max_actions=2, seed=0):
    """A scripted policy for rollout.play: looks at each env, writes `demonstration(...)` and the end-of-turn token."""
    rng = random.Random(seed)
    end = rollout.end_of_turn_ids(tokenizer)[0]

    def policy(prompt_ids, worlds):
        return [rollout.Generation(tokenizer.encode(demonstration(env, rng, noise, max_actions),
                                                    add_special_tokens=False) + [end]) for env in worlds]

    return policy


# --------------------------------------------------------------------------------------------------------- tokenizer

def _sample_texts(seeds=range(8)):
    """Every kind of text the rollout loop writes for tiny: system prompts, user turns, demonstrations, numbers."""
    texts = [TINY_SYSTEM, CHAT_TEMPLATE, "Try Push from none expects pays"]
    rng = random.Random(0)
    for name in envs.ENVS:
        for seed in seeds:
            env = envs.make_env(name)
            obs, _ = env.reset(seed=seed)
            texts += [rollout.system_prompt(env, k) for k in (1, 2)]
            texts += [user(obs, 0.0, env.max_steps, 1) for user in (user_turn(name), rollout.user_message)]
            texts.append(demonstration(env, rng, noise=0.5))
            texts.append(obs + "\n" + "\n".join(env.actions))
    # turn rewards (two decimals) and actions left
    texts += [f"{k / 10:.2f}" for k in range(-30, 121)] + [str(k) for k in range(101)]
    return texts


def build_tokenizer():
    """Word-level tokenizer over the worlds' texts with a character fallback, ChatML chat template, Qwen's specials.

    >>> tok = build_tokenizer(); tok.convert_ids_to_tokens(tok.encode("#_P\\n<think> Up"))
    ['#', '_', 'P', '\\n', '<think>', ' ', 'Up']
    """
    pieces = set(string.printable)
    for text in _sample_texts():
        pieces.update(text)  # every character, the grid symbols included
        pieces.update(re.findall(PIECE, text))
    pieces -= set(TAGS) | set(SPECIAL)
    vocab = {UNK: 0}
    for piece in sorted(pieces):
        vocab[piece] = len(vocab)
    # WordPiece with an empty continuation prefix = greedy longest known prefix: whole words when known, else chars
    core = Tokenizer(models.WordPiece(vocab, unk_token=UNK, continuing_subword_prefix="",
                                      max_input_chars_per_word=1_000_000))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(PIECE), behavior="isolated")
    core.decoder = decoders.Fuse()  # decoding = concatenation: exact round trip
    core.add_tokens([AddedToken(t, normalized=False, special=False) for t in TAGS])
    core.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token=UNK, chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
                                   padding_side="left", model_max_length=4096)


# ------------------------------------------------------------------------------------------------------------- model

def build_model(tokenizer, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                init_std=0.2, seed=0):
    """A Qwen2ForCausalLM from a Qwen2Config (grouped-query attention, RoPE, RMSNorm, SwiGLU), tied embeddings.

    Weights start at std `init_std`, not Qwen's 0.02 (meant for 896-wide and wider models): at 64 wide, 0.02 gives
    attention logits near 0, so every head starts uniform and the warm start sat for hundreds of steps on a loss
    plateau before it used the positions line, and most Sokoban builds never left it. Measured with seed 0 and 800
    steps (README): Sokoban val_success 0.16 at std 0.02, 0.33-0.48 at 0.1-0.2; FrozenLake 0.48, and 0.70-0.83.

    Default: 2 layers, 64 wide, ~0.11M parameters with the ~500-token vocabulary. Measured on 2 threads: 128 wide or
    4 layers cost 1.5-2x the time per step and learned the demonstrations no better within the warm-start budget.
    Attention is torch's SDPA kernel (the default): on 2 cores it ran 3x faster than the eager one for both the
    batched rollouts and the warm start.
    """
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"hidden_size must divide by num_heads and num_heads by num_kv_heads, got "
                         f"{hidden_size}, {num_heads}, {num_kv_heads}")
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, max_position_embeddings=4096, rope_theta=10_000.0,
                         tie_word_embeddings=True, initializer_range=init_std, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


# -------------------------------------------------------------------------------------------------------- warm start

def demo_loss(model, batch):
    """Mean cross-entropy of the policy's tokens (policy_mask) under teacher forcing; batch from rollout.collate.

    Only the positions whose next token the policy wrote go through the output layer: the prompts, most of a
    transcript, need no logits.
    """
    hidden = model.model(input_ids=batch["input_ids"],
                         attention_mask=batch["attention_mask"]).last_hidden_state[:, :-1]  # [B, T-1, D]
    keep = batch["policy_mask"][:, 1:] > 0  # [B, T-1]
    logits = model.lm_head(hidden[keep])  # [N, V]
    return torch.nn.functional.cross_entropy(logits, batch["input_ids"][:, 1:][keep])


def demonstrations(tokenizer, env_name, seeds, env_kwargs=None, noise=0.2, seed=0, max_turns=5,
                   max_actions_per_turn=2):
    """Demonstration episodes (rollout.Episode) on `seeds`, one each, in the tiny policy's prompts."""
    policy = demo_policy(tokenizer, noise=noise, max_actions=max_actions_per_turn, seed=seed)
    return rollout.play(policy, tokenizer, env_name, seeds, 1, env_kwargs=env_kwargs, max_turns=max_turns,
                        max_actions_per_turn=max_actions_per_turn, **prompts(env_name))


DEMO_SEEDS = 1_000_000  # demonstrations use seeds from here on, away from the small seeds used for validation
ROUND = 4  # batches of demonstrations played at once


def imitate(model, tokenizer, env_name, env_kwargs=None, steps=800, batch_size=16, lr=1e-2, noise=0.2, seed=0,
            progress=True, turns=5):
    """Behaviour cloning: `steps` AdamW steps, each on `batch_size` fresh demonstrations; returns the loss per step.

    Episodes of up to `turns` turns, played ROUND batches at a time and cut into batches after sorting by length.
    Linear warm-up over the first 10% of steps, then cosine decay to 10% of `lr`. Learning follows a plateau: the
    format first, then reading the positions line. How long the plateau lasts depends mostly on the initial weight
    scale (build_model's init_std); at std 0.2 the Sokoban loss left it by step ~200, and 400 steps were still too few
    (val_success 0.22 and 0.30 against 0.48 at 800). Whole episodes, because a network trained on first and second
    turns only wrote garbage from the third on.
    """
    pad = rollout.pad_token_id(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / warmup, 0.1 + 0.45 * (
        1 + math.cos(math.pi * max(0, s - warmup) / max(1, steps - warmup)))))
    model.train()
    losses = []
    bar = _progress(range(steps), progress, f"tiny warm start ({env_name})")
    for step in bar:
        if step % ROUND == 0:  # play ROUND batches at once and cut them by length: less padding to compute
            first = DEMO_SEEDS + (seed * steps + step) * batch_size  # fresh layouts every step
            played = sorted(demonstrations(tokenizer, env_name, range(first, first + ROUND * batch_size), env_kwargs,
                                           noise, seed=first, max_turns=turns), key=lambda e: len(e.input_ids))
            batches = [played[k:k + batch_size] for k in range(0, len(played), batch_size)]
            random.Random(first).shuffle(batches)
        batch = rollout.collate(batches[step % ROUND], pad)
        loss = demo_loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if progress:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses


def _progress(iterable, show, desc):
    if not show:
        return iterable
    from tqdm.auto import tqdm
    return tqdm(iterable, desc=desc)  # tqdm shows the elapsed time and the estimate of the time left


# ------------------------------------------------------------------------------------------------------------- cache

def cache_folder(cache_dir, env_name, tokenizer, env_kwargs=None, **settings):
    """cache_dir/<env>-<hash>: the hash covers the world's settings, the tiny settings, the vocabulary and
    FORMAT_VERSION, so a change to any of them builds a new model instead of loading a stale one."""
    vocab = tokenizer.get_vocab()
    key = json.dumps({"env": env_name, "env_kwargs": env_kwargs or {}, "settings": settings, "version": FORMAT_VERSION,
                      "vocab": sorted(vocab.items())}, sort_keys=True, default=str)
    return os.path.join(cache_dir, f"{env_name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}")


def load_tiny(env_name, env_kwargs=None, cache_dir=".cache/tiny", rebuild=False, warm_start=True, steps=800,
              seed=0, progress=True, **sizes):
    """(model, tokenizer) for `env_name`: warm-started on demonstrations on first use, then loaded from the cache.

    warm_start=False gives the untrained network (nothing cached); rebuild=True trains again even when cached.
    The folder also holds warm_start.json (steps, seconds, first and last loss). `sizes` go to build_model.
    """
    if env_name not in envs.ENVS:
        raise ValueError(f"unknown environment {env_name!r}; valid: {', '.join(sorted(envs.ENVS))}")
    tokenizer = build_tokenizer()
    if not warm_start:
        return build_model(tokenizer, seed=seed, **sizes), tokenizer
    folder = cache_folder(cache_dir, env_name, tokenizer, env_kwargs, steps=steps, seed=seed, **sizes)
    if not rebuild and os.path.exists(os.path.join(folder, "warm_start.json")):
        model = Qwen2ForCausalLM.from_pretrained(folder)
        model.eval()
        return model, PreTrainedTokenizerFast.from_pretrained(folder)
    model = build_model(tokenizer, seed=seed, **sizes)
    start = time.time()
    losses = imitate(model, tokenizer, env_name, env_kwargs, steps=steps, seed=seed, progress=progress)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with open(os.path.join(folder, "warm_start.json"), "w") as f:  # written last: marks a complete folder
        json.dump({"env": env_name, "env_kwargs": env_kwargs or {}, "steps": steps, "seconds": time.time() - start,
                   "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None}, f)
    return model, tokenizer
