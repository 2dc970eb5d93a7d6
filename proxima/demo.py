"""``proxima demo``: the README's main job end to end on the embedded default, in five named stages.

It installs tiny-arith, starts ``proxima serve`` on a free port, uploads the datasets, creates a GRPO job over REST,
follows it live, downloads the adapter and compares base and trained accuracy. The trainer (torch) is imported in
the stages that use it, so that ``proxima``'s other commands start without it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from api.cli import Client, console, download_adapter, follow_job
from api.settings import get_settings
from api.status import JobStatus
from proxima.serve import free_port


class Stages:
    """The demo's stages, each named with how long it takes here before it starts and how long it took after: plain
    lines, which read the same in a terminal and in a log."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.started = time.monotonic()

    @contextlib.contextmanager
    def stage(self, name: str, expected: str) -> Iterator[None]:
        self.done += 1
        console.print(f"[bold][{self.done}/{self.total}] {name}[/bold] ({expected})", highlight=False)
        began = time.monotonic()
        yield
        console.print(f"      done in {time.monotonic() - began:.1f} s", highlight=False)

    def finish(self) -> None:
        console.print(f"[bold]demo done in {time.monotonic() - self.started:.0f} s[/bold]", highlight=False)


# What the demo trains: GRPO on the tiny-arith task (what the README's figures are of).
DEMO_GRADER = {
    "type": "string_check",
    "name": "accuracy",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}


def demo_job(files: dict[str, str], steps: int) -> dict[str, Any]:
    hp = {"max_steps": steps, "batch_size": 8, "group_size": 8, "learning_rate": 3e-4, "beta": 0.04,
          "max_completion_tokens": 8, "eval_interval": 10, "checkpoint_interval": 10}  # fmt: skip
    return {
        "model": "tiny-arith",
        "training_file": files["train"],
        "validation_file": files["validation"],
        "suffix": "demo",
        "seed": 0,
        "method": {"type": "grpo", "grpo": {"grader": DEMO_GRADER, "hyperparameters": hp}},
    }


def demo(
    workdir: Annotated[Path, typer.Option(help="where the demo writes its data and downloads")] = Path("runs/demo"),
    steps: Annotated[int, typer.Option(help="training steps")] = 40,
) -> None:
    """The main job end to end on the embedded default: install tiny-arith, start the service, upload the dataset,
    create a GRPO job over REST, follow it live, download the adapter, compare base and trained accuracy."""
    from trainer.builtin_models import tiny_arith
    from trainer.cli import install_builtin

    stages = Stages(5)
    console.print(f"Proxima's demo: GRPO teaches tiny-arith to carry, on this machine, in {steps} steps")
    with stages.stage("base model", "under a second: the shipped build, copied and checked"):
        install_builtin(tiny_arith.MODEL_NAME)
    data = workdir / "data"
    tiny_arith.write_arithmetic_datasets(data)
    with stages.stage("starting the service", "a few seconds: the API, a worker and the inference server"):
        server, base = _start_demo_server(workdir)
    c: Client | None = None
    try:
        c = Client(base, None)
        with stages.stage("uploading the datasets", "a second"):
            files = {name: _upload(c, data / f"{name}.jsonl") for name in ("train", "validation")}
        expected = f"about {max(5, steps // 3)} s on 2 cores with fast bf16 matmuls, up to twice that in fp32"
        with stages.stage(f"training: GRPO, {steps} steps of 8 prompts × 8 samples", expected):
            job = _train(c, files, steps)
        with stages.stage("evaluating the downloaded adapter", "a few seconds"):
            _evaluate_demo(c, job, workdir, data)
    finally:
        if c is not None:
            c.http.close()
        _stop(server)
    stages.finish()


