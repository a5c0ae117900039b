"""The project's modules form layers. No module imports, directly or through others, one that
imports it back, counting imports inside functions (which only hide a circle until the function
runs); each folder imports only the layers its README names; no module imports train.py (the
experiment a student reads; only tests and bench scripts may)."""
import ast
import os
import subprocess
import sys

import pytest
from conftest import project_modules, run_fresh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# layer: the layers its modules may import (its own included). The root's paper files stand alone
# on worlds/; warmstart/ (what a policy knows before RL) stands on them, plumbing/ above it,
# train.py above all; lab/, course/ and scaleout/ use what they need, but never train.py.
LAYERS = {"worlds": {"worlds"},
          "paper": {"paper", "worlds"},
          "warmstart": {"warmstart", "paper", "worlds"},
          "plumbing": {"plumbing", "warmstart", "paper", "worlds"},
          "train": {"paper", "worlds", "warmstart", "plumbing"},
          "lab": {"lab", "plumbing", "warmstart", "paper", "worlds"},
          "course": {"course", "plumbing", "warmstart", "paper", "worlds"},
          "scaleout": {"scaleout", "plumbing", "warmstart", "paper", "worlds"}}
SAID = {"paper": "the root's modules but train.py", "plumbing": "plumbing/", "worlds": "worlds/",
        "warmstart": "warmstart/"}


def layer(module):
    """The layer of a dotted module name: its package folder, or paper / train at the root."""
    return module.split(".")[0] if "." in module else "train" if module == "train" else "paper"


def imports(root=ROOT):
    """{module: the project's modules it imports anywhere in its source} for every module of
    conftest.project_modules (dotted: "plumbing.runs"); `from plumbing import runs` imports
    plumbing.runs, `from plumbing.flags import Args` plumbing.flags."""
    modules = project_modules(root)
    graph = {}
    for name, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        found = set()
        for node in ast.walk(tree):  # every node: imports inside functions and classes too
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = found & set(modules) - {name}
    return graph


