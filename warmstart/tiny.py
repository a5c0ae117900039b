"""The embedded tiny policy: a small Qwen2 and a word-level tokenizer built in code, warm-started
once per world.

The policy that lets the main job run, and learn, on a laptop CPU with no download. The rest of the
code treats it exactly like a Qwen2.5 model.

Tokenizer. Word-level: text is cut into pieces -- the tags <think> </think> <answer> </answer> ||,
words, numbers, any other single character, each with the one space before it, as Qwen's BPE carries
a word's leading space in the word's token (" Down", " 1", " </think>"); then runs of white space --
and every piece seen in the worlds' prompts is one token, so a grid cell is one token. Carrying the
space makes a Sokoban transcript about 0.7x as long and a reply about 0.6x (tokens per world:
README). An unseen piece falls back to its longest known prefixes, down to single characters (every
printable ASCII character and every character of the prompts is a token), and decoding concatenates
the pieces, so decode(encode(s)) == s and no prompt meets <unk>. Chat template: ChatML as Qwen2.5
writes it.

Model. A Qwen2ForCausalLM from a Qwen2Config: 2 layers, 64 wide, grouped-query attention, about 0.1M
parameters.

Warm start. A random network never writes a valid action, so on first use per world the model is
trained by behaviour cloning on solver demonstrations (demos.py) and cached in
.cache/tiny/<world>-<hash>; every later run loads it. The build is the same whatever the run's
--seed (like a pretrained checkpoint, it is part of the model); --warm-start-seed builds another one
and --template-prior ALPHA one taught to reason with a template on a share ALPHA of its turns
(templates.py; its vocabulary adds the templates' words), each in its own folder. It saves its
progress every SAVE_EVERY steps (an interrupted build continues where it stopped), one process
builds while others wait for it, and the cached files carry checksums: a damaged entry is built
again.
"""
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import random
import re
import shutil
import string
import time

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

import envs
import rollout
from warmstart import demos, templates

# bump when demonstrations, tokenizer or default sizes / training settings change: no stale cache
FORMAT_VERSION = 7
WARM_START_STEPS = 600
SAVE_EVERY = 100  # warm-start steps between saves of its progress (a multiple of demos.ROUND)
# the warm start's torch threads, fixed so that the build does not depend on the core count
BUILD_THREADS = 2
TAGS = ("<think>", "</think>", "<answer>", "</answer>", "||")
# Qwen2.5's: pad, turn start, turn end (= eos)
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
UNK = "<unk>"
# a piece, as Qwen's (GPT-2's) pre-tokenizer cuts text: a tag, a word (capitalised or lower case:
# grid rows such as "_PX#" fall apart into cells), a number or one other character, each carrying
# the single space before it (" Down", " 1", " </think>"); then white space, whose last space is
# left to the piece that follows it
PIECE = (r" ?</?think>| ?</?answer>| ?\|\||"
         r" ?[A-Za-z][a-z]*| ?-?\d+(?:\.\d+)?|\s+(?!\S)| ?\S|\s+")
# Qwen2.5's ChatML template without tool calls; like Qwen's it writes a default system message when
# none is given
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n" + rollout.TINY_SYSTEM + "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CHECKED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# the worlds whose words every tiny tokenizer holds; an answer world adds its own (world_texts)
SHARED_WORLDS = ("sokoban", "frozenlake", "bandit")


# ---------------------------------------------------------------------------------------- tokenizer

def _sample_texts(seeds=range(8), with_templates=False, world=None):
    """Every kind of text the rollout loop writes for tiny: system prompts, user turns,
    demonstrations, numbers; and the template grammar's sentences when asked (templates.py); and
    the texts of `world` when it is not one of SHARED_WORLDS (world_texts)."""
    texts = [rollout.TINY_SYSTEM, CHAT_TEMPLATE, "Try Push from none expects pays", "user assistant"]
    rng = random.Random(0)
    for name in SHARED_WORLDS:
        for seed in seeds:
            env = envs.make_env(name)
            obs, _ = env.reset(seed=seed)
            texts += [rollout.system_prompt(env, k) for k in (1, 2)]
            texts += [
                user(obs, 0.0, env.max_steps, 1)
                for user in (rollout.tiny_user(name), rollout.user_message)
            ]
            texts.append(demos.demonstration(env, rng, noise=0.5))
            texts.append(obs + "\n" + "\n".join(env.actions))
    # turn rewards (two decimals) and actions left
    texts += [f"{k / 10:.2f}" for k in range(-30, 121)] + [str(k) for k in range(101)]
    if world is not None and world not in SHARED_WORLDS:
        texts += world_texts(world)
    # a reasoning starts with the space after "<think>": " Let", as the demonstrations write it
    return texts + ([" " + t for t in templates.sentences()] if with_templates else [])


