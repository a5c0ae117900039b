"""tiny.py: tokenizer round trip, Qwen-style chat template, the model, and the warm-start cache
(reused, rebuilt when damaged, continued after an interruption, built by one process while another
waits)."""
import json
import os
import threading
import time

import pytest
import torch

import envs
import rollout
from warmstart import demos, templates, tiny

SIZES = dict(hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer()


@pytest.mark.parametrize("name", sorted(envs.ENVS))
def test_round_trip_on_prompts_and_demonstrations(name):
    tok = tiny.build_tokenizer(world=name)  # the world's policy's own
    episodes = demos.demonstrations(tok, name, range(5))
    texts = [tok.decode(e.ids) for e in episodes]
    env = envs.make_env(name)
    for seed in range(20, 25):
        obs, _ = env.reset(seed=seed)
        texts += [rollout.system_prompt(env), rollout.user_message(obs, -1.2, 7, 3)]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert tok.unk_token_id not in ids
    for e in episodes:  # the transcript rollout built turn by turn is what encoding its text gives
        assert tok.encode(tok.decode(e.ids), add_special_tokens=False) == e.ids


def test_pieces_carry_their_leading_space(tok):
    """As in Qwen's BPE: a word, number, tag or sign takes the one space before it, so no
    demonstration holds a lone-space token, and longer runs of spaces leave their last space to the
    word that follows."""
    for word in (" Up", " Down", " 1", " -0.1", " </think>", " <answer>", " ||", " ("):
        assert tok.convert_ids_to_tokens(tok.encode(word)) == [word]
    assert tok.convert_ids_to_tokens(tok.encode("Up  Down\n Left")) == ["Up", " ", " Down", "\n", " Left"]
    for name in sorted(envs.ENVS):
        own = tiny.build_tokenizer(world=name)
        for e in demos.demonstrations(own, name, range(5)):
            assert own.convert_tokens_to_ids(" ") not in e.ids


def test_the_reasoning_cross_scored_is_the_reasoning_sampled():
    """On the demonstrations, Z re-tokenised alone (what --retokenize scores) gives exactly the tokens
    between <think> and the closing tag's token, as the split of the sampled ids does (text sampled at
    a high temperature need not come back: tests/test_train.py)."""
    for name in sorted(envs.ENVS):
        tok = tiny.build_tokenizer(world=name)
        close = tok.convert_tokens_to_ids(" </think>")
        for e in demos.demonstrations(tok, name, range(5)):
            start = len(tok.encode(e.first.prompt, add_special_tokens=False))
            sampled = e.ids[start:e.ids.index(close, start)]
            assert tok.encode(e.first.reasoning, add_special_tokens=False) == sampled == e.first.reasoning_ids


def test_an_answer_world_adds_its_words_and_the_other_worlds_keep_their_vocabulary(tok):
    """The shared worlds' policies (and so their cached warm starts) keep the vocabulary they had;
    an answer world's own tokenizer holds its words and numbers whole, the shared ones as before."""
    for name in tiny.SHARED_WORLDS:
        assert tiny.build_tokenizer(world=name).get_vocab() == tok.get_vocab()
    for name, words in (("countdown", ["Target", " nums", " 15", " +", " *"]),
                        ("wordproblems", ["Cara", " apples", " triples", " 42", "Incorrect"])):
        own = tiny.build_tokenizer(world=name)
        assert set(tok.get_vocab()) < set(own.get_vocab())
        assert all(len(own.encode(w, add_special_tokens=False)) == 1 for w in words), name
        assert tok.convert_ids_to_tokens(tok.encode(" Up")) == own.convert_ids_to_tokens(own.encode(" Up"))


def test_unseen_text_falls_back_to_characters(tok):
    text = "Zebra walks 123.456 steps\t\tfast!"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and tok.unk_token_id not in ids
    # longest known prefix first
    assert tok.convert_ids_to_tokens(tok.encode("Upward"))[:1] == ["Up"]


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
    assert default == f"<|im_start|>system\n{rollout.TINY_SYSTEM}<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert rollout.end_of_turn_ids(tok) == [tok.convert_tokens_to_ids("<|im_end|>")]
    for special in ("<|im_start|>", "<|im_end|>", "<think>", "||"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1


def test_bad_input_raises(tok):
    with pytest.raises(ValueError, match="valid"):
        tiny.load_tiny("chess")
    with pytest.raises(ValueError, match="num_heads"):
        tiny.build_model(tok, hidden_size=30, num_heads=4)


def test_weights_start_at_init_std_and_leave_the_global_random_stream_alone(tok):
    for std in (0.02, 0.2):
        torch.manual_seed(7)
        expected = torch.rand(3)
        torch.manual_seed(7)
        model = tiny.build_model(tok, init_std=std)
        # building consumed nothing of the caller's stream
        assert torch.equal(torch.rand(3), expected)
        # ~33k embedding entries: the sample std is within 2% of the true one
        assert abs(model.model.embed_tokens.weight.std().item() - std) < 0.02 * std
        assert abs(model.model.layers[0].self_attn.q_proj.weight.std().item() - std) < 0.05 * std
        assert model.lm_head.weight is model.model.embed_tokens.weight  # tied


def test_save_and_load_round_trip(tok, tmp_path):
    model = tiny.build_model(tok, **SIZES).eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model2 = tiny.Qwen2ForCausalLM.from_pretrained(tmp_path).eval()
    tok2 = tiny.PreTrainedTokenizerFast.from_pretrained(tmp_path)
    text = tok.decode(demos.demonstrations(tok, "sokoban", [7])[0].ids)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok2.encode(text, add_special_tokens=False) == ids and tok2.decode(ids) == text
    assert tok2.chat_template == tok.chat_template
    x = torch.tensor([ids])  # [1, T]
    with torch.no_grad():
        assert torch.equal(model(x).logits, model2(x).logits)


# ---------------------------------------------------------------------------------------- the cache

def build(tmp_path, **kw):
    return tiny.load_tiny("bandit", cache_dir=str(tmp_path), steps=4, progress=False, **SIZES, **kw)


def test_cache_is_reused_and_rebuild_retrains(tmp_path, monkeypatch):
    model, tokenizer = build(tmp_path)
    folders = [f for f in tmp_path.iterdir() if f.is_dir()]
    assert len(folders) == 1 and (folders[0] / "warm_start.json").exists()
    info = json.loads((folders[0] / "warm_start.json").read_text())
    assert set(info["checksums"]) == set(tiny.CHECKED_FILES) and all(info["checksums"].values())

    # the build hands back what a load gives, not the model it trained: nothing of its training
    # left on it (gradients of the last step), so a run computes alike either way
    assert all(p.grad is None for p in model.parameters())

    def no_training(*args, **kwargs):
        raise AssertionError("trained again although a cached model exists")

    monkeypatch.setattr(demos, "imitate", no_training)
    again, tokenizer2 = build(tmp_path)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    assert tokenizer2.get_vocab() == tokenizer.get_vocab()
    with pytest.raises(AssertionError, match="trained again"):
        build(tmp_path, rebuild=True)
    # other settings: another cache folder
    with pytest.raises(AssertionError, match="trained again"):
        build(tmp_path, seed=1)
    random_model, _ = build(tmp_path, warm_start=False)
    assert len([f for f in tmp_path.iterdir() if f.is_dir()]) == 1 and random_model is not None


def test_a_template_prior_builds_its_own_warm_start_and_none_keeps_todays_folder(tmp_path, monkeypatch):
    imitate, taught = demos.imitate, []

    def recording(*args, **kwargs):
        taught.append((kwargs["template_prior"], kwargs["pool"]))
        return imitate(*args, **kwargs)

    monkeypatch.setattr(demos, "imitate", recording)
    _, plain = build(tmp_path)
    # no prior: the folder of the key without any template setting, today's
    assert os.path.isdir(tiny.cache_folder(str(tmp_path), "bandit", tiny.build_tokenizer(), None, steps=4,
                                           seed=0, **SIZES))
    model, taught_tokenizer = build(tmp_path, template_prior=0.5)
    folders = [f for f in tmp_path.iterdir() if f.is_dir()]
    assert len(folders) == 2 and taught == [(0.0, ()), (0.5, templates.pool("bandit"))]
    assert " me" in taught_tokenizer.get_vocab() and " me" not in plain.get_vocab()
    assert model.get_input_embeddings().weight.shape[0] == len(taught_tokenizer)
    infos = [json.loads((f / "warm_start.json").read_text()) for f in folders]
    assert sorted(i["template_prior"] for i in infos) == [0.0, 0.5]
    _, again = build(tmp_path, template_prior=0.5)  # loaded, with the tokenizer it was built with
    assert len(taught) == 2 and again.get_vocab() == taught_tokenizer.get_vocab()
    build(tmp_path, template_prior=0.5, seed=1)  # another build seed: another warm start
    assert len(taught) == 3 and len([f for f in tmp_path.iterdir() if f.is_dir()]) == 3
    with pytest.raises(ValueError, match="template_prior"):
        build(tmp_path, template_prior=1.5)


def test_a_complete_cache_on_a_read_only_disk_loads(tmp_path, monkeypatch):
    """Reading a complete entry needs no write, not even its lock file: on a read-only disk it
    loads as it would anywhere (tiny.py's every write refused with EROFS, as such a disk would)."""
    import builtins
    import errno

    model, tokenizer = build(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())

    def read_only(path, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return builtins.open(path, mode, *args, **kwargs)

    # the build hands back what a load gives, not the model it trained: nothing of its training
    # left on it (gradients of the last step), so a run computes alike either way
    assert all(p.grad is None for p in model.parameters())

    def no_training(*args, **kwargs):
        raise AssertionError("trained again although a cached model exists")

    monkeypatch.setattr(tiny, "open", read_only, raising=False)
    monkeypatch.setattr(demos, "imitate", no_training)
    again, tokenizer2 = build(tmp_path)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    assert tokenizer2.get_vocab() == tokenizer.get_vocab()
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    with pytest.raises(OSError):  # an entry not there cannot be built on it: models.py says so
        build(tmp_path, seed=1)


@pytest.mark.parametrize("damage", [
    # truncated
    lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:-100]),
    lambda f: (f / "model.safetensors").write_bytes(b""),  # empty
    lambda f: (f / "model.safetensors").unlink(),  # deleted
    # from_pretrained would build a default-size Qwen2 from nothing
    lambda f: (f / "config.json").unlink(),
    lambda f: (f / "tokenizer.json").write_text("{"),
    # loads, but wrong numbers
    lambda f: (f / "model.safetensors").write_bytes(_flip(f / "model.safetensors")),
])
def test_a_damaged_cache_entry_is_built_again(tmp_path, capsys, damage):
    model, _ = build(tmp_path)
    folder = next(f for f in tmp_path.iterdir() if f.is_dir())
    damage(folder)
    again, _ = build(tmp_path)
    assert "is damaged" in capsys.readouterr().out
    # built the same again
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    # and intact now
    assert build(tmp_path)[0] is not None and "is damaged" not in capsys.readouterr().out


def test_a_damaged_partial_build_is_started_over_saying_so(tmp_path, capsys):
    straight, _ = tiny.load_tiny("bandit", cache_dir=str(tmp_path / "a"), steps=4, progress=False, **SIZES)
    folder = tiny.cache_folder(str(tmp_path / "b"), "bandit", tiny.build_tokenizer(), None, steps=4, seed=0, **SIZES)
    os.makedirs(tmp_path / "b")
    with open(folder + ".partial.pt", "wb") as f:
        f.write(os.urandom(4096))  # random bytes: pickle's own error, not one of torch's
    built, _ = tiny.load_tiny("bandit", cache_dir=str(tmp_path / "b"), steps=4, progress=False, **SIZES)
    assert "is damaged" in capsys.readouterr().out and not os.path.exists(folder + ".partial.pt")
    assert all(torch.equal(p, q) for p, q in zip(straight.parameters(), built.parameters()))


def _flip(path):
    data = bytearray(path.read_bytes())
    data[-17] ^= 0xFF  # one byte of the last weights
    return bytes(data)


def test_an_interrupted_warm_start_continues_where_it_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny, "SAVE_EVERY", 4)
    straight, _ = tiny.load_tiny("bandit", cache_dir=str(tmp_path / "a"), steps=12, progress=False, **SIZES)
    imitate, calls = demos.imitate, []

    def stopped_at_step_9(*args, on_step=None, **kwargs):
        def step(i, loss, optimizer):
            on_step(i, loss, optimizer)
            if i == 9:
                raise KeyboardInterrupt
        calls.append(kwargs["start"])
        return imitate(*args, on_step=step if not calls[1:] else on_step, **kwargs)

    monkeypatch.setattr(demos, "imitate", stopped_at_step_9)
    with pytest.raises(KeyboardInterrupt):
        tiny.load_tiny("bandit", cache_dir=str(tmp_path / "b"), steps=12, progress=False, **SIZES)
    resumed, _ = tiny.load_tiny("bandit", cache_dir=str(tmp_path / "b"), steps=12, progress=False, **SIZES)
    assert calls == [0, 8]  # continued from the last save (step 8), not from the start
    assert all(torch.equal(p, q) for p, q in zip(straight.parameters(), resumed.parameters()))


