"""PromptSampler: epochs, shuffling, exact resume from a JSON round-tripped state."""
import json

import pytest

from rl.data import PromptSampler


def test_each_epoch_is_a_permutation_and_epochs_differ():
    sampler = PromptSampler(10, seed=0, shuffle=True)
    first, second = sampler.next_indices(10), sampler.next_indices(10)
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second and first != list(range(10))
    assert sampler.epoch == 1 and sampler.position == 10


def test_crossing_epoch_boundaries_and_no_shuffle():
    sampler = PromptSampler(4, seed=0, shuffle=False)
    assert sampler.next_indices(3) == [0, 1, 2]
    assert sampler.next_indices(7) == [3, 0, 1, 2, 3, 0, 1]
    assert (sampler.epoch, sampler.position) == (2, 2)
    assert sampler.next_indices(0) == []


def test_same_seed_same_sequence_other_seed_differs():
    a = PromptSampler(50, seed=1).next_indices(120)
    assert PromptSampler(50, seed=1).next_indices(120) == a
    assert PromptSampler(50, seed=2).next_indices(120) != a


@pytest.mark.parametrize("consumed", [0, 5, 7, 14, 20])
def test_restore_mid_epoch_continues_the_exact_sequence(consumed):
    reference = PromptSampler(7, seed=42)
    expected = reference.next_indices(consumed + 30)[consumed:]
    sampler = PromptSampler(7, seed=42)
    sampler.next_indices(consumed)
    state = json.loads(json.dumps(sampler.state_dict()))  # must survive JSON
    restored = PromptSampler(7, seed=42)
    restored.load_state_dict(state)
    assert restored.next_indices(11) + restored.next_indices(19) == expected


def test_mismatched_state_is_rejected():
    state = PromptSampler(7, seed=42).state_dict()
    with pytest.raises(ValueError, match=r"sampler state: num_examples: saved 7, now 8"):
        PromptSampler(8, seed=42).load_state_dict(state)
    with pytest.raises(ValueError, match=r"sampler state: seed: saved 42, now 1"):
        PromptSampler(7, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"position=9"):
        PromptSampler(7, seed=42).load_state_dict({**state, "position": 9})
    with pytest.raises(ValueError, match=r"num_examples: got 0"):
        PromptSampler(0, seed=0)
