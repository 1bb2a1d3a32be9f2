"""`launch.convert --rollout-experts fp8`: the rollout side a weight-synced vLLM V4 engine loads.

The model is tiny-deepseek-v4 with the FP8 linears' and experts' dims made multiples of 128
(q_lora_rank, o_lora_rank, moe_intermediate_size 128): vLLM's block-FP8 methods refuse a fused
layer whose parts are not whole 128-row blocks, as the real Flash dims are. It is written in the
published layout (`tests.helpers.v4_published`), converted to both sides, and then:
  * the FP8 side is loaded by vLLM's own V4 model built with its own FP8 quant config
    (`tests.helpers.vllm_v4_fp8`, a process of its own): every parameter filled, each streamed
    element used once, the experts' bytes and scales equal to an independent reference
    dequantisation (FP4) -> block quantisation (FP8, power-of-two scales) of the published
    tensors, and their values to the published FP4 values (lossless);
  * the trainer side is loaded by `load_model` and sent by the trainer's `WeightSender` (FP8
    wire); that stream loads into the same vLLM model, and has the converter output's tensors
    (names up to vLLM's `.scale` -> `.weight_scale_inv` mapping, FP8 / scale dtypes, shapes),
    with the same expert weights up to the wire's FP8 rounding.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from launch.convert import main as convert_main
from rl.config import SyncConfig
from rl.models.hf_classes import transformers_classes
from rl.models.loading import load_model
from rl.models.name_maps import checkpoint_state
from rl.models.presets import padded_vocab_size, preset_config, save_model
from rl.models.tokenizer import build_char_tokenizer
from tests.helpers.v4_published import (
    FP4_RE, FP8_RE, ref_block_fp8, ref_fp4, ref_fp8, write_published,
)
from tests.helpers.weight_stream import send_and_receive

ROOT = Path(__file__).resolve().parents[3]
EXPERTS = "model.layers.{}.ffn.experts.routed_experts."


def _aligned_v4():
    tokenizer = build_char_tokenizer()
    config = preset_config("tiny-deepseek-v4", padded_vocab_size(len(tokenizer)))
    config.q_lora_rank = config.o_lora_rank = config.moe_intermediate_size = 128
    torch.manual_seed(0)
    model = transformers_classes("deepseek_v4")[1]._from_config(config, dtype=torch.float32)
    return model.eval(), tokenizer


def _all_tensors(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    return {n: t for f in sorted(set(index.values())) for n, t in load_file(out / f).items()}


@pytest.fixture(scope="module")
def fp8_side(tmp_path_factory):
    """Published checkpoint -> both sides -> the sync stream; vLLM loads the FP8 side (stream 0)
    and the sync stream (stream 1)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("dsv4fp8")
    model, tokenizer = _aligned_v4()
    save_model(model, root / "hf", tokenizer=tokenizer)
    config = json.loads((root / "hf" / "config.json").read_text())
    src = root / "published"
    write_published(dict(checkpoint_state(model)), config, root / "hf", src)
    convert_main([str(src), "--trainer-out", str(root / "bf16"), "--rollout-out",
                  str(root / "fp8"), "--max-shard-gb", "0.001"])  # ~1 MiB parts
    converted = _all_tensors(root / "fp8")

    trainer = load_model(root / "bf16", torch.bfloat16)  # what model.dtype trains
    _, sync = send_and_receive(trainer, SyncConfig(wire_dtype="fp8", bucket_mb=0.25,
                                                   verify=True), dtype=None)
    streams = [root / "converted.safetensors", root / "sync.safetensors"]
    for path, tensors in zip(streams, (converted, sync)):
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(path))
    out = root / "vllm"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.vllm_v4_fp8", str(root / "fp8"),
                           str(out), *map(str, streams)], cwd=ROOT, capture_output=True,
                          text=True, timeout=1200)
    assert (out / "result.json").is_file(), proc.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    return {"src": src, "out": root / "fp8", "converted": converted, "sync": sync,
            "result": result, "loaded": [load_file(out / f"loaded-{i}.safetensors")
                                         for i in range(2)]}


