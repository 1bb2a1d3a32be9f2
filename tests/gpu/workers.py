"""Worker classes the GPU tests host in spawned processes (`rl.cluster.actors.ProcActor`)."""
from __future__ import annotations

import torch

from rl.rollout.native.engine import NativeEngine


def two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


class SenderWorker:
    """Trainer rank 0 stand-in: an HF model on `device` (perturbed, seeded) and a WeightSender."""

    def __init__(self, model_dir: str, device: str, wire: str, bucket_mb: float = 1.0,
                 verify: bool = False):
        from rl.config import SyncConfig
        from rl.models.loading import load_model
        from rl.trainer.weights import WeightSender

        torch.cuda.set_device(torch.device(device))
        self.model = load_model(model_dir, torch.bfloat16, device)
        g = torch.Generator(device=device).manual_seed(11)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g, device=device, dtype=p.dtype))
        self.sender = WeightSender(self.model, 0, True,
                                   SyncConfig(wire_dtype=wire, bucket_mb=bucket_mb, verify=verify),
                                   torch.device(device))

    def plan(self):
        return self.sender.plan()

    def connect(self, host: str, port: int, world: int) -> None:
        self.sender.connect(host, port, world)

    def send(self, version: int) -> dict:
        return self.sender.send(version)

    def perturb(self, seed: int) -> None:
        """Change every parameter in place (same storage: what a CUDA-graph pack would read)."""
        g = torch.Generator(device=self.model.device).manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype))

    def uses_graphs(self) -> bool:
        return bool(self.sender._graphs)

    def weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        params = dict(self.model.named_parameters())
        return {n: params[n].detach().float().cpu() for n in names}


class EngineProbe(NativeEngine):
    """A native engine that also hands out its fused slots (dequantised) for inspection."""

    def slot(self, key: str) -> torch.Tensor:
        return self.model.linears[key].dequantized(torch.float32).cpu()

    def slot_scale(self, key: str) -> torch.Tensor:
        return self.model.linears[key].scale.cpu()
