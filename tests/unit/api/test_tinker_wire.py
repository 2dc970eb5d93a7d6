"""api.tinker_wire against the Tinker SDK's own converters: requests written by its ``request_conv`` (as
``resources/training.py`` sends them), results read back by its ``response_conv`` (as ``retrieve_future`` does)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
import torch
import zstandard
from tinker.proto import request_conv, response_conv
from tinker.types import ForwardBackwardInput, ImageChunk, LossFnType
from tinker.types import ForwardBackwardRequest as SdkRequest

from api.errors import PayloadTooLarge
from api.tinker_wire import (
    WireError,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
    pb,
)
from trainer.spec.tinker_types import ForwardResult, SampledSequence, SampleResult

REPO = Path(__file__).resolve().parents[3]


def sdk_message(
    data: list[tinker.Datum],
    *,
    loss_fn: LossFnType = "cross_entropy",
    config: dict[str, float | str] | None = None,
    forward_only: bool = False,
) -> Any:
    """The protobuf message ``AsyncTrainingResource.forward_backward`` serialises, built by the SDK's code."""
    request = SdkRequest(
        forward_backward_input=ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="sess:train:0",
        seq_id=7,
    )
    msg = request_conv.forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg


def sdk_body(data: list[tinker.Datum], **kwargs: Any) -> bytes:
    return bytes(sdk_message(data, **kwargs).SerializeToString())


def datum(tokens: list[int], **inputs: Any) -> tinker.Datum:
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def wire_error(body: bytes, *, content_encoding: str | None = None) -> str:
    with pytest.raises(WireError) as err:
        decode_forward_backward(body, content_encoding=content_encoding)
    assert err.value.status == 400
    return err.value.message


def hand_built(tensor: Any, *, tokens: int = 3, name: str = "weights") -> bytes:
    """A one-datum request whose ``name`` input is ``tensor``, for encodings the SDK never writes."""
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.arange(tokens, dtype="<i4").tobytes()
    d.loss_fn_inputs[name].CopyFrom(tensor)
    return bytes(msg.SerializeToString())


