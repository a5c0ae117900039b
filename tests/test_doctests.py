"""Every `>>>` example in every module's docstrings runs, so no worked example can drift from the code; every
module's deprecated calls are errors in the suite."""
import doctest
import importlib
import os
import re

import pytest
from conftest import project_modules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = sorted(project_modules())


def test_every_module_is_collected():
    assert {"envs", "mi", "ppo", "grpo", "snr_filter", "rollout", "warmstart.tiny", "train",
            "lab.grids", "course.exercises", "scaleout.trl_ragen", "worlds.sokoban"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_deprecations_raised_from_every_module_are_errors():
    """pytest.ini makes a DeprecationWarning or FutureWarning an error when Python attributes it to one of the
    project's modules, named in a regex: a new module must be named there too."""
    with open(os.path.join(ROOT, "pytest.ini")) as f:
        regexes = re.findall(r"^\s*error::(DeprecationWarning|FutureWarning):(\S+)$", f.read(), re.M)
    assert sorted(kind for kind, _ in regexes) == ["DeprecationWarning", "FutureWarning"]
    for _, regex in regexes:
        assert [name for name in MODULES + ["test_train", "conftest"] if not re.match(regex, name)] == []
        assert not any(re.match(regex, name) for name in ("transformers.utils.deprecation", "trl", "mistune"))
