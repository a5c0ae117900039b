"""Memory: peak memory of one update with Qwen's 151,936-token vocabulary, the plain full-logits
path vs this code.

The plain path runs the policy on every position of every transcript and keeps full-vocabulary
logits -- [b, T, V] floats, then their log-softmax and entropy -- for the backward pass: with
V = 151,936 that is what fills the memory, whatever the model's width. This code
(logprobs.policy_logprobs) gathers the hidden states at the policy's own tokens and runs the output layer
on them in chunks under torch.utils.checkpoint, so the backward pass keeps [N, D] hidden states and
one chunk of logits at a time. The plain side is bench_step's (plain_logprobs, plain_pieces).

The model is Qwen2 64 wide, 2 layers (the tiny policy's shapes) with Qwen's vocabulary
(bench_gpu.qwen_shaped); the update is one PPO step (train.update_policy: old log-probs, critic
values, GAE, clipped loss, backward, optimiser steps) on B transcripts of T tokens, a third of them
the policy's (1024 is about the worst-case length of the tiny main command: 5 turns of 64 sampled
and ~140 template tokens). Each configuration runs in a fresh subprocess on CPU (--quick: its
two in one); glibc serves every block over 64 KiB with mmap (MALLOC_MMAP_THRESHOLD_), so freed
tensors leave the resident set at once and the kernel's high-water mark VmHWM tracks live memory. After a warm-up update (optimiser
state, allocator) the high-water mark is reset; the measured update's peak growth over the
resident set before it is what the configuration costs.

    python bench/bench_memory.py           # 16 transcripts: both paths at 512 tokens, ours at 1024
    python bench/bench_memory.py --quick   # small sizes and vocabulary: proves the script runs

Last line: RESULT memory <plain peak / this code's peak, micro-batch 2, 512 tokens> (higher is
better).
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # as when run as a script: its siblings import
from arguments import Parser, at_least, parse, thread_count  # noqa: E402
# (path, micro-batch, tokens per transcript); the plain path at 1024 tokens needs more than 24 GiB
CONFIGS = (("plain", 2, 512), ("this code", 2, 512), ("this code", 2, 1024), ("this code", 8, 1024))


def kib(field):
    """A field of /proc/self/status in KiB, e.g. kib("VmHWM")."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def even_batch(text):
    """An argparse type: the update's transcripts, two groups of at least 2 (a group of one has no
    reward spread for the filter to rank)."""
    value = at_least(4)(text)
    if value % 2:
        raise argparse.ArgumentTypeError(f"must be even (two groups), got {value}")
    return value


def child(args, configs):
    """One update of each configuration ([path, micro-batch, tokens]) in this process, the plain
    path last (it replaces the update's pieces for the rest of the process); prints their
    {"peak_mib", "before_mib"}, in the order given, as one JSON list."""
    import torch

    sys.path.insert(0, HERE)
    import bench_step
    import logprobs
    import train
    from bench_gpu import qwen_shaped

    results = {}
    for i in sorted(range(len(configs)), key=lambda i: configs[i][0] == "plain"):
        path, micro_batch, seq_len = configs[i]
        torch.manual_seed(0)
        model, tokenizer = qwen_shaped("tiny", torch.device("cpu"), args.vocab)
        flags = ["--algo", "ppo", "--groups", "2", "--group-size", str(args.batch // 2),
                 "--mini-batch-size", str(args.batch), "--micro-batch", str(micro_batch),
                 "--threads", str(args.threads), "--model", "qwen-vocab-tiny"]
        run = bench_step.make_run(flags, model, tokenizer)
        episodes, rewards = transcripts(args.batch, seq_len)
        if path == "plain":
            bench_step.PAD[0] = run.pad_id
            train.micro_batches = bench_step.plain_pieces
            logprobs.policy_logprobs = bench_step.plain_logprobs
            train.critic_pass = bench_step.plain_critic_pass

        def update():
            train.update_policy(run, episodes, rewards, torch.Generator().manual_seed(0))

        update()  # warm-up: AdamW state exists from here on
        before = kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident set
        update()
        results[i] = {"peak_mib": (kib("VmHWM") - before) / 1024, "before_mib": before / 1024}
    print(json.dumps([results[i] for i in range(len(configs))]))


def transcripts(batch, seq_len):
    """`batch` transcripts of `seq_len` random tokens in two groups, a third of each turn the
    policy's, and their rewards [2, batch / 2]."""
    import torch

    import rollout

    gen = torch.Generator().manual_seed(0)
    period = min(200, seq_len)  # a turn: two thirds template, one third sampled
    mask = [float(t % period >= 2 * period // 3) for t in range(seq_len)]
    episodes = [rollout.Episode(env=None, group=i * 2 // batch, seed=0, noise_seed=i,
                                ids=torch.randint(10, 500, (seq_len,), generator=gen).tolist(),
                                policy_mask=mask, logprobs=None, prompt_text="",
                                turn_rewards=[float(torch.randn(1, generator=gen))])
                for i in range(batch)]
    return episodes, torch.tensor([e.total_reward for e in episodes]).view(2, batch // 2)


def measure(args, configs):
    """[{"peak_mib", "before_mib"}] of the configurations ((path, micro-batch, tokens)), measured
    in one fresh process."""
    child_args = json.dumps([[path, micro, min(seq_len, args.seq_len)]
                             for path, micro, seq_len in configs])
    command = [sys.executable, os.path.abspath(__file__), "--child", child_args,
               "--threads", str(args.threads), "--batch", str(args.batch),
               "--seq-len", str(args.seq_len), "--vocab", str(args.vocab)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(command, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"configuration failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=thread_count, default=2, help="torch.set_num_threads")
    parser.add_argument("--batch", type=even_batch, default=16,
                        help="transcripts in the update: two groups, an even number >= 4")
    parser.add_argument("--seq-len", type=at_least(2), default=1024,
                        help="longest transcript, in tokens")
    # the transcripts' token ids go up to 500
    parser.add_argument("--vocab", type=at_least(512), default=151_936,
                        help="vocabulary size (Qwen's)")
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    # --quick: the two paths once, small: proves the script runs
    args = parse(parser, quick=dict(batch=4, seq_len=100, vocab=4096))
    if args.child:
        import torch
        torch.set_num_threads(args.threads)
        return child(args, json.loads(args.child))
    configs = CONFIGS[:2] if args.quick else CONFIGS
    # each configuration in a fresh process, whose resident set holds nothing of another's; --quick
    # (small sizes: its numbers prove the script runs, nothing more) measures its two in one
    batches = [configs] if args.quick else [[config] for config in configs]
    results = {}
    for batch in batches:
        results.update(zip(batch, measure(args, batch)))
    base = next(iter(results.values()))["before_mib"]
    print(f"Qwen2 64 wide, 2 layers, vocabulary {args.vocab:,}; PPO update of {args.batch} "
          f"transcripts (a third of each sampled); torch threads {args.threads}; resident set "
          f"before the update ~{base:.0f} MiB")
    print(f"{'path':<12}{'micro-batch':>12}{'tokens':>8}{'peak growth MiB':>17}")
    for (path, micro, seq_len), r in results.items():
        print(f"{path:<12}{micro:>12}{min(seq_len, args.seq_len):>8}{r['peak_mib']:>17.0f}")
    plain, ours = (results[(p, 2, 512)]["peak_mib"] for p in ("plain", "this code"))
    print(f"RESULT memory {plain / max(ours, 1e-9):.2f}")


if __name__ == "__main__":
    main()
