"""``proxima``: the command line. Training commands run the trainer locally, without the service."""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from trainer import builtin_models
from trainer.generation.models import ModelError
from trainer.grading.sandbox import configure_sandbox, configured_sandbox, default_packages_dir, packages_dir_problem
from trainer.spec import graders
from trainer.spec import metrics as M
from trainer.spec.callbacks import BaseCallback, Callbacks, JsonlFiles
from trainer.spec.config import JobSpec, SpecError, load_spec
from trainer.spec.data import DatasetError, load_prompts
from trainer.spec.names import BUILTIN_MODELS

app = typer.Typer(
    help="Proxima: reinforcement-learning fine-tuning of language models with LoRA.", no_args_is_help=True
)
models_app = typer.Typer(help="Base models this machine offers.", no_args_is_help=True)
datasets_app = typer.Typer(help="Built-in datasets.", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(datasets_app, name="datasets")

console = Console(stderr=True, soft_wrap=True)  # messages stay on one line: scripts grep them
# peft calls a transformers API that transformers 5 deprecates: not the user's concern.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
USER_ERRORS = (SpecError, DatasetError, ModelError, graders.GraderError)
SandboxPackages = Annotated[
    Path | None,
    typer.Option(
        help="the folder of packages python graders and environments import (as PROXIMA_SANDBOX_PACKAGES is the "
        "service's); default: this checkout's build/sandbox-packages (`make sandbox-packages`) when it is there, "
        "else the standard library only",
        show_default=False,
    ),
]


def use_sandbox_packages(packages: Path | None) -> None:
    """This process's python sandboxes import from `packages` (default_packages_dir() when None); a folder they
    cannot use is a usage error naming --sandbox-packages."""
    if packages is not None and (problem := packages_dir_problem(packages.absolute())) is not None:
        raise typer.BadParameter(problem, param_hint="--sandbox-packages")
    folder = packages.absolute() if packages is not None else default_packages_dir()
    configure_sandbox(replace(configured_sandbox(), packages_dir=folder))


def proxima_home() -> Path:
    return Path(os.environ.get("PROXIMA_HOME", Path.home() / ".proxima")).expanduser()


def model_store() -> Path:
    return proxima_home() / "models"


def resolve_model(name: str) -> str:
    """A name in the model store → its folder (a built-in model missing there is installed first); anything else (a
    local path or a hub id) is passed through."""
    local = model_store() / name
    if (local / "config.json").is_file():
        return str(local)
    if name in BUILTIN_MODELS:  # shipped with the project: installed on first use
        return str(install_builtin(name).path)
    return name


@app.callback()
def _quiet_libraries() -> None:
    """Our own progress bars say what is happening; transformers' weight-loading bars only add noise."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _fail(err: Exception) -> None:
    console.print(f"[red]error:[/red] {err}")
    raise typer.Exit(2)


class ProgressBar(BaseCallback):
    """A rich progress bar with step, reward and KL."""

    def __init__(self, progress: Progress, total: int, start: int = 0) -> None:
        self.progress = progress
        self.task = progress.add_task("training", total=total, completed=start, info="")

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if M.REWARD_MEAN in metrics or M.LOSS_TOTAL not in metrics:
            info = f"reward {metrics.get(M.REWARD_MEAN, 0.0):.3f}"
        else:  # reward_model, dpo, supervised: no sampled reward, a loss
            info = f"loss {metrics[M.LOSS_TOTAL]:.4f}"
        if M.PREFERENCE_ACCURACY in metrics:
            info += f"  acc {metrics[M.PREFERENCE_ACCURACY]:.3f}"
        if M.KL_MEAN in metrics:
            info += f"  kl {metrics[M.KL_MEAN]:.4f}"
        if M.VAL_REWARD_MEAN in metrics:
            info += f"  val {metrics[M.VAL_REWARD_MEAN]:.3f}"
        elif M.VAL_LOSS in metrics:
            info += f"  val loss {metrics[M.VAL_LOSS]:.4f}"
        self.progress.update(self.task, completed=step, info=info)

    def on_event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        if level != "info":
            self.progress.console.print(f"[yellow]{level}:[/yellow] {message}")


def run_training(spec: JobSpec, output: Path, *, resume: bool = False, quiet: bool = False) -> Any:
    """Run a spec locally with files under ``output`` and a progress bar; returns the trainer's RunResult."""
    from trainer.generation import distributed
    from trainer.loops import checkpoint
    from trainer.train import build_trainer

    world = distributed.from_environment()  # one rank of several when `train` relaunched itself (resources.gpus)
    distributed.initialise(world)
    spec = spec.model_copy(update={"model": resolve_model(spec.model)})
    latest = checkpoint.latest_checkpoint(output) if resume else None
    if not resume and output.exists() and checkpoint.list_checkpoints(output):
        raise SpecError(f"{output} already holds checkpoints: pass --resume to continue, or choose a new --output")
    if not world.main:  # rank 0 writes the files and shows the progress
        trainer = build_trainer(spec, output_dir=output, callback=BaseCallback(), world=world)
        result = trainer.run(resume=resume)
        distributed.shut_down()
        return result
    files = JsonlFiles(output, resume_step=latest.step if latest else None)
    trainer = build_trainer(spec, output_dir=output, callback=files, world=world)
    output.mkdir(parents=True, exist_ok=True)
    (output / "spec.json").write_text(json.dumps(spec.to_json(), indent=2))
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
    )
    with Progress(*columns, console=console, disable=quiet) as progress:
        trainer.cb = Callbacks(files, ProgressBar(progress, trainer.total_steps, latest.step if latest else 0))
        result = trainer.run(resume=resume)
    distributed.shut_down()
    return result


