"""Tests of plumbing/hardware.py and of the branches it chooses, on any machine: the choice by
hardware is a function handed faked CPU flags and devices; the bfloat16 branch runs here whatever
the CPU (without AVX512-BF16 it is emulated: slower, the same rounding), with tolerances derived
from bfloat16's precision."""
import json
import math

import pytest
import torch

import logprobs
import train
from plumbing import hardware, runs

CPU = torch.device("cpu")
U = 2.0 ** -8  # bfloat16's unit roundoff: 8 significant bits, a rounding moves a number by <= u|x|


def test_the_flags_come_from_cpuinfo_unless_the_environment_names_them(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\nprocessor\t: 1\n"
                    "flags\t\t: fpu avx2 avx512f\n")
    assert hardware.cpu_flags({}, str(info)) == {"fpu", "avx2", "avx512f"}
    assert hardware.cpu_flags({}, str(tmp_path / "none")) == frozenset()
    named = {hardware.FLAGS_VARIABLE: "avx512_bf16 avx2"}
    assert hardware.cpu_flags(named, str(info)) == {"avx512_bf16", "avx2"}
    assert hardware.cpu_flags({hardware.FLAGS_VARIABLE: ""}, str(info)) == frozenset()


@pytest.mark.parametrize("device, tiny, flags, capability, dtype", [
    ("cpu", False, {"avx2", "avx512f"}, None, "float32"),           # the Intel Xeon, an AMD EPYC 7003
    ("cpu", False, {"avx512f", "avx512_bf16"}, None, "bfloat16"),   # an AMD EPYC 9004
    ("cpu", False, {"amx_bf16"}, None, "bfloat16"),                 # an Intel Xeon with AMX
    ("cpu", True, {"avx512_bf16"}, None, "float32"),                # the tiny policy: everywhere
    ("cuda", False, set(), (9, 0), "bfloat16"),                     # an H100 or H200
    ("cuda", False, set(), (8, 0), "bfloat16"),                     # an A100
    ("cuda", False, set(), (7, 5), "float32"),                      # a T4: no bfloat16 units
    ("cuda", True, set(), (9, 0), "float32"),
])
def test_the_precision_follows_the_hardware(device, tiny, flags, capability, dtype):
    chosen, why = hardware.default_dtype(device, tiny, frozenset(flags), capability)
    assert chosen == dtype and why


@pytest.mark.parametrize("device, dtype, flags, transposed", [
    ("cpu", "float32", {"avx512f"}, True),      # the Intel Xeon: x @ W^T 4.5x F.linear's speed
    ("cpu", "float32", {"avx2"}, False),        # an AMD EPYC 7003: F.linear as fast or faster
    ("cpu", "bfloat16", {"avx512f", "avx512_bf16"}, False),  # an AMD EPYC 9004: F.linear 2x
    ("cpu", "bfloat16", {"avx2"}, False),       # emulated bfloat16: the copy 5-20x slower
    ("cuda", "float32", {"avx512f"}, False),
])
def test_the_weights_layout_follows_the_measurements(device, dtype, flags, transposed):
    assert hardware.transposed_weights(device, dtype, frozenset(flags)) == transposed


def resolved(monkeypatch, flags, model="smollm2", device=CPU, capability=None, **kw):
    monkeypatch.setenv(hardware.FLAGS_VARIABLE, flags)
    if capability is not None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    a = train.Args(model=model, env="frozenlake", out="unused", **kw)
    runs.resolve_defaults(a, device)
    return a


def test_a_run_takes_the_branch_of_the_machine_it_is_told_it_is_on(monkeypatch, capsys, tmp_path):
    """resolve_defaults with faked flags and devices: a real model computes in bfloat16 on an
    AVX512-BF16 CPU and on a GPU with bfloat16 units, and says so; float32 elsewhere; the tiny
    policy, and a checkpoint of it (its policy.json says so), in float32 everywhere; --dtype
    decides over all of it; the sampler follows unless --sample-dtype says."""
    assert resolved(monkeypatch, "avx512_bf16").dtype == "bfloat16"
    assert "precision: bfloat16 (this CPU has AVX512-BF16 or AMX" in capsys.readouterr().out
    assert resolved(monkeypatch, "avx2").dtype == "float32"
    assert capsys.readouterr().out == ""  # float32 on a CPU is not news
    assert resolved(monkeypatch, "avx512_bf16", dtype="float32").dtype == "float32"
    a = resolved(monkeypatch, "", device=torch.device("cuda"), capability=(7, 5))
    assert a.dtype == "float32" and "no bfloat16 units" in capsys.readouterr().out
    a = resolved(monkeypatch, "", device=torch.device("cuda"), capability=(9, 0))
    assert (a.dtype, a.sample_dtype) == ("bfloat16", "bfloat16")
    assert resolved(monkeypatch, "avx512_bf16", sample_dtype="float32").sample_dtype == "float32"
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "policy.json").write_text(json.dumps({"prompt": "tiny", "observation": "grid"}))
    for model in ("tiny", str(checkpoint)):
        assert resolved(monkeypatch, "avx512_bf16", model=model).dtype == "float32"


# ----------------------------------------------------------------- the bfloat16 branch, here

