"""trl_ragen.py: RAGEN-2's filter and diagnosis inside TRL's GRPOTrainer. Two CPU steps log every
metric and keep exactly select_groups's groups, and a step that keeps nothing leaves the weights and
AdamW's state unchanged; the gradient with dropped groups (removed on one process, masked as several
processes do) is that of a batch that never held them; the entropy bonus under gradient accumulation
is one batch's; dr_grpo's loss and gradient are train.py's drgrpo's; the diagnosis scores the
sampled ids, and under --bf16 (the GPU default, run here on the CPU) still in float32 while the
loss's forward pass runs in bfloat16; bad flags are one line and exit code 2. A real two-process run
(gloo) splits a group across processes and both keep the one-process selection; on the same
processes, multi-turn episodes of different lengths through TRL's server-mode vLLM calls (a fake
client) and through a policy sharded by torch FSDP. With --filter none the batch and loss are stock
GRPOTrainer's. The policy is mostly scripted (tests/trl_ragen_script.py), so rewards have known
spread."""
import contextlib
import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

import envs
import mi
import rollout
import snr_filter
import train
from plumbing import defaults, flags, runs
from warmstart import tiny
from scaleout import trl_ragen

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trl_ragen_script as script  # noqa: E402

K = 2
DTYPE = torch.float64  # float32 sums rows in a batch-shape-dependent order: 1e-5 apart
EVERY_STEP = {"step", "train_success", "reward_mean", "reward_std", "response_length", "turns",
              "cut_frac", "kept_ratio", "num_kept", "num_zero_var", "zero_var_frac",
              "mean_score_kept", "mean_score_dropped", "skipped", "time_rollout", "time_scoring",
              "time_step", "loss", "grad_norm", "token_entropy", "group_rewards", "kept_groups"}


