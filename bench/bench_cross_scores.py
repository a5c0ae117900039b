"""Cross-scoring cost: prefix-cache reuse (mi.cross_scores) vs naive re-encoding of every (prompt,
reasoning) pair.

Setting of the paper's diagnostic (Sec. 2.3): N prompts, M sampled reasonings, every reasoning
scored under every prompt. Naive re-encoding runs N x M sequences of (prompt + reasoning) tokens;
mi.cross_scores encodes each prompt once and repeats its key/value cache over the reasonings, so it
runs N x M x (reasoning tokens) plus N x (prompt tokens). With prompts 4x longer than reasonings the
ideal ratio is about 5x. Also reported: the cost relative to one forward pass of the policy over the
batch itself (the M own (prompt + reasoning) sequences), the pass training does anyway.

    python bench/bench_cross_scores.py              # N = 8 prompts, M = 64 samples, tiny Qwen2, CPU
    python bench/bench_cross_scores.py --quick      # tiny sizes, 1 repeat: proves the script still runs

Last line: RESULT cross_scores <speedup of cache reuse over naive re-encoding>.
"""

import os
import statistics
import sys
import time

# the bench's siblings; arguments first: it lets OpenMP's threads sleep before torch loads
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arguments import Parser, at_least, multiple_of, parse, thread_count  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mi  # noqa: E402


def build_word_tokenizer(vocab_size):
    """Word-level tokenizer over the words w0 .. w{vocab_size - 2} plus <pad>: one word = one token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"w{i}": i + 1 for i in range(vocab_size - 1)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>")


def random_texts(count, length, vocab_size, generator):
    ids = torch.randint(1, vocab_size - 1, (count, length), generator=generator)
    return [" ".join(f"w{i}" for i in row.tolist()) for row in ids]


@torch.inference_mode()
def naive_scores(model, tokenizer, prompts, reasonings, batch_size):
    """Re-encode every (prompt, reasoning) pair from scratch, batch_size pairs per forward pass (right-padded)."""
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    reasoning_ids = tokenizer(reasonings, add_special_tokens=False)["input_ids"]
    pairs = [(m, j) for m in range(len(reasonings)) for j in range(len(prompts))]
    scores = torch.zeros(len(reasonings), len(prompts))
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        seqs = [prompt_ids[j] + reasoning_ids[m] for m, j in chunk]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)  # [B, T]
        # [B, T - 1]: 1 where token t + 1 belongs to the reasoning
        target = torch.zeros(len(seqs), width - 1)
        for r, ((m, j), s) in enumerate(zip(chunk, seqs)):
            ids[r, : len(s)] = torch.tensor(s)
            target[r, len(prompt_ids[j]) - 1 : len(s) - 1] = 1.0
        # [B, T]
        mask = (torch.arange(width)[None] < torch.tensor([len(s) for s in seqs])[:, None]).long()
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]  # [B, T - 1, V]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]  # [B, T - 1]
        for r, (m, j) in enumerate(chunk):
            scores[m, j] = (logp[r] * target[r]).sum()
    return scores


@torch.inference_mode()
def policy_forward(model, tokenizer, prompts, reasonings, owner):
    """One forward pass over the batch's own (prompt + reasoning) sequences, with their token log-probs."""
    ids = torch.tensor(
        [
            tokenizer(prompts[j] + " " + z, add_special_tokens=False)["input_ids"]
            for z, j in zip(reasonings, owner)
        ]
    )  # [M, T], equal lengths here
    logits = model(input_ids=ids).logits[:, :-1]  # [M, T - 1, V]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]  # [M, T - 1]


def median_seconds(fns, repeats):
    """Median wall time of each function; the functions take turns within every repeat, so a change
    in the load of a shared machine hits all of them alike. Returns (medians, last results)."""
    times, results = [[] for _ in fns], [None] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            results[i] = fn()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times], results


def main():
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=thread_count, default=2, help="torch.set_num_threads")
    parser.add_argument("--prompts", type=at_least(1), default=8, help="N prompts")
    parser.add_argument("--samples", type=at_least(1), default=64,
                        help="M reasonings (M / N per prompt)")
    parser.add_argument("--prompt-len", type=at_least(1), default=128, help="prompt tokens")
    parser.add_argument("--reasoning-len", type=at_least(1), default=32, help="reasoning tokens")
    parser.add_argument(
        "--batch-size", type=at_least(1), default=64,
        help="sequences per forward pass (both methods)"
    )
    parser.add_argument("--hidden", type=multiple_of(8), default=128)
    parser.add_argument("--layers", type=at_least(1), default=4)
    parser.add_argument("--vocab", type=at_least(3), default=512)  # words w1 .. w{vocab - 2}
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat")
    args = parse(parser, quick=dict(prompts=3, samples=6, prompt_len=16, reasoning_len=4,
                                    hidden=32, layers=1, vocab=64, repeats=1, batch_size=8))
    torch.set_num_threads(args.threads)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    tokenizer = build_word_tokenizer(args.vocab)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=2 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).eval()
    prompts = random_texts(args.prompts, args.prompt_len, args.vocab, generator)
    reasonings = [
        " " + z for z in random_texts(args.samples, args.reasoning_len, args.vocab, generator)
    ]
    owner = [m % args.prompts for m in range(args.samples)]

    # warm-up, then the timed runs
    prompt_ids, reasoning_ids = mi.tokenize(tokenizer, prompts), mi.tokenize(tokenizer, reasonings)
    mi.cross_scores(model, prompt_ids[:1], reasoning_ids[:2], batch_size=2)
    (t_cache, t_naive, t_forward), (cached, naive, _) = median_seconds(
        [
            lambda: mi.cross_scores(
                model, prompt_ids, reasoning_ids, batch_size=args.batch_size
            )[0],
            lambda: naive_scores(model, tokenizer, prompts, reasonings, args.batch_size),
            lambda: policy_forward(model, tokenizer, prompts, reasonings, owner),
        ],
        args.repeats,
    )
    max_diff = (cached - naive).abs().max().item()
    speedup = t_naive / t_cache

    print(
        f"tiny Qwen2: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; torch threads "
        f"{torch.get_num_threads()}; N = {args.prompts} prompts x {args.prompt_len} tokens, M = {args.samples} "
        f"reasonings x {args.reasoning_len} tokens; batch size {args.batch_size}; median of {args.repeats}"
    )
    print(f"{'method':<40}{'seconds':>10}{'x forward':>12}")
    rows = (
        ("naive re-encoding of N x M pairs", t_naive),
        ("prefix-cache reuse (mi.cross_scores)", t_cache),
        ("one policy forward over the M sequences", t_forward),
    )
    for name, seconds in rows:
        print(f"{name:<40}{seconds:>10.3f}{seconds / t_forward:>12.2f}")
    print(f"max |cached - naive| = {max_diff:.2e} (must be < 1e-4)")
    if max_diff >= 1e-4:
        print("FAIL: cached and naive scores differ")
        sys.exit(1)
    print(f"RESULT cross_scores {speedup:.2f}")


if __name__ == "__main__":
    main()
