"""Data parallel training over ``torch.distributed``: one process (a rank) per device, started by torch's elastic
launcher (``torch.distributed.run``; the worker's ``worker.launch``), which sets ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK`` in each rank's environment.

How a step of the RL loop is split (``trainer.loops.rl``):

- every rank draws the same prompts (the data order and the sampling RNG advance alike on all ranks) and samples,
  grades and scores a contiguous block of whole groups (:meth:`World.block`): a group is never split, so a group's
  advantage sees all its samples;
- sampling draws each row's randomness from its own seed (the draw's seed plus the row's index in the global batch),
  so a row's completion does not depend on how many ranks there are, nor which one sampled it;
- the blocks are gathered in rank order, so that every rank holds the whole batch, computes the same advantages and
  the same loss normalisation (the totals of the whole mini-batch), and takes the same decisions (dynamic sampling,
  the KL controller, when to stop);
- each rank backpropagates its share of every mini-batch against the whole mini-batch's totals; the gradients are
  summed across ranks (one all-reduce of the flattened LoRA gradients, as DDP's buckets do) before clipping, so every
  rank takes the same optimiser step and the adapters stay equal without being sent;
- rank 0 alone reports (metrics, events, checkpoints) and validates; a checkpoint is written once, by rank 0, and
  holds no per-rank state, so it resumes on any number of ranks.

On CPUs the backend is gloo (how it is tested), on CUDA devices NCCL, one device per rank (``cuda:LOCAL_RANK``).

A base too big for one device is sharded (``resources.shard_base``; :func:`shard_frozen_base`): FSDP2's
``fully_shard`` on each decoder layer and on the whole model gives every rank 1/N of the frozen base's weights, and a
layer's full weights exist only while it runs (all-gathered before, freed after, again in the backward). The LoRA
weights are left out of the sharding (``ignored_params``): they are small, whole on every rank, and trained as above
(one all-reduce of their gradients), so the optimiser, the checkpoints and the adapter are the unsharded run's. The
price is lockstep: a layer's gather needs every rank, so every rank runs the same forward (and backward) passes of
the model in the same order. Decoding goes on while any rank has a running row (:meth:`World.any`), a rank with no
rows runs a padding row, and the scoring and training passes pad each rank's share to the largest share
(``trainer.loops.rl``); an agent's episodes, whose turns differ by rank, are refused (``trainer.spec.config``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from trainer.generation.models import map_large_blocks

T = TypeVar("T")

COLLECTIVE_TIMEOUT = timedelta(minutes=60)
"""How long a rank waits in a collective for the others (rank 0 validating alone, a slow grader on one block)."""


@dataclass(frozen=True)
class World:
    """This process's place among the job's ranks; ``World()`` is a run on its own (no process group)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    launched: bool = False  # started by the launcher (a process group exists, even of one rank)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def block(self, n: int) -> tuple[int, int]:
        """This rank's contiguous share [lo, hi) of ``n`` items: the first ``n % size`` ranks take one more."""
        base, extra = divmod(n, self.size)
        lo = self.rank * base + min(self.rank, extra)
        return lo, lo + base + (1 if self.rank < extra else 0)

    # -- collectives (trivial for a run on its own) ------------------------------------------------------------------

    def gather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order (tensors are best on the CPU: they are pickled)."""
        if not self.launched:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        if not self.launched:
            return obj
        box: list[Any] = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def sum_floats(self, values: list[float]) -> list[float]:
        """The elementwise sum of every rank's ``values`` (in float64)."""
        if not self.launched or self.size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (lockstep: whether any rank still decodes)."""
        if not self.launched or self.size == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int32, device=self.collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the parameters' gradients across ranks, in place (a missing gradient counts as zeros). One flat
        all-reduce: LoRA's gradients are small, so one bucket is DDP's own choice for them."""
        if not self.launched or self.size == 1 or not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(g).to(g.dtype)
            offset += n

    def barrier(self) -> None:
        if self.launched and self.size > 1:
            dist.barrier()

    def collective_device(self) -> torch.device:
        """Where the backend's tensors live: the rank's GPU for NCCL, the CPU for gloo."""
        if self.launched and dist.get_backend() == "nccl":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def device(self) -> torch.device | None:
        """The rank's device when the launcher gave it one (``cuda:LOCAL_RANK``); None: the usual default."""
        if self.launched and torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return None


