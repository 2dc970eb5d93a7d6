"""trainer.agents.tools.PythonEnvironmentExecutor: a Python environment's reset and steps in the python grader's
sandbox, one sandbox per episode. Real sandboxes (bubblewrap as root), as in test_sandbox.py: where the sandbox cannot
start, every test here fails with the reason (`make test` installs bubblewrap); none is skipped."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import pytest

from trainer.agents.tools import EnvironmentFailed, PythonEnvironmentExecutor, ToolResult
from trainer.grading import sandbox as sandbox_module
from trainer.grading.sandbox import SandboxConfig, sandbox_available
from trainer.spec.agent_spec import EnvironmentSpec

pytestmark = pytest.mark.alone  # time limits and latencies: under pytest-xdist, no other test beside them

LIMITS = SandboxConfig(
    sample_timeout_s=2.0,
    startup_timeout_s=20.0,  # a loaded 2-core machine: a start is ~0.1-0.2 s, its limit is for what never happens
    cpu_seconds=10,
    address_space_bytes=256 << 20,
    processes=24,
    file_size_bytes=4 << 20,
    scratch_bytes=8 << 20,
    output_bytes=64 << 10,
)
CALCULATOR = """
import json

total = 0


def reset(item):
    global total
    total = item["start"]
    return [{"role": "user", "content": f"Start at {total}; add with `add`, then call `done`."}]


def step(tool_call):
    global total
    if tool_call["name"] == "done":
        return f"final {total}", True
    if tool_call["name"] != "add":
        raise ValueError(f"no tool named {tool_call['name']}")
    total += json.loads(tool_call["arguments"])["n"]
    return str(total), False
