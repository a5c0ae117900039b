"""Run every bench/bench_*.py one after the other and print their RESULT lines together at the end.

    python bench/run_all.py                                   # full sizes (each script < 5 minutes on CPU)
    python bench/run_all.py --quick                           # every script's --quick mode

bench_gpu.py's full size needs a GPU (a 0.5B model on a CPU takes hours); without
one only its --quick mode runs. Exit status 1 when any script fails.
"""

import glob
import os
import subprocess
import sys

# the bench's siblings; arguments first: it lets OpenMP's threads sleep before torch loads
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arguments import Parser, parse, thread_count  # noqa: E402
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # its siblings, however loaded


def main():
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to every script")
    parser.add_argument(
        "--threads", type=thread_count, default=2,
        help="passed to every script (torch.set_num_threads)"
    )
    args = parse(parser)

    results, failed = [], []
    for script in sorted(glob.glob(os.path.join(HERE, "bench_*.py"))):
        name = os.path.basename(script)
        quick = args.quick or (name == "bench_gpu.py" and not torch.cuda.is_available())
        command = [sys.executable, script, "--threads", str(args.threads)] + (["--quick"] if quick else [])
        print(f"== {' '.join(command)}", flush=True)
        out = subprocess.run(command, capture_output=True, text=True)
        print(out.stdout, flush=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            print(out.stderr[-3000:])
            failed.append(name)
            results.append(f"{name}: FAILED (exit {out.returncode})")
        else:
            results.append(lines[-1])
    print("== results (higher is better)")
    print("\n".join(results))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
