"""`launch.convert` on a tiny DeepSeek-V4 written here in the published layout.

The checkpoint is tiny-deepseek-v4's weights in DeepSeek's names, split over three shards with
an index; attention / indexer / shared-expert linears as block-FP8 with ue8m0 scales, routed
experts as packed FP4 (MXFP4, ue8m0 per 32 inputs), one scale stored in another shard than its
weight. The FP4 quantiser and the reference dequantisation below are written independently of
`rl.models.convert` (own e2m1 table and bit order, own scale broadcast).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from launch.convert import main as convert_main
from rl.config import ConfigError
from rl.models.convert import ConvertError, convert, open_source
from rl.models.convert.writer import MANIFEST, sha256_file
from rl.models.loading import load_model
from rl.models.name_maps import checkpoint_state
from rl.models.presets import build_model, build_preset
from rl.quant.block_fp8 import quantize_weight_block

# The linears vLLM's V4 builds with the FP8 quant config (attention.py, nvidia/model.py); the
# compressors, the indexer's weights_proj, routers, embeddings and head get quant_config=None.
FP8_RE = re.compile(r"\.(attn\.(wq_a|wkv|wq_b|wo_a|wo_b)|attn\.indexer\.wq_b|"
                    r"ffn\.shared_experts\.w[123])\.weight$")
FP4_RE = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
FP32_RE = re.compile(r"hc_|attn_sink|\.gate\.bias$")
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
CROSS_SHARD_SCALE = "layers.1.attn.wq_b.scale"


def pow2_up(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, torch.exp2(torch.ceil(torch.log2(x))), torch.ones_like(x))


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> (N, K/2) int8 (code of input 2j in bits 0-3, of 2j+1 in bits 4-7), (N, K/32)
    e8m0 scales."""
    n, k = w.shape
    groups = w.float().reshape(n, k // 32, 32)
    scale = pow2_up(groups.abs().amax(-1) / 6.0)
    v = groups / scale[..., None]
    mag = (v.abs()[..., None] - torch.tensor(E2M1)).abs().argmin(-1)
    codes = (mag | ((v < 0).long() << 3)).reshape(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def ref_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    u = packed.view(torch.uint8).long()
    out = torch.empty(u.shape[0], 2 * u.shape[1])
    for col, codes in ((0, u % 16), (1, u // 16)):
        sign = torch.where(codes >= 8, -1.0, 1.0)
        out[:, col::2] = sign * torch.tensor(E2M1)[codes % 8]
    s = scale.float()
    return out * torch.stack([s] * 32, dim=-1).reshape(out.shape)


def ref_fp8(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = w8.shape
    s = scale.float()
    rows = torch.arange(n) // 128
    cols = torch.arange(k) // 128
    return w8.float() * s[rows][:, cols]


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """(directory in the published layout, {name: reference dequantised fp32/original tensor})."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("dsv4")
    preset = build_preset("tiny-deepseek-v4", root / "preset", seed=0)
    state = dict(checkpoint_state(build_model("tiny-deepseek-v4", seed=0)))
    tensors, reference = {}, {}
    for name, t in state.items():
        base = name[:-len(".weight")]
        if FP8_RE.search(name):
            w8, s = quantize_weight_block(t.float(), 128, pow2=True)
            tensors[name], tensors[base + ".scale"] = w8, s.to(torch.float8_e8m0fnu)
            reference[name] = ref_fp8(w8, tensors[base + ".scale"])
        elif FP4_RE.search(name):
            tensors[name], tensors[base + ".scale"] = quantize_fp4(t)
            reference[name] = ref_fp4(tensors[name], tensors[base + ".scale"])
        else:
            keep32 = FP32_RE.search(name) or not t.is_floating_point()
            tensors[name] = t if keep32 else t.to(torch.bfloat16)
            reference[name] = tensors[name]
    src = root / "published"
    src.mkdir()
    names = sorted(tensors)
    thirds = [names[i::3] for i in range(3)]
    weight_map = {}
    for i, part in enumerate(thirds, start=1):
        fname = f"model-{i:05d}-of-00003.safetensors"
        weight_map.update({n: fname for n in part})
    weight_map[CROSS_SHARD_SCALE] = "model-00003-of-00003.safetensors"
    weight_map[CROSS_SHARD_SCALE[:-len(".scale")] + ".weight"] = "model-00001-of-00003.safetensors"
    for fname in sorted(set(weight_map.values())):
        save_file({n: tensors[n].contiguous() for n, f in weight_map.items() if f == fname},
                  str(src / fname), metadata={"format": "pt"})
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = json.loads((preset / "config.json").read_text())
    config.pop("expert_dtype")  # the published Flash config relies on vLLM's default (fp4)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps(config))
    for extra in preset.iterdir():
        if extra.name not in ("config.json", "model.safetensors"):
            (src / extra.name).write_bytes(extra.read_bytes())
    return src, reference


def _all_tensors(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    return {n: t for f in sorted(set(index.values())) for n, t in load_file(out / f).items()}


def test_trainer_side_loads_as_the_reference_dequantisation(published, tmp_path):
    src, reference = published
    out = tmp_path / "bf16"
    lines = []
    convert(open_source(src), out, "trainer", max_shard_bytes=400_000, log=lines.append)
    assert [ln.split(" ")[0] for ln in lines[:3]] == ["[1/3]", "[2/3]", "[3/3]"]
    assert len(json.loads((out / MANIFEST).read_text())["shards"]) == 3
    written = _all_tensors(out)
    assert not any(n.endswith(".scale") for n in written)
    assert len({f for f in out.glob("model-*.safetensors")}) > 3  # 400 kB parts
    quantized = [n for n in reference if FP8_RE.search(n) or FP4_RE.search(n)]
    assert len(quantized) > 40 and all(written[n].dtype == torch.bfloat16 for n in quantized)

    model = load_model(out, torch.bfloat16)
    loaded = dict(checkpoint_state(model))
    assert set(loaded) == set(reference)
    for name, ref in reference.items():
        # ue8m0 scales: the BF16 dequantisation is exact, so equality is exact.
        assert torch.equal(loaded[name], ref.to(loaded[name].dtype)), name


def test_interrupted_run_resumes_and_a_corrupt_shard_is_converted_again(published, tmp_path):
    src = open_source(published[0])
    clean = tmp_path / "clean"
    convert(src, clean, "trainer", log=lambda _: None)

    out = tmp_path / "resumed"

    def interrupt(shard):
        (out / ".model-00002-001.safetensors.tmp").write_bytes(b"half a shard")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(src, out, "trainer", log=lambda _: None, on_shard_done=interrupt)
    assert len(json.loads((out / MANIFEST).read_text())["shards"]) == 1
    assert not (out / "model.safetensors.index.json").exists()

    lines = []
    convert(src, out, "trainer", log=lines.append)
    assert "converted earlier, sha256 verified" in lines[0]
    assert "converted earlier" not in lines[1] and not list(out.glob(".*.tmp"))
    files = sorted(p.name for p in clean.glob("model-*.safetensors"))
    assert files == sorted(p.name for p in out.glob("model-*.safetensors"))
    assert all(sha256_file(clean / f) == sha256_file(out / f) for f in files)

    victim = out / files[-1]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    lines.clear()
    convert(src, out, "trainer", log=lines.append)
    assert any(f"{files[-1]}: checksum mismatch" in ln for ln in lines)
    assert sum("sha256 verified" in ln for ln in lines) == 2
    assert sha256_file(victim) == sha256_file(clean / files[-1])


def test_rollout_side_is_the_layout_vllm_v4_loads(published, tmp_path):
    src_dir = published[0]
    out = tmp_path / "fp8"
    convert(open_source(src_dir), out, "rollout", log=lambda _: None)
    written = _all_tensors(out)
    source = _all_tensors(src_dir)
    assert set(written) == set(source)
    for name, t in source.items():  # unchanged bytes: no second rounding
        assert written[name].dtype == t.dtype and torch.equal(written[name].view(torch.uint8),
                                                               t.view(torch.uint8)), name
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert config["expert_dtype"] == "fp4" and config["model_type"] == "deepseek_v4"

    # Names: vLLM's own V4 mapper (what its load_weights applies first) must send FP4 expert
    # scales to Mxfp4MoEMethod's `weight_scale` and the FP8 linears' to `weight_scale_inv`.
    from vllm.models.deepseek_v4.cpu.model import _make_deepseek_v4_weights_mapper

    mapped = dict(zip(written, _make_deepseek_v4_weights_mapper("fp4").apply_list(list(written))))
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    for name, t in written.items():
        if FP4_RE.search(name):
            scale = written[name[:-len(".weight")] + ".scale"]
            assert mapped[name[:-len(".weight")] + ".scale"].endswith(".weight_scale")
            # Mxfp4MoEMethod: w13 (E, 2I, H/2) uint8 + (E, 2I, H/32); w2 (E, H, I/2) + (E, H, I/32)
            n, k = (hidden, inter) if name.endswith("w2.weight") else (inter, hidden)
            assert t.dtype == torch.int8 and tuple(t.shape) == (n, k // 2), name
            assert scale.dtype == torch.float8_e8m0fnu and tuple(scale.shape) == (n, k // 32)
        elif FP8_RE.search(name):
            scale = written[name[:-len(".weight")] + ".scale"]
            assert mapped[name[:-len(".weight")] + ".scale"].endswith(".weight_scale_inv")
            n, k = t.shape
            assert t.dtype == torch.float8_e4m3fn, name
            assert tuple(scale.shape) == (-(-n // 128), -(-k // 128)), name
    assert mapped["embed.weight"] == "model.embed_tokens.weight"


def test_load_model_refuses_a_quantized_checkpoint(published, tmp_path):
    with pytest.raises(ConfigError, match=r"quantized .*python -m launch\.convert"):
        load_model(published[0], torch.bfloat16)
    # FP8 tensors without a quantization_config are refused too.
    plain = tmp_path / "noconfig"
    plain.mkdir()
    config = json.loads((published[0] / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    save_file({"embed.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn)},
              str(plain / "model.safetensors"))
    with pytest.raises(ConfigError,
                       match=r"embed\.weight is F8_E4M3\); .*python -m launch\.convert"):
        load_model(plain, torch.bfloat16)


def _copy_published(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_bad_scale_shape_is_one_line_and_exit_2(published, tmp_path, capsys):
    bad = _copy_published(published[0], tmp_path / "bad")
    index = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]
    shard = bad / index[CROSS_SHARD_SCALE]
    tensors = load_file(shard)
    tensors[CROSS_SHARD_SCALE] = torch.ones(3, 3).to(torch.float8_e8m0fnu)
    save_file(tensors, str(shard))
    with pytest.raises(SystemExit) as exit_info:
        convert_main([str(bad), "--trainer-out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "layers.1.attn.wq_b.weight: scale shape (3, 3), expected" in err


def test_a_scale_without_weight_and_a_foreign_output_dir_are_refused(published, tmp_path):
    bad = _copy_published(published[0], tmp_path / "bad")
    index_path = bad / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["layers.0.attn.wo_b.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ConvertError, match=r"layers\.0\.attn\.wo_b\.scale has no weight"):
        open_source(bad)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(ConvertError, match=r"not empty and has no convert_manifest\.json"):
        convert(open_source(published[0]), busy, "trainer", log=lambda _: None)
