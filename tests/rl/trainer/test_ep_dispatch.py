"""The expert-parallel dispatch and combine (`rl.trainer.expert_parallel.ShardedExperts`) against
the whole experts module on one rank.

Four gloo ranks, each with its own tokens and picks (4 of 8 experts per token, some tokens with
several picks on one rank, a different token count per rank), the tiny DeepSeek-V4's experts
module (its clamped SwiGLU) sharded by `ExpertParallel` as the trainer shards it. Each layout is
compared with the unsharded module on the same tokens: outputs, the tokens' and routing weights'
gradients, and each shard's expert gradients against the matching slice of the unsharded
module's gradients summed over the ranks. Layouts: EP 4 in one hop; EP 4 over two "nodes" of two
ranks (`RL_EP_NODE_SIZE=2`: two hops, across nodes then inside); EP 2, two replicas. fp32 within
rounding, bf16 (the production dtype) within twice the unsharded bf16 module's own error against
fp32.

Bytes: the test counts the token rows each all-to-all sends to a rank on another node. One hop
sends a token once per other rank that owns one of its picks (not once per pick); two hops send
it once per other node that does, exactly that many rows.
"""
import pytest
import torch

from rl.cluster.actors import ProcActor, wait_all
from rl.cluster.groups import free_port
from rl.config import ModelConfig
from rl.models.loading import resolve_model_dir

pytestmark = pytest.mark.slow

WORLD, EXPERTS, TOP_K, NODE = 4, 8, 4, 2


