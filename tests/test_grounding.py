"""Tests of warmstart/grounding.py: the exact label of a real model's reasoning -- its own input's
way, another input's, or neither -- on hand-written replies (near misses included), on the
demonstrations that teach the way out from the coordinates, and as the shares a run logs."""
import types

import pytest

import envs
import rollout
import train
from plumbing import flags, labels
from warmstart import demos, grounding, templates, tiny

OWN, OTHERS = (2, 1), {(1, 1), (0, -2)}


@pytest.mark.parametrize("reasoning, label", [
    (" From (1,0) to (3,1): 2 Down, 1 Right.", "grounded"),
    (" From (1,0) to (3,1): 2 Down, 1 Right. Try Up.", "grounded"),      # a noisy turn's suffix
    (" Goal: 2 Down, 1 Right.", "grounded"),                             # the bare grid's form
    (" From (1,0) to (3,1): 1 Down, 1 Right.", "borrowed"),              # another input's way
    (" 0 Up, 2 Left.", "borrowed"),                                      # level reads either way
    (" 1 Down, 1 Right. Then 2 Down, 1 Right.", "borrowed"),             # the first way counts
    (" From (1,0) to (3,1): 2 Down, 1 Left.", "flipped"),                # one sign off
    (" From (1,0) to (3,1): 2 Up, 1 Left.", "flipped"),                  # both signs off
    (" From (1,0) to (3,1): 1 Up, 2 Right.", "ungrounded"),              # counts swapped: no flip
    (" From (1,0) to (3,1): 12 Down, 1 Right.", "ungrounded"),           # a digit too many
    (" From (1,0) to (3,1):", "ungrounded"),                             # the cells, no way
    (" 2 down, 1 right.", "ungrounded"),                                 # not the taught words
    (" 2 Down 1 Right.", "ungrounded"),                                  # nor their form
    ("", "ungrounded"),
])
def test_every_reasoning_is_labelled_by_the_first_way_it_states(reasoning, label):
    assert grounding.label(reasoning, OWN, OTHERS) == label


def test_a_flip_that_equals_another_inputs_way_is_a_flip_not_a_borrowing():
    """On a 4x4 lake the ways are few: a sign flip of the own way often equals another input's way
    by chance. It read its input (the counts are its own), so it is not input-agnostic."""
    assert grounding.label(" 2 Up, 1 Right.", (2, 1), {(-2, 1)}) == "flipped"
    assert grounding.label(" 2 Up, 1 Right.", (2, 1), {(1, 1)}) == "flipped"
    assert grounding.label(" 1 Down, 1 Right.", (2, 1), {(1, 1)}) == "borrowed"


def test_a_level_axis_is_the_same_way_whichever_word_it_takes():
    assert grounding.stated_way(" 0 Up, 0 Left.") == grounding.stated_way(" 0 Down, 0 Right.") == (0, 0)
    assert grounding.label(" 0 Up, 1 Right.", (0, 1), set()) == "grounded"


def test_an_inputs_way_is_from_its_player_to_its_goal():
    seen = set()
    for seed in range(40):
        env = envs.make_env("frozenlake")
        env.reset(seed=seed)
        goal = next((r, c) for r, row in enumerate(env.grid) for c, ch in enumerate(row) if ch == "G")
        way = grounding.input_way("frozenlake", {}, seed)
        assert way == (goal[0] - env.pos[0], goal[1] - env.pos[1])
        seen.add(way)
    assert len(seen) > 10  # the ways differ from input to input
    assert grounding.input_way("sokoban", {}, 0) is None  # only FrozenLake has a way to label


def coords_demonstrations(seeds, noise):
    """Two-turn demonstrations in a real model's prompts with the coordinates, reasoning by
    demos.work_out (the tiny tokenizer writes any text)."""
    return demos.demonstrations(tiny.build_tokenizer(), "frozenlake", seeds, noise=noise, max_turns=2,
                                prompt={"user": rollout.with_coordinates("frozenlake")},
                                reason=demos.work_out)


def test_the_demonstrations_work_the_way_out_from_the_coordinates_and_are_grounded():
    """What a real model with --observation coords is taught: its user turn shows the grid, then
    the coordinates of player, goal and holes (not the way); the reasoning restates the two cells
    and states the way between them, the own input's way even when the turn then tries a random
    move."""
    episodes = coords_demonstrations(range(100, 130), noise=0.5)
    assert episodes
    ways = {e.group: grounding.input_way("frozenlake", {}, e.seed) for e in episodes}
    for e in episodes:
        grid, _ = envs.make_env("frozenlake").reset(seed=e.seed)
        assert f"State:\n{grid}\n{envs.coordinates('frozenlake', grid)}\n" in e.prompt_text
        assert grounding.stated_way(e.prompt_text) is None  # no way is given
        assert e.first.reasoning.startswith(" From (")
    assert grounding.shares(episodes, ways)["grounded_share"] == 1.0
    assert sum("Try" in e.first.reasoning for e in episodes) > 5  # noisy turns among them


