"""A prompt source for the rollout-pipeline tests (`rl.data.source.PromptSource`'s verbs)."""
from rl.data.sampler import PromptSampler


class FakeSource:
    """10 prompts `[1, i]`, drawn by the real seeded sampler."""

    def __init__(self):
        self.sampler, self.tokenizer = PromptSampler(10, 0), None

    def draw(self, k):
        return self.sampler.next_indices(k)

    def prompts(self, indices):
        return [[1, i] for i in indices]

    def state_dict(self):
        return self.sampler.state_dict()

    def load_state_dict(self, state):
        self.sampler.load_state_dict(state)
