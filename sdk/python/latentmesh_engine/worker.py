"""The worker event loop: connect, register, serve tasks with three callbacks.

Protocol version 2 (negotiated at registration; an agent of version 1 grants
nothing and the worker behaves as before) adds, for a model that declares
them, step checkpoints (``Task.checkpoint``, ``Task.resume``,
``Task.should_stop``, ``Task.stop``), the agent's tensor cache
(``Task.tensor_get``, ``Task.tensor_put``) and the model shapes: named
conditioning tensors (``Model.conds``, ``Task.conds``, ``Task.set_len``), a
latent that compresses time (``LatentLayout.temporal``,
``Task.video_first``), a reference image (``Model.image``, ``Task.image``)
and a parameter schema (``Model.params``, ``Task.params``); and the
lifecycle: a decode's state kept across a job's chunks (``Model.decode_state``,
``Task.stream``, ``Task.state``), a denoise's chunks final before it ends
(``Model.chunk_ready``, ``Task.chunk_ready``), models added and removed and
adapters loaded and unloaded while serving (``Worker.add_model``,
``Worker.remove_model``, ``Worker.load_adapter``, ``Worker.unload_adapter``,
``Task.adapter``); and batching: up to ``Model.batch[stage]`` tasks in one
call of a batch callback (``Worker.denoise_batch`` and its kin, ``Batch``).
``Worker.run_forever`` reconnects after the agent restarts.
"""
from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import queue
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterator, List, NoReturn, Optional, Sequence, Set, Tuple, Union

import numpy as np

from . import protocol as p

log = logging.getLogger("latentmesh_engine")

_DTYPES = {"float32": np.float32, "float16": np.float16, "uint8": np.uint8}

Region = Tuple[int, int, str, Tuple[int, ...]]


class Cancelled(Exception):
    """Raised at a step boundary of a task the agent cancelled (or whose
    connection closed)."""


class BadInput(Exception):
    """Raise from a callback to fail a task for unusable inputs (NaN latents,
    a spec the model cannot take): the agent fails the job with the reason."""


class Stopped(Exception):
    """Raised by ``Task.stop``: the task ends at its checkpoint, as the
    agent's ``stop`` asked (a preemption or a drain); it runs again
    elsewhere from that checkpoint."""


class LostState(Exception):
    """A decode chunk of a stream whose state this worker no longer holds
    (it never saw the stream's chunk 0, or dropped it after
    ``protocol.STREAM_IDLE_S``): the agent decodes the job again from its
    first chunk. The SDK raises it; a callback may too."""


class NoAdapter(Exception):
    """Raise from a denoise callback when ``task.adapter`` is not loaded
    (unloaded while the task was on its way): the task runs elsewhere."""


class LifecycleRefused(Exception):
    """The agent did not take a lifecycle call (``add_model``,
    ``load_adapter``, ...); the message is its reason. Nothing changed."""


@dataclasses.dataclass
class DecodeStream:
    """A decode task's place in its stream (protocol v2, decode_state): the
    chunks of one job's decode stage, sent one at a time in order. ``id``
    is unique on the connection; ``chunk`` 0 opens the stream and the chunk
    with ``last`` closes it."""

    id: int
    job: str
    chunk: int
    last: bool


class BadCheckpoint(Exception):
    """Raise from a denoise callback when ``task.resume`` cannot be continued
    from (another sampler's state, another schedule or spec): the agent then
    starts the denoise over from noise."""


@dataclasses.dataclass
class Layout:
    dtype: str
    shape: List[int]


@dataclasses.dataclass
class LatentLayout:
    dtype: str
    channels: int
    scale: int  # pixels per latent position along a side
    # Protocol v2 (temporal_latent): 0 or 1, one latent frame per video
    # frame; t > 1, videos of t*k+1 frames make k+1 latent frames (Wan: 4,
    # 81 frames -> 21): the first alone, then each group of t. The model's
    # frame_step must be t and frame_offset 1.
    temporal: int = 0


