"""LoRA adapters (peft) on the policy: only the adapters train, and no copy of the base exists.

The policy trains through its "default" adapter. For PPO the critic is the same frozen base seen
through a second adapter, "critic", plus its value head (make_lora_critic); the KL reference is the
base with its adapters switched off (models.reference). --lora-targets and --lora are checked
against the model's layers before peft sees them (check_lora), as peft's own refusal is a
traceback.
"""

import contextlib
import warnings

import torch

import ppo
from plumbing.flags import UsageError


@contextlib.contextmanager
def quiet_peft():
    """peft asks transformers for a name transformers deprecates (is_gradient_checkpointing): a
    warning for peft's authors, not for the user of a run."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated",
                                FutureWarning)
        yield


def add_lora(model, a):
    """Wrap the policy in LoRA adapters (peft): "default" for the policy and, for PPO, "critic"
    for the critic."""
    from peft import LoraConfig, get_peft_model

    check_lora(model, a)  # peft's own refusal is a traceback
    targets = a.lora_targets if a.lora_targets == "all-linear" else a.lora_targets.split(",")
    config = dict(
        r=a.lora,
        lora_alpha=a.lora_alpha,
        target_modules=targets,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with quiet_peft():
        peft_model = get_peft_model(model, LoraConfig(**config))
        if a.algo == "ppo":
            peft_model.add_adapter("critic", LoraConfig(**config))
    peft_model.set_adapter("default")
    return peft_model


def lora_layers(model, targets):
    """{name: module} of the layers LoRA adapts for --lora-targets `targets`: all-linear (as peft
    reads it) is every linear layer but the output layer; names match the end of a module's, as
    peft matches them."""
    output = model.get_output_embeddings()
    layers = {}
    for name, m in model.named_modules():
        if targets == "all-linear":
            if isinstance(m, torch.nn.Linear) and m is not output:
                layers[name] = m
        elif isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) and any(
                name == t or name.endswith("." + t) for t in targets.split(",")):
            layers[name] = m
    return layers


def check_lora(model, a):
    """--lora-targets names layers of `model` that LoRA can adapt (peft matches a name to the end
    of a module's), and --lora is a rank they can use: else a UsageError naming what the model
    has. --lora no larger than the largest full rank, min(rows, columns), of the layers it
    adapts: beyond it every adapter can already learn any update of its layer, and a larger rank
    only adds parameters (--lora 100000 on the 64-wide tiny policy would write a 1.6 GB
    checkpoint)."""
    targets = [] if a.lora_targets == "all-linear" else a.lora_targets.split(",")
    missing = [t for t in targets if not lora_layers(model, t)]
    if missing:
        known = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))})
        raise UsageError(f"--lora-targets {a.lora_targets}: the policy has no layer named "
                         f"{', '.join(missing)}; its layers: {', '.join(known[:8])} (or "
                         f"all-linear)")
    shapes = {name: tuple(m.weight.shape) for name, m in lora_layers(model, a.lora_targets).items()}
    if not shapes:
        return
    name, shape = max(shapes.items(), key=lambda item: min(item[1]))
    if a.lora > min(shape):
        raise UsageError(f"--lora {a.lora}: no layer it adapts has a rank above {min(shape)} "
                         f"({name}: {shape[0]} x {shape[1]}), so a larger adapter only adds "
                         f"parameters; use --lora {min(shape)} or less")


def lora_params(model, adapter):
    return [p for n, p in model.named_parameters() if f".{adapter}." in n and "lora_" in n]


@contextlib.contextmanager
def adapter(model, name):
    """Run with LoRA adapter `name` active, then switch back. peft leaves only the active adapter
    trainable; the critic's adapter is made trainable again for its own optimiser."""
    before = model.active_adapter
    model.set_adapter(name)
    try:
        yield model
    finally:
        model.set_adapter(before)
        for p in lora_params(model, "critic"):
            p.requires_grad_(True)


def critic_scope(critic):
    """The context a critic's forward pass AND its backward pass run in. With activation
    checkpointing the backward pass runs each layer's forward again, and peft's layers read the
    active adapter when they run: a LoRA critic's backward outside its adapter would recompute the
    policy's "default" adapter and give the critic wrong gradients, silently. A critic of its own
    weights (full fine-tuning) needs no context."""
    body = getattr(critic, "body", None)
    if isinstance(body, AdapterBody):
        return adapter(body.peft_model, "critic")
    return contextlib.nullcontext()


class AdapterBody(torch.nn.Module):
    """The critic's body under LoRA: the policy's frozen base seen through its "critic" adapter. The
    base is not a submodule here, so the critic's own parameters are its head (the adapter goes to
    its optimiser)."""

    def __init__(self, peft_model):
        super().__init__()
        object.__setattr__(self, "peft_model", peft_model)

    def forward(self, input_ids, attention_mask=None):
        with adapter(self.peft_model, "critic"):
            decoder = self.peft_model.get_base_model().get_decoder()
            return decoder(input_ids=input_ids, attention_mask=attention_mask)


def make_lora_critic(peft_model):
    return ppo.Critic(AdapterBody(peft_model), peft_model.config.get_text_config().hidden_size)
