"""exercises.py: grading that bites and isolates, and a student copy that runs and gives nothing away.

An exercise is "blanked" or "planted" in this process: its functions get the code compiled from
the student source (exercises.student_source) or from the solution with a plausible mistake
(PLANTED), through their __code__, and the grading tests (tests/test_grading.py) are called
directly. Hostile code is patched in here too: `check` forks each exercise's process from this one.
A fresh process (conftest.run_fresh) grades two real student copies made by `make`.
"""
import ast
import errno
import importlib
import json
import multiprocessing
import os
import shutil

import pytest

import grpo
import ppo
from conftest import run_fresh
from course import exercises
import test_grading

ROOT = exercises.ROOT

# exercise: [(file, solution text inside its regions, a plausible wrong version[, and again])]
PLANTED = {
    "chain_rule": [
        ("mi.py", "return float(prior @ _neg_xlogx(table).sum(axis=1))",
         "return float(_neg_xlogx(table).sum(axis=1).mean())"),              # forgets p(x)
        ("mi.py", "return -p * np.log(np.where(p > 0, p, 1.0))",
         "return -p * np.log(p)"),                                          # 0 log 0 = nan
    ],
    "mi_estimate": [
        ("mi.py", "marginal = torch.logsumexp(table, dim=1) - math.log(table.shape[1])",
         "marginal = table.mean(dim=1)"),                           # averages the log-likelihoods
        ("mi.py", "marginal = torch.logsumexp(table, dim=1) - math.log(table.shape[1])",
         "marginal = torch.logsumexp(table, dim=1)"),                        # no - log N
        ("mi.py", "estimate = (matched - marginal).mean().item()",
         "estimate = (matched + math.log(num_prompts)).mean().item()"),    # matched pairs only
        ("mi.py", "spread = marginal.std(correction=0).item() if num_samples > 1 else 0.0",
         "spread = marginal.std().item() if num_samples > 1 else 0.0"),      # sample std
    ],
    "retrieval": [
        ("mi.py", "return torch.where(j > 0, 1.0 - miss, torch.zeros_like(miss))",
         "return (key[scores.argmax(1)] == key[owner]).double()"),           # ties to the first
        ("mi.py", "own = key[None, :] == key[owner][:, None]",
         "own = torch.arange(len(key))[None, :] == owner[:, None]"),         # ignores prompt_keys
    ],
    "bound": [
        ("snr_filter.py", "rv = (centred ** 2).mean()", "rv = (centred ** 2).sum() / (len(r) - 1)"),
        ("snr_filter.py", "centred = r - r.mean()", "centred = r"),           # no baseline
    ],
    "topp": [
        ("snr_filter.py", "value * ranked.sum() - 0.01", "value * ranked.sum()"),   # no slack
        ("snr_filter.py", "return min(n_keep, int((ranked > 0).sum()))", "return n_keep"),
        ("snr_filter.py", "mass = torch.softmax(ranked, 0).cumsum(0)",
         "mass = ranked.cumsum(0) / ranked.sum()"),                          # linear, not softmax
    ],
    "topk": [
        ("snr_filter.py", "max(1, int(value * G))", "max(1, int(value * n_ranked))"),
        ("snr_filter.py", "max(1, int(value * G))", "int(value * G)"),
    ],
    "gae": [  # the batch as one long stream: a row's last token bootstraps from the next row
        ("ppo.py", "B, T = rewards.shape\n",
         "shape = rewards.shape\n"
         "    rewards, values, on = rewards.reshape(1, -1), values.reshape(1, -1), on.reshape(1, -1)\n"
         "    B, T = rewards.shape\n",
         "returns = (advantages + values) * on",
         "advantages, values, on = advantages.view(shape), values.view(shape), on.view(shape)\n"
         "    returns = (advantages + values) * on"),
        ("ppo.py", "next_value = torch.where(on[:, t], values[:, t], next_value)",
         "next_value = values[:, t]"),                                       # masked V leaks in
        ("ppo.py", "returns = (advantages + values) * on",                   # [1, B, T]
         "advantages, values, on = advantages[None], values[None], on[None]\n"
         "    returns = (advantages + values) * on"),
    ],
    "clip_loss": [
        ("ppo.py", "ratio.clamp(1.0 - clip_low, 1.0 + clip_high)",
         "ratio.clamp(1.0 - clip_low, 1.0 + clip_low)"),                     # symmetric clip
        ("ppo.py", "capped = (adv < 0) & (per_token > cap)", "capped = per_token > cap"),
        ("ppo.py", "per_token = torch.maximum(unclipped, clipped)",
         "per_token = torch.minimum(unclipped, clipped)"),
    ],
    "grpo": [
        ("ppo.py", "per_seq = per_seq / norm_length",
         "per_seq = per_seq / mask.sum(-1).clamp_min(1)"),   # Dr.GRPO over the sequence length
        ("ppo.py", "return masked_mean(per_seq, has_tokens)", "return per_seq.mean()"),
        ("grpo.py", "rewards.std(dim=1, keepdim=True)", "rewards.std(dim=1, keepdim=True, correction=0)"),
        ("grpo.py", "centred / (rewards.std(dim=1, keepdim=True) + eps)",           # NaN when flat
         "centred / rewards.std(dim=1, keepdim=True)",
         "return torch.where(flat, torch.zeros_like(centred), centred)", "return centred"),
    ],
    "experiment": [
        ("course/exercises.py", '"verdict": "undecided"}',
         '"verdict": "filter" if last_val[0] > last_val[1] else "control"}'),
        ("course/exercises.py", '"kept_spread_gap": first[0]["mean_score_kept"] - first[1]["mean_score_kept"],',
         '"kept_spread_gap": first[1]["mean_score_kept"] - first[0]["mean_score_kept"],'),  # the sign
    ],
    "silent_bug": [],  # the planted defect itself is its wrong version (DEFECTS)
}


