"""Routing survives the pipeline's checkpoint state (batches generated ahead) bitwise."""
import pickle

import numpy as np

from rl.pipeline import RolloutBatch
from rl.rollout.base import Sample


def test_pending_batch_state_keeps_routing_bitwise():
    rng = np.random.default_rng(0)
    routing = rng.integers(0, 256, size=(6, 4, 2), dtype=np.uint8)
    s = Sample(prompt_ids=[1, 2, 3], response_ids=[4, 5, 6, 7], text="", logprobs=[-1.0] * 4,
               finish_reason="length", weight_version=3, routing=routing)
    plain = Sample(prompt_ids=[1], response_ids=[2], text="", logprobs=[-1.0],
                   finish_reason="stop", weight_version=3)
    batch = RolloutBatch(step=4, indices=[0, 1], groups=[[s], [plain]], ahead=True)
    # driver.pt is a torch.save (pickle) of this state
    back = RolloutBatch.from_state(pickle.loads(pickle.dumps(batch.to_state())))
    got = back.groups[0][0].routing
    assert got.dtype == np.uint8 and np.array_equal(got, routing)
    assert got is not routing  # a copy: later edits of the live batch do not reach the state
    assert back.groups[1][0].routing is None
    # states written before routing existed load with routing None
    old = batch.to_state()
    for g in old["groups"]:
        for d in g:
            d.pop("routing")
    assert RolloutBatch.from_state(old).groups[0][0].routing is None
