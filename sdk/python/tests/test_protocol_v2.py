"""Protocol version 2 in the SDK, against a scripted agent on a real socket:
negotiation, checkpoints (the buffer reused only once acknowledged),
resumes, a stop at a checkpoint, and the tensor cache."""
from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from latentmesh_engine import protocol as p  # noqa: E402
from latentmesh_engine.worker import (BadCheckpoint, CheckpointSpec, LatentLayout, Layout, Model, Task,  # noqa: E402
                                      Worker)
from test_worker import FakeAgent  # noqa: E402

SAMPLER = "toy/1"
NEG = 0.5  # the toy's "negative branch", computed when not cached
IN, OUT, CKBUF, LENT, CACHED, RESUMED = 0, 64, 128, 256, 512, 768  # arena offsets


def toy_step(x: np.ndarray, nb: np.ndarray) -> np.ndarray:
    return (x * np.float32(0.5) + nb).astype("<f4")


def toy_run(x: np.ndarray, steps: int, nb: float = NEG, start: int = 0) -> np.ndarray:
    b = np.full(x.shape, nb, dtype="<f4")
    for _ in range(start, steps):
        x = toy_step(x, b)
    return x


def latent(off: int) -> dict:
    return {"off": off, "len": 16, "dtype": "float32", "shape": [1, 4, 1, 1]}


def spec(steps: int) -> dict:
    return {"model": "toy2", "prompt": "a", "negative_prompt": "n", "seed": 1, "width": 8, "height": 8, "frames": 1,
            "steps": steps, "guidance_scale": 1.0}


def task(tid: int, steps: int, **v2: object) -> dict:
    m = {"t": p.TYPE_TASK, "task": tid, "stage": "denoise", "model": "toy2", "spec": spec(steps),
         "inputs": [{"off": IN, "len": 16, "dtype": "float32", "shape": [4]}], "output": latent(OUT)}
    m.update(v2)
    return m


X0 = np.array([1, 2, 3, 4], dtype="<f4")


