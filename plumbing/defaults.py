"""Numbers and names shared by train.py, the TRL entry, the lab (grids.py, report.py) and the
command line (flags.py), without loading torch; the modules that use them import them from here."""
MAX_SKIPS = 5  # stop after this many steps in a row without reward spread (the official default)
GROUP_SIZE = 16  # rollouts per group, --group-size's default
MODES = ("none", "topp", "topk")  # snr_filter's filters (--filter)
CONTROLS = ("random", "bottom")  # controls for the filter's claims, not remedies (select_control)
PROB_MODES = ("linear", "softmax")  # Top-P on the spread itself or on its softmax
KL_KINDS = ("k1", "k2", "k3")  # ppo's KL estimators (Schulman 2020)
VAL_SEED_BASE = 10_000_000  # validation seeds are 10_000_000 + i; training seeds are drawn below it
PROBE_SEED_BASE = 20_000_000  # the probe set's prompts: 20_000_000 + i, held out like validation's
