"""One Tinker training session on this machine: a base model with a fresh LoRA adapter, trained and sampled
through the calls of the official Tinker SDK — ``forward_backward``, ``optim_step``, ``sample``, ``save_state`` /
``load_state``. The protocol, the queue and the storage are the service's; this module is the torch side only and
takes and returns the plain data of :mod:`trainer.spec.tinker_types`.

Tinker's semantics, and where they come from:

- LoRA: rank from the client, α = 32 for every rank (the update is scaled by 32/r; "LoRA Without Regret",
  thinkingmachines.ai/blog/lora, and the cookbook's ``get_lora_lr_over_full_finetune_lr(lora_alpha=32)`` in
  ``hyperparam_utils``), A random and B = 0 (the policy starts as the base), no dropout; ``train_attn`` /
  ``train_mlp`` / ``train_unembed`` choose the attention projections, the MLP projections and the LM head (SDK
  ``types.LoraConfig``).
- Losses: tinker-docs "Loss functions" (``docs/losses.mdx`` of thinking-machines-lab/tinker-cookbook,
  https://tinker-docs.thinkingmachines.ai/tinker/losses/): position ``i`` of the input predicts
  ``target_tokens[i]``; every loss is a per-token loss **summed** over the positions and the batch (no mean:
  normalisation is the client's, in its advantages or weights); the metric is ``loss:sum``. The table
  :data:`TINKER_LOSSES` names, for each, the parts of :mod:`trainer.algorithms.core_algos` it is made of.
- Optimiser: AdamW with decoupled weight decay, its settings sent with every step, ``grad_clip_norm`` 0 = no clip
  (SDK ``types.AdamParams``).
- Sampling: ``stop`` None stops at the model's end of sequence, ``[]`` disables every stop including EOS
  (SDK ``types.SamplingParams``); a returned sequence includes the token that stopped it (the cookbook's
  ``renderers.parse_response`` strips a final EOS and splits the text on a stop string itself).
"""

from __future__ import annotations

import contextlib
import json
import math
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from pydantic import ValidationError
from safetensors.torch import load_file
from torch import Tensor

from trainer.algorithms.core_algos import POLICY_LOSSES, ClipOptions, dro_loss, gspo_token_old_logp, masked_sum
from trainer.generation.models import ModelError, Precision, load_tokenizer, reference_policy
from trainer.generation.rollout import Rollout, completion_logprobs, micro_slices
from trainer.generation.rollout_engine import HFRolloutEngine, SamplingParams
from trainer.loops import checkpoint as ckpt
from trainer.loops.engine import Engine, ParamGroup, load_policy
from trainer.spec.config import Hyperparameters
from trainer.spec.lora import LoraSpec
from trainer.spec.tinker_types import (
    AdamParams,
    Datum,
    ForwardResult,
    LoraChoice,
    SampledSequence,
    SampleParams,
    SampleResult,
)

TINKER_LORA_ALPHA = 32.0
"""Tinker's fixed LoRA α (module docstring): with it the best learning rate does not depend on the rank."""

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
"""Llama-family module names (Llama, Qwen, Mistral): what ``train_attn`` / ``train_mlp`` / ``train_unembed`` select."""

STATE_FILE = "tinker_state.pt"
"""Beside the adapter's files in a :meth:`TrainingSession.save_state` folder: the engine's state (weights, optimiser,
the sampling RNG) and ``optimizer_steps``."""
STATE_FORMAT = 2

Weights = dict[str, Tensor] | Literal["current", "base"]


class SessionInputError(ValueError):
    """A request this session cannot serve as sent (a user error, never a bug): the message says what to change."""


class LossInputError(SessionInputError):
    """A ``forward_backward`` whose loss, loss inputs or loss config are missing, malformed or unsupported; the
    message names the loss, the input and the datum."""


# -- the losses ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossBatch:
    """What a Tinker loss reads, right-padded over the batch: ``logp`` [B, T, K] the log-probs of the target tokens
    (K = 1 unless a datum gave [T, K] candidates), ``mask`` [B, T] 1 on each datum's positions, ``inputs`` the
    loss inputs [B, T] (``weights``: [B, T, K]), 0 on padding."""

    logp: Tensor
    mask: Tensor
    inputs: dict[str, Tensor]

    @property
    def token_logp(self) -> Tensor:
        """[B, T]: the log-prob of the one target token of each position (the policy-gradient losses)."""
        return self.logp[..., 0]


