"""What the broker holds: the jobs (and eval runs) whose wake-up message is still waiting in the queue, or was just
handed to a worker.

The sweeper re-sends a waiting job's message only when the broker no longer holds one (lost with a broker restart, or
never sent because the broker was down when the job was created): a job that merely waits its turn behind busy
workers keeps its place in the queue, and the queue stays first in, first out.

Read for the two brokers a deployment uses, through the kombu channel of each:

- Redis: the queue's lists (one per priority step) hold the waiting messages; the ``unacked`` hash holds those handed
  to a worker and not yet acknowledged, with the time each was handed over in the ``unacked_index`` sorted set.
- the embedded broker (kombu's SQLAlchemy transport): the queue's visible rows are the waiting messages. A row is
  made invisible when a worker takes it and never shown again, so a taken message counts only until the job is
  claimed, which is at once.

A message handed over to a worker counts as held for ``reserved_grace_s``: a live worker claims its job within
moments, so a job still waiting with a message taken longer ago than that lost its worker before the claim. Another
transport answers None: the caller cannot tell, and falls back to its time rule.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Iterable
from typing import Any

from celery import Celery

from api.tasks import RUN_JOB

log = logging.getLogger("proxima.sweeper")


def task_arg_of(raw: str | bytes | dict[str, Any], *, task: str = RUN_JOB) -> str | None:
    """The id a ``task`` message carries as its first argument (a job's, an eval run's: Celery's message protocol 2,
    JSON body), None for another task's message or one that cannot be read."""
    try:
        message = json.loads(raw) if isinstance(raw, str | bytes) else raw
        if message.get("headers", {}).get("task") != task:
            return None
        body = message["body"]
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return args[0] if args and isinstance(args[0], str) else None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None


def job_id_of(raw: str | bytes | dict[str, Any]) -> str | None:
    """The job id a ``proxima.jobs.run`` message carries, None for any other message or one that cannot be read."""
    return task_arg_of(raw, task=RUN_JOB)


def held_task_ids(
    app: Celery,
    *,
    reserved_grace_s: float,
    task: str = RUN_JOB,
    at: float | None = None,
    queues: list[str] | None = None,
) -> set[str] | None:
    """Ids carried by the ``task`` messages in ``queues`` (default: the default queue; jobs of several devices wait
    in queues of their size, ``api.tasks.queue_for``), or handed to a worker less than ``reserved_grace_s`` ago; None
    when this broker's contents cannot be read."""
    at = time.time() if at is None else at
    queues = queues or [app.conf.task_default_queue]
    with app.connection_for_read() as conn:
        driver = conn.transport.driver_type
        channel: Any = conn.default_channel
        if driver == "redis":
            return _redis(channel, task, queues, reserved_since=at - reserved_grace_s)
        if driver == "sql":
            return set().union(*(_sqlalchemy(channel, task, q) for q in queues))
    return None


def held_job_ids(
    app: Celery, *, reserved_grace_s: float, at: float | None = None, queues: list[str] | None = None
) -> set[str] | None:
    """``held_task_ids`` of the jobs' messages."""
    return held_task_ids(app, reserved_grace_s=reserved_grace_s, task=RUN_JOB, at=at, queues=queues)


def _ids(task: str, raws: Iterable[str | bytes | dict[str, Any]]) -> set[str]:
    return {found for raw in raws if (found := task_arg_of(raw, task=task)) is not None}


def _redis(channel: Any, task: str, queues: list[str], *, reserved_since: float) -> set[str]:
    client = channel.client
    with client.pipeline() as pipe:
        for key in dict.fromkeys(channel._q_for_pri(q, pri) for q in queues for pri in channel.priority_steps):
            pipe.lrange(key, 0, -1)
        pipe.zrangebyscore(channel.unacked_index_key, reserved_since, "+inf")
        *lists, recent = pipe.execute()
    held = _ids(task, (raw for items in lists for raw in items))
    if recent:
        reserved = [json.loads(v)[0] for v in client.hmget(channel.unacked_key, recent) if v is not None]
        held |= _ids(task, reserved)
    return held


def _sqlalchemy(channel: Any, task: str, queue: str) -> set[str]:
    session = channel.session
    try:
        q = channel._query_all(queue).filter(channel.message_cls.visible.is_(True))
        return _ids(task, (m.payload for m in q))
    finally:
        session.commit()
        session.close()
