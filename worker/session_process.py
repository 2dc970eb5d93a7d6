"""The process that holds one Tinker session's model (``python -m worker.session_process``), started by the worker
that leased the session (``worker.sessions``) and killed with it (the kernel's parent-death signal).

It reads requests from stdin and writes answers to stdout, each a frame of ``worker.frames``. The first request
loads the model; then each runs one operation of ``trainer.serving.tinker_session.TrainingSession``. The worker does
every database and artifact-store write; this process reads and writes only the local folders it is given.
"""

from __future__ import annotations

import json
import os
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from api.tinker_wire import WireError, decode_forward_backward, encode_forward_backward_output, encode_sample_response
from trainer.generation.models import ModelError, default_device, resolve_precision
from trainer.serving.tinker_session import SessionInputError, TrainingSession, batch_key
from trainer.spec.config import SpecError
from trainer.spec.tinker_types import AdamParams, LoraChoice, SampleParams
from worker.frames import read_frame, write_frame
from worker.runner import die_with_parent

SNAPSHOTS_KEPT = 8  # sampler weights kept in memory (LoRA tensors: small), least recently used out first
USER_ERRORS = (SessionInputError, WireError, SpecError, ModelError)
"""What a request's own content caused: its client gets the message, category ``user``."""


class Server:
    """The operations, on one loaded session."""

    def __init__(self, load: dict[str, Any]) -> None:
        device = default_device()
        precision = resolve_precision(load.get("precision", "auto"), device)
        lora = LoraChoice(**{k: v for k, v in load["lora"].items() if k in LoraChoice.__dataclass_fields__})
        torch.set_num_threads(max(1, int(load.get("threads") or torch.get_num_threads())))
        self.session = TrainingSession(load["model_path"], lora, device=device, precision=precision)
        if load.get("state_dir"):
            self.session.load_state(Path(load["state_dir"]), optimizer=bool(load.get("optimizer", True)))
        self.snapshots: OrderedDict[str, Any] = OrderedDict()

    def handle(self, op: str, msg: dict[str, Any]) -> dict[str, Any]:
        return getattr(self, f"op_{op}")(msg)

    def op_forward_backward(self, msg: dict[str, Any]) -> dict[str, Any]:
        request = decode_forward_backward(msg["payload"], content_encoding=None)
        result = self.session.forward_backward(
            request.data, request.loss_fn, request.config, backward=not request.forward_only
        )
        loss = result.metrics.get("loss:sum")
        return {"result": encode_forward_backward_output(result), "format": "proto", "loss": loss}

    op_forward = op_forward_backward

    def op_optim_step(self, msg: dict[str, Any]) -> dict[str, Any]:
        adam = AdamParams(**json.loads(msg["payload"])["adam_params"])
        metrics = self.session.optim_step(adam)
        return {"result": json.dumps({"metrics": metrics}).encode(), "format": "json"}

    def op_save_state(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.session.save_state(Path(msg["dir"]), gradients=bool(msg.get("gradients")))
        return {}

    def op_save_adapter(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.session.save_adapter(Path(msg["dir"]))
        if msg.get("snapshot_key"):
            self._keep(msg["snapshot_key"], self.session.snapshot())
        return {}

    def op_load_state(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.session.load_state(Path(msg["dir"]), optimizer=bool(msg["optimizer"]))
        return {}

    def op_sample_many(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Sample requests on one set of weights (``weights``: "base", or ``snapshot_key`` and its folder ``dir``):
        each checked alone (a bad one is answered alone, category user), those whose settings agree
        (``trainer.serving.tinker_session.batch_key``) sampled in one generation. Answers in the requests' order."""
        weights: Any = msg.get("weights", "current")
        if msg.get("snapshot_key"):
            weights = self._snapshot(msg["snapshot_key"], Path(msg["dir"]))
        answers: list[dict[str, Any] | None] = [None] * len(msg["payloads"])
        groups: dict[Any, list[tuple[int, list[int], SampleParams]]] = {}
        for i, payload in enumerate(msg["payloads"]):
            body = json.loads(payload)
            try:
                params = sample_params(body)
                prompt = [int(t) for chunk in body["prompt"]["chunks"] for t in chunk["tokens"]]
                self.session.check_sample(prompt, params)
            except USER_ERRORS as err:
                answers[i] = {"ok": False, "category": "user", "error": str(err)}
                continue
            key = batch_key(params)
            groups.setdefault(("alone", i) if key is None else key, []).append((i, prompt, params))
        for members in groups.values():
            results = self.session.sample_many([(prompt, params) for _, prompt, params in members], weights=weights)
            for (i, _, _), result in zip(members, results, strict=True):
                answers[i] = {"ok": True, "result": encode_sample_response(result), "format": "proto"}
        return {"answers": answers}

    def _keep(self, key: str, snapshot: Any) -> None:
        self.snapshots[key] = snapshot
        self.snapshots.move_to_end(key)
        while len(self.snapshots) > SNAPSHOTS_KEPT:
            self.snapshots.popitem(last=False)

    def _snapshot(self, key: str, folder: Path) -> Any:
        if key not in self.snapshots:
            self._keep(key, self.session.read_adapter_snapshot(folder))
        self.snapshots.move_to_end(key)
        return self.snapshots[key]


def sample_params(body: dict[str, Any]) -> SampleParams:
    sp = body["sampling_params"]
    stop = sp.get("stop")
    return SampleParams(
        max_tokens=sp.get("max_tokens") or 16,
        temperature=float(sp.get("temperature", 1.0)),
        top_p=float(sp.get("top_p", 1.0)),
        top_k=int(sp.get("top_k", -1)),
        seed=sp.get("seed"),
        stop=[stop] if isinstance(stop, str) else stop,
        num_samples=int(body.get("num_samples", 1)),
        prompt_logprobs=bool(body.get("prompt_logprobs", False)),
    )


def main() -> int:
    die_with_parent()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # print() and library chatter go to stderr, never into the frames
    sys.stdout = sys.stderr
    inp = sys.stdin.buffer
    server: Server | None = None
    while True:
        try:
            msg = read_frame(inp)
        except EOFError:
            return 0
        op = msg["op"]
        try:
            if op == "load":
                server = Server(msg)
                write_frame(out, {"ok": True, "gradients": server.session.has_gradients()})
                continue
            assert server is not None, "load first"
            write_frame(out, {"ok": True, **server.handle(op, msg)})
        except USER_ERRORS as err:
            write_frame(out, {"ok": False, "category": "user", "error": str(err)})
        except Exception as err:
            write_frame(out, {"ok": False, "category": "server", "error": f"{type(err).__name__}: {err}"})


if __name__ == "__main__":
    sys.exit(main())
