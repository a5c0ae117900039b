"""Course assignments: the reference turned into graded exercises, one command for the teacher and
the student (as Spinning Up's problem sets, CS336's stubs graded against stored outputs, and
nbgrader's solution regions -- here in plain .py modules).

    python -m course.exercises list                           # name, points, where, what to read first
    python -m course.exercises make DIR [--only NAME ...]     # the student copy, chosen regions stubbed
    python -m course.exercises check [NAME ...]               # grade: one row per exercise, a total

Setting and grading changes no module's behaviour; it only reads them.

Solution regions. In a module, the lines between the comments `# BEGIN SOLUTION name` and
`# END SOLUTION name` solve exercise `name` (an exercise may have several regions). `make` copies
every file git tracks into DIR and puts, in place of each chosen region's lines, a stub at the same
indentation: the shape comments of the lines it replaces, then raise NotImplementedError with a
one-line hint (the equation to implement); the markers stay, so the student writes between them.
Signatures, docstrings and the code around a region are unchanged, so the copy imports and runs
everything that calls no stub. The silent-bug exercise is the one exception: its region becomes a
planted defect, markers removed (finding it is the exercise). The copy's tests/ holds only the
grading tests and conftest.py (the project's own tests check the solution, some against a
re-implementation of it), and the reference runs of the experiment stay out. The copy's
assignment.txt names its exercises: what `check` grades there by default.

Grading. A grading test carries @pytest.mark.exercise("name"). `check` runs exactly the tests of the
chosen exercises (default: all, or a copy's assignment) from tests/test_grading.py and from a folder
of hidden tests (--hidden DIR or $EXERCISES_HIDDEN), and prints one row per exercise: name, points,
passed or FAILED, and the first failure in one line. An exercise passes when it has at least one
test and all of them pass; its points are all or nothing. Exit 0 only when every checked exercise
passes; --json FILE writes the result in the Gradescope autograder format. The experiment exercise
is graded on the run folders in --runs DIR (or $EXERCISE_RUNS; default runs/exercise when it exists,
else the committed reference runs).

The grader does not trust the code it grades: each exercise runs in a process of its own, with a
time limit (--timeout, 300 s), and this process only reads what that one reports. A test that
hangs, or code that ends its process (os._exit, a crash), fails that exercise with the reason in
its row; the rows and the JSON file are written whatever the code does.
"""
import ast
import contextlib
import importlib
import io
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import time

if not __package__:  # run as a file (python course/exercises.py): imports from the root, as with -m
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from plumbing.flags import Parser, UsageError, polite_threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
GRADING_TESTS = os.path.join("tests", "test_grading.py")
STUDENT_TESTS = ("tests/conftest.py", GRADING_TESTS)  # the only files of tests/ a copy gets
# instructor material a student copy leaves out: the experiment's reference runs, the planted
# defect's run (the student makes both)
INSTRUCTOR_ONLY = ("results/exercises/experiment/", "results/exercises/silent_bug/defect/")
EXPERIMENT_RUNS = ("topk", "random")  # the experiment's two run folders: the filter, its control
MARKER = re.compile(r"^(\s*)# (BEGIN|END) SOLUTION (\w+)\s*$")
ASSIGNMENT = "assignment.txt"  # a student copy's exercises, one a line: what check grades there
TIMEOUT = 300.0  # seconds an exercise's tests may take together (check --timeout)
# Each exercise is graded in a process forked from this one (where fork exists): it inherits these
# libraries of the grading tests instead of loading them again (seconds each time). Never a module
# of the project: those hold the student's code, which runs only in the forked processes.
PRELOAD = ("numpy", "torch", "pytest", "transformers.models.qwen2.modeling_qwen2",
           "transformers.tokenization_utils_fast")

