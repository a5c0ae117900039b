"""Against TRL: one GRPO step (generation + update) of ours vs TRL's GRPOTrainer, same tiny model,
prompts and settings.

One GRPO step (Shao et al. 2024; one of RAGEN-2's training algorithms): sample K completions for
each of G prompts, score them with a single-turn reward, A_gi = (R_gi - mean_g R) / std_g R, one
clipped-loss update on all G x K completions. Both sides run it on CPU with the same tiny Qwen2
(random weights; each side gets its own copy of the same initial weights), the same G prompts (the
tiny policy's first Sokoban prompt, one seed per group), the same K, the same token limit,
temperature 1, clip 0.2 / 0.28, grad clip 1.0, AdamW, no KL term, no gradient checkpointing (TRL
turns it on by default; off here so both do the same work -- --trl-grad-checkpointing puts it back).

Ours is lean: sampler.hf_policy samples and records each token's log-prob (these are the old
log-probs of the ratio: no second forward), grpo.group_advantages, one forward with
ppo.token_logprobs, grpo.grpo_loss, backward, step. A second variant of ours, in this script only,
adds group sharing: each group's prompt is encoded once and its key/value cache repeated across the
K samples, in sampling and in the update (the gradient flows back through the repeated cache); the
script checks that it gives the same log-probs as the plain forward. RESULT is for that variant (for
the plain one when the prompts differ in length, which it cannot handle); the table shows both.

Reward (single-turn, both sides): the fraction of the world's action names that appear in the
completion.

Needs trl (bench/requirements.txt), installed apart from the project, e.g. in its own virtual
environment:
    python -m venv --system-site-packages trl-venv && trl-venv/bin/pip install -r
    bench/requirements.txt
    trl-venv/bin/python bench/bench_trl.py              # G = 4 prompts x K = 8 samples, 32 new tokens
    trl-venv/bin/python bench/bench_trl.py --quick      # tiny sizes, 1 step: proves the script still runs

Last line: RESULT trl <our samples/s with the shared prompt cache / TRL samples/s> (target >= 1.2).
"""

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import demos  # noqa: E402
import envs  # noqa: E402
import grpo  # noqa: E402
import ppo  # noqa: E402
import rollout  # noqa: E402
import sampler  # noqa: E402
import tiny  # noqa: E402

ACTIONS = envs.make_env("sokoban").actions


def reward_of(text):
    """Fraction of the action names in `text`: reward_of("Up then Left") == 0.5 (Sokoban: Up, Down, Left, Right)."""
    return sum(a in text for a in ACTIONS) / len(ACTIONS)


def first_prompts(tokenizer, groups):
    """The tiny policy's turn-1 Sokoban prompt text (chat template + "<think>") for seeds 0 .. groups - 1."""
    texts = []
    for seed in range(groups):
        env = envs.make_env("sokoban")
        obs, _ = env.reset(seed=seed)
        messages = [
            {"role": "system", "content": demos.TINY_SYSTEM},
            {"role": "user", "content": rollout.user_message(obs, 0.0, env.max_steps, 1)},
        ]
        texts.append(
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            + "<think>"
        )
    return texts


# --------------------------------------------------------------------------------------------- ours


def right_padded(prompt_ids, generations, pad):
    """(ids [B, T], attention [B, T], policy mask [B, T-1], old log-probs [B, T-1]) of prompt + completion rows."""
    rows = [p + g.token_ids for p, g in zip(prompt_ids, generations)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)  # [B, T]
    attention = torch.zeros_like(ids)  # [B, T]
    mask = torch.zeros(len(rows), width - 1)  # [B, T-1], aligned with logits[:, :-1]
    old = torch.zeros(len(rows), width - 1)  # [B, T-1]
    for b, (p, g, r) in enumerate(zip(prompt_ids, generations, rows)):
        ids[b, : len(r)] = torch.tensor(r)
        attention[b, : len(r)] = 1
        mask[b, len(p) - 1 : len(r) - 1] = 1.0
        old[b, len(p) - 1 : len(r) - 1] = torch.tensor(g.logprobs)
    return ids, attention, mask, old


