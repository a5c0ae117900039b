"""The agent-environment loop: batched multi-turn rollouts of a language-model policy in the worlds
of envs.py.

The loop turns a policy pi(z | x) and an environment into the token-level data that PPO / GRPO train
on (RAGEN-2, Sec. 4.1: prompt groups of K rollouts, up to 5 turns).

Prompt groups. Group g is one environment seed: its K rollouts reset to the same layout
(reset(seed)) but draw independent transition noise (reset(noise_seed=seed * 1000 + k)), so the
spread of a group's total rewards R_1..R_K is the reward variance Var(R | x) that snr_filter.py
ranks groups by.

One episode is one chat transcript, kept as token ids exactly as sampled (training never
re-tokenizes text):

    [system, user_1, assistant header, <think>] [sampled_1] [end, user_2, header, <think>] [sampled_2] ...
    |----------- template, mask 0 -----------| |- mask 1 -| |-- new template, mask 0 --| |- mask 1 -|

The template tokens between turns are the text the chat template renders between one assistant
message and the next generation prompt (found by rendering a marker message and cutting after it).
When the policy ended its turn with the end-of-turn token (Qwen: <|im_end|>), that token is its own,
sampled one and is not repeated; when a turn was cut at the token limit, the end-of-turn tokens are
appended as template tokens (mask 0). So for turns that end normally the transcript is token for
token the chat template's rendering of the conversation.

Rewards. Each turn the reply is parsed as the official loop does (envs.parse_response: the answer's
`||` pieces are capped at `max_actions_per_turn` first), the valid actions among them are stepped,
and a turn whose answer is malformed -- no closed think and answer blocks, or a kept piece that is
not an action -- earns the format penalty -0.1. In an answer world (Countdown, the word problems)
the answer block's whole text is the turn's one action, scored by the world: only a reply without
closed blocks or with an empty answer earns the penalty. The episode's total R = env rewards +
penalties (+ any shaping an algorithm adds: DAPO's overlong penalty) sits on its last policy token
(collate's token_rewards), as in the reference's token-level PPO.

The policy is any function policy(prompt_ids, envs) -> list[Generation]; sampler.py turns a Hugging
Face causal LM into one.
"""

import bisect
from dataclasses import dataclass, field

import torch

import envs

FORMAT_PENALTY = -0.1
ANSWER_FORMAT = "<think> ... </think> <answer> ... </answer>"
_MARK = "\u2063MARK\u2063"  # a message text no template alters: rendered text is cut after it


# ------------------------------------------------------------------------------------------ prompts
def system_prompt(env, max_actions_per_turn=2):
    """Rules, legend, action names and the answer format; for FrozenLake it ends with 'Answer as
    <think> ... </think> <answer> ... </answer>, up to 2 actions separated by ||, e.g. <answer> Up
    || Down </answer>.' An answer world (Countdown, the word problems) names no actions: its
    worked example of a whole reply instead."""
    lines = [f"You are playing {env.name}. {env.rules}"]
    if env.legend:
        lines.append(env.legend)
    if env.actions is None:
        lines.append(f"Answer as {ANSWER_FORMAT}, the answer alone in the answer block. For "
                     f"example: {env.example}")
        return "\n".join(lines)
    example = " || ".join(env.actions[:max(1, min(2, max_actions_per_turn, env.max_steps))])
    lines.append(f"Actions: {', '.join(env.actions)}.")
    lines.append(
        f"Answer as {ANSWER_FORMAT}, up to {max_actions_per_turn} actions separated by ||, "
        f"e.g. <answer> {example} </answer>."
    )
    return "\n".join(lines)


def user_message(obs, turn_reward, actions_left, turn):
    """One user turn: state, reward of the last turn (left out on turn 1), actions left, the answer
    format.

    >>> user_message("P_O", -0.1, 8, 2)[:56]
    'Turn 2. Reward of last turn: -0.10\\nState:\\nP_O\\nYou have 8'
    """
    reward = f" Reward of last turn: {turn_reward:.2f}" if turn > 1 else ""
    return (
        f"Turn {turn}.{reward}\nState:\n{obs}\n"
        f"You have {actions_left} actions left. Answer as {ANSWER_FORMAT}, actions separated by ||."
    )


def with_coordinates(env_name):
    """user_message with the grid followed by its coordinates line (--observation coords:
    envs.coordinates, RAGEN's grid_coord observation): where things are, for a real model."""
    def user(obs, turn_reward, actions_left, turn):
        return user_message(f"{obs}\n{envs.coordinates(env_name, obs)}", turn_reward, actions_left,
                            turn)
    return user


