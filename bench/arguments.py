"""The bench scripts' command lines: a size, count or name they cannot use is one line on stderr
and exit code 2, as train.py's flags are, never a traceback from inside a measurement; --quick's
small sizes fill only the flags not given."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project
from plumbing.flags import Parser, UsageError, polite_threads  # noqa: E402,F401 (Parser: theirs)

polite_threads()  # every bench script imports this module before torch


def at_least(low):
    """An argparse type: a whole number >= low (a size, a count)."""
    def whole(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return whole


def thread_count(text):
    """An argparse type: torch threads, 1 to the machine's cores (more only wait for each other)."""
    value, cores = at_least(1)(text), os.cpu_count() or 1
    if value > cores:
        raise argparse.ArgumentTypeError(f"must be at most the machine's {cores} cores, got "
                                         f"{value}")
    return value


def multiple_of(n):
    """An argparse type: a whole number >= n that n divides (a model's width: its attention heads
    divide it, and rotary embeddings need heads of even width)."""
    def width(text):
        value = at_least(n)(text)
        if value % n:
            raise argparse.ArgumentTypeError(f"must be a multiple of {n}, got {value}")
        return value
    return width


def parse(parser, argv=None, quick=None):
    """The parsed flags; with --quick, the sizes `quick` ({dest: value}) stand in for the defaults
    of the flags not given, so a flag given with --quick is used, not ignored. A refused flag is
    one line and exit code 2."""
    try:
        args = parser.parse_args(argv)
        if quick and args.quick:
            defaults = {k: parser.get_default(k) for k in quick}
            parser.set_defaults(**quick)
            args = parser.parse_args(argv)
            parser.set_defaults(**defaults)
    except UsageError as e:
        refuse(str(e))
    return args


def refuse(message):
    """Bad input met after parsing (a model that cannot load, a setting the run refuses): one line,
    exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
