"""Walks over a grader's tree: its leaves keyed as `grade` keys its sub_scores, the item fields its templates read,
the leaves scored over batches (reward models, python, remote), and the same over a grader's unvalidated JSON."""

from collections.abc import Mapping
from typing import Any, assert_never

from trainer.spec.graders.formulas import compile_formula, formula_names
from trainer.spec.graders.judges import EndpointGrader, LabelModelGrader, ScoreModelGrader
from trainer.spec.graders.leaves import (
    LengthPenaltyGrader,
    NumericMatchGrader,
    PythonGrader,
    RegexGrader,
    RewardModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
)
from trainer.spec.graders.templates import Ref, lookup, missing_field_message, parse_template
from trainer.spec.graders.text_metrics import REMOTE_SIMILARITY_METRICS
from trainer.spec.graders.tree import Grader, LeafGrader, MultiGrader, RemoteGrader


def _templates(grader: LeafGrader) -> tuple[str, ...]:
    match grader:
        case StringCheckGrader() | TextSimilarityGrader() | NumericMatchGrader():
            return (grader.input, grader.reference)
        case RegexGrader() | LengthPenaltyGrader():
            return (grader.input,)
        case RewardModelGrader():
            return tuple(m.content for m in grader.prompt or ())
        case PythonGrader() | EndpointGrader():
            return ()
        case ScoreModelGrader() | LabelModelGrader():
            return tuple(t for m in grader.input for t in m.templates)
        case _:
            assert_never(grader)


def _leaves(grader: Grader) -> list[LeafGrader]:
    if isinstance(grader, MultiGrader):
        return [leaf for child in grader.graders.values() for leaf in _leaves(child)]
    return [grader]


def _item_refs(grader: Grader) -> list[tuple[str, Ref]]:
    """(leaf grader name, reference) of every `{{item.*}}` reference, depth first, in field order."""
    return [
        (leaf.name, part)
        for leaf in _leaves(grader)
        for template in _templates(leaf)
        for part in parse_template(template)
        if isinstance(part, Ref) and part.namespace == "item"
    ]


def template_fields(grader: Grader) -> set[str]:
    """Dotted `item` paths referenced by the grader's templates: `{{item.meta.answer}}` → 'meta.answer'."""
    return {ref.dotted for _, ref in _item_refs(grader)}


def check_item(grader: Grader, item: Mapping[str, Any]) -> str | None:
    """None when each `{{item.*}}` of the grader is in `item`, else a message naming the first missing one."""
    for name, ref in _item_refs(grader):
        if not lookup(item, ref.path)[0]:
            return missing_field_message(name, ref)
    for _, leaf in model_graders(grader):
        if leaf.prompt is None and item_conversation(item) is None:
            return f"grader {leaf.name!r} takes its prompt from the item's 'messages' or 'prompt', and it has neither"
    return None


def held_out_keys(grader: Grader) -> tuple[str, ...]:
    """The sub-graders of a top-level `multi` that its `calculate_output` does not read: scored and reported
    (reward/{key}/mean, val/reward/{key}/mean) but not trained on, e.g. the true answer beside a reward model."""
    if not isinstance(grader, MultiGrader):
        return ()
    used = set(formula_names(compile_formula(grader.calculate_output)))
    return tuple(k for k in grader.graders if k not in used)


def model_graders(grader: Grader) -> list[tuple[str, RewardModelGrader]]:
    """(key, grader) of every reward_model leaf, keyed as `grade` keys sub_scores (`rm`, `quality.rm`)."""
    if isinstance(grader, RewardModelGrader):
        return [(grader.name, grader)]
    if not isinstance(grader, MultiGrader):
        return []
    out: list[tuple[str, RewardModelGrader]] = []
    for key, child in grader.graders.items():
        if isinstance(child, RewardModelGrader):
            out.append((key, child))
        elif isinstance(child, MultiGrader):
            out.extend((f"{key}.{path}", leaf) for path, leaf in model_graders(child))
    return out


def with_models(grader: Grader, models: Mapping[str, str]) -> Grader:
    """The grader with every reward_model leaf's ``model`` replaced by ``models[model]`` (kept where it is not a key):
    the service's job id of a reward model becomes the folder a worker fetched it to."""
    if isinstance(grader, RewardModelGrader):
        return grader.model_copy(update={"model": models.get(grader.model, grader.model)})
    if isinstance(grader, MultiGrader):
        return grader.model_copy(update={"graders": {k: with_models(c, models) for k, c in grader.graders.items()}})
    return grader


def keyed_leaves(grader: Grader, param: str = "grader") -> list[tuple[str, str, LeafGrader]]:
    """(key, param path, leaf) of every leaf, depth first: the key as `grade` keys sub_scores and reads
    `model_scores` (`judge`, `quality.judge`; a lone leaf is keyed by its name), the param path as the API names the
    leaf's fields (`grader`, `grader.graders.quality.graders.judge`)."""
    if not isinstance(grader, MultiGrader):
        return [(grader.name, param, grader)]
    out: list[tuple[str, str, LeafGrader]] = []
    for key, child in grader.graders.items():
        child_param = f"{param}.graders.{key}"
        if isinstance(child, MultiGrader):
            out.extend((f"{key}.{path}", p, leaf) for path, p, leaf in keyed_leaves(child, child_param))
        else:
            out.append((key, child_param, child))
    return out


