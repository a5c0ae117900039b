"""What lets a run survive a kill at any moment (Ctrl-C, kill -9, a full disk) and lose at most the
step in flight: checkpoints written aside and swapped in, the newest complete one found again after
whatever a kill left, and the metrics log restored from the copy each checkpoint holds.

A checkpoint is written to checkpoint.tmp, marked complete by its last file, then swapped in by
renames (checkpoint -> checkpoint.old, checkpoint.tmp -> checkpoint, remove checkpoint.old); at any
moment a kill can hit, recover_checkpoint finds the newest complete one, and a resumed run repeats
the lost step exactly: the same metrics as a run never interrupted. A log damaged since the
checkpoint (a garbage line, a truncated or deleted file) is rewritten from its copy, saying so
(restore_metrics): never a log with holes.
"""
import errno
import json
import os
import random
import shutil

import numpy as np
import torch

from plumbing import models


class CheckpointError(Exception):
    """A checkpoint or log that cannot be written or used: one line on stderr, exit code 2."""


def atomic_write(path, text):
    """`text` into `path` whole or not at all: written aside, flushed, renamed into place."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


# -------------------------------------------------------------------------------------- checkpoints

CHECKPOINT_SMALL = 2 * 2 ** 30  # bytes: a checkpoint this small is written every step
CHECKPOINT_EVERY = 10  # steps between larger checkpoints (on a GPU)


def checkpoint_every(device, n_trained):
    """Steps between checkpoints when --save-every is not given: every step on a CPU and for a
    small checkpoint (LoRA adapters, SmolLM2); on a GPU a large one (what trains in float32 and
    AdamW's two moments: 12 bytes a trained parameter, 0.5B PPO's policy and critic about 12 GB)
    every CHECKPOINT_EVERY steps. A kill then loses the steps since the last checkpoint, which
    --resume runs again exactly as they ran."""
    size = 12 * n_trained
    every = 1 if device.type != "cuda" or size < CHECKPOINT_SMALL else CHECKPOINT_EVERY
    if device.type == "cuda":
        print(f"checkpoints: every {every} step{'s' if every > 1 else ''} ({size / 1e9:.1f} GB "
              f"each; a kill loses at most {every - 1} steps, which --resume runs again "
              f"exactly; --save-every chooses)")
    return every


def _checkpoint_paths(out):
    return [os.path.join(out, name) for name in ("checkpoint", "checkpoint.tmp", "checkpoint.old")]


def save_checkpoint(run, step):
    """Everything needed to continue exactly. Written to checkpoint.tmp, marked complete by its last
    file, then swapped in: checkpoint -> checkpoint.old, checkpoint.tmp -> checkpoint, remove
    checkpoint.old."""
    out = run.args.out
    final, tmp, old = _checkpoint_paths(out)
    recover_checkpoint(out)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        models.save_policy(run, tmp)
        rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
               "python": random.getstate(),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        torch.save({"step": step, "state": run.state, "rng": rng,
                    "critic": run.critic.state_dict() if run.critic is not None else None,
                    "optimizers": [o.state_dict() for o in run.optimizers]},
                   os.path.join(tmp, "trainer_state.pt"))
        # the log so far, to repair a damaged metrics.jsonl from (restore_metrics)
        shutil.copyfile(os.path.join(out, "metrics.jsonl"), os.path.join(tmp, "metrics.jsonl"))
        atomic_write(os.path.join(tmp, "complete"), json.dumps({"step": step}))
    except (OSError, RuntimeError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        full = ((isinstance(e, OSError) and e.errno == errno.ENOSPC)
                or shutil.disk_usage(out).free < 2 ** 26)
        reason = "no space left on the device" if full else str(e).strip().splitlines()[0]
        raise CheckpointError(f"cannot write the checkpoint of step {step} to {out}: {reason}; the "
                              f"previous one is intact") from None
    if os.path.isdir(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def recover_checkpoint(out):
    """The folder of the newest complete checkpoint after whatever a kill left behind, or None. A
    complete checkpoint.tmp is newer than checkpoint and checkpoint.old; checkpoint is complete by
    construction (it is only ever renamed into place); checkpoint.old stands in when checkpoint is
    missing. Leftovers are removed."""
    final, tmp, old = _checkpoint_paths(out)
    if os.path.isfile(os.path.join(tmp, "complete")) and not os.path.isdir(final):
        os.replace(tmp, final)
    if not os.path.isdir(final) and os.path.isfile(os.path.join(old, "complete")):
        os.replace(old, final)
    if os.path.isdir(final):
        for leftover in (tmp, old):
            shutil.rmtree(leftover, ignore_errors=True)
    return final if os.path.isfile(os.path.join(final, "complete")) else None


def checkpoint_step(folder):
    try:
        with open(os.path.join(folder, "complete")) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"{folder} is damaged: no readable step") from None


def restore(run, folder):
    """The critic, optimisers and random streams of a checkpoint (models.load gave the policy)."""
    try:
        ckpt = torch.load(os.path.join(folder, "trainer_state.pt"), weights_only=False)
        if run.critic is not None:
            run.critic.load_state_dict(ckpt["critic"])
        for opt, s in zip(run.optimizers, ckpt["optimizers"]):
            opt.load_state_dict(s)
        torch.set_rng_state(ckpt["rng"]["torch"])
        np.random.set_state(ckpt["rng"]["numpy"])
        random.setstate(ckpt["rng"]["python"])
        if ckpt["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])
        return ckpt["step"], ckpt["state"]
    except Exception as e:  # whatever unpickling a damaged file raises (random bytes: pickle's)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"cannot resume: {folder} is damaged ({first})") from None


# ---------------------------------------------------------------------------------- the metrics log

def restore_metrics(path, ckpt):
    """The log as it stood at checkpoint `ckpt` (None: no checkpoint, an empty log): the lines of
    the steps after it go, as those steps run again. A log damaged up to that step (a line that is
    no record, a step missing) is rewritten from the checkpoint's copy, saying so; without a copy
    (a checkpoint of an older version) the run is refused. Never a log with holes."""
    step = checkpoint_step(ckpt) if ckpt else -1
    lines = open(path).readlines() if os.path.isfile(path) else []
    kept = [line for line in lines if _step_of(line) <= step]
    copy = os.path.join(ckpt, "metrics.jsonl") if ckpt else None
    saved = open(copy).read() if copy and os.path.isfile(copy) else None
    problems = log_damage(lines, step)
    garbage = [i + 1 for i, line in enumerate(lines) if _step_of(line) == float("inf")]
    if garbage and not problems:  # after the kept steps: a kill's half-written line, or added
        print(f"{path}: removed line {garbage[0]}, which is not a metrics record"
              + (f" (and {len(garbage) - 1} more)" if len(garbage) > 1 else ""))
    if saved is not None and (problems or "".join(kept) != saved):
        problems = problems or ["it differs from the checkpoint's copy"]
        print(f"{path} is damaged ({'; '.join(problems)}): rewrote its steps up to {step} from "
              f"the checkpoint's copy")
        kept = [saved]
    elif problems:
        raise CheckpointError(f"{path} is damaged ({'; '.join(problems)}) and the checkpoint holds "
                              f"no copy of it: repair the file or start the run again")
    atomic_write(path, "".join(kept))


def drop_garbage(path, expected):
    """The log of a run that no checkpoint holds a copy of (--save-every 0) cleared of lines that
    are no record, saying so, when its records are still exactly the steps `expected`, in order:
    then those lines were added to it, and the run's own lines are all there. Otherwise (a record
    damaged, a step missing or twice) a CheckpointError: nothing holds what to restore."""
    with open(path) as f:
        lines = f.readlines()
    garbage = [i + 1 for i, line in enumerate(lines) if _step_of(line) == float("inf")]
    kept = [line for line in lines if _step_of(line) != float("inf")]
    if [_step_of(line) for line in kept] != list(expected):
        problems = log_damage(lines, max(expected, default=0)) or [
            f"its steps are not {expected[0]} to {expected[-1]} in order"]
        raise CheckpointError(f"{path} is damaged ({'; '.join(problems)}) and no checkpoint holds "
                              f"a copy of it (--save-every 0): repair the file")
    if garbage:
        which = (f"line {garbage[0]} is not a metrics record" if len(garbage) == 1 else
                 f"{len(garbage)} lines are not metrics records, the first line {garbage[0]}")
        print(f"{path} is damaged ({which}): removed; its records of steps {expected[0]} to "
              f"{expected[-1]} are kept as they are")
        atomic_write(path, "".join(kept))


def log_damage(lines, step):
    """What keeps a log from holding every step 1..step once: lines that are no record (a kill's
    half-written last line, after the kept steps, is not damage), missing or repeated steps."""
    steps = [_step_of(line) for line in lines]
    last = max((i for i, s in enumerate(steps) if s <= step), default=-1)
    bad = [i + 1 for i, s in enumerate(steps[:last]) if s == float("inf")]
    kept = [s for s in steps if s <= step]
    missing = sorted(set(range(1, step + 1)) - set(kept))
    problems = []
    if bad:
        problems.append(f"line {bad[0]} is not a metrics record")
    if len(missing) == 1:
        problems.append(f"step {missing[0]} is missing")
    elif missing:
        problems.append(f"{len(missing)} steps are missing ({missing[0]} to {missing[-1]})")
    if len(set(kept)) < len(kept):
        problems.append("a step is logged twice")
    return problems


def log_steps(path):
    """The step of each line of the metrics log at `path`, inf for a line that is no record ([]:
    no log)."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [_step_of(line) for line in f]


def _step_of(line):
    try:
        step = json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")  # a half-written line of a killed run, or damage
    return step if isinstance(step, int) else float("inf")