def grading_tests():
    """{exercise: [test functions]} of tests/test_grading.py."""
    out = {}
    for name, fn in vars(test_grading).items():
        for mark in getattr(fn, "pytestmark", []) if name.startswith("test_") else []:
            if mark.name == "exercise":
                out.setdefault(mark.args[0], []).append(fn)
    return out


TESTS = grading_tests()


def failing(names=None):
    """The exercises (of `names`, default all) whose grading tests do not all pass."""
    bad = set()
    for name, tests in TESTS.items():
        if names is not None and name not in names:
            continue
        for test in tests:
            try:
                test()
            except Exception:  # an assertion, NotImplementedError, or what a wrong version raises
                bad.add(name)
                break
    return bad


def variant(texts, monkeypatch):
    """Give every top-level function that holds a solution region (in the solution's source) the
    code compiled from texts[file] (the module's source as a whole: a student or planted
    version)."""
    for file, text in texts.items():
        module = importlib.import_module(file[:-3].replace("/", "."))
        solution = source(file)  # the regions are found in the solution: a planted defect hides its own
        names = {node.name for node in ast.parse(solution).body if isinstance(node, ast.FunctionDef)
                 and any(node.lineno <= b + 1 <= node.end_lineno
                         for _, b, _ in exercises.regions(solution))}
        assert names, file  # a variant that swaps nothing would pass every check
        scope = {"__name__": module.__name__, "__file__": module.__file__}
        exec(compile(text, module.__file__, "exec"), scope)
        for name in names:
            monkeypatch.setattr(getattr(module, name), "__code__", scope[name].__code__)


def source(file):
    with open(os.path.join(ROOT, file), encoding="utf-8") as f:
        return f.read()


def planted(text, name, pairs):
    """`text` with each (right, wrong) pair replaced inside the regions of exercise `name`, where
    `right` occurs exactly once."""
    for right, wrong in zip(pairs[::2], pairs[1::2]):
        lines = text.splitlines(keepends=True)
        hits = ["".join(lines[b:e + 1]) for n, b, e in exercises.regions(text) if n == name]
        hits = [region for region in hits if right in region]
        assert len(hits) == 1 and hits[0].count(right) == 1, (name, right)
        text = text.replace(hits[0], hits[0].replace(right, wrong))
    return text


def region_text(file, name):
    lines = source(file).splitlines(keepends=True)
    return "".join("".join(lines[b:e]) for n, b, e in exercises.regions(source(file)) if n == name)


