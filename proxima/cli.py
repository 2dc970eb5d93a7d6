"""``proxima``, the console script: every command of the service and of the trainer on one typer app.

The service's commands come from ``api.cli`` (keys, database, REST clients: the API package alone) and
``proxima.serve`` (the API with a worker and the inference server), the demo from ``proxima.demo``. The trainer's
local commands (train, eval, models, datasets) are ``trainer.cli``'s; they import torch, so they are loaded only when
one of them is run or listed: the API process that ``proxima serve`` runs, and the REST clients, never import torch.
"""

from __future__ import annotations

import functools
import sys
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from api.cli import console, db_app, files_app, jobs_app, keys_app
from proxima.demo import demo
from proxima.serve import inference, serve, worker

TRAINER_COMMANDS = ("train", "eval", "models", "datasets")


@functools.cache
def _trainer_commands() -> TyperGroup:
    """``trainer.cli``'s commands (importing it imports torch)."""
    from trainer.cli import app as trainer_app

    group = typer.main.get_command(trainer_app)
    assert isinstance(group, TyperGroup)
    return group


class _Commands(TyperGroup):
    """The service's commands, and the trainer's taken from ``trainer.cli`` when one is run or listed."""

    def list_commands(self, ctx: typer.Context) -> list[str]:  # type: ignore[override]
        return [*TRAINER_COMMANDS, *super().list_commands(ctx)]

    def get_command(self, ctx: typer.Context, cmd_name: str) -> Any:  # type: ignore[override]
        if cmd_name in TRAINER_COMMANDS:
            return _trainer_commands().get_command(ctx, cmd_name)
        return super().get_command(ctx, cmd_name)


app = typer.Typer(
    cls=_Commands,
    help="Proxima: reinforcement-learning fine-tuning of language models with LoRA.",
    no_args_is_help=True,
)


@app.callback()
def _setup(ctx: typer.Context) -> None:
    if ctx.invoked_subcommand in TRAINER_COMMANDS and (callback := _trainer_commands().callback) is not None:
        callback()  # the trainer's own set-up (quieter libraries), as when its group runs them
    if ctx.invoked_subcommand in ("train", "eval"):
        # The deployment's judge, embeddings endpoint and URL policy (PROXIMA_JUDGE_*, PROXIMA_EMBEDDINGS_*,
        # PROXIMA_GRADER_*), as a worker hands them to its trainer: score_model, label_model, endpoint and cosine
        # graders grade the same way locally.
        from api.services.graders import remote_config
        from api.settings import get_settings
        from trainer.grading.remote_process import configure_remote

        configure_remote(remote_config(get_settings()))


tools_app = typer.Typer(help="Built-in tool servers for agent jobs.", no_args_is_help=True)


@tools_app.command("calculator")
def tools_calculator(
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port")] = 8765,
    latency_ms: Annotated[
        float, typer.Option(help="wait this long before every answer (to try slow tools; at most 60,000)")
    ] = 0.0,
) -> None:
    """The calculator tool server (OpenAI agent RFT's function_call → function_call_output at POST /), the tool of
    tiny-calc's agent task; in the foreground until interrupted. A job's tool entry: {"name": "calculator",
    "server_url": "http://HOST:PORT/"}."""
    from trainer.agents import calculator_server

    if not 0 <= latency_ms <= calculator_server.MAX_LATENCY_S * 1000:
        console.print(f"[red]error:[/red] --latency-ms must be in 0..{calculator_server.MAX_LATENCY_S * 1000:g}")
        raise typer.Exit(2)
    print(f"calculator tool at http://{host}:{port}/", flush=True)
    calculator_server.serve(host, port, latency_ms / 1000)


# The order of `proxima --help`: the trainer's commands, then these, then the groups.
for command in (worker, inference, serve, demo):
    app.command()(command)
app.add_typer(files_app, name="files")
app.add_typer(jobs_app, name="jobs")
app.add_typer(keys_app, name="keys")
app.add_typer(db_app, name="db")
app.add_typer(tools_app, name="tools")


def main() -> None:  # pragma: no cover
    sys.exit(app())


if __name__ == "__main__":  # pragma: no cover
    main()