class TestDecodeForwardBackward:
    def test_the_request_fields_and_each_datums_tokens_across_its_chunks(self) -> None:
        two_chunks = tinker.ModelInput.from_ints([1, 2]).append_int(3)
        body = sdk_body(
            [datum([10, 11, 12], target_tokens=[11, 12, 13]), tinker.Datum(model_input=two_chunks)],
            loss_fn="importance_sampling",
            forward_only=True,
        )
        req = decode_forward_backward(body, content_encoding=None)
        assert (req.model_id, req.seq_id, req.loss_fn, req.forward_only) == (
            "sess:train:0",
            7,
            "importance_sampling",
            True,
        )
        assert req.config == {}
        assert [d.tokens.tolist() for d in req.data] == [[10, 11, 12], [1, 2, 3]]
        assert all(d.tokens.dtype == np.int64 for d in req.data)
        assert req.data[1].inputs == {}

    def test_dense_inputs_keep_their_values_and_targets_are_int64_the_rest_float32(self) -> None:
        advantages = np.array([0.5, -1.25, 3.0], dtype=np.float64)  # the SDK sends float32; so do we
        body = sdk_body(
            [
                datum(
                    [1, 2, 3],
                    target_tokens=[2, 3, 4],
                    weights=[1, 1, 0],
                    advantages=advantages,
                    logprobs=[-0.1, -2, -3],
                )
            ]
        )
        inputs = decode_forward_backward(body, content_encoding=None).data[0].inputs
        assert inputs["target_tokens"].dtype == np.int64 and inputs["target_tokens"].tolist() == [2, 3, 4]
        assert inputs["weights"].dtype == np.float32 and inputs["weights"].tolist() == [1.0, 1.0, 0.0]
        np.testing.assert_array_equal(inputs["advantages"], advantages.astype(np.float32))
        np.testing.assert_array_equal(inputs["logprobs"], np.array([-0.1, -2, -3], dtype=np.float32))
        assert all(a.flags.writeable for a in inputs.values())  # not views of the request's bytes

    def test_an_integer_array_of_weights_becomes_float32(self) -> None:
        body = sdk_body([datum([1, 2], target_tokens=[2, 3], weights=np.array([1, 0]))])  # numpy int → DTYPE_INT64
        weights = decode_forward_backward(body, content_encoding=None).data[0].inputs["weights"]
        assert weights.dtype == np.float32 and weights.tolist() == [1.0, 0.0]

    def test_a_2d_torch_target_sent_as_sparse_csr_is_densified_with_zeros(self) -> None:
        targets = torch.zeros(4, 6, dtype=torch.int64)
        targets[0, 1], targets[2, 5], targets[3, 0] = 7, 9, 11
        weights = torch.zeros(4, 6)
        weights[0, 1], weights[2, 5] = 0.75, -2.5
        msg = sdk_message([datum([1, 2, 3, 4], target_tokens=targets, weights=weights)])
        assert msg.data[0].loss_fn_inputs["target_tokens"].WhichOneof("encoding") == "sparse_csr"
        assert msg.data[0].loss_fn_inputs["weights"].WhichOneof("encoding") == "sparse_csr"
        inputs = decode_forward_backward(msg.SerializeToString(), content_encoding=None).data[0].inputs
        assert inputs["target_tokens"].dtype == np.int64 and inputs["target_tokens"].shape == (4, 6)
        np.testing.assert_array_equal(inputs["target_tokens"], targets.numpy())
        assert inputs["weights"].dtype == np.float32
        np.testing.assert_array_equal(inputs["weights"], weights.numpy())

    def test_a_dense_2d_torch_target_keeps_its_shape(self) -> None:
        targets = torch.arange(6, dtype=torch.int64).reshape(3, 2) + 1  # no zeros: the SDK sends it dense
        msg = sdk_message([datum([1, 2, 3], target_tokens=targets)])
        assert msg.data[0].loss_fn_inputs["target_tokens"].WhichOneof("encoding") == "dense"
        got = decode_forward_backward(msg.SerializeToString(), content_encoding=None).data[0].inputs["target_tokens"]
        np.testing.assert_array_equal(got, targets.numpy())

    def test_a_zstd_body_decodes_like_the_plain_one(self) -> None:
        body = sdk_body([datum([5, 6, 7], target_tokens=[6, 7, 8], weights=[0.5, 1, 1])])
        plain = decode_forward_backward(body, content_encoding=None)
        packed = decode_forward_backward(zstandard.ZstdCompressor().compress(body), content_encoding="zstd")
        assert packed.data[0].tokens.tolist() == plain.data[0].tokens.tolist() == [5, 6, 7]
        assert {k: v.tolist() for k, v in packed.data[0].inputs.items()} == {
            k: v.tolist() for k, v in plain.data[0].inputs.items()
        }
        assert decode_forward_backward(body, content_encoding="identity").data[0].tokens.tolist() == [5, 6, 7]

    def test_config_numbers_and_text_arrive_with_their_types(self) -> None:
        body = sdk_body(
            [datum([1], target_tokens=[2])], loss_fn="custom", config={"clip_low_threshold": 0.2, "loss_id": "loss_9"}
        )
        assert decode_forward_backward(body, content_encoding=None).config == {
            "clip_low_threshold": 0.2,
            "loss_id": "loss_9",
        }

    def test_config_v2_wins_over_the_legacy_map(self) -> None:
        msg = pb.ForwardBackwardRequest(model_id="m", loss_fn="ppo", loss_fn_config={"beta": 1.0, "old": 3.0})
        msg.loss_fn_config_v2["beta"].number = 2.0
        assert decode_forward_backward(msg.SerializeToString(), content_encoding=None).config == {
            "beta": 2.0,
            "old": 3.0,
        }

    @pytest.mark.parametrize(
        ("chunk", "kind"), [(ImageChunk(data=b"\x89PNG", format="png"), "image"), (tinker.DmelChunk(dmel=b"x"), "dmel")]
    )
    def test_a_non_text_chunk_is_refused_naming_the_datum(self, chunk: Any, kind: str) -> None:
        mixed = tinker.ModelInput(chunks=[tinker.EncodedTextChunk(tokens=[1]), chunk])
        body = sdk_body([datum([1]), tinker.Datum(model_input=mixed)])
        assert wire_error(body) == f"datum 1: {kind} chunks are not supported by this model"

    def test_bytes_that_are_not_the_message_are_refused(self) -> None:
        assert wire_error(b"\xff\xff\xff").startswith("the body is not a ForwardBackwardRequest protobuf")

    def test_a_body_that_is_not_zstd_and_an_unknown_encoding_are_refused(self) -> None:
        body = sdk_body([datum([1])])
        assert wire_error(body, content_encoding="zstd").startswith("the zstd body does not decompress")
        assert wire_error(body, content_encoding="gzip") == "unsupported Content-Encoding 'gzip': send zstd or none"

    def test_a_zstd_body_over_the_limit_is_too_large(self) -> None:
        bomb = zstandard.ZstdCompressor().compress(bytes(1_000_000))
        with pytest.raises(PayloadTooLarge):
            decode_forward_backward(bomb, content_encoding="zstd", max_decoded_bytes=100_000)

    def test_an_input_whose_length_is_not_the_model_inputs_is_refused(self) -> None:
        body = sdk_body([datum([1, 2]), datum([1, 2, 3], target_tokens=[2, 3])])
        assert wire_error(body) == (
            "datum 1: loss_fn_inputs['target_tokens'] has shape [2]: "
            "its first dimension must be the model input's length 3"
        )

    def test_float_target_tokens_are_refused(self) -> None:
        body = sdk_body([datum([1, 2], target_tokens=np.array([2.0, 3.0]))])
        assert wire_error(body) == "datum 0: loss_fn_inputs['target_tokens'] must be integers (int64), got float32"

    def test_a_datum_without_tokens_is_refused(self) -> None:
        msg = pb.ForwardBackwardRequest(model_id="m")
        msg.data.add()
        assert wire_error(msg.SerializeToString()) == "datum 0: model_input has no tokens"

    def test_values_that_do_not_fill_the_shape_are_refused_naming_the_field(self) -> None:
        short = pb.Tensor(dense=np.ones(2, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[3])
        assert wire_error(hand_built(short)) == "datum 0: loss_fn_inputs['weights']: 2 values do not fill shape [3]"
        ragged = pb.Tensor(dense=b"\x00" * 7, dtype=pb.DTYPE_FLOAT32, shape=[3])
        assert wire_error(hand_built(ragged)) == (
            "datum 0: loss_fn_inputs['weights']: 7 bytes is not a whole number of 4-byte values"
        )

    def test_token_bytes_that_are_not_int32s_are_refused(self) -> None:
        msg = pb.ForwardBackwardRequest(model_id="m")
        msg.data.add().model_input.add().encoded_text.tokens = b"\x01\x00\x00"
        assert wire_error(msg.SerializeToString()) == (
            "datum 0: model_input chunk 0: 3 bytes is not a whole number of 4-byte values"
        )

    def test_unspecified_dtype_and_missing_data_are_refused(self) -> None:
        assert wire_error(hand_built(pb.Tensor(dense=b"", shape=[3]))) == (
            "datum 0: loss_fn_inputs['weights']: unsupported dtype 0 (float32, bfloat16, int64 or int32)"
        )
        assert wire_error(hand_built(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[3]))) == (
            "datum 0: loss_fn_inputs['weights'] has no data (neither dense nor sparse_csr)"
        )

    def test_inconsistent_csr_indices_are_refused(self) -> None:
        def csr(crow: list[int], col: list[int]) -> pb.Tensor:
            return pb.Tensor(
                dtype=pb.DTYPE_INT64,
                shape=[3, 4],
                sparse_csr=pb.SparseCsr(
                    values=np.array([5, 6], "<i8").tobytes(),
                    crow_indices=np.array(crow, "<i8").tobytes(),
                    col_indices=np.array(col, "<i8").tobytes(),
                ),
            )

        field = "datum 0: loss_fn_inputs['target_tokens'].sparse_csr"
        assert wire_error(hand_built(csr([0, 1, 2], [0, 1]), name="target_tokens")) == (
            f"{field}.crow_indices must rise from 0 to the 2 values in 4 entries"
        )
        assert wire_error(hand_built(csr([0, 2, 1, 2], [0, 1]), name="target_tokens")).startswith(
            f"{field}.crow_indices"
        )
        assert wire_error(hand_built(csr([0, 1, 1, 2], [0, 4]), name="target_tokens")) == (
            f"{field}.col_indices must give one column in [0, 4) per value"
        )

    def test_a_sparse_tensor_too_large_to_densify_is_refused(self) -> None:
        huge = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[3, 10**9], sparse_csr=pb.SparseCsr(crow_indices=bytes(32)))
        with pytest.raises(PayloadTooLarge):
            decode_forward_backward(hand_built(huge), content_encoding=None)

    def test_int32_and_bfloat16_tensors_are_widened(self) -> None:
        ints = pb.Tensor(dense=np.array([4, 5, 6], "<i4").tobytes(), dtype=pb.DTYPE_INT32, shape=[3])
        targets = decode_forward_backward(hand_built(ints, name="target_tokens"), content_encoding=None)
        assert targets.data[0].inputs["target_tokens"].dtype == np.int64
        assert targets.data[0].inputs["target_tokens"].tolist() == [4, 5, 6]
        bf16 = (np.array([1.0, -2.5, 0.15625], "<f4").view("<u4") >> 16).astype("<u2")  # exact in bfloat16
        weights = decode_forward_backward(
            hand_built(pb.Tensor(dense=bf16.tobytes(), dtype=pb.DTYPE_BFLOAT16, shape=[3])), content_encoding=None
        ).data[0]
        assert weights.inputs["weights"].dtype == np.float32
        assert weights.inputs["weights"].tolist() == [1.0, -2.5, 0.15625]