def garbage_after_step_1(trainer, *settings):
    """make_policy: the scripted roles at step 1, garbage from every rollout at step 2 (no group
    has spread: the step is skipped)."""
    step1 = trainer.state.global_step == 0
    return script.scripted(script.default_role if step1 else lambda row: False)(trainer, *settings)


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """Two steps of the command line on one process (the scripted policy, step 2 skipped): its
    metrics lines, the weights and the optimiser's state at the start and after each step, and
    the env seeds each step drew."""
    from transformers import TrainerCallback

    class Snapshots(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            self.seen = [([p.detach().clone() for p in model.parameters()], {})]

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
            self.seen.append(([p.detach().clone() for p in model.parameters()],
                              copy.deepcopy(optimizer.state_dict()["state"])))

    out, snapshots, drawn = tmp_path_factory.mktemp("trl") / "run", Snapshots(), []
    argv = script.ARGS + ["--steps", "2", "--out", str(out)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trl_ragen, "step_seeds", lambda *a: drawn.append(a) or [5, 6, 7])
        assert trl_ragen.main(argv, make_policy=garbage_after_step_1, callbacks=[snapshots]) == 0
    with open(out / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    return {"lines": lines, "snapshots": snapshots.seen, "drawn": drawn}


def test_two_steps_log_every_metric_and_keep_select_groups_choice(one_process_run):
    lines = one_process_run["lines"]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        assert EVERY_STEP <= set(r), EVERY_STEP - set(r)
        scores = snr_filter.group_scores(r["group_rewards"])
        keep = snr_filter.select_groups(scores, "topp", 0.9)
        assert r["kept_groups"] == keep.nonzero()[:, 0].tolist()
    assert lines[0]["kept_groups"] == [1, 2]  # group 0 has no spread
    assert lines[0]["num_kept"] == 2 and lines[0]["zero_var_frac"] == 1 / 3
    assert lines[1]["kept_groups"] == [] and lines[1]["skipped"] == 1
    assert set(mi.DIAGNOSIS_KEYS) - {"retrieval_acc_top2"} <= set(lines[0])  # step 1
    # each step's env seeds drawn for that step (seed 0, 3 groups), as train.py draws them
    assert one_process_run["drawn"] == [(0, 1, 3), (0, 2, 3)]


def test_a_skipped_step_leaves_the_weights_and_the_optimiser_state_unchanged(one_process_run):
    """Step 1 trains (AdamW gains momentum); step 2 keeps no group: no weight and no optimiser
    state may change (a zero gradient would still move the weights by the momentum)."""
    (start, _), (after1, state1), (after2, state2) = one_process_run["snapshots"]
    assert state1 and any(not torch.equal(a, b) for a, b in zip(start, after1))
    assert all(torch.equal(a, b) for a, b in zip(after1, after2))
    assert state1.keys() == state2.keys()
    for k in state1:
        for name in state1[k]:
            assert torch.equal(state1[k][name], state2[k][name]), (k, name)


def test_step_count_costs_nothing_before_training(tmp_path):
    """--steps up to train.py's bound: the dataset holds each group once (TRL cycles it, a pass a
    step), not one row per step."""
    a = trl_ragen.parse_args(script.ARGS + ["--steps", str(flags.MAX_STEPS), "--out",
                                            str(tmp_path)])
    a.lr, a.max_new_tokens = 1e-4, 8
    trainer = trl_ragen.build_trainer(a, *trl_ragen.load_model(a, cuda=False))
    assert trainer.train_dataset.num_rows == a.groups and trainer.args.max_steps == flags.MAX_STEPS
    train_py = np.random.default_rng([0, 2]).integers(0, defaults.VAL_SEED_BASE, 3)  # train.train
    assert trl_ragen.step_seeds(0, 2, 3) == train_py.tolist()


def test_the_flags_the_entry_points_share_are_defined_once_in_flags_py(tmp_path):
    """Every flag both take is plumbing.flags.Args's own (type, default, help, choices), but the
    two trl_ragen.py re-declares; a flag added to flags.Args and named shared is a flag of both;
    what --filter means is snr_filter.select's, so the controls run here too."""
    assert train.Args is flags.Args  # train.py's flags are these
    ours = {f.name: f for f in dataclasses.fields(flags.Args)}
    both = [f for f in dataclasses.fields(trl_ragen.Args) if f.name in ours]
    assert {f.name for f in both} == set(trl_ragen.SHARED) | {"grad_checkpointing", "out"}
    for f in both:
        if f.name in trl_ragen.SHARED:
            assert (f.type, f.default, f.metadata) == (ours[f.name].type, ours[f.name].default,
                                                       ours[f.name].metadata), f.name

    @dataclasses.dataclass
    class Grown(flags.Args):
        new_flag: int = flags.arg(7, "a flag defined once")
    shared = trl_ragen.shared_flags(Grown, trl_ragen.SHARED + ("new_flag",))
    assert "a flag defined once [7]" in flags.build_parser(shared).format_help()
    a = trl_ragen.parse_args(["--filter", "random", "--control-of", "topp", "--out", str(tmp_path)])
    assert (a.filter, a.control_of) == ("random", "topp")


def longer_first_turn_for(seed):
    """rollout.play's `user` writer that lengthens the turn-1 prompt of one layout: its group's
    rows get more left padding than the others, so padding they leave behind would show."""
    long_obs = None if seed is None else envs.make_env("sokoban").reset(seed=seed)[0]

    def user(obs, reward, actions_left, turn):
        extra = " Think twice." * 4 if turn == 1 and obs == long_obs else ""
        return rollout.user_message(obs, reward, actions_left, turn) + extra
    return user


def trainer_on(seeds, solves, filter="topp", loss_type="dapo", stock=False, long_seed=None,
               scale="group", accumulation=1, entropy_coef=0.0, max_turns=1, budget=None,
               mi_every=0):
    """A trainer on the given env seeds (K rollouts each) with the scripted policy (solves None:
    the sampler), the tiny model at its seed-0 weights, and the inputs of one generation batch;
    long_seed's prompt is longer (the tiny policy's Sokoban prompts otherwise all have one
    length). accumulation: micro-batches per generation batch."""
    tokenizer = tiny.build_tokenizer()
    config = GRPOConfig(output_dir=os.path.join(tempfile.gettempdir(), "trl-ragen-test"),
                        use_cpu=True, per_device_train_batch_size=K * len(seeds) // accumulation,
                        gradient_accumulation_steps=accumulation, num_generations=K,
                        max_completion_length=8, loss_type=loss_type, scale_rewards=scale,
                        entropy_coef=entropy_coef, bf16=False, report_to="none",
                        save_strategy="no", gradient_checkpointing=False, shuffle_dataset=False)
    prompts = [trl_ragen.group_prompt(g) for g in range(len(seeds))]
    rollout_func = trl_ragen.rollout_function("sokoban", lambda step: seeds, max_turns=max_turns,
                                              max_new_tokens=8,
                                              prompt={"user": longer_first_turn_for(long_seed)},
                                              make_policy=solves and script.scripted(solves))
    kwargs = dict(model=tiny.build_model(tokenizer).to(DTYPE),
                  reward_funcs=trl_ragen.episode_reward, args=config, processing_class=tokenizer,
                  train_dataset=Dataset.from_dict({"prompt": prompts}), rollout_func=rollout_func)
    trainer = (GRPOTrainer(**kwargs) if stock else
               trl_ragen.RagenGRPOTrainer(filter=filter, top_p=1.0, mi_every=mi_every,
                                          response_budget=budget, **kwargs))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); one micro-batch
    return trainer, [{"prompt": p} for p in prompts for _ in range(K)]


def loss_and_gradient(trainer, batch):
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in trainer.model.parameters()])


