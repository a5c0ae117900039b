"""Every benchmark's --quick mode still runs: exit status 0 and a last `RESULT <name> <finite
number>` line; bench_gpu's number is the fraction of its rows that ran, so its one quick row must
have run (1.000, not 0.000).

No timing is asserted: the numbers depend on the machine.
"""
import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def run_quick(script, python=sys.executable):
    out = subprocess.run([python, os.path.join(BENCH, script), "--quick", "--threads", "1"], capture_output=True,
                         text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1].split()
    assert len(last) == 3 and last[0] == "RESULT", out.stdout[-2000:]
    assert math.isfinite(float(last[2])), last
    return last[1], float(last[2])


@pytest.mark.parametrize("script, name", [("bench_cross_scores.py", "cross_scores"), ("bench_rollout.py", "rollout"),
                                          ("bench_filter.py", "filter"), ("bench_memory.py", "memory"),
                                          ("bench_gpu.py", "gpu"), ("bench_step.py", "step"),
                                          ("bench_trl.py", "trl"), ("bench_retokenize.py", "retokenize")])
def test_quick_mode_reports_a_result(script, name):
    reported, value = run_quick(script)
    assert reported == name
    if name == "gpu":  # rows that ran / rows run: the quick row failing prints 0.000
        assert value == 1.0



def test_the_gpu_bench_refuses_a_cpu_unless_asked(monkeypatch, capsys):
    """Without a GPU a 0.5B row would run for hours on the CPU, saying nothing: one line and exit 2,
    unless --cpu asks for it (--quick, above, stays a CPU check)."""
    spec = importlib.util.spec_from_file_location("bench_gpu", os.path.join(BENCH, "bench_gpu.py"))
    bench_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_gpu)
    rows = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench_gpu, "one_row", lambda args: rows.append(args.size) or {"exit_code": 0})
    assert bench_gpu.main(["--size", "0.5b", "--algo", "ppo"]) == 2 and rows == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no GPU found") and "--cpu" in err[0]
    assert bench_gpu.main(["--size", "0.5b", "--algo", "ppo", "--cpu"]) == 0 and rows == ["0.5b"]
