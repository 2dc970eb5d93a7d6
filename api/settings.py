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
from trainer.grading.sandbox import default_packages_dir, packages_dir_problem


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PROXIMA_", extra="ignore")

    home: Path = Field(default_factory=lambda: Path.home() / ".proxima")
    database_url: str | None = None
    broker_url: str | None = None
    artifacts: str | None = None
    s3_endpoint_url: str | None = None
    base_models: list[str] = Field(default_factory=lambda: ["tiny-arith", "tiny-calc"])
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
    # --- the sandbox of python graders and python environments (trainer.grading.sandbox) ---
    sandbox_packages: Path | None = Field(
        default_factory=default_packages_dir,
        description="the folder of packages python graders and environments can import (built by "
        "trainer/grading/sandbox_packages/build: OpenAI's grader image's), mounted read-only in every sandbox; "
        "unset: the checkout's build/sandbox-packages (`make sandbox-packages`) when it is there and the sandboxes "
        "can read it, else none (with a warning saying why); "
        "empty: none (the standard library only)",
    )
    sandbox_memory_bytes: int = Field(
        2 << 30,
        ge=64 << 20,
        description="the memory of one sandbox as a whole, its processes and scratch /tmp together, where the host "
        "gives it a cgroup (trainer.grading.cgroups); each process is bounded to 2 GiB of address space besides",
    )
    # --- inference: `proxima inference` and the API's chat completions ---
    inference_url: str | None = Field(
        None,
        description="base URL of the inference server (`proxima inference`, or vLLM's OpenAI server), e.g. "
        "http://inference:8001; unset: `proxima serve` starts `proxima inference` beside the API",
    )
    inference_api_key: SecretStr | None = Field(
        None, description="a shared secret the API sends to the inference server as a bearer token"
    )
    inference_host: str = "127.0.0.1"
    inference_port: int = Field(8001, ge=1, le=65535, description="where `proxima inference` listens")
    inference_max_adapters: int = Field(
        8, ge=1, le=1024, description="LoRA adapters the inference server keeps loaded (least recently used leaves)"
    )
    inference_idle_unload_s: float = Field(
        900.0, gt=0, description="a model or adapter unused this long is unloaded by the inference server"
    )
    inference_max_batch: int = Field(
        16, ge=1, le=1024, description="requests for one base model the inference server decodes together"
    )
    inference_timeout_s: float = Field(
        300.0, gt=0, description="the API's limit on one request to the inference server"
    )
    inference_precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="of `proxima inference`'s models (auto: bf16 where matmuls run fast in it, as the trainer picks); "
        "fp32 gives the greedy completions of a job trained in fp32 exactly",
    )
    # --- the Tinker-compatible API: training sessions held by workers ---
    tinker_max_request_bytes: int = Field(
        64 * 1024 * 1024,
        gt=0,
        description="the largest body of a Tinker request (`/api/v1/`: forward_backward carries token batches)",
    )
    max_job_gpus: int = Field(
        1,
        ge=1,
        le=64,
        description="the most devices one job may ask for (`resources.gpus`): the largest worker's "
        "(`PROXIMA_WORKER_DEVICES`); a job asking for more is a 400",
    )
    worker_devices: int | None = Field(
        None,
        ge=1,
        le=64,
        description="devices this worker gives one job (one trainer rank each; on CPUs, processes): it takes jobs "
        "asking for up to this many. Default: the GPUs it sees (CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`), else 1",
    )
    worker_sessions: int = Field(
        1, ge=0, le=64, description="Tinker training sessions a worker holds at once, beside its jobs (`--concurrency`)"
    )
    session_idle_s: float = Field(
        300.0,
        gt=0,
        description="a session without requests this long is saved and unloaded; its next request reloads it",
    )
    session_autosave_steps: int = Field(
        1,
        ge=1,
        description="a session's state is saved to the artifact store every this many optimiser steps: what a session "
        "continues from when its worker dies",
    )
    session_precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="of a session's model (auto: bf16 where matmuls run fast in it, as the trainer picks)"
    )
    session_poll_s: float = Field(
        20.0, gt=0, le=40, description="how long `retrieve_future` holds a poll for a result before 'try again'"
    )
    # --- webhooks ---
    # An endpoint's URL obeys the endpoint graders' policy (grader_url_schemes, grader_url_allow_networks,
    # grader_url_deny_networks), checked when it is set and again, pinned to the checked address, at every delivery.
    webhook_timeout_s: float = Field(10.0, gt=0, le=300, description="the time limit of one webhook delivery")
    webhook_retry_base_s: float = Field(
        10.0, gt=0, description="the wait before a failed delivery's first retry; each next retry waits twice as long"
    )
    webhook_retry_max_delay_s: float = Field(3600.0, gt=0, description="the longest wait between two retries")
    webhook_retry_horizon_s: float = Field(
        86_400.0, gt=0, description="a delivery not accepted this long after its event is given up (recorded)"
    )
    webhook_poll_interval_s: float = Field(
        2.0, gt=0, description="how often each worker's delivery loop looks for deliveries that are due"
    )
    # --- experiment trackers: W&B and MLflow credentials come from the deployment, never from a job ---
    # A job's `integrations` name a project and a run; the workers export to the trackers configured here (the API
    # refuses a job that asks for one that is not). Read by the API (is it configured?) and the workers (export).
    wandb_api_key: SecretStr | None = Field(
        None, description="the W&B API key the workers log runs with; W&B integrations are accepted when it is set"
    )
    wandb_base_url: str | None = Field(
        None, description="a W&B server of your own (https://wandb.example.com); unset: W&B's cloud"
    )
    wandb_mode: Literal["online", "offline"] = Field(
        "online",
        description="offline: runs are written under wandb_dir only, for `wandb sync` later, and no key is needed "
        "(W&B integrations are accepted)",
    )
    wandb_dir: Path | None = Field(None, description="where W&B writes its local run files; unset: <home>/wandb")
    mlflow_tracking_uri: str | None = Field(
        None,
        description="the MLflow tracking server (http://mlflow:5000) or store (file:///srv/mlruns) the workers log "
        "runs to; MLflow integrations are accepted when it is set",
    )
    mlflow_tracking_token: SecretStr | None = Field(
        None, description="a bearer token for the MLflow server (MLflow's MLFLOW_TRACKING_TOKEN)"
    )
    tracker_queue_size: int = Field(
        1000,
        ge=1,
        le=1_000_000,
        description="exports (a step's metrics, a step's rollouts) a worker holds per tracker while the tracker is "
        "slow; beyond that they are dropped, with a warning event on the job",
    )
    tracker_close_timeout_s: float = Field(
        120.0, gt=0, le=3600, description="how long a worker waits at a job's end for its trackers to flush"
    )

    @field_validator("wandb_api_key", "mlflow_tracking_token", "wandb_base_url", "mlflow_tracking_uri", mode="before")
    @classmethod
    def _empty_is_unset(cls, v: object) -> object:
        return None if v == "" else v  # `VAR=` in a compose file or an env file: not configured

    @field_validator("sandbox_packages", mode="before")
    @classmethod
    def _no_packages(cls, v: object) -> object:
        return None if v == "" else v  # set but empty: the standard library only

    @field_validator("sandbox_packages")
    @classmethod
    def _packages_folder(cls, v: Path | None) -> Path | None:
        if v is not None and (problem := packages_dir_problem(v)) is not None:
            raise ValueError(f"PROXIMA_SANDBOX_PACKAGES: {problem} (build one with `make sandbox-packages`)")
        return v

    @field_validator("wandb_base_url", "mlflow_tracking_uri")
    @classmethod
    def _tracker_url(cls, v: str | None) -> str | None:
        if v is not None and not urlsplit(v).scheme:
            raise ValueError(
                "not a URL (expected e.g. https://wandb.example.com, http://mlflow:5000, file:///srv/mlruns)"
            )
        return v

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