def test_fp8_side_loads_into_vllms_v4_fp8_model_as_the_reference_requantisation(fp8_side):
    config = json.loads((fp8_side["out"] / "config.json").read_text())
    assert config["expert_dtype"] == "fp8" and "scale_fmt" not in config["quantization_config"]
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    stream = fp8_side["result"]["streams"][0]
    assert stream["unfilled"] == {} and stream["stream_elements"] == stream["param_elements"]
    params = fp8_side["result"]["params"]
    assert params[EXPERTS.format(1) + "w13_weight"] == [[8, 256, 128], "float8_e4m3fn"]
    assert params[EXPERTS.format(1) + "w13_weight_scale_inv"] == [[8, 2, 1], "float32"]

    published = _all_tensors(fp8_side["src"])
    loaded = fp8_side["loaded"][0]
    experts = [n for n in published if FP4_RE.search(n)]
    assert len(experts) == 4 * 8 * 3
    for layer in range(4):
        vllm = {k: loaded[EXPERTS.format(layer) + k] for k in
                ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")}
        for e in range(8):
            ref = {}
            for w in ("w1", "w2", "w3"):
                base = f"layers.{layer}.ffn.experts.{e}.{w}"
                fp4 = ref_fp4(published[base + ".weight"], published[base + ".scale"])
                ref[w] = ref_block_fp8(fp4)
                assert torch.equal(ref_fp8(*ref[w]), fp4), base  # lossless requantisation
            for got, want in ((vllm["w13_weight"][e], torch.cat([ref["w1"][0], ref["w3"][0]])),
                              (vllm["w2_weight"][e], ref["w2"][0])):
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (layer, e)
            assert torch.equal(vllm["w13_weight_scale_inv"][e],
                               torch.cat([ref["w1"][1], ref["w3"][1]]))
            assert torch.equal(vllm["w2_weight_scale_inv"][e], ref["w2"][1])
    # The FP8 linears keep the published bytes; their ue8m0 scales arrive as fp32, same values.
    attn = "model.layers.1.attn.wq_b."
    assert torch.equal(loaded[attn + "weight"].view(torch.uint8),
                       published["layers.1.attn.wq_b.weight"].view(torch.uint8))
    assert loaded[attn + "weight_scale_inv"].dtype == torch.float32
    assert torch.equal(loaded[attn + "weight_scale_inv"],
                       published["layers.1.attn.wq_b.scale"].float())


def test_sync_stream_has_the_converters_layout_and_expert_weights(fp8_side):
    converted, sync = fp8_side["converted"], fp8_side["sync"]

    def vllm_name(name):  # vLLM's V4 mapper (expert_dtype fp8) maps every `.scale` this way
        return name[:-len(".scale")] + ".weight_scale_inv" if name.endswith(".scale") else name

    # Names and shapes of every tensor; dtypes of the quantised ones and their scales (the rest
    # are in the trainer's own precision, e.g. fp32 norms, which vLLM casts on load).
    layout = {vllm_name(n): tuple(t.shape) for n, t in converted.items()}
    assert layout == {n: tuple(t.shape) for n, t in sync.items()}
    fp8 = {n for n, t in sync.items() if t.dtype == torch.float8_e4m3fn}
    assert fp8 == {n for n in sync if FP8_RE.search(n) or FP4_RE.search(n)}
    assert fp8 == {n for n, t in converted.items() if t.dtype == torch.float8_e4m3fn}
    scales = {n for n in converted if n.endswith(".scale")}
    assert len(scales) == len(fp8)
    assert all(converted[n].dtype == sync[vllm_name(n)].dtype == torch.float32 for n in scales)
    for name in (n for n in converted if FP4_RE.search(n)):  # the same experts, in one place
        base = name[:-len(".weight")]
        conv = ref_fp8(converted[name], converted[base + ".scale"])
        wire = ref_fp8(sync[name], sync[base + ".weight_scale_inv"])
        # The wire's amax / 448 scales round each value once: half an e4m3 step, at most 1/16
        # of the value (3 mantissa bits) or half a subnormal step (2^-10 of the block scale).
        step = ref_fp8(torch.ones(sync[name].shape), sync[base + ".weight_scale_inv"])
        assert ((wire - conv).abs() <= conv.abs() / 16 + step * 2**-10).all(), name
    # The sync's receiver takes the wire's FP8 bytes as they are for an engine built from it.
    assert fp8_side["result"]["engine_loads_block_fp8"] is True
    stream = fp8_side["result"]["streams"][1]
    assert stream["unfilled"] == {} and stream["stream_elements"] == stream["param_elements"]


def test_launch_submit_accepts_the_fp8_side_as_rollout_model_path(fp8_side):
    from launch.checks import check_rollout_checkpoint_or_exit
    from rl.config import load_config

    cfg = load_config(str(ROOT / "configs" / "local.yaml"),
                      [f"rollout.model_path={fp8_side['out']}"])
    check_rollout_checkpoint_or_exit(cfg)  # exits 2 on MXFP4 experts


def test_fp8_side_resumes_and_reconverts_a_missing_part_to_the_same_bytes(fp8_side, capsys):
    from rl.models.convert.writer import MANIFEST, sha256_file

    out = fp8_side["out"]
    before = {f: d for e in json.loads((out / MANIFEST).read_text())["shards"].values()
              for f, d in e["files"].items()}
    victim = sorted(before)[-1]
    (out / victim).unlink()
    capsys.readouterr()
    convert_main([str(fp8_side["src"]), "--rollout-out", str(out), "--max-shard-gb", "0.001"])
    lines = capsys.readouterr().out.splitlines()
    assert sum("sha256 verified" in ln for ln in lines) == 2
    assert any(f"{victim}: missing" in ln for ln in lines)
    assert sha256_file(out / victim) == before[victim]  # the requantisation is deterministic
