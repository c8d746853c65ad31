"""The torch reference worker's sampler: a cached negative-prompt branch
and a resume from a checkpoint each give the uninterrupted, uncached run's
bytes (what the mesh tests rely on); its video model's named tensors,
image, parameter and temporal decoder. Skipped without torch."""
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


@unittest.skipIf(torch is None, "torch is not installed")
class TorchVideoTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        import torch_pipeline as tp
        cls.tp = tp
        d = tempfile.mkdtemp()
        path = os.path.join(d, "w.safetensors")
        tp.write_weights(path)
        cls.p = tp.build(path)

    def conds(self, prompt: str, negative: str):
        tp = self.tp
        c = {"tokens": torch.zeros(tp.TOKENS, tp.DIM), "tokens_neg": torch.zeros(tp.TOKENS, tp.DIM),
             "pooled": torch.zeros(2, tp.POOLED, dtype=torch.float16)}
        n, m = self.p.encode_video(prompt, negative, c)
        return c, n, m

    def latent(self, image, rescale: float = 0.0, prompt: str = "a fox"):
        c, n, m = self.conds(prompt, "blurry")
        out = torch.zeros(3, self.tp.CHANNELS, 2, 2)  # 9 frames: 3 latent frames of 16x16
        self.p.denoise_video(c["tokens"][:n], c["tokens_neg"][:m], c["pooled"], image, 3, 3, 5.0, rescale, out, lambda *a: None)
        return out

    def image(self, v: int):
        img = torch.full((12, 10, 4), v, dtype=torch.uint8)
        img[:, :, 3] = 255
        return img

    def test_token_sequences_have_the_texts_lengths(self) -> None:
        _, n, m = self.conds("abc", "")
        self.assertEqual((n, m), (3, 1))
        _, n, _ = self.conds("x" * 100, "")
        self.assertEqual(n, self.tp.TOKENS)

    def test_image_and_rescale_reach_the_output(self) -> None:
        base = self.latent(self.image(40))
        self.assertTrue(torch.equal(base, self.latent(self.image(40))), "the same inputs, different latents")
        self.assertFalse(torch.equal(base, self.latent(self.image(200))), "the image does not reach the latent")
        self.assertFalse(torch.equal(base, self.latent(self.image(40), rescale=0.7)), "guidance_rescale does nothing")
        z = self.p.image_latent(self.image(40), 2, 2)
        self.assertTrue(torch.equal(base[0], z), "the first latent frame is not the image's latent")

    def test_chunks_decode_as_a_stream(self) -> None:
        """The causal decoder carries its state from chunk to chunk: a
        stream of chunks gives the whole's bytes; a chunk without the state
        is refused, and one with another stream's state differs."""
        lat = self.latent(self.image(90))
        whole = torch.zeros(9, 16, 16, 4, dtype=torch.uint8)
        self.p.decode_video(lat, 0, whole, {})
        parts = [torch.zeros(1, 16, 16, 4, dtype=torch.uint8), torch.zeros(4, 16, 16, 4, dtype=torch.uint8),
                 torch.zeros(4, 16, 16, 4, dtype=torch.uint8)]
        state: dict = {}
        for j, out in enumerate(parts):
            self.p.decode_video(lat[j:j + 1], j, out, state)
        self.assertTrue(torch.equal(whole, torch.cat(parts)), "decoding chunk by chunk differs from decoding whole")
        self.assertFalse(torch.equal(whole[1], whole[2]), "the four frames of a latent frame are one image")
        with self.assertRaises(self.tp.BadInput):
            self.p.decode_video(lat[1:2], 1, parts[1], {})
        other = torch.zeros(4, 16, 16, 4, dtype=torch.uint8)
        self.p.decode_video(lat[1:2], 1, other, {"prev": torch.zeros_like(lat[0:1])})
        self.assertFalse(torch.equal(other, parts[1]), "the state before a chunk does not reach its pixels")

    def test_adapter_changes_the_denoise_deterministically(self) -> None:
        """A LoRA-like adapter of the query projection changes the latent,
        the same way every time; without one the output is the base's."""
        path = os.path.join(tempfile.mkdtemp(), "a.safetensors")
        self.tp.write_adapter(path, 3)
        lora = self.tp.load_adapter(path, torch.device("cpu"))
        cond = torch.zeros(2, self.tp.TOKENS, self.tp.DIM)
        self.p.encode("a fox", "", cond)

        def run(lo):
            out = torch.zeros(1, 4, 8, 8)
            self.p.denoise(cond, 5, 3, 5.0, out, lambda *a: None, lora=lo)
            return out
        base, a1, a2 = run(None), run(lora), run(lora)
        self.assertTrue(torch.equal(a1, a2), "the adapter's output is not deterministic")
        self.assertGreater(float((a1 - base).abs().max()), 1e-3, "the adapter does not change the latent measurably")


if __name__ == "__main__":
    unittest.main()
