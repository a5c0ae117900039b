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
                                          ("bench_shared_cores.py", "shared_cores")])
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
