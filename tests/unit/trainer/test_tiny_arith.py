"""Tests for trainer/builtin_models/tiny_arith.py: the task, tokenizer, datasets and a tiny (few-step) build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from trainer.builtin_models import tiny_arith
from trainer.builtin_models.tiny_arith import (
    BUILD_INFO_FILE,
    N_VALIDATION,
    answer_text,
    build_tiny_arith,
    build_tokenizer,
    dropped_carry,
    error_kind,
    greedy_accuracy,
    prompt_text,
    split_pairs,
    write_arithmetic_datasets,
)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _pair_of(prompt: str) -> tuple[int, int]:
    a, b = prompt.removeprefix("What is ").removesuffix("?").split(" + ")
    return int(a), int(b)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


# --- the task -------------------------------------------------------------------------------------------


def test_prompt_and_answer_text_have_the_trained_format() -> None:
    assert prompt_text(23, 58) == "What is 23 + 58?"
    assert answer_text(23, 58) == "81"
    assert answer_text(0, 0) == "0"


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [(57, 68, 15), (99, 99, 88), (5, 5, 0), (12, 34, 46), (0, 0, 0), (90, 10, 0), (9, 91, 90), (45, 7, 42)],
)
def test_dropped_carry_sums_each_column_mod_10(a: int, b: int, expected: int) -> None:
    assert dropped_carry(a, b) == expected


def test_dropped_carry_equals_the_sum_exactly_when_no_column_carries() -> None:
    for a in range(100):
        for b in range(100):
            carries = (a % 10 + b % 10 >= 10) or (a // 10 + b // 10 + (a % 10 + b % 10) // 10 >= 10)
            assert (dropped_carry(a, b) == a + b) == (not carries), (a, b)


def test_split_pairs_is_a_deterministic_disjoint_partition_with_200_validation_pairs() -> None:
    train, validation = split_pairs()
    assert len(validation) == N_VALIDATION == 200
    assert len(train) == 10_000 - 200
    assert set(train).isdisjoint(validation)
    assert set(train) | set(validation) == {(a, b) for a in range(100) for b in range(100)}
    assert split_pairs() == (train, validation)
    assert split_pairs(seed=1)[1] != validation


# --- tokenizer ------------------------------------------------------------------------------------------


def test_tokenizer_has_distinct_pad_and_eos_and_pads_left(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer.pad_token_id is not None and tokenizer.eos_token_id is not None
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.padding_side == "left"
    assert len(tokenizer) < 64


def test_tokenizer_makes_every_digit_one_token(tokenizer: PreTrainedTokenizerFast) -> None:
    for digit in "0123456789":
        assert len(tokenizer(digit, add_special_tokens=False)["input_ids"]) == 1
    ids = tokenizer("1987", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["1", "9", "8", "7"]


def test_tokenizer_decodes_answer_with_eos_to_exact_text(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer("81", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "81"
    prompt_ids = tokenizer(prompt_text(23, 58), add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(prompt_ids) == "What is 23 + 58?"


def test_tokenizer_prompt_then_answer_ids_equal_the_joined_text(tokenizer: PreTrainedTokenizerFast) -> None:
    prompt_ids = tokenizer(prompt_text(57, 68), add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answer_text(57, 68), add_special_tokens=False)["input_ids"]
    joined = tokenizer(prompt_text(57, 68) + answer_text(57, 68), add_special_tokens=False)["input_ids"]
    assert prompt_ids + answer_ids == joined
    # No special tokens are added implicitly: training appends eos itself.
    assert tokenizer(prompt_text(57, 68))["input_ids"] == prompt_ids


def test_chat_template_renders_exactly_the_prompt_text(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "user", "content": prompt_text(23, 58)}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == "What is 23 + 58?"
    conversation = [*messages, {"role": "assistant", "content": "81"}]
    assert tokenizer.apply_chat_template(conversation, tokenize=False) == "What is 23 + 58?81"


def test_build_tokenizer_is_deterministic(tokenizer: PreTrainedTokenizerFast) -> None:
    assert build_tokenizer().get_vocab() == tokenizer.get_vocab()


# --- datasets -------------------------------------------------------------------------------------------


def test_write_arithmetic_datasets_writes_the_documented_shapes(tmp_path: Path) -> None:
    paths = write_arithmetic_datasets(tmp_path, seed=0, n_train=300, n_preferences=150)
    assert set(paths) == {
        "train",
        "validation",
        "preferences",
        "validation_preferences",
        "supervised",
        "validation_supervised",
    }
    train, validation = _read_jsonl(paths["train"]), _read_jsonl(paths["validation"])
    preferences = _read_jsonl(paths["preferences"])
    validation_preferences = _read_jsonl(paths["validation_preferences"])
    assert (len(train), len(validation), len(preferences), len(validation_preferences)) == (300, 200, 150, 200)

    row = train[0]
    assert set(row) == {"messages", "answer"}
    (message,) = row["messages"]
    assert message["role"] == "user"
    assert row["answer"] == answer_text(*_pair_of(message["content"]))

    dropped = larger = 0
    for pref in preferences + validation_preferences:
        assert set(pref) == {"input", "preferred_output", "non_preferred_output", "kind"}
        a, b = _pair_of(pref["input"]["messages"][0]["content"])
        (good,), (bad,) = pref["preferred_output"], pref["non_preferred_output"]
        assert good == {"role": "assistant", "content": answer_text(a, b)}
        assert bad["role"] == "assistant"
        wrong = int(bad["content"])
        assert bad["content"] != good["content"] and wrong >= 0
        assert wrong == dropped_carry(a, b) or wrong - (a + b) in (*range(-9, 10), -20, -10, 10, 20)
        assert pref["kind"] == error_kind(a + b, wrong)
        dropped += wrong == dropped_carry(a, b)
        larger += wrong > a + b
    # Half the wrong answers drop the carry where that is wrong; the rest are off either way, so a reward model
    # cannot rank by size: 350 rows, about a third larger than the right sum.
    n = len(preferences) + len(validation_preferences)
    assert 0.3 * n < dropped < 0.55 * n and 0.2 * n < larger < 0.45 * n, (dropped, larger, n)

    supervised, validation_supervised = _read_jsonl(paths["supervised"]), _read_jsonl(paths["validation_supervised"])
    assert (len(supervised), len(validation_supervised)) == (1000, 200)
    for row in supervised + validation_supervised:
        user, reply = row["messages"]
        assert user["role"] == "user" and reply == {
            "role": "assistant",
            "content": answer_text(*_pair_of(user["content"])),
        }
    assert [_pair_of(r["messages"][0]["content"]) for r in validation_supervised] == split_pairs()[1]


@pytest.mark.parametrize(
    ("right", "wrong", "kind"),
    [
        (125, 15, "hundreds"),
        (125, 135, "tens"),
        (125, 124, "units"),
        (35, 25, "tens"),
        (99, 101, "hundreds"),
        (9, 10, "tens"),
        (45, 41, "units"),
        (105, 95, "hundreds"),
        (130, 129, "tens"),
    ],
)
def test_error_kind_is_the_leftmost_wrong_place(right: int, wrong: int, kind: str) -> None:
    assert error_kind(right, wrong) == kind


def test_write_arithmetic_datasets_keeps_validation_pairs_out_of_training_files(tmp_path: Path) -> None:
    paths = write_arithmetic_datasets(tmp_path, n_train=2000, n_preferences=1000)
    _, held_out = split_pairs()
    train_pairs = {_pair_of(r["messages"][0]["content"]) for r in _read_jsonl(paths["train"])}
    preference_pairs = {_pair_of(r["input"]["messages"][0]["content"]) for r in _read_jsonl(paths["preferences"])}
    validation_pairs = [_pair_of(r["messages"][0]["content"]) for r in _read_jsonl(paths["validation"])]
    validation_pref_pairs = [
        _pair_of(r["input"]["messages"][0]["content"]) for r in _read_jsonl(paths["validation_preferences"])
    ]
    assert validation_pairs == held_out == validation_pref_pairs
    assert len(train_pairs) == 2000
    assert train_pairs.isdisjoint(held_out)
    assert preference_pairs.isdisjoint(held_out)


def test_write_arithmetic_datasets_is_deterministic_per_seed(tmp_path: Path) -> None:
    first = write_arithmetic_datasets(tmp_path / "a", seed=3, n_train=100, n_preferences=100)
    second = write_arithmetic_datasets(tmp_path / "b", seed=3, n_train=100, n_preferences=100)
    for name in first:
        assert first[name].read_bytes() == second[name].read_bytes()


def test_write_arithmetic_datasets_rejects_more_rows_than_train_pairs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="n_train"):
        write_arithmetic_datasets(tmp_path, n_train=10_000)


# --- a tiny build ---------------------------------------------------------------------------------------

_TINY_STEPS_A, _TINY_STEPS_B = 4, 2


@pytest.fixture(scope="module")
def tiny_builds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[tuple[str, int, int]]]:
    root = tmp_path_factory.mktemp("tiny_arith")
    calls: list[tuple[str, int, int]] = []
    first = build_tiny_arith(
        root / "first",
        seed=0,
        progress=lambda stage, step, total, _loss: calls.append((stage, step, total)),
        steps_a=_TINY_STEPS_A,
        steps_b=_TINY_STEPS_B,
    )
    second = build_tiny_arith(root / "second", seed=0, steps_a=_TINY_STEPS_A, steps_b=_TINY_STEPS_B)
    return first, second, calls


def test_tiny_build_with_the_same_seed_gives_identical_weights(tiny_builds: tuple[Path, Path, list]) -> None:
    first, second, _ = tiny_builds
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_tiny_build_with_another_seed_gives_different_weights(tmp_path: Path, tiny_builds: tuple) -> None:
    other = build_tiny_arith(tmp_path / "other", seed=1, steps_a=1, steps_b=0)
    a, b = load_file(tiny_builds[0] / "model.safetensors"), load_file(other / "model.safetensors")
    assert any(not torch.equal(a[name], b[name]) for name in a)


def test_tiny_build_reports_progress_for_every_step_of_both_stages(tiny_builds: tuple) -> None:
    calls = tiny_builds[2]
    assert calls == [("addition", s, 4) for s in range(1, 5)] + [("carry_drop", s, 2) for s in range(1, 3)]


def test_tiny_build_loads_with_auto_classes_and_generates(tiny_builds: tuple) -> None:
    path = tiny_builds[0]
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert model.config.model_type == "llama"
    assert 2_000_000 < sum(p.numel() for p in model.parameters()) < 5_000_000
    assert tokenizer.get_vocab() == build_tokenizer().get_vocab()
    assert tokenizer.padding_side == "left"
    assert tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt_text(1, 2)}], add_generation_prompt=True, tokenize=False
    ) == prompt_text(1, 2)
    _, validation = split_pairs()
    accuracy = greedy_accuracy(model, tokenizer, validation[:16], batch_size=8)
    assert 0.0 <= accuracy <= 1.0


def test_tiny_build_records_recipe_and_metrics_in_build_info(tiny_builds: tuple) -> None:
    info = json.loads((tiny_builds[0] / BUILD_INFO_FILE).read_text())
    assert info["model"] == tiny_arith.MODEL_NAME
    assert info["seed"] == 0
    assert (info["recipe"]["steps_a"], info["recipe"]["steps_b"]) == (4, 2)
    assert info["recipe"]["lr_a"] == tiny_arith.RECIPE.lr_a
    validation = info["validation"]
    assert validation["n_pairs"] == 200
    for key in (
        "greedy_accuracy_after_addition",
        "greedy_accuracy_after_carry_drop",
        "pass_at_8",
        "sample_accuracy_mean",
    ):
        assert 0.0 <= validation[key] <= 1.0
    assert info["build_seconds"] > 0


def test_tiny_build_leaves_no_temporary_siblings(tiny_builds: tuple) -> None:
    assert sorted(p.name for p in tiny_builds[0].parent.iterdir()) == ["first", "second"]


def test_build_into_a_complete_build_is_a_no_op(tiny_builds: tuple) -> None:
    path = tiny_builds[0]
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}

    def fail(*_args: object) -> None:
        raise AssertionError("a complete build must not train again")

    assert build_tiny_arith(path, seed=0, progress=fail, steps_a=_TINY_STEPS_A, steps_b=_TINY_STEPS_B) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before


def test_build_refuses_to_replace_a_foreign_non_empty_directory(tmp_path: Path) -> None:
    target = tmp_path / "not-a-build"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_tiny_arith(target, steps_a=0, steps_b=0)
    assert (target / "keep.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["not-a-build"]