class DispatchRank:
    def __init__(self, model_dir: str, rank: int, port: int):
        import os

        import torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        self.model_dir, self.rank = model_dir, rank
        self.cross_rows = 0
        self._count_cross_node_rows()

    def _count_cross_node_rows(self) -> None:
        """Wrap all_to_all_single: add up the float rows it sends to ranks of another node."""
        import torch.distributed as dist
        real = dist.all_to_all_single

        def counting(out, inp, out_splits=None, in_splits=None, group=None, **kw):
            if inp.is_floating_point() and inp.dim() == 2 and inp.shape[1] > TOP_K and in_splits:
                peers = dist.get_process_group_ranks(group)
                self.cross_rows += sum(n for peer, n in zip(peers, in_splits)
                                       if peer // NODE != self.rank // NODE)
            return real(out, inp, out_splits, in_splits, group=group, **kw)
        dist.all_to_all_single = counting

    def run(self, dtype_name: str, ep: int, node_size: str) -> dict:
        import os

        import torch.distributed as dist
        from torch import nn

        from rl.models.loading import load_model
        from rl.trainer.expert_parallel import (ExpertParallel, is_experts_module, make_groups,
                                                ranks_per_node)
        os.environ["RL_EP_NODE_SIZE"] = node_size
        dtype = getattr(torch, dtype_name)
        model = load_model(self.model_dir, dtype=torch.float32, device="cpu")
        experts = next(m for m in model.modules() if is_experts_module(m))
        assert experts.num_experts == EXPERTS
        g = torch.Generator().manual_seed(100 + self.rank)
        tokens = 29 + 5 * self.rank
        hidden = torch.randn(tokens, experts.gate_up_proj.shape[-1], generator=g)
        picks = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
        weights = torch.rand(tokens, TOP_K, generator=g) + 0.1
        probe = torch.randn(tokens, hidden.shape[1], generator=g)

        def grads(module: nn.Module, dt: torch.dtype) -> dict:
            x = hidden.to(dt, copy=True).requires_grad_()
            w = weights.to(dt, copy=True).requires_grad_()
            module.zero_grad()
            out = module(x, picks, w)
            (out.float() * probe).sum().backward()
            return {"out": out.detach().float(), "x": x.grad.float(), "w": w.grad.float()}

        full = {}
        for dt in dict.fromkeys([torch.float32, dtype]):  # fp32 first: .to() is in place
            whole = experts.to(dt)
            full[dt] = grads(whole, dt)
            for name in ("gate_up_proj", "down_proj"):
                grad = getattr(whole, name).grad.float().clone()
                dist.all_reduce(grad)  # every rank's tokens
                full[dt][name] = grad
        holder = nn.Module()
        holder.experts = experts.to(dtype)
        groups = make_groups(WORLD, self.rank, ep, ranks_per_node(WORLD))
        shards = ExpertParallel(holder, groups, torch.device("cpu"))
        self.cross_rows = 0
        got = grads(holder.experts, dtype)
        got["cross_rows"] = self.cross_rows
        per = EXPERTS // ep
        lo = groups.ep_rank * per
        for name in ("gate_up_proj", "down_proj"):
            got[name] = shards.params[f"experts.{name}"].grad.float()
            dist.all_reduce(got[name], group=groups.edp_group)  # the other replicas' tokens
            for dt in full:
                full[dt][name] = full[dt][name][lo:lo + per]
        # Token rows that must cross nodes: per token, each other node (one hop: each other
        # rank) owning one of its picks.
        owner = picks // per
        node_of = owner // NODE
        my_node = (self.rank % ep) // NODE
        got["need_hops2"] = int(sum(len(set(r.tolist()) - {my_node}) for r in node_of))
        got["need_hop1"] = int(sum(len({o for o in r.tolist() if o // NODE != my_node})
                                   for r in owner))
        got["pairs_cross"] = int((node_of != my_node).sum())
        got["stages"] = len(groups.stages)
        return {"got": got, "ref": full[dtype], "fp32": full[torch.float32]}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    model_dir = resolve_model_dir(ModelConfig(preset="tiny-deepseek-v4"),
                                  tmp_path_factory.mktemp("models"))
    port = free_port()
    actors = [ProcActor(DispatchRank, str(model_dir), r, port, name=f"dispatch{r}")
              for r in range(WORLD)]
    try:
        wait_all([a.ready for a in actors], timeout=600)
        yield actors
    finally:
        for a in actors:
            a.close()


KEYS = ("out", "x", "w", "gate_up_proj", "down_proj")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ep, node_size, stages", [(4, "4", 1), (4, "2", 2), (2, "2", 1)])
def test_sharded_experts_match_the_whole_module(ranks, dtype, ep, node_size, stages):
    results = wait_all([a.call("run", dtype, ep, node_size) for a in ranks], timeout=600)
    for rank, r in enumerate(results):
        got, ref, exact = r["got"], r["ref"], r["fp32"]
        assert got["stages"] == stages
        for key in KEYS:
            if dtype == "float32":
                torch.testing.assert_close(got[key], ref[key], rtol=1e-5, atol=1e-5,
                                           msg=f"rank {rank} {key}")
            else:
                err = (got[key] - exact[key]).abs().max()
                own = (ref[key] - exact[key]).abs().max()
                scale = exact[key].abs().max()
                assert err <= 2 * own + 1e-3 * scale, (rank, key, float(err), float(own))
    if ep == 4:
        # Rows over the node boundary: once per other node (two hops) or per other rank, each
        # four times (the tokens there and their results back; the same two in the backward).
        need = {k: sum(r["got"][k] for r in results)
                for k in ("need_hops2", "need_hop1", "pairs_cross")}
        sent = sum(r["got"]["cross_rows"] for r in results)
        assert sent == 4 * need["need_hops2" if stages == 2 else "need_hop1"]
        assert need["need_hops2"] < need["need_hop1"] < need["pairs_cross"]


@pytest.mark.parametrize("hosts, size", [(["a", "a", "b", "b"], 2), (["a"] * 4, 4),
                                         (["a", "b", "a", "b"], 0), (["a", "a", "a", "b"], 0),
                                         (["a", "a", "b", "b", "a", "a"], 0)])
def test_ranks_per_node_from_host_names(monkeypatch, caplog, hosts, size):
    """Ranks placed node by node give the node size; any other placement gives 0 (one hop),
    with a warning naming the hosts."""
    from rl.trainer import expert_parallel as ep
    monkeypatch.delenv("RL_EP_NODE_SIZE", raising=False)
    monkeypatch.setattr(ep.dist, "all_gather_object", lambda out, _: out.__setitem__(
        slice(None), hosts))
    assert ep.ranks_per_node(len(hosts)) == size
    assert ("not placed node by node" in caplog.text) == (size == 0)
    monkeypatch.setenv("RL_EP_NODE_SIZE", "3")
    with pytest.raises(ValueError, match="RL_EP_NODE_SIZE='3'"):
        ep.ranks_per_node(4)