def _train(c: Client, files: dict[str, str], steps: int) -> dict[str, Any]:
    """The demo's job created and followed until it ends; a job that did not succeed ends the demo (exit 1)."""
    job = c.json("POST", "/fine_tuning/jobs", json=demo_job(files, steps))
    console.print(f"      created {job['id']}; its steps as they finish:")
    job = follow_job(c, job["id"])
    if job["status"] != JobStatus.SUCCEEDED:
        console.print(f"[red]job {job['status']}[/red]: {job.get('error')}")
        raise typer.Exit(1)
    console.print(f"      fine-tuned model {job['fine_tuned_model']}")
    return job


def _start_demo_server(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``proxima serve`` on a free port, its output in ``workdir/server.log``; once it is ready, with its URL."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, "PROXIMA_PORT": str(port)}
    with (workdir / "server.log").open("w") as log:
        server = subprocess.Popen([sys.executable, "-m", "proxima.cli", "serve"], env=env, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            _stop(server)
            console.print(f"[red]error:[/red] the server did not start; see {workdir / 'server.log'}")
            raise typer.Exit(2)
        time.sleep(0.5)
    console.print(f"      up at {base} (embedded SQLite, broker and artifact folder under {get_settings().home})")
    return server, base


def _stop(server: subprocess.Popen[bytes]) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()


def _upload(c: Client, path: Path) -> str:
    with path.open("rb") as f:
        file_id: str = c.json("POST", "/files", files={"file": (path.name, f)}, data={"purpose": "fine-tune"})["id"]
    console.print(f"      {path.name}: {file_id}")
    return file_id


def _evaluate_demo(c: Client, job: dict[str, Any], workdir: Path, data: Path) -> None:
    """The downloaded adapter loaded with PEFT here against the base, then both asked one question over chat."""
    archive = download_adapter(c, job["id"], workdir / "adapter.tar.gz")
    adapter_dir = workdir / "adapter"
    with tarfile.open(archive) as tar:
        tar.extractall(adapter_dir, filter="data")
    base_acc, trained_acc = _accuracy_with_and_without(adapter_dir, data / "validation.jsonl", DEMO_GRADER)
    console.print(
        f"      validation greedy accuracy (the adapter in {adapter_dir}, loaded with PEFT here): "
        f"base {base_acc:.3f} → trained {trained_acc:.3f}"
    )
    question = "What is 57 + 68?"  # a carry: tiny-arith's base model tends to drop it (15)
    for model in ("tiny-arith", job["fine_tuned_model"]):
        body = {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0}
        r = c.http.post("/chat/completions", json=body)
        said = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else f"(HTTP {r.status_code})"
        console.print(f"      chat completion of {model}: {question} → {said}")


def _accuracy_with_and_without(adapter_dir: Path, data: Path, grader_obj: dict[str, Any]) -> tuple[float, float]:
    """Greedy mean reward of tiny-arith alone and with the adapter (``PeftModel.from_pretrained``)."""
    from transformers.utils import logging as hf_logging

    from trainer.builtin_models import tiny_arith
    from trainer.cli import resolve_model
    from trainer.generation.encoding import encode_prompts
    from trainer.generation.models import (
        default_device,
        load_adapter,
        load_base_model,
        load_tokenizer,
        resolve_precision,
    )
    from trainer.loops.evaluate import evaluate
    from trainer.spec import graders
    from trainer.spec.data import load_prompts

    hf_logging.disable_progress_bar()  # the loading bar of 38 small tensors says nothing
    g = graders.parse_grader(grader_obj)
    items = load_prompts(data, grader=g)
    path = resolve_model(tiny_arith.MODEL_NAME)
    tok = load_tokenizer(path)
    prompts = encode_prompts(tok, items, max_prompt_tokens=1_000)
    device = default_device()
    precision = resolve_precision("auto", device)
    model = load_adapter(load_base_model(path, device), adapter_dir)
    trained = evaluate(model, tok, prompts, items, g, max_new_tokens=8, precision=precision).mean_reward
    with model.disable_adapter():
        base = evaluate(model, tok, prompts, items, g, max_new_tokens=8, precision=precision).mean_reward
    return base, trained
