"""Shared cores: how much one busy process beside it slows a small fixed CPU workload, with
OpenMP's default waiting (threads spin at every barrier) and with the passive policy train.py and
trl_ragen.py now set (OMP_WAIT_POLICY=PASSIVE: a waiting thread sleeps).

The workload is the tiny policy's shape (hidden 64, 2 layers, 4 heads, feed-forward 128, a
500-token vocabulary; torch's own transformer layers, so that a fresh process needs no
transformers): --passes forward/backward passes of a batch of 16 x 128 tokens on --threads threads
(default 2, the tiny policy's). Its matrices are small, so each pass is many short parallel
regions, each ending at a barrier: where a thread spins there instead of sleeping, a busy process
on the same cores takes turns with the spinning thread, not with the work. OpenMP reads the policy
once, when torch loads it, so each policy runs in a fresh process that times the passes alone and
then beside one busy process (a Python loop); the two policies take turns for --repeats rounds,
and each cell is the median.

    python bench/bench_shared_cores.py            # 40 passes, 3 rounds
    python bench/bench_shared_cores.py --quick    # 2 passes, 1 round: proves the script still runs

Last line: RESULT shared_cores <slowdown beside a busy process, default / the same, passive>
(above 1: the passive policy loses less to the other process).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its siblings, however loaded
from arguments import Parser, at_least, parse, thread_count  # noqa: E402

POLICIES = {"default (spin)": None, "passive": "PASSIVE"}


def workload(threads, passes):
    """{"idle": seconds, "busy": seconds} of `passes` forward/backward passes of the
    tiny-policy-shaped model, alone and then beside one busy process (this process's OpenMP
    runtime, loaded once, serves both)."""
    import time

    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    vocab, width = 500, 64
    layer = torch.nn.TransformerEncoderLayer(width, 4, 128, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, width),
                                torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                                torch.nn.Linear(width, vocab))
    tokens = torch.randint(0, vocab, (16, 128))                                       # [B, T]

    def passes_seconds():
        start = time.perf_counter()
        for _ in range(passes):
            model.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(tokens[:, :-1]).reshape(-1, vocab),
                                              tokens[:, 1:].reshape(-1)).backward()
        return time.perf_counter() - start

    passes_seconds()  # warm-up: allocations, kernels chosen
    out = {"idle": passes_seconds()}
    other = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # until it spins
        out["busy"] = passes_seconds()
    finally:
        other.kill()
        other.wait()
    return out


def measure(policy, threads, passes):
    """workload's seconds in a fresh process with OMP_WAIT_POLICY `policy` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update({"OMP_WAIT_POLICY": policy} if policy else {})
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--threads",
                           str(threads), "--passes", str(passes)], capture_output=True, text=True,
                          env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=thread_count, default=2,
                        help="torch threads of the workload")
    parser.add_argument("--passes", type=at_least(1), default=40,
                        help="forward/backward passes timed")
    parser.add_argument("--repeats", type=at_least(1), default=3,
                        help="rounds the four cases take turns")
    parser.add_argument("--quick", action="store_true", help="2 passes, 1 round")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = parse(parser, sys.argv[1:] if argv is None else argv, quick=dict(passes=2, repeats=1))
    if a.worker:
        print(json.dumps(workload(a.threads, a.passes)))
        return 0
    times = {(name, busy): [] for name in POLICIES for busy in (False, True)}
    for _ in range(a.repeats):  # the policies take turns: a change in the machine's load hits both
        for name, policy in POLICIES.items():
            seconds = measure(policy, a.threads, a.passes)
            times[name, False].append(seconds["idle"])
            times[name, True].append(seconds["busy"])
    median = {case: statistics.median(t) for case, t in times.items()}
    slowdown = {name: median[name, True] / median[name, False] for name in POLICIES}
    print(f"threads {a.threads}, {a.passes} forward/backward passes, {os.cpu_count()} cores, "
          f"median of {a.repeats} rounds")
    print(f"{'OMP_WAIT_POLICY':<16} {'idle s':>8} {'beside 1 busy s':>16} {'slowdown':>9}")
    for name in POLICIES:
        print(f"{name:<16} {median[name, False]:>8.3f} {median[name, True]:>16.3f} "
              f"{slowdown[name]:>9.2f}")
    idle = median["passive", False] / median["default (spin)", False]
    print(f"passive / default when idle: {idle:.2f}")
    print(f"RESULT shared_cores {slowdown['default (spin)'] / slowdown['passive']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
