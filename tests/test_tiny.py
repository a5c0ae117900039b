"""Tests for tiny.py: tokenizer round trip, Qwen-style chat template, demonstrations, save/load, warm start, cache."""
import random

import pytest
import torch

import envs
import rollout
import tiny


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer()


def small_model(tokenizer, seed=0):
    return tiny.build_model(tokenizer, hidden_size=32, intermediate_size=64, seed=seed)


def test_docstring_examples(tok):
    assert tok.convert_ids_to_tokens(tok.encode("#_P\n<think> Up")) == ["#", "_", "P", "\n", "<think>", " ", "Up"]
    assert tiny._where("#P\nX_", "PS") == [(0, 1)]
    assert tiny._cells("frozenlake", "P_\n_G") == [[(0, 0)], [(1, 1)]]
    assert tiny._way((0, 2), (1, 1)) == "1 Down, 1 Left" and tiny._way((3, 3), (3, 3)) == "0 Down, 0 Right"
    env = envs.Sokoban(room="######\n#P_XO#\n######")
    env.reset()
    assert tiny.describe(env, ["Right", "Right"]) == (
        "Box 0 Down, 2 Right. Target 0 Down, 1 Right. Push Right from 0 Down, 1 Right.")
    env = envs.Sokoban(room="#####\n#PXO#\n#####")
    env.reset()
    assert tiny.demonstration(env, random.Random(0), noise=0.0) == (
        " Box 0 Down, 1 Right. Target 0 Down, 1 Right. Push Right from 0 Down, 0 Right. </think> <answer> Right"
        " </answer>")
    stuck = envs.Sokoban(room="#####\n#X_O#\n#P__#\n#####")  # the box sits in a corner: no solution
    stuck.reset()
    assert envs.solve(stuck) is None and tiny.describe(stuck, []) == "Stuck."
    assert tiny.around("###\n#PX\n#_#") == "Around: Up wall, Down floor, Left wall, Right box."


@pytest.mark.parametrize("name", sorted(envs.ENVS))
def test_round_trip_on_prompts_and_demonstrations(tok, name):
    episodes = tiny.demonstrations(tok, name, range(5))
    texts = [tok.decode(e.input_ids) for e in episodes]
    env = envs.make_env(name)
    for seed in range(20, 25):
        obs, _ = env.reset(seed=seed)
        texts += [rollout.system_prompt(env), rollout.user_message(obs, -1.2, 7, 3)]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert tok.unk_token_id not in ids
    for e in episodes:  # the transcript rollout built turn by turn is what encoding its text gives
        assert tok.encode(tok.decode(e.input_ids), add_special_tokens=False) == e.input_ids.tolist()


def test_unseen_text_falls_back_to_characters(tok):
    text = "Zebra walks 123.456 steps\t\tfast!"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and tok.unk_token_id not in ids
    assert tok.convert_ids_to_tokens(tok.encode("Upward"))[:1] == ["Up"]  # longest known prefix first


def test_one_token_per_grid_cell(tok):
    for name in ("sokoban", "frozenlake"):
        env = envs.make_env(name)
        for seed in range(10):
            obs, _ = env.reset(seed=seed)
            assert tok.convert_ids_to_tokens(tok.encode(obs)) == list(obs)


