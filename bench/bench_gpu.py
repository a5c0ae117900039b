"""Memory and time of one training step on a GPU, for Qwen2.5's model shapes at worst-case lengths.

    python bench/bench_gpu.py --all                                    # the README table: sizes x algorithms x LoRA
    python bench/bench_gpu.py --size 0.5b --algo ppo --budget-gb 24    # one row; 24 GiB enforced on a larger GPU
    python bench/bench_gpu.py --quick                                  # a tiny model on the CPU: the script runs

Without a GPU only --quick runs, unless --cpu asks for a row on the CPU (a 0.5B step there takes hours).

Nothing can be downloaded, so each model is a Qwen2ForCausalLM built from Qwen2.5's published shapes
with random weights, and the tokenizer is a word-level one over Qwen's 151,936 ids. A random model
practically never writes the end-of-turn token (one id in 151,936), so every turn runs to the token
limit and every answer earns the format penalty: 5 full turns, the longest transcripts a real run
can reach. Each row is two train.py steps (8 groups x 16 rollouts, the MI diagnosis at step 1 only,
its time apart in time_scoring; no validation) through train.py's own code, in a fresh process; micro-batch and gradient checkpointing
are what train.py chooses for the budget (memory.memory_plan) unless given. With --budget-gb the
process may allocate only that much (torch.cuda.set_per_process_memory_fraction): a row that fits
has really fit in that budget.

Each row prints one JSON object; the script ends with RESULT gpu <rows that fit / rows run>.
"""

import json
import os
import subprocess
import sys
import time

# the bench's siblings; arguments first: it lets OpenMP's threads sleep before torch loads
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arguments import Parser, at_least, parse, thread_count  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# Qwen2.5 base and -Instruct: hidden, intermediate, layers, attention heads, key-value heads
SHAPES = {
    "0.5b": (896, 4864, 24, 14, 2),
    "1.5b": (1536, 8960, 28, 12, 2),
    "3b": (2048, 11008, 36, 16, 2),
    "tiny": (64, 128, 2, 4, 2),
    "smollm2": (576, 1536, 30, 9, 3),  # SmolLM2-135M's (a Llama: here a Qwen2, q/k/v biases added)
}
VOCAB = 151_936
VOCABS = {"smollm2": 49_152}  # a size's own vocabulary where it is not Qwen's


def qwen_shaped(size, device, vocab_size=None):
    """A random Qwen2ForCausalLM with Qwen2.5's shapes, in float32 on `device`, and a word-level
    tokenizer over its vocab (vocab_size: the size's own, VOCABS, else Qwen's 151,936, unless a
    test asks for fewer)."""
    vocab_size = vocab_size or VOCABS.get(size, VOCAB)
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from warmstart import tiny

    hidden, inter, layers, heads, kv = SHAPES[size]
    base = tiny.build_tokenizer()
    vocab = dict(base.get_vocab())
    for i in range(len(vocab), vocab_size):
        vocab[f"<t{i}>"] = i
    core = Tokenizer(
        models.WordLevel({k: v for k, v in vocab.items() if v < vocab_size - 3}, unk_token=tiny.UNK)
    )
    core.pre_tokenizer = pre_tokenizers.Split(tiny.Regex(tiny.PIECE), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True) for t in tiny.SPECIAL])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=tiny.UNK,
        chat_template=tiny.CHAT_TEMPLATE,
    )
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model, tokenizer


