"""PROXIMA_SANDBOX_PACKAGES and PROXIMA_SANDBOX_MEMORY_BYTES: the python sandboxes' packages folder and whole-sandbox
memory bound, checked at start (a folder the sandboxes cannot use fails naming the variable), and the SandboxConfig
every sandbox of the deployment gets (`api.services.graders.sandbox_config`)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from pydantic import ValidationError

from api.services.graders import SANDBOX, sandbox_config
from api.settings import Settings
from trainer.grading import sandbox as sandbox_module
from trainer.grading.sandbox import BUILT_PACKAGES, SandboxConfig


def settings(monkeypatch: pytest.MonkeyPatch, **env: str) -> Settings:
    for name, value in env.items():
        monkeypatch.setenv(f"PROXIMA_{name.upper()}", value)
    return Settings()


class TestPackagesSetting:
    def test_unset_is_the_checkouts_built_folder(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv("PROXIMA_SANDBOX_PACKAGES", raising=False)
        assert Settings().sandbox_packages == (BUILT_PACKAGES if BUILT_PACKAGES.is_dir() else None)

    def test_empty_is_the_standard_library_only(self, monkeypatch: pytest.MonkeyPatch) -> None:
        assert settings(monkeypatch, sandbox_packages="").sandbox_packages is None

    def test_a_folder_that_is_not_there_fails_naming_the_variable(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        with pytest.raises(ValidationError, match=f"PROXIMA_SANDBOX_PACKAGES: {tmp_path / 'nope'} is not there"):
            settings(monkeypatch, sandbox_packages=str(tmp_path / "nope"))

    def test_a_folder_the_sandboxes_uids_cannot_read_fails_naming_the_variable(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        private = tmp_path / "private"
        private.mkdir(mode=0o700)
        with pytest.raises(ValidationError, match=r"PROXIMA_SANDBOX_PACKAGES: \S+ is not readable by every uid"):
            settings(monkeypatch, sandbox_packages=str(private))

    def test_an_unusable_built_folder_is_no_default_saying_why_but_set_it_fails_naming_the_variable(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A checkout under a folder only its owner can search (/root): its built folder is there, but no sandbox's uid
        can reach it, so that mounting it would refuse every python grader."""
        private = tmp_path / "root"
        built = private / "checkout" / "build" / "sandbox-packages"
        built.mkdir(parents=True)
        private.chmod(0o700)
        monkeypatch.setattr(sandbox_module, "BUILT_PACKAGES", built)
        monkeypatch.delenv("PROXIMA_SANDBOX_PACKAGES", raising=False)
        with caplog.at_level(logging.WARNING, logger="proxima.sandbox"):
            assert Settings().sandbox_packages is None
        assert f"the checkout's built packages cannot be mounted ({private}, above {built}, cannot be searched" in (
            caplog.text
        )
        with pytest.raises(
            ValidationError, match=rf"PROXIMA_SANDBOX_PACKAGES: {private}, above \S+, cannot be searched"
        ):
            settings(monkeypatch, sandbox_packages=str(built))

    def test_a_relative_path_fails_naming_the_variable(self, monkeypatch: pytest.MonkeyPatch) -> None:
        with pytest.raises(ValidationError, match="PROXIMA_SANDBOX_PACKAGES: build is not an absolute path"):
            settings(monkeypatch, sandbox_packages="build")

    def test_a_memory_bound_under_64_mib_is_refused(self, monkeypatch: pytest.MonkeyPatch) -> None:
        with pytest.raises(ValidationError, match="sandbox_memory_bytes"):
            settings(monkeypatch, sandbox_memory_bytes=str(1 << 20))


class TestSandboxConfig:
    def test_every_sandbox_gets_the_folder_and_the_bound_with_its_own_limits(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        s = settings(monkeypatch, sandbox_packages="/usr/lib", sandbox_memory_bytes=str(1 << 30))
        training, dry_run = sandbox_config(s), sandbox_config(s, dry_run=True)
        assert training == SandboxConfig(packages_dir=Path("/usr/lib"), memory_bytes=1 << 30)
        assert dry_run == SandboxConfig(
            packages_dir=Path("/usr/lib"),
            memory_bytes=1 << 30,
            sample_timeout_s=SANDBOX.sample_timeout_s,
            startup_timeout_s=SANDBOX.startup_timeout_s,
            cpu_seconds=SANDBOX.cpu_seconds,
        )