class TestEncodeForwardBackwardOutput:
    def test_the_sdk_reads_each_datums_outputs_and_the_metrics(self) -> None:
        outputs = [
            {
                "logprobs": np.array([-0.5, -1.25, -3.0], np.float32),
                "elementwise_loss": np.array([0.5, 1.25, 3.0], np.float32),
            },
            {"logprobs": np.array([-0.125], np.float32), "elementwise_loss": np.array([0.0625], np.float32)},
        ]
        body = encode_forward_backward_output(
            ForwardResult(outputs=outputs, metrics={"loss:sum": 4.8125, "tokens:sum": 4.0})
        )
        got = response_conv.deserialize_forward_backward_output(body)
        assert got.loss_fn_output_type == "ArrayRecord"
        assert got.metrics == {"loss:sum": 4.8125, "tokens:sum": 4.0}
        assert len(got.loss_fn_outputs) == 2
        for sent, received in zip(outputs, got.loss_fn_outputs, strict=True):
            assert set(received) == {"logprobs", "elementwise_loss"}
            for name, array in sent.items():
                assert received[name].dtype == "float32" and received[name].shape == [array.size]
                np.testing.assert_array_equal(received[name].to_numpy(), array)

    def test_one_record_holds_every_datum_with_byte_offsets(self) -> None:
        outputs = [{"logprobs": np.zeros(n, np.float32)} for n in (3, 1, 2)]
        msg = pb.ForwardBackwardOutput.FromString(encode_forward_backward_output(ForwardResult(outputs, {})))
        assert len(msg.loss_fn_outputs) == 1 and msg.loss_fn_outputs[0].num_datums == 3
        logprobs = msg.loss_fn_outputs[0].fields["logprobs"]
        assert np.frombuffer(logprobs.offsets, "<i8").tolist() == [0, 12, 16, 24]
        assert logprobs.dtype == pb.DTYPE_FLOAT32 and list(logprobs.trailing_shape) == []

    def test_outputs_of_2d_targets_keep_their_trailing_shape_even_when_it_varies(self) -> None:
        outputs = [
            {"logprobs": np.arange(6, dtype=np.float32).reshape(3, 2)},
            {"logprobs": -np.arange(2, dtype=np.float32).reshape(1, 2)},
            {"logprobs": np.full((2, 3), -0.5, np.float32)},
        ]
        got = response_conv.deserialize_forward_backward_output(
            encode_forward_backward_output(ForwardResult(outputs=outputs, metrics={"loss:sum": 1.0}))
        )
        assert [o["logprobs"].shape for o in got.loss_fn_outputs] == [[3, 2], [1, 2], [2, 3]]
        for sent, received in zip(outputs, got.loss_fn_outputs, strict=True):
            np.testing.assert_array_equal(received["logprobs"].to_numpy(), sent["logprobs"])

    def test_no_datums_gives_no_outputs_and_the_metrics(self) -> None:
        got = response_conv.deserialize_forward_backward_output(
            encode_forward_backward_output(ForwardResult(outputs=[], metrics={"loss:sum": 0.0}))
        )
        assert got.loss_fn_outputs == [] and got.metrics == {"loss:sum": 0.0}

    @pytest.mark.parametrize("key", ["loss", "loss:total", "a:b:sum", ":sum"])
    def test_a_metric_name_the_sdk_cannot_split_is_a_bug_here(self, key: str) -> None:
        with pytest.raises(ValueError, match="is not 'name:reduction'"):
            encode_forward_backward_output(ForwardResult(outputs=[], metrics={key: 1.0}))

    def test_datums_with_different_fields_are_a_bug_here(self) -> None:
        outputs = [{"logprobs": np.zeros(1, np.float32)}, {"elementwise_loss": np.zeros(1, np.float32)}]
        with pytest.raises(ValueError, match="datum 1's outputs"):
            encode_forward_backward_output(ForwardResult(outputs=outputs, metrics={}))