def shared_prompt_logits(model, prompt, completions, attention, K):
    """Logits [G*K, P+N, V] of the sequences prompt_g + completion_gk with each group's prompt [G,
    P] encoded once: its key/value cache is repeated K times and the completions [G*K, N] attend to
    it (right-padded, `attention`
    [G*K, P+N]). Gradients flow back through the repeated cache into the prompt pass."""
    head = model(input_ids=prompt, use_cache=True)  # prompt pass: G rows, not G*K
    cache = head.past_key_values
    cache.batch_repeat_interleave(K)
    P = prompt.shape[1]
    tail = model(
        input_ids=completions,
        attention_mask=attention,
        past_key_values=cache,
        position_ids=torch.arange(P, P + completions.shape[1]).expand_as(completions),
    )
    return torch.cat([head.logits.repeat_interleave(K, 0), tail.logits], dim=1)  # [G*K, P+N, V]


def our_step(model, optimizer, policy, prompt_ids, G, K, tokenizer, pad, shared_prompt):
    """Sample G x K completions, GRPO advantages, one update -> (log-probs of the update's forward
    [B, T-1], policy mask [B, T-1], ids [B, T], attention [B, T]), for the shared-prompt check."""
    model.eval()
    generations = policy([p for p in prompt_ids for _ in range(K)])
    rewards = torch.tensor([reward_of(tokenizer.decode(g.token_ids)) for g in generations]).view(
        G, K
    )  # [G, K]
    adv = grpo.group_advantages(rewards).reshape(-1)  # [G*K]
    ids, attention, mask, old = right_padded(
        [p for p in prompt_ids for _ in range(K)], generations, pad
    )
    adv_tokens = grpo.episode_advantages_to_tokens(adv, mask)  # [B, T-1]
    model.train()
    if shared_prompt:
        P = len(prompt_ids[0])
        # [B, T-1, V]
        logits = shared_prompt_logits(model, ids[::K, :P], ids[:, P:], attention, K)[:, :-1]
    else:
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]  # [B, T-1, V]
    logp = ppo.token_logprobs(logits, ids[:, 1:])  # [B, T-1]
    loss, _ = grpo.grpo_loss(logp, old, adv_tokens, mask, clip_low=0.2, clip_high=0.28)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return logp.detach(), mask, ids, attention


def shared_policy(model, tokenizer, max_new_tokens, K):
    """sampler.hf_policy's sampling (temperature 1, log-probs recorded) with each group's prompt
    encoded once: the G distinct prompts minus their last token are run, the cache is repeated K
    times and handed to model.generate, which starts from the last prompt token. Needs equal-length
    prompts, given K-fold repeated in group order."""
    stop_ids, pad = rollout.end_of_turn_ids(tokenizer), rollout.pad_token_id(tokenizer)

    @torch.no_grad()
    def policy(prompt_ids, env_list=None):
        ids = torch.tensor(prompt_ids)  # [G*K, P]
        cache = model(input_ids=ids[::K, :-1], use_cache=True).past_key_values  # G rows
        cache.batch_repeat_interleave(K)
        tables = []  # every step's log-softmax, for the sampled tokens' log-probs

        def record(input_ids, scores):
            tables.append(torch.log_softmax(scores.float(), dim=-1))
            return scores

        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_p=1.0,
                             top_k=0, eos_token_id=stop_ids, pad_token_id=pad, logits_processor=[record])
        new = out[:, ids.shape[1]:]  # [G*K, N]
        logprobs = torch.stack(tables, 1)[:, :new.shape[1]].gather(-1, new[..., None])[..., 0]
        return sampler.as_generations(new.tolist(), logprobs.tolist(), stop_ids)

    return policy


# ---------------------------------------------------------------------------------------------- TRL


