"""latentmesh engine SDK: serve stages of a model to a latentmesh agent.

See docs/engines.md and docs/engine-protocol.md in the latentmesh repository.
"""
from .protocol import PROTOCOL_VERSION, ProtocolError
from .worker import (Batch, BadCheckpoint, BadInput, Cancelled, CheckpointSpec, CondTensor, DecodeStream, ImageSpec,
                     LatentLayout, Layout, LifecycleRefused, LostState, Model, NoAdapter, Param, ParamValue, Resume, Spec,
                     Stopped, Task, Worker, socket_from_args)

__all__ = ["PROTOCOL_VERSION", "ProtocolError", "Batch", "BadCheckpoint", "BadInput", "Cancelled", "CheckpointSpec", "CondTensor",
           "DecodeStream", "ImageSpec", "LatentLayout", "Layout", "LifecycleRefused", "LostState", "Model", "NoAdapter",
           "Param", "ParamValue", "Resume", "Spec", "Stopped", "Task", "Worker", "socket_from_args"]
