import subprocess
import sys
from pathlib import Path

import pytest

from rl.config import Config, ConfigError, load_config, parse_override

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_and_embedded_local_config_load():
    cfg = load_config(ROOT / "configs" / "local.yaml")
    assert isinstance(cfg, Config)
    assert cfg.cluster.kind == "local" and cfg.rollout.engine == "vllm"


def test_unknown_key_names_file_key_and_suggestion(tmp_path):
    p = write(tmp_path, "trainer:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:trainer.lrr: unknown key (did you mean 'lr'?)")
    assert "valid keys:" in msg and "micro_batch_tokens" in msg


def test_wrong_type_names_value_and_expected(tmp_path):
    p = write(tmp_path, "trainer:\n  zero_stage: three\n")
    with pytest.raises(ConfigError, match=r"c.yaml:trainer.zero_stage: got 'three', expected an integer$"):
        load_config(p)


def test_bool_is_not_an_int(tmp_path):
    with pytest.raises(ConfigError, match="num_steps: got True, expected an integer"):
        load_config(write(tmp_path, "num_steps: true\n"))


def test_out_of_range_value(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.top_p: got 1.5, expected a value in \(0, 1\]"):
        load_config(write(tmp_path, "rollout:\n  top_p: 1.5\n"))


def test_literal_choices(tmp_path):
    with pytest.raises(ConfigError, match="rollout.engine: got 'sglang', expected one of 'vllm', 'hf', 'native'"):
        load_config(write(tmp_path, "rollout:\n  engine: sglang\n"))


def test_overrides_apply_and_parse_yaml_scalars(tmp_path):
    cfg = load_config(write(tmp_path, "trainer:\n  lr: 0.1\n"), ["trainer.lr=1e-6", "algorithm.tis_cap=null",
                                                               "data.synthetic.operators=['+']"])
    assert cfg.trainer.lr == 1e-6 and cfg.algorithm.tis_cap is None
    assert cfg.data.synthetic.operators == ["+"]


def test_bad_override_names_command_line():
    with pytest.raises(ConfigError, match=r"^<command line>:trainr: unknown key \(did you mean 'trainer'\?\)"):
        load_config(None, ["trainr.lr=1"])
    with pytest.raises(ConfigError, match="expected an override of the form"):
        parse_override("trainer.lr")


def test_invalid_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"c.yaml:2: invalid YAML"):
        load_config(write(tmp_path, "a: 1\n b: [\n"))
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.slow
def test_cli_typo_exits_2_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "launch.sft", "configs/local.yaml", "trainr.lr=1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "trainr" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
