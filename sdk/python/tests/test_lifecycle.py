"""The SDK's lifecycle features (protocol v2) against the scripted agent of
test_worker: decode streams and their state, chunk_ready, adapters loaded
and unloaded with the agent's ack, and reconnecting after the agent goes."""
from __future__ import annotations

import os
import sys
import threading
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from latentmesh_engine import protocol as p  # noqa: E402
from latentmesh_engine.worker import LatentLayout, Layout, LifecycleRefused, Model, Worker  # noqa: E402
from test_worker import FakeAgent, region, spec  # noqa: E402

FEATURES = [p.FEATURE_DECODE_STATE, p.FEATURE_CHUNK_READY, p.FEATURE_ADAPTERS]


class LifecycleTest(unittest.TestCase):
    def setUp(self) -> None:
        self.agent = FakeAgent()
        model = Model(name="toy", stages=["denoise", "decode"], cond=Layout("float32", [4]),
                      latent=LatentLayout("float32", 4, 8), decode_state=True, chunk_ready=True, adapters=True)
        self.worker = Worker("toy-engine", [model], slots={"denoise": 1, "decode": 1})
        self.seen: list = []

        @self.worker.decode
        def decode(task):  # adds the chunks so far: a decode with state
            task.state["sum"] = task.state.get("sum", 0.0) + float(task.inputs[0].sum())
            task.output[...] = task.state["sum"]
            self.seen.append((task.stream.chunk if task.stream else None, task.state["sum"]))

        @self.worker.denoise
        def denoise(task):
            self.seen.append(task.adapter)
            task.output[...] = 1
            task.chunk_ready(1)
            with self.assertRaises(ValueError):
                task.chunk_ready(1)
            with self.assertRaises(ValueError):
                task.chunk_ready(2)

        self.thread = threading.Thread(target=self.worker.run_forever, args=(self.agent.path, 0.01, 0.05), daemon=True)
        self.thread.start()

    def tearDown(self) -> None:
        self.worker.close()
        self.agent.close()
        self.thread.join(5)
        self.assertFalse(self.thread.is_alive(), "run_forever did not return after close")

    def handshake(self) -> dict:
        reg = self.agent.accept()
        self.agent.welcome(p.VERSION_2, FEATURES)
        return reg

    def decode(self, task: int, stream: int, chunk: int, last: bool, value: float) -> dict:
        self.agent.write(0, (bytes(bytearray(__import__("struct").pack("<f", value))) * 4))
        self.agent.send({"t": p.TYPE_TASK, "task": task, "stage": "decode", "model": "toy", "spec": spec(),
                         "inputs": [region(0, [4])], "output": region(64, [4]), "first_frame": chunk, "frames": 1,
                         "stream": stream, "job": "j1", "chunk": chunk, "last": last})
        return self.agent.read_until(p.TYPE_DONE)

    def test_register_asks_for_the_features_the_models_declare(self) -> None:
        reg = self.handshake()
        self.assertEqual(reg["features"], FEATURES)

    def test_a_stream_keeps_its_state_until_its_last_chunk(self) -> None:
        self.handshake()
        self.assertEqual(self.decode(1, 7, 0, False, 1.0)["t"], p.TYPE_DONE)
        self.assertEqual(self.decode(2, 7, 1, True, 2.0)["t"], p.TYPE_DONE)
        self.assertEqual(self.seen, [(0, 4.0), (1, 12.0)], "chunk 1 did not see chunk 0's state")
        m = self.decode(3, 7, 2, False, 1.0)  # after the last chunk: dropped
        self.assertEqual((m["t"], m["code"]), (p.TYPE_FAILED, p.CODE_LOST_STATE))
        m = self.decode(4, 9, 1, False, 1.0)  # never opened
        self.assertEqual((m["t"], m["code"]), (p.TYPE_FAILED, p.CODE_LOST_STATE))
        self.decode(5, 11, 0, False, 1.0)
        self.agent.send({"t": p.TYPE_STREAM_END, "stream": 11})
        m = self.decode(6, 11, 1, True, 1.0)
        self.assertEqual((m["t"], m.get("code")), (p.TYPE_FAILED, p.CODE_LOST_STATE), "stream_end did not drop the state")

    def test_chunk_ready_and_adapter(self) -> None:
        self.handshake()
        self.agent.send({"t": p.TYPE_TASK, "task": 1, "stage": "denoise", "model": "toy", "spec": spec(),
                         "inputs": [region(0, [4])], "output": region(64, [2, 4, 1, 1]), "adapter": "paint-v1"})
        m = self.agent.read_until(p.TYPE_CHUNK_READY)
        self.assertEqual((m["t"], m.get("chunk"), m["task"]), (p.TYPE_CHUNK_READY, 1, 1))
        self.assertEqual(self.agent.read_until(p.TYPE_DONE)["t"], p.TYPE_DONE)
        self.assertEqual(self.seen, ["paint-v1"])

    def test_adapters_are_acked_and_announced_again_after_a_reconnect(self) -> None:
        self.handshake()
        done = threading.Event()
        errs: list = []

        def load():
            try:
                self.worker.load_adapter("toy", "paint-v1")
            except Exception as e:  # noqa: BLE001
                errs.append(e)
            done.set()
        threading.Thread(target=load, daemon=True).start()
        m = self.agent.read_until(p.TYPE_ADAPTER_LOADED)
        self.assertEqual((m["t"], m["model"], m["adapter"]), (p.TYPE_ADAPTER_LOADED, "toy", "paint-v1"))
        self.agent.send({"t": p.TYPE_ACK, "model": "toy", "adapter": "paint-v1"})
        self.assertTrue(done.wait(5))
        self.assertEqual(errs, [])

        refused = threading.Event()

        def unload_refused():
            try:
                self.worker.unload_adapter("toy", "paint-v1")
            except LifecycleRefused as e:
                errs.append(str(e))
            refused.set()
        threading.Thread(target=unload_refused, daemon=True).start()
        self.agent.read_until(p.TYPE_ADAPTER_UNLOADED)
        self.agent.send({"t": p.TYPE_ACK, "model": "toy", "adapter": "paint-v1", "reason": "no such adapter"})
        self.assertTrue(refused.wait(5))
        self.assertEqual(errs, ["no such adapter"])

        # The agent restarts: the worker connects again, registers, and
        # announces the adapter it still has loaded.
        assert self.agent.conn is not None
        self.agent.conn.close()
        reg = self.agent.accept()
        self.assertEqual(reg["t"], p.TYPE_REGISTER)
        self.agent.welcome(p.VERSION_2, FEATURES)
        m = self.agent.read_until(p.TYPE_ADAPTER_LOADED)
        self.assertEqual((m["model"], m["adapter"]), ("toy", "paint-v1"))
        self.agent.send({"t": p.TYPE_ACK, "model": "toy", "adapter": "paint-v1"})


if __name__ == "__main__":
    unittest.main()
