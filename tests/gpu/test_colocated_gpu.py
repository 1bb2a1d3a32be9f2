"""Trainer and engine on ONE GPU in plain processes: DeepSpeed BF16 trainer rank 0 and the native
BF16 engine share cuda:0, `sync.backend: auto` takes CUDA IPC (NCCL refuses two ranks on one GPU),
and after the sync the engine scores as the trainer does. Two syncs: the second packs through the
trainer's CUDA graphs (ZeRO-2) and reuses the IPC staging slots. Its CPU twin (the same code path
over /dev/shm): tests/rl/sync/test_ipc_runtime.py."""
import pytest
import torch

from tests.helpers.colocated import one_step_on_one_device

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def test_trainer_and_engine_share_one_gpu_and_sync_over_cuda_ipc(tmp_path, report):
    pytest.importorskip("deepspeed")
    r = one_step_on_one_device(tmp_path, "cuda", "auto", "bfloat16", zero_stage=2)
    report("colocated_gpu", transport=r["transport"], sync_seconds=r["sync"]["seconds"],
           sync_again_seconds=r["sync_again"]["seconds"], sync_bytes=r["sync"]["bytes"],
           train_tokens_per_s=r["train_tokens_per_s"], trainer_moved=r["trainer_moved"],
           engine_vs_trainer_before_sync=r["engine_vs_trainer_before_sync"],
           engine_vs_trainer_after_sync=r["engine_vs_trainer_after_sync"])
    assert r["transport"] == "ipc"
    assert r["versions"] == [1] and r["versions_again"] == [2]
    assert r["sample_versions_again"] == [2]
    assert r["trainer_moved"] > 0.01                             # the step changed the policy
    assert r["engine_vs_trainer_after_sync"] < r["engine_vs_trainer_before_sync"]
    assert r["engine_vs_trainer_after_sync"] < 0.05              # BF16 on both sides
