"""Shared fixtures: small models the project builds itself (no model hub is reachable)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
# Built models are cached between local runs (the folder is git-ignored); CI builds them once per run.
MODEL_CACHE = Path(os.environ.get("PROXIMA_TEST_MODELS", REPO / ".cache" / "models"))


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
    from trainer.tiny_arith import build_tokenizer

    return save_random_llama(tmp_path_factory.mktemp("random-llama"), build_tokenizer())


@pytest.fixture(scope="session")
def random_calc_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised 2-layer Llama with tiny-calc's tokenizer and chat template (Hermes tool calls)."""
    from trainer.tiny_calc import build_tokenizer

    return save_random_llama(tmp_path_factory.mktemp("random-calc"), build_tokenizer(), max_positions=128)


@pytest.fixture(scope="session")
def arithmetic_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trainer.tiny_arith import write_arithmetic_datasets

    out = tmp_path_factory.mktemp("arith-data")
    write_arithmetic_datasets(out)
    return out


@pytest.fixture(scope="session")
def tiny_arith_dir() -> Path:
    """The real tiny-arith base model (built once, about three minutes on 2 cores, then cached)."""
    from trainer.tiny_arith import build_tiny_arith

    return build_tiny_arith(MODEL_CACHE / "tiny-arith")


@pytest.fixture(scope="session")
def tiny_calc_dir() -> Path:
    """The real tiny-calc base model, the agent task's (built once, under two minutes on 2 cores, then cached)."""
    from trainer.tiny_calc import build_tiny_calc

    return build_tiny_calc(MODEL_CACHE / "tiny-calc")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build tiny-arith and tiny-calc once before the tests run when any collected test needs them: outside every
    test's timeout (pytest-timeout counts fixture set-up against the first test that asks, and a build takes minutes
    on two shared cores), and a no-op when the cache already holds them."""
    needed = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    if "tiny_arith_dir" in needed:
        from trainer.tiny_arith import build_tiny_arith

        build_tiny_arith(MODEL_CACHE / "tiny-arith")
    if "tiny_calc_dir" in needed:
        from trainer.tiny_calc import build_tiny_calc

        build_tiny_calc(MODEL_CACHE / "tiny-calc")