def world_texts(name, seeds=range(200)):
    """An answer world's texts (Countdown, the word problems): its prompts, demonstrations and
    the turn after a wrong answer on `seeds` -- enough of them to meet every word of its lists --
    and the numbers 0..200 with the space before them, as its arithmetic writes them."""
    texts, rng, env = [], random.Random(0), envs.make_env(name)
    for seed in seeds:
        obs, _ = env.reset(seed=seed)
        texts += [rollout.system_prompt(env), rollout.user_message(obs, 0.0, env.max_steps, 1), obs,
                  demos.demonstration(env, rng, noise=0.5)]
        env.reset(seed=seed)
        env.step(env.random_action(rng))
        texts.append(env.render())
    return texts + [f" {k}" for k in range(201)]


def build_tokenizer(with_templates=False, world=None):
    """Word-level tokenizer over the worlds' texts with a character fallback, ChatML chat template,
    Qwen's specials; with_templates adds the template grammar's words (a warm start with a template
    prior writes them; without one the vocabulary, and so the cache folder, is unchanged); `world`
    adds an answer world's words (world_texts) for its own policy: the worlds of SHARED_WORLDS, and
    so their cached warm starts, keep the vocabulary they had before the answer worlds came.

    >>> tok = build_tokenizer(); tok.convert_ids_to_tokens(tok.encode("#_P\\n<think> Up"))
    ['#', '_', 'P', '\\n', '<think>', ' Up']
    """
    pieces = set(string.printable) | set(TAGS) | {" " + tag for tag in TAGS}
    for text in _sample_texts(with_templates=with_templates, world=world):
        pieces.update(text)  # every character, the grid symbols included
        pieces.update(re.findall(PIECE, text))
    pieces -= set(SPECIAL)
    vocab = {UNK: 0}
    for piece in sorted(pieces):
        vocab[piece] = len(vocab)
    # WordPiece with an empty continuation prefix = greedy longest known prefix: whole words when
    # known, else chars
    core = Tokenizer(models.WordPiece(vocab, unk_token=UNK, continuing_subword_prefix="",
                                      max_input_chars_per_word=1_000_000))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(PIECE), behavior="isolated")
    core.decoder = decoders.Fuse()  # decoding = concatenation: exact round trip
    core.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", unk_token=UNK,
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
                                   clean_up_tokenization_spaces=False, padding_side="left",
                                   model_max_length=4096)


# -------------------------------------------------------------------------------------------- model


def build_model(tokenizer, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                intermediate_size=128, init_std=0.2, seed=0):
    """A Qwen2ForCausalLM from a Qwen2Config (grouped-query attention, RoPE, RMSNorm, SwiGLU), tied
    embeddings, its weights drawn from `seed` without touching the global random stream.

    Weights start at std `init_std`, not Qwen's 0.02 (meant for 896-wide and wider models): at 64
    wide, 0.02 leaves attention logits near 0, so every head starts uniform and the warm start sits
    long on a loss plateau before it reads the positions line. Attention is torch's SDPA kernel (the
    default).
    """
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"hidden_size must divide by num_heads and num_heads by num_kv_heads, got "
                         f"{hidden_size}, {num_heads}, {num_kv_heads}")
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden_size,
                         num_hidden_layers=num_layers, intermediate_size=intermediate_size,
                         num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, max_position_embeddings=4096,
                         rope_theta=10_000.0, tie_word_embeddings=True, initializer_range=init_std,
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


# -------------------------------------------------------------------------------------------- cache

