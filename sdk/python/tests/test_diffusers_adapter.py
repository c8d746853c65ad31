"""The diffusers adapter (examples/diffusers_adapter.py) against stand-in
pipelines: diffusers is not installed here, so each family's pipeline is
faked with diffusers' own call signatures (parameter names copied from its
source: an unknown keyword is a TypeError, as in diffusers) and attribute
names (encode_prompt, __call__'s hooks, vae.decode, vae.config, scheduler,
_interrupt). The adapter runs as a worker against the scripted agent of
test_worker, so what it writes lands in a real arena.

What this cannot show: that real pipelines produce images (no weights, no
GPU, no diffusers here); that the stand-ins' arithmetic is diffusers'."""
from __future__ import annotations

import inspect
import json
import os
import sys
import threading
import time
import unittest
from typing import Any, Dict, List, Optional

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import diffusers_adapter as da  # noqa: E402
from latentmesh_engine import protocol as p  # noqa: E402
from test_worker import FakeAgent  # noqa: E402

FEATURES = [p.FEATURE_CHECKPOINT, p.FEATURE_NAMED_COND, p.FEATURE_TEMPORAL, p.FEATURE_PARAMS, p.FEATURE_DECODE_STATE]
PAYLOAD, LATENT, OUT, CKBUF, RESUME = 0, 8192, 16384, 32768, 40960  # arena offsets
SEQ, DIM, POOLED, CH, SCALE = 6, 8, 4, 4, 2  # the stand-ins' sizes: text rows, widths, latent channels, VAE scale


class Config(dict):
    """diffusers' FrozenDict: a dict whose keys read as attributes."""

    def __getattr__(self, k: str) -> Any:
        try:
            return self[k]
        except KeyError:
            raise AttributeError(k) from None


def embed(text: str, rows: int, dim: int, dtype: torch.dtype, used: Optional[int] = None) -> torch.Tensor:
    """A stand-in text encoder: rows [0, used) a function of the text, the
    rest zeros; batch 1."""
    used = rows if used is None else used
    base = (sum(text.encode()) % 97 + 1) / 100
    t = torch.zeros(rows, dim)
    t[:used] = base + torch.arange(used * dim, dtype=torch.float32).view(used, dim) / 64
    return t.to(dtype).unsqueeze(0)


def words(text: str) -> int:
    """A stand-in tokenizer's length: a token a word, and one more."""
    return len(text.split()) + 1


# --- schedulers ---

class FlowMatchEulerDiscreteScheduler:
    """Flow matching Euler: each sigma shifted on its own, a terminal 0."""

    def __init__(self, **cfg: Any) -> None:
        self.config = Config({"num_train_timesteps": 1000, "shift": 1.0, **cfg})
        self.sigma_max, self.sigma_min = 1.0, 0.001

    @classmethod
    def from_config(cls, config: Dict[str, Any], **kw: Any) -> "FlowMatchEulerDiscreteScheduler":
        return cls(**{**config, **kw})

    def set_timesteps(self, num_inference_steps: Optional[int] = None, device: Any = None,
                      sigmas: Optional[List[float]] = None, mu: Optional[float] = None) -> None:
        s = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps) if sigmas is None else np.array(sigmas, np.float32)
        k = self.config.shift
        s = torch.from_numpy(k * s / (1 + (k - 1) * s)).float()
        self.timesteps, self.sigmas, self.index = s * 1000, torch.cat([s, torch.zeros(1)]), 0

    def step(self, out: torch.Tensor, t: Any, x: torch.Tensor) -> torch.Tensor:
        d = self.sigmas[self.index + 1] - self.sigmas[self.index]
        self.index += 1
        return (x.float() + d * out.float()).to(x.dtype)


class UniPCMultistepScheduler(FlowMatchEulerDiscreteScheduler):
    pass


class PNDMScheduler(FlowMatchEulerDiscreteScheduler):
    init_noise_sigma = 1.0


# --- VAEs ---

class FakeVAE:
    """decode(z) -> (image in [-1, 1],): the first three channels, tanh,
    upsampled; a 5D latent [1, C, F, h, w] decodes causally (video frame
    of latent frame j: the sum of latent frames <= j), 1 + temporal (F-1)
    video frames. Records what it was given."""

    def __init__(self, cfg: Dict[str, Any], temporal: int = 0) -> None:
        self.config, self.dtype, self.temporal, self.seen = Config(cfg), torch.float32, temporal, []

    def decode(self, z: torch.Tensor, return_dict: bool = True) -> tuple:
        self.seen.append(z.clone())
        up = lambda x: x.repeat_interleave(SCALE, -2).repeat_interleave(SCALE, -1)  # noqa: E731
        if z.dim() == 4:
            return (torch.tanh(up(z[:, :3].float())),)
        acc = torch.cumsum(z[:, :3].float(), dim=2)
        frames = [acc[:, :, :1]] + [acc[:, :, j:j + 1] + 0.05 * r for j in range(1, z.shape[2]) for r in range(self.temporal)]
        return (torch.tanh(up(torch.cat(frames, dim=2))),)


# --- pipelines: a base with the denoising loop every diffusers pipeline runs ---