"""


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str = "{}"
    id: str = "call_1"


def add(n: int) -> Call:
    return Call("add", f'{{"n": {n}}}')


@pytest.fixture(scope="module", autouse=True)
def available() -> None:
    """Every test here fails, saying why, where the sandbox cannot start (never skipped)."""
    reason = sandbox_available(LIMITS)
    if reason is not None:
        pytest.fail(f"the python grader's sandbox is unavailable here: {reason} (`make test` installs bubblewrap)")


def environment(source: str, config: SandboxConfig = LIMITS) -> PythonEnvironmentExecutor:
    return PythonEnvironmentExecutor(EnvironmentSpec(type="python", name="calc", source=source), config)


@pytest.fixture
def calculator() -> Iterator[PythonEnvironmentExecutor]:
    with environment(CALCULATOR) as executor:
        yield executor


def step(executor: PythonEnvironmentExecutor, call: Call, trace_id: str = "trace_a") -> ToolResult:
    return executor.call(call, None, item={}, trace_id=trace_id)


def sandbox_processes() -> list[int]:
    return [pid for n in range(LIMITS.uid_slots) for pid in sandbox_module._slot_processes(LIMITS.uid_base + n)]


class TestEpisodes:
    def test_reset_opens_the_episode_and_steps_keep_its_state_until_done(
        self, calculator: PythonEnvironmentExecutor
    ) -> None:
        messages = calculator.start({"start": 5}, "trace_a", [{"role": "user", "content": "the line's prompt"}])
        assert messages == [{"role": "user", "content": "Start at 5; add with `add`, then call `done`."}]
        outputs = [step(calculator, c) for c in (add(3), add(10), Call("done"))]
        assert [(r.output, r.error, r.done) for r in outputs] == [
            ("8", None, False),
            ("18", None, False),
            ("final 18", None, True),
        ]
        assert all(0 < r.seconds < LIMITS.sample_timeout_s for r in outputs)
        after = step(calculator, add(1))  # the environment ended the episode: its sandbox is gone
        assert (after.error, after.done) == ("environment", True)
        calculator.finish("trace_a")

    def test_each_episode_has_its_own_state_and_none_is_kept_across_episodes(
        self, calculator: PythonEnvironmentExecutor
    ) -> None:
        calculator.start({"start": 5}, "trace_a", [])
        calculator.start({"start": 100}, "trace_b", [])
        assert step(calculator, add(3), "trace_a").output == "8"
        assert step(calculator, add(1), "trace_b").output == "101"
        assert step(calculator, add(2), "trace_a").output == "10"
        calculator.finish("trace_a")
        calculator.start({"start": 0}, "trace_a", [])  # the same trace id, a new episode: a new sandbox
        assert step(calculator, add(2), "trace_a").output == "2"
        assert step(calculator, add(1), "trace_b").output == "102"

    def test_concurrent_episodes_run_side_by_side(self, calculator: PythonEnvironmentExecutor) -> None:
        def episode(i: int) -> list[str]:
            trace = f"trace_{i}"
            calculator.start({"start": i * 100}, trace, [])
            try:
                return [step(calculator, add(i), trace).output for _ in range(3)]
            finally:
                calculator.finish(trace)

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(episode, range(4)))
        assert results == [[str(i * 100 + i * k) for k in (1, 2, 3)] for i in range(4)]

    def test_the_call_reaches_step_as_id_name_and_arguments_text(self) -> None:
        source = "def reset(item):\n    return None\n\ndef step(call):\n    return repr(sorted(call.items())), False\n"
        with environment(source) as executor:
            assert executor.start({}, "trace_a", []) is None  # None keeps the line's prompt
            result = step(executor, Call("lookup", '{"q": "x"}', id="call_9"))
        assert result.output == "[('arguments', '{\"q\": \"x\"}'), ('id', 'call_9'), ('name', 'lookup')]"

    def test_finish_and_close_end_the_sandboxes(self, calculator: PythonEnvironmentExecutor) -> None:
        calculator.start({"start": 1}, "trace_a", [])
        calculator.start({"start": 2}, "trace_b", [])
        assert len(sandbox_processes()) >= 2
        calculator.finish("trace_a")
        calculator.finish("trace_a")  # idempotent
        assert step(calculator, add(1), "trace_a").error == "environment"
        calculator.close()
        assert step(calculator, add(1), "trace_b").error == "environment"
        deadline = time.monotonic() + 3
        while sandbox_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sandbox_processes() == []


class TestFailures:
    def test_an_exception_in_step_ends_the_episode_with_its_message(
        self, calculator: PythonEnvironmentExecutor
    ) -> None:
        calculator.start({"start": 0}, "trace_a", [])
        result = step(calculator, Call("multiply"))
        assert (result.error, result.done) == ("environment", True)
        assert "ValueError: no tool named multiply" in result.output
        assert 'environment.py", line' in result.output  # the environment's traceback, not the runner's
        assert step(calculator, add(1)).error == "environment"  # ended

    @pytest.mark.parametrize(
        ("returned", "shown"),
        [("42", "not int"), ("('x', 1)", "not (str, int)"), ("(None, False)", "not (NoneType, bool)")],
    )
    def test_a_step_returning_anything_but_str_and_bool_ends_the_episode(self, returned: str, shown: str) -> None:
        source = f"def reset(item):\n    return []\n\ndef step(tool_call):\n    return {returned}\n"
        with environment(source) as executor:
            executor.start({}, "trace_a", [])
            result = step(executor, add(1))
        assert (result.error, result.done) == ("environment", True)
        assert "step must return (content: str, done: bool)" in result.output and shown in result.output

    def test_a_step_that_loops_forever_is_cut_at_the_wall_limit(self) -> None:
        source = "def reset(item):\n    return []\n\ndef step(tool_call):\n    while True:\n        pass\n"
        with environment(source) as executor:
            executor.start({}, "trace_a", [])
            start = time.monotonic()
            result = step(executor, add(1))
            wall = time.monotonic() - start
        assert (result.error, result.done) == ("environment", True)
        assert "step took longer than 2 s" in result.output
        assert LIMITS.sample_timeout_s <= result.seconds <= wall < LIMITS.sample_timeout_s + 2.0

    def test_a_step_that_kills_its_sandbox_is_an_environment_error(self) -> None:
        source = "import os\n\ndef reset(item):\n    return []\n\ndef step(call):\n    print('bye', flush=True)\n"
        source += "    os._exit(3)\n"
        with environment(source) as executor:
            executor.start({}, "trace_a", [])
            result = step(executor, add(1))
        assert (result.error, result.done) == ("environment", True)
        assert "exited (3)" in result.output and "bye" in result.output

    def test_a_step_printing_past_the_output_limit_is_stopped(self) -> None:
        source = (
            "def reset(item):\n    return []\n\ndef step(call):\n    print('x' * 1_000_000)\n    return 'ok', False\n"
        )
        with environment(source) as executor:
            executor.start({}, "trace_a", [])
            result = step(executor, add(1))
        assert (result.error, result.done) == ("environment", True)
        assert f"printed more than {LIMITS.output_bytes} bytes" in result.output

    def test_a_step_cannot_reach_the_network(self) -> None:
        source = """
