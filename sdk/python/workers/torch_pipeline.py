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

Model ``latentmesh-tiny-video`` (protocol v2's model shapes), from the same
text encoder and U-Net:
- two named conditioning tensors per text: ``tokens`` / ``tokens_neg``, the
  token sequence of the prompt / negative prompt at its own length (1-32
  rows of 64, float32, variable length), and ``pooled``, a pooled vector of
  each [2, 32] (float16);
- a 4x temporal latent: videos of 4k+1 frames make k+1 latent frames, and
  the VAE decoder up-samples time (latent frame 0 to one video frame, each
  later one to four, each latent frame decoded alone);
- a reference image (required, at denoise), encoded to the first latent
  frame, which the sampler keeps on the image's noised latent;
- one parameter, ``guidance_rescale`` (0-1, default 0): classifier-free
  guidance rescaled towards the conditional prediction's spread;
- a causal VAE decoder: each latent frame is decoded with a quarter of the
  one before it added (a causal 3D VAE's cache, in miniature), so a job's
  chunks decode as one stream, its state kept between them (protocol v2,
  decode_state);
- the first latent frame is held on the reference image's latent, which
  makes it final before the first step: the denoise reports it ready at
  once (chunk_ready), so the decode of chunk 0 starts while it runs.

Adapters (protocol v2, adapters): a LoRA-like low-rank update of the mid
cross-attention's query projection of the U-Net, ``q += scale * up(down(h))``
(``--write-adapter``), loaded and unloaded while serving by commands on
standard input with ``--control``: ``load-adapter MODEL NAME PATH``,
``unload-adapter MODEL NAME``.

Weights are generated from a fixed seed (no download) and stored in a
safetensors file (``--write-weights``); workers load them with ``--weights``.
``--reference`` runs the whole pipeline in this one process, without
latentmesh, for comparison. Everything runs on one CPU thread so results are
bit-identical across processes.

``--device cuda`` runs the same worker on a GPU (not bit-identical to the
CPU, and not across GPU models).

    torch_pipeline.py --write-weights W
    torch_pipeline.py --weights W --socket PATH [--stages encode,denoise,decode] [--step-ms N] [--checkpoint-every N] [--device D]
    torch_pipeline.py --weights W --reference SPEC_JSON OUT_RGBA [--device D]
    torch_pipeline.py --write-adapter A [--adapter-seed N]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from latentmesh_engine import (Batch, BadCheckpoint, BadInput, CheckpointSpec, CondTensor, ImageSpec,  # noqa: E402
                               LatentLayout, Layout, Model, NoAdapter, Param, Task, Worker, socket_from_args)

MODEL = "latentmesh-tiny-torch"
VIDEO_MODEL = "latentmesh-tiny-video"
TOKENS, DIM, CHANNELS, SCALE = 32, 64, 4, 8
POOLED, TEMPORAL = 32, 4  # the video model's pooled vector, its latent's temporal compression
TRAIN_STEPS = 1000
# SAMPLER names the checkpoint state's format and the schedule; change it
# with anything that changes the sampler's output.
SAMPLER = "torch-tiny/ddim/1"

log = logging.getLogger("torch_pipeline")

KV = List[Tuple[torch.Tensor, torch.Tensor]]  # per cross-attention layer: keys, values [batch, TOKENS, channels]
Lora = Tuple[torch.Tensor, torch.Tensor, float]  # down [r, 64], up [64, r], scale: the mid attention's query update
CAUSAL = 0.25  # the video VAE's share of the latent frame before
ADAPTER_RANK = 4

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
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
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

    def forward(self, x: torch.Tensor, kv: Tuple[torch.Tensor, torch.Tensor], lora: Optional[Lora] = None) -> torch.Tensor:
        b, c, h, w = x.shape
        wq, _, _, bq, _, _ = self._weights()
        heads = self.attn.num_heads
        hd = c // heads
        hn = self.norm(x).flatten(2).transpose(1, 2)
        q = F.linear(hn, wq, bq)
        if lora is not None:  # a low-rank update of the query projection, unmerged: the base path is unchanged
            down, up, scale = lora
            q = q + scale * F.linear(F.linear(hn, down), up)
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

    def forward(self, x: torch.Tensor, t: torch.Tensor, kv: KV, lora: Optional[Lora] = None) -> torch.Tensor:
        te = self.temb(timestep_embedding(t, 64))
        h0 = self.down1(self.stem(x), te)
        h = self.attn(self.mid(self.down(h0), te), kv[0], lora)
        h = self.up1(torch.cat([self.up(h), h0], dim=1), te)
        return self.out(self.attn_up(h, kv[1]))


def kv_shapes() -> List[Tuple[int, int]]:
    """The shapes of one branch's keys (and values) per layer: [TOKENS, channels]."""
    return [(TOKENS, 64), (TOKENS, 32)]


def kv_bytes() -> int:
    return sum(2 * 4 * t * c for t, c in kv_shapes())


def kv_pack(kv: KV) -> np.ndarray:
    """One branch's keys and values as bytes: each layer's keys then values, float32."""
    return np.concatenate([t.detach().contiguous().cpu().numpy().astype("<f4").reshape(-1) for pair in kv for t in pair]).view(np.uint8)


def kv_unpack(b: np.ndarray) -> KV:
    """kv_pack's inverse, into fresh tensors (copies, never views of b)."""
    flat = torch.from_numpy(np.array(b, dtype=np.uint8).view("<f4").astype(np.float32))  # the caller moves it
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
        self.video = VideoParts()  # made last: the weights above are what they always were
        self.device = torch.device("cpu")  # build moves it

    # Each stage reads and writes arrays (views of the arena in a worker),
    # so the reference run and the mesh run the very same code.

    @torch.no_grad()
    def encode(self, prompt: str, negative: str, out: torch.Tensor) -> None:
        self.encode_batch([(prompt, negative)], [out])  # a batch of one is the same call

    @torch.no_grad()
    def denoise(self, cond: torch.Tensor, seed: int, steps: int, guidance: float, out: torch.Tensor,
                each_step: Callable[[int, int, bool, torch.Tensor], None],
                resume: Optional[Tuple[int, torch.Tensor]] = None, uncond_kv: Optional[KV] = None,
                lora: Optional[Lora] = None) -> None:
        """DDIM from the seed's noise, or from resume (the steps done and
        the latent after them); each_step(i, steps, before, x) runs before
        and after step i. The run is a function of the seed, the
        conditioning and the latent at the step it starts from, so a resume
        gives the uninterrupted run's bytes."""
        frames, c, h, w = out.shape
        if resume is None:
            g = torch.Generator().manual_seed(seed)  # on the CPU: the same noise on any device
            x = torch.randn((frames, c, h, w), generator=g, dtype=torch.float32).to(self.device)
            start = 0
        else:
            start, x = resume
            x = x.to(self.device)
        ts = torch.linspace(TRAIN_STEPS - 1, 0, steps, dtype=torch.float64).round().long()
        cond = cond.to(self.device)
        if uncond_kv is not None:
            uncond_kv = [(k.to(self.device), v.to(self.device)) for k, v in uncond_kv]
        kv = self.unet.context_kv(cond, frames, uncond_kv)
        for i in range(start, steps):
            each_step(i, steps, True, x)
            x = self.ddim_step(x, ts, i, kv, guidance, lora)
            each_step(i, steps, False, x)
        out.copy_(x)

    def ddim_step(self, x: torch.Tensor, ts: torch.Tensor, i: int, kv: KV, guidance: Union[float, torch.Tensor],
                  lora: Optional[Lora]) -> torch.Tensor:
        """DDIM step i of the schedule ts from latents x (a batch of frames,
        each with its prompt's and negative prompt's rows in kv), with
        classifier-free guidance: a number, or one per row of x."""
        t = ts[i]
        xin = x.repeat_interleave(2, dim=0)
        eps = self.unet(xin, t.repeat(xin.shape[0]).to(self.device), kv, lora)
        e_c, e_u = eps[0::2], eps[1::2]
        e = e_u + guidance * (e_c - e_u)
        a_t = self.alphas_cumprod[t].float()
        a_prev = self.alphas_cumprod[ts[i + 1]].float() if i + 1 < len(ts) else torch.tensor(1.0)
        x0 = (x - (1 - a_t).sqrt() * e) / a_t.sqrt()
        x0 = x0.clamp(-4, 4)
        return a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * e

    # --- batches: several requests of one size and step count in one call ---

    @torch.no_grad()
    def encode_batch(self, texts: List[Tuple[str, str]], outs: List[torch.Tensor]) -> None:
        """encode of each (prompt, negative prompt), in one text encoder call."""
        ids = torch.tensor([tokenize(t) for pair in texts for t in pair], dtype=torch.long, device=self.device)
        e = self.text(ids)
        for j, out in enumerate(outs):
            out.copy_(e[2 * j:2 * j + 2])

    @torch.no_grad()
    def denoise_batch(self, conds: List[torch.Tensor], seeds: List[int], steps: int, guidances: List[float],
                      outs: List[torch.Tensor], boundary: Callable[[int, List[torch.Tensor]], List[int]],
                      after: Callable[[int, List[torch.Tensor]], None], uncond_kvs: List[Optional[KV]],
                      lora: Optional[Lora] = None) -> None:
        """denoise of several requests of one size and step count, each
        from its seed's noise, as one batch of UNet calls: member j's rows
        are its frames. boundary(i, xs) runs before step i with each live
        member's latent and returns the positions of the members that left,
        in the order they left, each in the list as it stood then (their rows
        are dropped in that order); after(i, xs) runs after
        step i. The math of each row is denoise's."""
        frames, c, h, w = outs[0].shape
        xs = []
        for seed in seeds:
            g = torch.Generator().manual_seed(seed)  # on the CPU: the same noise on any device
            xs.append(torch.randn((frames, c, h, w), generator=g, dtype=torch.float32))
        x = torch.cat(xs).to(self.device)
        kvs = []
        for cond, ukv in zip(conds, uncond_kvs):
            if ukv is not None:
                ukv = [(k.to(self.device), v.to(self.device)) for k, v in ukv]
            kvs.append(self.unet.context_kv(cond.to(self.device), frames, ukv))
        kv = [(torch.cat([m[L][0] for m in kvs]), torch.cat([m[L][1] for m in kvs])) for L in range(len(kvs[0]))]
        g = torch.tensor(guidances, dtype=torch.float32, device=self.device).repeat_interleave(frames)[:, None, None, None]
        outs = list(outs)
        ts = torch.linspace(TRAIN_STEPS - 1, 0, steps, dtype=torch.float64).round().long()
        for i in range(steps):
            for j in boundary(i, list(x.split(frames))):
                keep = torch.ones(x.shape[0], dtype=torch.bool, device=self.device)
                keep[j * frames:(j + 1) * frames] = False
                keep2 = keep.repeat_interleave(2)
                x, g = x[keep], g[keep]
                kv = [(k[keep2], v[keep2]) for k, v in kv]
                del outs[j]
            if not outs:
                return
            x = self.ddim_step(x, ts, i, kv, g, lora)
            after(i, list(x.split(frames)))
        for out, xj in zip(outs, x.split(frames)):
            out.copy_(xj)

    @torch.no_grad()
    def decode_batch(self, latents: List[torch.Tensor], outs: List[torch.Tensor]) -> None:
        """decode of each latent, in one VAE call."""
        frames = [lat.shape[0] for lat in latents]
        rgb = self.vae(torch.cat(latents).to(self.device))  # [frames, 3, H, W] in (-1, 1)
        for out, part in zip(outs, rgb.split(frames)):
            out[:, :, :, :3].copy_(to_pixels(part).permute(0, 2, 3, 1))
            out[:, :, :, 3] = 255

    @torch.no_grad()
    def decode(self, latent: torch.Tensor, out: torch.Tensor) -> None:
        self.decode_batch([latent], [out])  # a batch of one is the same call

    # --- the video model (protocol v2's shapes) ---

    @torch.no_grad()
    def encode_text(self, text: str, tokens: torch.Tensor) -> Tuple[int, torch.Tensor]:
        """One text's token sequence into tokens [TOKENS, DIM] (the first n
        rows; n, 1-32, is the text's length in bytes, an empty text one
        padding token) and its pooled vector [POOLED]."""
        ids = list(text.encode("utf-8")[:TOKENS]) or [256]
        n = len(ids)
        t = self.text
        x = t.tok(torch.tensor([ids], dtype=torch.long, device=self.device)) + t.pos[:n]
        for layer in t.layers:
            x = layer(x)
        x = t.norm(x)[0]  # [n, DIM]
        tokens[:n].copy_(x)
        return n, self.video.pool(x.mean(dim=0))

    @torch.no_grad()
    def encode_video(self, prompt: str, negative: str, conds: Dict[str, torch.Tensor]) -> Tuple[int, int]:
        """The named tensors: tokens, tokens_neg (their lengths returned)
        and pooled [2, POOLED] (float16)."""
        n, pc = self.encode_text(prompt, conds["tokens"])
        m, pu = self.encode_text(negative, conds["tokens_neg"])
        conds["pooled"].copy_(torch.stack([pc, pu]))
        return n, m

    @torch.no_grad()
    def image_latent(self, image: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """The reference image, RGBA uint8 [H0, W0, 4] at any size, resized
        to the request's and encoded to a latent frame [CHANNELS, h, w]."""
        rgb = image[:, :, :3].to(self.device).permute(2, 0, 1)[None].float() / 127.5 - 1
        rgb = F.interpolate(rgb, size=(h * SCALE, w * SCALE), mode="bilinear", align_corners=False)
        return self.video.enc(rgb)[0]

    @torch.no_grad()
    def denoise_video(self, tokens: torch.Tensor, tokens_neg: torch.Tensor, pooled: torch.Tensor, image: torch.Tensor,
                      seed: int, steps: int, guidance: float, rescale: float, out: torch.Tensor,
                      each_step: Callable[[int, int, bool, torch.Tensor], None],
                      chunk_ready: Optional[Callable[[int], None]] = None) -> None:
        """DDIM over a video latent [F, C, h, w]: the prompt's and the
        negative prompt's branches run apart (their sequences differ in
        length); the pooled vectors steer each branch's noise; the first
        latent frame is held on the reference image's latent at the step's
        noise level; guidance_rescale pulls the guided prediction's spread
        towards the conditional one's."""
        frames, c, h, w = out.shape
        g = torch.Generator().manual_seed(seed)
        x = torch.randn((frames, c, h, w), generator=g, dtype=torch.float32).to(self.device)
        noise0 = x[0].clone()
        z = self.image_latent(image, h, w)
        ts = torch.linspace(TRAIN_STEPS - 1, 0, steps, dtype=torch.float64).round().long()
        kv_c = [(k.repeat(frames, 1, 1), v.repeat(frames, 1, 1)) for k, v in self.unet.branch_kv(tokens.to(self.device)[None])]
        kv_u = [(k.repeat(frames, 1, 1), v.repeat(frames, 1, 1)) for k, v in self.unet.branch_kv(tokens_neg.to(self.device)[None])]
        bias = torch.tanh(self.video.pooled_bias(pooled.to(self.device).float()))[:, :, None, None] * 0.1  # [2, C, 1, 1]
        x[0] = self.alphas_cumprod[ts[0]].float().sqrt() * z + (1 - self.alphas_cumprod[ts[0]].float()).sqrt() * noise0
        # The first latent frame is held on the image's latent at each
        # step's noise level; after the last step (a_prev = 1) it is this,
        # computed as that step computes it: final now, so written now.
        one = torch.tensor(1.0)
        final0 = one.sqrt() * z + (1 - one).sqrt() * noise0
        out[0].copy_(final0)
        if chunk_ready is not None:
            chunk_ready(0)
        for i in range(steps):
            each_step(i, steps, True, x)
            t = ts[i].repeat(frames).to(self.device)
            e_c = self.unet(x, t, kv_c) + bias[0]
            e_u = self.unet(x, t, kv_u) + bias[1]
            e = e_u + guidance * (e_c - e_u)
            if rescale > 0:
                std_c = e_c.std(dim=(1, 2, 3), keepdim=True)
                std_g = e.std(dim=(1, 2, 3), keepdim=True)
                e = rescale * (e * (std_c / std_g)) + (1 - rescale) * e
            a_t = self.alphas_cumprod[ts[i]].float()
            a_prev = self.alphas_cumprod[ts[i + 1]].float() if i + 1 < steps else torch.tensor(1.0)
            x0 = ((x - (1 - a_t).sqrt() * e) / a_t.sqrt()).clamp(-4, 4) + 0.1 * z
            x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * e
            x[0] = a_prev.sqrt() * z + (1 - a_prev).sqrt() * noise0
            each_step(i, steps, False, x)
        if not torch.equal(x[0], final0):
            raise RuntimeError("latent frame 0 changed after it was reported final")
        out[1:].copy_(x[1:])

    @torch.no_grad()
    def decode_video(self, latent: torch.Tensor, first: int, out: torch.Tensor, state: Dict) -> None:
        """Latent frames first, first+1, ... ([k, C, h, w]) into their video
        frames (out [n, H, W, 4]): latent frame 0 to one, each later one to
        TEMPORAL. The decoder is causal: latent frame j is decoded with
        CAUSAL times frame j-1 added, which state["prev"] carries from one
        chunk of a job to the next, so chunks decode to the same bytes as
        the whole."""
        at = 0
        prev = None if first == 0 else state.get("prev")
        if first > 0 and prev is None:
            raise BadInput(f"latent frame {first} decoded without the frame before it (no decode state)")
        for j in range(latent.shape[0]):
            z = latent[j:j + 1].to(self.device)
            zin = z if prev is None else z + CAUSAL * prev
            prev = z.clone()
            sub = self.video.vae(zin)  # [TEMPORAL, 3, H, W]
            if first + j == 0:
                sub = sub[:1]
            n = sub.shape[0]
            out[at:at + n, :, :, :3].copy_(to_pixels(sub).permute(0, 2, 3, 1))
            at += n
        if at != out.shape[0]:
            raise BadInput(f"latent frames {first}-{first + latent.shape[0] - 1} make {at} video frames, the output holds {out.shape[0]}")
        out[:, :, :, 3] = 255
        state["prev"] = prev


def to_pixels(rgb: torch.Tensor) -> torch.Tensor:
    """RGB in (-1, 1) to uint8, on the CPU."""
    return ((rgb + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).cpu()


class VideoParts(nn.Module):
    """What the video model adds to the shared text encoder and U-Net: the
    pooled projection, the pooled vector's bias on the noise, the image
    encoder and the temporal VAE decoder."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.Linear(DIM, POOLED)
        self.pooled_bias = nn.Linear(POOLED, CHANNELS)
        self.enc = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.SiLU(),
                                 nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.SiLU(),
                                 nn.Conv2d(32, CHANNELS, 3, stride=2, padding=1))
        self.vae = TemporalVAEDecoder()


class TemporalVAEDecoder(nn.Module):
    """The VAE decoder with time up-sampled: one latent frame to TEMPORAL
    RGB frames (the head's channels split in time)."""

    def __init__(self) -> None:
        super().__init__()
        layers = [nn.Conv2d(CHANNELS, 64, 3, padding=1), nn.SiLU()]
        for cin, cout in ((64, 48), (48, 32), (32, 16)):
            layers += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(cin, cout, 3, padding=1), nn.SiLU()]
        layers += [nn.Conv2d(16, 3 * TEMPORAL, 3, padding=1)]
        self.net = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        y = self.net(z)  # [1, 3*TEMPORAL, H, W]
        return torch.tanh(y.reshape(TEMPORAL, 3, y.shape[2], y.shape[3]))


def build(weights: str, device: str = "cpu") -> Pipeline:
    p = Pipeline()
    state = load_safetensors(weights)
    p.load_state_dict(state, strict=True)
    # The weights' identity, in tensor cache keys: values computed with
    # other weights are never used.
    p.weights_id = hashlib.sha256(Path(weights).read_bytes()).hexdigest()[:16]
    p.device = torch.device(device)
    return p.to(p.device).eval()


def write_weights(path: str) -> None:
    torch.manual_seed(0)
    p = Pipeline()
    with torch.no_grad():  # scale the output layers so guidance does not saturate every pixel
        p.unet.out[-1].weight.mul_(0.5)
    save_safetensors(path, p.state_dict())


def model_decl(stages, checkpoint_every: int = 0, batch: int = 1) -> Model:
    denoises = "denoise" in stages
    return Model(name=MODEL, stages=stages, cond=Layout("float32", [2, TOKENS, DIM]),
                 latent=LatentLayout("float32", CHANNELS, SCALE), default_steps=12, max_side=256, max_frames=4,
                 max_steps=200,
                 # The checkpoint's latent is the sampler's x, float32 like the latent.
                 checkpoint=CheckpointSpec(SAMPLER, "float32", CHANNELS, checkpoint_every) if denoises else None,
                 tensor_cache=denoises, adapters=denoises,
                 batch={st: batch for st in stages} if batch > 1 else None)


def video_decl(stages) -> Model:
    """The video model: named tensors, a 4x temporal latent (videos of
    4k+1 frames, up to 81: 21 latent frames), a required reference image at
    denoise, and guidance_rescale."""
    return Model(name=VIDEO_MODEL, stages=stages,
                 conds=[CondTensor("tokens", "float32", [TOKENS, DIM], var_len=True),
                        CondTensor("tokens_neg", "float32", [TOKENS, DIM], var_len=True),
                        CondTensor("pooled", "float16", [2, POOLED])],
                 latent=LatentLayout("float32", CHANNELS, SCALE, temporal=TEMPORAL),
                 default_steps=8, max_side=128, max_frames=81, max_steps=200, frame_step=TEMPORAL, frame_offset=1,
                 image=ImageSpec(stages=["denoise"], required=True),
                 params=[Param.number("guidance_rescale", 0.0, 1.0, 0.0)],
                 decode_state=True, chunk_ready=True)


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
        kv = p.unet.branch_kv(neg.to(p.device))
    task.tensor_put(key, kv_pack(kv))
    return kv


def write_adapter(path: str, seed: int) -> None:
    """A LoRA-like adapter of the mid cross-attention's query projection:
    down [ADAPTER_RANK, 64], up [64, ADAPTER_RANK], scale, from seed."""
    g = torch.Generator().manual_seed(seed)
    save_safetensors(path, {"attn.down": torch.randn(ADAPTER_RANK, 64, generator=g) * 0.3,
                            "attn.up": torch.randn(64, ADAPTER_RANK, generator=g) * 0.3,
                            "scale": torch.tensor([1.0])})


def load_adapter(path: str, device: torch.device) -> Lora:
    t = load_safetensors(path)
    down, up = t["attn.down"], t["attn.up"]
    if tuple(down.shape) != (ADAPTER_RANK, 64) or tuple(up.shape) != (64, ADAPTER_RANK):
        raise ValueError(f"{path}: adapter of shapes {tuple(down.shape)}, {tuple(up.shape)}")
    return down.to(device), up.to(device), float(t["scale"][0])


class Adapters:
    """The adapters loaded, by model and name (the control thread loads
    and unloads; denoise tasks read)."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._loaded: Dict[Tuple[str, str], Lora] = {}

    def get(self, model: str, name: str) -> Optional[Lora]:
        with self._mu:
            return self._loaded.get((model, name))

    def put(self, model: str, name: str, lora: Optional[Lora]) -> None:
        with self._mu:
            if lora is None:
                self._loaded.pop((model, name), None)
            else:
                self._loaded[(model, name)] = lora


def control(p: Pipeline, w: Worker, adapters: Adapters, lines) -> None:
    """Commands from lines (standard input): load-adapter MODEL NAME PATH,
    unload-adapter MODEL NAME. The weights are loaded before the agent is
    told, and dropped after."""
    for line in lines:
        args = line.split()
        try:
            if args[:1] == ["load-adapter"] and len(args) == 4:
                adapters.put(args[1], args[2], load_adapter(args[3], p.device))
                w.load_adapter(args[1], args[2])
                log.info("control: adapter %s of %s loaded", args[2], args[1])
            elif args[:1] == ["unload-adapter"] and len(args) == 3:
                w.unload_adapter(args[1], args[2])
                adapters.put(args[1], args[2], None)
                log.info("control: adapter %s of %s unloaded", args[2], args[1])
            elif args:
                log.warning("control: unknown command %r", line.strip())
        except Exception as e:  # a bad command is reported, the worker goes on
            log.warning("control: %r failed: %s", line.strip(), e)


def serve(p: Pipeline, stages, step_ms: int, checkpoint_every: int = 0, controlled: bool = False,
          reconnect: bool = False, batch: int = 1) -> None:
    w = Worker(engine="torch-tiny/1", models=[model_decl(stages, checkpoint_every, batch), video_decl(stages)],
               slots={s: 1 for s in stages})
    adapters = Adapters()
    if controlled:
        threading.Thread(target=control, args=(p, w, adapters, sys.stdin), daemon=True).start()

    @w.encode
    def _encode(task: Task) -> None:
        if task.model == VIDEO_MODEL:
            n, m = p.encode_video(task.spec.prompt, task.spec.negative_prompt, task.torch_conds())
            task.set_len("tokens", n)
            task.set_len("tokens_neg", m)
            return
        p.encode(task.spec.prompt, task.spec.negative_prompt, task.torch_output())

    @w.denoise
    def _denoise(task: Task) -> None:
        if task.model == VIDEO_MODEL:
            denoise_video(p, task, step_ms)
            return
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

        lora = None
        if task.adapter:
            lora = adapters.get(task.model, task.adapter)
            if lora is None:
                raise NoAdapter(f"adapter {task.adapter} of {task.model} is not loaded here")
        p.denoise(cond, s.seed, s.steps, s.guidance_scale, task.torch_output(), each_step,
                  resume=resume, uncond_kv=uncond_kv(p, task, cond), lora=lora)

    @w.decode
    def _decode(task: Task) -> None:
        (lat,) = task.torch_inputs()
        if not bool(torch.isfinite(lat).all()):
            raise BadInput("latent holds NaN or infinite values")
        if task.model == VIDEO_MODEL:
            if task.stream is not None:  # the test of the early handoff reads this line
                log.info("decode of job %s chunk %d started at %.6f", task.stream.job, task.stream.chunk, time.time())
            p.decode_video(lat, task.first_frame, task.torch_output(), task.state)
            return
        p.decode(lat, task.torch_output())

    serve_batches(p, w, adapters, step_ms)
    path = socket_from_args(sys.argv[1:])
    if reconnect:
        w.run_forever(path)
    else:
        w.run(path)


def serve_batches(p: Pipeline, w: Worker, adapters: "Adapters", step_ms: int) -> None:
    """The image model's batch callbacks (--batch): each stage's members in
    one call of the networks, every member's rows computed as alone (the
    latents are bit-identical to one-at-a-time runs; a decode's pixels may
    differ by a rounding, as the VAE's batched convolutions sum in another
    order). The agent batches only tasks of one size, frame count, step
    count and adapter."""
    log.info("batching the image model's stages")

    @w.encode_batch
    def _encode(b: Batch) -> None:
        p.encode_batch([(t.spec.prompt, t.spec.negative_prompt) for t in b.tasks], [t.torch_output() for t in b.tasks])
        log.info("batch of %d encode tasks ran", len(b.tasks))  # the batching test counts these lines

    @w.denoise_batch
    def _denoise(b: Batch) -> None:
        conds = finite_inputs(b, "conditioning")
        if not b.tasks:
            return
        lora = None
        if b.tasks[0].adapter:  # one adapter for every member
            lora = adapters.get(b.tasks[0].model, b.tasks[0].adapter)
            if lora is None:
                raise NoAdapter(f"adapter {b.tasks[0].adapter} of {b.tasks[0].model} is not loaded here")
        n, steps = len(b.tasks), b.spec.steps
        log.info("batch of %d denoise tasks started", n)  # the batching test counts these lines

        def boundary(i: int, xs: List[torch.Tensor]) -> List[int]:
            gone = b.prune()  # cancelled members leave, the others go on
            for j in gone:
                del xs[j]
            for j in reversed(range(len(b.tasks))):  # a stop checkpoints its member, which leaves
                t = b.tasks[j]
                if t.should_stop():
                    b.stop(t, i, sampler_state(i, t.spec), xs[j])
                    gone.append(j)
                    del xs[j]
            if step_ms and b.tasks:
                time.sleep(step_ms / 1000)  # stands in for a larger model's step time, once a batched step
            return gone

        def after(i: int, xs: List[torch.Tensor]) -> None:
            b.progress(i + 1, steps)
            for t, x in zip(b.tasks, xs):
                if t.wants_checkpoint(i + 1):
                    t.checkpoint(i + 1, sampler_state(i + 1, t.spec), x)

        p.denoise_batch(conds, [t.spec.seed for t in b.tasks], steps, [t.spec.guidance_scale for t in b.tasks],
                        [t.torch_output() for t in b.tasks], boundary, after,
                        [uncond_kv(p, t, c) for t, c in zip(b.tasks, conds)], lora=lora)

    @w.decode_batch
    def _decode(b: Batch) -> None:
        lats = finite_inputs(b, "latent")
        if b.tasks:
            p.decode_batch(lats, [t.torch_output() for t in b.tasks])
            log.info("batch of %d decode tasks ran", len(b.tasks))


def finite_inputs(b: Batch, what: str) -> List[torch.Tensor]:
    """Each member's one input, the members whose input holds NaN or
    infinite values failed and gone from the batch."""
    out = []
    for t in list(b.tasks):
        (x,) = t.torch_inputs()
        if bool(torch.isfinite(x).all()):
            out.append(x)
        else:
            b.leave(t, BadInput(f"{what} holds NaN or infinite values"))
    return out


def denoise_video(p: Pipeline, task: Task, step_ms: int) -> None:
    conds = task.torch_conds()
    for name, t in conds.items():
        if not bool(torch.isfinite(t).all()):
            raise BadInput(f"conditioning {name} holds NaN or infinite values")
    image = task.torch_image()
    if image is None:
        raise BadInput("the video model needs a reference image")
    s = task.spec

    def each_step(i: int, total: int, before: bool, x: torch.Tensor) -> None:
        if before:
            task.check_cancelled()
            if step_ms:
                time.sleep(step_ms / 1000)
        else:
            task.progress(i + 1, total)

    p.denoise_video(conds["tokens"], conds["tokens_neg"], conds["pooled"], image, s.seed, s.steps, s.guidance_scale,
                    float(task.params.get("guidance_rescale", 0.0)), task.torch_output(), each_step,
                    chunk_ready=task.chunk_ready)
    log.info("denoise task %d finished at %.6f", task.id, time.time())  # the test of the early handoff reads this line


def reference(p: Pipeline, specs, out_path: str) -> None:
    """The whole pipeline in one process, no latentmesh: raw RGBA bytes of
    each spec (a JSON object or list of them), concatenated."""
    if isinstance(specs, dict):
        specs = [specs]
    Path(out_path).write_bytes(b"".join(reference_one(p, s) for s in specs))


def reference_one(p: Pipeline, spec: dict) -> bytes:
    if spec.get("model") == VIDEO_MODEL:
        return reference_video(p, spec)
    frames, h, w = spec.get("frames", 1), spec["height"], spec["width"]
    cond = torch.zeros(2, TOKENS, DIM)
    p.encode(spec["prompt"], spec.get("negative_prompt", ""), cond)
    lat = torch.zeros(frames, CHANNELS, h // SCALE, w // SCALE)
    lora = load_adapter(spec["lora"], p.device) if spec.get("lora") else None
    p.denoise(cond, spec["seed"], spec["steps"], spec["guidance_scale"], lat, lambda *a: None, lora=lora)
    out = torch.zeros(frames, h, w, 4, dtype=torch.uint8)
    p.decode(lat, out)
    return out.numpy().tobytes()


def reference_video(p: Pipeline, spec: dict) -> bytes:
    """The video model in one process, as the mesh runs it: the named
    tensors written at their maximum and read at their lengths (pooled
    through float16), the image as raw RGBA (spec["image"]: path, width,
    height), one latent frame decoded at a time."""
    frames, h, w = spec.get("frames", 1), spec["height"], spec["width"]
    conds = {"tokens": torch.zeros(TOKENS, DIM), "tokens_neg": torch.zeros(TOKENS, DIM),
             "pooled": torch.zeros(2, POOLED, dtype=torch.float16)}
    n, m = p.encode_video(spec["prompt"], spec.get("negative_prompt", ""), conds)
    im = spec["image"]
    raw = np.frombuffer(Path(im["path"]).read_bytes(), dtype=np.uint8).reshape(im["height"], im["width"], 4)
    lf = video_decl(["decode"]).latent_frames(frames)
    lat = torch.zeros(lf, CHANNELS, h // SCALE, w // SCALE)
    p.denoise_video(conds["tokens"][:n], conds["tokens_neg"][:m], conds["pooled"], torch.from_numpy(raw.copy()), spec["seed"],
                    spec["steps"], spec["guidance_scale"], float(spec.get("params", {}).get("guidance_rescale", 0.0)), lat,
                    lambda *a: None)
    out = torch.zeros(frames, h, w, 4, dtype=torch.uint8)
    at, state = 0, {}
    for j in range(lf):
        n_out = 1 if j == 0 else TEMPORAL
        p.decode_video(lat[j:j + 1], j, out[at:at + n_out], state)
        at += n_out
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
    ap.add_argument("--device", default="cpu", help="torch device to run on: cpu (bit-identical across processes), cuda, cuda:1, ...")
    ap.add_argument("--control", action="store_true", help="read load-adapter/unload-adapter commands from standard input")
    ap.add_argument("--reconnect", action="store_true", help="connect again after the agent closes the socket (else exit)")
    ap.add_argument("--write-adapter", help="write a LoRA-like adapter (safetensors) and exit")
    ap.add_argument("--adapter-seed", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1, help="the most tasks of a stage of the image model one call takes (1: no batching)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    if a.write_weights:
        write_weights(a.write_weights)
        return
    if a.write_adapter:
        write_adapter(a.write_adapter, a.adapter_seed)
        return
    p = build(a.weights, a.device)
    if a.reference:
        reference(p, json.loads(a.reference[0]), a.reference[1])
        return
    serve(p, a.stages.split(","), a.step_ms, a.checkpoint_every, a.control, a.reconnect, a.batch)


if __name__ == "__main__":
    main()