class FakePipeline:
    vae_scale_factor = SCALE

    def __init__(self, scheduler: Any, vae: FakeVAE, step_s: float = 0.0) -> None:
        self.scheduler, self.vae, self.step_s = scheduler, vae, step_s
        self._interrupt = False
        self.calls: List[Dict[str, Any]] = []
        self.encodes: List[Dict[str, Any]] = []
        self.ran: List[int] = []  # steps run by the last call

    def __call__(self, **kw: Any) -> tuple:
        inspect.signature(self.signature).bind(**kw)  # diffusers' keywords only
        self.calls.append(kw)
        self._interrupt, self.ran = False, []
        n, sigmas = kw["num_inference_steps"], kw.get("sigmas")
        self.scheduler.set_timesteps(num_inference_steps=None if sigmas is not None else n, sigmas=sigmas)
        x = kw["latents"] * getattr(self.scheduler, "init_noise_sigma", 1.0)
        cond = float(kw["prompt_embeds"].float().mean())
        for i, t in enumerate(self.scheduler.timesteps):
            if self._interrupt:
                continue
            self.ran.append(i)
            time.sleep(self.step_s)
            x = self.scheduler.step(x.float() * 0.5 + cond + float(t) / 1000, t, x)
            cb = kw.get("callback_on_step_end")
            if cb is not None:
                x = cb(self, i, t, {k: x for k in kw["callback_on_step_end_tensor_inputs"]}).pop("latents", x)
        return (x,)

    def signature(self) -> None:
        raise NotImplementedError


class FluxPipeline(FakePipeline):
    def encode_prompt(self, prompt, prompt_2=None, device=None, num_images_per_prompt=1, prompt_embeds=None,
                      pooled_prompt_embeds=None, max_sequence_length=512, lora_scale=None):
        self.encodes.append(dict(prompt=prompt, prompt_2=prompt_2, max_sequence_length=max_sequence_length))
        return (embed(prompt, max_sequence_length, DIM, torch.bfloat16), embed(prompt, 1, POOLED, torch.bfloat16)[0],
                torch.zeros(max_sequence_length, 3))

    def signature(self, prompt=None, prompt_2=None, negative_prompt=None, negative_prompt_2=None, true_cfg_scale=1.0,
                  height=None, width=None, num_inference_steps=28, sigmas=None, guidance_scale=3.5,
                  num_images_per_prompt=1, generator=None, latents=None, prompt_embeds=None, pooled_prompt_embeds=None,
                  ip_adapter_image=None, ip_adapter_image_embeds=None, negative_ip_adapter_image=None,
                  negative_ip_adapter_image_embeds=None, negative_prompt_embeds=None,
                  negative_pooled_prompt_embeds=None, output_type="pil", return_dict=True, joint_attention_kwargs=None,
                  callback_on_step_end=None, callback_on_step_end_tensor_inputs=["latents"], max_sequence_length=512):
        pass


class StableDiffusion3Pipeline(FakePipeline):
    def encode_prompt(self, prompt, prompt_2, prompt_3, device=None, num_images_per_prompt=1,
                      do_classifier_free_guidance=True, negative_prompt=None, negative_prompt_2=None,
                      negative_prompt_3=None, prompt_embeds=None, negative_prompt_embeds=None,
                      pooled_prompt_embeds=None, negative_pooled_prompt_embeds=None, clip_skip=None,
                      max_sequence_length=256, lora_scale=None):
        self.encodes.append(dict(prompt=prompt, negative_prompt=negative_prompt, max_sequence_length=max_sequence_length))
        rows = 2 + max_sequence_length  # CLIP's tokens, then T5's
        return (embed(prompt, rows, DIM, torch.float16), embed(negative_prompt, rows, DIM, torch.float16),
                embed(prompt, 1, POOLED, torch.float16)[0], embed(negative_prompt, 1, POOLED, torch.float16)[0])

    def signature(self, prompt=None, prompt_2=None, prompt_3=None, height=None, width=None, num_inference_steps=28,
                  sigmas=None, guidance_scale=7.0, negative_prompt=None, negative_prompt_2=None,
                  negative_prompt_3=None, num_images_per_prompt=1, generator=None, latents=None, prompt_embeds=None,
                  negative_prompt_embeds=None, pooled_prompt_embeds=None, negative_pooled_prompt_embeds=None,
                  ip_adapter_image=None, ip_adapter_image_embeds=None, output_type="pil", return_dict=True,
                  joint_attention_kwargs=None, clip_skip=None, callback_on_step_end=None,
                  callback_on_step_end_tensor_inputs=["latents"], max_sequence_length=256, skip_guidance_layers=None,
                  skip_layer_guidance_scale=2.8, skip_layer_guidance_stop=0.2, skip_layer_guidance_start=0.01,
                  mu=None):
        pass