def test_every_exercise_has_regions_hints_tests_and_a_planted_mistake():
    places = exercises.solution_map()
    assert list(TESTS) and set(TESTS) == set(exercises.EXERCISES) == set(places) == set(PLANTED)
    assert len(exercises.EXERCISES) >= 11
    for name, regions in places.items():
        for file, function, _, _ in regions:
            assert name in exercises.DEFECTS or (name, function) in exercises.HINTS, (name, function)
        assert PLANTED[name] or name in exercises.DEFECTS
        for file, *pairs in PLANTED[name]:
            for right in pairs[::2]:
                assert region_text(file, name).count(right) == 1, (name, right)
    assert set(exercises.HINTS) == {(n, f) for n, r in places.items() for _, f, _, _ in r
                                    if n not in exercises.DEFECTS}


def test_the_solution_passes_every_grading_test():
    assert failing() == set()


@pytest.mark.parametrize("name", list(exercises.EXERCISES))
def test_blanking_one_exercise_fails_its_grade_and_no_other(name, monkeypatch):
    files = {file for file, _, _, _ in exercises.solution_map()[name]}
    variant({f: exercises.student_source(source(f), {name}, f) for f in files}, monkeypatch)
    assert failing() == {name}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # a wrong version's NaN is the point
@pytest.mark.parametrize("name, index", [(n, i) for n, ps in PLANTED.items()
                                         for i in range(len(ps))])
def test_each_planted_mistake_fails_its_exercise(name, index, monkeypatch):
    file, *pairs = PLANTED[name][index]
    variant({file: planted(source(file), name, pairs)}, monkeypatch)
    assert failing({name}) == {name}


def test_a_stub_keeps_the_code_around_it_and_the_other_regions():
    text = source("ppo.py")
    out = exercises.student_source(text, {"gae"}, "ppo.py")
    assert out != text and ast.parse(out)
    assert out.count("raise NotImplementedError(") == 1 + text.count("raise NotImplementedError(")
    assert "# advantages: [B, T]" in out and "# BEGIN SOLUTION gae" in out
    assert region_text("ppo.py", "clip_loss") in out and region_text("ppo.py", "grpo") in out
    assert "per_token = torch.maximum(unclipped, clipped)" in out
    sampler_text = source("plumbing/sampler.py")
    planted = exercises.student_source(sampler_text, {"silent_bug"}, "plumbing/sampler.py")
    assert "SOLUTION" not in planted and "[::-1]" in planted and ast.parse(planted)


def test_region_markers_must_pair():
    for bad in ("# BEGIN SOLUTION a\n", "# END SOLUTION a\n",
                "# BEGIN SOLUTION a\n# BEGIN SOLUTION b\n# END SOLUTION b\n# END SOLUTION a\n",
                "# BEGIN SOLUTION a\n# END SOLUTION b\n"):
        with pytest.raises(ValueError):
            exercises.regions(bad)


def test_list_names_every_exercise_first(capsys):
    assert exercises.main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:-1]] == list(exercises.EXERCISES)
    assert "mi.py:collapse_metrics" in lines[1] and "theory.md Sec. 2" in lines[1]
    assert "sampler" not in lines[-2]  # the silent bug's place is the exercise


@pytest.mark.parametrize("argv", [["check", "nope"], ["make", "/tmp/x", "--only", "nope"],
                                  ["frobnicate"], [], ["check", "--hidden", "/no/such/folder"],
                                  ["make", ROOT], ["check", "--runs", "/no/such/folder"]])
def test_bad_input_is_one_line_and_exit_2(argv, capsys):
    assert exercises.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1


