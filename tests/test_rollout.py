"""Tests of rollout.py: exact transcripts, masks and rewards with scripted policies; malformed model
output never crashes."""
import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

import envs
import rollout
from warmstart import tiny
from conftest import tiny_qwen2
from rollout import Generation

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CHATML = ("{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
LAKE = {"desc": ["SFFG"], "max_steps": 6}  # start far left, goal three steps to the right
SYSTEM = "Reach G."  # a short system prompt keeps the char-level transcripts short


def make_tokenizer():
    """Character-level tokenizer over printable ASCII, newline and the grid symbol √, Qwen's special
    tokens and a ChatML template; no pad token (the loop must cope)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = ["<unk>"] + [chr(i) for i in range(32, 127)] + ["\n", "√"]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(specials + chars)}, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>")
    tokenizer.chat_template = CHATML
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def make_model(tokenizer, seed=0):
    return tiny_qwen2(len(tokenizer), hidden_size=64, seed=seed, eos_token_id=tokenizer.eos_token_id)


def scripted(tokenizer, scripts, calls=None):
    """A stand-in policy: episode i (in order of the first call) answers scripts[i][turn] (a str, or
    a (token list, cut) pair; the last entry repeats); strings get the end-of-turn token appended,
    like a model that closes its turn."""
    owner, turn = {}, {}
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def policy(prompt_ids, env_list):
        if calls is not None:
            calls.append(len(env_list))
        out = []
        for env in env_list:
            i = owner.setdefault(id(env), len(owner))
            t = turn[i] = turn.get(i, -1) + 1
            reply = scripts[i][min(t, len(scripts[i]) - 1)]
            if isinstance(reply, str):
                out.append(Generation(tokenizer.encode(reply, add_special_tokens=False) + [end], None, False))
            else:
                out.append(Generation(list(reply[0]), None, reply[1]))
        return out

    return policy


def chat_ids(tokenizer, episode, system):
    """Token ids of the chat template's rendering of the episode's conversation (without the final newline)."""
    env = envs.make_env("frozenlake", **LAKE)
    obs, _ = env.reset(seed=episode.seed)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": rollout.user_message(
        obs, 0.0, env.max_steps, 1)}]
    steps = iter(episode.actions)
    for turn, (response, reward) in enumerate(zip(episode.responses, episode.turn_rewards), start=1):
        messages.append({"role": "assistant", "content": response})
        _, actions, _ = envs.parse_response(response, env.actions, 2)
        for _ in actions:
            if not env.done:
                obs = env.step(next(steps))[0]
        if turn < episode.turns:
            left = env.max_steps - env.steps
            messages.append({"role": "user", "content": rollout.user_message(obs, reward, left, turn + 1)})
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.endswith("<|im_end|>\n")
    return tokenizer.encode(text[:-1], add_special_tokens=False)


# ------------------------------------------------------------------------------------------ prompts
def test_prompts_carry_state_reward_budget_and_format():
    env = envs.make_env("frozenlake", **LAKE)
    text = rollout.system_prompt(env, max_actions_per_turn=2)
    assert env.rules in text and env.legend in text and "<answer> Up || Down </answer>" in text
    assert rollout.user_message("P_O", -0.1, 8, 2) == (
        "Turn 2. Reward of last turn: -0.10\nState:\nP_O\nYou have 8 actions left. "
        "Answer as <think> ... </think> <answer> ... </answer>, actions separated by ||.")
    assert "Reward" not in rollout.user_message("P_O", 0.0, 10, 1)
    assert rollout._split_reasoning("Q", "<think> a </think> b") == ("Q<think>", " a")
    assert rollout._split_reasoning("Q", "<think> a  </think>") == ("Q<think>", " a ")  # one space
    assert rollout._split_reasoning("Q", "<think> </think>") == ("Q<think>", "")
    assert rollout._split_reasoning("Q<think>x</think>", "<think> a") == ("Q<think>x</think><think>", " a")
    assert rollout._split_reasoning("Q", "no tags") == ("Q", "no tags")


def test_end_of_turn_and_pad_without_touching_the_tokenizer(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert rollout.end_of_turn_ids(tokenizer) == [end]
    assert tokenizer.pad_token is None and rollout.pad_token_id(tokenizer) == end and tokenizer.pad_token is None
    other = make_tokenizer()
    other.eos_token = "<|endoftext|>"  # a base model: eos differs from the template's end of turn
    assert rollout.end_of_turn_ids(other) == [end, other.convert_tokens_to_ids("<|endoftext|>")]


# --------------------------------------------------------------- scripted episodes, checked by hand
def test_group_mates_go_on_after_one_succeeds_on_turn_two(tokenizer):
    calls = []
    policy = scripted(tokenizer, [
        [" go right </think> <answer> Right || Right </answer>", "one more</think><answer>Right</answer>"],
        [" left </think> <answer> Left || Left || Left </answer>"],  # capped at 2 actions a turn
        ["I refuse to use the format."]],  # format penalty every turn
        calls)
    eps = rollout.play(policy, tokenizer, "frozenlake", seeds=[7], group_size=3, env_kwargs=LAKE, system=SYSTEM)
    win, lefty, garbage = eps
    assert calls == [3, 3, 2, 1, 1]  # ended episodes are not generated for
    assert (win.success, win.turns, win.num_actions, win.total_reward) == (True, 2, 3, 1.0)
    assert win.actions == ["Right"] * 3 and win.turn_rewards == [0.0, 1.0]
    # max_steps=6 actions, 2 a turn: the env truncates after turn 3
    assert (lefty.success, lefty.turns, lefty.num_actions, lefty.total_reward) == (False, 3, 6, 0.0)
    assert (garbage.turns, garbage.num_actions, garbage.success) == (5, 0, False)
    assert garbage.turn_rewards == [-0.1] * 5 and garbage.total_reward == pytest.approx(-0.5)
    assert [e.group for e in eps] == [0, 0, 0] and [e.noise_seed for e in eps] == [7000, 7001, 7002]
    for e in eps:
        assert e.ids == chat_ids(tokenizer, e, SYSTEM)  # exactly the template's rendering
        sampled = [t for t, m in zip(e.ids, e.policy_mask) if m]
        replies = [tokenizer.encode(r[len("<think>"):], add_special_tokens=False) for r in e.responses]
        end = tokenizer.eos_token_id
        # mask 1 = the policy's tokens only
        assert sampled == [t for reply in replies for t in reply + [end]]
        assert e.response_lengths == [len(r) + 1 for r in replies] and not e.cut
        rewards = rollout.collate([e], 0)["token_rewards"][0]
        last = max(t for t, m in enumerate(e.policy_mask) if m)
        assert rewards[last] == pytest.approx(e.total_reward)
        assert rewards.abs().sum() == pytest.approx(abs(e.total_reward))
        assert e.first.prompt.endswith("<|im_start|>assistant\n<think>") and SYSTEM in e.first.prompt
        assert e.logprobs is None
    assert win.first.reasoning == " go right" and garbage.first.reasoning == "I refuse to use the format."


def test_the_reasoning_is_split_on_the_sampled_tokens(tokenizer):
    """X, Z and the rest of turn 1 as the ids that were sampled: they add up to the transcript's first
    reply, Z stops where "</think>" begins, the end-of-turn token goes with the rest, and the log-prob
    sums are those of the sampled tokens. A policy that wrote no think block: all of it is Z."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    end = tokenizer.eos_token_id
    replies = [enc(" go right </think> <answer> Right </answer>") + [end],
               enc(" never closed"),                       # cut at the limit: no end token
               enc("</think> <answer> Up </answer>") + [end],
               [end]]
    logprobs = [[-0.5 * (i + 1)] * len(r) for i, r in enumerate(replies)]

    def policy(prompt_ids, env_list):
        return [Generation(r, lp, end not in r) for r, lp in zip(replies, logprobs)]

    eps = rollout.play(policy, tokenizer, "frozenlake", [3], 4, env_kwargs=LAKE, system=SYSTEM, max_turns=1)
    for e, reply, lp in zip(eps, replies, logprobs):
        n = len(e.first.prompt_ids)
        assert e.ids[:n] == e.first.prompt_ids and tokenizer.decode(e.first.prompt_ids) == e.first.prompt
        assert e.first.prompt_ids + e.first.reasoning_ids + e.first.answer_ids == e.ids[:n + len(reply)]
        assert e.first.reasoning_logprob == pytest.approx(sum(lp[:len(e.first.reasoning_ids)]))
        assert e.first.answer_logprob == pytest.approx(sum(lp[len(e.first.reasoning_ids):]))
    assert tokenizer.decode(eps[0].first.reasoning_ids) == " go right "  # the space is a token of its own
    assert tokenizer.decode(eps[0].first.answer_ids) == "</think> <answer> Right </answer><|im_end|>"
    assert tokenizer.decode(eps[1].first.reasoning_ids) == " never closed" and eps[1].first.answer_ids == []
    assert eps[2].first.reasoning_ids == [] and eps[3].first.reasoning_ids == [] and eps[3].first.answer_ids == [end]
    # a tokenizer that writes the space into the tag's token leaves it out of Z, as the text split does
    tok = tiny.build_tokenizer()
    ids = tok.encode(" go right </think> <answer> Right </answer>", add_special_tokens=False)
    x, z, rest, _, _ = rollout._split_reasoning_ids(tok, [1], "<think>", ids, None, False)
    assert tok.decode(z) == " go right" and tok.decode(rest).startswith(" </think>") and x == [1]
    # without a prefill, the sampled "<think>" joins the prompt
    ids = tok.encode("<think> up </think>", add_special_tokens=False)
    x, z, _, _, _ = rollout._split_reasoning_ids(tok, [1], "", ids, None, False)
    assert tok.decode(x[1:]) == "<think>" and tok.decode(z) == " up"


def test_a_group_shares_its_layout_but_not_its_noise(tokenizer):
    prompts, same_moves = [], scripted(tokenizer, [["a</think><answer>Up || Left</answer>"]] * 16)

    def policy(prompt_ids, env_list):
        prompts.append([tuple(p) for p in prompt_ids])
        return same_moves(prompt_ids, env_list)

    eps = rollout.play(policy, tokenizer, "frozenlake", [0, 1], 8, env_kwargs={"success_rate": 1 / 3},
                       max_turns=2, system=SYSTEM)
    first, second = prompts[0][:8], prompts[0][8:]
    # one layout per group
    assert len(set(first)) == 1 and len(set(second)) == 1 and first[0] != second[0]
    assert len({e.first.prompt for e in eps[:8]}) == 1
    assert len({p for p, e in zip(prompts[1], [e for e in eps if e.turns == 2]) if e.group == 0}) > 1  # slips differ


def test_noise_seeds_let_a_caller_play_part_of_a_group(tokenizer):
    """Rollouts 5..7 of seed 0 (noise seeds 0 * 1000 + k) played apart, as one process of several
    holds them, meet the same slips as in the whole group: the same transcripts."""
    moves = [["a</think><answer>Up || Left</answer>"]] * 8
    kw = dict(env_kwargs={"success_rate": 1 / 3}, max_turns=2, system=SYSTEM)
    whole = rollout.play(scripted(tokenizer, moves), tokenizer, "frozenlake", [0], 8, **kw)
    part = rollout.play(scripted(tokenizer, moves), tokenizer, "frozenlake", [0, 0, 0], 1,
                        noise_seeds=[5, 6, 7], **kw)
    assert [e.noise_seed for e in part] == [5, 6, 7] and [e.group for e in part] == [0, 1, 2]
    assert [e.ids for e in part] == [e.ids for e in whole[5:]]
    assert len({tuple(e.ids) for e in whole}) > 1  # the slips differ across the group
    with pytest.raises(ValueError, match="one noise seed per episode"):
        rollout.play(scripted(tokenizer, moves), tokenizer, "frozenlake", [0], 2, noise_seeds=[1], **kw)


def test_malformed_output_is_penalised_never_crashes(tokenizer):
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    script = [([], False),  # nothing at all
              ([end], False),  # only the end-of-turn token
              (enc("<think> never closed, cut at the limit"), True),
              # stray special token, unclosed
              (enc("a") + [start] + enc("</think><answer>Right") + [end], False),
              # tags out of order
              (enc("</answer><answer> Right </answer></think>") + [end], False)]
    eps = rollout.play(scripted(tokenizer, [script]), tokenizer, "frozenlake", [3], 1, env_kwargs=LAKE, system=SYSTEM)
    (e,) = eps
    assert e.turns == 5 and e.num_actions == 0 and e.turn_rewards == [-0.1] * 5 and not e.cut
    assert e.response_lengths == [0, 1, len(script[2][0]), len(script[3][0]), len(script[4][0])]
    assert e.ids == chat_ids(tokenizer, e, SYSTEM)  # the cut turn got its end token, as mask 0
    assert sum(e.policy_mask) == sum(e.response_lengths)
    assert e.first.reasoning == ""  # turn 1 produced nothing after the prefilled "<think>"


def test_the_first_pieces_are_acted_on_and_any_invalid_one_costs_the_penalty(tokenizer):
    """The official rule: the answer's pieces are capped at max_actions_per_turn first; the valid
    ones among them are stepped; a kept piece that is not an action costs -0.1 all the same."""
    eps = rollout.play(scripted(tokenizer, [["a</think><answer>Right || Jump</answer>"],
                                            ["b</think><answer>Right || Right || Jump</answer>"]]),
                       tokenizer, "frozenlake", [1], 2, env_kwargs=LAKE, max_turns=1, system=SYSTEM)
    jump, capped = eps
    assert jump.actions == ["Right"] and jump.turn_rewards == [rollout.FORMAT_PENALTY]
    assert capped.actions == ["Right", "Right"] and capped.turn_rewards == [0.0]  # Jump was cut off


def test_bad_arguments_raise_value_error(tokenizer):
    policy = scripted(tokenizer, [["x"]])
    with pytest.raises(ValueError, match="group_size"):
        rollout.play(policy, tokenizer, "frozenlake", [0], 0)
    with pytest.raises(ValueError, match="valid"):
        rollout.play(policy, tokenizer, "chess", [0], 1)
    with pytest.raises(ValueError, match="generations"):
        rollout.play(lambda ids, e: [], tokenizer, "frozenlake", [0], 2, env_kwargs=LAKE)


def test_collate_right_pads(tokenizer):
    eps = rollout.play(scripted(tokenizer, [["<answer>Left</answer>"], ["x</think><answer>Right</answer>"]]),
                       tokenizer, "frozenlake", [1], 2, env_kwargs=LAKE, max_turns=2, system=SYSTEM)
    batch = rollout.collate(eps, pad_id=-5)
    lengths = [len(e.ids) for e in eps]
    assert batch["input_ids"].shape == (2, max(lengths)) and "logprobs" not in batch
    for b, (e, n) in enumerate(zip(eps, lengths)):
        assert batch["input_ids"][b, :n].tolist() == e.ids
        assert (batch["input_ids"][b, n:] == -5).all() and batch["attention_mask"][b].sum() == n
        assert batch["policy_mask"][b, n:].sum() == 0
        assert batch["token_rewards"][b].sum() == pytest.approx(e.total_reward)
    assert batch["total_reward"].tolist() == pytest.approx([-0.2, 0.0]) and batch["group"].tolist() == [0, 0]
    with pytest.raises(ValueError):
        rollout.collate([], 0)


def test_an_answer_world_is_scored_by_the_world_and_penalised_only_for_the_format(tokenizer):
    """Countdown, one turn: the answer block's text is the action, whatever it is; a correct
    expression earns 1, right numbers 0.1, anything else in the block 0 -- and only a reply without
    closed blocks the format penalty, once: the world has one turn."""
    env = envs.make_env("countdown")
    env.reset(seed=0)
    (good,) = envs.solve(env)
    assert "-" in good  # so that a + in its place misses the target
    replies = [f"a</think><answer>{good}</answer>", f"a</think><answer>{good.replace('-', '+')}</answer>",
               "a</think><answer>7 ++ 7</answer>", "a</think> 7"]
    eps = rollout.play(scripted(tokenizer, [[r] for r in replies]), tokenizer, "countdown", [0], 4,
                       system=SYSTEM)  # up to 5 turns, but Countdown's is one
    assert [e.turn_rewards for e in eps] == [[1.0], [0.1], [0.0], [rollout.FORMAT_PENALTY]]
    assert [e.actions for e in eps] == [[good], [good.replace("-", "+")], ["7 ++ 7"], []]
    assert [e.success for e in eps] == [True, False, False, False] and all(e.done for e in eps)
    assert "For example: Target: 9" in rollout.system_prompt(env) and "Actions:" not in rollout.system_prompt(env)


def test_a_wrong_word_problem_answer_retries_for_half_the_reward(tokenizer):
    """The word problems over turns: the wrong first answer is told so in the next user turn, the
    second answer earns 1/2, and the transcript is the chat template's rendering."""
    env = envs.make_env("wordproblems")
    question, _ = env.reset(seed=2)
    eps = rollout.play(scripted(tokenizer, [["a</think><answer>6</answer>", "b</think><answer>7</answer>"]]),
                       tokenizer, "wordproblems", [2], 1, system=SYSTEM)
    (e,) = eps
    assert e.turn_rewards == [0.0, 0.5] and e.actions == ["6", "7"] and e.success and e.turns == 2
    assert f"Incorrect. Please think again.\n{question}" in tokenizer.decode(e.ids)
