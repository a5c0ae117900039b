"""The paper's claims in miniature: run the pre-registered grids of grids.py side by side, resumable,
archive each finished run's metrics under results/<grid>/runs/, and report from those archives alone.

    python -m lab.experiments list [GRID ...]        # the grids, their claims, rules and wall time
    python -m lab.experiments run collapse-env --jobs 2   # run what is missing (1 thread each), report
    python -m lab.experiments run calibration --only frozenlake   # the settings named so, only
    python -m lab.experiments report [GRID ...]      # every table, figure and number from the archives

Run folders go to runs/experiments/<grid>/<setting>-s<seed> (not committed); a finished run is never
run again, an interrupted one is resumed (train.py --resume). When a run's process ends having done
its steps, its scalar metrics are gzipped to results/<grid>/runs/<setting>-s<seed>.jsonl.gz (the
archive the report reads, committed); a run that did not finish is not archived, and the runner says
so. Every grid names its model: the tiny policy (on a GPU machine too), or smollm2 for the grid of
that name. The statistics are in stats.py, the tables and figures in report.py.
"""
import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import time

if not __package__:  # run as a file (python lab/experiments.py): imports from the root, as with -m
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from plumbing.flags import polite_threads

polite_threads()  # before anything loads torch (and for the train.py runs it starts)
from lab import calibration, real_templates, report  # noqa: E402
from lab.grids import GRIDS, describe, done, estimate_hours, runs_of
from lab.protocol import BUCKET, RESULTS
from plumbing.flags import Parser, UsageError
from plumbing.plots import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def finished(folder, steps):
    """The run did its steps, or train.py stopped it: MAX_SKIPS steps in a row without spread."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        return done([], steps)
    with open(path) as f:
        records = read_jsonl(f)
    return done(records, steps)


def run(name, jobs, only=None):
    """Every run of the grid that has not finished (of the settings whose name holds `only`),
    `jobs` processes at a time; each run is archived when its process ends having finished; then
    the report. Ctrl-C stops the runs (each resumable) and says which were archived."""
    steps = GRIDS[name]["steps"]
    selected = selected_runs(name, only)
    todo = [r for r in selected if not finished(r[2], steps)]
    print(f"{name}: {len(selected) - len(todo)} runs finished, {len(todo)} to go, {jobs} at "
          f"a time (estimate {estimate_hours(name, jobs):.1f} h for the whole grid)")
    started, running = time.time(), []
    try:
        while todo or running:
            while todo and len(running) < jobs:
                setting, seed, folder, argv = todo.pop(0)
                resume = os.path.isfile(os.path.join(folder, "config.json"))
                flags = ["--resume", folder, "--steps", str(steps)] if resume else argv
                os.makedirs(os.path.dirname(folder), exist_ok=True)
                log = open(folder + ".log", "a")
                process = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py")]
                                           + flags, stdout=log, stderr=subprocess.STDOUT)
                running.append((folder, process, log))
                print(f"  {'resuming' if resume else 'starting'} {folder}", flush=True)
            time.sleep(2)
            for item in [r for r in running if r[1].poll() is not None]:
                folder, process, log = item
                log.close()
                running.remove(item)
                minutes = (time.time() - started) / 60
                print(f"  {folder}: exit {process.returncode}, {settle(folder, name, steps)} "
                      f"({minutes:.1f} min into this call)", flush=True)
    except KeyboardInterrupt:
        for folder, process, log in running:
            process.terminate()
            process.wait()
            log.close()
            print(f"  {folder}: stopped, {settle(folder, name, steps)}", flush=True)
        raise
    for _, _, folder, _ in runs_of(name):  # runs finished by an earlier call, archived again
        if finished(folder, steps):
            archive(folder, name)
    write_report(name)


def selected_runs(name, only=None, results=RESULTS):
    """The grid's runs of the settings whose name holds `only`; a follow-up grid's only in the
    cells its parent's rule selects (report.controlled_cells, from the parent's archives)."""
    selected = [r for r in runs_of(name) if (only or "") in r[0]]
    parent = GRIDS[name].get("followup_of")
    if parent:
        cells = report.controlled_cells(parent, results)
        selected = [r for r in selected if GRIDS[name]["cell_of"][r[0]] in cells]
        print(f"{name}: the cells {parent}'s rule selects: {', '.join(cells) or 'none'}")
    return selected


def write_report(name, results=RESULTS, with_figures=True, force=False):
    """The grid's report: report.report's curves and verdicts, or for a grid of policies measured
    once (a run a policy) its own tables: calibration.write_report, real_templates'."""
    kind = GRIDS[name].get("kind")
    writer = {"calibration": calibration.write_report,
              "real-templates": real_templates.write_report}.get(kind, report.report)
    return writer(name, results=results, with_figures=with_figures, force=force)


def settle(folder, name, steps):
    """Archive a run whose process has ended if it finished -> what happened, in words."""
    if finished(folder, steps):
        return f"archived to {archive(folder, name)}"
    return "not finished: not archived (run the grid again to resume it)"


