"""theory.md against the code: every `file.py:function` and `tests/test_x.py::test_name` it names
exists, and every number in its `# worked example` blocks is recomputed here from the code.
README.md's reading map is checked the same way when it has one."""
import ast
import math
import os
import re

import numpy as np
import pytest
import torch

import envs
import grpo
import mi
import ppo
import snr_filter
from warmstart import templates

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THEORY = os.path.join(ROOT, "theory.md")
README = os.path.join(ROOT, "README.md")
README_SECTIONS = ("Reading alongside the paper", "Exercises")

CODE_REF = re.compile(r"(?<![\w/])((?:[a-z]+/)?[A-Za-z_]\w*)\.py:([A-Za-z_][\w.]*)")
TEST_REF = re.compile(r"(tests/test_\w+\.py)::(\w+)")
NUMBER_LINE = re.compile(r"^([A-Za-z_][\w.]*)\s*=\s*(.+?)\s*$")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def readme_reading_map():
    """The README sections that hold the reading map, or None when README.md has none yet."""
    if not os.path.exists(README):
        return None
    text = read(README)
    parts = re.split(r"^(#{1,6} .*)$", text, flags=re.MULTILINE)  # [before, heading, body, ...]
    picked = [h + b for h, b in zip(parts[1::2], parts[2::2])
              if any(s in h for s in README_SECTIONS)]
    return "\n".join(picked) or None


# --------------------------------------------------------------------------------- references exist

