"""Each step of the given run folders as one row, from their metrics.jsonl alone: what a GPU lease
keeps of a run even when its time limit killed it (the log is written a step at a time).

    python bench/run_rows.py /tmp/gpu-check/smollm2 /tmp/gpu-check/main/*

Per step: the seconds of the rollouts, the diagnosis (time_scoring: 0 at a step without one), the
update and the whole step, the peak GPU memory, the tokens sampled and the reply length. A folder
without a log is one row saying so. Last line: RESULT run_rows <steps found>.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arguments import Parser, parse  # noqa: E402

KEYS = ("time_rollout", "time_scoring", "time_update", "time_step", "gpu_peak_gb",
        "tokens_sampled", "response_length")


def rows(folder):
    """The folder's steps as rows (a cut last line, from a kill, is left out)."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        return [{"run": folder, "steps": 0, "note": "no log: killed before its first step"}]
    out = []
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("step"):
                out.append({"run": folder, "step": r["step"],
                            **{k: round(r[k], 3) for k in KEYS if isinstance(r.get(k), float)}})
    return out


def main(argv=None):
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="*", help="run folders")
    parser.add_argument("--quick", action="store_true", help="no folders needed: an empty table")
    args = parse(parser, argv)
    found = 0
    for folder in args.folders:
        for row in rows(folder):
            print(json.dumps(row))
            found += "step" in row
    print(f"RESULT run_rows {found}")


if __name__ == "__main__":
    main()
