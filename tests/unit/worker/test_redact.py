"""worker.redact: a job's events and errors name what the user knows (the model's name, the file's id), never the
worker's local paths."""

from __future__ import annotations

from worker.redact import Redactor

HOME = "/srv/proxima"
MODEL = f"{HOME}/models/tiny-arith"
TRAIN = f"{HOME}/runs/ftjob-abc-x1/data/train.jsonl"

redactor = Redactor({MODEL: "tiny-arith", TRAIN: "file-123", "/data/models/mine": "/data/models/mine"})


def test_a_local_path_becomes_the_name_the_user_gave() -> None:
    assert redactor.text(f"training grpo on {MODEL} for 6 steps") == "training grpo on tiny-arith for 6 steps"
    assert redactor.text(f"cannot load model '{MODEL}': bad config") == "cannot load model 'tiny-arith': bad config"
    assert redactor.text(f"{TRAIN}:3: no prompt") == "file-123:3: no prompt"


def test_a_path_inside_a_named_folder_keeps_its_part_below_it() -> None:
    assert redactor.text(f"missing {MODEL}/config.json") == "missing tiny-arith/config.json"
    assert redactor.text(f"{MODEL}-v2 is a sibling") == "tiny-arith-v2 is a sibling"  # not inside: its last component


def test_any_other_absolute_path_is_cut_to_its_last_component() -> None:
    text = f"No such file or directory: '{HOME}/runs/ftjob-abc-x1/checkpoints/step-000003/trainer_state.pt'"
    assert redactor.text(text) == "No such file or directory: 'trainer_state.pt'"
    assert redactor.text("in /usr/lib/python3.11/site-packages/torch/optim/adam.py line 3") == "in adam.py line 3"


def test_a_path_the_user_gave_stays_and_text_that_is_not_a_path_is_left_alone() -> None:
    assert redactor.text("training on /data/models/mine for 2 steps") == "training on /data/models/mine for 2 steps"
    for text in ("1/2/3 of the steps", "ratio a/b", "see https://example.com/a/b", "~/x/y relative", "/root"):
        assert redactor.text(text) == text


def test_event_data_is_redacted_wherever_a_string_is() -> None:
    data = {"model": MODEL, "steps": 6, "nested": [{"path": TRAIN}, 1.5, None]}
    assert redactor.value(data) == {"model": "tiny-arith", "steps": 6, "nested": [{"path": "file-123"}, 1.5, None]}
