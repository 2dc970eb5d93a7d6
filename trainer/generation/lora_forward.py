"""The training engine's forward for PEFT's LoRA linear layers: PEFT's function, fewer passes over the activations.

A LoRA linear layer computes ``base(x) + s · B(A(dropout(x)))``. PEFT's ``lora.Linear.forward`` does it as: ``x``
cast to the LoRA weights' dtype (fp32 under bf16 autocast, which the matmul then casts back to bf16), A, B, a
multiply by ``s`` and an add: four passes over a ``[rows, features]`` tensor besides the matmuls, per layer, in every
forward and again in the backward. Here the LoRA input stays in the activations' dtype (autocast casts the small
weights instead) and B's product is accumulated into the base's output by one ``addmm`` with ``alpha = s``: on this
CPU the policy's forward is 22–24 % faster in bf16 and its backward 12–17 % (8–11 % either way in fp32), the same
function to bf16 rounding (exact in fp32); BENCHMARKS.md.

:func:`install` puts it on every LoRA linear layer of a model (an instance attribute over the class's ``forward``).
What it does not handle goes to PEFT's own forward: mixed-adapter batches (``adapter_names``), merged adapters, LoRA
variants (DoRA, aLoRA) and inputs whose dtype differs from the weights' outside autocast. :func:`adapter_blocks`
runs contiguous blocks of a batch's rows through different adapters in one forward (PPO's critic joining the
policy's passes, ``trainer.loops.critic``).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import torch
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch import Tensor

NO_ADAPTER = "__base__"  # PEFT's name for the base alone in a mixed-adapter batch: the reference policy


def install(model: torch.nn.Module) -> int:
    """Our forward on every LoRA linear layer of ``model``; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    for layer in layers:
        layer.forward = types.MethodType(_forward, layer)
    return len(layers)


def installed(model: torch.nn.Module) -> bool:
    """Whether every LoRA layer of ``model`` is a plain linear one with our forward (what ``adapter_blocks`` needs)."""
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    return bool(layers) and all(isinstance(m, LoraLinear) and "forward" in vars(m) for m in layers)


@contextlib.contextmanager
def adapter_blocks(model: torch.nn.Module, adapters: Sequence[str]) -> Iterator[None]:
    """Within the block, the rows of every forward of ``model`` form ``len(adapters)`` equal contiguous blocks, block
    j going through adapter ``adapters[j]`` (``NO_ADAPTER``: none): each LoRA layer runs its frozen base over all
    the rows in one matmul and each adapter's low-rank update over its own block. PEFT's mixed-adapter batch
    (``adapter_names``) does the same for rows in any order, by index lists whose gathers and scatters cost, on a
    CPU, several times the matmuls they serve. Needs :func:`install` first."""
    assert installed(model), "adapter_blocks needs trainer.generation.lora_forward.install"
    names = list(adapters)
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    for layer in layers:
        layer.forward = types.MethodType(partial(_forward, blocks=names), layer)
    try:
        yield
    finally:
        for layer in layers:
            layer.forward = types.MethodType(_forward, layer)


def _forward(layer: LoraLinear, x: Tensor, *args: Any, blocks: list[str] | None = None, **kwargs: Any) -> Tensor:
    names = blocks if blocks is not None else [a for a in layer.active_adapters if a in layer.lora_A]
    live = [n for n in names if n != NO_ADAPTER]
    autocasting = torch.is_autocast_enabled(x.device.type)
    if (
        kwargs.get("adapter_names") is not None
        or layer.merged
        or any(n in layer.lora_variant for n in live)
        or (not autocasting and any(layer.lora_A[n].weight.dtype != x.dtype for n in live))
    ):
        assert blocks is None, "adapter blocks with merged adapters, LoRA variants or mixed dtypes"
        return type(layer).forward(layer, x, *args, **kwargs)
    result = layer.base_layer(x, *args, **kwargs)
    if (layer.disable_adapters and blocks is None) or not live:
        return result
    out, rows = result.reshape(-1, result.shape[-1]), x.reshape(-1, x.shape[-1])
    if blocks is None:
        for n in live:
            h = torch.nn.functional.linear(layer.lora_dropout[n](rows), layer.lora_A[n].weight)
            out = torch.addmm(out, h, layer.lora_B[n].weight.t(), alpha=float(layer.scaling[n]))
        return out.view(result.shape).to(result.dtype)
    per = rows.shape[0] // len(blocks)
    for j, n in enumerate(blocks):
        if n == NO_ADAPTER:
            continue
        h = torch.nn.functional.linear(layer.lora_dropout[n](rows[j * per : (j + 1) * per]), layer.lora_A[n].weight)
        b = layer.lora_B[n].weight.t().to(out.dtype)  # in place: autocast does not cast for it
        out[j * per : (j + 1) * per].addmm_(h.to(out.dtype), b, alpha=float(layer.scaling[n]))
    return result
