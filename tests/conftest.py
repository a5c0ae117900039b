"""Shared test set-up: the project root on sys.path, quiet and deterministic torch, one tiny-Qwen2 builder."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one thread is faster than several fighting over shared cores, and results do
    not depend on the machine's core count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_qwen2(vocab_size, hidden_size=32, layers=2, seed=0, **config):
    """A random Qwen2ForCausalLM in eval mode, small enough for a test: tiny_qwen2(48) is 2 layers, 32 wide."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = {"intermediate_size": 2 * hidden_size, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 4096, **config}
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers,
                                        **config)).eval()
