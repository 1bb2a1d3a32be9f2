"""Weight sync trainer GPU0 -> rollout GPU1, all in one run, on a Qwen3-1.7B-shaped model:

1. ours, FP8 on the wire: `WeightSender` (wire_dtype fp8: bf16 -> e4m3 + scales in one Triton
   pass per weight, bucketed, pipelined) -> `NativeEngine.receive_weights` (FP8 bytes placed
   into the engine's fused FP8 weights), timed until the weights are usable on GPU1;
2. ours, BF16 on the wire, quantised on receive (same sender with wire_dtype native);
3. per-tensor broadcast: one NCCL broadcast per parameter (bf16), into preallocated tensors
   (what several frameworks do; it does not even include loading into an engine);
4. one raw NCCL broadcast of a flat bf16 buffer with the same number of parameters.

Each side times from a common barrier (a 1-element broadcast + device sync on both) to its own
finish; a repetition costs the slower side; reported: median of `--reps` after two warm-ups
`--smoke`: gloo on CPU with a tiny model (both processes on CPU).

Run: python -m bench.weight_sync   (needs 2 GPUs)
"""
from __future__ import annotations

import statistics
import time

import torch

from bench.common import (QWEN3_17B, TINY, device_info, hf_config, parse_args, random_model,
                          write_results)


def _barrier(pg, device) -> None:
    t = torch.zeros(1, device=device)
    pg.broadcast([t]).wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_reps(pg, device, reps: int, once) -> list[float]:
    """Runs `once()` reps + 2 times, each between barriers on both ranks; returns the wall times
    after 2 warm-ups (compile, then capture the pack graphs)."""
    times = []
    for i in range(reps + 2):
        _barrier(pg, device)
        t0 = time.perf_counter()
        once()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return times


class Sender:
    """Trainer stand-in (rank 0): a random bf16 model and two WeightSenders (fp8 / bf16 wire)."""

    def __init__(self, fields: dict, device: str, bucket_mb: float):
        from rl.config import SyncConfig
        from rl.trainer.weights import WeightSender

        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = random_model("qwen3", fields, device, dtype)
        self.senders = {wire: WeightSender(self.model, 0, True,
                                           SyncConfig(wire_dtype=wire, bucket_mb=bucket_mb),
                                           self.device) for wire in ("fp8", "native")}

    def info(self) -> dict:
        params = list(self.model.parameters())
        return {"num_params": sum(p.numel() for p in params), "num_tensors": len(params),
                "shapes": [tuple(p.shape) for p in params], "dtype": str(params[0].dtype),
                "plans": {w: s.plan() for w, s in self.senders.items()}}

    version = 0

    def connect(self, host: str, port: int) -> None:
        self.senders["fp8"].connect(host, port, 2)
        self.senders["native"].group = self.senders["fp8"].group
        self.pg = self.senders["fp8"].group.pg

    def run(self, method: str, reps: int) -> list[float]:
        params = [p.detach() for p in self.model.parameters()]
        flat = None
        if method == "flat":
            flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype,
                               device=self.device)

        def once() -> None:
            if method in ("fp8", "native"):
                self.version += 1
                self.senders[method].send(version=self.version)
            elif method == "per_tensor":
                for p in params:
                    self.pg.broadcast([p]).wait()
            else:
                self.pg.broadcast([flat]).wait()
        return _time_reps(self.pg, self.device, reps, once)

    def shutdown(self) -> None:
        from rl.sync.transport import destroy
        destroy(self.senders["fp8"].group)


class Receiver:
    """Rollout stand-in (rank 1): a native FP8 engine with zero weights."""

    def __init__(self, fields: dict, device: str):
        from rl.config import RolloutConfig
        from rl.rollout.native.engine import NativeEngine

        cfg = RolloutConfig(engine="native", quantization="fp8", max_model_len=256)
        self.engine = NativeEngine.from_config(hf_config("qwen3", fields), cfg, device=device)
        self.device = self.engine.device

    def connect(self, host: str, port: int, backend: str) -> None:
        self.engine.init_weight_sync(host, port, 2, 1, backend, 300.0)
        self.pg = self.engine._sync_group.pg

    def weight_bytes(self) -> int:
        return self.engine.model.weight_bytes()

    def run(self, method: str, reps: int, info: dict) -> list[float]:
        dtype = getattr(torch, info["dtype"].removeprefix("torch."))
        bufs = flat = None
        if method == "per_tensor":
            bufs = [torch.empty(s, dtype=dtype, device=self.device) for s in info["shapes"]]
        elif method == "flat":
            flat = torch.empty(info["num_params"], dtype=dtype, device=self.device)

        def once() -> None:
            if method in ("fp8", "native"):
                self.engine.receive_weights(info["plans"][method], version=self.engine.weight_version + 1)
            elif method == "per_tensor":
                for b in bufs:
                    self.pg.broadcast([b]).wait()
            else:
                self.pg.broadcast([flat]).wait()
        return _time_reps(self.pg, self.device, reps, once)

    def shutdown(self) -> None:
        self.engine.shutdown()


