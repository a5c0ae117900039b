"""Tests of sampler.py: sampling-time log-probs and entropies equal a recomputed forward pass
(tempered, inside the nucleus); a later turn encodes only its new tokens; the loop waits for the
device only when it looks, into a cache allocated before it; greedy is the argmax of a full
forward pass, and a model trained on one of the loop's transcripts replays it greedily; the
from_pretrained path samples the same."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import generate
import rollout
from plumbing import flags, sampler
from test_rollout import DEVICES, LAKE, SYSTEM, make_model, make_tokenizer, scripted


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def test_bad_arguments_raise_value_error(tokenizer):
    with pytest.raises(ValueError, match="max_new_tokens"):
        sampler.hf_policy(None, tokenizer, 0)
    with pytest.raises(ValueError, match="top_p"):
        sampler.hf_policy(None, tokenizer, 4, top_p=0.0)


def test_a_later_turn_encodes_only_its_new_tokens(tokenizer, monkeypatch):
    """hf_policy continues each episode's cached row: the second call feeds the model only the
    tokens added since the first (the sampled reply and the new observation)."""
    model, fed = make_model(tokenizer), []
    forward = sampler.forward

    def counting(lm, weights, cache, ids, *args):
        fed.append(ids.shape[1])
        return forward(lm, weights, cache, ids, *args)

    monkeypatch.setattr(sampler, "forward", counting)
    policy = sampler.hf_policy(model, tokenizer, max_new_tokens=5)
    eps = rollout.play(policy, tokenizer, "frozenlake", [0], 2, env_kwargs=LAKE, max_turns=2,
                       system=SYSTEM)
    prompts = [n for n in fed if n > 1]  # the calls that encode prompts (the others: one new token)
    turn2_prompt = max(len(e.ids) - e.response_lengths[1] for e in eps)  # tokens before reply 2
    assert len(prompts) == 2
    assert prompts[1] <= turn2_prompt - prompts[0]  # the reply and the new template, not the transcript


def forward_logprobs(model, batch, temperature):
    """log softmax(logits / T) of every token given its prefix, from one forward pass over right-padded ids."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)  # [B, T-1, V]
    return logp, logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)  # [B, T-1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.5)])
def test_sampling_logprobs_equal_a_forward_pass(tokenizer, device, temperature, top_p):
    model = make_model(tokenizer).to(device)
    policy = sampler.hf_policy(model, tokenizer, max_new_tokens=40, temperature=temperature, top_p=top_p)
    torch.manual_seed(1)
    eps = rollout.play(policy, tokenizer, "frozenlake", [0, 1], 2, max_turns=3, system=SYSTEM)
    # both endings occur
    assert any(e.cut for e in eps) and any(n < 40 for e in eps for n in e.response_lengths)
    batch = {k: v.to(device) for k, v in rollout.collate(eps, rollout.pad_token_id(tokenizer)).items()}
    table, recomputed = forward_logprobs(model, batch, temperature)
    mask = batch["policy_mask"][:, 1:] == 1  # [B, T-1]
    assert batch["policy_mask"][:, 0].sum() == 0
    torch.testing.assert_close(batch["logprobs"][:, 1:][mask], recomputed[mask], atol=1e-4, rtol=0)
    # and the entropy of the tempered full distribution each token was drawn from (not the nucleus)
    probs = table.exp()
    entropy = -(probs * table).sum(-1)                                              # [B, T-1]
    torch.testing.assert_close(batch["entropies"][:, 1:][mask], entropy[mask], atol=1e-4, rtol=0)
    assert (batch["entropies"][:, 1:][~mask] == 0).all()
    # every sampled token lies in the top-p nucleus: less than top_p of the mass is on likelier
    # tokens
    chosen = probs.gather(-1, batch["input_ids"][:, 1:, None])  # [B, T-1, 1]
    above = (probs * (probs > chosen)).sum(-1)  # [B, T-1]
    assert (above[mask] < top_p + 1e-5).all()
    # every turn but the last ends with the end-of-turn token: sampled (mask 1) or appended (mask 0)
    for e in eps:
        ids, m = e.ids, e.policy_mask
        run_ends = [i for i in range(1, len(m)) if m[i - 1] == 1 and m[i] == 0]
        assert len(run_ends) == e.turns - 1
        assert all(tokenizer.eos_token_id in (ids[i - 1], ids[i]) for i in run_ends)


