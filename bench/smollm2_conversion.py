"""The first load of SmolLM2 (its GGUF file de-quantised to float32 by transformers): with the
file read once (`models.load_smollm2`) against transformers' own way, side by side.

    python bench/smollm2_conversion.py              # 2 repeats, 2 threads: about 3 minutes
    python bench/smollm2_conversion.py --repeats 1

transformers reads a Llama GGUF file three times (for the config, the tokenizer and the weights)
and builds gguf's tensor-name map once per module; `models._gguf_read_once` makes each once while
it converts. The two ways take turns (plain first, then read once, each into a fresh temporary
cache), so a change in the machine's load hits both; the weights and the tokenizer's vocabulary
must come out identical. Not named bench_*.py, so run_all.py leaves it out: it takes minutes.
RESULT: the plain conversion's median seconds / the read-once conversion's.
"""
import contextlib
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its siblings
from arguments import Parser, at_least, parse, refuse, thread_count  # noqa: E402
import torch  # noqa: E402

from plumbing import models  # noqa: E402 (arguments put the project on the path)


def convert(read_once):
    """(seconds, model, tokenizer) of one conversion into a fresh cache folder."""
    saved = models._gguf_read_once
    if not read_once:  # transformers' own way: nothing kept between its three reads
        models._gguf_read_once = contextlib.nullcontext
    try:
        with tempfile.TemporaryDirectory() as folder:
            start = time.perf_counter()
            model, tokenizer = models.load_smollm2(os.path.join(folder, "smollm2"))
            return time.perf_counter() - start, model, tokenizer
    finally:
        models._gguf_read_once = saved


def main():
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=at_least(1), default=2, help="conversions each way")
    parser.add_argument("--threads", type=thread_count, default=2)
    args = parse(parser)
    torch.set_num_threads(args.threads)
    try:
        models.smollm2_gguf()
    except models.ModelError as e:
        refuse(str(e))
    print(f"threads {args.threads}, {args.repeats} conversion(s) each way, taking turns")
    seconds = {False: [], True: []}
    for _ in range(args.repeats):
        for read_once in (False, True):
            t, model, tokenizer = convert(read_once)
            seconds[read_once].append(t)
            state = {k: v.clone() for k, v in model.state_dict().items()}
            if read_once:
                same = state.keys() == plain.keys() and all(torch.equal(state[k], plain[k])
                                                            for k in plain)
                if not same or tokenizer.get_vocab() != plain_vocab:
                    refuse("the two conversions differ")
            else:
                plain, plain_vocab = state, tokenizer.get_vocab()
            print(f"  {'read once' if read_once else 'plain':9s} {t:6.1f} s", flush=True)
    plain_s, once_s = statistics.median(seconds[False]), statistics.median(seconds[True])
    print(f"median: plain {plain_s:.1f} s, read once {once_s:.1f} s; the weights and the "
          f"vocabulary identical")
    print(f"RESULT smollm2_conversion {plain_s / once_s:.2f}")


if __name__ == "__main__":
    main()
