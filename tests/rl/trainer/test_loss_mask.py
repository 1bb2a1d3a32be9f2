"""Multi-turn samples: environment tokens are context. The loss, KL, entropy and TIS of the
trainer's micro-batch loss (`micro_policy_loss`, what `TrainerWorker` calls) give them no
gradient, and they do not count in the loss denominator."""
import torch

from rl.config import AlgorithmConfig
from rl.rollout.base import Sample
from rl.trainer import losses
from rl.trainer.batch import TrainBatch
from rl.trainer.microbatch import loss_count, micro_batches, micro_policy_loss

V = 16


def sample(prompt, response, mask=None):
    return Sample(prompt_ids=prompt, response_ids=response, text="",
                  logprobs=[-1.0 if m else 0.0 for m in (mask or [1] * len(response))],
                  finish_reason="stop", weight_version=0, loss_mask=mask)


def batch_and_micro(samples, adv):
    batch = TrainBatch.from_samples(samples, adv)
    (mb,) = micro_batches(batch, list(range(len(samples))), budget=10_000, world_size=1)
    return batch, mb


def grads(mb, algo, adv):
    """d loss / d logits at each input position (B, L-1), summed over the vocabulary."""
    torch.manual_seed(0)
    B, L = mb.input_ids.shape
    logits = torch.randn(B, L - 1, V, requires_grad=True)
    logp = losses.token_logprobs(logits, mb.input_ids[:, 1:])
    old = logp.detach() + 0.05
    ent = losses.entropy_from_logits(logits)
    loss, _ = micro_policy_loss(logp, old, old - 0.1, ent, torch.tensor(adv), mb, algo,
                                loss_count(mb, algo.loss_agg))
    loss.backward()
    return logits.grad.abs().sum(-1)


def test_environment_tokens_get_no_gradient():
    # prompt 3 tokens; response: 2 model tokens, 3 environment tokens, 2 model tokens
    mask = [1, 1, 0, 0, 0, 1, 1]
    samples = [sample([1, 2, 3], [4, 5, 6, 7, 8, 9, 10], mask), sample([1, 2], [11, 12])]
    adv = [1.0, -1.0]
    batch, mb = batch_and_micro(samples, adv)
    assert batch.loss_mask == [mask, [1, 1]]  # a single-turn sample among them: all ones
    algo = AlgorithmConfig(kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0)
    g = grads(mb, algo, adv)
    # logits position t predicts input token t+1: response token j of sample 0 is at P + j
    env_targets = [3 + j - 1 for j, m in enumerate(mask) if not m]
    model_targets = [3 + j - 1 for j, m in enumerate(mask) if m]
    assert torch.all(g[0, env_targets] == 0), g[0]
    assert torch.all(g[0, model_targets] > 0), g[0]
    assert torch.all(g[1, 1:3] > 0)
    assert loss_count(mb, "token") == 4 + 2
    assert loss_count(mb, "sequence") == 2


def test_without_the_mask_environment_tokens_would_get_gradient():
    """The same batch read as single-turn: the environment positions do get gradient, so the
    test above sees the mask, not a property of the positions."""
    mask = [1, 1, 0, 0, 0, 1, 1]
    samples = [sample([1, 2, 3], [4, 5, 6, 7, 8, 9, 10])]
    _, mb = batch_and_micro(samples, [1.0])
    assert mb.loss_mask is None and torch.equal(mb.train_mask, mb.resp_mask)
    g = grads(mb, AlgorithmConfig(kl_coef=0.1, entropy_coef=0.01), [1.0])
    assert torch.all(g[0, [3 + j - 1 for j, m in enumerate(mask) if not m]] > 0)


def test_single_turn_batches_carry_no_mask():
    batch = TrainBatch.from_samples([sample([1], [2, 3])], [0.5])
    assert batch.loss_mask is None
