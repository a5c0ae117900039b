"""The mutation check: plausible one-line bugs, each of which the tests named beside it must catch.

    python tests/mutants.py              # every mutant; exit 1 on a survivor or a mutant that rotted
    python tests/mutants.py -k gae       # the mutants whose name (or file) holds "gae"
    python tests/mutants.py --list       # names, places and tests, nothing run

A test that passes whatever the code does tells its reader that something is checked when nothing
is. Each mutant below is one bug someone could write: one line of one function changed (`old` ->
`new`, `old` found exactly once in that function). The script copies the repository's files (the
working tree as it is, never touched) to a scratch folder, runs the named tests there once
unchanged (they must pass: else a failure would prove nothing), then for each mutant changes the
one line, runs only its named tests and puts the line back:

    caught    every named test failed (one named without its parameters: one of its cases)
    survived  a named test passed with the bug in place: the test does not check what it claims
    timeout   the named tests ran past --timeout seconds (the process group killed): the bug hangs
              the suite, which a CI limit catches, so it counts with the caught, shown apart
    rotted    the line is no longer in its function (the code moved on): update the mutant

A curated list rather than a generated one (mutmut, cosmic-ray): those mutate every operator of
every line and run the whole suite on each, thousands of runs of a suite that takes minutes, and
most of their survivors are equivalent or meaningless (a changed log message). Here every mutant is
a bug the paper's reader cares about, named after it, and says which tests answer for it, so a
survivor points at one weak test.
"""
import argparse
import ast
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import namedtuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

Mutant = namedtuple("Mutant", "name file function old new tests")


def m(name, file, function, old, new, *tests):
    return Mutant(name, file, function, old, new, tests)


ENVS, ROLLOUT, SAMPLER = "tests/test_envs.py::", "tests/test_rollout.py::", "tests/test_sampler.py::"
PPO, GRPO, SNR = "tests/test_ppo.py::", "tests/test_grpo.py::", "tests/test_snr_filter.py::"
MI, TRAIN, RUNS = "tests/test_mi.py::", "tests/test_train.py::", "tests/test_runs.py::"
DEMOS = "tests/test_demos.py::"
TRL, BENCH = "tests/test_trl_ragen.py::", "tests/test_bench.py::"
EXP = "tests/test_experiments.py::"
DOCTESTS = "tests/test_doctests.py::test_docstring_examples"
RESUME = (RUNS + "test_resume_continues_exactly_like_an_uninterrupted_run",
          RUNS + "test_kill_9_of_a_real_run_then_resume_is_exact",
          RUNS + "test_a_kill_at_every_file_operation_then_resume_is_exact")