class TestEncodeSampleResponse:
    def test_the_sdk_reads_sequences_stop_reasons_and_prompt_logprobs_with_none_first(self) -> None:
        result = SampleResult(
            sequences=[
                SampledSequence(tokens=[5, 2**31 - 1, 0], logprobs=[-0.5, -1.25, -0.0625], stop_reason="stop"),
                SampledSequence(tokens=[9], logprobs=[-3.0], stop_reason="length"),
            ],
            prompt_logprobs=[None, -1.25, -0.5],
        )
        got = response_conv.deserialize_sample_response(encode_sample_response(result))
        assert [s.stop_reason for s in got.sequences] == ["stop", "length"]
        assert [s.tokens for s in got.sequences] == [[5, 2**31 - 1, 0], [9]]
        assert [s.logprobs for s in got.sequences] == [[-0.5, -1.25, -0.0625], [-3.0]]
        assert got.prompt_logprobs == [None, -1.25, -0.5]

    def test_no_prompt_logprobs_asked_gives_none(self) -> None:
        result = SampleResult(sequences=[SampledSequence(tokens=[1], logprobs=[-1.0], stop_reason="stop")])
        assert response_conv.deserialize_sample_response(encode_sample_response(result)).prompt_logprobs is None

    def test_logprobs_not_one_per_token_are_a_bug_here(self) -> None:
        bad = SampleResult(sequences=[SampledSequence(tokens=[1, 2], logprobs=[-1.0], stop_reason="stop")])
        with pytest.raises(ValueError, match="sequence 0 has 2 tokens but 1 logprobs"):
            encode_sample_response(bad)


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