class WanPipeline(FakePipeline):
    vae_scale_factor_spatial, vae_scale_factor_temporal = SCALE, 4

    def encode_prompt(self, prompt, negative_prompt=None, do_classifier_free_guidance=True, num_videos_per_prompt=1,
                      prompt_embeds=None, negative_prompt_embeds=None, max_sequence_length=226, device=None,
                      dtype=None):
        self.encodes.append(dict(prompt=prompt, negative_prompt=negative_prompt, max_sequence_length=max_sequence_length))
        # umT5 at the text's length, zero rows after (as _get_t5_prompt_embeds pads)
        return tuple(embed(t, max_sequence_length, DIM, torch.bfloat16, used=min(words(t), max_sequence_length))
                     for t in (prompt, negative_prompt))

    def signature(self, prompt=None, negative_prompt=None, height=480, width=832, num_frames=81,
                  num_inference_steps=50, guidance_scale=5.0, guidance_scale_2=None, num_videos_per_prompt=1,
                  generator=None, latents=None, prompt_embeds=None, negative_prompt_embeds=None, output_type="np",
                  return_dict=True, attention_kwargs=None, callback_on_step_end=None,
                  callback_on_step_end_tensor_inputs=["latents"], max_sequence_length=512):
        pass


class QwenImagePipeline(FakePipeline):
    def encode_prompt(self, prompt, device=None, num_images_per_prompt=1, prompt_embeds=None, prompt_embeds_mask=None,
                      max_sequence_length=1024):
        self.encodes.append(dict(prompt=prompt, max_sequence_length=max_sequence_length))
        used = min(words(prompt), max_sequence_length)
        return embed(prompt, used, DIM, torch.bfloat16), None  # no mask: every row is the text's

    def signature(self, prompt=None, negative_prompt=None, true_cfg_scale=4.0, height=None, width=None,
                  num_inference_steps=50, sigmas=None, guidance_scale=None, num_images_per_prompt=1, generator=None,
                  latents=None, prompt_embeds=None, prompt_embeds_mask=None, negative_prompt_embeds=None,
                  negative_prompt_embeds_mask=None, output_type="pil", return_dict=True, attention_kwargs=None,
                  callback_on_step_end=None, callback_on_step_end_tensor_inputs=["latents"], max_sequence_length=512):
        pass


class StableDiffusionPipeline(FakePipeline):
    def encode_prompt(self, prompt, device, num_images_per_prompt, do_classifier_free_guidance, negative_prompt=None,
                      prompt_embeds=None, negative_prompt_embeds=None, lora_scale=None, clip_skip=None):
        self.encodes.append(dict(prompt=prompt, negative_prompt=negative_prompt, cfg=do_classifier_free_guidance))
        return embed(prompt, 5, DIM, torch.float16), embed(negative_prompt or "", 5, DIM, torch.float16)

    def signature(self, prompt=None, height=None, width=None, num_inference_steps=50, timesteps=None, sigmas=None,
                  guidance_scale=7.5, negative_prompt=None, num_images_per_prompt=1, eta=0.0, generator=None,
                  latents=None, prompt_embeds=None, negative_prompt_embeds=None, ip_adapter_image=None,
                  ip_adapter_image_embeds=None, output_type="pil", return_dict=True, cross_attention_kwargs=None,
                  guidance_rescale=0.0, clip_skip=None, callback_on_step_end=None,
                  callback_on_step_end_tensor_inputs=["latents"], **kwargs):
        pass


class StableDiffusionXLPipeline(FakePipeline):
    def encode_prompt(self, prompt, prompt_2=None, device=None, num_images_per_prompt=1,
                      do_classifier_free_guidance=True, negative_prompt=None, negative_prompt_2=None,
                      prompt_embeds=None, negative_prompt_embeds=None, pooled_prompt_embeds=None,
                      negative_pooled_prompt_embeds=None, lora_scale=None, clip_skip=None):
        self.encodes.append(dict(prompt=prompt, negative_prompt=negative_prompt))
        zero = negative_prompt is None  # force_zeros_for_empty_prompt
        neg = torch.zeros(1, 5, DIM, dtype=torch.float16) if zero else embed(negative_prompt, 5, DIM, torch.float16)
        npool = torch.zeros(1, POOLED, dtype=torch.float16) if zero else embed(negative_prompt, 1, POOLED, torch.float16)[0]
        return embed(prompt, 5, DIM, torch.float16), neg, embed(prompt, 1, POOLED, torch.float16)[0], npool

    def signature(self, prompt=None, prompt_2=None, height=None, width=None, num_inference_steps=50, timesteps=None,
                  sigmas=None, denoising_end=None, guidance_scale=5.0, negative_prompt=None, negative_prompt_2=None,
                  num_images_per_prompt=1, eta=0.0, generator=None, latents=None, prompt_embeds=None,
                  negative_prompt_embeds=None, pooled_prompt_embeds=None, negative_pooled_prompt_embeds=None,
                  ip_adapter_image=None, ip_adapter_image_embeds=None, output_type="pil", return_dict=True,
                  cross_attention_kwargs=None, guidance_rescale=0.0, original_size=None, crops_coords_top_left=(0, 0),
                  target_size=None, negative_original_size=None, negative_crops_coords_top_left=(0, 0),
                  negative_target_size=None, clip_skip=None, callback_on_step_end=None,
                  callback_on_step_end_tensor_inputs=["latents"], **kwargs):
        pass


MEAN, STD = [0.1 * i for i in range(CH)], [1.0 + 0.5 * i for i in range(CH)]


