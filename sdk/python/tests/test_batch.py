"""The SDK's batching (protocol v2, Model.batch) against the scripted agent
of test_worker: a batch's members reach one call of the batch callback once
all have come, each is answered on its own, a member cancelled mid-call
leaves it alone, and without a batch callback the members run one by one."""
from __future__ import annotations

import os
import sys
import threading
import time
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from latentmesh_engine import protocol as p  # noqa: E402
from latentmesh_engine.worker import BadInput, Batch, LatentLayout, Layout, Model, Worker  # noqa: E402
from test_worker import FakeAgent, region, spec  # noqa: E402


class BatchTest(unittest.TestCase):
    def setUp(self) -> None:
        self.agent = FakeAgent()
        model = Model(name="toy", stages=["denoise", "decode"], cond=Layout("float32", [4]),
                      latent=LatentLayout("float32", 4, 8), batch={"denoise": 4})
        self.worker = Worker("toy-engine", [model], slots={"denoise": 1, "decode": 1})
        self.calls: list = []
        self.block = False
        self.started, self.go_on = threading.Event(), threading.Event()

        @self.worker.denoise_batch
        def denoise(b: Batch) -> None:
            self.calls.append(sorted(t.id for t in b.tasks))
            for t in list(b.tasks):
                if t.spec.seed == 13:
                    b.leave(t, BadInput("seed 13 is unlucky"))
            for i in range(4):
                if i == 1 and self.block:
                    self.started.set()
                    self.go_on.wait(5)
                b.prune()
                b.progress(i + 1, 4)
            for t in b.tasks:
                t.output[...] = t.spec.seed

        self.thread = threading.Thread(target=self.worker.run_forever, args=(self.agent.path, 0.01, 0.05), daemon=True)
        self.thread.start()
        reg = self.agent.accept()
        self.assertIn(p.FEATURE_BATCH, reg["features"])
        self.assertEqual(reg["models"][0]["batch"], {"denoise": 4})
        self.agent.welcome(p.VERSION_2, [p.FEATURE_BATCH])

    def tearDown(self) -> None:
        self.worker.close()
        self.agent.close()
        self.thread.join(5)

    def task(self, tid: int, seed: int, batch: int = 0, size: int = 0) -> None:
        s = spec()
        s["seed"] = seed
        m = {"t": p.TYPE_TASK, "task": tid, "stage": "denoise", "model": "toy", "spec": s,
             "inputs": [region(0, [4])], "output": region(64 * tid, [1, 4, 1, 1])}
        if batch:
            m["batch"], m["batch_size"] = batch, size
        self.agent.send(m)

    def answers(self, n: int) -> dict:
        got = {}
        while len(got) < n:
            m = self.agent.read_until(p.TYPE_DONE)  # or failed
            got[m["task"]] = m
        return got

    def output(self, tid: int) -> float:
        return float(np.frombuffer(self.agent.read(64 * tid, 4), dtype="<f4")[0])

    def test_members_run_in_one_call_each_answered(self) -> None:
        for tid, seed in ((1, 1), (2, 13), (3, 3)):
            self.task(tid, seed, batch=5, size=3)
        got = self.answers(3)
        self.assertEqual(self.calls, [[1, 2, 3]])
        self.assertEqual(got[1]["t"], p.TYPE_DONE)
        self.assertEqual((got[2]["t"], got[2]["code"]), (p.TYPE_FAILED, p.CODE_BAD_INPUT))
        self.assertEqual(got[3]["t"], p.TYPE_DONE)
        self.assertEqual((self.output(1), self.output(3)), (1.0, 3.0))

    def test_a_cancelled_member_leaves_alone(self) -> None:
        self.block = True
        self.task(1, 1, batch=6, size=2)
        self.task(2, 2, batch=6, size=2)
        self.assertTrue(self.started.wait(5))
        self.agent.send({"t": p.TYPE_CANCEL, "task": 2})
        time.sleep(0.05)  # the worker's reader marks it cancelled
        self.go_on.set()
        got = self.answers(2)
        self.assertEqual(got[1]["t"], p.TYPE_DONE)
        self.assertEqual((got[2]["t"], got[2]["code"]), (p.TYPE_FAILED, p.CODE_CANCELLED))
        self.assertEqual(self.calls, [[1, 2]])

    def test_a_lone_task_runs_as_a_batch_of_one(self) -> None:
        self.task(1, 5)  # no batch fields: its window passed with no other task
        got = self.answers(1)
        self.assertEqual(got[1]["t"], p.TYPE_DONE)
        self.assertEqual((self.calls, self.output(1)), ([[1]], 5.0))


if __name__ == "__main__":
    unittest.main()