def cache_folder(cache_dir, env_name, tokenizer, env_kwargs=None, **settings):
    """cache_dir/<env>-<hash>: the hash covers the world's settings, the tiny settings, the
    vocabulary and FORMAT_VERSION, so a change to any of them builds a new model instead of loading
    a stale one."""
    vocab = tokenizer.get_vocab()
    key = json.dumps({"env": env_name, "env_kwargs": env_kwargs or {}, "settings": settings,
                      "version": FORMAT_VERSION, "vocab": sorted(vocab.items())},
                     sort_keys=True, default=str)
    return os.path.join(cache_dir, f"{env_name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}")


def checksums(folder):
    """sha256 of every file a cached model is loaded from (missing files: None)."""
    def digest(path):
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    paths = {name: os.path.join(folder, name) for name in CHECKED_FILES}
    return {name: digest(path) if os.path.isfile(path) else None for name, path in paths.items()}


def load_tiny(env_name, env_kwargs=None, cache_dir=".cache/tiny", rebuild=False, warm_start=True,
              steps=None, seed=0, progress=True, template_prior=0.0, template_kind="pool",
              filler=None, **sizes):
    """(model, tokenizer) for `env_name`: warm-started on demonstrations on first use, then loaded
    from the cache.

    warm_start=False gives the untrained network (nothing cached); rebuild=True trains again even
    when cached; steps defaults to WARM_START_STEPS; `seed` draws the weights and picks the
    demonstrations (a build seed); `template_prior` is the share of demonstration turns that reason
    with a template (templates.py) of `template_kind` (pool sentences, or surface-matched: another
    layout's task reasoning); `filler` the eps of templates.filler appended to every reasoning
    (None: none). The folder holds warm_start.json (steps, seconds, losses,
    checksums). `sizes` go to build_model.
    """
    if env_name not in envs.ENVS:
        raise ValueError(f"unknown environment {env_name!r}; valid: {', '.join(sorted(envs.ENVS))}")
    if not 0 <= template_prior <= 1:
        raise ValueError(f"template_prior must be in [0, 1], got {template_prior}")
    steps = steps or WARM_START_STEPS
    if template_kind not in templates.TEMPLATE_KINDS:
        raise ValueError(f"template_kind must be one of {', '.join(templates.TEMPLATE_KINDS)}")
    tokenizer = build_tokenizer(with_templates=template_prior > 0 and template_kind == "pool",
                                world=env_name)
    if not warm_start:
        return build_model(tokenizer, seed=seed, **sizes), tokenizer
    settings = dict(steps=steps, seed=seed, **sizes)
    if template_prior:  # only then: without a prior the key, and the folder, are as before
        settings.update(template_prior=template_prior, template_pool=templates.pool(env_name))
    if template_kind != "pool" and template_prior:  # own folders; the pool's keys as before
        settings.update(template_kind=template_kind)
        settings.pop("template_pool", None)
    if filler is not None:
        settings.update(filler=filler)
    folder = cache_folder(cache_dir, env_name, tokenizer, env_kwargs, **settings)
    # a complete entry is only ever swapped in whole: reading it needs no lock, nor a cache that
    # can be written (a read-only disk); a damaged one is built again under the lock below
    if not rebuild:
        model, _ = _load_cached(folder)
        if model is not None:
            return model, PreTrainedTokenizerFast.from_pretrained(folder)
    os.makedirs(cache_dir, exist_ok=True)
    with _locked(folder + ".lock", f"waiting for another process that is building the tiny warm "
                                   f"start in {folder}"):
        if not rebuild:
            model, problem = _load_cached(folder)
            if model is not None:
                return model, PreTrainedTokenizerFast.from_pretrained(folder)
            if problem:
                print(f"the cached tiny warm start in {folder} is damaged ({problem}); "
                      f"building it again")
        # Two builds side by side on fewer cores than their threads (each spins BUILD_THREADS
        # threads at every barrier) ran more than 15 times slower than one after the other on 2
        # cores: there, builds of different warm starts take turns.
        turns = (os.cpu_count() or 1) < 2 * BUILD_THREADS
        waiting = "waiting for another warm start's build to end (too few cores for two)"
        with (_locked(os.path.join(cache_dir, "build.lock"), waiting) if turns
              else contextlib.nullcontext()):
            model = _build(folder, tokenizer, env_name, env_kwargs, steps, seed, progress, sizes,
                           template_prior, template_kind, filler)
        return model, tokenizer


