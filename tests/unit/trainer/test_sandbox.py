"""trainer.grading.sandbox: the python grader's sandbox. Every escape tried here (the network, the host's files and
processes, the service's environment, privileges, resource limits) is a grader that scores 1.0 (or says what it
found) when the escape works, so that each test fails if it does.

The sandbox is required, not optional: where it cannot start (bubblewrap missing, no root), every test here fails
with the reason (`make test` installs bubblewrap). Limits are small so that the file runs in seconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from trainer.grading import sandbox as sandbox_module
from trainer.grading.sandbox import (
    MAX_SOURCE_BYTES,
    PythonSandbox,
    Result,
    SandboxConfig,
    check_source,
    sandbox_available,
)

pytestmark = pytest.mark.alone  # time limits and latencies: under pytest-xdist, no other test beside them

REPO = Path(__file__).resolve().parents[3]
LIMITS = SandboxConfig(
    sample_timeout_s=3.0,
    startup_timeout_s=20.0,  # a loaded 2-core machine: a start is ~0.1-0.2 s, its limit is for what never happens
    cpu_seconds=4,
    address_space_bytes=256 << 20,
    processes=24,
    file_size_bytes=4 << 20,
    scratch_bytes=8 << 20,
    output_bytes=64 << 10,
    max_restarts=3,
)
SANDBOX_ROOT = {"bin", "dev", "lib", "lib64", "proc", "sandbox", "tmp", "usr"}
SANDBOX_ENV = {"HOME", "LANG", "MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "PATH", "PWD", "TMPDIR"}


@pytest.fixture(scope="module", autouse=True)
def sandbox() -> PythonSandbox:
    """The sandbox under test; every test here fails, saying why, where it cannot start (never skipped)."""
    reason = sandbox_available(LIMITS)
    if reason is not None:
        pytest.fail(f"the python grader's sandbox is unavailable here: {reason} (`make test` installs bubblewrap)")
    return PythonSandbox(LIMITS)


def run(
    sandbox: PythonSandbox, source: str, items: list[dict[str, Any]], samples: list[dict[str, Any]] | None = None
) -> list[Result]:
    return sandbox.grade_batch(source, samples or [{"output_text": ""}] * len(items), items)


def refused(result: Result, *errors: str) -> bool:
    """The grader raised (the escape did not work) with one of `errors` in its traceback."""
    return result.score == 0.0 and result.kind == "exception" and any(e in (result.error or "") for e in errors)


def slot_processes() -> list[str]:
    """Every process of the sandboxes' uids, zombies included (a zombie still counts against its uid's limit)."""
    uids = {str(LIMITS.uid_base + n) for n in range(LIMITS.uid_slots)}
    found = []
    for entry in os.scandir("/proc"):
        try:
            status = Path(entry.path, "status").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields and fields["Uid"].split()[0] in uids:
            found.append(f"{entry.name} {fields['Name'].strip()} {fields['State'].strip()}")
    return found


class TestGrading:
    def test_a_correct_grader_scores_64_samples_exactly_with_one_sandbox_start(
        self, sandbox: PythonSandbox, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        launches: list[list[str]] = []
        popen = subprocess.Popen

        def counting_popen(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
            launches.append(argv)
            return popen(argv, **kwargs)

        monkeypatch.setattr(sandbox_module.subprocess, "Popen", counting_popen)
        source = (
            "def grade(sample, item):\n"
            "    assert sample['output_json'] == {'n': item['n']} and sample['choices'][0]['index'] == 0\n"
            "    return float(sample['output_text'].strip() == item['answer'])\n"
        )
        samples = [
            {"output_text": f" {n} ", "output_json": {"n": n}, "output_tools": [], "choices": [{"index": 0}]}
            for n in range(64)
        ]
        items = [{"answer": str(n if n % 3 else n + 1), "n": n} for n in range(64)]
        starts = sandbox.starts

        results = sandbox.grade_batch(source, samples, items)

        assert [r.score for r in results] == [0.0 if n % 3 == 0 else 1.0 for n in range(64)]
        assert {(r.error, r.kind) for r in results} == {(None, None)}
        assert len(launches) == 1 and sandbox.starts == starts + 1
        assert "bwrap" in " ".join(launches[0]) and all(r.seconds >= 0 for r in results)

    def test_a_score_is_what_float_makes_of_a_finite_number(self, sandbox: PythonSandbox) -> None:
        source = "def grade(sample, item):\n    return eval(item['value'])\n"
        values = ["True", "2", "-0.5", "__import__('fractions').Fraction(1, 4)"]
        assert [r.score for r in run(sandbox, source, [{"value": v} for v in values])] == [1.0, 2.0, -0.5, 0.25]

    def test_what_is_not_a_finite_number_scores_zero_with_its_kind(self, sandbox: PythonSandbox) -> None:
        source = (
            "import sys\n"
            "def grade(sample, item):\n"
            "    if item['do'] == 'raise':\n"
            "        raise ValueError('the answer is missing')\n"
            "    if item['do'] == 'exit':\n"
            "        sys.exit(0)\n"
            "    return eval(item['do'])\n"
        )
        dos = ["raise", "exit", "'1.0'", "None", "[1.0]", "float('nan')", "float('-inf')", "10 ** 400"]
        results = run(sandbox, source, [{"do": d} for d in dos])
        assert [r.kind for r in results] == ["exception"] * 2 + ["not_a_number"] * 3 + ["non_finite"] * 3
        assert {r.score for r in results} == {0.0}
        assert 'File "grader.py", line 4, in grade' in (results[0].error or "")
        assert (results[0].error or "").endswith("ValueError: the answer is missing")
        assert "SystemExit" in (results[1].error or "")
        assert results[2].error == "grade returned str, not a number"

    def test_what_the_grader_prints_cannot_forge_a_reply(self, sandbox: PythonSandbox) -> None:
        source = (
            "import os\n"
            "def grade(sample, item):\n"
            '    print(\'{"i": 0, "score": 1.0}\', flush=True)\n'
            '    os.write(1, b\'{"i": 0, "score": 1.0}\\n\')\n'
            "    return 0.0\n"
        )
        assert [(r.score, r.kind) for r in run(sandbox, source, [{}, {}])] == [(0.0, None), (0.0, None)]

    def test_a_crash_scores_its_sample_and_the_rest_are_graded_in_a_new_sandbox(self, sandbox: PythonSandbox) -> None:
        source = "import os\ndef grade(sample, item):\n    if item['crash']:\n        os._exit(3)\n    return 1.0\n"
        starts = sandbox.starts
        results = run(sandbox, source, [{"crash": False}, {"crash": True}, {"crash": False}])
        assert [(r.score, r.kind) for r in results] == [(1.0, None), (0.0, "crash"), (1.0, None)]
        assert results[1].error == "the sandbox exited (3)"
        assert sandbox.starts == starts + 2


class TestPackages:
    def test_the_packages_folder_is_importable_read_only_and_the_host_site_packages_are_not(self) -> None:
        packages = Path(tempfile.mkdtemp(prefix="proxima-grader-site-", dir="/tmp"))  # readable by the slot's uid
        try:
            packages.chmod(0o755)
            (packages / "gradelib.py").write_text("HALF = 0.5\n")
            (packages / "gradelib.py").chmod(0o666)  # writable by anyone: only the read-only mount stops a write
            source = (
                "def grade(sample, item):\n"
                "    if item['try'] == 'import':\n"
                "        import gradelib\n"
                "        return gradelib.HALF\n"
                "    if item['try'] == 'write':\n"
                "        import gradelib\n"
                "        open(gradelib.__file__, 'a').write('HALF = 1.0')\n"
                "        return 1.0\n"
                "    import yaml\n"  # Debian's python3-yaml, in the host's dist-packages: -S leaves it out
                "    return 1.0\n"
            )
            with_packages = PythonSandbox(replace(LIMITS, packages_dir=packages))
            results = run(with_packages, source, [{"try": "import"}, {"try": "write"}, {"try": "host"}])
        finally:
            shutil.rmtree(packages)
        assert (results[0].score, results[0].kind) == (0.5, None), results[0].error
        assert refused(results[1], "Read-only file system")
        assert refused(results[2], "ModuleNotFoundError: No module named 'yaml'")

    def test_a_limit_that_is_not_positive_is_refused_by_name(self) -> None:
        with pytest.raises(ValueError, match=r"SandboxConfig\.processes must be positive, not 0"):
            SandboxConfig(processes=0)
        with pytest.raises(ValueError, match=r"SandboxConfig\.uid_base must be an unprivileged uid"):
            SandboxConfig(uid_base=0)


class TestSource:
    @pytest.mark.parametrize(
        ("source", "problem"),
        [
            ("def grade(sample, item:\n    return 1.0\n", "source does not parse: '(' was never closed (line 1)"),
            ("def score(sample, item):\n    return 1.0\n", "source does not define a top-level function grade"),
            ("def grade(sample):\n    return 1.0\n", "grade must take two positional arguments"),
            ("def grade(sample, item, other):\n    return 1.0\n", "grade must take two positional arguments"),
            ("def grade(sample, item, *, key):\n    return 1.0\n", "grade must take two positional arguments"),
            ("async def grade(sample, item):\n    return 1.0\n", "grade must be a plain function"),
            ("class G:\n    def grade(self, sample, item):\n        return 1.0\n", "does not define a top-level"),
        ],
    )
    def test_check_source_names_the_problem(self, source: str, problem: str) -> None:
        assert problem in (check_source(source, LIMITS) or "")

    @pytest.mark.parametrize(
        "source",
        [
            "import os\nos._exit(1)\ndef grade(sample, item):\n    return 1.0\n",  # nothing of it runs
            "def grade(sample, item, extra=None):\n    return 1.0\n",
            "def grade(*args):\n    return 1.0\n",
            "def grade(sample, item, /):\n    return 1.0\n",
        ],
    )
    def test_check_source_accepts_a_grade_taking_two_positional_arguments(self, source: str) -> None:
        assert check_source(source, LIMITS) is None

    def test_check_source_refuses_an_oversized_source_without_a_sandbox(self, sandbox: PythonSandbox) -> None:
        source = "def grade(sample, item):\n    return 1.0\n#" + "x" * MAX_SOURCE_BYTES
        starts = sandbox.starts
        assert (sandbox.check_source(source) or "").startswith(f"source is {len(source)} bytes long; at most")
        assert [r.kind for r in run(sandbox, source, [{}])] == ["invalid_source"] and sandbox.starts == starts

    def test_check_source_parses_within_a_time_limit(self) -> None:
        # 256 kB of f-string placeholders takes seconds of CPU to parse: the check runs in a sandbox, with a limit
        bomb = "x = f'" + "{a}" * (MAX_SOURCE_BYTES // 3 - 20) + "'\ndef grade(sample, item):\n    return 1.0\n"
        start = time.monotonic()
        problem = PythonSandbox(replace(LIMITS, sample_timeout_s=1.0)).check_source(bomb)
        assert problem is not None and ("took longer than 1 s" in problem or "MemoryError" in problem)
        assert time.monotonic() - start < 5.0

    @pytest.mark.parametrize(
        ("source", "error"),
        [
            ("def grade(sample, item:\n    return 1.0\n", "source does not parse"),
            ("x = 1 / 0\ndef grade(sample, item):\n    return 1.0\n", "ZeroDivisionError: division by zero"),
            ("def grade(sample, item):\n    return 1.0\ngrade = 5\n", "grade is not a function"),
        ],
    )
    def test_an_invalid_source_scores_every_sample_zero(self, sandbox: PythonSandbox, source: str, error: str) -> None:
        results = run(sandbox, source, [{}, {}, {}])
        assert [(r.score, r.kind) for r in results] == [(0.0, "invalid_source")] * 3
        assert all(error in (r.error or "") for r in results)

    def test_top_level_code_past_the_start_limit_scores_every_sample_zero(self) -> None:
        quick = PythonSandbox(replace(LIMITS, startup_timeout_s=1.0))
        source = "import time\ntime.sleep(3600)\ndef grade(sample, item):\n    return 1.0\n"
        results = run(quick, source, [{}, {}])
        assert [r.kind for r in results] == ["invalid_source"] * 2 and quick.starts == 1
        assert "top-level code took longer than 1 s" in (results[0].error or "")


class TestNetwork:
    SOURCE = (
        "import socket\n"
        "def grade(sample, item):\n"
        "    family = socket.AF_UNIX if item['to'] == 'unix' else socket.AF_INET\n"
        "    kind = socket.SOCK_DGRAM if item.get('udp') else socket.SOCK_STREAM\n"
        "    s = socket.socket(family, kind)\n"
        "    s.settimeout(2)\n"
        "    if item['to'] == 'dns':\n"
        "        socket.getaddrinfo(item['host'], 443)\n"
        "    elif item['to'] == 'unix':\n"
        "        s.connect(item['path'])\n"
        "    elif item.get('udp'):\n"
        "        s.sendto(b'escaped', (item['host'], item['port']))\n"
        "    else:\n"
        "        s.connect((item['host'], item['port']))\n"
        "    return 1.0\n"
    )

    @pytest.fixture
    def listeners(self, tmp_path: Path) -> Iterator[dict[str, socket.socket]]:
        tcp = socket.create_server(("127.0.0.1", 0))
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind(("127.0.0.1", 0))
        unix = socket.socket(socket.AF_UNIX)
        unix.bind(str(tmp_path / "service.sock"))
        unix.listen()
        abstract = socket.socket(socket.AF_UNIX)
        abstract.bind(f"\0proxima-sandbox-test-{uuid.uuid4().hex}")
        abstract.listen()
        sockets = {"tcp": tcp, "udp": udp, "unix": unix, "abstract": abstract}
        for s in sockets.values():
            s.setblocking(False)
        yield sockets
        for s in sockets.values():
            s.close()

    def test_no_socket_reaches_the_host_or_the_outside(
        self, sandbox: PythonSandbox, listeners: dict[str, socket.socket]
    ) -> None:
        tcp_port = listeners["tcp"].getsockname()[1]
        items = [
            {"to": "host", "host": "127.0.0.1", "port": tcp_port},  # a port this test listens on
            {"to": "outside", "host": "192.0.2.1", "port": 80},  # TEST-NET-1: no route but the default one
            {"to": "outside", "host": "1.1.1.1", "port": 53, "udp": True},
            {"to": "dns", "host": "pypi.org"},
            {"to": "unix", "path": listeners["unix"].getsockname()},
            {"to": "unix", "path": listeners["abstract"].getsockname().decode()},
        ]
        results = run(sandbox, self.SOURCE, items)

        assert refused(results[0], "ConnectionRefusedError")
        assert refused(results[1], "Network is unreachable") and refused(results[2], "Network is unreachable")
        assert refused(results[3], "gaierror")
        assert refused(results[4], "FileNotFoundError") and refused(results[5], "ConnectionRefusedError")
        for name in ("tcp", "unix", "abstract"):
            with pytest.raises(BlockingIOError):
                listeners[name].accept()  # nothing connected

    def test_a_datagram_to_the_host_stays_in_the_sandbox(
        self, sandbox: PythonSandbox, listeners: dict[str, socket.socket]
    ) -> None:
        port = listeners["udp"].getsockname()[1]
        run(sandbox, self.SOURCE, [{"to": "host", "host": "127.0.0.1", "port": port, "udp": True}])
        time.sleep(0.1)
        with pytest.raises(BlockingIOError):
            listeners["udp"].recv(100)


class TestFiles:
    READ = (
        "def grade(sample, item):\n"
        "    with open(item['path'], 'rb') as f:\n"
        "        data = f.read()\n"
        "    return float(item['canary'].encode() in data)\n"
    )

    @pytest.fixture
    def home_canary(self) -> Iterator[tuple[Path, str]]:
        token = uuid.uuid4().hex
        path = Path.home() / f".proxima-sandbox-canary-{token}"
        path.write_text(token)
        yield path, token
        path.unlink()

    def test_host_files_are_not_there(
        self, sandbox: PythonSandbox, tmp_path: Path, home_canary: tuple[Path, str]
    ) -> None:
        artifacts = tmp_path / "artifacts" / "ftjob-1"
        artifacts.mkdir(parents=True)
        token = uuid.uuid4().hex
        (artifacts / "adapter_config.json").write_text(token)
        items = [
            {"path": "/etc/passwd", "canary": "root:"},
            {"path": str(artifacts / "adapter_config.json"), "canary": token},
            {"path": str(home_canary[0]), "canary": home_canary[1]},
            {"path": str(REPO / "pyproject.toml"), "canary": "proxima"},
            {"path": "/var/run/postgresql/.s.PGSQL.5432", "canary": ""},
        ]
        for result in run(sandbox, self.READ, items):
            assert refused(result, "FileNotFoundError", "PermissionError"), result

    def test_the_root_holds_only_the_sandbox_own_folders(self, sandbox: PythonSandbox) -> None:
        source = (
            "import os\n"
            "def grade(sample, item):\n"
            "    found = sorted(os.listdir('/'))\n"
            "    assert found == item['expected'], found\n"
            "    assert sorted(os.listdir('/tmp')) == [], os.listdir('/tmp')\n"
            "    return 1.0\n"
        )
        [result] = run(sandbox, source, [{"expected": sorted(SANDBOX_ROOT)}])
        assert (result.score, result.kind) == (1.0, None), result.error

    def test_writes_outside_the_scratch_space_are_refused(self, sandbox: PythonSandbox) -> None:
        source = (
            "def grade(sample, item):\n"
            "    with open(item['path'], item['mode']) as f:\n"
            "        f.write(b'x' * item['size'])\n"
            "    return 1.0\n"
        )
        targets = [
            "/escape",
            "/usr/escape",
            "/usr/bin/python3",
            "/dev/escape",
            "/sandbox/runner.py",
            "/proc/sys/kernel/hostname",
        ]
        items = [{"path": p, "mode": "wb" if p.startswith("/proc") else "ab", "size": 1} for p in targets]
        items += [
            {"path": "/tmp/scratch", "mode": "wb", "size": 1 << 20},  # the scratch space works ...
            {"path": "/dev/shm/scratch", "mode": "wb", "size": 1 << 20},
            {"path": "/tmp/large", "mode": "wb", "size": LIMITS.file_size_bytes + 1},  # ... within its limits
        ]
        results = run(sandbox, source, items)

        for result in results[: len(targets)]:
            assert refused(result, "Read-only file system", "Permission denied"), result
        assert [(r.score, r.kind) for r in results[len(targets) : -1]] == [(1.0, None)] * 2
        assert refused(results[-1], "File too large")

    def test_the_scratch_space_is_bounded(self, sandbox: PythonSandbox) -> None:
        source = (
            "def grade(sample, item):\n"
            "    for n in range(1000):\n"
            "        with open(f\"{item['dir']}/fill-{n}\", 'wb') as f:\n"
            "            f.write(b'x' * (1 << 20))\n"
            "    return 1.0\n"  # 1000 MiB written
        )
        for result in run(sandbox, source, [{"dir": "/tmp"}, {"dir": "/dev/shm"}]):
            assert refused(result, "No space left on device"), result


class TestEnvironment:
    def test_the_service_environment_is_not_visible_anywhere(
        self, sandbox: PythonSandbox, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("PROXIMA_SANDBOX_CANARY", uuid.uuid4().hex)
        source = (
            "import os\n"
            "def grade(sample, item):\n"
            "    assert sorted(os.environ) == item['expected'], sorted(os.environ)\n"
            "    environs = []\n"
            "    for pid in os.listdir('/proc'):\n"
            "        if pid.isdigit():\n"
            "            try:\n"
            "                environs.append(open(f'/proc/{pid}/environ', 'rb').read())\n"
            "            except OSError:\n"
            "                pass\n"
            "    assert os.getpid() == 1 and len(environs) >= 1, 'read no environment'\n"
            "    pid_1 = open('/proc/1/environ', 'rb').read().split(b'\\0')\n"
            "    names = sorted(v.split(b'=')[0].decode() for v in pid_1 if v)\n"
            "    assert names == item['expected'], names\n"
            "    return float(any(b'PROXIMA' in e for e in environs))\n"
        )
        [result] = run(sandbox, source, [{"expected": sorted(SANDBOX_ENV)}])
        assert (result.score, result.kind) == (0.0, None), result.error

    def test_host_processes_are_not_visible(self, sandbox: PythonSandbox) -> None:
        source = (
            "import os\n"
            "def grade(sample, item):\n"
            "    pids = [int(p) for p in os.listdir('/proc') if p.isdigit()]\n"
            "    return float(item['pid'] in pids or max(pids) > 10)\n"
        )
        [result] = run(sandbox, source, [{"pid": os.getpid()}])
        assert (result.score, result.kind) == (0.0, None), result.error


class TestPrivileges:
    SOURCE = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def grade(sample, item):\n"
        "    if item['try'] == 'setuid':\n"
        "        os.setuid(0)\n"
        "        return 1.0\n"
        "    if item['try'] == 'mount':\n"
        "        rc = libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)\n"
        "    else:\n"
        "        rc = libc.unshare(item['flags'])\n"
        "    if rc != 0:\n"
        "        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))\n"
        "    return 1.0\n"
    )

    def test_new_namespaces_mounts_and_root_are_refused(self, sandbox: PythonSandbox) -> None:
        items: list[dict[str, Any]] = [
            {"try": "unshare", "flags": 0x10000000},  # CLONE_NEWUSER: refused by --disable-userns
            {"try": "unshare", "flags": 0x40000000},  # CLONE_NEWNET
            {"try": "mount"},
            {"try": "setuid"},
        ]
        results = run(sandbox, self.SOURCE, items)
        assert refused(results[0], "No space left on device", "Operation not permitted"), results[0]
        assert refused(results[1], "Operation not permitted") and refused(results[2], "Operation not permitted")
        assert refused(results[3], "Operation not permitted", "Invalid argument"), results[3]  # 0 is not mapped


class TestLimits:
    FORK_BOMB = (
        "import os, time\n"
        "def grade(sample, item):\n"
        "    forks = 0\n"
        "    try:\n"
        "        while forks < 10000:\n"
        "            if os.fork() == 0:\n"
        "                time.sleep(60)\n"
        "                os._exit(0)\n"
        "            forks += 1\n"
        "    except OSError:\n"
        "        pass\n"
        "    time.sleep(item['hold'])\n"
        "    return float(forks)\n"
    )

    def test_two_fork_bombs_at_once_each_stop_at_their_own_process_limit(self, sandbox: PythonSandbox) -> None:
        with ThreadPoolExecutor(2) as pool:
            batches = list(pool.map(lambda _: run(sandbox, self.FORK_BOMB, [{"hold": 1.5}]), range(2)))

        # Each sandbox holds its uid's limit alone: bwrap and the runner, then the forks. Under a shared uid the two
        # would share one limit, and one of them would get half of it or less.
        forks = [result.score for [result] in batches]
        assert all(LIMITS.processes - 4 <= n <= LIMITS.processes - 2 for n in forks), forks
        assert {result.kind for [result] in batches} == {None}
        assert slot_processes() == []  # every fork died with its sandbox

    def test_a_memory_bomb_gets_memory_error(self, sandbox: PythonSandbox) -> None:
        source = (
            "import mmap\n"
            "def grade(sample, item):\n"
            "    if item['try'] == 'once':\n"
            "        hoard = bytearray(8 << 30)\n"
            "    elif item['try'] == 'mmap':\n"
            "        hoard = mmap.mmap(-1, 8 << 30)\n"
            "    elif item['try'] == 'chunks':\n"
            "        hoard = [bytearray(64 << 20) for _ in range(128)]\n"
            "    return 1.0\n"
        )
        results = run(sandbox, source, [{"try": "once"}, {"try": "mmap"}, {"try": "chunks"}, {"try": "nothing"}])
        assert refused(results[0], "MemoryError") and refused(results[2], "MemoryError")
        assert refused(results[1], "Cannot allocate memory")
        assert (results[3].score, results[3].kind) == (1.0, None)  # the same sandbox goes on

    # `n` children of 300 MB each, together for a second: every one under its RLIMIT_AS (1 GiB here).
    TOGETHER = (
        "import os, time\n"
        "def grade(sample, item):\n"
        "    children = []\n"
        "    for _ in range(item['n']):\n"
        "        pid = os.fork()\n"
        "        if pid == 0:\n"
        "            hoard = bytearray(300 << 20)\n"
        "            for i in range(0, len(hoard), 4096):\n"
        "                hoard[i] = 1\n"
        "            time.sleep(0.5)\n"
        "            os._exit(0)\n"
        "        children.append(pid)\n"
        "    return float(sum(os.waitpid(pid, 0)[1] == 0 for pid in children))\n"
    )

    def test_processes_together_past_the_sandbox_memory_bound_stop_it_with_memory_limit(self) -> None:
        config = replace(LIMITS, address_space_bytes=1 << 30, memory_bytes=512 << 20, sample_timeout_s=10.0)
        bound = sandbox_module.memory_bound(config)
        if bound.version is None:
            pytest.skip(f"no whole-sandbox bound on this host: {bound.reason}")
        bounded = PythonSandbox(config)
        results = run(bounded, self.TOGETHER, [{"n": 4}, {"n": 1}])
        assert [(r.score, r.kind) for r in results] == [(0.0, "memory_limit"), (1.0, None)]  # the next: a new sandbox
        assert results[0].error == (
            "the sandbox's processes used more than 512 MiB of memory together (its whole-sandbox bound); killed"
        )
        assert slot_processes() == []
        assert "cgroup v" in bound.description(config.memory_bytes, config.processes)

    def test_where_no_cgroup_is_made_the_description_says_rlimit_as_bounds_each_process(self) -> None:
        bound = sandbox_module.memory_bound(replace(LIMITS, cgroups=False))
        assert bound.version is None
        assert bound.description(LIMITS.memory_bytes, LIMITS.processes) == (
            "python sandboxes: no whole-sandbox memory bound (SandboxConfig.cgroups is off); each process is bounded "
            f"by RLIMIT_AS, with at most {LIMITS.processes} processes of the sandbox's uid"
        )

    def test_an_infinite_loop_spends_the_batch_cpu_time(self) -> None:
        busy = PythonSandbox(replace(LIMITS, cpu_seconds=1, sample_timeout_s=20.0))
        source = "def grade(sample, item):\n    while item['loop']:\n        pass\n    return 1.0\n"
        results = run(busy, source, [{"loop": False}, {"loop": True}, {"loop": False}])
        assert [(r.score, r.kind) for r in results] == [(1.0, None), (0.0, "cpu_limit"), (0.0, "cpu_limit")]
        assert results[1].seconds < 10.0 and (results[2].error or "").startswith("not graded")
        assert busy.starts == 1

    def test_a_sample_past_its_wall_time_is_killed_and_the_batch_goes_on(self) -> None:
        quick = PythonSandbox(replace(LIMITS, sample_timeout_s=1.0))
        source = (
            "import signal, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "def grade(sample, item):\n"
            "    time.sleep(item['sleep'])\n"
            "    return 1.0\n"
        )
        results = run(quick, source, [{"sleep": 0}, {"sleep": 3600}, {"sleep": 0}])
        assert [(r.score, r.kind) for r in results] == [(1.0, None), (0.0, "timeout"), (1.0, None)]
        assert 1.0 <= results[1].seconds < 3.0 and results[1].error == "grade took longer than 1 s"
        assert quick.starts == 2

    def test_a_batch_stops_restarting_after_max_restarts(self) -> None:
        quick = PythonSandbox(replace(LIMITS, sample_timeout_s=0.5, max_restarts=1))
        source = "import time\ndef grade(sample, item):\n    time.sleep(3600)\n"
        start = time.monotonic()
        results = run(quick, source, [{}] * 5)
        assert [r.kind for r in results] == ["timeout"] * 5 and quick.starts == 2
        assert all((r.error or "").startswith("not graded: 2 sandboxes") for r in results[2:])
        assert time.monotonic() - start < 5.0

    def test_no_process_outlives_its_batch_however_it_ended(self) -> None:
        # Not even a zombie: one would count against its uid's process limit until the host's init reaps it (never,
        # under an init that does not reap), and a grader could then starve every later sandbox of that uid.
        quick = PythonSandbox(replace(LIMITS, sample_timeout_s=0.5, cpu_seconds=1, max_restarts=1))
        source = (
            "import os, time\n"
            "def grade(sample, item):\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(3600)\n"
            "    if item['end'] == 'exit':\n"
            "        os._exit(1)\n"
            "    while item['end'] == 'loop':\n"
            "        pass\n"
            "    if item['end'] == 'sleep':\n"
            "        time.sleep(3600)\n"
            "    if item['end'] == 'print':\n"
            "        os.write(1, b'x' * (1 << 20))\n"
            "    return 1.0\n"
        )
        for end in ("return", "exit", "sleep", "print", "loop"):
            [result] = run(quick, source, [{"end": end}])
            assert result.kind == {"return": None, "exit": "crash", "sleep": "timeout"}.get(end, result.kind)
            assert slot_processes() == [], end
        assert [r.kind for r in run(quick, "x = (", [{}])] == ["invalid_source"] and slot_processes() == []

    def test_printing_gigabytes_is_cut_off(self, sandbox: PythonSandbox) -> None:
        source = (
            "import os, sys\n"
            "def grade(sample, item):\n"
            "    for _ in range(4096 if item['to'] else 0):\n"  # 4 GiB
            "        if item['to'] == 'print':\n"
            "            print('x' * (1 << 20))\n"
            "        else:\n"
            "            os.write(item['to'], b'x' * (1 << 20))\n"
            "    return 1.0\n"
        )
        starts, start = sandbox.starts, time.monotonic()
        results = run(sandbox, source, [{"to": "print"}, {"to": 1}, {"to": 2}, {"to": None}])
        assert [(r.score, r.kind) for r in results] == [(0.0, "output_limit")] * 3 + [(1.0, None)]
        assert results[0].error == f"the grader printed more than {LIMITS.output_bytes} bytes"
        assert sandbox.starts == starts + 4 and time.monotonic() - start < 10.0


class TestAvailability:
    def test_a_missing_bwrap_is_named(self) -> None:
        reason = sandbox_available(replace(LIMITS, bwrap="/nonexistent/bwrap"))
        assert reason == "/nonexistent/bwrap is not installed (Debian package bubblewrap)"

    def test_an_interpreter_outside_usr_is_refused(self) -> None:
        reason = sandbox_available(replace(LIMITS, python="/root/.pyenv/versions/3.11.7/bin/python3"))
        assert reason is not None and "under /usr" in reason

    def test_a_failure_is_not_kept_once_its_cause_is_gone(self) -> None:
        base = Path(tempfile.mkdtemp(prefix="proxima-grader-site-"))  # not under tmp_path: the slot uid must read it
        try:
            base.chmod(0o755)
            packages = base / "site"
            config = replace(LIMITS, packages_dir=packages)
            assert sandbox_available(config) == f"the sandbox's packages folder {packages} is not there"
            packages.mkdir(mode=0o755)
            assert sandbox_available(config) is None
        finally:
            shutil.rmtree(base)

    def test_a_slot_is_free_again_after_its_sandbox_is_killed(self) -> None:
        one = PythonSandbox(replace(LIMITS, uid_slots=1, slot_wait_s=5.0, sample_timeout_s=0.5))
        source = "import os, time\ndef grade(sample, item):\n    os.fork()\n    time.sleep(3600)\n"
        assert [r.kind for r in run(one, source, [{}])] == ["timeout"]
        assert slot_processes() == []
        assert [r.score for r in run(one, "def grade(s, i):\n    return 1.0\n", [{}])] == [1.0]

    def test_the_sandbox_dies_with_the_service(self, tmp_path: Path) -> None:
        # A service killed outright (SIGKILL: no cleanup of its own) leaves no sandbox behind (--die-with-parent).
        script = tmp_path / "service.py"
        script.write_text(
            "import sys\n"
            f"sys.path.insert(0, {str(REPO)!r})\n"
            "from trainer.grading.sandbox import PythonSandbox, SandboxConfig\n"
            f"s = PythonSandbox(SandboxConfig(sample_timeout_s=60, uid_base={LIMITS.uid_base}))\n"
            "print('grading', flush=True)\n"
            "s.grade_batch('import time\\ndef grade(a, b):\\n    time.sleep(3600)\\n', [{}], [{}])\n"
        )
        service = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
        assert service.stdout is not None and service.stdout.readline() == "grading\n"
        deadline = time.monotonic() + 10
        while not slot_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert slot_processes(), "the sandbox did not start"
        os.kill(service.pid, signal.SIGKILL)
        service.wait()
        deadline = time.monotonic() + 5
        while slot_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert slot_processes() == []


class TestCgroupCleanup:
    """What a sandbox leaves in its slot's cgroups is killed with the slot: none of it counts against the memory and
    process bounds of the slot's next sandbox (the cgroups of this host, where it has them: v1 as root here)."""

    @staticmethod
    def config(tmp_path: Path) -> SandboxConfig:
        config = replace(LIMITS, uid_base=61990, uid_slots=1, slot_dir=tmp_path / "slots")
        bound = sandbox_module.memory_bound(config)
        assert bound.version is not None, bound.reason  # the cgroups tested here
        return config

    @staticmethod
    def stray(group: Any) -> subprocess.Popen[bytes]:
        """A process and its child in the slot's groups that nothing ends."""
        argv = group.enter_argv(["/bin/sh", "-c", "sleep 3600 & wait"])
        return subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def test_a_released_slot_kills_its_leftovers_and_the_next_sandbox_starts_clean(self, tmp_path: Path) -> None:
        config = self.config(tmp_path)
        with sandbox_module._uid_slot(config) as slot:
            assert slot.group is not None
            stray = self.stray(slot.group)
            while len(slot.group.procs[0].read_text().split()) < 2:  # the shell and its sleep
                time.sleep(0.01)
        try:
            assert stray.wait(timeout=5) == -signal.SIGKILL
        finally:
            stray.kill()
            slot.group.remove()  # its sleep too, where the slot left it
        assert [d.exists() for d in slot.group.dirs] == [False] * len(slot.group.dirs)
        with sandbox_module._uid_slot(config) as again:
            assert again.group is not None and again.uid == slot.uid
            assert [p.read_text().split() for p in again.group.procs] == [[]] * len(again.group.procs)

    def test_a_group_left_by_a_dead_holder_is_emptied_before_it_is_reused(self, tmp_path: Path) -> None:
        config = self.config(tmp_path)
        bound = sandbox_module.memory_bound(config)
        group = sandbox_module.cgroups.make_group(bound, 61991, memory_bytes=64 << 20, processes=8)
        assert group is not None
        stray = self.stray(group)  # as if its holder had died without releasing the slot
        try:
            while not group.procs[0].read_text().split():
                time.sleep(0.01)
            again = sandbox_module.cgroups.make_group(bound, 61991, memory_bytes=64 << 20, processes=8)
            assert again is not None and [p.read_text().split() for p in again.procs] == [[]] * len(again.procs)
            assert stray.wait(timeout=5) == -signal.SIGKILL
            again.remove()
            assert not any(d.exists() for d in again.dirs)
        finally:
            stray.kill()
            group.remove()
