"""Tiny HF MoE models for the FP8 tests (built inline: no downloads, well under a second)."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM


def make_tiny_qwen3_moe(seed: int = 0, device: str = "cpu") -> Qwen3MoeForCausalLM:
    """2 layers: layer 0 sparse (4 experts, top-2, fused 3-D expert weights), layer 1 dense MLP
    (`mlp_only_layers`) so that `mlp.gate` (router) and `mlp.gate_proj` both occur."""
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                         max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.05)
    torch.manual_seed(seed)
    with torch.device(device):
        return Qwen3MoeForCausalLM(cfg).eval()


def make_tiny_deepseek_v3_meta():
    """DeepSeek-V3 layout (MLA, shared experts, router with e_score_correction_bias) on the meta
    device: parameter names and shapes only."""
    cfg = AutoConfig.for_model(
        "deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        max_position_embeddings=64)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


@pytest.fixture
def tiny_qwen3_moe():
    return make_tiny_qwen3_moe()


@pytest.fixture(scope="session")
def tiny_deepseek_v3_meta():
    return make_tiny_deepseek_v3_meta()


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