def cycles(graph):
    """The circles of a {node: successors} graph: its strongly connected components of more than
    one node (Tarjan), each as a sorted list.

    >>> cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    [['a', 'b', 'c']]
    """
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_cycle_finder_sees_a_circle_hidden_in_a_function(tmp_path):
    (tmp_path / "low.py").write_text("import os\n\n\ndef f():\n    from pkg import high\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "high.py").write_text("from low import f\n")
    (tmp_path / "alone.py").write_text("import low\nfrom pkg.high import x\n")
    graph = imports(str(tmp_path))
    assert graph == {"low": {"pkg.high"}, "pkg.high": {"low"}, "alone": {"low", "pkg.high"}}
    assert cycles(graph) == [["low", "pkg.high"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_among_the_modules():
    graph = imports()
    assert {"envs", "rollout", "plumbing.sampler", "warmstart.tiny", "train", "plumbing.runs",
            "plumbing.flags", "lab.grids", "scaleout.trl_ragen", "worlds.textenv"} <= set(graph)
    assert graph["train"] and graph["rollout"]  # imports are found at all
    assert cycles(graph) == []


def test_each_layer_imports_only_what_its_readme_allows():
    graph = imports()
    assert {layer(m) for m in graph} == set(LAYERS)
    wrong = sorted((m, i) for m, found in graph.items() for i in found
                   if layer(i) not in LAYERS[layer(m)])
    assert wrong == []


def test_no_module_imports_train():
    graph = imports()
    assert graph["scaleout.trl_ragen"]  # the TRL port imports the project at all
    assert sorted(m for m, found in graph.items() if "train" in found) == []


def test_every_folder_says_what_it_holds_and_may_import():
    for folder in sorted(set(LAYERS) - {"paper", "train"}):
        with open(os.path.join(ROOT, folder, "README.md"), encoding="utf-8") as f:
            text = f.read()
        allowed = ", ".join(SAID[x] for x in sorted(LAYERS[folder] - {folder}))
        line = next((x for x in text.splitlines() if x.startswith("May import:")), "")
        assert line == f"May import: {allowed or 'nothing outside this folder'}.", (folder, line)


def below(graph, name):
    """Every module that `name` imports, directly or through others."""
    seen, todo = set(), [name]
    while todo:
        for m in graph[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    return seen


def test_the_flags_stand_below_every_module_that_loads_torch():
    """plumbing/flags.py (and what it imports) never imports a module of the project that loads
    torch, numpy or transformers: the command line is checked before any of them loads."""
    graph = imports()
    heavy = {"torch", "numpy", "transformers", "trl"}
    modules = project_modules()
    for name in below(graph, "plumbing.flags") | {"plumbing.flags"}:
        with open(modules[name], encoding="utf-8") as f:
            tree = ast.parse(f.read())
        found = {alias.name.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.Import) for alias in node.names}
        found |= {node.module.split(".")[0] for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module}
        assert not found & heavy, (name, found & heavy)


@pytest.mark.parametrize("argv, said", [
    (["train.py", "--top-p", "7"], "error: --top-p must be in (0, 1], got 7.0"),
    (["train.py", "--nosuch"], "error: unrecognized arguments: --nosuch"),
    (["-m", "scaleout.trl_ragen", "--top-p", "7"], "error: --top-p must be in (0, 1], got 7.0")])
def test_a_refused_flag_answers_before_torch_is_imported(argv, said):
    """The script, run as `python <argv>`, refuses the flag in one line with exit code 2, and at
    its exit neither torch nor transformers has been imported (so it answers in about a second)."""
    assert answer(argv) == (2, said + "\n", "[]\n")


def answer(argv, env=None):
    """(exit code, stderr, the heavy modules imported by its exit) of `python <argv>`."""
    run = (f"runpy.run_module({argv[1]!r}, run_name='__main__', alter_sys=True)" if argv[0] == "-m"
           else f"runpy.run_path({argv[0]!r}, run_name='__main__')")
    argv = argv[1:] if argv[0] == "-m" else argv
    script = ("import atexit, runpy, sys\n"
              "atexit.register(lambda: print(sorted(m for m in ('torch', 'transformers', 'trl')\n"
              "                                     if m in sys.modules)))\n"
              f"sys.argv = {argv!r}\n" + run + "\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                         env=env)
    return out.returncode, out.stderr, out.stdout


def test_what_a_command_names_is_refused_before_torch_is_imported(tmp_path):
    """An --out that names a file, a run or a folder of other files, a --model folder that holds
    no model, a hub id that the local cache lacks while HF_HUB_OFFLINE=1 forbids the network:
    one line on stderr, exit code 2, before torch or transformers is imported -- train.py's and
    scaleout.trl_ragen's alike."""
    a_file, run, notes, folder = (tmp_path / name for name in ("file", "run", "notes", "model"))
    a_file.write_text("x")
    for made in (run, notes, folder):
        made.mkdir()
    (run / "metrics.jsonl").write_text("")
    (notes / "notes.txt").write_text("mine")
    (folder / "README.md").write_text("weights to come")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}  # an empty cache
    cases = [(["--out", str(a_file)], f"--out {a_file}: cannot write there (not a folder: "
                                      f"{a_file})"),
             (["--out", str(a_file / "run")], "cannot write there (not a folder"),
             (["--out", str(run)], f"--out {run} already holds a run"),
             (["--out", str(notes)], "is a folder with other files in it, not a run"),
             (["--model", str(folder)], f"--model {folder}: this folder holds no model"),
             (["--model", "no-such-org/no-such-model"],
              "--model no-such-org/no-such-model: not in the local Hugging Face cache")]
    for entry in (["train.py"], ["-m", "scaleout.trl_ragen"]):
        for args, said in cases:
            code, err, heavy = answer(entry + args, env)
            assert code == 2 and heavy == "[]\n", (entry, args, err)
            assert err.startswith("error: ") and err.count("\n") == 1 and said in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "model", "notes", "run"]



LIGHT = {"plumbing.flags", "plumbing.defaults", "envs", "worlds", "numpy", "scipy", "matplotlib",
         "tqdm"}  # what an entry point may import before it sets the wait policy: no torch there


def loads_torch(module):
    """Whether importing `module` (a dotted name) may load torch: anything not in the standard
    library or LIGHT ("arguments", bench's, sets the policy itself)."""
    top = module.split(".")[0]
    return not (top in sys.stdlib_module_names or top == "arguments"
                or any(module == m or module.startswith(m + ".") for m in LIGHT))


def test_every_entry_point_lets_openmp_threads_sleep_before_torch_loads():
    """OpenMP reads OMP_WAIT_POLICY once, when torch loads it: every script that runs from the
    command line and loads torch as it is imported first calls flags.polite_threads (itself, in
    flags.before_torch, or by importing bench/arguments.py). Checked on the source of each
    script git tracks: no top-level import that may load torch before such a call."""
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    scripts = [p for p in tracked if not p.startswith("tests/")
               and "__main__" in open(os.path.join(ROOT, p), encoding="utf-8").read()]
    assert len(scripts) > 10
    checked = 0
    for path in scripts:
        tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
        polite = False
        for node in tree.body:
            text = ast.unparse(node)
            if "polite_threads()" in text or "before_torch(" in text or (
                    isinstance(node, ast.ImportFrom) and node.module == "arguments"):
                polite = True
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) and node.module else [])
            heavy = [n for n in names if loads_torch(n)]
            if heavy:
                checked += 1
                assert polite, f"{path} imports {heavy[0]} before it sets the wait policy"
    assert checked > 10  # most scripts load torch as they are imported