def archive(folder, name, results=RESULTS):
    """A run's metrics.jsonl, every scalar metric, a real model's logged texts (probe_reasonings)
    and the gradient decomposition's BUCKET numbers, floats to 6 significant digits, gzipped
    without a time stamp (the same log gives the same bytes) to
    results/<grid>/runs/<run>.jsonl.gz, written atomically, with what ran it beside (provenance).
    No log: nothing."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    lines = []
    with open(path) as f:
        records = read_jsonl(f)
    for r in records:
        kept = {k: six_digits(v) for k, v in r.items() if not isinstance(v, (list, dict))
                or isinstance(v, list) and all(isinstance(x, str) for x in v)}
        if "grad_decomposition" in r:
            kept["grad_decomposition"] = [{k: six_digits(b[k]) for k in BUCKET}
                                          for b in r["grad_decomposition"]]
        lines.append(json.dumps(kept) + "\n")
    out = report.archive_path(name, folder, results)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, filename="") as f:
        f.write("".join(lines).encode())
    with open(out + ".tmp", "wb") as f:
        f.write(buffer.getvalue())
    os.replace(out + ".tmp", out)
    provenance(folder, out)
    return out


def provenance(folder, out):
    """Beside the archive, <run>.provenance.json: what ran it -- each process's commit, command
    line, starting weights and machine (plumbing/runs.py:write_provenance) and the run's resolved
    settings (config.json); nothing where the run folder has neither (runs made before either)."""
    kept = {}
    for key, file in (("provenance", "provenance.json"), ("config", "config.json")):
        try:
            with open(os.path.join(folder, file)) as f:
                kept[key] = json.load(f)
        except (OSError, ValueError):
            pass
    if kept:
        path = out[:-len(".jsonl.gz")] + ".provenance.json"
        with open(path + ".tmp", "w") as f:
            f.write(json.dumps(kept, indent=1, sort_keys=True) + "\n")
        os.replace(path + ".tmp", path)


def six_digits(v):
    return float(f"{v:.6g}") if isinstance(v, float) else v


# ------------------------------------------------------------------------------------- command line

def main(argv=None):
    parser = Parser(
        prog="python -m lab.experiments", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("command", choices=("list", "run", "report"))
    parser.add_argument("grids", nargs="*", help=f"grid names: {', '.join(GRIDS)} (list, report: "
                                                  f"all when none is named)")
    parser.add_argument("--jobs", type=int, default=2, help="train.py processes at a time")
    parser.add_argument("--only", help="run: only the settings whose name contains this text")
    parser.add_argument("--force", action="store_true",
                        help="report: overwrite a report even with fewer or shorter archives")
    parser.add_argument("--into", help="report: regenerate into this folder (the archives copied "
                                       "there first), to compare with results/")
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        return fail(str(e))
    unknown = [g for g in args.grids if g not in GRIDS]
    if unknown:
        return fail(f"unknown grid {unknown[0]!r}; valid: {', '.join(GRIDS)}")
    if args.jobs < 1:
        return fail("--jobs must be >= 1")
    if args.command == "run" and not args.grids:
        return fail(f"name the grids to run (hours each: python -m lab.experiments list): "
                    f"{', '.join(GRIDS)}")
    closed = [g for g in args.grids if args.command == "run" and GRIDS[g].get("closed")]
    if closed:
        return fail(f"{closed[0]} is {GRIDS[closed[0]]['closed']}; its report stands on the "
                    f"archived runs")
    for name in args.grids if args.only is not None else ():
        if not any(args.only in setting for setting in GRIDS[name]["settings"]):
            return fail(f"--only {args.only}: no setting of {name} has it in its name; its "
                        f"settings: {', '.join(GRIDS[name]['settings'])}")
    try:
        if args.command == "list":
            for name in args.grids or GRIDS:
                print(describe(name))
        elif args.command == "run":
            for name in args.grids:
                run(name, args.jobs, args.only)
        else:
            names = [n for n in args.grids or GRIDS
                     if args.grids or os.path.isdir(os.path.join(RESULTS, n, "runs"))]
            for name in set(args.grids or GRIDS) - set(names):
                print(f"{name}: not run yet (no {RESULTS}/{name}/runs)")
            results = RESULTS if args.into is None else scratch_copy(args.into)
            for name in names:
                write_report(name, results=results, force=args.force)
            if args.into is not None:
                print(f"reports written into {args.into}; compare: diff -r {RESULTS} {args.into}")
    except report.ReportError as e:
        return fail(str(e))
    except KeyboardInterrupt:
        print("interrupted: the runs that finished are archived; run the grid again to resume "
              "the others", file=sys.stderr)
        return 130
    return 0


def scratch_copy(folder, results=RESULTS):
    """Every committed grid's archives and manifest, and the first report, copied into `folder`
    (new or empty): what a report is made from and nothing else -> `folder`."""
    if os.path.exists(folder) and os.listdir(folder):
        raise report.ReportError(f"--into {folder}: not an empty folder")
    for name in os.listdir(results):
        for part in ("runs", "numbers.json"):
            source = os.path.join(results, name, part)
            if os.path.isdir(source):
                shutil.copytree(source, os.path.join(folder, name, part))
            elif os.path.isfile(source):
                os.makedirs(os.path.join(folder, name), exist_ok=True)
                shutil.copy(source, os.path.join(folder, name, part))
    shutil.copytree(os.path.join(results, report.FIRST_REPORT),
                    os.path.join(folder, report.FIRST_REPORT), dirs_exist_ok=True)
    return folder


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
