"""Tiny random models for the trainer's unit tests (``model``: a Llama with grouped-query attention; ``gpt2``: absolute
positions; ``any_model``: each in turn)."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB = 32
PAD = 0
EOS = 1


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.2,  # peaked next-token distributions: greedy choices are not near-ties
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def gpt2() -> GPT2LMHeadModel:
    """Absolute position embeddings: wrong position ids under left padding change its outputs (RoPE hides them)."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=2,
        initializer_range=0.2,
    )
    return GPT2LMHeadModel(config).eval()


@pytest.fixture(params=["llama", "gpt2"])
def any_model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return request.getfixturevalue("model" if request.param == "llama" else "gpt2")