TINY_SYSTEM = "Reach the goal. Think in <think> </think>, then act in <answer> </answer>."


def tiny_user(env_name):
    """The tiny policy's user turn: the grid, then (Sokoban, FrozenLake) its positions line
    (envs.positions) -- and nothing else, so every turn of a world has the same shape and the
    newest line sits at a fixed distance before the reasoning that reads it.

    >>> tiny_user("frozenlake")("P_\\n_G", 0.0, 10, 1)
    'P_\\n_G\\nPlayer (0,0), goal (1,1). Goal: 1 Down, 1 Right.'
    """
    if env_name not in envs.OBJECTS:
        return lambda obs, turn_reward, actions_left, turn: obs
    return lambda obs, turn_reward, actions_left, turn: obs + "\n" + envs.positions(env_name, obs)


def prompts(env_name, tiny=False, observation="grid"):
    """The prompt pieces a run plays with (play's `system` and `user`; none given: the paper's),
    chosen here for every run:
      a real model (Qwen2.5, SmolLM2, a folder of one): the paper's system_prompt and user_message
        on the bare grid, RAGEN's; with --observation coords each grid followed by its coordinates
        (with_coordinates), where things are but not the way;
      the tiny policy (--model tiny, the default on a CPU): TINY_SYSTEM, one line, and tiny_user,
        the grid and a line that names the way to the goal (envs.positions): a 64-wide network
        cloned from demonstrations in minutes reads no coordinates off a grid, so it is handed
        them, and what it learns by RL is which move to make and how to say so.
    A run writes the first prompt it renders into its folder (prompt.txt), as the policy read it.

    >>> prompts("frozenlake"), sorted(prompts("frozenlake", tiny=True))
    ({}, ['system', 'user'])
    """
    if tiny:
        return {"system": TINY_SYSTEM, "user": tiny_user(env_name)}
    return {"user": with_coordinates(env_name)} if observation == "coords" else {}


# -------------------------------------------------------------------- chat template, token by token
def _render(tokenizer, messages, add_generation_prompt):
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _encode(tokenizer, text):
    # the chat template already wrote every special token (BOS included), so none are added here
    return tokenizer.encode(text, add_special_tokens=False)


def _after_assistant(tokenizer, next_user=None, prefill=""):
    """Text the template writes after an assistant message: its end-of-turn text, then (if next_user
    is given) the next user message and the generation prompt; ChatML (Qwen2.5):
    '<|im_end|>\\n<|im_start|>user\\n{next_user}<|im_end|>\\n<|im_start|>assistant\\n'."""
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": _MARK}]
    if next_user is not None:
        messages.append({"role": "user", "content": next_user})
    text = _render(tokenizer, messages, add_generation_prompt=next_user is not None)
    return text[text.index(_MARK) + len(_MARK):] + prefill


def end_of_turn_ids(tokenizer):
    """Token ids that end an assistant turn: the template's end-of-turn token (Qwen: <|im_end|>) and
    the eos token. Generation stops at any of them."""
    ids = []
    if tokenizer.chat_template is not None:
        end_text = _after_assistant(tokenizer)
        if end_text:
            ids.append(_encode(tokenizer, end_text)[0])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError(
            "tokenizer has no eos token and no chat template with an end-of-turn token"
        )
    return ids


def pad_token_id(tokenizer):
    """The tokenizer's pad id, or (tokenizer without one) its end-of-turn id. The tokenizer itself
    is not changed: padding is done here, positions are masked, so the pad id's value never
    matters."""
    return (
        tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else end_of_turn_ids(tokenizer)[0]
    )


# ------------------------------------------------------- the policy: prompts in, sampled tokens out
@dataclass
class Generation:
    """One sampled response: token ids as sampled (with the end-of-turn token when produced),
    per-token log-probs at sampling time (or None), cut = the per-turn token limit was hit, and
    per-token entropies of the distributions the tokens were drawn from (or None)."""
    token_ids: list
    logprobs: list = None
    cut: bool = False
    entropies: list = None


