"""Every command in the Markdown files works as written, as far as its arguments: each `python ...`
(and `accelerate launch ... -m ...`) line of a ```bash block of every tracked .md file names a
script or module that exists, and the entry point's own argument parser accepts its arguments
(train.py's and scaleout.trl_ragen's with their checks). Nothing is run: a command that trains for
hours is checked in a fraction of a second."""
import argparse
import importlib.util
import os
import re
import shlex
import subprocess

import pytest

from plumbing import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Words a command may hold that stand for something the reader chooses, and what the check puts in
# their place. A command holding any other placeholder-looking word (`<...>`, `[...]`, `...`) fails.
PLACEHOLDERS = {"DIR": "runs/x", "RUN": "runs/x", "NAME": "main"}


def markdown_files():
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [path for path in out if os.path.isfile(os.path.join(ROOT, path))]


def bash_commands(text):
    """The command lines of a Markdown text's ```bash blocks, a line continued with a trailing
    backslash joined to the next: [str]."""
    lines = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
        lines += block.replace("\\\n", " ").splitlines()
    return [line.strip() for line in lines if line.strip()]


def argv_of(line):
    """A command line as argv: a leading `cd X &&` and a trailing `# comment` dropped, the
    placeholders filled in; None for a line that runs neither python nor accelerate."""
    argv = shlex.split(line, comments=True)
    if argv[:1] == ["cd"] and "&&" in argv:
        argv = argv[argv.index("&&") + 1:]
    if argv[:2] == ["accelerate", "launch"]:  # its own options, then `-m module` or a script
        rest = argv[2:]
        start = next((i for i, a in enumerate(rest) if a == "-m" or a.endswith(".py")), None)
        assert start is not None, f"accelerate launch without a script or module: {line}"
        argv = ["python"] + rest[start:]
    if argv[:1] != ["python"]:
        return None
    return [PLACEHOLDERS.get(a, a) for a in argv]


def all_commands():
    """[(file, line, argv)] for every python command of every tracked Markdown file."""
    found = []
    for path in markdown_files():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            for line in bash_commands(f.read()):
                argv = argv_of(line)
                if argv is not None:
                    found.append((path, line, argv))
    return found


class Parsed(Exception):
    """Raised by the patched ArgumentParser.parse_args: the entry point parsed its arguments and
    stops there, before it does anything."""

    def __init__(self, namespace):
        super().__init__()
        self.namespace = namespace


