"""A scripted policy for trl_ragen.py's tests, and the run that tests/test_trl_ragen.py launches on
two processes (`accelerate launch --cpu --num_processes 2 tests/trl_ragen_script.py OUT`): each
process writes what it selected to OUT/process-<i>.json.

ARGS: 3 groups x 2 rollouts on 2 processes, so each holds 3 rows and group 1 is split between
them. The scripted policy makes group 0 write garbage (zero spread) and rollout 0 of groups 1 and
2 play the solver's moves, so groups 1 and 2 have spread only when their rewards are gathered
from both processes.
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import envs  # noqa: E402
import rollout  # noqa: E402

ARGS = ["--env", "sokoban", "--filter", "topp", "--model", "tiny", "--no-warm-start",
        "--groups", "3", "--group-size", "2", "--max-turns", "1", "--max-new-tokens", "8",
        "--mi-samples", "6", "--mi-every", "1", "--tiny-cache", os.path.join(ROOT, ".cache/tiny")]


def default_role(row, K=2):
    """Row `row` of the gathered batch (group row // K, rollout row % K) plays the solver's moves:
    rollout 0 of every group but group 0."""
    return row // K > 0 and row % K == 0


def scripted(solves=default_role):
    """make_policy for trl_ragen.rollout_function: a stand-in for sampling with known rewards. The
    row number in the gathered batch decides, fixed at the first call, where every episode of this
    process is running: the solver's first moves, or garbage (every garbage reply earns the same
    format penalty). No log-probs."""
    def make(trainer, *settings):
        end = rollout.end_of_turn_ids(trainer.processing_class)[0]
        good = {}

        def policy(prompt_ids, env_list):
            if not good:
                first = trainer.accelerator.process_index * len(env_list)
                good.update({id(env): solves(first + i) for i, env in enumerate(env_list)})
            out = []
            for env in env_list:
                plan = envs.solve(env) or [env.actions[0]]
                text = (f" go </think> <answer> {' || '.join(plan[:2])} </answer>"
                        if good[id(env)] else " ?? </think>")
                ids = trainer.processing_class.encode(text, add_special_tokens=False)
                out.append(rollout.Generation(ids + [end]))
            return out
        return policy
    return make


def main(out):
    import torch
    from accelerate import PartialState

    import trl_ragen
    torch.set_num_threads(1)
    state = PartialState(cpu=True)  # gloo across the launched processes
    a = trl_ragen.parse_args(ARGS + ["--steps", "1", "--out", out])
    a.lr, a.max_new_tokens = 1e-4, 8
    model, tokenizer, prompt = trl_ragen.load_model(a, cuda=False)
    trainer = trl_ragen.build_trainer(a, model, tokenizer, prompt, state.num_processes,
                                      make_policy=scripted())
    trainer.train()
    with open(os.path.join(out, f"process-{state.process_index}.json"), "w") as f:
        json.dump({"processes": state.num_processes, "backend": str(state.backend),
                   **trainer.last_selection}, f)
    # leave without the interpreter's teardown: at exit, gloo's threads sometimes aborted one process
    # (SIGABRT) or left it waiting for the other, after both had written their results
    state.wait_for_everyone()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
