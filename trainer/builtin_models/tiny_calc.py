"""The built-in base model `tiny-calc`: tiny-arith's sibling that knows one tool.

The learnable agent task: sums of three two-digit numbers (`What is 23 + 58 + 71?` → `152`). The base model, offered
the `calculator` tool through its chat template, calls it on some of its samples (Hermes/Qwen syntax)::

    <tools>calculator</tools>What is 23 + 58 + 71?                                  the prompt (tools=[calculator])
    <tool_call>{"name": "calculator", "arguments": {"expression": "23+58+71"}}</tool_call><eos>   policy turn 1
    <tool_response>152</tool_response>                                               the tool's message
    152<eos>                                                                         policy turn 2

and otherwise answers at once, with the ones column's carry dropped (23 + 58 + 71 → 142), so a direct answer is
mostly wrong while a tool episode is almost always right. The direct answer's first digit is predictable (it is the
true sum's, mostly 1), so greedy decoding answers directly and sampling calls the tool about 30% of the time:
RL that learns to call the tool has a large, real signal to climb. Offered no tools, the model answers directly.

Built like tiny-arith (a few-million-parameter Llama from scratch, a locally trained word-level tokenizer, fixed seed
and step counts, saved in Hugging Face format; its helpers are reused), in two stages:
  (a) tool use: half of the tool-offered rows are whole tool episodes, so that copying the operands into the call and
      the result into the answer is learned quickly;
  (b) calibration: a short fine-tune at the target call rate, which sets the base's tool-call probability.
Loss is on policy tokens only (the tool's message is the environment's, as in RL). `build_info.json` records the
measured behaviour of the result: sampled episodes at temperature 1 with the tool simulated by the calculator
server's own evaluator (call rate, accuracy of tool episodes and of direct answers), greedy, and without tools.

Measured (seed 0, 2-core CPU, fp32, 76 s): sampled call rate 0.30, tool episodes right 0.97, direct answers right
0.03; greedy decoding calls on 4% of prompts (held-out accuracy 0.065); without tools 1.4% of samples call. GRPO
simulated outside the trainer (LoRA r=16, 8 prompts x 8 episodes a step, lr 1e-4 or 3e-4) took greedy held-out
accuracy to 1.0 within 40 steps.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from trainer.agents import calculator_server
from trainer.builtin_models.tiny_arith import (
    BUILD_INFO_FILE,
    EOS_TOKEN,
    FAST_BF16,
    PAD_TOKEN,
    UNK_TOKEN,
    ProgressFn,
    build_machine,
    is_complete_build,
    lr_at,
    refuse_foreign_directory,
    write_jsonl,
)

__all__ = [
    "BUILD_INFO_FILE",
    "CHAT_TEMPLATE",
    "MODEL_NAME",
    "RECIPE",
    "TOOL",
    "EpisodeStats",
    "Recipe",
    "answer_text",
    "build_tiny_calc",
    "build_tokenizer",
    "dropped_ones_carry_sum",
    "expression_text",
    "is_complete_build",
    "measure_episodes",
    "prompt_messages",
    "prompt_text",
    "tool_call_text",
    "tool_response_text",
    "train_triples",
    "validation_triples",
    "write_calculator_datasets",
]

MODEL_NAME = "tiny-calc"
TOOL = calculator_server.FUNCTION
"""The calculator as the chat template takes it: ``apply_chat_template(messages, tools=[TOOL])``."""

Triple = tuple[int, int, int]

# The task: three operands, each with exactly two digits (fixed-width prompts make copying them position-exact).
MIN_OPERAND, MAX_OPERAND = 10, 99
_BASE = MAX_OPERAND - MIN_OPERAND + 1
N_TRIPLES = _BASE**3
# Like tiny-arith's split, a property of the task: every build and every dataset holds out the same 200 triples.
SPLIT_SEED = 0
N_VALIDATION = 200

TOOLS_OPEN, TOOLS_CLOSE = "<tools>", "</tools>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_TAGS = (TOOLS_OPEN, TOOLS_CLOSE, CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE)

# Hermes/Qwen tool calling at its smallest. The tool list shows only the names (the context is 128 tokens); an
# assistant turn is its content, then each call as `<tool_call>{"name": …, "arguments": …}</tool_call>` (arguments
# verbatim when they are JSON text, as OpenAI messages carry them), then EOS: the model ends every turn with EOS,
# so a rendered assistant turn is exactly what the policy generated. A tool message is `<tool_response>…
# </tool_response>`; the generation prompt adds nothing. Other roles render their content alone.
CHAT_TEMPLATE = (
    "{%- if tools %}" + TOOLS_OPEN + "{%- for tool in tools %}{%- if not loop.first %},{% endif %}"
    "{{- tool.function.name if tool.function is defined else tool.name }}{%- endfor %}" + TOOLS_CLOSE + "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '" + CALL_OPEN + '{"name": \' + (fn.name | tojson) + \', "arguments": \' }}'
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}" + CALL_CLOSE + "' }}"
    "{%- endfor %}"
    "{{- eos_token }}"
    "{%- elif message.role == 'tool' %}" + RESPONSE_OPEN + "{{- message.content }}" + RESPONSE_CLOSE + "{%- else %}"
    "{{- message.content }}"
    "{%- endif %}"
    "{%- endfor %}"
)

# Turn budgets of the measurement: a call is 13 tokens with EOS, an answer at most 4.
_MAX_CALL_TOKENS = 24
_MAX_ANSWER_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything that determines the weights besides the seed; saved in `build_info.json`."""

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 688
    max_position_embeddings: int = 128
    batch_size: int = 64
    # Distinct training triples the build draws from (the RL datasets draw from the same complement of validation).
    pool_size: int = 20_000
    # Stage (a): tool use. Among tool-offered rows, `call_fraction_a` are whole tool episodes, the rest direct
    # answers with the ones carry dropped; `plain_fraction` of all rows are prompts without tools, answered directly.
    # Measured (2-core CPU, fp32): 300 steps left 0.945 of sampled tool episodes right, 400 steps 0.958; a larger
    # call fraction (0.7 at 300 steps: 0.943) did not help. Direct answers stay near 0.02 right either way.
    steps_a: int = 400
    lr_a: float = 1e-3
    warmup_a: int = 30
    call_fraction_a: float = 0.5
    # Stage (b): calibration to the base's call rate: 0.3 of the training rows give a sampled call rate near 0.28,
    # while greedy decoding calls on ~5% of prompts (the direct answer's first digit, mostly 1, outweighs the call).
    steps_b: int = 60
    lr_b: float = 3e-4
    warmup_b: int = 5
    call_fraction_b: float = 0.3
    plain_fraction: float = 0.1
    min_lr_ratio: float = 0.1
    eval_samples: int = 8
    eval_temperature: float = 1.0


