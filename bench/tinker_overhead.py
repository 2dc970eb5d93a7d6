"""The Tinker protocol's overhead: one ``forward_backward`` + ``optim_step`` through the official SDK, the
API, PostgreSQL and a worker's session process, against the same two calls on ``trainer.serving.tinker_session`` in this
process, on the small benchmark model (bench/common.py). Sides alternate; a round starts once the 1-minute load is
below ``--max-load`` (1.0; a round that cannot is tried again later) and the load is printed for each side.

    .venv/bin/python bench/tinker_overhead.py --rounds 5 --steps 10

Needs PostgreSQL on 127.0.0.1:5432 (a database of its own is created and dropped) and Redis on 6379.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psycopg2  # type: ignore[import-untyped]
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DEFAULT_WORKDIR, SETTLE_S, build_assets, loadavg, settle

DATUMS, LENGTH, RANK = 8, 64, 16


def batch(vocab: int, seed: int) -> list[tuple[list[int], list[int], list[float]]]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(DATUMS):
        tokens = rng.integers(3, vocab, LENGTH + 1).tolist()
        rows.append((tokens[:-1], tokens[1:], [1.0 / LENGTH] * LENGTH))
    return rows


def in_process(model_dir: Path, rows: list[Any], steps: int) -> list[float]:
    from trainer.serving.tinker_session import TrainingSession
    from trainer.spec.tinker_types import AdamParams, Datum, LoraChoice

    session = TrainingSession(str(model_dir), LoraChoice(rank=RANK), device=torch.device("cpu"), precision="fp32")
    data = [Datum(np.array(t), {"target_tokens": np.array(g), "weights": np.array(w, np.float32)}) for t, g, w in rows]
    times = []
    for _ in range(steps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        session.forward_backward(data, "cross_entropy", {}, backward=True)
        session.optim_step(AdamParams(learning_rate=1e-4))
        times.append(time.perf_counter() - t0)
    return times[1:]


def through_protocol(url: str, key: str, model: str, rows: list[Any], steps: int) -> list[float]:
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=url, api_key=f"tml-{key}")
    training = client.create_lora_training_client(base_model=model, rank=RANK).result()
    data = [
        types.Datum(model_input=types.ModelInput.from_ints(t), loss_fn_inputs={"target_tokens": g, "weights": w})
        for t, g, w in rows
    ]
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        fb = training.forward_backward(data, "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result()
        step.result()
        times.append(time.perf_counter() - t0)
    client.close("success").result()  # the worker unloads the finished session: the next round's takes its place
    return times[1:]


class Stack:
    """A fresh PostgreSQL database, the API in a thread and one worker process holding sessions."""

    def __init__(self, model_dir: Path, root: Path, *, autosave_steps: int) -> None:
        from api.app import create_app
        from api.auth import create_key
        from api.db import session_scope
        from api.migrate import upgrade
        from api.settings import Settings

        self.db = f"proxima_bench_{secrets.token_hex(4)}"
        self._admin("CREATE DATABASE {}")
        url = f"postgresql+psycopg2://postgres@127.0.0.1:5432/{self.db}"
        env = {
            "PROXIMA_HOME": str(root / "home"),
            "PROXIMA_DATABASE_URL": url,
            "PROXIMA_BROKER_URL": "redis://127.0.0.1:6379/14",
            "PROXIMA_ARTIFACTS": str(root / "artifacts"),
            "PROXIMA_BASE_MODELS": json.dumps([str(model_dir)]),
            "PROXIMA_SESSION_PRECISION": "fp32",
            "PROXIMA_SESSION_AUTOSAVE_STEPS": str(autosave_steps),
        }
        settings = Settings(  # type: ignore[call-arg]
            home=root / "home", database_url=url, artifacts=str(root / "artifacts"), base_models=[str(model_dir)]
        )
        upgrade(url)
        with session_scope(url) as s:
            _, self.key = create_key(s, tenant_name="bench")
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")} | env
        self.log = root / "worker.log"
        with self.log.open("wb") as log:
            self.worker = subprocess.Popen(
                [sys.executable, "-m", "worker.main", "--hostname", "bench"],
                env=full_env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        import threading

        import uvicorn

        port = 18000 + secrets.randbelow(1000)
        self.server = uvicorn.Server(uvicorn.Config(create_app(settings), port=port, log_level="warning"))
        threading.Thread(target=self.server.run, daemon=True).start()
        while not self.server.started:
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"

    def _admin(self, sql: str) -> None:
        conn = psycopg2.connect(host="127.0.0.1", port=5432, user="postgres", dbname="postgres")
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(sql.format(f'"{self.db}"'))
        conn.close()

    def close(self) -> None:
        self.server.should_exit = True
        self.worker.kill()
        self.worker.wait()
        self._admin("DROP DATABASE IF EXISTS {} WITH (FORCE)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    p.add_argument(
        "--autosave-steps", type=int, default=1, help="the worker's PROXIMA_SESSION_AUTOSAVE_STEPS (1: the default)"
    )
    p.add_argument("--max-load", type=float, default=1.0, help="a round starts once the 1-minute load is below this")
    args = p.parse_args()
    model_dir, _ = build_assets(args.workdir, "small")
    rows = batch(vocab=1024, seed=0)
    stack = Stack(model_dir, Path(tempfile.mkdtemp(prefix="proxima-tinker-bench-")), autosave_steps=args.autosave_steps)
    results: dict[str, list[float]] = {"in_process": [], "protocol": []}
    try:
        # A warm-up round, not counted: the worker's start (imports, its first session's load) runs beside it.
        in_process(model_dir, rows, 2)
        through_protocol(stack.url, stack.key, str(model_dir), rows, 2)
        r = attempts = 0
        while r < args.rounds and attempts < 3 * args.rounds:
            attempts += 1
            load = settle(args.max_load)
            if load >= args.max_load:
                print(f"round {r}: load {loadavg()} did not fall below {args.max_load} in {SETTLE_S:.0f} s; again")
                continue
            medians: dict[str, float] = {}
            for side in ("in_process", "protocol") if r % 2 == 0 else ("protocol", "in_process"):
                before = loadavg()
                if side == "in_process":
                    times = in_process(model_dir, rows, args.steps)
                else:
                    times = through_protocol(stack.url, stack.key, str(model_dir), rows, args.steps)
                medians[side] = statistics.median(times)
                print(
                    f"round {r} {side:10s} median {medians[side] * 1e3:7.1f} ms/step "
                    f"(steps {min(times) * 1e3:.1f}–{max(times) * 1e3:.1f})  load {before} → {loadavg()}",
                    flush=True,
                )
            for side, median in medians.items():
                results[side].append(median)
            r += 1
    finally:
        stack.close()
    for side, medians in results.items():
        print(f"{side:10s} median of rounds {statistics.median(medians) * 1e3:7.1f} ms "
              f"(rounds {min(medians) * 1e3:.1f}–{max(medians) * 1e3:.1f})")  # fmt: skip
    overhead = statistics.median(results["protocol"]) - statistics.median(results["in_process"])
    print(f"overhead per forward_backward + optim_step: {overhead * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