@app.command()
def train(
    spec_file: Annotated[Path, typer.Argument(help="job spec (YAML or JSON) with local paths for the files")],
    output: Annotated[Path, typer.Option("--output", "-o", help="run folder")],
    resume: Annotated[bool, typer.Option(help="continue from the latest checkpoint in --output")] = False,
    sandbox_packages: SandboxPackages = None,
) -> None:
    """Run a job spec locally: writes metrics.jsonl, rollouts.jsonl, checkpoints/ and the final adapter/. A spec
    asking for ``resources.gpus`` N > 1 runs as N ranks under torch's launcher (one per GPU; processes on a CPU)."""
    use_sandbox_packages(sandbox_packages)
    try:
        spec = load_spec(spec_file)
        if spec.gpus > 1 and "WORLD_SIZE" not in os.environ:
            packages = configured_sandbox().packages_dir
            args = ["train", str(spec_file), "--output", str(output), *(["--resume"] if resume else [])]
            _relaunch(spec.gpus, [*args, *(["--sandbox-packages", str(packages)] if packages else [])])
        result = run_training(spec, output, resume=resume)
    except USER_ERRORS as err:
        _fail(err)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if result.stopped:
        console.print(f"stopped at step {result.last_step}; continue with --resume")
    else:
        console.print(f"adapter: {result.adapter_dir}")


def _relaunch(ranks: int, args: list[str]) -> None:
    """Replace this process by torch's launcher running ``python -m trainer.cli ARGS`` as ``ranks`` ranks (one node;
    a failed rank ends them all)."""
    sys.stderr.flush()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    os.execv(sys.executable, [*launcher, "--max-restarts=0", "--module", "trainer.cli", *args])


@app.command("eval")
def eval_cmd(
    model: Annotated[str, typer.Option(help="base model: a name in the model store, a local path or a hub id")],
    data: Annotated[Path, typer.Option(help="RL prompt dataset (JSONL)")],
    grader: Annotated[Path, typer.Option(help="grader object (JSON file)")],
    adapter: Annotated[Path | None, typer.Option(help="LoRA adapter folder")] = None,
    temperature: Annotated[float, typer.Option(help="0 is greedy")] = 0.0,
    max_tokens: Annotated[int, typer.Option(help="max new tokens per completion")] = 64,
    limit: Annotated[int | None, typer.Option(help="evaluate only the first N prompts")] = None,
    batch_size: Annotated[int, typer.Option()] = 64,
    seed: Annotated[int, typer.Option()] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    sandbox_packages: SandboxPackages = None,
) -> None:
    """Mean reward of a model (and adapter) on a dataset."""
    import torch

    from trainer.generation.encoding import PromptTooLongError, encode_prompts
    from trainer.generation.models import (
        default_device,
        load_adapter,
        load_base_model,
        load_tokenizer,
        resolve_precision,
    )
    from trainer.loops.evaluate import evaluate

    use_sandbox_packages(sandbox_packages)
    try:
        g = graders.parse_grader(_read_json(grader))
        items = load_prompts(data, grader=g)[:limit]
        path = resolve_model(model)
        tok = load_tokenizer(path)
        try:
            prompts = encode_prompts(tok, items, max_prompt_tokens=1_000_000)
        except PromptTooLongError as err:  # pragma: no cover - limit is effectively unbounded
            raise DatasetError(str(err), line=err.item.line) from None
        device = default_device()
        net: torch.nn.Module = load_base_model(path, device)
        if adapter is not None:
            net = load_adapter(net, adapter)
        res = evaluate(
            net,
            tok,
            prompts,
            items,
            g,
            max_new_tokens=max_tokens,
            temperature=temperature,
            precision=resolve_precision("auto", device),
            batch_size=batch_size,
            generator=torch.Generator(device).manual_seed(seed),
        )
    except USER_ERRORS as err:
        _fail(err)
    if as_json:
        print(json.dumps(res.as_json()))
    else:
        console.print(f"mean reward {res.mean_reward:.4f} over {res.n} prompts")
        for k, v in res.sub_means.items():
            console.print(f"  {k}: {v:.4f}")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SpecError(f"{path}: {err}") from None