MUTANTS = [
    # ---------------------------------------------------------------------------------- envs.py
    m("sokoban-solved-bonus-lost", "worlds/sokoban.py", "Sokoban._apply",
      "reward += SOLVED_REWARD if solved else 0.0", "reward += 0.0",
      ENVS + "test_push_onto_target_solves"),
    m("frozenlake-slips-one-way-only", "worlds/frozenlake.py", "FrozenLake._apply",
      "side_a if u < self.success_rate + rest else side_b",
      "side_a if u < self.success_rate + 2 * rest else side_b",
      ENVS + "test_slip_frequencies_match_the_exact_probabilities"),
    m("parse-checks-pieces-past-the-cap", "envs.py", "parse_response",
      "kept = pieces[:cap]", "kept = pieces",
      ENVS + "test_parse_caps_the_pieces_before_checking_them"),
    # ------------------------------------------------------------------------------- rollout.py
    m("no-format-penalty", "rollout.py", "act",
      "reward = 0.0 if valid else FORMAT_PENALTY", "reward = 0.0",
      ROLLOUT + "test_the_first_pieces_are_acted_on_and_any_invalid_one_costs_the_penalty"),
    m("only-the-last-turns-reward-trained-on", "rollout.py", "collate",
      'batch["token_rewards"][b, sampled[-1] if sampled else n - 1] = e.total_reward',
      'batch["token_rewards"][b, sampled[-1] if sampled else n - 1] = e.turn_rewards[-1]',
      ROLLOUT + "test_collate_right_pads"),
    # ------------------------------------------------------------------------------- sampler.py
    m("sampling-temperature-ignored", "generate.py", "sample",
      "x = logits.float() / (temperature or 1.0)",
      "x = logits.float()",
      SAMPLER + "test_sampling_logprobs_equal_a_forward_pass[0.7-0.5-cpu]"),
    m("the-loop-looks-at-the-device-every-step", "generate.py", "decode",
      "(t + 1) % law.every == 0 and not looks_alive(still, finite)",
      "not looks_alive(still, finite)",
      SAMPLER + "test_the_loop_waits_for_the_device_only_when_it_looks_and_keeps_its_cache[4]"),
    m("a-stop-id-of-the-generation-config-ignored", "generate.py", "stop_ids",
      "        if i not in ids:", "        if False:",
      SAMPLER + "test_a_reply_ends_at_every_end_id_the_generation_config_names"),
    m("the-fast-layer-drops-the-lora-merge", "plumbing/sampler.py", "merged",
      "w = w + module.get_delta_weight(name)", "w = w",
      SAMPLER + "test_the_fast_layer_samples_the_plain_samplers_tokens"),
    m("grouped-heads-read-as-if-each-query-head-had-its-own", "plumbing/sampler.py", "forward",
      "q = q.reshape(B, H_kv, g * W, d)", "q = q.transpose(1, 2).reshape(B, H_kv, g * W, d)",
      SAMPLER + "test_greedy_picks_the_argmax_of_a_full_forward_pass"),
    m("nucleus-drops-the-token-that-crosses-p", "generate.py", "nucleus",
      "drop = running - ranked >= top_p * running[:, -1:]",
      "drop = running >= top_p * running[:, -1:]",
      DOCTESTS + "[generate]"),
    m("a-later-turn-restarts-its-positions", "plumbing/sampler.py", "hf_policy",
      "positions = cache.position[:, None] + (real.cumsum(1) - 1).clamp(min=0)",
      "positions = (real.cumsum(1) - 1).clamp(min=0)",
      SAMPLER + "test_sampling_logprobs_equal_a_forward_pass"),
    m("a-captured-step-forgets-which-rows-run", "plumbing/sampler.py", "graphed_step",
      "running.copy_(running_)", "running.copy_(running)",
      SAMPLER + "test_a_captured_step_on_a_cpu_stand_in_samples_what_the_eager_loop_samples"),
    m("the-capture-writes-into-the-last-filled-slot", "plumbing/sampler.py", "graphed_step",
      "slot = torch.tensor([cache.slot], device=device)",
      "slot = torch.tensor([cache.slot - 1], device=device)",
      SAMPLER + "test_a_captured_step_on_a_cpu_stand_in_samples_what_the_eager_loop_samples"),
    m("select-gives-the-cache-new-tensors", "plumbing/sampler.py", "select",
      "x.copy_(x[index]) if len(x) == len(index) else x[index]", "x[index]",
      SAMPLER + "test_one_capture_serves_the_turns_that_continue_their_rows_and_reads_the_live_weights"),
    m("a-reused-capture-samples-the-weights-it-was-captured-with", "plumbing/sampler.py",
      "sampling_weights", "            old[0].copy_(w)", "            pass",
      SAMPLER + "test_one_capture_serves_the_turns_that_continue_their_rows_and_reads_the_live_weights"),
    m("a-captured-step-draws-with-its-first-uniforms", "plumbing/sampler.py", "graphed_step",
      "            u.copy_(u_)", "            pass",
      SAMPLER + "test_a_captured_step_on_a_cpu_stand_in_samples_what_the_eager_loop_samples"),
    m("greedy-calls-a-masked-token-diverged", "generate.py", "sample",
      "finite = ~x.isnan().any(-1) & torch.isfinite(top[:, 0])",
      "finite = torch.isfinite(x).all(-1)",
      SAMPLER + "test_greedy_over_a_masked_vocabulary_is_finite_and_its_entropy_a_number"),
    m("the-exactness-check-compares-bfloat16-with-float32", "train.py", "sampled_in_float32",
      'if run.args.sample_dtype == "float32" or any(f.reasoning_logprob is None for f in firsts):',
      "if True:",
      "tests/test_hardware.py::test_the_bfloat16_branch_samples_diagnoses_and_updates_within_its_rounding[tiny]"),
    m("the-update-takes-a-bfloat16-samplers-logprobs-as-its-own", "train.py", "old_policy",
      'exact = run.args.dtype == run.args.sample_dtype == "float32"',
      'exact = run.args.dtype == "float32"',
      TRAIN + "test_a_run_at_temperature_07_logs_the_sampler_and_the_update_agreeing[float32-bfloat16]"),
    # ----------------------------------------------------------------------------------- ppo.py
    m("gae-bootstraps-past-the-terminal", "ppo.py", "gae",
      "next_value = torch.zeros_like(values[:, 0])", "next_value = values[:, -1].clone()",
      PPO + "test_gae_example", PPO + "test_gae_lambda_one_is_return_to_go_minus_value[0]"),
    m("whitening-with-the-biased-variance", "ppo.py", "masked_whiten",
      "var = torch.where(on, (x - mean) ** 2, 0.0).sum() / (n - 1).clamp_min(1)",
      "var = torch.where(on, (x - mean) ** 2, 0.0).sum() / n.clamp_min(1)",
      PPO + "test_gae_whitens_over_all_policy_tokens_of_the_batch"),
    m("dual-clip-caps-positive-advantages", "ppo.py", "clipped_policy_loss",
      "capped = (adv < 0) & (per_token > cap)", "capped = per_token > cap",
      PPO + "test_dual_clip_caps_only_negative_advantages_past_c"),
    m("clip-high-is-clip-low", "ppo.py", "clipped_policy_loss",
      "clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)",
      "clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_low)",
      PPO + "test_clip_higher_example"),
    m("drgrpo-normaliser-is-the-sequence-length", "ppo.py", "aggregate",
      "per_seq = per_seq / norm_length", "per_seq = per_seq / mask.sum(-1).clamp_min(1)",
      PPO + "test_aggregate_hand_computed",
      TRAIN + "test_the_update_trains_on_policy_loss_and_drgrpo_divides_by_the_budget"),
    m("k3-with-the-wrong-sign", "ppo.py", "kl_estimate",
      "return (torch.expm1(-delta) + delta).clamp(0.0, 10.0)",
      "return (torch.expm1(delta) - delta).clamp(0.0, 10.0)",
      PPO + "test_kl_estimators_unbiased_under_pi"),
    m("entropy-bonus-subtracted-as-a-penalty", "ppo.py", "policy_loss",
      'loss = loss - coef.entropy_coef * terms["entropy_loss"]',
      'loss = loss + coef.entropy_coef * terms["entropy_loss"]',
      PPO + "test_policy_loss_is_the_clipped_loss_minus_the_entropy_bonus_plus_the_kl_term"),
    # ---------------------------------------------------------------------------------- grpo.py
    m("grpo-divides-by-the-population-std", "grpo.py", "group_advantages",
      "centred = centred / (rewards.std(dim=1, keepdim=True) + eps)",
      "centred = centred / (rewards.std(dim=1, keepdim=True, correction=0) + eps)",
      GRPO + "test_group_advantages_matches_numpy_and_dr_grpo"),
    m("drgrpo-divides-by-the-std-too", "grpo.py", "group_advantages",
      "if normalize_std and rewards.shape[1] > 1:", "if rewards.shape[1] > 1:",
      GRPO + "test_group_advantages_matches_numpy_and_dr_grpo",
      GRPO + "test_dr_grpo_group_gradient_exact_enumeration"),
    # ---------------------------------------------------------------------------- snr_filter.py
    m("top-p-ignores-p", "snr_filter.py", "topp_count",
      "reached = (ranked.cumsum(0) >= value * ranked.sum() - 0.01).nonzero()",
      "reached = (ranked.cumsum(0) >= ranked.sum() - 0.01).nonzero()",
      SNR + "test_paper_worked_example_fig5", SNR + "test_linear_topp_equals_plain_loop"),
    m("zero-spread-groups-kept", "snr_filter.py", "select_groups",
      "candidates = torch.ones_like(s, dtype=torch.bool) if include_zero else s > 0",
      "candidates = torch.ones_like(s, dtype=torch.bool) if include_zero else s >= 0",
      SNR + "test_all_zero_batch_keeps_none"),
    m("top-k-rounds-instead-of-truncating", "snr_filter.py", "topk_count",
      "return min(n_ranked, max(1, int(value * G)))",
      "return min(n_ranked, max(1, round(value * G)))",
      SNR + "test_topk_counts"),
    m("random-control-keeps-one-too-many", "snr_filter.py", "select_control",
      "keep[torch.randperm(G, generator=generator)[:n].to(s.device)] = True",
      "keep[torch.randperm(G, generator=generator)[:n + 1].to(s.device)] = True",
      SNR + "test_controls_keep_exactly_the_named_filters_count",
      TRAIN + "test_random_control_keeps_the_filters_count_reproducibly_per_step"),
    m("spread-is-the-biased-std", "snr_filter.py", "group_scores",
      "var = r.var(dim=1, correction=1)", "var = r.var(dim=1, correction=0)",
      SNR + "test_group_scores_closed_form"),
    m("buckets-remainder-to-the-lowest", "snr_filter.py", "rv_buckets",
      "return list(torch.split(order, [size] * (n - 1) + [G - size * (n - 1)]))",
      "return list(torch.split(order, [G - size * (n - 1)] + [size] * (n - 1)))",
      SNR + "test_rv_buckets_partition_equal_count_lowest_first"),
    m("decomposition-ignores-temperature", "snr_filter.py", "bucket_gradients",
      "temperature=temperature)          # [b, T-1]", "temperature=1.0)          # [b, T-1]",
      SNR + "test_decomposition_equals_plain_backward_loop[0.7]"),
    # ------------------------------------------------------------------------------------ mi.py
    m("marginal-without-log-n", "mi.py", "matched_and_marginal",
      "marginal = torch.logsumexp(table, dim=1) - math.log(table.shape[1])",
      "marginal = torch.logsumexp(table, dim=1)",
      MI + "test_collapse_metrics_worked_example",
      MI + "test_sampled_estimate_matches_exact_mi_and_bayes_retrieval"),
    m("mi-scored-on-matched-pairs-only", "mi.py", "collapse_metrics",
      "estimate = (matched - marginal).mean().item()", "estimate = (matched - matched).mean().item()",
      MI + "test_collapse_metrics_worked_example",
      MI + "test_sampled_estimate_matches_exact_mi_and_bayes_retrieval"),
    m("zscore-with-the-sample-std", "mi.py", "collapse_metrics",
      "spread = marginal.std(correction=0).item() if num_samples > 1 else 0.0",
      "spread = marginal.std(correction=1).item() if num_samples > 1 else 0.0",
      MI + "test_zscore_uses_population_std_of_marginal"),
    m("identical-prompts-count-apart", "mi.py", "retrieval_credit",
      "own = key[None, :] == key[owner][:, None]",
      "own = torch.arange(len(key))[None, :] == owner[:, None]",
      MI + "test_repeated_prompts_count_as_one_target_as_the_official_metric"),
    m("ema-weights-swapped", "mi.py", "ema",
      "return float(value) if previous is None else decay * previous + (1.0 - decay) * float(value)",
      "return float(value) if previous is None else (1.0 - decay) * previous + decay * float(value)",
      MI + "test_ema_is_a_pure_state_update"),
    # --------------------------------------------------------------------------------- train.py
    m("train-top-p-ignored", "snr_filter.py", "select",
      'value = how.top_p if named == "topp" else how.top_k',
      'value = 1.0 if named == "topp" else how.top_k',
      TRAIN + "test_every_combination_performs_a_real_filtered_update[topp-ppo-sokoban]",
      TRAIN + "test_update_on_kept_groups_equals_an_update_on_a_batch_without_the_dropped_ones"),
    m("random-control-same-draw-every-step", "snr_filter.py", "select",
      "draw = int(np.random.default_rng([seed, step, CONTROL_STREAM]).integers(2 ** 62))",
      "draw = int(np.random.default_rng([seed, CONTROL_STREAM]).integers(2 ** 62))",
      TRAIN + "test_random_control_keeps_the_filters_count_reproducibly_per_step"),
    m("probe-not-reseeded", "train.py", "probe",
      "torch.manual_seed(a.seed)", "pass",
      TRAIN + "test_the_probe_set_leaves_training_unchanged_and_repeats_itself"),
    m("decomposition-not-given-the-temperature", "train.py", "decompose_gradients",
      "gradient_decomposition(run.policy, batch, rewards, coef, a.temperature)",
      "gradient_decomposition(run.policy, batch, rewards, coef)",
      TRAIN + "test_fig4_kl_is_measured_against_the_initial_policy_without_a_kl_term"),
    m("critic-backward-outside-its-adapter", "train.py", "critic_loss",
      "with lora.critic_scope(run.critic):", "with lora.critic_scope(None):",
      RUNS + "test_every_trainable_gradient_is_the_same_with_and_without_checkpointing"),
    m("checkpointing-reentrant", "plumbing/models.py", "enable_checkpointing",
      'kwargs = {"use_reentrant": False}', 'kwargs = {"use_reentrant": True}',
      RUNS + "test_every_trainable_gradient_is_the_same_with_and_without_checkpointing"),
    m("optimizer-steps-ignored", "train.py", "mini_batches",
      "return list(order.tensor_split(min(optimizer_steps, n_rows)))", "return list(order.split(size))",
      TRAIN + "test_optimizer_steps_fix_the_number_of_steps_whatever_is_kept"),
    m("micro-batch-weighed-against-the-whole-batch", "train.py", "micro_batch_weight",
      "return float(mask[rows].sum() / mask[mini_batch].sum().clamp_min(1))",
      "return float(mask[rows].sum() / mask.sum().clamp_min(1))",
      TRAIN + "test_micro_batch_weights_recompose_the_mini_batchs_aggregate"),
    m("drgrpo-budget-is-one-turn", "plumbing/flags.py", "response_budget",
      "return args.max_turns * args.max_new_tokens", "return args.max_new_tokens",
      TRAIN + "test_the_update_trains_on_policy_loss_and_drgrpo_divides_by_the_budget"),
    # ---------------------------------------------------------------------------------- runs.py
    m("resume-ignores-the-checkpoint", "plumbing/runs.py", "start",
      "ckpt = recover_checkpoint(a.out)", "ckpt = None", *RESUME),
    m("restored-log-drops-the-checkpoints-step", "plumbing/checkpoints.py", "restore_metrics",
      "kept = [line for line in lines if _step_of(line) <= step]",
      "kept = [line for line in lines if _step_of(line) < step]",
      RUNS + "test_the_log_is_cut_back_to_its_checkpoints_step_exactly"),
    m("top-p-0-accepted", "plumbing/flags.py", "check_args",
      'need(0 < a.top_p <= 1, f"--top-p must be in (0, 1], got {a.top_p}")',
      'need(0 <= a.top_p <= 1, f"--top-p must be in (0, 1], got {a.top_p}")',
      RUNS + "test_bad_arguments_print_one_line_exit_2_and_leave_nothing[argv2---top-p]"),
    m("old-checkpoint-never-recovered", "plumbing/checkpoints.py", "recover_checkpoint",
      'if not os.path.isdir(final) and os.path.isfile(os.path.join(old, "complete")):',
      "if False:",
      RUNS + "test_recovery_picks_the_newest_complete_checkpoint"),
    # -------------------------------------------------------------------------------- models.py
    m("a-cached-model-fetched-from-the-hub-anyway", "plumbing/models.py", "load_hf",
      "return load_hf_files(source, attn_implementation, local_files_only=True)",
      "return load_hf_files(source, attn_implementation)",
      RUNS + "test_a_hub_model_comes_from_the_cache_or_as_huggingface_hub_fetches_it"),
    m("gguf-file-read-three-times", "plumbing/models.py", "_gguf_read_once",
      "setattr(gguf, n, functools.lru_cache(maxsize=4)(f))", "setattr(gguf, n, f)",
      "tests/test_smollm2.py::test_while_converting_a_gguf_file_is_read_once_then_gguf_is_as_it_was"),
    m("gguf-left-patched-after-the-conversion", "plumbing/models.py", "_gguf_read_once",
      "setattr(gguf, n, f)", "pass",
      "tests/test_smollm2.py::test_while_converting_a_gguf_file_is_read_once_then_gguf_is_as_it_was"),
    m("update-scores-at-temperature-1", "logprobs.py", "_head_logprobs",
      "table = tempered(output_logits(lm, hidden), temperature)",
      "table = tempered(output_logits(lm, hidden), 1.0)",
      TRAIN + "test_policy_logprobs_score_the_policy_at_its_sampling_temperature"),
    m("scored-with-the-bare-output-layer", "logprobs.py", "output_logits",
      "if cap:", "if False:",
      "tests/test_logprobs.py::test_the_chunks_score_what_the_models_own_forward_gives"),
    # -------------------------------------------------------------------------------- memory.py
    m("checkpointing-whatever-the-memory", "plumbing/memory.py", "memory_plan",
      "for option in [ckpt] if ckpt is not None else [False, True]:",
      "for option in [ckpt] if ckpt is not None else [True, False]:",
      RUNS + "test_memory_plan_fits_the_budget_and_prefers_no_checkpointing"),
    # ---------------------------------------------------------------------------------- tiny.py
    m("warm-start-cache-never-read", "warmstart/tiny.py", "_load_cached",
      "if not os.path.exists(info_path):", "if True:",
      RUNS + "test_the_same_result_whether_the_warm_start_was_built_or_loaded"),
    m("warm-start-built-without-waiting-for-the-lock", "warmstart/tiny.py", "_locked",
      "fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)", "pass",
      "tests/test_tiny.py::test_one_process_builds_while_another_waits",
      "tests/test_tiny.py::test_builds_of_different_warm_starts_take_turns_on_few_cores"),
    m("warm-start-builds-never-take-turns", "warmstart/tiny.py", "load_tiny",
      "turns = (os.cpu_count() or 1) < 2 * BUILD_THREADS", "turns = False",
      "tests/test_tiny.py::test_builds_of_different_warm_starts_take_turns_on_few_cores"),
    # --------------------------------------------------------------------------------- demos.py
    m("demonstrations-without-noise", "warmstart/demos.py", "demonstration",
      "if not plan or rng.random() < noise:", "if not plan:",
      DEMOS + "test_demonstrations_are_valid_and_imperfect"),
    # --------------------------------------------------------------------------------- plots.py
    m("standard-error-is-the-std", "plumbing/plots.py", "mean_and_se",
      "ses.append(sd / math.sqrt(len(xs)))", "ses.append(sd)",
      DOCTESTS + "[plumbing.plots]"),
    # ----------------------------------------------------------------------------- trl_ragen.py
    m("trl-top-p-not-passed", "scaleout/trl_ragen.py", "build_trainer",
      "top_p=a.top_p, top_k=a.top_k, prob_mode=a.filter_prob_mode,",
      "top_k=a.top_k, prob_mode=a.filter_prob_mode,",
      TRL + "test_top_p_decides_the_kept_groups"),
    m("trl-masked-rows-stay-in-the-loss", "scaleout/trl_ragen.py", "RagenGRPOTrainer.drop_groups",
      'out["tool_mask"] = mask * rows[:, None]', 'out["tool_mask"] = mask',
      TRL + "test_gradient_with_dropped_groups_is_that_of_a_batch_without_them[dapo-False-group]"),
    m("diagnosis-through-the-forward-pass", "mi.py", "diagnose",  # bfloat16 under mixed precision
      "scores, lengths = cross_scores(model, xs, zs, batch_size, temperature, pad_id)",
      "scores, lengths = cross_scores_plain(model, xs, zs, temperature), torch.tensor(list(map(len, zs)))",
      TRL + "test_bf16_the_gpu_default_runs_on_a_cpu_and_the_diagnosis_scores_in_float32"),
    # ------------------------------------------------------------------------------------ bench
    m("bench-gpu-row-fails", "bench/bench_gpu.py", "one_row",
      'flags += ["--groups", "2", "--group-size", "2", "--max-turns", "2", "--probe-prompts", "2",',
      'flags += ["--groups", "0", "--group-size", "2", "--max-turns", "2", "--probe-prompts", "2",',
      BENCH + "test_quick_mode_reports_a_result[bench_gpu.py-gpu]"),
    # ------------------------------------------------ experiments.py, grids.py, stats.py, report.py
    m("interval-from-two-runs", "lab/stats.py", "interval",
      "if len(xs) < MIN_RUNS:", "if len(xs) < 2:",
      EXP + "test_no_interval_from_fewer_than_five_runs"),
    m("optimiser-count-ties-to-the-earlier-step", "lab/stats.py", "value_on",
      "return sum(exact) / len(exact)", "return exact[0]",
      EXP + "test_a_value_at_a_count_of_optimiser_steps_is_interpolated_within_a_limit"),
    m("optimiser-count-without-a-distance-limit", "lab/stats.py", "value_on",
      "if not below or not above or above[0][0] - below[-1][0] > gap:",
      "if not below or not above:",
      EXP + "test_a_value_at_a_count_of_optimiser_steps_is_interpolated_within_a_limit"),
    m("onset-on-one-point", "lab/stats.py", "onset",
      "if all(moved[i:i + SUSTAIN]):", "if moved[i]:",
      EXP + "test_the_onset_is_a_sustained_move_in_the_series_own_noise_units"),
    m("correlations-by-run-not-by-seed", "lab/report.py", "correlations",
      "m, half, n = stats.interval(stats.by_seed({k: rho([k]) for k in points}))",
      "m, half, n = stats.interval([rho([k]) for k in points])",
      EXP + "test_correlations_by_seed_within_worlds_and_pooled"),
    m("report-overwrites-with-less", "lab/report.py", "archived",
      "if not force:", "if False:",
      EXP + "test_the_report_never_overwrites_a_report_with_less"),
    m("an-archive-not-read", "lab/report.py", "load",
      "if not os.path.isfile(path):", "if not os.path.isfile(path) or seed == 0:",
      EXP + "test_decision_rules_are_paired_differences_over_seeds",
      EXP + "test_committed_tables_equal_the_regenerated_ones"),
    m("unfinished-run-archived", "lab/experiments.py", "settle",
      "if finished(folder, steps):", "if True:",
      EXP + "test_ctrl_c_stops_the_runs_and_archives_only_what_finished"),
    m("a-dial-that-stayed-put-counted-as-moved", "lab/dials.py", "changes",
      "if moved is None and half is not None and abs(m) > half:",
      "if moved is None and half is not None and abs(m) >= half:",
      "tests/test_experiments.py::test_each_dials_change_from_step_1_is_paired_within_runs_and_first_moves_where_its_interval_leaves_0"),
    m("calibration-verdict-over-some-alphas", "lab/calibration.py", "decide",
      "if ran and missing:", "if False:",
      "tests/test_calibration.py::"
      "test_an_estimate_falling_like_one_minus_the_share_holds_and_a_flat_one_is_contradicted"),
    m("template-share-left-out-of-the-table", "lab/report.py", "table_rows",
      "metrics = METRICS + logged(data, TEMPLATE)", "metrics = METRICS",
      EXP + "test_the_template_share_is_reported_only_where_runs_logged_it"),
]


