"""What the machine computes fast, and so how a run computes: every choice by hardware is one
function of what was found, printed and written in the run's record, so that a test can hand it
any machine's facts.

    precision   bfloat16 for a real model on a GPU that multiplies it natively (compute capability
                8.0 on: Ampere, Hopper) and on a CPU with AVX512-BF16 or AMX, where it runs faster
                than float32; float32 elsewhere (an x86 CPU without them emulates bfloat16, several
                times slower) and for the tiny policy everywhere (its width-64 matrices gain
                nothing, and its results stay exact across machines). --dtype overrides.
    attention   masked attention on a GPU on memory-efficient or math kernels, never cuDNN's
                (masked_attention: its masked kernels have open correctness bugs on Hopper and
                Blackwell)
    layout      the sampler's weight copies on a CPU in float32 on a CPU with AVX-512: transposed
                (x @ W^T, W^T contiguous), 4.5x faster there than F.linear at a decode step's 16
                rows; elsewhere the original layout, which was as fast or faster on every other
                CPU and dtype measured (bench/README.md, bench/bench_layout.py).

The CPU's flags come from /proc/cpuinfo, or from the environment variable RAGEN_CPU_FLAGS where it
is set (space-separated; empty: no flags), so that any machine can take another's branch:
`RAGEN_CPU_FLAGS=avx512_bf16 python -m pytest` runs the suite as an AVX512-BF16 CPU would.
"""
import os

FLAGS_VARIABLE = "RAGEN_CPU_FLAGS"
BF16_FLAGS = {"avx512_bf16", "amx_bf16"}  # a CPU that multiplies bfloat16 natively
BF16_GPU = (8, 0)  # compute capability from which a GPU multiplies bfloat16 natively


def cpu_flags(environ=None, path="/proc/cpuinfo"):
    """The CPU's feature flags: RAGEN_CPU_FLAGS's where set, else /proc/cpuinfo's (none where it
    cannot be read)."""
    environ = os.environ if environ is None else environ
    if FLAGS_VARIABLE in environ:
        return frozenset(environ[FLAGS_VARIABLE].split())
    try:
        with open(path) as f:
            return frozenset(word for line in f if line.startswith("flags")
                             for word in line.split(":", 1)[1].split())
    except OSError:
        return frozenset()


def masked_attention(device_type):
    """The kernels attention with a mask may run on, chosen on purpose -> a context manager: on
    CUDA memory-efficient attention, else the math kernel; never cuDNN's, which recent torch
    prefers on Hopper and Blackwell and which has open silent-correctness bugs exactly where the
    sampler calls it (boolean masks, grouped key/value heads: pytorch/pytorch#193893 -- greedy
    generation corrupted on B200 for models with fewer than 8 key/value heads, Qwen2.5-0.5B has
    2 --, #196678, #191612), nor flash attention, which takes no mask. On a CPU: as torch
    chooses (it has no cuDNN kernel)."""
    import contextlib

    if device_type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def cpu_name(path="/proc/cpuinfo"):
    """The CPU's model name as /proc/cpuinfo gives it ("" where it cannot be read)."""
    try:
        with open(path) as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), "")
    except OSError:
        return ""


def default_dtype(device_type, tiny, flags=frozenset(), capability=None):
    """The precision a run computes in where --dtype does not say -> (dtype, why). `capability`:
    a GPU's (major, minor) compute capability.

    >>> default_dtype("cpu", False, {"avx2", "avx512_bf16"})[0], default_dtype("cpu", False, {"avx2"})[0]
    ('bfloat16', 'float32')
    >>> default_dtype("cuda", False, capability=(7, 5))
    ('float32', 'this GPU (compute capability 7.5) has no bfloat16 units')
    """
    if tiny:
        return "float32", "the tiny policy computes in float32 everywhere"
    if device_type == "cuda":
        if capability is not None and tuple(capability) < BF16_GPU:
            return "float32", (f"this GPU (compute capability {capability[0]}.{capability[1]}) "
                               f"has no bfloat16 units")
        return "bfloat16", "this GPU computes bfloat16 natively"
    if flags & BF16_FLAGS:
        return "bfloat16", "this CPU has AVX512-BF16 or AMX"
    return "float32", "this CPU has neither AVX512-BF16 nor AMX"


def transposed_weights(device_type, dtype, flags=frozenset()):
    """Whether the sampler multiplies by transposed weight copies (x @ W^T with W^T contiguous)
    rather than F.linear's layout: only in float32 on a CPU with AVX-512 (module docstring).

    >>> transposed_weights("cpu", "float32", {"avx512f"}), transposed_weights("cpu", "float32", {"avx2"})
    (True, False)
    """
    return device_type == "cpu" and dtype == "float32" and "avx512f" in flags
