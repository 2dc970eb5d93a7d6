"""OpenAI's Evals API as the API drives it: evals (create, read, update, delete), their runs (create and enqueue,
read, cancel, delete) and the runs' output items; and the rules the worker grades by (``worker.evals``).

An eval is a data source config (``custom``: the JSON schema of its items) and testing criteria: graders of
``trainer.spec.graders``, validated as a job's grader is (parsed, python sources checked in a sandbox, remote graders
checked against the deployment: ``api.services.graders.check_job_grader``), each with a distinct ``name`` and a pass
rule (``passes``). A run names a data source: ``jsonl`` (items graded as they are, ``{{sample.*}}`` read from each row's
``sample``) or ``completions`` (each item's messages rendered from a template, or read from the item, and sampled
from a model the tenant may use, resolved as chat completions resolve it: ``api.services.inference.resolve``). The
run is committed, then enqueued by name (``proxima.evals.run``); the worker claims it with a lease.

Proxima stores no completions or logs, so the ``stored_completions``, ``logs`` and ``responses`` sources are a 400
naming the field; so is any criterion that cannot be an eval's (a ``reward_model`` grader, which needs a trained
model loaded by a training worker).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal, TypeVar

import jsonschema
import referencing
import referencing.exceptions
from pydantic import BaseModel, ValidationError
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from api import ids
from api.auth import Caller
from api.db import session_scope
from api.errors import Conflict, InvalidRequest, ModelNotFound, NotFound
from api.orm import Eval, EvalOutputItem, EvalRun, now
from api.repositories import evals as evals_repo
from api.repositories import files as files_repo
from api.repositories.evals import Order
from api.schemas_evals import (
    CompletionsDataSource,
    CustomDataSourceConfig,
    EvalCreate,
    EvalUpdate,
    FileContentSource,
    FileIdSource,
    ItemReferenceInput,
    JsonlDataSource,
    RunCreate,
    TemplateInput,
)
from api.services import graders as graders_service
from api.services import inference as inference_service
from api.services.jobs import celery_client
from api.settings import Settings
from api.status import EVAL_RUN_TERMINAL, EvalRunStatus
from api.tasks import DEFAULT_QUEUE, RUN_EVAL
from trainer.grading.graders import render
from trainer.spec import graders
from trainer.spec.graders.templates import lookup, parse_template

log = logging.getLogger("proxima.api.evals")
M = TypeVar("M", bound=BaseModel)

MAX_LIST_LIMIT = 100
DEFAULT_LIST_LIMIT = 20
EVAL_FILE_PURPOSES = ("evals", "fine-tune")
BINARY_PASS = frozenset({"string_check", "label_model"})
"""Criteria that pass on a score of 1 (string_check's match; label_model's label among passing_labels)."""
THRESHOLD_REQUIRED = frozenset({"text_similarity"})
"""Criteria whose pass_threshold OpenAI requires."""
DEFAULT_PASS_THRESHOLD = 0.5
"""The pass threshold of the other criteria when none is given (a score_model's: the middle of its range)."""
_OWN_THRESHOLD = frozenset({"text_similarity", "score_model", "endpoint"})
"""The grader models that carry pass_threshold themselves (the others get it stripped before parsing)."""
SAMPLE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object"}},
        "output_text": {"type": "string"},
        "finish_reason": {"type": "string"},
    },
    "required": ["model", "choices", "output_text"],
}
ECHO_LIMIT = 200
"""The most characters of a schema's value or an item's that an item problem repeats (an item may be large)."""


# -- parsing the parts ----------------------------------------------------------------------------------------


