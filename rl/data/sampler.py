"""Resumable prompt sampler: an endless stream of dataset indices, epoch after epoch.

Each epoch is a permutation of range(num_examples) that is a pure function of (seed, epoch), so
the whole state is two integers; `load_state_dict` mid-epoch continues the exact same sequence.
"""
from __future__ import annotations

import random

STATE_VERSION = 1


class PromptSampler:
    """`next_indices(k)` hands out the next k indices, crossing epoch boundaries (each epoch is
    reshuffled from the seed when `shuffle`, else in order). Every index appears exactly once per
    epoch."""

    def __init__(self, num_examples: int, seed: int, shuffle: bool = True):
        if num_examples <= 0:
            raise ValueError(f"PromptSampler: num_examples: got {num_examples}, expected > 0")
        self.num_examples, self.seed, self.shuffle = num_examples, seed, shuffle
        self.epoch = 0
        self.position = 0
        """Indices of the current epoch already handed out."""
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.num_examples))
        if self.shuffle:
            # A string seed is hashed with SHA-512 by `random`: stable across processes/versions.
            random.Random(f"prompt-sampler:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_indices(self, k: int) -> list[int]:
        """The next k indices (k >= 0)."""
        if k < 0:
            raise ValueError(f"next_indices: k: got {k}, expected >= 0")
        out: list[int] = []
        while len(out) < k:
            if self.position == self.num_examples:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(k - len(out), self.num_examples - self.position)
            out += self._order[self.position:self.position + take]
            self.position += take
        return out

    def state_dict(self) -> dict:
        """JSON-serialisable state: {version, num_examples, seed, shuffle, epoch, position}."""
        return {"version": STATE_VERSION, "num_examples": self.num_examples, "seed": self.seed,
                "shuffle": self.shuffle, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict()`. The dataset size, seed and shuffle must match the saved ones
        (a mismatch means the data or config changed since the checkpoint: ValueError)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"sampler state: version: got {state.get('version')!r}, "
                             f"expected {STATE_VERSION}")
        for key in ("num_examples", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"sampler state: {key}: saved {state.get(key)!r}, now "
                                 f"{getattr(self, key)!r}; the data or config changed since the "
                                 "checkpoint")
        epoch, position = state["epoch"], state["position"]
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(position, int)
                and 0 <= position <= self.num_examples):
            raise ValueError(f"sampler state: got epoch={epoch!r}, position={position!r}, "
                             f"expected epoch >= 0 and 0 <= position <= {self.num_examples}")
        self.epoch, self.position = epoch, position
        self._order = self._permutation(epoch)