# name: points, what to read first, the task in one line. The order is the paper's.
EXERCISES = {
    "chain_rule": (4, "theory.md Sec. 1, Key equations",
                   "entropy, conditional entropy and mutual information of discrete tables"),
    "mi_estimate": (4, "theory.md Sec. 2, Key equations",
                    "the MI estimate, z-score and both entropies from a cross-score matrix"),
    "retrieval": (4, "theory.md Sec. 2, Key equations (retrieval accuracy)",
                  "retrieval credit: the own prompt among the k best-scoring ones, ties shared"),
    "bound": (3, "theory.md Sec. 3, Key equations",
              "the group task-gradient norm and its sqrt(RV) Cauchy-Schwarz bound"),
    "topp": (3, "theory.md Sec. 4, Key equations",
             "Top-P selection, linear and softmax, over the ranked groups"),
    "topk": (2, "theory.md Sec. 4, Key equations", "Top-K selection over the ranked groups"),
    "gae": (4, "theory.md Sec. 5, Key equations (GAE)",
            "GAE over the policy tokens only, each row its own episode"),
    "clip_loss": (4, "theory.md Sec. 5, Key equations (the clipped surrogate)",
                  "PPO's per-token clipped loss with clip-higher and the dual clip"),
    "grpo": (4, "theory.md Sec. 5, Key equations (GRPO, Dr.GRPO, aggregation)",
             "group-relative advantages (GRPO, Dr.GRPO) and the four loss aggregations"),
    "experiment": (5, "RESULTS.md Sec. 1-2, theory.md Sec. 4, EXERCISES.md (the commands)",
                   "run Top-K and its random control, answer from their metrics.jsonl"),
    "silent_bug": (5, "theory.md Sec. 2, Background; EXERCISES.md (the commands)",
                   "a run whose entropy looks healthy hides a defect: find and fix it"),
}
HIDDEN_LOCATION = {"silent_bug": "somewhere in the code a training run executes"}

# the one-line hint of each stub, by (exercise, function)
HINTS = {
    ("chain_rule", "_neg_xlogx"): "-p log p elementwise, 0 where p = 0",
    ("chain_rule", "entropy"): "H(Z) = -sum_z p(z) log p(z)",
    ("chain_rule", "conditional_entropy"): "H(Z|X) = sum_x p(x) H(Z | X = x)",
    ("chain_rule", "mutual_information"):
        "I(X;Z) = sum_x p(x) KL(p(z|x) || p(z)) with p(z) = sum_x p(x) p(z|x)",
    ("mi_estimate", "matched_and_marginal"):
        "matched_m = table[m, owner[m]]; marginal_m = logsumexp_j table[m, j] - log N",
    ("mi_estimate", "collapse_metrics"):
        "estimate = mean(matched - marginal); zscore = estimate / (population std of marginal "
        "+ 1e-3); H(Z|X) = -mean(matched); H(Z) = -mean(marginal); out's keys: the docstring",
    ("retrieval", "retrieval_credit"):
        "credit = 1 - C(t - a', k - g) / C(t, k - g): g columns above the owner's best score s, "
        "t columns tied at s, a' of them the owner's prompt; 0 when k <= g",
    ("bound", "task_gradient_bound"):
        "norm = ||1/K sum_k (r_k - rbar) s_k||; bound = sqrt(1/K sum_k (r_k - rbar)^2) "
        "sqrt(1/K sum_k ||s_k||^2)",
    ("topp", "topp_count"):
        "n_keep: p >= 1 every ranked group; linear: the smallest prefix of `ranked` whose sum "
        "reaches p * total - 0.01, zero scores never kept; softmax: the smallest prefix whose "
        "softmax mass reaches p",
    ("topk", "topk_count"): "n_keep = max(1, int(k * G)), at most the ranked groups",
    ("gae", "gae"):
        "per row, over its policy tokens t < t' only: delta_t = r_t + gamma V(t') - V(t), "
        "A_t = delta_t + gamma lam A_t', V = A = 0 after the row's last one; returns = A + V",
    ("clip_loss", "clipped_policy_loss"):
        "r = exp(logp - old_logp); l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)); "
        "l = min(l, -A c) where A < 0 (capped marks it)",
    ("grpo", "aggregate"):
        "token-mean; seq-mean-token-mean; seq-mean-token-sum; seq-mean-token-sum-norm (sum / "
        "norm_length), the seq- means over rows with a policy token",
    ("grpo", "group_advantages"):
        "A = (r - mean_g r) / (std_g r + eps), unbiased std (normalize_std=False: no division); "
        "exactly 0 for a group without spread",
    ("experiment", "experiment_answers"):
        "read each answer off the two runs' records (see the docstring)",
}

