"""``POST /v1/fine_tuning/estimates``: a job's length and duration before it is created.

The body is a job's; it is checked as job creation checks it (``jobs.validated_spec``: the spec, the model, the
files, the lengths fitted to the model) and nothing is written. The steps are ``max_steps``, or ``n_epochs`` passes
over the training file's lines (counted at upload, so no dataset is read) in batches of ``batch_size``.

The duration comes from this deployment's measured throughput for the base model and method: the latest jobs of any
tenant on them (:func:`api.repositories.sizing.measured_jobs`), each giving the median ``time/step_s`` of its latest
training steps without a validation run, divided by the size of its step: for the online RL methods the tokens it
may sample, ``batch_size × samples_per_prompt × max_completion_tokens``, for the others its examples, ``batch_size``.
The median of those seconds per unit over the jobs, times the new job's step size, is its seconds per step. Only
aggregates are answered (how many jobs and steps), never another tenant's job. With no measured job there is no
duration (null, and ``basis.reason`` says why): a number would be invented. Validation runs and checkpoints are not
counted: they depend on the validation file and the cadence, which past jobs do not share.
"""

from __future__ import annotations

import statistics

from sqlalchemy.orm import Session

from api.auth import Caller
from api.repositories import files as files_repo
from api.repositories import sizing
from api.schemas import EstimateBasis, JobCreate, JobEstimate
from api.services import jobs as jobs_service
from api.settings import Settings
from trainer.spec import metrics as M
from trainer.spec.config import (
    METHODS,
    RL_METHODS,
    Hyperparameters,
    JobSpec,
    RLHyperparameters,
    recipe_name,
    trained_examples,
)

VALIDATION_PREFIX = "val/"  # the validation series (trainer.spec.metrics.validation): a step that ran one is slower
RL_STEP = "batch_size × samples_per_prompt × max_completion_tokens"
STEP = "batch_size"


def step_size(hp: Hyperparameters) -> float:
    """The size of one training step the measured times scale with (see the module's docstring)."""
    if isinstance(hp, RLHyperparameters):
        return float(hp.batch_size * hp.samples_per_prompt * hp.max_completion_tokens)
    return float(hp.batch_size)


def training_step_seconds(steps: list[dict[str, float | None]]) -> list[float]:
    """The ``time/step_s`` of the steps that ran no validation (of all, when every one ran one)."""
    timed = [(v, s) for v in steps if isinstance(s := v.get(M.STEP_SECONDS), int | float)]
    plain = [float(s) for v, s in timed if not any(k.startswith(VALIDATION_PREFIX) for k in v)]
    return plain or [float(s) for _, s in timed]


def seconds_per_unit(jobs: list[sizing.MeasuredJob], method: str) -> tuple[float | None, int, int]:
    """(the median over the jobs of their median step time per unit of step size, jobs counted, steps counted)."""
    rates: list[float] = []
    steps = 0
    for job in jobs:
        times = training_step_seconds(job.steps)
        if times:  # a value the stored spec lacks (an older job's) is the method's default, as parsing gives it
            hp = JobSpec.from_stored(job.spec).method.hyperparameters
            rates.append(statistics.median(times) / step_size(hp))
            steps += len(times)
    return (statistics.median(rates) if rates else None), len(rates), steps


def estimate(*, session: Session, settings: Settings, tenant: Caller, body: JobCreate) -> JobEstimate:
    spec, _ = jobs_service.validated_spec(session=session, settings=settings, tenant=tenant, body=body)
    method = spec.method.type
    hp = spec.method.hyperparameters
    if hp.max_steps is not None:
        total, source = hp.max_steps, "max_steps"
    else:
        row = files_repo.get(session, tenant_id=tenant.id, file_id=spec.training_file)
        assert row is not None  # validated_spec checked it
        total, source = hp.total_steps(trained_examples(spec, row.lines)), "training_file"
    # A method and its OpenAI name (reinforcement, grpo) run one recipe: each one's jobs measure the other's steps.
    same_recipe = [m for m in METHODS if recipe_name(m) == recipe_name(method)]
    measured = sizing.measured_jobs(session, model=spec.model, methods=same_recipe)
    rate, n_jobs, n_steps = seconds_per_unit(measured, method)
    scaled_by = RL_STEP if method in RL_METHODS else STEP
    if rate is None:
        reason = f"no {method} job on {spec.model} has recorded a timed training step on this deployment yet"
        basis = EstimateBasis(jobs=0, steps=0, scaled_by=scaled_by, reason=reason)
        per_step, duration = None, None
    else:
        basis = EstimateBasis(jobs=n_jobs, steps=n_steps, scaled_by=scaled_by)
        per_step = rate * step_size(hp)
        duration = round(per_step * total)
    return JobEstimate(
        model=spec.model,
        method=method,
        total_steps=total,
        total_steps_from=source,  # type: ignore[arg-type]
        seconds_per_step=per_step,
        estimated_duration_seconds=duration,
        basis=basis,
        hyperparameters=hp.model_dump(mode="json"),
    )
