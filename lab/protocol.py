"""What every registered grid shares (lab/grids.py, lab/real_grids.py), and what a report reads of
its runs: where runs and archives live, the flags and seeds of every claim, the template shares the
warm-start families are taught, and the metrics a table shows, with how each is read at a step."""
import os

RUNS = os.path.join("runs", "experiments")
RESULTS = "results"
WINDOW = 10  # per-step metrics in a table are the mean of the WINDOW steps ending at the table step
COMMON = ["--model", "tiny", "--mi-every", "5", "--val-every", "10", "--threads", "1", "--no-plot"]
FILTERS = {"none": ["--filter", "none"], "topp": ["--filter", "topp"], "topk": ["--filter", "topk"]}
CONTROLS = {"random": ["--filter", "random", "--control-of", "topk"],
            "bottom": ["--filter", "bottom", "--control-of", "topk"]}
SEEDS = [0, 1, 2, 3, 4]  # 5 seeds for every claim
# The template shares ALPHA a family of warm starts is taught (the calibration, the iso families,
# smollm2-templates): each a warm start whose truth is known in closed form or by exact labels.
ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)

# ----------------------------------------------------------------------- what a report reads
METRICS = ["val_success", "train_success", "probe_mi_estimate", "probe_retrieval_acc",
           "probe_reasoning_entropy", "probe_conditional_entropy", "probe_action_mi",
           "mi_estimate", "token_entropy", "kept_ratio", "zero_var_success_frac",
           "zero_var_fail_frac", "optimizer_steps_total", "trajectories_total"]
AT_THE_STEP = ("val_success", "mi_estimate", "retrieval_acc", "reasoning_entropy",
               "conditional_entropy", "probe_", "optimizer_steps_total", "trajectories_total")
BUCKET = ["mean_std", "task_grad_norm", "kl_grad_norm", "entropy_grad_norm", "reg_grad_norm"]
DIAGNOSTICS = ["probe_mi_estimate", "probe_retrieval_acc", "probe_reasoning_entropy",
               "probe_conditional_entropy", "probe_action_mi", "mi_estimate", "token_entropy"]
PHASE = ["probe_mi_estimate", "probe_reasoning_entropy", "probe_conditional_entropy",
         "token_entropy"]  # the MI-versus-entropy phase, run by run
# The onset rule's series: the direction of a collapse, and the smallest noise unit (the early
# spread of a series can be 0 by chance): validation success's binomial standard error at p = 1/2
# over the 64 validation seeds; for the probe metrics their own logged standard error takes its place
ONSET = {"probe_mi_estimate": (-1, 0.01), "val_success": (-1, 0.0625),
         "probe_conditional_entropy": (1, 0.01), "token_entropy": (1, 0.005),
         "probe_template_share": (1, 0.0625),  # a share of the 8 x 8 probe samples: as success
         "probe_grounded_share": (-1, 0.088)}  # a share of the 8 x 4 probe samples: at p = 1/2
TEMPLATE = ["probe_template_share", "template_share"]  # reported where the runs logged them
# a real model's exact labels (warmstart/grounding.py), reported where the runs logged them
GROUNDED = ["probe_grounded_share", "probe_flipped_share", "probe_borrowed_share", "grounded_share"]