@dataclass(frozen=True)
class TinkerLoss:
    """A Tinker loss: the ``loss_fn_inputs`` it needs besides ``target_tokens``, the ``loss_fn_config`` keys it
    accepts with their defaults (None: required), whether targets may be [T, K], and its per-token loss [B, T]."""

    inputs: tuple[str, ...]
    per_token: Callable[[LossBatch, Mapping[str, float]], Tensor]
    config: Mapping[str, float | None] = field(default_factory=dict)
    candidates: bool = False


def _clip(config: Mapping[str, float]) -> ClipOptions:
    """Tinker's clip thresholds are bounds on the ratio (0.8, 1.2), ours are ε: clip(ρ, 1 − ε_low, 1 + ε_high)."""
    return ClipOptions(1.0 - config["clip_low_threshold"], config["clip_high_threshold"] - 1.0)


def _cross_entropy(b: LossBatch, config: Mapping[str, float]) -> Tensor:
    """L_t = −Σ_k w_{t,k}·log p(target_{t,k}); weights of any sign (the SDK's ``forward_backward_custom`` sends
    w = −∂C/∂log p)."""
    return torch.where(b.mask.bool(), -(b.inputs["weights"] * b.logp).sum(-1), 0.0)


def _policy_loss(name: str, *, clipped: bool) -> Callable[[LossBatch, Mapping[str, float]], Tensor]:
    """A loss of ``core_algos.POLICY_LOSSES`` on (sampling log-probs, advantages), with Tinker's clip thresholds."""

    def per_token(b: LossBatch, config: Mapping[str, float]) -> Tensor:
        opts = _clip(config) if clipped else ClipOptions()
        out = POLICY_LOSSES.get(name)(b.token_logp, b.inputs["logprobs"], b.inputs["advantages"], b.mask, opts)
        return out.per_token

    return per_token


def _gspo(b: LossBatch, config: Mapping[str, float]) -> Tensor:
    """GSPO-token: PPO's clipped surrogate on the sequence ratio over ``sequence_ratio_mask`` (every position carries
    its value, each with its own log-prob's gradient), summed over every position as Tinker does."""
    in_ratio = (b.inputs["sequence_ratio_mask"] != 0).float() * b.mask
    old = gspo_token_old_logp(b.token_logp, b.inputs["logprobs"], in_ratio)
    return POLICY_LOSSES.get("clipped")(b.token_logp, old, b.inputs["advantages"], b.mask, _clip(config)).per_token


def _dro(b: LossBatch, config: Mapping[str, float]) -> Tensor:
    return dro_loss(b.token_logp, b.inputs["logprobs"], b.inputs["advantages"], b.mask, beta=config["beta"])


_CLIP_DEFAULTS: Mapping[str, float | None] = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_PG_INPUTS = ("logprobs", "advantages")

TINKER_LOSSES: Mapping[str, TinkerLoss] = {
    # L = Σ −w·log p  (tinker-docs "Loss functions": cross_entropy)
    "cross_entropy": TinkerLoss(("weights",), _cross_entropy, candidates=True),
    # L = Σ −ρ·A, ρ = p/q  (importance_sampling)
    "importance_sampling": TinkerLoss(_PG_INPUTS, _policy_loss("importance_sampling", clipped=False)),
    # L = Σ −min(ρA, clip(ρ, lo, hi)·A), lo/hi default 0.8/1.2 (ppo; cookbook tutorials/202_loss_functions.py)
    "ppo": TinkerLoss(_PG_INPUTS, _policy_loss("clipped", clipped=True), _CLIP_DEFAULTS),
    # L = Σ −sg(clip(ρ, lo, hi))·A·log p, same thresholds (cispo)
    "cispo": TinkerLoss(_PG_INPUTS, _policy_loss("cispo", clipped=True), _CLIP_DEFAULTS),
    # L = Σ −min(s_t·A, clip(s_t, lo, hi)·A), s_t the sequence ratio (tinker-docs losses/gspo). Tinker's documented
    # defaults for gspo's thresholds were not found: those of ppo and cispo are used.
    "gspo": TinkerLoss((*_PG_INPUTS, "sequence_ratio_mask"), _gspo, _CLIP_DEFAULTS),
    # L = Σ −(A·log p − ½β·(log p − log q)²); β has no documented default, so it is required (losses: dro)
    "dro": TinkerLoss(_PG_INPUTS, _dro, {"beta": None}),
}

UNSUPPORTED_LOSSES: Mapping[str, str] = {
    "stable_reinforce": "Tinker has not published its objective nor what record_stability_info records at sampling "
    "time (an alpha loss); importance_sampling, ppo, cispo, gspo and dro are offered",
    "custom": "losses uploaded with create_custom_loss are not run on this server; forward_backward_custom with a "
    "Python function works",
}


