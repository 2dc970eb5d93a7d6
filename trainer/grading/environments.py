"""Python environments of agent jobs in the sandbox: the runner program a session starts
(`trainer.grading.environment_runner`), and the check of an environment's source where it arrives (the API's)."""

from __future__ import annotations

from pathlib import Path

from trainer.grading import environment_runner
from trainer.grading.sandbox import (
    SandboxConfig,
    SandboxSession,
    SandboxUnavailable,
    SessionStopped,
    configured_sandbox,
)

ENVIRONMENT_RUNNER = Path(environment_runner.__file__).read_bytes()
assert len(ENVIRONMENT_RUNNER) < 60_000, "the runner is sent to bwrap through a pipe, which must hold all of it"


def environment_session(config: SandboxConfig) -> SandboxSession:
    """A sandbox running the environment runner, its replies bounded by the runner's own bound (and framing)."""
    return SandboxSession(config, ENVIRONMENT_RUNNER, max_reply_bytes=environment_runner.MAX_REPLY_BYTES + 1024)


def check_environment_source(source: str, config: SandboxConfig | None = None) -> str | None:
    """What is wrong with an environment's source (`environment_runner.source_problem`: size, syntax, top-level
    `reset(item)` and `step(tool_call)` each taking one positional argument), or None. Parsed in a sandbox within
    `startup_timeout_s`, never in the caller (hostile source can take seconds of CPU to parse); nothing of it runs.
    Raises SandboxUnavailable when no sandbox starts. `config`: this process's (`configure_sandbox`) unless given."""
    config = config or configured_sandbox()
    if len(source.encode("utf-8", "surrogatepass")) > environment_runner.MAX_SOURCE_BYTES:
        return f"source is longer than {environment_runner.MAX_SOURCE_BYTES} bytes"
    session = environment_session(config)
    try:
        reply = session.request({"check": source}, config.startup_timeout_s)
    except SessionStopped as stop:
        if stop.kind == "timeout":
            return f"source took longer than {config.startup_timeout_s:g} s to parse"
        return f"source could not be parsed ({stop.kind}: {stop.message})"
    finally:
        session.close()
    problem = reply.get("problem", 0)
    if len(reply) != 1 or (problem is not None and not isinstance(problem, str)):
        raise SandboxUnavailable("the sandbox answered something that is not a source check")
    return problem
