#!/usr/bin/env python3
"""Serve a diffusers pipeline to a latentmesh agent through the pipeline's
public hooks only: ``encode_prompt``, ``__call__`` (with ``prompt_embeds``
and friends, ``latents``, ``output_type="latent"`` and
``callback_on_step_end``), ``pipe._interrupt``, ``vae.decode`` and the VAE's
config. The scheduler loop is never rewritten here: the pipeline runs its
own.

NOT RUN against diffusers in the latentmesh tree: diffusers, model weights
and a GPU are all missing there. ``tests/test_diffusers_adapter.py`` checks
the mapping against stand-in pipelines with diffusers' call signatures and
attribute names; run ``latentmesh engine check`` on the real thing.

    python3 diffusers_adapter.py --family flux --model-id black-forest-labs/FLUX.1-dev \\
        --name flux1-dev --socket /run/latentmesh/engine.sock --device cuda

Stages (each family's row of FAMILIES says the details):

- encode: ``pipe.encode_prompt`` on the prompt and the negative prompt; each
  output the pipeline's ``__call__`` takes back (``prompt_embeds``,
  ``pooled_prompt_embeds``, their negatives) is one named conditioning
  tensor (protocol v2 ``named_cond``), at the text's length where the
  model's text is of variable length (Qwen-Image, Wan);
- denoise: ``pipe(prompt_embeds=..., latents=noise, output_type="latent",
  callback_on_step_end=...)``; the noise is drawn on the CPU from the
  request's seed in the pipeline's own latent shape (the same numbers as
  ``generator=torch.Generator("cpu").manual_seed(seed)``), packed as the
  pipeline packs it (FLUX and Qwen-Image: 2x2 patches); the callback reports
  progress, takes checkpoints and sets ``pipe._interrupt`` on a cancel or a
  stop; the latent lands in the arena frame-major, unpacked;
- decode: ``pipe.vae.decode`` after the pipeline's own scaling (scaling and
  shift factors, or the latents' mean and std), to RGBA; a temporal VAE
  (Wan) decodes a job's chunks as one stream (``decode_state``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from latentmesh_engine import (BadCheckpoint, BadInput, Cancelled, CheckpointSpec, CondTensor,  # noqa: E402
                               LatentLayout, Model, Param, Stopped, Task, Worker, socket_from_args)

log = logging.getLogger("diffusers_adapter")

Tensors = Dict[str, torch.Tensor]
Encode = Callable[[Any, str, str, Any, int], Tensors]

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


# --- how each family's encode_prompt is called; every one returns its
# outputs by the name of the __call__ keyword that takes them back ---

def _encode_flux(pipe: Any, prompt: str, negative: str, device: Any, seq: int) -> Tensors:
    out: Tensors = {}
    for pre, text in (("", prompt), ("negative_", negative)):
        pe, pooled, _text_ids = pipe.encode_prompt(prompt=text, prompt_2=None, device=device, num_images_per_prompt=1,
                                                   max_sequence_length=seq)
        out[pre + "prompt_embeds"], out[pre + "pooled_prompt_embeds"] = pe, pooled
    return out


def _encode_sd3(pipe: Any, prompt: str, negative: str, device: Any, seq: int) -> Tensors:
    pe, npe, pooled, npooled = pipe.encode_prompt(prompt=prompt, prompt_2=None, prompt_3=None, device=device,
                                                  num_images_per_prompt=1, do_classifier_free_guidance=True,
                                                  negative_prompt=negative, max_sequence_length=seq)
    return {"prompt_embeds": pe, "negative_prompt_embeds": npe, "pooled_prompt_embeds": pooled,
            "negative_pooled_prompt_embeds": npooled}


def _encode_wan(pipe: Any, prompt: str, negative: str, device: Any, seq: int) -> Tensors:
    pe, npe = pipe.encode_prompt(prompt=prompt, negative_prompt=negative, do_classifier_free_guidance=True,
                                 num_videos_per_prompt=1, max_sequence_length=seq, device=device)
    return {"prompt_embeds": pe, "negative_prompt_embeds": npe}


def _encode_qwen(pipe: Any, prompt: str, negative: str, device: Any, seq: int) -> Tensors:
    out: Tensors = {}
    for pre, text in (("", prompt), ("negative_", negative)):
        pe, mask = pipe.encode_prompt(prompt=text, device=device, num_images_per_prompt=1, max_sequence_length=seq)
        if mask is not None:  # None when every row is the text's (one prompt): trim to the mask otherwise
            pe = pe[:, : int(mask[0].sum())]
        out[pre + "prompt_embeds"] = pe
    return out


def _encode_sd(pipe: Any, prompt: str, negative: str, device: Any, seq: int) -> Tensors:
    pe, npe = pipe.encode_prompt(prompt, device, 1, True, negative_prompt=negative)
    return {"prompt_embeds": pe, "negative_prompt_embeds": npe}


def _encode_sdxl(pipe: Any, prompt: str, negative: str, device: Any, seq: int) -> Tensors:
    # None, not "": SDXL's force_zeros_for_empty_prompt then gives the
    # zero negative the stock pipeline uses for no negative prompt.
    pe, npe, pooled, npooled = pipe.encode_prompt(prompt=prompt, device=device, num_images_per_prompt=1,
                                                  do_classifier_free_guidance=True, negative_prompt=negative or None)
    return {"prompt_embeds": pe, "negative_prompt_embeds": npe, "pooled_prompt_embeds": pooled,
            "negative_pooled_prompt_embeds": npooled}


@dataclasses.dataclass(frozen=True)
class CondMap:
    """One encode_prompt output as a named conditioning tensor.

    ``kwarg`` names both the output and the ``__call__`` keyword it goes
    back in. ``length``: ``fixed`` (written whole: padded by the encoder
    with what the model attends to, as T5's pad embeddings in FLUX);
    ``trimmed`` (encode_prompt returns it at the text's length: Qwen-Image);
    ``zero_padded`` (rows past the text are zeros: trimmed here, padded back
    with zeros at denoise, so the pipeline gets what encode_prompt gave: Wan)."""

    name: str
    kwarg: str
    length: str = "fixed"


@dataclasses.dataclass(frozen=True)
class ParamMap:
    """A model parameter (protocol v2 ``model_params``) and where its value
    goes: ``call`` (a ``__call__`` keyword) or ``scheduler`` (a key of the
    scheduler's config: the scheduler is rebuilt with ``from_config``).
    ``lo``, ``hi`` bound it; the default is ``default`` or, for a scheduler
    key, the loaded scheduler's own value."""

    name: str
    target: str
    key: str
    lo: float
    hi: float
    default: float


@dataclasses.dataclass(frozen=True)
class Family:
    """How one diffusers pipeline class maps onto the protocol."""

    name: str
    pipeline_class: str
    encode: Encode
    conds: Tuple[CondMap, ...]
    # max_sequence_length of the text (encode_prompt's and __call__'s
    # keyword; 0: the pipeline takes none, its text is fixed at 77 tokens).
    max_sequence_length: int
    # The __call__ keyword the request's guidance_scale goes to (None: the
    # model has no use for it).
    guidance_kwarg: Optional[str]
    # The latent: packed in 2x2 patches in the pipeline's sequence (FLUX,
    # Qwen-Image); temporal compression (0: an image model); the VAE takes
    # [B, C, F, h, w] (Wan; Qwen-Image with F = 1).
    packed: bool
    temporal: int
    vae_5d: bool
    # The pipeline's own scaling before vae.decode: "scale_shift" (latents
    # / scaling_factor + shift_factor), "scale" (/ scaling_factor),
    # "mean_std" (latents / (1 / latents_std) + latents_mean), "sdxl"
    # (mean and std when the VAE's config has them, else scale).
    vae_norm: str
    # Sides are multiples of the VAE's scale times this (2: 2x2 patches).
    side_factor: int
    params: Tuple[ParamMap, ...]
    # How the checkpointed schedule is built ("linspace": the pipeline's
    # own np.linspace(1, 1/n, n) sigmas; "range": the scheduler's sigma
    # range, as its set_timesteps draws it), or "" with why_no_checkpoint.
    sigmas: str
    why_no_checkpoint: str
    # The latent's dtype: None, the conditioning's (the pipeline's latents
    # follow prompt_embeds); else this one.
    latent_dtype: Optional[torch.dtype]
    default_steps: int
    max_side: int
    max_frames: int = 1
    max_frame_pixels: int = 0
    # The first frame alone, then groups of temporal: frames 4k+1 (Wan).
    frames_kwarg: Optional[str] = None


# What each family's pipeline takes; the shapes and dtypes of the tensors
# are read from the loaded pipeline (an encode of "" at start), so a
# scaled-down test pipeline maps as the full model does. Production
# shapes, for reference: docs/engines.md, "diffusers".
FAMILIES: Dict[str, Family] = {f.name: f for f in [
    Family("flux", "FluxPipeline", _encode_flux,
           (CondMap("t5", "prompt_embeds"), CondMap("clip_pooled", "pooled_prompt_embeds"),
            CondMap("t5_neg", "negative_prompt_embeds"), CondMap("clip_pooled_neg", "negative_pooled_prompt_embeds")),
           max_sequence_length=512, guidance_kwarg="guidance_scale", packed=True, temporal=0, vae_5d=False,
           vae_norm="scale_shift", side_factor=2,
           params=(ParamMap("true_cfg_scale", "call", "true_cfg_scale", 1.0, 20.0, 1.0),),
           sigmas="linspace", why_no_checkpoint="", latent_dtype=None, default_steps=28, max_side=2048),
    Family("sd3", "StableDiffusion3Pipeline", _encode_sd3,
           (CondMap("context", "prompt_embeds"), CondMap("pooled", "pooled_prompt_embeds"),
            CondMap("context_neg", "negative_prompt_embeds"), CondMap("pooled_neg", "negative_pooled_prompt_embeds")),
           max_sequence_length=256, guidance_kwarg="guidance_scale", packed=False, temporal=0, vae_5d=False,
           vae_norm="scale_shift", side_factor=2,
           params=(ParamMap("shift", "scheduler", "shift", 0.5, 20.0, 3.0),),
           sigmas="range", why_no_checkpoint="", latent_dtype=None, default_steps=28, max_side=2048),
    Family("wan", "WanPipeline", _encode_wan,
           (CondMap("context", "prompt_embeds", "zero_padded"), CondMap("context_neg", "negative_prompt_embeds", "zero_padded")),
           max_sequence_length=512, guidance_kwarg="guidance_scale", packed=False, temporal=4, vae_5d=True,
           vae_norm="mean_std", side_factor=2,
           params=(ParamMap("flow_shift", "scheduler", "flow_shift", 1.0, 20.0, 3.0),),
           sigmas="", why_no_checkpoint="UniPC (multistep) keeps its last model outputs inside the scheduler, "
                                         "which no public hook reads or restores",
           latent_dtype=torch.float32, default_steps=50, max_side=1280, max_frames=81, max_frame_pixels=1280 * 720,
           frames_kwarg="num_frames"),
    Family("qwen-image", "QwenImagePipeline", _encode_qwen,
           (CondMap("text", "prompt_embeds", "trimmed"), CondMap("text_neg", "negative_prompt_embeds", "trimmed")),
           max_sequence_length=512, guidance_kwarg=None, packed=True, temporal=0, vae_5d=True,
           vae_norm="mean_std", side_factor=2,
           params=(ParamMap("true_cfg_scale", "call", "true_cfg_scale", 1.0, 20.0, 4.0),),
           sigmas="linspace", why_no_checkpoint="", latent_dtype=None, default_steps=50, max_side=2048),
    Family("sd15", "StableDiffusionPipeline", _encode_sd,
           (CondMap("context", "prompt_embeds"), CondMap("context_neg", "negative_prompt_embeds")),
           max_sequence_length=0, guidance_kwarg="guidance_scale", packed=False, temporal=0, vae_5d=False,
           vae_norm="scale", side_factor=1,
           params=(ParamMap("guidance_rescale", "call", "guidance_rescale", 0.0, 1.0, 0.0),),
           sigmas="", why_no_checkpoint="prepare_latents multiplies any latents passed in by init_noise_sigma, so a "
                                         "mid-run latent cannot be handed back unchanged",
           latent_dtype=None, default_steps=50, max_side=1024),
    Family("sdxl", "StableDiffusionXLPipeline", _encode_sdxl,
           (CondMap("context", "prompt_embeds"), CondMap("pooled", "pooled_prompt_embeds"),
            CondMap("context_neg", "negative_prompt_embeds"), CondMap("pooled_neg", "negative_pooled_prompt_embeds")),
           max_sequence_length=0, guidance_kwarg="guidance_scale", packed=False, temporal=0, vae_5d=False,
           vae_norm="sdxl", side_factor=1,
           params=(ParamMap("guidance_rescale", "call", "guidance_rescale", 0.0, 1.0, 0.0),),
           sigmas="", why_no_checkpoint="prepare_latents multiplies any latents passed in by init_noise_sigma, so a "
                                         "mid-run latent cannot be handed back unchanged",
           latent_dtype=None, default_steps=50, max_side=2048),
]}

# A flow-matching Euler run resumes from its schedule's tail (each sigma
# is shifted on its own, the step keeps no history) unless one of these
# options is on: Karras and friends rescale the whole list, a terminal
# shift stretches it, stochastic sampling draws noise, and FLUX drops
# explicit sigmas under use_flow_sigmas.
_FLOW_EULER = "FlowMatchEulerDiscreteScheduler"
_NOT_ELEMENTWISE = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "shift_terminal",
                    "stochastic_sampling", "invert_sigmas", "use_flow_sigmas")


# --- latent layouts ---

def pack_2x2(z: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, (h/2)(w/2), 4C], as FluxPipeline._pack_latents
    (and QwenImagePipeline's)."""
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of pack_2x2: [B, (h/2)(w/2), 4C] -> [B, C, h, w]."""
    b, _n, c4 = x.shape
    return x.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c4 // 4, h, w)


def to_pipeline(fam: Family, z: torch.Tensor) -> torch.Tensor:
    """The arena's latent [F, C, h, w] (frame-major) as the pipeline's
    ``latents``: packed (FLUX, Qwen-Image), [1, C, F, h, w] (Wan), or
    [1, C, h, w]."""
    if fam.temporal > 1:
        return z.permute(1, 0, 2, 3).unsqueeze(0)
    return pack_2x2(z) if fam.packed else z


def from_pipeline(fam: Family, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The pipeline's latents as the arena's [F, C, h, w]."""
    if fam.temporal > 1:
        return x[0].permute(1, 0, 2, 3)
    return unpack_2x2(x, h, w) if fam.packed else x


def noise(fam: Family, seed: int, channels: int, frames: int, h: int, w: int, dtype: torch.dtype) -> torch.Tensor:
    """The request's noise in the pipeline's unpacked latent shape (what
    its prepare_latents draws with a CPU generator of the seed), returned
    frame-major [F, C, h, w] for the arena's layout."""
    g = torch.Generator("cpu").manual_seed(int(seed))
    if fam.temporal > 1:
        x = torch.randn((1, channels, frames, h, w), generator=g, dtype=dtype)
        return x[0].permute(1, 0, 2, 3)
    # Qwen-Image draws [1, 1, C, h, w]: the same numbers in the same order.
    return torch.randn((1, channels, h, w), generator=g, dtype=dtype)


def vae_input(fam: Family, vae: Any, z: torch.Tensor) -> torch.Tensor:
    """What the pipeline hands vae.decode for latents z (the VAE's shape:
    [1, C, h, w], or [1, C, F, h, w]), with its own scaling, in its order
    of operations (so the bytes match the stock pipeline's)."""
    cfg = vae.config
    if fam.vae_norm == "scale_shift":
        return z / cfg.scaling_factor + cfg.shift_factor
    if fam.vae_norm == "scale":
        return z / cfg.scaling_factor
    c = z.shape[1]
    if fam.vae_norm == "mean_std":
        z = z.to(vae.dtype)
        mean = torch.tensor(cfg.latents_mean).view(1, c, 1, 1, 1).to(z.device, z.dtype)
        inv_std = (1.0 / torch.tensor(cfg.latents_std)).view(1, c, 1, 1, 1).to(z.device, z.dtype)
        return z / inv_std + mean
    if fam.vae_norm == "sdxl":
        z = z.to(vae.dtype)
        if getattr(cfg, "latents_mean", None) is not None and getattr(cfg, "latents_std", None) is not None:
            mean = torch.tensor(cfg.latents_mean).view(1, c, 1, 1).to(z.device, z.dtype)
            std = torch.tensor(cfg.latents_std).view(1, c, 1, 1).to(z.device, z.dtype)
            return z * std / cfg.scaling_factor + mean
        return z / cfg.scaling_factor
    raise ValueError(f"family {fam.name}: unknown VAE scaling {fam.vae_norm!r}")


def to_rgba(img: torch.Tensor, out: torch.Tensor) -> None:
    """VAE output [N, 3, H, W] in [-1, 1] into RGBA uint8 [N, H, W, 4],
    rounded as diffusers' image processor rounds (denormalize in the
    image's dtype, then float32 * 255, round half to even)."""
    x = (img / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu()
    out[..., :3].copy_((x * 255).round().to(torch.uint8))
    out[..., 3] = 255


def _raw(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes (bfloat16 has no numpy dtype: viewed as int16)."""
    t = t.detach().contiguous().cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.numpy().reshape(-1).view(np.uint8)


class DiffusersEngine:
    """One diffusers pipeline served as one latentmesh model.

    ``pipe`` is a loaded pipeline of ``family``'s class; the named tensors'
    shapes and dtypes are read from it (an encode of "" here), and its
    VAE's config says the latent's channels and scale."""

    def __init__(self, pipe: Any, family: Family, name: str, device: Any = "cpu",
                 stages: Tuple[str, ...] = ("encode", "denoise", "decode"), max_sequence_length: int = 0,
                 max_side: int = 0, checkpoint_every: int = 0) -> None:
        self.pipe, self.fam, self.name, self.device = pipe, family, name, device
        self.seq = max_sequence_length or family.max_sequence_length
        self._base_scheduler = pipe.scheduler
        with torch.no_grad():
            probe = family.encode(pipe, "", "", device, self.seq)
        conds = []
        for c in family.conds:
            t = probe[c.kwarg][0]
            shape = list(t.shape)
            if c.length != "fixed":
                shape[0] = self.seq
            conds.append(CondTensor(c.name, _DTYPES[t.dtype], shape, var_len=c.length != "fixed"))
        self.cond_dtype = probe[family.conds[0].kwarg].dtype
        self.latent_dtype = family.latent_dtype or self.cond_dtype
        cfg = pipe.vae.config
        self.channels = int(getattr(cfg, "latent_channels", None) or cfg.z_dim)
        self.scale = int(getattr(pipe, "vae_scale_factor_spatial", None) or pipe.vae_scale_factor)
        if family.temporal > 1 and int(pipe.vae_scale_factor_temporal) != family.temporal:
            raise ValueError(f"family {family.name}: the VAE compresses time {pipe.vae_scale_factor_temporal}x, "
                             f"the table says {family.temporal}x")
        self.why_no_checkpoint = family.why_no_checkpoint or self._scheduler_refusal()
        self.sampler = f"diffusers/{family.name}/{type(pipe.scheduler).__name__}/1"
        sched_cfg = dict(pipe.scheduler.config)
        self.params = [Param.number(q.name, q.lo, q.hi, float(sched_cfg.get(q.key, q.default)) if q.target == "scheduler"
                                    else q.default) for q in family.params]
        t = family.temporal
        self.model = Model(
            name=name, stages=list(stages), conds=conds,
            latent=LatentLayout(_DTYPES[self.latent_dtype], self.channels, self.scale, temporal=t),
            default_steps=family.default_steps, max_side=max_side or family.max_side, max_steps=1000,
            max_frames=family.max_frames, max_frame_pixels=family.max_frame_pixels,
            side_multiple=self.scale * family.side_factor,
            frame_step=t if t > 1 else 0, frame_offset=1 if t > 1 else 0,
            checkpoint=None if self.why_no_checkpoint else CheckpointSpec(self.sampler, _DTYPES[self.latent_dtype],
                                                                          self.channels, checkpoint_every),
            params=self.params, decode_state=t > 1)
        if self.why_no_checkpoint:
            log.info("model %s does not checkpoint: %s", name, self.why_no_checkpoint)

    def _scheduler_refusal(self) -> str:
        s = self.pipe.scheduler
        if type(s).__name__ != _FLOW_EULER:
            return f"the scheduler is {type(s).__name__}; only {_FLOW_EULER} resumes from a tail of its schedule here"
        on = [k for k in _NOT_ELEMENTWISE if s.config.get(k)]
        return f"the scheduler's {on} make a schedule's tail differ from its whole" if on else ""

    def worker(self, engine: str = "diffusers/1", slots: Optional[Dict[str, int]] = None) -> Worker:
        w = Worker(engine, [self.model], slots=slots or {"encode": 1, "denoise": 1, "decode": 1})
        w.encode(self.encode)
        w.denoise(self.denoise)
        w.decode(self.decode)
        return w

    # --- encode ---

    def encode(self, task: Task) -> None:
        s = task.spec
        with torch.no_grad():
            out = self.fam.encode(self.pipe, s.prompt, s.negative_prompt, self.device, self.seq)
        conds = task.torch_conds()
        for c, decl in zip(self.fam.conds, self.model.conds or []):
            t = out[c.kwarg][0].detach().to("cpu", conds[c.name].dtype)
            n = t.shape[0]
            if c.length == "zero_padded":
                nz = (t != 0).flatten(1).any(dim=1).nonzero()
                n = int(nz[-1]) + 1 if len(nz) else 1
            if list(t.shape[1:]) != list(decl.shape[1:]) or n > decl.shape[0] or (not decl.var_len and n != decl.shape[0]):
                raise RuntimeError(f"encode_prompt's {c.kwarg} is {list(t.shape)}, the model declares {decl.shape}")
            conds[c.name][:n].copy_(t[:n])
            if decl.var_len:
                task.set_len(c.name, n)

    # --- denoise ---

    def _schedule(self, n: int) -> List[float]:
        """The sigmas of an n-step run, passed explicitly whenever the
        model checkpoints, so a run and its resume (the tail) compute the
        same floats."""
        if self.fam.sigmas == "linspace":  # what FLUX and Qwen-Image pass themselves
            return [float(x) for x in np.linspace(1.0, 1 / n, n)]
        s = self.pipe.scheduler
        t = s.config["num_train_timesteps"]
        return [float(x) for x in np.linspace(s.sigma_max * t, s.sigma_min * t, n) / t]

    def _state(self, task: Task, step: int) -> bytes:
        s = task.spec
        return json.dumps({"step": step, "total": s.steps, "seed": s.seed, "width": s.width, "height": s.height,
                           "frames": s.frames, "params": task.params}, sort_keys=True).encode()

    def _resume(self, task: Task, out: torch.Tensor) -> Tuple[int, torch.Tensor]:
        """Where the denoise starts: step 0 and the seed's noise, or a
        resume's step and latent (BadCheckpoint if it is another run's)."""
        s, h, w = task.spec, out.shape[2], out.shape[3]
        r = task.resume
        if r is None:
            return 0, noise(self.fam, s.seed, self.channels, out.shape[0], h, w, self.latent_dtype)
        try:
            st = json.loads(r.state)
        except ValueError as e:
            raise BadCheckpoint(f"state is not this adapter's: {e}")
        want = json.loads(self._state(task, r.step))
        if st != want or r.total != s.steps:
            raise BadCheckpoint(f"checkpoint of {st}, this task is {want} (a run of another step count, seed, size or "
                                f"parameters does not continue it)")
        return r.step, r.torch_latent().clone()

    def denoise(self, task: Task) -> None:
        s, fam, pipe = task.spec, self.fam, self.pipe
        out = task.torch_output()  # [F, C, h, w]
        h, w = out.shape[2], out.shape[3]
        start, z = self._resume(task, out)
        kw: Dict[str, Any] = {"height": s.height, "width": s.width, "num_inference_steps": s.steps - start,
                              "output_type": "latent", "return_dict": False, "latents": to_pipeline(fam, z).to(self.device),
                              "callback_on_step_end_tensor_inputs": ["latents"]}
        conds = task.torch_conds()
        for c, decl in zip(fam.conds, self.model.conds or []):
            t = conds[c.name]
            if c.length == "zero_padded" and t.shape[0] < decl.shape[0]:
                t = torch.cat([t, t.new_zeros((decl.shape[0] - t.shape[0], *t.shape[1:]))])
            kw[c.kwarg] = t.unsqueeze(0).to(self.device)
        if fam.max_sequence_length:
            kw["max_sequence_length"] = self.seq
        if fam.guidance_kwarg:
            kw[fam.guidance_kwarg] = s.guidance_scale
        if fam.frames_kwarg:
            kw[fam.frames_kwarg] = s.frames
        base, over = self._base_scheduler, {}
        for q in fam.params:
            v = task.params[q.name]
            if q.target == "call":
                kw[q.key] = v
            elif base.config.get(q.key) != v:
                over[q.key] = v
        # The loaded scheduler, or one rebuilt with this request's values.
        pipe.scheduler = type(base).from_config(base.config, **over) if over else base
        if self.model.checkpoint is not None:
            kw["sigmas"] = self._schedule(s.steps)[start:]
        ended: Dict[str, bool] = {}

        def on_step(p: Any, i: int, _t: Any, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
            step = start + i + 1
            task.progress(step, s.steps)
            if step < s.steps and (task.wants_checkpoint(step) or task.should_stop()):
                task.checkpoint(step, self._state(task, step),
                                _raw(from_pipeline(fam, tensors["latents"], h, w).to(self.latent_dtype)))
            if task.cancelled:
                ended["cancelled"] = True
            elif task.should_stop() and step < s.steps:
                ended["stopped"] = True
            if ended:
                p._interrupt = True  # the pipeline skips its remaining steps
            return {}

        kw["callback_on_step_end"] = on_step
        task.check_cancelled()
        with torch.no_grad():
            x = pipe(**kw)[0]
        if ended.get("cancelled"):
            raise Cancelled()
        if ended.get("stopped"):
            raise Stopped()
        out.copy_(from_pipeline(fam, x, h, w).to("cpu", out.dtype))

    # --- decode ---

    def decode(self, task: Task) -> None:
        (lat,) = task.torch_inputs()  # latent frames [k, C, h, w]
        if not bool(torch.isfinite(lat.float()).all()):
            raise BadInput("latent holds NaN or infinite values")
        out = task.torch_output()  # video frames [n, H, W, 4]
        vae = self.pipe.vae
        with torch.no_grad():
            if self.fam.temporal > 1:
                self._decode_video(task, lat, out)
                return
            for j in range(lat.shape[0]):
                z = lat[j:j + 1].to(self.device)
                if self.fam.vae_5d:
                    z = z.unsqueeze(2)  # Qwen-Image: [1, C, 1, h, w]
                img = vae.decode(vae_input(self.fam, vae, z), return_dict=False)[0]
                if self.fam.vae_5d:
                    img = img[:, :, 0]
                to_rgba(img, out[j:j + 1])

    def _decode_video(self, task: Task, lat: torch.Tensor, out: torch.Tensor) -> None:
        """A causal video VAE (Wan): the chunks of a stream decode as the
        whole latent would. The state is the latent frames so far, and each
        chunk decodes them all with its own, keeping the video frames it
        adds: exact (the VAE is causal: a video frame depends on its latent
        frame and those before), at the cost of decoding the prefix again
        for each chunk (no public hook hands over the VAE's causal cache)."""
        prior = task.state.get("latents") if task.stream is not None else None
        frames = lat.clone() if prior is None else torch.cat([prior, lat])
        if task.first_frame != (0 if prior is None else prior.shape[0]):
            raise BadInput(f"latent frame {task.first_frame} after {0 if prior is None else prior.shape[0]} frames of its stream")
        if task.stream is not None and not task.stream.last:
            task.state["latents"] = frames
        vae = self.pipe.vae
        z = frames.permute(1, 0, 2, 3).unsqueeze(0).to(self.device)
        video = vae.decode(vae_input(self.fam, vae, z), return_dict=False)[0]  # [1, 3, T, H, W]
        v = video[0, :, task.video_first:task.video_first + task.video_frames].permute(1, 0, 2, 3)
        to_rgba(v, out)


def load_pipeline(fam: Family, model_id: str, dtype: torch.dtype, device: str) -> Any:
    """from_pretrained of the family's pipeline class (diffusers imported
    here only: the module loads without it)."""
    try:
        import diffusers  # type: ignore[import]
    except ImportError as e:
        raise SystemExit(f"diffusers is not installed ({e}): pip install diffusers transformers accelerate")
    pipe = getattr(diffusers, fam.pipeline_class).from_pretrained(model_id, torch_dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    if fam.vae_norm == "sdxl" and pipe.vae.dtype == torch.float16 and getattr(pipe.vae.config, "force_upcast", False):
        pipe.vae.to(torch.float32)  # as the stock pipeline's upcast for decode, once
    return pipe


def main(argv: List[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=sorted(FAMILIES), required=True)
    ap.add_argument("--model-id", required=True, help="a Hugging Face repo id or a local directory")
    ap.add_argument("--name", help="the model's latentmesh name (default: the family)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--max-sequence-length", type=int, default=0)
    ap.add_argument("--max-side", type=int, default=0)
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--socket")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    fam = FAMILIES[args.family]
    pipe = load_pipeline(fam, args.model_id, getattr(torch, args.dtype), args.device)
    eng = DiffusersEngine(pipe, fam, args.name or fam.name, device=args.device,
                          max_sequence_length=args.max_sequence_length, max_side=args.max_side,
                          checkpoint_every=args.checkpoint_every)
    eng.worker(f"diffusers-{fam.name}/1").run_forever(socket_from_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