# ----------------------------------------------------------------------------------------- the loop
@dataclass
class FirstTurn:
    """The first reply split as the MI diagnosis reads it (mi.py): X, the turn-1 prompt through the
    reply's "<think>"; Z, the reasoning up to "</think>" (the rest of the reply if unclosed); A,
    the rest of the turn (closing tag, answer, end-of-turn token). As text and as the token ids
    sampled (the diagnosis scores these, never re-tokenised text), with the sampling log-probs
    summed over Z and over A (None when the policy gave none)."""
    prompt: str
    reasoning: str
    prompt_ids: list
    reasoning_ids: list
    answer_ids: list
    reasoning_logprob: float = None
    answer_logprob: float = None
    reply: str = ""  # the first reply's text after X: Z, the closing tag, the answer

    def split_answer(self):
        """(X + Z + "</think>", the answer after it) as text, to score A after Z re-tokenised; an
        unclosed think gives an empty answer (it scores 0 under every reasoning: no dependence)."""
        full = self.prompt + self.reply
        cut = full.find("</think>", len(self.prompt))
        return (full, "") if cut < 0 else (full[:cut + len("</think>")],
                                           full[cut + len("</think>"):])


@dataclass
class Episode:
    """One rollout, filled in turn by turn. ids / policy_mask / logprobs / entropies run over the
    transcript's T tokens."""
    env: envs.TextEnv = field(repr=False)  # the world, left in its final state
    group: int  # prompt group: index of its seed in the step's seeds
    seed: int  # layout seed, shared by the group
    noise_seed: int  # transition-noise seed, own to this rollout
    ids: list  # [T] token ids: template and observations (mask 0), the policy's tokens (mask 1)
    policy_mask: list  # [T] 1.0 on sampled tokens
    # [T] sampling-time log-probs on sampled tokens, else 0; None if the policy gave none
    logprobs: list
    prompt_text: str  # the rendered turn-1 prompt
    # [T] entropies of the sampling distributions on sampled tokens, else 0; None if none given
    entropies: list = None
    first: FirstTurn = None  # the first reply as the diagnosis reads it
    responses: list = field(default_factory=list)  # decoded replies (prefill included), per turn
    response_lengths: list = field(default_factory=list)  # sampled tokens per turn
    turn_rewards: list = field(default_factory=list)  # env rewards + penalty, per turn
    actions: list = field(default_factory=list)  # actions stepped, in order
    success: bool = False
    done: bool = False
    cut: bool = False  # the last turn hit the token limit
    shaping: float = 0.0  # added to the reward by the algorithm (DAPO's overlong penalty)

    @property
    def total_reward(self):
        return float(sum(self.turn_rewards)) + self.shaping

    @property
    def turns(self):
        return len(self.turn_rewards)

    @property
    def num_actions(self):
        return len(self.actions)

    def append(self, tokens, mask, logprobs=None, entropies=None):
        self.ids += tokens
        self.policy_mask += [float(mask)] * len(tokens)
        if self.logprobs is not None:
            self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)
        if self.entropies is not None:
            self.entropies += list(entropies) if entropies is not None else [0.0] * len(tokens)


@dataclass
class Turns:
    """How an episode is played, beside its policy and seeds (play's keywords): the world's
    settings, at most `max_turns` turns of at most `max_actions_per_turn` actions, and the prompt
    pieces -- `system`: None (system_prompt(env)), a string, or a function env -> string; `user`:
    the function that writes each user turn (user_message's signature); `prefill`: what the
    assistant's turn starts with (prompts chooses system and user for a run)."""
    env_kwargs: dict = None
    max_turns: int = 5
    max_actions_per_turn: int = 2
    system: object = None
    user: object = user_message
    prefill: str = "<think>"


