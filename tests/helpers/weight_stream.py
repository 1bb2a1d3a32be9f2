"""One weight-sync send received in-process: what an engine's worker extension gets."""
from __future__ import annotations

import threading

import torch

from rl.cluster.groups import free_port
from rl.config import SyncConfig
from rl.trainer.weights import WeightSender


def send_and_receive(model, sync: SyncConfig, dtype: torch.dtype | None = torch.float32
                     ) -> tuple[WeightSender, dict[str, torch.Tensor]]:
    """Send `model` once over gloo; returns the sender and what a receiver got (name -> tensor)
    by the receive path the vLLM worker extension uses (`rl.rollout.weights.receive_stream`):
    decoded into `dtype`, or with `dtype` None as the block-FP8 checkpoint tensors the wire
    carries (`x` float8_e4m3fn + `x_scale_inv` fp32, `rl.rollout.weights.as_fp8_checkpoint`)."""
    from rl.rollout.weights import StreamStats, as_fp8_checkpoint, receive_stream
    from rl.sync.transport import destroy, join_group

    sender = WeightSender(model, 0, True, sync, torch.device("cpu"))
    plan, port = sender.plan(), free_port()
    received, errors = {}, []

    def receive():
        try:
            group = join_group(None, "127.0.0.1", port, 2, 1, "gloo", 60.0, torch.device("cpu"))
            stream = receive_stream(group, plan, 1, True, dtype, StreamStats())
            if dtype is None:
                stream = as_fp8_checkpoint(stream)
            for name, t in stream:
                received[name] = t.clone()
            destroy(group)
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    thread = threading.Thread(target=receive)
    thread.start()
    sender.connect("127.0.0.1", port, 2)
    sender.send(version=1)
    thread.join(120)
    sender.close()
    assert not errors, errors
    return sender, received
