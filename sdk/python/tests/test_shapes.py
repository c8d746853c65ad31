"""Protocol version 2's model shapes in the SDK, against a scripted agent on
a real socket: named conditioning tensors (split by the agent, or by the
SDK when the agent does not grant them), a temporal latent, a reference
image and parameters."""
from __future__ import annotations

import os
import sys
import threading
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from latentmesh_engine import protocol as p  # noqa: E402
from latentmesh_engine.worker import (CondTensor, ImageSpec, LatentLayout, Model, Param, Task,  # noqa: E402
                                      Worker)
from test_worker import FakeAgent  # noqa: E402

SHAPES = [p.FEATURE_NAMED_COND, p.FEATURE_TEMPORAL, p.FEATURE_IMAGE, p.FEATURE_PARAMS]
PAYLOAD, LATENT, IMAGE = 0, 1024, 2048  # arena offsets
TOTAL = 580  # the payload of tokens [16, 8] float32 (var_len) and pooled [6] float16, as the Go agent lays it out


def model() -> Model:
    return Model(name="vid", stages=["encode", "denoise", "decode"],
                 conds=[CondTensor("tokens", "float32", [16, 8], var_len=True), CondTensor("pooled", "float16", [6])],
                 latent=LatentLayout("float32", 4, 8, temporal=4), frame_step=4, frame_offset=1,
                 image=ImageSpec(["denoise"], required=True),
                 params=[Param.number("rescale", 0.0, 1.0, 0.25), Param.enum("sampler", ["euler", "unipc"], "euler")])


def spec() -> dict:
    return {"model": "vid", "prompt": "abc", "negative_prompt": "", "seed": 1, "width": 8, "height": 8, "frames": 9,
            "steps": 1, "guidance_scale": 1.0}


def payload_region() -> dict:
    return {"off": PAYLOAD, "len": TOTAL, "dtype": "uint8", "shape": [TOTAL]}