class V2Test(unittest.TestCase):
    def setUp(self) -> None:
        self.agent = FakeAgent()
        model = Model(name="toy2", stages=["denoise"], cond=Layout("float32", [4]), latent=LatentLayout("float32", 4, 8),
                      checkpoint=CheckpointSpec(SAMPLER, "float32", 4, every=5), tensor_cache=True)
        self.worker = Worker("toy2-engine/1", [model], slots={"denoise": 1})
        self.kv_seen: list[str] = []

        @self.worker.denoise
        def denoise(t: Task) -> None:  # kept as self.denoise for a second worker
            steps = t.spec.steps
            x = np.array(t.inputs[0], dtype="<f4").reshape(1, 4, 1, 1)
            start = 0
            if t.resume is not None:
                if t.resume.sampler != SAMPLER or t.resume.state != struct.pack("<I", t.resume.step):
                    raise BadCheckpoint(f"not a {SAMPLER} state")
                x, start = t.resume.latent.copy(), t.resume.step
            got = t.tensor_get("neg/k", 16)
            if got is None:
                nb = np.full(4, NEG, dtype="<f4")
                t.tensor_put("neg/k", nb)
                self.kv_seen.append("computed")
            else:
                nb = got.view("<f4").copy()
                self.kv_seen.append("cached")
            nb = nb.reshape(x.shape)
            for i in range(start, steps):
                t.check_cancelled()
                if t.should_stop():
                    t.stop(i, struct.pack("<I", i), x)
                x = toy_step(x, nb)
                time.sleep(0.005)
                t.progress(i + 1, steps)
                if t.wants_checkpoint(i + 1):
                    t.checkpoint(i + 1, struct.pack("<I", i + 1), x)
            t.output[...] = x

        self.denoise = denoise
        self.thread = threading.Thread(target=self.worker.run, args=(self.agent.path,), daemon=True)
        self.agent.write(IN, X0.tobytes())

    def tearDown(self) -> None:
        self.agent.close()
        if self.thread.ident is None:
            return
        self.thread.join(5)
        self.assertFalse(self.thread.is_alive(), "worker did not return after the agent closed")

    def handshake(self, version: int = p.VERSION_2, features: tuple = (p.FEATURE_CHECKPOINT, p.FEATURE_TENSOR_CACHE)) -> dict:
        """Starts the worker and answers its register as an agent of version."""
        self.thread.start()
        reg = self.agent.accept()
        self.agent.welcome(version, list(features))
        return reg

    def frames_until(self, t: str, answer_gets: bool = True) -> list[dict]:
        """Frames (heartbeats left out) up to the first of type t, or
        done/failed; a tensor_get (unless t is one) is answered not found,
        with nothing lent, as by an agent whose cache is off."""
        out = []
        while True:
            assert self.agent.reader is not None
            m = self.agent.reader.read()
            self.assertEqual(m["v"], self.agent.version, m)
            if m["t"] == p.TYPE_HEARTBEAT:
                continue
            out.append(m)
            if m["t"] in (t, p.TYPE_DONE, p.TYPE_FAILED):
                return out
            if m["t"] == p.TYPE_TENSOR_GET:
                self.agent.send({"t": p.TYPE_TENSOR, "task": m["task"], "key": m["key"]})

    def none_of(self, t: str, within: float) -> None:
        """Asserts that no frame of type t arrives within the given seconds."""
        assert self.agent.conn is not None and self.agent.reader is not None
        deadline = time.monotonic() + within
        try:
            while (left := deadline - time.monotonic()) > 0:
                self.agent.conn.settimeout(left)
                m = self.agent.reader.read()
                self.assertNotEqual(m["t"], t, m)
        except socket.timeout:
            pass
        finally:
            self.agent.conn.settimeout(10)

    def out(self) -> np.ndarray:
        return np.frombuffer(self.agent.read(OUT, 16), dtype="<f4").reshape(1, 4, 1, 1)

    def test_register_offers_v2_and_asks_for_its_models_features(self) -> None:
        reg = self.handshake()
        self.assertEqual((reg["v"], reg["versions"]), (p.VERSION_1, [1, 2]))
        self.assertEqual(reg["features"], [p.FEATURE_CHECKPOINT, p.FEATURE_TENSOR_CACHE])
        (m,) = reg["models"]
        self.assertEqual(m["checkpoint"], {"sampler": SAMPLER, "dtype": "float32", "channels": 4, "every": 5})
        self.assertTrue(m["tensor_cache"])

    def test_an_agent_of_version_1_grants_nothing(self) -> None:
        self.handshake(p.VERSION_1)
        self.agent.send(task(1, 4))
        frames = self.frames_until(p.TYPE_DONE)  # every frame of version 1 (frames_until checks)
        self.assertEqual([m["t"] for m in frames], [p.TYPE_PROGRESS] * 4 + [p.TYPE_DONE])
        np.testing.assert_array_equal(self.out(), toy_run(X0.reshape(1, 4, 1, 1), 4))
        self.assertEqual((self.worker.version, self.worker.features), (p.VERSION_1, set()))
        self.assertEqual(self.kv_seen, ["computed"])

    def test_checkpoint_buffer_is_reused_only_once_acknowledged(self) -> None:
        self.handshake()
        self.agent.send(task(2, 6, checkpoint_every=2, checkpoint_buf=latent(CKBUF)))
        x0 = X0.reshape(1, 4, 1, 1)
        ck = self.frames_until(p.TYPE_CHECKPOINT)[-1]
        self.assertEqual((ck["t"], ck["step"], ck["total"], ck["state"]), (p.TYPE_CHECKPOINT, 2, 6, struct.pack("<I", 2)))
        after2 = self.agent.read(CKBUF, 16)
        self.assertEqual(after2, toy_run(x0, 2).tobytes())
        # Not acknowledged: the worker runs on, but neither writes the
        # buffer nor sends the checkpoint after step 4.
        steps = [m["step"] for m in self.frames_until(p.TYPE_PROGRESS) if m["t"] == p.TYPE_PROGRESS]
        while steps[-1] < 4:
            steps += [m["step"] for m in self.frames_until(p.TYPE_PROGRESS) if m["t"] == p.TYPE_PROGRESS]
        self.none_of(p.TYPE_CHECKPOINT, 0.3)
        self.assertEqual(self.agent.read(CKBUF, 16), after2, "the checkpoint buffer was overwritten before checkpointed")
        self.agent.send({"t": p.TYPE_CHECKPOINTED, "task": 2, "step": 2})
        ck = self.frames_until(p.TYPE_CHECKPOINT)[-1]
        self.assertEqual((ck["t"], ck["step"]), (p.TYPE_CHECKPOINT, 4))
        self.assertEqual(self.agent.read(CKBUF, 16), toy_run(x0, 4).tobytes())
        self.agent.send({"t": p.TYPE_CHECKPOINTED, "task": 2, "step": 4})
        self.assertEqual(self.frames_until(p.TYPE_DONE)[-1]["t"], p.TYPE_DONE)
        np.testing.assert_array_equal(self.out(), toy_run(x0, 6))

    def test_stop_checkpoints_the_step_reached_and_ends_stopped(self) -> None:
        self.handshake()
        self.agent.send(task(3, 1000, checkpoint_buf=latent(CKBUF)))
        frames = self.frames_until(p.TYPE_PROGRESS)  # under way
        self.agent.send({"t": p.TYPE_STOP, "task": 3})
        frames += self.frames_until(p.TYPE_FAILED)
        progress = [m["step"] for m in frames if m["t"] == p.TYPE_PROGRESS]
        cks = [m for m in frames if m["t"] == p.TYPE_CHECKPOINT]
        self.assertEqual((frames[-1]["t"], frames[-1]["code"]), (p.TYPE_FAILED, p.CODE_STOPPED))
        self.assertEqual(len(cks), 1, frames)
        self.assertEqual(cks[0]["step"], progress[-1], "a stop checkpoints the last step done")
        self.assertLess(progress[-1], 1000)
        self.assertEqual(self.agent.read(CKBUF, 16), toy_run(X0.reshape(1, 4, 1, 1), progress[-1]).tobytes())

    def test_resume_continues_from_the_checkpoint_or_is_refused(self) -> None:
        self.handshake()
        x2 = toy_run(X0.reshape(1, 4, 1, 1), 2)
        self.agent.write(RESUMED, x2.tobytes())
        resume = {"sampler": SAMPLER, "step": 2, "total": 4, "state": struct.pack("<I", 2), "latent": latent(RESUMED)}
        self.agent.send(task(4, 4, resume=resume, checkpoint_every=2, checkpoint_buf=latent(CKBUF)))
        frames = self.frames_until(p.TYPE_DONE)
        self.assertEqual([m["step"] for m in frames if m["t"] == p.TYPE_PROGRESS], [3, 4])
        self.assertEqual([m for m in frames if m["t"] == p.TYPE_CHECKPOINT], [], "checkpointed the resumed step or the last")
        np.testing.assert_array_equal(self.out(), toy_run(X0.reshape(1, 4, 1, 1), 4))
        resume["sampler"] = "another/1"
        self.agent.send(task(5, 4, resume=resume))
        m = self.frames_until(p.TYPE_FAILED)[-1]
        self.assertEqual((m["t"], m["code"]), (p.TYPE_FAILED, p.CODE_BAD_CHECKPOINT))
        self.assertIn("not a toy/1 state", m["reason"])

    def test_tensor_cache_through_lent_regions_and_inline(self) -> None:
        self.handshake()
        x0 = X0.reshape(1, 4, 1, 1)
        # A miss with a region lent: the value is written there and put without data.
        self.agent.send(task(6, 2))
        get = self.frames_until(p.TYPE_TENSOR_GET)[-1]
        self.assertEqual((get["t"], get["key"], get["len"]), (p.TYPE_TENSOR_GET, "neg/k", 16))
        self.agent.send({"t": p.TYPE_TENSOR, "task": 6, "key": "neg/k", "region": {"off": LENT, "len": 16, "dtype": "uint8", "shape": [16]}})
        put = self.frames_until(p.TYPE_TENSOR_PUT)[-1]
        self.assertEqual((put["t"], put["key"], "data" in put), (p.TYPE_TENSOR_PUT, "neg/k", False))
        self.assertEqual(self.agent.read(LENT, 16), np.full(4, NEG, dtype="<f4").tobytes())
        self.assertEqual(self.frames_until(p.TYPE_DONE)[-1]["t"], p.TYPE_DONE)
        # A hit: the worker uses the cached bytes.
        self.agent.write(CACHED, np.full(4, 0.25, dtype="<f4").tobytes())
        self.agent.send(task(7, 2))
        self.frames_until(p.TYPE_TENSOR_GET)
        self.agent.send({"t": p.TYPE_TENSOR, "task": 7, "key": "neg/k", "found": True,
                         "region": {"off": CACHED, "len": 16, "dtype": "uint8", "shape": [16]}})
        frames = self.frames_until(p.TYPE_DONE)
        self.assertEqual([m for m in frames if m["t"] == p.TYPE_TENSOR_PUT], [], "put a tensor it found")
        np.testing.assert_array_equal(self.out(), toy_run(x0, 2, nb=0.25))
        # A miss with nothing lent: the value goes inline.
        self.agent.send(task(8, 2))
        self.frames_until(p.TYPE_TENSOR_GET)
        self.agent.send({"t": p.TYPE_TENSOR, "task": 8, "key": "neg/k"})
        put = self.frames_until(p.TYPE_TENSOR_PUT)[-1]
        self.assertEqual(put["data"], np.full(4, NEG, dtype="<f4").tobytes())
        self.assertEqual(self.frames_until(p.TYPE_DONE)[-1]["t"], p.TYPE_DONE)
        self.assertEqual(self.kv_seen, ["computed", "cached", "computed"])

    def test_a_version_1_worker_registers_as_before_version_2(self) -> None:
        self.worker = Worker("toy2-engine/1", self.worker.models, slots={"denoise": 1}, versions=(p.VERSION_1,))
        self.worker.on_denoise = self.denoise
        self.thread = threading.Thread(target=self.worker.run, args=(self.agent.path,), daemon=True)
        reg = self.handshake(p.VERSION_1)
        self.assertNotIn("versions", reg)
        self.assertNotIn("features", reg)
        self.assertNotIn("checkpoint", reg["models"][0])
        self.agent.send(task(10, 2))
        self.assertEqual(self.frames_until(p.TYPE_DONE)[-1]["t"], p.TYPE_DONE)

    def test_features_not_granted_are_not_used(self) -> None:
        self.handshake(p.VERSION_2, (p.FEATURE_CHECKPOINT,))
        self.agent.send(task(9, 4, checkpoint_every=2, checkpoint_buf=latent(CKBUF)))
        frames = self.frames_until(p.TYPE_DONE)
        self.assertEqual([m["t"] for m in frames if m["t"] in (p.TYPE_TENSOR_GET, p.TYPE_TENSOR_PUT)], [])
        self.assertEqual([m["step"] for m in frames if m["t"] == p.TYPE_CHECKPOINT], [2])


if __name__ == "__main__":
    unittest.main()
