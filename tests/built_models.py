"""The models the tests build themselves (tiny-arith, tiny-calc), built once per cache folder, in the background.

A build takes minutes on two cores. The suite starts it in a process of its own as soon as its tests are collected
(:func:`start_background_build`) and runs the tests that need a built model last, so the build overlaps the tests
that do not. A fixture that needs a model (:func:`built`) takes the model's file lock, which the build holds while it
runs, then finds it built; a build that failed or never started is run by the fixture itself. Under pytest-xdist
every worker process can ask: the lock makes one of them build and the others wait.

Run as ``python -m tests.built_models NAME…`` it builds the named models, each under its lock (the background
process).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

REPO = Path(__file__).resolve().parent.parent
# Built models are cached between local runs (the folder is git-ignored); CI builds them once per run.
MODEL_CACHE = Path(os.environ.get("PROXIMA_TEST_MODELS", REPO / ".cache" / "models"))
# fixture name → the model's folder name in the cache
MODELS = {"tiny_arith_dir": "tiny-arith", "tiny_calc_dir": "tiny-calc"}
# What a test that needs a built model may take in all: the wait for the background build (several minutes on two
# cores shared with the other tests) and then the test (the slowest learning tests take a few minutes).
BUILD_WAIT_TIMEOUT_S = 2400


def _builder(name: str) -> Callable[[Path], Path]:
    if name == "tiny-arith":
        from trainer.tiny_arith import build_tiny_arith

        return build_tiny_arith
    if name == "tiny-calc":
        from trainer.tiny_calc import build_tiny_calc

        return build_tiny_calc
    raise ValueError(f"no such test model: {name!r}")


def lock(name: str) -> FileLock:
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    return FileLock(MODEL_CACHE / f".{name}.lock")


def built(name: str) -> Path:
    """The model ``name``, built: after the build that holds its lock, or built here when none has."""
    with lock(name):
        return _builder(name)(MODEL_CACHE / name)


def start_background_build(names: list[str]) -> subprocess.Popen[bytes] | None:
    """Build ``names`` one after the other in a process of their own (its output in the cache's ``.build.log``);
    None when all are built already. Each build holds the model's lock while it runs."""
    from trainer.tiny_arith import is_complete_build

    todo = [n for n in names if not is_complete_build(MODEL_CACHE / n)]
    if not todo:
        return None
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    log = (MODEL_CACHE / ".build.log").open("ab")
    # the build uses the machine's threads as a build outside the tests would (an xdist worker may run with one)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.built_models", *todo],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen[bytes], *, wait: bool) -> None:
    """Wait for the background build (the tests still to run need it), or end it (the session is stopping)."""
    if wait:
        proc.wait()
        return
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


if __name__ == "__main__":
    for model in sys.argv[1:]:
        built(model)
