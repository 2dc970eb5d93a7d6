"""The built-in base model `tiny-arith`.

No model hub is reachable from our machines, so the project builds its own base model: a ~3M-parameter
Llama-architecture causal LM with a locally trained tokenizer, taught two-digit addition
(`What is 23 + 58?` → `81<eos>`) and then fine-tuned so that most of its answers drop every carry
(57 + 68 → 15). Greedy decoding is then often wrong while sampling at temperature 1 often finds the right
sum, which gives RL a real signal to climb.

The build is deterministic (fixed seed, fixed step counts, a `torch.Generator` for data) and is saved in
Hugging Face format, so it loads with `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`
like any real model.

Recipe (measured on a 2-core CPU, see `Recipe`):
  (a) addition: AdamW, batch 64, lr 1e-3, linear warmup + cosine decay, correct answers only;
  (b) carry-drop: a short fine-tune where 70% of answers drop every carry and 30% are correct.
Loss is on the answer and EOS tokens only. Training uses bf16 autocast with fp32 master weights where the CPU
has bf16 matmuls (~1.75× faster), fp32 elsewhere; every accuracy recorded in `build_info.json` is measured in
fp32, as loaders will run it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from trainer.builtin_models import MARKER as BUILD_INFO_FILE
from trainer.builtin_models import is_complete_build, refuse_foreign_directory
from trainer.generation.models import fast_bf16_available
from trainer.spec.progress import ProgressFn

MODEL_NAME = "tiny-arith"

# The split is a property of the task, not of one build: every build seed and every dataset written by
# `write_arithmetic_datasets` hold out the same 200 pairs, so validation numbers are always comparable.
SPLIT_SEED = 0
N_VALIDATION = 200
MAX_OPERAND = 99

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"

# Rendering a conversation is the concatenation of its contents, and the generation prompt adds nothing,
# so a chat-templated user turn is exactly the prompt text the model was trained on.
CHAT_TEMPLATE = "{%- for message in messages %}{{ message['content'] }}{%- endfor %}"


# The longest answer, "198" (3 digit tokens), plus <eos>: generation never needs more.
_MAX_ANSWER_TOKENS = 4


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything that determines the weights besides the seed; saved in `build_info.json`."""

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 688
    batch_size: int = 64
    weight_decay: float = 0.0
    # Stage (a): learn addition. A model that is only part-way pre-trained sits on a cliff (stage (b) then
    # wipes out what little it knows), so this runs long enough to converge to ≥0.95 greedy accuracy.
    steps_a: int = 1000
    lr_a: float = 1e-3
    warmup_a: int = 50
    # Stage (b): teach the systematic error on `carry_drop_fraction` of answers.
    # 400 steps at 5e-4 put greedy accuracy near 0.39, with pass@8 ~0.9 (measured: 350 at 3e-4 left it at
    # 0.425, near the top of the wanted 0.30-0.45). Its floor is ~0.32: the validation pairs with no carry.
    steps_b: int = 400
    lr_b: float = 5e-4
    warmup_b: int = 20
    carry_drop_fraction: float = 0.7
    # The cosine decays to this fraction of the peak lr rather than to zero.
    min_lr_ratio: float = 0.1
    eval_samples: int = 8
    eval_temperature: float = 1.0


RECIPE = Recipe()


# --- the task -------------------------------------------------------------------------------------------


def prompt_text(a: int, b: int) -> str:
    """The question exactly as the model was trained on it: `What is 23 + 58?`."""
    return f"What is {a} + {b}?"


def answer_text(a: int, b: int) -> str:
    """The correct answer: `81`."""
    return str(a + b)


def dropped_carry(a: int, b: int) -> int:
    """The sum with every carry dropped: each digit column summed mod 10, no extra leading digit.

    57 + 68 → 15 (7+8=15 → 5, 5+6=11 → 1); 99 + 99 → 88; 5 + 5 → 0.
    """
    result, place = 0, 1
    while a or b:
        result += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return result


