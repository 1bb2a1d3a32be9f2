"""`launch.export --format deepseek-v4`: the round trip the issue asks for, on the tiny V4.

The published layout (`tests.helpers.v4_published`: block-FP8 linears with ue8m0 scales, MXFP4
experts, an MTP layer, three shards plus MTP's) -> `launch.convert --trainer-out` -> two real
training steps of two DeepSpeed ranks (ZeRO-3, BF16, `tests.launch.test_export`'s run) ->
`launch.export --format deepseek-v4` -> `launch.convert` again. The export has the published
checkpoint's names, dtypes and shapes exactly (its MTP layer copied through byte for byte), and
the weights that come back are the trainer's BF16 weights quantised: equal to a reference
quantisation written independently (`tests/rl/models/test_convert_quantize.py`), and within
each block's rounding bound of the trainer's weights.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch.convert import main as convert_main
from launch.export import main as export_main
from rl.models.name_maps import checkpoint_state
from rl.models.presets import build_model, build_preset
from tests.helpers.v4_published import FP4_RE, FP8_RE, write_published
from tests.launch.test_export import _expected, _logprobs, _train_and_checkpoint
from tests.rl.models.test_convert_quantize import ref_fp4, ref_fp8

pytestmark = pytest.mark.slow


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(index.values()))
    assert files == sorted(p.name for p in out.glob("*.safetensors"))
    state = {n: t for f in files for n, t in load_file(out / f).items()}
    assert set(state) == set(index)
    return state


def export(capsys, *args) -> tuple[int, str, str]:
    """`python -m launch.export ARGS` in this process (the imports are paid once): (exit
    status, stdout, stderr)."""
    capsys.readouterr()
    try:
        export_main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _layout(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {n: (t.dtype, tuple(t.shape)) for n, t in state.items()}


@pytest.fixture(scope="module")
def v4_run(tmp_path_factory):
    """(root, published dir, trainer dir, the trainer's BF16 state after step 2 in checkpoint
    names, the trainer's scores)."""
    root = tmp_path_factory.mktemp("dsv4_export")
    preset = build_preset("tiny-deepseek-v4", root / "preset", seed=0)
    state = dict(checkpoint_state(build_model("tiny-deepseek-v4", seed=0)))
    config = json.loads((preset / "config.json").read_text())
    published = root / "published"
    write_published(state, config, preset, published, mtp=True)
    convert_main([str(published), "--trainer-out", str(root / "trainer")])
    got = _train_and_checkpoint(root / "run", root / "trainer", 3, "bfloat16")
    trained = _expected(root / "trainer", got["state"][2], torch.bfloat16)
    return root, published, root / "trainer", trained, got


def _quantized(published: dict) -> dict[str, str]:
    """{weight name: 'fp8' / 'fp4'} of the published checkpoint (by its own regexes)."""
    return {n: "fp8" if FP8_RE.search(n) else "fp4" for n in published
            if (FP8_RE.search(n) or FP4_RE.search(n)) and not n.startswith("mtp.")}


def _assert_round_trip(exported: dict, back: dict, trained: dict, kinds: dict[str, str],
                       plain_dtypes: dict) -> None:
    """`back` (the export converted again) holds the reference quantisation of `trained`,
    within each block's bound; the other tensors are `trained` cast to the published dtype."""
    assert set(back) == set(trained)
    worst = {"fp8": 0.0, "fp4": 0.0}
    for name, w in trained.items():
        if name not in kinds:
            assert torch.equal(back[name], w.to(plain_dtypes[name])), name
            continue
        kind, scale = kinds[name], exported[name[:-len("weight")] + "scale"].float()
        ref, ref_scale = (ref_fp8 if kind == "fp8" else ref_fp4)(w.float())
        assert torch.equal(scale, ref_scale), name
        assert back[name].dtype == torch.bfloat16 and torch.equal(back[name].float(), ref), name
        if kind == "fp8":  # half an e4m3 step: at most 16 scales (256..448), 2**-4 relative
            full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:w.shape[0],
                                                                             :w.shape[1]]
            bound = torch.minimum(16 * full, torch.maximum(w.float().abs() / 16,
                                                           full * 2.0 ** -10))
        else:  # half an e2m1 step: at most one scale (4..6), a quarter of the value above 1
            full = scale.repeat_interleave(32, 1)
            bound = torch.minimum(full, torch.maximum(full / 4, w.float().abs() / 4))
        err = (back[name].float() - w.float()).abs()
        assert torch.all(err <= bound), (name, (err - bound).max())
        worst[kind] = max(worst[kind], (err / full).max().item())
    # the weights did change and were rounded: the bound is met, not trivially
    assert worst["fp8"] > 1 and (worst["fp4"] > 0.2 or "fp4" not in kinds.values()), worst