SYNCS = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "cpu", "numpy",
         "nonzero", "masked_select", "unique"}  # what makes the host wait for a GPU


@pytest.mark.parametrize("every", [1, 4])
def test_the_loop_waits_for_the_device_only_when_it_looks_and_keeps_its_cache(
        tokenizer, monkeypatch, every):
    """Between two looks (every `every` steps: has every row stopped?) a step asks the device
    nothing: every operation that would make the host wait for a GPU (a tensor read as a bool, an
    int, a list, copied to the CPU...) inside the decode loop is a look. And the cache a turn
    decodes into is allocated before its loop: the same storage at every step."""
    from torch.overrides import TorchFunctionMode

    events, storage = [], set()
    decode_step, looks_alive = sampler.decode_step, generate.looks_alive

    def step(lm, weights, cache, *args):
        events.append("step")
        storage.add((id(cache), cache.keys[0].data_ptr(), cache.valid.data_ptr()))
        return decode_step(lm, weights, cache, *args)

    def look(*args):
        events.append("look")
        return looks_alive(*args)

    class Syncs(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in SYNCS:
                events.append("sync")
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(sampler, "decode_step", step)
    monkeypatch.setattr(generate, "looks_alive", look)
    policy = sampler.hf_policy(make_model(tokenizer), tokenizer, max_new_tokens=40, temperature=0.7,
                               top_p=0.5, check_every=every)
    torch.manual_seed(1)
    with Syncs():
        eps = rollout.play(lambda *args: events.append("call") or policy(*args), tokenizer, "frozenlake", [0, 1], 2, max_turns=2, system=SYSTEM)
    assert any(n < 40 for e in eps for n in e.response_lengths)  # rows stop early
    calls = "".join({"call": "|", "step": "s", "look": "L", "sync": "."}[e] for e in events)
    loops = [c[min(c.find("s"), c.find("L")):c.rindex("s") + 1] for c in calls.split("|")[1:]]
    assert len(loops) == 2  # one decode loop a turn, from its first step or look to its last step
    for loop in loops:
        assert loop.replace("L.", "").count(".") == 0  # each sync is a look, and only one
        runs = loop.replace(".", "").split("L")  # the steps between two looks
        assert len(runs[0]) == every - 1 and all(len(r) == every for r in runs[1:-1])
    assert len(storage) == 2  # one cache a turn, never reallocated while decoding


def test_a_distribution_that_is_not_finite_is_the_error_a_run_reads_as_diverged(tokenizer):
    """A model whose output layer holds a nan samples garbage until the loop's next look, which
    raises what torch.multinomial raises (runs.finite_sampling names the diverged step)."""
    model = make_model(tokenizer)
    with torch.no_grad():
        model.lm_head.weight[5, 0] = math.nan
    policy = sampler.hf_policy(model, tokenizer, max_new_tokens=6, check_every=3)
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        rollout.play(policy, tokenizer, "frozenlake", [0], 2, max_turns=1, system=SYSTEM)


def tiny_gpt2(tokenizer):
    """A model of another architecture: GPT-2, absolute positions, its own attention and cache."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    return GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_model_of_another_layout_samples_through_its_own_forward(tokenizer, temperature):
    """GPT-2 is not of the Llama layout: it samples through its own forward pass and cache, left
    padded, its positions counted over each row's real tokens; the log-probs it records equal a
    full forward pass over the transcripts of two turns, and greedy is that pass's argmax."""
    model = tiny_gpt2(tokenizer)
    assert sampler.check_layout(model) is None and sampler.check_layout(make_model(tokenizer))
    policy = sampler.hf_policy(model, tokenizer, max_new_tokens=12, temperature=temperature)
    torch.manual_seed(2)
    eps = rollout.play(policy, tokenizer, "frozenlake", [0, 1], 2, max_turns=2, system=SYSTEM)
    assert min(e.turns for e in eps) == 2
    assert temperature == 0 or len({len(e.ids) for e in eps}) > 1  # left padding at work
    batch = rollout.collate(eps, rollout.pad_token_id(tokenizer))
    table, recomputed = forward_logprobs(model, batch, temperature or 1.0)
    mask = batch["policy_mask"][:, 1:] == 1                                         # [B, T-1]
    torch.testing.assert_close(batch["logprobs"][:, 1:][mask], recomputed[mask], atol=1e-4, rtol=0)
    if temperature == 0:
        assert (table.argmax(-1)[mask] == batch["input_ids"][:, 1:][mask]).all()


@pytest.mark.parametrize("transposed, lora", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_the_fast_layer_samples_the_plain_samplers_tokens(tokenizer, temperature, top_p,
                                                         transposed, lora):
    """The decode loop (merged weights -- LoRA's adapters merged in -- either layout, its cache
    kept across turns) is a drop-in for generate.py's plain sampler (the model's own forward pass
    and cache, encoded afresh every turn): from the same random stream, three-turn episodes get
    the same tokens, token for token, and the same log-probs and entropies within float32
    rounding."""
    model = make_model(tokenizer, seed=5)
    if lora:  # adapters that change the policy: B non-zero
        from plumbing import lora as adapters
        model = adapters.add_lora(model, flags.Args(lora=4, lora_alpha=8.0, algo="grpo"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.5, generator=torch.Generator().manual_seed(len(name)))
    assert sampler.check_layout(model) is not None
    runs = []
    for policy in (generate.policy(model, tokenizer, 12, temperature, top_p),
                   sampler.hf_policy(model, tokenizer, 12, temperature, top_p,
                                     transposed=transposed)):
        torch.manual_seed(3)
        runs.append(rollout.play(policy, tokenizer, "frozenlake", [0, 1, 2], 2, max_turns=3,
                                 system=SYSTEM))
    plain, fast = runs
    assert max(e.turns for e in plain) == 3
    assert temperature == 0 or len({len(e.ids) for e in plain}) > 1  # rows of other lengths
    for a, b in zip(plain, fast):
        assert a.ids == b.ids and a.responses == b.responses
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(a.entropies), torch.tensor(b.entropies),
                                   atol=1e-5, rtol=0)


def test_a_reply_ends_at_every_end_id_the_generation_config_names(tokenizer):
    """Qwen2.5's generation config ends on <|endoftext|> beside the template's <|im_end|>: a reply
    that writes it ends there (not cut), in both samplers, instead of running on to the limit."""
    model = make_model(tokenizer, seed=5)
    other = tokenizer.convert_tokens_to_ids(tokenizer.tokenize("Right")[0])
    model.generation_config.eos_token_id = [rollout.end_of_turn_ids(tokenizer)[0], other]
    assert generate.stop_ids(model, tokenizer)[-1] == other
    with torch.no_grad():  # every token but `other` made impossible: it is the first one drawn
        model.lm_head.bias = torch.nn.Parameter(torch.full((len(tokenizer),), -1e4))
        model.lm_head.bias[other] = 0.0
    for policy in (generate.policy(model, tokenizer, 8), sampler.hf_policy(model, tokenizer, 8)):
        (g,) = policy([tokenizer.encode("<think>", add_special_tokens=False)])
        assert g.token_ids == [other] and not g.cut


def test_greedy_picks_the_argmax_of_a_full_forward_pass(tokenizer):
    """Greedy decoding through the cache equals a plain decode that runs the whole transcript for
    every token: each policy token is the argmax of a fresh forward pass over what precedes it, on
    episodes of two and three turns."""
    model = make_model(tokenizer)
    policy = sampler.hf_policy(model, tokenizer, max_new_tokens=10, temperature=0)
    eps = rollout.play(policy, tokenizer, "frozenlake", [2, 7], 1, max_turns=3, system=SYSTEM)
    assert min(e.turns for e in eps) >= 2
    batch = rollout.collate(eps, 0)
    table, recomputed = forward_logprobs(model, batch, 1.0)
    mask = batch["policy_mask"][:, 1:] == 1                                         # [B, T-1]
    assert (table.argmax(-1)[mask] == batch["input_ids"][:, 1:][mask]).all()
    torch.testing.assert_close(batch["logprobs"][:, 1:][mask], recomputed[mask], atol=1e-4, rtol=0)


def test_from_pretrained_round_trip_is_identical(tokenizer, tmp_path):
    model = make_model(tokenizer, seed=3)
    model.save_pretrained(tmp_path / "model")
    # its own folder: next to a qwen2 config.json, AutoTokenizer would build Qwen's byte-level
    # tokenizer instead
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    loaded_model = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    loaded_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    assert loaded_tokenizer.chat_template == tokenizer.chat_template
    runs = []
    for m, t in ((model, tokenizer), (loaded_model, loaded_tokenizer)):
        torch.manual_seed(0)
        policy = sampler.hf_policy(m, t, max_new_tokens=16, temperature=0.9, top_p=0.95)
        runs.append(rollout.play(policy, t, "sokoban", [5, 6], 2, max_turns=2, system=SYSTEM))
    for a, b in zip(*runs):
        assert a.ids == b.ids and a.responses == b.responses
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))


