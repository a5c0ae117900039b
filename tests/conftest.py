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