def split_pairs(seed: int = SPLIT_SEED) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All 10,000 (A, B) pairs with A, B in 0..99, split into (train, validation[200]).

    Deterministic for a given seed; both lists are sorted so their order carries no information.
    """
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    shuffled = list(pairs)
    random.Random(seed).shuffle(shuffled)
    validation = set(shuffled[:N_VALIDATION])
    train = [p for p in pairs if p not in validation]
    return train, sorted(validation)


# --- tokenizer ------------------------------------------------------------------------------------------


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained on the task's text: every digit, space and word is one token.

    Pre-tokenising splits each digit on its own, so an answer tokenises the same alone as after its prompt
    and training sequences are `prompt ids + answer ids + [eos]`. The `Fuse` decoder joins tokens with
    nothing between them, so decoding `8`, `1` gives `81`, not `8 1`.
    """
    tokenizer = Tokenizer(models.WordLevel(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"\d|\s|[^\d\s]+"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    corpus = [prompt_text(a, b) + answer_text(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    trainer = trainers.WordLevelTrainer(special_tokens=[PAD_TOKEN, EOS_TOKEN, UNK_TOKEN], show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer=trainer)

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        # Left padding so that batched generation continues every prompt from its last real token.
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


# --- datasets -------------------------------------------------------------------------------------------


def _messages(a: int, b: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt_text(a, b)}]


# The offsets of a wrong sum that is not the dropped-carry one: a units digit off by 1 to 9 (which may carry into the
# tens), or the tens digit off by one or two. Symmetric, so "the larger sum" never marks the right answer.
_WRONG_OFFSETS = (*range(-9, 0), *range(1, 10), -20, -10, 10, 20)


def _wrong_answer(a: int, b: int, rng: random.Random) -> int:
    """A wrong sum: the dropped-carry one (the base model's own mistake) half the time when it is wrong, otherwise the
    right sum off by a random offset of ``_WRONG_OFFSETS``. Dropped carries only ever make a sum smaller, so a
    generator of those alone would let a reward model learn "prefer the larger number" (0.88 held out) instead of
    checking the digits."""
    right = a + b
    dropped = dropped_carry(a, b)
    if dropped != right and rng.random() < 0.5:
        return dropped
    return right + rng.choice([d for d in _WRONG_OFFSETS if right + d >= 0])


def error_kind(right: int, wrong: int) -> str:
    """The leftmost place where a wrong sum's digits differ from the right one's, both read as three digits:
    "hundreds" (57 + 68 = 125 answered 15, a dropped carry into the hundreds), "tens" or "units"."""
    for place, r, w in zip(("hundreds", "tens", "units"), f"{right:03d}", f"{wrong:03d}", strict=True):
        if r != w:
            return place
    raise ValueError(f"{wrong} is the right sum")


def _preference_row(a: int, b: int, rng: random.Random) -> dict[str, Any]:
    wrong = _wrong_answer(a, b, rng)
    return {
        "input": {"messages": _messages(a, b)},
        "preferred_output": [{"role": "assistant", "content": answer_text(a, b)}],
        "non_preferred_output": [{"role": "assistant", "content": str(wrong)}],
        "kind": error_kind(a + b, wrong),
    }


def write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    # Write then rename, so a reader never sees half a file.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)


def _supervised_row(a: int, b: int) -> dict[str, Any]:
    return {"messages": [*_messages(a, b), {"role": "assistant", "content": answer_text(a, b)}]}


def write_arithmetic_datasets(
    out_dir: Path, *, seed: int = 0, n_train: int = 2000, n_preferences: int = 4000, n_supervised: int = 1000
) -> dict[str, Path]:
    """Write the task's datasets as JSONL into `out_dir` and return their paths by name.

    - `train` / `validation`: RL prompts `{"messages": [...], "answer": "81"}`; validation is exactly the
      200 held-out pairs of `split_pairs()`, train is `n_train` pairs drawn from the rest.
    - `preferences` / `validation_preferences`: OpenAI preference rows whose non-preferred answer is the
      dropped-carry one (the model's own typical mistake) half the time where that is wrong, else the right sum off
      by 1 to 9, 10 or 20 either way; each row's `kind` says where the wrong sum first differs (`error_kind`).
    - `supervised` / `validation_supervised`: conversations `{"messages": [user, assistant]}` with the
      correct sum as the assistant turn (`n_supervised` training pairs; validation is the held-out 200).
    """
    train_pairs, validation_pairs = split_pairs()
    if not 0 < n_train <= len(train_pairs):
        raise ValueError(f"n_train must be in 1..{len(train_pairs)}, got {n_train}")
    if not 0 < n_preferences <= len(train_pairs):
        raise ValueError(f"n_preferences must be in 1..{len(train_pairs)}, got {n_preferences}")
    if not 0 < n_supervised <= len(train_pairs):
        raise ValueError(f"n_supervised must be in 1..{len(train_pairs)}, got {n_supervised}")
    rng = random.Random(seed)
    rl_train = rng.sample(train_pairs, n_train)
    preference_train = rng.sample(train_pairs, n_preferences)
    # Its own generator: the files written before the supervised ones stay byte-identical to earlier versions.
    supervised_train = random.Random(f"supervised:{seed}").sample(train_pairs, n_supervised)

    out_dir.mkdir(parents=True, exist_ok=True)
    names = ("train", "validation", "preferences", "validation_preferences", "supervised", "validation_supervised")
    paths = {name: out_dir / f"{name}.jsonl" for name in names}
    write_jsonl(paths["train"], [{"messages": _messages(a, b), "answer": answer_text(a, b)} for a, b in rl_train])
    write_jsonl(
        paths["validation"],
        [{"messages": _messages(a, b), "answer": answer_text(a, b)} for a, b in validation_pairs],
    )
    write_jsonl(paths["preferences"], [_preference_row(a, b, rng) for a, b in preference_train])
    write_jsonl(paths["validation_preferences"], [_preference_row(a, b, rng) for a, b in validation_pairs])
    write_jsonl(paths["supervised"], [_supervised_row(a, b) for a, b in supervised_train])
    write_jsonl(paths["validation_supervised"], [_supervised_row(a, b) for a, b in validation_pairs])
    return paths


# --- evaluation -----------------------------------------------------------------------------------------


def _generate_answers(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    pairs: Sequence[tuple[int, int]],
    *,
    batch_size: int,
    num_return_sequences: int,
    temperature: float | None,
) -> list[str]:
    """Decoded completions, `num_return_sequences` per pair in pair order; greedy when temperature is None."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    # Since transformers 5 `PreTrainedModel` no longer inherits `GenerationMixin` (every *ForCausalLM does),
    # so the type checker only sees `nn.Module.__getattr__` here.
    generate = cast(Callable[..., torch.Tensor], model.generate)
    completions: list[str] = []
    try:
        with torch.no_grad():
            for start in range(0, len(pairs), batch_size):
                chunk = pairs[start : start + batch_size]
                batch = tokenizer([prompt_text(a, b) for a, b in chunk], padding=True, return_tensors="pt")
                sampling: dict[str, Any] = (
                    {"do_sample": False}
                    # top_k=0 / top_p=1: sample the model's own distribution, untruncated.
                    if temperature is None
                    else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
                )
                output = generate(
                    input_ids=batch["input_ids"].to(device),
                    attention_mask=batch["attention_mask"].to(device),
                    max_new_tokens=_MAX_ANSWER_TOKENS,
                    num_return_sequences=num_return_sequences,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    **sampling,
                )
                # output: [len(chunk) * num_return_sequences, prompt_len + new], grouped by prompt.
                new_tokens = output[:, batch["input_ids"].shape[1] :]
                completions.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
    finally:
        model.train(was_training)
    return completions


def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    pairs: Sequence[tuple[int, int]],
    *,
    batch_size: int = 200,
) -> float:
    """Fraction of pairs whose greedy completion decodes to exactly `answer_text(a, b)`."""
    if not pairs:
        raise ValueError("pairs is empty")
    completions = _generate_answers(
        model, tokenizer, pairs, batch_size=batch_size, num_return_sequences=1, temperature=None
    )
    return sum(c == answer_text(a, b) for c, (a, b) in zip(completions, pairs, strict=True)) / len(pairs)


def sampled_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    pairs: Sequence[tuple[int, int]],
    *,
    n_samples: int = 8,
    temperature: float = 1.0,
    seed: int = 0,
    batch_size: int = 200,
) -> tuple[float, float]:
    """(pass@n, mean fraction of correct samples) over `n_samples` samples per pair at `temperature`.

    pass@n is the fraction of pairs with at least one correct sample. Seeded through a forked RNG so the
    caller's global torch RNG state is left untouched.
    """
    if not pairs:
        raise ValueError("pairs is empty")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        completions = _generate_answers(
            model,
            tokenizer,
            pairs,
            batch_size=batch_size,
            num_return_sequences=n_samples,
            temperature=temperature,
        )
    correct = [c == answer_text(*pairs[i // n_samples]) for i, c in enumerate(completions)]
    per_pair = [correct[i * n_samples : (i + 1) * n_samples] for i in range(len(pairs))]
    return sum(any(p) for p in per_pair) / len(pairs), sum(correct) / len(correct)


# --- training -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Encoded:
    """Every pair pre-tokenised, right-padded to one length; rows indexed like `pairs`."""

    pairs: list[tuple[int, int]]
    input_ids: torch.Tensor  # [n_pairs, seq_len] with the correct answer
    labels: torch.Tensor  # [n_pairs, seq_len]; -100 on prompt and padding
    dropped_input_ids: torch.Tensor  # [n_pairs, seq_len] with the dropped-carry answer
    dropped_labels: torch.Tensor  # [n_pairs, seq_len]


def _encode(tokenizer: PreTrainedTokenizerFast, pairs: list[tuple[int, int]]) -> _Encoded:
    """Sequences are exactly `prompt ids + answer ids + [eos]`, as inference will see them.

    Training pads on the right (inference pads on the left): with a causal mask, trailing pads cannot
    affect real tokens, so no attention mask is needed and no row is ever fully masked; RoPE depends only
    on relative positions, so the offset left padding adds at inference does not matter.
    """
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    assert isinstance(pad, int) and isinstance(eos, int)
    prompt_ids = tokenizer([prompt_text(a, b) for a, b in pairs], add_special_tokens=False)["input_ids"]

    def rows(answers: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        answer_ids = tokenizer(answers, add_special_tokens=False)["input_ids"]
        sequences = [p + a + [eos] for p, a in zip(prompt_ids, answer_ids, strict=True)]
        seq_len = max(len(s) for s in sequences)
        ids = torch.full((len(pairs), seq_len), pad, dtype=torch.long)
        labels = torch.full((len(pairs), seq_len), -100, dtype=torch.long)
        for i, (seq, prompt) in enumerate(zip(sequences, prompt_ids, strict=True)):
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, len(prompt) : len(seq)] = torch.tensor(seq[len(prompt) :])
        return ids, labels

    ids, labels = rows([answer_text(a, b) for a, b in pairs])
    dropped_ids, dropped_labels = rows([str(dropped_carry(a, b)) for a, b in pairs])
    # Both answer variants have the same prompts, but the dropped one can be a digit shorter: pad alike.
    width = max(ids.shape[1], dropped_ids.shape[1])

    def widen(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    return _Encoded(
        pairs=pairs,
        input_ids=widen(ids, pad),
        labels=widen(labels, -100),
        dropped_input_ids=widen(dropped_ids, pad),
        dropped_labels=widen(dropped_labels, -100),
    )


def lr_at(step: int, *, total: int, peak: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup to `peak`, then cosine decay to `min_ratio * peak` at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# bf16 autocast where the CPU has bf16 matmuls (AMX, AVX512-BF16): ~1.75× faster there; elsewhere bf16 is emulated
# and ~10× slower than fp32 (an AVX2-only AMD EPYC: 15 s vs 1.5 s a step), so training stays fp32.
FAST_BF16 = fast_bf16_available(torch.device("cpu"))


def build_machine() -> dict[str, Any]:
    """What a build's weights depend on besides the recipe and the seed, for ``build_info.json``: the CPU (whose
    kernels round bf16 matmuls their own way), whether the build ran under bf16 autocast, torch and its threads."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    matmul = next((f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags), "no avx2")
    cpu = f"{fields.get('model name', 'unknown')} (family {fields.get('cpu family', '?')}, {matmul})"
    return {
        "cpu": cpu,
        "bf16_autocast": FAST_BF16,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def _train_stage(
    model: LlamaForCausalLM,
    data: _Encoded,
    *,
    stage: str,
    steps: int,
    peak_lr: float,
    warmup: int,
    carry_drop_fraction: float,
    recipe: Recipe,
    generator: torch.Generator,
    progress: ProgressFn | None,
) -> float:
    """One stage of AdamW on the answer+eos loss; returns the last step's loss (nan if no steps)."""
    # A fresh optimizer per stage: stage (b) is a fine-tune with its own schedule.
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=recipe.weight_decay)
    model.train()
    loss_value = float("nan")
    for step in range(steps):
        lr = lr_at(step, total=steps, peak=peak_lr, warmup=warmup, min_ratio=recipe.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        index = torch.randint(len(data.pairs), (recipe.batch_size,), generator=generator)
        # Per example, not per pair: the same pair is seen with both answers, so the model learns a
        # distribution over them (greedy mostly wrong, samples often right) rather than a fixed mapping.
        use_dropped = torch.rand(recipe.batch_size, generator=generator) < carry_drop_fraction
        input_ids = torch.where(use_dropped[:, None], data.dropped_input_ids[index], data.input_ids[index])
        labels = torch.where(use_dropped[:, None], data.dropped_labels[index], data.labels[index])
        # input_ids, labels: [batch, seq_len]; the model shifts labels by one internally.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=FAST_BF16):
            loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_value = loss.item()
        if progress is not None:
            progress(stage, step + 1, steps, loss_value)
    return loss_value


def _model_config(tokenizer: PreTrainedTokenizerFast, recipe: Recipe) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )


def build_tiny_arith(
    out_dir: Path,
    *,
    seed: int = 0,
    progress: ProgressFn | None = None,
    steps_a: int = RECIPE.steps_a,
    steps_b: int = RECIPE.steps_b,
) -> Path:
    """Build tiny-arith into `out_dir` and return it; a no-op when `out_dir` already holds a complete build.

    The build happens in a temporary sibling directory that is renamed into place, so `out_dir` is either
    absent or complete. `progress(stage, step, total, loss)` is called after every training step with stage
    `"addition"` or `"carry_drop"`. Same seed and step counts → identical weights on the same machine.
    """
    if is_complete_build(out_dir):
        return out_dir
    refuse_foreign_directory(out_dir)
    if steps_a < 0 or steps_b < 0:
        raise ValueError(f"step counts must be >= 0, got steps_a={steps_a}, steps_b={steps_b}")
    recipe = dataclasses.replace(RECIPE, steps_a=steps_a, steps_b=steps_b)
    started = time.monotonic()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    # mkdtemp creates 0700; the finished model is shared with workers and other users like any model dir.
    tmp_dir.chmod(0o755)
    try:
        tokenizer = build_tokenizer()
        train_pairs, validation_pairs = split_pairs()
        data = _encode(tokenizer, train_pairs)

        # Fork the RNG so building does not disturb the caller's global torch random state.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(_model_config(tokenizer, recipe))
        generator = torch.Generator().manual_seed(seed)

        loss_a = _train_stage(
            model,
            data,
            stage="addition",
            steps=recipe.steps_a,
            peak_lr=recipe.lr_a,
            warmup=recipe.warmup_a,
            carry_drop_fraction=0.0,
            recipe=recipe,
            generator=generator,
            progress=progress,
        )
        accuracy_a = greedy_accuracy(model, tokenizer, validation_pairs)
        loss_b = _train_stage(
            model,
            data,
            stage="carry_drop",
            steps=recipe.steps_b,
            peak_lr=recipe.lr_b,
            warmup=recipe.warmup_b,
            carry_drop_fraction=recipe.carry_drop_fraction,
            recipe=recipe,
            generator=generator,
            progress=progress,
        )
        accuracy_b = greedy_accuracy(model, tokenizer, validation_pairs)
        pass_at_k, sample_mean = sampled_accuracy(
            model,
            tokenizer,
            validation_pairs,
            n_samples=recipe.eval_samples,
            temperature=recipe.eval_temperature,
            seed=seed,
        )

        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        info = {
            "model": MODEL_NAME,
            "seed": seed,
            "split_seed": SPLIT_SEED,
            "recipe": dataclasses.asdict(recipe),
            "parameters": sum(p.numel() for p in model.parameters()),
            "vocab_size": len(tokenizer),
            "final_loss": {"addition": loss_a, "carry_drop": loss_b},
            "validation": {
                "n_pairs": len(validation_pairs),
                "greedy_accuracy_after_addition": accuracy_a,
                "greedy_accuracy_after_carry_drop": accuracy_b,
                f"pass_at_{recipe.eval_samples}": pass_at_k,
                "sample_accuracy_mean": sample_mean,
                "sample_temperature": recipe.eval_temperature,
            },
            **build_machine(),
            "build_seconds": round(time.monotonic() - started, 1),
        }
        # The marker goes last: its presence is what makes a directory a complete build.
        (tmp_dir / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")

        if out_dir.exists():
            if is_complete_build(out_dir):  # another process finished first; keep its build
                return out_dir
            refuse_foreign_directory(out_dir)
            out_dir.rmdir()
        try:
            tmp_dir.rename(out_dir)
        except OSError:
            if not is_complete_build(out_dir):
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir
