"""RAGEN-2 inside TRL: the SNR-aware filter and the MI diagnosis in TRL's GRPOTrainer, on whole
multi-turn episodes of envs.py's worlds, for several processes (GPUs) and vLLM rollouts.

The paper's method on a released multi-GPU trainer. train.py is the readable one-process loop; this
file adds to TRL (pinned at 1.16.0: the subclass overrides private methods) what its GRPOTrainer
lacks -- a group filter and a collapse diagnosis -- with the project's own functions, not copies.

    python -m scaleout.trl_ragen --env sokoban --filter topp --model tiny --steps 2 --out DIR
    accelerate launch --num_processes 8 -m scaleout.trl_ragen --model Qwen/Qwen2.5-3B-Instruct --use-vllm ...

One step of TRL's GRPOTrainer, with what this file adds (+):
  1. rollouts    rollout_func: each process plays its share of the G groups x K episodes with
                 rollout.play (the project's prompt format); the completion is everything after
                 the turn-1 prompt, env_mask = 0 on observation tokens, the sampler's log-probs
  2. rewards     one reward per episode, its total R (env rewards + format penalties), gathered
                 by TRL from every process: one prompt's K episodes may sit on different ones
  + filter       snr_filter.select (train.py's --filter) on the spread of the gathered raw totals
                 [G, K], before any normalisation: the same choice on every process
  + diagnosis    step 1 and every mi_every steps: mi.cross_scores of first-turn reasonings (the
                 ids sampled) under every group's prompt, mi.collapse_metrics
  3. advantages  TRL's A = (R - mean_g R) / (std + 1e-4); with scale_rewards="batch" the std is
                 taken again over the kept groups only
  + drop         one process: the dropped rows leave the batch (and its padding) before the loss;
                 several processes (or accumulation): every process keeps its rows (all stay in
                 step), masked with the token count recounted -- exact for the losses divided by
                 the batch's token count (TOKEN_NORMALISED, TRL's default "dapo")
  4. loss        TRL's, with the entropy bonus a token mean over the whole batch and Dr.GRPO's
                 constant train.py's (flags.response_budget); a step that keeps nothing leaves
                 the weights and the optimiser's state as they are

Metrics carry train.py's names (kept_ratio, zero_var_frac, mi_estimate, ...), so that plots.py
draws both; the command line writes them to DIR/metrics.jsonl, one line per step.
"""
import contextlib
import dataclasses
import importlib.util
import json
import os
import sys
import time
import warnings

if not __package__:  # run as a file (python scaleout/trl_ragen.py): imports from the root, as with -m
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from plumbing import defaults, flags
from plumbing.flags import arg  # the same one-line flag declarations as train.py's

# ------------------------------------------------------------------------------------- command line

# train.py's flags that mean the same here, defined once in flags.Args; TRL's names for them are
# in GRPOConfig below (group_size: num_generations, clip_low: epsilon, kl_coef: beta, ...)
SHARED = ("env", "room_size", "num_boxes", "lake_size", "success_rate", "high_prob",
          "countdown_numbers", "attempts", "max_turns",
          "max_actions_per_turn", "filter", "control_of", "top_p", "top_k", "filter_prob_mode",
          "include_zero", "groups", "group_size", "steps", "lr", "clip_low", "clip_high", "kl_coef",
          "entropy_coef", "grad_clip", "temperature", "sample_top_p", "max_new_tokens", "model",
          "warm_start", "tiny_cache", "mi_every", "mi_samples", "seed", "report_to")


def shared_flags(Args, names):
    """A dataclass of the fields `names` of Args, each as Args declares it."""
    return dataclasses.make_dataclass("Shared", [
        (f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata))
        for f in dataclasses.fields(Args) if f.name in names])