def is_remote(leaf: LeafGrader) -> bool:
    """Whether `remote_graders` scores the leaf (it calls a judge, an endpoint or an embeddings endpoint)."""
    if isinstance(leaf, TextSimilarityGrader):
        return leaf.evaluation_metric in REMOTE_SIMILARITY_METRICS
    return isinstance(leaf, ScoreModelGrader | LabelModelGrader | EndpointGrader)


def remote_graders(grader: Grader, param: str = "grader") -> list[tuple[str, str, RemoteGrader]]:
    """(key, param path, leaf) of every remote leaf (`is_remote`), as `keyed_leaves` gives them."""
    out: list[tuple[str, str, RemoteGrader]] = []
    for key, path, leaf in keyed_leaves(grader, param):
        if is_remote(leaf):
            assert isinstance(leaf, ScoreModelGrader | LabelModelGrader | EndpointGrader | TextSimilarityGrader)
            out.append((key, path, leaf))
    return out


def is_batched(grader: Grader) -> bool:
    """Whether the whole grader is one leaf scored over batches outside the grading process (python or remote): its
    batch scores are its results, with nothing left for `grade` to combine."""
    return not isinstance(grader, MultiGrader) and (isinstance(grader, PythonGrader) or is_remote(grader))


def python_graders(grader: Grader) -> list[tuple[str, PythonGrader]]:
    """(key, grader) of every python leaf, keyed as `grade` keys sub_scores and reads `model_scores` (`py`,
    `quality.py`)."""
    if isinstance(grader, PythonGrader):
        return [(grader.name, grader)]
    if not isinstance(grader, MultiGrader):
        return []
    out: list[tuple[str, PythonGrader]] = []
    for key, child in grader.graders.items():
        if isinstance(child, PythonGrader):
            out.append((key, child))
        elif isinstance(child, MultiGrader):
            out.extend((f"{key}.{path}", leaf) for path, leaf in python_graders(child))
    return out


def python_grader_params(grader: dict[str, Any], path: str = "grader") -> list[tuple[str, str]]:
    """(param path of its `source`, source) of every python leaf of a grader in its JSON form (validated or not:
    what is not a python leaf with a string source is skipped), e.g. `grader.graders.py.source`."""
    if grader.get("type") == "python":
        source = grader.get("source")
        return [(f"{path}.source", source)] if isinstance(source, str) else []
    if grader.get("type") != "multi" or not isinstance(grader.get("graders"), dict):
        return []
    out: list[tuple[str, str]] = []
    for key, child in grader["graders"].items():
        if isinstance(child, dict):
            out.extend(python_grader_params(child, f"{path}.graders.{key}"))
    return out


def batched_leaf_params(grader: dict[str, Any], path: str = "grader") -> list[str]:
    """The param paths of the leaves of a grader in its JSON form (validated or not) that are scored over batches
    outside the grading process: python and remote leaves (`is_batched`, `is_remote`), found by their `type` (and a
    text_similarity's `evaluation_metric`) alone."""
    kind = grader.get("type")
    if kind in ("python", "score_model", "label_model", "endpoint") or (
        kind == "text_similarity" and grader.get("evaluation_metric") in REMOTE_SIMILARITY_METRICS
    ):
        return [path]
    if kind != "multi" or not isinstance(grader.get("graders"), dict):
        return []
    out: list[str] = []
    for key, child in grader["graders"].items():
        if isinstance(child, dict):
            out.extend(batched_leaf_params(child, f"{path}.graders.{key}"))
    return out


def grader_names(grader: Grader) -> list[str]:
    """The keys `grade` puts in sub_scores, in the same order."""
    if not isinstance(grader, MultiGrader):
        return [grader.name]
    names: list[str] = []
    for key, child in grader.graders.items():
        names.append(key)
        if isinstance(child, MultiGrader):
            names.extend(f"{key}.{name}" for name in grader_names(child))
    return names


def item_conversation(item: Mapping[str, Any]) -> list[dict[str, str]] | None:
    """The conversation an item holds, as a reward_model grader without a `prompt` scores the sample as the reply to:
    the item's `messages`, or its `prompt` string as a user turn; None when it has neither."""
    messages = item.get("messages")
    if isinstance(messages, list) and messages and all(isinstance(m, Mapping) for m in messages):
        return [{"role": str(m.get("role", "user")), "content": str(m.get("content", ""))} for m in messages]
    prompt = item.get("prompt")
    if isinstance(prompt, str) and prompt:
        return [{"role": "user", "content": prompt}]
    return None
