"""The torch reference worker's sampler: a cached negative-prompt branch
and a resume from a checkpoint each give the uninterrupted, uncached run's
bytes (what the mesh tests rely on). Skipped without torch."""
from __future__ import annotations

import os
import sys
import tempfile
import unittest

try:
    import torch
except ImportError:  # the SDK does not need torch; this worker does
    torch = None

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "workers"))


@unittest.skipIf(torch is None, "torch is not installed")
class TorchSamplerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        import torch_pipeline as tp
        cls.tp = tp
        d = tempfile.mkdtemp()
        path = os.path.join(d, "w.safetensors")
        tp.write_weights(path)
        cls.p = tp.build(path)

    def cond(self, prompt: str, negative: str) -> "torch.Tensor":
        c = torch.zeros(2, self.tp.TOKENS, self.tp.DIM)
        self.p.encode(prompt, negative, c)
        return c

    def run_denoise(self, cond, steps: int = 8, **kw) -> bytes:
        out = torch.zeros(1, self.tp.CHANNELS, 8, 8)
        self.p.denoise(cond, 5, steps, 5.0, out, kw.pop("each_step", lambda *a: None), **kw)
        return out.numpy().tobytes()

    def test_cached_negative_branch_gives_the_same_bytes(self) -> None:
        cond = self.cond("a red fox", "blurry")
        plain = self.run_denoise(cond)
        packed = self.tp.kv_pack(self.p.unet.branch_kv(cond[1:2].clone()))
        self.assertEqual(packed.size, self.tp.kv_bytes())
        cached = self.run_denoise(cond, uncond_kv=self.tp.kv_unpack(packed.copy()))
        self.assertEqual(cached, plain, "a cached negative branch changed the output")
        other = self.tp.kv_unpack(self.tp.kv_pack(self.p.unet.branch_kv(self.cond("x", "text, watermark")[1:2].clone())))
        self.assertNotEqual(self.run_denoise(cond, uncond_kv=other), plain, "the negative branch does not reach the output")

    def test_resume_from_any_step_gives_the_same_bytes(self) -> None:
        cond = self.cond("a lighthouse", "")
        seen = {}

        def keep(i, steps, before, x) -> None:
            if not before:
                seen[i + 1] = x.clone()

        plain = self.run_denoise(cond, each_step=keep)
        for step in (1, 3, 7):
            got = self.run_denoise(cond, resume=(step, seen[step].clone()))
            self.assertEqual(got, plain, f"a resume after step {step} differs from the uninterrupted run")


if __name__ == "__main__":
    unittest.main()