@dataclasses.dataclass
class CondTensor:
    """One named conditioning tensor of a model (protocol v2, named_cond):
    encode's output, denoise's input. With ``var_len`` dimension 0 is a
    sequence length that varies per request, up to ``shape[0]``: the encode
    says the length it wrote (``Task.set_len``) and the denoise gets the
    tensor at that length."""

    name: str
    dtype: str
    shape: List[int]
    var_len: bool = False

    def wire(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": [int(x) for x in self.shape]}
        if self.var_len:
            d["var_len"] = True
        return d


@dataclasses.dataclass
class ImageSpec:
    """How a model takes a request's reference image (protocol v2,
    image_input): at which stages (encode and/or denoise), and whether a
    request must carry one. The image arrives as RGBA uint8 ``[height,
    width, 4]`` at its own size (resize it as the model needs)."""

    stages: List[str]
    required: bool = False

    def wire(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"stages": list(self.stages)}
        if self.required:
            d["required"] = True
        return d


ParamValue = Union[float, int, bool, str]


@dataclasses.dataclass
class Param:
    """One model parameter (protocol v2, model_params): ``type`` number,
    integer (both with ``min`` and ``max``), bool, or enum (one of
    ``values``), and the ``default`` a request that leaves it out gets.
    The agent checks requests against it at submission; ``Task.params``
    holds every parameter."""

    name: str
    type: str
    default: ParamValue
    min: float = 0.0
    max: float = 0.0
    values: Optional[List[str]] = None

    @staticmethod
    def number(name: str, lo: float, hi: float, default: float) -> "Param":
        return Param(name, "number", float(default), float(lo), float(hi))

    @staticmethod
    def integer(name: str, lo: int, hi: int, default: int) -> "Param":
        return Param(name, "integer", int(default), float(lo), float(hi))

    @staticmethod
    def boolean(name: str, default: bool) -> "Param":
        return Param(name, "bool", bool(default))

    @staticmethod
    def enum(name: str, values: Sequence[str], default: str) -> "Param":
        return Param(name, "enum", str(default), values=list(values))

    def wire(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"name": self.name, "type": self.type, "default": self.default}
        if self.type in ("number", "integer"):
            d["min"], d["max"] = float(self.min), float(self.max)
        if self.values:
            d["values"] = list(self.values)
        return d


@dataclasses.dataclass
class CheckpointSpec:
    """What a model's denoise checkpoints are (protocol version 2).

    ``sampler`` names the state's format and schedule: a checkpoint resumes
    only on a model registering the same name, so change it with anything
    that changes the output. The checkpoint's latent is ``[frames, channels,
    height/scale, width/scale]`` of ``dtype`` (the scale the latent's); a
    sampler keeping several latents stacks them as channels. ``every`` is
    the model's default period in steps (0: the agent's setting decides)."""

    sampler: str
    dtype: str
    channels: int
    every: int = 0

    def wire(self) -> Dict[str, Any]:
        return {"sampler": self.sampler, "dtype": self.dtype, "channels": self.channels, "every": self.every}


@dataclasses.dataclass
class Model:
    """A model and the stages this worker serves of it.

    ``cond`` is encode's output (denoise's input); a model with named
    conditioning tensors (``conds``) leaves it out: it is then the one
    payload the agent moves them in, ``uint8 [n]``."""

    name: str
    stages: List[str]
    cond: Optional[Layout] = None
    latent: Optional[LatentLayout] = None
    default_steps: int = 0
    max_side: int = 0
    max_frames: int = 0
    max_steps: int = 0
    # Limits beyond the sides, frames and steps (0: the agent's default or
    # no such rule); see docs/engine-protocol.md, register.
    min_side: int = 0
    max_frame_pixels: int = 0  # width*height, e.g. 1280*720
    max_pixels: int = 0  # width*height*frames (0: max_frame_pixels or max_side**2, times max_frames)
    side_multiple: int = 0  # sides are multiples of it (0: the latent scale)
    frame_step: int = 0  # frames = frame_step*k + frame_offset (Wan: 4k+1); 0: any count
    frame_offset: int = 0
    # Protocol version 2: the denoise checkpoints and resumes; it uses the
    # agent's tensor cache. Each is dropped when the agent does not grant it.
    checkpoint: Optional[CheckpointSpec] = None
    tensor_cache: bool = False
    # Protocol version 2, the model shapes; each is dropped when the agent
    # does not grant its feature (see Worker for what the SDK then does).
    conds: Optional[List[CondTensor]] = None
    image: Optional[ImageSpec] = None
    params: Optional[List[Param]] = None
    # Protocol version 2, the lifecycle: the decode keeps state from one
    # chunk of a job to the next (a causal VAE: ``Task.state``); the denoise
    # reports chunks final early (``Task.chunk_ready``); the denoise takes
    # adapters (``Worker.load_adapter``). Each asks for its feature.
    decode_state: bool = False
    chunk_ready: bool = False
    adapters: bool = False
    # Protocol version 2, batching: the most tasks of a stage one call of
    # its batch callback takes, e.g. {"denoise": 4} (1 or absent: one at a
    # time). The agent sends a batch only of tasks of one model, size,
    # frame count, step count and adapter.
    batch: Optional[Dict[str, int]] = None

    def __post_init__(self) -> None:
        if self.latent is None:
            raise ValueError(f"model {self.name}: no latent layout")
        if self.conds:
            if len(self.conds) > p.MAX_CONDS or len({c.name for c in self.conds}) != len(self.conds) or \
                    not all(p.valid_name(c.name) for c in self.conds):
                raise ValueError(f"model {self.name}: want 1-{p.MAX_CONDS} named tensors of distinct [a-z0-9_] names")
            payload = Layout("uint8", [self.cond_layout()[2]])
            if self.cond is not None and (self.cond.dtype, list(self.cond.shape)) != (payload.dtype, payload.shape):
                raise ValueError(f"model {self.name}: cond must be {payload} with named tensors (or left out)")
            self.cond = payload
        if self.cond is None:
            raise ValueError(f"model {self.name}: no cond layout and no named tensors")
        t = self.latent.temporal
        if t > 1 and (self.frame_step, self.frame_offset) != (t, 1):
            raise ValueError(f"model {self.name}: latent temporal {t} needs frame_step {t} and frame_offset 1")
        for st, n in (self.batch or {}).items():
            if st not in self.stages or not 1 <= int(n) <= p.MAX_BATCH:
                raise ValueError(f"model {self.name}: batch of {n} {st} tasks: want a stage it serves and 1-{p.MAX_BATCH}")

    def cond_layout(self) -> Tuple[List[int], List[int], int]:
        """Each named tensor's offset and size in the payload, and its size."""
        return p.cond_layout([(c.name, c.dtype, list(c.shape), c.var_len) for c in self.conds or []])

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a video of frames frames (81 -> 21 at temporal 4)."""
        t = self.latent.temporal if self.latent else 0
        return frames if t <= 1 or frames <= 1 else (frames - 1) // t + 1

    def video_frames(self, first: int, k: int) -> Tuple[int, int]:
        """The video frames latent frames [first, first+k) decode to: the
        first video frame and how many."""
        t = self.latent.temporal if self.latent else 0
        if t <= 1:
            return first, k
        v0 = 0 if first == 0 else t * (first - 1) + 1
        return v0, t * (first + k - 1) + 1 - v0

    def param_defaults(self) -> Dict[str, ParamValue]:
        return {q.name: q.default for q in self.params or []}

    def wire(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {
            "name": self.name, "stages": list(self.stages), "default_steps": self.default_steps,
            "max_side": self.max_side, "max_frames": self.max_frames, "max_steps": self.max_steps,
            "min_side": self.min_side, "max_frame_pixels": self.max_frame_pixels, "max_pixels": self.max_pixels,
            "side_multiple": self.side_multiple, "frame_step": self.frame_step, "frame_offset": self.frame_offset,
            "cond": {"dtype": self.cond.dtype, "shape": list(self.cond.shape)},
            "latent": {"dtype": self.latent.dtype, "channels": self.latent.channels, "scale": self.latent.scale},
        }
        if self.checkpoint is not None:
            d["checkpoint"] = self.checkpoint.wire()
        if self.tensor_cache:
            d["tensor_cache"] = True
        if self.latent.temporal > 1:
            d["latent"]["temporal"] = self.latent.temporal
        if self.conds:
            d["conds"] = [c.wire() for c in self.conds]
        if self.image is not None:
            d["image"] = self.image.wire()
        if self.params:
            d["params"] = [q.wire() for q in self.params]
        if self.batch:
            d["batch"] = {st: int(n) for st, n in self.batch.items()}
        return d

    # The version 2 keys of wire(), left out of a version 1 register.
    V2_KEYS = ("checkpoint", "tensor_cache", "conds", "image", "params", "batch")


@dataclasses.dataclass
class Spec:
    """The request, as the agent's engine.Spec."""

    model: str
    prompt: str
    negative_prompt: str
    seed: int
    width: int
    height: int
    frames: int
    steps: int
    guidance_scale: float

    @staticmethod
    def from_wire(d: Dict[str, Any]) -> "Spec":
        return Spec(model=d.get("model") or "latentmesh-reference", prompt=d.get("prompt", ""),
                    negative_prompt=d.get("negative_prompt", ""), seed=int(d.get("seed", 0)),
                    width=int(d.get("width", 0)), height=int(d.get("height", 0)), frames=int(d.get("frames", 1)),
                    steps=int(d.get("steps", 0)), guidance_scale=float(d.get("guidance_scale", 0.0)))


def _bytes_of(a: Any) -> np.ndarray:
    """a (a numpy array, a torch tensor or anything bytes-like) as a flat
    uint8 array of its bytes, without a copy where it is contiguous."""
    if hasattr(a, "detach"):  # a torch tensor
        a = a.detach().contiguous().cpu().numpy()
    if isinstance(a, np.ndarray):
        return np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(a).cast("B"), dtype=np.uint8)


@dataclasses.dataclass
class Resume:
    """Where a denoise continues from (protocol version 2): the sampler
    state after ``step`` of ``total`` steps, and the latent (the model's
    checkpoint layout) in the arena."""

    sampler: str
    step: int
    total: int
    state: bytes
    _task: "Task"
    _latent: Region

    @property
    def latent(self) -> np.ndarray:
        """The checkpoint's latent: a numpy view of the arena (copy what you keep)."""
        return self._task._view(self._latent)

    def torch_latent(self) -> Any:
        """The latent as a torch tensor sharing the arena (clone what you keep)."""
        return _torch_view(self._task._w.arena, self._latent)