def test_builds_of_different_warm_starts_take_turns_on_few_cores(tmp_path, capsys, monkeypatch):
    import fcntl
    monkeypatch.setattr(os, "cpu_count", lambda: 2 * tiny.BUILD_THREADS - 1)
    lock = open(tmp_path / "build.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # another warm start is being built
    result = {}
    waiter = threading.Thread(target=lambda: result.update(model=build(tmp_path)[0]))
    waiter.start()
    said = ""
    while waiter.is_alive() and "waiting for another warm start's build" not in said:
        said += capsys.readouterr().out
        time.sleep(0.01)
    assert waiter.is_alive() and "waiting for another warm start's build" in said
    lock.close()
    waiter.join()
    assert result["model"] is not None
    monkeypatch.setattr(os, "cpu_count", lambda: 2 * tiny.BUILD_THREADS)  # enough cores: no turns
    os.remove(tmp_path / "build.lock")
    build(tmp_path, seed=1)
    assert not os.path.exists(tmp_path / "build.lock")


def test_one_process_builds_while_another_waits(tmp_path, capsys):
    folder = tiny.cache_folder(str(tmp_path), "bandit", tiny.build_tokenizer(), None, steps=4, seed=0, **SIZES)
    import fcntl
    lock = open(folder + ".lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # someone else is building
    result = {}
    waiter = threading.Thread(target=lambda: result.update(model=build(tmp_path)[0]))
    waiter.start()
    said = ""
    while waiter.is_alive() and "waiting for another process" not in said:  # no clock: it says so, or ends
        said += capsys.readouterr().out
        time.sleep(0.01)
    assert waiter.is_alive() and "waiting for another process" in said  # it waits for the lock
    lock.close()  # the other build ends
    waiter.join()
    assert result["model"] is not None
