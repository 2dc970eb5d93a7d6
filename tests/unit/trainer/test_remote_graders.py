"""trainer.grading.remote_graders without the network: OpenAI's shapes of score_model, label_model and endpoint graders,
the strict parsing of a judge's, an endpoint's and an embeddings endpoint's answers, the judge request, the budget, and
what a deployment without a judge or embeddings says. (tests/integration/test_remote_graders.py: real servers.)"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from trainer.grading.graders import grade
from trainer.grading.remote_graders import (
    AnswerError,
    BudgetSpent,
    ConfigMissing,
    EmbeddingsConfig,
    JudgeBudget,
    JudgeConfig,
    RemoteConfig,
    _judge_body,
    _judge_messages,
    cosine,
    grade_remote_leaves,
    judge_message,
    label_schema,
    missing_service,
    parse_embeddings,
    parse_endpoint_score,
    parse_label,
    parse_score,
    score_schema,
)
from trainer.spec import graders
from trainer.spec.graders import GraderError, parse_grader

PROMPT = [
    {"role": "system", "content": "You grade additions."},
    {"role": "user", "content": "Question: {{item.question}}\nAnswer: {{sample.output_text}}"},
]


def score_model(**extra: Any) -> dict[str, Any]:
    return {"type": "score_model", "name": "judge", "model": "gpt-4o-mini", "input": PROMPT, **extra}


def label_model(**extra: Any) -> dict[str, Any]:
    return {
        "type": "label_model",
        "name": "verdict",
        "model": "gpt-4o-mini",
        "input": PROMPT,
        "labels": ["correct", "incorrect"],
        "passing_labels": ["correct"],
        **extra,
    }


def endpoint(**extra: Any) -> dict[str, Any]:
    return {"type": "endpoint", "name": "mine", "url": "https://grader.example.com/grade", **extra}


def parse_error(obj: dict[str, Any]) -> GraderError:
    with pytest.raises(GraderError) as info:
        parse_grader(obj)
    return info.value


class TestShapes:
    def test_openais_score_model_parses_with_the_default_range(self) -> None:
        obj = score_model(sampling_params={"temperature": 0.2, "max_completions_tokens": 512, "seed": 7})
        grader = parse_grader(obj)
        assert isinstance(grader, graders.ScoreModelGrader)
        dumped = grader.model_dump(mode="json", exclude_none=True)
        assert dumped["range"] == [0.0, 1.0]
        assert dumped["sampling_params"] == {"max_completions_tokens": 512, "seed": 7, "temperature": 0.2}
        assert parse_grader(dumped) == grader

    def test_message_content_takes_a_string_a_text_block_or_a_list_of_them(self) -> None:
        grader = parse_grader(
            score_model(
                input=[
                    {"role": "developer", "content": {"type": "input_text", "text": "Grade {{item.question}}"}},
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "A: "},
                            {"type": "output_text", "text": "{{sample.output_text}}"},
                        ],
                    },
                    {"role": "user", "content": "plain", "type": "message"},
                ]
            )
        )
        assert isinstance(grader, graders.ScoreModelGrader)
        assert graders.template_fields(grader) == {"question"}
        messages, errors = _judge_messages(grader, "42", {"question": "What is 1 + 2?"})
        assert errors == []
        assert messages == [
            {"role": "developer", "content": [{"type": "text", "text": "Grade What is 1 + 2?"}]},
            {"role": "user", "content": [{"type": "text", "text": "A: "}, {"type": "text", "text": "42"}]},
            {"role": "user", "content": "plain"},
        ]

    @pytest.mark.parametrize(
        ("obj", "param", "message"),
        [
            (score_model(range=[1, 0]), "grader.range", "expected [low, high] with low < high, got [1.0, 0.0]"),
            (score_model(range=[0, 1, 2]), "grader.range", "expected [low, high]"),
            (score_model(input=[]), "grader.input", "at least 1 item"),
            (score_model(model=""), "grader.model", "at least 1 character"),
            (
                score_model(sampling_params={"temperature": 3}),
                "grader.sampling_params.temperature",
                "less than or equal to 2",
            ),
            (score_model(sampling_params={"max_tokens": 3}), "grader.sampling_params.max_tokens", "unknown field"),
            (
                score_model(sampling_params={"reasoning_effort": "huge"}),
                "grader.sampling_params.reasoning_effort",
                "'minimal'",
            ),
            (
                score_model(
                    input=[{"role": "user", "content": {"type": "input_image", "image_url": "https://x/y.png"}}]
                ),
                "grader.input.0.content",
                "content blocks of type 'input_image' are not supported",
            ),
            (
                score_model(input=[{"role": "user", "content": [{"type": "input_text", "text": "{{items.x}}"}]}]),
                "grader.input.0.content",
                "[0].text: unknown namespace 'items'",
            ),
            (score_model(input=[{"role": "tool", "content": "x"}]), "grader.input.0.role", "'user'"),
            (label_model(labels=["a", "a"]), "grader.labels", "labels must be distinct; repeated: ['a']"),
            (label_model(passing_labels=["maybe"]), "grader.passing_labels", "['maybe'] not among labels"),
            (label_model(passing_labels=[]), "grader.passing_labels", "at least 1 item"),
            (endpoint(url="grader.example.com/grade"), "grader.url", "the URL must start with http:// or https://"),
            (endpoint(url="https://me:pw@grader.example.com/"), "grader.url", "may not hold a user name or password"),
            (endpoint(headers={"Content-Length": "1"}), "grader.headers", "'Content-Length' is set by the service"),
            (endpoint(headers={"Proxy-Foo": "1"}), "grader.headers", "is set by the service"),
            (endpoint(headers={"X-Key": "a\r\nHost: evil"}), "grader.headers", "printable ASCII characters only"),
            (endpoint(headers={"Bad Name": "1"}), "grader.headers", "'Bad Name' is not a valid header name"),
            (endpoint(rate_limit=0), "grader.rate_limit", "greater than or equal to 1"),
            (endpoint(rate_limit=1.5), "grader.rate_limit", "valid integer"),
        ],
    )
    def test_bad_fields_are_named(self, obj: dict[str, Any], param: str, message: str) -> None:
        error = parse_error(obj)
        assert error.param == param, str(error)
        assert message in str(error)

    def test_remote_leaves_inside_multi_are_keyed_and_named_by_their_path(self) -> None:
        cos = {
            "type": "text_similarity",
            "name": "sim",
            "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}",
            "evaluation_metric": "cosine",
        }
        inner = {
            "type": "multi",
            "name": "inner",
            "graders": {"ep": endpoint(), "v": label_model()},
            "calculate_output": "ep * v",
        }
        obj = {
            "type": "multi",
            "name": "all",
            "graders": {
                "j": score_model(),
                "cos": cos,
                "inner": inner,
                "fmt": {**cos, "evaluation_metric": "fuzzy_match"},
            },
            "calculate_output": "j + cos + inner + fmt",
        }
        grader = parse_grader(obj)
        keyed = [(key, param, leaf.type) for key, param, leaf in graders.remote_graders(grader)]
        assert keyed == [
            ("j", "grader.graders.j", "score_model"),
            ("cos", "grader.graders.cos", "text_similarity"),
            ("inner.ep", "grader.graders.inner.graders.ep", "endpoint"),
            ("inner.v", "grader.graders.inner.graders.v", "label_model"),
        ]
        assert graders.batched_leaf_params(obj) == [p for _, p, _ in keyed]
        scores = {"j": 0.5, "cos": 0.25, "inner.ep": 3.0, "inner.v": 1.0}
        result = grade(grader, output_text="12", item={"answer": "12"}, model_scores=scores)
        assert result.score == 0.5 + 0.25 + 3.0 + 1.0  # fmt: fuzzy_match of equal texts is 1.0
        assert result.sub_scores == {"j": 0.5, "cos": 0.25, "inner": 3.0, "inner.ep": 3.0, "inner.v": 1.0, "fmt": 1.0}

    def test_grading_a_remote_leaf_without_its_batch_score_is_an_error_not_a_zero(self) -> None:
        with pytest.raises(GraderError, match="score_model graders call a judge model over batches of samples"):
            grade(parse_grader(score_model()), output_text="1", item={})


class TestAnswers:
    @pytest.mark.parametrize(
        ("content", "expected"),
        [
            ('{"steps": [{"description": "d", "conclusion": "c"}], "result": 0.75}', 0.75),
            ('{"result": 1}', 1.0),  # steps are optional when the server ignored the schema
            ('```json\n{"steps": [], "result": 0.5}\n```', 0.5),
            ('  ```\n{"steps": [], "result": 0}\n```  ', 0.0),
        ],
    )
    def test_a_score_answer_is_openais_structured_result(self, content: str, expected: float) -> None:
        assert parse_score(content, 0.0, 1.0) == expected

    @pytest.mark.parametrize(
        ("content", "problem"),
        [
            ("The answer deserves 0.8.", "not a JSON object"),
            ('Sure! {"result": 0.8}', "not a JSON object"),  # no fishing a result out of prose
            ('{"result": 0.8} and more', "not a JSON object"),
            ("[0.8]", "not a JSON object"),
            ('{"result": "0.8"}', "'result' is not a number"),
            ('{"result": true}', "'result' is not a number"),
            ('{"score": 0.8}', "'result' is not a number"),
            ('{"result": NaN}', "not a JSON object"),
            ('{"result": 1e999}', "'result' is not finite"),
            ('{"result": 1.5}', "'result' 1.5 is outside the grader's range [0, 1]"),
            ('{"result": -0.1}', "outside the grader's range"),
            ('{"steps": "thinking", "result": 0.5}', "'steps' is not a list"),
        ],
    )
    def test_anything_else_does_not_parse(self, content: str, problem: str) -> None:
        with pytest.raises(AnswerError) as info:
            parse_score(content, 0.0, 1.0)
        assert problem in str(info.value)

    def test_a_score_in_a_wider_range(self) -> None:
        assert parse_score('{"steps": [], "result": 7}', 1.0, 10.0) == 7.0

    def test_a_label_must_be_one_of_the_labels_exactly(self) -> None:
        assert parse_label('{"steps": [], "result": "correct"}', ["correct", "incorrect"]) == "correct"
        for bad in ('{"result": "Correct"}', '{"result": "yes"}', '{"result": 1}', "correct"):
            with pytest.raises(AnswerError):
                parse_label(bad, ["correct", "incorrect"])

    def test_a_chat_completion_gives_its_content_or_its_refusal(self) -> None:
        message = {"role": "assistant", "content": "{}", "refusal": None}
        assert judge_message({"choices": [{"index": 0, "message": message}]}) == ("{}", None)
        refused = {"role": "assistant", "content": None, "refusal": "no"}
        assert judge_message({"choices": [{"message": refused}]}) == (None, "no")
        bad_completions: list[Any] = [
            {},
            {"choices": []},
            {"choices": [{"message": {"content": 3}}]},
            {"choices": [{"message": {}}]},
            [],
        ]
        for bad in bad_completions:
            with pytest.raises(AnswerError):
                judge_message(bad)

    def test_an_endpoint_answers_a_finite_score(self) -> None:
        assert parse_endpoint_score({"score": 0.25, "why": "close"}) == 0.25
        assert parse_endpoint_score({"score": -3}) == -3.0  # not clipped
        bad_answers: list[Any] = [
            {"score": "1"},
            {"score": True},
            {"score": None},
            {"reward": 1},
            [1],
            1.0,
            {"score": math.inf},
        ]
        for bad in bad_answers:
            with pytest.raises(AnswerError):
                parse_endpoint_score(bad)

    def test_embeddings_are_placed_by_index(self) -> None:
        answer = {"data": [{"index": 1, "embedding": [0, 1]}, {"index": 0, "embedding": [1, 0]}]}
        assert parse_embeddings(answer, 2) == [[1.0, 0.0], [0.0, 1.0]]
        assert parse_embeddings({"data": [{"embedding": [2]}]}, 1) == [[2.0]]  # no index: by position

    @pytest.mark.parametrize(
        "answer",
        [
            {"data": [{"index": 0, "embedding": [1.0]}]},  # one for two inputs
            {"data": [{"index": 0, "embedding": [1.0]}, {"index": 0, "embedding": [1.0]}]},
            {"data": [{"index": 0, "embedding": [1.0]}, {"index": 2, "embedding": [1.0]}]},
            {"data": [{"index": 0, "embedding": [1.0]}, {"index": 1, "embedding": [1.0, 2.0]}]},
            {"data": [{"index": 0, "embedding": []}, {"index": 1, "embedding": []}]},
            {"data": [{"index": 0, "embedding": "AAAA"}, {"index": 1, "embedding": "AAAA"}]},  # base64: not asked for
            {"data": [{"index": 0, "embedding": [1.0]}, {"index": 1, "embedding": [1e999]}]},
            {"error": "down"},
        ],
    )
    def test_a_wrong_embeddings_answer_does_not_parse(self, answer: dict[str, Any]) -> None:
        with pytest.raises(AnswerError):
            parse_embeddings(answer, 2)

    def test_cosine(self) -> None:
        assert cosine([1, 2, 2], [2, 4, 4]) == pytest.approx(1.0)
        assert cosine([1, 0], [0, 3]) == 0.0
        assert cosine([3, 4], [4, 3]) == pytest.approx(24 / 25)
        assert cosine([1, 0], [-1, 0]) == -1.0
        with pytest.raises(ValueError, match="zero vector"):
            cosine([0, 0], [1, 1])


JUDGE = JudgeConfig(base_url="https://judge.example/v1", api_key="sk-test", models={"gpt-4o-mini": "upstream-mini"})


class TestJudgeRequest:
    def test_the_request_names_the_upstream_model_asks_for_the_schema_and_passes_sampling_params(self) -> None:
        params = {"max_completions_tokens": 64, "temperature": 0.0, "top_p": 0.5, "seed": 3, "reasoning_effort": "low"}
        grader = parse_grader(score_model(sampling_params=params))
        assert isinstance(grader, graders.ScoreModelGrader)
        body = _judge_body(grader, JUDGE, [{"role": "user", "content": "x"}])
        assert body == {
            "model": "upstream-mini",
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "score_model_result", "strict": True, "schema": score_schema()},
            },
            "max_completion_tokens": 64,
            "temperature": 0.0,
            "top_p": 0.5,
            "seed": 3,
            "reasoning_effort": "low",
        }
        assert score_schema()["required"] == ["steps", "result"]
        assert score_schema()["properties"]["result"] == {"type": "number"}

    def test_a_label_model_asks_for_one_of_its_labels(self) -> None:
        grader = parse_grader(label_model())
        assert isinstance(grader, graders.LabelModelGrader)
        body = _judge_body(grader, JUDGE, [])
        assert body["response_format"]["json_schema"]["schema"] == label_schema(["correct", "incorrect"])
        assert label_schema(["a"])["properties"]["result"] == {"type": "string", "enum": ["a"]}

    def test_a_missing_item_field_renders_empty_and_is_flagged(self) -> None:
        grader = parse_grader(score_model())
        assert isinstance(grader, graders.ScoreModelGrader)
        messages, errors = _judge_messages(grader, "42", {})
        assert messages[1]["content"] == "Question: \nAnswer: 42"
        assert [e.kind for e in errors] == ["invalid_variable"]


class TestDeployment:
    def test_no_judge_no_model_no_embeddings_each_say_so_naming_the_field(self) -> None:
        leaf = parse_grader(score_model())
        assert isinstance(leaf, graders.ScoreModelGrader)
        missing = missing_service(leaf, RemoteConfig(), "grader")
        assert isinstance(missing, ConfigMissing) and missing.code == "judge_unavailable"
        assert missing.param == "grader.model" and "no judge configured (PROXIMA_JUDGE_BASE_URL)" in str(missing)
        other = JudgeConfig(base_url="https://judge.example/v1", models={"o3": "o3"})
        missing = missing_service(leaf, RemoteConfig(judge=other), "grader.graders.j")
        assert missing is not None and missing.code == "model_not_available"
        assert str(missing) == (
            "grader.graders.j.model: judge model 'gpt-4o-mini' is not offered by this deployment; offered: o3"
        )
        assert missing_service(leaf, RemoteConfig(judge=JUDGE), "grader") is None
        cos = parse_grader(
            {"type": "text_similarity", "name": "c", "input": "a", "reference": "b", "evaluation_metric": "cosine"}
        )
        assert isinstance(cos, graders.TextSimilarityGrader)
        missing = missing_service(cos, RemoteConfig(), "grader")
        assert missing is not None and (missing.param, missing.code) == (
            "grader.evaluation_metric",
            "embeddings_unavailable",
        )
        embeddings = EmbeddingsConfig(base_url="https://e.example/v1", model="m")
        assert missing_service(cos, RemoteConfig(embeddings=embeddings), "grader") is None

    def test_grading_without_the_service_raises_before_any_request(self) -> None:
        with pytest.raises(ConfigMissing, match="no judge configured"):
            grade_remote_leaves(parse_grader(score_model()), ["1"], [{}], config=RemoteConfig(), budget=JudgeBudget(1))

    def test_a_config_travels_as_json_with_its_keys_but_does_not_print_them(self) -> None:
        config = RemoteConfig(judge=JUDGE, allow_networks=("127.0.0.0/8",), url_schemes=("http", "https"))
        assert RemoteConfig.model_validate_json(config.model_dump_json()) == config
        assert json.loads(config.model_dump_json())["judge"]["api_key"] == "sk-test"
        assert "sk-test" not in repr(config)
        assert config.url_policy.address_problem("127.0.0.1") is None
        with pytest.raises(ValueError, match="is not an IP network"):
            RemoteConfig(allow_networks=("nope",))

    def test_the_budget_counts_calls_and_refuses_the_one_past_it(self) -> None:
        budget = JudgeBudget(2)
        budget.take()
        budget.take()
        with pytest.raises(BudgetSpent, match="its budget of 2 judge calls"):
            budget.take()
        assert budget.used == 2
        unbounded = JudgeBudget(None)
        for _ in range(1000):
            unbounded.take()
        assert unbounded.used == 1000


def test_every_remote_failure_kind_counts_as_a_grader_failure() -> None:
    remote_kinds = {
        "model_grader_parse",
        "model_grader_refusal",
        "model_grader_server",
        "endpoint_parse",
        "endpoint_server",
        "embeddings",
    }
    from typing import get_args

    assert remote_kinds <= set(get_args(graders.GradeErrorKind))
    assert remote_kinds <= graders.FAILURE_KINDS
