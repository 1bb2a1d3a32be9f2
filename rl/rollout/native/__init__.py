"""The `native` rollout engine: our own decode loop for Qwen3 / Qwen3-MoE (BF16 or block-FP8
weights, a static KV cache, CUDA graphs on GPU), for machines where vLLM cannot travel.

- `engine`: `NativeEngine` (generate, score, weight updates) and its CUDA-graph buckets;
- `model`: the forward pass over fused weight slots; `kernels`: its Triton / torch kernels;
- `sampling`: seeded per-request sampling; `weights`: HF names -> fused slots, and loading.
"""
