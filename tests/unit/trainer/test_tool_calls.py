"""Tool-call parsing per model family and the environment's tokens between turns (trainer.agents.tool_calls)."""

from __future__ import annotations

import json
import re
import string
import threading
from typing import Any

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from trainer.agents.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ResponseTemplateParser,
    ToolCallFormatError,
    call_markers,
    environment_segment,
    parser_for,
)
from trainer.builtin_models import tiny_arith
from trainer.generation.constrained import constraints, text_without
from trainer.generation.encoding import prompt_text
from trainer.serving.inference_requests import Request, Sampling
from trainer.serving.inference_waves import WaveDecoder, _Row, decoded, special_ids_dropped

# --- a small ChatML tokenizer with a Qwen-like template (shared with test_episodes) ------------------------------

CHATML_SPECIAL = [
    "<pad>",
    "<|im_end|>",
    "<|im_start|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

# ChatML as Qwen 2.5 writes it: tool definitions in a system turn, calls as <tool_call> JSON after the content,
# consecutive tool messages grouped in one user turn, each in <tool_response>.
QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if THINK and loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' }}'
    "{%- if call.function.arguments is string %}{{- call.function.arguments }}"
    "{%- else %}{{- call.function.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def chatml_tokenizer(*, think: bool = False) -> PreTrainedTokenizerFast:
    """One token per character (and per ChatML marker), so that token ids are easy to write by hand. ``think``:
    the template renders the last assistant turn with an empty <think> block, as Qwen 3's does."""
    vocab = {t: i for i, t in enumerate(CHATML_SPECIAL + sorted(set(string.printable)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        additional_special_tokens=CHATML_SPECIAL[2:],
        padding_side="left",
    )
    tok.chat_template = QWEN_LIKE_TEMPLATE.replace("THINK", "true" if think else "false")
    return tok


def ids(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def tool_message(content: str, call_id: str = "call_1") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


# --- Hermes ----------------------------------------------------------------------------------------------------


class TestHermesParser:
    def test_call_keeps_arguments_text_exactly_as_written(self) -> None:
        turn = HermesParser().parse(
            'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"b":  2, "a": "é"}}\n</tool_call>'
        )
        assert turn.content == "Let me add."
        assert [(c.name, c.arguments) for c in turn.calls] == [("add", '{"b":  2, "a": "é"}')]
        assert CALL_ID.match(turn.calls[0].id)

    def test_several_calls_in_one_turn_get_distinct_ids_in_order(self) -> None:
        turn = HermesParser().parse(
            'A<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\nB\n'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
        )
        assert [(c.name, c.arguments) for c in turn.calls] == [("f", '{"x": 1}'), ("g", "{}")]
        assert turn.content == "A\nB"
        assert turn.calls[0].id != turn.calls[1].id

    def test_turn_without_call_is_its_text_unchanged(self) -> None:
        turn = HermesParser().parse("  The answer is 42.\n")
        assert turn.content == "  The answer is 42.\n"
        assert turn.calls == []

    def test_missing_arguments_are_an_empty_object(self) -> None:
        assert HermesParser().parse('<tool_call>{"name": "now"}</tool_call>').calls[0].arguments == "{}"

    def test_last_block_may_end_with_the_turn(self) -> None:
        turn = HermesParser().parse('<tool_call>\n{"name": "f", "arguments": {"q": "x"}}\n')
        assert [(c.name, c.arguments) for c in turn.calls] == [("f", '{"q": "x"}')]

    @pytest.mark.parametrize(
        "text",
        [
            "<tool_call>{'name': 'f'}</tool_call>",  # not JSON
            '<tool_call>{"arguments": {}}</tool_call>',  # no name
            '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
            '<tool_call>{"name": " ", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
            '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',  # arguments as a string
            '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
            '<tool_call>{"name": "f", "arguments": {}} and more</tool_call>',
            '<tool_call>["f"]</tool_call>',
            '<tool_call>{"name": "f", "arguments": {}</tool_call>',  # unbalanced
            "I am done.</tool_call>",  # a closing tag alone
            '<tool_call>{"name": "f"}</tool_call><tool_call>oops</tool_call>',  # one bad call spoils the turn
        ],
    )
    def test_call_that_does_not_parse_is_a_format_error(self, text: str) -> None:
        with pytest.raises(ToolCallFormatError):
            HermesParser().parse(text)


# --- Llama 3 ---------------------------------------------------------------------------------------------------


class TestLlama3JsonParser:
    def test_json_turn_is_a_call_with_parameters_as_arguments(self) -> None:
        turn = Llama3JsonParser().parse('{"name": "search", "parameters": {"query": "rl"}}')
        assert (turn.content, [(c.name, c.arguments) for c in turn.calls]) == ("", [("search", '{"query": "rl"}')])

    def test_python_tag_with_text_before_and_several_calls(self) -> None:
        turn = Llama3JsonParser().parse(
            'Looking it up.<|python_tag|>{"name": "f", "arguments": {"a": 1}}; {"name": "g", "parameters": {}}'
        )
        assert turn.content == "Looking it up."
        assert [(c.name, c.arguments) for c in turn.calls] == [("f", '{"a": 1}'), ("g", "{}")]

    @pytest.mark.parametrize("text", ['{"answer": 42}', "The answer is {x}.", "42"])
    def test_text_that_is_not_a_call_is_content(self, text: str) -> None:
        assert Llama3JsonParser().parse(text).calls == []
        assert Llama3JsonParser().parse(text).content == text

    @pytest.mark.parametrize(
        "text",
        [
            '{"name": "f", "parameters": {"a": 1}',
            '{"name": "f", "parameters": [1]}',
            '<|python_tag|>{"parameters": {}}',
            '{"name": "f", "parameters": {}} then text',
        ],
    )
    def test_broken_call_is_a_format_error(self, text: str) -> None:
        with pytest.raises(ToolCallFormatError):
            Llama3JsonParser().parse(text)


# --- Mistral ---------------------------------------------------------------------------------------------------


class TestMistralParser:
    def test_json_list_of_calls(self) -> None:
        turn = MistralParser().parse('Sure.[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g"}]')
        assert turn.content == "Sure."
        assert [(c.name, c.arguments) for c in turn.calls] == [("f", '{"x": 1}'), ("g", "{}")]
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in turn.calls)

    def test_v11_syntax_with_call_ids(self) -> None:
        turn = MistralParser().parse('[TOOL_CALLS]f[ARGS]{"x": [1, 2]}[TOOL_CALLS]g[CALL_ID]ab12[ARGS]{}')
        assert [(c.name, c.arguments) for c in turn.calls] == [("f", '{"x": [1, 2]}'), ("g", "{}")]

    def test_turn_without_marker_is_content(self) -> None:
        assert MistralParser().parse("Hello").content == "Hello"

    @pytest.mark.parametrize(
        "text",
        [
            "[TOOL_CALLS][{",
            "[TOOL_CALLS]f{}",
            '[TOOL_CALLS]f[ARGS]"x"',
            '[TOOL_CALLS][{"name": "f"}] extra',
            "[TOOL_CALLS][]x",
        ],
    )
    def test_broken_call_is_a_format_error(self, text: str) -> None:
        with pytest.raises(ToolCallFormatError):
            MistralParser().parse(text)


# --- transformers' response parsing ----------------------------------------------------------------------------

# A response_template (transformers 5.x's declarative format) for the Hermes syntax.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*<\|im_end\|>", "content": "text"},
    },
}


class TestResponseTemplateParser:
    def test_tokenizer_with_response_template_uses_transformers_parsing(self) -> None:
        tok = chatml_tokenizer()
        tok.response_template = RESPONSE_TEMPLATE
        parser = parser_for(tok)
        assert isinstance(parser, ResponseTemplateParser)
        turn = parser.parse('Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": "é"}}\n</tool_call>')
        assert turn.content == "Adding."
        assert [(c.name, json.loads(c.arguments)) for c in turn.calls] == [("add", {"a": 2, "b": "é"})]
        assert turn.calls[0].arguments == '{"a": 2, "b": "é"}'  # re-serialised, non-ASCII kept
        assert CALL_ID.match(turn.calls[0].id)

    @pytest.mark.parametrize(
        "text",
        [
            "<tool_call>{not json}</tool_call>",
            '<tool_call>{"arguments": {}}</tool_call>',
            '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
            '<tool_call>{"name": "f", "arguments": "[1]"}</tool_call>',
        ],
    )
    def test_bad_call_is_a_format_error(self, text: str) -> None:
        tok = chatml_tokenizer()
        tok.response_template = RESPONSE_TEMPLATE
        with pytest.raises(ToolCallFormatError):
            parser_for(tok).parse(text)

    def test_arguments_given_as_text_are_kept(self) -> None:
        tok = chatml_tokenizer()
        tok.response_template = RESPONSE_TEMPLATE
        turn = parser_for(tok).parse('<tool_call>{"name": "f", "arguments": "{\\"x\\":  1}"}</tool_call>')
        assert turn.calls[0].arguments == '{"x":  1}'


# --- choosing a parser -----------------------------------------------------------------------------------------


class TestParserFor:
    @pytest.mark.parametrize(
        ("template", "expected"),
        [
            ("{{ messages[0].content }}<tool_call>", HermesParser),
            ("{%- if tools %}[AVAILABLE_TOOLS]{%- endif %}{{ '[TOOL_CALLS]' }}", MistralParser),
            ("<|start_header_id|>ipython<|end_header_id|>{{- '<|python_tag|>' }}", Llama3JsonParser),
            ('<|start_header_id|>assistant{{- \'{"name": "\' }}{{- \'"parameters": \' }}<|eot_id|>', Llama3JsonParser),
            ("{{ messages[0].content }}", HermesParser),  # nothing recognisable: the default
        ],
    )
    def test_parser_is_chosen_by_template_markers(self, template: str, expected: type) -> None:
        tok = chatml_tokenizer()
        tok.chat_template = template
        assert type(parser_for(tok)) is expected

    def test_tiny_arith_gets_the_default_hermes_parser(self) -> None:
        assert type(parser_for(tiny_arith.build_tokenizer())) is HermesParser

    def test_qwen_like_template_gets_hermes(self) -> None:
        assert type(parser_for(chatml_tokenizer())) is HermesParser


# --- the environment's tokens ----------------------------------------------------------------------------------

ONE_RESULT = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


class TestEnvironmentSegment:
    @pytest.mark.parametrize("think", [False, True])
    def test_chatml_segment_is_the_tool_turn_and_generation_prompt(self, think: bool) -> None:
        tok = chatml_tokenizer(think=think)
        # The model generated "...<|im_end|>"; the "\n" after it is the template's, so the segment starts with it.
        assert environment_segment(tok, [tool_message("5")]) == ids(tok, ONE_RESULT)

    def test_consecutive_tool_messages_share_one_user_turn(self) -> None:
        tok = chatml_tokenizer()
        segment = environment_segment(tok, [tool_message("5", "call_a"), tool_message("x y", "call_b")])
        expected = (
            "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\nx y\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n"
        )
        assert tok.decode(segment, skip_special_tokens=False) == expected
        assert segment == ids(tok, expected)

    def test_prompt_turn_and_segment_tokenise_as_the_whole_conversation(self) -> None:
        """The row (prompt ids + generated ids + segment) is the token sequence of the rendered conversation."""
        tok = chatml_tokenizer()
        tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
        prompt = [{"role": "user", "content": "What is 2 + 3?"}]
        generated = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        turn = HermesParser().parse(generated)
        assistant: dict[str, Any] = {
            "role": "assistant",
            "content": turn.content,
            "tool_calls": [turn.calls[0].chat_completions()],
        }
        result = tool_message("5", turn.calls[0].id)
        row = (
            ids(tok, prompt_text(tok, prompt, {"tools": tools}))
            + ids(tok, generated)
            + [tok.eos_token_id]
            + environment_segment(tok, [result])
        )
        assert row == ids(tok, prompt_text(tok, [*prompt, assistant, result], {"tools": tools}))

    def test_turn_ended_by_another_token_gets_the_whole_turn_end(self) -> None:
        tok = chatml_tokenizer()
        segment = environment_segment(tok, [tool_message("5")], turn_end="<pad>")
        assert tok.decode(segment, skip_special_tokens=False) == "<|im_end|>" + ONE_RESULT

    def test_template_kwargs_reach_the_template(self) -> None:
        tok = chatml_tokenizer()
        tok.chat_template = QWEN_LIKE_TEMPLATE.replace("THINK", "think_flag")
        assert environment_segment(tok, [tool_message("5")], template_kwargs={"think_flag": True}) == ids(
            tok, ONE_RESULT
        )

    def test_template_that_wants_calls_before_tool_messages_gets_them(self) -> None:
        tok = chatml_tokenizer()
        tok.chat_template = (
            "{%- for m in messages %}{%- if m.role == 'tool' and not messages[loop.index0 - 1].tool_calls %}"
            "{{- raise_exception('tool message without a call') }}{%- endif %}"
            "{{- '[' + m.role + ']' + m.content }}{%- if m.role == 'assistant' %}{{- '<|im_end|>' }}{%- endif %}"
            "{%- endfor %}{%- if add_generation_prompt %}{{- '[assistant]' }}{%- endif %}"
        )
        segment = environment_segment(tok, [tool_message("5")])
        assert tok.decode(segment, skip_special_tokens=False) == "[tool]5[assistant]"

    def test_template_that_rewrites_the_turn_end_is_refused(self) -> None:
        tok = chatml_tokenizer()
        tok.chat_template = (
            "{%- for m in messages %}{{- m.content }}{%- if m.role == 'assistant' and loop.last %}END{%- endif %}"
            "{%- endfor %}"
        )
        with pytest.raises(ValueError, match="differently"):
            environment_segment(tok, [tool_message("5")])

    def test_tiny_arith_segment_is_the_tool_contents(self) -> None:
        """tiny-arith's template concatenates contents and has no generation prompt: the segment is the results'
        own tokens, one per digit."""
        tok = tiny_arith.build_tokenizer()
        digit = tok.convert_tokens_to_ids
        assert environment_segment(tok, [tool_message("42")]) == [digit("4"), digit("2")]
        assert environment_segment(tok, [tool_message("1"), tool_message("23")]) == [digit("1"), digit("2"), digit("3")]


# --- the inference server's text of a turn ----------------------------------------------------------------------


def special_marker_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, Mistral's and Llama's call markers special tokens (as their tokenizers have them)."""
    special = ["<pad>", "</s>", "[TOOL_CALLS]", "<|python_tag|>", "[INST]"]
    vocab = {t: i for i, t in enumerate(special + sorted(set(string.printable)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", additional_special_tokens=special[2:]
    )


@pytest.mark.parametrize(
    ("parser", "marker", "body"),
    [
        (MistralParser(), "[TOOL_CALLS]", '[{"name": "f", "arguments": {"x": 1}}]'),
        (Llama3JsonParser(), "<|python_tag|>", '{"name": "f", "arguments": {"x": 1}}'),
    ],
    ids=["mistral", "llama"],
)
def test_the_servers_text_keeps_a_special_call_marker_for_the_parser(parser: Any, marker: str, body: str) -> None:
    tok = special_marker_tokenizer()
    drop = special_ids_dropped(tok, call_markers(parser))
    assert drop is not None and tok.convert_tokens_to_ids(marker) not in drop
    generated = [*ids(tok, "Sure."), tok.convert_tokens_to_ids(marker), tok.convert_tokens_to_ids("[INST]")]
    generated += ids(tok, body)
    # as the engine decodes a row: other special tokens still leave the text
    decoder = WaveDecoder.__new__(WaveDecoder)
    req = Request("m", None, [0], Sampling(max_tokens=99, keep_special=call_markers(parser)), lambda ev: None)
    row = _Row(req, 0, None, drop=drop)
    for t in generated:
        decoder._accept(row, t, None, tok.eos_token_id, tok, threading.Lock())
    assert row.text == f"Sure.{marker}{body}"
    turn = parser.parse(row.text)
    assert turn.content == "Sure." and [(c.name, json.loads(c.arguments)) for c in turn.calls] == [("f", {"x": 1})]
    assert tok.decode(generated, skip_special_tokens=True) == f"Sure.{body}"  # what the server parsed before
    assert decoded(tok, generated, special_ids_dropped(tok, ())) == f"Sure.{body}"  # no markers kept: as before


@pytest.mark.parametrize(
    "parser", [HermesParser(), MistralParser(), Llama3JsonParser()], ids=lambda p: type(p).__name__
)
def test_tool_choice_none_forbids_the_marker_spelt_in_pieces(parser: Any) -> None:
    tok = chatml_tokenizer()  # one token per character: any marker can be spelt a character at a time
    [marker] = call_markers(parser)
    [c] = constraints(text_without(call_markers(parser)), tok, 1)
    for ch in "ok " + marker[:-1]:
        assert bool(c.allowed(len(tok))[tok.convert_tokens_to_ids(ch)])
        c.advance(tok.convert_tokens_to_ids(ch))
    ok = c.allowed(len(tok))
    assert not bool(ok[tok.convert_tokens_to_ids(marker[-1])])  # the marker's last character would complete it
    assert bool(ok[tok.convert_tokens_to_ids("x")]) and bool(ok[tok.eos_token_id]) and not c.dead
    assert not bool(ok[tok.convert_tokens_to_ids("<tool_call>")])  # the marker's own token, as before
