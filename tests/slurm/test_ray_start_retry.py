"""A Ray head whose GCS never answers is retried like a node that did not join.

Seen on the CI machine (2 cores, fresh clone of a123412, Slurm requeue test, restart 2): the head's
`ray start` listened, then died with "The current node timed out during startup", and the
driver's `ray.init` raised ConnectionError; `_start_ray` retried only RayClusterError, so the job
FAILED instead of starting Ray again. Here `ray.init` is replaced by one raising that exact error
(a GCS that hangs for a minute is too slow to stage in the suite); the rest is the real code."""
from pathlib import Path

import pytest

pytest.importorskip("ray")

CI_ERROR = "Failed to connect to Ray cluster at 10.213.7.11:36800"


def _cluster(tmp_path: Path):
    from slurm.ray_cluster import RayCluster, RayNode
    head = RayNode(name="n1", ip="10.213.7.11", group=0, num_cpus=1, port_base=36800)
    (tmp_path / "ray-n1.log").write_text("Exception: The current node timed out during "
                                         "startup.\n")
    return RayCluster(address="10.213.7.11:36800", nodes=[head], run_dir=tmp_path,
                      token_path=tmp_path / "token")


def test_connect_turns_a_silent_head_into_a_ray_cluster_error(tmp_path, monkeypatch):
    import ray
    from slurm.ray_cluster import RayClusterError, connect

    def silent_head(*a, **kw):
        raise ConnectionError(CI_ERROR)
    monkeypatch.setattr(ray, "init", silent_head)
    with pytest.raises(RayClusterError) as e:
        connect(_cluster(tmp_path))
    msg = str(e.value)
    assert msg.splitlines()[0].startswith(
        "Ray head on n1 listened on 10.213.7.11:36800 but did not answer (ConnectionError: "
        + CI_ERROR)
    assert str(tmp_path / "ray-n1.log") in msg and "timed out during startup" in msg
    assert not ray.is_initialized()


def test_start_ray_is_tried_again_after_a_ray_cluster_error(tmp_path, monkeypatch, capsys):
    import slurm.allocation as allocation
    from rl.config import Config
    from slurm.ray_cluster import RayClusterError

    calls = []

    def flaky(run_dir, **kw):
        calls.append(kw["timeout_s"])
        if len(calls) == 1:
            raise RayClusterError("Ray head on n1 listened on x but did not answer")
        return "cluster"
    monkeypatch.setattr(allocation, "start_ray", flaky)
    cfg = Config()
    assert allocation._start_ray(cfg) == "cluster" and len(calls) == 2
    assert "Ray did not start (attempt 1 of 2): Ray head on n1" in capsys.readouterr().out
    calls.clear()
    monkeypatch.setattr(allocation, "start_ray", lambda run_dir, **kw: (_ for _ in ()).throw(
        RayClusterError("still silent")))
    with pytest.raises(RayClusterError, match="still silent"):
        allocation._start_ray(cfg)
