"""The agent part of an online method's body: the tools a policy may call and how long an episode runs.

In the shape of OpenAI's agent RFT (``method.reinforcement.tools: [{"name", "server_url", "headers"}]`` and
``max_episode_steps``), each tool optionally with its function definition as OpenAI's function tools define it
(``description``, ``parameters``: a JSON schema), which the chat template shows the model. Or, for users who host no
tool server, ``environment``: Python source defining ``reset(item) -> messages`` and ``step(tool_call) -> (tool
message, done)``, run in the same sandbox as the python grader; its ``tools`` then carry no ``server_url``.

A dataset line may carry ``tools`` too: the tools offered for that item, a subset of the job's, each named as one
of the job's tools (and, where it gives a ``server_url``, the same one). Torch-free: the API parses it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_TOOLS = 128
"""Most tools a job (or a line) may offer (OpenAI's function tools: 128 per request)."""
MAX_EPISODE_STEPS = 100
"""Most model turns of one episode."""
DEFAULT_EPISODE_STEPS = 10
"""OpenAI's examples set 10."""
MAX_ENVIRONMENT_SOURCE = 256 * 1024
"""The same bound as a python grader's source."""
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
"""OpenAI's rule for function names."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ToolSpec(_Strict):
    """One tool: ``{"name", "server_url", "headers"}`` as OpenAI's agent RFT has it, with the function definition the
    model is shown. ``server_url`` is where calls go (a POST of a Responses ``function_call`` item); an environment's
    tools have none."""

    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]
    server_url: Annotated[str, Field(min_length=1, max_length=2048)] | None = None
    headers: dict[Annotated[str, Field(min_length=1, max_length=256)], Annotated[str, Field(max_length=8192)]] = Field(
        default_factory=dict, max_length=64
    )
    description: Annotated[str, Field(max_length=8192)] | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "object") != "object":
            raise ValueError("a function's parameters are a JSON schema of type 'object'")
        return v

    def function(self) -> dict[str, Any]:
        """The definition as chat templates take it: ``{"type": "function", "function": {name, description,
        parameters}}``."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters if self.parameters is not None else {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}


class EnvironmentSpec(_Strict):
    """A Python environment: ``source`` defines ``reset(item)`` (the episode's opening messages, a list of
    ``{"role", "content"}``; None or [] keeps the dataset line's) and ``step(tool_call)`` (``tool_call`` is
    ``{"id", "name", "arguments"}``, arguments as the JSON text the model wrote; returns ``(content, done)``: the tool
    message's content and whether the episode ends)."""

    type: Literal["python"]
    name: Annotated[str, Field(min_length=1, max_length=128)] = "environment"
    source: Annotated[str, Field(min_length=1, max_length=MAX_ENVIRONMENT_SOURCE)]
    image_tag: str | None = None


class AgentSpec(_Strict):
    """What an online method's body adds for agent episodes."""

    tools: Annotated[list[ToolSpec], Field(max_length=MAX_TOOLS)] = Field(default_factory=list)
    environment: EnvironmentSpec | None = None
    max_episode_steps: int = Field(DEFAULT_EPISODE_STEPS, ge=1, le=MAX_EPISODE_STEPS)

    @model_validator(mode="after")
    def _consistent(self) -> AgentSpec:
        names = [t.name for t in self.tools]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"tools: the name {dup!r} is used twice")
        for i, t in enumerate(self.tools):
            if self.environment is None and t.server_url is None:
                raise ValueError(f"tools.{i}.server_url: field required (no environment answers this tool)")
            if self.environment is not None and t.server_url is not None:
                raise ValueError(f"tools.{i}.server_url: the environment answers every tool call; leave it out")
        if self.environment is None and not self.tools:
            raise ValueError("tools: at least one tool, or an environment")
        return self

    def by_name(self) -> dict[str, ToolSpec]:
        return {t.name: t for t in self.tools}

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


def parse_line_tools(raw: Any, job: AgentSpec) -> list[ToolSpec]:
    """A dataset line's ``tools``: the job's tools it names, in its order. Each entry is ``{"name", ...}`` in the job's
    shape or an OpenAI function tool ``{"type": "function", "function": {"name", ...}}``; a definition the line gives
    (description, parameters) replaces the job's for that item; a ``server_url`` must equal the job tool's. Raises
    ``ValueError`` naming the entry."""
    if not isinstance(raw, list):
        raise ValueError("tools: must be a list")
    if len(raw) > MAX_TOOLS:
        raise ValueError(f"tools: at most {MAX_TOOLS}")
    known = job.by_name()
    out: list[ToolSpec] = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise ValueError(f"tools.{i}: must be an object")
        body = entry
        if entry.get("type") == "function":
            fn = entry.get("function")
            if not isinstance(fn, dict) or set(entry) - {"type", "function"}:
                raise ValueError(f"tools.{i}: a function tool is {{'type': 'function', 'function': {{...}}}}")
            body = fn
        name = body.get("name")
        if not isinstance(name, str) or name not in known:
            raise ValueError(f"tools.{i}.name: {name!r} is not one of the job's tools ({', '.join(known) or 'none'})")
        base = known[name]
        url = body.get("server_url")
        if url is not None and url != base.server_url:
            raise ValueError(f"tools.{i}.server_url: must be the job's server_url for {name!r}")
        merged = base.model_dump() | {k: v for k, v in body.items() if k in ("description", "parameters", "strict")}
        try:
            out.append(ToolSpec.model_validate(merged))
        except ValueError as err:
            raise ValueError(f"tools.{i}: {err}") from None
    return out
