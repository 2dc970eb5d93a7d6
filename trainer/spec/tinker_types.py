"""The plain data of the Tinker-compatible training API, shared by the protocol codec (``api``, torch-free)
and the session's trainer (``trainer.serving.tinker_session``): numpy arrays and Python numbers, no torch.

A datum is what the SDK's ``tinker.Datum`` carries: the model input's tokens (its chunks concatenated) and the loss
function's inputs by name. Position ``i`` of the input predicts ``target_tokens[i]`` (the SDK shifts them itself), so
every input of a datum has the input's length ``T`` as its first dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

StopReason = Literal["stop", "length"]


@dataclass
class Datum:
    tokens: npt.NDArray[np.int64]  # [T] the model input
    inputs: dict[str, npt.NDArray[np.generic]]  # loss_fn_inputs: target_tokens int64 [T] or [T, K]; float32 others


@dataclass
class ForwardResult:
    """Per datum its outputs (``logprobs`` float32 of the target tokens, shaped like ``target_tokens``; the loss per
    position as ``elementwise_loss``) and the batch's metrics, each named ``name:reduction`` as the SDK requires."""

    outputs: list[dict[str, npt.NDArray[np.float32]]]
    metrics: dict[str, float]


@dataclass(frozen=True)
class AdamParams:
    """One optimiser step's AdamW settings, as the SDK's ``AdamParams`` sends them (``grad_clip_norm`` 0: no clip)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class LoraChoice:
    """The SDK's ``LoraConfig``: the rank and which parts of the model are trained."""

    rank: int = 32
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


@dataclass(frozen=True)
class SampleParams:
    """The SDK's ``SamplingParams`` (``top_k`` −1: off; ``stop`` None: the model's end of sequence only; an empty
    list: no stop at all) and ``asample``'s count and prompt log-prob flag."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] | list[int] | None = None
    num_samples: int = 1
    prompt_logprobs: bool = False


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]  # one per token: log π of the sampled token at the sampling temperature
    stop_reason: StopReason


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None  # one per prompt token, None at position 0