def test_chat_template_renders_multi_turn_like_qwen(tok):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                {"role": "assistant", "content": "<think> a </think> <answer> Up </answer>"},
                {"role": "user", "content": "U2"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n"
                    "<|im_start|>assistant\n<think> a </think> <answer> Up </answer><|im_end|>\n"
                    "<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n")
    default = tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=False)
    assert default == f"<|im_start|>system\n{tiny.TINY_SYSTEM}<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert rollout.end_of_turn_ids(tok) == [tok.convert_tokens_to_ids("<|im_end|>")]
    for special in ("<|im_start|>", "<|im_end|>", "<think>", "||"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1


def test_demonstrations_are_valid_and_imperfect(tok):
    env = envs.make_env("frozenlake")
    env.reset(seed=3)
    rng = random.Random(1)
    plan = envs.solve(env)
    for _ in range(20):
        text = tiny.demonstration(env, rng, noise=0.0)
        think, actions, valid = envs.parse_response("<think>" + text, env.actions)
        assert valid and actions == plan[:len(actions)] and 1 <= len(actions) <= 2
        assert think == "Goal: 2 Down, 1 Right."  # the way from the player at (1,0) to the goal at (3,1)
    noisy = [envs.parse_response("<think>" + tiny.demonstration(env, rng, noise=1.0), env.actions) for _ in range(40)]
    assert all(t.endswith(f"Try {a[0]}.") and len(a) == 1 for t, a, _ in noisy)
    assert len({a[0] for _, a, _ in noisy}) > 1  # random moves, not the plan
    episodes = tiny.demonstrations(tok, "frozenlake", range(30), noise=0.0)
    assert all(e.success for e in episodes)  # the solver's moves, one or two a turn, reach the goal in 5 turns
    assert all(e.turn_rewards.count(rollout.FORMAT_PENALTY) == 0 for e in episodes)


def test_bad_input_raises(tok):
    with pytest.raises(ValueError, match="valid"):
        tiny.load_tiny("chess")
    with pytest.raises(ValueError, match="num_heads"):
        tiny.build_model(tok, hidden_size=30, num_heads=4)


def test_weights_start_at_init_std(tok):
    for std in (0.02, 0.2):
        model = tiny.build_model(tok, init_std=std)
        # ~33k embedding entries: the sample std is within 0.5% of the true one
        assert abs(model.model.embed_tokens.weight.std().item() - std) < 0.02 * std
        assert abs(model.model.layers[0].self_attn.q_proj.weight.std().item() - std) < 0.05 * std
        assert model.lm_head.weight is model.model.embed_tokens.weight  # tied


def test_save_and_load_round_trip(tok, tmp_path):
    model = small_model(tok).eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model2 = tiny.Qwen2ForCausalLM.from_pretrained(tmp_path).eval()
    tok2 = tiny.PreTrainedTokenizerFast.from_pretrained(tmp_path)
    text = tok.decode(tiny.demonstrations(tok, "sokoban", [7])[0].input_ids)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok2.encode(text, add_special_tokens=False) == ids and tok2.decode(ids) == text
    assert tok2.chat_template == tok.chat_template
    x = torch.tensor([ids])  # [1, T]
    with torch.no_grad():
        assert torch.equal(model(x).logits, model2(x).logits)


def test_short_warm_start_lowers_demonstration_loss(tok):
    model = small_model(tok)
    held_out = rollout.collate(tiny.demonstrations(tok, "bandit", range(8)), tok.pad_token_id)  # short episodes
    with torch.no_grad():
        before = tiny.demo_loss(model, held_out).item()
    losses = tiny.imitate(model, tok, "bandit", steps=12, batch_size=4, lr=1e-2, progress=False)
    with torch.no_grad():
        after = tiny.demo_loss(model, held_out).item()
    assert len(losses) == 12 and after < 0.8 * before


def test_warm_start_batches_are_cut_from_length_sorted_rounds(tok, monkeypatch):
    seen, demo_loss = [], tiny.demo_loss

    def recording_loss(model, batch):
        seen.append(batch["attention_mask"].sum(1).tolist())  # [B] episode lengths
        return demo_loss(model, batch)

    monkeypatch.setattr(tiny, "demo_loss", recording_loss)
    tiny.imitate(small_model(tok), tok, "frozenlake", steps=tiny.ROUND, batch_size=3, progress=False)
    assert [len(b) for b in seen] == [3] * tiny.ROUND
    spans = sorted((min(b), max(b)) for b in seen)
    assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:]))  # cut from one sorted list: no overlap


