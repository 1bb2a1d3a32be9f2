"""Routing replay in the HF MoE gates (rl.models.routing) of every preset."""
import numpy as np
import pytest
import torch

from rl.models.presets import PRESETS, build_model
from rl.models.routing import RoutingReplay, routing_dtype


def _experts_seen(model):
    """Forward pre-hooks on the expert modules: the top_k_index each MoE layer actually used."""
    seen, handles = [], []
    for name, mod in model.named_modules():
        if type(mod).__name__.endswith("Experts") and ".mlp." in name:
            handles.append(mod.register_forward_pre_hook(
                lambda m, args, _n=name: seen.append((_n, args[1].detach().clone()))))
    return seen, handles


@pytest.fixture(scope="module", params=PRESETS)
def model(request):
    torch.set_num_threads(1)
    return build_model(request.param, seed=0).eval()


def _ids(model, b=2, length=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (b, length), generator=g)


def test_routers_found_hash_layers_excluded(model):
    rr = RoutingReplay(model)
    try:
        kinds = getattr(model.config, "mlp_layer_types", None)
        if kinds:  # V4: hash layers are not replayed
            assert rr.layers == [i for i, k in enumerate(kinds) if k == "moe"]
        assert rr.num_layers >= 1 and rr.top_k == model.config.num_experts_per_tok
        assert rr.dtype == np.uint8
    finally:
        rr.remove()


def test_replaying_own_routing_is_bitwise_identity(model):
    rr = RoutingReplay(model)
    ids = _ids(model)
    try:
        with torch.no_grad():
            plain = model(input_ids=ids).logits
            with rr.capture() as cap:
                model(input_ids=ids)
            own = rr.recorded_BLNK(cap, tuple(ids.shape))
            with rr.capture(own) as cap2:
                again = model(input_ids=ids).logits
        assert torch.equal(plain, again)
        assert cap2.agree == cap2.total > 0
    finally:
        rr.remove()


def test_replayed_experts_are_used_and_router_keeps_gradient(model):
    rr = RoutingReplay(model)
    ids = _ids(model)
    b, length = ids.shape
    # Random distinct experts per (token, layer): most differ from the router's own choice.
    g = torch.Generator().manual_seed(3)
    e = rr.num_experts
    want = torch.stack([torch.randperm(e, generator=g)[:rr.top_k]
                        for _ in range(b * length * rr.num_layers)])
    want = want.view(b, length, rr.num_layers, rr.top_k)
    mask = torch.ones(b, length, dtype=torch.bool)
    mask[1, -3:] = False  # e.g. padding: keeps its own routing
    seen, handles = _experts_seen(model)
    try:
        model.zero_grad()
        with rr.capture(want, mask) as cap:
            model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        own = rr.recorded_BLNK(cap, (b, length))
        replayed = [idx for name, idx in seen
                    if not (getattr(model.config, "mlp_layer_types", None)
                            and model.config.mlp_layer_types[int(name.split(".")[2])] != "moe")]
        assert len(replayed) == rr.num_layers
        for slot, idx in enumerate(replayed):
            got = idx.view(b, length, rr.top_k)
            assert torch.equal(got[mask], want[:, :, slot][mask])
            assert torch.equal(got[~mask], own[:, :, slot][~mask])
        assert 0 < cap.agree < cap.total  # random routing agrees only by chance
        for r in rr.routers:
            assert r.module.weight.grad is not None and r.module.weight.grad.abs().sum() > 0
    finally:
        for h in handles:
            h.remove()
        rr.remove()


def test_bad_routing_shape_is_refused(model):
    rr = RoutingReplay(model)
    try:
        with pytest.raises(ValueError, match="expected"):
            with rr.capture(torch.zeros(1, 4, rr.num_layers + 1, rr.top_k, dtype=torch.long)):
                pass
    finally:
        rr.remove()


def test_routing_dtype():
    assert routing_dtype(8) == np.uint8 and routing_dtype(256) == np.uint8
    assert routing_dtype(257) == np.uint16
    with pytest.raises(ValueError):
        routing_dtype(70000)
