"""The `hf` engine: samples, finish reasons, seeding, log-probs, weight loading and receiving."""
import pytest
import torch

from rl.rollout.base import RolloutEngine, SamplingParams
from tests.rl.rollout.checks import assert_generated


def forward_logprobs(model, prompt, response) -> list[float]:
    """Reference: one unpadded forward pass over prompt + response, fp32 log_softmax."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(response)]


def test_generates_n_samples_per_prompt_with_finish_reasons(hf_engine, prompts):
    assert isinstance(hf_engine, RolloutEngine) and hf_engine.num_sync_ranks == 1
    # Extra stop tokens beside <eos> (always a stop), so both finish reasons show up.
    stop = [t for t in range(3, 100, 3)]
    sp = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=5, stop_token_ids=stop)
    for s in assert_generated(hf_engine.generate(prompts, sp), prompts, 4, 10, stop):
        assert s.text == hf_engine.tokenizer.decode(
            s.response_ids[:-1] if s.finish_reason == "stop" else s.response_ids,
            skip_special_tokens=True)


def test_sampling_is_seeded_per_call_and_leaves_the_global_rng_alone(hf_engine, prompts):
    sp = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=11)
    state = torch.get_rng_state()
    a = hf_engine.generate(prompts, sp)
    assert torch.equal(state, torch.get_rng_state())
    b = hf_engine.generate(prompts, sp)
    c = hf_engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=12))
    tokens = lambda groups: [s.response_ids for g in groups for s in g]  # noqa: E731
    assert tokens(a) == tokens(b)
    assert tokens(a) != tokens(c)
    assert len({tuple(t) for t in tokens(a)}) > len(prompts)  # samples of a prompt differ


def test_logprobs_equal_an_unpadded_forward_pass(hf_engine, prompts):
    groups = hf_engine.generate(prompts, SamplingParams(n=2, temperature=1.0, top_p=0.9,
                                                        max_new_tokens=12, seed=3))
    worst = 0.0
    for s in (s for g in groups for s in g):
        ref = forward_logprobs(hf_engine.model, s.prompt_ids, s.response_ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, s.logprobs)))
        # Raw temperature-1 log-probs: a proper distribution, not the top-p renormalised one.
        assert all(lp < 0 for lp in s.logprobs)
    assert worst < 1e-5


def test_greedy_copies_the_argmax_path(hf_engine, prompts):
    groups = hf_engine.generate(prompts, SamplingParams(n=3, temperature=0.0, max_new_tokens=10))
    for group in groups:
        assert all(s.response_ids == group[0].response_ids for s in group)
        s = group[0]
        with torch.no_grad():
            logits = hf_engine.model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0]
        argmax = logits[len(s.prompt_ids) - 1: -1].argmax(-1).tolist()
        assert argmax == s.response_ids


def test_score_handles_empty_responses_and_checks_lengths(hf_engine, prompts):
    out = hf_engine.score(prompts[:2], [[5, 6, 7], []])
    assert out[1] == [] and len(out[0]) == 3
    assert out[0] == pytest.approx(forward_logprobs(hf_engine.model, prompts[0], [5, 6, 7]),
                                   abs=1e-5)
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        hf_engine.score(prompts[:2], [[5]])


def test_load_weights_by_checkpoint_name_changes_scores_and_version(hf_engine, model_dir, prompts,
                                                                    perturb):
    from safetensors.torch import load_file

    from rl.models.loading import load_model

    responses = [[10, 20, 30, 40]] * len(prompts)
    before = hf_engine.score(prompts, responses)
    new = perturb(sorted(load_file(str(model_dir / "model.safetensors")).items()), seed=4)
    hf_engine.load_weights(new, version=3)
    assert hf_engine.weight_version == 3
    reference = load_model(model_dir, torch.float32)
    reference.load_state_dict(dict(hf_engine.model.state_dict()))
    after = hf_engine.score(prompts, responses)
    assert max(abs(a - b) for x, y in zip(before, after) for a, b in zip(x, y)) > 1e-2
    ref = [forward_logprobs(reference, p, r) for p, r in zip(prompts, responses)]
    assert after == [pytest.approx(r, abs=1e-5) for r in ref]
    with pytest.raises(ValueError, match="backwards"):
        hf_engine.load_weights(new, version=2)
    sample = hf_engine.generate(prompts[:1], SamplingParams(max_new_tokens=2))[0][0]
    assert sample.weight_version == 3


@pytest.mark.parametrize("transport", ["gloo", "ipc"])
def test_receive_weights_over_the_sync_transport(hf_engine, model_dir, prompts, start_sender,
                                                 perturb, transport):
    from safetensors.torch import load_file

    new = perturb(sorted(load_file(str(model_dir / "model.safetensors")).items()), seed=6)
    sender = start_sender(new, world_size=2, version=1, backend=transport)
    hf_engine.init_weight_sync("127.0.0.1", sender.port, 2, 1, transport, 60.0)
    stats = hf_engine.receive_weights(sender.plan, version=1, verify=True)
    sent = sender.join()
    assert stats["bytes"] == sent["bytes"] == sender.plan.total_bytes
    assert stats["loaded_tensors"] == len(new) and hf_engine.weight_version == 1
    assert len(sender.plan.buckets) > 1  # the test exercises several buckets
    from rl.models.name_maps import checkpoint_state
    now = dict(checkpoint_state(hf_engine.model))
    assert all(torch.equal(now[n], t) for n, t in new)
    hf_engine.shutdown()
