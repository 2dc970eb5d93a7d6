"""`proxima serve` on the embedded default, driven by the client commands: upload, create, follow, download; its API
process never loads torch."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture()
def server(random_model_dir: Path, tmp_path: Path) -> Iterator[dict[str, str]]:
    home = tmp_path / "home"
    shutil.copytree(random_model_dir, home / "models" / "tiny-random")
    port = _free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PROXIMA_")  # the embedded default: no database, broker or store configured
    }
    env |= {
        "PROXIMA_HOME": str(home),
        "PROXIMA_PORT": str(port),
        "PROXIMA_BASE_MODELS": '["tiny-random"]',
        "PROXIMA_API_BASE": f"http://127.0.0.1:{port}",
    }
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxima.cli", "serve"], env=env, stdout=log, stderr=log, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.3)
        yield {**env, "SERVE_PID": str(proc.pid)}
        # SIGTERM to `proxima serve` alone: it stops the worker and the inference server it started before it exits
        # (uvicorn's re-raised signal once ended it first, and they went minutes later by watching for its death),
        # leaving no process behind.
        children = _children(proc.pid)
        assert len(children) == 2, children  # the worker and the inference server
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert not [pid for pid in children if _running(pid)], "a child outlived proxima serve"
        deadline = time.monotonic() + 60
        while _group_alive(proc.pid):
            assert time.monotonic() < deadline, "the worker outlived proxima serve"
            time.sleep(0.5)
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie waiting for its parent has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def proxima(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxima.cli", *args], env=env, text=True, capture_output=True, timeout=300
    )


def test_client_commands_run_a_job_end_to_end(server: dict[str, str], arithmetic_data: Path, tmp_path: Path) -> None:
    home = Path(server["PROXIMA_HOME"])
    assert (home / "local_api_key").is_file()  # created on first start and used by the client commands

    up = proxima(server, "files", "upload", str(arithmetic_data / "train.jsonl"))
    assert up.returncode == 0, up.stderr
    file_id = json.loads(up.stdout)["id"]
    assert file_id.startswith("file-")

    spec = tmp_path / "job.json"
    spec.write_text(
        json.dumps(
            {
                "model": "tiny-random",
                "training_file": file_id,
                "suffix": "cli",
                "method": {
                    "type": "grpo",
                    "grpo": {
                        "grader": {
                            "type": "text_similarity",
                            "name": "sim",
                            "input": "{{sample.output_text}}",
                            "reference": "{{item.answer}}",
                            "evaluation_metric": "fuzzy_match",
                        },
                        "hyperparameters": {
                            "max_steps": 3,
                            "batch_size": 2,
                            "group_size": 2,
                            "max_completion_tokens": 4,
                            "checkpoint_interval": 1,
                            "precision": "fp32",
                        },
                    },
                },
            }
        )
    )
    created = proxima(server, "jobs", "create", str(spec))
    assert created.returncode == 0, created.stderr
    job_id = json.loads(created.stdout)["id"]

    followed = proxima(server, "jobs", "follow", job_id)
    assert followed.returncode == 0, followed.stderr
    assert "step 3/3" in followed.stderr and f"{job_id}: succeeded" in followed.stderr

    listed = proxima(server, "jobs", "list")
    assert job_id in listed.stdout and "succeeded" in listed.stdout

    out = tmp_path / "adapter.tar.gz"
    dl = proxima(server, "jobs", "download", job_id, "--output", str(out))
    assert dl.returncode == 0, dl.stderr
    with tarfile.open(out) as tar:
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(tar.getnames())

    # The API process served all of this (a job's creation, its files, its progress) without loading torch.
    assert "libtorch" not in Path(f"/proc/{server['SERVE_PID']}/maps").read_text()

    key_b = proxima(server, "keys", "create", "--tenant", "team-b")
    assert key_b.returncode == 0, key_b.stderr
    other = proxima({**server, "PROXIMA_API_KEY": key_b.stdout.strip()}, "jobs", "get", job_id)
    assert other.returncode == 2 and "error 404" in other.stderr
