"""docker-compose.yml and the Dockerfile: Docker is not available here, so check what can be checked."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml
from typer.testing import CliRunner

from proxima.cli import app

REPO = Path(__file__).resolve().parents[2]


def _proxima_commands(command: list[str] | str) -> list[list[str]]:
    """Every `proxima ...` invocation inside a compose command (plain list or `sh -c "a && b"`)."""
    if isinstance(command, str):
        command = shlex.split(command)
    parts = [shlex.split(p) for p in command[2].split("&&")] if command[:2] == ["sh", "-c"] else [command]
    return [p[1:] for p in parts if p and p[0] == "proxima"]


def test_compose_has_the_services_and_every_command_exists() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "redis", "api", "models-init", "worker"} <= set(services)
    assert services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert services["worker"]["depends_on"]["models-init"] == {"condition": "service_completed_successfully"}
    runner = CliRunner()
    seen = 0
    for name in ("api", "models-init", "worker"):
        for argv in _proxima_commands(services[name]["command"]):
            words = [w for w in argv if not w.startswith("-")][:2]
            # `proxima db upgrade`, `proxima serve`, `proxima worker`, `proxima models build ...`
            path = words[:2] if words and words[0] in ("db", "models", "keys", "files", "jobs") else words[:1]
            result = runner.invoke(app, [*path, "--help"])
            assert result.exit_code == 0, (name, argv, result.output)
            seen += 1
    assert seen >= 4
    env = compose["x-proxima-env"]
    assert env["PROXIMA_DATABASE_URL"].startswith("postgresql") and env["PROXIMA_BROKER_URL"].startswith("redis://")


def test_the_api_runs_the_torch_free_image_and_the_workers_the_trainers() -> None:
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    targets = {name: services[name]["build"]["target"] for name in ("api", "models-init", "worker")}
    assert targets == {"api": "api", "models-init": "worker", "worker": "worker"}
    stages = [line.split()[-1] for line in (REPO / "Dockerfile").read_text().splitlines() if line.startswith("FROM ")]
    assert stages == ["api", "worker"]
    assert "models" not in services["api"]["command"][-1]  # building a model needs torch: the worker image's job


def test_dockerfile_copies_paths_that_exist() -> None:
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (REPO / src).exists(), src
