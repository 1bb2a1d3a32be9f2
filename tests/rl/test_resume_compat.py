"""A config key added by a later version (at its default) must not refuse the resume of a run
that an earlier version wrote: neither the run directory's config.yaml check nor the
checkpoint's config hash."""
import hashlib
import json

from rl.config import Config, load_config, to_dict
from rl.resume import config_differences, resume_hash


def _without(d: dict, dotted: str) -> dict:
    d = json.loads(json.dumps(d))
    *parents, leaf = dotted.split(".")
    node = d
    for p in parents:
        node = node[p]
    del node[leaf]
    return d


def test_a_key_the_old_config_lacks_is_no_difference_at_its_default():
    new = to_dict(load_config(None, []))
    old = _without(new, "algorithm.routing_replay")  # as a version before routing replay wrote it
    assert config_differences(old, new) == []
    changed = to_dict(load_config(None, ["algorithm.routing_replay=r3"]))
    assert config_differences(old, changed) == ["algorithm.routing_replay: None -> 'r3'"]


def test_the_hash_counts_only_keys_off_their_default():
    empty = hashlib.sha256(b"{}").hexdigest()[:16]
    assert resume_hash(Config()) == empty  # a key added at its default cannot change a hash
    assert resume_hash(load_config(None, ["name=other", "eval.every=7"])) == empty  # ignored keys
    assert resume_hash(load_config(None, ["algorithm.clip_low=0.1"])) != empty
    assert resume_hash(load_config(None, ["seed=1"])) != resume_hash(load_config(None, ["seed=2"]))


def test_reward_answer_after_keeps_old_runs_resumable_unless_their_scoring_changes():
    """Runs written before reward.answer_after resume as before; a DeepSeek-V4 thinking run now
    scores only the answer after `</think>`, a change the resume check names."""
    new = to_dict(load_config(None, []))
    assert config_differences(_without(new, "reward.answer_after"), new) == []
    assert resume_hash(load_config(None, [])) == resume_hash(Config())
    v4 = to_dict(load_config(None, ["model.path=/m", "data.prompt_format=deepseek_v4"]))
    assert config_differences(_without(v4, "reward.answer_after"), v4) == [
        "reward.answer_after: None -> '</think>'"]


def test_reward_workers_may_change_on_resume_the_sandbox_may_not():
    """reward.num_workers does not change the rewards (tested in tests/rl/rewards); the sandbox
    can (a call that passes unconfined may fail confined): the resume check names it."""
    new = to_dict(load_config(None, []))
    assert config_differences(_without(_without(new, "reward.num_workers"), "reward.sandbox"),
                              new) == []
    more = to_dict(load_config(None, ["reward.num_workers=6"]))
    assert config_differences(new, more) == []
    assert resume_hash(load_config(None, ["reward.num_workers=6"])) == resume_hash(Config())
    boxed = to_dict(load_config(None, ["reward.sandbox.enabled=true"]))
    assert config_differences(new, boxed) == ["reward.sandbox.enabled: False -> True"]