@dataclasses.dataclass
class Args(shared_flags(flags.Args, SHARED)):
    """train.py's shared flags, then this entry point's own."""
    # the batch and the update (GRPOConfig underneath)
    loss_type: str = arg("dapo", "TRL's loss: dapo = token-mean over the batch, grpo = seq-mean-"
                         "token-mean, bnpo = dapo on one micro-batch, dr_grpo = token sums / "
                         "(max_turns x max_new_tokens)",
                         choices=("dapo", "grpo", "bnpo", "dr_grpo"))
    scale_rewards: str = arg("group", "TRL's advantage std: group (GRPO), batch, none (Dr.GRPO)",
                             choices=("group", "batch", "none"))
    accumulation: int = arg(1, "micro-batches per optimiser step (TRL: gradient_accumulation)")
    # generation
    use_vllm: bool = arg(False, "sample with vLLM (GPU; TRL's vllm_mode below)")
    vllm_mode: str = arg("colocate", "vLLM beside training or a trl vllm-serve server",
                         choices=("colocate", "server"))
    # the model, output
    bf16: bool = arg(None, "bfloat16 mixed precision (GPU default)")
    # train.py's flags of the same name with another default: train.py decides these from its
    # memory plan and names its folders by --algo, which TRL has neither of
    grad_checkpointing: bool = arg(False, "recompute activations in backward")
    out: str = arg(None, "run folder (runs/trl-<env>-<filter>-<time>)")


def parse_args(argv):
    """Args from the command line (flags.build_parser: one flag per field); bad input raises
    flags.UsageError."""
    parser = flags.build_parser(Args)
    parser.prog, parser.usage = "scaleout.trl_ragen", "python -m scaleout.trl_ragen [flags]"
    parser.description = ("RAGEN-2 in TRL's GRPOTrainer: SNR-aware filtering and the MI diagnosis "
                          "on multi-turn episodes. Defaults in brackets.")
    a = Args(**vars(parser.parse_args(argv)))
    given = vars(flags.build_parser(Args, defaults=False).parse_args(argv))
    flags.check_named(given)
    flags.check_ignored(a, given)
    for bad, said in ((a.steps < 1, f"--steps must be >= 1, got {a.steps}"),
                      (a.group_size < 2, f"--group-size must be >= 2 (GRPO compares rollouts), "
                                         f"got {a.group_size}"),
                      (a.accumulation < 1, f"--accumulation must be >= 1, got {a.accumulation}")):
        if bad:
            raise flags.UsageError(said)
    # train.py's checks (finite, bounded) on the flags the two share; its defaults elsewhere
    flags.check_args(flags.Args(**{k: getattr(a, k) for k in SHARED}))
    return a


def check_start(a):
    """What the command names on this machine, before anything loads: --use-vllm on a machine
    without vLLM, which is no dependency here (TRL samples through vLLM's own engine, and that
    runs on CUDA GPUs only: main checks for the GPU); a --model that cannot load here, an --out
    that cannot hold a new run (flags.check_start, as train.py's)."""
    if a.use_vllm and importlib.util.find_spec("vllm") is None:
        raise flags.UsageError("--use-vllm: vLLM is not installed; it needs a CUDA GPU and pip "
                               "install trl[vllm] (vLLM pins its own torch), or leave --use-vllm "
                               "out to sample with the trainer's model")
    flags.check_start(a)


