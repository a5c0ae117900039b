"""runs.py and checkpoints.py: flags, the run folder, checkpoints and resume. A run survives a kill at
every moment that matters and resumes exactly; bad input is one line and exit code 2, leaving nothing
behind; running out of memory is exit 3."""
import contextlib
import dataclasses
import errno
import json
import math
import os
import re
import shlex
import signal
import socket
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import logprobs
import ppo
import rollout
import train
from conftest import CLOCK, tiny_qwen2
from plumbing import checkpoints, defaults, flags, lora, memory, models, runs
from warmstart import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--model", "tiny", "--no-warm-start", "--groups", "2", "--group-size", "2", "--max-turns", "2",
         "--max-new-tokens", "8", "--val-seeds", "1", "--mi-samples", "4", "--no-plot", "--filter", "none",
         "--probe-prompts", "2", "--probe-samples", "2"]


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def same_metrics(a, b):
    """Two runs' metrics agree on everything but timings. The MI metrics of a re-loaded model, and
    the diagnosis' distance from the sampling log-probs, may differ in the last float32 bits of a
    summed log-likelihood (1e-6), far below any meaningful change."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert set(x) == set(y)
        for k in x:
            if k.startswith(CLOCK):
                continue
            if k.startswith(("mi_", "reasoning_entropy", "conditional_entropy", "probe_",
                             "diagnosis_")):
                assert x[k] == pytest.approx(y[k], rel=1e-3, abs=1e-6), k
            else:
                assert x[k] == y[k], k


def fails(argv, capsys, words, code=2, started=False):
    """The command exits with `code` and one error line; before training started (no progress bar
    yet) that line is all there is on stderr."""
    assert train.main(argv) == code
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]
    assert last.startswith("error:") and words in last and "Traceback" not in err, err
    assert started or len(err.splitlines()) == 1, err
    return last


# -------------------------------------------------------------------------------------------- flags

def help_lines(capsys, monkeypatch, columns):
    """train.py --help's lines on a terminal `columns` wide."""
    monkeypatch.setenv("COLUMNS", str(columns))  # what shutil.get_terminal_size reads first
    with pytest.raises(SystemExit):
        flags.build_parser(train.Args).parse_args(["--help"])
    return capsys.readouterr().out.splitlines()


def test_help_fits_the_terminal_it_is_read_on(capsys, monkeypatch):
    """Every line of --help fits the terminal's width, and every flag is in it, however narrow."""
    for columns in (50, 80, 200):
        lines = help_lines(capsys, monkeypatch, columns)
        assert lines and max(len(line) for line in lines) <= columns, columns
        flagged = {word for line in lines for word in line.split() if word.startswith("--")}
        assert {"--" + f.name.replace("_", "-") for f in dataclasses.fields(train.Args)} <= flagged


def test_help_is_one_line_per_flag_with_its_default(capsys, monkeypatch):
    lines = help_lines(capsys, monkeypatch, 160)  # wide enough: a line a flag
    options = lines[[i for i, line in enumerate(lines) if line.startswith("options")][0] + 1:]
    # no wrapped lines
    assert all(line.lstrip().startswith("-") for line in options)
    assert len(options) == len(dataclasses.fields(train.Args)) + 1  # every flag, and --help
    text = "\n".join(options)
    assert "environment: sokoban, frozenlake, bandit, countdown, wordproblems [sokoban]" in text and "[0.9]" in text and "[on]" in text
    shown = {line.split()[0]: line.rsplit("[", 1)[-1].rstrip("]") for line in options if line.endswith("]")}
    # numbers are numbers, even 0 and 1 (Python's 1 == True); on / off only for on/off flags
    assert (shown["--seed"], shown["--epochs"], shown["--success-rate"], shown["--kl-coef"]) == ("0", "1", "1.0", "0.0")
    assert (shown["--warm-start"], shown["--include-zero"]) == ("on", "off")


@pytest.mark.parametrize("argv, words", [
    (["--env", "chess"], "--env"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-p", "0"], "--top-p"),
    (["--steps", "-1"], "--steps"),
    (["--step", "3"], "--step"),  # no prefix matching: --step is not --steps
    (["--groups", "0"], "--groups"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2 ** 32)], "--seed"),
    (["--lr", "-1"], "--lr must be in (0, 0.1]"),
    (["--lr", "nan"], "finite"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--mi-samples", "0"], "--mi-samples"),
    (["--gamma", "5"], "--gamma"),
    (["--lam", "-3"], "--lam"),
    (["--gamma", "0.99"], "only 1 is supported"),  # rewards sit on the last token: no discount
    (["--clip-c", "0.5"], "--clip-c"),
    (["--model", "./no/such/folder"], "no such folder"),
    (["--model", "tinny"], "did you mean --model tiny"),
    (["--model", "no-such-org/no-such-model"], "not in the local Hugging Face cache"),
    (["--resume", "/no/such/run"], "--resume"),
    (["--env", "frozenlake", "--success-rate", "2"], "success_rate"),
    (["--mi-every", "-1"], "--mi-every must be >= 0"),
    (["--save-every", "-2"], "--save-every must be >= 0"),
    (["--template-prior", "1.5"], "--template-prior must be in [0, 1]"),
    (["--warm-start-seed", "-1"], "--warm-start-seed >= 0"),
    (["--kl-template-prior", "1"], "share a vocabulary"),  # the policy's prior is 0
    (["--template-prior", "0.1", "--kl-template-prior", "1", "--lora", "4"], "no --lora"),
    # what cannot run or cannot mean anything, each with its reason
    (["--steps", "99999999999999999999999"], "four months"),
    (["--groups", "100000000"], "in memory"),
    (["--val-seeds", "100000000"], "in memory"),
    (["--group-size", "5000"], "--group-size must be <= 1000"),
    (["--group-size", "1"], "zero reward spread: --filter topp has nothing to rank"),
    (["--group-size", "1", "--filter", "none", "--algo", "grpo"], "advantage is always 0"),
    (["--room-size", "70"], "--room-size sets it"),  # the first prompt alone does not fit
    (["--room-size", "60"], "context of 4096 tokens"),  # the first turn fits, five do not
    (["--env", "frozenlake", "--lake-size", "100"], "--lake-size sets it"),
    (["--max-new-tokens", "100000000"], "a reply cannot be longer than the model's context"),
    (["--max-new-tokens", "1000"], "more than the model's context"),
    # the diagnosis: bounded like a step, and never an MI that is 0 by construction
    (["--probe-samples", "100000"], "--probe-samples must be in 2..1000"),
    (["--probe-prompts", "2147483648"], "--probe-prompts x --probe-samples must be <= 65536"),
    (["--probe-prompts", "100000"], "--probe-prompts x --probe-samples must be <= 65536"),
    (["--probe-prompts", "4096", "--probe-samples", "16"], "would score 269,484,032 reasonings"),
    (["--mi-samples", "10000", "--groups", "4096"], "use fewer --mi-samples or --groups"),
    (["--probe-prompts", "1"], "--probe-prompts must be 0 (off) or >= 2, got 1"),
    (["--probe-samples", "1"], "--probe-samples must be in 2..1000, got 1"),
    (["--groups", "1"], "--groups 1: an MI over one prompt is 0 by construction"),
    # flags that would be ignored or clamped
    (["--filter", "topk", "--control-of", "topp"], "--control-of topp is ignored with --filter topk"),
    (["--filter", "topk", "--top-p", "0.5"], "--top-p 0.5 is ignored with --filter topk"),
    (["--filter", "none", "--include-zero"], "--include-zero is ignored with --filter none"),
    (["--env", "frozenlake", "--room-size", "3"], "--room-size 3 is ignored with --env frozenlake"),
    # the coordinates line is a real model's: the tiny policy reads its own line; a bandit has no grid
    (["--observation", "coords", "--model", "tiny"], "the tiny policy reads its own positions line"),
    (["--observation", "coords"], "the tiny policy (the default without a GPU) reads its own"),
    (["--observation", "coords", "--model", "smollm2", "--env", "bandit"], "--env bandit has no grid"),
    # past these a run hangs, diverges or only waits
    (["--epochs", "101"], "--epochs must be in 1..100"),
    (["--threads", str(10 * (os.cpu_count() or 1))], "the machine's cores"),
    (["--entropy-coef", "1e30"], "--entropy-coef must be in [0, 10]"),
    (["--kl-coef", "11"], "--kl-coef must be in [0, 10]"),
    (["--lr", "1"], "--lr must be in (0, 0.1]"),
    (["--temperature", "1e-30"], "use --temperature 0.001 or more"),
    (["--val-temperature", "1e-30"], "use --val-temperature 0.001 or more (or 0: greedy)"),
    (["--lora", "4", "--lora-targets", "nosuchlayer"], "no layer named nosuchlayer; its layers: down_proj"),
    (["--model", "smollm2", "--env", "frozenlake", "--lora", "4", "--lora-targets", "nosuch"],
     "no layer named nosuch; its layers: down_proj"),  # found when SmolLM2 loads, not by peft
    (["--env", "frozenlake", "--lake-size", "3000"], "--lake-size must be <= 128, got 3000 ("),
    (["--room-size", "100000"], "--room-size must be <= 128, got 100000 ("),
    # a number that is not finite, an empty name, a LoRA rank above every layer's: named
    (["--lr", "nan"], "--lr nan: a number must be finite"),
    (["--top-p", "inf"], "--top-p inf: a number must be finite"),
    (["--resume", ""], "--resume '': an empty name names nothing"),
    (["--out", ""], "--out '': an empty name names nothing"),
    (["--lora", "100000"], "--lora 100000: no layer it adapts has a rank above 64"),
    (["--lora", "65", "--lora-targets", "q_proj"], "use --lora 64 or less"),
    (["--optimizer-steps", "1000000"], "--optimizer-steps must be in 0..128"),
    # DAPO's own flags, and its objective without a KL term; the answer worlds' flags
    (["--algo", "dapo", "--kl-coef", "0.001"], "DAPO's objective has no KL term"),
    (["--algo", "dapo", "--max-draws", "0"], "--max-draws must be >= 1"),
    (["--max-draws", "4"], "--max-draws 4 is ignored with --algo ppo: it is --algo dapo's"),
    (["--algo", "grpo", "--overlong-buffer", "8"], "--overlong-buffer 8 is ignored with --algo grpo"),
    (["--algo", "dapo", "--max-new-tokens", "16", "--overlong-buffer", "16"],
     "--overlong-buffer must be >= 0 and below --max-new-tokens (16)"),
    (["--env", "countdown", "--countdown-numbers", "9"], "count must be an int in 2..6"),
    (["--env", "wordproblems", "--attempts", "0"], "attempts must be an int in 1..10"),
    (["--env", "sokoban", "--attempts", "2"], "--attempts 2 is ignored with --env sokoban"),
    (["--env", "countdown", "--template-prior", "0.5"], "the template pools are the action worlds'"),
])
def test_bad_arguments_print_one_line_exit_2_and_leave_nothing(tmp_path, argv, words, capsys, monkeypatch):
    out = tmp_path / "never"
    tried = []  # every network connection attempted: refused, and counted

    def refuse(*args, **kwargs):
        tried.append(args)
        raise OSError("no network in the tests")

    for owner, name in ((socket, "create_connection"), (socket, "getaddrinfo"), (socket.socket, "connect")):
        monkeypatch.setattr(owner, name, refuse)
    fails(["--steps", "1", "--no-warm-start", "--out", str(out)] + argv, capsys, words)
    assert not out.exists()  # a failed start leaves no folder behind
    assert tried == []  # refused without asking the network: nothing to wait for, no retries