def _path(param: str, loc: tuple[int | str, ...]) -> str:
    out = param
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _parse(model: type[M], data: Any, *, param: str) -> M:
    """``data`` as ``model``, or a 400 naming the first offending field under ``param``."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = _path(param, tuple(first["loc"]))
        raise InvalidRequest(f"{where}: {first['msg']}", param=where) from None


def _type_of(data: dict[str, Any], *, param: str, valid: tuple[str, ...], why: str) -> str:
    kind = data.get("type")
    if kind not in valid:
        raise InvalidRequest(
            f"{param}.type: {kind!r} is not supported here; valid: {', '.join(valid)}{why}", param=f"{param}.type"
        )
    return str(kind)


def check_data_source_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The stored form of a data source config: ``custom`` with a valid JSON schema that items can be checked by."""
    param = "data_source_config"
    _type_of(raw, param=param, valid=("custom",), why=" (Proxima stores no completions or logs to read from)")
    config = _parse(CustomDataSourceConfig, raw, param=param)
    try:
        jsonschema.validators.validator_for(config.item_schema).check_schema(config.item_schema)
    except jsonschema.SchemaError as err:
        where = f"{param}.item_schema"
        raise InvalidRequest(f"{where}: not a JSON schema: {_clip(err.message)}", param=where) from None
    stored = config.model_dump()
    # a valid schema may still name what it cannot reach (a remote or missing $ref, a $ref to itself): found at
    # once on an empty item rather than on the first item of each run
    item_problem(stored, {})
    return stored