def test_demo_loss_equals_plain_loop_over_policy_tokens(tok):
    model = small_model(tok).eval()
    batch = rollout.collate(tiny.demonstrations(tok, "bandit", range(3)), tok.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # [B, T, V]
        total, count = 0.0, 0
        for b in range(len(batch["input_ids"])):
            for t in range(1, batch["input_ids"].shape[1]):
                if batch["policy_mask"][b, t] > 0:  # only the policy's own tokens are scored
                    total -= torch.log_softmax(logits[b, t - 1], -1)[batch["input_ids"][b, t]].item()
                    count += 1
        assert tiny.demo_loss(model, batch).item() == pytest.approx(total / count, rel=1e-5)


def test_cache_is_reused_and_rebuild_retrains(tmp_path, monkeypatch):
    sizes = dict(hidden_size=32, intermediate_size=64)
    model, tokenizer = tiny.load_tiny("bandit", cache_dir=str(tmp_path), steps=1, progress=False, **sizes)
    folders = list(tmp_path.iterdir())
    assert len(folders) == 1 and (folders[0] / "warm_start.json").exists()

    def no_training(*args, **kwargs):
        raise AssertionError("trained again although a cached model exists")

    monkeypatch.setattr(tiny, "imitate", no_training)
    again, tokenizer2 = tiny.load_tiny("bandit", cache_dir=str(tmp_path), steps=1, progress=False, **sizes)
    for p, q in zip(model.parameters(), again.parameters()):
        assert torch.equal(p, q)
    assert tokenizer2.get_vocab() == tokenizer.get_vocab()
    with pytest.raises(AssertionError, match="trained again"):
        tiny.load_tiny("bandit", cache_dir=str(tmp_path), steps=1, progress=False, rebuild=True, **sizes)
    with pytest.raises(AssertionError, match="trained again"):  # other settings: another cache folder
        tiny.load_tiny("bandit", cache_dir=str(tmp_path), steps=2, progress=False, **sizes)
    random_model, _ = tiny.load_tiny("bandit", cache_dir=str(tmp_path), warm_start=False, **sizes)
    assert len(list(tmp_path.iterdir())) == 1 and random_model is not None


def test_tiny_user_turn_is_the_grid_and_the_positions_line(tok):
    assert tiny.positions("frozenlake", "P_\n_G") == "Player (0,0), goal (1,1). Goal: 1 Down, 1 Right."
    assert tiny.positions("sokoban", "######\n#P_XO#\n######") == (
        "Player (1,1), box (1,3), target (1,4). Box: 0 Down, 2 Right. Target: 0 Down, 1 Right. "
        "Around: Up wall, Down wall, Left wall, Right floor.")
    assert tiny.positions("sokoban", "######\n#PXXO#\n#O___#\n######").endswith(  # two boxes: no ways
        "target (1,4), (2,1). Around: Up wall, Down target, Left wall, Right box.")
    assert tiny.around("P_") == "Around: Up wall, Down wall, Left wall, Right floor."  # off the grid is wall
    assert tiny.prompts("bandit")["user"]("Phoenix: pays 0.1", 0.0, 1, 1) == "Phoenix: pays 0.1"  # nothing to locate
    text = tiny.prompts("frozenlake")["user"]("P_\n_G", 0.5, 7, 2)
    assert text == "P_\n_G\nPlayer (0,0), goal (1,1). Goal: 1 Down, 1 Right."  # no turn, reward or count text
    assert {"Player", "goal", "Goal", "Down"} <= set(tok.convert_ids_to_tokens(tok.encode(text)))  # words, not chars
    env = envs.make_env("sokoban")
    lengths = set()
    for seed in range(20):  # every turn of a world has the same shape: the line sits at a fixed distance
        obs, _ = env.reset(seed=seed)
        lengths.add(len(tok.encode(tiny.prompts("sokoban")["user"](obs, 0.0, 10, 1))))
    assert len(lengths) == 1
    episode = tiny.demonstrations(tok, "frozenlake", [3])[0]
    assert "Goal: 2 Down, 1 Right.<|im_end|>" in tok.decode(episode.input_ids)  # demonstrations use the same prompts
