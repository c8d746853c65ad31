#!/usr/bin/python3
"""Reference worker 2: a small but real latent-diffusion pipeline in PyTorch.

Model ``latentmesh-tiny-torch``:
- text encoder: byte-level token embedding + learned positions + two
  transformer encoder layers + layer norm -> conditioning [2, 32, 64]
  (the prompt's row, then the negative prompt's: classifier-free guidance);
- denoiser: a conditional U-Net (conv stem, timestep embedding, one
  down/up level with skip connection, cross-attention to the text) that
  predicts noise, sampled with DDIM (eta 0) and classifier-free guidance;
- VAE decoder: convolutions and three 2x upsamplings from the 4-channel
  latent to RGB.

Weights are generated from a fixed seed (no download) and stored in a
safetensors file (``--write-weights``); workers load them with ``--weights``.
``--reference`` runs the whole pipeline in this one process, without
latentmesh, for comparison. Everything runs on one CPU thread so results are
bit-identical across processes.

    torch_pipeline.py --write-weights W
    torch_pipeline.py --weights W --socket PATH [--stages encode,denoise,decode] [--step-ms N]
    torch_pipeline.py --weights W --reference SPEC_JSON OUT_RGBA
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import struct
import sys
import time
from pathlib import Path
from typing import Dict

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from latentmesh_engine import BadInput, LatentLayout, Layout, Model, Task, Worker, socket_from_args  # noqa: E402

MODEL = "latentmesh-tiny-torch"
TOKENS, DIM, CHANNELS, SCALE = 32, 64, 4, 8
TRAIN_STEPS = 1000

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
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(8, ch)
        self.attn = nn.MultiheadAttention(ch, 4, kdim=DIM, vdim=DIM, batch_first=True)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        q = self.norm(x).flatten(2).transpose(1, 2)
        y, _ = self.attn(q, ctx, ctx, need_weights=False)
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

    def forward(self, x: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        te = self.temb(timestep_embedding(t, 64))
        h0 = self.down1(self.stem(x), te)
        h = self.attn(self.mid(self.down(h0), te), ctx)
        h = self.up1(torch.cat([self.up(h), h0], dim=1), te)
        return self.out(self.attn_up(h, ctx))


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

    # Each stage reads and writes arrays (views of the arena in a worker),
    # so the reference run and the mesh run the very same code.

    @torch.no_grad()
    def encode(self, prompt: str, negative: str, out: torch.Tensor) -> None:
        ids = torch.tensor([tokenize(prompt), tokenize(negative)], dtype=torch.long)
        out.copy_(self.text(ids))

    @torch.no_grad()
    def denoise(self, cond: torch.Tensor, seed: int, steps: int, guidance: float, out: torch.Tensor, each_step) -> None:
        frames, c, h, w = out.shape
        g = torch.Generator().manual_seed(seed)
        x = torch.randn((frames, c, h, w), generator=g, dtype=torch.float32)
        ts = torch.linspace(TRAIN_STEPS - 1, 0, steps, dtype=torch.float64).round().long()
        ctx = cond.repeat_interleave(frames, dim=0).reshape(2, frames, TOKENS, DIM).transpose(0, 1).reshape(2 * frames, TOKENS, DIM)
        for i in range(steps):
            each_step(i, steps, True)
            t = ts[i]
            xin = x.repeat_interleave(2, dim=0)
            eps = self.unet(xin, t.repeat(2 * frames), ctx)
            e_c, e_u = eps[0::2], eps[1::2]
            e = e_u + guidance * (e_c - e_u)
            a_t = self.alphas_cumprod[t].float()
            a_prev = self.alphas_cumprod[ts[i + 1]].float() if i + 1 < steps else torch.tensor(1.0)
            x0 = (x - (1 - a_t).sqrt() * e) / a_t.sqrt()
            x0 = x0.clamp(-4, 4)
            x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * e
            each_step(i, steps, False)
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
    return p.eval()


def write_weights(path: str) -> None:
    torch.manual_seed(0)
    p = Pipeline()
    with torch.no_grad():  # scale the output layers so guidance does not saturate every pixel
        p.unet.out[-1].weight.mul_(0.5)
    save_safetensors(path, p.state_dict())


def model_decl(stages) -> Model:
    return Model(name=MODEL, stages=stages, cond=Layout("float32", [2, TOKENS, DIM]),
                 latent=LatentLayout("float32", CHANNELS, SCALE), default_steps=12, max_side=256, max_frames=4,
                 max_steps=200)


def serve(p: Pipeline, stages, step_ms: int) -> None:
    w = Worker(engine="torch-tiny/1", models=[model_decl(stages)], slots={s: 1 for s in stages})

    @w.encode
    def _encode(task: Task) -> None:
        p.encode(task.spec.prompt, task.spec.negative_prompt, task.torch_output())

    @w.denoise
    def _denoise(task: Task) -> None:
        (cond,) = task.torch_inputs()
        if not bool(torch.isfinite(cond).all()):
            raise BadInput("conditioning holds NaN or infinite values")
        s = task.spec

        def each_step(i: int, total: int, before: bool) -> None:
            if before:
                task.check_cancelled()  # a step boundary: stop here if cancelled
                if step_ms:
                    time.sleep(step_ms / 1000)  # stands in for a larger model's step time
            else:
                task.progress(i + 1, total)

        p.denoise(cond, s.seed, s.steps, s.guidance_scale, task.torch_output(), each_step)

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
    ap.add_argument("--reference", nargs=2, metavar=("SPEC_JSON", "OUT_RGBA"))
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")  # the SDK logs task events
    if a.write_weights:
        write_weights(a.write_weights)
        return
    p = build(a.weights)
    if a.reference:
        reference(p, json.loads(a.reference[0]), a.reference[1])
        return
    serve(p, a.stages.split(","), a.step_ms)


if __name__ == "__main__":
    main()