# the planted defect the silent-bug exercise's region becomes in a student copy (lines relative
# to the region's indentation)
DEFECTS = {
    "silent_bug": [
        "order = sorted(range(B), key=lambda b: len(prompt_ids[b]))[::-1]  # longest first",
        "new = [prompt_ids[b][known[b]:] for b in order]  # rows of equal length together",
    ],
}


# -------------------------------------------------------------------------------- solution regions

def regions(text, path="<text>"):
    """[(name, begin, end)]: the 0-based line numbers of each region's BEGIN and END markers.
    Nested, unclosed or mismatched markers raise ValueError.

    >>> regions("a\\n  # BEGIN SOLUTION x\\n  b\\n  # END SOLUTION x\\n")
    [('x', 1, 3)]
    """
    found, open_ = [], None
    for i, line in enumerate(text.splitlines()):
        m = MARKER.match(line)
        if not m:
            continue
        kind, name = m.group(2), m.group(3)
        if kind == "BEGIN" and open_ is None:
            open_ = (name, i)
        elif kind == "END" and open_ is not None and open_[0] == name:
            found.append((name, open_[1], i))
            open_ = None
        else:
            raise ValueError(f"{path}:{i + 1}: unexpected {kind} SOLUTION {name}")
    if open_ is not None:
        raise ValueError(f"{path}:{open_[1] + 1}: BEGIN SOLUTION {open_[0]} is never closed")
    return found


def enclosing_function(tree, line):
    """Name of the innermost function whose body holds 0-based `line`, or None."""
    best = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.lineno <= line + 1 <= node.end_lineno:
                if best is None or node.lineno > best.lineno:
                    best = node
    return best.name if best else None


def solution_map(root=ROOT):
    """{exercise: [(file, function, begin, end)]} over the project's .py files of `root`: the
    top level and its packages (folders with an __init__.py; tests/ and bench/ are none)."""
    out = {}
    for name in project_files(root):
        with open(os.path.join(root, name), encoding="utf-8") as f:
            text = f.read()
        found = regions(text, name)
        tree = ast.parse(text) if found else None
        for exercise, begin, end in found:
            out.setdefault(exercise, []).append(
                (name, enclosing_function(tree, begin), begin, end))
    return out


def project_files(root):
    """The project's .py files, relative to `root`: the top level's, then each package's."""
    top = sorted(n for n in os.listdir(root) if n.endswith(".py"))
    packages = sorted(d for d in os.listdir(root)
                      if os.path.isfile(os.path.join(root, d, "__init__.py")))
    return top + [f"{d}/{n}" for d in packages
                  for n in sorted(os.listdir(os.path.join(root, d))) if n.endswith(".py")]


def shape_comments(lines):
    """'# name: [shape] ...' for each replaced assignment that ends in a shape comment, once each.

    >>> shape_comments(["    x = a + b    # [B, T]", "    y = 2", "    x = x * 2   # [B, T]"])
    ['# x: [B, T]']
    """
    out = []
    for line in lines:
        code, _, comment = line.partition("#")
        comment = comment.strip()
        if code.strip() and comment.startswith("[") and "=" in code:
            out.append(f"# {code.split('=')[0].strip()}: {comment}")
    return list(dict.fromkeys(out))


