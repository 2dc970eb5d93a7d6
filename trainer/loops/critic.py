"""PPO's value model: V(s_t) for every completion position, a scalar head on a backbone's last hidden state.

By default the critic shares the policy's frozen base weights: it is a second LoRA adapter (``critic``) on the same
:class:`~peft.PeftModel`, switched on only for the value forward, so policy, reference (adapter disabled) and critic
hold one copy of the base in memory. With ``value_model`` set it is a separate base model with its own adapter
(its tokenizer's vocabulary must be the policy's: the critic reads the same token ids).

With ``critic: policy_trunk`` the head reads the policy's own last hidden states (TRL ≤ 0.11's
``AutoModelForCausalLMWithValueHead``; Ziegler et al. 2019's shared trunk): no second adapter and no pass of its own.
The policy's forwards yield V (:meth:`Critic.head_values` on ``completion_logprobs(..., with_hidden=True)``), and the
value loss joins the policy's loss, so its gradient also reaches the policy's LoRA. The critic's own parameters are
the head alone.

The adapter critic's passes can share the policy's (``Critic.can_fuse``; used on CUDA devices, ``Critic.fuses``):
the rollout's old log-probs, reference log-probs and V as one forward of the base over three copies of the rows,
each copy through its own adapter (policy, none, critic: ``trainer.generation.lora_forward.adapter_blocks``), and the
update's policy log-probs and V as one forward with the graph, then one backward of the summed loss. Every LoRA layer
runs its frozen base weight over all the rows in one matmul and each adapter's low-rank product over its own rows. Rows
never interact (attention, norms and positions are per row), so the results are those of the separate passes, to
float rounding (tested); what is saved is a launch of every kernel per pass and per backward. On this project's
CPUs that saved nothing and the larger joined update ran slower (BENCHMARKS.md), so there the passes stay apart.
The rows of all the copies are held at once: ``micro_batch_size`` still counts rollout rows.

V is read where the policy's logits are: the hidden state at position ``t − 1`` values the state before completion
token ``t`` is chosen (TRL's ``full_value[:, context_length − 1 : −1]``). The head is zero-initialised, so V starts
at 0 (no baseline) and no random value noise enters the first advantages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from peft import LoraConfig, PeftModel
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from trainer.generation.lora_forward import NO_ADAPTER, adapter_blocks, installed
from trainer.generation.models import (
    ModelError,
    Precision,
    add_lora,
    autocast,
    load_base_model,
    store_frozen_linears_in,
)
from trainer.generation.rollout import (
    Rollout,
    completion_logprobs,
    completion_logprobs_from_logits,
    micro_slices,
    position_ids,
)
from trainer.loops.engine import cat_padded, cpu_bf16_attention
from trainer.spec.config import PPOHyperparameters, SpecError
from trainer.spec.lora import LoraSpec

CRITIC_ADAPTER = "critic"
POLICY_ADAPTER = "default"
# Causal-LM settings under which the logits are not ``lm_head(final hidden state)`` (Gemma 2's soft cap, Cohere's
# and Granite's scales): a fused pass, which applies ``lm_head`` itself, is not used for such a model.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class Critic:
    """The value model: a LoRA adapter on a backbone plus ``head`` (hidden → 1, fp32)."""

    def __init__(
        self,
        policy: PeftModel,
        *,
        lora: LoraSpec,
        seed: int,
        separate_base: torch.nn.Module | None = None,
        trunk: bool = False,
        device: torch.device | None = None,
    ) -> None:
        assert not (trunk and separate_base is not None), "a trunk head reads the policy (config._check_rl_method)"
        self.shared = separate_base is None
        self.trunk = trunk  # the head on the policy's hidden states: no adapter of its own
        if trunk:
            self.model: PeftModel = policy
        elif separate_base is None:
            torch.manual_seed(seed + 1)  # the critic's LoRA A differs from the policy's
            cfg = LoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=0.0,  # dropout in the critic makes V noisy at a fixed state (rl-algorithms §4.11)
                target_modules=lora.target_modules,
                task_type="CAUSAL_LM",
            )
            policy.add_adapter(CRITIC_ADAPTER, cfg)
            self.model = policy
            with self._active():  # add_adapter leaves the new adapter inactive and frozen: train it
                pass
        else:
            self.model = add_lora(separate_base, lora.model_copy(update={"dropout": 0.0}), seed=seed + 1)
        backbone = self._backbone()
        config = self.model.get_base_model().config
        hidden = int(backbone.config.hidden_size)
        # the trainer's device (the model may still be on the meta device or the host: a sharded base's, before
        # sharding); the head is zeros, alike on every rank
        device = device or next(self.model.parameters()).device
        # The critic's passes can join the policy's: a second adapter on the same base, logits plain lm_head's. On
        # this project's CPUs the joined passes measured no faster (the update slower: BENCHMARKS.md), so they are
        # used on CUDA devices only, where a pass of a LoRA-sized model is bound by kernel launches.
        self.can_fuse = (
            self.shared
            and not trunk
            and not any(getattr(config, k, None) for k in LOGIT_TRANSFORMS)
            and installed(policy)
        )
        self.fuses = self.can_fuse and device.type == "cuda"
        self.head = torch.nn.Linear(hidden, 1, device=device, dtype=torch.float32)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    # -- parameters -----------------------------------------------------------------------------------------------

    def parameters(self) -> list[torch.nn.Parameter]:
        """The critic's trainable parameters: its LoRA weights and the head (the head alone on the policy's trunk)."""
        if self.trunk:
            return list(self.head.parameters())
        lora = [
            p
            for n, p in self.model.named_parameters()
            if "lora_" in n and (not self.shared or f".{CRITIC_ADAPTER}." in n)
        ]
        return [*lora, *self.head.parameters()]

    def state_dict(self) -> dict[str, Any]:
        named = dict(self.model.named_parameters())
        ids = {id(p) for p in self.parameters()}
        return {
            "lora": {n: p.detach().clone() for n, p in named.items() if id(p) in ids},
            "head": {k: v.detach().clone() for k, v in self.head.state_dict().items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        named = dict(self.model.named_parameters())
        with torch.no_grad():
            for n, t in state["lora"].items():
                named[n].copy_(t)
        self.head.load_state_dict(state["head"])

    # -- forward --------------------------------------------------------------------------------------------------

    def _backbone(self) -> Any:
        base = self.model.get_base_model()
        backbone = getattr(base, "base_model", None)
        if backbone is None or backbone is base or not hasattr(backbone, "config"):
            raise ModelError(
                f"{type(base).__name__} has no backbone to read hidden states from: it cannot carry a value head"
            )
        return backbone

    @contextlib.contextmanager
    def _active(self) -> Iterator[None]:
        """Route the shared base through the critic's adapter. PEFT's ``set_adapter`` also freezes the inactive
        adapter's weights; both adapters are trained, so their ``requires_grad`` is restored on the way in and out."""
        if not self.shared:
            yield
            return
        trainable = [p for n, p in self.model.named_parameters() if "lora_" in n]
        self.model.set_adapter(CRITIC_ADAPTER)
        for p in trainable:
            p.requires_grad_(True)
        try:
            yield
        finally:
            self.model.set_adapter(POLICY_ADAPTER)
            for p in trainable:
                p.requires_grad_(True)

    def _fused(
        self,
        batch: Rollout,
        adapters: Sequence[str],
        *,
        temperature: float,
        precision: Precision,
        with_entropy: bool = False,
    ) -> tuple[dict[str, Tensor], Tensor | None]:
        """One forward of the shared base over a copy of ``batch``'s rows for each of ``adapters``, each copy through
        its adapter: the completion log-probs [B, C] of every policy copy (``POLICY_ADAPTER``, ``NO_ADAPTER``) and V
        [B, C] of the critic's, by adapter; the entropy of the policy's log-probs when asked. Differentiable when
        grad is enabled."""
        assert self.can_fuse and CRITIC_ADAPTER in adapters
        n, c, k = len(batch), batch.completion_ids.shape[1], len(adapters)
        ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1).repeat(k, 1)
        mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1).repeat(k, 1)
        with adapter_blocks(self.model, adapters), autocast(precision, ids.device):
            hidden = self._backbone()(
                input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False
            ).last_hidden_state[:, -c - 1 : -1]  # position t − 1 predicts (and values the state before) token t
        lm_head = self.model.get_base_model().get_output_embeddings()
        out: dict[str, Tensor] = {}
        entropy = None
        for j, adapter in enumerate(adapters):
            rows = hidden[j * n : (j + 1) * n]
            if adapter == CRITIC_ADAPTER:
                out[adapter] = self.head_values(rows)
                continue
            with autocast(precision, ids.device):  # the logits of one copy at a time: [B, C, V] fp32 at most
                logits = lm_head(rows)
            out[adapter], ent = completion_logprobs_from_logits(
                logits,
                batch.completion_ids,
                temperature=temperature,
                with_entropy=with_entropy and adapter == POLICY_ADAPTER,
            )
            entropy = ent if ent is not None else entropy
        return out, entropy

    def forward_with_policy(
        self, batch: Rollout, *, temperature: float, precision: Precision, with_entropy: bool = False
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """The update's passes as one: the policy's log-probs [B, C] (and entropy), and V [B, C], with the graph."""
        out, entropy = self._fused(
            batch,
            (POLICY_ADAPTER, CRITIC_ADAPTER),
            temperature=temperature,
            precision=precision,
            with_entropy=with_entropy,
        )
        return out[POLICY_ADAPTER], entropy, out[CRITIC_ADAPTER]

    @torch.no_grad()
    def rollout_scores(
        self,
        batch: Rollout,
        *,
        policy: bool,
        reference: bool,
        temperature: float,
        precision: Precision,
        micro_batch_size: int | None,
    ) -> tuple[Tensor, ...]:
        """The rollout's passes as one, micro-batch by micro-batch: the policy's log-probs (when ``policy``), the
        reference's (when ``reference``: the adapter disabled) and V_old, [N, C] each, in this order."""
        adapters = [a for a, on in ((POLICY_ADAPTER, policy), (NO_ADAPTER, reference)) if on] + [CRITIC_ADAPTER]
        parts: dict[str, list[Tensor]] = {a: [] for a in adapters}
        for sl in micro_slices(len(batch), micro_batch_size):
            out, _ = self._fused(
                batch.select(torch.arange(sl.start, sl.stop)), adapters, temperature=temperature, precision=precision
            )
            for a in adapters:
                parts[a].append(out[a])
        width = batch.completion_ids.shape[1]
        return tuple(cat_padded(parts[a], width) for a in adapters)

    def head_values(self, hidden: Tensor) -> Tensor:
        """V from the hidden states that predict each completion token: [B, C, H] → [B, C] fp32."""
        return self.head(hidden.float()).squeeze(-1)

    def values(self, batch: Rollout, *, precision: Precision) -> Tensor:
        """V for every completion position from the critic's own forward, [B, C] fp32; differentiable when grad is
        enabled. On the policy's trunk V comes with the policy's forwards instead (:meth:`head_values`)."""
        assert not self.trunk, "a trunk critic has no forward of its own"
        ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
        mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
        c = batch.completion_ids.shape[1]
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids(mask), "use_cache": False}
        sharded = isinstance(self.model, FSDPModule)
        with self._active(), autocast(precision, ids.device):
            if sharded:  # a sharded base: through the root, whose forward gathers its own
                # weights (the embeddings, the final norm); its LM head on one position only
                out = self.model(**inputs, logits_to_keep=1, output_hidden_states=True)
                hidden = out.hidden_states[-1]  # the final norm's output, as the backbone's last_hidden_state
            else:
                hidden = self._backbone()(**inputs).last_hidden_state
        return self.head_values(hidden[:, -c - 1 : -1])  # position t − 1 values the state before token t

    @torch.no_grad()
    def rollout_values(self, batch: Rollout, *, precision: Precision, micro_batch_size: int | None) -> Tensor:
        """V_old of a whole rollout, [N, C], micro-batch by micro-batch. A trunk head reads the policy's pass, which
        also gives the policy's log-probs: use :meth:`rollout_logprobs_and_values` then."""
        out = []
        for sl in micro_slices(len(batch), micro_batch_size):
            out.append(self.values(batch.select(torch.arange(sl.start, sl.stop)), precision=precision))
        return cat_padded(out, batch.completion_ids.shape[1])

    @torch.no_grad()
    def rollout_logprobs_and_values(
        self, batch: Rollout, *, temperature: float, precision: Precision, micro_batch_size: int | None
    ) -> tuple[Tensor, Tensor]:
        """A trunk critic's rollout pass: the policy's log-probs and the head's V from one forward, [N, C] each."""
        assert self.trunk, "only a trunk head reads the policy's forward"
        logps, values = [], []
        for sl in micro_slices(len(batch), micro_batch_size):
            part = batch.select(torch.arange(sl.start, sl.stop))
            lp, _, hidden = completion_logprobs(
                self.model, part, temperature=temperature, precision=precision, with_hidden=True, share_prompts=True
            )
            logps.append(lp)
            values.append(self.head_values(hidden))
        width = batch.completion_ids.shape[1]
        return cat_padded(logps, width), cat_padded(values, width)


