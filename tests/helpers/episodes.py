"""Scripted engines for the multi-turn episode tests (the character tokenizer of the presets)."""
from rl.models.tokenizer import EOS_ID, build_char_tokenizer
from rl.rollout.base import Sample

TOK = build_char_tokenizer()


def ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


class ScriptedEngine:
    """Answers by the context's text: `script(text, sample_index) -> response text` (+ EOS
    unless it is longer than max_new_tokens); records every call."""

    def __init__(self, script, version=3):
        self.script, self.version, self.calls = script, version, []

    def __call__(self, prompts, sampling, seed):
        self.calls.append((len(prompts), sampling.n, sampling.max_new_tokens, seed))
        out = []
        for p in prompts:
            group = []
            for j in range(sampling.n):
                tokens = ids(self.script(TOK.decode(p), j)) + [EOS_ID]
                reason = "stop"
                if len(tokens) > sampling.max_new_tokens:
                    tokens, reason = tokens[:sampling.max_new_tokens], "length"
                group.append(Sample(prompt_ids=list(p), response_ids=tokens, text="",
                                    logprobs=[-0.5] * len(tokens), finish_reason=reason,
                                    weight_version=self.version))
            out.append(group)
        return out


def transcript(*parts: str) -> list[int]:
    """Token ids of an episode's whole response: model turns (each ending with EOS) are the
    parts starting with `>`, the others are the environment's observations."""
    out: list[int] = []
    for p in parts:
        out += ids(p[1:]) + [EOS_ID] if p.startswith(">") else ids(p)
    return out


class OracleEngine:
    """Writes the model turns of a fixed transcript (`transcript`): given a context that follows
    it so far, the rest of the current model turn (cut at max_new_tokens). Log-probs carry the
    call's seed and the engine's version, so a call with another seed or other weights shows.
    Every call is recorded: (contexts, max_new_tokens, seed, version)."""

    def __init__(self, prompt_len: int, target: list[int], version: int = 3):
        self.prompt_len, self.target, self.version, self.calls = prompt_len, target, version, []

    def __call__(self, prompts, sampling, seed):
        self.calls.append((len(prompts), sampling.max_new_tokens, seed, self.version))
        out = []
        for p in prompts:
            done = list(p[self.prompt_len:])
            assert self.target[:len(done)] == done, "the context left the transcript"
            end = self.target.index(EOS_ID, len(done)) + 1
            tokens, reason = self.target[len(done):end], "stop"
            if len(tokens) > sampling.max_new_tokens:
                tokens, reason = tokens[:sampling.max_new_tokens], "length"
            lp = [-(seed % 1000 + 1) / 1000 - self.version / 10] * len(tokens)
            out.append([Sample(prompt_ids=list(p), response_ids=tokens, text="", logprobs=lp,
                               finish_reason=reason, weight_version=self.version)
                        for _ in range(sampling.n)])
        return out