def student_source(text, chosen, path="<text>"):
    """`text` with every region of an exercise in `chosen` replaced: a stub between the kept
    markers, or for a planted defect (DEFECTS) the defect without markers."""
    lines = text.splitlines(keepends=True)
    found = regions(text, path)
    if not any(name in chosen for name, _, _ in found):
        return text
    tree = ast.parse(text)
    for name, begin, end in reversed(found):  # from the end: earlier line numbers stay valid
        if name not in chosen:
            continue
        indent = MARKER.match(lines[begin]).group(1)
        if name in DEFECTS:
            new = [indent + line + "\n" if line else "\n" for line in DEFECTS[name]]
            lines[begin:end + 1] = new
            continue
        hint = HINTS[(name, enclosing_function(tree, begin))]
        stub = shape_comments(lines[begin + 1:end])
        stub.append(f"raise NotImplementedError({name + ': ' + hint!r})")
        lines[begin + 1:end] = [indent + line + "\n" for line in stub]
    return "".join(lines)



# ---------------------------------------------------------------------------------------- commands

def check_names(names):
    unknown = [n for n in names if n not in EXERCISES]
    if unknown:
        raise UsageError(f"unknown exercise {unknown[0]!r}; choose from {', '.join(EXERCISES)}")
    return list(dict.fromkeys(names)) or list(EXERCISES)


def where(name, places):
    """'file:function, ...' of an exercise's regions (its hidden location for a silent bug)."""
    if name in HIDDEN_LOCATION:
        return HIDDEN_LOCATION[name]
    return ", ".join(dict.fromkeys(f"{file}:{func}" for file, func, _, _ in places)) or "-"


def assigned(root=ROOT):
    """The exercises a student copy assigns (its assignment.txt); every exercise elsewhere."""
    path = os.path.join(root, ASSIGNMENT)
    if not os.path.isfile(path):
        return list(EXERCISES)
    with open(path, encoding="utf-8") as f:
        return check_names(f.read().split())


def list_exercises(root=ROOT):
    places = solution_map(root)
    total = 0
    for name, (points, read, task) in EXERCISES.items():
        total += points
        print(f"{name:<12} {points:>2} pts  {where(name, places.get(name, []))}  "
              f"(read first: {read}) -- {task}")
    print(f"{len(EXERCISES)} exercises, {total} points")
    if os.path.isfile(os.path.join(root, ASSIGNMENT)):
        print(f"assigned in this copy: {', '.join(assigned(root))}")


def tracked_files(root):
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        raise UsageError(f"make copies the files git tracks, and {root} is not a git checkout")
    return [p for p in out.stdout.decode().split("\0") if p]


