"""`buffers_to`: ZeRO-3 places parameters, not buffers; the trainer moves the buffers itself
(V4's router bias stayed on the host and met CUDA activations on an H200). On CPU the move is
checked against the meta device: every buffer, nested ones included, and nothing else."""
import torch

from rl.trainer.worker import buffers_to


def test_every_buffer_moves_and_parameters_stay():
    inner = torch.nn.Linear(4, 4)
    inner.register_buffer("bias_correction", torch.zeros(4))
    outer = torch.nn.Sequential(inner, torch.nn.BatchNorm1d(4))
    outer.register_buffer("absent", None)
    buffers_to(outer, torch.device("meta"))
    assert {n: b.device.type for n, b in outer.named_buffers()} == {
        "0.bias_correction": "meta", "1.running_mean": "meta", "1.running_var": "meta",
        "1.num_batches_tracked": "meta"}
    assert all(p.device.type == "cpu" for p in outer.parameters())
    assert outer._buffers["absent"] is None