def greedy_success(model, tokenizer, seeds, max_new_tokens):
    """Success rate of the model's greedy rollouts (temperature 0), one per seed, on the easy lake."""
    policy = sampler.hf_policy(model, tokenizer, max_new_tokens, temperature=0)
    episodes = rollout.play(policy, tokenizer, "frozenlake", seeds, 1, env_kwargs=LAKE, system=SYSTEM)
    return sum(e.success for e in episodes) / len(episodes)


def test_greedy_sampling_replays_a_learned_transcript(tokenizer):
    """A model trained on the loop's own transcripts (one scripted winning episode) solves the easy lake
    when sampled greedily."""
    episodes = rollout.play(scripted(tokenizer, [["go</think><answer>Right || Right</answer>"]]),
                            tokenizer, "frozenlake", [0], 1, env_kwargs=LAKE, system=SYSTEM)
    assert episodes[0].success and episodes[0].turns == 2
    model = make_model(tokenizer, seed=4)
    assert greedy_success(model, tokenizer, [0, 1], max_new_tokens=40) == 0.0
    batch = rollout.collate(episodes, 0)
    mask = batch["policy_mask"][:, 1:] > 0                                       # [1, T-1]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    # Train until every demonstrated token has probability > 0.9 given its prefix: it is then the
    # argmax, and greedy decoding on the same (fixed) lake replays the winning transcript token for
    # token. A bound on the worst token, not a step count: it does not depend on the trajectory.
    for _ in range(1000):
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1]              # [1, T-1, V]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["input_ids"][:, 1:],
                                                reduction="none")[mask]          # [N]
        if nll.max().item() < -math.log(0.9):
            break
        optimizer.zero_grad()
        nll.mean().backward()
        optimizer.step()
    assert nll.max().item() < -math.log(0.9)
    model.eval()
    assert greedy_success(model, tokenizer, [0, 1], max_new_tokens=60) == 1.0


