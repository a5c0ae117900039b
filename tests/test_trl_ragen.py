"""trl_ragen.py: RAGEN-2's filter and diagnosis inside TRL's GRPOTrainer. Two CPU steps log every
metric and keep exactly select_groups's groups; the gradient with dropped groups (removed on one
process, masked as several processes do) is that of a batch that never held them; a real
two-process run splits a group across processes and both keep the one-process selection; with
--filter none the batch and loss are stock GRPOTrainer's. The policy is scripted
(tests/trl_ragen_script.py), so rewards have known spread."""
import copy
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

import envs
import rollout
import snr_filter
import tiny
import trl_ragen

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trl_ragen_script as script  # noqa: E402

K = 2
DTYPE = torch.float64  # float32 sums rows in a batch-shape-dependent order: 1e-5 apart
EVERY_STEP = {"step", "train_success", "reward_mean", "reward_std", "response_length", "turns",
              "cut_frac", "kept_ratio", "num_kept", "num_zero_var", "zero_var_frac",
              "mean_score_kept", "mean_score_dropped", "skipped", "time_rollout", "time_scoring",
              "time_step", "loss", "grad_norm", "token_entropy", "group_rewards", "kept_groups"}


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """Two steps of the command line on one process (the scripted policy), its metrics lines."""
    out = tmp_path_factory.mktemp("trl") / "run"
    argv = script.ARGS + ["--steps", "2", "--out", str(out)]
    assert trl_ragen.main(argv, make_policy=script.scripted()) == 0
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_two_steps_log_every_metric_and_keep_select_groups_choice(one_process_run):
    assert [r["step"] for r in one_process_run] == [1, 2]
    for r in one_process_run:
        assert EVERY_STEP <= set(r), EVERY_STEP - set(r)
        scores = snr_filter.group_scores(r["group_rewards"])
        keep = snr_filter.select_groups(scores, "topp", 0.9)
        assert r["kept_groups"] == keep.nonzero()[:, 0].tolist()
        assert r["kept_groups"] and 0 not in r["kept_groups"]  # group 0 has no spread
        assert r["num_kept"] == len(r["kept_groups"]) and r["zero_var_frac"] == 1 / 3
    assert set(trl_ragen.MI_KEYS) - {"retrieval_acc_top2"} <= set(one_process_run[0])  # step 1


def longer_first_turn_for(seed):
    """rollout.play's `user` writer that lengthens the turn-1 prompt of one layout: its group's
    rows get more left padding than the others, so padding they leave behind would show."""
    long_obs = None if seed is None else envs.make_env("sokoban").reset(seed=seed)[0]

    def user(obs, reward, actions_left, turn):
        extra = " Think twice." * 4 if turn == 1 and obs == long_obs else ""
        return rollout.user_message(obs, reward, actions_left, turn) + extra
    return user


def trainer_on(seeds, solves, filter="topp", loss_type="dapo", stock=False, long_seed=None,
               scale="group"):
    """A trainer on the given env seeds (K rollouts each) with the scripted policy, the tiny model
    at its seed-0 weights, and the inputs of one generation batch; long_seed's prompt is longer
    (the tiny policy's Sokoban prompts otherwise all have one length)."""
    tokenizer = tiny.build_tokenizer()
    config = GRPOConfig(output_dir=os.path.join(tempfile.gettempdir(), "trl-ragen-test"),
                        use_cpu=True, per_device_train_batch_size=K * len(seeds),
                        num_generations=K, max_completion_length=8, loss_type=loss_type,
                        scale_rewards=scale, report_to="none", save_strategy="no",
                        gradient_checkpointing=False, shuffle_dataset=False)
    prompts = [trl_ragen.seed_prompt(s) for s in seeds]
    rollout_func = trl_ragen.rollout_function("sokoban", max_turns=1, max_new_tokens=8,
                                              prompt={"user": longer_first_turn_for(long_seed)},
                                              make_policy=script.scripted(solves))
    kwargs = dict(model=tiny.build_model(tokenizer).to(DTYPE),
                  reward_funcs=trl_ragen.episode_reward, args=config, processing_class=tokenizer,
                  train_dataset=Dataset.from_dict({"prompt": prompts}), rollout_func=rollout_func)
    trainer = (GRPOTrainer(**kwargs) if stock else
               trl_ragen.RagenGRPOTrainer(filter=filter, top_p=1.0, mi_every=0, **kwargs))
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
    # the timeout guards against a hang of the process group, not a speed check
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [json.loads((tmp_path / f"process-{i}.json").read_text()) for i in (0, 1)]
    assert all(s["processes"] == 2 and s["backend"] == "gloo" for s in seen)
    first = one_process_run[0]  # the same command's step 1 on one process
    for s in seen:
        assert s["group_rewards"] == first["group_rewards"]
        assert s["kept_groups"] == first["kept_groups"] == [1, 2]
    assert seen[0]["kept_rows"] == [2] and seen[1]["kept_rows"] == [3, 4, 5]  # group 1 split


def test_bad_flags_are_one_line_and_exit_code_2(tmp_path, capsys):
    for argv, words in ((["--filter", "best"], "invalid choice"), (["--top-p", "0"], "--top-p"),
                        (["--groups", "3", "--group-size", "3", "--accumulation", "2"], "divide"),
                        (["--loss-type", "grpo", "--accumulation", "2"], "averages over sequences"),
                        (["--stepz", "2"], "unrecognized")):
        assert trl_ragen.main(argv + ["--out", str(tmp_path / "x"), "--model", "tiny",
                                      "--no-warm-start"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err


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