@pytest.mark.parametrize("loss_type, removed, scale", [
    ("dapo", True, "group"), ("dapo", False, "group"), ("grpo", True, "group"),
    ("dapo", False, "batch")])
def test_gradient_with_dropped_groups_is_that_of_a_batch_without_them(loss_type, removed, scale):
    """Removed (one process): group 0's longer prompt takes its left padding with it. Masked
    (several processes): the rows and their padding stay, so the prompts have one length here --
    TRL passes no position ids, so a row's numbers depend on its batch's padding, filter or not.
    scale_rewards="batch": the advantages' std over the kept groups only."""
    seeds = [5, 6, 7]  # group 0 (seed 5) writes garbage only: no spread, dropped
    long_seed = 5 if removed else None
    trainer, inputs = trainer_on(seeds, lambda r: r // K > 0 and r % K == 0, loss_type=loss_type,
                                 long_seed=long_seed, scale=scale)
    trainer.remove_dropped = removed  # False: what several processes do (rows masked)
    batch = trainer._generate_and_score_completions(inputs)
    assert trainer.last_selection["kept_groups"] == [1, 2]
    assert len(batch["advantages"]) == (2 * K if removed else 3 * K)
    assert batch["prompt_mask"].all()  # removed: the longer prompt's padding went with it

    never, never_inputs = trainer_on(seeds[1:], lambda r: r % K == 0, filter="none",
                                     loss_type=loss_type, long_seed=long_seed, scale=scale)
    clean = never._generate_and_score_completions(never_inputs)
    loss, grad = loss_and_gradient(trainer, batch)
    clean_loss, clean_grad = loss_and_gradient(never, clean)
    assert clean_grad.abs().max() > 0
    # TRL's advantages are float32; the batch std is ours (torch.std) against TRL's nanstd, and
    # masked rows stay in TRL's float32 tensors (other shapes, other rounding): one float32
    # rounding apart
    rel = 1e-6 if scale == "batch" or not removed else 1e-12
    assert loss == pytest.approx(clean_loss, rel=rel)
    torch.testing.assert_close(grad, clean_grad, rtol=rel * 100, atol=rel)


def test_filter_none_gives_stock_grpo_trainers_batch_and_loss():
    seeds, solves = [5, 6, 7], lambda r: r % K == 0 and r // K != 1  # group 1 without spread
    ours, inputs = trainer_on(seeds, solves, filter="none")
    stock, _ = trainer_on(seeds, solves, stock=True)
    a = ours._generate_and_score_completions(copy.deepcopy(inputs))
    b = stock._generate_and_score_completions(copy.deepcopy(inputs))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert loss_and_gradient(ours, a)[0] == loss_and_gradient(stock, b)[0]
    assert ours.last_selection["kept_groups"] == [0, 1, 2]


