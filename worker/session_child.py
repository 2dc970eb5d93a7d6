"""The child process that holds a Tinker session's model (``worker.session_process``), spoken to in frames, and the
folders of saved state it reads and writes, moved to and from the artifact store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from api.storage import ArtifactStore
from worker.frames import read_frame, write_frame


class SessionFailed(Exception):
    """The child reported a failure: ``category`` user (the request's content) or server."""

    def __init__(self, message: str, category: str) -> None:
        super().__init__(message)
        self.category = category


class Child:
    """The child process holding the model, spoken to in frames."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker.session_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.inp: IO[bytes] = self.proc.stdin
        self.out: IO[bytes] = self.proc.stdout

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        try:
            write_frame(self.inp, {"op": op, **fields})
            answer: dict[str, Any] = read_frame(self.out)
        except (EOFError, BrokenPipeError, OSError):
            code = self.proc.poll()
            raise SessionFailed(f"the session's process ended (exit status {code})", "server") from None
        if not answer.get("ok"):
            raise SessionFailed(str(answer.get("error")), str(answer.get("category", "server")))
        return answer

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def upload_folder(store: ArtifactStore, folder: Path, prefix: str) -> int:
    total = 0
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        total += store.put_file(f"{prefix}/{path.relative_to(folder).as_posix()}", path)
    return total


def download_folder(store: ArtifactStore, prefix: str, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for key in store.list(prefix):
        dest = folder / key.removeprefix(prefix + "/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        store.get_to_path(key, dest)
    return folder
