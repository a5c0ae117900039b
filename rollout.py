"""The agent-environment loop: batched multi-turn rollouts of a language-model policy in the worlds of envs.py.

A new top-level file because the loop is a concept of its own: it turns a policy pi(z | x) and an environment into
the token-level data that PPO / GRPO train on (RAGEN-2, Sec. 4.1: prompt groups of K rollouts, up to 5 turns).

Prompt groups. Group g is one environment seed: its K rollouts reset to the same layout (reset(seed)) but draw
independent transition noise (reset(noise_seed=seed * 1000 + k)), so the spread of a group's total rewards R_1..R_K
is the reward variance Var(R | x) that snr_filter.py ranks groups by.

One episode is one chat transcript, kept as token ids exactly as sampled (training never re-tokenizes text):

    [system, user_1, assistant header, <think>] [sampled_1] [end, user_2, assistant header, <think>] [sampled_2] ...
    |----------- template, mask 0 -----------| |- mask 1 -| |------ new template tokens, mask 0 -----| |- mask 1 -|

The template tokens between turns are the text that the chat template renders between one assistant message and the
next generation prompt (found by rendering a marker message and cutting after it); when the policy ended its turn
with the template's end-of-turn token (Qwen: <|im_end|>) that token is its own, sampled one and is not repeated;
when a turn was cut at the per-turn token limit, the end-of-turn tokens are appended as template tokens (mask 0).
So for turns that end normally the transcript is token for token the chat template's rendering of the conversation.

Rewards. Each turn the response is parsed (envs.parse_response), at most `max_actions_per_turn` valid actions are
stepped, a turn with no valid action earns the format penalty -0.1 and does not move. The episode's total
R = sum of env rewards + penalties sits on its last policy token (token_rewards), as in the reference's token-level
PPO.

Log-probs at sampling time. For every sampled token we record log softmax(logits / temperature)[token], the tempered
full-vocabulary log-prob, i.e. exactly what a training forward pass recomputes (tests check equality). With
top_p < 1 the token was drawn from the renormalised nucleus, whose log-prob is larger by -log(nucleus mass); that
number is not recorded, because the training loss compares against the tempered full-vocabulary policy.
"""
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

import envs

FORMAT_PENALTY = -0.1
ANSWER_FORMAT = "<think> ... </think> <answer> ... </answer>"
_MARK = "\u2063MARK\u2063"  # a message text no template alters, used to cut rendered text after a message


# ---------------------------------------------------------------- prompts
def system_prompt(env, max_actions_per_turn=2):
    """Rules, legend, action names and the answer format; for FrozenLake it ends with 'Answer as <think> ...
    </think> <answer> ... </answer>, up to 2 actions separated by ||, e.g. <answer> Up || Down </answer>.'"""
    lines = [f"You are playing {env.name}. {env.rules}"]
    if env.legend:
        lines.append(env.legend)
    example = " || ".join(env.actions[:max(1, min(2, max_actions_per_turn, env.max_steps))])
    lines.append(f"Actions: {', '.join(env.actions)}.")
    lines.append(f"Answer as {ANSWER_FORMAT}, up to {max_actions_per_turn} actions separated by ||, "
                 f"e.g. <answer> {example} </answer>.")
    return "\n".join(lines)


def user_message(obs, turn_reward, actions_left, turn):
    """One user turn: state, reward of the last turn (left out on turn 1), actions left, the answer format.
    user_message("P_O", -0.1, 8, 2) starts 'Turn 2. Reward of last turn: -0.10\\nState:\\nP_O\\nYou have 8 actions'."""
    reward = f" Reward of last turn: {turn_reward:.2f}" if turn > 1 else ""
    return (f"Turn {turn}.{reward}\nState:\n{obs}\n"
            f"You have {actions_left} actions left. Answer as {ANSWER_FORMAT}, actions separated by ||.")


# ---------------------------------------------------------------- chat template, token by token
def _render(tokenizer, messages, add_generation_prompt):
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _encode(tokenizer, text):
    # the chat template already wrote every special token (BOS included), so none are added here
    return tokenizer.encode(text, add_special_tokens=False)


def _after_assistant(tokenizer, next_user=None, prefill=""):
    """Text the template writes after an assistant message: its end-of-turn text, then (if next_user is given) the
    next user message and the generation prompt; ChatML (Qwen2.5):
    '<|im_end|>\\n<|im_start|>user\\n{next_user}<|im_end|>\\n<|im_start|>assistant\\n'."""
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": _MARK}]
    if next_user is not None:
        messages.append({"role": "user", "content": next_user})
    text = _render(tokenizer, messages, add_generation_prompt=next_user is not None)
    return text[text.index(_MARK) + len(_MARK):] + prefill


