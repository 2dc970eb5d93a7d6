"""One settings object (pydantic-settings, prefix ``PROXIMA_``), read through a cached function that tests override.

Unset backends fall back to embedded ones computed here: a SQLite file, a broker that needs no server (kombu's
SQLAlchemy transport on a second SQLite file) and a local artifact folder, all under ``PROXIMA_HOME``.

``PROXIMA_DATABASE_URL`` may be the plain ``postgresql://`` (or ``postgres://``) URL a provider prints: it is read as
psycopg2's (``api.db.driver_url``). Its time limits are libpq parameters of that URL (``api.db``).
"""

from __future__ import annotations

import ipaddress
from functools import lru_cache
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
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
    stop_grace_s: float = Field(
        60.0,
        gt=0,
        le=86_400,
        description="seconds a trainer asked to stop (cancel, pause) has before it is terminated, then killed",
    )
    run_migrations: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "warning", description="of `proxima serve`'s log on stderr; `info` adds a line per request"
    )
    slow_request_ms: float = Field(
        1000.0, gt=0, description="a request that takes longer is logged as a warning, with its request id"
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)

    # Remote graders (README, "Graders"): the judge of score_model and label_model graders, the embeddings of
    # text_similarity's cosine, and what endpoint graders may call. A tenant names a judge model, never a URL.
    judge_base_url: str | None = Field(
        None, description="an OpenAI-compatible API (`https://…/v1`) whose chat completions judge model graders"
    )
    judge_api_key: SecretStr | None = None
    judge_models: dict[str, str] = Field(
        default_factory=dict,
        description="the judge models a grader's `model` may name, each mapped to the name the judge API knows, as "
        'JSON: {"gpt-4o-mini": "gpt-4o-mini-2024-07-18"}',
    )
    judge_max_calls_per_job: int = Field(
        100_000, ge=0, description="judge requests one attempt at a job may make (retries count); then it fails"
    )
    embeddings_base_url: str | None = Field(
        None, description="an OpenAI-compatible API (`https://…/v1`) whose embeddings score text_similarity's cosine"
    )
    embeddings_api_key: SecretStr | None = None
    embeddings_model: str | None = None
    grader_url_schemes: list[Literal["http", "https"]] = Field(
        ["https"], min_length=1, description="the schemes an endpoint grader's URL may use"
    )
    grader_url_allow_networks: list[str] = Field(
        default_factory=list,
        description="networks (CIDR) an endpoint grader may call although they are not public (loopback, private, "
        "link-local, reserved: all refused by default)",
    )
    grader_url_deny_networks: list[str] = Field(
        default_factory=list, description="networks (CIDR) an endpoint grader may never call, whatever else allows"
    )
    grader_http_timeout_s: float = Field(
        60.0, gt=0, description="the time limit of one request to a judge, an endpoint grader or embeddings"
    )
    grader_http_max_retries: int = Field(3, ge=0, le=10, description="retries of a request that timed out or got 5xx")
    grader_http_concurrency: int = Field(
        16, ge=1, le=1024, description="requests a trainer has in flight at once to each grading service"
    )

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

    @field_validator("judge_base_url", "embeddings_base_url")
    @classmethod
    def _api_url(cls, v: str | None) -> str | None:
        if v is not None and (urlsplit(v).scheme not in ("http", "https") or not urlsplit(v).hostname):
            raise ValueError("not an http(s) URL (expected e.g. https://api.openai.com/v1)")
        return v

    @field_validator("grader_url_allow_networks", "grader_url_deny_networks")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        for network in v:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                raise ValueError(f"{network!r} is not an IP network (expected e.g. 10.1.0.0/16 or ::1/128)") from None
        return v

    @model_validator(mode="after")
    def _embeddings_model(self) -> Settings:
        if self.embeddings_base_url is not None and not self.embeddings_model:
            raise ValueError("PROXIMA_EMBEDDINGS_MODEL is required with PROXIMA_EMBEDDINGS_BASE_URL")
        return self

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
