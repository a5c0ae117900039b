"""Shared test set-up: the project root on sys.path, quiet and deterministic torch, a tiny-Qwen2 builder, a cut SmolLM2."""
import os
import sys

import pytest

# The suite runs one worker a core (pytest -n auto). A process under test may take more threads
# than its share of the cores (train.py's tiny default is 2), and OpenMP threads that busy-wait at
# every barrier then made the suite twice as slow as in one process: passive waiting lets them
# sleep. Set before torch loads its OpenMP runtime, which reads it once.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network


def project_modules(root=ROOT):
    """{dotted name: path} of the project's modules: the top level's (the paper) and those of each
    package folder (exercises.project_files: tests/ and bench/ are none)."""
    from course.exercises import project_files

    return {f[:-3].replace("/", "."): os.path.join(root, f) for f in project_files(root)
            if os.path.basename(f) != "__init__.py"}


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """Tiny matrices: one thread is faster than several fighting over shared cores, and results do
    not depend on the machine's core count. A run or a warm-start build under test takes one too
    (train.py's tiny default and tiny.BUILD_THREADS are 2): the suite runs one worker a core.
    Only where the test imported them: a pure test does not depend on them."""
    for module, name in (("plumbing.runs", "TINY_THREADS"), ("warmstart.tiny", "BUILD_THREADS")):
        if module in sys.modules:
            monkeypatch.setattr(sys.modules[module], name, 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CLOCK = ("time_", "tokens_per_s", "mfu")  # logged keys a clock measures: no two runs agree on them


def tiny_qwen2(vocab_size, hidden_size=32, layers=2, seed=0, **config):
    """A random Qwen2ForCausalLM in eval mode, small enough for a test: tiny_qwen2(48) is 2 layers, 32 wide."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = {"intermediate_size": 2 * hidden_size, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 4096, **config}
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers,
                                        **config)).eval()


@pytest.fixture
def cut_smollm2(monkeypatch):
    """`--model smollm2` loads SmolLM2-135M-Instruct with only the first 2 of its 30 decoder
    layers in this test: its real tokenizer, embedding, head and first layers, for a test of what
    runs around the model (a run's plumbing, a warm start's build, a precision's rounding) at about
    a tenth of a full pass's cost."""
    from plumbing import models

    load = models.load_smollm2

    def cut():
        model, tokenizer = load()
        model.model.layers = model.model.layers[:2]
        model.config.num_hidden_layers = 2
        return model, tokenizer

    monkeypatch.setattr(models, "load_smollm2", cut)


# What a command line does, at a fraction of a fresh interpreter's cost: one process imports the
# heavy libraries (torch, transformers, ...) but none of the project's modules, then forks a child
# a case, which sets its working directory, sys.path and sys.argv as `python` would for that
# command and runs it; every module of the project the command imports, the child imports anew
# (from the case's own tree: a student copy's). One fresh interpreter a case would spend most of
# its time importing torch and transformers.
FRESH = r"""
import json, os, runpy, sys, traceback
sys.path[:] = [p for p in sys.path if p and os.path.isabs(p)  # neither '' nor a project tree
               and not os.path.isfile(os.path.join(p, "train.py"))]
import matplotlib
matplotlib.use("Agg")
for heavy in ("torch", "transformers", "transformers.models.qwen2.modeling_qwen2", "trl", "peft",
              "accelerate", "matplotlib.pyplot", "scipy.stats", "pytest"):
    __import__(heavy)
cases, logs = json.loads(sys.argv[1]), sys.argv[2]
results = []
for i, (kind, target, args, cwd) in enumerate(cases):
    out, err = (os.path.join(logs, f"{i}.{name}") for name in ("out", "err"))
    pid = os.fork()
    if pid == 0:
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        code = 0
        try:
            os.chdir(cwd)
            if kind == "file":  # python path args: the file's folder first on the path
                sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
                sys.argv = [target] + args
                runpy.run_path(target, run_name="__main__")
            elif kind == "module":  # python -m name args: the working directory first
                sys.path.insert(0, os.getcwd())
                sys.argv = ["-m"] + args
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:  # python -c code args
                sys.path.insert(0, "")
                sys.argv = ["-c"] + args
                exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    results.append([code] + [open(p, errors="replace").read() for p in (out, err)])
print(json.dumps(results))
"""


def run_fresh(cases, tmp_path, env=None):
    """[(exit code, stdout, stderr)] of each case, run as a fresh `python` would run it, from its
    working directory: ("file", path, args, cwd) is `python path args`, ("module", name, args,
    cwd) `python -m name args`, ("code", text, args, cwd) `python -c text args`."""
    import json
    import subprocess

    logs = tmp_path / "fresh-logs"
    logs.mkdir()
    done = subprocess.run([sys.executable, "-c", FRESH, json.dumps(cases), str(logs)],
                          cwd=str(tmp_path), capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return [tuple(r) for r in json.loads(done.stdout.strip().splitlines()[-1])]