def tinker_loss(name: str) -> TinkerLoss:
    """The loss called ``name``, or a :class:`LossInputError` saying it is unsupported or unknown."""
    if name in UNSUPPORTED_LOSSES:
        raise LossInputError(f"loss {name!r} is not supported by this server: {UNSUPPORTED_LOSSES[name]}")
    if name not in TINKER_LOSSES:
        raise LossInputError(f"unknown loss {name!r}; valid: {', '.join(sorted(TINKER_LOSSES))}")
    return TINKER_LOSSES[name]


def resolve_loss_config(name: str, loss: TinkerLoss, config: Mapping[str, float | str]) -> dict[str, float]:
    """``loss_fn_config`` with the loss's defaults filled in; unknown keys, missing required ones, non-numbers and
    thresholds out of order are :class:`LossInputError`."""
    unknown = sorted(set(config) - set(loss.config))
    if unknown:
        accepted = ", ".join(sorted(loss.config)) or "none"
        raise LossInputError(f"loss {name!r} does not take loss_fn_config {', '.join(unknown)}; it takes: {accepted}")
    out: dict[str, float] = {}
    for key, default in loss.config.items():
        value = config.get(key, default)
        if value is None:
            raise LossInputError(f"loss {name!r} needs loss_fn_config {key!r}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise LossInputError(f"loss {name!r}: loss_fn_config {key!r} must be a finite number, not {value!r}")
        out[key] = float(value)
    if "clip_low_threshold" in out and not 0.0 <= out["clip_low_threshold"] <= out["clip_high_threshold"]:
        raise LossInputError(f"loss {name!r}: need 0 ≤ clip_low_threshold ≤ clip_high_threshold, got {out}")
    if out.get("beta", 0.0) < 0:
        raise LossInputError(f"loss {name!r}: beta must be ≥ 0, got {out['beta']}")
    return out


# -- checking a datum ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckedDatum:
    """A datum as the forward uses it: tokens [T], targets [T, K], float inputs ([T], ``weights`` [T, K])."""

    tokens: npt.NDArray[np.int64]
    targets: npt.NDArray[np.int64]
    candidates: bool  # target_tokens was [T, K]
    inputs: dict[str, npt.NDArray[np.float32]]


def check_datum(i: int, datum: Datum, name: str, loss: TinkerLoss, *, vocab: int, context: int) -> CheckedDatum:
    """Datum ``i`` checked against loss ``name``: every needed input present, no other, each with the input's length
    T, token ids inside the vocabulary, floats finite. Anything else is a :class:`LossInputError` naming it."""
    where = f"datum {i}"
    t = len(datum.tokens)
    if t == 0 or t > context:
        raise LossInputError(f"{where}: the model input has {t} tokens; it needs 1 to {context} (the model's context)")
    _check_ids(where, "model input", datum.tokens, vocab)
    needed = {"target_tokens", *loss.inputs}
    missing, extra = sorted(needed - set(datum.inputs)), sorted(set(datum.inputs) - needed)
    if missing:
        raise LossInputError(f"{where}: loss {name!r} needs loss_fn_inputs {', '.join(map(repr, missing))}")
    if extra:
        raise LossInputError(f"{where}: loss {name!r} does not take loss_fn_inputs {', '.join(map(repr, extra))}")
    targets = np.asarray(datum.inputs["target_tokens"])
    shapes = "[T] or [T, K]" if loss.candidates else "[T]"
    if targets.ndim not in ((1, 2) if loss.candidates else (1,)) or targets.shape[0] != t or targets.size == 0:
        raise LossInputError(
            f"{where}: target_tokens has shape {list(targets.shape)}; loss {name!r} needs {shapes}, T={t}"
        )
    _check_ids(where, "target_tokens", targets, vocab)
    inputs = {
        n: _float_input(where, n, datum.inputs[n], targets.shape if n == "weights" else (t,)) for n in loss.inputs
    }
    if "weights" in inputs and targets.ndim == 1:
        inputs["weights"] = inputs["weights"][:, None]
    tokens = np.asarray(datum.tokens, dtype=np.int64)
    return CheckedDatum(tokens, targets.astype(np.int64).reshape(t, -1), targets.ndim == 2, inputs)


def _check_ids(where: str, what: str, ids: npt.NDArray[Any], vocab: int) -> None:
    if not np.issubdtype(ids.dtype, np.integer):
        raise LossInputError(f"{where}: {what} must be integer token ids, not {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise LossInputError(f"{where}: {what} holds a token id outside the vocabulary (0 to {vocab - 1})")


def _float_input(where: str, name: str, value: npt.NDArray[Any], shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
    arr = np.asarray(value)
    if arr.shape != shape:
        raise LossInputError(f"{where}: {name!r} has shape {list(arr.shape)}, the loss needs {list(shape)}")
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise LossInputError(f"{where}: {name!r} must hold numbers, not {arr.dtype}")
    out = arr.astype(np.float32)
    if not np.isfinite(out).all():
        raise LossInputError(f"{where}: {name!r} holds a NaN or an infinity")
    return out


def _pad(data: Sequence[CheckedDatum], device: torch.device) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
    """Right-padded ids [B, T], mask [B, T], targets [B, T, K] and float inputs ([B, T] / weights [B, T, K])."""
    b, t, k = len(data), max(len(d.tokens) for d in data), max(d.targets.shape[1] for d in data)
    ids = np.zeros((b, t), np.int64)
    mask = np.zeros((b, t), np.float32)
    targets = np.zeros((b, t, k), np.int64)
    inputs = {n: np.zeros((b, t, k) if n == "weights" else (b, t), np.float32) for n in data[0].inputs}
    for i, d in enumerate(data):
        n, kd = len(d.tokens), d.targets.shape[1]
        ids[i, :n], mask[i, :n], targets[i, :n, :kd] = d.tokens, 1.0, d.targets
        for name, arr in d.inputs.items():
            if name == "weights":
                inputs[name][i, :n, :kd] = arr
            else:
                inputs[name][i, :n] = arr

    def as_tensor(a: npt.NDArray[Any]) -> Tensor:
        return torch.from_numpy(a).to(device)

    return as_tensor(ids), as_tensor(mask), as_tensor(targets), {n: as_tensor(a) for n, a in inputs.items()}


# -- sampling's stops ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StopRule:
    """When a sampled sequence ends: on one of ``token_ids``, or once its decoded text contains one of ``strings``."""

    token_ids: frozenset[int]
    strings: tuple[str, ...]

    @classmethod
    def of(cls, stop: Sequence[str] | Sequence[int] | None, eos_ids: frozenset[int]) -> StopRule:
        """None: the model's EOS; ``[]``: nothing (run to max_tokens); token ids or strings: those, and EOS."""
        if stop is None:
            return cls(eos_ids, ())
        if not stop:
            return cls(frozenset(), ())
        if all(isinstance(s, str) for s in stop):
            if any(s == "" for s in stop):
                raise SessionInputError("a stop string must not be empty")
            return cls(eos_ids, tuple(str(s) for s in stop))
        if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
            return cls(eos_ids | frozenset(int(s) for s in stop), ())
        raise SessionInputError("stop must be a list of strings or a list of token ids, not a mix")


# -- the session -----------------------------------------------------------------------------------------------------


class TrainingSession:
    """A base model with a LoRA adapter held by a training :class:`~trainer.loops.engine.Engine` (the jobs' engine: its
    forward, backward, AdamW step and state), and the Tinker calls on it.

    ``optimizer_steps`` counts optimiser steps since the adapter was created (or its state loaded);
    ``weights_version`` (the engine's) goes up by one at every change of the trainable weights (a step, a load), so
    that a cache of them (a sampler) knows when it is stale."""

    def __init__(
        self,
        model_path: str,
        lora: LoraChoice,
        *,
        device: torch.device,
        precision: Precision,
        micro_batch_size: int | None = None,
    ) -> None:
        self.lora, self.device, self.precision = lora, device, precision
        self.micro_batch_size = micro_batch_size  # datums per forward in forward_backward (None: all at once)
        policy = load_policy(model_path, lora_spec(lora), device=device, precision=precision, seed=lora.seed or 0)
        self.model = policy.model
        self.tokenizer = load_tokenizer(model_path)
        self.trainable = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        defaults = AdamParams()
        self.engine = Engine(
            self.model,
            groups=[ParamGroup(list(self.trainable.values()), defaults.learning_rate)],
            hp=Hyperparameters(max_grad_norm=None),  # clipping, like every AdamW setting, comes with each step
            total_steps=1,
            device=device,
            precision=precision,
            data_order=None,  # the client brings the data
            seed=lora.seed or 0,
            dropout=False,
        )
        self._set_adam(defaults)
        self.optimizer_steps = 0
        config = self.model.get_base_model().config
        self.vocab = int(self.model.get_output_embeddings().weight.shape[0])
        self.context = int(getattr(config, "max_position_embeddings", None) or 2**31 - 1)
        self.eos_ids = _eos_ids(self.model.get_base_model(), self.tokenizer.eos_token_id)
        eos = self.tokenizer.eos_token_id
        self.rollout = HFRolloutEngine(  # samples the policy itself: snapshots are swapped into it
            self.model,
            eos_id=eos,
            pad_id=self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos,
            device=device,
            precision=precision,
            tokenizer=self.tokenizer,
        )

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def weights_version(self) -> int:
        return self.engine.weights_version

    # -- training --------------------------------------------------------------------------------------------------

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, config: Mapping[str, float | str], *, backward: bool
    ) -> ForwardResult:
        """One forward of ``data`` with Tinker loss ``loss_fn`` (summed over positions and datums); with ``backward``
        its gradient is added to the gradients that wait for the next :meth:`optim_step`. Per datum: ``logprobs``
        (shaped like ``target_tokens``) and ``elementwise_loss`` [T]; metrics ``loss:sum``. Every datum is checked
        before anything runs."""
        loss = tinker_loss(loss_fn)
        resolved = resolve_loss_config(loss_fn, loss, config)
        if not data:
            raise LossInputError("forward_backward needs at least one datum")
        checked = [check_datum(i, d, loss_fn, loss, vocab=self.vocab, context=self.context) for i, d in enumerate(data)]
        outputs: list[dict[str, npt.NDArray[np.float32]]] = []
        total = 0.0
        for sl in micro_slices(len(checked), self.micro_batch_size):
            part_outputs, part_loss = self._forward_part(checked[sl], loss, resolved, backward=backward)
            outputs += part_outputs
            total += part_loss
        return ForwardResult(outputs, {"loss:sum": total})

    def _forward_part(
        self, data: Sequence[CheckedDatum], loss: TinkerLoss, config: Mapping[str, float], *, backward: bool
    ) -> tuple[list[dict[str, npt.NDArray[np.float32]]], float]:
        ids, mask, targets, inputs = _pad(data, self.device)
        with torch.set_grad_enabled(backward):
            logp = self.engine.token_logprobs(ids, mask, targets)  # [B, T, K]
            per_token = loss.per_token(LossBatch(logp, mask, inputs), config)  # [B, T]
            total = masked_sum(per_token, mask)
            if backward:
                self.engine.backward(total)
        logp_np, loss_np = logp.detach().float().cpu().numpy(), per_token.detach().float().cpu().numpy()
        outputs = []
        for i, d in enumerate(data):
            n, k = len(d.tokens), d.targets.shape[1]
            lp = logp_np[i, :n, :k] if d.candidates else logp_np[i, :n, 0]
            outputs.append({"logprobs": lp.copy(), "elementwise_loss": loss_np[i, :n].copy()})
        return outputs, float(total.detach())

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """One AdamW step on the gradients accumulated since the last step, with ``adam``'s settings; the gradient
        is first clipped to ``grad_clip_norm`` (when > 0). Returns the gradient norm before clipping. A non-finite
        norm skips the step (the weights stay as they are) and is reported in ``skipped_steps:sum``."""
        _check_adam(adam)
        self._set_adam(adam)
        max_norm = adam.grad_clip_norm if adam.grad_clip_norm > 0 else math.inf
        (norm,) = self.engine.optim_step(max_grad_norm=max_norm, skip_non_finite=True)
        skipped = not math.isfinite(norm)
        if not skipped:
            self.optimizer_steps += 1
        self.engine.zero_grad()
        return {"grad_norm:mean": norm, "learning_rate:mean": adam.learning_rate, "skipped_steps:sum": float(skipped)}

    def _set_adam(self, adam: AdamParams) -> None:
        self.engine.set_adam(
            learning_rate=adam.learning_rate,
            betas=(adam.beta1, adam.beta2),
            eps=adam.eps,
            weight_decay=adam.weight_decay,
        )

    # -- weights ---------------------------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Tensor]:
        """A CPU copy of the trainable (LoRA) weights, by parameter name."""
        return {n: p.detach().to("cpu", copy=True) for n, p in self.trainable.items()}

    def save_adapter(self, folder: Path) -> None:
        """The LoRA weights as a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``)."""
        ckpt.save_adapter(self.model, folder)

    def save_state(self, folder: Path, *, gradients: bool = False) -> None:
        """Everything to resume exactly, in another process too: the PEFT adapter and, beside it,
        :data:`STATE_FILE` (the optimiser's state and ``optimizer_steps``); with ``gradients``, the gradients
        waiting for the next step too (an idle session unloaded between ``forward_backward`` and ``optim_step``
        keeps them; a client's ``save_state`` does not, as in Tinker)."""
        self.save_adapter(folder)
        engine = self.engine.state(self.optimizer_steps, process_rng=False)  # the host's RNGs are not the session's
        state = {"format": STATE_FORMAT, "optimizer_steps": self.optimizer_steps, "engine": engine}
        if gradients:
            state["gradients"] = {n: p.grad.detach().cpu() for n, p in self.trainable.items() if p.grad is not None}
        torch.save(state, folder / STATE_FILE)

    def has_gradients(self) -> bool:
        """Whether gradients wait for an optimiser step."""
        return any(p.grad is not None for p in self.trainable.values())

    def load_state(self, folder: Path, *, optimizer: bool) -> None:
        """Load a :meth:`save_state` folder: the weights and, with ``optimizer``, the optimiser's state and
        ``optimizer_steps`` (and the waiting gradients it was saved with); without, the optimiser starts afresh
        (Tinker's ``load_state``: "optimizer resets"). Gradients waiting for a step are dropped first. Nothing
        changes when the folder does not fit this session."""
        state = _read_state(folder) if optimizer else None
        self.load_adapter_weights(folder)  # checks that the folder fits this session first
        self.optimizer.state.clear()
        self.optimizer_steps = 0
        if state is not None:
            self.engine.load_state(state["engine"])
            self.optimizer_steps = int(state["optimizer_steps"])
            for name, grad in state.get("gradients", {}).items():
                param = self.trainable[name]
                param.grad = grad.to(param.device, param.dtype)

    def load_adapter_weights(self, folder: Path) -> None:
        """Set the LoRA weights from a PEFT adapter folder written by :meth:`save_adapter` or :meth:`save_state`
        (which must have this session's rank, α and modules). Gradients waiting for a step are dropped."""
        weights = self._adapter_file(folder)
        with torch.no_grad():
            set_peft_model_state_dict(self.model, weights)
        self.engine.zero_grad()
        self.engine.weights_changed()

    def read_adapter_snapshot(self, folder: Path) -> dict[str, Tensor]:
        """A PEFT adapter folder's weights as a :meth:`snapshot` (to sample with), the session's own weights and
        waiting gradients untouched."""
        weights = self._adapter_file(folder)
        current = {n: p.detach().clone() for n, p in self.trainable.items()}
        try:
            with torch.no_grad():
                set_peft_model_state_dict(self.model, weights)
            return self.snapshot()
        finally:
            self._copy_in(current)

    def _adapter_file(self, folder: Path) -> dict[str, Tensor]:
        """The weights of an adapter folder that fits this session (its rank, α and modules), by PEFT's names."""
        expected, found = lora_spec(self.lora), adapter_lora(folder)
        if (found.r, found.alpha, found.target_modules) != (expected.r, expected.alpha, expected.target_modules):
            raise SessionInputError(f"the adapter in {folder.name} has LoRA {found}, this session {expected}")
        weights = load_file(str(folder / "adapter_model.safetensors"), device=str(self.device))
        wanted = {k: v.shape for k, v in get_peft_model_state_dict(self.model).items()}
        if {k: v.shape for k, v in weights.items()} != wanted:
            raise SessionInputError(f"the adapter in {folder.name} does not hold this model's LoRA weights")
        return weights

    @contextlib.contextmanager
    def _weights(self, weights: Weights) -> Iterator[None]:
        """Run the body with ``weights``: as they are, the base (adapter off), or a :meth:`snapshot` swapped in and
        the current weights copied back after, bit for bit."""
        if isinstance(weights, dict):
            shapes = {n: p.shape for n, p in self.trainable.items()}
            if {n: w.shape for n, w in weights.items()} != shapes:
                raise SessionInputError("the weights to sample with are not a snapshot of this session's adapter")
            current = {n: p.detach().clone() for n, p in self.trainable.items()}
            try:
                self._copy_in(weights)
                yield
            finally:
                self._copy_in(current)
        elif weights == "base":
            with reference_policy(self.model):
                yield
        else:
            yield

    @torch.no_grad()
    def _copy_in(self, weights: Mapping[str, Tensor]) -> None:
        for name, p in self.trainable.items():
            p.copy_(weights[name])

    # -- sampling --------------------------------------------------------------------------------------------------

    def sample(self, prompt: Sequence[int], params: SampleParams, *, weights: Weights = "current") -> SampleResult:
        """``params.num_samples`` completions of ``prompt``, one batch of the rollout engine (the jobs' sampler), each
        with the log-prob of every token under the distribution it was sampled from (at ``params.temperature``; at
        temperature 0, the model's own, T = 1; before top-k and top-p), and the prompt's log-probs when asked.
        ``weights``: "current", "base" (the adapter off) or a :meth:`snapshot`; the session's weights are the same
        after as before."""
        return self.sample_many([(prompt, params)], weights=weights)[0]

    def sample_many(
        self, requests: Sequence[tuple[Sequence[int], SampleParams]], *, weights: Weights = "current"
    ) -> list[SampleResult]:
        """Several :meth:`sample` requests in one generation: their settings must agree but for ``num_samples`` and
        ``prompt_logprobs`` (:func:`batch_key`), and a seeded request samples alone (its seed fixes its draws)."""
        checked = [
            (_checked_prompt(prompt, params, vocab=self.vocab, context=self.context), params)
            for prompt, params in requests
        ]
        params = checked[0][1]
        if len(checked) > 1 and any(batch_key(p) is None or batch_key(p) != batch_key(params) for _, p in checked):
            raise ValueError("sample_many: the requests' settings differ, or one of them is seeded")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        generator = torch.Generator(self.device).manual_seed(seed & (2**64 - 1))
        rule = StopRule.of(params.stop, self.eos_ids)
        sampling = SamplingParams(
            max_new_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            stop_token_ids=rule.token_ids,
            stop_strings=rule.strings,
            logprobs=True,
        )
        rows = [ids for ids, p in checked for _ in range(p.num_samples)]
        with self._weights(weights):
            out = self.rollout.generate(rows, sampling, generator=generator)
            prompt_lps = [
                _prompt_logprobs(self.model, ids, self.device, self.precision) if p.prompt_logprobs else None
                for ids, p in checked
            ]
        assert out.logprobs is not None
        lengths, truncated = out.rollout.lengths.tolist(), out.rollout.truncated.tolist()
        ids, logprobs = out.rollout.completion_ids.tolist(), out.logprobs.tolist()
        sequences = [
            SampledSequence(ids[i][:n], logprobs[i][:n], "length" if truncated[i] else "stop")
            for i, n in enumerate(lengths)
        ]
        results, start = [], 0
        for (_, p), prompt_lp in zip(checked, prompt_lps, strict=True):
            results.append(SampleResult(sequences[start : start + p.num_samples], prompt_lp))
            start += p.num_samples
        return results

    def check_sample(self, prompt: Sequence[int], params: SampleParams) -> None:
        """Raise the :class:`SessionInputError` :meth:`sample` would raise for this request, sampling nothing."""
        _checked_prompt(prompt, params, vocab=self.vocab, context=self.context)
        StopRule.of(params.stop, self.eos_ids)


def _checked_prompt(prompt: Sequence[int], params: SampleParams, *, vocab: int, context: int) -> list[int]:
    """The prompt's token ids, once the prompt and the sampling settings are known to be valid for a model of
    ``vocab`` tokens and a ``context`` of that many (a :class:`SessionInputError` says what is not)."""
    ids = [int(t) for t in prompt]
    if not ids:
        raise SessionInputError("the prompt is empty")
    if min(ids) < 0 or max(ids) >= vocab:
        raise SessionInputError(f"the prompt holds a token id outside the vocabulary (0 to {vocab - 1})")
    if params.max_tokens < 1 or params.num_samples < 1:
        raise SessionInputError("max_tokens and num_samples must be at least 1")
    if len(ids) + params.max_tokens > context:
        raise SessionInputError(
            f"the prompt ({len(ids)} tokens) and max_tokens ({params.max_tokens}) exceed the model's context "
            f"of {context} tokens"
        )
    if not (params.temperature >= 0 and 0 < params.top_p <= 1 and params.top_k >= -1):
        raise SessionInputError("need temperature ≥ 0, 0 < top_p ≤ 1 and top_k ≥ −1 (−1 or 0: off)")
    return ids


def _prompt_logprobs(
    model: torch.nn.Module, prompt: list[int], device: torch.device, precision: Precision
) -> list[float | None]:
    """log p(prompt[i] | prompt[:i]) at T = 1 for i ≥ 1; None for the first token, which has no context."""
    if len(prompt) == 1:
        return [None]
    rest: list[float | None] = list(_sequence_logprobs(model, prompt[:1], [prompt[1:]], 1.0, device, precision)[0])
    return [None, *rest]


@torch.no_grad()
def _sequence_logprobs(
    model: torch.nn.Module,
    prompt: list[int],
    rows: list[list[int]],
    temperature: float,
    device: torch.device,
    precision: Precision,
) -> list[list[float]]:
    """log π(token | prefix) / T-scaled of every token of ``rows`` after ``prompt``: one teacher-forced forward, as
    the training forward computes it."""
    n, width = len(rows), max(len(r) for r in rows)
    lengths = torch.tensor([len(r) for r in rows], device=device)
    completion = torch.zeros((n, width), dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        completion[i, : len(r)] = torch.tensor(r, device=device)
    cmask = (torch.arange(width, device=device) < lengths.unsqueeze(-1)).long()
    prompt_ids = torch.tensor([prompt] * n, device=device)
    batch = Rollout(prompt_ids, torch.ones_like(prompt_ids), completion, cmask, lengths, lengths == width)
    logp, _ = completion_logprobs(model, batch, temperature=temperature, precision=precision)
    return [logp[i, : len(r)].tolist() for i, r in enumerate(rows)]


# -- helpers ---------------------------------------------------------------------------------------------------------


def batch_key(params: SampleParams) -> tuple[Any, ...] | None:
    """What sample requests that share one generation must agree on (None: a seeded request, which samples alone)."""
    if params.seed is not None:
        return None
    stop = None if params.stop is None else tuple(params.stop)
    return (params.max_tokens, params.temperature, params.top_p, params.top_k, stop)


def lora_spec(lora: LoraChoice) -> LoraSpec:
    """Tinker's LoRA as a :class:`LoraSpec`: the rank, α = 32, no dropout, the chosen Llama-family modules."""
    modules = [
        *(ATTENTION_MODULES if lora.train_attn else ()),
        *(MLP_MODULES if lora.train_mlp else ()),
        *(UNEMBED_MODULES if lora.train_unembed else ()),
    ]
    if not modules:
        raise ModelError("LoRA must train at least one of the attention, the MLP and the unembedding")
    try:
        return LoraSpec(r=lora.rank, alpha=TINKER_LORA_ALPHA, dropout=0.0, target_modules=sorted(modules))
    except ValidationError:
        raise ModelError(f"LoRA rank {lora.rank}: must be 1 to 1024") from None


def adapter_lora(folder: Path) -> LoraSpec:
    """The LoRA of a PEFT adapter folder (its ``adapter_config.json``)."""
    try:
        cfg = json.loads((folder / "adapter_config.json").read_text())
        modules = cfg["target_modules"]
        modules = sorted(modules) if isinstance(modules, list) else modules
        return LoraSpec(r=cfg["r"], alpha=cfg["lora_alpha"], dropout=cfg["lora_dropout"], target_modules=modules)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SessionInputError(f"{folder.name} is not a LoRA adapter folder: {err}") from None


def saved_lora_choice(folder: Path) -> LoraChoice:
    """The :class:`LoraChoice` a session must be created with to load ``folder`` (a :meth:`TrainingSession.save_state`
    or :meth:`TrainingSession.save_adapter` folder)."""
    spec = adapter_lora(folder)
    chosen = set(spec.target_modules)
    return LoraChoice(
        rank=spec.r,
        train_attn=bool(chosen & set(ATTENTION_MODULES)),
        train_mlp=bool(chosen & set(MLP_MODULES)),
        train_unembed=bool(chosen & set(UNEMBED_MODULES)),
    )


def _read_state(folder: Path) -> dict[str, Any]:
    try:
        # weights_only: the file may come from storage; it holds tensors, numbers and strings only.
        state: dict[str, Any] = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as err:
        raise SessionInputError(f"{folder.name} holds no readable session state: {err}") from None
    if (
        not isinstance(state, dict)
        or state.get("format") != STATE_FORMAT
        or not {"engine", "optimizer_steps"} <= set(state)
    ):
        raise SessionInputError(f"{folder.name} holds no session state of format {STATE_FORMAT}")
    return state


def _check_adam(adam: AdamParams) -> None:
    values = asdict(adam)
    if not all(math.isfinite(v) for v in values.values()):
        raise SessionInputError(f"the optimiser's settings must be finite numbers: {values}")
    if adam.learning_rate < 0 or adam.eps < 0 or adam.weight_decay < 0 or adam.grad_clip_norm < 0:
        raise SessionInputError("learning_rate, eps, weight_decay and grad_clip_norm must be ≥ 0")
    if not (0 <= adam.beta1 < 1 and 0 <= adam.beta2 < 1):
        raise SessionInputError("beta1 and beta2 must be in [0, 1)")


def _eos_ids(model: Any, tokenizer_eos: int | None) -> frozenset[int]:
    """The tokenizer's EOS and the generation config's (Llama 3 instruct models end turns with several)."""
    ids = {tokenizer_eos} if tokenizer_eos is not None else set()
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    ids |= set(extra) if isinstance(extra, list) else ({extra} if extra is not None else set())
    return frozenset(int(i) for i in ids)
