"""``trainer.spec.progress``: a live bar in a terminal, plain lines in a log (a tenth of a stage each)."""

from __future__ import annotations

import io

from rich.console import Console

from trainer.spec.progress import stage_progress


def run(console: Console) -> None:
    with stage_progress(console) as progress:
        for step in range(1, 101):
            progress("addition", step, 100, 1.0 / step)
        for step in range(1, 8):
            progress("carry_drop", step, 7, 0.5)


def test_in_a_log_each_stage_prints_its_first_step_every_tenth_and_its_last() -> None:
    out = io.StringIO()
    run(Console(file=out, force_terminal=False, width=200))
    lines = out.getvalue().splitlines()
    addition = [ln for ln in lines if ln.startswith("  addition:")]
    assert [ln.split()[2] for ln in addition] == ["1/100", *(f"{n}/100" for n in range(10, 101, 10))]
    assert addition[-1].startswith("  addition: step 100/100  loss 0.010  ")
    # a stage shorter than ten steps: every step
    assert [ln.split()[2] for ln in lines if ln.startswith("  carry_drop:")] == [f"{n}/7" for n in range(1, 8)]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_in_a_terminal_it_is_a_live_bar_per_stage_and_no_lines() -> None:
    out = io.StringIO()
    run(Console(file=out, force_terminal=True, width=120))
    text = out.getvalue()
    assert "addition" in text and "carry_drop" in text and "100/100" in text
    assert "  addition: step" not in text  # the bar, not the log's lines
