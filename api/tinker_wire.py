"""The protobuf side of the Tinker-compatible training API, without torch.

The SDK sends ``forward``/``forward_backward`` as a ``tinker_public.ForwardBackwardRequest`` (optionally zstd) and
reads the results of those and of sampling back from ``retrieve_future`` as ``ForwardBackwardOutput`` and
``SampleResponse`` protobufs; every other call is JSON. The messages are the SDK's own generated module
(``tinker/proto/tinker_public_pb2.py``), loaded from its file so that ``tinker/__init__`` (which imports torch) never
runs in the API process. Numbers travel as little-endian byte strings: tokens int32, tensors in their ``DType``,
offsets int64. The SDK's side is ``tinker/proto/request_conv.py`` and ``response_conv.py``; the tests round-trip
through both.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import zstandard
from google.protobuf.message import DecodeError

from api.errors import InvalidRequest, PayloadTooLarge
from trainer.spec.tinker_types import Datum, ForwardResult, SampleResult

PROTOBUF_CONTENT_TYPE = "application/x-protobuf"
DEFAULT_MAX_DECODED_BYTES = 64 * 1024 * 1024
"""The most a request may take once decompressed or densified: the SDK sends at most ~5 MB per POST
(``fwdbwd_max_chunk_bytes_count``), so this only stops a zstd or sparse-tensor bomb."""

_PB_MODULE = "tinker.proto.tinker_public_pb2"
# The reductions the SDK folds chunked results with (tinker/lib/chunked_fwdbwd_helpers.py REDUCE_MAP).
METRIC_REDUCTIONS = frozenset({"mean", "sum", "min", "max", "slack", "hash2", "unique"})


def _load_sdk_protos() -> ModuleType:
    """The SDK's generated protobuf module, executed without its package (``tinker/__init__`` imports torch).

    It is registered under its real name, so a later ``import tinker`` in the same process reuses it rather than
    adding the same file to protobuf's descriptor pool a second time (and the two agree on the message classes);
    if the SDK was imported first, its module is the one returned.
    """
    loaded = sys.modules.get(_PB_MODULE)
    if loaded is not None:
        return loaded
    package = importlib.util.find_spec("tinker")  # finds the package without executing its __init__
    if package is None or not package.submodule_search_locations:
        raise ModuleNotFoundError(
            "the Tinker-compatible API needs the Tinker SDK's protobuf messages: install the `tinker` package "
            "(a dependency of the service)",
            name="tinker",
        )
    path = Path(next(iter(package.submodule_search_locations))) / "proto" / "tinker_public_pb2.py"
    spec = importlib.util.spec_from_file_location(_PB_MODULE, path)
    if spec is None or spec.loader is None or not path.is_file():
        raise ModuleNotFoundError(f"the `tinker` package has no {path.name} at {path}", name=_PB_MODULE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_PB_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_PB_MODULE]
        raise
    return module


if TYPE_CHECKING:  # the generated stubs type the messages; at run time the same module, loaded as above
    from tinker.proto import tinker_public_pb2 as pb
else:
    pb = _load_sdk_protos()


class WireError(InvalidRequest):
    """A forward/backward body that is not a well-formed request: a 400 naming the datum and field."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_tinker_request")


@dataclass(frozen=True)
class ForwardBackwardRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]  # loss_fn_config, then loss_fn_config_v2 over it (the SDK writes numbers to both)
    forward_only: bool
    data: list[Datum]


# -- the request ---------------------------------------------------------------------------------------------------


def decode_forward_backward(
    body: bytes, *, content_encoding: str | None, max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES
) -> ForwardBackwardRequest:
    """``POST /api/v1/forward_backward``'s body (``forward`` too: ``forward_only``), as the SDK's ``request_conv``
    writes it. Raises WireError for anything malformed, PayloadTooLarge past ``max_decoded_bytes``."""
    raw = decompress(body, content_encoding=content_encoding, limit=max_decoded_bytes)
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except DecodeError as err:
        raise WireError(f"the body is not a ForwardBackwardRequest protobuf: {err}") from None
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind is None:
            raise WireError(f"loss_fn_config_v2[{key!r}] has neither a number nor a text")
        config[key] = value.number if kind == "number" else value.text
    return ForwardBackwardRequest(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        loss_fn=msg.loss_fn,
        config=config,
        forward_only=msg.forward_only,
        data=[_datum(d, index=i, limit=max_decoded_bytes) for i, d in enumerate(msg.data)],
    )


