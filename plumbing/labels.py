"""What a run logs beside the MI diagnosis where its warm start makes it known: the exact label of
each diagnosed reasoning, so that the estimate can be read against the truth.

- The tiny policy: the share of its first reasonings that are templates of --template-kind
  (warmstart/templates.py), template_share; 0 without a template prior.
- A real model on FrozenLake: the shares that state their own input's way, a flip of it, another
  input's, or neither (warmstart/grounding.py), grounded_share, flipped_share, borrowed_share and
  ungrounded_share, and the share that are exactly a sentence of the template grammar
  (warmstart/templates.py: membership, whether or not the warm start was taught it),
  template_share; on the probe set also the reasonings as text, to read what they say over a run. Read with coordinates,
  its reasoning copies cells of its input first: what each prompt's copy is, for the work's MI
  (plumbing/probe_set.py:work_scores).

Other runs log none of these. The labels are bookkeeping of the warm starts, not of the paper's
loop: train.py asks for them in one call each.
"""
from plumbing.flags import env_kwargs
from warmstart import grounding, templates


def labels(run, episodes, inputs):
    """The exact labels of the diagnosed reasonings (`episodes`' first turns), as shares; a real
    model's borrowed way is another input's of `inputs`' groups."""
    a = run.args
    if "system" in run.prompt:  # the tiny policy's prompt (a real model's has no system piece)
        return {"template_share": templates.share_of(episodes, a.env, a.template_kind)}
    if a.env != "frozenlake":  # only FrozenLake has a way to label
        return {}
    seeds = {e.group: e.seed for e in inputs}
    ways = {g: grounding.input_way(a.env, env_kwargs(a), seed) for g, seed in seeds.items()}
    grammar = templates.template_share([e.first.reasoning for e in episodes], templates.COORDS_POOL)
    return {**grounding.shares(episodes, ways), "template_share": grammar or 0.0}


def texts(run, episodes):
    """A real model's first reasonings as text (the tiny policy's are known from its
    demonstrations: none)."""
    return {} if "system" in run.prompt else {"reasonings": [e.first.reasoning for e in episodes]}


def copies(run, seeds):
    """For each probe prompt (a layout seed) the token ids its reasoning copies from it, where a
    reasoning copies its input (a real model reading FrozenLake's coordinates); else None."""
    a = run.args
    if "system" in run.prompt or a.observation != "coords" or a.env != "frozenlake":
        return None
    return grounding.copy_ids(run.tokenizer, a.env, env_kwargs(a), seeds)