def fake(family: str, step_s: float = 0.0) -> FakePipeline:
    flow = FlowMatchEulerDiscreteScheduler
    if family == "flux":
        return FluxPipeline(flow(), FakeVAE({"latent_channels": CH, "scaling_factor": 0.3611, "shift_factor": 0.1159}), step_s)
    if family == "sd3":
        return StableDiffusion3Pipeline(flow(shift=3.0), FakeVAE({"latent_channels": CH, "scaling_factor": 1.5305, "shift_factor": 0.0609}), step_s)
    if family == "wan":
        return WanPipeline(UniPCMultistepScheduler(flow_shift=3.0), FakeVAE({"z_dim": CH, "latents_mean": MEAN, "latents_std": STD}, 4), step_s)
    if family == "qwen-image":
        return QwenImagePipeline(flow(), FakeVAE({"z_dim": CH, "latents_mean": MEAN, "latents_std": STD}, 1), step_s)
    if family == "sd15":
        return StableDiffusionPipeline(PNDMScheduler(), FakeVAE({"latent_channels": CH, "scaling_factor": 0.18215}), step_s)
    return StableDiffusionXLPipeline(PNDMScheduler(), FakeVAE({"latent_channels": CH, "scaling_factor": 0.13025}), step_s)


def spec(frames: int = 1, steps: int = 4, seed: int = 11, negative: str = "blurry") -> dict:
    return {"model": "m", "prompt": "a red fox", "negative_prompt": negative, "seed": seed, "width": 8, "height": 8,
            "frames": frames, "steps": steps, "guidance_scale": 3.5}


def tensor_at(raw: bytes, dtype: str, shape: List[int]) -> torch.Tensor:
    t = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "uint8": torch.uint8}[dtype]
    return torch.frombuffer(bytearray(raw), dtype=t).view(shape)


