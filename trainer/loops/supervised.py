"""The supervised fine-tuning loop, readable top to bottom.

One training step: ``batch_size`` conversations → rows (one conversation a row, or several packed into rows of
``max_length`` tokens) → for each micro-batch of rows, next-token cross-entropy on the assistant tokens only → one
optimiser step. The loss is a token mean over the whole step's trained tokens (``core_algos``' ``token_mean``
against the step's total), so micro-batching and packing change the layout, never the loss.

Packing keeps attention inside each conversation: the position ids restart at 0 for every packed conversation and
no 2-D attention mask is passed, from which transformers builds a block-diagonal causal mask (its "packed sequence"
format, ``masking_utils.find_packed_sequence_indices``; checked against unpacked rows by the tests).
Without packing, ``group_by_length`` draws batches of conversations of similar length so that rows pad little.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from trainer.algorithms.core_algos import AGGREGATIONS, LossScale, selective_log_softmax
from trainer.generation.distributed import World
from trainer.generation.encoding import (
    EncodedExample,
    LengthGroupedSampler,
    PromptSampler,
    encode_supervised,
    pack_examples,
)
from trainer.generation.models import (
    Precision,
    autocast,
    default_device,
    load_tokenizer,
    resolve_precision,
    trainable_parameters,
)
from trainer.generation.rollout import micro_slices, position_ids
from trainer.loops.engine import Engine, ParamGroup, check_context, load_policy, seed_everything
from trainer.loops.steps import EngineLoop, validation_due
from trainer.spec import metrics as M
from trainer.spec.callbacks import Callback
from trainer.spec.config import JobSpec, SupervisedHyperparameters
from trainer.spec.data import SupervisedItem, load_supervised

LENGTH_GROUP_BATCHES = 16  # group_by_length sorts mega-batches of this many batches by length (HF's default: 50)


@dataclass
class Rows:
    """A micro-batch of rows, right-padded to T tokens."""

    ids: Tensor  # [B, T]
    targets: Tensor  # [B, T] bool: token t is trained (predicted from position t − 1)
    position_ids: Tensor  # [B, T] restarting at 0 for every conversation of a packed row
    attention_mask: Tensor | None  # [B, T]; None for packed rows (the position ids say where conversations start)


def collate(examples: list[list[EncodedExample]], pad_id: int, *, packed: bool) -> Rows:
    """Rows of concatenated conversations (one each unless packed) → :class:`Rows`. The padding at a row's end
    counts as one more sequence in a packed row (its positions restart at 0), so it never attends to a real token."""
    width = max(sum(len(e.ids) for e in row) for row in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    targets = torch.zeros((len(examples), width), dtype=torch.bool)
    pos = torch.zeros((len(examples), width), dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for r, row in enumerate(examples):
        t = 0
        for e in row:
            n = len(e.ids)
            ids[r, t : t + n] = torch.tensor(e.ids)
            targets[r, t : t + n] = torch.tensor(e.targets)
            pos[r, t : t + n] = torch.arange(n)
            mask[r, t : t + n] = 1
            t += n
        pos[r, t:] = torch.arange(width - t)
    if packed:
        return Rows(ids, targets, pos, None)
    return Rows(ids, targets, position_ids(mask), mask)


class SupervisedTrainer(EngineLoop):
    """Holds what the loop needs; :meth:`run` is the loop."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        output_dir: Path,
        callback: Callback,
        device: torch.device | None = None,
        world: World | None = None,
    ):
        self.world = world or World()  # data parallel: this rank's place (trainer.generation.distributed)
        self.spec, self.out, self.cb = spec, output_dir, callback
        assert isinstance(spec.method.hyperparameters, SupervisedHyperparameters)
        self.hp: SupervisedHyperparameters = spec.method.hyperparameters

        # Everything that can be wrong with the input is checked before the model's weights are loaded.
        train_items = load_supervised(Path(spec.training_file))
        val_items = load_supervised(Path(spec.validation_file)) if spec.validation_file else []
        self.tokenizer = load_tokenizer(spec.model)
        self.train_examples, self.val_examples = self._encode_examples(train_items, val_items)
        self.total_steps = self.hp.total_steps(len(self.train_examples))

        self.device = device or self.world.device() or default_device()
        self.precision: Precision = resolve_precision(self.hp.precision, self.device)
        seed_everything(spec.seed)
        self.model = load_policy(
            spec.model, spec.method.lora, device=self.device, precision=self.precision, seed=spec.seed
        ).model
        self.params = trainable_parameters(self.model)
        self.engine = self._engine()
        self.aggregate = AGGREGATIONS.get("token_mean")

    def _encode_examples(
        self, train_items: list[SupervisedItem], val_items: list[SupervisedItem]
    ) -> tuple[list[EncodedExample], list[EncodedExample]]:
        """The training and validation conversations (the first ``eval_samples`` of these) encoded, once the longest
        of them is known to fit the model's context."""
        spec, hp = self.spec, self.hp
        last_only = hp.assistant_turns == "last"
        train = encode_supervised(
            self.tokenizer, train_items, max_length=hp.max_length, last_turn_only=last_only, path=spec.training_file
        )
        val = encode_supervised(
            self.tokenizer,
            val_items,
            max_length=hp.max_length,
            last_turn_only=last_only,
            path=spec.validation_file or "",
        )
        longest = max(len(e.ids) for e in train + val)
        check_context(
            spec.model,
            needed=longest,
            what=f"the longest conversation ({longest} tokens)",
            param=f"method.{spec.method.type}.hyperparameters.max_length",
        )
        return train, val[: hp.eval_samples] if hp.eval_samples else val

    def _engine(self) -> Engine:
        """The optimiser, schedule and data order over the training conversations: batches of similar length with
        ``group_by_length`` (unpacked rows pad little), else shuffled."""
        spec, hp = self.spec, self.hp
        lengths = [len(e.ids) for e in self.train_examples]
        return Engine(
            self.model,
            groups=[ParamGroup(self.params, hp.effective_learning_rate)],
            hp=hp,
            total_steps=self.total_steps,
            device=self.device,
            precision=self.precision,
            data_order=(
                LengthGroupedSampler(lengths, seed=spec.seed, group=hp.batch_size * LENGTH_GROUP_BATCHES)
                if hp.group_by_length and not hp.packing
                else PromptSampler(len(lengths), seed=spec.seed)
            ),
            seed=spec.seed,  # nothing here samples; the generator makes a restore set every RNG, as the RL loop's
            dropout=spec.method.lora.dropout > 0,
        )

    # -- state -------------------------------------------------------------------------------------------------

    def has_validation_data(self) -> bool:
        return bool(self.val_examples)

    # -- the loop ----------------------------------------------------------------------------------------------

    def _rows(self, examples: list[EncodedExample]) -> list[list[EncodedExample]]:
        if not self.hp.packing:
            return [[e] for e in examples]
        return [[examples[i] for i in row] for row in pack_examples([len(e.ids) for e in examples], self.hp.max_length)]

    def step(self, step: int) -> dict[str, float]:
        hp = self.hp
        t0 = time.perf_counter()
        lr = self.engine.learning_rate
        rows = self._rows([self.train_examples[i] for i in self.engine.next_indices(hp.batch_size)])
        scale = LossScale(float(sum(sum(e.targets) for row in rows for e in row)), len(rows), 0)
        loss_sum = correct = tokens = 0.0
        self.engine.zero_grad()
        self.model.train(self.spec.method.lora.dropout > 0)
        lo, hi = self.world.block(len(rows))  # this rank's rows, against the whole batch's token count
        mine = rows[lo:hi]
        for sl in micro_slices(len(mine), hp.micro_batch_size):
            batch = collate(mine[sl], self.tokenizer.pad_token_id, packed=hp.packing)
            nll, mask, hits = self._token_losses(batch)
            loss = self.aggregate(nll, mask, scale)  # this micro-batch's share of the step's token mean
            self.engine.backward(loss)
            loss_sum += float(loss.detach())
            correct += float(hits)
            tokens += float(batch.ids.numel())
        self.model.eval()
        self.sync_gradients()
        grad_norm = self.engine.optim_step()[0]
        self.engine.lr_step()
        train_s = time.perf_counter() - t0
        loss_sum, correct, tokens = self.world.sum_floats([loss_sum, correct, tokens])

        m = {
            M.LOSS_TOTAL: loss_sum,
            M.TOKEN_ACCURACY: correct / max(scale.total_tokens, 1.0),
            M.GRAD_NORM: grad_norm,
            M.LEARNING_RATE: lr,
            M.TOKENS_PER_S_TRAINING: tokens / max(train_s, 1e-9),
        }
        every = hp.eval_every(self.total_steps)  # eval_interval, or the one 'auto' picks from the run's length
        if self.val_examples and validation_due(step, interval=every, total_steps=self.total_steps):
            m |= self.validation_metrics()
        m[M.STEP_SECONDS] = time.perf_counter() - t0
        return self.report(step, m)

    def _token_losses(self, batch: Rows) -> tuple[Tensor, Tensor, Tensor]:
        """(−log p of every next token [B, T−1], the trained-token mask [B, T−1], how many the argmax gets right)."""
        ids = batch.ids.to(self.device)
        attention = batch.attention_mask.to(self.device) if batch.attention_mask is not None else None
        with autocast(self.precision, self.device):
            logits = self.model(
                input_ids=ids,
                attention_mask=attention,
                position_ids=batch.position_ids.to(self.device),
                use_cache=False,
            ).logits
        logits = logits[:, :-1]  # logits[:, t] predicts token t + 1
        target, mask = ids[:, 1:], batch.targets[:, 1:].to(self.device)
        nll = -selective_log_softmax(logits, target)
        hits = ((logits.detach().argmax(-1) == target) & mask).sum()
        return nll, mask, hits

    def validation_metrics(self) -> dict[str, float]:
        """Token-mean cross-entropy and argmax accuracy over the validation conversations' trained tokens (rank 0's,
        on every rank)."""
        return self.from_rank0(self._validation_metrics)

    @torch.no_grad()
    def _validation_metrics(self) -> dict[str, float]:
        examples = self.val_examples
        total = float(sum(sum(e.targets) for e in examples))
        scale = LossScale(total, len(examples), 0)
        loss = correct = 0.0
        for sl in micro_slices(len(examples), self.hp.micro_batch_size or self.hp.batch_size):
            batch = collate([[e] for e in examples[sl]], self.tokenizer.pad_token_id, packed=False)
            nll, mask, hits = self._token_losses(batch)
            loss += float(self.aggregate(nll, mask, scale))
            correct += float(hits)
        return {M.VAL_LOSS: loss, M.validation(M.TOKEN_ACCURACY): correct / max(total, 1.0)}
