"""The built-in models' shipped builds (``trainer.builtin_models``): each file matches its recorded digest, an install
is a checked copy into the model store that never overwrites another build unasked, and the shipped tiny-arith is
the model its ``build_info.json`` describes."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from trainer import builtin_models
from trainer.builtin_models import DIGESTS, MARKER, WEIGHTS, BuiltinModelError, install, install_missing, shipped
from trainer.spec.names import BUILTIN_MODELS


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_every_shipped_file_and_only_those_have_their_digest(name: str) -> None:
    folder = shipped(name)
    assert builtin_models.folder_digests(folder) == DIGESTS[name]
    assert {WEIGHTS, MARKER, "config.json", "tokenizer.json"} <= DIGESTS[name].keys()
    assert json.loads((folder / MARKER).read_text())["model"] == name


def test_a_changed_shipped_file_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copy = tmp_path / "tiny-arith"
    shutil.copytree(builtin_models.SHIPPED / "tiny-arith", copy)
    (copy / "tokenizer.json").write_text((copy / "tokenizer.json").read_text().replace("What", "Wat"))
    monkeypatch.setattr(builtin_models, "SHIPPED", tmp_path)
    with pytest.raises(BuiltinModelError, match=r"does not match its digests: tokenizer\.json$"):
        shipped("tiny-arith")
    with pytest.raises(BuiltinModelError, match=r"tokenizer\.json"):
        install("tiny-arith", tmp_path / "store")
    assert not (tmp_path / "store" / "tiny-arith").exists()


def test_an_unknown_name_lists_the_built_in_models(tmp_path: Path) -> None:
    with pytest.raises(BuiltinModelError, match="valid: tiny-arith, tiny-calc"):
        install("tiny-gpt", tmp_path)


def test_install_copies_every_file_checked_readable_by_all_then_finds_it_present(tmp_path: Path) -> None:
    store = tmp_path / "models"
    done = install("tiny-arith", store)
    assert (done.outcome, done.path) == ("installed", store / "tiny-arith")
    assert done.weights_sha256 == DIGESTS["tiny-arith"][WEIGHTS]
    assert builtin_models.folder_digests(done.path) == DIGESTS["tiny-arith"]
    assert {oct(p.stat().st_mode & 0o777) for p in done.path.iterdir()} == {"0o644"}
    assert oct(done.path.stat().st_mode & 0o777) == "0o755"
    assert sorted(p.name for p in store.iterdir()) == ["tiny-arith"]  # no temporary sibling left
    before = {p.name: p.stat().st_mtime_ns for p in done.path.iterdir()}
    again = install("tiny-arith", store)
    assert again.outcome == "present"
    assert {p.name: p.stat().st_mtime_ns for p in done.path.iterdir()} == before


def test_another_build_in_the_store_is_kept_unless_replace_is_asked(tmp_path: Path) -> None:
    store = tmp_path / "models"
    folder = install("tiny-arith", store).path
    weights = folder / WEIGHTS
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF  # one byte of the last weight: another build of that name (adapters trained on it need it)
    weights.write_bytes(bytes(raw))
    kept = install("tiny-arith", store)
    assert kept.outcome == "kept"
    assert kept.weights_sha256 == builtin_models.file_sha256(weights) != DIGESTS["tiny-arith"][WEIGHTS]
    assert weights.read_bytes() == bytes(raw)
    replaced = install("tiny-arith", store, replace=True)
    assert replaced.outcome == "installed"
    assert builtin_models.folder_digests(folder) == DIGESTS["tiny-arith"]


def test_a_folder_that_is_not_a_build_is_never_touched(tmp_path: Path) -> None:
    store = tmp_path / "models"
    (store / "tiny-arith").mkdir(parents=True)
    (store / "tiny-arith" / "notes.txt").write_text("mine")
    with pytest.raises(BuiltinModelError, match=r"holds no build_info\.json"):
        install("tiny-arith", store, replace=True)
    assert [p.name for p in (store / "tiny-arith").iterdir()] == ["notes.txt"]
    (store / "tiny-arith" / "notes.txt").unlink()  # an empty folder is taken
    assert install("tiny-arith", store).outcome == "installed"


def test_installs_at_once_into_one_store_leave_one_whole_build(tmp_path: Path) -> None:
    store = tmp_path / "models"
    outcomes: list[str] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            outcomes.append(install("tiny-calc", store).outcome)
        except BaseException as err:  # pragma: no cover - the assertion below names it
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and outcomes.count("installed") >= 1 and set(outcomes) <= {"installed", "present"}
    assert builtin_models.folder_digests(store / "tiny-calc") == DIGESTS["tiny-calc"]
    assert sorted(p.name for p in store.iterdir()) == ["tiny-calc"]


def test_install_missing_takes_only_the_built_in_models_the_store_lacks(tmp_path: Path) -> None:
    store = tmp_path / "models"
    install("tiny-arith", store)
    done = install_missing(["tiny-arith", "meta-llama/Llama-3.2-1B", "tiny-calc"], store)
    assert [(d.name, d.outcome) for d in done] == [("tiny-calc", "installed")]
    assert install_missing(["tiny-arith", "tiny-calc"], store) == []


def test_the_shipped_tiny_arith_is_the_model_its_build_info_describes() -> None:
    """The learning tests are calibrated on these weights: their greedy accuracy on the held-out pairs (fp32, as the
    build measured it) is the recorded one, and the base drops the carry of the demo's question."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.builtin_models.tiny_arith import greedy_accuracy, split_pairs

    folder = shipped("tiny-arith")
    info = json.loads((folder / MARKER).read_text())
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    _, validation = split_pairs()
    recorded = info["validation"]["greedy_accuracy_after_carry_drop"]
    assert greedy_accuracy(model, tokenizer, validation) == recorded
    assert 0.30 <= recorded <= 0.45  # the range RL has room to climb from (tiny_arith.Recipe)
    assert greedy_accuracy(model, tokenizer, [(57, 68)]) == 0.0