def test_draw_follows_the_probabilities_and_flags_what_is_not_finite():
    """generate.draw's inverse transform has torch.multinomial's law: over 40,000 draws a row, each
    token's frequency lies within 4 standard errors of its probability (the probabilities
    unnormalised, one row with zeros that are never drawn); a row with a nan or inf is flagged."""
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.0, 3.0, 0.0, 1.0]], dtype=torch.float64)
    torch.manual_seed(0)
    draws, finite = generate.draw(probs.repeat(40_000, 1))
    draws = draws.view(40_000, 2)                                                    # [n, 2]
    assert finite.all()
    p = probs / probs.sum(-1, keepdim=True)
    freq = torch.stack([torch.bincount(draws[:, b], minlength=4) for b in range(2)]) / 40_000
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / 40_000).sqrt() + 1e-12).all(), freq
    assert freq[1, 0] == freq[1, 2] == 0
    for bad in (math.nan, math.inf):
        assert generate.draw(torch.tensor([[0.5, bad], [0.5, 0.5]]))[1].tolist() == [False, True]


# --------------------------------------------------------- replays, captures and weight changes

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_forced_replay_scores_the_sampled_replies_exactly_as_they_were_sampled(tokenizer, dtype):
    """policy(prompts, forced=replies) runs the loop that sampled the replies, each token given:
    the same computation, so in either precision (bfloat16 under autocast, as a bf16 run samples)
    the same log-probs and entropies to the bit. The diagnosis's exactness check replays a bf16
    run's replies in float32 this way (train.sampled_in_float32)."""
    model = make_model(tokenizer)
    policy = sampler.hf_policy(model, tokenizer, max_new_tokens=60, temperature=1.5)
    prompts = [tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
               for text in ("Go right.", "Go left.", "Go right.", "Up.", "Down.", "Stay.")]
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        torch.manual_seed(3)
        sampled = policy(prompts)
        assert len({len(g.token_ids) for g in sampled}) > 1  # rows stop at different steps
        replayed = policy(prompts, forced=[g.token_ids for g in sampled])
    for a, b in zip(sampled, replayed):
        assert a.token_ids == b.token_ids and a.cut == b.cut
        assert a.logprobs == b.logprobs and a.entropies == b.entropies


