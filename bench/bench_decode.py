"""The decode loop (plumbing/sampler.py) against an earlier commit's sampler, side by side in one
run: tokens a second, a decode step's time and the memory bandwidth it reaches, and how exactly
each records the log-probs it sampled with.

    python bench/bench_decode.py                          # tiny and SmolLM2, float32 (and
                                                          # bfloat16 where the CPU computes it fast)
    python bench/bench_decode.py --model smollm2 --dtype bfloat16
    python bench/bench_decode.py --device cuda            # SmolLM2 and Qwen2.5-0.5B's shapes
    python bench/bench_decode.py --commit 97f350b         # the sampler to compare with
    python bench/bench_decode.py --quick                  # tiny sizes, 1 repeat

Each side samples the same rollouts (rollout.play, FrozenLake, G groups x K, the same seed) with the
same model: the tiny policy with random weights at the main command's batch (8 x 16, 3 turns of 64
tokens: it never stops, so every turn runs to the limit); SmolLM2-135M-Instruct, pretrained,
reading the coordinates at the README's SmolLM2 sizes (4 x 4, 2 turns of 40); on a GPU, random
weights with Qwen2.5-0.5B's shapes (bench_gpu.qwen_shaped; 8 x 16, 2 turns of 128). The two sides
take turns, so a change in the machine's load hits both. The earlier sampler is read from git
(`git show COMMIT:plumbing/sampler.py`) and imported beside the current one.

Per side: tokens sampled a second over the whole rollout (prefill and decode); a decode step (the
sampling of a token a row and the forward pass of those tokens, from one step to the next, the
device waited for); the bytes that step reads -- the weights in the dtype it computes in, and the
keys and values of every slot it attends over -- over its time, as gpt-fast prints its bandwidth,
beside what the device's memory gives (a large copy, read and written, best of 5). Exactness: the
largest |recorded log-prob - a full forward pass's| over the sampled tokens
(logprobs.policy_logprobs, float32 and without autocast), and how many episodes the two sides
sampled alike (the same uniform numbers meet logits a rounding apart).

Last line: RESULT decode <tokens/s of this loop / the earlier one's, the first model measured>.
"""
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

# the bench's siblings; arguments first: it lets OpenMP's threads sleep before torch loads
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arguments import Parser, at_least, parse, refuse, thread_count  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import logprobs  # noqa: E402
import rollout  # noqa: E402
from plumbing import hardware, models, sampler  # noqa: E402
from warmstart import tiny  # noqa: E402


BEFORE = "97f350b"  # the sampler before the static-cache loop: Hugging Face's forward a token
SIZES = {"tiny": dict(groups=8, group_size=16, max_turns=3, max_new_tokens=64),
         "smollm2": dict(groups=4, group_size=4, max_turns=2, max_new_tokens=40),
         "qwen0.5b": dict(groups=8, group_size=16, max_turns=2, max_new_tokens=128)}


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


def the_model(name, device):
    """(model, tokenizer, rollout.play's prompt pieces) in eval mode, float32, on `device`."""
    if name == "tiny":
        tokenizer = tiny.build_tokenizer()
        return (tiny.build_model(tokenizer, seed=0).eval().to(device), tokenizer,
                tiny.prompts("frozenlake"))
    if name == "qwen0.5b":  # random weights with Qwen2.5-0.5B's shapes: it never stops
        from bench_gpu import qwen_shaped
        model, tokenizer = qwen_shaped("0.5b", device)
        return model.eval(), tokenizer, tiny.prompts("frozenlake")
    model, tokenizer = models.load_smollm2()
    return model.eval().to(device), tokenizer, models.real_prompt("frozenlake", "coords")


