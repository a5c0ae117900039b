"""Two numbers of train.py that the lab (grids.py, report.py) needs without loading torch."""
MAX_SKIPS = 5  # stop after this many steps in a row without reward spread (the official default)
GROUP_SIZE = 16  # rollouts per group, --group-size's default
