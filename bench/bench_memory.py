"""Memory: peak memory of one update with and without gradient checkpointing and micro-batching, on a larger tiny model.

The update (train.update: old log-probs, clipped loss, backward, optimiser step) holds every layer's activations of a
micro-batch until its backward pass. Two knobs cut that peak without changing the result:
  micro-batching          (--micro-batch)          activations of micro_batch sequences at a time instead of all;
  gradient checkpointing  (--grad-checkpointing)   keep only each layer's input, recompute the rest in backward.

Each configuration runs in a fresh subprocess (so no allocator state is shared) on CPU. glibc is told to serve every
block over 64 KiB with mmap (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident set at once and the
kernel's high-water mark VmHWM (/proc/self/status) tracks live memory. After a warm-up update (which creates the
AdamW state and the allocator's steady state) the high-water mark is reset (/proc/self/clear_refs, "5") and the
measured update's peak growth over the resident set before it is what the configuration costs on top of weights,
gradients and optimiser state.

    python bench/bench_memory.py              # Qwen2 hidden 512, 8 layers, 16 sequences x 256 tokens, GRPO
    python bench/bench_memory.py --quick      # tiny sizes, 1 repeat, 2 configurations: proves the script runs

Last line: RESULT memory <peak growth without either knob / peak growth with both> (higher is better).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = (("baseline", False, False), ("micro-batching", False, True), ("gradient checkpointing", True, False),
           ("checkpointing + micro-batching", True, True))


def kib(field):
    """A field of /proc/self/status in KiB, e.g. kib("VmHWM")."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(args, checkpointing, micro_batch):
    """One update in this process; prints {"peak_mib", "before_mib"} as JSON."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, ROOT)
    import train

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True))
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    B, T, G = args.batch, args.seq_len, 2
    ids = torch.randint(1, args.vocab, (B, T))  # [B, T]
    policy_mask = (torch.arange(T) >= T // 4).float().expand(B, T).contiguous()  # [B, T], the last 3/4 sampled
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "policy_mask": policy_mask,
             "token_rewards": torch.zeros(B, T)}
    rewards = torch.randn(G, B // G)  # [G, K]
    a = train.Args(algo="grpo", groups=G, group_size=B // G, mini_batch_size=B, micro_batch=micro_batch)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-5)]
    autocast = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731

    def update():
        train.update(a, model, None, optimizers, None, batch, rewards, autocast, torch.Generator().manual_seed(0))
        model.zero_grad(set_to_none=True)

    update()  # warm-up: AdamW state exists from here on
    before = kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    update()
    print(json.dumps({"peak_mib": (kib("VmHWM") - before) / 1024, "before_mib": before / 1024}))


def measure(args, checkpointing, micro_batch):
    command = [sys.executable, os.path.abspath(__file__), "--child", json.dumps([checkpointing, micro_batch])]
    for name in ("threads", "hidden", "layers", "vocab", "batch", "seq_len"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(command, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"configuration failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16, help="sequences in the update (one mini-batch)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per pass when micro-batching")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        checkpointing, micro_batch = json.loads(args.child)
        return child(args, checkpointing, micro_batch)
    if args.quick:
        args.hidden, args.layers, args.vocab, args.batch, args.seq_len, args.micro_batch = 64, 2, 64, 4, 32, 2
        args.repeats = 1
    configs = (CONFIGS[0], CONFIGS[-1]) if args.quick else CONFIGS  # quick: the two ends only

    peaks, before = {}, {}
    for _ in range(args.repeats):
        for name, checkpointing, micro in configs:
            result = measure(args, checkpointing, args.micro_batch if micro else args.batch)
            peaks.setdefault(name, []).append(result["peak_mib"])
            before[name] = result["before_mib"]
    peak = {name: statistics.median(v) for name, v in peaks.items()}

    print(f"Qwen2: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; torch threads {args.threads}; "
          f"GRPO update of {args.batch} sequences x {args.seq_len} tokens, one optimiser step; micro-batch "
          f"{args.micro_batch} when on; median of {args.repeats}; each configuration in a fresh process")
    print(f"{'configuration':<34}{'peak growth MiB':>17}{'vs baseline':>13}{'RSS before MiB':>16}")
    for name, _, _ in configs:
        print(f"{name:<34}{peak[name]:>17.1f}{peak[name] / peak['baseline']:>13.2f}{before[name]:>16.1f}")
    print(f"RESULT memory {peak['baseline'] / max(peak['checkpointing + micro-batching'], 1e-3):.2f}")


if __name__ == "__main__":
    main()
