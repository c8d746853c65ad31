#!/usr/bin/python3
"""What host-memory hand-offs cost an engine on a GPU (issue 20).

latentmesh hands every stage's input and output through the agent's arena:
a memfd the agent maps and passes to the engine, which maps it too
(docs/engine-protocol.md). An engine on a GPU therefore copies each payload
device -> arena after its stage and arena -> device before the next one.
This script measures those copies against the stages they sit between:

1. the copies, per payload size and direction, into and out of an arena
   made exactly as the agent makes it (memfd, MAP_SHARED), as it comes
   (pageable) and after cudaHostRegister (what an engine could do once at
   start), against a pinned torch buffer and a device-to-device copy;
2. the reference torch worker's stages (sdk/python/workers/torch_pipeline.py,
   random weights: no download) on the GPU, per stage;
3. one transformer block of FLUX.1's and of Wan2.1-1.3B's width at their
   sequence lengths (bf16, random weights), times the block count: what a
   denoise step of those models costs, to set the copies against.

Timing uses CUDA events around each region, after warm-up, and reports the
median of the repetitions. Run on a machine with a CUDA GPU:

    python3 sdk/python/bench/gpu_costs.py [--out DIR] [--quick]

It prints a table and writes gpu_costs.json to --out (default: .).
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "workers"))
sys.path.insert(0, str(ROOT))

MiB = 1 << 20


def cuda_time(fn, reps: int, warm: int = 3) -> float:
    """Median milliseconds of fn() over reps, timed with CUDA events."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


class Arena:
    """An arena as the agent makes one: a memfd of size bytes, mapped shared."""

    def __init__(self, size: int) -> None:
        self.fd = os.memfd_create("latentmesh-arena")
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.t = torch.frombuffer(self.map, dtype=torch.uint8)
        self.t.fill_(1)  # fault every page in, as the agent pre-faults its arena
        self.registered = False

    def register(self) -> float:
        """cudaHostRegister the whole arena; returns how long it took (ms)."""
        cudart = torch.cuda.cudart()
        start = time.perf_counter()
        err = cudart.cudaHostRegister(self.t.data_ptr(), self.t.numel(), 0)
        took = (time.perf_counter() - start) * 1e3
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister: error {err}")
        self.registered = True
        return took

    def close(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.t.data_ptr())
        del self.t
        self.map.close()
        os.close(self.fd)


def copies(sizes, reps: int) -> list:
    """Device<->arena copy times per size: pageable, registered, pinned, d2d."""
    dev = torch.device("cuda")
    arena = Arena(max(sizes))
    rows = []
    for registered in (False, True):
        if registered:
            try:
                reg_ms = arena.register()
            except Exception as e:  # a sandbox may refuse it: say so and go on
                rows.append({"what": "cudaHostRegister", "bytes": arena.t.numel(), "error": str(e)})
                continue
            rows.append({"what": "cudaHostRegister", "bytes": arena.t.numel(), "ms": reg_ms})
        for n in sizes:
            src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
            host = arena.t[:n]
            d2h = cuda_time(lambda: host.copy_(src, non_blocking=registered), reps)
            back = torch.empty_like(src)
            h2d = cuda_time(lambda: back.copy_(host, non_blocking=registered), reps)
            if not torch.equal(back, src):
                raise RuntimeError("arena round trip changed the bytes")
            rows.append({"what": "arena registered" if registered else "arena pageable", "bytes": n,
                         "d2h_ms": d2h, "h2d_ms": h2d,
                         "d2h_GBps": n / d2h / 1e6, "h2d_GBps": n / h2d / 1e6})
    for n in sizes:
        src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        d2h = cuda_time(lambda: pinned.copy_(src, non_blocking=True), reps)
        back = torch.empty_like(src)
        h2d = cuda_time(lambda: back.copy_(pinned, non_blocking=True), reps)
        d2d = cuda_time(lambda: back.copy_(src), reps)
        rows.append({"what": "torch pinned", "bytes": n, "d2h_ms": d2h, "h2d_ms": h2d,
                     "d2h_GBps": n / d2h / 1e6, "h2d_GBps": n / h2d / 1e6,
                     "d2d_ms": d2d, "d2d_GBps": 2 * n / d2d / 1e6})
    arena.close()
    return rows


