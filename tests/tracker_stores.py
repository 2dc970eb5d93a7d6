"""Reading back what the experiment trackers stored locally, for the trackers' tests (unit and e2e), no network:

- a W&B offline run: its ``.wandb`` transaction log parsed record by record (W&B's own ``wandb_internal_pb2.Record``
  protobufs in LevelDB's log format, which ``wandb sync`` uploads), and its files (the rollout tables);
- an MLflow run on a ``file://`` store, through ``MlflowClient``.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient
from wandb.proto import wandb_internal_pb2 as pb

# The .wandb file: a 7-byte header (":W&B", magic 0xBEE1, version 0), then LevelDB's log format: 32 KiB blocks of
# chunks, each a 7-byte header (CRC-32 of the type byte and the data, the data's length, the type: full, first,
# middle, last) and its data; a block's tail too short for a header is padding. One protobuf Record per logical record.
_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list[pb.Record]:
    data = path.read_bytes()
    if len(data) < _HEADER:  # a run whose process was killed before W&B wrote anything
        return []
    assert struct.unpack("<4sHB", data[:_HEADER]) == (b":W&B", 0xBEE1, 0), data[:_HEADER]
    records: list[pb.Record] = []
    pending = b""
    pos = _HEADER
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:
            pos += _BLOCK - pos % _BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0 and length == 0:  # zeros: the end of what was written
            break
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        if len(chunk) < length:  # cut short by a kill: what came before is complete
            break
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc, f"{path}: bad checksum at {pos}"
        pos += _HEADER + length
        pending += chunk
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
        else:
            assert kind in (_FIRST, _MIDDLE), kind
    return records


@dataclass
class WandbRun:
    """What one offline run folder holds."""

    folder: Path
    run: Any = None  # the RunRecord: run_id, project, display_name, tags, ...
    config: dict[str, Any] = field(default_factory=dict)  # the user's keys (W&B's own `_wandb` left out)
    history: dict[int, dict[str, Any]] = field(default_factory=dict)  # step → logged values (W&B's `_…` left out)
    summary: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None

    def table(self, ref: dict[str, Any]) -> dict[str, Any]:
        """A logged wandb.Table's content (``{"columns", "data"}``) from its history value."""
        assert ref["_type"] == "table-file", ref
        return dict(json.loads((self.folder / "files" / ref["path"]).read_text()))


def _items(items: Any) -> dict[str, Any]:
    """Record items as a dict: an item's ``key``, or its ``nested_key`` path (a table's reference is nested under
    its key: ``rollouts`` → ``path``, ``nrows``, ...; a metric name with a slash is one key), W&B's own ``_…`` keys
    left out."""
    out: dict[str, Any] = {}
    for item in items:
        path = [item.key] if item.key else list(item.nested_key)
        if path[0].startswith("_"):
            continue
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = json.loads(item.value_json)
    return out


def wandb_run(folder: Path) -> WandbRun:
    """The run in an offline folder; empty while W&B's service process has not created its log (and for good when
    that process was killed first)."""
    out = WandbRun(folder)
    logs = list(folder.glob("run-*.wandb"))
    if not logs:
        return out
    (log,) = logs
    for record in wandb_records(log):
        match record.WhichOneof("record_type"):
            case "run":
                out.run = record.run
                out.config.update(_items(record.run.config.update))
            case "config":
                out.config.update(_items(record.config.update))
            case "history":
                (step,) = [json.loads(i.value_json) for i in record.history.item if list(i.nested_key) == ["_step"]]
                out.history[int(step)] = _items(record.history.item)
            case "summary":
                out.summary.update(_items(record.summary.update))
            case "exit":
                out.exit_code = record.exit.exit_code
    return out


def wandb_runs(wandb_dir: Path, *, finished_within: float = 30.0) -> list[WandbRun]:
    """The offline runs under a W&B ``dir`` (``PROXIMA_WANDB_DIR``), oldest first, once the newest has its exit
    record: W&B's service process writes a run's log out shortly after ``run.finish()`` returns (and a run whose
    process was killed may hold nothing at all)."""
    deadline = time.monotonic() + finished_within
    while True:
        runs = [wandb_run(f) for f in sorted((wandb_dir / "wandb").glob("offline-run-*"))]
        if (runs and runs[-1].exit_code is not None) or time.monotonic() > deadline:
            return runs
        time.sleep(0.1)


def mlflow_histories(client: MlflowClient, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Every metric's history as (step, value), in the order logged."""
    names = client.get_run(run_id).data.metrics
    return {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in names}
