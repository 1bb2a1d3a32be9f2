"""Prompt data: examples, file and synthetic datasets, answer extraction, the resumable sampler."""
from rl.data.answers import extract_answer, find_boxed, find_gsm8k
from rl.data.datasets import build_datasets, format_prompt
from rl.data.example import DataError, Example
from rl.data.files import load_examples
from rl.data.sampler import PromptSampler
from rl.data.synthetic import make_synthetic

__all__ = ["DataError", "Example", "PromptSampler", "build_datasets", "extract_answer",
           "find_boxed", "find_gsm8k", "format_prompt", "load_examples", "make_synthetic"]