def test_two_processes_split_a_group_and_keep_the_one_process_selection(tmp_path,
                                                                        one_process_run):
    """accelerate launch, two CPU processes over gloo, 3 rows each: group 1 has one rollout on
    each process, so its spread exists only in the gathered rewards."""
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", script.__file__, str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [json.loads((tmp_path / f"process-{i}.json").read_text()) for i in (0, 1)]
    assert all(s["processes"] == 2 and s["backend"] == "gloo" for s in seen)
    first = one_process_run["lines"][0]  # the same command's step 1 on one process
    for s in seen:
        assert s["group_rewards"] == first["group_rewards"]
        assert s["kept_groups"] == first["kept_groups"] == [1, 2]
    assert seen[0]["kept_rows"] == [2] and seen[1]["kept_rows"] == [3, 4, 5]  # group 1 split
    # vLLM (server mode, fake client): process 0's 2 episodes end after turn 1, process 1's 4
    # after turn 3, yet both made the same calls with as many prompts, and every reply is the
    # server's reply to its own prompt
    assert seen[0]["vllm_turns"] == [1, 1] and seen[1]["vllm_turns"] == [3] * 4
    assert seen[0]["vllm_calls"] == seen[1]["vllm_calls"] == [4, 4, 4]
    assert seen[0]["vllm_replies_match"] and seen[1]["vllm_replies_match"]
    # FSDP: process 0 plays 1 turn, process 1 two (so their forward passes differ in number);
    # sharded, the samples, their log-probs and the diagnosis are the unsharded policy's
    assert [s["fsdp"]["plain"]["turns"] for s in seen] == [[1, 1, 1], [2, 2, 2]]
    for s in seen:
        plain, sharded = s["fsdp"]["plain"], s["fsdp"]["fsdp"]
        assert sharded["ids"] == plain["ids"] and sharded["turns"] == plain["turns"]
        flat = [torch.tensor(sum(x["logprobs"], [])) for x in (sharded, plain)]
        torch.testing.assert_close(*flat)
        assert sharded["mi"] == pytest.approx(plain["mi"], rel=1e-6)
        assert sharded["mi"]["diagnosis_logprob_diff"] < 1e-4  # the sampled ids were scored


def test_diagnosis_scores_the_sampled_ids_and_logs_their_logprob_diff():
    """The tiny policy samples (random weights, temperature 1) and the diagnosis scores the ids it
    sampled, so a sample's score under its own prompt is its sampling log-prob:
    diagnosis_logprob_diff (train.py's) is 0 up to float32 rounding."""
    torch.manual_seed(0)
    trainer, inputs = trainer_on([5, 6, 7], None, mi_every=1)
    trainer._generate_and_score_completions(inputs)
    metrics = trainer._metrics["train"]
    assert set(mi.DIAGNOSIS_KEYS) - {"retrieval_acc_top2"} <= set(metrics)
    assert len(metrics["diagnosis_logprob_diff"]) == 1
    assert 0 <= metrics["diagnosis_logprob_diff"][0] < 1e-4


def scripted_then_sampled(trainer, *settings):
    """make_policy: the scripted roles at step 1 (groups with spread: an update), the tiny policy's
    sampler after it (its log-probs: the diagnosis's check)."""
    if trainer.state.global_step == 0:
        return script.scripted()(trainer, *settings)
    return trl_ragen.sampler_policy(trainer, *settings)