class Session:
    """A DiffusersEngine's worker and the scripted agent it serves."""

    def __init__(self, family: str, step_s: float = 0.0, checkpoint_every: int = 0) -> None:
        self.pipe = fake(family, step_s)
        self.eng = da.DiffusersEngine(self.pipe, da.FAMILIES[family], "m", max_sequence_length=SEQ,
                                      checkpoint_every=checkpoint_every)
        self.agent = FakeAgent()
        self.worker = self.eng.worker()
        threading.Thread(target=self.worker.run, args=(self.agent.path,), daemon=True).start()
        self.reg = self.agent.accept()
        self.agent.welcome(p.VERSION_2, FEATURES)
        self.m = self.eng.model
        self.offs, self.sizes, self.total = self.m.cond_layout()
        self.ids = 0
        self.params = {q.name: q.default for q in self.m.params or []}

    def close(self) -> None:
        self.agent.close()

    def run(self, task: dict, answer: Optional[Any] = None) -> tuple:
        """Sends task; returns (its done or failed frame, the frames before
        it). answer(frame) may send frames back."""
        self.ids += 1
        task.update(t=p.TYPE_TASK, task=self.ids, model="m", params=self.params)
        self.agent.send(task)
        seen = []
        assert self.agent.reader is not None
        while True:
            m = self.agent.reader.read()
            if m.get("task") != self.ids:
                continue
            if m["t"] in (p.TYPE_DONE, p.TYPE_FAILED):
                return m, seen
            seen.append(m)
            if answer is not None:
                answer(m)

    def named(self, lens: Optional[Dict[str, int]] = None) -> List[dict]:
        """The named regions of the payload at PAYLOAD, at lens (or the maximum)."""
        out = []
        for c, off, n in zip(self.m.conds or [], self.offs, self.sizes):
            shape = list(c.shape)
            if lens and c.name in lens:
                n = n // shape[0] * lens[c.name]
                shape[0] = lens[c.name]
            out.append({"name": c.name, "off": PAYLOAD + off, "len": n, "dtype": c.dtype, "shape": shape})
        return out

    def encode(self, s: dict) -> dict:
        whole = {"off": PAYLOAD, "len": self.total, "dtype": "uint8", "shape": [self.total]}
        done, _ = self.run({"stage": "encode", "spec": s, "output": whole, "conds": self.named()})
        assert done["t"] == p.TYPE_DONE, done
        return done.get("lens") or {}

    def cond(self, name: str, n: Optional[int] = None) -> torch.Tensor:
        r = next(r for r in self.named({name: n} if n else None) if r["name"] == name)
        return tensor_at(self.agent.read(r["off"], r["len"]), r["dtype"], r["shape"])

    def latent_region(self, frames: int, off: int = LATENT) -> dict:
        shape = [frames, CH, 8 // SCALE, 8 // SCALE]
        size = {"float32": 4, "float16": 2, "bfloat16": 2}[self.m.latent.dtype] * int(np.prod(shape))
        return {"off": off, "len": size, "dtype": self.m.latent.dtype, "shape": shape}

    def denoise(self, s: dict, lens: Dict[str, int], answer: Optional[Any] = None, **extra: Any) -> tuple:
        whole = {"off": PAYLOAD, "len": self.total, "dtype": "uint8", "shape": [self.total]}
        frames = self.m.latent_frames(s["frames"])
        task = {"stage": "denoise", "spec": s, "inputs": [whole], "output": self.latent_region(frames),
                "conds": self.named(lens)}
        task.update(extra)
        return self.run(task, answer)

    def latent(self, frames: int, off: int = LATENT) -> torch.Tensor:
        r = self.latent_region(frames, off)
        return tensor_at(self.agent.read(off, r["len"]), r["dtype"], r["shape"])


class DiffusersAdapterTest(unittest.TestCase):
    def session(self, family: str, **kw: Any) -> Session:
        s = Session(family, **kw)
        self.addCleanup(s.close)
        return s

    def test_flux_stage_by_stage(self) -> None:
        """FLUX: T5 and pooled CLIP of the prompt and the negative prompt
        into their named regions; the pipeline called with them, seeded
        packed noise and the latent hooks; the latent unpacked into the
        arena; the VAE given latents / scaling_factor + shift_factor."""
        s = self.session("flux")
        conds = {c["name"]: (c["dtype"], c["shape"], c.get("var_len", False)) for c in s.reg["models"][0]["conds"]}
        self.assertEqual(conds, {"t5": ("bfloat16", [SEQ, DIM], False), "clip_pooled": ("bfloat16", [POOLED], False),
                                 "t5_neg": ("bfloat16", [SEQ, DIM], False), "clip_pooled_neg": ("bfloat16", [POOLED], False)})
        m = s.reg["models"][0]
        self.assertEqual((m["latent"], m["side_multiple"]), ({"dtype": "bfloat16", "channels": CH, "scale": SCALE}, 2 * SCALE))
        self.assertEqual(m["params"], [{"name": "true_cfg_scale", "type": "number", "default": 1.0, "min": 1.0, "max": 20.0}])
        self.assertEqual(m["checkpoint"]["sampler"], "diffusers/flux/FlowMatchEulerDiscreteScheduler/1")

        self.assertEqual(s.encode(spec()), {})
        self.assertEqual(s.pipe.encodes[-2:], [dict(prompt="a red fox", prompt_2=None, max_sequence_length=SEQ),
                                              dict(prompt="blurry", prompt_2=None, max_sequence_length=SEQ)])
        torch.testing.assert_close(s.cond("t5"), embed("a red fox", SEQ, DIM, torch.bfloat16)[0], rtol=0, atol=0)
        torch.testing.assert_close(s.cond("clip_pooled_neg"), embed("blurry", 1, POOLED, torch.bfloat16)[0, 0], rtol=0, atol=0)

        s.params = {"true_cfg_scale": 2.5}
        done, frames = s.denoise(spec(), {})
        self.assertEqual(done["t"], p.TYPE_DONE, done)
        self.assertEqual([(f["step"], f["total"]) for f in frames if f["t"] == p.TYPE_PROGRESS], [(1, 4), (2, 4), (3, 4), (4, 4)])
        kw = s.pipe.calls[-1]
        self.assertEqual(sorted(kw), sorted(["height", "width", "num_inference_steps", "output_type", "return_dict", "latents",
                                             "callback_on_step_end_tensor_inputs", "prompt_embeds", "pooled_prompt_embeds",
                                             "negative_prompt_embeds", "negative_pooled_prompt_embeds", "max_sequence_length",
                                             "guidance_scale", "true_cfg_scale", "sigmas", "callback_on_step_end"]))
        self.assertEqual((kw["output_type"], kw["return_dict"], kw["height"], kw["width"], kw["num_inference_steps"]),
                         ("latent", False, 8, 8, 4))
        self.assertEqual((kw["guidance_scale"], kw["true_cfg_scale"], kw["max_sequence_length"]), (3.5, 2.5, SEQ))
        torch.testing.assert_close(kw["prompt_embeds"], embed("a red fox", SEQ, DIM, torch.bfloat16), rtol=0, atol=0)
        torch.testing.assert_close(kw["negative_pooled_prompt_embeds"], embed("blurry", 1, POOLED, torch.bfloat16)[0:1, 0], rtol=0, atol=0)
        g = torch.Generator("cpu").manual_seed(11)
        seeded = torch.randn((1, CH, 4, 4), generator=g, dtype=torch.bfloat16)
        self.assertEqual(tuple(kw["latents"].shape), (1, 4, 4 * CH), "latents not packed in 2x2 patches")
        torch.testing.assert_close(kw["latents"], da.pack_2x2(seeded), rtol=0, atol=0)
        np.testing.assert_allclose(kw["sigmas"], np.linspace(1.0, 0.25, 4))
        final = self.rerun(s.pipe, kw)
        torch.testing.assert_close(s.latent(1), da.unpack_2x2(final, 4, 4), rtol=0, atol=0)

        lat = s.latent(1).clone()
        out = {"off": OUT, "len": 8 * 8 * 4, "dtype": "uint8", "shape": [1, 8, 8, 4]}
        done, _ = s.run({"stage": "decode", "spec": spec(), "inputs": [s.latent_region(1)], "output": out, "frames": 1})
        self.assertEqual(done["t"], p.TYPE_DONE, done)
        torch.testing.assert_close(s.pipe.vae.seen[-1], lat / 0.3611 + 0.1159, rtol=0, atol=0)
        img = torch.tanh((lat / 0.3611 + 0.1159)[:, :3].float().repeat_interleave(2, -2).repeat_interleave(2, -1))
        want = np.round(np.clip(img.permute(0, 2, 3, 1).numpy() / 2 + 0.5, 0, 1) * 255).astype(np.uint8)
        got = np.frombuffer(s.agent.read(OUT, 256), np.uint8).reshape(1, 8, 8, 4)
        np.testing.assert_array_equal(got[..., :3], want)
        self.assertTrue((got[..., 3] == 255).all())

    def rerun(self, pipe: FakePipeline, kw: Dict[str, Any]) -> torch.Tensor:
        """The stand-in pipeline's own output for kw, without the callback."""
        kw = dict(kw, callback_on_step_end=None)
        return pipe(**kw)[0]

    def test_each_family_gets_its_keywords(self) -> None:
        """Per family: the named tensors the encode writes (lengths of the
        variable ones), the keywords reaching __call__ (names checked
        against diffusers' signature by the stand-in), the noise's layout,
        and the parameters where they belong."""
        cases = {
            "sd3": ({}, {"prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds",
                         "max_sequence_length", "guidance_scale", "sigmas"}, (1, CH, 4, 4)),
            "wan": ({"context": 4, "context_neg": 3}, {"prompt_embeds", "negative_prompt_embeds", "max_sequence_length",
                                                        "guidance_scale", "num_frames"}, (1, CH, 3, 4, 4)),
            "qwen-image": ({"text": 4, "text_neg": 3}, {"prompt_embeds", "negative_prompt_embeds", "max_sequence_length",
                                                         "true_cfg_scale", "sigmas"}, (1, 4, 4 * CH)),
            "sd15": ({}, {"prompt_embeds", "negative_prompt_embeds", "guidance_scale", "guidance_rescale"}, (1, CH, 4, 4)),
            "sdxl": ({}, {"prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds",
                          "guidance_scale", "guidance_rescale"}, (1, CH, 4, 4)),
        }
        common = {"height", "width", "num_inference_steps", "output_type", "return_dict", "latents",
                  "callback_on_step_end", "callback_on_step_end_tensor_inputs"}
        for family, (lens_want, keys, noise_shape) in cases.items():
            with self.subTest(family=family):
                s = Session(family)
                try:
                    frames = 9 if family == "wan" else 1
                    negative = "" if family == "sdxl" else "blurry text"
                    lens = s.encode(spec(frames, negative=negative))
                    self.assertEqual(lens, lens_want)
                    done, _ = s.denoise(spec(frames, negative=negative), lens)
                    self.assertEqual(done["t"], p.TYPE_DONE, done)
                    kw = s.pipe.calls[-1]
                    self.assertEqual(set(kw), common | keys)
                    self.assertEqual(tuple(kw["latents"].shape), noise_shape)
                    enc = s.pipe.encodes[-1]
                    if family == "wan":  # zero-padded back to the maximum: what encode_prompt gave
                        self.assertEqual(kw["num_frames"], 9)
                        torch.testing.assert_close(kw["prompt_embeds"], embed("a red fox", SEQ, DIM, torch.bfloat16, used=4), rtol=0, atol=0)
                        torch.testing.assert_close(kw["negative_prompt_embeds"], embed("blurry text", SEQ, DIM, torch.bfloat16, used=3), rtol=0, atol=0)
                        g = torch.Generator("cpu").manual_seed(11)
                        torch.testing.assert_close(kw["latents"], torch.randn(noise_shape, generator=g), rtol=0, atol=0)
                        self.assertEqual(tuple(s.latent(3).shape), (3, CH, 4, 4))
                        self.assertEqual(s.pipe.scheduler.config["flow_shift"], 3.0)
                    if family == "qwen-image":  # at the text's length, no guidance_scale: true CFG
                        torch.testing.assert_close(kw["prompt_embeds"], embed("a red fox", 4, DIM, torch.bfloat16), rtol=0, atol=0)
                        self.assertEqual(tuple(kw["negative_prompt_embeds"].shape), (1, 3, DIM))
                        self.assertEqual(kw["true_cfg_scale"], 4.0)
                    if family == "sd3":
                        self.assertEqual((enc["negative_prompt"], enc["max_sequence_length"]), ("blurry text", SEQ))
                        self.assertEqual(tuple(kw["prompt_embeds"].shape), (1, 2 + SEQ, DIM))
                        self.assertEqual(s.pipe.scheduler.config["shift"], 3.0)
                    if family == "sdxl":  # "" -> None: force_zeros_for_empty_prompt's zeros
                        self.assertIsNone(enc["negative_prompt"])
                        self.assertEqual(float(kw["negative_prompt_embeds"].abs().sum()), 0.0)
                    if family in ("sd15", "sdxl"):
                        self.assertEqual(kw["guidance_rescale"], 0.0)
                finally:
                    s.close()

    def test_scheduler_params_rebuild_the_scheduler(self) -> None:
        s = self.session("sd3")
        base = s.pipe.scheduler
        s.encode(spec())
        s.params = {"shift": 5.0}
        done, _ = s.denoise(spec(), {})
        self.assertEqual(done["t"], p.TYPE_DONE, done)
        self.assertIsNot(s.pipe.scheduler, base)
        self.assertEqual(s.pipe.scheduler.config["shift"], 5.0)
        self.assertEqual(base.config["shift"], 3.0, "the loaded scheduler changed")
        s.params = {"shift": 3.0}
        s.denoise(spec(), {})
        self.assertIs(s.pipe.scheduler, base)

    def test_cancel_and_stop_interrupt_the_pipeline(self) -> None:
        """A cancel reaches the pipeline as _interrupt at the next step's
        callback: the remaining steps are skipped, the task fails cancelled.
        A stop checkpoints the step just done, then interrupts."""
        s = self.session("flux", step_s=0.02)
        s.encode(spec())

        def cancel_at_2(m: dict) -> None:
            if m["t"] == p.TYPE_PROGRESS and m["step"] == 2:
                s.agent.send({"t": p.TYPE_CANCEL, "task": m["task"]})

        done, frames = s.denoise(spec(steps=20), {}, cancel_at_2)
        self.assertEqual((done["t"], done["code"]), (p.TYPE_FAILED, p.CODE_CANCELLED))
        self.assertTrue(s.pipe._interrupt)
        steps = [f["step"] for f in frames if f["t"] == p.TYPE_PROGRESS]
        self.assertLessEqual(max(steps), 4, f"went on to step {max(steps)} after a cancel at step 2")
        self.assertEqual(len(s.pipe.ran), max(steps), "the pipeline ran steps it did not report")

        def stop_at_3(m: dict) -> None:
            if m["t"] == p.TYPE_PROGRESS and m["step"] == 3:
                s.agent.send({"t": p.TYPE_STOP, "task": m["task"]})
            if m["t"] == p.TYPE_CHECKPOINT:
                s.agent.send({"t": p.TYPE_CHECKPOINTED, "task": m["task"], "step": m["step"]})

        done, frames = s.denoise(spec(steps=20), {}, stop_at_3, checkpoint_buf=s.latent_region(1, CKBUF))
        self.assertEqual((done["t"], done["code"]), (p.TYPE_FAILED, p.CODE_STOPPED))
        (ck,) = [f for f in frames if f["t"] == p.TYPE_CHECKPOINT]
        last = max(f["step"] for f in frames if f["t"] == p.TYPE_PROGRESS)
        self.assertEqual(ck["step"], last)
        self.assertEqual(json.loads(ck["state"])["step"], last)

    def test_checkpoint_and_resume_byte_identical(self) -> None:
        """FLUX's flow-matching Euler run checkpoints from the callback, and a
        resume (the schedule's tail, the checkpoint's latent) gives the
        uninterrupted run's bytes; another seed's checkpoint is refused."""
        s = self.session("flux", checkpoint_every=2)
        s.encode(spec())
        cks: Dict[int, tuple] = {}

        def ack(m: dict) -> None:
            if m["t"] == p.TYPE_CHECKPOINT:
                r = s.latent_region(1, CKBUF)
                cks[m["step"]] = (m["state"], s.agent.read(CKBUF, r["len"]))
                s.agent.send({"t": p.TYPE_CHECKPOINTED, "task": m["task"], "step": m["step"]})

        done, _ = s.denoise(spec(steps=6), {}, ack, checkpoint_every=2, checkpoint_buf=s.latent_region(1, CKBUF))
        self.assertEqual(done["t"], p.TYPE_DONE, done)
        self.assertEqual(sorted(cks), [2, 4])
        whole = s.agent.read(LATENT, s.latent_region(1)["len"])
        state, latent = cks[4]
        s.agent.write(RESUME, latent)
        s.agent.write(LATENT, b"\xff" * len(whole))
        resume = {"sampler": s.eng.sampler, "step": 4, "total": 6, "state": state, "latent": s.latent_region(1, RESUME)}
        done, frames = s.denoise(spec(steps=6), {}, resume=resume)
        self.assertEqual(done["t"], p.TYPE_DONE, done)
        self.assertEqual([f["step"] for f in frames if f["t"] == p.TYPE_PROGRESS], [5, 6])
        np.testing.assert_allclose(s.pipe.calls[-1]["sigmas"], np.linspace(1.0, 1 / 6, 6)[4:])
        self.assertEqual(s.agent.read(LATENT, len(whole)), whole, "the resumed run's latent differs")
        done, _ = s.denoise(spec(steps=6, seed=12), {}, resume=resume)
        self.assertEqual((done["t"], done["code"]), (p.TYPE_FAILED, p.CODE_BAD_CHECKPOINT))

    def test_checkpoints_only_where_the_scheduler_allows(self) -> None:
        for family, why in [("wan", "UniPC (multistep) keeps its last model outputs"),
                            ("sd15", "multiplies any latents passed in by init_noise_sigma")]:
            eng = da.DiffusersEngine(fake(family), da.FAMILIES[family], "m", max_sequence_length=SEQ)
            self.assertIsNone(eng.model.checkpoint)
            self.assertIn(why, eng.why_no_checkpoint)
        pipe = fake("flux")
        pipe.scheduler = FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True)
        eng = da.DiffusersEngine(pipe, da.FAMILIES["flux"], "m", max_sequence_length=SEQ)
        self.assertIsNone(eng.model.checkpoint)
        self.assertIn("use_karras_sigmas", eng.why_no_checkpoint)

    def test_packing_round_trips_in_diffusers_layout(self) -> None:
        z = torch.randn(1, CH, 6, 8)
        x = da.pack_2x2(z)
        self.assertEqual(tuple(x.shape), (1, 3 * 4, 4 * CH))
        # patch (0, 0): channel 0's 2x2 pixels, then channel 1's, ...
        self.assertEqual(x[0, 0, :4].tolist(), [z[0, 0, 0, 0], z[0, 0, 0, 1], z[0, 0, 1, 0], z[0, 0, 1, 1]])
        self.assertEqual(x[0, 1, 4:8].tolist(), [z[0, 1, 0, 2], z[0, 1, 0, 3], z[0, 1, 1, 2], z[0, 1, 1, 3]])
        torch.testing.assert_close(da.unpack_2x2(x, 6, 8), z, rtol=0, atol=0)
        fam = da.FAMILIES["wan"]
        v = torch.randn(3, CH, 4, 4)  # frame-major, as the arena holds it
        self.assertEqual(tuple(da.to_pipeline(fam, v).shape), (1, CH, 3, 4, 4))
        torch.testing.assert_close(da.from_pipeline(fam, da.to_pipeline(fam, v), 4, 4), v, rtol=0, atol=0)

    def test_vae_scaling(self) -> None:
        z4, z5 = torch.randn(1, CH, 2, 2), torch.randn(1, CH, 3, 2, 2)
        vae = FakeVAE({"scaling_factor": 0.5, "shift_factor": 0.25, "latents_mean": MEAN, "latents_std": STD})
        f = da.FAMILIES
        torch.testing.assert_close(da.vae_input(f["flux"], vae, z4), z4 / 0.5 + 0.25, rtol=0, atol=0)
        torch.testing.assert_close(da.vae_input(f["sd15"], vae, z4), z4 / 0.5, rtol=0, atol=0)
        mean, inv = torch.tensor(MEAN).view(1, CH, 1, 1, 1), 1.0 / torch.tensor(STD).view(1, CH, 1, 1, 1)
        torch.testing.assert_close(da.vae_input(f["wan"], vae, z5), z5 / inv + mean, rtol=0, atol=0)
        std4, mean4 = torch.tensor(STD).view(1, CH, 1, 1), torch.tensor(MEAN).view(1, CH, 1, 1)
        torch.testing.assert_close(da.vae_input(f["sdxl"], vae, z4), z4 * std4 / 0.5 + mean4, rtol=0, atol=0)
        del vae.config["latents_mean"]
        torch.testing.assert_close(da.vae_input(f["sdxl"], vae, z4), z4 / 0.5, rtol=0, atol=0)

    def test_wan_decodes_a_stream_as_the_whole(self) -> None:
        """Wan's latent frames decoded as a stream's chunks (the VAE is
        causal) write the video frames of the whole decode, byte for byte;
        the VAE sees latents * std + mean, [1, C, F, h, w]."""
        s = self.session("wan")
        lat = torch.randn(3, CH, 4, 4)
        s.agent.write(LATENT, lat.numpy().tobytes())
        px = 8 * 8 * 4

        def decode(first: int, k: int, stream: Optional[dict] = None) -> bytes:
            v0, n = s.m.video_frames(first, k)
            region = {"off": LATENT + first * lat[0].numel() * 4, "len": k * lat[0].numel() * 4, "dtype": "float32",
                      "shape": [k, CH, 4, 4]}
            task = {"stage": "decode", "spec": spec(9), "inputs": [region], "first_frame": first, "frames": k,
                    "video_first": v0, "video_frames": n,
                    "output": {"off": OUT, "len": n * px, "dtype": "uint8", "shape": [n, 8, 8, 4]}}
            task.update(stream or {})
            done, _ = s.run(task)
            self.assertEqual(done["t"], p.TYPE_DONE, done)
            return s.agent.read(OUT, n * px)

        whole = decode(0, 3)
        mean, inv = torch.tensor(MEAN).view(1, CH, 1, 1, 1), 1.0 / torch.tensor(STD).view(1, CH, 1, 1, 1)
        torch.testing.assert_close(s.pipe.vae.seen[-1], lat.permute(1, 0, 2, 3).unsqueeze(0) / inv + mean, rtol=0, atol=0)
        chunks = b"".join(decode(k, 1, {"stream": 5, "job": "j", "chunk": k, "last": k == 2}) for k in range(3))
        self.assertEqual(len(whole), 9 * px)
        self.assertEqual(chunks, whole, "a stream's chunks decode differently from the whole")

    def test_imports_without_diffusers(self) -> None:
        self.assertNotIn("diffusers", sys.modules)
        if "diffusers" not in sys.modules:
            with self.assertRaises(SystemExit) as e:
                da.load_pipeline(da.FAMILIES["flux"], "x", torch.bfloat16, "cpu")
            self.assertIn("diffusers is not installed", str(e.exception))


if __name__ == "__main__":
    unittest.main()