def main() -> None:
    import bench.weight_sync as mod  # importable classes for the spawned processes
    from rl.cluster.actors import ProcActor, wait_all
    from rl.cluster.groups import free_port

    args = parse_args(__doc__.splitlines()[0], lambda p: (
        p.add_argument("--reps", type=int, default=5),
        p.add_argument("--bucket-mb", type=float, default=256.0)))
    gpu = not args.smoke
    fields = QWEN3_17B if gpu else TINY
    reps = args.reps if gpu else 2
    dev0, dev1 = ("cuda:0", "cuda:1") if gpu else ("cpu", "cpu")
    sender = ProcActor(mod.Sender, fields, dev0, args.bucket_mb if gpu else 0.05, name="sender")
    receiver = ProcActor(mod.Receiver, fields, dev1, name="receiver")
    try:
        wait_all([sender.ready, receiver.ready], timeout=600)
        info = sender.call("info").result()
        port = free_port()
        wait_all([sender.call("connect", "127.0.0.1", port),
                  receiver.call("connect", "127.0.0.1", port, "nccl" if gpu else "gloo")],
                 timeout=300)
        results = {}
        for method in ("fp8", "native", "per_tensor", "flat"):
            s, r = wait_all([sender.call("run", method, reps),
                             receiver.call("run", method, reps, info)], timeout=600)
            results[method] = statistics.median(max(a, b) for a, b in zip(s, r))
        engine_bytes = receiver.call("weight_bytes").result()
    finally:
        for a in (sender, receiver):
            try:
                a.call("shutdown").result(timeout=60)
            except Exception:  # noqa: BLE001 - best effort
                pass
            a.kill()
    bf16_bytes = info["num_params"] * (2 if gpu else 4)  # smoke: fp32 on CPU
    wire = {"fp8": info["plans"]["fp8"].total_bytes, "native": info["plans"]["native"].total_bytes,
            "per_tensor": bf16_bytes, "flat": bf16_bytes}
    labels = {"fp8": "ours: FP8 on the wire, into the FP8 engine",
              "native": "ours: BF16 on the wire, quantised on receive",
              "per_tensor": f"per-tensor broadcast ({info['num_tensors']} tensors), no load",
              "flat": "one raw flat BF16 broadcast"}
    rows = [{"method": labels[m], "seconds": t, "wire_GB": wire[m] / 1e9,
             "GB_per_s": wire[m] / t / 1e9, "param_GB_per_s (bf16-equiv)": bf16_bytes / t / 1e9,
             "vs_flat": t / results["flat"], "per_tensor_vs_this": results["per_tensor"] / t}
            for m, t in results.items()]
    notes = [f"model: Qwen3-{'1.7B' if gpu else 'tiny'}-shaped, {info['num_params'] / 1e9:.3f} B "
             f"parameters ({info['num_tensors']} tensors), random bf16 weights on {dev0}; "
             f"native FP8 engine on {dev1} holds {engine_bytes / 1e9:.2f} GB of weights",
             f"buckets: {args.bucket_mb if gpu else 0.05} MB; median of {reps} after 2 warm-ups",
             "'ours' = until the weights are loaded and usable on the rollout GPU; the baselines "
             "stop when the bytes have landed",
             f"target: ours (FP8 wire) / flat <= 1.0 -> {results['fp8'] / results['flat']:.2f}; "
             f"per-tensor / ours >= 10 -> {results['per_tensor'] / results['fp8']:.1f}"]
    write_results("weight_sync" + ("_smoke" if args.smoke else ""), args.out,
                  {**device_info(), "num_params": info["num_params"]}, rows,
                  ["method", "seconds", "wire_GB", "GB_per_s", "param_GB_per_s (bf16-equiv)",
                   "vs_flat", "per_tensor_vs_this"], notes)


if __name__ == "__main__":
    main()
