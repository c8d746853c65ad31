"""The latentmesh worker protocol (docs/engine-protocol.md), engine side.

Frames are a 4-byte big-endian length and a msgpack map. The agent attaches
its arena's memfd (SCM_RIGHTS) to the welcome frame, once.

Versions: register, welcome and refused are always version 1 frames; the
engine offers the versions it speaks in register, the agent names the one
chosen (and the features granted) in welcome, and every later frame of the
connection carries that version.
"""
from __future__ import annotations

import array
import re
import socket
import struct
from typing import Any, Dict, List, Optional, Tuple

import msgpack

VERSION_1 = 1
VERSION_2 = 2  # step checkpoints, the tensor cache and the model shapes, each a feature
PROTOCOL_VERSION = VERSION_2  # the newest this SDK speaks
VERSIONS = (VERSION_1, VERSION_2)
MAX_FRAME = 1 << 20  # as the agent's extengine.MaxFrame

# Features of version 2 an engine asks for in register; welcome grants a subset.
FEATURE_CHECKPOINT = "checkpoint"
FEATURE_TENSOR_CACHE = "tensor_cache"
# The model shapes (issue 20): named conditioning tensors, a latent that
# compresses time, a reference image, a parameter schema.
FEATURE_NAMED_COND = "named_cond"
FEATURE_TEMPORAL = "temporal_latent"
FEATURE_IMAGE = "image_input"
FEATURE_PARAMS = "model_params"
# The lifecycle (issue 20): a decode's state across a job's chunks, a
# denoise's chunks final before it ends, models and adapters at run time.
FEATURE_DECODE_STATE = "decode_state"
FEATURE_CHUNK_READY = "chunk_ready"
FEATURE_MODEL_LIFECYCLE = "model_lifecycle"
FEATURE_ADAPTERS = "adapters"
# Batching (issue 20): up to Model.batch[stage] tasks in one engine call.
FEATURE_BATCH = "batch"
MAX_BATCH = 64  # as the agent's extengine.MaxBatch

# Bounds the agent enforces (extengine), checked here before sending.
MAX_STATE = 768 << 10  # a checkpoint's sampler state, inline
MAX_KEY = 128  # a tensor cache key
MAX_TENSOR = 64 << 20  # a cached tensor
MAX_INLINE_TENSOR = 768 << 10  # a tensor put inline
_KEY = re.compile(r"^[A-Za-z0-9._:/=+-]{1,%d}$" % MAX_KEY)
MAX_CONDS = 8  # named conditioning tensors of a model
COND_ALIGN = 64  # each named tensor starts at a multiple of it in the payload
MAX_PARAMS = 16
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")  # a named tensor's or a parameter's name

MAX_ADAPTERS = 16  # adapters of one model loaded at once
MAX_ADAPTER_LEN = 32
_ADAPTER = re.compile(r"^[A-Za-z0-9._-]{1,%d}$" % MAX_ADAPTER_LEN)
STREAM_IDLE_S = 600.0  # a decode stream no chunk of which came for this long may be dropped
MAX_MODELS = 6

DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1}

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
# Version 2, FEATURE_CHECKPOINT.
TYPE_STOP = "stop"  # agent -> engine: checkpoint at the next step boundary and end the task
TYPE_CHECKPOINT = "checkpoint"  # engine -> agent: state after step, latent in checkpoint_buf
TYPE_CHECKPOINTED = "checkpointed"  # agent -> engine: checkpoint_buf is the engine's again
# Version 2, FEATURE_TENSOR_CACHE.
TYPE_TENSOR_GET = "tensor_get"
TYPE_TENSOR = "tensor"
TYPE_TENSOR_PUT = "tensor_put"
# Version 2, the lifecycle features.
TYPE_CHUNK_READY = "chunk_ready"  # engine -> agent: a denoise's latent chunk is final
TYPE_STREAM_END = "stream_end"  # agent -> engine: drop a decode stream's state
TYPE_ADD_MODEL = "add_model"  # engine -> agent: serve one more model
TYPE_REMOVE_MODEL = "remove_model"
TYPE_ADAPTER_LOADED = "adapter_loaded"
TYPE_ADAPTER_UNLOADED = "adapter_unloaded"
TYPE_ACK = "ack"  # agent -> engine: a lifecycle frame taken, or refused with a reason

CODE_CANCELLED = "cancelled"
CODE_BAD_INPUT = "bad_input"
CODE_INTERNAL = "engine_error"
CODE_STOPPED = "stopped"  # version 2: ended after a stop, its last step checkpointed
CODE_BAD_CHECKPOINT = "bad_checkpoint"  # version 2: the resume cannot be continued from
CODE_LOST_STATE = "lost_state"  # version 2: a decode chunk of a stream whose state is gone
CODE_NO_ADAPTER = "no_adapter"  # version 2: a denoise names an adapter not loaded


class ProtocolError(Exception):
    """The agent sent something this SDK cannot use, or refused us."""


def valid_key(key: str) -> bool:
    """Whether key can name a cached tensor: 1-128 bytes of [A-Za-z0-9._:/=+-]."""
    return bool(_KEY.match(key))


def valid_adapter(name: str) -> bool:
    """Whether name can name an adapter: 1-32 bytes of [A-Za-z0-9._-]."""
    return bool(_ADAPTER.match(name))


def valid_name(name: str) -> bool:
    """Whether name can name a conditioning tensor or a parameter."""
    return bool(_NAME.match(name))


def cond_layout(conds: List[Tuple[str, str, List[int], bool]]) -> Tuple[List[int], List[int], int]:
    """The conditioning payload of named tensors (name, dtype, shape,
    var_len), as the agent lays it out (extengine.CondLayout): each tensor
    at a multiple of COND_ALIGN at its maximum size, in order; after the
    last, aligned up, a little-endian uint32 per var_len tensor (its
    length). Returns each tensor's offset and byte size, and the total."""
    offs, sizes, at, nvar = [], [], 0, 0
    for _name, dtype, shape, var_len in conds:
        n = DTYPE_SIZES[dtype]
        for d in shape:
            n *= int(d)
        at = -(-at // COND_ALIGN) * COND_ALIGN
        offs.append(at)
        sizes.append(n)
        at += n
        nvar += 1 if var_len else 0
    total = at
    if nvar:
        total = -(-at // COND_ALIGN) * COND_ALIGN + 4 * nvar
    return offs, sizes, total


def encode_frame(msg: Dict[str, Any], version: int = VERSION_1) -> bytes:
    msg = dict(msg)
    msg["v"] = version
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return struct.pack(">I", len(body)) + body


class FrameReader:
    """Reads frames from a stream socket, collecting any passed fds.

    ``version`` is the version every frame must carry: 1 until the welcome,
    then the session's (the worker sets it)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.fds: List[int] = []
        self.version = VERSION_1

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
        if not isinstance(msg, dict) or msg.get("v") != self.version:
            got = msg.get("v") if isinstance(msg, dict) else "?"
            raise ProtocolError(f"agent frame of protocol version {got} in a version {self.version} session")
        return msg


def region_of(msg: Dict[str, Any]) -> Tuple[int, int, str, Tuple[int, ...]]:
    return int(msg["off"]), int(msg["len"]), str(msg["dtype"]), tuple(int(d) for d in msg["shape"])


def take_fd(reader: FrameReader) -> Optional[int]:
    return reader.fds.pop(0) if reader.fds else None
