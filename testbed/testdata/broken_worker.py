#!/usr/bin/python3
"""A deliberately broken engine for `latentmesh engine check` tests: it
registers and runs tasks, but ignores cancellation (runs every denoise step
whatever the agent says). The check must fail it with a clear line."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sdk" / "python"))
from latentmesh_engine import BadInput, LatentLayout, Layout, Model, Task, Worker, socket_from_args  # noqa: E402

import numpy as np  # noqa: E402

w = Worker(engine="broken/1", models=[Model(name="broken-model", stages=["denoise", "decode"],
                                             cond=Layout("float32", [2, 8, 16]), latent=LatentLayout("float32", 4, 8))])


@w.denoise
def denoise(task: Task) -> None:
    out = task.output
    for i in range(task.spec.steps):  # never looks at task.cancelled: the bug under test
        time.sleep(0.01)
        task.progress(i + 1, task.spec.steps)
    out[...] = 0


@w.decode
def decode(task: Task) -> None:
    (lat,) = task.inputs
    if not np.isfinite(lat).all():
        raise BadInput("latent holds NaN")
    task.output[...] = 128


w.run(socket_from_args(sys.argv[1:]))