def end_of_turn_ids(tokenizer):
    """Token ids that end an assistant turn: the template's end-of-turn token (Qwen: <|im_end|>) and the eos token.
    Generation stops at any of them."""
    ids = []
    if tokenizer.chat_template is not None:
        end_text = _after_assistant(tokenizer)
        if end_text:
            ids.append(_encode(tokenizer, end_text)[0])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("tokenizer has no eos token and no chat template with an end-of-turn token")
    return ids


def pad_token_id(tokenizer):
    """The tokenizer's pad id, or (tokenizer without one) its end-of-turn id. The tokenizer itself is not changed:
    padding is done here, positions are masked, so the pad id's value never matters."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_of_turn_ids(tokenizer)[0]


# ---------------------------------------------------------------- the policy: prompts in, sampled tokens out
@dataclass
class Generation:
    """One sampled response: token ids as sampled (with the end-of-turn token when produced), per-token log-probs
    at sampling time (or None), and cut = the per-turn token limit was hit."""
    token_ids: list
    logprobs: list = None
    cut: bool = False


def _logprob_recorder(temperature):
    """A logits processor that sees the raw logits of every decoding step and keeps log softmax(logits / T) of the
    token sampled from them. The sampled token only shows up in input_ids at the next step, so only one [B, V] table
    is held at a time (storing every step's logits would need steps * B * V floats)."""
    state = {"table": None, "taken": []}

    def record(input_ids, scores):  # input_ids [B, t], scores [B, V] raw float32 logits
        if state["table"] is not None:
            state["taken"].append(state["table"].gather(1, input_ids[:, -1:]))  # [B, 1]
        state["table"] = torch.log_softmax(scores / temperature, dim=-1)  # [B, V]
        return scores

    def finish(new_tokens):  # new_tokens [B, N]
        taken = list(state["taken"])
        if len(taken) < new_tokens.shape[1]:  # the last step's token is only in the output
            taken.append(state["table"].gather(1, new_tokens[:, -1:]))
        return torch.cat(taken, dim=1)[:, :new_tokens.shape[1]]  # [B, N]

    return record, finish


def hf_policy(model, tokenizer, max_new_tokens, temperature=1.0, top_p=1.0):
    """Wrap model.generate as a policy(prompt_ids, envs) -> list[Generation]: one batched, left-padded, KV-cached
    call for all prompts; stops at the end-of-turn token or after max_new_tokens; temperature 0 means greedy
    (log-probs then at temperature 1). Sampling settings are passed explicitly, so a checkpoint's generation_config
    (e.g. Qwen's repetition penalty and top_k) cannot change the distribution. Runs on the model's device, in the
    model's current mode (sample in eval mode so that dropout, if any, is off)."""
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    stop_ids = end_of_turn_ids(tokenizer)
    pad = pad_token_id(tokenizer)
    greedy = temperature == 0

    def policy(prompt_ids, env_list=None):  # the environments are not needed to sample
        device = model.device
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)  # [B, P]
        attention = torch.zeros((len(prompt_ids), width), dtype=torch.long)  # [B, P]
        for b, p in enumerate(prompt_ids):  # left padding: every prompt ends where generation starts
            ids[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention[b, width - len(p):] = 1
        record, finish = _logprob_recorder(1.0 if greedy else temperature)
        processors = [record]  # first: it must see the raw logits
        if not greedy and temperature != 1.0:
            processors.append(TemperatureLogitsWarper(temperature))
        if not greedy and top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p))
        # neutral built-in settings: temperature and top-p come only from the processors above
        sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_p": 1.0,
                                                         "top_k": 0, "min_p": None, "typical_p": 1.0}
        with torch.no_grad():
            out = model.generate(
                input_ids=ids.to(device), attention_mask=attention.to(device), max_new_tokens=max_new_tokens,
                repetition_penalty=1.0, no_repeat_ngram_size=0, use_cache=True, eos_token_id=stop_ids,
                pad_token_id=pad, logits_processor=LogitsProcessorList(processors), **sampling)
        new = out[:, width:]  # [B, N]
        logprobs = finish(new).float().cpu().tolist()  # one transfer for the whole batch
        generations = []
        for row, lp in zip(new.cpu().tolist(), logprobs):
            end = next((i + 1 for i, t in enumerate(row) if t in stop_ids), None)
            length = end if end is not None else len(row)
            generations.append(Generation(row[:length], lp[:length], cut=end is None))
        return generations

    return policy


