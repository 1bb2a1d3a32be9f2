"""Shared rollout fixtures: one peaked tiny Qwen3-MoE directory and ONE vLLM engine per session.

The preset's random init gives nearly uniform next-token distributions, where a greedy argmax
can hinge on float rounding; scaling `lm_head` by 8 spreads the logits so greedy decoding is
decided by margins far above fp32 noise, and the engines can be compared token for token.
"""
from __future__ import annotations

import itertools
import threading

import pytest
import torch

from rl.config import RolloutConfig
from rl.models.tokenizer import BOS_ID

LM_HEAD_SCALE = 8.0


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from rl.models.presets import build_model, save_model
    from rl.models.tokenizer import build_char_tokenizer

    out = tmp_path_factory.mktemp("rollout_model")
    model = build_model("tiny-qwen3-moe", seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    save_model(model, out)
    build_char_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def rollout_cfg() -> RolloutConfig:
    return RolloutConfig(engine="vllm", max_model_len=256, cpu_kvcache_gb=1.0, seed=0)


@pytest.fixture
def hf_engine(model_dir, rollout_cfg):
    """A fresh HF engine per test (0.5 s), so tests may change its weights."""
    from rl.rollout.hf_engine import HFEngine

    torch.set_num_threads(1)
    return HFEngine(model_dir, rollout_cfg, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def vllm_engine(model_dir, rollout_cfg):
    from rl.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(model_dir, rollout_cfg, dtype="float32", device="cpu")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def next_version():
    """Strictly increasing weight versions for the shared engine (versions never go back)."""
    counter = itertools.count(1)
    return lambda: next(counter)


@pytest.fixture
def restore_vllm_weights(vllm_engine, model_dir, next_version):
    """Tests that change the shared engine's weights get the original ones back afterwards."""
    yield
    from safetensors.torch import load_file

    vllm_engine.load_weights(load_file(str(model_dir / "model.safetensors")).items(),
                             next_version())


@pytest.fixture
def prompts(hf_engine) -> list[list[int]]:
    tok = hf_engine.tokenizer
    texts = ["12+3=", "7-4=", "hello world", "99*9=", "a", "The answer is"]
    return [[BOS_ID] + tok(t).input_ids for t in texts]  # <bos> + text, as the chat template does


class Sender:
    """Trainer rank 0 in a thread: joins the sync group (gloo, or ipc) and sends `named` as buckets."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], world_size: int, version: int,
                 bucket_bytes: int = 64 * 1024, verify: bool = True, backend: str = "gloo"):
        from rl.cluster.groups import free_port
        from rl.sync.buckets import plan_for

        self.named = dict(named)
        self.plan = plan_for(named, bucket_bytes)
        self.port = free_port()
        self.world_size, self.version, self.verify = world_size, version, verify
        self.backend = backend
        self.stats: dict | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from rl.sync.buckets import pack_bucket
        from rl.sync.transport import destroy, make_group, send_buckets

        try:
            group = make_group("127.0.0.1", self.port, self.world_size, 0, self.backend, 60.0)
            try:
                self.stats = send_buckets(group, self.plan, self.version,
                                          lambda _i, b: pack_bucket(b, self.named),
                                          verify=self.verify)
            finally:
                destroy(group)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread by join()
            self.error = e

    def join(self) -> dict:
        self.thread.join(timeout=120)
        assert not self.thread.is_alive(), "sender thread hung"
        if self.error is not None:
            raise self.error
        return self.stats


@pytest.fixture
def start_sender():
    """`start_sender(named, world_size, version)` -> a running `Sender` (trainer rank 0)."""
    return Sender


def perturbed(named, seed: int, scale: float = 0.02) -> list[tuple[str, torch.Tensor]]:
    """Copies of float tensors plus seeded noise (integer buffers are kept)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, t in named:
        if t.is_floating_point():
            t = t + scale * torch.randn(t.shape, generator=g, dtype=t.dtype)
        out.append((name, t.clone()))
    return out


@pytest.fixture
def perturb():
    return perturbed
