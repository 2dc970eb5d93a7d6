"""The training engine the three loops share: one training state and the step's parts, each callable alone.

A loop (``trainer.loops.rl``, ``trainer.loops.preference``, ``trainer.loops.supervised``) builds its model with the
set-up helpers here (:func:`check_context`, :func:`load_policy`), then holds an :class:`Engine`: the trainable model,
the optimiser and its schedule, the data order, the sampling RNG and any extra state (PPO's critic and KL coefficient).
The engine's parts are the low-level training API a loop (or a user's own loop, through a Tinker-style server) calls:

- :meth:`Engine.forward` — log-probs (and entropy, hidden states) of a batch under the policy, with the graph;
- :meth:`Engine.token_logprobs` — log-probs of arbitrary target tokens at every position of token rows (Tinker's
  forward: position t predicts ``targets[t]``, one or K candidates), with the graph when gradients are on;
- :meth:`Engine.logprobs` — the same without the graph, micro-batch by micro-batch, under the policy or the reference;
- :meth:`Engine.backward` — backpropagate a loss (gradients accumulate until the next step);
- :meth:`Engine.forward_backward` — the two with a policy loss and an aggregation from the registries;
- :meth:`Engine.zero_grad` / :meth:`Engine.optim_step` — clear the gradients; clip each parameter group's
  gradient and take one optimiser step (:meth:`Engine.set_adam` first when the settings come with every step, as a
  Tinker ``optim_step``'s do);
- :meth:`Engine.lr_step` — advance the learning-rate schedule (once per training step);
- :meth:`Engine.state` / :meth:`Engine.load_state` / :meth:`Engine.save_checkpoint` — exact save and restore.

Sampling is the rollout engine's (``trainer.generation.rollout_engine``): it reads :attr:`Engine.weights_version` to
know when the policy's weights changed.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from peft import PeftModel
from transformers import AutoConfig, PreTrainedModel

from trainer.algorithms.core_algos import (
    AGGREGATIONS,
    POLICY_LOSSES,
    ClipOptions,
    LossScale,
    candidate_logprobs,
    cosine_or_constant_lr,
)
from trainer.generation.attention import use_grouped_attention
from trainer.generation.models import (
    ModelError,
    Precision,
    add_lora,
    autocast,
    load_base_model,
    reference_policy,
    store_frozen_linears_in,
    trim_freed_memory,
)
from trainer.generation.rollout import Rollout, completion_logprobs, micro_slices, position_ids
from trainer.loops import checkpoint as ckpt
from trainer.spec.config import Hyperparameters, SpecError
from trainer.spec.lora import LoraSpec

T = TypeVar("T")

# -- set-up ----------------------------------------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def check_context(model: str, *, needed: int, what: str, param: str) -> None:
    """Refuse, before any weight is loaded, an input longer than the model's context (``max_position_embeddings``).

    ``what`` describes the ``needed`` tokens ("the longest pair (40 tokens)"); ``param`` is the spec field to name."""
    try:
        model_cfg = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot load model {model!r}: {err}") from None
    max_pos = getattr(model_cfg, "max_position_embeddings", None)
    if max_pos is not None and needed > max_pos:
        raise SpecError(f"{what} exceeds the model's context of {max_pos} tokens", param=param)


@dataclass
class Policy:
    """A base model with a fresh LoRA adapter, and (when asked) an untouched fp32 copy of the base for a sampler."""

    model: PeftModel
    base_copy: PreTrainedModel | None


def load_policy(
    model: str,
    lora: LoraSpec,
    *,
    device: torch.device,
    precision: Precision,
    seed: int,
    sampler_copy: bool = False,
    weights: bool = True,
) -> Policy:
    """Base + LoRA in the engine's precision: in bf16 the frozen linear weights are stored in bf16 (bit-identical
    matmuls under autocast, half the memory), and on a CPU attention is eager's maths (:func:`cpu_bf16_attention`).
    ``weights`` False: on the meta device, the structure alone (:func:`~trainer.generation.models.load_base_model`)."""
    base = load_base_model(model, device, weights=weights)
    base_copy = copy.deepcopy(base) if sampler_copy else None
    if precision == "bf16":
        store_frozen_linears_in(base, torch.bfloat16)
    policy = add_lora(base, lora, seed=seed)
    cpu_bf16_attention(policy, precision=precision, device=device)
    return Policy(policy, base_copy)


def cpu_bf16_attention(model: torch.nn.Module, *, precision: Precision, device: torch.device) -> None:
    """The CPU's SDPA in bf16 is slower than eager attention, forward and backward (bench/README.md): a bf16 model on
    a CPU computes eager attention's maths, grouped (``trainer.generation.attention``: no copies of the key/value heads)
    where its attention is the standard one, else transformers' own eager attention."""
    if precision == "bf16" and device.type == "cpu":
        base: Any = model.get_base_model() if isinstance(model, PeftModel) else model
        if not use_grouped_attention(base):
            base.set_attn_implementation("eager")


# -- the engine ------------------------------------------------------------------------------------------------------


