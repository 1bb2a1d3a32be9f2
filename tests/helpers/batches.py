"""Random training batches for the trainer tests (seeded: the same batch every run)."""
import random

from rl.trainer.batch import TrainBatch


def random_batch(n: int = 8, seed: int = 0, min_response: int = 2) -> TrainBatch:
    """`n` samples: a 5-token prompt, a response of `min_response` to 5 tokens, rollout
    log-probs -4.5 and advantages alternating -1 / +1."""
    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(3, 100) for _ in range(4)] for _ in range(n)]
    responses = [[rng.randrange(3, 100) for _ in range(rng.randrange(min_response, 6))]
                 for _ in range(n)]
    return TrainBatch(prompt_ids=prompts, response_ids=responses,
                      rollout_logprobs=[[-4.5] * len(r) for r in responses],
                      advantages=[1.0 if i % 2 else -1.0 for i in range(n)])
