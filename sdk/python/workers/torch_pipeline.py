#!/usr/bin/python3
"""Reference worker 2: a small but real latent-diffusion pipeline in PyTorch.

Model ``latentmesh-tiny-torch``:
- text encoder: byte-level token embedding + learned positions + two
  transformer encoder layers + layer norm -> conditioning [2, 32, 64]
  (the prompt's row, then the negative prompt's: classifier-free guidance);
- denoiser: a conditional U-Net (conv stem, timestep embedding, one
  down/up level with skip connection, cross-attention to the text) that
  predicts noise, sampled with DDIM (eta 0) and classifier-free guidance;
  the text's attention keys and values are projected once per denoise, and
  the negative prompt's come from the agent's tensor cache when an earlier
  request had the same one (protocol v2; the same bytes either way);
  the sampler checkpoints (step index, seed and size as state, the latent
  at full float32 precision) and resumes byte-identically, and stops at a
  checkpoint when the agent asks (protocol v2);
- VAE decoder: convolutions and three 2x upsamplings from the 4-channel
  latent to RGB.

Weights are generated from a fixed seed (no download) and stored in a
safetensors file (``--write-weights``); workers load them with ``--weights``.
``--reference`` runs the whole pipeline in this one process, without
latentmesh, for comparison. Everything runs on one CPU thread so results are
bit-identical across processes.

    torch_pipeline.py --write-weights W
    torch_pipeline.py --weights W --socket PATH [--stages encode,denoise,decode] [--step-ms N] [--checkpoint-every N]
    torch_pipeline.py --weights W --reference SPEC_JSON OUT_RGBA
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import struct
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from latentmesh_engine import (BadCheckpoint, BadInput, CheckpointSpec, LatentLayout, Layout, Model, Task,  # noqa: E402
                               Worker, socket_from_args)

MODEL = "latentmesh-tiny-torch"
TOKENS, DIM, CHANNELS, SCALE = 32, 64, 4, 8
TRAIN_STEPS = 1000
# SAMPLER names the checkpoint state's format and the schedule; change it
# with anything that changes the sampler's output.
SAMPLER = "torch-tiny/ddim/1"

log = logging.getLogger("torch_pipeline")

KV = List[Tuple[torch.Tensor, torch.Tensor]]  # per cross-attention layer: keys, values [batch, TOKENS, channels]

torch.set_num_threads(1)  # one thread: the same reductions in every process


# --- safetensors (the format's documented layout: u64 header length, JSON, data) ---

def save_safetensors(path: str, tensors: Dict[str, torch.Tensor]) -> None:
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        b = tensors[name].detach().contiguous().to(torch.float32).numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def load_safetensors(path: str) -> Dict[str, torch.Tensor]:
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8 or n > 1 << 24:
        raise ValueError(f"{path}: header of {n} bytes")
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] != "F32":
            raise ValueError(f"{name}: dtype {meta['dtype']}")
        a, b = meta["data_offsets"]
        out[name] = torch.from_numpy(np.frombuffer(data[a:b], dtype="<f4").copy()).reshape(meta["shape"])
    return out


# --- the model ---

class TextEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(257, DIM)  # bytes + padding
        self.pos = nn.Parameter(torch.randn(TOKENS, DIM) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(DIM, 4, 128, dropout=0.0, batch_first=True) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def tokenize(text: str) -> list:
    b = list(text.encode("utf-8")[:TOKENS])
    return b + [256] * (TOKENS - len(b))


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    a = t.float()[:, None] * freqs[None]
    return torch.cat([torch.sin(a), torch.cos(a)], dim=1)


class CrossAttention(nn.Module):
    """Multi-head cross-attention from the latent to the text, its keys and
    values projected by the caller (project_kv) so they can be computed
    once per denoise, and the negative prompt's taken from a cache."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(8, ch)
        self.attn = nn.MultiheadAttention(ch, 4, kdim=DIM, vdim=DIM, batch_first=True)  # holds the weights

    def _weights(self) -> Tuple[torch.Tensor, ...]:
        a, e = self.attn, self.attn.embed_dim
        if a._qkv_same_embed_dim:
            wq, wk, wv = a.in_proj_weight.split(e)
        else:
            wq, wk, wv = a.q_proj_weight, a.k_proj_weight, a.v_proj_weight
        bq, bk, bv = a.in_proj_bias.split(e)
        return wq, wk, wv, bq, bk, bv

    def project_kv(self, ctx: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of text ctx [batch, TOKENS, DIM]."""
        _, wk, wv, _, bk, bv = self._weights()
        return F.linear(ctx, wk, bk), F.linear(ctx, wv, bv)

    def forward(self, x: torch.Tensor, kv: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        b, c, h, w = x.shape
        wq, _, _, bq, _, _ = self._weights()
        heads = self.attn.num_heads
        hd = c // heads
        q = F.linear(self.norm(x).flatten(2).transpose(1, 2), wq, bq)
        q = q.reshape(b, h * w, heads, hd).transpose(1, 2)
        k, v = (t.reshape(b, -1, heads, hd).transpose(1, 2) for t in kv)
        att = torch.softmax((q @ k.transpose(-2, -1)) / math.sqrt(hd), dim=-1)
        y = self.attn.out_proj((att @ v).transpose(1, 2).reshape(b, h * w, c))
        return x + y.transpose(1, 2).reshape(b, c, h, w)


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, temb: int) -> None:
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(8, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.t = nn.Linear(temb, cout)
        self.n2, self.c2 = nn.GroupNorm(8, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.c1(torch.nn.functional.silu(self.n1(x))) + self.t(t)[:, :, None, None]
        h = self.c2(torch.nn.functional.silu(self.n2(h)))
        return self.skip(x) + h


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.temb = nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 128))
        self.stem = nn.Conv2d(CHANNELS, 32, 3, padding=1)
        self.down1 = ResBlock(32, 32, 128)
        self.down = nn.Conv2d(32, 64, 3, stride=2, padding=1)
        self.mid = ResBlock(64, 64, 128)
        self.attn = CrossAttention(64)
        self.up = nn.ConvTranspose2d(64, 32, 4, stride=2, padding=1)
        self.up1 = ResBlock(64, 32, 128)
        self.attn_up = CrossAttention(32)
        self.out = nn.Sequential(nn.GroupNorm(8, 32), nn.SiLU(), nn.Conv2d(32, CHANNELS, 3, padding=1))

    def branch_kv(self, text: torch.Tensor) -> KV:
        """One branch's keys and values, text [1, TOKENS, DIM]: they depend
        on the text alone, so the negative prompt's can be cached."""
        return [layer.project_kv(text) for layer in (self.attn, self.attn_up)]

    def context_kv(self, cond: torch.Tensor, frames: int, uncond: Optional[KV] = None) -> KV:
        """Both branches' keys and values for a batch of frames latents,
        each frame's prompt then negative prompt (the order of forward's
        batch); uncond, if given, is the negative prompt's branch_kv."""
        kc = self.branch_kv(cond[0:1].clone())
        ku = uncond if uncond is not None else self.branch_kv(cond[1:2].clone())
        return [(torch.cat([k1, k2]).repeat(frames, 1, 1), torch.cat([v1, v2]).repeat(frames, 1, 1))
                for (k1, v1), (k2, v2) in zip(kc, ku)]

    def forward(self, x: torch.Tensor, t: torch.Tensor, kv: KV) -> torch.Tensor:
        te = self.temb(timestep_embedding(t, 64))
        h0 = self.down1(self.stem(x), te)
        h = self.attn(self.mid(self.down(h0), te), kv[0])
        h = self.up1(torch.cat([self.up(h), h0], dim=1), te)
        return self.out(self.attn_up(h, kv[1]))


def kv_shapes() -> List[Tuple[int, int]]:
    """The shapes of one branch's keys (and values) per layer: [TOKENS, channels]."""
    return [(TOKENS, 64), (TOKENS, 32)]


def kv_bytes() -> int:
    return sum(2 * 4 * t * c for t, c in kv_shapes())


def kv_pack(kv: KV) -> np.ndarray:
    """One branch's keys and values as bytes: each layer's keys then values, float32."""
    return np.concatenate([t.detach().contiguous().numpy().astype("<f4").reshape(-1) for pair in kv for t in pair]).view(np.uint8)


def kv_unpack(b: np.ndarray) -> KV:
    """kv_pack's inverse, into fresh tensors (copies, never views of b)."""
    flat = torch.from_numpy(np.array(b, dtype=np.uint8).view("<f4").astype(np.float32))
    out, at = [], 0
    for t, c in kv_shapes():
        n = t * c
        k = flat[at:at + n].reshape(1, t, c).clone()
        v = flat[at + n:at + 2 * n].reshape(1, t, c).clone()
        out.append((k, v))
        at += 2 * n
    return out


class VAEDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layers = [nn.Conv2d(CHANNELS, 64, 3, padding=1), nn.SiLU()]
        for cin, cout in ((64, 48), (48, 32), (32, 16)):
            layers += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(cin, cout, 3, padding=1), nn.SiLU()]
        layers += [nn.Conv2d(16, 3, 3, padding=1)]
        self.net = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.net(z))


