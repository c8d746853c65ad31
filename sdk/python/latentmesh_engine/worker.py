"""The worker event loop: connect, register, serve tasks with three callbacks."""
from __future__ import annotations

import dataclasses
import mmap
import os
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np

from . import protocol as p

_DTYPES = {"float32": np.float32, "float16": np.float16, "uint8": np.uint8}


class Cancelled(Exception):
    """Raised at a step boundary of a task the agent cancelled."""


class BadInput(Exception):
    """Raise from a callback to fail a task for unusable inputs (NaN latents,
    a spec the model cannot take): the agent fails the job with the reason."""


@dataclasses.dataclass
class Layout:
    dtype: str
    shape: List[int]


@dataclasses.dataclass
class LatentLayout:
    dtype: str
    channels: int
    scale: int  # pixels per latent position along a side


@dataclasses.dataclass
class Model:
    """A model and the stages this worker serves of it."""

    name: str
    stages: List[str]
    cond: Layout
    latent: LatentLayout
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

    def wire(self) -> Dict[str, Any]:
        return {
            "name": self.name, "stages": list(self.stages), "default_steps": self.default_steps,
            "max_side": self.max_side, "max_frames": self.max_frames, "max_steps": self.max_steps,
            "min_side": self.min_side, "max_frame_pixels": self.max_frame_pixels, "max_pixels": self.max_pixels,
            "side_multiple": self.side_multiple, "frame_step": self.frame_step, "frame_offset": self.frame_offset,
            "cond": {"dtype": self.cond.dtype, "shape": list(self.cond.shape)},
            "latent": {"dtype": self.latent.dtype, "channels": self.latent.channels, "scale": self.latent.scale},
        }


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


