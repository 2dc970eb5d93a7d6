"""LoRA plumbing: the reference is the base with the adapter disabled; the merged sampler equals the policy."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from trainer.generation.models import (
    MergedSampler,
    add_lora,
    load_base_model,
    reference_policy,
    resolve_precision,
    store_frozen_linears_in,
)
from trainer.spec.lora import LoraSpec


@pytest.fixture()
def policy_and_copy(random_model_dir: Path) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    base = load_base_model(str(random_model_dir), torch.device("cpu"))
    pristine = copy.deepcopy(base)
    base_copy = copy.deepcopy(base)
    policy = add_lora(base, LoraSpec(r=4, alpha=8), seed=0)
    return policy, base_copy, pristine


def _randomise_lora_b(policy: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


IDS = torch.tensor([[3, 4, 5, 6, 7, 8]])


def test_fresh_adapter_equals_base_and_disabled_adapter_is_the_base_bit_for_bit(policy_and_copy) -> None:
    policy, _, pristine = policy_and_copy
    with torch.no_grad():
        base_logits = pristine(IDS).logits
        assert torch.equal(policy(IDS).logits, base_logits)  # B = 0 at init
        _randomise_lora_b(policy, 0)
        assert not torch.allclose(policy(IDS).logits, base_logits)
        with reference_policy(policy):
            assert torch.equal(policy(IDS).logits, base_logits)
        assert not torch.allclose(policy(IDS).logits, base_logits)  # the adapter is back after the context


def test_merged_sampler_matches_the_policy_and_follows_its_updates(policy_and_copy) -> None:
    policy, base_copy, _ = policy_and_copy
    assert MergedSampler.supported(policy)
    sampler = MergedSampler(base_copy, policy, torch.float32)
    _randomise_lora_b(policy, 1)
    with torch.no_grad():
        torch.testing.assert_close(sampler.sync()(IDS).logits, policy(IDS).logits, rtol=0, atol=1e-5)
        _randomise_lora_b(policy, 2)
        stale = sampler.sync()(IDS).logits  # not marked stale: still the previous weights
        assert not torch.allclose(stale, policy(IDS).logits, atol=1e-4)
        sampler.stale = True
        torch.testing.assert_close(sampler.sync()(IDS).logits, policy(IDS).logits, rtol=0, atol=1e-5)
    assert not any(p.requires_grad for p in sampler.model.parameters())


def test_bf16_merged_sampler_stays_close_to_the_autocast_policy(policy_and_copy) -> None:
    policy, base_copy, _ = policy_and_copy
    sampler = MergedSampler(base_copy, policy, torch.bfloat16)
    _randomise_lora_b(policy, 3)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.log_softmax(policy(IDS).logits.float(), -1)
    with torch.no_grad():
        got = torch.log_softmax(sampler.sync()(IDS).logits.float(), -1)
    assert sampler.model.lm_head.weight.dtype == torch.bfloat16
    assert (got - ref).abs().max() < 0.1  # bf16 round-off of merged vs separate LoRA paths


def test_precision_auto_resolves_to_a_supported_mode() -> None:
    assert resolve_precision("fp32", torch.device("cpu")) == "fp32"
    assert resolve_precision("auto", torch.device("cpu")) in ("fp32", "bf16")


def test_frozen_linears_in_bf16_give_the_same_autocast_logits_and_fp32_lora(random_model_dir: Path) -> None:
    a = load_base_model(str(random_model_dir), torch.device("cpu"))
    b = copy.deepcopy(a)
    n = store_frozen_linears_in(b, torch.bfloat16)
    assert n == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the untied lm_head
    assert b.get_input_embeddings().weight.dtype == torch.float32
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(a(IDS).logits, b(IDS).logits)
    policy = add_lora(b, LoraSpec(r=4, alpha=8), seed=0)
    assert all(p.dtype == torch.float32 for p in policy.parameters() if p.requires_grad)


def test_training_on_cuda_switches_cudnn_attention_off_and_the_cpu_leaves_it() -> None:
    """cuDNN's SDPA backward gives NaN on the fully masked query rows of left padding (an H200 run: NaN gradients
    from the second step): a CUDA training process turns that kernel off; a CPU one leaves the flag alone."""
    from trainer.generation.models import no_cudnn_attention

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        no_cudnn_attention(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        no_cudnn_attention(torch.device("cuda"))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
