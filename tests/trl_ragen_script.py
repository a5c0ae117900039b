"""A scripted policy for trl_ragen.py's tests, and the run that tests/test_trl_ragen.py launches on
two processes (`accelerate launch --multi_gpu --num_processes 2 tests/trl_ragen_script.py OUT`):
each process writes what it found to OUT/process-<i>.json.

ARGS: 3 groups x 2 rollouts on 2 processes, so each holds 3 rows and group 1 is split between
them. The scripted policy makes group 0 write garbage (zero spread) and rollout 0 of groups 1 and
2 play the solver's moves, so groups 1 and 2 have spread only when their rewards are gathered
from both processes. After that step, on the same processes: multi-turn episodes through TRL's
server-mode vLLM generate with a fake client (vllm_episodes), and sampling and the diagnosis on
the policy sharded by torch FSDP (fsdp_episodes), each with episodes of different lengths on the
two processes.
"""
import copy
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


def reply_to(prompt, end):
    """The fake vLLM server's reply to a prompt: two ids made from it, then the end of the turn."""
    return [10 + sum(prompt) % 50, 10 + len(prompt) % 50, end]


def replies_answer_their_prompts(out, end):
    """Is every sampled turn of rollout_func's answer `out` reply_to of the transcript before it?"""
    for prompt, completion, mask in zip(out["prompt_ids"], out["completion_ids"],
                                        out["env_mask"]):
        ids, turns = prompt + completion, [t for t, m in enumerate(mask) if m and not
                                           (t and mask[t - 1])]  # each reply's first token
        for t in turns:
            start = len(prompt) + t
            if ids[start:start + 3] != reply_to(ids[:start], end):
                return False
    return True


def vllm_episodes(trainer):
    """Process i plays 2 + 2 i episodes of 1 + 2 i turns through TRL's VLLMGeneration.generate in
    server mode (its gather, broadcast and per-process slice) with a fake client: the processes
    bring different numbers of prompts to the first turn, and process 0 none to the next two."""
    from types import SimpleNamespace

    from trl.generation.vllm_generation import VLLMGeneration

    from scaleout import trl_ragen
    rank = trainer.accelerator.process_index
    end = rollout.end_of_turn_ids(trainer.processing_class)[0]

    def serve(prompts, n, **kw):
        replies = [reply_to(p, end) for p in prompts for _ in range(n)]
        return {"prompt_ids": prompts, "completion_ids": replies,
                "logprobs": [[[-1.0]] * len(r) for r in replies]}

    engine = VLLMGeneration.__new__(VLLMGeneration)  # the server's client faked, nothing started
    engine.__dict__.update(
        accelerator=trainer.accelerator, mode="server", enable_sleep_mode=False,
        vllm_client=SimpleNamespace(generate=serve), temperature=1.0, top_p=1.0, top_k=-1,
        min_p=None, repetition_penalty=1.0, max_completion_length=8, logprobs=0,
        structured_outputs_regex=None, generation_kwargs={})
    calls, generate = [], engine.generate
    engine.generate = lambda prompts, *a: calls.append(len(prompts)) or generate(prompts, *a)
    trainer.use_vllm, trainer.vllm_generation = True, engine
    func = trl_ragen.rollout_function("sokoban", lambda step: [5, 6, 7], max_turns=1 + 2 * rank)
    out = func([trl_ragen.group_prompt(g % 3) for g in range(2 + 2 * rank)], trainer)
    trainer.use_vllm = False
    return {"vllm_calls": calls, "vllm_turns": [int(t) for t in out["turns"]],
            "vllm_replies_match": replies_answer_their_prompts(out, end)}


def fsdp_episodes(trainer):
    """The trained policy sharded by torch FSDP (each decoder layer its own unit, so every forward
    pass gathers shards from both processes) as the trainer's model: process i samples its 3 rows
    of 3 groups x 2 episodes, of up to 1 + i turns, and the diagnosis scores them; the same on an
    unsharded copy, from the same random state, for comparison."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from warmstart import tiny
    from scaleout import trl_ragen
    rank, plain = trainer.accelerator.process_index, tiny.build_model(trainer.processing_class)
    plain.load_state_dict(trainer.model.state_dict())  # a copy without TRL's patched forward
    layer = type(plain.model.layers[0])
    sharded = FSDP(copy.deepcopy(plain), auto_wrap_policy=ModuleWrapPolicy({layer}),
                   device_id=torch.device("cpu"), use_orig_params=True)
    func = trl_ragen.rollout_function("sokoban", lambda step: [5, 6, 7], max_turns=1 + rank,
                                      max_new_tokens=8, prompt=rollout.prompts("sokoban", tiny=True))
    seen = {}
    for name, model, version in (("plain", plain, None), ("fsdp", sharded, 1)):
        trainer.model = trainer.model_wrapped = model
        trainer._dist.fsdp_version, trainer.std_ema = version, None
        torch.manual_seed(rank)
        # rows 3 i .. 3 i + 2 of the 3 groups x 2 rollouts, as TRL hands them out
        out = func([trl_ragen.group_prompt(r // 2) for r in range(3 * rank, 3 * rank + 3)],
                   trainer)
        inputs = [dict(zip(out, row)) for row in zip(*out.values())]
        seen[name] = {"ids": out["completion_ids"], "logprobs": out["logprobs"],
                      "turns": out["turns"], "mi": trainer.diagnose(inputs)}
    return seen


def main(out):
    import torch
    from accelerate import PartialState

    from scaleout import trl_ragen
    torch.set_num_threads(1)
    state = PartialState(cpu=True)  # gloo across the launched processes
    a = trl_ragen.parse_args(ARGS + ["--steps", "1", "--out", out])
    a.lr, a.max_new_tokens = 1e-4, 8
    model, tokenizer, prompt = trl_ragen.load_model(a, cuda=False)
    trainer = trl_ragen.build_trainer(a, model, tokenizer, prompt, state.num_processes,
                                      make_policy=scripted())
    trainer.train()
    seen = {"processes": state.num_processes, "backend": str(state.backend),
            **trainer.last_selection}
    trainer.model = trainer.accelerator.unwrap_model(trainer.model)
    seen.update(vllm_episodes(trainer), fsdp=fsdp_episodes(trainer))
    with open(os.path.join(out, f"process-{state.process_index}.json"), "w") as f:
        json.dump(seen, f)
    # leave without the interpreter's teardown: at exit, gloo's threads sometimes aborted one process
    # (SIGABRT) or left it waiting for the other, after both had written their results
    state.wait_for_everyone()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
