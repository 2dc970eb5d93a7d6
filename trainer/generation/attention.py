"""Grouped-query attention for bf16 on a CPU (the sampler and the training passes): two batched matrix products per
layer, no copies.

A decode step's attention is tiny (one query per row against the cache) and on a CPU it costs far more than its
arithmetic: torch's bf16 ``scaled_dot_product_attention`` takes about 0.9 ms a layer for 64 rows × 4 heads × 64 cached
positions, HF's eager attention copies the keys and values once per query head (``repeat_kv``), and inductor lowers
a one-query product to a reduction into which it inlines the query's rotary embedding, recomputed for every key
(bench/README.md); in the training passes the copies cost time too. Here each key/value head is multiplied once by
all its query heads' rows (the group's heads stacked as rows: ``[B, H_kv, G·Q, D] @ [B, H_kv, D, L]``), with the
mask added and the softmax taken in float32 as eager attention does. Under ``torch.compile`` (the sampler's decode
step) it runs as one custom op, so the compiled graph calls it as it is instead of fusing into it.

The maths is eager attention's: the same scores, the additive mask of HF's ``eager_mask``, a float32 softmax cast to
the query's dtype, then the weighted values. Only models whose eager attention is the standard one (the signature
``module, query, key, value, attention_mask, scaling, dropout, **kwargs``: no soft-capping, sinks or position biases)
are switched (:func:`use_grouped_attention`)."""

from __future__ import annotations

import inspect
import sys

import torch
from torch import Tensor

GROUPED = "proxima_grouped"
"""The attention implementation's name in transformers' ``AttentionInterface`` (and its mask's)."""


def grouped_scores_softmax_values(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scaling: float, dropout: float = 0.0
) -> Tensor:
    """softmax(Q·Kᵀ·scaling + mask)·V with each key/value head shared by its group of query heads, without copying
    them. query [B, H, Q, D], key and value [B, H_kv, L, D] (H a multiple of H_kv; query head i reads key/value head
    i // (H / H_kv), as ``repeat_kv`` orders them), mask additive [B, 1, Q, ≥L] or None → [B, Q, H, D]."""
    b, h, q, d = query.shape
    hk, length = key.shape[1], key.shape[2]
    g = h // hk
    scores = torch.matmul(query.reshape(b, hk, g * q, d), key.transpose(-1, -2)) * scaling
    if mask is not None:
        scores = (scores.view(b, hk, g, q, length) + mask[:, :, None, :, :length]).view(b, hk, g * q, length)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    if dropout:
        probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
    return torch.matmul(probs, value).view(b, h, q, d).transpose(1, 2)


@torch.library.custom_op("proxima::grouped_attention", mutates_args=())
def _grouped_op(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scaling: float) -> Tensor:
    return grouped_scores_softmax_values(query, key, value, mask, scaling).contiguous()


@_grouped_op.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scaling: float) -> Tensor:
    b, h, q, d = query.shape
    return query.new_empty((b, q, h, d))


def grouped_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature (``AttentionInterface``): [B, Q, H, D] and no weights. Compiled
    (the sampler's decode step) it is the custom op, which has no backward; eager it is differentiable, with the
    attention dropout of a model in train mode."""
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    p = dropout if module.training else 0.0
    if torch.compiler.is_compiling() and not p and not torch.is_grad_enabled():
        return _grouped_op(query, key, value, attention_mask, scale), None
    return grouped_scores_softmax_values(query, key, value, attention_mask, scale, p), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, eager_mask

    if GROUPED not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(GROUPED, grouped_attention)
        AttentionMaskInterface.register(GROUPED, eager_mask)


def standard_eager_attention(model: torch.nn.Module) -> bool:
    """Whether every attention layer of the model computes eager attention the standard way: its modeling module's
    ``eager_attention_forward`` takes no parameters beyond the standard ones (soft-capping, attention sinks and
    position biases add some) and the model can switch attention functions."""
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is None or not can_set():
        return False
    standard = ["module", "query", "key", "value", "attention_mask", "scaling", "dropout", "kwargs"]
    modules = {type(m).__module__ for m in model.modules() if type(m).__name__.endswith("Attention")}
    if not modules:
        return False
    for name in modules:
        eager = getattr(sys.modules[name], "eager_attention_forward", None)
        if eager is None or list(inspect.signature(eager).parameters) != standard:
            return False
    return True


def use_grouped_attention(model: torch.nn.Module) -> bool:
    """Switch a model on a CPU (the bf16 sampler, the bf16 training passes) to :func:`grouped_attention` where its
    attention is the standard one; returns whether it did."""
    if next(model.parameters()).device.type != "cpu" or not standard_eager_attention(model):
        return False
    _register()
    model.set_attn_implementation(GROUPED)  # type: ignore[operator]
    return getattr(model.config, "_attn_implementation", None) == GROUPED