@dataclass(frozen=True)
class Sharding:
    """What :func:`shard_frozen_base` did: the frozen base's elements held on this rank, of how many in all, and the
    modules sharded on their own (decoder layers) besides the whole model; ``from_rank0``: the other ranks loaded
    no weights and received their shards from rank 0."""

    held: int
    total: int
    layers: int
    from_rank0: bool = False


def shard_frozen_base(model: torch.nn.Module, world: World, device: torch.device) -> Sharding:
    """Shard ``model``'s frozen weights across the world's ranks with FSDP2 (``fully_shard`` on each decoder layer,
    the modules the model's ``_no_split_modules`` names, then on the whole model); its trainable weights (LoRA) stay
    whole on every rank. A model loaded on the CPU moves to ``device`` (each rank keeps its shard there).

    Where the other ranks hold the model on the meta device (loaded without weights: only rank 0 read them, so the
    host holds one whole copy, not one a rank), each allocates its shard and the whole trainable weights and receives
    them from rank 0 (``set_model_state_dict``'s broadcast from rank 0; the buffers too, such as rotary frequencies,
    which no state dict holds)."""
    map_large_blocks(device)  # on a CPU a gathered layer's memory goes back to the OS when freed
    from_rank0 = any(world.gather(any(p.is_meta for p in model.parameters())))
    whole = model.state_dict() if from_rank0 and world.main else {}  # rank 0's weights (references, not copies)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:  # fully_shard moves what it shards (and the buffers); the rest is ours to move
        if not p.is_meta:
            p.data = p.data.to(device)
    total = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    mesh = init_device_mesh(device.type, (world.size,))
    keep = set(trainable)
    names = set(_no_split_modules(model))
    layers = [m for m in model.modules() if type(m).__name__ in names]
    for layer in layers:
        fully_shard(layer, mesh=mesh, ignored_params={p for p in layer.parameters() if p in keep})
    # the root's own weights (embeddings, final norm, LM head) freed after each forward too (FSDP2 keeps a root's)
    fully_shard(model, mesh=mesh, ignored_params=keep, reshard_after_forward=True)
    if from_rank0:
        if not world.main:
            model.to_empty(device=device)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, whole, options=options)
        for buffer in model.buffers():
            dist.broadcast(buffer.data, src=0)
    held = sum(
        p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters() if not p.requires_grad
    )
    return Sharding(held=held, total=total, layers=len(layers), from_rank0=from_rank0)


@contextlib.contextmanager
def gathered(model: torch.nn.Module) -> Iterator[None]:
    """A sharded model's weights whole on every rank for the block (one all-gather of every sharded module at the
    start, not one per forward; a collective, so every rank enters it), sharded again after it."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.unshard()
        m.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for m in modules:
            m.set_reshard_after_forward(True)
            m.reshard()


def _no_split_modules(model: torch.nn.Module) -> list[str]:
    """The class names of a Hugging Face model's blocks (its decoder layers), under any wrappers (PEFT's)."""
    for m in model.modules():
        names = getattr(m, "_no_split_modules", None)
        if names:
            return list(names)
    return []


def from_environment() -> World:
    """The world the launcher described in this process's environment (``World()`` when none did)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return World()
    return World(
        rank=int(os.environ["RANK"]),
        size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
        launched=True,
    )


def initialise(world: World) -> None:
    """Join the process group of a launched world (NCCL on CUDA devices, gloo on CPUs); nothing for one alone."""
    if not world.launched or dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(world.local_rank)
        dist.init_process_group("nccl", timeout=COLLECTIVE_TIMEOUT, device_id=torch.device("cuda", world.local_rank))
    else:
        dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)


def shut_down() -> None:
    """Leave the process group after a run that ended well on every rank: a barrier first (no rank tears its
    communicators down while another's last collective is still in flight), then destroy it while the interpreter is
    whole (gloo's worker threads left to interpreter teardown can abort the process). Not after an error: a rank that
    failed mid-collective would leave the others waiting in the barrier."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
