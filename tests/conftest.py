"""Shared fixtures: small models the project builds itself (no model hub is reachable)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import built_models
from tests.built_models import MODELS


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
    """The real tiny-arith base model (built once, in the background: tests/built_models.py; then cached)."""
    return built_models.built("tiny-arith")


@pytest.fixture(scope="session")
def tiny_calc_dir() -> Path:
    """The real tiny-calc base model, the agent task's (built once, in the background; then cached)."""
    return built_models.built("tiny-calc")


def _needs_model(item: pytest.Item) -> bool:
    return any(name in MODELS for name in getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The test files that need a built model run last (in their order), so the background build overlaps the
    others; their tests may wait for it (the build, minutes on two shared cores, counts against pytest-timeout's
    limit of the first test that asks): their limit is the wait's. Whole files move, so pytest-xdist's
    ``--dist loadfile`` keeps each file on one worker."""
    later = {item.path for item in items if _needs_model(item)}
    items[:] = [i for i in items if i.path not in later] + [i for i in items if i.path in later]
    for item in items:
        if _needs_model(item):
            item.add_marker(pytest.mark.timeout(built_models.BUILD_WAIT_TIMEOUT_S))


_build: subprocess.Popen[bytes] | None = None


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building tiny-arith and tiny-calc in the background when a collected test needs them (a no-op when
    the cache holds them). Under pytest-xdist the first worker starts it; every worker's fixture waits on the
    models' locks."""
    global _build
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return
    needed = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    names = [model for fixture, model in MODELS.items() if fixture in needed]
    if names:
        _build = built_models.start_background_build(names)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The background build is waited for when the run went its course (another worker's tests may need it), ended
    when the run is stopping (interrupted, ``-x``)."""
    if _build is not None:
        stopping = bool(session.shouldstop or session.shouldfail) or exitstatus == pytest.ExitCode.INTERRUPTED
        built_models.stop(_build, wait=not stopping)