class Task:
    """One stage call. Callbacks report progress and meet cancellation
    through it: iterate ``task.steps(n)`` in a denoise loop, or call
    ``task.progress(step, total)`` and ``task.check_cancelled()``.

    A denoise of a model that checkpoints (protocol version 2) also gets
    ``checkpoint_every`` and ``resume``, calls ``task.checkpoint`` after the
    steps ``task.wants_checkpoint`` names, and at each step boundary where
    ``task.should_stop()`` calls ``task.stop``. One that uses the tensor
    cache calls ``task.tensor_get`` and ``task.tensor_put``. Without the
    features (an older agent) these are no-ops: ``wants_checkpoint`` and
    ``should_stop`` are False, ``tensor_get`` returns None."""

    def __init__(self, worker: "Worker", msg: Dict[str, Any]) -> None:
        self._w = worker
        self.id: int = int(msg["task"])
        self.stage: str = msg["stage"]
        self.model: str = msg.get("model", "")
        self.spec = Spec.from_wire(msg["spec"])
        self.first_frame: int = int(msg.get("first_frame", 0))
        self.frames: int = int(msg.get("frames", 0))
        self._inputs = [p.region_of(r) for r in msg.get("inputs") or []]
        self._output = p.region_of(msg["output"])
        self._cancel = threading.Event()
        self.last_step = 0  # the last step reported with progress
        # Version 2, checkpoints.
        self.checkpoint_every: int = int(msg.get("checkpoint_every", 0))
        self._ckbuf: Optional[Region] = p.region_of(msg["checkpoint_buf"]) if msg.get("checkpoint_buf") else None
        self.resume: Optional[Resume] = None
        if msg.get("resume"):
            r = msg["resume"]
            self.resume = Resume(sampler=str(r["sampler"]), step=int(r["step"]), total=int(r["total"]),
                                 state=bytes(r.get("state") or b""), _task=self, _latent=p.region_of(r["latent"]))
        self.last_checkpoint = self.resume.step if self.resume else 0  # the newest step checkpointed (or resumed)
        self._stop = threading.Event()
        self._ack = threading.Condition()
        self._acked = True  # the checkpoint buffer is ours (guarded by _ack)
        # Version 2, tensor cache.
        self._cache = worker._uses_tensor_cache(self.model, self.stage)
        self._answers: "queue.Queue[Dict[str, Any]]" = queue.Queue()
        self._lent: Dict[str, Region] = {}  # regions the agent lent for a tensor_put, by key
        # Version 2, the model shapes.
        self._model = worker._model(self.model)
        granted = worker.features
        self.params: Dict[str, ParamValue] = dict(msg.get("params") or {})
        if p.FEATURE_PARAMS not in granted and self._model is not None:
            self.params = self._model.param_defaults()  # the agent sends none: the defaults
        self._image: Optional[Region] = p.region_of(msg["ref_image"]) if msg.get("ref_image") else None
        self.video_first: int = int(msg.get("video_first", 0))  # decode of a temporal latent: its first video frame
        self.video_frames: int = int(msg.get("video_frames", 0))  # ... and how many it writes
        if not self.video_frames and self.stage == "decode":
            self.video_first, self.video_frames = self.first_frame, self.frames
        self._conds: Dict[str, Region] = {str(c["name"]): p.region_of(c) for c in msg.get("conds") or []}
        self._lens: Dict[str, int] = {}
        # Version 2, the lifecycle.
        self.adapter: str = str(msg.get("adapter") or "")  # a denoise's adapter ("": none)
        self.stream: Optional[DecodeStream] = None
        if msg.get("stream"):
            self.stream = DecodeStream(int(msg["stream"]), str(msg.get("job") or ""), int(msg.get("chunk") or 0),
                                       bool(msg.get("last")))
        # What a decode keeps across its stream's chunks: the worker hands
        # the same dict to every chunk of a stream and drops it after the
        # last (or a failure, a cancel, stream_end). Fresh for a task
        # without a stream.
        self.state: Dict[str, Any] = {}
        self._ready: Set[int] = set()
        self._split = False  # named tensors the agent did not split: this SDK splits the payload (_prepare)

    def _prepare(self) -> None:
        """What the task needs before its callback runs (in the worker's
        try: a bad payload fails the task, not the worker)."""
        if self._model is not None and self._model.conds and not self._conds and self.stage in ("encode", "denoise"):
            self._split_payload()

    def _split_payload(self) -> None:
        """The named tensors of a session without named_cond: the SDK lays
        the one payload out as the agent would (and completes an encode's
        on done)."""
        assert self._model is not None and self._model.conds
        offs, sizes, total = self._model.cond_layout()
        whole = self._output if self.stage == "encode" else (self._inputs[0] if self._inputs else None)
        if whole is None or whole[1] != total:
            return  # the callback sees the payload as it came, and fails on it
        self._split = True
        lens = self._trailer_lens(whole) if self.stage == "denoise" else {}
        for c, off, n in zip(self._model.conds, offs, sizes):
            shape = list(c.shape)
            if c.var_len and c.name in lens:
                n = n // shape[0] * lens[c.name]
                shape[0] = lens[c.name]
            self._conds[c.name] = (whole[0] + off, n, c.dtype, tuple(shape))

    def _trailer_lens(self, whole: Region) -> Dict[str, int]:
        """The lengths a payload's trailer holds."""
        assert self._model is not None and self._model.conds
        offs, sizes, total = self._model.cond_layout()
        raw = self._bytes(whole)
        at, lens = total - 4 * sum(1 for c in self._model.conds if c.var_len), {}
        for c in self._model.conds:
            if c.var_len:
                n = int(raw[at:at + 4].view("<u4")[0])
                if not 1 <= n <= c.shape[0]:
                    raise BadInput(f"named tensor {c.name} of length {n}, want 1-{c.shape[0]}")
                lens[c.name] = n
                at += 4
        return lens

    def _finish_payload(self) -> None:
        """Completes a split encode's payload as the agent does on done:
        the rows past each length and the padding zeroed, the lengths in
        the trailer."""
        assert self._model is not None and self._model.conds
        offs, sizes, total = self._model.cond_layout()
        raw = self._bytes(self._output)
        at = 0
        tail = total - 4 * sum(1 for c in self._model.conds if c.var_len)
        trailer = []
        for c, off, n in zip(self._model.conds, offs, sizes):
            raw[at:off] = 0
            used = n
            if c.var_len:
                length = self._lens.get(c.name, c.shape[0])
                used = n // c.shape[0] * length
                trailer.append(length)
            raw[off + used:off + n] = 0
            at = off + n
        raw[at:tail] = 0
        if trailer:
            raw[tail:] = np.array(trailer, dtype="<u4").view(np.uint8)

    def _shape_refusal(self) -> Optional[str]:
        """Why this task cannot run in a session without a shape feature
        its model needs (None: it can)."""
        m, granted = self._model, self._w.features
        if m is None:
            return None
        if m.latent is not None and m.latent.temporal > 1 and p.FEATURE_TEMPORAL not in granted:
            return (f"model {m.name} has a temporal latent, but the agent did not grant {p.FEATURE_TEMPORAL}: "
                    f"it would lay out one latent frame per video frame")
        if m.image is not None and m.image.required and self.stage in m.image.stages and self._image is None:
            return f"model {m.name} needs a reference image at {self.stage}, and the task has none"
        if m.decode_state and self.stage == "decode" and self.stream is None and self.first_frame > 0:
            return (f"model {m.name} decodes with state across a job's chunks, but the agent did not grant "
                    f"{p.FEATURE_DECODE_STATE}: latent frame {self.first_frame} cannot be decoded without the ones before")
        return None

    def _view(self, region: Region) -> np.ndarray:
        off, n, dtype, shape = region
        if dtype not in _DTYPES:
            raise BadInput(f"dtype {dtype} has no numpy view here")
        if off < 0 or off + n > self._w.arena_size:
            raise BadInput(f"region [{off},{off + n}) outside the {self._w.arena_size}-byte arena")
        dt = np.dtype(_DTYPES[dtype]).newbyteorder("<")
        return np.frombuffer(self._w.arena, dtype=dt, count=n // dt.itemsize, offset=off).reshape(shape)

    def _bytes(self, region: Region) -> np.ndarray:
        off, n, _, _ = region
        if off < 0 or off + n > self._w.arena_size:
            raise BadInput(f"region [{off},{off + n}) outside the {self._w.arena_size}-byte arena")
        return np.frombuffer(self._w.arena, dtype=np.uint8, count=n, offset=off)

    @property
    def inputs(self) -> List[np.ndarray]:
        """The input tensors: numpy views of the agent's arena (no copy)."""
        return [self._view(r) for r in self._inputs]

    @property
    def output(self) -> np.ndarray:
        """The output tensor: a writable numpy view of the agent's arena."""
        return self._view(self._output)

    def torch_inputs(self) -> List[Any]:
        """The inputs as torch tensors sharing the arena (torch.frombuffer)."""
        return [_torch_view(self._w.arena, r) for r in self._inputs]

    def torch_output(self) -> Any:
        return _torch_view(self._w.arena, self._output)

    # --- protocol version 2: the model shapes ---

    @property
    def conds(self) -> Dict[str, np.ndarray]:
        """The named conditioning tensors, as numpy views of the arena: an
        encode's outputs at their maximum shape (write them, and say each
        variable one's length with ``set_len``), a denoise's inputs at the
        lengths the encode said. (bfloat16 has no numpy view: use
        ``torch_conds``.)"""
        return {k: self._view(r) for k, r in self._conds.items()}

    def torch_conds(self) -> Dict[str, Any]:
        """The named tensors as torch tensors sharing the arena."""
        return {k: _torch_view(self._w.arena, r) for k, r in self._conds.items()}

    def set_len(self, name: str, n: int) -> None:
        """Says the length an encode wrote of named tensor ``name`` (of
        variable length): dimension 0's rows past it are zeroed by the agent
        and the denoise gets the tensor at this length. Unset: the maximum."""
        c = next((c for c in (self._model.conds if self._model and self._model.conds else []) if c.name == name), None)
        if c is None or not c.var_len:
            raise ValueError(f"{name!r} is not a named tensor of variable length of model {self.model}")
        if not 1 <= n <= c.shape[0]:
            raise ValueError(f"length {n} of {name!r}: want 1-{c.shape[0]}")
        self._lens[name] = int(n)

    @property
    def image(self) -> Optional[np.ndarray]:
        """The request's reference image, RGBA uint8 ``[height, width, 4]``
        (a view of the arena), at the stages the model takes it; else None."""
        return self._view(self._image) if self._image is not None else None

    def torch_image(self) -> Any:
        return _torch_view(self._w.arena, self._image) if self._image is not None else None

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def check_cancelled(self) -> None:
        if self._cancel.is_set():
            raise Cancelled()

    def progress(self, step: int, total: int) -> None:
        self.last_step = step
        self._w._send({"t": p.TYPE_PROGRESS, "task": self.id, "step": step, "total": total})

    def preview(self, step: int, png: bytes) -> None:
        self._w._send({"t": p.TYPE_PREVIEW, "task": self.id, "step": step, "image": png})

    def chunk_ready(self, k: int) -> bool:
        """Says latent chunk ``k`` (frame k of the output) is final: the
        agent hands it to the decode stage at once, so the caller must not
        write it again. Returns False, doing nothing, where the session has
        no chunk_ready or the task is not a denoise (the agent then takes
        every chunk at done)."""
        if self.stage != "denoise" or p.FEATURE_CHUNK_READY not in self._w.features:
            return False
        n = self._output[3][0] if self._output[3] else 0
        if not 0 <= k < n:
            raise ValueError(f"chunk {k}: the latent has {n} chunks")
        if k in self._ready:
            raise ValueError(f"chunk {k} reported ready twice")
        self._ready.add(k)
        self._w._send({"t": p.TYPE_CHUNK_READY, "task": self.id, "chunk": k})
        log.debug("task %d: latent chunk %d ready", self.id, k)
        return True

    def steps(self, total: int, start: int = 0) -> Iterator[int]:
        """Yields start..total-1 (start: the steps a resume already did);
        after each step reports progress, and before each raises Cancelled
        if the agent cancelled the task."""
        for i in range(start, total):
            self.check_cancelled()
            yield i
            self.progress(i + 1, total)

    # --- protocol version 2: checkpoints ---

    @property
    def checkpoints(self) -> bool:
        """Whether this task can checkpoint (the agent lent it a buffer)."""
        return self._ckbuf is not None

    def wants_checkpoint(self, step: int) -> bool:
        """Whether the agent asked for a checkpoint after ``step`` (1-based:
        steps done): every ``checkpoint_every``-th step, counted from the
        start of the whole run, never after the last."""
        e = self.checkpoint_every
        return self._ckbuf is not None and e > 0 and step % e == 0 and self.last_checkpoint < step < self.spec.steps

    def should_stop(self) -> bool:
        """Whether the agent asked the task to stop at a checkpoint (a
        preemption or a drain): call ``stop`` at this step boundary."""
        return self._stop.is_set()

    def checkpoint(self, step: int, state: bytes, latent: Any) -> bool:
        """Publishes the sampler's state after ``step`` of ``spec.steps``:
        ``state`` (at most 768 KiB, inline) and ``latent`` (a numpy array,
        torch tensor or bytes of exactly the checkpoint buffer's size, the
        model's checkpoint layout) written into the task's checkpoint
        buffer. The buffer is reused only once the agent has copied the
        previous checkpoint (``checkpointed``): this waits for that, not
        for this one. Returns False, doing nothing, when the task cannot
        checkpoint or ``step`` is already checkpointed."""
        if self._ckbuf is None or step <= self.last_checkpoint:
            return False
        if not 1 <= step < self.spec.steps:
            raise ValueError(f"a checkpoint after step {step} of {self.spec.steps}: want 1 <= step < steps")
        if len(state) > p.MAX_STATE:
            raise ValueError(f"checkpoint state of {len(state)} bytes, at most {p.MAX_STATE}")
        src = _bytes_of(latent)
        buf = self._bytes(self._ckbuf)
        if src.size != buf.size:
            raise ValueError(f"checkpoint latent of {src.size} bytes, the buffer holds {buf.size}")
        self._await_ack()
        buf[:] = src
        with self._ack:
            self._acked = False
        self.last_checkpoint = step
        self._w._send({"t": p.TYPE_CHECKPOINT, "task": self.id, "step": step, "total": self.spec.steps,
                       "state": bytes(state)})
        return True

    def stop(self, step: int, state: bytes, latent: Any) -> NoReturn:
        """Ends the task as the agent's stop asked: checkpoints ``step``
        (the steps done) unless it is already checkpointed or is not a
        step a checkpoint may follow, then raises Stopped."""
        if 1 <= step < self.spec.steps:
            self.checkpoint(step, state, latent)
        raise Stopped()

    def _await_ack(self) -> None:
        with self._ack:
            while not self._acked:
                if self._cancel.is_set():
                    raise Cancelled()
                self._ack.wait()

    def _checkpointed(self) -> None:
        with self._ack:
            self._acked = True
            self._ack.notify_all()

    def _abort(self) -> None:
        """Cancels the task, waking whatever of it waits on the agent."""
        self._cancel.set()
        with self._ack:
            self._ack.notify_all()
        self._answers.put({})

    # --- protocol version 2: the tensor cache ---

    @property
    def tensor_cache(self) -> bool:
        """Whether this task may use the agent's tensor cache."""
        return self._cache

    def tensor_get(self, key: str, nbytes: int) -> Optional[np.ndarray]:
        """The cached tensor ``key`` (computed from conditioning alone, e.g.
        the negative prompt's attention keys and values), as a uint8 view of
        the arena valid until the task ends (copy what you keep), or None.
        On a miss the agent may lend ``nbytes`` of arena for the value, which
        ``tensor_put`` then fills in place. The key must say everything the
        value depends on beyond this engine's name and the model's (weights,
        the conditioning's hash)."""
        if not self._cache:
            return None
        self.check_cancelled()
        if not p.valid_key(key):
            raise ValueError(f"tensor cache key {key!r}: want 1-{p.MAX_KEY} bytes of [A-Za-z0-9._:/=+-]")
        if not 0 <= nbytes <= p.MAX_TENSOR:
            raise ValueError(f"tensor of {nbytes} bytes, at most {p.MAX_TENSOR}")
        self._w._send({"t": p.TYPE_TENSOR_GET, "task": self.id, "key": key, "len": nbytes})
        while True:
            a = self._answers.get()
            self.check_cancelled()  # _abort's wake-up, or a cancel meanwhile
            if a.get("key") == key:
                break
        region = p.region_of(a["region"]) if a.get("region") else None
        if a.get("found") and region is not None:
            return self._bytes(region)
        if region is not None:
            self._lent[key] = region
        return None

    def tensor_put(self, key: str, value: Any) -> bool:
        """Offers ``value`` (bytes, a numpy array or a torch tensor) to the
        agent's cache under ``key``: written into the region lent by the
        ``tensor_get`` that missed, or inline when small enough. Returns
        whether it was sent."""
        if not self._cache:
            return False
        if not p.valid_key(key):
            raise ValueError(f"tensor cache key {key!r}: want 1-{p.MAX_KEY} bytes of [A-Za-z0-9._:/=+-]")
        src = _bytes_of(value)
        region = self._lent.pop(key, None)
        if region is not None and region[1] == src.size:
            self._bytes(region)[:] = src
            self._w._send({"t": p.TYPE_TENSOR_PUT, "task": self.id, "key": key})
            return True
        if 0 < src.size <= p.MAX_INLINE_TENSOR:
            self._w._send({"t": p.TYPE_TENSOR_PUT, "task": self.id, "key": key, "data": src.tobytes()})
            return True
        log.debug("tensor %s of %d bytes not cached: no region lent for it and too large to send inline", key, src.size)
        return False


def _torch_view(arena: mmap.mmap, region: Any) -> Any:
    import torch  # optional dependency

    off, n, dtype, shape = region
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "uint8": torch.uint8}[dtype]
    elem = torch.tensor([], dtype=tdt).element_size()
    return torch.frombuffer(arena, dtype=tdt, count=n // elem, offset=off).view(shape)


EncodeFn = Callable[[Task], None]
DenoiseFn = Callable[[Task], None]
DecodeFn = Callable[[Task], None]
BatchFn = Callable[["Batch"], None]


class Worker:
    """An engine worker: declare models, set the callbacks, run.

    Each callback gets a Task and writes ``task.output`` from
    ``task.inputs``: encode (no inputs -> conditioning), denoise
    (conditioning -> latent, reporting steps), decode (latent frames ->
    RGBA pixels ``[frames, height, width, 4]`` uint8; the agent encodes the
    PNG or GIF).

    The worker offers ``versions`` (by default 1 and 2) and asks for the
    features its models declare (``Model.checkpoint``,
    ``Model.tensor_cache``); ``version`` and ``features`` say what the agent
    granted. Offering version 1 alone registers exactly as an engine from
    before version 2 does.
    """

    def __init__(self, engine: str, models: List[Model], slots: Optional[Dict[str, int]] = None,
                 versions: Sequence[int] = p.VERSIONS, lifecycle: bool = False) -> None:
        if not versions or any(v not in p.VERSIONS for v in versions):
            raise ValueError(f"protocol versions {list(versions)}: this SDK speaks {list(p.VERSIONS)}")
        self.engine = engine
        self.models = models
        self.slots = dict(slots or {})
        self.versions = sorted(set(versions))
        self.on_encode: Optional[EncodeFn] = None
        self.on_denoise: Optional[DenoiseFn] = None
        self.on_decode: Optional[DecodeFn] = None
        # Batch callbacks, by stage: what runs a batch the agent sent
        # (without one, its members run one after another).
        self.on_batch: Dict[str, BatchFn] = {}
        self._forming: Dict[int, List[Task]] = {}  # batches whose members are still coming
        self.arena: Any = None
        self.arena_size = 0
        self.version = p.VERSION_1  # the session's, once welcomed
        self.features: Set[str] = set()  # granted
        self._sock: Optional[socket.socket] = None
        self._wlock = threading.Lock()
        self._tasks: Dict[int, Task] = {}
        self._tlock = threading.Lock()
        self._closed = threading.Event()
        self._closed.set()  # no session yet
        # The lifecycle: models added and removed at run time (lifecycle),
        # adapters loaded (re-announced after a reconnect), decode streams'
        # state, and the lifecycle calls waiting for their ack.
        self.lifecycle = lifecycle
        self.adapters: Dict[str, Set[str]] = {}
        self._streams: Dict[int, Tuple[float, Dict[str, Any]]] = {}
        self._slock = threading.Lock()
        self._acks: List[Dict[str, Any]] = []
        self._alock = threading.Lock()
        self._stop = threading.Event()
        self._welcomed = threading.Event()  # the session's features are known

    def encode(self, fn: EncodeFn) -> EncodeFn:
        self.on_encode = fn
        return fn

    def denoise(self, fn: DenoiseFn) -> DenoiseFn:
        self.on_denoise = fn
        return fn

    def decode(self, fn: DecodeFn) -> DecodeFn:
        self.on_decode = fn
        return fn

    def encode_batch(self, fn: BatchFn) -> BatchFn:
        self.on_batch["encode"] = fn
        return fn

    def denoise_batch(self, fn: BatchFn) -> BatchFn:
        self.on_batch["denoise"] = fn
        return fn

    def decode_batch(self, fn: BatchFn) -> BatchFn:
        self.on_batch["decode"] = fn
        return fn

    def _wanted_features(self) -> List[str]:
        f = []
        if any(m.checkpoint is not None for m in self.models):
            f.append(p.FEATURE_CHECKPOINT)
        if any(m.tensor_cache for m in self.models):
            f.append(p.FEATURE_TENSOR_CACHE)
        if any(m.conds for m in self.models):
            f.append(p.FEATURE_NAMED_COND)
        if any(m.latent is not None and m.latent.temporal > 1 for m in self.models):
            f.append(p.FEATURE_TEMPORAL)
        if any(m.image is not None for m in self.models):
            f.append(p.FEATURE_IMAGE)
        if any(m.params for m in self.models):
            f.append(p.FEATURE_PARAMS)
        if any(m.decode_state for m in self.models):
            f.append(p.FEATURE_DECODE_STATE)
        if any(m.chunk_ready for m in self.models):
            f.append(p.FEATURE_CHUNK_READY)
        if self.lifecycle:
            f.append(p.FEATURE_MODEL_LIFECYCLE)
        if any(m.adapters for m in self.models):
            f.append(p.FEATURE_ADAPTERS)
        if any(m.batch and max(m.batch.values()) > 1 for m in self.models):
            f.append(p.FEATURE_BATCH)
        return f

    def _model(self, name: str) -> Optional[Model]:
        return next((m for m in self.models if m.name == name), None)

    def _uses_tensor_cache(self, model: str, stage: str) -> bool:
        return stage == "denoise" and p.FEATURE_TENSOR_CACHE in self.features and any(
            m.name == model and m.tensor_cache for m in self.models)

    def _send(self, msg: Dict[str, Any]) -> None:
        frame = p.encode_frame(msg, self.version)
        with self._wlock:
            if self._sock is None:
                return
            try:
                self._sock.sendall(frame)
            except OSError:
                self._closed.set()

    def _task(self, msg: Dict[str, Any]) -> Optional[Task]:
        with self._tlock:
            return self._tasks.get(int(msg.get("task", 0)))

    def run_forever(self, path: str, first_backoff: float = 0.5, max_backoff: float = 5.0) -> None:
        """Runs the worker (``run``) until ``close``, connecting again after
        the agent closes the socket or cannot be reached (it is restarting):
        after a pause drawn uniformly from [0, min(max_backoff, first_backoff
        * 2**n)] ("full jitter", so that the engines of a restarted host do
        not reconnect at once), n counting the failed tries since the last
        session that registered. A refused registration is raised: trying
        again gets the same answer."""
        tries = 0
        while not self._stop.is_set():
            registered = False
            try:
                registered = self.run(path)
            except p.ProtocolError:
                raise
            except OSError as e:  # the socket is not there yet, refused, or reset
                log.info("agent at %s not reachable: %s", path, e)
            tries = 0 if registered else tries + 1
            delay = random.uniform(0, min(max_backoff, first_backoff * 2 ** min(tries, 16)))
            if not self._stop.is_set():
                log.info("reconnecting to the agent in %.2f s", delay)
            self._stop.wait(delay)

    def close(self) -> None:
        """Ends ``run_forever`` (and the session ``run`` serves): tasks
        running are cancelled."""
        self._stop.set()
        with self._wlock:
            if self._sock is not None:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def run(self, path: str) -> bool:
        """Connects to the agent's engine socket, registers and serves tasks
        until the agent closes the connection (then returns whether it
        registered)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            raise
        log.info("connected to the agent at %s", path)
        self._closed = threading.Event()
        self._welcomed.clear()
        self.version, self.features = p.VERSION_1, set()  # register is a version 1 frame; the welcome decides
        self._sock = sock
        reader = p.FrameReader(sock)
        reg: Dict[str, Any] = {"t": p.TYPE_REGISTER, "engine": self.engine, "slots": self.slots,
                               "models": [m.wire() for m in self.models]}
        if self.versions != [p.VERSION_1]:
            reg["versions"], reg["features"] = self.versions, self._wanted_features()
        else:  # a version 1 register: models as version 1 knew them
            for m in reg["models"]:
                for k in Model.V2_KEYS:
                    m.pop(k, None)
                m["latent"].pop("temporal", None)
        try:
            self._send(reg)
            return self._serve(sock, reader)
        finally:
            self._closed.set()
            with self._wlock:
                sock.close()
                self._sock = None

    def _serve(self, sock: socket.socket, reader: p.FrameReader) -> bool:
        """The session after register: the welcome, then tasks until the
        agent closes the connection (False: it closed it before welcoming
        this worker)."""
        try:
            msg = reader.read()
        except OSError as e:  # ConnectionError among them
            log.info("the agent closed the engine socket before its welcome: %s", e)
            return False
        if msg.get("t") == p.TYPE_REFUSED:
            raise p.ProtocolError(f"agent refused registration: {msg.get('reason', '')}")
        if msg.get("t") != p.TYPE_WELCOME:
            raise p.ProtocolError(f"expected welcome, got {msg.get('t')}")
        version = int(msg.get("version") or p.VERSION_1)
        if version not in self.versions:
            raise p.ProtocolError(f"agent chose protocol version {version}, this worker offered {self.versions}")
        fd = p.take_fd(reader)
        if fd is None:
            raise p.ProtocolError("welcome carried no arena fd")
        self.version, reader.version = version, version
        self.features = set(msg.get("features") or []) if version >= p.VERSION_2 else set()
        self._welcomed.set()
        log.info("registered with agent %s: protocol v%d, features %s", msg.get("node", ""), version, sorted(self.features))
        self.arena_size = int(msg["arena_size"])
        self.arena = mmap.mmap(fd, self.arena_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        beat = max(0.05, int(msg["heartbeat_ms"]) / 1000.0)
        hb = threading.Thread(target=self._heartbeats, args=(beat, self._closed), daemon=True)
        hb.start()
        with self._slock:
            self._streams.clear()  # a new connection: no stream of the last one goes on
        self._forming.clear()
        if any(self.adapters.values()):
            threading.Thread(target=self._announce_adapters, daemon=True).start()
        pool = ThreadPoolExecutor(max_workers=max([1, *self.slots.values()]) + 1)
        try:
            while not self._closed.is_set():
                try:
                    msg = reader.read()
                except (ConnectionError, OSError):
                    break
                t = msg.get("t")
                if t == p.TYPE_ACK:
                    self._acked(msg)
                    continue
                if t == p.TYPE_STREAM_END:
                    self._drop_stream(int(msg.get("stream") or 0), "the agent ended it")
                    continue
                if t == p.TYPE_TASK:
                    task = Task(self, msg)
                    with self._tlock:
                        self._tasks[task.id] = task
                    bid, size = int(msg.get("batch") or 0), int(msg.get("batch_size") or 0)
                    if bid and size > 1:  # the members come back to back: run them once all are here
                        members = self._forming.setdefault(bid, [])
                        members.append(task)
                        if len(members) >= size:
                            del self._forming[bid]
                            pool.submit(self._run_batch, members)
                        continue
                    pool.submit(self._run_task, task)
                    continue
                task = self._task(msg)
                if task is None:
                    continue
                if t == p.TYPE_CANCEL:
                    task._abort()
                elif t == p.TYPE_STOP:
                    task._stop.set()
                elif t == p.TYPE_CHECKPOINTED:
                    task._checkpointed()
                elif t == p.TYPE_TENSOR:
                    task._answers.put(msg)
        finally:
            self._closed.set()
            with self._tlock:
                for task in self._tasks.values():
                    task._abort()
            with self._alock:
                for a in self._acks:
                    a["reason"] = None
                    a["lost"] = True
                    a["event"].set()
                self._acks.clear()
            pool.shutdown(wait=True)
            log.info("the agent closed the engine socket")
        return True

    def _heartbeats(self, every: float, closed: threading.Event) -> None:
        while not closed.wait(every):
            self._send({"t": p.TYPE_HEARTBEAT})

    # --- protocol version 2: the lifecycle ---

    def _request(self, msg: Dict[str, Any], timeout: float) -> None:
        """Sends a lifecycle frame and waits for the agent's ack (they come
        in the order the frames went)."""
        a: Dict[str, Any] = {"event": threading.Event(), "reason": None, "lost": False}
        with self._alock:
            if self._closed.is_set():
                raise ConnectionError("not connected to an agent")
            self._acks.append(a)
            self._send(msg)
        if not a["event"].wait(timeout):
            raise TimeoutError(f"no answer from the agent to {msg['t']} within {timeout} s")
        if a["lost"]:
            raise ConnectionError(f"the agent closed the connection before answering {msg['t']}")
        if a["reason"]:
            raise LifecycleRefused(a["reason"])

    def _acked(self, msg: Dict[str, Any]) -> None:
        with self._alock:
            if not self._acks:
                log.warning("an ack nothing waits for: %s", msg)
                return
            a = self._acks.pop(0)
        a["reason"] = str(msg.get("reason") or "")
        a["event"].set()

    def _granted(self, feature: str, timeout: float = 10.0) -> bool:
        """Whether the session (once welcomed: a call made during the
        handshake waits for it) granted feature; False when not connected."""
        closed = self._closed
        if closed.is_set():
            return False
        self._welcomed.wait(timeout)
        return not closed.is_set() and feature in self.features

    def add_model(self, model: Model, timeout: float = 10.0) -> None:
        """Serves one more model from now on (protocol v2, model_lifecycle:
        ask for it with ``Worker(..., lifecycle=True)``). Connected, the
        agent must take it (LifecycleRefused says why not: a name already
        registered, too many models); either way it is registered again
        after a reconnect."""
        if any(m.name == model.name for m in self.models):
            raise ValueError(f"model {model.name} is already registered")
        if len(self.models) >= p.MAX_MODELS:
            raise ValueError(f"{len(self.models)} models registered, at most {p.MAX_MODELS}")
        if self._granted(p.FEATURE_MODEL_LIFECYCLE):
            self._request({"t": p.TYPE_ADD_MODEL, "models": [model.wire()]}, timeout)
        elif not self._closed.is_set():
            raise p.ProtocolError(f"the agent did not grant {p.FEATURE_MODEL_LIFECYCLE}")
        self.models.append(model)
        log.info("model %s added", model.name)

    def remove_model(self, name: str, timeout: float = 10.0) -> None:
        """Stops serving model ``name`` (its adapters go with it); tasks of
        it already running finish."""
        if self._granted(p.FEATURE_MODEL_LIFECYCLE):
            self._request({"t": p.TYPE_REMOVE_MODEL, "model": name}, timeout)
        elif not self._closed.is_set():
            raise p.ProtocolError(f"the agent did not grant {p.FEATURE_MODEL_LIFECYCLE}")
        self.models = [m for m in self.models if m.name != name]
        self.adapters.pop(name, None)
        log.info("model %s removed", name)

    def load_adapter(self, model: str, adapter: str, timeout: float = 10.0) -> None:
        """Tells the agent adapter ``adapter`` of ``model`` is loaded (load
        the weights first: a denoise naming it may come at once). The agent
        advertises it, so requests naming it come here (protocol v2,
        adapters: declare ``Model(adapters=True)``). Announced again after a
        reconnect."""
        if not p.valid_adapter(adapter):
            raise ValueError(f"adapter name {adapter!r}: want 1-{p.MAX_ADAPTER_LEN} bytes of [A-Za-z0-9._-]")
        m = self._model(model)
        if m is None or not m.adapters or "denoise" not in m.stages:
            raise ValueError(f"model {model} does not take adapters here (declare Model(adapters=True) with a denoise)")
        loaded = self.adapters.setdefault(model, set())
        if adapter not in loaded and len(loaded) >= p.MAX_ADAPTERS:
            raise ValueError(f"{len(loaded)} adapters of {model} loaded, at most {p.MAX_ADAPTERS}")
        if self._granted(p.FEATURE_ADAPTERS):
            self._request({"t": p.TYPE_ADAPTER_LOADED, "model": model, "adapter": adapter}, timeout)
        elif not self._closed.is_set():
            raise p.ProtocolError(f"the agent did not grant {p.FEATURE_ADAPTERS}")
        loaded.add(adapter)
        log.info("adapter %s of model %s loaded", adapter, model)

    def unload_adapter(self, model: str, adapter: str, timeout: float = 10.0) -> None:
        """Tells the agent adapter ``adapter`` of ``model`` is no longer
        loaded: requests naming it go to another worker that has it, or are
        refused. Free the weights after it returns (a task naming it may
        still be on its way: fail it with NoAdapter)."""
        if adapter not in self.adapters.get(model, set()):
            raise ValueError(f"adapter {adapter} of model {model} is not loaded")
        if self._granted(p.FEATURE_ADAPTERS):
            self._request({"t": p.TYPE_ADAPTER_UNLOADED, "model": model, "adapter": adapter}, timeout)
        self.adapters[model].discard(adapter)
        log.info("adapter %s of model %s unloaded", adapter, model)

    def _announce_adapters(self) -> None:
        """Tells a new session's agent the adapters loaded before it."""
        if p.FEATURE_ADAPTERS not in self.features:
            log.warning("the agent did not grant %s: loaded adapters %s are not advertised", p.FEATURE_ADAPTERS, self.adapters)
            return
        for model, names in list(self.adapters.items()):
            for a in sorted(names):
                try:
                    self._request({"t": p.TYPE_ADAPTER_LOADED, "model": model, "adapter": a}, 10.0)
                except (LifecycleRefused, ConnectionError, TimeoutError) as e:
                    log.warning("adapter %s of model %s not announced: %s", a, model, e)

    def _stream_state(self, task: Task) -> Dict[str, Any]:
        """The state of task's decode stream: a new one at chunk 0, else
        the one its earlier chunks left (LostState when there is none).
        Streams idle past STREAM_IDLE_S are dropped on the way."""
        assert task.stream is not None
        now = time.monotonic()
        with self._slock:
            for sid, (at, _) in list(self._streams.items()):
                if now - at > p.STREAM_IDLE_S:
                    del self._streams[sid]
                    log.info("decode stream %d dropped: no chunk for %.0f s", sid, now - at)
            if task.stream.chunk == 0:
                state: Dict[str, Any] = {}
            elif task.stream.id in self._streams:
                state = self._streams[task.stream.id][1]
            else:
                raise LostState(f"chunk {task.stream.chunk} of decode stream {task.stream.id} (job {task.stream.job}): "
                                f"this worker holds no state of it")
            self._streams[task.stream.id] = (now, state)
        return state

    def _drop_stream(self, sid: int, why: str) -> None:
        with self._slock:
            if self._streams.pop(sid, None) is not None:
                log.debug("decode stream %d dropped: %s", sid, why)

    def _begin(self, task: Task) -> None:
        """Readies task for its callback: its shape checked, its payload
        prepared, its decode stream's state found (raising what fails it)."""
        why = task._shape_refusal()
        if why is not None:
            raise BadInput(why)
        task._prepare()
        if task.stream is not None:
            task.state = self._stream_state(task)
        log.debug("task %d (%s of %s) started", task.id, task.stage, task.model)

    def _done(self, task: Task) -> None:
        """Answers task done (its callback wrote its output)."""
        if task.stream is not None and task.stream.last:
            self._drop_stream(task.stream.id, "its last chunk is done")
        done: Dict[str, Any] = {"t": p.TYPE_DONE, "task": task.id}
        if task._split:
            if task.stage == "encode":
                task._finish_payload()
        elif task._lens:
            done["lens"] = dict(task._lens)
        self._send(done)

    def _failed(self, task: Task, e: BaseException) -> None:
        """Answers task failed, with the code exception e stands for."""
        code, reason = p.CODE_INTERNAL, repr(e)[:1000]
        if isinstance(e, Cancelled):
            log.info("task %d (%s) cancelled after step %d of %d", task.id, task.stage, task.last_step, task.spec.steps)
            code, reason = p.CODE_CANCELLED, "cancelled"
        elif isinstance(e, Stopped):
            log.info("task %d (%s) stopped after step %d of %d, checkpointed after step %d", task.id, task.stage,
                     task.last_step, task.spec.steps, task.last_checkpoint)
            code, reason = p.CODE_STOPPED, "stopped at a checkpoint"
        elif isinstance(e, BadCheckpoint):
            log.warning("task %d (%s): resume refused: %s", task.id, task.stage, e)
            code, reason = p.CODE_BAD_CHECKPOINT, str(e)[:1000]
        elif isinstance(e, BadInput):
            code, reason = p.CODE_BAD_INPUT, str(e)[:1000]
        elif isinstance(e, LostState):
            log.info("task %d (%s): %s", task.id, task.stage, e)
            code, reason = p.CODE_LOST_STATE, str(e)[:1000]
        elif isinstance(e, NoAdapter):
            log.info("task %d (%s): adapter %s not loaded: %s", task.id, task.stage, task.adapter, e)
            code, reason = p.CODE_NO_ADAPTER, str(e)[:1000]
        else:  # a bug in a callback fails the task, not the worker
            log.error("task %d (%s) failed", task.id, task.stage, exc_info=e)
        self._send({"t": p.TYPE_FAILED, "task": task.id, "code": code, "reason": reason})
        if task.stream is not None:
            self._drop_stream(task.stream.id, "a chunk of it failed")

    def _forget(self, task: Task) -> None:
        with self._tlock:
            self._tasks.pop(task.id, None)

    def _run_task(self, task: Task) -> None:
        fn = {"encode": self.on_encode, "denoise": self.on_denoise, "decode": self.on_decode}.get(task.stage)
        if fn is None and task.stage in self.on_batch:
            self._run_batch([task])  # a batch callback alone serves a lone task too
            return
        try:
            if fn is None:
                raise BadInput(f"this worker has no {task.stage} callback")
            self._begin(task)
            fn(task)
            self._done(task)
        except Exception as e:
            self._failed(task, e)
        finally:
            self._forget(task)

    def _run_batch(self, tasks: List[Task]) -> None:
        """Runs a batch the agent sent: its stage's batch callback once for
        the members that could begin, each answered on its own (a member
        that fails to begin, is cancelled or leaves does not fail the
        others); without a batch callback, one member after another."""
        fn = self.on_batch.get(tasks[0].stage)
        if fn is None:
            for t in tasks:
                self._run_task(t)
            return
        b = Batch(self, [])
        for t in tasks:
            try:
                self._begin(t)
                t.check_cancelled()
                b.tasks.append(t)
            except Exception as e:
                self._failed(t, e)
                self._forget(t)
        log.debug("batch of %d %s tasks (%d began)", len(tasks), tasks[0].stage, len(b.tasks))
        try:
            if b.tasks:
                fn(b)
            for t in b.tasks:
                self._done(t)
        except Exception as e:  # what fails the call fails the members still in it
            for t in b.tasks:
                self._failed(t, e)
        finally:
            for t in tasks:
                self._forget(t)