def make(out_dir, only=(), root=ROOT):
    """Write the student copy into out_dir (which must not exist, or be empty)."""
    chosen = [name for name in EXERCISES if name in check_names(list(only))]  # the paper's order
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise UsageError(f"{out_dir} exists and is not an empty folder")
    if out_dir == root or out_dir.startswith(root + os.sep):
        raise UsageError(f"{out_dir} is inside the repository; choose a folder outside it")
    copied, sources = 0, set(project_files(root))  # the files whose regions become stubs
    for rel in tracked_files(root):
        src = os.path.join(root, rel)
        if (not os.path.isfile(src) or rel.startswith(INSTRUCTOR_ONLY)
                or (rel.startswith("tests/") and rel not in STUDENT_TESTS)):
            continue
        dst = os.path.join(out_dir, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if rel in sources:
            with open(src, encoding="utf-8") as f:
                text = student_source(f.read(), chosen, rel)
            with open(dst, "w", encoding="utf-8") as f:
                f.write(text)
            shutil.copymode(src, dst)
        else:
            shutil.copy2(src, dst)
        copied += 1
    with open(os.path.join(out_dir, ASSIGNMENT), "w", encoding="utf-8") as f:
        f.write("".join(name + "\n" for name in chosen))
    print(f"wrote {out_dir}: {copied} files, exercises {', '.join(chosen)} to do; "
          f"grade with: cd {out_dir} && python -m course.exercises check")


class Grades:
    """A pytest plugin, in the process grading one exercise: it sends (over `conn`) how many tests
    grade the exercise and the tests marked with an unknown one, then what each test checks as it
    starts; it keeps the first failure and the tests that finished. A row names a check by what it
    checks (check_name), never by the test's own name, and a failure by its kind and the message
    its test wrote, never by pytest's account of the assertion: a name or a compared expression can
    give the answer away (the silent bug's)."""

    def __init__(self, name, conn):
        self.name, self.conn = name, conn
        self.tests, self.finished, self.failure, self.broken = [], set(), None, None
        self.checks = {}  # nodeid: what it checks

    def pytest_collection_modifyitems(self, session, config, items):
        kept, unknown = [], []
        for item in items:
            mark = item.get_closest_marker("exercise")
            name = mark.args[0] if mark and mark.args else None
            if name is not None and name not in EXERCISES:
                unknown.append(f"{item.nodeid} grades an unknown exercise {name!r}")
            if name == self.name:
                kept.append(item)
                self.checks[item.nodeid] = check_name(item.name, name, mark.kwargs.get("check"))
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
        self.tests = [item.nodeid for item in kept]
        self.conn.send(("collected", len(kept), unknown))

    def pytest_collectreport(self, report):  # e.g. a module that no longer imports
        if report.failed and self.broken is None:
            self.broken = f"{report.nodeid or 'collection'}: {one_line(report)}"

    def pytest_runtest_logstart(self, nodeid, location):
        self.conn.send(("running", self.checks.get(nodeid, nodeid)))

    def pytest_runtest_makereport(self, item, call):  # a test's setup, call or teardown ended
        import pytest

        error = call.excinfo.value if call.excinfo is not None else None
        if (error is not None and not isinstance(error, pytest.skip.Exception)
                and self.failure is None and item.nodeid in self.checks):
            self.failure = f"{self.checks[item.nodeid]}: {failure_reason(error)}"

    def pytest_runtest_logreport(self, report):
        if report.failed and self.failure is None:  # failed without an exception to read
            self.failure = f"{self.checks.get(report.nodeid, report.nodeid)}: {one_line(report)}"
        if report.when == "teardown":
            self.finished.add(report.nodeid)

    def verdict(self):
        """'' when the exercise passed, else the reason in one line."""
        if self.broken or self.failure:
            return self.broken or self.failure
        if not self.tests:
            return "no grading test found"
        unfinished = [t for t in self.tests if t not in self.finished]  # the session was stopped
        return f"{self.checks[unfinished[0]]}: did not finish" if unfinished else ""


def check_name(test, exercise, check=None):
    """What a grading test checks, as its row says it: the marker's check="..." where the test
    gives one, else its name read as words, the test_ and the exercise's prefix dropped.

    >>> check_name("test_gae_discounts", "gae")
    'discounts'
    >>> check_name("test_silent_bug_runs", "silent_bug", check="what the diagnosis relies on")
    'what the diagnosis relies on'
    """
    if check:
        return check
    words = test[len("test_"):] if test.startswith("test_") else test
    words = words[len(exercise) + 1:] if words.startswith(exercise + "_") else words
    return words.replace("_", " ") or test


def failure_reason(error):
    """Why a check failed, in one line: for an assertion the message its test wrote with it (else
    that a result differs), for any other error its type and first line; never pytest's
    rewritten expression, which shows the compared values and the code that computed them.

    >>> failure_reason(AssertionError("0 log 0 counts as 0\\nassert nan == 0.0"))
    '0 log 0 counts as 0'
    >>> failure_reason(AssertionError("assert False\\n +  where False = close(0.3, 0.5)"))
    'a result is not the expected one'
    >>> failure_reason(NotImplementedError("gae: A_t = delta_t + gamma lam A_t'"))
    "NotImplementedError: gae: A_t = delta_t + gamma lam A_t'"
    """
    text = str(error).strip()
    if isinstance(error, AssertionError):
        written = "" if text.startswith("assert ") else text.split("\nassert ")[0]
        text = written or "a result is not the expected one"
    else:
        text = f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
    text = " ".join(text.split())
    return text if len(text) <= 160 else text[:157] + "..."


def tests_count(n):
    """'1 test' or 'N tests', aligned in the rows."""
    return f"{n:>2} test " if n == 1 else f"{n:>2} tests"


def one_line(report):
    """A failed test's (or collection's) error in one line of at most 160 characters."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1]
    text = " ".join(text.split())
    return text if len(text) <= 160 else text[:157] + "..."


def grade_here(name, paths, root, conn):
    """In the process of its own that grades exercise `name`: run its tests, send the verdict."""
    import pytest

    grades = Grades(name, conn)
    # pytest's own plugins only (no installed one reorders or reseeds the tests); not the one that
    # collects garbage at exit to find unraisable exceptions (seconds with torch loaded)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:unraisableexception",
                     "--rootdir", root, *paths], plugins=[grades])
    conn.send(("verdict", grades.verdict()))


def grade(name, paths, root, timeout):
    """Grade exercise `name` in a process of its own, stopped after `timeout` seconds ->
    (its number of tests, '' or why it failed, the tests marked with an unknown exercise)."""
    context = multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=grade_here, args=(name, paths, root, send))
    child.start()
    send.close()  # the child holds the only sending end: when it ends, receiving ends too
    deadline, tests, unknown, running = time.monotonic() + timeout, 0, [], None
    try:
        while True:
            if not receive.poll(max(0.0, deadline - time.monotonic())):
                verdict = f"timed out after {timeout:g} s"
                break
            kind, *data = receive.recv()  # EOFError: the process ended without a verdict
            if kind == "verdict":
                return tests, data[0], unknown
            if kind == "collected":
                tests, unknown = data
            else:
                running = data[0]  # what the test that started checks
    except EOFError:
        child.join()
        verdict = f"its process ended (exit code {child.exitcode}) before reporting"
    finally:
        child.kill()
        child.join()
        receive.close()
    return tests, f"{running}: {verdict}" if running else verdict, unknown


def hidden_folder(hidden):
    """The folder of hidden tests as an absolute path, each of its .py files compiled first: a
    teacher's syntax error is bad input, not the student's failure."""
    if not os.path.isdir(hidden):
        raise UsageError(f"hidden tests folder {hidden} does not exist")
    for folder, _, files in os.walk(hidden):
        for file in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, file)
            try:
                with open(path, "rb") as f:
                    compile(f.read(), path, "exec")
            except SyntaxError as e:
                raise UsageError(f"hidden test {path}, line {e.lineno}: {e.msg}")
    return os.path.abspath(hidden)


def graded_tree(root=ROOT):
    """The first line of check: which tree it grades. In the repository, the solution passes every
    exercise; a student who runs check there reads a full score that is not theirs."""
    if os.path.isfile(os.path.join(root, ASSIGNMENT)):
        return f"grading the student copy in {root}"
    return (f"grading the reference solution in {root}, not a student copy (a copy holds "
            f"{ASSIGNMENT}; run check inside it)")


def check(names=(), hidden=None, runs=None, json_path=None, timeout=TIMEOUT, root=ROOT):
    """Grade the chosen exercises, each in a process of its own; returns the exit code (0: all
    passed)."""
    names = check_names(list(names) or assigned(root))
    if not 0 < timeout < float("inf"):
        raise UsageError(f"--timeout must be a positive number of seconds, not {timeout:g}")
    hidden = hidden or os.environ.get("EXERCISES_HIDDEN")
    paths = [os.path.join(root, GRADING_TESTS)] + ([hidden_folder(hidden)] if hidden else [])
    if runs:
        if not os.path.isdir(runs):
            raise UsageError(f"runs folder {runs} does not exist")
        os.environ["EXERCISE_RUNS"] = os.path.abspath(runs)
    if json_path:
        with open(json_path, "w") as f:  # an unwritable path stops here, before any grading
            json.dump({}, f)
    polite_threads()  # before torch loads: its OpenMP threads sleep while they wait
    for module in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    print(graded_tree(root), flush=True)
    rows, score, best = [], 0, 0
    for name in names:
        points = EXERCISES[name][0]
        tests, message, unknown = grade(name, paths, root, timeout)
        if unknown:
            raise UsageError(unknown[0])
        passed = not message
        score, best = score + points * passed, best + points
        rows.append((name, points, passed, tests, message))
        print(f"{name:<12} {points * passed:>2}/{points:<2} {'passed' if passed else 'FAILED':<6} "
              f"{tests_count(tests)}  {message}".rstrip(), flush=True)
    done = sum(r[2] for r in rows)
    print(f"total        {score}/{best} points, {done}/{len(rows)} exercises passed")
    if json_path:
        result = {"score": score, "max_score": best, "tests": [
            {"name": n, "score": p * ok, "max_score": p, "status": "passed" if ok else "failed",
             "output": msg or f"{tests_count(k).strip()} passed"} for n, p, ok, k, msg in rows]}
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if done == len(rows) else 1


def main(argv=None):
    parser = Parser(prog="python -m course.exercises", description="Course assignments on the reference: list "
                    "them, make a student copy, grade a copy.", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    sub.add_parser("list", help="one line per exercise")
    p = sub.add_parser("make", help="write a student copy with the chosen exercises stubbed")
    p.add_argument("dir", help="a new (or empty) folder outside the repository")
    p.add_argument("--only", nargs="+", default=[], metavar="NAME", help="these exercises only")
    p = sub.add_parser("check", help="run the grading tests, one row per exercise")
    p.add_argument("names", nargs="*", metavar="NAME", help="exercises to grade (default: all)")
    p.add_argument("--hidden", help="a folder of hidden grading tests ($EXERCISES_HIDDEN)")
    p.add_argument("--runs", help="the experiment's run folders ($EXERCISE_RUNS)")
    p.add_argument("--json", help="write the result here (Gradescope's results.json format)")
    p.add_argument("--timeout", type=float, default=TIMEOUT, metavar="SECONDS",
                   help=f"the time an exercise's tests may take together (default {TIMEOUT:g})")
    try:
        a = parser.parse_args(sys.argv[1:] if argv is None else argv)
        if a.command == "list":
            list_exercises()
        elif a.command == "make":
            make(a.dir, a.only)
        else:
            return check(a.names, a.hidden, a.runs, a.json, a.timeout)
        return 0
    except (UsageError, ValueError, OSError) as e:  # OSError: a folder or file it cannot write
        print(f"error: {e}", file=sys.stderr)
        return 2


# ------------------------------------------------------------------ the experiment's answers

def experiment_answers(filtered, control):
    """The experiment exercise, answered from the metrics.jsonl records (lists of dicts, one per
    line; step 0 holds the warm start's validation) of a Top-K run and of its random control, run
    with the same seed and settings -> dict:

      same_first_batch  True when both runs drew the same step-1 batch (equal train_success,
                        reward_mean and reward_std at step 1): the comparison is paired
      kept_ratio        the filter run's kept_ratio, averaged over its training steps
      kept_spread_gap   at step 1, mean_score_kept of the filter run minus the control's: how much
                        more reward spread the filter's groups had than a random set as large
      val_difference    the last val_success of the filter run minus the control's
      verdict           "filter", "control" or "undecided": which run kept more of the warm
                        start's success, as far as one seed of each can tell (a claim takes 5 seeds)
    """
    # BEGIN SOLUTION experiment
    first = [next(r for r in rows if r["step"] == 1) for rows in (filtered, control)]
    same = all(first[0][k] == first[1][k] for k in ("train_success", "reward_mean", "reward_std"))
    steps = [r for r in filtered if r["step"] >= 1]
    last_val = [[r["val_success"] for r in rows if "val_success" in r][-1]
                for rows in (filtered, control)]
    return {"same_first_batch": same,
            "kept_ratio": sum(r["kept_ratio"] for r in steps) / len(steps),
            "kept_spread_gap": first[0]["mean_score_kept"] - first[1]["mean_score_kept"],
            "val_difference": last_val[0] - last_val[1],
            "verdict": "undecided"}  # one seed each: no interval, no claim
    # END SOLUTION experiment


if __name__ == "__main__":
    sys.exit(main())