def decompress(body: bytes, *, content_encoding: str | None, limit: int = DEFAULT_MAX_DECODED_BYTES) -> bytes:
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding != "zstd":
        raise WireError(f"unsupported Content-Encoding {content_encoding!r}: send zstd or none")
    try:
        # -1 when the frame does not say; the SDK's ZstdCompressor always writes it
        declared = zstandard.frame_content_size(body)
        if declared > limit:
            raise PayloadTooLarge(f"the body decompresses to {declared} bytes, over the limit of {limit}")
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=limit)
    except zstandard.ZstdError as err:
        raise WireError(f"the zstd body does not decompress (to at most {limit} bytes): {err}") from None


def _datum(msg: pb.Datum, *, index: int, limit: int) -> Datum:
    where = f"datum {index}"
    parts: list[npt.NDArray[np.int64]] = []
    for j, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind is None:
            raise WireError(f"{where}: model_input chunk {j} is empty")
        if kind != "encoded_text":
            raise WireError(f"{where}: {kind} chunks are not supported by this model")
        parts.append(_array(chunk.encoded_text.tokens, "<i4", f"{where}: model_input chunk {j}").astype(np.int64))
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if tokens.size == 0:
        raise WireError(f"{where}: model_input has no tokens")
    inputs: dict[str, npt.NDArray[np.generic]] = {}
    for name, tensor in msg.loss_fn_inputs.items():
        field = f"{where}: loss_fn_inputs[{name!r}]"
        array = _tensor(tensor, field=field, length=tokens.size, limit=limit)
        if name == "target_tokens":
            if array.dtype != np.int64:
                raise WireError(f"{field} must be integers (int64), got float32")
            inputs[name] = array
        else:
            inputs[name] = array.astype(np.float32, copy=False)
    return Datum(tokens=tokens, inputs=inputs)


# DType → (the wire's element type, what the datum holds): the SDK's widening (response_conv.py), int → int64 and
# bfloat16 (the top half of a float32) → float32.
_DTYPES: dict[int, tuple[str, type[np.generic]]] = {
    pb.DTYPE_FLOAT32: ("<f4", np.float32),
    pb.DTYPE_BFLOAT16: ("<u2", np.float32),
    pb.DTYPE_INT64: ("<i8", np.int64),
    pb.DTYPE_INT32: ("<i4", np.int64),
}


