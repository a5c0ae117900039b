"""train.py end to end on the tiny policy (random weights: seconds per run), and the filter's exactness."""
import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import envs
import rollout
import tiny
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--model", "tiny", "--no-warm-start", "--groups", "2", "--group-size", "2", "--max-turns", "2",
         "--max-new-tokens", "8", "--val-seeds", "1", "--mi-samples", "4", "--micro-batch", "2", "--no-plot"]
EVERY_STEP = {"step", "train_success", "reward_mean", "reward_std", "kept_ratio", "zero_var_frac", "num_zero_var",
              "response_length", "skipped", "time_rollout", "time_scoring", "time_update", "time_step"}
DIAGNOSIS = {"mi_estimate", "mi_seq_estimate", "mi_zscore", "mi_zscore_ema", "retrieval_acc", "conditional_entropy",
             "reasoning_entropy"}
UPDATE = {"pg_loss", "entropy_loss", "clip_frac", "approx_kl", "grad_norm", "token_entropy"}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add overhead
    yield
    torch.set_num_threads(threads)


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def finite(record):
    return all(math.isfinite(v) for v in record.values() if isinstance(v, float))


@pytest.mark.parametrize("env", sorted(envs.ENVS))
@pytest.mark.parametrize("algo", ["ppo", "grpo", "drgrpo"])
@pytest.mark.parametrize("filt", ["none", "topp", "topk"])
def test_every_combination_runs_and_logs_the_documented_keys(tmp_path, env, algo, filt):
    out = str(tmp_path / "run")
    assert train.main(SMALL + ["--env", env, "--algo", algo, "--filter", filt, "--steps", "2", "--out", out]) == 0
    first, last = records(out)
    assert first["step"] == 1 and last["step"] == 2
    assert EVERY_STEP <= set(first) and EVERY_STEP <= set(last)
    assert DIAGNOSIS <= set(first)                        # step 1 is diagnosed
    assert "val_success" in last                          # and the last step validated
    for r in (first, last):
        assert finite(r)
        assert r["skipped"] == (r["kept_ratio"] == 0)
        if not r["skipped"]:
            assert UPDATE <= set(r)
            assert ("value_loss" in r) == (algo == "ppo")
    if filt == "none":
        assert first["kept_ratio"] == 1.0 and not first["skipped"]
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["algo"] == algo
    assert os.path.isfile(os.path.join(out, "checkpoint", "trainer_state.pt"))


def test_zero_spread_batches_skip_the_update_and_stop_after_five(tmp_path, capsys):
    # A random network never writes a valid action: every rollout earns the same format penalties, no group has
    # spread, Top-P keeps nothing, and the run stops after 5 skipped steps in a row -- without NaN.
    out = str(tmp_path / "run")
    before = copy.deepcopy(tiny.build_model(tiny.build_tokenizer(), seed=0).state_dict())
    assert train.main(SMALL + ["--filter", "topp", "--steps", "8", "--out", out, "--mi-every", "0"]) == 0
    rs = records(out)
    assert [r["step"] for r in rs] == [1, 2, 3, 4, 5]
    assert all(r["skipped"] and r["kept_ratio"] == 0 and r["zero_var_frac"] == 1 for r in rs)
    assert all(finite(r) for r in rs)
    assert "no group had any reward spread" in capsys.readouterr().out
    after = train.load_policy(train.Args(), torch.device("cpu"), os.path.join(out, "checkpoint"))[0].state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # no update ever happened


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    common = SMALL + ["--filter", "none", "--algo", "ppo", "--mi-every", "1", "--val-every", "0"]
    straight, broken = str(tmp_path / "straight"), str(tmp_path / "broken")
    assert train.main(common + ["--steps", "3", "--out", straight]) == 0
    assert train.main(common + ["--steps", "2", "--out", broken]) == 0      # "interrupted" after step 2
    assert train.main(["--resume", broken, "--steps", "3"]) == 0
    a, b = records(straight), records(broken)
    assert [r["step"] for r in b] == [1, 2, 3]
    # Everything sampled and every loss is identical. The cross-scores of the re-loaded model differ from those of
    # the model object that trained in memory in the last float32 bits (1e-6 of a summed log-likelihood; the
    # plain forward pass is bit-identical), so the MI metrics get a tolerance far below any meaningful change.
    for x, y in zip(a, b):
        assert set(x) - {"val_success"} == set(y) - {"val_success"}
        for k in x:
            if k.startswith("time_") or k == "val_success":
                continue
            if k.startswith(("mi_", "reasoning_entropy", "conditional_entropy")):
                assert x[k] == pytest.approx(y[k], rel=1e-3, abs=1e-6), k
            else:
                assert x[k] == y[k], k


def test_a_killed_step_is_run_again_not_logged_twice(tmp_path):
    out = str(tmp_path / "run")
    common = SMALL + ["--filter", "none", "--algo", "grpo", "--mi-every", "0"]
    assert train.main(common + ["--steps", "2", "--out", out]) == 0
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 3, "train_success": 0.0}) + "\n" + '{"step": 4, "trai')  # died mid-step 4
    assert train.main(["--resume", out, "--steps", "3"]) == 0
    assert [r["step"] for r in records(out)] == [1, 2, 3]
    assert "reward_mean" in records(out)[-1]               # step 3 is the re-run one, not the stale line


