"""Expert parallelism with the experts' optimizer state offloaded (`trainer.optimizer_offload`).

Two gloo ranks, EP = 2, the tiny Qwen3-MoE in bf16 (so the fp32 master copy, the host staging
in the training dtype and the copy back all run), `ExpertParallel` alone: only the routed experts
train, no DeepSpeed engine (the dense part's offload is DeepSpeed's own, tested by DeepSpeed;
the worker wiring is one flag). Each rank feeds its own tokens, so the all-to-all and the
gradient reduction matter, and the clip threshold is half the global norm, so clipping is on.

- With the same optimizer code (torch's AdamW in both), the offloaded step is the device step:
  losses, gradient norms and weights after 3 steps are bitwise equal.
- With the offload's own optimizer (torch's fused CPU AdamW): the first step's loss and norm
  are bitwise equal (same weights), later ones and the weights agree within rounding.
- A checkpoint written after step 2 resumes step 3 bitwise, and is refused by a run that does
  not offload.

What a CPU run cannot show: every tensor is on the CPU either way. Placement is asserted on what
decides it (the `offload` flag, master copies that are not the module's parameters, the
optimizer being the fused AdamW, whose CPU kernel runs only on CPU tensors, and the checkpoint
layout); `tests/gpu/test_expert_offload_gpu.py` checks the real placement on a GPU.
"""
import io

import pytest
import torch

from rl.cluster.actors import ProcActor, wait_all
from rl.cluster.groups import free_port
from rl.config import ModelConfig
from rl.models.loading import resolve_model_dir

pytestmark = pytest.mark.slow

LR, BETAS, WD = 1e-2, (0.9, 0.999), 0.1


class EPRank:
    """One rank: the model with its experts sharded, trained by `ExpertParallel` alone."""

    def __init__(self, model_dir: str, rank: int, port: int):
        import os

        import torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        self.model_dir, self.rank = model_dir, rank

    def build(self, offload: bool, optimizer: str) -> dict:
        """A fresh model and ExpertParallel (collective: the EP groups); what decides placement."""
        from rl.models.loading import load_model
        from rl.trainer.expert_parallel import ExpertParallel, make_groups
        self.model = load_model(self.model_dir, dtype=torch.bfloat16, device="cpu")
        for p in self.model.parameters():
            p.requires_grad_(False)  # only the experts train (fresh parameters below)
        self.ep = ExpertParallel(self.model, make_groups(2, self.rank, 2), torch.device("cpu"),
                                 offload=offload)
        self.ep.make_optimizer(LR, BETAS, WD)
        if optimizer == "torch":  # the optimizer the device path runs, for a bitwise comparison
            self.ep.optimizer = torch.optim.AdamW(list(self.ep.master.values()), lr=LR,
                                                  betas=BETAS, weight_decay=WD)
        return {"offload": self.ep.offload, "optimizer": type(self.ep.optimizer).__name__,
                "fused": bool(self.ep.optimizer.param_groups[0].get("fused")),
                "separate_master": all(self.ep.master[n] is not p
                                       for n, p in self.ep.params.items()),
                "master_dtypes": {m.dtype for m in self.ep.master.values()},
                "param_dtypes": {p.dtype for p in self.ep.params.values()}}

    def train(self, steps: list[int]) -> list[tuple[float, float]]:
        out = []
        vocab = self.model.config.vocab_size
        for s in steps:
            g = torch.Generator().manual_seed(1000 * s + self.rank)  # each rank its own tokens
            ids = torch.randint(3, vocab, (2, 12), generator=g)
            logits = self.model(input_ids=ids).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab),
                                                     ids[:, 1:].reshape(-1))
            (loss * 2).backward()  # x world_size, as the worker scales its losses
            self.ep.reduce_grads(2)
            norm = float(self.ep.grad_norm)
            self.ep.step(LR, norm, clip=norm / 2)
            out.append((loss.item(), norm))
        return out

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: self.ep.gather(n) for n in self.ep.params}

    def save(self) -> bytes:
        buf = io.BytesIO()
        torch.save(self.ep.state_dict(), buf)
        return buf.getvalue()

    def load(self, blobs: list[bytes]) -> None:
        self.ep.load_state_dict(torch.load(io.BytesIO(blobs[self.rank]), weights_only=False),
                                "ckpt")


def _all(ranks, method, *args):
    return wait_all([a.call(method, *args) for a in ranks], timeout=300)


