"""Length-prefixed pickle frames between a worker and the child that holds a Tinker session's model
(``worker.session_process``). Both ends are this project's code; nothing from a client is unpickled: a client's
bytes travel inside the frames as ``bytes``."""

from __future__ import annotations

import pickle
import struct
from typing import IO, Any

FRAME = struct.Struct(">Q")


def write_frame(out: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(FRAME.pack(len(data)) + data)
    out.flush()


def read_frame(inp: IO[bytes]) -> Any:
    head = inp.read(FRAME.size)
    if len(head) < FRAME.size:
        raise EOFError
    (n,) = FRAME.unpack(head)
    data = inp.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)
