"""Progress of long steps (a model's build, a stage of the demo) that works in a terminal and reads well in a log.

In a terminal it is rich's live bar. Anywhere else (CI, ``make demo > demo.log``, a container's log) a live bar
renders nothing until it ends, which is minutes of silence: there it prints a plain line when a stage starts, at
every tenth of it and when it ends, each with the step, the loss and the time so far. No torch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

ProgressFn = Callable[[str, int, int, float], None]
"""``progress(stage, step, total, loss)``, called after every step of a stage."""

LOG_LINES_PER_STAGE = 10


@contextlib.contextmanager
def stage_progress(console: Console, *, log_lines: int = LOG_LINES_PER_STAGE) -> Iterator[ProgressFn]:
    """A :data:`ProgressFn` for the ``with`` block: a live bar per stage in a terminal, else ``log_lines`` lines per
    stage (and its first and last step)."""
    if console.is_terminal:
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("loss {task.fields[loss]:.3f}"),
        )
        with Progress(*columns, console=console) as bars:
            tasks: dict[str, Any] = {}

            def live(stage: str, step: int, total: int, loss: float) -> None:
                if stage not in tasks:
                    tasks[stage] = bars.add_task(stage, total=total, loss=loss)
                bars.update(tasks[stage], completed=step, loss=loss)

            yield live
        return
    started: dict[str, float] = {}

    def lines(stage: str, step: int, total: int, loss: float) -> None:
        first = stage not in started
        started.setdefault(stage, time.monotonic())
        every = max(1, total // max(1, log_lines))
        if first or step == total or step % every == 0:
            elapsed = time.monotonic() - started[stage]
            console.print(f"  {stage}: step {step}/{total}  loss {loss:.3f}  {elapsed:.0f} s", highlight=False)

    yield lines