def test_round_trip_published_convert_train_export_convert(v4_run, tmp_path, capsys):
    root, published_dir, trainer_dir, trained, got = v4_run
    out = tmp_path / "ds"
    code, stdout, stderr = export(capsys, root / "run", "--format", "deepseek-v4", "--out", out,
                                  "--model-dir", trainer_dir, "--max-shard-gb", 0.0005)
    assert code == 0, stderr
    published = _tensors(published_dir)
    exported = _tensors(out)
    mtp = sorted(n for n in published if n.startswith("mtp."))
    assert f"MTP layer: {len(mtp)} tensors copied unchanged from {published_dir}" in stdout
    assert f"{len(published)} tensors, names, dtypes and shapes as in" in stdout
    assert stdout.count("export: wrote model-") > 3
    # exactly the published layout, MTP byte for byte, config and tokenizer as published
    assert _layout(exported) == _layout(published)
    for name in mtp:
        assert torch.equal(exported[name].view(torch.uint8), published[name].view(torch.uint8))
    assert json.loads((out / "config.json").read_text()) == \
        json.loads((published_dir / "config.json").read_text())
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).read_bytes() == (published_dir / f).read_bytes(), f
    assert all(exported[n].dtype == torch.float8_e8m0fnu for n in exported
               if n.endswith(".scale"))
    record = json.loads((out / "export.json").read_text())
    assert record["experts"] == "fp4" and record["mtp_tensors"] == len(mtp)

    convert_main([str(out), "--trainer-out", str(tmp_path / "back")])
    back = _tensors(tmp_path / "back")
    plain = {n: published[n].dtype for n in trained}
    _assert_round_trip(exported, back, trained, _quantized(published), plain)

    # BF16: the converted-back directory loads in BF16 with exactly these weights and runs.
    from rl.models.loading import load_model
    model = load_model(tmp_path / "back", torch.bfloat16)
    for name, t in checkpoint_state(model):
        assert torch.equal(t.float(), back[name].float()), name
    scores = _logprobs(model, got["probe"])
    assert all(torch.isfinite(torch.tensor(s)).all() for s in scores)


def test_fp8_experts_without_mtp(v4_run, tmp_path, capsys):
    """`--experts fp8 --no-mtp`: DeepSeek-V4-Flash-Base's form (block-FP8 experts, every scale
    fp32, `expert_dtype: fp8`), which the converter reads back."""
    root, published_dir, trainer_dir, trained, _ = v4_run
    out = tmp_path / "ds8"
    code, stdout, stderr = export(capsys, root / "run", "--format", "deepseek-v4", "--experts",
                                  "fp8", "--no-mtp", "--out", out, "--model-dir", trainer_dir)
    assert code == 0, stderr
    assert "MTP layer left out (--no-mtp)" in stdout
    published, exported = _tensors(published_dir), _tensors(out)
    assert not any(n.startswith("mtp.") for n in exported)
    assert set(exported) == {n for n in published if not n.startswith("mtp.")}
    kinds = {n: "fp8" for n in _quantized(published)}
    for name, t in exported.items():
        if name in kinds:
            n, k = trained[name].shape
            scale = exported[name[:-len("weight")] + "scale"]
            assert t.dtype == torch.float8_e4m3fn and t.shape == (n, k), name
            assert scale.dtype == torch.float32 and scale.shape == (-(-n // 128), -(-k // 128))
        elif not name.endswith(".scale"):
            assert _layout({name: t}) == _layout({name: published[name]}), name
    config = json.loads((out / "config.json").read_text())
    assert config["expert_dtype"] == "fp8"
    assert config["quantization_config"] == \
        json.loads((published_dir / "config.json").read_text())["quantization_config"]
    convert_main([str(out), "--trainer-out", str(tmp_path / "back")])
    _assert_round_trip(exported, _tensors(tmp_path / "back"), trained, kinds,
                       {n: published[n].dtype for n in trained})


def test_without_the_published_checkpoint_the_layout_follows_the_names(v4_run, tmp_path,
                                                                      capsys):
    """A model directory that does not record its published source: DeepSeek-V4-Flash's layout
    by name gives the same names, dtypes and shapes as the published checkpoint (less MTP),
    config.json the run's own plus DeepSeek's quantization_config."""
    root, published_dir, trainer_dir, _, _ = v4_run
    bare = tmp_path / "model"
    shutil.copytree(trainer_dir, bare)
    (bare / "convert_manifest.json").unlink()
    code, stdout, stderr = export(capsys, root / "run", "--format", "deepseek-v4", "--out",
                                  tmp_path / "ds", "--model-dir", bare, "--no-verify")
    assert code == 0, stderr
    assert "no convert_manifest.json): DeepSeek-V4-Flash's layout by name, no MTP" in stdout
    published = {n: t for n, t in _tensors(published_dir).items() if not n.startswith("mtp.")}
    assert _layout(_tensors(tmp_path / "ds")) == _layout(published)
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert config["quantization_config"]["scale_fmt"] == "ue8m0"
    assert config["expert_dtype"] == "fp4" and "dtype" not in config


def test_deepseek_v4_errors(v4_run, tmp_path, capsys):
    root, published_dir, trainer_dir, _, _ = v4_run
    cases = [(("--dtype", "float32"), "--dtype is for --format hf"),
             (("--published", root / "preset"), "--published: "),
             (("--published", tmp_path / "none"), "no config.json")]
    for extra, message in cases:
        code, _, stderr = export(capsys, root / "run", "--format", "deepseek-v4", "--out",
                                 tmp_path / "o", "--model-dir", trainer_dir, "--no-verify", *extra)
        assert code == 2 and message in stderr, (extra, stderr)
        assert len(stderr.strip().splitlines()) == 1, stderr