def test_bf16_the_gpu_default_runs_on_a_cpu_and_the_diagnosis_scores_in_float32(tmp_path):
    """--bf16, the default on a GPU, on this CPU: accelerate wraps the model's forward pass in
    bfloat16 autocast (its logits move by more than 1e-2 here), the update of step 1 runs under it
    and moves the weights, and the diagnosis of step 2 still scores in float32, as train.py's does:
    it runs the decoder and the output layer itself (logprobs.policy_logprobs), not the wrapped
    forward pass, so its check against the float32 sampler's log-probs stays below 1e-4."""
    from transformers import TrainerCallback

    seen = {}

    class Look(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            seen["start"] = [p.detach().clone() for p in model.parameters()]

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step == 1:
                seen["after"] = [p.detach().clone() for p in model.parameters()]
                ids = torch.randint(10, 100, (2, 30), generator=torch.Generator().manual_seed(0))
                with torch.no_grad():
                    mixed = model(input_ids=ids).logits.float()                    # [2, 30, V]
                    plain = model._original_forward(input_ids=ids).logits          # [2, 30, V]
                seen["gap"] = (mixed - plain).abs().max().item()

    out = tmp_path / "run"
    argv = script.ARGS + ["--steps", "2", "--bf16", "--out", str(out)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trl_ragen, "step_seeds", lambda *a: [5, 6, 7])
        assert trl_ragen.main(argv, make_policy=scripted_then_sampled, callbacks=[Look()]) == 0
    lines = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert seen["gap"] > 1e-2  # the forward pass TRL's loss runs is bfloat16's
    assert lines[0]["num_kept"] == 2 and math.isfinite(lines[0]["loss"]) and lines[0]["grad_norm"] > 0
    assert all(torch.isfinite(p).all() for p in seen["after"])
    assert any(not torch.equal(a, b) for a, b in zip(seen["start"], seen["after"]))
    assert 0 <= lines[1]["diagnosis_logprob_diff"] < 1e-4


def rows_of(batch, rows):
    """The micro-batch of `rows` of a generation batch, cut as TRL's split_tensor_dict cuts."""
    B = len(batch["advantages"])
    return {k: v[rows] if torch.is_tensor(v) and v.dim() and len(v) == B else v
            for k, v in batch.items()}


def test_entropy_bonus_under_gradient_accumulation_is_that_of_one_batch():
    """Two micro-batches with different token counts (rows 1 and 2 play the solver's longer
    replies): their summed gradient is that of the whole batch as one micro-batch, the entropy
    bonus included (a token mean over the whole batch, as dapo's policy term)."""
    seeds, solves = [5, 6, 7], lambda r: r in (1, 2)
    split, inputs = trainer_on(seeds, solves, accumulation=2, entropy_coef=0.1)
    whole, _ = trainer_on(seeds, solves, entropy_coef=0.1)
    batch = split._generate_and_score_completions(copy.deepcopy(inputs))
    halves = [rows_of(batch, slice(0, 3)), rows_of(batch, slice(3, 6))]
    assert halves[0]["completion_mask"].sum() != halves[1]["completion_mask"].sum()
    split.current_gradient_accumulation_steps = 2
    summed = sum(loss_and_gradient(split, h)[1] for h in halves)
    grad = loss_and_gradient(whole, whole._generate_and_score_completions(inputs))[1]
    assert grad.abs().max() > 0  # float32 sums in another order: equal to float32's rounding
    torch.testing.assert_close(summed, grad, rtol=1e-6, atol=1e-6 * grad.abs().max().item())


def test_dr_grpo_loss_and_gradient_are_train_pys_on_one_batch():
    """trl_ragen.py's dr_grpo (no std division) and train.py's drgrpo on the same 2-turn
    episodes: one loss and one gradient (train.py's one SGD step of lr 1). Both divide each
    episode's token sum by max_turns x max_new_tokens (flags.response_budget), where TRL's
    max_completion_length is one turn's limit."""
    seeds, solves = [5, 6, 7], lambda r: r in (1, 2)
    args = train.Args(algo="drgrpo", max_turns=2, max_new_tokens=8, entropy_coef=0.0,
                      micro_batch=64, grad_clip=1e9)
    trainer, inputs = trainer_on(seeds, solves, loss_type="dr_grpo", scale="none", filter="none",
                                 max_turns=2, budget=flags.response_budget(args))
    policy = copy.deepcopy(trainer.model)
    loss, grad = loss_and_gradient(trainer, trainer._generate_and_score_completions(inputs))

    tokenizer = trainer.processing_class
    episodes = rollout.play(script.scripted(solves)(trainer), tokenizer, "sokoban", seeds, K,
                            max_turns=2)
    assert {e.turns for e in episodes} == {2}
    rewards = torch.tensor([e.total_reward for e in episodes]).view(len(seeds), K)  # [G, K]
    before = [p.detach().clone() for p in policy.parameters()]
    run = runs.Run(args, torch.device("cpu"), contextlib.nullcontext(), policy, tokenizer, {},
                   None, None, [torch.optim.SGD(policy.parameters(), lr=1.0)],
                   list(policy.parameters()), [], pad_id=rollout.pad_token_id(tokenizer))
    out = train.update_policy(run, episodes, rewards, torch.Generator().manual_seed(0))
    assert out["pg_loss"] == pytest.approx(loss, rel=1e-6)
    step = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, policy.parameters())])
    torch.testing.assert_close(step, grad, rtol=1e-5, atol=1e-6)  # train.py's logp: float32


