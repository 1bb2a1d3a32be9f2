"""Models: local HF checkpoints, tiny deterministic MoE presets, the character tokenizer, and the
parameter-name maps between HF transformers and inference-engine (vLLM) checkpoint layouts.

Entry points: `loading.resolve_model_dir`, `loading.load_model`, `loading.load_tokenizer`,
`presets.build_preset`, `presets.save_model`, `name_maps.full_state_for_engine`,
`name_maps.to_engine_weights`.
"""