class Task:
    """One stage call. Callbacks report progress and meet cancellation
    through it: iterate ``task.steps(n)`` in a denoise loop, or call
    ``task.progress(step, total)`` and ``task.check_cancelled()``."""

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

    def _view(self, region: Any) -> np.ndarray:
        off, n, dtype, shape = region
        if dtype not in _DTYPES:
            raise BadInput(f"dtype {dtype} has no numpy view here")
        if off < 0 or off + n > self._w.arena_size:
            raise BadInput(f"region [{off},{off + n}) outside the {self._w.arena_size}-byte arena")
        dt = np.dtype(_DTYPES[dtype]).newbyteorder("<")
        return np.frombuffer(self._w.arena, dtype=dt, count=n // dt.itemsize, offset=off).reshape(shape)

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

    def steps(self, total: int) -> Iterator[int]:
        """Yields 0..total-1; after each step reports progress, and before
        each raises Cancelled if the agent cancelled the task."""
        for i in range(total):
            self.check_cancelled()
            yield i
            self.progress(i + 1, total)


def _torch_view(arena: mmap.mmap, region: Any) -> Any:
    import torch  # optional dependency

    off, n, dtype, shape = region
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "uint8": torch.uint8}[dtype]
    elem = torch.tensor([], dtype=tdt).element_size()
    return torch.frombuffer(arena, dtype=tdt, count=n // elem, offset=off).view(shape)


EncodeFn = Callable[[Task], None]
DenoiseFn = Callable[[Task], None]
DecodeFn = Callable[[Task], None]


class Worker:
    """An engine worker: declare models, set the callbacks, run.

    Each callback gets a Task and writes ``task.output`` from
    ``task.inputs``: encode (no inputs -> conditioning), denoise
    (conditioning -> latent, reporting steps), decode (latent frames ->
    RGBA pixels ``[frames, height, width, 4]`` uint8; the agent encodes the
    PNG or GIF).
    """

    def __init__(self, engine: str, models: List[Model], slots: Optional[Dict[str, int]] = None) -> None:
        self.engine = engine
        self.models = models
        self.slots = dict(slots or {})
        self.on_encode: Optional[EncodeFn] = None
        self.on_denoise: Optional[DenoiseFn] = None
        self.on_decode: Optional[DecodeFn] = None
        self.arena: Any = None
        self.arena_size = 0
        self._sock: Optional[socket.socket] = None
        self._wlock = threading.Lock()
        self._tasks: Dict[int, Task] = {}
        self._tlock = threading.Lock()
        self._closed = threading.Event()

    def encode(self, fn: EncodeFn) -> EncodeFn:
        self.on_encode = fn
        return fn

    def denoise(self, fn: DenoiseFn) -> DenoiseFn:
        self.on_denoise = fn
        return fn

    def decode(self, fn: DecodeFn) -> DecodeFn:
        self.on_decode = fn
        return fn

    def _send(self, msg: Dict[str, Any]) -> None:
        frame = p.encode_frame(msg)
        with self._wlock:
            if self._sock is None:
                return
            try:
                self._sock.sendall(frame)
            except OSError:
                self._closed.set()

    def run(self, path: str) -> None:
        """Connects to the agent's engine socket, registers and serves tasks
        until the agent closes the connection (then returns)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        self._sock = sock
        reader = p.FrameReader(sock)
        self._send({"t": p.TYPE_REGISTER, "engine": self.engine, "models": [m.wire() for m in self.models],
                    "slots": self.slots})
        msg = reader.read()
        if msg.get("t") == p.TYPE_REFUSED:
            raise p.ProtocolError(f"agent refused registration: {msg.get('reason', '')}")
        if msg.get("t") != p.TYPE_WELCOME:
            raise p.ProtocolError(f"expected welcome, got {msg.get('t')}")
        fd = p.take_fd(reader)
        if fd is None:
            raise p.ProtocolError("welcome carried no arena fd")
        self.arena_size = int(msg["arena_size"])
        self.arena = mmap.mmap(fd, self.arena_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        beat = max(0.05, int(msg["heartbeat_ms"]) / 1000.0)
        hb = threading.Thread(target=self._heartbeats, args=(beat,), daemon=True)
        hb.start()
        pool = ThreadPoolExecutor(max_workers=max([1, *self.slots.values()]) + 1)
        try:
            while not self._closed.is_set():
                try:
                    msg = reader.read()
                except (ConnectionError, OSError):
                    break
                t = msg.get("t")
                if t == p.TYPE_TASK:
                    task = Task(self, msg)
                    with self._tlock:
                        self._tasks[task.id] = task
                    pool.submit(self._run_task, task)
                elif t == p.TYPE_CANCEL:
                    with self._tlock:
                        task = self._tasks.get(int(msg["task"]))
                    if task is not None:
                        task._cancel.set()
        finally:
            self._closed.set()
            for task in list(self._tasks.values()):
                task._cancel.set()
            pool.shutdown(wait=True)
            with self._wlock:
                sock.close()
                self._sock = None

    def _heartbeats(self, every: float) -> None:
        while not self._closed.wait(every):
            self._send({"t": p.TYPE_HEARTBEAT})

    def _run_task(self, task: Task) -> None:
        fn = {"encode": self.on_encode, "denoise": self.on_denoise, "decode": self.on_decode}.get(task.stage)
        try:
            if fn is None:
                raise BadInput(f"this worker has no {task.stage} callback")
            fn(task)
            self._send({"t": p.TYPE_DONE, "task": task.id})
        except Cancelled:
            print(f"latentmesh_engine: task {task.id} ({task.stage}) cancelled after step {task.last_step} of {task.spec.steps}",
                  file=sys.stderr, flush=True)
            self._send({"t": p.TYPE_FAILED, "task": task.id, "code": p.CODE_CANCELLED, "reason": "cancelled"})
        except BadInput as e:
            self._send({"t": p.TYPE_FAILED, "task": task.id, "code": p.CODE_BAD_INPUT, "reason": str(e)[:1000]})
        except Exception as e:  # a bug in a callback fails the task, not the worker
            print(f"latentmesh_engine: task {task.id} ({task.stage}) failed: {e!r}", file=sys.stderr)
            self._send({"t": p.TYPE_FAILED, "task": task.id, "code": p.CODE_INTERNAL, "reason": repr(e)[:1000]})
        finally:
            with self._tlock:
                self._tasks.pop(task.id, None)


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
