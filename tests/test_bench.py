"""Every benchmark's --quick mode still runs: its main() returns and prints a last `RESULT <name>
<finite number>` line; bench_gpu's number is the fraction of its rows that ran, so its one quick row
must have run (1.000, not 0.000).

The quick modes run in the test's own process: a fresh interpreter would spend more time importing
torch and transformers than the quick mode spends running. What a script reassigns in the project's
modules (bench_gpu swaps models.load_policy, bench_step the update's pieces) is put back afterwards.
No timing is asserted: the numbers depend on the machine.
"""
import contextlib
import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")


def load(script):
    spec = importlib.util.spec_from_file_location(script[:-3], os.path.join(BENCH, script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def project_modules_restored():
    """Every attribute of the project's and bench's modules as it was before; a module first
    imported inside is forgotten, so the next import loads it afresh."""
    def ours(module):  # the root's, a package folder's (worlds/, plumbing/, ...) or bench's
        path = getattr(module, "__file__", None)
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        return bool(path) and (folder in (ROOT, BENCH) or os.path.dirname(folder) == ROOT
                               and os.path.isfile(os.path.join(folder, "__init__.py")))

    saved = {module: dict(vars(module)) for module in list(sys.modules.values()) if ours(module)}
    path = list(sys.path)
    try:
        yield
    finally:
        sys.path[:] = path
        for module, attributes in saved.items():
            vars(module).update(attributes)
        for name, module in list(sys.modules.items()):
            if ours(module) and module not in saved:
                del sys.modules[name]


def run_quick(script, monkeypatch, capsys):
    """main() of `script` with --quick, as when run as a script -> its last line, split."""
    monkeypatch.setattr(sys, "argv", [script, "--quick", "--threads", "1"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with project_modules_restored():
        sys.path.insert(0, BENCH)  # as when run as a script: the bench's siblings import
        assert load(script).main() in (None, 0)
    return capsys.readouterr().out.strip().splitlines()[-1].split()


@pytest.mark.parametrize("script, name", [("bench_cross_scores.py", "cross_scores"), ("bench_rollout.py", "rollout"),
                                          ("bench_filter.py", "filter"), ("bench_memory.py", "memory"),
                                          ("bench_gpu.py", "gpu"), ("bench_step.py", "step"),
                                          ("bench_trl.py", "trl"), ("bench_retokenize.py", "retokenize"),
                                          ("bench_shared_cores.py", "shared_cores"),
                                          ("bench_decode.py", "decode"), ("bench_layout.py", "layout")])
def test_quick_mode_reports_a_result(script, name, monkeypatch, capsys):
    last = run_quick(script, monkeypatch, capsys)
    assert len(last) == 3 and last[0] == "RESULT", last
    assert last[1] == name and math.isfinite(float(last[2])), last
    if name == "gpu":  # rows that ran / rows run: the quick row failing prints 0.000
        assert float(last[2]) == 1.0


def test_a_quick_mode_leaves_the_project_as_it_found_it(monkeypatch, capsys):
    """bench_gpu swaps models.load_policy for its in-memory model; later tests must get the real one."""
    from plumbing import models

    load_policy = models.load_policy
    run_quick("bench_gpu.py", monkeypatch, capsys)
    assert models.load_policy is load_policy and sys.modules["plumbing.models"] is models


def test_the_gpu_bench_refuses_a_cpu_unless_asked(monkeypatch, capsys):
    """Without a GPU a 0.5B row would run for hours on the CPU, saying nothing: one line and exit 2,
    unless --cpu asks for it (--quick, above, stays a CPU check)."""
    bench_gpu = load("bench_gpu.py")
    rows = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench_gpu, "one_row", lambda args: rows.append(args.size) or {"exit_code": 0})
    assert bench_gpu.main(["--size", "0.5b", "--algo", "ppo"]) == 2 and rows == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no GPU found") and "--cpu" in err[0]
    assert bench_gpu.main(["--size", "0.5b", "--algo", "ppo", "--cpu"]) == 0 and rows == ["0.5b"]


def test_the_zero_shot_table_regenerates_from_its_committed_archives():
    """results/zero-shot/README.md is bench/zero_shot.py's table of the archives beside it, byte for
    byte, and every archive it reads is committed."""
    import subprocess

    folder = os.path.join(ROOT, "results", "zero-shot")
    tracked = subprocess.run(["git", "ls-files", folder], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    archives = [f for f in os.listdir(folder) if f.endswith(".json")]
    assert archives and all(any(t.endswith("/" + f) for t in tracked) for f in archives)
    with open(os.path.join(folder, "README.md")) as f:
        assert load("zero_shot.py").table(folder) == f.read()


@pytest.mark.parametrize("script, argv, words", [
    ("bench_step.py", ["--threads", "0"], "argument --threads: must be >= 1, got 0"),
    ("bench_step.py", ["--env", "nosuch"], "argument --env: invalid choice: 'nosuch'"),
    ("bench_filter.py", ["--groups", "0"], "argument --groups: must be >= 2, got 0"),
    ("bench_filter.py", ["--quick", "--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
    ("bench_memory.py", ["--batch", "-1"], "argument --batch: must be >= 4, got -1"),
    ("bench_memory.py", ["--batch", "-1", "--quick"], "argument --batch: must be >= 4, got -1"),
    ("bench_memory.py", ["--batch", "5"], "argument --batch: must be even (two groups), got 5"),
    ("bench_cross_scores.py", ["--prompts", "0"], "argument --prompts: must be >= 1, got 0"),
    ("bench_cross_scores.py", ["--hidden", "12"], "argument --hidden: must be a multiple of 8"),
    ("bench_rollout.py", ["--env", "nosuch"], "argument --env: invalid choice: 'nosuch'"),
    ("bench_rollout.py", ["--threads", str(10 * (os.cpu_count() or 1))], "the machine's"),
    ("bench_gpu.py", ["--size", "7b"], "argument --size: invalid choice: '7b'"),
    ("bench_retokenize.py", ["--world", "nosuch"], "argument --world: invalid choice: 'nosuch'"),
    ("run_all.py", ["--threads", "0"], "argument --threads: must be >= 1, got 0"),
    ("versus_commit.py", [], "the following arguments are required: commit"),
    ("zero_shot.py", ["--model", "gpt2", "--quick"], "--model gpt2: not in the local Hugging Face cache"),
    ("zero_shot.py", ["--worlds", "frozenlake,nosuch"], "argument --worlds: no world 'nosuch'"),
    ("zero_shot.py", ["--observation", "coords", "--worlds", "bandit", "--quick"],
     "--observation coords is for a real model in a grid world"),
])
def test_a_size_or_name_a_script_cannot_use_is_one_line_and_exit_2(script, argv, words, monkeypatch, capsys):
    """As train.py's flags: one line naming the flag, exit code 2, no traceback from inside a
    measurement (the sizes are checked as they are parsed; a model is refused as it loads)."""
    monkeypatch.setattr(sys, "argv", [script] + argv)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # gpt2 is not on this machine: no network asked
    with project_modules_restored():
        sys.path.insert(0, BENCH)
        with pytest.raises(SystemExit) as stopped:
            load(script).main()
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("error: ") and words in err[0], err


def test_a_size_given_with_quick_is_used_not_ignored():
    """--quick's small sizes stand in for the defaults only: a flag given beside it is the one
    used."""
    with project_modules_restored():
        sys.path.insert(0, BENCH)
        arguments = load("arguments.py")
        parser = arguments.Parser()
        parser.add_argument("--batch", type=arguments.at_least(4), default=16)
        parser.add_argument("--quick", action="store_true")
        quick = dict(batch=4)
        assert arguments.parse(parser, ["--quick"], quick).batch == 4
        assert arguments.parse(parser, ["--quick", "--batch", "8"], quick).batch == 8
        assert arguments.parse(parser, [], quick).batch == 16


@pytest.mark.parametrize("script", sorted(f for f in os.listdir(BENCH) if f.endswith(".py")
                                          and f != "arguments.py"))
def test_each_scripts_help_says_what_it_does_in_whole_sentences(script, monkeypatch, capsys):
    """--help opens with the script's first paragraph, ending where its sentence ends (it once
    stopped mid-sentence: the docstring's first line)."""
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with project_modules_restored():
        sys.path.insert(0, BENCH)
        with pytest.raises(SystemExit):
            load(script).main()
    text = capsys.readouterr().out
    said = " ".join(text.split("\n\n")[1].split())  # after the usage lines
    assert said.endswith("."), said


def test_the_lease_scripts_rows_keep_what_a_killed_run_logged(tmp_path, capsys):
    """run_rows reads each run's log as it was left: every whole step a row, a line a kill cut
    left out, a folder without a log one row that says so."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(
        '{"step": 1, "time_step": 2.5, "time_scoring": 1.5}\n{"step": 2, "time_st')
    with project_modules_restored():
        sys.path.insert(0, BENCH)
        load("run_rows.py").main([str(tmp_path / "run"), str(tmp_path / "none")])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "RESULT run_rows 1"
    assert '"step": 1' in lines[0] and '"time_scoring": 1.5' in lines[0] and "no log" in lines[1]


def test_the_lease_script_says_in_one_line_that_there_is_no_gpu(tmp_path):
    """bench/gpu_check.sh on a machine without a GPU: one line and exit 2 before any part runs
    (it once built SmolLM2's warm start on the CPU until its part's limit); --dry-run runs each
    part's CPU check instead."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script would measure it")
    done = subprocess.run(["bash", os.path.join(BENCH, "gpu_check.sh")], capture_output=True,
                          text=True, env={**os.environ, "OUT": str(tmp_path / "out")})
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and err[0].startswith("error: no GPU found")
    assert done.stdout == ""
