"""Numbers of the training loop shared by train.py, the TRL entry, the lab (grids.py, report.py)
and the command line (flags.py), without loading torch. The paper's own names (the filters, the
KL estimators) live in its modules (snr_filter.py, ppo.py); flags.py reads them from there."""
MAX_SKIPS = 5  # stop after this many steps in a row without reward spread (the official default)
GROUP_SIZE = 16  # rollouts per group, --group-size's default
VAL_SEED_BASE = 10_000_000  # validation seeds are 10_000_000 + i; training seeds are drawn below it
PROBE_SEED_BASE = 20_000_000  # the probe set's prompts: 20_000_000 + i, held out like validation's