# ---------------------------------------------------------------- the loop
@dataclass
class Episode:
    """One rollout. Tensors are 1-D over the transcript's T tokens; logprobs is None for policies that give none."""
    input_ids: torch.Tensor  # [T] long
    policy_mask: torch.Tensor  # [T] float, 1 on sampled tokens
    token_rewards: torch.Tensor  # [T] float, total_reward on the last sampled token
    logprobs: torch.Tensor  # [T] float, sampling-time log-probs on sampled tokens, 0 elsewhere (or None)
    total_reward: float
    success: bool
    turns: int
    num_actions: int
    response_lengths: list  # sampled tokens per turn
    cut: bool  # the last turn hit the token limit
    group: int
    seed: int
    noise_seed: int
    first_prompt: str  # turn-1 prompt text up to and including "<think>" (X of the MI diagnosis)
    first_reasoning: str  # turn-1 text between <think> and </think>, the rest of the response if unclosed (Z)
    turn_rewards: list = field(default_factory=list)  # env rewards + penalty, per turn
    responses: list = field(default_factory=list)  # decoded responses (prefill included), per turn
    actions: list = field(default_factory=list)  # actions stepped, in order


def _split_reasoning(prompt_text, response_text):
    """(X, Z) for cross-scoring: X ends with the response's first "<think>" (the prompt's own format example does
    not count), Z runs to "</think>". _split_reasoning("Q", "<think> a </think> b") == ("Q<think>", " a ")."""
    full = prompt_text + response_text
    start = full.find("<think>", len(prompt_text))
    if start < 0:
        return prompt_text, response_text
    start += len("<think>")
    stop = full.find("</think>", start)
    return full[:start], full[start:] if stop < 0 else full[start:stop]


def play(policy, tokenizer, env_name, seeds, group_size, env_kwargs=None, max_turns=5, max_actions_per_turn=2,
         system=None, prefill="<think>", user=user_message):
    """Play len(seeds) groups x group_size rollouts for at most max_turns turns; each turn one policy call for all
    running episodes (episodes that ended are not generated for). system: None (system_prompt(env)), a string, or a
    function env -> string; user: the function that writes each user turn (user_message's signature). Returns the
    episodes group by group."""
    if not (isinstance(group_size, int) and 1 <= group_size <= 1000):
        raise ValueError(f"group_size must be an int in 1..1000, got {group_size!r}")
    if max_turns < 1 or max_actions_per_turn < 1:
        raise ValueError(f"max_turns and max_actions_per_turn must be >= 1, got {max_turns}, {max_actions_per_turn}")
    stop_ids = end_of_turn_ids(tokenizer)
    runs = []
    for g, seed in enumerate(seeds):
        for k in range(group_size):
            env = envs.make_env(env_name, **(env_kwargs or {}))
            obs, info = env.reset(seed=seed, noise_seed=seed * 1000 + k)
            sys_text = system_prompt(env, max_actions_per_turn) if system is None else (
                system(env) if callable(system) else system)
            messages = [{"role": "system", "content": sys_text},
                        {"role": "user", "content": user(obs, 0.0, env.max_steps, 1)}]
            prompt_text = _render(tokenizer, messages, add_generation_prompt=True)
            ids = _encode(tokenizer, prompt_text + prefill)
            runs.append(dict(env=env, ids=ids, mask=[0.0] * len(ids), logp=[0.0] * len(ids), has_logp=True,
                             group=g, seed=seed, noise_seed=seed * 1000 + k, prompt_text=prompt_text,
                             success=bool(info.get("success", False)), done=False, lengths=[], turn_rewards=[],
                             responses=[], actions=[], cut=False, first_prompt=None, reasoning=None))

    for turn in range(1, max_turns + 1):
        running = [r for r in runs if not r["done"]]
        if not running:
            break
        generations = policy([r["ids"] for r in running], [r["env"] for r in running])
        if len(generations) != len(running):
            raise ValueError(f"policy returned {len(generations)} generations for {len(running)} prompts")
        for r, gen in zip(running, generations):
            tokens = list(gen.token_ids)
            r["ids"] += tokens
            r["mask"] += [1.0] * len(tokens)
            r["has_logp"] &= gen.logprobs is not None
            r["logp"] += list(gen.logprobs) if gen.logprobs is not None else [0.0] * len(tokens)
            r["lengths"].append(len(tokens))
            r["cut"] = bool(gen.cut)
            ended = bool(tokens) and tokens[-1] in stop_ids
            text = prefill + tokenizer.decode(tokens[:-1] if ended else tokens, skip_special_tokens=False)
            r["responses"].append(text)
            if turn == 1:
                r["first_prompt"], r["reasoning"] = _split_reasoning(r["prompt_text"], text)

            # ---- act: at most max_actions_per_turn valid actions, the format penalty for none
            env = r["env"]
            _, actions, valid = envs.parse_response(text, env.actions)
            actions = actions[:max_actions_per_turn] if valid else []
            reward = 0.0 if actions else FORMAT_PENALTY
            for action in actions:
                _, step_reward, terminated, truncated, info = env.step(action)
                reward += step_reward
                r["actions"].append(action)
                r["success"] = bool(info.get("success", False))
                if terminated or truncated:
                    r["done"] = True
                    break
            r["turn_rewards"].append(reward)
            if r["done"] or turn == max_turns:
                r["done"] = True
                continue

            # ---- the next prompt: only the template tokens that are new since the sampled ones
            between = _encode(tokenizer, _after_assistant(tokenizer, user(
                env.render(), reward, env.max_steps - len(r["actions"]), turn + 1), prefill))
            if ended and between and between[0] == tokens[-1]:
                between = between[1:]  # the policy wrote the end-of-turn token itself
            r["ids"] += between
            r["mask"] += [0.0] * len(between)
            r["logp"] += [0.0] * len(between)

    return [_finish(r) for r in runs]