def _tensor(msg: pb.Tensor, *, field: str, length: int, limit: int) -> npt.NDArray[np.generic]:
    """A ``Tensor`` as a dense array whose first dimension is the datum's input length; a sparse CSR one (a 2-D
    ``target_tokens`` or ``weights`` from torch) gets 0 in every entry it does not list, as the SDK's
    ``TensorData.to_numpy()`` does."""
    if msg.dtype not in _DTYPES:
        raise WireError(f"{field}: unsupported dtype {msg.dtype} (float32, bfloat16, int64 or int32)")
    wire, held = _DTYPES[msg.dtype]
    shape = [int(s) for s in msg.shape]
    encoding = msg.WhichOneof("encoding")
    if encoding is None:
        raise WireError(f"{field} has no data (neither dense nor sparse_csr)")
    if not shape and encoding == "dense":  # a TensorData built without a shape is 1-D
        shape = [len(msg.dense) // np.dtype(wire).itemsize]
    if any(s < 0 for s in shape):
        raise WireError(f"{field}: negative dimension in shape {shape}")
    if shape[:1] != [length]:
        raise WireError(f"{field} has shape {shape}: its first dimension must be the model input's length {length}")
    if math.prod(shape) * np.dtype(held).itemsize > limit:
        raise PayloadTooLarge(f"{field} of shape {shape} is over the limit of {limit} bytes")
    if encoding == "dense":
        array = _array(msg.dense, wire, field)
        if array.size != math.prod(shape):
            raise WireError(f"{field}: {array.size} values do not fill shape {shape}")
        array = array.reshape(shape)
    else:
        array = _densify(msg.sparse_csr, wire, shape=shape, field=field)
    if wire == "<u2":  # bfloat16 → float32: the same bits in the upper half
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(held)


def _densify(csr: pb.SparseCsr, wire: str, *, shape: list[int], field: str) -> npt.NDArray[np.generic]:
    if len(shape) != 2:
        raise WireError(f"{field}: a sparse_csr tensor must be 2-D, got shape {shape}")
    rows, cols = shape
    values = _array(csr.values, wire, f"{field}.sparse_csr.values")
    crow = _array(csr.crow_indices, "<i8", f"{field}.sparse_csr.crow_indices")
    col = _array(csr.col_indices, "<i8", f"{field}.sparse_csr.col_indices")
    if crow.size != rows + 1 or crow[0] != 0 or np.any(np.diff(crow) < 0) or crow[-1] != values.size:
        raise WireError(
            f"{field}.sparse_csr.crow_indices must rise from 0 to the {values.size} values in {rows + 1} entries"
        )
    if col.size != values.size or np.any((col < 0) | (col >= cols)):
        raise WireError(f"{field}.sparse_csr.col_indices must give one column in [0, {cols}) per value")
    dense = np.zeros(shape, dtype=values.dtype)
    dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return dense


def _array(data: bytes, dtype: str, field: str) -> npt.NDArray[Any]:
    itemsize = np.dtype(dtype).itemsize
    if len(data) % itemsize:
        raise WireError(f"{field}: {len(data)} bytes is not a whole number of {itemsize}-byte values")
    return np.frombuffer(data, dtype=dtype)


# -- the results ---------------------------------------------------------------------------------------------------


def encode_forward_backward_output(result: ForwardResult) -> bytes:
    """A ``ForwardBackwardOutput`` as ``response_conv.deserialize_forward_backward_output`` reads it.

    Each output field is a ``BatchedTensor``: the datums' float32 values back to back, ``offsets`` the int64 byte
    offsets of each datum's start and of the end, and ``trailing_shape`` every dimension after the first (the SDK
    infers the first from the byte count). A trailing shape is one per ``ArrayRecord``, so datums are grouped into
    one record per run of equal trailing shapes (one record in the usual case of 1-D outputs). The SDK lines the
    datums up by index across every field, so each datum has the same fields.
    """
    _check_metric_names(result.metrics)
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=result.metrics)
    if not result.outputs:
        return msg.SerializeToString()
    names = sorted(result.outputs[0])
    arrays = [_output_arrays(out, names=names, index=i) for i, out in enumerate(result.outputs)]
    start = 0
    for end in range(1, len(arrays) + 1):
        if end < len(arrays) and _trailing(arrays[end]) == _trailing(arrays[start]):
            continue
        record = msg.loss_fn_outputs.add(num_datums=end - start)  # type_tag: the SDK does not read it
        for name in names:
            group = [a[name] for a in arrays[start:end]]
            sizes = [a.nbytes for a in group]
            record.fields[name].CopyFrom(
                pb.BatchedTensor(
                    data=b"".join(a.tobytes() for a in group),
                    offsets=np.cumsum([0, *sizes], dtype="<i8").tobytes(),
                    dtype=pb.DTYPE_FLOAT32,
                    trailing_shape=group[0].shape[1:],
                )
            )
        start = end
    return msg.SerializeToString()


def _output_arrays(
    out: dict[str, npt.NDArray[np.float32]], *, names: list[str], index: int
) -> dict[str, npt.NDArray[np.float32]]:
    if sorted(out) != names:
        raise ValueError(f"datum {index}'s outputs {sorted(out)} differ from datum 0's {names}")
    arrays = {name: np.ascontiguousarray(out[name], dtype="<f4") for name in names}
    for name, array in arrays.items():
        if array.ndim == 0:
            raise ValueError(f"datum {index}'s output {name!r} is a scalar; outputs are per position")
    return arrays


def _trailing(arrays: dict[str, npt.NDArray[np.float32]]) -> dict[str, tuple[int, ...]]:
    return {name: a.shape[1:] for name, a in arrays.items()}


def _check_metric_names(metrics: dict[str, float]) -> None:
    """The SDK splits every key as ``name, reduction = key.split(":")``: anything else fails the user's result."""
    for key in metrics:
        name, _, reduction = key.partition(":")
        if not name or ":" in reduction or reduction not in METRIC_REDUCTIONS:
            raise ValueError(f"metric {key!r} is not 'name:reduction' with one of {sorted(METRIC_REDUCTIONS)}")


_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


def encode_sample_response(result: SampleResult) -> bytes:
    """A ``SampleResponse`` as ``response_conv.deserialize_sample_response`` reads it: per sequence its stop reason,
    tokens (int32) and their log-probs (float32); the prompt's log-probs float32 with NaN where there is none
    (position 0), which the SDK turns back into None. The sequence ids travel on the future, not here."""
    msg = pb.SampleResponse()
    for i, seq in enumerate(result.sequences):
        if len(seq.logprobs) != len(seq.tokens):
            raise ValueError(f"sequence {i} has {len(seq.tokens)} tokens but {len(seq.logprobs)} logprobs")
        msg.sequences.add(
            stop_reason=_STOP_REASONS[seq.stop_reason],
            tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype="<f4").tobytes(),
        )
    if result.prompt_logprobs is not None:
        values = [math.nan if lp is None else lp for lp in result.prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    return msg.SerializeToString()
