"""trainer.generation.attention: grouped-query attention against attention done head by head by hand, a switched model
against transformers' eager attention (outputs and gradients), and the compiled decode step calling it as one op."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaForCausalLM

from trainer.generation.attention import GROUPED, _grouped_op, grouped_scores_softmax_values, use_grouped_attention
from trainer.generation.rollout import StaticDecoder, generate, left_pad


def by_hand(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scaling: float) -> Tensor:
    """Head by head: query head i against key/value head i // (H / H_kv), softmax in float32 → [B, Q, H, D]."""
    b, h, n, d = q.shape
    g = h // k.shape[1]
    length = k.shape[2]
    out = torch.empty(b, n, h, d, dtype=v.dtype)
    for i in range(h):
        scores = q[:, i] @ k[:, i // g].transpose(-1, -2) * scaling  # [B, Q, L]
        if mask is not None:
            scores = scores + mask[:, 0, :, :length]
        out[:, :, i] = torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v[:, i // g]
    return out


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("queries", [1, 5])
def test_grouped_attention_is_each_query_head_against_its_kv_head(heads: int, kv_heads: int, queries: int) -> None:
    torch.manual_seed(0)
    b, d, length = 3, 8, 7
    q = torch.randn(b, heads, queries, d)
    k, v = torch.randn(b, kv_heads, length, d), torch.randn(b, kv_heads, length, d)
    # additive mask, longer than the keys (a static cache's mask may be): row 0 left-padded, row 2 one key masked
    allowed = torch.ones(b, 1, queries, length + 3, dtype=torch.bool)
    allowed[0, :, :, :2] = False
    allowed[2, :, :, 4] = False
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    for m in (mask, None):
        want = by_hand(q, k, v, m, 0.3)
        torch.testing.assert_close(grouped_scores_softmax_values(q, k, v, m, 0.3), want, rtol=0, atol=1e-6)
        torch.testing.assert_close(_grouped_op(q, k, v, m, 0.3), want, rtol=0, atol=1e-6)
    # a masked key takes no weight: changing its value changes nothing
    v2 = v.clone()
    v2[0, :, :2] = 100.0
    torch.testing.assert_close(
        grouped_scores_softmax_values(q, k, v2, mask, 0.3)[0], grouped_scores_softmax_values(q, k, v, mask, 0.3)[0]
    )
    torch.library.opcheck(_grouped_op, (q, k, v, mask, 0.3))


def test_a_switched_model_gives_eager_attentions_outputs_and_gradients(any_model: torch.nn.Module) -> None:
    """In train mode, GPT-2's dropout included (the attention weights' among them): the same seed, the same masks."""
    eager = copy.deepcopy(any_model)
    eager.set_attn_implementation("eager")
    grouped = copy.deepcopy(eager)
    assert use_grouped_attention(grouped) and grouped.config._attn_implementation == GROUPED
    ids, mask = left_pad([[5, 6, 7], [8, 9, 10, 11, 12], [13]], 0)
    outs = []
    for m in (eager, grouped):
        m.train()
        torch.manual_seed(1)
        logits = m(input_ids=ids, attention_mask=mask).logits
        (logits[mask.bool()].log_softmax(-1)[:, 3]).sum().backward()
        outs.append((logits[mask.bool()], {n: p.grad for n, p in m.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=1e-5)
    for name, grad in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][name], grad, rtol=1e-4, atol=1e-5)


def test_a_model_whose_eager_attention_is_not_the_standard_one_is_left_as_it_is() -> None:
    """Gemma 2 soft-caps its attention scores (its eager attention takes ``softcap``): not switched."""
    config = Gemma2Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    gemma = Gemma2ForCausalLM(config)
    before = gemma.config._attn_implementation
    assert not use_grouped_attention(gemma)
    assert gemma.config._attn_implementation == before


@pytest.mark.parametrize("compiled", [False, True])
def test_the_decode_step_on_grouped_attention_samples_what_sdpa_samples(
    model: LlamaForCausalLM, compiled: bool
) -> None:
    """A static-cache decoder on a grouped-attention copy (compiled: every attention layer of every decode step is
    one call of the custom op, not code inductor fused) samples the tokens the SDPA model samples on a growing
    cache, with log-probs within float rounding."""
    sdpa = copy.deepcopy(model).eval()
    sdpa.set_attn_implementation("sdpa")
    grouped = copy.deepcopy(sdpa)
    assert use_grouped_attention(grouped)
    ids, mask = left_pad([[5, 6, 7], [8, 9, 10, 11, 12], [13], [5, 6, 7]], 0)
    steps = 6

    def sample(model: torch.nn.Module, decoder: StaticDecoder | None) -> Any:
        return generate(
            model,
            ids,
            mask,
            max_new_tokens=steps,
            eos_id=1,
            pad_id=0,
            temperature=1.0,
            min_new_tokens=steps,
            generator=torch.Generator().manual_seed(3),
            with_logprobs=True,
            decoder=decoder,
        )

    with torch.no_grad():
        want, want_lp = sample(sdpa, None)
        decoder = StaticDecoder(grouped, compiled=compiled)
        sample(grouped, decoder)  # compiles, when compiled
        with torch.profiler.profile() as prof:
            got, got_lp = sample(grouped, decoder)
    for x, y in zip(got.tensors(), want.tensors(), strict=True):
        assert torch.equal(x, y)
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=1e-5)
    calls = sum(e.count for e in prof.key_averages() if e.key == "proxima::grouped_attention")
    layers = grouped.config.num_hidden_layers
    assert calls == (layers * (steps - 1) if compiled else 0)
    assert decoder.compile_error is None