def test_check_grades_hidden_tests_and_writes_json(tmp_path, monkeypatch, capsys):
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "test_hidden_gae.py").write_text(
        "import pytest, torch, ppo\n\n"
        "@pytest.mark.exercise('gae')\n"
        "def test_gae_a_hidden_case():\n"
        "    assert ppo.gae(torch.ones(1, 1), torch.zeros(1, 1), torch.ones(1, 1), whiten=False)[0]"
        ".item() == 2.0, 'a hidden expectation'\n")
    monkeypatch.setenv("EXERCISES_HIDDEN", str(hidden))
    result = tmp_path / "results.json"
    assert exercises.main(["check", "gae", "topk", "--json", str(result)]) == 1
    tree, *rows = capsys.readouterr().out.splitlines()
    assert tree == f"grading the reference solution in {ROOT}, not a student copy (a copy holds " \
                   f"assignment.txt; run check inside it)"
    assert rows[0].split()[:3] == ["gae", "0/4", "FAILED"] and "a hidden expectation" in rows[0]
    assert rows[1].split()[:3] == ["topk", "2/2", "passed"]
    assert rows[2].startswith("total") and "2/6 points" in rows[2]
    out = json.loads(result.read_text())
    assert out["score"] == 2 and out["max_score"] == 6 and [t["score"] for t in out["tests"]] == [0, 2]
    monkeypatch.delenv("EXERCISES_HIDDEN")
    assert exercises.main(["check", "topk", "bound"]) == 0
    (hidden / "test_hidden_typo.py").write_text(
        "import pytest\n\n@pytest.mark.exercise('gea')\ndef test_typo():\n    pass\n")
    capsys.readouterr()
    assert exercises.main(["check", "gae", "--hidden", str(hidden)]) == 2   # a teacher's typo
    err = capsys.readouterr().err
    assert "unknown exercise 'gea'" in err and len(err.strip().splitlines()) == 1


def hangs(*args, **kwargs):
    while True:
        pass


def ends_its_process(*args, **kwargs):
    os._exit(0)


def stops_the_session(*args, **kwargs):
    raise KeyboardInterrupt  # pytest stops: no test fails, and the rest never run


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                    reason="the patched functions reach the graded process by fork")
def test_check_survives_code_that_hangs_or_ends_its_process(tmp_path, monkeypatch, capsys):
    """Each exercise is graded in a process of its own, with a time limit: a gae that never
    returns fails when its limit is up, a clip_loss that ends its process fails, so does a grpo
    that stops the test session before any test fails; the next exercise is graded as usual, and
    the rows and the JSON file come all the same. Only the hanging exercise gets a short limit: a
    hang can end no other way, while the others, under the default limit, end on their own
    however busy the machine (no verdict here depends on which of two clocks runs out first)."""
    monkeypatch.setattr(ppo, "gae", hangs)
    monkeypatch.setattr(ppo, "clipped_policy_loss", ends_its_process)
    monkeypatch.setattr(grpo, "group_advantages", stops_the_session)
    grade = exercises.grade
    monkeypatch.setattr(exercises, "grade", lambda name, paths, root, timeout: grade(
        name, paths, root, 2.0 if name == "gae" else timeout))
    result = tmp_path / "results.json"
    argv = ["check", "gae", "clip_loss", "grpo", "topk", "--json", str(result)]
    assert exercises.main(argv) == 1
    rows = capsys.readouterr().out.splitlines()[1:]  # after the tree graded
    # stopped while collecting or inside a test (then the row names what that test checks)
    assert rows[0].split()[:3] == ["gae", "0/4", "FAILED"] and rows[0].endswith(
        "timed out after 2 s")
    assert rows[1].split()[:3] == ["clip_loss", "0/4", "FAILED"] and rows[1].endswith(
        "  by hand: its process ended (exit code 0) before reporting")
    assert rows[2].split()[:3] == ["grpo", "0/4", "FAILED"] and rows[2].endswith(
        "  group advantages by hand: did not finish")
    assert rows[3].split()[:3] == ["topk", "2/2", "passed"] and "2/14 points" in rows[4]
    out = json.loads(result.read_text())
    assert [(t["name"], t["status"]) for t in out["tests"]] == [
        ("gae", "failed"), ("clip_loss", "failed"), ("grpo", "failed"), ("topk", "passed")]
    assert out["score"] == 2 and "timed out" in out["tests"][0]["output"]


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                    reason="the patched code reaches the graded process by fork")
def test_a_row_names_the_check_that_failed_but_not_the_answer(tmp_path, monkeypatch, capsys):
    """The silent bug planted, as a student copy holds it: its row says which check failed by what
    the check is for, never by the test's name (which could say what it compares) nor by pytest's
    account of the assertion (the values and the code that computed them); the count of tests
    reads "1 test", "3 tests"."""
    file = "plumbing/sampler.py"
    variant({file: exercises.student_source(source(file), {"silent_bug"}, file)}, monkeypatch)
    result = tmp_path / "results.json"
    assert exercises.main(["check", "silent_bug", "topk", "gae", "--json", str(result)]) == 1
    rows = capsys.readouterr().out.splitlines()[1:]
    assert rows[0].split()[:5] == ["silent_bug", "0/5", "FAILED", "1", "test"], rows[0]
    assert rows[0].endswith("  the property the MI diagnosis relies on: a result is not the "
                            "expected one"), rows[0]
    (test,) = TESTS["silent_bug"]
    assert test.__name__[len("test_"):] not in rows[0] and "assert" not in rows[0]
    assert rows[1].split()[:5] == ["topk", "2/2", "passed", "1", "test"], rows[1]
    assert rows[2].split()[:5] == ["gae", "4/4", "passed", "3", "tests"], rows[2]
    outputs = [t["output"] for t in json.loads(result.read_text())["tests"]]
    assert outputs[1:] == ["1 test passed", "3 tests passed"] and outputs[0] in rows[0]


