"""A job's trainer on several devices: ``python -m worker.launch N RUN_DIR`` runs ``python -m worker.runner RUN_DIR``
as N ranks under torch's elastic launcher (``torch.distributed.run``: one node, no restarts), one rank per device
(``trainer.generation.distributed``). The worker starts it instead of the runner when a job asks for ``resources.gpus``
> 1.

- The ranks inherit this process's standard streams: rank 0 talks to the worker as a lone trainer does (messages on
  stdout, the control channel on stdin); the other ranks send only their errors and never read stdin.
- It dies with its worker (``PR_SET_PDEATHSIG``, as the runner does), and its ranks die with it: they are told that
  this process is the parent to watch.
- When a rank fails, the launcher ends the others. A rank ended by a signal (SIGKILL: the out-of-memory killer, most
  often) is said in an event, and this process then ends itself by the same signal, so that the worker sees what it
  sees of a killed lone trainer: the attempt trains again from the latest checkpoint, once, before the job fails. A
  rank that failed with an error sent it, as a lone trainer does; the launcher then exits with code 1.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from worker import messages as msg
from worker.runner import Pipe, die_with_parent

LAUNCH_MODULE = "worker.launch"
MONITOR_INTERVAL_S = 0.5  # how often the launcher looks at its ranks


def main(ranks: int, run_dir: str) -> int:
    die_with_parent()
    os.environ[msg.PARENT_PID_ENV] = str(os.getpid())  # the ranks' parent is this process
    pipe = Pipe(os.fdopen(os.dup(1), "w", encoding="utf-8"))
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(
        [
            "--standalone",
            f"--nproc-per-node={ranks}",
            "--max-restarts=0",
            f"--monitor-interval={MONITOR_INTERVAL_S}",
            "--module",
            "worker.runner",
            run_dir,
        ]
    )
    try:
        run(args)
    except ChildFailedError as err:
        rank, exitcode = cause({r: f.exitcode for r, f in err.failures.items()})
        if exitcode < 0:
            sig = signal.Signals(-exitcode)
            pipe.send(
                msg.Event(
                    level="warn",
                    message=f"rank {rank} of the trainer's {ranks} was ended by {sig.name}; the others were stopped",
                    data={"rank": rank, "ranks": ranks, "signal": sig.name},
                )
            )
            sys.stderr.flush()
            with contextlib.suppress(OSError, ValueError):  # SIGKILL's cannot be set (nor caught)
                signal.signal(sig, signal.SIG_DFL)  # the elastic agent handles SIGTERM and others
            os.kill(os.getpid(), sig)
        return 1
    return 0


def cause(exitcodes: dict[int, int]) -> tuple[int, int]:
    """The rank whose end failed the others, and its exit code, from the failed ranks' exit codes (negative: the
    signal that ended it). A rank ended by a signal is the cause: the others failed in a collective because of it,
    or were still running when the launcher noticed and were ended by its SIGTERM, which it counts as failures too.
    So SIGKILL (the out-of-memory killer's, an operator's) comes first, then any other signal but SIGTERM (a crash:
    SIGSEGV, SIGABRT), then SIGTERM, then an error exit; the lowest rank among equals."""

    def order(item: tuple[int, int]) -> tuple[int, int]:
        rank, code = item
        if code >= 0:
            return (3, rank)
        return (0 if code == -signal.SIGKILL else 2 if code == -signal.SIGTERM else 1, rank)

    return min(exitcodes.items(), key=order)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: python -m worker.launch RANKS RUN_DIR", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(int(sys.argv[1]), sys.argv[2]))