@models_app.command("build")
def models_build(
    name: Annotated[str, typer.Argument(help="the built-in model: tiny-arith or tiny-calc")],
    from_scratch: Annotated[
        bool,
        typer.Option(
            "--from-scratch", help="train it with its recipe (minutes) instead of installing the shipped build"
        ),
    ] = False,
    output: Annotated[
        Path | None, typer.Option(help="with --from-scratch: the folder to build into (default: the model store)")
    ] = None,
    replace: Annotated[bool, typer.Option(help="replace the folder when it holds another build")] = False,
    seed: Annotated[int, typer.Option(help="with --from-scratch: the recipe's seed (the shipped build's is 0)")] = 0,
) -> None:
    """Put a built-in base model into the model store: a copy of the shipped build, checked against its digests (a
    no-op when the store holds it), or with --from-scratch one trained by its recipe. Prints its folder last."""
    try:
        if from_scratch:
            out = build_from_scratch(name, output or model_store() / name, seed=seed, replace=replace)
        elif seed != 0 or output is not None:
            raise ModelError("--seed and --output build a model with its recipe: add --from-scratch")
        else:
            out = install_builtin(name, replace=replace).path
    except (ModelError, builtin_models.BuiltinModelError) as err:
        _fail(err)
    print(out)


def install_builtin(name: str, *, replace: bool = False) -> builtin_models.Installed:
    """The shipped build of ``name`` in the model store (:func:`trainer.builtin_models.install`); says what it did."""
    done = builtin_models.install(name, model_store(), replace=replace)
    short = done.weights_sha256[:12]
    if done.outcome == "kept":
        console.print(
            f"[yellow]{name}:[/yellow] {done.path} holds another build (weights sha256 {short}…), kept: adapters "
            f"trained on it need it; --replace installs the shipped build"
        )
    else:
        said = "installed the shipped build" if done.outcome == "installed" else "the shipped build is in place"
        console.print(f"{name}: {said} (weights sha256 {short}…, every file checked) in {done.path}")
    return done


def build_from_scratch(name: str, out: Path, *, seed: int, replace: bool) -> Path:
    """Train ``name`` with its recipe into ``out`` (minutes; progress as it goes), then say whether it reproduced the
    shipped build's files."""
    from trainer.builtin_models import tiny_arith, tiny_calc
    from trainer.spec.progress import stage_progress

    builders = {tiny_arith.MODEL_NAME: tiny_arith.build_tiny_arith, tiny_calc.MODEL_NAME: tiny_calc.build_tiny_calc}
    if name not in builders:
        raise ModelError(f"unknown built-in model {name!r}; valid: {', '.join(BUILTIN_MODELS)}")
    if builtin_models.is_complete_build(out):
        if not replace:
            raise ModelError(f"{out} already holds a build of {name}: pass --replace to build it again")
        shutil.rmtree(out)
    console.print(f"{name}: training with its recipe into {out} (two to four minutes on 2 cores)")
    with stage_progress(console) as progress:
        builders[name](out, seed=seed, progress=progress)
    info = json.loads((out / builtin_models.MARKER).read_text())
    console.print(f"{name}: built in {info['build_seconds']:.0f} s; {_build_summary(name, info)}")
    expected = {f: d for f, d in builtin_models.DIGESTS[name].items() if f != builtin_models.MARKER}
    actual = {f: d for f, d in builtin_models.folder_digests(out).items() if f != builtin_models.MARKER}
    if not (differ := builtin_models.differences(expected, actual)):
        console.print(
            f"{name}: identical to the shipped build (every file but {builtin_models.MARKER}, which holds times)"
        )
    else:
        shipped = json.loads((builtin_models.SHIPPED / name / builtin_models.MARKER).read_text())
        console.print(
            f"{name}: differs from the shipped build in {', '.join(differ)}: this build ran on {info.get('cpu')} "
            f"(bf16 autocast {info.get('bf16_autocast')}), the shipped one on {shipped.get('cpu')} "
            f"(bf16 autocast {shipped.get('bf16_autocast')}); seed {seed}"
        )
    return out


def _build_summary(name: str, info: dict[str, Any]) -> str:
    validation = info["validation"]
    if name == "tiny-calc":
        sampled, greedy = validation["sampled"], validation["greedy"]
        return (
            f"sampled episodes call the calculator {sampled['call_rate']:.2f} of the time, right "
            f"{sampled['tool_accuracy']:.2f} when they do; greedy accuracy {greedy['accuracy']:.3f}"
        )
    return f"validation greedy accuracy {validation['greedy_accuracy_after_carry_drop']:.3f}"


@datasets_app.command("arithmetic")
def datasets_arithmetic(
    out: Annotated[Path, typer.Argument(help="folder to write train/validation/preferences JSONL into")],
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Write the tiny-arith task's datasets: train.jsonl, validation.jsonl, preferences.jsonl."""
    from trainer.builtin_models import tiny_arith

    for path in tiny_arith.write_arithmetic_datasets(out, seed=seed).values():
        print(path)


@datasets_app.command("calculator")
def datasets_calculator(
    out: Annotated[Path, typer.Argument(help="folder to write train/validation JSONL into")],
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Write the tiny-calc agent task's datasets (three-number sums with their answers): train.jsonl,
    validation.jsonl."""
    from trainer.builtin_models import tiny_calc

    for path in tiny_calc.write_calculator_datasets(out, seed=seed):
        print(path)


def main() -> None:  # pragma: no cover
    sys.exit(app())


if __name__ == "__main__":  # pragma: no cover
    main()
