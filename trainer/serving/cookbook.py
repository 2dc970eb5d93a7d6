"""tinker-cookbook's own training loops on the built-in models, against a Proxima server.

The cookbook's loops (``tinker_cookbook.supervised.train`` and ``tinker_cookbook.rl.train``) run unchanged through the
official ``tinker`` SDK; what a model needs from the cookbook is a tokenizer and a renderer, and the built-in models
have neither on a model hub. This module registers both, then runs a loop:

- the tokenizer is the model folder's own (``proxima models build tiny-arith`` prints it);
- the renderer ``proxima/plain`` writes a conversation as the model was trained: the user's text, then the
  assistant's followed by the end-of-sequence token, which is also the stop sequence (the cookbook's ``role_colon``
  writes ``User:`` and ``Assistant:``, words outside tiny-arith's 18-token vocabulary).

    TINKER_API_KEY=tml-<Proxima key> python -m trainer.serving.cookbook rl --base-url http://127.0.0.1:8000 \\
        --model-dir ~/.proxima/models/tiny-arith --log-path runs/rl

``sl`` fine-tunes on a JSONL of conversations (the cookbook's ``FromConversationFileBuilder``); ``rl`` runs the
cookbook's arithmetic environment (``recipes.math_rl.arithmetic_env``) with its default ``importance_sampling`` loss.
Metrics land in ``<log path>/metrics.jsonl`` as the cookbook writes them.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import tinker
from tinker_cookbook import renderers
from tinker_cookbook.renderers.base import ParseTermination, RenderContext, RenderedMessage, Renderer, ensure_text
from tinker_cookbook.tokenizer_utils import register_tokenizer
from transformers import AutoTokenizer

RENDERER = "proxima/plain"


class PlainRenderer(Renderer):
    """A user turn is its text; an assistant turn is its text and EOS. Generation stops at EOS."""

    @property
    def has_extension_property(self) -> bool:
        return True  # each conversation's rendering is a prefix of the next one's

    def render_message(self, message: renderers.Message, ctx: RenderContext) -> RenderedMessage:
        tokens = list(self.tokenizer.encode(ensure_text(message["content"]), add_special_tokens=False))
        if message["role"] == "assistant":
            tokens.append(self._eos())
        return RenderedMessage(header=None, output=[tinker.types.EncodedTextChunk(tokens=tokens)])

    def get_stop_sequences(self) -> list[int]:
        return [self._eos()]

    def parse_response(self, response: list[int]) -> tuple[renderers.Message, ParseTermination]:
        ended = bool(response) and response[-1] == self._eos()
        text = self.tokenizer.decode(response[:-1] if ended else response)
        return {"role": "assistant", "content": text}, (
            ParseTermination.STOP_SEQUENCE if ended else ParseTermination.MALFORMED
        )

    def _eos(self) -> int:
        eos = self.tokenizer.eos_token_id
        assert eos is not None, "the model's tokenizer defines EOS (trainer.generation.models.load_tokenizer checks it)"
        return int(eos)


def register(model_name: str, model_dir: Path) -> None:
    """Make ``model_name``'s tokenizer (from ``model_dir``) and the plain renderer known to the cookbook."""

    def tokenizer() -> Any:
        return AutoTokenizer.from_pretrained(str(model_dir))

    def renderer(tokenizer: Any, _image_processor: Any = None) -> Renderer:
        return PlainRenderer(tokenizer)

    register_tokenizer(model_name, tokenizer)
    renderers.register_renderer(RENDERER, renderer)


def supervised_config(args: argparse.Namespace) -> Any:
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=args.model, renderer_name=RENDERER, max_length=64, batch_size=args.batch_size
    )
    return train.Config(
        log_path=str(args.log_path),
        model_name=args.model,
        recipe_name="proxima_sl",
        renderer_name=RENDERER,
        dataset_builder=FromConversationFileBuilder(common_config=common, file_path=str(args.data), test_size=16),
        learning_rate=args.learning_rate,
        lora_rank=args.lora_rank,
        base_url=args.base_url,
        max_steps=args.steps,
        save_every=args.save_every,
        eval_every=args.save_every,
    )


def rl_config(args: argparse.Namespace) -> Any:
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    builder = ArithmeticDatasetBuilder(
        batch_size=args.batch_size,
        group_size=args.group_size,
        model_name_for_tokenizer=args.model,
        renderer_name=RENDERER,
        n_batches=args.steps,
        include_fewshot=False,
    )
    return train.Config(
        log_path=str(args.log_path),
        model_name=args.model,
        recipe_name="proxima_rl",
        renderer_name=RENDERER,
        dataset_builder=builder,
        learning_rate=args.learning_rate,
        max_tokens=args.max_tokens,
        lora_rank=args.lora_rank,
        base_url=args.base_url,
        save_every=args.save_every,
        eval_every=0,
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("loop", choices=["sl", "rl"])
    p.add_argument("--base-url", required=True, help="the Proxima server (its key: TINKER_API_KEY=tml-<key>)")
    p.add_argument("--model", default="tiny-arith", help="a base model the server offers")
    p.add_argument("--model-dir", type=Path, required=True, help="the model's folder, for its tokenizer")
    p.add_argument("--log-path", type=Path, required=True)
    p.add_argument("--data", type=Path, help="sl: a JSONL of conversations")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8, help="sl: conversations a step; rl: problems a step")
    p.add_argument("--group-size", type=int, default=8, help="rl: samples a problem")
    p.add_argument("--max-tokens", type=int, default=5, help="rl: tokens a sample")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--save-every", type=int, default=10)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    register(args.model, args.model_dir)
    if args.loop == "sl":
        from tinker_cookbook.supervised import train as sl_train

        if args.data is None:
            raise SystemExit("sl needs --data (a JSONL of conversations)")
        asyncio.run(sl_train.main(supervised_config(args)))
    else:
        from tinker_cookbook.rl import train as rl_train

        asyncio.run(rl_train.main(rl_config(args)))


if __name__ == "__main__":
    main()
