"""Unit tests of the SDK against a scripted agent on a real Unix socket.

The agent side here is a fake (the Go agent is tested with the real
workers in testbed/engines_test.go); it checks what the SDK puts on the
wire and how it treats the arena, cancellation and bad input.
"""
from __future__ import annotations

import array
import os
import socket
import struct
import sys
import tempfile
import threading
import time
import unittest

import msgpack
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from latentmesh_engine import protocol as p  # noqa: E402
from latentmesh_engine.worker import BadInput, LatentLayout, Layout, Model, Worker  # noqa: E402

ARENA = 1 << 16


class FakeAgent:
    """Accepts one engine connection and speaks the agent's side."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp()
        self.path = os.path.join(self.dir, "engine.sock")
        self.ln = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.ln.bind(self.path)
        self.ln.listen(1)
        self.fd = os.memfd_create("arena")
        os.ftruncate(self.fd, ARENA)
        self.arena = memoryview(bytearray(0))
        self.conn: socket.socket | None = None
        self.reader: p.FrameReader | None = None
        self.version = p.VERSION_1

    def accept(self) -> dict:
        self.conn, _ = self.ln.accept()
        self.conn.settimeout(10)
        self.reader = p.FrameReader(self.conn)
        return self.reader.read()

    def welcome(self, version: int = p.VERSION_1, features: list[str] | None = None) -> None:
        """Welcomes the engine as an agent of version (1: an agent from
        before protocol v2, whose welcome has no version key)."""
        assert self.conn is not None and self.reader is not None
        msg = {"t": p.TYPE_WELCOME, "arena_size": ARENA, "heartbeat_ms": 50}
        if version > p.VERSION_1:
            msg["version"], msg["features"] = version, list(features or [])
        self.conn.sendmsg([p.encode_frame(msg)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [self.fd]))])
        self.version = self.reader.version = version

    def send(self, msg: dict) -> None:
        assert self.conn is not None
        self.conn.sendall(p.encode_frame(msg, self.version))

    def read_until(self, t: str) -> dict:
        assert self.reader is not None
        while True:
            m = self.reader.read()
            if m.get("t") == t or m.get("t") in (p.TYPE_DONE, p.TYPE_FAILED):
                return m

    def write(self, off: int, data: bytes) -> None:
        os.pwrite(self.fd, data, off)

    def read(self, off: int, n: int) -> bytes:
        return os.pread(self.fd, n, off)

    def close(self) -> None:
        if self.conn:
            self.conn.close()
        self.ln.close()
        os.close(self.fd)


def region(off: int, shape: list[int]) -> dict:
    n = 4
    for d in shape:
        n *= d
    return {"off": off, "len": n, "dtype": "float32", "shape": shape}


def spec(steps: int = 4) -> dict:
    return {"model": "toy", "prompt": "a", "seed": 1, "width": 8, "height": 8, "frames": 1, "steps": steps, "guidance_scale": 1.0}


class WorkerTest(unittest.TestCase):
    def setUp(self) -> None:
        self.agent = FakeAgent()
        model = Model(name="toy", stages=["denoise", "decode"], cond=Layout("float32", [4]),
                      latent=LatentLayout("float32", 4, 8), default_steps=4, max_side=64)
        self.worker = Worker("toy-engine", [model], slots={"denoise": 1, "decode": 1})
        self.stepped = threading.Event()

        @self.worker.denoise
        def denoise(task):  # doubles its input, one step at a time
            x = task.inputs[0]
            out = task.output
            out[...] = x
            for _ in task.steps(task.spec.steps):
                out *= 2
                self.stepped.set()
                time.sleep(0.02)

        @self.worker.decode
        def decode(task):
            x = task.inputs[0]
            if not np.isfinite(x).all():
                raise BadInput("latent holds NaN")
            task.output[...] = x + 1

        self.thread = threading.Thread(target=self.worker.run, args=(self.agent.path,), daemon=True)
        self.thread.start()

    def tearDown(self) -> None:
        self.agent.close()
        self.thread.join(5)
        self.assertFalse(self.thread.is_alive(), "worker did not return after the agent closed")

    def handshake(self) -> dict:
        reg = self.agent.accept()
        self.agent.welcome()
        return reg

    def test_register_declares_models_and_slots(self) -> None:
        reg = self.handshake()
        self.assertEqual(reg["t"], p.TYPE_REGISTER)
        self.assertEqual(reg["v"], p.VERSION_1)  # register is a version 1 frame whatever the versions offered
        self.assertEqual(reg["versions"], [1, 2])
        self.assertEqual(reg["features"], [])  # the toy model declares no v2 feature
        self.assertEqual(reg["engine"], "toy-engine")
        self.assertEqual(reg["slots"], {"denoise": 1, "decode": 1})
        (m,) = reg["models"]
        self.assertEqual((m["name"], m["stages"], m["default_steps"], m["max_side"]), ("toy", ["denoise", "decode"], 4, 64))

    def test_task_reads_and_writes_the_arena_in_place(self) -> None:
        self.handshake()
        self.agent.write(0, np.arange(4, dtype="<f4").tobytes())
        self.agent.send({"t": p.TYPE_TASK, "task": 1, "stage": "denoise", "model": "toy", "spec": spec(3),
                         "inputs": [region(0, [4])], "output": region(64, [4])})
        steps = []
        while True:
            m = self.agent.read_until(p.TYPE_PROGRESS)
            if m["t"] != p.TYPE_PROGRESS:
                break
            steps.append(m["step"])
        self.assertEqual(m["t"], p.TYPE_DONE, m)
        self.assertEqual(steps[-1], 3)
        out = np.frombuffer(self.agent.read(64, 16), dtype="<f4")
        np.testing.assert_array_equal(out, np.arange(4) * 8)

    def test_cancel_stops_at_the_next_step(self) -> None:
        self.handshake()
        self.agent.write(0, np.ones(4, dtype="<f4").tobytes())
        self.agent.send({"t": p.TYPE_TASK, "task": 2, "stage": "denoise", "model": "toy", "spec": spec(1000),
                         "inputs": [region(0, [4])], "output": region(64, [4])})
        self.assertTrue(self.stepped.wait(5))
        self.agent.send({"t": p.TYPE_CANCEL, "task": 2})
        last = 0
        while True:
            m = self.agent.read_until(p.TYPE_PROGRESS)
            if m["t"] != p.TYPE_PROGRESS:
                break
            last = m["step"]
        self.assertEqual((m["t"], m["code"]), (p.TYPE_FAILED, p.CODE_CANCELLED))
        self.assertLess(last, 1000)

    def test_bad_input_and_bad_regions_fail_the_task_not_the_worker(self) -> None:
        self.handshake()
        self.agent.write(0, np.array([np.nan] * 4, dtype="<f4").tobytes())
        self.agent.send({"t": p.TYPE_TASK, "task": 3, "stage": "decode", "model": "toy", "spec": spec(),
                         "inputs": [region(0, [4])], "output": region(64, [4])})
        m = self.agent.read_until(p.TYPE_FAILED)
        self.assertEqual((m["t"], m["code"]), (p.TYPE_FAILED, p.CODE_BAD_INPUT))
        self.assertIn("NaN", m["reason"])
        # A region past the arena's end is refused, not read.
        self.agent.send({"t": p.TYPE_TASK, "task": 4, "stage": "decode", "model": "toy", "spec": spec(),
                         "inputs": [region(ARENA - 8, [4])], "output": region(64, [4])})
        m = self.agent.read_until(p.TYPE_FAILED)
        self.assertEqual((m["t"], m["code"]), (p.TYPE_FAILED, p.CODE_BAD_INPUT))
        self.assertIn("outside", m["reason"])
        # A stage with no callback fails the same way; the worker still serves.
        self.agent.send({"t": p.TYPE_TASK, "task": 5, "stage": "encode", "model": "toy", "spec": spec(),
                         "inputs": [], "output": region(64, [4])})
        m = self.agent.read_until(p.TYPE_FAILED)
        self.assertEqual(m["code"], p.CODE_BAD_INPUT)
        self.agent.write(0, np.zeros(4, dtype="<f4").tobytes())
        self.agent.send({"t": p.TYPE_TASK, "task": 6, "stage": "decode", "model": "toy", "spec": spec(),
                         "inputs": [region(0, [4])], "output": region(64, [4])})
        self.assertEqual(self.agent.read_until(p.TYPE_DONE)["t"], p.TYPE_DONE)


class ProtocolTest(unittest.TestCase):
    def test_frames_are_bounded_and_versioned(self) -> None:
        a, b = socket.socketpair()
        try:
            with self.assertRaises(p.ProtocolError):
                p.encode_frame({"t": "x", "blob": b"\0" * (p.MAX_FRAME + 1)})
            a.sendall(struct.pack(">I", p.MAX_FRAME + 1))
            with self.assertRaises(p.ProtocolError):
                p.FrameReader(b).read()
            body = msgpack.packb({"v": p.PROTOCOL_VERSION + 1, "t": p.TYPE_TASK})
            a.sendall(struct.pack(">I", len(body)) + body)
            with self.assertRaises(p.ProtocolError):
                p.FrameReader(b).read()
            # A v2 session takes only v2 frames.
            r = p.FrameReader(b)
            r.version = p.VERSION_2
            a.sendall(p.encode_frame({"t": p.TYPE_HEARTBEAT}, p.VERSION_2) + p.encode_frame({"t": p.TYPE_HEARTBEAT}, p.VERSION_1))
            self.assertEqual(r.read()["v"], p.VERSION_2)
            with self.assertRaises(p.ProtocolError):
                r.read()
        finally:
            a.close()
            b.close()


if __name__ == "__main__":
    unittest.main()
