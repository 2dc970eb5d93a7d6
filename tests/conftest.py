"""Shared fixtures: small models the project builds itself (no model hub is reachable)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.xdist_alone import pytest_runtest_protocol  # noqa: F401  (the hook that runs `alone` tests alone)

pytest_plugins = ("tests.budget",)  # the suite's time against its budget, printed at its end

REPO = Path(__file__).resolve().parent.parent


def built(name: str) -> Path:
    """The built-in model ``name`` (tiny-arith, tiny-calc): the project's shipped build, every file checked against
    its digest, the same weights on every machine (``trainer.builtin_models``). Read-only: a test that needs the
    model in a model store copies it there."""
    from trainer.builtin_models import shipped

    return shipped(name)


def save_random_llama(out: Path, tok: Any, *, max_positions: int = 64) -> Path:
    """A randomly initialised 2-layer Llama (seed 0) for ``tok``, saved with it to ``out``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok.save_pretrained(out)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=max_positions,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        LlamaForCausalLM(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised 2-layer Llama with the tiny-arith tokenizer: fast plumbing tests, no learning."""
    from trainer.builtin_models.tiny_arith import build_tokenizer

    return save_random_llama(tmp_path_factory.mktemp("random-llama"), build_tokenizer())


@pytest.fixture(scope="session")
def random_calc_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised 2-layer Llama with tiny-calc's tokenizer and chat template (Hermes tool calls)."""
    from trainer.builtin_models.tiny_calc import build_tokenizer

    return save_random_llama(tmp_path_factory.mktemp("random-calc"), build_tokenizer(), max_positions=128)


@pytest.fixture(scope="session")
def arithmetic_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trainer.builtin_models.tiny_arith import write_arithmetic_datasets

    out = tmp_path_factory.mktemp("arith-data")
    write_arithmetic_datasets(out)
    return out


@pytest.fixture(scope="session")
def tiny_arith_dir() -> Path:
    """The real tiny-arith base model, as shipped."""
    return built("tiny-arith")


@pytest.fixture(scope="session")
def tiny_calc_dir() -> Path:
    """The real tiny-calc base model, the agent task's, as shipped."""
    return built("tiny-calc")