def top_level_names(path):
    """Names a module defines at top level (functions, classes, assignments) and the methods of
    its classes."""
    names = set()
    for node in ast.parse(read(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names |= {f"{node.name}.{n.name}" for n in node.body
                          if isinstance(n, ast.FunctionDef)}
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def defined_tests(path):
    return {n.name for n in ast.walk(ast.parse(read(path))) if isinstance(n, ast.FunctionDef)
            and n.name.startswith("test_")}


def missing_references(text):
    """Every `file.py:name` and tests/test_x.py::test_name in `text` that does not exist -> list
    of strings."""
    missing = []
    for module, name in sorted(set(CODE_REF.findall(text))):
        path = os.path.join(ROOT, module + ".py")
        if not os.path.exists(path) or name not in top_level_names(path):
            missing.append(f"{module}.py:{name}")
    for test_file, name in sorted(set(TEST_REF.findall(text))):
        path = os.path.join(ROOT, test_file)
        if not os.path.exists(path) or name not in defined_tests(path):
            missing.append(f"{test_file}::{name}")
    return missing


def test_every_code_and_test_reference_in_theory_exists():
    text = read(THEORY)
    # the parser still finds them (a broken pattern would find nothing and pass vacuously)
    assert len(set(CODE_REF.findall(text))) >= 25 and len(set(TEST_REF.findall(text))) >= 40
    assert missing_references(text) == []


def test_the_light_modules_expose_what_theory_names():
    """The same references by import: the named objects are callables of the loaded modules (heavy
    modules that load transformers are checked by source above, to keep this file fast)."""
    loaded = {"mi": mi, "snr_filter": snr_filter, "ppo": ppo, "grpo": grpo, "envs": envs}
    for module, name in set(CODE_REF.findall(read(THEORY))):
        if module in loaded:
            obj = loaded[module]
            for part in name.split("."):
                obj = getattr(obj, part)
            assert callable(obj), f"{module}.py:{name}"


def test_every_reference_in_the_readme_reading_map_exists():
    text = readme_reading_map()
    assert text is not None, "README.md lost its 'Reading alongside the paper' / 'Exercises' sections"
    assert CODE_REF.search(text) and TEST_REF.search(text)
    assert missing_references(text) == []


def test_reference_checker_catches_a_missing_name():
    good = "`mi.py:mutual_information` tests/test_mi.py::test_ema_is_a_pure_state_update"
    assert missing_references(good) == []
    assert missing_references("`mi.py:no_such_function`") == ["mi.py:no_such_function"]
    assert missing_references("`nosuchfile.py:f`") == ["nosuchfile.py:f"]
    missing = "tests/test_mi.py::test_nothing_here"
    assert missing_references(missing) == [missing]


# ------------------------------------------------------------------------------------------- layout

SPINNING_UP = ["Background", "Key equations", "Pseudocode", "Implementation details"]


def test_theory_sections_follow_the_spinning_up_order_and_fit_100_columns():
    text = read(THEORY)
    sections = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    algorithmic = [s for s in sections if re.match(r"[1-5]\. ", s)]
    assert len(algorithmic) == 5
    for section in algorithmic:
        headings = re.findall(r"^### (.+)$", section, flags=re.MULTILINE)
        assert headings == SPINNING_UP, section.splitlines()[0]
    assert any(s.startswith("6. Where this code and the official code differ") for s in sections)
    wide = [i for i, line in enumerate(text.splitlines(), 1) if len(line) > 100]
    assert wide == []
    # a reference broken across two lines would escape the reference checker
    assert not re.search(r"(tests/test_\w+\.py::|\w+\.py:)\s*$", text, flags=re.MULTILINE)


# ---------------------------------------------------------------------------------- worked examples

def worked_examples(text):
    """{key: printed value} from the fenced blocks whose first line starts with
    '# worked example'."""
    values = {}
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
        lines = block.strip().splitlines()
        if not lines or not lines[0].startswith("# worked example"):
            continue
        for line in lines[1:]:
            match = NUMBER_LINE.match(line.strip())
            assert match, f"unreadable worked-example line: {line!r}"
            key, value = match.groups()
            assert key not in values, f"{key} appears twice"
            values[key] = value
    return values


def agrees(printed, computed):
    """A printed number agrees when it is the computed one rounded to the printed decimals; lists
    elementwise; text (e.g. 'A, C') exactly; an integer without a decimal point exactly."""
    printed = printed.strip()
    if printed.startswith("["):
        items = [p for p in printed.strip("[]").split(",") if p.strip()]
        return len(items) == len(computed) and all(agrees(p, c) for p, c in zip(items, computed))
    if isinstance(computed, str):
        return printed == computed
    if re.fullmatch(r"-?\d+", printed):
        return float(printed) == computed
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return abs(float(printed) - float(computed)) <= 0.5 * 10 ** -decimals * (1 + 1e-9) + 1e-12


def names(mask, labels="ABC"):
    kept = [labels[i] for i, k in enumerate(mask.tolist()) if k]
    return ", ".join(kept) if kept else "none"


THIRD = 1 / 3
TABLES = {
    "healthy": [[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5]],
    "template": [[THIRD] * 3] * 3,
    "entropy_collapse": np.eye(3).tolist(),
    "full_collapse": [[1.0, 0.0, 0.0]] * 3,
}


def enumerate_pairs(table):
    """Every (x, z) with p(z|x) > 0 once, scored exactly under every prompt: scores [M, N],
    owner [M]."""
    table = np.array(table)
    pairs = [(x, z) for x in range(3) for z in range(3) if table[x, z] > 0]
    assert len({table[x, z] for x, z in pairs}) == 1   # equally likely: the joint distribution
    with np.errstate(divide="ignore"):
        return np.log(table[:, [z for _, z in pairs]].T), [x for x, _ in pairs]


def bound_group(rewards, arms, pi=(0.5, 0.5)):
    """task_gradient_bound for a softmax bandit: score of arm a is e_a - pi."""
    pi = np.array(pi)
    return snr_filter.task_gradient_bound(rewards, np.eye(len(pi))[arms] - pi)


def computed_values():
    """Every worked-example number of theory.md, from the code."""
    v = {}
    # 1. four regimes
    for name, table in TABLES.items():
        table = np.array(table)
        v[f"{name}.H_Z"] = mi.entropy(table.mean(0))
        v[f"{name}.H_Z_given_X"] = mi.conditional_entropy(table)
        v[f"{name}.I_XZ"] = mi.mutual_information(table)
        out = mi.collapse_metrics(*enumerate_pairs(table))
        v[f"{name}.mi_estimate"] = out["mi_seq_estimate"]
        v[f"{name}.retrieval_acc"] = out["retrieval_acc"]
        v[f"{name}.bayes_acc"] = table.max(axis=0).sum() / table.shape[0]
    # 2. cross-scoring by hand
    scores = torch.tensor([[-1.0, -3.0], [-4.0, -2.0], [-2.0, -2.0]], dtype=torch.float64)
    owner = [0, 1, 0]
    matched = scores[torch.arange(3), owner]
    marginal = torch.logsumexp(scores, 1) - math.log(2)
    out = mi.collapse_metrics(scores, owner)
    assert out["mi_seq_estimate"] == pytest.approx((matched - marginal).mean().item())
    v.update({"hand.matched": matched.tolist(), "hand.marginal": marginal.tolist(),
              "hand.gap": (matched - marginal).tolist(),
              "hand.mi_seq_estimate": out["mi_seq_estimate"], "hand.log_N": out["mi_upper_bound"],
              "hand.conditional_entropy": out["conditional_entropy_seq"],
              "hand.reasoning_entropy": out["reasoning_entropy_seq"],
              "hand.retrieval_acc": out["retrieval_acc"],
              "hand.marginal_std": out["marginal_std_seq"],
              "hand.mi_zscore": out["mi_zscore_seq"]})
    keyed = [[-1.0, -3.0, -1.0], [-4.0, -2.0, -4.0]]
    for name, keys in (("keys", ["x", "y", "x"]), ("distinct", None)):
        out = mi.collapse_metrics(keyed, [2, 1], prompt_keys=keys)
        v[f"{name}.retrieval_acc"] = out["retrieval_acc"]
        v[f"{name}.retrieval_chance"] = out["retrieval_chance"]
    z1, s1 = mi.mi_zscore_ema({"mi_estimate": 0.2, "marginal_std": 0.5})
    z2, s2 = mi.mi_zscore_ema({"mi_estimate": 0.3, "marginal_std": 1.5}, s1)
    v.update({"ema.step1.zscore": z1, "ema.step1.std_ema": s1, "ema.step2.std_ema": s2,
              "ema.step2.zscore": z2})
    # the template prior
    v["toy.I_XZ"] = mi.mutual_information([[0.5, 0.0, 0.25, 0.25], [0.0, 0.5, 0.25, 0.25]])
    for world in ("frozenlake", "sokoban"):
        v[f"{world}.I_task"] = templates.TASK[world]["i_task"]
        v[f"{world}.log_pool"] = math.log(len(templates.pool(world)))
    v["frozenlake.H_task_given_X"] = templates.TASK["frozenlake"]["h_given_x"]
    quarter = templates.truth("frozenlake", 0.25)
    for key in ("I_XZ", "H_Z_given_X", "H_Z"):
        v[f"frozenlake.alpha_0.25.{key}"] = quarter[key]
    v["frozenlake.alpha_0.25.mi_seq_N8"] = quarter["mi_seq_estimate_N8"]
    v["frozenlake.alpha_1.H_Z"] = templates.truth("frozenlake", 1.0)["H_Z"]
    v["sokoban.alpha_0.5.mi_seq_N32"] = templates.truth("sokoban", 0.5)["mi_seq_estimate_N32"]
    # 3. the bound
    tight = snr_filter.task_gradient_bound([0.0, 2.0], [[-1.0, 0.0], [1.0, 0.0]])
    v["bound.tight.norm"], v["bound.tight.bound"] = tight
    loose = snr_filter.task_gradient_bound([0.0, 1.0], [[1.0, 0.0], [0.0, 1.0]])
    v["bound.loose.norm"], v["bound.loose.bound"] = loose
    arms = [0, 0, 1, 1]
    v["bandit.signal.norm"], v["bandit.signal.bound"] = bound_group([0.0, 0.0, 1.0, 1.0], arms)
    v["bandit.noise.norm"], v["bandit.noise.bound"] = bound_group([0.0, 1.0, 0.0, 1.0], arms)
    bandit, q = envs.Bandit(), 0.5
    outcomes = [(1 - q, bandit.low_reward, "safe"),                   # (probability, reward, arm)
                (q * bandit.high_prob, bandit.high_reward, "risky"),
                (q * (1 - bandit.high_prob), 0.0, "risky")]
    mean = sum(p * r for p, r, _ in outcomes)
    arm_mean = {"safe": bandit.low_reward, "risky": bandit.high_prob * bandit.high_reward}
    v["bandit_env.var_total"] = sum(p * (r - mean) ** 2 for p, r, _ in outcomes)
    v["bandit_env.var_signal"] = sum(p * (arm_mean[a] - mean) ** 2 for p, _, a in outcomes)
    v["bandit_env.var_noise"] = sum(p * (r - arm_mean[a]) ** 2 for p, r, a in outcomes)
    parts = v["bandit_env.var_signal"] + v["bandit_env.var_noise"]
    assert v["bandit_env.var_total"] == pytest.approx(parts)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.1, 0.0, 0.0, 0.0]])
    for algo, normalize in (("grpo", True), ("drgrpo", False)):
        adv = grpo.group_advantages(rewards, normalize_std=normalize)
        v[f"{algo}.adv_rewards_1_0_0_0"], v[f"{algo}.adv_rewards_0.1_0_0_0"] = adv.tolist()
        if normalize:
            v["grpo.mean_square_adv"] = (adv[0] ** 2).mean().item()
    # 4. Fig. 5
    fig5 = [9.0, 1.0, 5.0]
    keep = snr_filter.select_groups(fig5, "topp", 0.9)
    v["fig5.topp_0.9.target"] = 0.9 * sum(fig5) - 0.01
    v["fig5.topp_0.9.kept"] = names(keep)
    v["fig5.topp_0.9.kept_ratio"] = snr_filter.filter_stats(fig5, keep)["kept_ratio"]
    v["fig5.topk_0.5.kept"] = names(snr_filter.select_groups(fig5, "topk", 0.5))
    softmax = snr_filter.select_groups(fig5, "topp", 0.9, prob_mode="softmax")
    v["fig5.softmax_0.9.kept"] = names(softmax)
    v["fig5.softmax_0.9_scores_div_10.kept"] = names(
        snr_filter.select_groups([s / 10 for s in fig5], "topp", 0.9, prob_mode="softmax"))
    v["all_zero.topp_0.9.kept"] = names(snr_filter.select_groups([0.0, 0.0, 0.0], "topp", 0.9))
    spreads, labels = [3.0, 2.0] + [0.0] * 6, "ABCDEFGH"
    for key, p, prob_mode, include_zero in (("softmax_0.7", 0.7, "softmax", False),
                                            ("softmax_0.7_include_zero", 0.7, "softmax", True),
                                            ("topp_1.0", 1.0, "linear", False),
                                            ("topp_1.0_include_zero", 1.0, "linear", True)):
        keep = snr_filter.select_groups(spreads, "topp", p, include_zero, prob_mode)
        v[f"zeros.{key}.kept"] = names(keep, labels)
    for G in (8, 3):
        sizes = [len(b) for b in snr_filter.rv_buckets(list(range(G)), 6)]
        v[f"rv_buckets.sizes_{G}_groups_6_buckets"] = sizes
    # 5. GAE, KL, PPO losses
    r, val = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.2, 9.0, 0.6]])
    m = torch.tensor([[1, 0, 1]])
    adv1, ret1 = ppo.gae(r, val, m, 1.0, 1.0, whiten=False)
    adv_half, _ = ppo.gae(r, val, m, 1.0, 0.5, whiten=False)
    v.update({"gae.rewards": r[0].tolist(), "gae.values": val[0].tolist(),
              "gae.mask": m[0].tolist(),
              "gae.lam_1.adv": adv1[0].tolist(), "gae.lam_1.returns": ret1[0].tolist(),
              "gae.lam_0.5.adv": adv_half[0].tolist(),
              "gae.lam_1.adv_whitened": ppo.gae(r, val, m, 1.0, 1.0)[0][0].tolist()})
    delta = torch.tensor(math.log(2.0), dtype=torch.float64)
    for kind in ppo.KL_KINDS:
        v[f"kl.delta_log2.{kind}"] = ppo.kl_estimate(delta, torch.zeros_like(delta), kind).item()
    pi = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    ref = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    v["kl.exact"] = (pi * (pi / ref).log()).sum().item()
    for kind in ppo.KL_KINDS:
        logits = pi.log().clone().requires_grad_()
        logp = torch.log_softmax(logits, 0)
        k = ppo.kl_estimate(logp, ref.log(), kind)                # [3] one value per token
        mean = (pi * k).sum()                                      # exact E_pi, weights fixed
        v[f"kl.{kind}.mean"] = mean.item()
        v[f"kl.{kind}.std"] = (pi * (k - mean) ** 2).sum().sqrt().item()
        (grad,) = torch.autograd.grad(mean, logits)
        v[f"kl.{kind}.grad_norm"] = grad.norm().item()
    for name, kl in (("reverse", lambda lp: (lp.exp() * (lp - ref.log())).sum()),
                     ("forward", lambda lp: (ref * (ref.log() - lp)).sum())):
        logits = pi.log().clone().requires_grad_()
        (grad,) = torch.autograd.grad(kl(torch.log_softmax(logits, 0)), logits)
        v[f"kl.{name}_kl.grad_norm"] = grad.norm().item()
    loss, stats = ppo.clipped_policy_loss(torch.log(torch.tensor([[1.5, 0.5]])), torch.zeros(1, 2),
                                          torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    v["ppo.clip_higher.loss"], v["ppo.clip_higher.clip_frac"] = loss.item(), stats["clip_frac"]
    one = torch.ones(1, 1)
    four, minus_one = torch.log(torch.tensor([[4.0]])), -one
    v["ppo.dual_clip.loss"] = ppo.clipped_policy_loss(four, 0 * one, minus_one, one)[0].item()
    v["ppo.dual_clip.loss_off"] = ppo.clipped_policy_loss(four, 0 * one, minus_one, one,
                                                          ppo.Coefficients(clip_c=None))[0].item()
    v["ppo.value_loss"] = ppo.value_loss(2.0 * one, one, 3.0 * one, one).item()
    loss_tbl = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask_tbl = torch.tensor([[1, 1, 1], [1, 0, 0]])
    v["ppo.aggregate"] = [ppo.aggregate(loss_tbl, mask_tbl, mode, norm_length=4).item()
                          for mode in ppo.AGG_MODES]
    return v


def test_worked_examples_match_the_code():
    printed, computed = worked_examples(read(THEORY)), computed_values()
    assert sorted(set(computed) - set(printed)) == [], "computed here, not printed in theory.md"
    assert sorted(set(printed) - set(computed)) == [], "printed in theory.md, not recomputed here"
    wrong = {k: (printed[k], computed[k]) for k in printed if not agrees(printed[k], computed[k])}
    assert wrong == {}


def test_kl_loss_gradients_are_zero_reverse_and_forward():
    """The estimators' expected gradients as vectors, not only norms: E_pi[grad k1] = 0,
    E_pi[grad k2] = grad KL(pi||ref), E_pi[grad k3] = grad KL(ref||pi) = pi - ref (gradients with
    respect to the logits)."""
    g = torch.Generator().manual_seed(0)
    pi = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    ref = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    grads = {}
    for kind in ppo.KL_KINDS:
        logits = pi.log().clone().requires_grad_()
        k = ppo.kl_estimate(torch.log_softmax(logits, 0), ref.log(), kind)
        expected = (pi * k).sum()                                  # E_pi, tokens fixed
        (grads[kind],) = torch.autograd.grad(expected, logits)
    logits = pi.log().clone().requires_grad_()
    lp = torch.log_softmax(logits, 0)
    (reverse,) = torch.autograd.grad((lp.exp() * (lp - ref.log())).sum(), logits)
    torch.testing.assert_close(grads["k1"], torch.zeros(6, dtype=torch.float64))
    torch.testing.assert_close(grads["k2"], reverse)
    torch.testing.assert_close(grads["k3"], pi - ref)


def test_worked_example_checker_can_fail():
    assert agrees("0.4055", math.log(1.5)) and not agrees("0.4056", math.log(1.5))
    assert agrees("[0.8, 0.0, 0.4]", [0.8, 0.0, 0.4])
    assert not agrees("[0.8, 0.0]", [0.8, 0.0, 0.4])
    assert agrees("A, C", "A, C") and not agrees("A", "A, C")
    assert agrees("1", 1.0) and not agrees("1", 1.0000001)
    text = "```text\n# worked example: x\nhealthy.I_XZ = 0.5000\n```\n```text\nnot.checked = 1\n```"
    assert worked_examples(text) == {"healthy.I_XZ": "0.5000"}
    assert not agrees(worked_examples(text)["healthy.I_XZ"], computed_values()["healthy.I_XZ"])
