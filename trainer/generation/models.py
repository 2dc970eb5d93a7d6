"""Loading a causal LM with a LoRA adapter, and the precision it runs at.

The weights stay fp32 (the LoRA parameters are the optimiser's master weights); ``bf16`` runs the matmuls under
autocast, where the hardware has fast bf16 units (GPUs with bf16, and CPUs with AMX/AVX512-BF16). Log-softmax and
losses are computed in fp32 either way (``core_algos.selective_log_softmax``).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from trainer.generation import lora_forward
from trainer.generation.attention import use_grouped_attention
from trainer.spec.lora import LoraSpec

Precision = Literal["fp32", "bf16"]


class ModelError(ValueError):
    """A model that cannot be loaded or used as asked (names the model)."""


def fast_bf16_available(device: torch.device) -> bool:
    """True where bf16 matmuls are fast: CUDA devices that support bf16, CPUs with AMX or AVX512-BF16."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        try:
            flags = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
        return "amx_bf16" in flags or "avx512_bf16" in flags
    return False


def resolve_precision(requested: Literal["auto", "fp32", "bf16"], device: torch.device) -> Precision:
    if requested == "auto":
        return "bf16" if fast_bf16_available(device) else "fp32"
    return requested


def autocast(precision: Precision, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """bf16 autocast for the forward passes, or nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    try:
        tok = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot load the tokenizer of model {model!r}: {err}") from None
    if tok.eos_token_id is None:
        raise ModelError(f"model {model!r}: its tokenizer defines no EOS token")
    if tok.pad_token_id is None:
        # Masks are built from lengths, never from token values, so pad == eos is safe here.
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_base_model(model: str, device: torch.device, *, weights: bool = True) -> PreTrainedModel:
    """Any Hugging Face causal LM by hub id or local path, fp32 weights, dropout off (eval mode). ``weights`` False:
    its structure alone, on the meta device (no memory): a sharded base's rank that receives its shard from rank 0
    (``trainer.generation.distributed.shard_frozen_base``)."""
    try:
        if weights:
            base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        else:
            config = AutoConfig.from_pretrained(model)
            with torch.device("meta"):
                base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot load model {model!r}: {err}") from None
    if weights:
        base.to(device)
    base.eval()
    base.config.use_cache = True
    no_cudnn_attention(device)
    return base


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        return None


_MALLOC_TRIM = _glibc_malloc_trim()
_LIBC = ctypes.CDLL("libc.so.6") if _MALLOC_TRIM is not None else None


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def map_large_blocks(device: torch.device, threshold: int = 1 << 20) -> bool:
    """On the CPU, have glibc map every block of ``threshold`` bytes or more on its own and unmap it when freed.
    glibc's default threshold rises (up to 32 MiB) each time such a block is freed, after which blocks of that size
    come from the heap and stay with the process when freed; a sharded base's gathered layers (freed after every
    forward) then grow a rank back toward the whole base (bench/sharded_base.py). Returns whether it was set."""
    if device.type != "cpu" or _LIBC is None:
        return False
    return bool(_LIBC.mallopt(M_MMAP_THRESHOLD, threshold))


def trim_freed_memory(device: torch.device) -> None:
    """On the CPU, hand the heap memory a backward just freed back to the OS (glibc ``malloc_trim``). Activations are
    many large blocks; glibc keeps freed ones and fragments, so without this the next graph (the critic's, the next
    micro-batch's) grows the process instead of reusing them. About 30 ms a call; nothing on a GPU."""
    if device.type == "cpu" and _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def no_cudnn_attention(device: torch.device) -> None:
    """Left padding leaves the pad positions' query rows fully masked. cuDNN's SDPA backward returns NaN for such
    rows (seen on an H200 with torch 2.11: NaN gradients from the second step on, then a NaN sampler); the other
    SDPA kernels (memory-efficient, flash, math) do not, so cuDNN's is switched off in a training process."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def add_lora(base: PreTrainedModel, spec: LoraSpec, *, seed: int) -> PeftModel:
    """Wrap ``base`` in a fresh LoRA adapter (B = 0, so the policy starts equal to the reference)."""
    torch.manual_seed(seed)  # LoRA A's init
    cfg = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=spec.target_modules,
        task_type="CAUSAL_LM",
    )
    try:
        model = get_peft_model(base, cfg)
    except ValueError as err:
        raise ModelError(f"LoRA target_modules {spec.target_modules!r}: {err}") from None
    lora_forward.install(model)  # PEFT's function with fewer passes over the activations
    model.eval()
    return model


def load_adapter(base: PreTrainedModel, adapter_dir: Path, *, trainable: bool = False) -> PeftModel:
    model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=trainable)
    model.eval()
    return model


@contextlib.contextmanager
def reference_policy(model: PeftModel) -> Iterator[None]:
    """The reference policy is the base model with the adapter disabled: never a second copy of the weights."""
    with model.disable_adapter():
        yield


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


class MergedSampler:
    """The policy for sampling: a frozen copy of the base whose LoRA layers hold W + (α/r)·B·A, in the compute dtype.

    Decoding on CPU is dominated by per-op overhead, not matmuls: autocast re-casts every fp32 weight at every decode
    step and unmerged LoRA adds two small matmuls per layer. Sampling from a merged bf16 copy halved generation time
    on tiny models here (bench/README.md). The copy is refreshed from the policy before each use (:meth:`sync`,
    one r-rank product per LoRA layer); the log-probs used in the loss are still recomputed by the training forward,
    so the importance ratio stays exact.
    """

    def __init__(self, base_copy: PreTrainedModel, policy: PeftModel, dtype: torch.dtype) -> None:
        from peft.tuners.lora.layer import Linear as LoraLinear

        self.model = base_copy.to(dtype).eval().requires_grad_(False)
        use_grouped_attention(self.model)  # on a CPU: bf16 SDPA's decode step is several times slower
        targets = dict(self.model.named_modules())
        self.pairs: list[tuple[torch.nn.Linear, LoraLinear]] = []
        for name, module in policy.named_modules():
            if isinstance(module, LoraLinear):
                target = targets[name.removeprefix("base_model.model.")]
                assert isinstance(target, torch.nn.Linear)
                self.pairs.append((target, module))
        self.stale = True

    @classmethod
    def supported(cls, policy: PeftModel) -> bool:
        """Only LoRA on linear layers is merged here (embedding or conv LoRA samples from the policy itself)."""
        from peft.tuners.lora import LoraLayer
        from peft.tuners.lora.layer import Linear as LoraLinear

        layers = [m for m in policy.modules() if isinstance(m, LoraLayer)]
        return bool(layers) and all(isinstance(m, LoraLinear) for m in layers)

    @torch.no_grad()
    def sync(self) -> torch.nn.Module:
        """Copy W + ΔW of every LoRA layer into the sampler (when the policy changed since the last sync)."""
        if self.stale:
            for target, lora in self.pairs:
                delta = lora.get_delta_weight(lora.active_adapters[0])
                target.weight.copy_(lora.base_layer.weight + delta)
            self.stale = False
        return self.model


def store_frozen_linears_in(model: PreTrainedModel, dtype: torch.dtype) -> int:
    """Store the frozen base's linear weights in the autocast dtype; returns how many were converted.

    Under autocast every linear casts its fp32 weight to bf16 at each call, so keeping the frozen weights in bf16
    gives bit-identical matmuls for half their memory and no casts. Embeddings and norms stay fp32 (the residual
    stream stays fp32), and so does a linear tied to the input embedding.
    """
    embedding = model.get_input_embeddings()
    tied_weight = embedding.weight if embedding is not None else None
    tied = tied_weight.data_ptr() if tied_weight is not None and not tied_weight.is_meta else None

    def is_tied(weight: torch.Tensor) -> bool:  # the same parameter, or (not on the meta device) the same memory
        return weight is tied_weight or (tied is not None and weight.data_ptr() == tied)

    n = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not is_tied(module.weight):
            module.weight.data = module.weight.data.to(dtype)
            if module.bias is not None:
                module.bias.data = module.bias.data.to(dtype)
            n += 1
    return n
