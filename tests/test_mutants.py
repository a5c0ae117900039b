"""The mutation check's own machinery (tests/mutants.py): every mutant still applies to the code
as it is and names tests that exist, a mutant changes one line of one function, and a hung mutant
is stopped, its processes with it."""
import ast
import importlib.util
import os
import sys
import textwrap
import time

from conftest import project_modules

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
spec = importlib.util.spec_from_file_location("mutants", os.path.join(HERE, "mutants.py"))
mutants = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutants)


def test_every_mutant_applies_once_and_names_tests_that_exist():
    assert len(mutants.MUTANTS) >= 30
    names = [mu.name for mu in mutants.MUTANTS]
    assert len(set(names)) == len(names)
    defined = {}
    for mu in mutants.MUTANTS:
        with open(os.path.join(ROOT, mu.file)) as f:
            source = f.read()
        changed = mutants.mutate(source, mu)
        assert changed is not None, f"{mu.name} rotted: its line is not once in {mu.function}"
        assert changed != source and mu.tests, mu.name
        for test in mu.tests:
            path, _, function = test.partition("::")
            if path not in defined:
                with open(os.path.join(ROOT, path)) as f:
                    defined[path] = {node.name for node in ast.walk(ast.parse(f.read()))
                                     if isinstance(node, ast.FunctionDef)}
            assert function.split("[")[0] in defined[path], f"{mu.name}: no test {test}"
            if function.startswith("test_docstring_examples["):  # its cases are the module names
                assert function[len("test_docstring_examples["):-1] in project_modules(), test


def test_a_mutant_changes_one_line_of_its_function_only():
    source = textwrap.dedent("""\
        def f(x):
            return x + 1


        class C:
            def g(self, x):
                return x + 1
        """)
    mu = mutants.Mutant("plus-minus", "x.py", "C.g", "x + 1", "x - 1", ())
    changed = mutants.mutate(source, mu).splitlines()
    assert changed[1] == "    return x + 1" and changed[6] == "        return x - 1"
    assert sum(a != b for a, b in zip(changed, source.splitlines())) == 1
    assert mutants.mutate(source, mu._replace(function="h")) is None  # no such function
    assert mutants.mutate(source, mu._replace(old="x * 2")) is None  # no such line


def test_a_parametrized_test_named_without_parameters_is_caught_by_any_failing_case():
    failed = {"tests/test_ppo.py::test_gae[0]", "tests/test_ppo.py::test_kl"}
    assert mutants.caught_by("tests/test_ppo.py::test_gae", failed)
    assert mutants.caught_by("tests/test_ppo.py::test_gae[0]", failed)
    assert mutants.caught_by("tests/test_ppo.py::test_kl", failed)
    assert not mutants.caught_by("tests/test_ppo.py::test_gae[1]", failed)
    assert not mutants.caught_by("tests/test_ppo.py::test_ga", failed)  # another test's prefix


def test_failed_ids_keep_parameters_with_spaces():
    report = ("FAILED tests/test_runs.py::test_bad[argv18-not in the cache] - AssertionError: x - y\n"
              "ERROR tests/test_mi.py::test_kl\n"
              "FAILED tests/test_ppo.py::test_gae[0]\n"
              "1 failed, 2 passed\n")
    assert mutants.failed_ids(report) == {"tests/test_runs.py::test_bad[argv18-not in the cache]",
                                          "tests/test_mi.py::test_kl", "tests/test_ppo.py::test_gae[0]"}


def test_a_hung_mutant_is_stopped_with_the_processes_it_started(tmp_path):
    """A command that hangs ends only by its time limit, its own child process with it: that child
    never reaches the end of its sleep (where it would leave a mark). No verdict here waits on a
    clock: a limit that came before the command had started its child checked nothing, and is
    tried again, longer."""
    pid_file, mark = tmp_path / "child.pid", tmp_path / "child-ended-on-its-own"
    child = f"import time; time.sleep(600); open({str(mark)!r}, 'w').close()"
    hang = textwrap.dedent(f"""\
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", {child!r}])
        open({str(pid_file)!r} + ".tmp", "w").write(str(child.pid))
        os.replace({str(pid_file)!r} + ".tmp", {str(pid_file)!r})
        time.sleep(600)
        """)
    limit = 1.0
    while True:
        code, _, _ = mutants.run_group([sys.executable, "-c", hang], str(tmp_path), dict(os.environ),
                                       limit)
        assert code is None  # stopped, not finished
        if pid_file.exists():
            break
        limit *= 2  # stopped before it started its child: nothing was checked
    child = int(pid_file.read_text())
    while running(child):  # killed: gone in a moment; not killed: it ends after its sleep
        time.sleep(0.05)
    assert not mark.exists(), "the hung command's own child process outlived the time limit"


def running(pid):
    """Whether process `pid` exists and is no zombie (a killed process left unreaped is one)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False