# ------------------------------------------------------------------------------------- applying

def function_lines(source, qualname):
    """(first, last) line numbers (1-based, inclusive) of function `qualname` ("f" or "Class.f")
    in `source`, or None."""
    def find(body, names):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                    node.name == names[0]:
                if len(names) == 1:
                    return node.lineno, node.end_lineno
                return find(node.body, names[1:])
        return None
    return find(ast.parse(source).body, qualname.split("."))


def mutate(source, mutant):
    """`source` with the mutant's one line changed, or None when `old` is not exactly once in the
    function (the mutant rotted)."""
    span = function_lines(source, mutant.function)
    if span is None or "\n" in mutant.old:
        return None
    lines = source.splitlines(keepends=True)
    hits = [i for i in range(span[0] - 1, span[1]) if mutant.old in lines[i]]
    if len(hits) != 1:
        return None
    lines[hits[0]] = lines[hits[0]].replace(mutant.old, mutant.new, 1)
    return "".join(lines)


def scratch_copy():
    """The repository's files as they are in the working tree (tracked and untracked, not ignored)
    in a new temporary folder."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\0")
    copy = tempfile.mkdtemp(prefix="mutants-")
    for name in filter(None, files):
        if os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(os.path.dirname(os.path.join(copy, name)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), os.path.join(copy, name))
    return copy


def run_tests(folder, tests, timeout=None):
    """pytest on `tests` in `folder` -> (exit code, the node ids that failed, its output); the exit
    code is None when it ran past `timeout` seconds."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1"}
    code, out, err = run_group([sys.executable, "-m", "pytest", "-q", "-rfE", "--no-header", *tests],
                               folder, env, timeout)
    return code, failed_ids(out), err + out  # pytest's report last


