"""Every `>>>` example in every module's docstrings runs, so no worked example can drift from the code."""
import doctest
import glob
import importlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py")))


def test_every_module_is_collected():
    assert {"envs", "mi", "ppo", "grpo", "snr_filter", "rollout", "tiny", "train"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