def timed_steps(model, side, record):
    """Record a decode step of `side` -- one pass of its loop: the sampling of a token a row,
    then the forward pass of those tokens -- as (seconds, bytes read), from one call of the
    loop's recurring function to the next (the earlier sampler's model call with one token a
    row, the current one's `sample`), the device waited for at each. Bytes: the weights in the
    dtype the step computes in, and the keys and values of every slot it attends over. Returns
    what undoes the wrapping."""
    cfg, device = model.config, model.device
    kv = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size //
                                                                cfg.num_attention_heads)
    size = 2 if torch.is_autocast_enabled(device.type) else 4
    weights = sum(p.numel() for p in model.parameters()) * size
    last = {}

    def tick(rows, slots):
        if device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        if last.get("rows") == rows:  # a step of the same loop: the time since the last one
            record.append((now - last["t"], weights + rows * slots * kv * size))
        last.update(t=now, rows=rows)

    if side == "now":
        sample_ = sampler.sample

        def sample(logits, *args):
            rows = len(logits)
            tick(rows, max(1, getattr(sample, "slots", 1)))
            return sample_(logits, *args)
        forward = sampler.forward

        def track(lm, cache, ids, positions, slots, end):  # the slots a step attends over
            sample.slots = end
            return forward(lm, cache, ids, positions, slots, end)
        sampler.sample, sampler.forward = sample, track

        def undo():
            sampler.sample, sampler.forward = sample_, forward
        return undo
    call = model.forward

    def step(*args, **kwargs):
        ids = kwargs["input_ids"]
        if ids.shape[1] == 1:
            tick(len(ids), kwargs["attention_mask"].shape[1])
        else:
            last.clear()  # a prompt: the next step starts a new run of steps
        return call(*args, **kwargs)
    model.forward = step
    return lambda: setattr(model, "forward", call)


def sample(model, tokenizer, prompt, make_policy, sizes, seed, autocast):
    """One rollout of every episode -> (episodes, seconds)."""
    policy = make_policy(model, tokenizer, sizes["max_new_tokens"])
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


def measure(name, dtype, earlier, repeats, sizes, device):
    """Both sides on one model and dtype -> a dict of the numbers."""
    model, tokenizer, prompt = the_model(name, device)
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
    p.add_argument("--model", default=None,
                   help="comma-separated: tiny, smollm2, qwen0.5b (a GPU's random Qwen2.5-0.5B "
                        "shapes); default tiny,smollm2 (GPU: smollm2,qwen0.5b)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "auto"), default="auto",
                   help="auto: float32, and bfloat16 too where the device computes it fast")
    p.add_argument("--commit", default=BEFORE, help="the earlier sampler's commit")
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--threads", type=thread_count, default=min(2, os.cpu_count() or 1))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat, the tiny policy")
    a = parse(p, argv, quick={"repeats": 1, "model": "tiny"})
    if a.device == "cuda" and not torch.cuda.is_available():
        refuse("--device cuda: no GPU here")
    device = torch.device(a.device)
    torch.set_num_threads(a.threads)
    earlier = earlier_sampler(a.commit)
    gpu = device.type == "cuda"
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
    print(f"{what}; a large copy moves {peak:.1f} GB/s (read + write); against {a.commit}")
    print(f"{'model':8} {'dtype':9} {'side':7} {'tokens/s':>9} {'step ms':>8} {'GB/s':>7} "
          f"{'% copy':>7} {'|dlogp|':>9}")
    results = []
    for name in names:
        for dtype in dtypes:
            r = measure(name, dtype, earlier, a.repeats, sizes[name], device)
            results.append(r)
            for side in ("before", "now"):
                s = r[side]
                print(f"{name:8} {dtype:9} {side:7} {s['tokens_per_s']:9.0f} {s['step_ms']:8.2f} "
                      f"{s['gb_per_s']:7.2f} {100 * s['gb_per_s'] / peak:6.1f}% "
                      f"{s['logprob_diff']:9.2e}")
            ratio = r["now"]["tokens_per_s"] / r["before"]["tokens_per_s"]
            print(f"{name:8} {dtype:9} sampled alike: {r['alike']:.2f} of the episodes; "
                  f"tokens/s now / before: {ratio:.2f}")
    first = results[0]
    print(f"RESULT decode {first['now']['tokens_per_s'] / first['before']['tokens_per_s']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
