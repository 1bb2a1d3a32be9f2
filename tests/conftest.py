"""Suite-wide settings: offline, single-threaded torch, GPU tests skipped without CUDA.

`RL_GPU_STRICT=1` (set by bench/run_gpu.sh on the GPU machine): a `gpu` test that skips, for
whatever reason (no CUDA, one GPU where it needs two, DeepSpeed not installed), fails instead, so
a missing dependency there can never pass as green.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                      os.path.join(os.path.dirname(os.path.dirname(__file__)), ".cache", "torch_extensions"))

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


GPU_STRICT = os.environ.get("RL_GPU_STRICT") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if GPU_STRICT and report.skipped and "gpu" in item.keywords:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (f"RL_GPU_STRICT=1: this GPU test skipped ({reason}); on the GPU "
                           "machine a skip is a failure")


@pytest.fixture(scope="session")
def report():
    """report(name, **values): print and, with GPU_REPORT set, append a JSON line."""
    def write(name: str, **values) -> None:
        print(f"[gpu-report] {name}: {values}")
        path = os.environ.get("GPU_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"test": name, **values}) + "\n")
    return write


# One Ray for the whole session, in this process: every test that needs a local Ray asks for this
# fixture (a second `ray.init` in the same process fails, and a Ray left running by one module
# would break the next one's).
@pytest.fixture(scope="session")
def ray_local():
    import ray

    from rl.cluster.groups import ROLLOUT_NODE, TRAINER_NODE
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    root = Path(__file__).resolve().parents[1]
    ray.init(num_cpus=4, resources={TRAINER_NODE: 1, ROLLOUT_NODE: 1}, include_dashboard=False,
             _temp_dir="/tmp/rl-ray-tests", runtime_env={"env_vars": {"PYTHONPATH": str(root)}})
    yield
    ray.shutdown()