@pytest.mark.parametrize("argv, words", [
    (["--env", "chess"], "--env"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-p", "0"], "--top-p"),
    (["--steps", "-1"], "--steps"),
    (["--groups", "0"], "--groups"),
    (["--model", "./no/such/folder"], "no such folder"),
    (["--model", "no-such-org/no-such-model"], "cannot load"),
    (["--resume", "/no/such/run"], "--resume"),
    (["--env", "frozenlake", "--success-rate", "2"], "success_rate"),
])
def test_bad_arguments_print_one_line_and_exit_2(argv, words, capsys):
    assert train.main(["--steps", "1", "--no-warm-start", "--out", "/tmp/never-written"] + argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error:") and words in err


def test_bad_arguments_from_the_shell_give_no_traceback():
    proc = subprocess.run([sys.executable, "train.py", "--top-p", "7"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_evaluating_a_checkpoint_is_one_command(tmp_path):
    out, ev = str(tmp_path / "run"), str(tmp_path / "eval")
    assert train.main(SMALL + ["--filter", "none", "--algo", "grpo", "--steps", "1", "--out", out,
                               "--mi-every", "0"]) == 0
    ckpt = os.path.join(out, "checkpoint")
    assert train.main(["--env", "sokoban", "--model", ckpt, "--steps", "0", "--val-seeds", "2", "--max-turns", "2",
                       "--max-new-tokens", "8", "--out", ev]) == 0
    (r,) = records(ev)
    assert r["step"] == 0 and 0.0 <= r["val_success"] <= 1.0
    # the checkpoint's tokenizer is the tiny one, unchanged by saving and loading
    tok = train.load_policy(train.Args(), torch.device("cpu"), ckpt)[1]
    text = "<think> P at row 2 </think> <answer> Up || Left </answer>"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


# ----------------------------------------------------------------------------------- the filter drops whole groups

def scripted(tokenizer, seeds, group_size):
    """Group of seed 0: every rollout plays the solver; other groups: rollout k does when k is even, else it writes
    garbage. Roles are assigned at the first call, where play passes all episodes group by group."""
    end = rollout.end_of_turn_ids(tokenizer)[0]
    good = {}

    def policy(prompt_ids, env_list):
        if not good:
            good.update({id(env): seeds[i // group_size] == 0 or i % 2 == 0 for i, env in enumerate(env_list)})
        out = []
        for env in env_list:
            plan = envs.solve(env) or ["Up"]
            text = f" go </think> <answer> {' || '.join(plan[:2])} </answer>" if good[id(env)] else " ?? </think>"
            out.append(rollout.Generation(tokenizer.encode(text, add_special_tokens=False) + [end]))
        return out
    return policy


def test_update_on_kept_groups_equals_an_update_on_a_batch_without_the_dropped_ones():
    tok = tiny.build_tokenizer()
    for algo in ("ppo", "grpo"):
        a = train.Args(env="frozenlake", algo=algo, filter="topp", group_size=4, micro_batch=3, mini_batch_size=5,
                       lr=1e-3, critic_lr=1e-3, max_turns=2)
        results = []
        for seeds in ([3, 0, 5], [3, 5]):                 # with and without the zero-spread group (seed 0)
            torch.manual_seed(0)
            model = tiny.build_model(tok, seed=0)
            critic = train.ppo.make_critic(model) if algo == "ppo" else None
            opts = [torch.optim.AdamW(model.parameters(), lr=a.lr)]
            if critic is not None:
                opts.append(torch.optim.AdamW(critic.parameters(), lr=a.critic_lr))
            episodes = rollout.play(scripted(tok, seeds, a.group_size), tok, a.env, seeds, a.group_size,
                                     max_turns=a.max_turns)
            rewards = torch.tensor([e.total_reward for e in episodes]).view(len(seeds), a.group_size)
            keep, _ = train.select(a, rewards)
            assert keep.tolist() == [s != 0 for s in seeds]
            stats = train.learn(a, model, critic, opts, None, episodes, rewards, keep, rollout.pad_token_id(tok),
                                lambda: torch.autocast("cpu", enabled=False), torch.Generator().manual_seed(1),
                                torch.device("cpu"))
            results.append((stats, model.state_dict()))
        (s1, w1), (s2, w2) = results
        for k in ("pg_loss", "entropy_loss", "grad_norm", "token_entropy"):
            assert s1[k] == pytest.approx(s2[k], abs=1e-6), k
        assert all(torch.allclose(w1[k], w2[k], atol=1e-6) for k in w1)
        assert any(not torch.equal(w1[k], tiny.build_model(tok, seed=0).state_dict()[k]) for k in w1)  # it learned


def test_kl_reference_checkpointing_and_gradient_decomposition(tmp_path):
    out = str(tmp_path / "run")
    assert train.main(SMALL + ["--filter", "none", "--algo", "grpo", "--steps", "1", "--out", out, "--mi-every", "0",
                               "--kl-coef", "0.01", "--grad-checkpointing", "--grad-decomp-every", "1"]) == 0
    (r,) = records(out)
    assert r["kl_loss"] == pytest.approx(0.0, abs=1e-6)      # the first update starts at the reference policy
    buckets = r["grad_decomposition"]
    assert 1 <= len(buckets) <= 6 and sum(b["n_groups"] for b in buckets) == 2
    for b in buckets:
        assert b["task_grad_norm"] == 0.0                   # a random network: no group has reward spread
        assert b["entropy_grad_norm"] > 0 and math.isfinite(b["kl_grad_norm"])