class ShapesTest(unittest.TestCase):
    def start(self, features: list) -> dict:
        self.agent = FakeAgent()
        self.seen: dict = {}
        self.worker = Worker("vid/1", [model()], slots={"encode": 1, "denoise": 1})

        @self.worker.encode
        def encode(t: Task) -> None:
            c = t.conds
            c["tokens"][:3] = np.arange(24, dtype="<f4").reshape(3, 8)
            c["pooled"][:] = np.float16(1.5)
            t.set_len("tokens", 3)

        @self.worker.denoise
        def denoise(t: Task) -> None:
            c = t.conds
            self.seen.update(tokens=c["tokens"].copy(), pooled=c["pooled"].copy(), params=dict(t.params),
                             image=None if t.image is None else t.image.copy())
            t.output[...] = 1

        threading.Thread(target=self.worker.run, args=(self.agent.path,), daemon=True).start()
        reg = self.agent.accept()
        self.agent.welcome(p.VERSION_2, features)
        return reg

    def tearDown(self) -> None:
        if hasattr(self, "agent"):
            self.agent.close()

    def denoise(self, image: bool = True) -> dict:
        task = {"t": p.TYPE_TASK, "task": 2, "stage": "denoise", "model": "vid", "spec": spec(),
                "inputs": [payload_region()], "output": {"off": LATENT, "len": 3 * 4 * 4, "dtype": "float32", "shape": [3, 4, 1, 1]}}
        if image:
            self.agent.write(IMAGE, bytes(range(16)))
            task["ref_image"] = {"off": IMAGE, "len": 16, "dtype": "uint8", "shape": [2, 2, 4]}
        return task

    def test_register_declares_the_shapes(self) -> None:
        reg = self.start(SHAPES)
        self.assertEqual(reg["features"], SHAPES)
        (m,) = reg["models"]
        self.assertEqual(m["cond"], {"dtype": "uint8", "shape": [TOTAL]})
        self.assertEqual(m["conds"][0], {"name": "tokens", "dtype": "float32", "shape": [16, 8], "var_len": True})
        self.assertEqual((m["latent"]["temporal"], m["image"], m["params"][1]["values"]), (4, {"stages": ["denoise"], "required": True}, ["euler", "unipc"]))
        self.assertEqual(model().latent_frames(81), 21)
        self.assertEqual(model().video_frames(20, 1), (77, 4))

    def test_named_tensors_split_by_the_agent(self) -> None:
        self.start(SHAPES)
        named = [{"name": "tokens", "off": PAYLOAD, "len": 512, "dtype": "float32", "shape": [16, 8]},
                 {"name": "pooled", "off": PAYLOAD + 512, "len": 12, "dtype": "float16", "shape": [6]}]
        self.agent.send({"t": p.TYPE_TASK, "task": 1, "stage": "encode", "model": "vid", "spec": spec(), "output": payload_region(),
                         "conds": named, "params": {"rescale": 0.25, "sampler": "euler"}})
        done = self.agent.read_until(p.TYPE_DONE)
        self.assertEqual((done["t"], done.get("lens")), (p.TYPE_DONE, {"tokens": 3}))
        # The agent gives the denoise its named inputs at the encode's lengths.
        named[0].update(len=96, shape=[3, 8])
        task = self.denoise()
        task.update(conds=named, params={"rescale": 0.5, "sampler": "unipc"})
        self.agent.send(task)
        self.assertEqual(self.agent.read_until(p.TYPE_DONE)["t"], p.TYPE_DONE)
        np.testing.assert_array_equal(self.seen["tokens"], np.arange(24, dtype="<f4").reshape(3, 8))
        np.testing.assert_array_equal(self.seen["pooled"], np.full(6, 1.5, dtype="<f2"))
        self.assertEqual(self.seen["params"], {"rescale": 0.5, "sampler": "unipc"})
        self.assertEqual(self.seen["image"].tolist(), np.arange(16, dtype=np.uint8).reshape(2, 2, 4).tolist())

    def test_named_tensors_split_by_the_sdk(self) -> None:
        """An agent that does not grant named_cond moves the same payload
        (cond is uint8 [580]): the SDK lays it out and completes it as the
        agent would, byte for byte."""
        self.start([p.FEATURE_TEMPORAL, p.FEATURE_IMAGE])
        self.agent.write(PAYLOAD, b"\xee" * TOTAL)
        self.agent.send({"t": p.TYPE_TASK, "task": 1, "stage": "encode", "model": "vid", "spec": spec(), "output": payload_region()})
        done = self.agent.read_until(p.TYPE_DONE)
        self.assertEqual(done["t"], p.TYPE_DONE)
        self.assertNotIn("lens", done)
        raw = self.agent.read(PAYLOAD, TOTAL)
        self.assertEqual(raw[:96], np.arange(24, dtype="<f4").tobytes())
        self.assertEqual(raw[96:512], bytes(416), "rows past the length not zeroed")
        self.assertEqual(raw[512:524], np.full(6, 1.5, dtype="<f2").tobytes())
        self.assertEqual(raw[524:576], bytes(52), "padding not zeroed")
        self.assertEqual(raw[576:], (3).to_bytes(4, "little"), "the length not in the trailer")
        self.agent.send(self.denoise())
        self.assertEqual(self.agent.read_until(p.TYPE_DONE)["t"], p.TYPE_DONE)
        self.assertEqual(self.seen["tokens"].shape, (3, 8))
        # Without model_params the task has the model's defaults.
        self.assertEqual(self.seen["params"], {"rescale": 0.25, "sampler": "euler"})

    def test_a_missing_feature_or_image_fails_the_task(self) -> None:
        self.start([p.FEATURE_NAMED_COND, p.FEATURE_IMAGE])  # no temporal_latent
        self.agent.send(self.denoise())
        m = self.agent.read_until(p.TYPE_FAILED)
        self.assertEqual((m["t"], m["code"]), (p.TYPE_FAILED, p.CODE_BAD_INPUT))
        self.assertIn("did not grant temporal_latent", m["reason"])

    def test_a_required_image_missing_fails_the_task(self) -> None:
        self.start(SHAPES)
        self.agent.write(PAYLOAD + 576, (3).to_bytes(4, "little"))
        self.agent.send(self.denoise(image=False))
        m = self.agent.read_until(p.TYPE_FAILED)
        self.assertEqual(m["code"], p.CODE_BAD_INPUT)
        self.assertIn("needs a reference image at denoise", m["reason"])

    def test_declarations_are_checked(self) -> None:
        with self.assertRaises(ValueError):
            Model(name="x", stages=["encode"], conds=[CondTensor("T5", "float32", [4])], latent=LatentLayout("float32", 4, 8))
        with self.assertRaises(ValueError):  # temporal 4 without frames 4k+1
            Model(name="x", stages=["decode"], conds=[CondTensor("t", "float32", [4])], latent=LatentLayout("float32", 4, 8, temporal=4))
        self.assertEqual(p.cond_layout([("tokens", "float32", [16, 8], True), ("pooled", "float16", [6], False)]), ([0, 512], [512, 12], TOTAL))

    def test_a_v1_register_drops_the_shapes(self) -> None:
        self.agent = FakeAgent()
        w = Worker("vid/1", [model()], versions=[p.VERSION_1])
        threading.Thread(target=w.run, args=(self.agent.path,), daemon=True).start()
        (m,) = self.agent.accept()["models"]
        self.assertFalse({"conds", "image", "params"} & set(m))
        self.assertNotIn("temporal", m["latent"])


if __name__ == "__main__":
    unittest.main()