def test_large_but_real_settings_are_kept(tmp_path):
    argv = ["--steps", "100000", "--groups", "512", "--group-size", "64", "--val-seeds", "4096", "--room-size",
            "20", "--max-new-tokens", "256", "--mi-every", "1000"]
    a = flags.parse_args(train.Args, argv + ["--model", "tiny", "--no-warm-start"])
    runs.resolve_defaults(a, torch.device("cpu"))
    runs.check_fits(a, *tiny.load_tiny(a.env, warm_start=False), rollout.prompts(a.env, tiny=True))
    # a group of one is plain PPO without a filter: it learns from the critic
    flags.parse_args(train.Args, ["--group-size", "1", "--filter", "none", "--algo", "ppo"])
    # one group without the diagnosis; a control with its count; one trajectory per optimiser step
    flags.parse_args(train.Args, ["--groups", "1", "--mi-every", "0"])
    flags.parse_args(train.Args, ["--filter", "random", "--control-of", "topp"])
    assert flags.parse_args(train.Args, ["--optimizer-steps", "128"]).optimizer_steps == 128
    assert flags.parse_args(train.Args, ["--probe-prompts", "0"]).probe_prompts == 0


def test_the_readmes_experiment_block_runs_as_written():
    """Each line of plumbing/README.md's "Running the experiment" block works after the lines above
    it: valid flags and settings, no globs or placeholders, every folder it reads made by an --out
    above."""
    text = open(os.path.join(ROOT, "plumbing", "README.md")).read()
    block = text.split("## Running the experiment", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    made = set()
    for line in block.splitlines():
        argv = shlex.split(line, comments=True)
        assert not any(c in arg for arg in argv for c in "*?[]<>"), line
        if argv[1:3] == ["-m", "plumbing.plots"]:
            assert set(argv[3:]) <= made, line
        if argv[1] != "train.py" or "--help" in argv:
            continue
        a = train.Args(**vars(flags.build_parser(train.Args).parse_args(argv[2:])))
        if a.resume:
            assert a.resume in made, line
            continue
        flags.check_args(a)
        if a.model not in (None, "tiny"):
            assert os.path.dirname(os.path.normpath(a.model)) in made, line
        if a.out:
            made.add(a.out)
    assert len(made) >= 2  # the runs it compares


def test_bad_arguments_from_the_shell_give_no_traceback():
    proc = subprocess.run([sys.executable, "train.py", "--top-p", "7"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_an_unusable_tiny_cache_is_one_line(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for cache in (a_file, a_file / "below"):
        out = tmp_path / "run"
        fails(["--model", "tiny", "--steps", "1", "--tiny-cache", str(cache), "--out", str(out)], capsys,
              "--tiny-cache")
        assert not out.exists()


def test_the_run_folder_is_made_only_once_the_models_are_loaded(tmp_path, monkeypatch):
    """A start killed (kill -9) while the models load or the warm start builds leaves no folder."""
    out, seen, load = tmp_path / "run", [], runs.load_run

    def watched(*args):
        seen.append(out.exists())
        return load(*args)

    monkeypatch.setattr(runs, "load_run", watched)
    assert train.main(SMALL + ["--steps", "1", "--out", str(out), "--mi-every", "0"]) == 0
    assert seen == [False] and (out / "config.json").exists()


def test_the_progress_bar_shows_no_nan(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert train.main(SMALL + ["--steps", "2", "--out", out, "--mi-every", "0", "--val-every", "0"]) == 0
    err = capsys.readouterr().err
    assert "success=" in err and "kept=" in err and "nan" not in err  # no diagnosis, no validation


def test_val_every_0_never_validates_and_n_validates_at_the_end(tmp_path):
    never, end = str(tmp_path / "never"), str(tmp_path / "end")
    assert train.main(SMALL + ["--steps", "2", "--out", never, "--mi-every", "0", "--val-every", "0"]) == 0
    assert [r["step"] for r in records(never)] == [1, 2]
    assert not any("val_success" in r for r in records(never))
    assert train.main(SMALL + ["--steps", "2", "--out", end, "--mi-every", "0", "--val-every", "3"]) == 0
    assert [r["step"] for r in records(end) if "val_success" in r] == [0, 2]  # before training, at the end


def test_the_log_is_strict_json_an_unmeasured_number_is_null(tmp_path, monkeypatch, capsys):
    stats = train.rollout_stats

    def with_nan(episodes, rewards):  # a number that could not be measured, at the top and deeper
        return {**stats(episodes, rewards), "reward_std": math.nan, "buckets": [{"norm": -math.inf}]}

    monkeypatch.setattr(train, "rollout_stats", with_nan)
    out = str(tmp_path / "run")
    assert train.main(SMALL + ["--steps", "1", "--out", out, "--mi-every", "0", "--val-every", "0"]) == 0

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    lines = open(os.path.join(out, "metrics.jsonl")).read().splitlines()
    (record,) = [json.loads(line, parse_constant=refuse) for line in lines]
    assert record["reward_std"] is None and record["buckets"] == [{"norm": None}]
    assert math.isfinite(record["train_success"])
    summary = capsys.readouterr().out.strip().splitlines()[-1]  # the closing summary line too
    json.loads(summary, parse_constant=refuse)


def readme_metrics_table():
    """{key: its row} of plumbing/README.md's "What is logged" table: every backquoted name in a
    row's first column."""
    text = open(os.path.join(ROOT, "plumbing", "README.md")).read().split("### What is logged", 1)[1]
    rows = [line for line in text.split("\n\n|", 1)[1].split("\n\n", 1)[0].splitlines()[2:]]
    return {key: row for row in rows for key in re.findall(r"`([a-z0-9_]+)`", row.split("|")[1])}


def test_every_logged_key_is_in_the_readmes_table_and_every_row_is_logged(tmp_path):
    """One step with every part of the loop on (validation, diagnosis, probe set, PPO with a KL
    term, the gradient decomposition) logs exactly the keys plumbing/README.md's table lists; only
    the GPU's memory is logged on a GPU alone."""
    documented = readme_metrics_table()
    assert {"step", "train_success", "mi_estimate", "val_success"} <= set(documented)
    out = str(tmp_path / "run")
    assert train.main(SMALL + ["--groups", "3", "--algo", "ppo", "--kl-coef", "0.001", "--mi-every", "1",
                               "--val-every", "1", "--grad-decomp-every", "1", "--steps", "1", "--out",
                               out]) == 0
    logged = {k for r in records(out) for k in r}
    assert logged and "pg_loss" in logged and "probe_action_mi" in logged  # an update and the probe ran
    assert sorted(logged - set(documented)) == []  # logged but not explained
    # explained but not logged here: the GPU's memory and captured step, what only bf16 runs log (the sampler's
    # agreement with a forward pass: in float32 the old log-probs are the sampler's; the gap its
    # replay in float32 finds), and what only a real model logs: the labels of its reasoning and
    # the reasonings themselves
    real = {f"{p}{k}_share" for p in ("", "probe_")
            for k in ("grounded", "flipped", "borrowed", "ungrounded")}
    real |= {k for k in documented if k.startswith("probe_work_")}  # reading coordinates only
    bf16 = {"rollout_logprob_diff", "sampling_precision_gap", "probe_sampling_precision_gap"}
    gpu = {"gpu_peak_gb", "capture_failures", "selfcheck_capture_diff"}  # a GPU's, or a failure's
    dapo = {"dynamic_draws", "dynamic_groups_drawn", "dynamic_groups_kept", "time_dynamic_sampling"}
    assert set(documented) - logged == {"probe_reasonings"} | gpu | bf16 | real | dapo


def test_unusable_out_folders(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    fails(SMALL + ["--steps", "1", "--out", str(a_file)], capsys, "cannot write there")
    fails(SMALL + ["--steps", "1", "--out", str(a_file / "run")], capsys, "cannot write there")
    out = str(tmp_path / "run")
    assert train.main(SMALL + ["--steps", "1", "--out", out, "--mi-every", "0"]) == 0
    capsys.readouterr()
    # never overwritten
    fails(SMALL + ["--steps", "1", "--out", out], capsys, "already holds a run")
    assert [r["step"] for r in records(out)] == [0, 1]
    with runs.lock_folder(out):  # another process is using it
        fails(["--resume", out, "--steps", "2"], capsys, "in use by another")


def test_a_read_only_place_is_called_so_not_a_missing_permission(tmp_path, capsys, monkeypatch):
    """--out on a read-only file system: the kernel's words for it (EROFS), since no permission
    would help there; a folder this process may not write to: EACCES. Both before anything loads
    (flags.check_out, which train.py's command line runs before torch). The file system is read-only
    as os.statvfs reports it, and the permission as os.access does (root may write anywhere)."""
    read_only, closed = str(tmp_path / "mounted"), str(tmp_path / "closed")
    os.mkdir(read_only)
    os.mkdir(closed)
    statvfs, access = os.statvfs, os.access

    class ReadOnly:
        f_flag = os.ST_RDONLY

    def under(path, folder):
        return os.path.abspath(path) == folder or os.path.abspath(path).startswith(folder + os.sep)

    monkeypatch.setattr(os, "statvfs", lambda p: ReadOnly() if under(p, read_only) else statvfs(p))
    monkeypatch.setattr(os, "access", lambda p, mode: not (under(p, read_only) or under(p, closed))
                        and access(p, mode))
    for out, said in ((os.path.join(read_only, "run"), f"(Read-only file system: {read_only})"),
                      (read_only, f"(Read-only file system: {read_only})"),
                      (os.path.join(closed, "a", "run"), f"(Permission denied: {closed})")):
        with pytest.raises(flags.UsageError, match=re.escape(f"--out {out}: cannot write there {said}")):
            flags.parse_command(flags.Args, ["--out", out])
        fails(SMALL + ["--steps", "1", "--out", out], capsys, f"cannot write there {said}")
    assert os.listdir(read_only) == [] and os.listdir(closed) == []


def test_a_non_empty_folder_that_holds_no_run_is_refused(tmp_path, capsys):
    """--out . in a source tree would put a run's files among the sources."""
    (tmp_path / "notes.txt").write_text("mine")
    fails(SMALL + ["--steps", "1", "--out", str(tmp_path)], capsys, "a folder with other files in it")
    assert os.listdir(tmp_path) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert train.main(SMALL + ["--steps", "1", "--out", str(empty), "--mi-every", "0"]) == 0


def test_a_diverged_run_stops_with_one_line_keeping_its_good_steps(tmp_path, capsys, monkeypatch):
    """The reported command (past today's --lr ceiling): the first distribution that cannot be
    sampled ends the run with one line naming its step and the likely cause; the steps before it
    are logged and the newest checkpoint is theirs."""
    monkeypatch.setattr(flags, "MAX_LR", 1e10)
    out = str(tmp_path / "run")
    last = fails(SMALL + ["--steps", "4", "--mi-every", "0", "--lr", "1e10", "--temperature", "1.5",
                          "--out", out], capsys, "the run diverged at step", started=True)
    assert "--lr (1e+10)" in last and "--temperature (1.5)" in last and "another --out" in last
    step = int(re.search(r"at step (\d+)", last).group(1))
    assert step >= 2 and [r["step"] for r in records(out)] == list(range(step))  # 0: validation
    assert runs.checkpoint_step(runs.recover_checkpoint(out)) == step - 1


def test_a_run_diverged_in_its_first_step_leaves_no_folder(tmp_path, capsys, monkeypatch):
    """A loss that is not finite stops the run before the update; no step was completed, so the
    folder goes, and the same command can run again."""
    policy_loss = train.ppo.policy_loss
    monkeypatch.setattr(train.ppo, "policy_loss", lambda *a, **k: (lambda loss, terms: (
        loss * math.nan, terms))(*policy_loss(*a, **k)))
    out = str(tmp_path / "run")
    argv = SMALL + ["--steps", "1", "--mi-every", "0", "--out", out]
    last = fails(argv, capsys, "the run diverged at step 1: the policy loss is not finite", started=True)
    assert "removed" in last and not os.path.exists(out)
    monkeypatch.setattr(train.ppo, "policy_loss", policy_loss)
    assert train.main(argv) == 0


@pytest.mark.parametrize("tracker", ["wandb", "trackio", "tensorboard"])
def test_a_tracker_that_is_not_installed_is_one_line(tmp_path, capsys, monkeypatch, tracker):
    find_spec = runs.importlib.util.find_spec
    monkeypatch.setattr(runs.importlib.util, "find_spec", lambda name, *a: None if name == tracker
                        else find_spec(name, *a))
    out = tmp_path / "run"
    fails(SMALL + ["--steps", "1", "--report-to", tracker, "--out", str(out)], capsys,
          f"pip install {tracker}")
    assert not out.exists()


@pytest.fixture
def no_wandb_account(monkeypatch, tmp_path):
    """wandb as on a machine where nobody logged in: no key in the environment or in ~/.netrc;
    its settings, which a process reads once, read afresh before and after the test."""
    wandb = pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # leaves pytest's capture of stdout alone
    wandb.teardown()
    yield wandb
    wandb.teardown()


def test_wandb_without_an_api_key_is_one_line_and_leaves_no_folder(tmp_path, capsys, no_wandb_account):
    """Refused by wandb before any network: one line saying how to log in or stay offline; the
    folder made for the run is gone, so the same command runs once that is done."""
    out = tmp_path / "run"
    argv = SMALL + ["--steps", "1", "--mi-every", "0", "--report-to", "wandb", "--out", str(out)]
    last = fails(argv, capsys, "--report-to wandb: wandb did not start (No API key")
    assert "WANDB_MODE=offline" in last and not out.exists()


def test_wandb_offline_gets_every_number_and_a_resumed_run_continues_its_run(tmp_path, monkeypatch,
                                                                             no_wandb_account):
    """WANDB_MODE=offline: every number of each log line at its step goes to wandb.log, into
    <out>/wandb; a resumed run continues the same wandb run (one id, the folder's)."""
    wandb = no_wandb_account
    monkeypatch.setenv("WANDB_MODE", "offline")
    sent, log = [], wandb.Run.log  # wandb.log is the run's, bound when the run starts
    monkeypatch.setattr(wandb.Run, "log", lambda run, data, step=None, **kw: sent.append((step, dict(data)))
                        or log(run, data, step=step, **kw))
    out = str(tmp_path / "run")
    argv = SMALL + ["--steps", "2", "--mi-every", "1", "--val-every", "2", "--report-to", "wandb"]
    assert train.main(argv + ["--out", out]) == 0
    assert train.main(["--resume", out, "--steps", "3"]) == 0
    expected = [(r["step"], {k: v for k, v in runs.scalars(r).items() if k != "step"}) for r in records(out)]
    assert [step for step, _ in sent] == [0, 1, 2, 3] and sent == expected
    folders = sorted(os.listdir(os.path.join(out, "wandb")))
    ids = {f.rsplit("-", 1)[1] for f in folders if f.startswith("offline-run-")}
    assert len([f for f in folders if f.startswith("offline-run-")]) == 2 and len(ids) == 1, folders


def test_trackio_gets_every_number_of_the_log_and_a_resumed_run_continues_it(tmp_path):
    """trackio, local: its stored values are the log's, steps 0-3 over a run and its resume. In a
    process of its own: trackio reads where it stores (TRACKIO_DIR) once, on import."""
    pytest.importorskip("trackio")
    out = str(tmp_path / "run")
    argv = SMALL + ["--steps", "2", "--mi-every", "1", "--val-every", "2", "--report-to", "trackio"]
    code = (f"import json, train, trackio; assert train.main({argv + ['--out', out]!r}) == 0; "
            f"assert train.main(['--resume', {out!r}, '--steps', '3']) == 0; "
            f"print(json.dumps(trackio.SQLiteStorage.get_logs('ragen2', run='run')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"),
                               "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    stored = json.loads(done.stdout.strip().splitlines()[-1])
    assert [s["step"] for s in stored] == [r["step"] for r in records(out)] == [0, 1, 2, 3]
    for s, r in zip(stored, records(out)):
        numbers = {k: v for k, v in runs.scalars(r).items() if k != "step"}
        assert {k: s[k] for k in numbers} == pytest.approx(numbers), r["step"]


def test_tensorboard_gets_every_number_of_the_log_at_its_step(tmp_path):
    """--report-to tensorboard: every numeric key of metrics.jsonl (nested dicts' keys joined
    with '/') at each step that logged it, read back with TensorBoard's own reader; a resumed run
    continues the same curves."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = str(tmp_path / "run")
    argv = SMALL + ["--steps", "2", "--mi-every", "1", "--val-every", "2", "--report-to", "tensorboard"]
    assert train.main(argv + ["--out", out]) == 0
    assert train.main(["--resume", out, "--steps", "3"]) == 0
    events = EventAccumulator(os.path.join(out, "tensorboard"))
    events.Reload()
    logged = {}
    for r in records(out):
        for k, v in runs.scalars(r).items():
            logged.setdefault(k, []).append((r["step"], v))
    assert "mi_estimate" in logged and "val_success" in logged and len(logged["train_success"]) == 3
    assert set(events.Tags()["scalars"]) == set(logged)
    for k, points in logged.items():
        assert [(e.step, e.value) for e in events.Scalars(k)] == [(s, pytest.approx(v)) for s, v in points], k


# ------------------------------------------------------------------------------------------- resume

def resume_and_check(monkeypatch, out, argv=()):
    """Resume `out` and check that it resumed: the log's lines up to its checkpoint are kept byte
    for byte (timings included: a run restarted from step 0 would write them anew) and only the
    steps after the checkpoint run (and are logged) in this process; without a checkpoint the run
    starts over, its step-0 validation included. -> the checkpoint's step"""
    ckpt = runs.recover_checkpoint(out)
    done = runs.checkpoint_step(ckpt) if ckpt else 0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        kept = [line for line in f if ckpt and checkpoints._step_of(line) <= done]
    logged, record = [], runs.record
    monkeypatch.setattr(runs, "record", lambda run, m: logged.append(m["step"]) or record(run, m))
    assert train.main(["--resume", out, *argv]) == 0
    monkeypatch.setattr(runs, "record", record)
    config = json.load(open(os.path.join(out, "config.json")))
    again = [0] if ckpt is None and config["val_every"] else []
    assert logged == again + list(range(done + 1, config["steps"] + 1))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert f.readlines()[:len(kept)] == kept
    return done


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path, monkeypatch):
    common = SMALL + ["--algo", "ppo", "--mi-every", "1", "--val-every", "2"]
    straight, broken = str(tmp_path / "straight"), str(tmp_path / "broken")
    assert train.main(common + ["--steps", "3", "--out", straight]) == 0
    assert train.main(common + ["--steps", "2", "--out", broken]) == 0  # "interrupted" after step 2
    assert resume_and_check(monkeypatch, broken, ["--steps", "3"]) == 2
    same_metrics(records(straight), records(broken))
    ran = json.load(open(os.path.join(broken, "provenance.json")))  # what ran it, each process
    assert [e["after_step"] for e in ran] == [0, 2] and ran[1]["argv"][0] == "--resume"
    assert ran[0]["weights_sha256"] == json.load(open(os.path.join(straight, "provenance.json")))[0][
        "weights_sha256"] != ran[1]["weights_sha256"]  # one warm start; trained weights on resume
    commit, _ = runs.code_commit()
    assert ran[0]["commit"] == commit and (commit is None or len(commit) == 40)


@pytest.mark.parametrize("with_copy", [True, False])
def test_the_log_is_cut_back_to_its_checkpoints_step_exactly(tmp_path, capsys, with_copy):
    """restore_metrics keeps every line up to the checkpoint's step, that step's included, and drops
    the later ones; a clean log is not called damaged, with the checkpoint's copy or without one (a
    checkpoint of an older version)."""
    lines = [json.dumps({"step": s, "loss": s / 10}) + "\n" for s in range(4)]
    log, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    log.write_text("".join(lines) + '{"step": 4, "lo')  # a kill's half-written line at the end
    ckpt.mkdir()
    (ckpt / "complete").write_text(json.dumps({"step": 2}))
    if with_copy:
        (ckpt / "metrics.jsonl").write_text("".join(lines[:3]))
    checkpoints.restore_metrics(str(log), str(ckpt))
    assert log.read_text() == "".join(lines[:3])
    assert "damaged" not in capsys.readouterr().out


def test_the_run_folder_shows_the_prompt_the_policy_reads(tmp_path):
    """prompt.txt: the turn-1 prompt as the tiny policy reads it (rollout.prompts' choice for it:
    its one-line system prompt, the grid and the line naming the way), up to the "<think>" it
    samples after -- the very token ids an episode of that layout starts from."""
    out = str(tmp_path / "run")
    assert train.main(SMALL + ["--env", "frozenlake", "--steps", "1", "--mi-every", "0",
                               "--out", out]) == 0
    text = open(os.path.join(out, "prompt.txt")).read()
    assert rollout.TINY_SYSTEM in text and "Goal: " in text and text.endswith("<think>")
    assert "Answer as" not in text  # the paper's system prompt is a real model's
    run_tokenizer = tiny.load_tiny("frozenlake", warm_start=False)[1]
    episode = rollout.play(lambda ids, worlds: [rollout.Generation([])] * len(ids), run_tokenizer,
                           "frozenlake", [defaults.VAL_SEED_BASE], 1, max_turns=2,
                           **rollout.prompts("frozenlake", tiny=True))[0]
    assert run_tokenizer.encode(text, add_special_tokens=False) == episode.first.prompt_ids


def test_resume_keeps_the_runs_settings_and_leaves_a_finished_run_alone(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert train.main(SMALL + ["--steps", "2", "--out", out, "--mi-every", "0"]) == 0
    capsys.readouterr()
    fails(["--resume", out, "--env", "bandit"], capsys, "--env bandit differs from the run's sokoban")
    fails(["--resume", out, "--seed", "3"], capsys, "--seed 3 differs")
    fails(["--resume", out, "--out", str(tmp_path / "elsewhere")], capsys, "stays in its folder")
    fails(["--resume", out, "--steps", "1"], capsys, "below the 2 steps")
    before = records(out)
    assert train.main(["--resume", out]) == 0  # finished: nothing run, nothing appended
    assert "is complete (2 of 2 steps)" in capsys.readouterr().out and records(out) == before
    assert json.load(open(os.path.join(out, "config.json")))["env"] == "sokoban"


def test_a_finished_run_with_an_emptied_log_gets_it_back(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert train.main(SMALL + ["--steps", "2", "--out", out, "--mi-every", "0"]) == 0
    before = records(out)
    open(os.path.join(out, "metrics.jsonl"), "w").close()
    capsys.readouterr()
    assert train.main(["--resume", out]) == 0
    said = capsys.readouterr().out
    assert "metrics.jsonl is damaged (2 steps are missing (1 to 2)): rewrote" in said
    assert "is complete (2 of 2 steps)" in said and records(out) == before


@pytest.mark.parametrize("damage, words", [
    (lambda d: open(os.path.join(d, "config.json"), "w").write("{not json"), "config.json is damaged"),
    (lambda d: open(os.path.join(d, "config.json"), "w").write("[1, 2]"), "not a run's config"),
    (lambda d: json.dump({**json.load(open(os.path.join(d, "config.json"))), "groups": "two"},
                         open(os.path.join(d, "config.json.x"), "w")) or os.replace(
        os.path.join(d, "config.json.x"), os.path.join(d, "config.json")), "not a int"),
    (lambda d: open(os.path.join(d, "checkpoint", "trainer_state.pt"), "r+b").truncate(100), "damaged"),
    (lambda d: open(os.path.join(d, "checkpoint", "model.safetensors"), "r+b").truncate(100), "cannot load"),
    (lambda d: open(os.path.join(d, "checkpoint", "trainer_state.pt"), "wb").write(os.urandom(4096)), "damaged"),
    (lambda d: open(os.path.join(d, "checkpoint", "policy.json"), "w").write("garbage"), "policy.json is damaged"),
    # a folder it cannot write (a read-only disk; here a folder where its lock file goes)
    (lambda d: os.remove(os.path.join(d, ".lock")) or os.mkdir(os.path.join(d, ".lock")),
     "cannot write its lock file"),
    (lambda d: open(os.path.join(d, "checkpoint", "policy.json"), "w").write("[]"), "policy.json is damaged"),
    (lambda d: json.dump({**json.load(open(os.path.join(d, "config.json"))), "loss_type": "dapo"},
                         open(os.path.join(d, "config.json.x"), "w")) or os.replace(
        os.path.join(d, "config.json.x"), os.path.join(d, "config.json")),
     "config.json has 'loss_type', which is no setting of train.py"),
])
def test_a_damaged_run_folder_is_one_line(tmp_path, capsys, damage, words):
    out = str(tmp_path / "run")
    assert train.main(SMALL + ["--steps", "1", "--out", out, "--mi-every", "0"]) == 0
    capsys.readouterr()
    damage(out)
    fails(["--resume", out, "--steps", "2"], capsys, words)
    assert os.path.isdir(out)  # a resumed run's folder is never removed


def garbage_line_2(path):
    lines = open(path).readlines()
    lines[1] = "garbage\n"
    open(path, "w").writelines(lines)


def garbage_inserted(path):
    lines = open(path).readlines()
    open(path, "w").writelines(lines[:1] + ["garbage\n"] + lines[1:])


@pytest.mark.parametrize("damage, words", [
    (garbage_line_2, "line 2 is not a metrics record; step 1 is missing"),
    (garbage_inserted, "line 2 is not a metrics record)"),  # the rest equals the copy
    (lambda path: open(path, "r+").truncate(len(open(path).readline()) + 10),  # cut in step 1's line
     "2 steps are missing (1 to 2)"),
    (os.remove, "2 steps are missing (1 to 2)"),
])
def test_a_damaged_log_is_repaired_from_the_checkpoint_saying_so(tmp_path, capsys, damage, words):
    out = str(tmp_path / "run")
    assert train.main(SMALL + ["--steps", "2", "--out", out, "--mi-every", "1"]) == 0
    before = open(os.path.join(out, "metrics.jsonl")).readlines()
    capsys.readouterr()
    damage(os.path.join(out, "metrics.jsonl"))
    assert train.main(["--resume", out, "--steps", "3"]) == 0
    said = capsys.readouterr().out
    assert "metrics.jsonl is damaged (" + words in said and "from the checkpoint's copy" in said
    after = open(os.path.join(out, "metrics.jsonl")).readlines()
    assert after[:3] == before and [r["step"] for r in records(out)] == [0, 1, 2, 3]  # no hole


def test_a_run_without_checkpoints_is_complete_or_refused_never_run_again(tmp_path, capsys):
    """--save-every 0 keeps no weights to continue from: extending the run is refused, and its
    log stays as it is. Without a checkpoint's copy of the log, a line that is no record is
    removed saying so while every step is still there once; a record damaged is refused."""
    out = str(tmp_path / "run")
    log = os.path.join(out, "metrics.jsonl")
    assert train.main(SMALL + ["--steps", "2", "--out", out, "--mi-every", "0", "--save-every", "0"]) == 0
    before = open(log).read()
    capsys.readouterr()
    fails(["--resume", out, "--steps", "5"], capsys, "its 2 steps ran with --save-every 0")
    assert train.main(["--resume", out]) == 0
    assert "is complete (2 of 2 steps)" in capsys.readouterr().out
    assert open(log).read() == before
    garbage_inserted(log)
    assert train.main(["--resume", out]) == 0
    said = capsys.readouterr().out
    assert "metrics.jsonl is damaged (line 2 is not a metrics record): removed" in said, said
    assert "is complete (2 of 2 steps)" in said and open(log).read() == before
    garbage_line_2(log)  # step 1's record itself: nothing holds it
    damaged = open(log).read()
    fails(["--resume", out], capsys, "line 2 is not a metrics record; step 1 is missing) and no checkpoint "
          "holds a copy of it (--save-every 0)")
    assert open(log).read() == damaged


def test_a_line_that_is_no_record_at_the_end_of_a_finished_runs_log_is_removed_saying_so(
        tmp_path, capsys):
    out = str(tmp_path / "run")
    log = os.path.join(out, "metrics.jsonl")
    assert train.main(SMALL + ["--steps", "2", "--out", out, "--mi-every", "0"]) == 0
    before = open(log).read()
    open(log, "a").write("garbage\n")
    capsys.readouterr()
    assert train.main(["--resume", out]) == 0
    said = capsys.readouterr().out
    assert "metrics.jsonl: removed line 4, which is not a metrics record" in said, said
    assert open(log).read() == before


def test_a_run_without_checkpoints_whose_only_record_is_cut_is_refused(tmp_path, capsys):
    """--save-every 0, one step: its one record cut in half (a kill mid-write, a disk) is a damaged
    log that nothing holds a copy of: refused in one line, the log left as it is (it once started
    the run again from step 0, silently)."""
    out = str(tmp_path / "run")
    log = os.path.join(out, "metrics.jsonl")
    assert train.main(SMALL + ["--steps", "1", "--out", out, "--mi-every", "0", "--save-every", "0",
                               "--val-every", "0"]) == 0
    open(log, "r+").truncate(os.path.getsize(log) // 2)
    cut = open(log).read()
    capsys.readouterr()
    fails(["--resume", out], capsys, "no line of it is a metrics record) and no checkpoint holds a copy")
    assert open(log).read() == cut


def test_a_damaged_log_without_a_copy_is_refused(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert train.main(SMALL + ["--steps", "2", "--out", out, "--mi-every", "0"]) == 0
    capsys.readouterr()
    os.remove(os.path.join(out, "checkpoint", "metrics.jsonl"))  # as an older checkpoint
    garbage_line_2(os.path.join(out, "metrics.jsonl"))
    fails(["--resume", out, "--steps", "3"], capsys, "line 2 is not a metrics record; step 1 is missing) and "
          "the checkpoint holds no copy")


class Killed(BaseException):
    """Stands for kill -9: nothing after the moment it is raised runs (no except clause catches a
    BaseException that is not KeyboardInterrupt, and what `finally` blocks do is only closing files,
    which a kill also does)."""


def test_a_kill_at_every_file_operation_then_resume_is_exact(tmp_path, monkeypatch):
    """Every rename of a 3-step run -- the config, the first checkpoint, each rotation (checkpoint
    -> .old, .tmp -> checkpoint) -- is a moment a kill can hit. Kill at each, resume, and the
    metrics equal the uninterrupted run's: nothing lost, nothing logged twice, never a crash on the
    leftovers."""
    common = SMALL + ["--algo", "grpo", "--mi-every", "1", "--val-every", "2", "--steps", "3"]
    straight = str(tmp_path / "straight")
    assert train.main(common + ["--out", straight]) == 0
    replace = os.replace
    kill_at = 1
    while True:
        calls = [0]

        def dying_replace(src, dst):
            calls[0] += 1
            if calls[0] == kill_at:
                raise Killed
            return replace(src, dst)

        out = str(tmp_path / f"kill{kill_at}")
        monkeypatch.setattr(runs.os, "replace", dying_replace)
        try:
            finished = train.main(common + ["--out", out]) == 0
        except Killed:
            finished = False
        monkeypatch.setattr(runs.os, "replace", replace)
        if finished:
            break  # kill_at is past the run's last rename: every moment was covered
        if os.path.isfile(os.path.join(out, "config.json")):
            resume_and_check(monkeypatch, out)
        # killed while starting: there is no run yet (in this simulation start() removes its folder)
        else:
            assert train.main(common + ["--out", out]) == 0
        same_metrics(records(straight), records(out))
        assert sorted(os.listdir(out)) == [".lock", "checkpoint", "config.json", "metrics.jsonl",
                                        "prompt.txt", "provenance.json"]
        kill_at += 1
    assert kill_at >= 8  # config + 3 saves of 1-3 renames each


def test_recovery_picks_the_newest_complete_checkpoint(tmp_path):
    """Every state a kill can leave between the renames of save_checkpoint, and what a start finds."""
    def state(**folders):  # name -> the step its "complete" file holds, or None: written, incomplete
        out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        for name, step in folders.items():
            os.makedirs(out / name)
            if step is not None:
                (out / name / "complete").write_text(json.dumps({"step": step}))
        return str(out)

    cases = [({"checkpoint": 3}, 3),  # no kill
             ({"checkpoint": 3, "checkpoint_old": 2}, 3),  # after the swap, before removing .old
             ({"checkpoint_old": 2, "checkpoint_tmp": 3}, 3),  # between the two renames
             ({"checkpoint": 2, "checkpoint_tmp": None}, 2),  # while writing .tmp
             ({"checkpoint_old": 2, "checkpoint_tmp": None}, 2),
             ({"checkpoint_tmp": None}, None)]  # during the first save: no checkpoint yet
    for folders, step in cases:
        out = state(**{k.replace("_", "."): v for k, v in folders.items()})
        found = runs.recover_checkpoint(out)
        assert (runs.checkpoint_step(found) if found else None) == step, folders
        assert sorted(os.listdir(out)) == (["checkpoint"] if step else sorted(
            k.replace("_", ".") for k in folders)), folders  # leftovers gone once a checkpoint exists


def test_kill_9_of_a_real_run_then_resume_is_exact(tmp_path, monkeypatch):
    # --threads: the killed run is another process, which the test's one-thread default misses
    common = SMALL + ["--algo", "ppo", "--mi-every", "2", "--val-every", "0", "--steps", "6", "--threads", "1"]
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    metrics = os.path.join(killed, "metrics.jsonl")
    while True:
        proc = subprocess.Popen([sys.executable, "train.py"] + common + ["--out", killed], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
        while proc.poll() is None:  # kill it once it has logged 2 of its 6 steps
            if os.path.isfile(metrics) and len(open(metrics).read().splitlines()) >= 2:
                break
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        code = proc.wait()
        if code == -signal.SIGKILL:  # killed, not finished on its own
            break
        # a busy machine let it finish its 6 steps before the kill: nothing killed, run it again
        assert code == 0, f"the run failed on its own (exit code {code})"
        shutil.rmtree(killed)
    assert len(records(killed)) < 6
    assert train.main(common + ["--out", straight]) == 0
    assert resume_and_check(monkeypatch, killed) >= 1  # step 1's checkpoint was written before step 2's line
    same_metrics(records(straight), records(killed))


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "run")
    save = torch.save

    def full_at_step_2(obj, path, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("step") == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(obj, path, *args, **kwargs)

    monkeypatch.setattr(runs.torch, "save", full_at_step_2)
    fails(SMALL + ["--steps", "3", "--out", out, "--mi-every", "0"], capsys, "no space left on the device",
          started=True)
    assert runs.checkpoint_step(runs.recover_checkpoint(out)) == 1 and not os.path.exists(out + "/checkpoint.tmp")
    monkeypatch.setattr(runs.torch, "save", save)
    assert train.main(["--resume", out]) == 0 and [r["step"] for r in records(out)] == [0, 1, 2, 3]


def test_out_of_memory_is_one_line_naming_the_phase(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "run")
    update = train.update_policy

    # named like the phase it stands for: the message names the phase
    def update_policy(run, *args):
        if run.step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.8 GiB")
        return update(run, *args)

    monkeypatch.setattr(train, "update_policy", update_policy)
    fails(SMALL + ["--steps", "3", "--out", out, "--mi-every", "0"], capsys, "out of GPU memory during the update",
          code=3, started=True)
    assert runs.checkpoint_step(runs.recover_checkpoint(out)) == 1  # the last checkpoint is intact


# ---------------------------------------------------------------------------------- the same result

def test_the_same_result_whether_the_warm_start_was_built_or_loaded(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny, "WARM_START_STEPS", 4)
    built, loaded, build, load = [], [], tiny._build, tiny._load_cached

    def counted_build(*args):
        built.append(args[0])
        return build(*args)

    def counted_load(folder):
        model, problem = load(folder)
        loaded.append(model is not None)  # False: nothing cached there (yet)
        return model, problem

    monkeypatch.setattr(tiny, "_build", counted_build)
    monkeypatch.setattr(tiny, "_load_cached", counted_load)
    common = ["--model", "tiny", "--env", "bandit", "--groups", "2", "--group-size", "4", "--val-seeds", "2",
              "--mi-samples", "4", "--no-plot", "--steps", "2", "--tiny-cache", str(tmp_path / "cache")]
    # builds the warm start in-process
    assert train.main(common + ["--out", str(tmp_path / "built")]) == 0
    assert len(built) == 1 and loaded and not any(loaded)  # looked for (again under the lock)
    looked = len(loaded)
    assert train.main(common + ["--out", str(tmp_path / "loaded")]) == 0  # loads it
    assert len(built) == 1 and loaded[looked:] == [True]  # read from the cache, not built again
    a, b = records(tmp_path / "built"), records(tmp_path / "loaded")
    assert [{k: v for k, v in r.items() if not k.startswith(CLOCK)} for r in a] == [
        {k: v for k, v in r.items() if not k.startswith(CLOCK)} for r in b]  # to the last bit


def test_evaluating_a_checkpoint_is_one_command(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = "topp"
    assert train.main(SMALL + ["--algo", "grpo", "--steps", "1", "--out", out, "--mi-every", "0"]) == 0
    ckpt = os.path.join(out, "checkpoint")
    assert train.main(["--env", "sokoban", "--model", ckpt + "/", "--steps", "0", "--val-seeds", "2", "--max-turns",
                       "2", "--max-new-tokens", "8"]) == 0
    assert "2 held-out seeds, one rollout each, temperature 0.5" in capsys.readouterr().out
    (ev,) = os.listdir("runs")
    assert ev.startswith("eval-sokoban-topp-")  # named after the run evaluated
    ev = os.path.join("runs", ev)
    (r,) = records(ev)
    assert r["step"] == 0 and 0.0 <= r["val_success"] <= 1.0
    tok = models.load_policy(train.Args(), ckpt, torch.device("cpu"), {})[1]  # the tiny tokenizer
    text = "<think> P at row 2 </think> <answer> Up || Left </answer>"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_a_hub_model_comes_from_the_cache_or_as_huggingface_hub_fetches_it(monkeypatch, capsys):
    """A hub id: from the local cache without asking the network; otherwise from where
    huggingface_hub would fetch it (HF_ENDPOINT for a mirror, through the proxy the environment
    names: a direct socket to huggingface.co once refused every user behind a proxy); a hub that
    cannot be reached is one line at once, naming HF_HUB_OFFLINE, before huggingface_hub retries
    for a minute; a model it cannot give is one line. The loader is a stand-in that records how it
    was asked, the network a stand-in that takes connections to the proxy only."""
    from huggingface_hub import constants
    asked, cached = [], {"org/cached"}
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                 "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")

    class Connection:
        def close(self):
            pass

    def connect(address, timeout=None):
        if address != ("proxy.example", 3128):
            raise OSError(f"no route to {address[0]}: only a proxy")
        return Connection()

    def load(source, attn, local_files_only=False):
        asked.append((source, local_files_only))
        if source in cached or (not local_files_only and source == "org/mirrored"):
            return "model", "tokenizer"
        raise OSError("not there")

    monkeypatch.setattr(models, "load_hf_files", load)
    monkeypatch.setattr(socket, "create_connection", connect)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://mirror.example")
    assert models.load_hf("org/cached") == ("model", "tokenizer") and asked == [("org/cached", True)]
    assert models.load_hf("org/mirrored") == ("model", "tokenizer")
    assert asked[1:] == [("org/mirrored", True), ("org/mirrored", False)]
    assert "fetching it from https://mirror.example" in capsys.readouterr().out
    with pytest.raises(models.ModelError, match="the hub did not give it \\(not there\\)"):
        models.load_hf("org/nowhere")
    monkeypatch.delenv("HTTPS_PROXY")  # no proxy: the mirror itself takes no connection
    with pytest.raises(models.ModelError, match="cannot be reached \\(no route to mirror.example"
                                                ": only a proxy\\); HF_HUB_OFFLINE=1"):
        models.load_hf("org/unreached")
    assert asked[-1] == ("org/unreached", True)  # the cache asked, the hub not
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(models.ModelError, match="not in the local Hugging Face cache, and HF_HUB_OFFLINE"):
        models.load_hf("org/nowhere")
    assert asked[-1] == ("org/nowhere", True)  # offline: the cache only


# --------------------------------------------------------------------------------------- GPU memory

# Qwen2.5's published shapes: hidden, intermediate, layers, heads, key/value heads; parameters
QWEN = {"0.5b": (896, 4864, 24, 14, 2, 494_032_768), "1.5b": (1536, 8960, 28, 12, 2, 1_543_714_304),
        "3b": (2048, 11008, 36, 16, 2, 3_085_938_688)}


def qwen_config(size):
    from transformers import Qwen2Config
    h, i, layers, heads, kv, n = QWEN[size]
    return Qwen2Config(hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, vocab_size=151_936), n


def test_memory_plan_fits_the_budget_and_prefers_no_checkpointing():
    qwen05, n = qwen_config("0.5b")
    a = train.Args(max_new_tokens=400)
    mb24, ckpt24, roll24, longest = memory.memory_plan(a, qwen05, n, n, 24 * 2 ** 30)
    mb80, ckpt80, roll80, _ = memory.memory_plan(a, qwen05, n, n, 80 * 2 ** 30)
    assert longest == 400 + 5 * 700 and ckpt24 and mb24 >= 1  # 24 GB: checkpointing needed
    assert not ckpt80 and mb80 >= 4  # 80 GB: no checkpointing, 4 sequences at least fit without it
    assert 16 <= roll24 < 128 and roll24 <= roll80 <= 128 and roll24 % 16 == 0  # whole groups of 16
    adapters = dataclasses.replace(a, lora=16)
    mb_lora, ckpt_lora, roll_lora, _ = memory.memory_plan(adapters, qwen05, n, 4_000_000,
                                                          24 * 2 ** 30)
    # adapters: more room
    assert (not ckpt_lora, mb_lora) >= (not ckpt24, mb24) and roll_lora >= roll24
    given = dataclasses.replace(a, micro_batch=3, grad_checkpointing=False, rollout_batch=32)
    # the user's choice stays
    assert memory.memory_plan(given, qwen05, n, n, 24 * 2 ** 30)[:3] == (3, False, 32)


def test_the_memory_plan_counts_what_the_update_and_the_sampler_hold():
    """The counts the plan divides by, on Qwen2.5-0.5B's shapes at 400 tokens a turn: a layer keeps
    32h + 8i bytes a token for the backward pass; an episode in the sampler holds its key/value
    cache in the sampling dtype (twice the bytes in float32) plus one layer more while rows move,
    a prefill's mask (G x its widest new piece x longest, as bools and as a bias in the sampling
    dtype) and 24 bytes of sampling tables a vocabulary entry (52 with top-p); the sampler's weights take 2
    bytes each in bfloat16, 4 in float32. The rollout batch the plan picks is the whole groups
    that fit what is left."""
    cfg, n = qwen_config("0.5b")
    a = train.Args(max_new_tokens=400, dtype="bfloat16", sample_dtype="bfloat16")
    longest = 400 + 5 * 700
    h, i, layers = 896, 4864, 24
    assert memory.update_bytes(cfg, longest)[False] == layers * longest * (32 * h + 8 * i)
    slots = (longest + 256) * 2 * 2 * 64
    mask, tables = 7 * 700 * longest, 24 * 151_936
    assert memory.rollout_bytes(a, cfg, n, longest) == (2 * n, slots * 2 * 25 + 3 * mask + tables)
    f32 = dataclasses.replace(a, sample_dtype="float32", sample_top_p=0.9)
    assert memory.rollout_bytes(f32, cfg, n, longest) == (
        4 * n, slots * 4 * 25 + 5 * mask + 52 * 151_936)
    total = 80 * 2 ** 30
    free = 0.85 * total - memory.resident_bytes(a, n, n)
    copies, per_episode = memory.rollout_bytes(a, cfg, n, longest)
    at_once = memory.memory_plan(a, cfg, n, n, total)[2]
    assert at_once == min(128, int((free - copies) // per_episode)) // 16 * 16


@pytest.mark.parametrize("size, algo, rank, gib, fits", [
    ("0.5b", "ppo", 0, 24, True), ("0.5b", "grpo", 0, 24, True), ("1.5b", "ppo", 0, 80, True),
    ("3b", "ppo", 16, 80, True), ("3b", "ppo", 16, 24, False), ("3b", "grpo", 0, 80, True),
    ("3b", "ppo", 0, 80, False), ("1.5b", "ppo", 0, 24, False), ("3b", "grpo", 0, 24, False)])
def test_what_cannot_fit_the_gpu_is_refused_naming_what_would(size, algo, rank, gib, fits):
    """The memory plan with Qwen2.5's published shapes at the main command's 400 tokens a turn:
    3B PPO without LoRA needs about 99 GB resident (fp32 weights of actor and critic, their
    gradients and AdamW moments), more than 80 GB: one line (a UsageError: exit 2 before the critic
    is made or a rollout starts) that names what fits; 0.5B PPO and 3B LoRA on 80 GB are accepted.
    On 24 GB 3B fits in no way: beside LoRA's 12 GiB resident, the sampler's bfloat16 weights (5.7
    GiB) and a group's 16 caches at 3,900 tokens (3.4 GiB) do not fit."""
    cfg, n = qwen_config(size)
    a = train.Args(algo=algo, lora=rank, max_new_tokens=400)
    trained = memory.lora_count(cfg, rank) if rank else n
    if fits:
        micro, _, rollout_batch, _ = memory.memory_plan(a, cfg, n, trained, gib * 2 ** 30)
        assert micro >= 1 and rollout_batch >= a.group_size
    else:
        with pytest.raises(flags.UsageError) as e:
            memory.memory_plan(a, cfg, n, trained, gib * 2 ** 30)
        said = str(e.value)
        named = "a smaller model" if (size, gib) == ("3b", 24) else "what fits: --lora 16"
        assert "\n" not in said and f"{gib} GiB" in said and named in said, said
    if (size, algo, rank) == ("3b", "ppo", 0):
        assert memory.resident_bytes(a, n, n) / 1e9 == pytest.approx(98.7, abs=0.1)


def test_a_large_checkpoint_on_a_gpu_is_written_every_ten_steps(capsys):
    """--save-every, not given: every step on a CPU and for LoRA's adapters; on a GPU, 0.5B PPO's
    policy and critic (12 bytes a trained parameter: about 12 GB) every 10 steps, saying what a
    kill loses."""
    n = QWEN["0.5b"][-1]
    assert checkpoints.checkpoint_every(torch.device("cpu"), 2 * n) == 1
    adapters = 2 * memory.lora_count(qwen_config("3b")[0], 16)
    assert checkpoints.checkpoint_every(torch.device("cuda"), adapters) == 1
    assert checkpoints.checkpoint_every(torch.device("cuda"), 2 * n) == 10
    assert "(11.9 GB each; a kill loses at most 9 steps" in capsys.readouterr().out


def test_lora_adapters_get_the_same_gradients_under_activation_checkpointing():
    """The memory plan turns activation checkpointing on: LoRA's adapters must still receive
    their gradients (reentrant checkpointing with frozen inputs once gave them none in peft's
    users' runs), and the same as without it."""
    a = train.Args(lora=4, algo="grpo", lora_alpha=8.0)
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    grads = []
    for checkpointing in (False, True):
        model = lora.add_lora(tiny_qwen2(40, seed=1), a)
        if checkpointing:
            models.enable_checkpointing(model)
        model.train()
        logp, _ = logprobs.policy_logprobs(model, ids, torch.ones(2, 11))
        logp.sum().backward()
        grads.append({k: p.grad for k, p in model.named_parameters() if p.requires_grad})
    assert grads[0] and all(g is not None for g in grads[1].values())
    assert all(g.abs().max() > 0 for k, g in grads[1].items() if "lora_B" in k)  # (A's: 0 at B = 0)
    for k, g in grads[0].items():
        torch.testing.assert_close(grads[1][k], g, rtol=1e-5, atol=1e-7)


def checkpointing_used(model):
    """How the layers of `model` recompute: {use_reentrant} of their checkpoint function."""
    import functools
    return {getattr(m._gradient_checkpointing_func, "keywords", {}).get("use_reentrant")
            for m in model.modules() if getattr(m, "gradient_checkpointing", False)
            and isinstance(getattr(m, "_gradient_checkpointing_func", None), functools.partial)}


@pytest.mark.parametrize("rank", [4, 0])
def test_every_trainable_gradient_is_the_same_with_and_without_checkpointing(rank):
    """PPO's update, policy and critic, with LoRA (rank 4: the critic is the policy's base seen
    through its "critic" adapter) and with full fine-tuning (rank 0: the critic its own copy):
    every trainable gradient, both adapters' and the value head's among them, is the same with
    activation checkpointing as without. Under checkpointing the critic's backward recomputes its
    layers, so it must run inside the critic's adapter (lora.critic_scope): outside it, the
    recompute ran the policy's adapter and the critic's gradients were off by 100%, with no sign.
    Both adapters' B matrices and the value head are made non-zero first, so that each term has a
    gradient that the other adapter's recompute would change."""
    a = train.Args(lora=rank, algo="ppo", lora_alpha=8.0, value_clip=0.5)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40, (2, 12), generator=g)
    mask = torch.ones(2, 11)
    mb = dict(input_ids=ids, mask=mask, old_values=torch.randn(2, 11, generator=g),
              returns=torch.randn(2, 11, generator=g), token_weight=1.0)
    grads = []
    for checkpointing in (False, True):
        policy = tiny_qwen2(40, seed=1)
        if rank:
            policy = lora.add_lora(policy, a)
            with torch.no_grad():
                for name, p in policy.named_parameters():
                    if "lora_B" in name:
                        p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(
                            len(name) + (7 if ".critic." in name else 0))))
        if checkpointing:
            models.enable_checkpointing(policy)
            assert checkpointing_used(policy) == {False}  # non-reentrant, said explicitly
        critic = lora.make_lora_critic(policy) if rank else ppo.make_critic(policy)
        with torch.no_grad():
            critic.head.weight.normal_(generator=torch.Generator().manual_seed(2))
        run = SimpleNamespace(policy=policy, critic=critic, args=a, ctx=contextlib.nullcontext())
        policy.train(), critic.train()
        logp, _ = logprobs.policy_logprobs(policy, ids, mask)
        logp.sum().backward()
        train.critic_loss(run, mb)
        trained = list(policy.named_parameters()) + [("critic." + k, p) for k, p in
                                                     critic.named_parameters()]
        grads.append({k: p.grad.clone() for k, p in trained if p.requires_grad})
    assert grads[0] and grads[0].keys() == grads[1].keys()
    assert any(".critic." in k for k in grads[0]) == bool(rank)
    for k, grad in grads[0].items():
        assert grad.abs().max() > 0, k
        torch.testing.assert_close(grads[1][k], grad, rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("lora_flags", [[], ["--lora", "4"]])
def test_a_run_with_every_part_switched_on_warns_of_nothing(tmp_path, lora_flags):
    """No library warning reaches a run's output unless it concerns the user: with the diagnosis,
    the probe set, activation checkpointing, PPO's critic and LoRA, every warning is recorded and
    none comes (transformers' deprecation of is_gradient_checkpointing once printed into every
    progress bar, and a log file left open warned at exit)."""
    import warnings
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert train.main(SMALL + lora_flags + ["--env", "frozenlake", "--steps", "1",
                                                "--mi-every", "1", "--probe-prompts", "2",
                                                "--probe-samples", "2", "--grad-checkpointing",
                                                "--out", str(tmp_path / "run")]) == 0
    assert [(w.category.__name__, str(w.message)) for w in seen] == []


# ------------------------------------------------------------------- a user's own model folder

def own_model_folder(tmp_path, kind):
    """A tiny random model of `kind` saved with save_pretrained beside a chat tokenizer, as a
    user's own checkpoint is: GPT-2 (another architecture) or Llama (the decode loop's layout)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from test_rollout import make_tokenizer

    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2,
                                           eos_token_id=tokenizer.eos_token_id,
                                           bos_token_id=tokenizer.eos_token_id))
    elif kind == "gemma2":  # soft-capped logits, as large as a trained model's (tens)
        from transformers import Gemma2Config, Gemma2ForCausalLM
        model = Gemma2ForCausalLM(Gemma2Config(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, final_logit_softcapping=30.0,
            pad_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id))
        with torch.no_grad():
            model.model.norm.weight.fill_(40.0)
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32,
                                             intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2))
    folder = str(tmp_path / kind)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def own_model_argv(folder, out):
    return ["--model", folder, "--env", "frozenlake", "--groups", "2", "--group-size", "2",
            "--max-turns", "2", "--max-new-tokens", "6", "--steps", "2", "--mi-every", "1",
            "--mi-samples", "4", "--probe-prompts", "2", "--probe-samples", "2", "--filter", "none",
            "--val-every", "0", "--no-plot", "--threads", "1", "--out", out]


@pytest.mark.parametrize("kind", ["gpt2", "llama", "gemma2"])
def test_a_users_own_model_folder_trains_with_the_diagnosis(tmp_path, capsys, kind):
    """A folder of another architecture (GPT-2; Gemma 2, which soft-caps its logits) trains
    through its own forward pass and cache, one line saying so and why; the Llama layout through
    the decode loop, without that line. Each runs 2 steps of PPO with the diagnosis, token-exact
    (Gemma 2's logits of tens included), and updates."""
    out = str(tmp_path / "run")
    assert train.main(own_model_argv(own_model_folder(tmp_path, kind), out)) == 0
    said = capsys.readouterr().out
    assert ("samples through its own forward pass" in said) == (kind != "llama")
    steps = records(out)
    assert [r["step"] for r in steps] == [1, 2] and all(r["optimizer_steps"] == 1 for r in steps)
    assert all(r["diagnosis_logprob_diff"] < 1e-4 for r in steps)


def test_a_model_scored_otherwise_than_it_samples_is_stopped_in_one_line(tmp_path, capsys,
                                                                        monkeypatch):
    """Where the scorer and the model's forward disagree (here the soft cap left out of the
    scores, as it once was), the token-exactness check is far off at the first diagnosis: the run
    stops there in one line naming the check, exit 2, and leaves no folder, instead of training
    on another policy's log-probs."""
    import logprobs
    folder, out = own_model_folder(tmp_path, "gemma2"), str(tmp_path / "run")
    monkeypatch.setattr(logprobs, "output_logits",
                        lambda lm, hidden: lm.get_output_embeddings()(hidden))
    last = fails(own_model_argv(folder, out), capsys,
                 "step 1: the diagnosis scores what was sampled", started=True)
    assert "diagnosis_logprob_diff above 0.01" in last and not os.path.exists(out)


def test_what_cannot_run_is_one_line_before_anything_loads(tmp_path, capsys):
    """A folder that holds no causal language model (T5, sequence to sequence) and a folder that
    does not exist: one line, exit 2, no run folder; the missing folder before torch loads."""
    from transformers import T5Config, T5ForConditionalGeneration

    T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1,
                                        num_heads=2, d_kv=8)).save_pretrained(tmp_path / "t5")
    capsys.readouterr()  # the saving's progress bar
    out = str(tmp_path / "run")
    assert train.main(["--model", str(tmp_path / "t5"), "--out", out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a t5 model is not a causal language model" in err[0]
    assert not os.path.exists(out)
    with pytest.raises(flags.UsageError, match="nowhere: no such folder"):  # the flags' own check,
        flags.parse_args(flags.Args, ["--model", str(tmp_path / "nowhere")])  # before torch loads


def test_a_new_run_that_fails_in_its_first_step_leaves_no_folder(tmp_path, monkeypatch):
    """An error no line was written for (a bug, a model that breaks mid-step) is raised as it is;
    a new run that completed no step leaves no folder, so the same command runs again."""
    out = str(tmp_path / "run")
    collect = train.collect_rollouts

    def broken(*args, **kwargs):
        raise RuntimeError("a model that breaks mid-step")

    monkeypatch.setattr(train, "collect_rollouts", broken)
    with pytest.raises(RuntimeError, match="breaks mid-step"):
        train.main(SMALL + ["--steps", "1", "--mi-every", "0", "--val-every", "0", "--out", out])
    assert not os.path.exists(out)
    monkeypatch.setattr(train, "collect_rollouts", collect)
    assert train.main(SMALL + ["--steps", "1", "--mi-every", "0", "--val-every", "0",
                               "--out", out]) == 0