def test_a_broken_hidden_test_or_an_unwritable_path_is_bad_input(tmp_path, monkeypatch, capsys):
    """A teacher's hidden test that does not compile, a --json path that cannot be written, a time
    limit of 0, a copy into a read-only folder: one line on stderr and exit 2, before any
    grading."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "test_hidden_gae.py").write_text("import ppo\n\ndef test_gae(:\n    pass\n")
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: refuse as the kernel refuses everyone else
        def refuse(path, *args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        monkeypatch.setattr(exercises.os, "makedirs", refuse)
    cases = [(["check", "gae", "--hidden", str(hidden)], "test_hidden_gae.py, line 3"),
             (["check", "gae", "--json", str(tmp_path)], "Is a directory"),
             (["check", "gae", "--timeout", "0"], "--timeout"),
             (["make", str(read_only / "hw")], "Permission denied")]
    for argv, reason in cases:
        assert exercises.main(argv) == 2, argv
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith("error: "), argv
        assert len(captured.err.strip().splitlines()) == 1 and reason in captured.err, captured.err
    assert os.listdir(read_only) == []


# What the student copies' tests run in their copy, as a student types it there
IMPORTS_AND_GRADES = ("import sys, train, plumbing.plots, lab.experiments; from course import exercises; "
                      "exercises.main(['list']); sys.exit(exercises.main(['check', '--json', 'result.json']))")


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """{name: (the copy, exit code, stdout, stderr)}: a student copy of every exercise ("student",
    its command importing everything, listing and grading) and one made with --only gae, whose gae
    the student then solved ("hw", `python -m course.exercises check --json result.json`); both
    commands run from their copy by one conftest.run_fresh, which imports torch once for both."""
    tmp = tmp_path_factory.mktemp("copies")
    student, hw = tmp / "student", tmp / "hw"
    assert exercises.main(["make", str(student)]) == 0
    assert exercises.main(["make", str(hw), "--only", "gae"]) == 0
    stubbed = exercises.student_source(source("ppo.py"), {"gae"}, "ppo.py")
    assert (hw / "ppo.py").read_text() == stubbed != source("ppo.py")
    shutil.copy(os.path.join(ROOT, "ppo.py"), hw / "ppo.py")  # the student solves it
    cases = [("code", IMPORTS_AND_GRADES, [], str(student)),
             ("module", "course.exercises", ["check", "--json", "result.json"], str(hw))]
    results = run_fresh(cases, tmp, env={**os.environ, "EXERCISE_RUNS": ""})
    return {name: (folder, *result) for name, folder, result in zip(("student", "hw"),
                                                                   (student, hw), results)}


def test_a_copy_of_some_exercises_grades_them_only(copies, capsys):
    """`make --only gae`: the copy grades gae alone (not the experiment, whose reference runs it
    leaves out), and exits 0 once gae passes."""
    copy, code, out, err = copies["hw"]
    assert (copy / "assignment.txt").read_text() == "gae\n"
    exercises.list_exercises(str(copy))
    assert capsys.readouterr().out.splitlines()[-1] == "assigned in this copy: gae"
    assert code == 0, out + err[-2000:]
    tree, *rows = out.splitlines()
    assert tree == f"grading the student copy in {copy}"  # its own score, not the solution's
    assert [row.split()[:3] for row in rows] == [["gae", "4/4", "passed"],
                                                  ["total", "4/4", "points,"]]
    assert json.loads((copy / "result.json").read_text())["max_score"] == 4


def solution_lines():
    """{stripped code line of a region} that no module holds outside its regions: text a student
    copy must hold nowhere (modules, tests, docs, bench)."""
    inside, outside = set(), set()
    for rel in exercises.tracked_files(ROOT):
        path = os.path.join(ROOT, rel)
        if not rel.endswith(".py") or "/" in rel:  # the modules: what a copy keeps as it is
            continue
        lines = source(rel).splitlines()
        marked = set()
        for _, b, e in exercises.regions(source(rel)):
            marked.update(range(b, e + 1))
        for i, line in enumerate(lines):
            code = line.split("  #")[0].strip()
            (inside if i in marked else outside).add(code)
    return {line for line in inside - outside if len(line) > 12 and not line.startswith("#")}


def test_the_student_copy_runs_fails_every_exercise_and_holds_no_solution(copies):
    copy, code, out, err = copies["student"]
    assert sorted(os.listdir(copy / "tests")) == ["conftest.py", "test_grading.py"]
    assert not (copy / "results" / "exercises" / "experiment").exists()
    distinctive = solution_lines()
    assert len(distinctive) > 40
    for folder, _, files in os.walk(copy):
        for file in files:
            try:
                text = open(os.path.join(folder, file), encoding="utf-8").read()
            except UnicodeDecodeError:
                continue
            leaked = [line for line in distinctive if line in text]
            assert not leaked, f"{file} holds solution text: {leaked[:3]}"
    # the copy imports everything, lists, and fails every exercise on its stubs (or the defect)
    assert code == 1, err[-2000:]
    rows = out.splitlines()[-len(exercises.EXERCISES) - 1:]
    for name, row in zip(exercises.EXERCISES, rows):
        assert row.split()[:3] == [name, f"0/{exercises.EXERCISES[name][0]}", "FAILED"], row
        if name not in ("experiment", "silent_bug"):
            assert "NotImplementedError" in row, row
    assert json.loads((copy / "result.json").read_text())["score"] == 0


# The silent bug's grading test (test_grading.py:test_silent_bug_is_fixed, named so as to say
# nothing) checks what the MI diagnosis takes for granted: episode m's first reply was sampled from
# episode m's prompt, so a fresh forward pass over its transcript gives the log-probs recorded while
# sampling (the diagnosis then scores each reply under its own prompt exactly).
def test_the_committed_silent_bug_runs_show_it_in_the_mi_not_in_the_entropy():
    """EXERCISES.md's silent-bug command, run on the solution (healthy) and on a copy made with
    --only silent_bug (defect): the entropy curves agree, the MI diagnosis tells them apart."""
    logs = {}
    for name in ("healthy", "defect"):
        folder = os.path.join(ROOT, "results", "exercises", "silent_bug", name)
        with open(os.path.join(folder, "config.json")) as f:
            config = {k: v for k, v in json.load(f).items() if k != "out"}
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            logs[name] = config, [json.loads(line) for line in f if line.strip()]
    assert logs["healthy"][0] == logs["defect"][0]  # the same command
    rows = {name: [r for r in log if "mi_estimate" in r] for name, (_, log) in logs.items()}
    assert len(rows["healthy"]) == len(rows["defect"]) >= 3
    mean = {name: {k: sum(r[k] for r in rs) / len(rs) for k in ("token_entropy", "reasoning_entropy")}
            for name, rs in rows.items()}
    assert 2 / 3 < mean["defect"]["token_entropy"] / mean["healthy"]["token_entropy"] < 3 / 2
    assert 0.8 < mean["defect"]["reasoning_entropy"] / mean["healthy"]["reasoning_entropy"] < 1.25
    for healthy, defect in zip(rows["healthy"], rows["defect"]):
        assert healthy["retrieval_acc"] > 2 * healthy["retrieval_chance"] and healthy["mi_estimate"] > .5
        assert defect["retrieval_acc"] <= defect["retrieval_chance"] and defect["mi_estimate"] < 0
