"""worker.validation's tokeniser check: a line the model's chat template cannot render without dropping a field fails
as ``invalid_file`` naming the file, line and field, without the advice about lengths that a too-long line gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.spec.config import parse_spec
from worker.errors import JobError
from worker.validation import _check_lengths

QUESTION = {"role": "user", "content": "What is 2 + 3?"}
TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("line", "detail"),
    [
        (
            {"messages": [QUESTION, {"role": "assistant", "content": "5"}], "tools": [TOOL]},
            "tools: the model's chat template does not render tools, so the model would never see them",
        ),
        (
            {"messages": [QUESTION, {"role": "assistant", "content": "5" * 40}]},
            "the conversation is 51 tokens, more than max_length = 32; shorten it or raise max_length (at most the "
            "model's context)",
        ),
    ],
)
def test_a_line_the_template_drops_a_field_of_is_invalid_file_without_length_advice(
    tiny_arith_dir: Path, tmp_path: Path, line: dict[str, object], detail: str
) -> None:
    good = {"messages": [QUESTION, {"role": "assistant", "content": "5"}]}
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(line) + "\n")
    spec = parse_spec(
        {"model": str(tiny_arith_dir), "training_file": str(path), "method": {"type": "supervised", "supervised": {}}}
    )
    with pytest.raises(JobError) as err:
        _check_lengths(tiny_arith_dir, spec, [("training", "training_file", "file-abc", path)], 32)
    assert err.value.code == "invalid_file" and err.value.param == "training_file"
    assert err.value.message == f"training file file-abc, line 2: {detail}"