def torch_worker_stages(reps: int) -> list:
    """The reference torch worker's stages on the GPU (random weights)."""
    import torch_pipeline as tp
    dev = torch.device("cuda")
    torch.set_default_device(dev)  # the worker's helpers make tensors (torch.arange) with no device named
    torch.manual_seed(0)
    p = tp.Pipeline().eval().to(dev)
    rows = []
    for name, frames, side in (("image 256x256", 1, 256), ("video 4x128x128", 4, 128)):
        with torch.no_grad():
            ids = torch.tensor([tp.tokenize("a red fox in the snow"), tp.tokenize("blurry")], dtype=torch.long, device=dev)
            enc = cuda_time(lambda: p.text(ids), reps)
            cond = p.text(ids)
            ctx = cond.repeat_interleave(frames, dim=0).reshape(2, frames, tp.TOKENS, tp.DIM).transpose(0, 1).reshape(2 * frames, tp.TOKENS, tp.DIM)
            lat = torch.randn(frames, tp.CHANNELS, side // tp.SCALE, side // tp.SCALE, device=dev)
            xin = lat.repeat_interleave(2, dim=0)
            t = torch.full((2 * frames,), 500, device=dev)
            step = cuda_time(lambda: p.unet(xin, t, ctx), reps)
            dec = cuda_time(lambda: p.vae(lat), reps)
        rows.append({"model": "latentmesh-tiny-torch", "job": name, "encode_ms": enc, "denoise_step_ms": step,
                     "decode_ms": dec, "cond_bytes": cond.numel() * 4, "latent_bytes": lat.numel() * 4,
                     "pixels_bytes": frames * side * side * 4})
    return rows


class Block(torch.nn.Module):
    """A DiT block: self-attention over the joint sequence and an MLP."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.o = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(approximate="tanh"),
                                       torch.nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.o(a.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.n2(x))


def dit_steps(reps: int) -> list:
    """One block's forward at each model's width and sequence, times its
    block count, with CFG's two branches as a batch of two."""
    dev = torch.device("cuda")
    rows = []
    # name, hidden, heads, blocks, tokens (image/video + text), latent bytes (bf16)
    models = (
        ("FLUX.1 1024x1024", 3072, 24, 57, 4096 + 512, 16 * 128 * 128 * 2),
        ("Wan2.1-T2V-1.3B 832x480x81", 1536, 12, 30, 21 * 30 * 52 + 512, 21 * 16 * 60 * 104 * 2),
    )
    for name, hidden, heads, blocks, tokens, latent in models:
        blk = Block(hidden, heads).to(dev, torch.bfloat16).eval()
        x = torch.randn(2, tokens, hidden, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            ms = cuda_time(lambda: blk(x), reps)
        rows.append({"model": name, "block_ms": ms, "blocks": blocks, "step_ms": ms * blocks, "latent_bytes": latent})
        del blk, x
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and sizes (a smoke test)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_costs: no CUDA device")
    reps = 5 if a.quick else 20
    sizes = [64 << 10, 512 << 10, 4 * MiB, 64 * MiB] if a.quick else [64 << 10, 512 << 10, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda}
    for key, run in (("copies", lambda: copies(sizes, reps)), ("torch_worker", lambda: torch_worker_stages(reps)),
                     ("dit", lambda: dit_steps(reps))):
        try:
            res[key] = run()
        except Exception as e:  # one part failing leaves the others' figures
            res[key] = []
            res[key + "_error"] = repr(e)
            print(f"gpu_costs: {key}: {e!r}", file=sys.stderr)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_costs.json").write_text(json.dumps(res, indent=2))

    print(f"{res['device']}, torch {res['torch']}, CUDA {res['cuda']}")
    print("\ncopies (median ms, GB/s):")
    print(f"  {'buffer':18} {'bytes':>11} {'d2h ms':>9} {'GB/s':>7} {'h2d ms':>9} {'GB/s':>7}")
    for r in res["copies"]:
        if r["what"] == "cudaHostRegister":
            print(f"  cudaHostRegister of a {r['bytes'] / MiB:.0f} MiB arena: " + (f"{r['ms']:.1f} ms" if "ms" in r else r["error"]))
            continue
        print(f"  {r['what']:18} {r['bytes']:>11} {r['d2h_ms']:>9.3f} {r['d2h_GBps']:>7.1f} {r['h2d_ms']:>9.3f} {r['h2d_GBps']:>7.1f}")
    print("\nreference torch worker on the GPU (median ms):")
    for r in res["torch_worker"]:
        print(f"  {r['job']:18} encode {r['encode_ms']:.3f}  denoise step {r['denoise_step_ms']:.3f}  decode {r['decode_ms']:.3f}"
              f"  (cond {r['cond_bytes']} B, latent {r['latent_bytes']} B, pixels {r['pixels_bytes']} B)")
    print("\nDiT step at real widths (bf16, CFG batch of 2):")
    reg = {r["bytes"]: r for r in res["copies"] if r["what"] == "arena registered"}
    pag = {r["bytes"]: r for r in res["copies"] if r["what"] == "arena pageable"}
    for r in res["dit"]:
        # The latent's hand-off: one d2h at the producer, one h2d at the
        # consumer, at the rate of the nearest size measured.
        n = r["latent_bytes"]
        line = f"  {r['model']:28} step {r['step_ms']:.1f} ms ({r['blocks']} blocks x {r['block_ms']:.2f}); latent {n / MiB:.2f} MiB hand-off"
        for label, rows in (("pageable", pag), ("registered", reg)):
            if rows:
                near = min(rows, key=lambda b: abs(b - n))
                line += f" ~{(rows[near]['d2h_ms'] + rows[near]['h2d_ms']) / near * n:.3f} ms {label}"
        print(line)
    print(f"\nwrote {Path(a.out) / 'gpu_costs.json'}")


if __name__ == "__main__":
    main()
