"""plots.py: the figures come from metrics.jsonl, overlay several runs, and survive a half-written last line."""
import json
import os

import pytest

from plumbing import plots


def write_run(folder, steps, success):
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for s in range(1, steps + 1):
            record = {"step": s, "train_success": success, "kept_ratio": 0.5, "zero_var_frac": 0.25,
                      "response_length": 20.0}
            if s % 5 == 0 or s == 1:
                record.update(mi_zscore=0.3, retrieval_acc=0.6, conditional_entropy=1.0, reasoning_entropy=1.2)
            f.write(json.dumps(record) + "\n")
        f.write('{"step": 99, "train_succ')  # a run killed mid-write


def test_series_reads_only_the_steps_that_logged_a_key(tmp_path):
    write_run(tmp_path / "a", 10, 0.5)
    records = plots.read_metrics(tmp_path / "a")
    assert len(records) == 10                                  # the broken last line is skipped
    assert plots.series(records, "mi_zscore") == ([1, 5, 10], [0.3, 0.3, 0.3])
    assert plots.series(records, "val_success") == ([], [])


def test_overlaid_runs_give_one_png_per_figure(tmp_path):
    write_run(tmp_path / "topp", 10, 0.6)
    write_run(tmp_path / "none", 10, 0.3)
    out = tmp_path / "figs"
    assert plots.main([str(tmp_path / "topp"), str(tmp_path / "none"), "--out", str(out)]) == 0
    for name in plots.FIGURES:
        with open(out / f"{name}.png", "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_folder_without_metrics_is_a_clear_error(tmp_path, capsys):
    assert plots.main([str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_an_overlay_leaves_the_runs_own_figures_alone(tmp_path, capsys):
    write_run(tmp_path / "topp", 10, 0.6)
    write_run(tmp_path / "none", 10, 0.3)
    assert plots.main([str(tmp_path / "topp"), str(tmp_path / "none")]) == 0
    assert not list((tmp_path / "topp").glob("*.png"))  # nothing written into the first run
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / "topp+none" / f"{name}.png") for name in plots.FIGURES]
    assert plots.main([str(tmp_path / "topp")]) == 0 and (tmp_path / "topp" / "success.png").exists()


def test_a_panel_without_data_says_why(tmp_path):
    write_run(tmp_path / "a", 3, 0.5)  # no validation logged
    fig, ax = plots.plt.subplots()
    plots.draw_panel(ax, {"a": [plots.read_metrics(tmp_path / "a")]}, *plots.FIGURES["success"][1])
    assert [t.get_text() for t in ax.texts] == ["no validation in these runs\n(--val-every 0)"]
    fig, ax = plots.plt.subplots()
    plots.draw_panel(ax, {"a": [plots.read_metrics(tmp_path / "a")]}, *plots.FIGURES["success"][0])
    assert not ax.texts  # a panel with data has no such words
    plots.plt.close("all")


def test_titles_name_the_line_styles_drawn(tmp_path):
    write_run(tmp_path / "a", 10, 0.5)
    with open(tmp_path / "a" / "metrics.jsonl", "a") as f:  # the references the collapse panels draw
        f.write("\n" + json.dumps({"step": 100, "mi_estimate": 0.2, "mi_upper_bound": 2.0, "retrieval_acc": 0.5,
                                   "retrieval_chance": 0.25, "reasoning_entropy": 1.0,
                                   "conditional_entropy": 0.8}) + "\n")
    names = {"-": "solid", "--": "dashed", ":": "dotted"}
    for panel in plots.FIGURES["collapse"]:
        fig, ax = plots.plt.subplots()
        plots.draw_panel(ax, {"a": [plots.read_metrics(tmp_path / "a")]}, *panel)
        drawn = {names[line.get_linestyle()] for line in ax.get_lines()}
        said = {word for word in names.values() if word in panel[1]}
        assert said <= drawn, (panel[1], drawn)
        plots.plt.close(fig)


def test_an_empty_log_is_a_clear_error_not_blank_figures(tmp_path, capsys):
    write_run(tmp_path / "good", 3, 0.5)
    os.makedirs(tmp_path / "empty")
    open(tmp_path / "empty" / "metrics.jsonl", "w").close()
    assert plots.main([str(tmp_path / "good"), str(tmp_path / "empty"), "--out", str(tmp_path / "figs")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no step records in") and "empty" in err[0]
    assert not (tmp_path / "figs").exists()


def test_the_readme_says_what_each_figure_shows():
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    assert plots.FIGURES
    for name in plots.FIGURES:
        assert f"- `{name}.png`: " in readme, name


def test_figures_never_replace_another_runs_own_nor_a_file(tmp_path, capsys):
    """--out naming a file, or another run's folder (a single run's figures, or an overlay): one
    line naming --out, exit 2, and nothing there changed; a run's own folder takes its own."""
    write_run(tmp_path / "a", 3, 0.5)
    write_run(tmp_path / "b", 3, 0.2)
    assert plots.main([str(tmp_path / "b")]) == 0  # b's own figures
    before = {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()}
    (tmp_path / "figure.png").write_text("mine")
    for argv, words in (([str(tmp_path / "a"), "--out", str(tmp_path / "figure.png")], "a file is there"),
                        ([str(tmp_path / "a"), "--out", str(tmp_path / "b")], "the folder of a run"),
                        ([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "a")],
                         "the folder of a run")):
        capsys.readouterr()
        assert plots.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: --out {argv[-1]}: ") and words in err[0], err
    assert {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()} == before
    assert (tmp_path / "figure.png").read_text() == "mine" and not list((tmp_path / "a").glob("*.png"))
    assert plots.main([str(tmp_path / "a"), "--out", str(tmp_path / "a")]) == 0  # its own folder
    assert (tmp_path / "a" / "success.png").exists()


def test_bad_arguments_are_one_line(capsys):
    assert plots.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "required: runs" in err[0], err


def test_a_run_that_decomposed_its_gradients_gets_fig4(tmp_path):
    """gradients.png: Fig. 4 from the run's decompositions (bucket_means: each bucket's mean over
    them), and only for a run that logged any."""
    write_run(tmp_path / "plain", 3, 0.5)
    assert plots.main([str(tmp_path / "plain")]) == 0
    assert not (tmp_path / "plain" / "gradients.png").exists()
    folder = tmp_path / "decomposed"
    write_run(folder, 3, 0.5)
    buckets = lambda scale: [{"bucket": b, "mean_std": 0.1 * b, "task_grad_norm": scale * b,
                              "reg_grad_norm": 1.0} for b in range(6)]
    with open(folder / "metrics.jsonl", "a") as f:
        for step, scale in ((4, 1.0), (5, 3.0)):
            f.write("\n" + json.dumps({"step": step, "grad_decomposition": buckets(scale)}) + "\n")
    assert plots.main([str(folder)]) == 0
    with open(folder / "gradients.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    means = plots.bucket_means([buckets(1.0), buckets(3.0)])
    assert [m["task_grad_norm"] for m in means] == [2.0 * b for b in range(6)]
    assert [m["reg_grad_norm"] for m in means] == [1.0] * 6


def test_a_figure_names_its_runs_and_a_short_run_gets_whole_steps(tmp_path, monkeypatch):
    """Each figure is titled with the run folders it draws; a run of one step (the MI diagnosed at
    step 1 only, as in scaleout/README.md's two-step check) gets ticks at whole steps on every
    panel, not 0.945 ... 1.050 around one point."""
    write_run(tmp_path / "a", 1, 0.5)
    drawn = []
    monkeypatch.setattr(plots.plt, "close", drawn.append)  # keep the figures to look at
    plots.plot_runs([str(tmp_path / "a")], str(tmp_path / "figs"))
    monkeypatch.undo()
    assert len(drawn) == len(plots.FIGURES)
    for fig in drawn:
        assert fig._suptitle.get_text() == str(tmp_path / "a")
        for ax in fig.axes:
            low, high = ax.get_xlim()
            ticks = [t for t in ax.get_xticks() if low <= t <= high]
            assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks
        plots.plt.close(fig)
    assert plots.run_title([f"runs/s{i}" for i in range(40)]) == "runs/s0 and 39 more runs"


def test_an_empty_panel_names_a_flag_only_where_the_runs_have_it(tmp_path):
    """No validation logged: a train.py run is told --val-every 0 turns it off; a
    scaleout.trl_ragen run, which has no such flag (it never validates), is not."""
    for name, config in (("train", {"val_every": 0, "mi_every": 5}), ("trl", {"mi_every": 5})):
        write_run(tmp_path / name, 3, 0.5)
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    said = {}
    for name in ("train", "trl"):
        fig, ax = plots.plt.subplots()
        plots.draw_panel(ax, {name: [plots.read_metrics(tmp_path / name)]}, *plots.FIGURES["success"][1],
                         settings=plots.run_settings([str(tmp_path / name)]))
        said[name] = [t.get_text() for t in ax.texts]
        plots.plt.close(fig)
    assert said == {"train": ["no validation in these runs\n(--val-every 0)"],
                    "trl": ["no validation in these runs"]}
    assert plots.run_settings([str(tmp_path / "train"), str(tmp_path / "trl")]) == {"mi_every"}
