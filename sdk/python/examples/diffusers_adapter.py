#!/usr/bin/env python3
"""UNTESTED here: needs the diffusers package, a model's weights and a GPU,
none of which the latentmesh CI has. It shows how a diffusers
StableDiffusionPipeline maps onto the three callbacks; adapt the model id,
dtypes and scheduler to yours, then run `latentmesh engine check` on it.

    python3 diffusers_adapter.py --socket /run/latentmesh/engine.sock

Stage mapping:
- encode:  pipe.encode_prompt (CLIP text encoder) for prompt and negative
           prompt -> cond [2, 77, 768] float16, conditional row first;
- denoise: the scheduler loop of pipe.__call__ with classifier-free
           guidance, one task.steps() iteration per scheduler step (progress
           and cancellation at every step) -> latent [F, 4, H/8, W/8];
- decode:  pipe.vae.decode, then to uint8 RGBA [F, H, W, 4]; the agent
           writes the PNG/GIF.
"""
import sys

import torch
from diffusers import StableDiffusionPipeline  # type: ignore[import]

from latentmesh_engine import BadInput, LatentLayout, Layout, Model, Task, Worker, socket_from_args

MODEL_ID = "stable-diffusion-v1-5/stable-diffusion-v1-5"  # any SD 1.x checkpoint
NAME = "sd15"
DEVICE, DTYPE = "cuda", torch.float16

pipe = StableDiffusionPipeline.from_pretrained(MODEL_ID, torch_dtype=DTYPE).to(DEVICE)
pipe.set_progress_bar_config(disable=True)

worker = Worker(
    engine="diffusers-sd15/0",
    models=[Model(name=NAME, stages=["encode", "denoise", "decode"],
                  cond=Layout("float16", [2, 77, 768]), latent=LatentLayout("float16", 4, 8),
                  default_steps=30, max_side=1024, max_frames=1, max_steps=150)],
    slots={"encode": 4, "denoise": 1, "decode": 2},
)


@worker.encode
def encode(task: Task) -> None:
    s = task.spec
    cond, uncond = pipe.encode_prompt(s.prompt, DEVICE, 1, True, negative_prompt=s.negative_prompt)
    task.torch_output().copy_(torch.cat([cond, uncond]).to("cpu", DTYPE))


@worker.denoise
def denoise(task: Task) -> None:
    s = task.spec
    (cond,) = task.torch_inputs()
    ctx = cond.to(DEVICE)
    sched = pipe.scheduler
    sched.set_timesteps(s.steps, device=DEVICE)
    g = torch.Generator(DEVICE).manual_seed(s.seed)
    out = task.torch_output()  # [F, 4, H/8, W/8]
    x = torch.randn(tuple(out.shape), generator=g, device=DEVICE, dtype=DTYPE) * sched.init_noise_sigma
    for i in task.steps(len(sched.timesteps)):  # progress + cancel at each step boundary
        t = sched.timesteps[i]
        xin = sched.scale_model_input(torch.cat([x, x]), t)
        eps = pipe.unet(xin, t, encoder_hidden_states=ctx.repeat_interleave(x.shape[0], 0)).sample
        e_c, e_u = eps.chunk(2)
        x = sched.step(e_u + s.guidance_scale * (e_c - e_u), t, x).prev_sample
    out.copy_(x.to("cpu"))


@worker.decode
def decode(task: Task) -> None:
    (lat,) = task.torch_inputs()
    if not bool(torch.isfinite(lat).all()):
        raise BadInput("latent holds NaN or infinite values")
    img = pipe.vae.decode(lat.to(DEVICE) / pipe.vae.config.scaling_factor).sample  # [F, 3, H, W] in [-1, 1]
    pix = ((img.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu()
    out = task.torch_output()
    out[..., :3].copy_(pix)
    out[..., 3] = 255


if __name__ == "__main__":
    with torch.inference_mode():
        worker.run(socket_from_args(sys.argv[1:]))
