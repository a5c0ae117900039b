"""The decode loop (plumbing/sampler.py) against an earlier commit's sampler, side by side in one
run: tokens a second, a decode step's time and the memory bandwidth it reaches, and how exactly
each records the log-probs it sampled with.

    python bench/bench_decode.py                          # tiny and SmolLM2, float32 (and
                                                          # bfloat16 where the CPU computes it fast)
    python bench/bench_decode.py --model smollm2 --dtype bfloat16
    python bench/bench_decode.py --commit 97f350b         # the sampler to compare with
    python bench/bench_decode.py --quick                  # tiny sizes, 1 repeat

Each side samples the same rollouts (rollout.play, FrozenLake, G groups x K, the same seed) with the
same model: the tiny policy with random weights at the main command's batch (8 x 16, 3 turns of 64
tokens: it never stops, so every turn runs to the limit) and SmolLM2-135M-Instruct, pretrained,
reading the coordinates at the README's SmolLM2 sizes (4 x 4, 2 turns of 40). The two sides take
turns, so a change in the machine's load hits both. The earlier sampler is read from git (`git
show COMMIT:plumbing/sampler.py`) and imported beside the current one.

Per side: tokens sampled a second over the whole rollout (prefill and decode); a decode step's
forward pass (one new token a row, the output layer included); the bytes that step reads -- the
weights in the dtype the step computes in, and the keys and values of every slot it attends over
-- over its time, as gpt-fast prints its bandwidth, beside what the machine's memory gives (a large
copy, read and written, best of 5). Exactness: the largest |recorded log-prob - a full forward
pass's| over the sampled tokens (logprobs.policy_logprobs, float32 and without autocast), and how
many episodes the two sides sampled alike (the same uniform numbers meet logits a rounding apart).

Last line: RESULT decode <tokens/s of this loop / the earlier one's, the first model measured>.
"""
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import logprobs  # noqa: E402
import rollout  # noqa: E402
from plumbing import models, sampler  # noqa: E402
from plumbing.runs import cpu_computes_bf16  # noqa: E402
from warmstart import tiny  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its siblings, however loaded
from arguments import Parser, at_least, parse, refuse, thread_count  # noqa: E402

BEFORE = "97f350b"  # the sampler before the static-cache loop: Hugging Face's forward a token
SIZES = {"tiny": dict(groups=8, group_size=16, max_turns=3, max_new_tokens=64),
         "smollm2": dict(groups=4, group_size=4, max_turns=2, max_new_tokens=40)}


def earlier_sampler(commit):
    """plumbing/sampler.py as it was at `commit`, imported as a module of its own."""
    shown = subprocess.run(["git", "-C", ROOT, "show", f"{commit}:plumbing/sampler.py"],
                           capture_output=True, text=True)
    if shown.returncode:
        refuse(f"cannot read the sampler at {commit} from git ({shown.stderr.strip()}); a clone "
               f"with the history is needed")
    path = os.path.join(tempfile.mkdtemp(), f"sampler_{commit}.py")
    with open(path, "w") as f:
        f.write(shown.stdout)
    spec = importlib.util.spec_from_file_location(f"sampler_{commit}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def the_model(name):
    """(model, tokenizer, rollout.play's prompt pieces) in eval mode, float32."""
    if name == "tiny":
        tokenizer = tiny.build_tokenizer()
        return tiny.build_model(tokenizer, seed=0).eval(), tokenizer, tiny.prompts("frozenlake")
    model, tokenizer = models.load_smollm2()
    return model.eval(), tokenizer, models.real_prompt("frozenlake", "coords")


def timed_steps(model, side, record):
    """Time every decode step's forward pass (one new token a row) of `side`, adding (seconds,
    bytes read) to `record`: a wrapper around the earlier sampler's model call, or the current
    one's `forward`. Returns what undoes it."""
    cfg = model.config
    kv = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size //
                                                                cfg.num_attention_heads)

    def weights():  # in the dtype the step computes in
        size = 2 if torch.is_autocast_enabled("cpu") else 4
        return sum(p.numel() for p in model.parameters()) * size

    if side == "now":
        forward = sampler.forward

        def step(lm, cache, ids, positions, slots, end):
            t = time.perf_counter()
            out = forward(lm, cache, ids, positions, slots, end)
            if ids.shape[1] == 1:
                read = weights() + len(ids) * end * kv * cache.keys[0].element_size()
                record.append((time.perf_counter() - t, read))
            return out
        sampler.forward = step
        return lambda: setattr(sampler, "forward", forward)
    call = model.forward

    def step(*args, **kwargs):
        t = time.perf_counter()
        out = call(*args, **kwargs)
        ids = kwargs["input_ids"]
        if ids.shape[1] == 1:
            size = 2 if torch.is_autocast_enabled("cpu") else 4
            read = weights() + len(ids) * kwargs["attention_mask"].shape[1] * kv * size
            record.append((time.perf_counter() - t, read))
        return out
    model.forward = step
    return lambda: setattr(model, "forward", call)