def _finish(r):
    mask = torch.tensor(r["mask"], dtype=torch.float32)  # [T]
    total = float(sum(r["turn_rewards"]))
    token_rewards = torch.zeros_like(mask)  # [T]
    sampled = mask.nonzero()
    # the episode's reward on its last sampled token (the last token if the policy never produced one)
    token_rewards[int(sampled[-1]) if len(sampled) else len(mask) - 1] = total
    return Episode(
        input_ids=torch.tensor(r["ids"], dtype=torch.long), policy_mask=mask, token_rewards=token_rewards,
        logprobs=torch.tensor(r["logp"], dtype=torch.float32) if r["has_logp"] else None,
        total_reward=total, success=r["success"], turns=len(r["turn_rewards"]), num_actions=len(r["actions"]),
        response_lengths=r["lengths"], cut=r["cut"], group=r["group"], seed=r["seed"], noise_seed=r["noise_seed"],
        first_prompt=r["first_prompt"], first_reasoning=r["reasoning"], turn_rewards=r["turn_rewards"],
        responses=r["responses"], actions=r["actions"])


# ---------------------------------------------------------------- batches for training, validation
def collate(episodes, pad_id):
    """Right-padded tensors: input_ids, attention_mask, policy_mask, token_rewards (and logprobs when every episode
    has them) [B, T]; total_reward [B]; group [B]. Padded positions have mask 0 and reward 0."""
    if not episodes:
        raise ValueError("collate needs at least one episode")
    width = max(len(e.input_ids) for e in episodes)
    batch = {"input_ids": torch.full((len(episodes), width), pad_id, dtype=torch.long),  # [B, T]
             "attention_mask": torch.zeros((len(episodes), width), dtype=torch.long),  # [B, T]
             "policy_mask": torch.zeros((len(episodes), width)),  # [B, T]
             "token_rewards": torch.zeros((len(episodes), width))}  # [B, T]
    with_logp = all(e.logprobs is not None for e in episodes)
    if with_logp:
        batch["logprobs"] = torch.zeros((len(episodes), width))  # [B, T]
    for b, e in enumerate(episodes):
        n = len(e.input_ids)
        batch["input_ids"][b, :n] = e.input_ids
        batch["attention_mask"][b, :n] = 1
        batch["policy_mask"][b, :n] = e.policy_mask
        batch["token_rewards"][b, :n] = e.token_rewards
        if with_logp:
            batch["logprobs"][b, :n] = e.logprobs
    batch["total_reward"] = torch.tensor([e.total_reward for e in episodes], dtype=torch.float32)  # [B]
    batch["group"] = torch.tensor([e.group for e in episodes], dtype=torch.long)  # [B]
    return batch


def validate(model, tokenizer, env_name, seeds, env_kwargs=None, temperature=0.5, max_new_tokens=200, top_p=1.0,
             max_turns=5, max_actions_per_turn=2, system=None, prefill="<think>", user=user_message):
    """Success rate on held-out seeds, one rollout each, at a lower temperature."""
    if not len(seeds):
        raise ValueError("validate needs at least one seed")
    policy = hf_policy(model, tokenizer, max_new_tokens, temperature=temperature, top_p=top_p)
    episodes = play(policy, tokenizer, env_name, seeds, 1, env_kwargs=env_kwargs, max_turns=max_turns,
                    max_actions_per_turn=max_actions_per_turn, system=system, prefill=prefill, user=user)
    return sum(e.success for e in episodes) / len(episodes)