def one_row(args):
    import train
    from plumbing import memory, models
    from plumbing.flags import parse_args

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and args.budget_gb:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.budget_gb * 2**30 / total))
    # --quick proves the script runs: "tiny" shapes and bench_memory's quick vocabulary of 4,096
    model, tokenizer = qwen_shaped(args.size, device, 4096 if args.quick else VOCAB)
    flags = [
        "--env",
        "sokoban",
        "--algo",
        args.algo,
        "--model",
        f"qwen2.5-{args.size}-shaped",
        "--steps",
        "2",
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--lora",
        str(args.lora),
        "--mi-every",
        "3",  # the diagnosis at step 1 only: step 2 is a step without it
        "--val-every",
        "0",
        "--val-seeds",
        "1",
        "--save-every",
        "0",
        "--no-plot",
        "--filter",
        "none",
        "--out",
        os.path.join(args.out, f"{args.size}-{args.algo}-lora{args.lora}-{time.time_ns()}"),
    ]
    if args.quick:
        flags += ["--groups", "2", "--group-size", "2", "--max-turns", "2", "--probe-prompts", "2",
                  "--probe-samples", "2"]
    flags += ["--micro-batch", str(args.micro_batch)] if args.micro_batch else []
    flags += ["--grad-checkpointing"] if args.grad_checkpointing else []
    a = parse_args(train.Args, flags)
    if (
        device.type == "cuda"
        and args.budget_gb
        and (a.micro_batch is None or a.grad_checkpointing is None)
    ):
        n_all = sum(p.numel() for p in model.parameters())
        # adapters: about 1% at rank 16 on all linear layers
        n_train = n_all if not args.lora else n_all // 100
        a.micro_batch, a.grad_checkpointing, a.rollout_batch, _ = memory.memory_plan(
            a, model.config, n_all, n_train, args.budget_gb * 2**30
        )
    models.load_policy = lambda *args: (model, tokenizer, {})
    row = {
        "size": args.size,
        "algo": args.algo,
        "lora": args.lora,
        "max_new_tokens": args.max_new_tokens,
        "budget_gb": args.budget_gb,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    code = train.main(
        flags
        + (["--micro-batch", str(a.micro_batch)] if a.micro_batch else [])
        + (["--rollout-batch", str(a.rollout_batch)] if a.rollout_batch else [])
        + (["--grad-checkpointing"] if a.grad_checkpointing else ["--no-grad-checkpointing"])
    )
    row.update(
        micro_batch=a.micro_batch,
        grad_checkpointing=bool(a.grad_checkpointing),
        rollout_batch=a.rollout_batch,
        exit_code=code,
    )
    metrics = os.path.join(flags[flags.index("--out") + 1], "metrics.jsonl")
    if code == 0 and os.path.isfile(metrics):
        first, m = [json.loads(line) for line in open(metrics).read().splitlines()][-2:]
        row["time_diagnosis"] = round(first["time_scoring"], 2)  # step 1's; step 2 has none
        row.update(
            {
                k: round(m[k], 2)
                for k in (
                    "time_rollout",
                    "time_scoring",
                    "time_update",
                    "time_step",
                    "gpu_peak_gb",
                    "response_length",
                )
                if k in m
            }
        )
    print(json.dumps(row), flush=True)
    return row


def main(argv=None):
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="0.5b", choices=tuple(SHAPES))
    parser.add_argument("--algo", default="ppo", choices=("ppo", "grpo"))
    parser.add_argument("--lora", type=at_least(0), default=0)
    parser.add_argument("--max-new-tokens", type=at_least(1), default=128)
    parser.add_argument(
        "--budget-gb", type=float, default=0, help="allocate at most this much (0 = the GPU's)"
    )
    parser.add_argument("--micro-batch", type=at_least(0), default=0)
    parser.add_argument("--grad-checkpointing", action="store_true")
    parser.add_argument("--out", default="/tmp/bench_gpu")
    parser.add_argument(
        "--all", action="store_true", help="every size x algorithm x (full, LoRA 16)"
    )
    parser.add_argument("--threads", type=thread_count, default=2)
    parser.add_argument(
        "--quick", action="store_true", help="a tiny model, small sizes: the script runs"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="run without a GPU anyway (a 0.5B step takes hours)"
    )
    parser.add_argument("--save-to", help="only save the --size model (random weights) and its "
                                          "tokenizer to this folder, for train.py --model")
    args = parse(parser, argv)
    if args.save_to:
        model, tokenizer = qwen_shaped(args.size, torch.device("cpu"))
        model.save_pretrained(args.save_to)
        tokenizer.save_pretrained(args.save_to)
        print(f"saved {args.size}'s shapes, random weights, to {args.save_to}")
        return 0
    if not (args.quick or args.cpu or torch.cuda.is_available()):
        print("error: no GPU found: these rows measure GPU memory and time; --quick runs a tiny "
              "model on the CPU, --cpu runs the rows there anyway", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    if args.quick:
        args.size, args.max_new_tokens = "tiny", 8
    if args.quick or not args.all:
        print(f"RESULT gpu {float(one_row(args)['exit_code'] == 0):.3f}")
        return 0
    fitted = 0
    rows = [
        (size, algo, lora)
        for size in ("0.5b", "1.5b", "3b")
        for algo in ("ppo", "grpo")
        for lora in (0, 16)
    ]
    for size, algo, lora in rows:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--size",
                size,
                "--algo",
                algo,
                "--lora",
                str(lora),
                "--max-new-tokens",
                str(args.max_new_tokens),
                "--budget-gb",
                str(args.budget_gb),
                "--out",
                args.out,
            ]
            + (["--cpu"] if args.cpu else []),
            capture_output=True,
            text=True,
        )
        line = [x for x in out.stdout.splitlines() if x.startswith("{")]
        print(
            (
                line[-1]
                if line
                else json.dumps(
                    {
                        "size": size,
                        "algo": algo,
                        "lora": lora,
                        "failed": out.stderr.strip().splitlines()[-1:],
                    }
                )
            ),
            flush=True,
        )
        fitted += bool(line) and json.loads(line[-1]).get("exit_code") == 0
    print(f"RESULT gpu {fitted / len(rows):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