def replaying(run):
    """A CPU stand-in with a CUDA graph's semantics: the capture runs `run` once (as the warm-up
    run before a capture does, writing what it writes), and every replay runs it again on the
    same input buffers, writing its results into the output tensors the capture returned, as a
    replayed graph writes into its static outputs."""
    out = run()

    def replay():
        for static, new in zip(out, run()):
            static.copy_(new)
        return out
    return replay


def test_a_captured_step_on_a_cpu_stand_in_samples_what_the_eager_loop_samples(tokenizer):
    """The captured step's data flow -- inputs copied into static buffers, the one output tensor
    written again at every replay, the capture run on rows that are not running at the slot
    written next -- driven on a CPU through `replaying`: the same episodes, log-probs and
    entropies as the eager loop, over three turns whose caches continue. A loop that read a
    replay's output after the next replay, or a capture that wrote into a filled slot, would
    differ."""
    model = make_model(tokenizer)
    results = []
    for capture in (False, replaying):
        policy = sampler.hf_policy(model, tokenizer, max_new_tokens=24, temperature=0.9,
                                   capture=capture)
        torch.manual_seed(4)
        results.append(rollout.play(policy, tokenizer, "frozenlake", [0, 1], 2, max_turns=3,
                                    system=SYSTEM))
    eager, graphed = results
    assert max(e.turns for e in eager) == 3
    for a, b in zip(eager, graphed):
        assert a.ids == b.ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6,
                                   rtol=0)


def test_one_capture_serves_the_turns_that_continue_their_rows_and_reads_the_live_weights(
        tokenizer, monkeypatch):
    """While a cache keeps its tensors (the next call's prompts continue its rows, and it has room)
    the step captured in the first call is replayed in the next, and it samples the weights of that
    call: an optimiser step between the calls is written into the tensors the capture reads. So the
    captured policy samples what the eager one samples, before and after the step, with one
    capture."""
    monkeypatch.setattr(sampler, "ROOM", 1024)  # no growth: the cache's tensors are kept
    captures = []

    def counting(run):
        captures.append(1)
        return replaying(run)

    model = make_model(tokenizer)
    eager, captured = (sampler.hf_policy(model, tokenizer, max_new_tokens=8, temperature=0.9,
                                         capture=c) for c in (False, counting))
    prompts = [tokenizer.encode(f"<|im_start|>user\nGo {i}.<|im_end|>\n<|im_start|>assistant\n")
               for i in range(3)]
    calls = []
    for policy in (eager, captured):
        torch.manual_seed(8)
        calls.append(policy(prompts))
    assert [g.token_ids for g in calls[0]] == [g.token_ids for g in calls[1]]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
    model(input_ids=torch.tensor([prompts[0]])).logits.sum().backward()
    optimizer.step()
    later = [p + g.token_ids + [5] for p, g in zip(prompts, calls[0])]  # each continues its row
    for policy in (eager, captured):
        torch.manual_seed(9)
        calls.append(policy(later))
    assert len(captures) == 1
    assert [g.token_ids for g in calls[2]] == [g.token_ids for g in calls[3]]
    # the captured step attends over all 1,024 slots, the eager one over the filled ones: the
    # same terms (the holes add 0) summed in another order, a float32 rounding of log-probs ~ 4
    torch.testing.assert_close(torch.tensor(sum((g.logprobs for g in calls[2]), [])),
                               torch.tensor(sum((g.logprobs for g in calls[3]), [])),
                               atol=1e-5, rtol=0)
    assert [g.logprobs for g in calls[2]] != [g.logprobs for g in calls[0]]  # the step changed it


