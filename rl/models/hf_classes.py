"""transformers' own classes for a `model_type`, whatever vLLM registered in the same process."""
from __future__ import annotations

from typing import Any

from transformers import AutoConfig, AutoModelForCausalLM


def transformers_classes(kind: str) -> tuple[Any, Any]:
    """transformers' own (config class, causal-LM class) for `model_type` `kind`.

    Looked up by name, not through `AutoConfig`'s registry: vLLM registers its own config classes
    there when it loads a model (`AutoConfig.register("deepseek_v4", ..., exist_ok=True)` in
    `vllm.transformers_utils.config`), and vLLM's `DeepseekV4Config` lacks fields transformers'
    model reads (`layer_types`), so an HF model built after a vLLM engine in the same process
    would break.
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if kind not in CONFIG_MAPPING_NAMES or kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoConfig, AutoModelForCausalLM  # e.g. a remote-code model
    return (getattr(transformers, CONFIG_MAPPING_NAMES[kind]),
            getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind]))
