"""The top-level modules form layers: no module imports, directly or through others, one that
imports it back, counting imports inside functions (which only hide a circle until the function
runs). A module's place in the layering is then plain from its imports."""
import ast
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def imports(root=ROOT):
    """{module: the top-level modules it imports anywhere in its source} for every top-level .py."""
    names = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(root, "*.py"))}
    graph = {}
    for name in names:
        with open(os.path.join(root, name + ".py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        found = set()
        for node in ast.walk(tree):  # every node: imports inside functions and classes too
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
        graph[name] = found & names - {name}
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
    (tmp_path / "low.py").write_text("import os\n\n\ndef f():\n    import high\n")
    (tmp_path / "high.py").write_text("from low import f\n")
    (tmp_path / "alone.py").write_text("import low\n")
    graph = imports(str(tmp_path))
    assert graph == {"low": {"high"}, "high": {"low"}, "alone": {"low"}}
    assert cycles(graph) == [["high", "low"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_among_the_top_level_modules():
    graph = imports()
    assert {"envs", "rollout", "sampler", "models", "tiny", "demos", "train", "runs",
            "flags"} <= set(graph)
    assert graph["train"] and graph["rollout"]  # imports are found at all
    assert cycles(graph) == []


def below(graph, name):
    """Every top-level module that `name` imports, directly or through others."""
    seen, todo = set(), [name]
    while todo:
        for m in graph[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    return seen


def test_the_flags_stand_below_every_module_that_loads_torch():
    """flags.py (and what it imports) never imports a module of the project that loads torch,
    numpy or transformers: the command line is checked before any of them loads."""
    graph = imports()
    heavy = {"torch", "numpy", "transformers", "trl"}
    for name in below(graph, "flags") | {"flags"}:
        with open(os.path.join(ROOT, name + ".py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        found = {alias.name.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.Import) for alias in node.names}
        found |= {node.module.split(".")[0] for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module}
        assert not found & heavy, (name, found & heavy)


@pytest.mark.parametrize("argv, said", [
    (["train.py", "--top-p", "7"], "error: --top-p must be in (0, 1], got 7.0"),
    (["train.py", "--nosuch"], "error: unrecognized arguments: --nosuch"),
    (["trl_ragen.py", "--top-p", "7"], "error: --top-p must be in (0, 1], got 7.0")])
def test_a_refused_flag_answers_before_torch_is_imported(argv, said):
    """The script, run as `python <argv>`, refuses the flag in one line with exit code 2, and at
    its exit neither torch nor transformers has been imported (so it answers in about a second)."""
    script = ("import atexit, runpy, sys\n"
              "atexit.register(lambda: print(sorted(m for m in ('torch', 'transformers', 'trl')\n"
              "                                     if m in sys.modules)))\n"
              f"sys.argv = {argv!r}\n"
              f"runpy.run_path({argv[0]!r}, run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert (out.returncode, out.stderr, out.stdout) == (2, said + "\n", "[]\n")