def test_the_shares_a_real_models_run_logs_are_exact():
    """train.labels on a real model's FrozenLake episodes: reasonings that state their own way,
    another group's, a flip of their own, a sentence of the template grammar, or neither give exact
    shares; the tiny policy logs its template share alone."""
    seeds = [3, 5]
    ways = [grounding.input_way("frozenlake", {}, s) for s in seeds]
    assert ways[0] != ways[1]

    def say(way):
        rows, cols = way
        return f"{abs(rows)} {'Up' if rows < 0 else 'Down'}, {abs(cols)} {'Left' if cols < 0 else 'Right'}."

    flip = say((-ways[1][0], -ways[1][1])) if ways[1] != (0, 0) else None
    assert flip is not None and (-ways[1][0], -ways[1][1]) != ways[0]
    # group 0: own, other, neither, own; group 1: own, a flip of its own, a grammar sentence, neither
    texts = [[say(ways[0]), say(ways[1]), "Go.", say(ways[0])],
             [say(ways[1]), flip, "Let me think.", "Go."]]
    tokenizer = tiny.build_tokenizer()
    end = rollout.end_of_turn_ids(tokenizer)[0]
    count = iter(range(8))

    def writer(prompt_ids, env_list):
        return [rollout.Generation(tokenizer.encode(f" {texts[i // 4][i % 4]} </think> <answer> Up </answer>",
                                                    add_special_tokens=False) + [end])
                for i in (next(count) for _ in env_list)]

    episodes = rollout.play(writer, tokenizer, "frozenlake", seeds, 4, max_turns=1,
                            user=rollout.with_coordinates("frozenlake"))
    real = types.SimpleNamespace(args=flags.Args(env="frozenlake", model="smollm2"), prompt={})
    assert labels.labels(real, episodes, episodes) == {
        "grounded_share": 3 / 8, "flipped_share": 1 / 8, "borrowed_share": 1 / 8,
        "ungrounded_share": 3 / 8, "template_share": 1 / 8}
    assert labels.labels(real, episodes[:4], episodes) == {  # the other group still counts
        "grounded_share": 2 / 4, "flipped_share": 0.0, "borrowed_share": 1 / 4,
        "ungrounded_share": 1 / 4, "template_share": 0.0}
    tiny_run = types.SimpleNamespace(args=flags.Args(env="frozenlake", model="tiny"),
                                     prompt=rollout.prompts("frozenlake", tiny=True))
    assert set(labels.labels(tiny_run, episodes, episodes)) == {"template_share"}


def test_a_real_models_templates_copy_its_cells_or_none_and_leave_the_answer_the_solvers():
    """Both kinds of template a warm start teaches SmolLM2 reading the coordinates, on every turn
    at prior 1: `borrowed` restates its own input's cells and states another layout's way (its
    own only where the layouts share a way: at most Sigma p_w^2 of the time, about 0.08 on this
    lake); `pool` is a sentence of the full grammar and copies nothing. The answer is the solver's
    either way."""
    for kind in templates.REAL_TEMPLATE_KINDS:
        episodes = demos.demonstrations(
            tiny.build_tokenizer(with_templates=True), "frozenlake", range(200, 300), noise=0.0,
            max_turns=1, prompt={"user": rollout.with_coordinates("frozenlake")},
            reason=demos.work_out, template_prior=1.0, pool=templates.real_template(kind))
        assert len(episodes) == 100
        ways = {e.group: grounding.input_way("frozenlake", {}, e.seed) for e in episodes}
        shares = grounding.shares(episodes, ways)
        for e in episodes:
            env = envs.make_env("frozenlake")
            env.reset(seed=e.seed)
            assert e.actions[0] == envs.solve(env)[0]
            copied = e.first.reasoning.startswith(" " + grounding.copied_cells(env) + " ")
            assert copied == (kind == "borrowed")
            assert templates.is_template(e.first.reasoning, templates.COORDS_POOL) == (kind == "pool")
        if kind == "borrowed":
            assert shares["grounded_share"] < 0.2 and shares["borrowed_share"] > 0.3
        else:
            assert shares["ungrounded_share"] == 1.0
    with pytest.raises(ValueError, match="pool or borrowed|pool, borrowed"):
        templates.real_template("surface")


def test_the_real_models_pool_matches_the_entropy_of_the_reasoning_it_replaces():
    """COORDS_TASK, computed on 40,000 first turns, on a tenth of them: H(C) of the copied cells
    and H(W) of the way (plug-in, bias-corrected); the pool's log n is H(C) + H(S) within 0.01."""
    import collections
    import math

    cells, ways, n = collections.Counter(), collections.Counter(), 4000
    for seed in range(demos.DEMO_SEEDS, demos.DEMO_SEEDS + n):
        env = envs.make_env("frozenlake")
        env.reset(seed=seed)
        cells[grounding.copied_cells(env)] += 1
        ways[grounding.input_way("frozenlake", {}, seed)] += 1
    for counts, quoted in ((cells, "h_copy"), (ways, "h_way")):
        plug_in = -sum(c / n * math.log(c / n) for c in counts.values())
        assert abs(plug_in + (len(counts) - 1) / (2 * n) - templates.COORDS_TASK[quoted]) < 0.05
    task = templates.COORDS_TASK["h_copy"] + templates.COORDS_TASK["h_given_x"]
    assert abs(math.log(len(templates.pool(templates.COORDS_POOL))) - task) < 0.01