@contextlib.contextmanager
def _locked(path, waiting):
    """Hold an exclusive lock on the file `path`, saying `waiting` if it is held."""
    with open(path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            print(waiting)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def in_memory(model):
    """The model with its weights in memory of its own: from_pretrained maps the safetensors file,
    and weights still read from a cache file that another process rewrites in place change under
    the run, or stop it (a bus error, seen when a damaged cache entry was rebuilt)."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    return model


def _load_cached(folder):
    """(model, None) when the folder holds an intact warm start; (None, problem) when it holds a
    damaged one; (None, None) when there is none."""
    info_path = os.path.join(folder, "warm_start.json")
    if not os.path.exists(info_path):
        return None, None
    try:
        with open(info_path) as f:
            expected = json.load(f)["checksums"]
        found = checksums(folder)
        bad = [name for name in CHECKED_FILES if found[name] != expected.get(name)]
        if bad:
            return None, f"{', '.join(bad)} differ from the checksums written at build time"
        return in_memory(Qwen2ForCausalLM.from_pretrained(folder)).eval(), None
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        return None, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _build(folder, tokenizer, env_name, env_kwargs, steps, seed, progress, sizes,
           template_prior=0.0, template_kind="pool", filler=None):
    """Behaviour cloning into `folder`, continuing a saved partial build; progress is saved every
    SAVE_EVERY steps."""
    partial = folder + ".partial.pt"
    fresh = functools.partial(build_model, tokenizer, seed=seed, **sizes)
    model, start, state, losses = demos.saved_progress(partial, fresh(), fresh)
    again = f" (continuing at step {start})" if start else ""
    print(f"building the tiny policy's warm start for {env_name}: behaviour cloning on solver "
          f"demonstrations, {steps} steps{again}. A one-time build, cached in {folder}; later runs "
          f"load it.")
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=steps, initial=start, desc=f"tiny warm start ({env_name})",
                   dynamic_ncols=True)

    def on_step(step, loss, optimizer):
        losses.append(loss)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
        if (step + 1) % SAVE_EVERY == 0 and step + 1 < steps:
            demos.keep_progress(partial, model, optimizer, step + 1, losses)

    threads = torch.get_num_threads()
    torch.set_num_threads(min(BUILD_THREADS, os.cpu_count() or 1))
    began = time.time()
    try:
        pool = () if not template_prior else (
            templates.surface_template() if template_kind == "surface" else templates.pool(env_name))
        demos.imitate(model, tokenizer, env_name, env_kwargs, steps=steps, seed=seed, start=start,
                      state=state, on_step=on_step, template_prior=template_prior, pool=pool,
                      filler=None if filler is None else templates.filler(filler))
    except KeyboardInterrupt:
        done = len(losses) - len(losses) % SAVE_EVERY
        print(f"\nthe warm start stopped at step {len(losses)}; the next run continues from step "
              f"{done}")
        raise
    finally:
        torch.set_num_threads(threads)
        if bar is not None:
            bar.close()
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    # written last: marks a complete folder
    with open(os.path.join(tmp, "warm_start.json"), "w") as f:
        json.dump({"env": env_name, "env_kwargs": env_kwargs or {}, "steps": steps, "seed": seed,
                   "template_prior": template_prior,
                   "seconds": time.time() - began, "first_loss": losses[0] if losses else None,
                   "last_loss": losses[-1] if losses else None, "checksums": checksums(tmp)}, f)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    if os.path.exists(partial):
        os.remove(partial)
    print(f"warm start built in {time.time() - began:.0f} s")
    # what every later run reads: the same bits in the same layout, so a run computes alike
    # whether it built the warm start or loaded it (the model trained in memory did not: on an AMD
    # EPYC its diagnosis differed from a loaded copy's by 1e-5)
    return in_memory(Qwen2ForCausalLM.from_pretrained(folder)).eval()