class TestLoadingTheSdkProtos:
    # A result the SDK decodes in that process: the message classes it uses are the ones the codec filled.
    ROUND_TRIP = (
        "from tinker.proto import response_conv, tinker_public_pb2; "
        "from trainer.spec.tinker_types import SampledSequence, SampleResult; "
        "assert tinker_public_pb2 is tinker_wire.pb; "
        "r = SampleResult([SampledSequence([3], [-0.5], 'length')]); "
        "s = response_conv.deserialize_sample_response(tinker_wire.encode_sample_response(r)).sequences[0]; "
        "assert (s.tokens, s.stop_reason) == ([3], 'length')"
    )

    def test_the_codec_imports_without_torch_or_the_sdk_package(self) -> None:
        out = run_python(
            "import sys; import api.tinker_wire; "
            "print(sorted(m for m in ('torch', 'tinker', 'tinker.types') if m in sys.modules))"
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "[]"

    def test_the_codec_then_the_sdk_share_one_module(self) -> None:
        out = run_python(f"from api import tinker_wire; import tinker; {self.ROUND_TRIP}")
        assert out.returncode == 0, out.stderr

    def test_the_sdk_then_the_codec_share_one_module(self) -> None:
        out = run_python(f"import tinker; from api import tinker_wire; {self.ROUND_TRIP}")
        assert out.returncode == 0, out.stderr

    def test_without_the_sdk_the_error_names_the_package(self) -> None:
        out = run_python("import sys; sys.modules['tinker'] = None; import api.tinker_wire")  # None: not installed
        assert out.returncode == 1
        assert out.stderr.strip().splitlines()[-1] == (
            "ModuleNotFoundError: the Tinker-compatible API needs the Tinker SDK's protobuf messages: "
            "install the `tinker` package (a dependency of the service)"
        )