class Pipeline(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.text = TextEncoder()
        self.unet = UNet()
        self.vae = VAEDecoder()
        betas = torch.linspace(1e-4, 0.02, TRAIN_STEPS, dtype=torch.float64)
        self.alphas_cumprod = torch.cumprod(1 - betas, dim=0)
        self.weights_id = ""  # build sets it

    # Each stage reads and writes arrays (views of the arena in a worker),
    # so the reference run and the mesh run the very same code.

    @torch.no_grad()
    def encode(self, prompt: str, negative: str, out: torch.Tensor) -> None:
        ids = torch.tensor([tokenize(prompt), tokenize(negative)], dtype=torch.long)
        out.copy_(self.text(ids))

    @torch.no_grad()
    def denoise(self, cond: torch.Tensor, seed: int, steps: int, guidance: float, out: torch.Tensor,
                each_step: Callable[[int, int, bool, torch.Tensor], None],
                resume: Optional[Tuple[int, torch.Tensor]] = None, uncond_kv: Optional[KV] = None) -> None:
        """DDIM from the seed's noise, or from resume (the steps done and
        the latent after them); each_step(i, steps, before, x) runs before
        and after step i. The run is a function of the seed, the
        conditioning and the latent at the step it starts from, so a resume
        gives the uninterrupted run's bytes."""
        frames, c, h, w = out.shape
        if resume is None:
            g = torch.Generator().manual_seed(seed)
            x = torch.randn((frames, c, h, w), generator=g, dtype=torch.float32)
            start = 0
        else:
            start, x = resume
        ts = torch.linspace(TRAIN_STEPS - 1, 0, steps, dtype=torch.float64).round().long()
        kv = self.unet.context_kv(cond, frames, uncond_kv)
        for i in range(start, steps):
            each_step(i, steps, True, x)
            t = ts[i]
            xin = x.repeat_interleave(2, dim=0)
            eps = self.unet(xin, t.repeat(2 * frames), kv)
            e_c, e_u = eps[0::2], eps[1::2]
            e = e_u + guidance * (e_c - e_u)
            a_t = self.alphas_cumprod[t].float()
            a_prev = self.alphas_cumprod[ts[i + 1]].float() if i + 1 < steps else torch.tensor(1.0)
            x0 = (x - (1 - a_t).sqrt() * e) / a_t.sqrt()
            x0 = x0.clamp(-4, 4)
            x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * e
            each_step(i, steps, False, x)
        out.copy_(x)

    @torch.no_grad()
    def decode(self, latent: torch.Tensor, out: torch.Tensor) -> None:
        rgb = self.vae(latent)  # [F, 3, H, W] in (-1, 1)
        pix = ((rgb + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
        out[:, :, :, :3].copy_(pix.permute(0, 2, 3, 1))
        out[:, :, :, 3] = 255


def build(weights: str) -> Pipeline:
    p = Pipeline()
    state = load_safetensors(weights)
    p.load_state_dict(state, strict=True)
    # The weights' identity, in tensor cache keys: values computed with
    # other weights are never used.
    p.weights_id = hashlib.sha256(Path(weights).read_bytes()).hexdigest()[:16]
    return p.eval()


def write_weights(path: str) -> None:
    torch.manual_seed(0)
    p = Pipeline()
    with torch.no_grad():  # scale the output layers so guidance does not saturate every pixel
        p.unet.out[-1].weight.mul_(0.5)
    save_safetensors(path, p.state_dict())


def model_decl(stages, checkpoint_every: int = 0) -> Model:
    denoises = "denoise" in stages
    return Model(name=MODEL, stages=stages, cond=Layout("float32", [2, TOKENS, DIM]),
                 latent=LatentLayout("float32", CHANNELS, SCALE), default_steps=12, max_side=256, max_frames=4,
                 max_steps=200,
                 # The checkpoint's latent is the sampler's x, float32 like the latent.
                 checkpoint=CheckpointSpec(SAMPLER, "float32", CHANNELS, checkpoint_every) if denoises else None,
                 tensor_cache=denoises)


# The sampler state of a checkpoint: magic, version, steps done, the
# run's step count, seed, frames, height, width (the latent rides in the
# checkpoint buffer).
_STATE = struct.Struct("<4sBIIqIII")
_STATE_MAGIC, _STATE_VERSION = b"TTDS", 1


def sampler_state(step: int, spec) -> bytes:
    return _STATE.pack(_STATE_MAGIC, _STATE_VERSION, step, spec.steps, spec.seed, spec.frames, spec.height, spec.width)


def resume_point(task: Task) -> Optional[Tuple[int, torch.Tensor]]:
    """Where task's denoise starts: None (the seed's noise), or the steps
    done and a copy of the latent after them. A checkpoint of another
    sampler, schedule (step count), seed or size is refused (BadCheckpoint:
    the agent starts over from noise); the prompt may differ (a fork)."""
    r, s = task.resume, task.spec
    if r is None:
        return None
    if r.sampler != SAMPLER:
        raise BadCheckpoint(f"sampler {r.sampler!r}, this worker's is {SAMPLER!r}")
    if len(r.state) != _STATE.size:
        raise BadCheckpoint(f"a state of {len(r.state)} bytes, want {_STATE.size}")
    magic, version, step, steps, seed, frames, height, width = _STATE.unpack(r.state)
    if (magic, version) != (_STATE_MAGIC, _STATE_VERSION):
        raise BadCheckpoint(f"state {magic!r} version {version}, want {_STATE_MAGIC!r} version {_STATE_VERSION}")
    if step != r.step or r.total != s.steps or steps != s.steps or not 1 <= step < steps:
        raise BadCheckpoint(f"taken after step {step} of {steps} (resume: {r.step} of {r.total}); "
                            f"this sampler resumes only its own {s.steps}-step schedule")
    if (seed, frames, height, width) != (s.seed, s.frames, s.height, s.width):
        raise BadCheckpoint(f"taken for seed {seed}, {width}x{height}x{frames}; the request is seed {s.seed}, "
                            f"{s.width}x{s.height}x{s.frames}")
    x = r.torch_latent().clone()  # a copy: the region is the agent's once the task ends
    if not bool(torch.isfinite(x).all()):
        raise BadCheckpoint("the checkpoint's latent holds NaN or infinite values")
    return step, x


def uncond_kv(p: Pipeline, task: Task, cond: torch.Tensor) -> Optional[KV]:
    """The negative prompt's keys and values from the agent's tensor cache,
    or computed and offered to it; None when the task has no cache (the
    denoise then computes them)."""
    if not task.tensor_cache:
        return None
    neg = cond[1:2].clone()
    key = f"negkv/{p.weights_id}/{hashlib.sha256(neg.numpy().tobytes()).hexdigest()}"
    got = task.tensor_get(key, kv_bytes())
    if got is not None and got.size == kv_bytes():
        log.debug("task %d: the negative prompt's keys and values from the tensor cache", task.id)
        return kv_unpack(got)
    with torch.no_grad():
        kv = p.unet.branch_kv(neg)
    task.tensor_put(key, kv_pack(kv))
    return kv


def serve(p: Pipeline, stages, step_ms: int, checkpoint_every: int = 0) -> None:
    w = Worker(engine="torch-tiny/1", models=[model_decl(stages, checkpoint_every)], slots={s: 1 for s in stages})

    @w.encode
    def _encode(task: Task) -> None:
        p.encode(task.spec.prompt, task.spec.negative_prompt, task.torch_output())

    @w.denoise
    def _denoise(task: Task) -> None:
        (cond,) = task.torch_inputs()
        if not bool(torch.isfinite(cond).all()):
            raise BadInput("conditioning holds NaN or infinite values")
        s = task.spec
        resume = resume_point(task)

        def each_step(i: int, total: int, before: bool, x: torch.Tensor) -> None:
            if before:  # a step boundary, i steps done
                task.check_cancelled()
                if task.should_stop():
                    task.stop(i, sampler_state(i, s), x)  # checkpoints step i, raises Stopped
                if step_ms:
                    time.sleep(step_ms / 1000)  # stands in for a larger model's step time
            else:
                task.progress(i + 1, total)
                if task.wants_checkpoint(i + 1):
                    task.checkpoint(i + 1, sampler_state(i + 1, s), x)

        p.denoise(cond, s.seed, s.steps, s.guidance_scale, task.torch_output(), each_step,
                  resume=resume, uncond_kv=uncond_kv(p, task, cond))

    @w.decode
    def _decode(task: Task) -> None:
        (lat,) = task.torch_inputs()
        if not bool(torch.isfinite(lat).all()):
            raise BadInput("latent holds NaN or infinite values")
        p.decode(lat, task.torch_output())

    w.run(socket_from_args(sys.argv[1:]))


def reference(p: Pipeline, specs, out_path: str) -> None:
    """The whole pipeline in one process, no latentmesh: raw RGBA bytes of
    each spec (a JSON object or list of them), concatenated."""
    if isinstance(specs, dict):
        specs = [specs]
    Path(out_path).write_bytes(b"".join(reference_one(p, s) for s in specs))


def reference_one(p: Pipeline, spec: dict) -> bytes:
    frames, h, w = spec.get("frames", 1), spec["height"], spec["width"]
    cond = torch.zeros(2, TOKENS, DIM)
    p.encode(spec["prompt"], spec.get("negative_prompt", ""), cond)
    lat = torch.zeros(frames, CHANNELS, h // SCALE, w // SCALE)
    p.denoise(cond, spec["seed"], spec["steps"], spec["guidance_scale"], lat, lambda *a: None)
    out = torch.zeros(frames, h, w, 4, dtype=torch.uint8)
    p.decode(lat, out)
    return out.numpy().tobytes()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write-weights")
    ap.add_argument("--weights")
    ap.add_argument("--socket")
    ap.add_argument("--stages", default="encode,denoise,decode")
    ap.add_argument("--step-ms", type=int, default=0)
    ap.add_argument("--checkpoint-every", type=int, default=0, help="the model's default checkpoint period in steps (0: the agent's)")
    ap.add_argument("--reference", nargs=2, metavar=("SPEC_JSON", "OUT_RGBA"))
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    if a.write_weights:
        write_weights(a.write_weights)
        return
    p = build(a.weights)
    if a.reference:
        reference(p, json.loads(a.reference[0]), a.reference[1])
        return
    serve(p, a.stages.split(","), a.step_ms, a.checkpoint_every)


if __name__ == "__main__":
    main()
