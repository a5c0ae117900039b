"""The top-level modules form layers: no module imports, directly or through others, one that
imports it back, counting imports inside functions (which only hide a circle until the function
runs). A module's place in the layering is then plain from its imports."""
import ast
import glob
import os

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
    assert {"envs", "rollout", "sampler", "models", "tiny", "demos", "train", "runs"} <= set(graph)
    assert graph["train"] and graph["rollout"]  # imports are found at all
    assert cycles(graph) == []
