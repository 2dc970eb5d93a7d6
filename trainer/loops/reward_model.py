"""Reward models: a base LM under a LoRA adapter scoring (prompt, reply) pairs, with one of three heads.

- ``likelihood`` (the default): r(x, y) = s · mean_t log π_θ(y_t | x, y_<t), the LoRA-tuned LM's mean log-probability
  of the reply's tokens (EOS included) times a learned scale s. The LM head compares each reply token with what the
  model predicts there, which a score head on hidden states must learn from scratch: on tiny-arith this ranks 1.0 of
  held-out pairs after 100 steps where the score heads plateau at 0.86–0.94 (BENCHMARKS.md). The adapter is a
  ``CAUSAL_LM`` LoRA adapter; s is stored in ``reward_model.json``.
- ``mean`` / ``last``: a base LM's backbone with a scalar score head (``AutoModelForSequenceClassification``, task
  ``SEQ_CLS``, the head in ``modules_to_save``), read on the mean of the reply's final hidden states or at the last
  real token (TRL's reward model; never at "the first pad": pad may equal EOS, rl-algorithms §4.6).

A reward model is trained by ``trainer.loops.preference`` (``method.type: reward_model``) and scored by ``reward_model``
graders (``trainer.loops.evaluate.grade_batch``). Both run the same forward (:func:`reward_scores`) on the same layout:
the prompt through the chat template, the reply, one EOS (``trainer.generation.encoding.encode_completion``).

A reward-model folder is the PEFT adapter plus ``reward_model.json``: the base model, the head (and its scale),
``max_length`` and the mean and standard deviation of its scores on its own preference data (``normalize``). A grader
names either that folder or the output folder of the job that wrote it (``<output>/adapter``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import Tensor
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from trainer.generation.encoding import completion_batch, encode_completion
from trainer.generation.models import (
    ModelError,
    Precision,
    autocast,
    default_device,
    load_tokenizer,
    no_cudnn_attention,
    resolve_precision,
    store_frozen_linears_in,
)
from trainer.generation.rollout import Rollout, completion_logprobs, position_ids
from trainer.grading.graders import reward_model_prompt
from trainer.spec import graders
from trainer.spec.lora import LoraSpec

INFO_FILE = "reward_model.json"
FORMAT = "proxima.reward_model/1"
Pooling = Literal["last", "mean"]
Head = Literal["likelihood", "mean", "last"]
SCALE = "reward_scale"  # the likelihood head's learned scale: a parameter on the PEFT model, saved in INFO_FILE


@dataclass(frozen=True)
class RewardModelInfo:
    """What ``reward_model.json`` records next to the adapter."""

    base_model: str  # the base model the adapter was trained on (name, local path or hub id)
    max_length: int  # tokens of prompt + reply + EOS it was trained on
    score_mean: float | None = None  # of its scores on its own preference pairs (chosen and rejected together)
    score_std: float | None = None
    scored_on: str | None = None  # "validation" or "training": the pairs the statistics come from
    n_scores: int = 0
    format: str = FORMAT
    head: Head = "last"  # files written before the head was a choice read the last token
    scale: float | None = None  # the likelihood head's learned scale

    def write(self, adapter_dir: Path) -> None:
        (adapter_dir / INFO_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """The score head is new when a causal LM is loaded as a classifier: transformers' load report says so at
    warning level, which is expected here, not news to the user."""
    log = logging.getLogger("transformers.modeling_utils")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


# ---------------------------------------------------------------------------------------------------------------
# The forward
# ---------------------------------------------------------------------------------------------------------------


def last_token_index(mask: Tensor) -> Tensor:
    """Index of the last position the mask keeps, per row: mask [B, T] → [B] (0 for an all-zero row). Works for any
    padding side; never infers the end from token values."""
    t = torch.arange(mask.shape[1], device=mask.device)
    return (mask.bool() * t).argmax(-1)


def _backbone_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    core = model.get_base_model() if isinstance(model, PeftModel) else model
    assert isinstance(core, PreTrainedModel)
    head = getattr(core, "score", None)
    if head is None:
        raise ModelError(f"{type(core).__name__} has no 'score' head: not a sequence-classification reward model")
    return getattr(core, core.base_model_prefix), head


def sequence_scores(
    model: torch.nn.Module, batch: Rollout, *, precision: Precision, pooling: Pooling = "last"
) -> Tensor:
    """r(x, y) of every row: the score head on the backbone's final hidden state at the last real token of
    prompt + completion (``last``), or on the mean of its states over the completion's tokens, EOS included
    (``mean``). batch of B rows → [B] fp32, differentiable when grad is enabled.

    The backbone and head are called directly (LoRA is injected into the backbone's layers) rather than through
    the classifier's forward, which pools at the last token that differs from ``pad_token_id``: wrong when pad
    equals EOS (transformers issue 35352)."""
    backbone, head = _backbone_and_head(model)
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
    with autocast(precision, ids.device):
        hidden = backbone(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False)[0]
    if pooling == "mean":
        reply = batch.completion_mask.to(hidden.dtype).unsqueeze(-1)  # [B, Tc, 1]
        states = hidden[:, batch.prompt_ids.shape[1] :]
        pooled = (states * reply).sum(1) / reply.sum(1).clamp(min=1)  # [B, H]
    else:
        pooled = hidden[torch.arange(ids.shape[0], device=ids.device), last_token_index(mask)]  # [B, H]
    # The head runs in fp32 outside autocast: one small matmul, and the reward keeps fp32 resolution.
    weight = next(head.parameters())
    return head(pooled.to(weight.dtype)).squeeze(-1).float()


def likelihood_scores(model: torch.nn.Module, batch: Rollout, *, precision: Precision, scale: Tensor | float) -> Tensor:
    """The likelihood head: s · the mean over the reply's tokens (EOS included) of log π(y_t | x, y_<t): [B] fp32."""
    logp, _ = completion_logprobs(model, batch, temperature=1.0, precision=precision)
    mask = batch.completion_mask.to(logp.dtype)
    return scale * (logp * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def reward_scores(model: torch.nn.Module, batch: Rollout, *, precision: Precision, head: Head) -> Tensor:
    """r(x, y) of every row with the model's head, differentiable when grad is enabled (training's forward)."""
    if head == "likelihood":
        return likelihood_scores(model, batch, precision=precision, scale=getattr(model, SCALE))
    return sequence_scores(model, batch, precision=precision, pooling=head)


def add_scale(model: torch.nn.Module, device: torch.device) -> None:
    """The likelihood head's scale s, a trained parameter of the model (so checkpoints restore it), starting at 1."""
    setattr(model, SCALE, torch.nn.Parameter(torch.ones((), device=device)))


# ---------------------------------------------------------------------------------------------------------------
# Building (training) and reading (grading) a reward model
# ---------------------------------------------------------------------------------------------------------------


def build_reward_model(
    base_model: str,
    lora: LoraSpec,
    *,
    pad_token_id: int,
    seed: int,
    device: torch.device,
    frozen_dtype: torch.dtype | None = None,
) -> PeftModel:
    """The base LM as ``AutoModelForSequenceClassification(num_labels=1)`` (its backbone, a fresh bias-free score
    head seeded by ``seed``) under a fresh LoRA adapter; the head is trained in full and saved with the adapter
    (``modules_to_save``, rl-algorithms §4.20). ``frozen_dtype``: store the frozen linear weights in it (bf16)."""
    torch.manual_seed(seed)  # the score head's initialisation
    try:
        with _quiet_transformers():
            base = AutoModelForSequenceClassification.from_pretrained(base_model, num_labels=1, dtype=torch.float32)
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot load model {base_model!r} with a score head: {err}") from None
    _backbone_and_head(base)
    base.config.pad_token_id = pad_token_id
    no_cudnn_attention(device)
    if frozen_dtype is not None:
        store_frozen_linears_in(base, frozen_dtype)
        base.score.to(torch.float32)  # trained in full: its master weights stay fp32
    base.to(device).eval()
    torch.manual_seed(seed)  # LoRA A's initialisation, as trainer.generation.models.add_lora
    cfg = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,  # a float is fine: PEFT scales by alpha / r
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="SEQ_CLS",
        modules_to_save=["score"],
    )
    try:
        model = get_peft_model(base, cfg)
    except ValueError as err:
        raise ModelError(f"LoRA target_modules {lora.target_modules!r}: {err}") from None
    model.eval()
    return model


def adapter_dir_of(path: Path) -> Path | None:
    """The adapter folder a grader's ``model`` names: the folder itself, or its ``adapter/`` (a job's output)."""
    for candidate in (path, path / "adapter"):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    return None


def read_info(path: Path, *, grader: str = "reward_model") -> tuple[Path, RewardModelInfo]:
    """(adapter folder, info) of a reward-model folder; :class:`graders.GraderError` saying what is wrong."""
    where = f"grader {grader!r}: model {str(path)!r}"
    if not path.exists():
        raise graders.GraderError(f"{where} does not exist")
    adapter = adapter_dir_of(path)
    if adapter is None:
        raise graders.GraderError(f"{where} holds no adapter (adapter_config.json): not a reward model's folder")
    info_path = adapter / INFO_FILE
    try:
        raw = json.loads(info_path.read_text())
        task = json.loads((adapter / "adapter_config.json").read_text()).get("task_type")
    except (OSError, json.JSONDecodeError):
        raise graders.GraderError(
            f"{where} is an adapter without a readable {INFO_FILE}: not the output of a reward_model job"
        ) from None
    expected = "CAUSAL_LM" if isinstance(raw, dict) and raw.get("head") == "likelihood" else "SEQ_CLS"
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or task != expected:
        raise graders.GraderError(f"{where} is not a reward model ({INFO_FILE} format {FORMAT}, task {expected})")
    try:
        info = RewardModelInfo(**raw)
    except TypeError as err:
        raise graders.GraderError(f"{where}: {INFO_FILE} is malformed ({err})") from None
    return adapter, info


def check_reward_models(grader: graders.Grader) -> None:
    """Every reward_model leaf of ``grader`` names a usable reward model (its folder, its base model's config, the
    statistics ``normalize`` needs), without loading weights: call before training starts."""
    for _, leaf in graders.model_graders(grader):
        _, info = read_info(Path(leaf.model), grader=leaf.name)
        if leaf.normalize and (info.score_mean is None or info.score_std is None):
            raise graders.GraderError(
                f"grader {leaf.name!r}: normalize needs the score statistics of a finished reward_model job; "
                f"{leaf.model!r} has none (an intermediate checkpoint?)"
            )
        try:
            AutoConfig.from_pretrained(info.base_model)
        except (OSError, ValueError) as err:
            raise graders.GraderError(
                f"grader {leaf.name!r}: the base model {info.base_model!r} of reward model {leaf.model!r} cannot be "
                f"loaded: {err}"
            ) from None


class RewardModel:
    """A trained reward model loaded for scoring: (prompt messages, reply) pairs → scores."""

    def __init__(self, path: Path, device: torch.device, precision: Precision | None = None) -> None:
        self.adapter_dir, self.info = read_info(path)
        self.device = device
        self.precision: Precision = precision or resolve_precision("auto", device)
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(self.info.base_model)
        likelihood = self.info.head == "likelihood"
        try:
            with _quiet_transformers():
                base = (
                    AutoModelForCausalLM.from_pretrained(self.info.base_model, dtype=torch.float32)
                    if likelihood
                    else AutoModelForSequenceClassification.from_pretrained(
                        self.info.base_model, num_labels=1, dtype=torch.float32
                    )
                )
        except (OSError, ValueError) as err:
            raise ModelError(f"cannot load model {self.info.base_model!r}: {err}") from None
        base.config.pad_token_id = self.tokenizer.pad_token_id
        # Scoring only: the LoRA weights are merged into the base (W + s·BA), so a forward is the plain model's,
        # without the adapter's extra matmuls and scaling (the same function: test_reward_model).
        self.model = PeftModel.from_pretrained(base, str(self.adapter_dir)).merge_and_unload().to(device).eval()
        context = getattr(base.config, "max_position_embeddings", None) or self.info.max_length
        self.max_length = min(self.info.max_length, context)

    def _encode(self, prompt: list[dict[str, str]], reply: str) -> tuple[list[int], list[int]]:
        """prompt ids, reply ids + EOS; cut to max_length (the reply first, keeping its EOS: the score is read
        there), which scoring can only approximate: training refuses such pairs."""
        p, c = encode_completion(self.tokenizer, prompt, reply)
        if len(p) + len(c) > self.max_length:
            keep = max(self.max_length - len(p), 1)
            c = [*c[: keep - 1], c[-1]]
            p = p[len(p) + len(c) - self.max_length :] if len(p) + len(c) > self.max_length else p
        return p, c

    @torch.no_grad()
    def score(self, prompts: Sequence[list[dict[str, str]]], replies: Sequence[str], *, batch_size: int) -> Tensor:
        """Raw scores [N] (fp32, on the CPU), ``batch_size`` sequences per forward pass."""
        out = []
        for start in range(0, len(replies), batch_size):
            chunk = zip(prompts[start : start + batch_size], replies[start : start + batch_size], strict=True)
            enc = [self._encode(p, r) for p, r in chunk]
            batch = completion_batch([p for p, _ in enc], [c for _, c in enc], self.tokenizer.pad_token_id)
            out.append(self._forward(batch.to(self.device)).cpu())
        return torch.cat(out) if out else torch.zeros(0)

    def _forward(self, batch: Rollout) -> Tensor:
        if self.info.head == "likelihood":
            scale = self.info.scale if self.info.scale is not None else 1.0
            return likelihood_scores(self.model, batch, precision=self.precision, scale=scale)
        return sequence_scores(self.model, batch, precision=self.precision, pooling=self.info.head)

    def normalize(self, scores: Tensor) -> Tensor:
        assert self.info.score_mean is not None and self.info.score_std is not None
        return (scores - self.info.score_mean) / max(self.info.score_std, 1e-8)


@functools.lru_cache(maxsize=4)
def _cached(path: str, device: str, precision: Precision | None, stamp: float) -> RewardModel:
    return RewardModel(Path(path), torch.device(device), precision)


def load_reward_model(
    path: Path, device: torch.device | None = None, precision: Precision | None = None
) -> RewardModel:
    """The reward model in ``path``, loaded once per process, device and precision (default: bf16 where it is
    fast, as the policy); a folder rewritten since is loaded again."""
    adapter, _ = read_info(path)
    weights = adapter / "adapter_model.safetensors"
    stamp = weights.stat().st_mtime if weights.exists() else 0.0
    return _cached(str(adapter.resolve()), str(device or default_device()), precision, stamp)


def score_samples(
    grader: graders.RewardModelGrader, texts: Sequence[str], items: Sequence[Mapping[str, Any]]
) -> Tensor:
    """The grader's reward for each (completion text, dataset row): [N] fp32, normalised when it asks."""
    read_info(Path(grader.model), grader=grader.name)  # errors name the grader
    rm = load_reward_model(Path(grader.model))
    prompts = []
    for item in items:
        prompt = reward_model_prompt(grader, item)
        if prompt is None:
            raise graders.GraderError(
                f"grader {grader.name!r} takes its prompt from the item's 'messages' or 'prompt', and it has neither"
            )
        prompts.append(prompt)
    scores = rm.score(prompts, list(texts), batch_size=grader.batch_size)
    if grader.normalize:
        if rm.info.score_mean is None:
            raise graders.GraderError(f"grader {grader.name!r}: {grader.model!r} has no score statistics")
        scores = rm.normalize(scores)
    return scores


def score_statistics(scores: Tensor) -> tuple[float, float]:
    """(mean, unbiased std) of a score sample, std 1 for fewer than two scores."""
    if scores.numel() < 2:
        return (float(scores.mean()) if scores.numel() else 0.0), 1.0
    std = float(scores.std())
    return float(scores.mean()), std if math.isfinite(std) and std > 0 else 1.0