def test_bad_flags_are_one_line_and_exit_code_2(tmp_path, capsys):
    small = ["--groups", "3", "--group-size", "2", "--steps", "1"]  # a quick run if accepted
    for argv, words in ((["--filter", "best"], "invalid choice"), (["--top-p", "0"], "--top-p"),
                        (["--groups", "3", "--group-size", "3", "--accumulation", "2"], "divide"),
                        (["--loss-type", "grpo", "--accumulation", "2"], "averages over sequences"),
                        (small + ["--loss-type", "bnpo", "--accumulation", "2"], "'dapo'"),
                        (small + ["--temperature", "inf"], "finite"),
                        (small + ["--lr", "inf"], "finite"),
                        (small + ["--clip-high", "inf"], "finite"),
                        (["--steps", "100000000"], "--steps"),
                        (["--steps", "0"], "--steps must be >= 1, got 0"),  # the one that failed
                        (["--group-size", "1"], "--group-size must be >= 2 (GRPO compares"),
                        (["--accumulation", "0"], "--accumulation must be >= 1, got 0"),
                        (["--stepz", "2"], "unrecognized")):
        assert trl_ragen.main(argv + ["--out", str(tmp_path / "x"), "--model", "tiny",
                                      "--no-warm-start"]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "x").exists()


def test_unusable_out_and_what_cannot_fit_are_one_line_as_in_train_py(tmp_path, capsys):
    a_file, full = tmp_path / "file", tmp_path / "full"
    a_file.write_text("x")
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    small = ["--model", "tiny", "--no-warm-start", "--steps", "1", "--out"]
    for argv, words in ((small + [str(a_file)], "cannot write there"),
                        (small + [str(a_file / "run")], "cannot write there"),
                        (small + [str(full)], "a folder with other files in it"),
                        (small + [str(tmp_path / "x"), "--max-new-tokens", "100000"], "context"),
                        (small + [str(tmp_path / "x"), "--max-turns", "100000"], "context"),
                        (small + [str(tmp_path / "x"), "--filter", "topk", "--top-p", "0.5"],
                         "--top-p 0.5 is ignored with --filter topk")):
        assert trl_ragen.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "x").exists() and os.listdir(full) == ["notes.txt"]