def test_the_step_is_one_graph_whose_sampling_draws_what_the_eager_step_draws(tokenizer):
    """sampling_step -- the forward pass of each row's last token and the next token's sampling,
    its uniform numbers given -- traced whole by torch.compile with fullgraph=True (what a
    compiled or captured GPU step needs: nothing that breaks the graph), and the traced step gives
    the eager step's tokens, log-probs and entropies."""
    model = make_model(tokenizer)
    lm = sampler.check_layout(model)
    weights = sampler.sampling_weights(lm, torch.float32, False)
    prompt = torch.tensor([tokenizer.encode("<|im_start|>user\nGo.")] * 3)   # [B, W]
    B, W = prompt.shape
    outs = []
    for step in (sampler.sampling_step,
                 torch.compile(sampler.sampling_step, backend="eager", fullgraph=True)):
        cache = sampler.new_cache(lm, B, "cpu")
        sampler.ensure(cache, W + 4)
        cache.valid[:, :W] = True
        cache.position += W
        with torch.no_grad():
            sampler.forward(lm, weights, cache, prompt, torch.arange(W).expand(B, W),
                            torch.arange(W), W)
            u = torch.tensor([[0.1], [0.5], [0.9]], dtype=torch.float64)
            outs.append(step(lm, weights, 0.8, 0.9, cache, prompt[:, -1], torch.ones(B, dtype=bool),
                             torch.tensor([W]), W + 4, u))
    (token, logp, entropy, finite), (token_, logp_, entropy_, finite_) = outs
    assert torch.equal(token, token_) and finite.all() and finite_.all()
    assert len(set(token.tolist())) > 1  # the uniform numbers chose different tokens
    torch.testing.assert_close(logp_, logp, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy_, entropy, atol=1e-6, rtol=0)


def test_a_capture_that_fails_is_said_once_and_the_turns_run_eagerly(tokenizer, capsys):
    """A capture that raises (a GPU without room for the graph, an operation it cannot record):
    one line, once per policy, and every turn samples eagerly what the eager loop samples."""
    calls = []

    def failing(run):
        calls.append(1)
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    model = make_model(tokenizer)
    results = []
    for capture in (False, failing):
        policy = sampler.hf_policy(model, tokenizer, max_new_tokens=16, capture=capture)
        torch.manual_seed(5)
        results.append(rollout.play(policy, tokenizer, "frozenlake", [0], 2, max_turns=3,
                                    system=SYSTEM))
    said = capsys.readouterr().out.splitlines()
    assert said == ["the decode step runs eagerly: capturing it failed (operation not permitted "
                    "when stream is capturing)"] and len(calls) == 1
    assert [e.ids for e in results[0]] == [e.ids for e in results[1]]


def test_a_fused_optimisers_step_is_sampled_from_at_the_next_call(tokenizer):
    """AdamW(fused=True) writes the weights without counting a version: the sampler's weights are
    made from the live ones at every call, so the next call samples the updated policy (equal to a
    fresh policy's records of the same draws), never the one before the step."""
    model = make_model(tokenizer)
    policy = sampler.hf_policy(model, tokenizer, max_new_tokens=8)
    prompts = [tokenizer.encode("<|im_start|>user\nGo.<|im_end|>\n<|im_start|>assistant\n")] * 2
    torch.manual_seed(6)
    before = policy(prompts)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
    model(input_ids=torch.tensor(prompts)).logits.sum().backward()
    optimizer.step()
    torch.manual_seed(7)
    after = policy([p + [5] for p in prompts], forced=[g.token_ids for g in before])
    torch.manual_seed(7)
    fresh = sampler.hf_policy(model, tokenizer, max_new_tokens=8)(
        [p + [5] for p in prompts], forced=[g.token_ids for g in before])
    assert [g.logprobs for g in after] == [g.logprobs for g in fresh]
    assert [g.logprobs for g in after] != [g.logprobs for g in before]


def test_greedy_over_a_masked_vocabulary_is_finite_and_its_entropy_a_number():
    """A logit of -inf (a token a model masks out) is a legitimate zero: greedy and sampled draws
    stay finite, never take it, and the entropy counts it as 0 log 0 = 0; a nan is not finite."""
    logits = torch.tensor([[0.0, -math.inf, 1.0], [2.0, 0.0, -math.inf]])
    for temperature in (0.0, 1.0):
        token, logp, entropy, finite = generate.sample(logits, temperature, 1.0)
        assert finite.all() and torch.isfinite(logp).all() and torch.isfinite(entropy).all()
        assert token.tolist() != [1, 2] and 1 not in token[:1].tolist() and 2 not in token[1:].tolist()
    assert generate.sample(logits, 0.0, 1.0)[0].tolist() == [2, 0]
    p = torch.tensor([1.0, math.e]) / (1 + math.e)
    assert generate.sample(logits, 0.0, 1.0)[2][0].item() == pytest.approx(-(p * p.log()).sum().item())
    assert not generate.sample(torch.tensor([[0.0, math.nan]]), 0.0, 1.0)[3].any()