def sample(model, tokenizer, prompt, make_policy, sizes, seed, autocast):
    """One rollout of every episode -> (episodes, seconds, [(step seconds, bytes)])."""
    policy = make_policy(model, tokenizer, sizes["max_new_tokens"])
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        t = time.perf_counter()
        episodes = rollout.play(policy, tokenizer, "frozenlake", list(range(sizes["groups"])),
                                sizes["group_size"], max_turns=sizes["max_turns"], **prompt)
        return episodes, time.perf_counter() - t


def exactness(model, tokenizer, episodes):
    """The largest |recorded log-prob - a full float32 forward pass's| over the sampled tokens."""
    batch = rollout.collate(episodes, rollout.pad_token_id(tokenizer))
    mask = batch["policy_mask"][:, 1:]
    with torch.no_grad():
        logp, _ = logprobs.policy_logprobs(model, batch["input_ids"], mask)
    return ((logp - batch["logprobs"][:, 1:]).abs() * mask).max().item()


def copy_bandwidth(megabytes=256):
    """The machine's memory bandwidth as a large copy sees it: bytes read and written a second,
    best of 5."""
    src = torch.empty(megabytes * 2 ** 20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best


def measure(name, dtype, earlier, repeats, sizes):
    """Both sides on one model and dtype -> a dict of the numbers."""
    model, tokenizer, prompt = the_model(name)
    sides = {"before": earlier.hf_policy, "now": sampler.hf_policy}
    seconds, tokens, steps, last = {s: [] for s in sides}, {}, {s: [] for s in sides}, {}
    autocast = dtype == "bfloat16"
    for r in range(repeats):
        for side, make in sides.items():
            record = []
            undo = timed_steps(model, side, record)
            try:
                episodes, s = sample(model, tokenizer, prompt, make, sizes, r, autocast)
            finally:
                undo()
            seconds[side].append(s)
            tokens[side] = sum(sum(e.response_lengths) for e in episodes)
            steps[side] += record
            last[side] = episodes
    out = {"model": name, "dtype": dtype}
    for side in sides:
        step = statistics.median(t for t, _ in steps[side])
        out[side] = {"tokens_per_s": tokens[side] / statistics.median(seconds[side]),
                     "step_ms": 1000 * step,
                     "gb_per_s": statistics.median(b / t for t, b in steps[side]) / 1e9,
                     "logprob_diff": exactness(model, tokenizer, last[side])}
    alike = [a.ids == b.ids for a, b in zip(last["before"], last["now"])]
    out["alike"] = sum(alike) / len(alike)
    return out


def main(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("tiny", "smollm2", "both"), default="both")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "auto"), default="auto",
                   help="auto: float32, and bfloat16 too where the CPU computes it fast")
    p.add_argument("--commit", default=BEFORE, help="the earlier sampler's commit")
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--threads", type=thread_count, default=min(2, os.cpu_count() or 1))
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat, the tiny policy")
    a = parse(p, argv, quick={"repeats": 1, "model": "tiny"})
    torch.set_num_threads(a.threads)
    earlier = earlier_sampler(a.commit)
    names = ("tiny", "smollm2") if a.model == "both" else (a.model,)
    dtypes = ((["float32"] + (["bfloat16"] if cpu_computes_bf16() else []))
              if a.dtype == "auto" else [a.dtype])
    sizes = {k: dict(v, groups=2, group_size=2) if a.quick else v for k, v in SIZES.items()}
    peak = copy_bandwidth(16 if a.quick else 256) / 1e9
    print(f"{a.threads} threads; {'this CPU computes bfloat16 natively' if cpu_computes_bf16() else 'no AVX512-BF16 or AMX on this CPU: float32 only unless asked'}; "
          f"a large copy moves {peak:.1f} GB/s (read + write); against {a.commit}")
    print(f"{'model':8} {'dtype':9} {'side':7} {'tokens/s':>9} {'step ms':>8} {'GB/s':>6} "
          f"{'% copy':>7} {'|dlogp|':>9}")
    results = []
    for name in names:
        for dtype in dtypes:
            r = measure(name, dtype, earlier, a.repeats, sizes[name])
            results.append(r)
            for side in ("before", "now"):
                s = r[side]
                print(f"{name:8} {dtype:9} {side:7} {s['tokens_per_s']:9.0f} {s['step_ms']:8.2f} "
                      f"{s['gb_per_s']:6.2f} {100 * s['gb_per_s'] / peak:6.1f}% "
                      f"{s['logprob_diff']:9.2e}")
            print(f"{name:8} {dtype:9} sampled alike: {r['alike']:.2f} of the episodes; "
                  f"tokens/s now / before: {r['now']['tokens_per_s'] / r['before']['tokens_per_s']:.2f}")
    first = results[0]
    print(f"RESULT decode {first['now']['tokens_per_s'] / first['before']['tokens_per_s']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
