"""Learning on tiny-calc: supervised fine-tuning on OpenAI-format tool-call conversations (the user asks a sum, the
assistant calls the calculator with the expression, the tool answers, the assistant answers) teaches the model to
call its tool, which greedy decoding does on about 4% of held-out prompts before (tiny_calc's build_info).

The held-out rate is measured as tiny-calc's build measures it (``tiny_calc.measure_episodes``: greedy, the calculator
offered through the chat template, the 200 validation triples no training file holds; a rate over 200 prompts has a
standard error of at most 0.035). The control trains on the same lines with the call turns at ``weight: 0``, so the
calls are rendered in the context but masked out of the loss: the rate must not rise then, which shows that the rise
comes from training the call tokens the dataset's ``tool_calls`` render to.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.builtin_models import tiny_calc
from trainer.spec.callbacks import JsonlFiles
from trainer.spec.config import parse_spec
from trainer.train import train

# Measured (2-core CPU, fp32, batch 16, lr 1e-3, LoRA defaults), greedy held-out call rate after n steps, on other
# lines of the same kind: 1: 0.09, 2: 0.375, 3: 0.97 (0.99 on a second draw), 4: 0.995, 5: 1.0; with the calls
# masked, 5 steps: 0.025, 10 steps: 0.04. Four steps clear the bar with a step to spare (these lines: 1.0, masked
# 0.02); each run trains in under a second, the test takes about 6 s.
STEPS, BATCH = 4, 16
BAR = 0.8
CONTROL_CEILING = 0.1


def conversation(numbers: tiny_calc.Triple, i: int, *, call_weight: int) -> dict[str, Any]:
    arguments = json.dumps({"expression": tiny_calc.expression_text(numbers)})
    call = {"id": f"call_{i}", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
    answer = tiny_calc.answer_text(numbers)
    return {
        "messages": [
            {"role": "user", "content": tiny_calc.prompt_text(numbers)},
            {"role": "assistant", "content": None, "tool_calls": [call], "weight": call_weight},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": answer},
            {"role": "assistant", "content": answer},
        ],
        "tools": [tiny_calc.TOOL],
        "parallel_tool_calls": False,
    }


def greedy_call_rate(model_dir: Path, adapter: Path | None) -> float:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    stats = tiny_calc.measure_episodes(model, tokenizer, tiny_calc.validation_triples(), n_samples=1, temperature=None)
    return stats.call_rate


def fine_tune(model_dir: Path, out: Path, *, call_weight: int) -> Path:
    triples = tiny_calc.train_triples(STEPS * BATCH, seed="sft-tool-calls")
    data = out / "train.jsonl"
    out.mkdir(parents=True)
    rows = [conversation(t, i, call_weight=call_weight) for i, t in enumerate(triples)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hp = {"batch_size": BATCH, "max_steps": STEPS, "learning_rate": 1e-3, "precision": "fp32"}
    hp |= {"checkpoint_interval": 1000, "eval_interval": 1000}
    spec = parse_spec(
        {
            "model": str(model_dir),
            "training_file": str(data),
            "seed": 0,
            "method": {"type": "supervised", "supervised": {"hyperparameters": hp}},
        }
    )
    train(spec, output_dir=out / "run", callback=JsonlFiles(out / "run"))
    return out / "run" / "adapter"


@pytest.mark.slow
def test_supervised_tool_call_conversations_teach_tiny_calc_to_call_its_tool(
    tiny_calc_dir: Path, tmp_path: Path
) -> None:
    base = greedy_call_rate(tiny_calc_dir, None)
    trained = greedy_call_rate(tiny_calc_dir, fine_tune(tiny_calc_dir, tmp_path / "calls", call_weight=1))
    masked = greedy_call_rate(tiny_calc_dir, fine_tune(tiny_calc_dir, tmp_path / "masked", call_weight=0))
    print(f"greedy held-out call rate: base {base:.3f}, {STEPS} steps {trained:.3f}, calls masked {masked:.3f}")
    assert base <= CONTROL_CEILING  # measured 0.04
    assert trained >= BAR  # measured 1.0
    assert masked <= CONTROL_CEILING  # measured 0.02: the answer turn alone teaches no calls
