"""The latentmesh worker protocol (docs/engine-protocol.md), engine side.

Frames are a 4-byte big-endian length and a msgpack map. The agent attaches
its arena's memfd (SCM_RIGHTS) to the welcome frame, once.
"""
from __future__ import annotations

import array
import socket
import struct
from typing import Any, Dict, List, Optional, Tuple

import msgpack

PROTOCOL_VERSION = 1
MAX_FRAME = 1 << 20  # as the agent's extengine.MaxFrame

TYPE_REGISTER = "register"
TYPE_WELCOME = "welcome"
TYPE_REFUSED = "refused"
TYPE_HEARTBEAT = "heartbeat"
TYPE_TASK = "task"
TYPE_CANCEL = "cancel"
TYPE_PROGRESS = "progress"
TYPE_PREVIEW = "preview"
TYPE_DONE = "done"
TYPE_FAILED = "failed"

CODE_CANCELLED = "cancelled"
CODE_BAD_INPUT = "bad_input"
CODE_INTERNAL = "engine_error"


class ProtocolError(Exception):
    """The agent sent something this SDK cannot use, or refused us."""


def encode_frame(msg: Dict[str, Any]) -> bytes:
    msg = dict(msg)
    msg["v"] = PROTOCOL_VERSION
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return struct.pack(">I", len(body)) + body


class FrameReader:
    """Reads frames from a stream socket, collecting any passed fds."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.fds: List[int] = []

    def _fill(self) -> None:
        fds = array.array("i")
        data, anc, _flags, _addr = self.sock.recvmsg(1 << 16, socket.CMSG_SPACE(4 * fds.itemsize))
        for level, typ, payload in anc:
            if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
        self.fds.extend(fds)
        if not data:
            raise ConnectionError("agent closed the engine socket")
        self.buf += data

    def read(self) -> Dict[str, Any]:
        while len(self.buf) < 4:
            self._fill()
        (n,) = struct.unpack(">I", self.buf[:4])
        if n > MAX_FRAME:
            raise ProtocolError(f"agent frame of {n} bytes exceeds {MAX_FRAME}")
        while len(self.buf) < 4 + n:
            self._fill()
        body = bytes(self.buf[4 : 4 + n])
        del self.buf[: 4 + n]
        msg = msgpack.unpackb(body, raw=False, max_bin_len=MAX_FRAME, max_str_len=MAX_FRAME,
                              max_array_len=1 << 12, max_map_len=1 << 12)
        if not isinstance(msg, dict) or msg.get("v") != PROTOCOL_VERSION:
            raise ProtocolError(f"agent speaks protocol {msg.get('v') if isinstance(msg, dict) else '?'}, this SDK {PROTOCOL_VERSION}")
        return msg


def region_of(msg: Dict[str, Any]) -> Tuple[int, int, str, Tuple[int, ...]]:
    return int(msg["off"]), int(msg["len"]), str(msg["dtype"]), tuple(int(d) for d in msg["shape"])


def take_fd(reader: FrameReader) -> Optional[int]:
    return reader.fds.pop(0) if reader.fds else None