class Batch:
    """Tasks the agent sent to run in one call (protocol version 2,
    ``Model.batch``): one stage of one model, with the same size, frame
    count, step count and adapter (prompts, seeds, guidance and
    parameters may differ). ``tasks`` are the members still in the call, in
    order; the callback writes each one's output as a stage callback does
    a task's. At each step boundary call ``prune``: members cancelled
    since leave (answered on their own) and the others go on. ``leave``
    ends one member with a failure of its own, ``stop`` at a checkpoint.
    Members still in ``tasks`` when the callback returns are answered
    done; an exception out of it fails them all."""

    def __init__(self, worker: "Worker", tasks: List[Task]) -> None:
        self._w = worker
        self.tasks: List[Task] = tasks

    @property
    def spec(self) -> "Spec":
        """The first member's spec: size, frames and steps are every member's."""
        return self.tasks[0].spec

    def leave(self, task: Task, e: BaseException) -> int:
        """Ends member task with failure e (answered now); returns the
        position it had in ``tasks``, which the caller drops from its
        batched tensors."""
        i = self.tasks.index(task)
        del self.tasks[i]
        self._w._failed(task, e)
        return i

    def prune(self) -> List[int]:
        """Members cancelled since the last call leave the batch (each
        answered cancelled); returns the positions they had in ``tasks``,
        highest first, so that deleting rows in that order is safe."""
        gone = [i for i, t in enumerate(self.tasks) if t.cancelled]
        for i in reversed(gone):
            self.leave(self.tasks[i], Cancelled())
        return list(reversed(gone))

    def stop(self, task: Task, step: int, state: bytes, latent: Any) -> int:
        """Ends member task as its stop asked: checkpoints ``step`` (as
        ``Task.stop``) and leaves, answered stopped; returns its position."""
        try:
            task.stop(step, state, latent)
        except Exception as e:  # Stopped, or the checkpoint failed
            return self.leave(task, e)
        raise AssertionError("Task.stop returned")  # pragma: no cover

    def progress(self, step: int, total: int) -> None:
        """Reports ``step`` of ``total`` for every member."""
        for t in self.tasks:
            t.progress(step, total)


def socket_from_args(argv: List[str]) -> str:
    """The engine socket path: --socket PATH, else $LATENTMESH_ENGINE_SOCKET."""
    for i, a in enumerate(argv):
        if a == "--socket" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--socket="):
            return a.split("=", 1)[1]
    path = os.environ.get("LATENTMESH_ENGINE_SOCKET", "")
    if not path:
        raise SystemExit("usage: worker --socket PATH (or LATENTMESH_ENGINE_SOCKET)")
    return path
