"""Shared fixtures: small models the project builds itself (no model hub is reachable)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.xdist_alone import pytest_runtest_protocol  # noqa: F401  (the hook that runs `alone` tests alone)

REPO = Path(__file__).resolve().parent.parent
# Built models are cached between local runs (the folder is git-ignored); CI builds them once per run.
MODEL_CACHE = Path(os.environ.get("PROXIMA_TEST_MODELS", REPO / ".cache" / "models"))


def built(name: str) -> Path:
    """The model ``name`` (tiny-arith, tiny-calc) from the cache, built first when missing. The build holds the
    model's file lock: under pytest-xdist one worker process builds and the others wait for it, then find it built."""
    from filelock import FileLock

    from trainer.tiny_arith import build_tiny_arith
    from trainer.tiny_calc import build_tiny_calc

    build = {"tiny-arith": build_tiny_arith, "tiny-calc": build_tiny_calc}[name]
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()  # `make test` runs two xdist workers of one thread each (see the Makefile)
    with FileLock(MODEL_CACHE / f".{name}.lock"):
        if os.environ.get("PYTEST_XDIST_WORKER"):  # a build has the machine to itself: every core
            torch.set_num_threads(len(os.sched_getaffinity(0)))
        try:
            return build(MODEL_CACHE / name)
        finally:
            torch.set_num_threads(threads)


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
    """The real tiny-arith base model (built once, about seven minutes on 2 cores, then cached)."""
    return built("tiny-arith")


@pytest.fixture(scope="session")
def tiny_calc_dir() -> Path:
    """The real tiny-calc base model, the agent task's (built once, about three minutes on 2 cores, then cached)."""
    return built("tiny-calc")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build tiny-arith and tiny-calc once before the tests run when any collected test needs them: outside every
    test's timeout (pytest-timeout counts fixture set-up against the first test that asks, and a build takes minutes
    on two shared cores), and a no-op when the cache already holds them. Under pytest-xdist every worker collects:
    the first to take a model's lock builds it with the machine to itself (the tests start once every worker has
    collected), the others find it built. A build beside the tests would share the cores with them: its two torch
    threads then wait on each other at every small op (measured on 2 cores: tiny-calc built in 1497 s beside two
    workers' tests, 165 s alone)."""
    needed = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    for fixture, model in (("tiny_arith_dir", "tiny-arith"), ("tiny_calc_dir", "tiny-calc")):
        if fixture in needed:
            built(model)
