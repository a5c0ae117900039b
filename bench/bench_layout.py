"""The sampler's weight layout on this CPU: F.linear(x, W) against x @ W^T with W^T contiguous, at a
decode step's few rows, in float32 and bfloat16, and what plumbing/hardware.py chooses here.

    python bench/bench_layout.py            # SmolLM2's projections at 4, 16 and 64 rows, 1 thread
    python bench/bench_layout.py --quick    # the down projection at 16 rows, a few repeats

SmolLM2-135M's matrices: its output layer (576 -> 49,152), its MLP's gate and up together
(576 -> 3,072, as the sampler joins them) and its down projection (1,536 -> 576). Each product is
timed in turns with the other layout (best of the repeats), as GFLOPS. Last line: RESULT layout
<the chosen layout's speed over the other's, float32, the output layer at 16 rows (--quick: the
down projection)>.
"""
import os
import sys
import time

# the bench's siblings; arguments first: it lets OpenMP's threads sleep before torch loads
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arguments import Parser, at_least, parse, thread_count  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing import hardware  # noqa: E402

SHAPES = {"output layer": (49_152, 576), "gate and up": (3_072, 576), "down": (576, 1_536)}


def gflops(fn, flops, repeats):
    """The best of `repeats` timings of fn, as GFLOPS (one call first, untimed)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return flops / best / 1e9


def main(argv=None):
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=thread_count, default=1, help="torch.set_num_threads")
    parser.add_argument("--repeats", type=at_least(1), default=20)
    parser.add_argument("--quick", action="store_true", help="the down projection at 16 rows")
    args = parse(parser, argv, quick=dict(repeats=3))
    torch.set_num_threads(args.threads)
    flags = hardware.cpu_flags()
    shapes = {"down": SHAPES["down"]} if args.quick else SHAPES
    print(f"{args.threads} thread(s); flags: " + (", ".join(sorted(
        f for f in flags if f.startswith(("avx512", "amx")) or f == "avx2")) or "none read"))
    print(f"{'dtype':9} {'matrix':13} {'rows':>4} {'F.linear':>9} {'x @ W^T':>9}   chosen here")
    result = None
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        transposed = hardware.transposed_weights("cpu", name, flags)
        for matrix, (out_f, in_f) in shapes.items():
            for rows in ((16,) if args.quick else (4, 16, 64)):
                w = torch.randn(out_f, in_f, dtype=dtype)                     # [out, in]
                wt = w.t().contiguous()                                        # [in, out]
                x = torch.randn(rows, in_f, dtype=dtype)                       # [rows, in]
                flops = 2 * rows * out_f * in_f
                plain = gflops(lambda: F.linear(x, w), flops, args.repeats)
                copy = gflops(lambda: x @ wt, flops, args.repeats)
                print(f"{name:9} {matrix:13} {rows:4} {plain:9.1f} {copy:9.1f}   "
                      f"{'x @ W^T' if transposed else 'F.linear'}", flush=True)
                if dtype == torch.float32 and rows == 16 and (result is None
                                                               or matrix == "output layer"):
                    result = copy / plain if transposed else plain / copy
    print(f"RESULT layout {result:.3f}")


if __name__ == "__main__":
    main()