def data_source_config_view(stored: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's answer: the schema of the namespaces graders read, ``item`` (and ``sample`` when included)."""
    properties: dict[str, Any] = {"item": stored["item_schema"]}
    if stored.get("include_sample_schema"):
        properties["sample"] = SAMPLE_SCHEMA
    return {"type": "custom", "schema": {"type": "object", "properties": properties, "required": list(properties)}}


def _clip(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= ECHO_LIMIT else text[:ECHO_LIMIT] + "…"


def item_problem(stored_config: dict[str, Any], item: Any) -> str | None:
    """Why an item does not fit the eval's item schema (its first violation), or None; an InvalidRequest
    (``invalid_item_schema``) when the schema cannot be applied at all."""
    schema = stored_config["item_schema"]
    # an empty registry: a $ref is resolved within the schema only, never fetched over the network
    validator = jsonschema.validators.validator_for(schema)(schema, registry=referencing.Registry())
    try:
        error = jsonschema.exceptions.best_match(validator.iter_errors(item))
    except (referencing.exceptions.Unresolvable, RecursionError) as err:
        where = "data_source_config.item_schema"
        why = "a $ref that refers to itself" if isinstance(err, RecursionError) else f"an unresolvable $ref ({err})"
        raise InvalidRequest(
            f"{where}: items cannot be checked: {_clip(why)}", param=where, code="invalid_item_schema"
        ) from None
    if error is None:
        return None
    where = "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in error.absolute_path)
    # not error.message: it repeats the whole offending value, however large
    return f"item{where}: fails {error.validator}: {_clip(error.validator_value)} (got {_clip(error.instance)})"


# -- testing criteria -----------------------------------------------------------------------------------------


def _criterion(raw: Any, *, index: int, settings: Settings) -> dict[str, Any]:
    param = f"testing_criteria[{index}]"
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{param}: expected a grader object", param=param)
    kind = raw.get("type")
    if not isinstance(kind, str):  # (a list or an object cannot even be looked up among the kinds)
        raise InvalidRequest(f"{param}.type: expected a grader type (a string)", param=f"{param}.type")
    grader = dict(raw)
    # string_check and label_model have no threshold: one given stays in and is refused by the grader's own schema
    kept = kind in _OWN_THRESHOLD or kind in BINARY_PASS
    threshold = grader.get("pass_threshold") if kept else grader.pop("pass_threshold", None)
    bad_number = isinstance(threshold, bool) or not isinstance(threshold, int | float)
    if kind not in BINARY_PASS and threshold is not None and bad_number:
        raise InvalidRequest(f"{param}.pass_threshold: expected a number", param=f"{param}.pass_threshold")
    if kind in THRESHOLD_REQUIRED and threshold is None:
        raise InvalidRequest(f"{param}.pass_threshold: required for {kind}", param=f"{param}.pass_threshold")
    try:
        parsed = graders.parse_grader(grader)
    except graders.GraderError as err:
        where = _renamed(err.param or "grader", param)
        raise InvalidRequest(_renamed(str(err), param), param=where, code="invalid_grader") from None
    if graders.model_graders(parsed):
        raise InvalidRequest(
            f"{param}: reward_model graders need a trained model loaded by a training worker; evals cannot run them",
            param=param,
            code="invalid_grader",
        )
    validated = parsed.model_dump(mode="json", exclude_none=True)
    graders_service.check_job_grader(validated, param=param, settings=settings)
    if kind in BINARY_PASS:
        rule: float | None = None
    elif threshold is not None:
        rule = float(threshold)
    elif isinstance(parsed, graders.ScoreModelGrader):
        rule = (parsed.range[0] + parsed.range[1]) / 2
    else:
        rule = DEFAULT_PASS_THRESHOLD
    return {"grader": validated, "pass_threshold": rule}


def _renamed(text: str, param: str) -> str:
    """A grader error's path (``grader.input``) as the criterion's (``testing_criteria[0].input``)."""
    return text.replace("grader", param, 1) if text.startswith("grader") else text


def check_criteria(raw: list[dict[str, Any]], *, settings: Settings) -> list[dict[str, Any]]:
    """The stored criteria: each validated as a job's grader is, with its pass rule; names distinct."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        criterion = _criterion(item, index=i, settings=settings)
        name = str(criterion["grader"]["name"])
        if name in seen:
            raise InvalidRequest(
                f"testing_criteria[{i}].name: {name!r} is the name of an earlier criterion; names must be distinct",
                param=f"testing_criteria[{i}].name",
            )
        seen.add(name)
        out.append(criterion)
    return out


def criterion_view(stored: dict[str, Any]) -> dict[str, Any]:
    """A criterion as OpenAI shows it: the grader, and its ``pass_threshold`` where it has one."""
    view = dict(stored["grader"])
    if stored["pass_threshold"] is not None:
        view["pass_threshold"] = stored["pass_threshold"]
    return view


def passes(stored: dict[str, Any], score: float) -> bool:
    """Whether ``score`` passes the criterion: a score of 1 for string_check and label_model, else the threshold."""
    threshold = stored["pass_threshold"]
    return score >= 1.0 if threshold is None else score >= threshold


# -- evals ----------------------------------------------------------------------------------------------------


def create(*, session: Session, settings: Settings, tenant: Caller, body: EvalCreate) -> Eval:
    config = check_data_source_config(body.data_source_config)
    criteria = check_criteria(body.testing_criteria, settings=settings)
    at = now()
    row = Eval(
        id=ids.eval_id(),
        tenant_id=tenant.id,
        name=body.name or "",
        data_source_config=config,
        testing_criteria=criteria,
        metadata_=body.metadata,
        created_at=at,
        updated_at=at,
    )
    return evals_repo.add_eval(session, row=row)


def get(*, session: Session, tenant: Caller, eval_id: str) -> Eval:
    row = evals_repo.get_eval(session, tenant_id=tenant.id, eval_id=eval_id)
    if row is None:
        raise NotFound("eval", eval_id, param="eval_id")
    return row


def page(
    *,
    session: Session,
    tenant: Caller,
    after: str | None,
    limit: int,
    order: Order,
    order_by: Literal["created_at", "updated_at"],
) -> tuple[list[Eval], bool]:
    cursor = None
    if after is not None:
        cursor = evals_repo.get_eval(session, tenant_id=tenant.id, eval_id=after)
        if cursor is None:
            raise InvalidRequest(f"no such eval: {after!r}", param="after")
    return evals_repo.evals_page(
        session, tenant_id=tenant.id, after=cursor, limit=limit, order=order, order_by=order_by
    )


def update(*, session: Session, tenant: Caller, eval_id: str, body: EvalUpdate) -> Eval:
    """OpenAI's update: the name and the metadata (the whole new set of pairs) the body gives."""
    row = get(session=session, tenant=tenant, eval_id=eval_id)
    if body.name is not None:
        row.name = body.name
    if "metadata" in body.model_fields_set:
        row.metadata_ = body.metadata
    row.updated_at = now()
    session.flush()
    return row


def delete(*, session: Session, tenant: Caller, eval_id: str) -> str:
    evals_repo.delete_eval(session, row=get(session=session, tenant=tenant, eval_id=eval_id))
    return eval_id


# -- data sources of runs -------------------------------------------------------------------------------------


def _check_source(session: Session, *, tenant: Caller, config: dict[str, Any], raw: dict[str, Any]) -> None:
    param = "data_source.source"
    kind = _type_of(raw, param=param, valid=("file_content", "file_id"), why=" (Proxima stores no completions)")
    if kind == "file_id":
        file_id = _parse(FileIdSource, raw, param=param).id
        row = files_repo.get(session, tenant_id=tenant.id, file_id=file_id)
        if row is None:
            raise InvalidRequest(f"{param}.id: no such file: {file_id!r}", param=f"{param}.id", code="file_not_found")
        if row.purpose not in EVAL_FILE_PURPOSES:
            raise InvalidRequest(
                f"{param}.id: file {file_id!r} has purpose {row.purpose!r}; valid: {', '.join(EVAL_FILE_PURPOSES)}",
                param=f"{param}.id",
            )
        return
    content = _parse(FileContentSource, raw, param=param).content
    for i, row_ in enumerate(content):
        if (problem := item_problem(config, row_.item)) is not None:
            where = f"{param}.content[{i}].item"
            raise InvalidRequest(f"{where}: does not fit the eval's item_schema: {problem}", param=where)


def _check_input_messages(raw: dict[str, Any]) -> None:
    param = "data_source.input_messages"
    kind = _type_of(raw, param=param, valid=("template", "item_reference"), why="")
    if kind == "item_reference":
        reference = _parse(ItemReferenceInput, raw, param=param).item_reference
        if not reference.startswith("item.") or len(reference) <= len("item."):
            where = f"{param}.item_reference"
            raise InvalidRequest(f"{where}: expected item.<path>, got {reference!r}", param=where)
        return
    for i, message in enumerate(_parse(TemplateInput, raw, param=param).template):
        where = f"{param}.template[{i}].content"
        try:
            parts = parse_template(message.text())
        except ValueError as err:
            raise InvalidRequest(f"{where}: {err}", param=where) from None
        if any(not isinstance(p, str) and p.namespace == "sample" for p in parts):
            raise InvalidRequest(f"{where}: the sample does not exist before sampling; use {{{{item.*}}}}", param=where)


def check_data_source(
    session: Session, *, settings: Settings, tenant: Caller, config: dict[str, Any], raw: dict[str, Any]
) -> tuple[dict[str, Any], str | None]:
    """The stored data source of a run, and the model it samples (None for ``jsonl``)."""
    kind = _type_of(raw, param="data_source", valid=("jsonl", "completions"), why=" (no stored responses here)")
    if kind == "jsonl":
        source = _parse(JsonlDataSource, raw, param="data_source")
        _check_source(session, tenant=tenant, config=config, raw=source.source)
        return source.model_dump(exclude_none=True), None
    completions = _parse(CompletionsDataSource, raw, param="data_source")
    _check_source(session, tenant=tenant, config=config, raw=completions.source)
    _check_input_messages(completions.input_messages)
    try:
        inference_service.resolve(session.connection(), settings=settings, tenant=tenant, model=completions.model)
    except ModelNotFound as err:
        raise InvalidRequest(err.message, param="data_source.model", code="model_not_found") from None
    return completions.model_dump(exclude_none=True), completions.model


def render_messages(data_source: dict[str, Any], item: dict[str, Any]) -> list[dict[str, str]] | str:
    """The messages a completions run samples for ``item``: its template rendered (``{{item.*}}``, as graders render
    templates) or the item's referenced messages; a string saying what is wrong when they cannot be made."""
    spec = data_source["input_messages"]
    if spec["type"] == "item_reference":
        found, value = lookup(item, tuple(spec["item_reference"].removeprefix("item.").split(".")))
        if not found:
            return f"the item has no {spec['item_reference']!r}"
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
        ok = isinstance(value, list) and value and all(isinstance(m, dict) for m in value)
        if not ok or not all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value):
            return f"{spec['item_reference']} is not a list of {{role, content}} messages"
        return [{"role": m["role"], "content": m["content"]} for m in value]
    out = []
    for message in spec["template"]:
        content = message["content"] if isinstance(message["content"], str) else message["content"]["text"]
        text, problems = render(content, "input_messages", output_text="", item=item)
        if problems:
            return str(problems[0])
        out.append({"role": message["role"], "content": text})
    return out


# -- runs -----------------------------------------------------------------------------------------------------


def create_run(*, session: Session, settings: Settings, tenant: Caller, eval_id: str, body: RunCreate) -> EvalRun:
    """Check the data source, write the run ``queued``, commit, then enqueue it (a broker that cannot be reached
    leaves it to the sweeper: ``worker.sweeper``)."""
    ev = get(session=session, tenant=tenant, eval_id=eval_id)
    data_source, model = check_data_source(
        session, settings=settings, tenant=tenant, config=ev.data_source_config, raw=body.data_source
    )
    row = evals_repo.add_run(
        session,
        row=EvalRun(
            id=ids.eval_run_id(),
            eval_id=ev.id,
            tenant_id=tenant.id,
            name=body.name or (model or "jsonl"),
            status=EvalRunStatus.QUEUED,
            data_source=data_source,
            model=model,
            metadata_=body.metadata,
            created_at=now(),
            attempts=0,
            cancel_requested=False,
        ),
    )
    session.commit()
    _enqueue(settings=settings, run_id=row.id)
    return row


def _enqueue(*, settings: Settings, run_id: str) -> None:
    """Publish the run's wake-up call and record when; failures are logged, never raised (the run is committed)."""
    try:
        celery_client(settings.celery_broker_url).send_task(RUN_EVAL, args=[run_id], queue=DEFAULT_QUEUE)
    except Exception as err:  # any broker failure: the sweeper enqueues queued runs from the database
        log.warning("could not enqueue eval run %s (%s: %s); the sweeper will", run_id, type(err).__name__, err)
        return
    try:
        with session_scope(settings.db_url) as s:
            evals_repo.mark_enqueued(s, run_id=run_id)
    except SQLAlchemyError as err:
        log.warning("eval run %s: could not record that it was enqueued (%s)", run_id, err)


def get_run(*, session: Session, tenant: Caller, eval_id: str, run_id: str) -> EvalRun:
    row = evals_repo.get_run(session, tenant_id=tenant.id, eval_id=eval_id, run_id=run_id)
    if row is None:
        raise NotFound("eval run", run_id, param="run_id")
    return row


def runs_page(
    *,
    session: Session,
    tenant: Caller,
    eval_id: str,
    after: str | None,
    limit: int,
    order: Order,
    status: str | None,
) -> tuple[list[EvalRun], bool]:
    ev = get(session=session, tenant=tenant, eval_id=eval_id)
    cursor = None
    if after is not None:
        cursor = evals_repo.get_run(session, tenant_id=tenant.id, eval_id=ev.id, run_id=after)
        if cursor is None:
            raise InvalidRequest(f"no such run of this eval: {after!r}", param="after")
    return evals_repo.runs_page(session, eval_id=ev.id, after=cursor, limit=limit, order=order, status=status)


def cancel_run(*, session: Session, tenant: Caller, eval_id: str, run_id: str) -> EvalRun:
    """A queued run is canceled now; an in-progress one is asked to stop (its worker ends it ``canceled`` before its
    next batch of items); a finished one is a 409."""
    row = get_run(session=session, tenant=tenant, eval_id=eval_id, run_id=run_id)
    if row.status in EVAL_RUN_TERMINAL:
        raise Conflict(f"eval run {run_id} is already {row.status}", param="run_id", code="run_finished")
    if not evals_repo.cancel_queued(session, run_id=row.id):
        evals_repo.request_cancel(session, run_id=row.id)
    session.refresh(row)
    return row


def delete_run(*, session: Session, tenant: Caller, eval_id: str, run_id: str) -> str:
    evals_repo.delete_run(session, row=get_run(session=session, tenant=tenant, eval_id=eval_id, run_id=run_id))
    return run_id


def items_page(
    *,
    session: Session,
    tenant: Caller,
    eval_id: str,
    run_id: str,
    after: str | None,
    limit: int,
    order: Order,
    status: Literal["pass", "fail"] | None,
) -> tuple[list[EvalOutputItem], bool]:
    run = get_run(session=session, tenant=tenant, eval_id=eval_id, run_id=run_id)
    cursor = None
    if after is not None:
        cursor = evals_repo.get_item(session, run_id=run.id, item_id=after)
        if cursor is None:
            raise InvalidRequest(f"no such output item of this run: {after!r}", param="after")
    return evals_repo.items_page(session, run_id=run.id, after=cursor, limit=limit, order=order, status=status)


def get_item(*, session: Session, tenant: Caller, eval_id: str, run_id: str, item_id: str) -> EvalOutputItem:
    run = get_run(session=session, tenant=tenant, eval_id=eval_id, run_id=run_id)
    row = evals_repo.get_item(session, run_id=run.id, item_id=item_id)
    if row is None:
        raise NotFound("output item", item_id, param="output_item_id")
    return row