def play(policy, tokenizer, env_name, seeds, group_size, noise_seeds=None, **turns):
    """Play len(seeds) groups x group_size rollouts, as `turns` (Turns' fields) say, for at most
    max_turns turns (fewer where the world has a turn limit of its own: Countdown's one); each turn
    one policy call for all running episodes (episodes that ended are not generated for).
    noise_seeds: one transition-noise seed per episode, in the order returned (default: seed * 1000
    + k for rollout k of a group; a caller holding only part of a group passes the numbers of the
    rollouts it holds). Returns the episodes group by group."""
    how = Turns(**turns)
    if not (isinstance(group_size, int) and 1 <= group_size <= 1000):
        raise ValueError(f"group_size must be an int in 1..1000, got {group_size!r}")
    if how.max_turns < 1 or how.max_actions_per_turn < 1:
        raise ValueError(f"max_turns and max_actions_per_turn must be >= 1, got {how.max_turns}, "
                         f"{how.max_actions_per_turn}")
    if noise_seeds is None:
        noise_seeds = [seed * 1000 + k for seed in seeds for k in range(group_size)]
    if len(noise_seeds) != len(seeds) * group_size:
        raise ValueError(f"need one noise seed per episode ({len(seeds) * group_size}), got "
                         f"{len(noise_seeds)}")
    episodes = [start(tokenizer, env_name, g, seed, noise_seeds[g * group_size + k], how)
                for g, seed in enumerate(seeds) for k in range(group_size)]
    stop_ids = end_of_turn_ids(tokenizer)
    for turn in range(1, how.max_turns + 1):
        running = [e for e in episodes if not e.done]
        if not running:
            break
        generations = policy([e.ids for e in running], [e.env for e in running])  # one call
        if len(generations) != len(running):
            raise ValueError(
                f"policy returned {len(generations)} generations for {len(running)} prompts"
            )
        for e, gen in zip(running, generations):
            ended = act(e, gen, tokenizer, stop_ids, turn, how)
            e.done = e.done or turn in (how.max_turns, e.env.turn_limit)  # the loop's or the world's
            if not e.done:  # the next observation: only the template tokens new since the reply
                between = _encode(tokenizer, _after_assistant(tokenizer, how.user(
                    e.env.render(), e.turn_rewards[-1], e.env.max_steps - e.num_actions,
                    turn + 1), how.prefill))
                if ended and between and between[0] == e.ids[-1]:
                    between = between[1:]  # the policy wrote the end-of-turn token itself
                e.append(between, 0.0)
    return episodes


def start(tokenizer, env_name, group, seed, noise_seed, how):
    """A new episode: the world reset to its layout (`seed`) and noise (`noise_seed`), the turn-1
    prompt rendered through the chat template (`how`: Turns) and encoded, up to and including its
    prefill."""
    env = envs.make_env(env_name, **(how.env_kwargs or {}))
    obs, info = env.reset(seed=seed, noise_seed=noise_seed)
    system = how.system
    sys_text = system_prompt(env, how.max_actions_per_turn) if system is None else (
        system(env) if callable(system) else system)
    messages = [{"role": "system", "content": sys_text},
                {"role": "user", "content": how.user(obs, 0.0, env.max_steps, 1)}]
    prompt_text = _render(tokenizer, messages, add_generation_prompt=True)
    ids = _encode(tokenizer, prompt_text + how.prefill)
    return Episode(env=env, group=group, seed=seed, noise_seed=noise_seed, ids=ids,
                   policy_mask=[0.0] * len(ids), logprobs=[0.0] * len(ids),
                   prompt_text=prompt_text, entropies=[0.0] * len(ids),
                   success=bool(info.get("success", False)))


def act(e, gen, tokenizer, stop_ids, turn, how):
    """One turn of episode `e` after the policy replied `gen`: the reply recorded (turn 1 also as
    the diagnosis' FirstTurn), parsed as the official loop does, its valid actions among the first
    how.max_actions_per_turn pieces stepped, the turn's reward (with the format penalty) recorded
    -> whether the policy ended its turn itself (with an end-of-turn token)."""
    prefill, max_actions_per_turn = how.prefill, how.max_actions_per_turn
    tokens = list(gen.token_ids)
    if gen.logprobs is None:
        e.logprobs = None
    if gen.entropies is None:
        e.entropies = None
    e.append(tokens, 1.0, gen.logprobs, gen.entropies)
    e.response_lengths.append(len(tokens))
    e.cut = bool(gen.cut)
    ended = bool(tokens) and tokens[-1] in stop_ids
    text = prefill + tokenizer.decode(tokens[:-1] if ended else tokens, skip_special_tokens=False)
    e.responses.append(text)
    if turn == 1:
        x, z = _split_reasoning(e.prompt_text, text)
        e.first = FirstTurn(x, z, *_split_reasoning_ids(
            tokenizer, e.ids[:len(e.ids) - len(tokens)], prefill, tokens, gen.logprobs, ended),
            reply=(e.prompt_text + text)[len(x):])
    _, actions, valid = envs.parse_response(text, e.env.actions, max_actions_per_turn)
    reward = 0.0 if valid else FORMAT_PENALTY
    for action in actions:
        _, step_reward, terminated, truncated, info = e.env.step(action)
        reward += step_reward
        e.actions.append(action)
        e.success = bool(info.get("success", False))
        if terminated or truncated:
            e.done = True
            break
    e.turn_rewards.append(reward)
    return ended