def build_critic(
    policy: PeftModel,
    hp: PPOHyperparameters,
    *,
    lora: LoraSpec,
    vocabulary: int,
    seed: int,
    device: torch.device,
    precision: Precision,
    where: str,
) -> Critic:
    """PPO's critic as ``hp`` asks: a second adapter on the policy's base, a separate ``value_model`` (which must
    read the policy's ``vocabulary`` of token ids) or a head on the policy's trunk. Problems are :class:`SpecError`
    naming ``where`` (the hyperparameters' path)."""
    field = "critic" if hp.critic == "policy_trunk" else "value_model"  # config refuses both at once
    param = f"{where}.{field}"
    separate = None
    if hp.value_model is not None:
        try:
            separate = load_base_model(hp.value_model, device)
        except ModelError as err:
            raise SpecError(str(err), param=param) from None
        emb = separate.get_input_embeddings()
        if emb is None or emb.num_embeddings < vocabulary:
            raise SpecError(
                f"value model {hp.value_model!r} does not share the policy's vocabulary "
                f"({vocabulary} tokens): the critic reads the policy's token ids",
                param=param,
            )
        if precision == "bf16":
            store_frozen_linears_in(separate, torch.bfloat16)
        cpu_bf16_attention(separate, precision=precision, device=device)
    try:
        return Critic(
            policy, lora=lora, seed=seed, separate_base=separate, trunk=hp.critic == "policy_trunk", device=device
        )
    except ModelError as err:
        raise SpecError(str(err), param=param) from None
