"""One settings object (pydantic-settings, prefix ``PROXIMA_``), read through a cached function that tests override.

Unset backends fall back to embedded ones computed here: a SQLite file, a broker that needs no server (kombu's
SQLAlchemy transport on a second SQLite file) and a local artifact folder, all under ``PROXIMA_HOME``.

``PROXIMA_DATABASE_URL`` may be the plain ``postgresql://`` (or ``postgres://``) URL a provider prints: it is read as
psycopg2's (``api.db.driver_url``). Its time limits are libpq parameters of that URL (``api.db``).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.exc import ArgumentError

from api.db import driver_url


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PROXIMA_", extra="ignore")

    home: Path = Field(default_factory=lambda: Path.home() / ".proxima")
    database_url: str | None = None
    broker_url: str | None = None
    artifacts: str | None = None
    s3_endpoint_url: str | None = None
    base_models: list[str] = Field(default_factory=lambda: ["tiny-arith"])
    max_upload_bytes: int = Field(512 * 1024 * 1024, gt=0, description="the largest file `POST /v1/files` takes")
    max_request_bytes: int = Field(
        1024 * 1024, gt=0, description="the largest body of any other request (job specs, grader dry-runs)"
    )
    lease_seconds: float = Field(30.0, gt=0, description="a worker's claim on a job expires after this")
    run_migrations: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "warning", description="of `proxima serve`'s log on stderr; `info` adds a line per request"
    )
    slow_request_ms: float = Field(
        1000.0, gt=0, description="a request that takes longer is logged as a warning, with its request id"
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)

    @field_validator("home")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser()

    @field_validator("database_url")
    @classmethod
    def _driver(cls, v: str | None) -> str | None:
        try:
            return driver_url(v) if v else v
        except ArgumentError:
            raise ValueError("not a database URL (expected e.g. postgresql://user:password@host:5432/db)") from None

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'proxima.db'}"

    @property
    def celery_broker_url(self) -> str:
        return self.broker_url or f"sqla+sqlite:///{self.home / 'broker.db'}"

    @property
    def artifacts_url(self) -> str:
        return self.artifacts or str(self.home / "artifacts")

    @property
    def model_store(self) -> Path:
        return self.home / "models"

    @property
    def embedded(self) -> bool:
        return self.database_url is None and self.broker_url is None


@lru_cache
def get_settings() -> Settings:
    return Settings()