def _split_reasoning(prompt_text, response_text):
    """(X, Z) for cross-scoring: X ends with the response's first "<think>" (the prompt's own format
    example does not count), Z runs to "</think>" without the one space before it: BPE tokenizers
    (Qwen's, the tiny one's) write that space into the closing tag's token, so Z re-tokenised alone
    gives the tokens the policy sampled. _split_reasoning("Q", "<think> a </think> b") ==
    ("Q<think>", " a")."""
    full = prompt_text + response_text
    start = full.find("<think>", len(prompt_text))
    if start < 0:
        return prompt_text, response_text
    start += len("<think>")
    stop = full.find("</think>", start)
    if stop < 0:
        return full[:start], full[start:]
    return full[:start], full[start:stop - (full[start:stop].endswith(" "))]


def _split_reasoning_ids(tokenizer, prompt_ids, prefill, tokens, logprobs, ended):
    """_split_reasoning on the sampled tokens themselves -> (X ids, Z ids, rest ids, Z log-prob,
    rest log-prob). Z is the run of sampled tokens that starts where the reply's "<think>" has been
    written and stops before the token in which "</think>" begins (a tokenizer that writes the
    space into the tag's token, " </think>", leaves that space out of Z, as the text split does);
    what precedes Z joins the prompt. Character offsets come from decoding prefixes of the sampled
    tokens (bisected: a prefix's text only grows). `ended`: the last token ends the turn (it goes
    with the rest, never with Z)."""
    content = len(tokens) - ended
    text = prefill + tokenizer.decode(tokens[:content], skip_special_tokens=False)

    def offset(k):  # characters of the reply written by the first k sampled tokens
        return len(prefill) + len(tokenizer.decode(tokens[:k], skip_special_tokens=False))

    think = text.find("<think>")
    if think < 0:  # no reasoning block: all of the reply is Z, as in the text split
        start, stop = 0, content
    else:
        start = bisect.bisect_left(range(content + 1), think + len("<think>"), key=offset)
        close = text.find("</think>", think + len("<think>"))
        stop = content if close < 0 else max(
            start, bisect.bisect_right(range(content + 1), close, key=offset) - 1)
    lp = (lambda a, b: float(sum(logprobs[a:b]))) if logprobs is not None else (lambda a, b: None)
    return (list(prompt_ids) + tokens[:start], tokens[start:stop], tokens[stop:], lp(start, stop),
            lp(stop, len(tokens)))


# ----------------------------------------------------------------------------- batches for training
def collate(episodes, pad_id):
    """Right-padded tensors [B, T]: input_ids, attention_mask, policy_mask, token_rewards (the
    episode's total reward on its last sampled token, or its last token if it sampled none),
    logprobs and entropies (each when every episode has them); total_reward [B]; group [B]. Padded
    positions have mask 0 and reward 0."""
    if not episodes:
        raise ValueError("collate needs at least one episode")
    B, width = len(episodes), max(len(e.ids) for e in episodes)
    batch = {"input_ids": torch.full((B, width), pad_id, dtype=torch.long),   # [B, T]
             "attention_mask": torch.zeros((B, width), dtype=torch.long),     # [B, T]
             "policy_mask": torch.zeros((B, width)),                          # [B, T]
             "token_rewards": torch.zeros((B, width))}                        # [B, T]
    sampled_with = [k for k in ("logprobs", "entropies")  # what the sampler recorded
                    if all(getattr(e, k) is not None for e in episodes)]
    for k in sampled_with:
        batch[k] = torch.zeros((B, width))                                    # [B, T]
    for b, e in enumerate(episodes):
        n = len(e.ids)
        batch["input_ids"][b, :n] = torch.tensor(e.ids, dtype=torch.long)
        batch["attention_mask"][b, :n] = 1
        batch["policy_mask"][b, :n] = torch.tensor(e.policy_mask)
        sampled = [t for t, m in enumerate(e.policy_mask) if m]
        batch["token_rewards"][b, sampled[-1] if sampled else n - 1] = e.total_reward
        for k in sampled_with:
            batch[k][b, :n] = torch.tensor(getattr(e, k))
    # [B]
    batch["total_reward"] = torch.tensor([e.total_reward for e in episodes], dtype=torch.float32)
    batch["group"] = torch.tensor([e.group for e in episodes], dtype=torch.long)  # [B]
    return batch
