"""The run's prompts: train and eval examples, encoded once, and the resumable sampler."""
from __future__ import annotations

from pathlib import Path

from rl.config import Config
from rl.data.datasets import build_datasets, encode_prompt
from rl.data.example import Example
from rl.data.sampler import PromptSampler


class PromptSource:
    """Examples and their token ids (`encode_prompt`, the one encoding SFT also uses); `draw`
    takes the next step's prompts from the seeded sampler (its state is checkpointed)."""

    def __init__(self, cfg: Config, tokenizer):
        self.tokenizer = tokenizer
        self.train, eval_set = build_datasets(cfg.data, cfg.seed)
        self.eval_set: list[Example] = eval_set[: cfg.eval.num_prompts]
        self.train_ids = [encode_prompt(ex, tokenizer, cfg.data) for ex in self.train]
        self.eval_ids = [encode_prompt(ex, tokenizer, cfg.data) for ex in self.eval_set]
        self.sampler = PromptSampler(len(self.train), cfg.seed, cfg.data.shuffle)

    @classmethod
    def from_model_dir(cls, cfg: Config, model_dir: Path) -> PromptSource:
        from rl.models.loading import load_tokenizer
        return cls(cfg, load_tokenizer(model_dir))

    def draw(self, k: int) -> list[int]:
        """Training-set indices of the next `k` prompts."""
        return self.sampler.next_indices(k)

    def prompts(self, indices: list[int]) -> list[list[int]]:
        return [self.train_ids[i] for i in indices]

    def examples(self, indices: list[int]) -> list[Example]:
        return [self.train[i] for i in indices]

    def probe(self) -> tuple[list[int], list[int]]:
        """A fixed (prompt, reference answer + EOS) sequence: the weight-sync log-prob check."""
        ex, prompt = ((self.eval_set[0], self.eval_ids[0]) if self.eval_set
                      else (self.train[0], self.train_ids[0]))
        answer = self.tokenizer(ex.answer, add_special_tokens=False)["input_ids"]
        return prompt, answer + [self.tokenizer.eos_token_id]

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
