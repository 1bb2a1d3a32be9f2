"""`launch.convert` on a tiny DeepSeek-V4 written here in the published layout.

The checkpoint is tiny-deepseek-v4's weights in DeepSeek's names, written by
`tests.helpers.v4_published` (three shards and an index, block-FP8 linears with ue8m0 scales,
MXFP4 experts, one scale in another shard than its weight, and a fourth shard holding an MTP
layer, `mtp.0.*`, as the published Flash's last shard does). The FP8-expert rollout side, which
needs block-aligned dims, is in test_convert_v4_fp8.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from launch.convert import main as convert_main
from rl.config import ConfigError
from rl.models.convert import ConvertError, convert, open_source
from rl.models.convert.writer import FORMAT_VERSION, MANIFEST, sha256_file
from rl.models.loading import load_model
from rl.models.name_maps import checkpoint_state
from rl.models.presets import build_model, build_preset
from tests.helpers.v4_published import CROSS_SHARD_SCALE, FP4_RE, FP8_RE, write_published


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """(directory in the published layout, {name: reference dequantised fp32/original tensor})."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("dsv4")
    preset = build_preset("tiny-deepseek-v4", root / "preset", seed=0)
    state = dict(checkpoint_state(build_model("tiny-deepseek-v4", seed=0)))
    src = root / "published"
    config = json.loads((preset / "config.json").read_text())
    return src, write_published(state, config, preset, src, mtp=True)


def _all_tensors(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    return {n: t for f in sorted(set(index.values())) for n, t in load_file(out / f).items()}


def test_trainer_side_loads_as_the_reference_dequantisation(published, tmp_path):
    src, reference = published
    out = tmp_path / "bf16"
    lines = []
    convert(open_source(src), out, "trainer", max_shard_bytes=400_000, log=lines.append)
    assert [ln.split(" ")[0] for ln in lines[:4]] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    assert len(json.loads((out / MANIFEST).read_text())["shards"]) == 4
    written = _all_tensors(out)
    assert not any(n.endswith(".scale") for n in written)
    assert len({f for f in out.glob("model-*.safetensors")}) > 3  # 400 kB parts
    reference = {n: t for n, t in reference.items() if not n.startswith("mtp.")}
    quantized = [n for n in reference if FP8_RE.search(n) or FP4_RE.search(n)]
    assert len(quantized) > 40 and all(written[n].dtype == torch.bfloat16 for n in quantized)

    model = load_model(out, torch.bfloat16)
    loaded = dict(checkpoint_state(model))
    assert set(loaded) == set(reference) == set(written)
    for name, ref in reference.items():
        # ue8m0 scales: the BF16 dequantisation is exact, so equality is exact.
        assert torch.equal(loaded[name], ref.to(loaded[name].dtype)), name


def _mtp_names(names) -> set[str]:
    return {n for n in names if n.startswith("mtp.")}


@pytest.mark.parametrize("target, experts", [("trainer", "fp8"), ("rollout", "fp8")])
def test_the_mtp_layer_is_left_out_where_nothing_uses_it(published, tmp_path, target, experts):
    """The trainer does not train MTP, and a weight-synced engine (fp8 experts) would hold a
    draft layer that no sync updates: neither directory gets `mtp.*`. The input shard that holds
    only MTP produces no file, and the index, the manifest and the files agree."""
    src = open_source(published[0])
    mtp = _mtp_names(src.weight_map)
    assert len(mtp) > 40 and {src.weight_map[n] for n in mtp} == {src.shards[-1]}
    assert {n for n in mtp if src.kind(n) in ("fp8", "fp4")} >= {"mtp.0.e_proj.weight",
                                                                 "mtp.0.ffn.experts.7.w2.weight"}
    out = tmp_path / target
    lines = []
    convert(src, out, target, rollout_experts=experts, log=lines.append)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert not _mtp_names(index["weight_map"])
    assert f"-> nothing (no tensors for the {target})" in lines[3]
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["shards"][src.shards[-1]] == {"files": {}, "weight_map": {}}
    files = {p.name for p in out.glob("*.safetensors")}
    assert set(index["weight_map"].values()) == files
    assert files == {f for e in manifest["shards"].values() for f in e["files"]}
    assert index["metadata"]["total_size"] == sum((out / f).stat().st_size for f in files)
    written = _all_tensors(out)
    assert set(written) == set(index["weight_map"]) and not _mtp_names(written)
    kept = set(src.weight_map) - mtp
    if target == "trainer":
        kept = {n for n in kept if src.kind(n) != "scale"}
    assert set(written) == kept

    # A directory written by the converter that kept MTP is refused, not resumed.
    manifest["fingerprint"]["format_version"] = FORMAT_VERSION - 1
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConvertError, match=r"written by another converter version"):
        convert(src, out, target, rollout_experts=experts, log=lambda _: None)


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
    assert sum("sha256 verified" in ln for ln in lines) == 3  # 2 shards, and MTP's (no files)
    assert sha256_file(victim) == sha256_file(clean / files[-1])


def test_rollout_side_with_fp4_experts_is_the_published_layout_vllm_v4_loads(published,
                                                                             tmp_path):
    src_dir = published[0]
    out = tmp_path / "fp4"
    convert(open_source(src_dir), out, "rollout", rollout_experts="fp4", log=lambda _: None)
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

    # The copy keeps the MTP layer (no sync changes it); vLLM's V4 model drops it unless
    # speculative decoding asks for it.
    assert len(_mtp_names(written)) > 40
    mapper = _make_deepseek_v4_weights_mapper("fp4")
    assert mapper.apply_list(sorted(_mtp_names(written))) == []
    written = {n: t for n, t in written.items() if not n.startswith("mtp.")}
    mapped = dict(zip(written, mapper.apply_list(list(written))))
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

    # launch.submit refuses it as a rollout.model_path: the weight sync sends FP8 experts.
    from launch.checks import check_rollout_checkpoint_or_exit
    from rl.config import load_config

    cfg = load_config(str(Path(__file__).resolve().parents[3] / "configs" / "local.yaml"),
                      [f"rollout.model_path={out}"])
    with pytest.raises(SystemExit) as exit_info:
        check_rollout_checkpoint_or_exit(cfg)
    assert exit_info.value.code == 2


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


def test_a_rollout_dir_of_the_other_expert_form_is_refused(published, tmp_path):
    """fp4 and fp8 rollout outputs differ in every expert: resuming one as the other would mix
    them, so the manifest records the form."""
    src = open_source(published[0])
    out = tmp_path / "rollout"
    convert(src, out, "rollout", rollout_experts="fp4", log=lambda _: None)
    with pytest.raises(ConvertError, match=r"records a conversion of another source or target"):
        convert(src, out, "rollout", rollout_experts="fp8", log=lambda _: None)
    assert json.loads((out / MANIFEST).read_text())["fingerprint"]["experts"] == "fp4"