class Stateful(Protocol):
    """Extra trainer state saved with every checkpoint (PPO's critic, the KL controller)."""

    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> None: ...


class DataOrder(Protocol):
    """The data position (``trainer.generation.encoding.PromptSampler`` and its kin)."""

    def next(self, k: int) -> list[int]: ...
    def state_dict(self) -> dict[str, int]: ...
    def load_state_dict(self, state: dict[str, int]) -> None: ...


@dataclass(frozen=True)
class ParamGroup:
    """Parameters optimised together at one learning rate and clipped by their own gradient norm."""

    params: list[torch.nn.Parameter]
    learning_rate: float


@dataclass(frozen=True)
class ForwardBackward:
    """What :meth:`Engine.forward_backward` computed: the loss, and per token [B, C] the log-probs and ratios."""

    loss: float
    logprobs: torch.Tensor
    ratio: torch.Tensor


class Engine:
    """One training state: model, optimiser (AdamW, one group per :class:`ParamGroup`), learning-rate schedule, data
    order (None: the caller brings the data, as a Tinker session's client does), sampling RNG and extra state; and
    the step's parts, each callable on its own."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        groups: list[ParamGroup],
        hp: Hyperparameters,
        total_steps: int,
        device: torch.device,
        precision: Precision,
        data_order: DataOrder | None,
        seed: int,
        dropout: bool,
        trim_memory: bool = False,
    ) -> None:
        self.model, self.device, self.precision = model, device, precision
        self.groups, self.data_order, self.dropout = groups, data_order, dropout
        self.trim_memory = trim_memory  # malloc_trim after each backward (the RL loop's many differently sized graphs)
        self.max_grad_norm = hp.max_grad_norm if hp.max_grad_norm is not None else float("inf")
        self.optimizer = torch.optim.AdamW(
            [{"params": g.params, "lr": g.learning_rate} for g in groups],
            lr=groups[0].learning_rate,
            betas=(hp.adam_beta1, hp.adam_beta2),
            weight_decay=hp.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: cosine_or_constant_lr(s, warmup=hp.warmup_steps, total=total_steps, schedule=hp.lr_scheduler),
        )
        self.generator = torch.Generator(device).manual_seed(seed)  # the sampler's RNG, saved with every checkpoint
        self.extra: dict[str, Stateful] = {}
        self.weights_version = 0  # +1 at every change of the trainable weights (optimiser step, restore)
        # rows with the same prompt share its forward (trainer.generation.rollout.shared_prompt_forward); off where the
        # ranks' forwards run in lockstep (a sharded base: the number of forwards would depend on each rank's rows)
        self.share_prompts = True

    def next_indices(self, k: int) -> list[int]:
        """The data order's next ``k`` example indices (a loop's batch)."""
        if self.data_order is None:
            raise RuntimeError("this engine has no data order: its caller brings the data")
        return self.data_order.next(k)

    @property
    def learning_rate(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    # -- the step's parts ------------------------------------------------------------------------------------------

    def run_forward(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``: a forward of the engine's model for training, in train mode when LoRA has dropout
        (eval mode again after it)."""
        self.model.train(self.dropout)
        try:
            return fn(*args, **kwargs)
        finally:
            self.model.eval()

    def forward(
        self,
        batch: Rollout,
        *,
        temperature: float,
        with_entropy: bool = False,
        with_hidden: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Log-probs [B, C] of the batch's completion tokens under the policy, with the graph (train mode when LoRA
        has dropout); entropy [B, C] (no graph) and the last hidden states [B, C, H] when asked."""

        def forward() -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
            t, p, e, share = temperature, self.precision, with_entropy, self.share_prompts
            if with_hidden:
                return completion_logprobs(
                    self.model, batch, temperature=t, precision=p, with_entropy=e, with_hidden=True, share_prompts=share
                )
            return (
                *completion_logprobs(
                    self.model, batch, temperature=t, precision=p, with_entropy=e, share_prompts=share
                ),
                None,
            )

        return self.run_forward(forward)

    def token_logprobs(self, ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log p(targets[b, t, k] | ids[b, ≤ t]) [B, T, K] in fp32 for right-padded token rows ids [B, T] (mask [B, T]
        1 on tokens): position t's logits scored against K candidate targets; with the graph when gradients are on
        (train mode when LoRA has dropout). Padding's entries are meaningless; the caller masks them."""

        def forward() -> torch.Tensor:
            with autocast(self.precision, self.device):
                out = self.model(
                    input_ids=ids, attention_mask=mask.long(), position_ids=position_ids(mask.long()), use_cache=False
                )
            return candidate_logprobs(out.logits, targets)

        return self.run_forward(forward)

    @torch.no_grad()
    def logprobs(
        self, batch: Rollout, *, temperature: float, micro_batch_size: int | None, reference: bool = False
    ) -> torch.Tensor:
        """Log-probs [N, C] of the whole batch under the policy (or the reference: the adapter disabled), no graph,
        micro-batch by micro-batch."""
        out = []
        for sl in micro_slices(len(batch), micro_batch_size):
            part = batch.select(torch.arange(sl.start, sl.stop))
            kw: dict[str, Any] = {"temperature": temperature, "precision": self.precision}
            if reference:
                with reference_policy(self.model):
                    lp, _ = completion_logprobs(self.model, part, share_prompts=self.share_prompts, **kw)
            else:
                lp, _ = completion_logprobs(self.model, part, share_prompts=self.share_prompts, **kw)
            out.append(lp)
        return cat_padded(out, batch.completion_ids.shape[1])

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss``; gradients add up until :meth:`zero_grad`."""
        loss.backward()
        if self.trim_memory:
            trim_freed_memory(self.device)

    def forward_backward(
        self,
        batch: Rollout,
        advantages: torch.Tensor,
        *,
        old_logp: torch.Tensor | None = None,
        loss: str = "clipped",
        aggregation: str = "token_mean",
        clip: ClipOptions = ClipOptions(0.2, 0.2, None),
        temperature: float = 1.0,
        scale: LossScale | None = None,
    ) -> ForwardBackward:
        """One forward with a policy loss of ``POLICY_LOSSES`` aggregated by ``AGGREGATIONS`` over the batch's policy
        tokens, then its backward (gradients accumulate). ``advantages`` [B] or [B, C]; ``old_logp`` [B, C] the
        behaviour policy's log-probs (None: this policy's, ratio 1); ``scale`` the totals of the whole mini-batch
        when the batch is one micro-batch of it (None: this batch's own)."""
        mask = batch.policy_mask.to(torch.float32)
        logp, _, _ = self.forward(batch, temperature=temperature)
        old = logp.detach() if old_logp is None else old_logp
        out = POLICY_LOSSES.get(loss)(logp, old, advantages, mask, clip)
        scale = scale or LossScale(float(mask.sum()), len(batch), batch.completion_ids.shape[1])
        value = AGGREGATIONS.get(aggregation)(out.per_token, mask, scale)
        self.backward(value)
        return ForwardBackward(float(value.detach()), logp.detach(), out.ratio.detach())

    def zero_grad(self) -> None:
        """Clear the accumulated gradients (before a step's first :meth:`backward`)."""
        self.optimizer.zero_grad(set_to_none=True)

    def set_adam(self, *, learning_rate: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        """AdamW's settings for every group from the next :meth:`optim_step` on (a Tinker client sends them with each
        step; a job's come from its hyperparameters and schedule and never pass here)."""
        for group in self.optimizer.param_groups:
            group.update(lr=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay)

    def optim_step(self, *, max_grad_norm: float | None = None, skip_non_finite: bool = False) -> list[float]:
        """Clip each group's gradient to ``max_grad_norm`` (default: the hyperparameters'; the groups' scales
        differ: the critic's is its own), one AdamW step. Returns each group's gradient norm before clipping. With
        ``skip_non_finite`` a NaN or infinite norm skips the step (the weights stay; the caller sees the norm). The
        gradients stay until :meth:`zero_grad`."""
        limit = self.max_grad_norm if max_grad_norm is None else max_grad_norm
        norms = [float(torch.nn.utils.clip_grad_norm_(g.params, limit)) for g in self.groups]
        if skip_non_finite and not all(math.isfinite(n) for n in norms):
            return norms
        self.optimizer.step()
        self.weights_version += 1
        return norms

    def weights_changed(self) -> None:
        """Note a change of the trainable weights made outside :meth:`optim_step` and :meth:`load_state` (weights
        copied in from an adapter): caches of them, a rollout engine's, see a new :attr:`weights_version`."""
        self.weights_version += 1

    def lr_step(self) -> None:
        self.scheduler.step()

    # -- state -----------------------------------------------------------------------------------------------------

    def state(self, step: int, *, process_rng: bool = True) -> dict[str, Any]:
        """Everything needed to resume exactly: trainable weights, optimiser, schedule, data position, RNG (the
        process-wide ones too unless ``process_rng`` is False), extras."""
        state = ckpt.training_state(
            step,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            sampler=self.data_order,
            generator=self.generator,
            process_rng=process_rng,
        )
        return state | {name: part.state_dict() for name, part in self.extra.items()}

    def load_state(self, state: dict[str, Any]) -> int:
        step = ckpt.restore_training_state(
            state,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            sampler=self.data_order,
            generator=self.generator,
        )
        for name, part in self.extra.items():
            part.load_state_dict(state[name])
        self.weights_version += 1
        return step

    def save_checkpoint(
        self, out: Path, *, step: int, spec: dict[str, Any], metrics: dict[str, float]
    ) -> ckpt.Checkpoint:
        assert isinstance(self.model, PeftModel)
        return ckpt.save_checkpoint(
            out, step=step, model=self.model, state=self.state(step), spec=spec, metrics=metrics
        )


def cat_padded(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """Micro-batch results [b_i, c_i] right-padded with 0 to ``width`` and stacked: [Σ b_i, width]."""
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in parts])
