"""The packages of OpenAI's python grader image in the sandbox: the folder `make sandbox-packages` builds
(sandbox-requirements.txt), importable by python graders and environments wherever the process's sandbox is configured
(`configure_sandbox`: the worker's trainer, `proxima train/eval`), and a package that is not there failing as it does
on OpenAI. Real sandboxes, as in test_sandbox.py: where the sandbox cannot start, or the folder is not built, every test
here fails saying why (`make test` builds it); none is skipped."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from tests.unit.trainer.test_environment import Call
from trainer import cli
from trainer.agents.tools import PythonEnvironmentExecutor
from trainer.grading.graders import python_grade_error
from trainer.grading.sandbox import (
    BUILT_PACKAGES,
    PythonSandbox,
    SandboxConfig,
    configure_sandbox,
    configured_sandbox,
    default_packages_dir,
    sandbox_available,
)
from trainer.loops.evaluate import GraderMonitor, grade_batch
from trainer.spec import graders
from trainer.spec import metrics as M
from trainer.spec.agent_spec import EnvironmentSpec
from trainer.spec.callbacks import BaseCallback
from trainer.spec.data import PromptItem
from worker.runner import configure_sandbox_of, write_sandbox_file

pytestmark = pytest.mark.alone  # sandboxes' time limits: under pytest-xdist, no other test beside them

PACKAGES = SandboxConfig(packages_dir=BUILT_PACKAGES, sample_timeout_s=10.0, startup_timeout_s=30.0)
MEAN = "import numpy as np\n\ndef grade(sample, item):\n    return np.mean(item['values'])\n"
TENSORFLOW = "import tensorflow as tf\n\ndef grade(sample, item):\n    return 1.0\n"
NO_TENSORFLOW = "ModuleNotFoundError: No module named 'tensorflow'"


@pytest.fixture(scope="module", autouse=True)
def available() -> None:
    if not BUILT_PACKAGES.is_dir():
        pytest.fail(f"the sandbox's packages are not built at {BUILT_PACKAGES}: run `make sandbox-packages`")
    reason = sandbox_available(PACKAGES)
    if reason is not None:
        pytest.fail(f"the python grader's sandbox is unavailable here: {reason} (`make test` installs bubblewrap)")


@pytest.fixture
def configured() -> Iterator[None]:
    """This process's sandboxes with the packages, as a worker's trainer has them; the defaults again after."""
    before = configured_sandbox()
    configure_sandbox(PACKAGES)
    yield
    configure_sandbox(before)


def grade(source: str, items: list[dict[str, Any]]) -> list[tuple[float, str | None]]:
    results = PythonSandbox(PACKAGES).grade_batch(source, [{"output_text": ""}] * len(items), items)
    return [(r.score, r.kind) for r in results]


class TestPackages:
    def test_a_numpy_grader_scores_the_mean_of_the_item_values(self) -> None:
        items: list[dict[str, Any]] = [{"values": [1, 2, 4]}, {"values": [0.5, 1.5]}, {"values": [-3, 3, 9, 11]}]
        assert grade(MEAN, items) == [(7 / 3, None), (1.0, None), (5.0, None)]

    def test_every_package_of_openais_image_imports(self) -> None:
        modules = [
            "numpy", "scipy.stats", "sympy", "pandas", "rapidfuzz", "sklearn.linear_model", "rouge_score.rouge_scorer",
            "deepdiff", "jsonschema", "pydantic", "yaml", "nltk", "sqlparse",
        ]  # fmt: skip
        source = (
            "import importlib\n\n"
            "def grade(sample, item):\n"
            "    return sum(importlib.import_module(name) is not None for name in item['modules'])\n"
        )
        items: list[dict[str, Any]] = [{"modules": modules}]
        assert grade(source, items) == [(13.0, None)]

    def test_the_packages_compute_as_they_do_anywhere(self) -> None:
        source = (
            "from rapidfuzz import fuzz\n"
            "import pandas as pd\n"
            "import sympy\n\n"
            "def grade(sample, item):\n"
            "    frame = pd.DataFrame({'x': item['x']})\n"
            "    root = sympy.solve(sympy.Symbol('z') * 2 - 6)[0]\n"
            "    return frame['x'].sum() + float(root) + fuzz.ratio('abcd', 'abce') / 100\n"
        )
        assert grade(source, [{"x": [1, 2, 3]}]) == [(6 + 3 + 0.75, None)]

    def test_a_package_that_is_not_there_is_a_runtime_error_with_the_import_error(self) -> None:
        [result] = PythonSandbox(PACKAGES).grade_batch(TENSORFLOW, [{}], [{}])
        assert (result.score, result.kind) == (0.0, "invalid_source") and result.kind is not None
        assert result.error is not None and result.error.endswith(NO_TENSORFLOW)
        error = python_grade_error("tf", result.kind, result.error)
        assert (error.kind, error.cause) == ("python_runtime", "invalid_source")  # OpenAI's runtime error
        assert NO_TENSORFLOW in error

    def test_the_checkouts_built_folder_is_the_default(self) -> None:
        assert default_packages_dir() == BUILT_PACKAGES


@pytest.mark.usefixtures("configured")
class TestConfiguredProcess:
    def test_a_training_step_grades_with_the_packages(self) -> None:
        grader = graders.parse_grader({"type": "python", "name": "mean", "source": MEAN})
        items = [PromptItem(messages=[], item={"values": [1, 2, 4]}), PromptItem(messages=[], item={"values": [2]})]
        scores = grade_batch(grader, ["a", "b"], items)
        assert scores.rewards.tolist() == torch.tensor([7 / 3, 2.0]).tolist()  # float32 of the exact means
        assert scores.errors == [(), ()]

    def test_an_import_of_what_is_not_there_is_the_jobs_error_rate_and_event(self) -> None:
        events: list[tuple[str, str, dict[str, Any]]] = []

        class Recorder(BaseCallback):
            def on_event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
                events.append((level, message, data or {}))

        grader = graders.parse_grader({"type": "python", "name": "tf", "source": TENSORFLOW})
        monitor = GraderMonitor(Recorder(), grader)
        monitor.observe(grade_batch(grader, ["a", "b"], [PromptItem(messages=[])] * 2))
        assert monitor.metrics() == {M.GRADER_ERROR_RATE: 1.0}
        monitor.end_step(1)
        [(level, message, data)] = events
        assert level == "warn" and NO_TENSORFLOW in message
        assert data == {"step": 1, "kind": "python_runtime", "cause": "invalid_source", "count": 2, "samples": 2}

    def test_an_environment_imports_the_packages(self) -> None:
        source = (
            "import numpy as np\n\n"
            "def reset(item):\n"
            "    return None\n\n"
            "def step(tool_call):\n"
            "    return str(np.median([3, 1, 2, 10])), True\n"
        )
        with PythonEnvironmentExecutor(EnvironmentSpec(type="python", name="np", source=source)) as executor:
            executor.start({}, "trace_a", [])
            result = executor.call(Call("median"), None, item={}, trace_id="trace_a")
            executor.finish("trace_a")
        assert (result.output, result.error, result.done) == ("2.5", None, True)


class TestWorkerHandOff:
    def test_the_run_folders_sandbox_is_the_trainers(self, tmp_path: Path) -> None:
        config = replace(PACKAGES, memory_bytes=768 << 20)
        write_sandbox_file(tmp_path, config)
        assert json.loads((tmp_path / "sandbox.json").read_text())["packages_dir"] == str(BUILT_PACKAGES)
        before = configured_sandbox()
        try:
            configure_sandbox_of(tmp_path)
            assert configured_sandbox() == config
        finally:
            configure_sandbox(before)

    def test_an_unknown_field_is_refused_by_name(self) -> None:
        with pytest.raises(ValueError, match="not fields of SandboxConfig: packages"):
            SandboxConfig.from_json({"packages": "/x"})


class TestCommandLine:
    def test_a_folder_the_sandboxes_cannot_use_is_a_usage_error_naming_the_option(self, tmp_path: Path) -> None:
        args = ["eval", "--model", "m", "--data", "d.jsonl", "--grader", "g.json"]
        result = CliRunner().invoke(cli.app, [*args, "--sandbox-packages", str(tmp_path / "nope")])
        said = "".join(result.output.replace("│", " ").split())  # rich's box, wrapped at the terminal's width
        assert result.exit_code == 2
        assert "--sandbox-packages" in said and f"{tmp_path / 'nope'}isnotthere" in said

    @pytest.mark.usefixtures("configured")
    @pytest.mark.parametrize("given", [None, BUILT_PACKAGES])
    def test_the_option_or_its_default_is_this_processs_packages(self, given: Path | None) -> None:
        configure_sandbox(SandboxConfig())
        cli.use_sandbox_packages(given)
        assert configured_sandbox() == SandboxConfig(packages_dir=BUILT_PACKAGES)