def trl_step_seconds(
    model, tokenizer, prompts, G, K, max_new_tokens, steps, grad_checkpointing, threads
):
    """Run TRL's GRPOTrainer for `steps` steps of G x K completions; seconds of each step (generation + update)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    times = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            times.append(time.perf_counter() - self.start)

    def reward(completions, **kwargs):
        return [reward_of(c) for c in completions]

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            use_cpu=True,
            per_device_train_batch_size=G * K,
            num_generations=K,
            max_completion_length=max_new_tokens,
            max_steps=steps,
            learning_rate=1e-5,
            beta=0.0,
            loss_type="grpo",
            epsilon=0.2,
            epsilon_high=0.28,
            max_grad_norm=1.0,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            gradient_checkpointing=grad_checkpointing,
            shuffle_dataset=False,
            report_to="none",
            save_strategy="no",
            logging_steps=10_000,
            bf16=False,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            callbacks=[Clock()],
        )
        torch.set_num_threads(threads)  # in case the trainer's set-up changed it
        trainer.train()
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--groups", type=int, default=4, help="G prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="K samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--steps", type=int, default=4, help="timed steps per side and round (after a warm-up step)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds in which the sides take turns"
    )
    parser.add_argument(
        "--trl-grad-checkpointing", action="store_true", help="TRL's default; off for parity"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 timed step")
    args = parser.parse_args()
    if args.quick:
        args.groups, args.group_size, args.max_new_tokens, args.hidden, args.layers, args.steps = (
            2,
            2,
            4,
            32,
            1,
            1,
        )
        args.rounds = 1
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import trl
    except ImportError:
        sys.exit(
            "trl is not installed here; see bench/requirements.txt (install it apart from the project)"
        )

    G, K = args.groups, args.group_size
    tokenizer = tiny.build_tokenizer()
    model = tiny.build_model(
        tokenizer,
        hidden_size=args.hidden,
        num_layers=args.layers,
        intermediate_size=2 * args.hidden,
    )
    prompts = first_prompts(tokenizer, G)
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    pad = rollout.pad_token_id(tokenizer)

    def our_seconds(shared, check=False):
        """Seconds of each of 1 + steps steps of ours, on a fresh copy of the initial weights."""
        ours = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(ours.parameters(), lr=1e-5)
        policy = (
            shared_policy(ours, tokenizer, args.max_new_tokens, K)
            if shared
            else sampler.hf_policy(ours, tokenizer, args.max_new_tokens)
        )
        times = []
        for _ in range(1 + args.steps):
            start = time.perf_counter()
            logp, mask, ids, attention = our_step(
                ours, optimizer, policy, prompt_ids, G, K, tokenizer, pad, shared
            )
            times.append(time.perf_counter() - start)
        if check:  # the shared-prompt forward must give the plain forward's log-probs
            with torch.no_grad():
                P = len(prompt_ids[0])
                a = ppo.token_logprobs(
                    shared_prompt_logits(ours, ids[::K, :P], ids[:, P:], attention, K)[:, :-1],
                    ids[:, 1:],
                )  # [B, T-1]
                b = ppo.token_logprobs(
                    ours(input_ids=ids, attention_mask=attention).logits[:, :-1], ids[:, 1:]
                )
            diff = ((a - b).abs() * mask).max().item()
            print(
                f"shared prompt cache vs plain forward: max |log-prob difference| on completion tokens {diff:.2e}"
            )
            if diff >= 1e-4:
                sys.exit("FAIL: shared-prompt log-probs differ from the plain forward")
        return times

    shared_ok = len({len(p) for p in prompt_ids}) == 1
    if not shared_ok:
        print("prompts differ in length: the shared prompt cache variant is left out")
    names = (
        ["ours: hf_policy + grpo_loss"]
        + ["ours, shared prompt cache (bench only)"] * shared_ok
        + ["TRL GRPOTrainer"]
    )
    times = {name: [] for name in names}
    # the three take turns, so a change in the load of a shared machine hits all alike
    for r in range(args.rounds):
        times[names[0]] += our_seconds(False)[1:]
        if shared_ok:
            times[names[1]] += our_seconds(True, check=r == 0)[1:]
        times[names[-1]] += trl_step_seconds(
            copy.deepcopy(model),
            tokenizer,
            prompts,
            G,
            K,
            args.max_new_tokens,
            1 + args.steps,
            args.trl_grad_checkpointing,
            args.threads,
        )[1:]
    seconds = {name: statistics.median(t) for name, t in times.items()}
    t_trl = seconds[names[-1]]

    print(
        f"tiny Qwen2 (random weights): hidden {args.hidden}, {args.layers} layers, vocab {len(tokenizer)}; torch "
        f"threads {torch.get_num_threads()}; G = {G} prompts x K = {K} samples, prompt {len(prompt_ids[0])} "
        f"tokens, <= {args.max_new_tokens} new tokens; TRL gradient checkpointing "
        f"{'on' if args.trl_grad_checkpointing else 'off'}; TRL {trl.__version__}; median of {args.rounds} rounds x "
        f"{args.steps} steps, each after a warm-up step"
    )
    print(
        f"{'one GRPO step (generation + update)':<42}{'seconds':>10}{'samples/s':>12}{'vs TRL':>9}"
    )
    for name, t in seconds.items():
        print(f"{name:<42}{t:>10.3f}{G * K / t:>12.1f}{t_trl / t:>9.2f}")
    # the shared prompt cache is how ours reaches the target, when usable
    best = names[1] if shared_ok else names[0]
    print(
        f"ours, plain (the project's code path) vs TRL: {t_trl / seconds[names[0]]:.3f}; RESULT is for: {best}"
    )
    print(f"RESULT trl {t_trl / seconds[best]:.3f}")


if __name__ == "__main__":
    main()