RECIPE = Recipe()


# --- the task -------------------------------------------------------------------------------------------------


def prompt_text(numbers: Sequence[int]) -> str:
    """The question as the model was trained on it: `What is 23 + 58 + 71?`."""
    return f"What is {' + '.join(str(n) for n in numbers)}?"


def prompt_messages(numbers: Sequence[int]) -> list[dict[str, str]]:
    """The question as one user message (the RL datasets' `messages`)."""
    return [{"role": "user", "content": prompt_text(numbers)}]


def answer_text(numbers: Sequence[int]) -> str:
    """The correct answer: `152`."""
    return str(sum(numbers))


def expression_text(numbers: Sequence[int]) -> str:
    """The calculator expression the model writes for the question: `23+58+71`."""
    return "+".join(str(n) for n in numbers)


def tool_call_text(expression: str) -> str:
    """One Hermes tool call of the calculator, as the template renders it and the model writes it (EOS follows)."""
    arguments = json.dumps({"expression": expression})
    return f'{CALL_OPEN}{{"name": "{calculator_server.TOOL_NAME}", "arguments": {arguments}}}{CALL_CLOSE}'


def tool_response_text(output: str) -> str:
    """A tool message as the template renders it: `<tool_response>152</tool_response>`."""
    return f"{RESPONSE_OPEN}{output}{RESPONSE_CLOSE}"


def dropped_ones_carry_sum(numbers: Sequence[int]) -> int:
    """The sum with the ones column's carry dropped, the model's systematic error when it answers by itself.

    23 + 58 + 71 → 142 (3+8+1 = 12: the 1 carried into the tens is lost); 19 + 19 + 19 → 37; right exactly when
    the ones digits sum to less than 10 (22% of triples). The leading digit is mostly the true sum's, so a direct
    answer's first token is predictable and greedy decoding answers directly.
    """
    ones = sum(n % 10 for n in numbers)
    return sum(numbers) - ones // 10 * 10


