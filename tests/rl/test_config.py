import dataclasses
import re
import subprocess
import sys
import typing
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


def test_expert_parallel_size_needs_a_zero_stage_and_a_divisor_of_the_ranks():
    for stage in (0, 1):  # ZeRO-1 in bf16 is DeepSpeed's BF16_Optimizer: its norm is not hooked
        with pytest.raises(ConfigError, match=f"trainer.expert_parallel_size: got 2, expected 1 "
                                              f"with zero_stage {stage}"):
            load_config(None, [f"trainer.zero_stage={stage}", "trainer.expert_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"trainer.expert_parallel_size: got 0, expected a "
                                          r"divisor of num_ranks \(2\)"):
        load_config(None, ["trainer.num_ranks=2", "trainer.expert_parallel_size=0"])
    assert load_config(None, ["trainer.num_ranks=4", "trainer.expert_parallel_size=2"]
                       ).trainer.expert_parallel_size == 2


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


@pytest.mark.parametrize("order", [0, 1])
def test_overrides_are_validated_as_a_set_in_any_order(order):
    # `data.source=file` alone fails the cross-field check (no train_path); together they pass,
    # whichever comes first.
    pair = ["data.source=file", "data.train_path=my.jsonl"]
    cfg = load_config(ROOT / "configs" / "local.yaml", pair if order == 0 else pair[::-1])
    assert cfg.data.source == "file" and cfg.data.train_path == "my.jsonl"


def test_cross_field_error_names_the_layer_that_caused_it():
    with pytest.raises(ConfigError, match=r"^<command line>:data.train_path: got None"):
        load_config(ROOT / "configs" / "local.yaml", ["data.source=file"])


def test_layered_files_later_wins_and_errors_name_the_file(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("num_steps: 7\ntrainer:\n  lr: 0.1\n  zero_stage: 2\n")
    mine = tmp_path / "mine.yaml"
    mine.write_text("trainer:\n  lr: 0.2\n")
    cfg = load_config([base, mine], ["num_steps=9"])
    assert (cfg.num_steps, cfg.trainer.lr, cfg.trainer.zero_stage) == (9, 0.2, 2)
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  zero_stage: 7\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:trainer.zero_stage: got 7"):
        load_config([base, bad, mine])
    # The file that set a bad value is named, not the last file.
    with pytest.raises(ConfigError, match=r"bad.yaml:trainer.zero_stage: got 7"):
        load_config([bad, mine])


def test_cli_takes_several_config_files_then_overrides(tmp_path):
    from launch.common import config_parser, split_config_args
    mine = tmp_path / "mine.yaml"
    mine.write_text("num_steps: 3\n")
    args = split_config_args(config_parser("x").parse_args(
        ["configs/local.yaml", str(mine), "trainer.lr=1e-4"]))
    assert args.config_files == ["configs/local.yaml", str(mine)]
    assert args.overrides == ["trainer.lr=1e-4"]
    with pytest.raises(SystemExit) as e:
        split_config_args(config_parser("x").parse_args(["configs/local.yaml", "a.b=1", str(mine)]))
    assert e.value.code == 2


def test_cli_flags_may_stand_among_the_overrides():
    from launch.common import config_parser, split_config_args
    p = config_parser("x")
    p.add_argument("--force", action="store_true")
    args = split_config_args(p.parse_args(["configs/local.yaml", "a.b=1", "--force", "c=2"]))
    assert args.force and args.overrides == ["a.b=1", "c=2"]


# (key, a value out of its range, what the error says is expected)
OUT_OF_RANGE = [
    ("algorithm.clip_low", 2, "a value in (0, 1)"),
    ("algorithm.clip_low", 0, "a value in (0, 1)"),
    ("algorithm.clip_high", 1.0, "a value in (0, 1)"),
    ("algorithm.clip_high", -0.1, "a value in (0, 1)"),
    ("algorithm.tis_cap", 0.5, "null (off) or a value >= 1"),
    ("algorithm.kl_coef", -0.01, "a value >= 0"),
    ("algorithm.partial_tokens", 16, "null or a value < rollout.max_new_tokens (16)"),
    ("rollout.temperature", -0.5, "a value >= 0"),
    ("rollout.top_p", 0, "a value in (0, 1]"),
    ("rollout.top_k", 0, "-1 (off) or > 0"),
    ("rollout.gpu_memory_utilization", 1.2, "a value in (0, 1]"),
    ("rollout.n_samples", 0, "a value > 0"),
    ("rollout.max_new_tokens", 513, "a value <= max_model_len (512)"),
    ("rollout.seed", -1, "a value >= 0"),
    ("trainer.min_lr_ratio", 1.5, "a value in [0, 1]"),
    ("trainer.betas", [0.9, 1.0], "two values in [0, 1)"),
    ("trainer.lr", 0, "a value > 0"),
    ("trainer.zero_stage", 4, "0, 1, 2 or 3"),
    ("eval.pass_k_temperature", -1, "a value >= 0"),
    ("eval.num_prompts", 0, "a value > 0"),
    ("data.eval_fraction", 1, "a value in [0, 1)"),
    ("data.eval_fraction", -0.05, "a value in [0, 1)"),
    ("data.max_prompt_tokens", 0, "a value > 0"),
    ("seed", -3, "a value >= 0"),
    ("model.seed", -1, "a value >= 0"),
    ("checkpoint.keep_last", 0, "a value > 0"),
    ("sync.bucket_mb", 0, "a value > 0"),
]


@pytest.mark.parametrize("key, value, expected", OUT_OF_RANGE)
def test_out_of_range_values_are_refused_in_one_line(key, value, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}={value}"])
    msg = str(e.value)
    assert msg.startswith(f"<command line>:{key}: got ") and msg.endswith(f", expected {expected}")
    assert "\n" not in msg


def _numeric_keys(cls=Config, prefix=""):
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _numeric_keys(tp, f"{prefix}{f.name}.")
        elif {int, float} & set(typing.get_args(tp) + (tp,)):
            yield f"{prefix}{f.name}"


# Numeric fields where a negative value means something (an operand bound, "off").
NEGATIVE_ALLOWED = {"data.synthetic.min_value", "rollout.top_k"}


@pytest.mark.parametrize("key", sorted(set(_numeric_keys()) - NEGATIVE_ALLOWED))
def test_every_numeric_field_has_a_range(key):
    # A new numeric field without a check in its __post_init__ fails here: add the check, or
    # add it to NEGATIVE_ALLOWED with the reason.
    with pytest.raises(ConfigError, match=rf"^<command line>:{re.escape(key)}: got -1"):
        load_config(None, [f"{key}=-1"])


def test_negative_allowed_fields_accept_their_meaning():
    cfg = load_config(None, ["data.synthetic.min_value=-5", "rollout.top_k=-1"])
    assert (cfg.data.synthetic.min_value, cfg.rollout.top_k) == (-5, -1)


@pytest.mark.parametrize("key, value", [("algorithm.clip_low", 0.999), ("algorithm.clip_high", 1e-3),
                                        ("data.eval_fraction", 0), ("rollout.temperature", 0),
                                        ("rollout.max_new_tokens", 512), ("eval.pass_k_temperature", 0)])
def test_range_bounds_that_are_allowed(key, value):
    load_config(None, [f"{key}={value}"])


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")))
def test_shipped_configs_pass_the_range_checks(path):
    load_config(path)


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("seed: 1\nname: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"^{path}:2: not UTF-8 \(byte 0xe9\); expected a "
                                          "UTF-8 YAML file$"):
        load_config(path)