def parse_with_main(module, args, monkeypatch):
    """The namespace `module.main(args)` parses (its own parser, whatever its parser class), or an
    AssertionError naming what the parser refused."""
    original = argparse.ArgumentParser.parse_args

    def stop(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", stop)
        try:
            module.main(args)
        except Parsed as p:
            return p.namespace
        except SystemExit as e:  # argparse's own error()
            raise AssertionError(f"{module.__name__} refused {args}: exit {e.code}") from None
    raise AssertionError(f"{module.__name__} did not parse {args} (its parser refused them)")


def check_train(args):
    """train.py: its flags and their checks, as train.py parses them before torch loads."""
    if "--help" in args:
        return
    if "--resume" in args:  # a resumed run's settings are checked against its folder: parse only
        flags.build_parser(flags.Args).parse_args(args)
        return
    assert isinstance(flags.parse_args(flags.Args, args), flags.Args)


def check_module(name, args, monkeypatch):
    if name == "scaleout.trl_ragen":
        from scaleout import trl_ragen
        if "--help" not in args:
            assert isinstance(trl_ragen.parse_args(args), trl_ragen.Args)
        return
    if name == "lab.experiments":
        from lab import experiments, grids
        a = parse_with_main(experiments, args, monkeypatch)
        assert set(a.grids) <= set(grids.GRIDS), f"unknown grid in {args}"
        return
    if name == "course.exercises":
        from course import exercises
        a = parse_with_main(exercises, args, monkeypatch)
        names = getattr(a, "names", []) + getattr(a, "only", [])
        assert set(names) <= set(exercises.EXERCISES), f"unknown exercise in {args}"
        return
    if name == "plumbing.plots":
        from plumbing import plots
        parse_with_main(plots, args, monkeypatch)
        return
    # any other module: it exists; pytest's test files too
    assert importlib.util.find_spec(name) is not None, name
    if name == "pytest":
        for a in args:
            if a.startswith("tests/"):
                assert os.path.exists(os.path.join(ROOT, a.split("::")[0])), a


def check_script(path, args):
    """A script run by path: it exists; train.py's arguments are parsed, another script's --flags
    must appear in its source (bench/*.py and tests/mutants.py parse with argparse)."""
    assert os.path.isfile(os.path.join(ROOT, path)), path
    if os.path.normpath(path) == "train.py":
        check_train(args)
        return
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        source = f.read()
    for a in args:
        if a.startswith("-"):
            flag = a.split("=", 1)[0]
            assert f'"{flag}"' in source, f"{path} has no {flag}"


def test_every_command_in_the_markdown_files_parses(monkeypatch):
    commands = all_commands()
    seen = {argv[1] if argv[1] != "-m" else argv[2] for _, _, argv in commands}
    assert {"train.py", "lab.experiments", "course.exercises"} <= seen, seen  # the check checks
    # the quick start, the main command, running the experiment, the real model's command, ...
    assert sum(argv[1] == "train.py" for path, _, argv in commands
               if path in ("README.md", "plumbing/README.md")) >= 5
    for path, line, argv in commands:
        where = f"{path}: {line}"
        assert not re.search(r"<\w|\[|\.\.\.", " ".join(argv[1:])), f"a placeholder in {where}"
        try:
            if argv[1] == "-m":
                check_module(argv[2], argv[3:], monkeypatch)
            else:
                check_script(argv[1], argv[2:])
        except (Exception, SystemExit) as e:  # whatever the check raised, with the line
            pytest.fail(f"{where}\n  {type(e).__name__}: {e}")


def test_the_command_reader():
    text = ("```bash\npython train.py --env sokoban \\\n    --filter topp   # a comment\n"
            "cd hw && python -m course.exercises check gae\nls\n```\nprose\n"
            "```python\npython nothing.py\n```\n")
    argvs = [argv_of(line) for line in bash_commands(text)]
    assert argvs == [["python", "train.py", "--env", "sokoban", "--filter", "topp"],
                     ["python", "-m", "course.exercises", "check", "gae"], None]
    assert argv_of("accelerate launch --multi_gpu --num_processes 2 -m scaleout.trl_ragen "
                   "--model tiny") == ["python", "-m", "scaleout.trl_ragen", "--model", "tiny"]


def test_a_bad_command_is_caught(monkeypatch):
    """The checks refuse what they should: a train.py flag that does not exist or fails its check,
    an unknown grid or exercise, a flag a script does not have."""
    for args in (["--nosuch"], ["--top-p", "7"]):
        with pytest.raises((flags.UsageError, SystemExit)):
            check_train(args)
    with pytest.raises(AssertionError):
        check_module("lab.experiments", ["run", "nosuch"], monkeypatch)
    with pytest.raises(AssertionError):
        check_module("course.exercises", ["check", "nosuch"], monkeypatch)
    with pytest.raises(AssertionError):
        check_module("course.exercises", ["grade"], monkeypatch)
    with pytest.raises(AssertionError):
        check_script("bench/run_all.py", ["--nosuch"])
    with pytest.raises(AssertionError):
        check_module("no_such_module_here", [], monkeypatch)


def test_the_readmes_smollm2_command_is_the_grids_top_p_run():
    """What RESULTS.md section 14 measures is what the README tells a reader to run: train.py reads
    the README's SmolLM2 command and the smollm2-coords grid's Top-P run of seed 0 as the same
    settings, but for the grid's thread count, figures and run folder."""
    import dataclasses

    from lab import grids

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = [argv_of(line) for line in bash_commands(f.read())]
    smollm2 = [argv[2:] for argv in readme if argv and argv[1] == "train.py" and "smollm2" in argv]
    assert len(smollm2) == 1, smollm2
    run = next(argv for setting, seed, _, argv in grids.runs_of("smollm2-coords")
               if (setting, seed) == ("topp", 0))
    settings = [{k: v for k, v in dataclasses.asdict(flags.parse_args(flags.Args, argv)).items()
                 if k not in ("threads", "plot", "out")} for argv in (smollm2[0], run)]
    assert settings[0] == settings[1]