def failed_ids(report):
    """The node ids of pytest's short summary lines "FAILED <id> - <message>" (an id's parameters
    may hold spaces)."""
    return {line.split(" ", 1)[1].split(" - ", 1)[0].strip() for line in report.splitlines()
            if line.startswith(("FAILED ", "ERROR "))}


def run_group(command, folder, env, timeout):
    """`command` in `folder` -> (exit code, stdout, stderr); past `timeout` seconds its whole process
    group is killed (the tests start train.py processes of their own) and the code is None."""
    proc = subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err
    return proc.returncode, out, err


def caught_by(test, failed):
    """Whether the named test failed: itself, or (a parametrized test named without its
    parameters) any of its cases."""
    return any(f == test or f.startswith(test + "[") for f in failed)


def check(folder, mutant, timeout):
    """'caught', 'timeout', 'survived (...)' or 'rotted (...)' for one mutant, the folder left as
    it was."""
    path = os.path.join(folder, mutant.file)
    with open(path) as f:
        original = f.read()
    changed = mutate(original, mutant)
    if changed is None:
        return "rotted (the line is not once in the function)"
    try:
        with open(path, "w") as f:
            f.write(changed)
        code, failed, _ = run_tests(folder, mutant.tests, timeout)
    finally:
        with open(path, "w") as f:
            f.write(original)
    if code is None:
        return "timeout"
    if code not in (0, 1):
        return f"rotted (pytest exit code {code}: a named test is gone?)"
    passed = [t for t in mutant.tests if not caught_by(t, failed)]
    return "caught" if not passed else f"survived ({', '.join(passed)} passed)"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python tests/mutants.py",  # not "mutants.py": run from the root
                                     description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only the mutants whose name or file holds this")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds a mutant's tests may run before they count as hung")
    args = parser.parse_args(argv)
    chosen = [mu for mu in MUTANTS if args.k in f"{mu.name} {mu.file}"]
    if args.list:
        for mu in chosen:
            print(f"{mu.name}: {mu.file}:{mu.function}\n    " + "\n    ".join(mu.tests))
        return 0
    if args.timeout <= 0:
        print("--timeout must be > 0 seconds", file=sys.stderr)
        return 2
    if not chosen:
        print(f"no mutant's name or file holds {args.k!r}", file=sys.stderr)
        return 2
    began = time.time()
    folder = scratch_copy()
    try:
        tests = sorted({t for mu in chosen for t in mu.tests})
        code, failed, out = run_tests(folder, tests)
        if code != 0:
            print(out[-3000:])
            print(f"the named tests fail without any mutant ({len(failed)}): fix those first")
            return 1
        results = []
        for mu in chosen:
            results.append(check(folder, mu, args.timeout))
            print(f"{results[-1]:>8}  {mu.name}  ({mu.file}:{mu.function})", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    caught, hung = results.count("caught"), results.count("timeout")
    print(f"{caught + hung} of {len(chosen)} mutants caught ({hung} by timing out after "
          f"{args.timeout:.0f} s) in {time.time() - began:.0f} s")
    return 0 if caught + hung == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
