"""trainer.generation.lora_forward: the training engine's LoRA linear forward computes PEFT's function and gradients,
follows the active adapter, the disabled adapters and dropout as PEFT's does, hands what it does not handle to PEFT, and
runs contiguous blocks of rows through different adapters as separate forwards would."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from peft.tuners.lora import Linear as LoraLinear
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.generation.lora_forward import NO_ADAPTER, adapter_blocks, installed
from trainer.generation.models import add_lora
from trainer.spec.lora import LoraSpec


def _model(dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = add_lora(LlamaForCausalLM(cfg), LoraSpec(r=4, alpha=8, dropout=dropout), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _layers(model: torch.nn.Module) -> list[LoraLinear]:
    return [m for m in model.modules() if isinstance(m, LoraLinear)]


def _peft_forward(model: torch.nn.Module) -> None:
    """PEFT's own forward again on every layer (the class's)."""
    for layer in _layers(model):
        del layer.forward


IDS = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(2))


def _logits_and_grads(model: torch.nn.Module, **kw: object) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=IDS, **kw).logits
    (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    return logits.detach(), [p.grad.clone() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None]


def test_the_forward_is_peft_s_function_with_peft_s_gradients_in_fp32() -> None:
    model = _model()
    assert installed(model) and len(_layers(model)) == 14  # q, k, v, o, gate, up, down × 2 layers
    ours, ours_g = _logits_and_grads(model)
    _peft_forward(model)
    assert not installed(model)
    peft, peft_g = _logits_and_grads(model)
    torch.testing.assert_close(ours, peft, rtol=0, atol=1e-5)
    assert len(ours_g) == len(peft_g) == 28  # every A and B
    for a, b in zip(ours_g, peft_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_under_bf16_autocast_it_matches_peft_to_bf16_rounding_in_the_same_dtype() -> None:
    model = _model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = model(input_ids=IDS).logits
        _peft_forward(model)
        peft = model(input_ids=IDS).logits
    assert ours.dtype == peft.dtype
    scale = float(peft.float().abs().max())
    assert float((ours.float() - peft.float()).abs().max()) < 0.02 * scale


def test_it_follows_the_active_adapter_and_the_disabled_adapters() -> None:
    model = _model()
    with torch.no_grad():
        first = model(input_ids=IDS).logits
        model.add_adapter("other", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        for n, p in model.named_parameters():
            if "lora_B.other" in n:
                torch.nn.init.normal_(p, std=0.3)
        model.set_adapter("other")
        other = model(input_ids=IDS).logits
        with model.disable_adapter():
            base = model(input_ids=IDS).logits
        _peft_forward(model)
        torch.testing.assert_close(other, model(input_ids=IDS).logits, rtol=0, atol=1e-5)
        with model.disable_adapter():
            torch.testing.assert_close(base, model(input_ids=IDS).logits, rtol=0, atol=1e-5)
        model.set_adapter("default")
        torch.testing.assert_close(first, model(input_ids=IDS).logits, rtol=0, atol=1e-5)
    assert float((other - first).abs().max()) > 1e-2 and float((base - first).abs().max()) > 1e-2


def test_dropout_in_train_mode_draws_peft_s_masks() -> None:
    model = _model(dropout=0.3)
    model.train()
    torch.manual_seed(5)
    ours = model(input_ids=IDS).logits
    torch.manual_seed(5)
    again = model(input_ids=IDS).logits
    _peft_forward(model)
    torch.manual_seed(5)
    peft = model(input_ids=IDS).logits
    torch.testing.assert_close(ours, again, rtol=0, atol=0)
    torch.testing.assert_close(ours, peft, rtol=0, atol=1e-5)
    model.eval()
    assert float((model(input_ids=IDS).logits - peft).abs().max()) > 1e-3  # dropout did act in train mode


def test_what_it_does_not_handle_goes_to_peft_mixed_batches_and_merged_adapters() -> None:
    model = _model()
    with torch.no_grad():
        plain = model(input_ids=IDS).logits
        with model.disable_adapter():
            base = model(input_ids=IDS).logits
        mixed = model(input_ids=IDS, adapter_names=["default", NO_ADAPTER, "default"]).logits  # PEFT's own
        torch.testing.assert_close(mixed[[0, 2]], plain[[0, 2]], rtol=0, atol=1e-5)
        torch.testing.assert_close(mixed[1], base[1], rtol=0, atol=1e-5)
        model.merge_adapter()
        torch.testing.assert_close(model(input_ids=IDS).logits, plain, rtol=0, atol=1e-4)
        model.unmerge_adapter()
        torch.testing.assert_close(model(input_ids=IDS).logits, plain, rtol=0, atol=1e-4)


@pytest.mark.parametrize("autocast", [False, True])
def test_adapter_blocks_run_each_block_of_rows_through_its_adapter(autocast: bool) -> None:
    model = _model()
    model.add_adapter("other", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B.other" in n:
                torch.nn.init.normal_(p, std=0.3)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with torch.no_grad(), ctx:
        policy = model(input_ids=IDS).logits
        with model.disable_adapter():
            base = model(input_ids=IDS).logits
        model.set_adapter("other")
        other = model(input_ids=IDS).logits
        model.set_adapter("default")
        with adapter_blocks(model, ["default", NO_ADAPTER, "other"]):
            joined = model(input_ids=IDS.repeat(3, 1)).logits
        after = model(input_ids=IDS).logits
    tol = 0.03 * float(policy.float().abs().max()) if autocast else 1e-5
    n = IDS.shape[0]
    for j, want in enumerate((policy, base, other)):
        assert float((joined[j * n : (j + 1) * n].float() - want.float()).abs().max()) <= tol, j
    torch.testing.assert_close(after, policy, rtol=0, atol=0)  # the plain forward is back