# ------------------------------------------------------------- the fast path's first check

def test_the_self_check_keeps_a_path_that_agrees_and_drops_one_that_does_not(tokenizer,
                                                                             monkeypatch, capsys):
    """sampler.self_check on a CPU: the decode loop and the model's own forward both within
    their tolerance of a teacher-forced pass, the loop kept; a captured step (the CPU stand-in)
    that agrees is kept, one that samples otherwise is switched off in one line; a decode loop
    whose forward is off is dropped for the model's own forward in one line; and where even that
    is off, the check says nothing agreed."""
    model = make_model(tokenizer, seed=5)
    prompt = tokenizer.encode("a box. go up <think>", add_special_tokens=False)
    ok = sampler.self_check(model, tokenizer, prompt, 8, 1.0, "float32", capture=replaying)
    assert ok["agreed"] and not ok["plain"] and ok["capture"] is replaying
    assert ok["selfcheck_fast_diff"] < 1e-5 and ok["selfcheck_plain_diff"] < 1e-5
    assert ok["selfcheck_capture_diff"] < 1e-6 and capsys.readouterr().out == ""

    def lying(run):  # a capture whose replays return another step's numbers
        out = run()
        return lambda: tuple(x + 1 if x.is_floating_point() else x for x in out)
    off = sampler.self_check(model, tokenizer, prompt, 8, 1.0, "float32", capture=lying)
    assert off["capture"] is False and off["agreed"] and not off["plain"]
    assert capsys.readouterr().out.startswith("the decode step runs eagerly: its captured step")

    forward = sampler.forward
    monkeypatch.setattr(sampler, "forward", lambda *a: 1.5 * forward(*a))  # a wrong decoder
    swapped = sampler.self_check(model, tokenizer, prompt, 8, 1.0, "float32")
    assert swapped["plain"] and swapped["agreed"] and swapped["selfcheck_fast_diff"] > 1e-3
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and said[0].startswith("sampling through the model's own forward pass")
    plain = generate.own_forward
    monkeypatch.setattr(generate, "own_forward", lambda m, ids, pad, law: (
        lambda logits, advance: (logits + 3 * torch.randn_like(logits), advance))(
        *plain(m, ids, pad, law)))
    assert not sampler.self_check(model, tokenizer, prompt, 8, 1.0, "float32")["agreed"]


def test_a_run_logs_its_self_check_and_samples_on_the_path_that_agreed(tmp_path, monkeypatch,
                                                                      capsys):
    """train.py checks its sampler before its first step: the figures in its first log record,
    the decode loop kept where it agrees; with the loop off, the run says so in one line and
    every rollout after samples through the model's own forward; with nothing agreeing, one line
    naming the check, exit 2, no folder left."""
    import json

    import train
    argv = ["--model", "tiny", "--no-warm-start", "--env", "frozenlake", "--groups", "2",
            "--group-size", "2", "--max-turns", "1", "--max-new-tokens", "6", "--steps", "1",
            "--mi-every", "0", "--val-every", "0", "--no-plot", "--filter", "none"]
    out = tmp_path / "good"
    assert train.main(argv + ["--out", str(out)]) == 0
    first = json.loads(open(out / "metrics.jsonl").readline())
    assert first["selfcheck_fast_diff"] < 1e-5 and first["selfcheck_plain_diff"] < 1e-5
    forward, calls = sampler.forward, []
    monkeypatch.setattr(sampler, "forward", lambda *a: 1.5 * forward(*a))
    plain = generate.own_forward
    monkeypatch.setattr(generate, "own_forward", lambda *a: calls.append(1) or plain(*a))
    capsys.readouterr()
    assert train.main(argv + ["--out", str(tmp_path / "swapped")]) == 0
    said = capsys.readouterr().out
    assert said.count("sampling through the model's own forward pass") == 1
    assert len(calls) == 2  # the check's replay of its reply, then the one turn of rollouts
    monkeypatch.setattr(generate, "own_forward", lambda m, ids, pad, law: (
        lambda logits, advance: (logits + 3 * torch.randn_like(logits), advance))(
        *plain(m, ids, pad, law)))
    assert train.main(argv + ["--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: the sampler's self-check: even the model's own forward")
    assert not (tmp_path / "bad").exists()