def test_use_vllm_without_vllm_or_a_gpu_is_one_line(tmp_path, capsys, monkeypatch):
    """--use-vllm needs vLLM installed and a CUDA GPU: without either, one line saying so and
    exit code 2 before anything loads, no folder."""
    out = tmp_path / "run"
    argv = script.ARGS + ["--steps", "1", "--use-vllm", "--out", str(out)]
    find_spec = trl_ragen.importlib.util.find_spec
    monkeypatch.setattr(trl_ragen.importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    assert trl_ragen.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --use-vllm: vLLM is not installed"), err
    monkeypatch.setattr(trl_ragen.importlib.util, "find_spec",  # installed, but no GPU here
                        lambda name, *a: object() if name == "vllm" else find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert trl_ragen.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--use-vllm: vLLM samples on a CUDA GPU and none was found" in err[0], err
    assert not out.exists()


class StartFails(Exception):
    """What a tracker or a sampler that cannot start raises as training begins."""


def test_a_failed_start_leaves_the_folder_as_it_found_it_and_the_same_command_runs(tmp_path):
    """TRL writes config.json and trl/ before training begins; a start that fails there (a
    tracker, vLLM) leaves no folder it made, and an empty one it was given empty, so the same
    command is not refused as 'already holds a run' once the cause is gone."""
    from transformers import TrainerCallback

    class Fails(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            raise StartFails("cannot start")

    for out in (tmp_path / "new", tmp_path / "empty"):
        given = out.name == "empty"
        if given:
            out.mkdir()
        argv = script.ARGS + ["--steps", "1", "--mi-every", "0", "--out", str(out)]
        with pytest.raises(StartFails):
            trl_ragen.main(argv, make_policy=script.scripted(), callbacks=[Fails()])
        assert (out.exists() and not os.listdir(out)) if given else not out.exists()
        assert trl_ragen.main(argv, make_policy=script.scripted()) == 0
        assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_wandb_without_a_key_is_one_line_and_offline_writes_into_the_run_folder(tmp_path, capsys,
                                                                                monkeypatch):
    """TRL's wandb callback refused for want of an API key: one line, exit 2, no folder; then the
    same command with WANDB_MODE=offline runs, its wandb files in the run folder, not in the
    working directory."""
    wandb = pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.chdir(tmp_path)
    wandb.teardown()
    out = tmp_path / "run"
    argv = script.ARGS + ["--steps", "1", "--mi-every", "0", "--report-to", "wandb", "--out", str(out)]
    try:
        assert trl_ragen.main(argv, make_policy=script.scripted()) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--report-to wandb: wandb did not start (No API key" in err[0], err
        assert "WANDB_MODE=offline" in err[0] and not out.exists()
        wandb.teardown()
        monkeypatch.setenv("WANDB_MODE", "offline")
        assert trl_ragen.main(argv, make_policy=script.scripted()) == 0
        assert any(f.startswith("offline-run-") for f in os.listdir(out / "wandb"))
        assert not (tmp_path / "wandb").exists() and "WANDB_DIR" not in os.environ
    finally:
        wandb.teardown()


def test_a_diverged_run_stops_with_one_line(tmp_path, capsys, monkeypatch):
    """A learning rate past today's ceiling: the first step whose loss or gradient norm is not
    finite ends the run with one line naming it; the steps before it stay logged."""
    monkeypatch.setattr(flags, "MAX_LR", 1e10)
    out = tmp_path / "run"
    argv = script.ARGS + ["--steps", "4", "--mi-every", "0", "--lr", "1e10", "--out", str(out)]
    assert trl_ragen.main(argv, make_policy=script.scripted()) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the run diverged at step" in err[0] and "--lr (1e+10)" in err[0], err
    step = int(err[0].split("at step ")[1].split(":")[0])
    assert step >= 2 and len((out / "metrics.jsonl").read_text().splitlines()) == step - 1


def test_report_to_tensorboard_writes_trls_events_in_the_run_folder(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    argv = script.ARGS + ["--steps", "1", "--report-to", "tensorboard", "--out", str(out)]
    assert trl_ragen.main(argv, make_policy=script.scripted()) == 0
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    (line,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"train/kept_ratio", "train/mi_estimate", "train/loss"} <= set(events.Tags()["scalars"])
    assert events.Scalars("train/kept_ratio")[0].value == pytest.approx(line["kept_ratio"])


def test_top_p_decides_the_kept_groups(tmp_path):
    """--top-p reaches the filter: at 0.5 the group with the larger spread alone holds half of the
    summed spread and is the only one kept, where the default 0.9 keeps both groups with spread."""
    out = tmp_path / "run"
    argv = script.ARGS + ["--steps", "1", "--mi-every", "0", "--top-p", "0.5", "--out", str(out)]
    assert trl_ragen.main(argv, make_policy=script.scripted()) == 0
    (r,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scores = snr_filter.group_scores(r["group_rewards"])
    assert len(snr_filter.select_groups(scores, "topp", 0.9).nonzero()) == 2
    assert r["kept_groups"] == [int(scores.argmax())] and r["num_kept"] == 1


def test_a_control_keeps_the_groups_train_select_keeps():
    """--filter random draws as train.py does, from the stream of (seed, step): the same groups."""
    trainer, inputs = trainer_on([5, 6, 7], lambda r: r % K == 0, filter="random")
    trainer._generate_and_score_completions(inputs)
    rewards = torch.tensor(trainer.last_selection["group_rewards"])               # [G, K]
    keep, _ = snr_filter.select(rewards, snr_filter.Filter(mode="random"), trainer.args.seed, 1)
    assert trainer.last_selection["kept_groups"] == keep.nonzero()[:, 0].tolist()
    assert len(trainer.last_selection["kept_groups"]) == 1  # topk's count: int(0.5 x 3)