if __name__ == "__main__":  # before torch loads: a bad flag, --out or --model answers at once
    flags.refuse_now(check_start, flags.before_torch(parse_args, sys.argv[1:]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import mi  # noqa: E402
import rollout  # noqa: E402
import snr_filter  # noqa: E402
from plumbing import runs, sampler  # noqa: E402
from plumbing.defaults import MAX_SKIPS  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

TOKEN_NORMALISED = ("dapo", "cispo", "vespo")  # TRL losses divided by the batch's token count


# ------------------------------------------------------------------------------------- the rollouts

def group_prompt(g):
    """A dataset row names its group: group_prompt(7) == "group 7"; rollout_func renders the
    prompt of the group's env seed at the current step. TRL cycles the G rows, a pass a step."""
    return f"group {g}"


def step_seeds(seed, step, groups):
    """The env seeds of a step's groups, drawn as train.py draws them."""
    return np.random.default_rng([seed, step]).integers(0, defaults.VAL_SEED_BASE, groups).tolist()


def rollout_function(env_name, seeds, env_kwargs=None, max_turns=5, max_actions_per_turn=2,
                     max_new_tokens=64, temperature=1.0, top_p=1.0, prompt=None,
                     make_policy=None):
    """TRL's rollout_func(prompts, trainer) for a world of envs.py: whole episodes by rollout.play.

    `prompts` are this process's rows, K copies of each group's group_prompt in TRL's global
    order (process p holds rows p B .. p B + B - 1): a row's global number gives its rollout's k
    in the group and the transition noise rollout.play would give it, even in a group split
    across processes. seeds(step) -> the step's env seeds; `prompt`: rollout.play's system / user
    pieces; make_policy(trainer, model, max_new_tokens, temperature, top_p) -> a rollout.play
    policy sampling with sampling_model's `model` (default sampler_policy)."""
    make_policy = make_policy or sampler_policy

    def rollout_func(prompts, trainer):
        training = trainer.model.training
        K = trainer.num_generations if training else trainer.num_generations_eval
        first = trainer.accelerator.process_index * len(prompts)  # global number of row 0
        drawn = seeds(trainer.state.global_step + 1)
        env_seeds = [drawn[int(p.split()[-1])] for p in prompts]
        noise = [s * 1000 + (first + i) % K for i, s in enumerate(env_seeds)]
        trainer.model.eval()  # sampling as train.py samples: no dropout
        try:
            with sampling_model(trainer) as model, \
                    runs.finite_sampling(trainer.state.global_step + 1):
                policy = make_policy(trainer, model, max_new_tokens, temperature, top_p)
                episodes = rollout.play(policy, trainer.processing_class, env_name, env_seeds, 1,
                                        noise_seeds=noise, env_kwargs=env_kwargs,
                                        max_turns=max_turns,
                                        max_actions_per_turn=max_actions_per_turn,
                                        **(prompt or {}))
        finally:
            trainer.model.train(training)
        return as_completions(episodes)

    return rollout_func


def as_completions(episodes):
    """Episodes as rollout_func's answer: prompt_ids (the turn-1 prompt), completion_ids (the rest
    of the transcript), env_mask (1 on sampled tokens), logprobs (the sampler's, 0 on
    observations; None without them) and an extra field per episode fact, which TRL hands to the
    reward function and back to us."""
    out = {k: [] for k in ("prompt_ids", "completion_ids", "env_mask", "logprobs",
                           "episode_reward", "success", "turns", "sampled_tokens", "cut",
                           "first_turn")}
    for e in episodes:
        n = e.policy_mask.index(1.0)  # the first sampled token: the turn-1 prompt ends before it
        out["prompt_ids"].append(e.ids[:n])
        out["completion_ids"].append(e.ids[n:])
        out["env_mask"].append([int(m) for m in e.policy_mask[n:]])
        out["logprobs"].append(None if e.logprobs is None else e.logprobs[n:])
        out["episode_reward"].append(e.total_reward)
        out["success"].append(float(e.success))
        out["turns"].append(float(e.turns))
        out["sampled_tokens"].append(float(sum(e.response_lengths)))
        out["cut"].append(float(e.cut))
        out["first_turn"].append(e.first)
    if any(lp is None for lp in out["logprobs"]):
        out["logprobs"] = None
    return out


def episode_reward(completions, episode_reward, **kwargs):
    """TRL reward function: a completion's reward is its whole episode's total."""
    return list(episode_reward)


def sampler_policy(trainer, model, max_new_tokens, temperature, top_p):
    """The sampler: TRL's vLLM engine when the trainer has one (model None), else
    sampler.hf_policy on `model` (CPU, GPUs), which records each sampled token's log-prob."""
    if model is None:
        return vllm_policy(trainer)
    return sampler.hf_policy(model, trainer.processing_class, max_new_tokens, temperature, top_p)


def most(trainer, n):
    """The largest of every process's n (a collective: all processes call it together)."""
    device = trainer.accelerator.device
    return int(trainer.accelerator.gather(torch.tensor([n], device=device)).max())


@contextlib.contextmanager
def full_parameters(trainer, every_layer=False):
    """The trainer's model with its full parameters, as TRL's own generation gets it: ZeRO-3's
    shards gathered (unwrap_model_for_generation), FSDP's root module summoned
    (summon_full_params; FSDP's inner layers gather theirs in each forward pass, from every
    process at once). every_layer: every FSDP layer summoned too, and ZeRO-3's shards gathered
    whatever ds3_gather_for_generation says, for code that runs the layers without their forward
    passes (the sampler)."""
    from trl.models import unwrap_model_for_generation
    wrapped, args = trainer.model_wrapped, trainer.args
    gather = every_layer or args.ds3_gather_for_generation
    with unwrap_model_for_generation(wrapped, trainer.accelerator, gather, None,
                                     args.gradient_checkpointing_kwargs) as model, \
            trainer._dist.summon_full_params(wrapped, recurse=every_layer):
        yield model


@contextlib.contextmanager
def sampling_model(trainer):
    """What the rollouts sample with: None with vLLM (its engine holds the weights; at the end
    this process joins the calls the others still make: vllm_policy), else the model with every
    parameter whole on this process: ZeRO-3's shards gathered (unwrap_model_for_generation, as
    ds3_gather_for_generation does), FSDP's summoned down to every layer (summon_full_params).
    The sampler (plumbing/sampler.py) runs the model's layers itself, not through their forward
    passes, so no shard may be left for a forward pass to gather; and with nothing to gather, the
    processes sample independently, though their episodes end at different turns. The price: a
    whole copy of the weights on each process while it samples, as vLLM holds one."""
    if trainer.use_vllm:
        yield None
        while n := most(trainer, 0):
            vllm_generate(trainer, [], n)
        return
    with full_parameters(trainer, every_layer=True) as model:
        yield model


def vllm_policy(trainer):
    """TRL's vLLM engine as a rollout.play policy: a call a turn for this process's running
    episodes, with vLLM's log-probs; sampling settings and the per-turn limit are GRPOConfig's.
    In server mode (and colocated with tensor parallelism) a call is collective: TRL gathers
    every process's prompts and hands process p completions p n .. p n + n - 1, so all call at
    once with the same n, the most any has, padded with dummy prompts whose completions are
    dropped (a process whose episodes are over calls from sampling_model's end)."""
    stop_ids = rollout.end_of_turn_ids(trainer.processing_class)

    def policy(prompt_ids, env_list=None):
        out = vllm_generate(trainer, prompt_ids, most(trainer, len(prompt_ids)))
        return [rollout.Generation(list(c), [lp[0] for lp in lps],
                                   cut=not c or c[-1] not in stop_ids) for c, lps in out]

    return policy


def vllm_generate(trainer, prompt_ids, n):
    """One vLLM call, prompt_ids padded to n prompts -> [(completion, log-probs)] of prompt_ids."""
    dummy = [rollout.pad_token_id(trainer.processing_class)]
    padded = list(prompt_ids) + [dummy] * (n - len(prompt_ids))
    _, completions, logprobs, _ = trainer.vllm_generation.generate(padded, None, 1)
    return list(zip(completions, logprobs))[:len(prompt_ids)]


# -------------------------------------------------------------------------------------- the trainer

class RagenGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with RAGEN-2's SNR-aware filter and MI diagnosis (module docstring):
    filter, control_of, top_p, top_k, prob_mode, include_zero: train.py's filter flags, which
    snr_filter.select reads (a control draws from the stream of (TRL's seed, step)); mi_every,
    mi_samples: the diagnosis at step 1 and every mi_every steps (0 = off) on up to mi_samples
    first-turn reasonings (it needs the `first_turn` field of rollout_function's episodes).
    response_budget: Dr.GRPO's constant (flags.response_budget). After each step
    `last_selection` holds the gathered rewards [G][K] and the kept groups."""

    def __init__(self, *args, filter="topp", top_p=0.9, top_k=0.5, prob_mode="linear",
                 include_zero=False, control_of="topk", mi_every=5, mi_samples=64,
                 response_budget=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.filter = snr_filter.Filter(filter, top_p, top_k, include_zero, prob_mode, control_of)
        snr_filter.select(torch.ones(1, 2), self.filter)  # bad settings raise here
        self.mi_every, self.mi_samples = mi_every, mi_samples
        # Dr.GRPO's |o|: TRL's max_completion_length is a turn's limit (vLLM's, a call), and an
        # episode writes up to max_turns of them; its only other use was vLLM's, at __init__
        self.max_completion_length = response_budget or self.max_completion_length
        # the entropy bonus as a token mean over the whole batch (_compute_loss)
        self.bonus_coef = 0.0 if self.use_adaptive_entropy else self.entropy_coef
        self._entropy_bonus_enabled &= self.use_adaptive_entropy
        # one process and one micro-batch per generation: dropped rows can leave the batch
        self.remove_dropped = (self.accelerator.num_processes == 1
                               and self.args.steps_per_generation == 1)
        one_batch = self.accelerator.num_processes == 1 == self.args.gradient_accumulation_steps
        if self.loss_type == "bnpo" and not one_batch:
            raise ValueError("loss_type 'bnpo' divides each micro-batch by its own token count: "
                             "with several processes or accumulation use 'dapo' (the batch's)")
        if filter != "none" and self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError("the filter ranks raw episode rewards: use "
                             "multi_objective_aggregation='sum_then_normalize'")
        if filter != "none" and not self.remove_dropped and self.loss_type not in TOKEN_NORMALISED:
            raise ValueError(f"loss_type {self.loss_type!r} averages over sequences, so masked "
                             f"rows would still count; with several processes or gradient "
                             f"accumulation use one of {TOKEN_NORMALISED}")
        self.generation_step, self.skips, self.std_ema, self.skipping = 0, 0, None, False
        self.last_selection = None  # a step's gathered rewards and kept groups and rows

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions,
                                                      completion_ids_list)
        # raw totals of every process's completions, before any normalisation: [P * B]
        weights = self.reward_weights.to(rewards_per_func.device)
        self.raw_rewards = (rewards_per_func * weights).nansum(dim=1)
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        t0 = time.time()
        out = super()._generate_and_score_completions(inputs)
        if not self.model.training:  # evaluation: no filter, no diagnosis
            return out
        self.generation_step += 1
        K = self.num_generations
        rewards = self.raw_rewards.view(-1, K).cpu()                   # [G, K] global order
        m = {"time_rollout": time.time() - t0, **rollout_stats(self, inputs, rewards)}

        t1 = time.time()
        if self.mi_every and (self.generation_step == 1
                              or self.generation_step % self.mi_every == 0):
            m.update(self.diagnose(inputs))
        keep, stats = snr_filter.select(rewards, self.filter, self.args.seed,
                                        self.generation_step)                              # [G]
        m.update(stats, skipped=not keep.any(), time_scoring=time.time() - t1)
        B = out["advantages"].shape[0]
        first = self.accelerator.process_index * B
        rows = keep.repeat_interleave(K)[first:first + B]            # [B] this process's rows
        if not keep.all():
            out = self.drop_groups(out, rows.to(out["advantages"].device), keep, rewards, first)
        self.skipping = not keep.any()
        self.skips = 0 if keep.any() else self.skips + 1
        if self.skips >= MAX_SKIPS:  # train.py's rule
            print(f"stopping: no group had any reward spread for {MAX_SKIPS} steps")
            self.control.should_training_stop = True

        for k, v in m.items():
            if v is not None:  # diagnosis_logprob_diff without the sampler's log-probs
                self._metrics["train"][k].append(float(v))
        self.last_selection = {"group_rewards": rewards.tolist(),
                               "kept_groups": keep.nonzero()[:, 0].tolist(),
                               "kept_rows": rows.nonzero()[:, 0].add(first).tolist()}
        return out

    def drop_groups(self, out, rows, keep, rewards, first):
        """The batch without the dropped groups' rows (rows [B]: this process's rows that stay,
        the first of them row `first` of the gathered batch): removed (one process), or masked
        out with the token count recounted (several processes; module docstring)."""
        B = len(rows)
        if self.scale_rewards == "batch":  # the batch's std over the kept groups only
            kept = rewards[keep]                                                   # [G', K]
            adv = (rewards - rewards.mean(1, keepdim=True)) / (kept.std() + 1e-4)  # [G, K]
            out["advantages"] = adv.reshape(-1)[first:first + B].to(rows.device)
        if self.remove_dropped and rows.any():
            out = {k: v[rows] if torch.is_tensor(v) and v.dim() and len(v) == B else v
                   for k, v in out.items()}
            out = trim_padding(out)
        else:
            mask = out.get("tool_mask", torch.ones_like(out["completion_mask"]))  # [B, C]
            out["tool_mask"] = mask * rows[:, None]
            out["advantages"] = out["advantages"] * rows
        loss_mask = out["completion_mask"] * out.get("tool_mask", 1)
        out["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        return out

    def training_step(self, model, inputs, num_items_in_batch):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.skipping:  # no gradient at all: AdamW then leaves every weight and its state as
            model.zero_grad(set_to_none=True)  # they are (a zero one moves them by momentum)
        return loss

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        logps, self.entropies, aux = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        return logps, self.entropies, aux

    def _compute_loss(self, model, inputs):
        """TRL's loss minus bonus_coef x this micro-batch's summed token entropy divided, as dapo's
        policy term, by the whole batch's token count: one gradient however the batch is cut
        into micro-batches and processes (TRL's own bonus divides by each one's count)."""
        loss = super()._compute_loss(model, inputs)
        if self.bonus_coef:
            mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)                # [b, C]
            share = self.current_gradient_accumulation_steps / self.args.steps_per_generation
            tokens = (inputs["num_items_in_batch"] / self.accelerator.num_processes
                      * (share if self.model.training else 1))  # TRL's dapo normaliser
            loss = loss - self.bonus_coef * (self.entropies * mask).sum() / tokens.clamp(min=1)
        return loss

    def diagnose(self, inputs):
        """train.py's step 2 on the gathered episodes: up to mi_samples first-turn reasonings, as
        many from every group (mi.mi_sample), their sampled ids cross-scored under every group's
        first prompt at the sampling temperature (mi.diagnose). Every process scores the same
        matrix and gets the same numbers."""
        from accelerate.utils import gather_object
        firsts = gather_object([x["first_turn"] for x in inputs])
        K = self.num_generations
        # the same draw on every process: its generator is seeded by the step
        picked = mi.mi_sample(len(firsts) // K, K, self.mi_samples,
                              np.random.default_rng([self.args.seed, self.state.global_step]))
        with full_parameters(self) as model:
            metrics = mi.diagnose(model, firsts[::K], [firsts[m] for m in picked],
                                  [m // K for m in picked], temperature=self.args.temperature,
                                  pad_id=rollout.pad_token_id(self.processing_class))
        metrics["mi_zscore_ema"], self.std_ema = mi.mi_zscore_ema(metrics, self.std_ema)
        return {k: metrics[k] for k in mi.DIAGNOSIS_KEYS + ("diagnosis_logprob_diff",)
                if k in metrics}


def rollout_stats(trainer, inputs, rewards):
    """train.py's rollout metrics over every process's episodes (rewards [G, K] gathered)."""
    local = torch.tensor([[x["success"], x["turns"], x["sampled_tokens"], x["cut"]]
                          for x in inputs], device=trainer.accelerator.device)  # [B, 4]
    success, turns, tokens, cut = trainer.accelerator.gather(local).cpu().T      # [P * B] each
    return {"train_success": success.mean().item(), "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
            "response_length": (tokens.sum() / turns.sum()).item(), "turns": turns.mean().item(),
            "cut_frac": cut.mean().item()}


def trim_padding(out):
    """Cut the padding columns no remaining row needs: prompts are left-padded, completions
    right-padded, so a batch that never held the dropped rows has exactly these widths (TRL
    passes no position ids: the width of the left padding changes the numbers)."""
    P, C = int(out["prompt_mask"].sum(1).max()), int(out["completion_mask"].sum(1).max())
    width = out["completion_ids"].shape[1]
    for k, v in out.items():
        if k in ("prompt_ids", "prompt_mask"):
            out[k] = v[:, v.shape[1] - P:]
        elif torch.is_tensor(v) and v.dim() == 2 and v.shape[1] == width:
            out[k] = v[:, :C]
    return out


def load_model(a, cuda):
    """(model, tokenizer, rollout.play's prompt pieces) for --model."""
    from plumbing import models
    from warmstart import tiny
    if a.model == "tiny":
        return (*tiny.load_tiny(a.env, runs.env_kwargs(a), cache_dir=a.tiny_cache,
                                warm_start=a.warm_start), rollout.prompts(a.env, tiny=True))
    try:
        if a.model == "smollm2":
            model, tokenizer = (models.smollm2_warm_start(a.env, runs.env_kwargs(a))
                                if a.warm_start else models.load_smollm2())
        else:
            model, tokenizer = models.load_hf(a.model)
    except models.ModelError as e:
        raise runs.UsageError(str(e)) from None
    return model, tokenizer, {}


def build_trainer(a, model, tokenizer, prompt, num_processes=1, make_policy=None, callbacks=()):
    """The RagenGRPOTrainer of a command line: G x K episodes a step, one optimiser step per
    generation, the step's env seeds drawn as train.py draws them."""
    from datasets import Dataset
    total = a.groups * a.group_size
    if total % (num_processes * a.accumulation):
        raise runs.UsageError(f"--groups x --group-size = {total} must divide among "
                              f"{num_processes} processes x --accumulation {a.accumulation}")
    config = GRPOConfig(
        output_dir=os.path.join(a.out, "trl"), use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=total // num_processes // a.accumulation,
        gradient_accumulation_steps=a.accumulation, num_generations=a.group_size,
        max_completion_length=a.max_new_tokens, max_steps=a.steps, learning_rate=a.lr,
        lr_scheduler_type="constant", weight_decay=0.0, beta=a.kl_coef, loss_type=a.loss_type,
        scale_rewards=a.scale_rewards, epsilon=a.clip_low, epsilon_high=a.clip_high,
        entropy_coef=a.entropy_coef, max_grad_norm=a.grad_clip, temperature=a.temperature,
        top_p=a.sample_top_p, use_vllm=a.use_vllm, vllm_mode=a.vllm_mode, bf16=bool(a.bf16),
        gradient_checkpointing=a.grad_checkpointing, shuffle_dataset=False, seed=a.seed,
        report_to=a.report_to, save_strategy="no", logging_steps=1, disable_tqdm=True,
        dataloader_num_workers=0)
    func = rollout_function(a.env, lambda step: step_seeds(a.seed, step, a.groups),
                            runs.env_kwargs(a), a.max_turns, a.max_actions_per_turn,
                            a.max_new_tokens, a.temperature, a.sample_top_p, prompt, make_policy)
    rows = Dataset.from_dict({"prompt": [group_prompt(g) for g in range(a.groups)]})
    try:
        trainer = RagenGRPOTrainer(
            model=model, reward_funcs=episode_reward, args=config, processing_class=tokenizer,
            train_dataset=rows, rollout_func=func, callbacks=list(callbacks), filter=a.filter,
            top_p=a.top_p, top_k=a.top_k, prob_mode=a.filter_prob_mode,
            include_zero=a.include_zero, control_of=a.control_of, mi_every=a.mi_every,
            mi_samples=a.mi_samples,
            response_budget=flags.response_budget(a))
    except ValueError as e:  # settings TRL or the filter cannot use
        raise runs.UsageError(str(e).strip().splitlines()[0]) from None
    for callback in trainer.callback_handler.callbacks:  # TensorBoard's events in <out>/tensorboard
        if type(callback).__name__ == "TensorBoardCallback":
            callback.logging_dir = os.path.join(a.out, "tensorboard")
    return trainer


def metrics_writer(path, trainer_box):
    """A TrainerCallback writing a train.py-format line a step to `path` (main process): our
    metrics, TRL's beside them, the step's wall time, gathered rewards and kept groups."""
    from transformers import TrainerCallback

    rename = {"entropy": "token_entropy", "clip_ratio/region_mean": "clip_frac", "kl": "kl_loss"}

    class Writer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.time()

        def on_log(self, args, state, control, logs=None, **kw):
            if not state.is_world_process_zero or "loss" not in (logs or {}):
                return
            runs.check_finite(state.global_step, {  # before the line: the step did not complete
                "the loss": logs.get("loss", 0.0), "the gradient norm": logs.get("grad_norm", 0.0)})
            line = {"step": state.global_step, **{rename.get(k, k): v for k, v in logs.items()},
                    "time_step": time.time() - self.start}
            selection = trainer_box[0].last_selection
            line.update({k: selection[k] for k in ("group_rewards", "kept_groups")})
            with open(path, "a") as f:  # closed, so flushed, a line at a time
                f.write(json.dumps(line) + "\n")

    return Writer()


def run_trainer(a, model, tokenizer, prompt, state, make_policy, callbacks):
    """The trainer of the command line, its config.json written, trained; wandb's files go into
    the run folder as train.py's do (TRL gives wandb no folder: WANDB_DIR, unless one is set)."""
    path = os.path.join(a.out, "metrics.jsonl")
    box = [None]
    box[0] = trainer = build_trainer(a, model, tokenizer, prompt, state.num_processes,
                                     make_policy, [metrics_writer(path, box), *callbacks])
    if state.is_main_process:
        os.makedirs(a.out, exist_ok=True)
        runs.atomic_write(os.path.join(a.out, "config.json"),
                          json.dumps(dataclasses.asdict(a), indent=1))
    given = os.environ.get("WANDB_DIR")
    os.environ["WANDB_DIR"] = given or os.path.abspath(a.out)
    try:
        trainer.train()
    finally:
        if given is None:
            del os.environ["WANDB_DIR"]


def steps_logged(path):
    """The lines of a metrics log (0: none yet, or no log)."""
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        return sum(1 for _ in f)


def main(argv=None, make_policy=None, callbacks=()):
    """Parse, load, train; bad input is one line on stderr and exit code 2."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    # transformers 5 renames gradient_checkpointing, which GRPOConfig 1.16 still sets
    warnings.filterwarnings("ignore", "`(is_)?gradient_checkpointing", FutureWarning)
    try:
        a = parse_args(sys.argv[1:] if argv is None else argv)
        check_start(a)
        cuda = torch.cuda.is_available()
        a.model = a.model or ("Qwen/Qwen2.5-0.5B-Instruct" if cuda else "tiny")
        a.lr = a.lr or (1e-4 if a.model == "tiny" else 1e-6)
        a.max_new_tokens = a.max_new_tokens or (64 if a.model == "tiny" else 400)
        a.bf16 = cuda if a.bf16 is None else a.bf16
        a.out = a.out or os.path.join("runs", f"trl-{a.env}-{a.filter}-"
                                      f"{time.strftime('%Y%m%d-%H%M%S')}")
        from accelerate import PartialState
        state = PartialState(cpu=not cuda)  # on a CPU: gloo across the launched processes
        path = os.path.join(a.out, "metrics.jsonl")
        if state.is_main_process:
            runs.check_folder(a)
        if a.use_vllm and not cuda:
            raise runs.UsageError("--use-vllm: vLLM samples on a CUDA GPU and none was found; "
                                  "leave --use-vllm out to sample with the trainer's model")
        model, tokenizer, prompt, fresh = *load_model(a, cuda), not os.path.exists(a.out)
        runs.check_fits(a, model, tokenizer, prompt)
        try:
            run_trainer(a, model, tokenizer, prompt, state, make_policy, callbacks)
        except runs.Diverged as e:
            raise runs.UsageError(runs.diverged(e, a, steps_logged(path), fresh)) from None
        except BaseException as e:  # TRL made the folder already: a failed start leaves none
            if state.is_main_process and not steps_logged(path) and os.path.isdir(a.out):
                runs.unmake(a.out, fresh)
            if type(e).__module__.split(".")[0] == a.report_to:  # wandb without a key, ...
                raise runs.UsageError(runs.tracker_failed(a.report_to, e)) from None
            raise
        if state.is_main_process:
            print(f"metrics: {path}")
        return 0
    except runs.UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