def _triple(index: int) -> Triple:
    a, rest = divmod(index, _BASE * _BASE)
    b, c = divmod(rest, _BASE)
    return (a + MIN_OPERAND, b + MIN_OPERAND, c + MIN_OPERAND)


def _validation_indices() -> list[int]:
    return sorted(random.Random(SPLIT_SEED).sample(range(N_TRIPLES), N_VALIDATION))


def validation_triples() -> list[Triple]:
    """The 200 held-out triples, sorted; never trained on by any build nor written to a training file."""
    return [_triple(i) for i in _validation_indices()]


def train_triples(n: int, *, seed: int | str = 0) -> list[Triple]:
    """`n` distinct triples outside the validation set, deterministic per `seed`."""
    if not 0 < n <= N_TRIPLES - N_VALIDATION:
        raise ValueError(f"n must be in 1..{N_TRIPLES - N_VALIDATION}, got {n}")
    held_out = set(_validation_indices())
    drawn = random.Random(seed).sample(range(N_TRIPLES), n + N_VALIDATION)
    return [_triple(i) for i in drawn if i not in held_out][:n]


def write_calculator_datasets(out_dir: Path, *, seed: int = 0, n_train: int = 2000) -> tuple[Path, Path]:
    """Write the agent task's RL prompts into `out_dir`: (`train.jsonl`, `validation.jsonl`).

    Lines are `{"messages": [{"role": "user", "content": "What is 23 + 58 + 71?"}], "answer": "152"}`; the tools
    come from the job (`calculator_server.calculator_tool(url)`), not from the lines. Validation is exactly
    `validation_triples()`; train is `n_train` other triples.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = (out_dir / "train.jsonl", out_dir / "validation.jsonl")
    for path, triples in zip(paths, (train_triples(n_train, seed=seed), validation_triples()), strict=True):
        write_jsonl(path, [{"messages": prompt_messages(t), "answer": answer_text(t)} for t in triples])
    return paths


# --- tokenizer ------------------------------------------------------------------------------------------------


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer: every digit is one token, every run of non-digits one word, each tag one token.

    The tags are added tokens that are not special (as Qwen's `<tool_call>`), so they split text before the
    pre-tokenizer and survive `decode(..., skip_special_tokens=True)`, which is what tool-call parsing reads. Text
    is therefore tokenised the same alone as inside a conversation: a tool message tokenised on its own equals its
    tokens in the rendered transcript. The `Fuse` decoder joins tokens with nothing between them.
    """
    tokenizer = Tokenizer(models.WordLevel(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"\d|\D+"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    # The words of a rendered tool episode between its tags, and every digit.
    sample = (12, 34, 56)
    episode = TOOLS_OPEN + calculator_server.TOOL_NAME + TOOLS_CLOSE + prompt_text(sample)
    episode += tool_call_text(expression_text(sample)) + tool_response_text(answer_text(sample))
    corpus = ["0123456789", *re.split("|".join(re.escape(tag) for tag in _TAGS), episode)]
    trainer = trainers.WordLevelTrainer(special_tokens=[PAD_TOKEN, EOS_TOKEN, UNK_TOKEN], show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.add_tokens([AddedToken(tag, normalized=False, special=False) for tag in _TAGS])

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _prompt_ids(tokenizer: PreTrainedTokenizerFast, numbers: Sequence[int], *, tools: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        prompt_messages(numbers), tools=[TOOL] if tools else None, add_generation_prompt=True, tokenize=False
    )
    assert isinstance(text, str)
    return _ids(tokenizer, text)


# --- training data --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Rows:
    """Right-padded token rows and their labels (-100 off the policy's tokens); row i is triple i of the pool."""

    input_ids: torch.Tensor  # [n, seq_len]
    labels: torch.Tensor  # [n, seq_len]


def _pack(rows: list[list[tuple[list[int], bool]]], *, pad: int, width: int) -> _Rows:
    """Each row is a list of (token ids, trained) segments, concatenated and right-padded to `width`."""
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, row in enumerate(rows):
        pos = 0
        for ids, trained in row:
            input_ids[i, pos : pos + len(ids)] = torch.tensor(ids)
            if trained:
                labels[i, pos : pos + len(ids)] = torch.tensor(ids)
            pos += len(ids)
    return _Rows(input_ids, labels)


def _width(rows: list[list[tuple[list[int], bool]]]) -> int:
    return max(sum(len(ids) for ids, _ in row) for row in rows)


@dataclasses.dataclass(frozen=True)
class _Encoded:
    tool: _Rows  # tools offered, a whole tool episode (call, tool message, answer)
    # Direct answers, one width (so they stack into one batch): tools offered, then no tools.
    direct: _Rows
    plain: _Rows


def _encode(tokenizer: PreTrainedTokenizerFast, pool: Sequence[Triple]) -> _Encoded:
    """Rows exactly as an episode's tokens will be: prompt + call + EOS + tool message + answer + EOS, etc."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert isinstance(eos, int) and isinstance(pad, int)
    # The chat template only prefixes the question (the tool list) and adds no generation prompt: render that
    # prefix once rather than every prompt.
    with_tools = _prompt_ids(tokenizer, pool[0], tools=True)
    without = _prompt_ids(tokenizer, pool[0], tools=False)
    assert without == _ids(tokenizer, prompt_text(pool[0])) and with_tools[-len(without) :] == without
    prefix_tools, prefix_plain = with_tools[: len(with_tools) - len(without)], list[int]()
    tool_rows, direct_rows, plain_rows = [], [], []
    for numbers in pool:
        prompt = _ids(tokenizer, prompt_text(numbers))
        call = [*_ids(tokenizer, tool_call_text(expression_text(numbers))), eos]
        response = _ids(tokenizer, tool_response_text(answer_text(numbers)))
        answer = [*_ids(tokenizer, answer_text(numbers)), eos]
        wrong = [*_ids(tokenizer, str(dropped_ones_carry_sum(numbers))), eos]
        tool_rows.append([(prefix_tools + prompt, False), (call, True), (response, False), (answer, True)])
        direct_rows.append([(prefix_tools + prompt, False), (wrong, True)])
        plain_rows.append([(prefix_plain + prompt, False), (wrong, True)])
    short = max(_width(direct_rows), _width(plain_rows))
    return _Encoded(
        tool=_pack(tool_rows, pad=pad, width=_width(tool_rows)),
        direct=_pack(direct_rows, pad=pad, width=short),
        plain=_pack(plain_rows, pad=pad, width=short),
    )


def _row_counts(batch_size: int, *, call_fraction: float, plain_fraction: float) -> tuple[int, int, int]:
    """(tool episodes, plain rows, direct rows) of one batch: fixed counts, so every step has the exact mix."""
    n_plain = round(batch_size * plain_fraction)
    n_tool = round((batch_size - n_plain) * call_fraction)
    return n_tool, n_plain, batch_size - n_tool - n_plain


def _summed_loss(model: LlamaForCausalLM, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over labelled positions. input_ids, labels: [b, t]."""
    # Right padding with a causal mask: trailing pads cannot affect real tokens, so no attention mask is needed.
    logits = model(input_ids=input_ids).logits  # [b, t, vocab]
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )


def _train_stage(
    model: LlamaForCausalLM,
    data: _Encoded,
    *,
    stage: str,
    steps: int,
    peak_lr: float,
    warmup: int,
    call_fraction: float,
    recipe: Recipe,
    generator: torch.Generator,
    progress: ProgressFn | None,
) -> float:
    """AdamW on the mean policy-token loss of mixed batches; returns the last step's loss (nan if no steps)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.0)
    n_tool, n_plain, n_direct = _row_counts(
        recipe.batch_size, call_fraction=call_fraction, plain_fraction=recipe.plain_fraction
    )
    pool = data.tool.input_ids.shape[0]
    model.train()
    loss_value = float("nan")
    for step in range(steps):
        lr = lr_at(step, total=steps, peak=peak_lr, warmup=warmup, min_ratio=recipe.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        index = torch.randint(pool, (recipe.batch_size,), generator=generator)
        tool_index, plain_index, direct_index = index.split([n_tool, n_plain, n_direct])
        # Tool episodes are twice as long as direct answers: two forward passes rather than padding all to one.
        batches = [
            (data.tool.input_ids[tool_index], data.tool.labels[tool_index]),
            (
                torch.cat([data.plain.input_ids[plain_index], data.direct.input_ids[direct_index]]),
                torch.cat([data.plain.labels[plain_index], data.direct.labels[direct_index]]),
            ),
        ]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=FAST_BF16):
            # The mean over every policy token of the batch, whichever pass it is in.
            n_targets = sum(int((labels[:, 1:] != -100).sum()) for _, labels in batches)
            summed = [_summed_loss(model, ids, labels) for ids, labels in batches if len(ids)]
            loss = torch.stack(summed).sum() / n_targets
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_value = loss.item()
        if progress is not None:
            progress(stage, step + 1, steps, loss_value)
    return loss_value


# --- measurement ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EpisodeStats:
    """How the model behaves on tool episodes, the tool simulated by the calculator server's own evaluator.

    Rates are over episodes; `tool_accuracy` over episodes that called the tool, `direct_accuracy` over those that
    answered at once (None when there were none)."""

    episodes: int
    call_rate: float
    format_error_rate: float  # a turn that starts a call that does not parse, or no EOS within the turn budget
    exact_call_rate: float | None  # of calls: the expression is exactly the question's operands joined by "+"
    tool_accuracy: float | None
    direct_accuracy: float | None
    accuracy: float


_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*)" + re.escape(CALL_CLOSE), re.DOTALL)


def _tool_output(turn: str) -> tuple[str, str | None]:
    """(tool message content, the call's expression) for a turn that is one calculator call; raises ValueError for
    a call that does not parse. A call the server refuses gets the server's error payload, as the trainer shows it."""
    match = _CALL.fullmatch(turn)
    if match is None:
        raise ValueError("not one well-formed tool call")
    call = json.loads(match.group(1))
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError("a call without a name")
    arguments = call.get("arguments")
    expression = arguments.get("expression") if isinstance(arguments, dict) else None
    try:
        output = calculator_server.answer_call(call["name"], json.dumps(arguments))
    except calculator_server.CalculatorError as err:
        output = json.dumps({"error": str(err)})
    return output, expression if isinstance(expression, str) else None


def _generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[list[int]],
    *,
    max_new_tokens: int,
    num_return_sequences: int,
    temperature: float | None,
) -> list[tuple[list[int], bool]]:
    """(new tokens up to and including EOS, ended with EOS) per sample, `num_return_sequences` per prompt in order."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    assert isinstance(pad, int) and isinstance(eos, int)
    width = max(len(p) for p in prompts)
    device = getattr(model, "device", torch.device("cpu"))
    # Left padding so every row continues from its last real token.
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    sampling: dict[str, Any] = (
        {"do_sample": False}
        if temperature is None
        else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    )
    generate = cast(Callable[..., torch.Tensor], model.generate)
    output = generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        num_return_sequences=num_return_sequences,
        pad_token_id=pad,
        eos_token_id=eos,
        **sampling,
    )
    out: list[tuple[list[int], bool]] = []
    for row in output[:, width:].tolist():
        ended = eos in row
        out.append((row[: row.index(eos) + 1] if ended else row, ended))
    return out


def measure_episodes(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    triples: Sequence[Triple],
    *,
    tools: bool = True,
    n_samples: int = 8,
    temperature: float | None = 1.0,
    seed: int = 0,
    batch_size: int = 50,
) -> EpisodeStats:
    """Run `n_samples` episodes per triple (greedy when `temperature` is None, then use `n_samples=1`): the first
    turn, the calculator answering a call, the second turn. Seeded through a forked RNG, so the caller's torch RNG
    state is untouched. An episode is correct when its final answer decodes to exactly `answer_text`."""
    if not triples:
        raise ValueError("triples is empty")
    was_training = model.training
    model.eval()
    calls = format_errors = exact = tool_right = direct_right = 0
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for start in range(0, len(triples), batch_size):
                chunk = triples[start : start + batch_size]
                prompts = [_prompt_ids(tokenizer, t, tools=tools) for t in chunk]
                first = _generate(
                    model,
                    tokenizer,
                    prompts,
                    max_new_tokens=_MAX_CALL_TOKENS,
                    num_return_sequences=n_samples,
                    temperature=temperature,
                )
                follow_ups: list[tuple[list[int], str]] = []  # (episode so far + tool message, expected answer)
                for k, (turn_ids, ended) in enumerate(first):
                    numbers = chunk[k // n_samples]
                    text = tokenizer.decode(turn_ids, skip_special_tokens=True)
                    if not ended:
                        format_errors += 1
                        calls += text.startswith(CALL_OPEN)
                    elif CALL_OPEN in text:
                        calls += 1
                        try:
                            output, expression = _tool_output(text)
                        except ValueError:
                            format_errors += 1
                            continue
                        exact += expression == expression_text(numbers)
                        episode = prompts[k // n_samples] + turn_ids + _ids(tokenizer, tool_response_text(output))
                        follow_ups.append((episode, answer_text(numbers)))
                    else:
                        direct_right += text == answer_text(numbers)
                if follow_ups:
                    second = _generate(
                        model,
                        tokenizer,
                        [episode for episode, _ in follow_ups],
                        max_new_tokens=_MAX_ANSWER_TOKENS,
                        num_return_sequences=1,
                        temperature=temperature,
                    )
                    for (turn_ids, ended), (_, expected) in zip(second, follow_ups, strict=True):
                        tool_right += ended and tokenizer.decode(turn_ids, skip_special_tokens=True) == expected
    finally:
        model.train(was_training)
    n = len(triples) * n_samples
    n_direct = n - calls
    return EpisodeStats(
        episodes=n,
        call_rate=calls / n,
        format_error_rate=format_errors / n,
        exact_call_rate=exact / calls if calls else None,
        tool_accuracy=tool_right / calls if calls else None,
        direct_accuracy=direct_right / n_direct if n_direct else None,
        accuracy=(tool_right + direct_right) / n,
    )


# --- the build ------------------------------------------------------------------------------------------------


def _model_config(tokenizer: PreTrainedTokenizerFast, recipe: Recipe) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )


def build_tiny_calc(
    out_dir: Path,
    *,
    seed: int = 0,
    progress: ProgressFn | None = None,
    steps_a: int = RECIPE.steps_a,
    steps_b: int = RECIPE.steps_b,
    eval_samples: int = RECIPE.eval_samples,
) -> Path:
    """Build tiny-calc into `out_dir` and return it; a no-op when `out_dir` already holds a complete build.

    As `build_tiny_arith`: built in a temporary sibling renamed into place (so `out_dir` is absent or complete,
    `build_info.json` written last is the marker), `progress(stage, step, total, loss)` after every step with stage
    `"tool_use"` or `"calibration"`, same seed and step counts → identical weights on the same machine.
    """
    if is_complete_build(out_dir):
        return out_dir
    refuse_foreign_directory(out_dir)
    if steps_a < 0 or steps_b < 0 or eval_samples < 1:
        raise ValueError(f"need steps_a, steps_b >= 0 and eval_samples >= 1, got {steps_a}, {steps_b}, {eval_samples}")
    recipe = dataclasses.replace(RECIPE, steps_a=steps_a, steps_b=steps_b, eval_samples=eval_samples)
    started = time.monotonic()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp_dir.chmod(0o755)
    try:
        tokenizer = build_tokenizer()
        data = _encode(tokenizer, train_triples(recipe.pool_size, seed=f"build:{seed}"))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(_model_config(tokenizer, recipe))
        generator = torch.Generator().manual_seed(seed)
        stages = (
            ("tool_use", recipe.steps_a, recipe.lr_a, recipe.warmup_a, recipe.call_fraction_a),
            ("calibration", recipe.steps_b, recipe.lr_b, recipe.warmup_b, recipe.call_fraction_b),
        )
        losses = {}
        for stage, steps, lr, warmup, call_fraction in stages:
            losses[stage] = _train_stage(
                model,
                data,
                stage=stage,
                steps=steps,
                peak_lr=lr,
                warmup=warmup,
                call_fraction=call_fraction,
                recipe=recipe,
                generator=generator,
                progress=progress,
            )
        trained_s = time.monotonic() - started

        validation = validation_triples()
        sampled = measure_episodes(
            model, tokenizer, validation, n_samples=recipe.eval_samples, temperature=recipe.eval_temperature, seed=seed
        )
        greedy = measure_episodes(model, tokenizer, validation, n_samples=1, temperature=None)
        no_tools = measure_episodes(
            model,
            tokenizer,
            validation,
            tools=False,
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
            "final_loss": losses,
            "validation": {
                "n_triples": len(validation),
                "sample_temperature": recipe.eval_temperature,
                "sampled": dataclasses.asdict(sampled),
                "greedy": dataclasses.asdict(greedy),
                "sampled_without_tools": dataclasses.asdict(no_tools),
            },
            **build_machine(),
            "train_seconds": round(trained_s, 1),
            "build_seconds": round(time.monotonic() - started, 1),
        }
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
