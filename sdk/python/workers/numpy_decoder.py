#!/usr/bin/python3
"""Reference worker 1: the built-in engine's decode stage in numpy.

It serves model ``latentmesh-reference`` on the decode stage and renders
exactly the RGBA pixels of agent/engine/decode.go (FrameDecoder.render); the
agent encodes them as PNG or GIF with the same code the built-in engine
uses, so a mesh mixing Go and Python decoders gives byte-identical files.

Bit-exactness: decode.go uses only + - * / and sqrt on float64, each
product rounded on its own (never fused), in a fixed order; numpy's
float64 element-wise operations are the same IEEE operations, evaluated
here in the same order, so every intermediate value is identical.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without pip install
from latentmesh_engine import BadInput, LatentLayout, Layout, Model, Task, Worker, socket_from_args  # noqa: E402

# Constants of agent/engine (engine.DefaultConfig and decode.go).
TABLE_SEED = 0x6C6D
SALT_TEXTURE = 5
VAE_SCALE = 8
TEX_CELL = 4
TEX_AMOUNT = 0.025
CHANNELS = 4
MASK = (1 << 64) - 1


def mix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def mix64_np(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def texture(width: int, height: int) -> np.ndarray:
    """The decoder's fine-texture lattice (NewFrameDecoder's d.tex)."""
    tw, th = width // TEX_CELL + 2, height // TEX_CELL + 2
    i = np.arange(tw * th, dtype=np.uint64)
    h = np.uint64(mix64(mix64(TABLE_SEED) ^ SALT_TEXTURE))  # hash4: seed, salt, then the coordinates
    h = mix64_np(h ^ (i % np.uint64(tw)))
    h = mix64_np(h ^ (i // np.uint64(tw)))
    u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return (2 * u) - 1


def upsample_taps(n: int, m: int):
    o = np.arange(n, dtype=np.float64)
    pos = np.clip(((o + 0.5) / VAE_SCALE) - 0.5, 0, m - 1)
    k = np.floor(pos)
    i0 = k.astype(np.int64)
    return i0, np.minimum(i0 + 1, m - 1), pos - k


def smoothstep(x: np.ndarray) -> np.ndarray:
    s = (x * x) * (3 - (2 * x))
    return np.where(x <= 0, 0.0, np.where(x >= 1, 1.0, s))


def squash(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x) + 1)


def lerp(a, b, t):
    return a + ((b - a) * t)


def render(lat: np.ndarray, width: int, height: int, tex: np.ndarray) -> np.ndarray:
    """One frame: lat is [C, h, w] float32; returns [H, W, 4] uint8."""
    nc, h, w = lat.shape
    xi0, xi1, xf = upsample_taps(width, w)
    yi0, yi1, yf = upsample_taps(height, h)
    p = lat.astype(np.float64)
    xf2, yf2 = xf[None, None, :], yf[None, :, None]
    top = lerp(p[:, yi0][:, :, xi0], p[:, yi0][:, :, xi1], xf2)
    bot = lerp(p[:, yi1][:, :, xi0], p[:, yi1][:, :, xi1], xf2)
    v = lerp(top, bot, yf2)  # [C, H, W]
    tw = width // TEX_CELL + 2
    Y = np.arange(height)
    X = np.arange(width)
    ty, tfy = Y // TEX_CELL, smoothstep((Y % TEX_CELL) / TEX_CELL)
    tx, tfx = X // TEX_CELL, smoothstep((X % TEX_CELL) / TEX_CELL)
    T = tex.reshape(-1, tw)
    t0 = lerp(T[ty][:, tx], T[ty][:, tx + 1], tfx[None, :])
    t1 = lerp(T[ty + 1][:, tx], T[ty + 1][:, tx + 1], tfx[None, :])
    grain = lerp(t0, t1, tfy[:, None])
    luma = v[0]
    if nc > 3:
        luma = ((TEX_AMOUNT * grain) * (1 + squash(v[3]))) + luma
    for c in range(4, nc):
        luma = (0.05 * v[c]) + luma
    r = (luma + (1.2 * v[1])) + (0.3 * v[2])
    g = (luma - (0.6 * v[1])) + (0.45 * v[2])
    b = (luma - (0.15 * v[1])) - (1.2 * v[2])
    out = np.empty((height, width, 4), dtype=np.uint8)
    for i, ch in enumerate((r, g, b)):
        q = (127.5 * squash(1.1 * ch)) + 128
        out[:, :, i] = np.clip(np.floor(q), 0, 255).astype(np.uint8)
    out[:, :, 3] = 0xFF
    return out


def decode(task: Task) -> None:
    s = task.spec
    (latent,) = task.inputs
    out = task.output
    if latent.ndim != 4 or latent.shape[1] != CHANNELS or latent.shape[2] * VAE_SCALE != s.height or latent.shape[3] * VAE_SCALE != s.width:
        raise BadInput(f"latent shape {latent.shape} does not fit {s.width}x{s.height}")
    if not np.isfinite(latent).all():
        raise BadInput("latent holds NaN or infinite values")
    tex = texture(s.width, s.height)
    for f in range(latent.shape[0]):
        task.check_cancelled()
        out[f] = render(latent[f], s.width, s.height, tex)


def main() -> None:
    w = Worker(
        engine="numpy-decoder/1",
        models=[Model(name="latentmesh-reference", stages=["decode"],
                      cond=Layout("float32", [2, 77, 64]), latent=LatentLayout("float32", CHANNELS, VAE_SCALE),
                      default_steps=20)],
        slots={"decode": 2},
        # It uses no feature of protocol version 2 (checkpoints and the
        # tensor cache are denoise's), so it stays a version 1 engine: the
        # mesh and engine check tests keep one of those in service.
        versions=(1,),
    )
    w.decode(decode)
    w.run(socket_from_args(sys.argv[1:]))


if __name__ == "__main__":
    main()
