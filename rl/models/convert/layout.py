"""The published DeepSeek-V4 form of each trained tensor: the inverse of the converter's trainer
target, for `launch.export --format deepseek-v4`.

The names are the converter's: it keeps DeepSeek's names, which the trainer's checkpoint names
are (`rl.models.name_maps.to_engine_weights`), so the map is the identity. What each tensor
becomes is read from the published checkpoint the run was converted from (`Source`), as the
converter reads it: a `.weight` stored with a `.scale` beside it is quantised again (FP4 when
it was FP4, FP8 when it was FP8), every other tensor is cast back to the dtype it was stored
in. The result then has the published checkpoint's names, dtypes and shapes exactly.

Routed experts can instead be written as block FP8 (`experts="fp8"`, DeepSeek-V4-Flash-Base's
form: FP8 experts, and every scale float32, which is what vLLM's `DeepseekV4FP8Config` reads when
config.json says `expert_dtype: fp8`); the FP4 form (DeepSeek-V4-Flash's) keeps ue8m0 scales.

Without the published checkpoint the form comes from the names, as DeepSeek-V4-Flash ships
them: the attention's, the indexer's and the shared experts' linears in block FP8
(`FP8_LINEAR_RE`, the linears vLLM's V4 builds with its FP8 quant config), routed experts in
FP4 (`ROUTED_EXPERT_RE`), the mHC mixers, attention sinks and router biases in fp32
(`FP32_RE`), integer tensors as they are, everything else BF16.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from rl.models.convert.quantize import quantize
from rl.models.convert.source import Source
from rl.models.convert.writer import MTP_PREFIX

EXPERT_FORMS = ("fp4", "fp8")
ROUTED_EXPERT_RE = re.compile(r"(^|\.)ffn\.experts\.\d+\.w[123]\.weight$")
FP8_LINEAR_RE = re.compile(r"(^|\.)(attn\.(wq_a|wkv|wq_b|wo_a|wo_b)|attn\.indexer\.wq_b|"
                           r"ffn\.shared_experts\.w[123])\.weight$")
FP32_RE = re.compile(r"hc_|attn_sink|\.gate\.bias$")
BLOCK = 128
"""DeepSeek-V4-Flash's FP8 block edge (`weight_block_size`)."""
QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                       "scale_fmt": "ue8m0", "weight_block_size": [BLOCK, BLOCK]}
"""DeepSeek-V4-Flash's `quantization_config` (config.json)."""
TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
                "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
                "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu}
"""safetensors dtype names -> torch dtypes."""


class LayoutError(ValueError):
    """A trained tensor that has no place in the published layout."""


@dataclass(frozen=True, slots=True)
class Form:
    kind: str
    """'fp8' or 'fp4' (written as `.weight` plus `.scale`) or 'plain'."""
    dtype: torch.dtype
    """A plain tensor's dtype; a quantised one's scale dtype."""


def expert_form(source: Source) -> str:
    """'fp4' or 'fp8': how `source` stores its routed experts (fp4 when it has none)."""
    for name in source.weight_map:
        if ROUTED_EXPERT_RE.search(name) and source.kind(name) in EXPERT_FORMS:
            return source.kind(name)
    return "fp4"


class Layout:
    """The output's form of every tensor: `source`'s where there is one, else by name."""

    def __init__(self, source: Source | None, experts: str | None = None):
        if experts is not None and experts not in EXPERT_FORMS:
            raise LayoutError(f"experts {experts!r}, expected one of {', '.join(EXPERT_FORMS)}")
        self.source = source
        self.experts = experts or (expert_form(source) if source is not None else "fp4")
        self.block = source.block if source is not None else BLOCK
        self.as_source = source is not None and self.experts == expert_form(source)
        """True when the output has `source`'s names, dtypes and shapes exactly."""
        # FP4 experts: ue8m0 scales (Flash); FP8 experts: fp32 scales (Flash-Base, and what vLLM
        # allocates for them).
        self.scale_dtype = torch.float8_e8m0fnu if self.experts == "fp4" else torch.float32

    def form(self, name: str, t: torch.Tensor) -> Form:
        if self.source is None:
            return self._form_by_name(name, t)
        src = self.source
        if name not in src.weight_map or src.kind(name) == "scale":
            raise LayoutError(f"{name} is not a tensor of the published checkpoint {src.path} "
                              "(was the run's model converted from another one?)")
        kind = src.kind(name)
        dtype, shape = src.dtype_shape(name)
        if kind == "fp4":
            shape = (*shape[:-1], 2 * shape[-1])
        if tuple(t.shape) != tuple(shape):
            raise LayoutError(f"{name}: shape {tuple(t.shape)} in the checkpoint, {shape} in the "
                              f"published checkpoint {src.path}")
        if kind == "plain":
            return Form("plain", TORCH_DTYPES[dtype])
        expert = kind == "fp4" or bool(ROUTED_EXPERT_RE.search(name))
        kind = self.experts if expert else "fp8"
        if self.as_source:
            return Form(kind, TORCH_DTYPES[src.dtype_shape(name[:-len("weight")] + "scale")[0]])
        return Form(kind, self.scale_dtype)

    def _form_by_name(self, name: str, t: torch.Tensor) -> Form:
        if FP8_LINEAR_RE.search(name):
            return Form("fp8", self.scale_dtype)
        if ROUTED_EXPERT_RE.search(name):
            return Form(self.experts, self.scale_dtype)
        if not t.is_floating_point():
            return Form("plain", t.dtype)
        return Form("plain", torch.float32 if FP32_RE.search(name) else torch.bfloat16)

    def tensors(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The published tensors of trained tensor `name`: itself cast, or its quantised
        `.weight` and `.scale` (quantised from its BF16 values)."""
        form = self.form(name, t)
        if form.kind == "plain":
            return [(name, t.to(form.dtype).contiguous())]
        try:
            q, scale = quantize(form.kind, t.to(torch.bfloat16), self.block)
        except ValueError as e:
            raise LayoutError(f"{name}: {e}") from None
        return [(name, q), (name[:-len("weight")] + "scale", scale.to(form.dtype))]

    def expected(self) -> set[str]:
        """The names of `source` the trained model must provide (all but MTP and scales)."""
        if self.source is None:
            return set()
        return {n for n in self.source.weight_map
                if not n.startswith(MTP_PREFIX) and self.source.kind(n) != "scale"}

    def mtp_names(self) -> list[str]:
        """`source`'s MTP layer (`mtp.*`), which the trainer does not train."""
        if self.source is None:
            return []
        return sorted(n for n in self.source.weight_map if n.startswith(MTP_PREFIX))

    def config(self, base: dict) -> dict:
        """config.json: `source`'s (only `expert_dtype` changed when the experts' form is not
        its own), or `base` (the trainer's) with DeepSeek's quantization_config."""
        if self.source is not None:
            config = dict(self.source.config)
            if not self.as_source:
                config["expert_dtype"] = self.experts
            return config
        config = {k: v for k, v in base.items() if k not in ("dtype", "torch_dtype")}
        config.update(quantization_config=dict(QUANTIZATION_CONFIG), expert_dtype=self.experts,
                      torch_dtype="bfloat16")
        return config