@pytest.mark.parametrize("given, kept", [(None, "PASSIVE"), ("", "PASSIVE"), ("  ", "PASSIVE"),
                                         ("ACTIVE", "ACTIVE")])
def test_an_empty_wait_policy_counts_as_unset(monkeypatch, given, kept):
    """OMP_WAIT_POLICY= (empty) is no policy to OpenMP, which then spins: polite_threads sets
    PASSIVE there as where it is unset, and keeps what the user chose."""
    from plumbing import flags
    if given is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", given)
    flags.polite_threads()
    assert os.environ["OMP_WAIT_POLICY"] == kept


def test_every_folder_readme_lists_the_files_git_tracks_there():
    """A reader finds every module of a folder in its README's table (`name.py` in backticks), and
    every results/ folder in results/README.md."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    folders = sorted({p.split("/")[0] for p in tracked if p.count("/") == 1 and p.endswith(".py")}
                     - {"tests"})
    assert len(folders) >= 7
    for folder in folders:
        text = open(os.path.join(ROOT, folder, "README.md"), encoding="utf-8").read()
        for path in tracked:
            name = path.split("/")[-1]
            if path.startswith(folder + "/") and path.count("/") == 1 and name.endswith(".py") \
                    and name != "__init__.py":
                assert f"`{name}`" in text, f"{folder}/README.md does not name {name}"
    results = open(os.path.join(ROOT, "results", "README.md"), encoding="utf-8").read()
    for name in {p.split("/")[1] for p in tracked if p.startswith("results/") and p.count("/") > 1}:
        assert f"`{name}`" in results, f"results/README.md does not name {name}"


def test_the_papers_functions_take_what_the_paper_names_and_fit_a_screen():
    """No function of the root's modules (the reading set) takes more than 8 parameters -- the
    loss's coefficients, the rollout's and the filter's settings travel as small dataclasses
    (ppo.Coefficients, rollout.Turns, snr_filter.Filter) -- or runs over 60 lines."""
    root = [f for f in os.listdir(ROOT) if f.endswith(".py")]
    assert "train.py" in root and "ppo.py" in root
    too_big = []
    for name in root:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                count = len(a.posonlyargs + a.args + a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                lines = node.end_lineno - node.lineno + 1
                if count > 8 or lines > 60:
                    too_big.append(f"{name}:{node.name} ({count} parameters, {lines} lines)")
    assert too_big == []


# an entry point's cheapest call (--help, unless it has no flags)
CHEAPEST = {"envs.py": []}


def entry_points():
    """Every script git tracks that runs from the command line (but the test helpers), as its
    file and its module."""
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    return [(p, p[:-3].replace("/", ".")) for p in tracked
            if not os.path.basename(p).startswith(("test_", "trl_ragen_script"))
            and '__name__ == "__main__"' in open(os.path.join(ROOT, p), encoding="utf-8").read()]


def test_every_entry_point_runs_as_a_file_and_as_a_module(tmp_path):
    """`python path/to/file.py --help` and `python -m package.file --help` both work for every
    script (their cheapest call: envs.py has no flags), every one a README names among them; the
    usage line names a command that runs it. A file's folder is sys.path[0] (so `from plumbing
    import ...` fails there unless the script puts the root on the path); with -m the working
    directory is (conftest.run_fresh runs each as a fresh interpreter would)."""
    import re

    points = entry_points()
    readmes = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    named = set()
    for path in readmes:
        text = open(os.path.join(ROOT, path), encoding="utf-8").read()
        named |= {m[1] or m[0] for m in re.findall(r"python (?:-m ([\w.]+)|([\w/.-]+\.py))", text)}
    ours = {p for pair in points for p in pair}
    assert {"train.py", "plumbing.plots", "scaleout.trl_ragen", "bench/run_all.py"} <= named
    assert named - {"pytest"} <= ours, sorted(named - {"pytest"} - ours)  # every one named is run
    cases = [(way, target, CHEAPEST.get(path, ["--help"]), ROOT) for path, module in points
             for way, target in (("file", path), ("module", module))]
    results = run_fresh(cases, tmp_path, env={**os.environ, "COLUMNS": "100"})
    assert len(results) == len(cases) > 40
    for (way, target, _, _), (code, out, err), (path, module) in zip(
            cases, results, [p for p in points for _ in "ab"]):
        said = out + err
        assert code == 0 and "Traceback" not in said, f"{way} {target}: exit {code}\n{said[-1500:]}"
        if CHEAPEST.get(path) == []:  # no flags, so no usage line
            continue
        assert "usage: " in said, (way, target, said[:500])
        usage = said.split("usage: ", 1)[1].split()
        assert usage[0] == "python" and (usage[1:3] == ["-m", module] or usage[1] == path), (
            way, target, said[:200])