def bf16_run(model, **kw):
    a = train.Args(model=model, warm_start=False, env="frozenlake", max_turns=1, threads=1,
                   out="unused", dtype="bfloat16", **kw)
    runs.resolve_defaults(a, CPU)
    return runs.load_run(a, CPU, a.model)


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_the_bfloat16_branch_samples_diagnoses_and_updates_within_its_rounding(model, request):
    """A run in bfloat16, on any CPU. The sampler: each token's recorded log-prob differs from a
    float32 full pass by bfloat16's rounding, not more. A log-prob is a logit minus the
    log-sum-exp of all; the output layer alone rounds a logit z by up to u|z|, so the tolerance is
    in units of u max|z| over the batch: the mean gap within one unit, every token within 8 (the
    sampled logit's and the normaliser's rounding, and as much again from the layers below, with
    room). A token scored at a shifted position would be off by nats.
    The diagnosis: it scores in float32 whatever the run's precision, and a bfloat16 run's replies
    are replayed in float32 for its exactness check (train.sampled_in_float32), which then holds to
    float32's 1e-4, while sampling_precision_gap says how far bfloat16's records were: above 0,
    within the per-token tolerance times the tokens of the longest reply.
    The update: it rescores the batch itself (the ratio exactly 1 before its optimiser step) and
    logs the sampler's mean gap a token, within one unit.
    SmolLM2 runs on its first 2 layers (conftest.cut_smollm2): its real vocabulary, embedding and
    head, where a bfloat16 logit's rounding is. Its update is left to the suite run as a bf16 CPU
    runs it (RAGEN_CPU_FLAGS=avx512_bf16: test_smollm2.py's runs then update in bfloat16): emulated
    bfloat16 makes even the cut model's update half a minute long."""
    if model == "smollm2":
        request.getfixturevalue("cut_smollm2")
    k = 3
    run = bf16_run(model, algo="grpo", groups=2, group_size=k, mi_samples=2 * k, max_new_tokens=12,
                   probe_samples=1, lr=1e-5, probe_prompts=2)
    torch.manual_seed(0)
    episodes = train.collect_rollouts(run, [3, 4], k, 1.0, 1.0)
    batch = train.rollout_batch(run, episodes)
    mask = batch["policy_mask"][:, 1:].bool()                                      # [B, T-1]
    with torch.no_grad():  # a float32 full pass: the exact log-probs, and the logits' scale
        logits = run.policy(input_ids=batch["input_ids"]).logits[:, :-1]           # [B, T-1, V]
        exact = logprobs.tempered(logits).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        scale = logits.abs().max().item()
    gap = (batch["logprobs"][:, 1:] - exact)[mask].abs()
    assert mask.sum() >= 16 and 0 < gap.mean() < U * scale and gap.max() < 8 * U * scale

    out = {**train.diagnose(run, episodes, None), **train.probe(run)}
    longest = max(len(e.first.reasoning_ids) + len(e.first.answer_ids) for e in episodes)
    for p in ("", "probe_"):
        assert out[p + "diagnosis_logprob_diff"] < 1e-4
        assert 0 < out[p + "sampling_precision_gap"] < 8 * U * scale * longest
    assert math.isfinite(out["mi_estimate"])

    if model == "smollm2":
        return
    rewards = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])  # spread in both groups
    update = train.update_policy(run, episodes, rewards, torch.Generator().manual_seed(0))
    assert update["approx_kl"] < 1e-6 and 0 < update["rollout_logprob_diff"] < U * scale


def test_masked_attention_on_a_gpu_runs_on_chosen_kernels_never_cudnns():
    """On CUDA the sampler's masked attention may use memory-efficient or math kernels only:
    cuDNN's masked kernels have open silent-correctness bugs on Hopper and Blackwell, and flash
    takes no mask. The choice is torch's global switch, read here on a CPU; the CPU's own choice is
    left alone, and a masked attention computes the same inside the context."""
    cuda = torch.backends.cuda
    before = (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled())
    q = torch.randn(1, 2, 5, 4, generator=torch.Generator().manual_seed(0))
    mask = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    free = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    with hardware.masked_attention("cuda"):
        assert not cuda.cudnn_sdp_enabled() and not cuda.flash_sdp_enabled()
        assert cuda.mem_efficient_sdp_enabled() and cuda.math_sdp_enabled()
        chosen = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    torch.testing.assert_close(chosen, free)
    assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled()) == before
    with hardware.masked_attention("cpu"):
        assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled()) == before


@pytest.mark.parametrize("layout", ["llama", "gpt2"])
def test_every_sampling_call_runs_under_the_chosen_attention(monkeypatch, layout):
    """Both samplers -- the decode loop and a model's own forward -- enter masked_attention for
    their device on every call."""
    from test_rollout import make_model, make_tokenizer
    from test_sampler import tiny_gpt2
    from plumbing import sampler
    tokenizer = make_tokenizer()
    model = make_model(tokenizer) if layout == "llama" else tiny_gpt2(tokenizer)
    entered = []
    real = hardware.masked_attention
    monkeypatch.setattr(hardware, "masked_attention", lambda d: entered.append(d) or real(d))
    policy = sampler.hf_policy(model, tokenizer, 4)
    for _ in range(2):
        policy([tokenizer.encode("<think>", add_special_tokens=False)])
    assert entered == ["cpu", "cpu"]
