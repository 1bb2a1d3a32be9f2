"""GPU fixtures: small Qwen3 / Qwen3-MoE directories with head_dim 128 (every fused FP8 piece
block-aligned, as in real checkpoints) and a peaked LM head (scaled x4), so log-prob
comparisons are decided by margins well above bf16 noise."""
from __future__ import annotations


import pytest
import torch

DENSE = dict(vocab_size=2048, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=128, intermediate_size=1536,
             max_position_embeddings=2048, tie_word_embeddings=False)
MOE = dict(vocab_size=2048, hidden_size=512, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=128, intermediate_size=1024, num_experts=16,
           num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True,
           max_position_embeddings=2048, tie_word_embeddings=False)


def build_dir(path, model_type: str, fields: dict, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, bos_token_id=0, eos_token_id=1, pad_token_id=0,
                                  **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_models")
    return {"dense": build_dir(root / "dense", "qwen3", DENSE),
            "moe": build_dir(root / "moe", "qwen3_moe", MOE)}