import socket, sys

def reset(item):
    return []

def step(tool_call):
    port = int(tool_call["arguments"])
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError as err:
        return f"refused: {type(err).__name__}", False
    return "connected", False
"""
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            listener.setblocking(False)
            port = listener.getsockname()[1]
            with environment(source) as executor:
                executor.start({}, "trace_a", [])
                result = step(executor, Call("connect", str(port)))
            assert result.output == "refused: ConnectionRefusedError"  # its own loopback, where nothing listens
            with pytest.raises(BlockingIOError):
                listener.accept()  # nothing came through to the host's

    def test_a_call_to_an_episode_that_never_started_is_an_environment_error(
        self, calculator: PythonEnvironmentExecutor
    ) -> None:
        result = step(calculator, add(1), "trace_unknown")
        assert (result.error, result.done, result.seconds) == ("environment", True, 0.0)


class TestStart:
    def test_a_reset_that_raises_fails_the_start_with_its_message(self, calculator: PythonEnvironmentExecutor) -> None:
        with pytest.raises(EnvironmentFailed, match=r"(?s)could not reset: reset raised .*KeyError: 'start'"):
            calculator.start({}, "trace_a", [])
        assert step(calculator, add(1)).error == "environment"  # no episode was left running

    @pytest.mark.parametrize(
        ("source", "problem"),
        [
            ("def reset(item):\n    return []\n", "does not define a top-level function step(tool_call)"),
            ("def reset(item):\n    return [\n", "does not parse"),
            ("raise RuntimeError('no config')\ndef reset(i): pass\ndef step(c): pass\n", "RuntimeError: no config"),
            ("def reset(a, b):\n    pass\ndef step(c):\n    pass\n", "reset must take one positional argument"),
        ],
    )
    def test_a_source_that_does_not_load_fails_the_start(self, source: str, problem: str) -> None:
        with environment(source) as executor, pytest.raises(EnvironmentFailed, match="does not load") as failed:
            executor.start({}, "trace_a", [])
        assert problem in str(failed.value)

    @pytest.mark.parametrize("returned", ["'hello'", "[{'role': 'user'}]", "[{'role': 'user', 'content': 1}]"])
    def test_reset_must_return_messages(self, returned: str) -> None:
        source = f"def reset(item):\n    return {returned}\n\ndef step(tool_call):\n    return '', False\n"
        with environment(source) as executor, pytest.raises(EnvironmentFailed, match="reset must return None or a"):
            executor.start({}, "trace_a", [])

    def test_a_reset_that_loops_forever_is_cut_at_the_wall_limit(self) -> None:
        source = "def reset(item):\n    while True:\n        pass\n\ndef step(tool_call):\n    return '', False\n"
        config = replace(LIMITS, sample_timeout_s=1.0)
        start = time.monotonic()
        with environment(source, config) as executor, pytest.raises(EnvironmentFailed, match="reset took longer"):
            executor.start({}, "trace_a", [])
        assert time.monotonic() - start < 1.0 + 3.0

    def test_a_trace_id_cannot_start_twice(self, calculator: PythonEnvironmentExecutor) -> None:
        calculator.start({"start": 1}, "trace_a", [])
        with pytest.raises(ValueError, match="already started"):
            calculator.start({"start": 1}, "trace_a", [])
        assert step(calculator, add(1)).output == "2"  # the running episode is untouched