def _run(ranks, offload: bool, optimizer: str) -> dict:
    """3 steps, with a checkpoint after step 2; then a fresh build resumes step 3 from it."""
    out = {"placement": _all(ranks, "build", offload, optimizer)[0]}
    out["initial"] = _all(ranks, "weights")[0]
    out["steps"] = _all(ranks, "train", [1, 2])
    out["ckpt"] = _all(ranks, "save")
    out["steps"] = [a + b for a, b in zip(out["steps"], _all(ranks, "train", [3]))]
    out["weights"] = _all(ranks, "weights")[0]
    _all(ranks, "build", offload, optimizer)
    _all(ranks, "load", out["ckpt"])
    out["resumed_step3"] = _all(ranks, "train", [3])
    out["resumed_weights"] = _all(ranks, "weights")[0]
    return out


def test_offloaded_expert_step_matches_the_device_step_and_resumes_bitwise(tmp_path):
    model_dir = str(resolve_model_dir(ModelConfig(preset="tiny-qwen3-moe"), tmp_path / "models"))
    port = free_port()
    ranks = [ProcActor(EPRank, model_dir, r, port, name=f"epoff{r}") for r in range(2)]
    try:
        wait_all([a.ready for a in ranks], timeout=300)
        ref = _run(ranks, offload=False, optimizer="torch")
        same = _run(ranks, offload=True, optimizer="torch")
        fused = _run(ranks, offload=True, optimizer="default")
        # A checkpoint of offloaded state, loaded by a run that keeps it on the device: refused.
        _all(ranks, "build", False, "default")
        with pytest.raises(Exception, match="trainer.optimizer_offload"):
            _all(ranks, "load", fused["ckpt"])
    finally:
        for a in ranks:
            a.close()

    assert ref["placement"]["optimizer"] == "AdamW" and not ref["placement"]["offload"]
    assert not ref["placement"]["fused"] and not same["placement"]["fused"]
    assert fused["placement"] == {"offload": True, "optimizer": "AdamW", "fused": True,
                               "separate_master": True, "master_dtypes": {torch.float32},
                               "param_dtypes": {torch.bfloat16}}
    state = torch.load(io.BytesIO(fused["ckpt"][0]), weights_only=False)
    assert state["offload"] is True
    assert all(t.dtype == torch.float32 for t in state["master"].values())
    assert {k for s in state["optimizer"]["state"].values() for k in s} == {
        "step", "exp_avg", "exp_avg_sq"}

    # The experts train (every shard moves).
    assert all(not torch.equal(ref["weights"][n], ref["initial"][n]) for n in ref["weights"])
    assert all(norm > 0 for rank in ref["steps"] for _, norm in rank)
    # Same optimizer code: the offloaded step is the device step, bit for bit.
    assert same["steps"] == ref["steps"]
    for n, w in ref["weights"].items():
        assert torch.equal(same["weights"][n], w), n
    # The fused CPU AdamW: the same AdamW (decoupled weight decay), its own rounding. Step 1 runs
    # on the same weights; after it, rounding makes them drift apart a little (below).
    assert fused["steps"][0][0] == ref["steps"][0][0] and fused["steps"][1][0] == ref["steps"][1][0]
    # Measured: losses within 5.1e-5 (relative), gradient norms within 2.9e-4.
    for got, want in zip(fused["steps"], ref["steps"]):
        for (loss, norm), (loss_r, norm_r) in zip(got, want):
            assert loss == pytest.approx(loss_r, rel=5e-4)
            assert norm == pytest.approx(norm_r, rel=3e-3)
    # Adam divides by sqrt(v) + eps: where an expert saw almost no gradient, rounding moves
    # that entry's update by up to a step (lr), so the bound is on the mean: the two optimizers'
    # weights differ by under 1% of how far the weights moved (measured: 0.1-0.2%).
    for n, w in ref["weights"].items():
        moved = (w.float() - ref["initial"][n].float()).abs().mean()
        diff = (fused["weights"][n].float() - w.float()).abs().mean()
        assert diff < 0.01 * moved, n
    # Resume: step 3 from the step-2 checkpoint, bitwise, for each optimizer.
    for name, run in (("device", ref), ("offload torch", same), ("offload fused", fused)):
        assert run["resumed_step3"] == [s[2:] for s in run["steps"]], name
        for n, w in run["weights"].items():
            assert torch.equal(run["resumed_weights"][n], w), (name, n)
