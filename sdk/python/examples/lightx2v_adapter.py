#!/usr/bin/env python3
"""UNTESTED here: needs LightX2V, a Wan2.x checkpoint and a GPU, none of
which the latentmesh CI has. It shows how a LightX2V runner maps onto the
three callbacks; the runner's attribute names follow LightX2V's default
Wan runner and may differ between its versions — check them against the
release you run, then run `latentmesh engine check` on it.

    python3 lightx2v_adapter.py --socket /run/latentmesh/engine.sock --config wan_t2v.json

Stage mapping (text to video):
- encode:  the runner's text encoder (umT5) on prompt and negative prompt
           -> cond [2, 512, 4096] bfloat16;
- denoise: the runner's scheduler loop (flow matching), one
           task.steps() iteration per step, CFG on the two rows
           -> latent frame-major [F, 16, H/8, W/8] (LightX2V keeps
           [16, F, ...]; the adapter transposes so each frame is a chunk
           the agent can hand to decode early);
- decode:  the runner's VAE decoder -> uint8 RGBA [F, H, W, 4]; the agent
           writes the GIF.
"""
import argparse
import sys

import torch

from latentmesh_engine import LatentLayout, Layout, Model, Task, Worker, socket_from_args

ap = argparse.ArgumentParser()
ap.add_argument("--config", required=True)
args, _ = ap.parse_known_args()

from lightx2v.infer import init_runner, set_config  # type: ignore[import]  # noqa: E402

runner = init_runner(set_config(argparse.Namespace(config_json=args.config, model_cls="wan2.1", task="t2v")))

worker = Worker(
    engine="lightx2v-wan/0",
    models=[Model(name="wan2.1-t2v", stages=["encode", "denoise", "decode"],
                  cond=Layout("bfloat16", [2, 512, 4096]), latent=LatentLayout("bfloat16", 16, 8),
                  default_steps=40, max_side=1280, max_frames=81, max_steps=100)],
    slots={"encode": 2, "denoise": 1, "decode": 1},
)


@worker.encode
def encode(task: Task) -> None:
    s = task.spec
    ctx = runner.text_encoders[0].infer([s.prompt, s.negative_prompt])
    task.torch_output().copy_(ctx.to("cpu", torch.bfloat16))


@worker.denoise
def denoise(task: Task) -> None:
    s = task.spec
    (cond,) = task.torch_inputs()
    sched = runner.model.scheduler
    sched.prepare(seed=s.seed, latent_shape=(16, s.frames, s.height // 8, s.width // 8), infer_steps=s.steps)
    ctx = cond.to("cuda")
    for i in task.steps(s.steps):
        sched.step_pre(step_index=i)
        e_c = runner.model.infer_one(sched.latents, ctx[0:1])
        e_u = runner.model.infer_one(sched.latents, ctx[1:2])
        sched.noise_pred = e_u + s.guidance_scale * (e_c - e_u)
        sched.step_post()
    task.torch_output().copy_(sched.latents.transpose(0, 1).to("cpu"))  # [16,F,h,w] -> [F,16,h,w]


@worker.decode
def decode(task: Task) -> None:
    (lat,) = task.torch_inputs()
    video = runner.vae_decoder.decode(lat.transpose(0, 1).to("cuda"))  # [3, F, H, W] in [-1, 1]
    pix = ((video.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 3, 0).cpu()
    out = task.torch_output()
    out[..., :3].copy_(pix)
    out[..., 3] = 255


if __name__ == "__main__":
    with torch.inference_mode():
        worker.run(socket_from_args(sys.argv[1:]))
