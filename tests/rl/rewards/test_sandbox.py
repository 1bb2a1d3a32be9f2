"""reward.sandbox: "model output" that a plugin executes (`exec_response`) cannot write to the
run directory, read outside its own directory, allocate without bound, leave processes behind or
reach the network; each such attempt fails its sample cleanly, and the run directory is left as
it was. A well-behaved call works in its own directory."""
import os
import socket
import time
from pathlib import Path

import pytest

from rl.config import ConfigError, RewardConfig, RewardSandboxConfig
from rl.data import Example
from rl.rewards import RewardComputer
from rl.rewards.sandbox import landlock_abi, readable_paths

EXEC = "tests.rl.rewards.user_reward_plugins:exec_response"
REPO = Path(__file__).resolve().parents[3]
TIMEOUT_S = 3.0
MARK = "31.4159"  # the argument of the sleeps a fork bomb leaves, to find them
needs_landlock = pytest.mark.skipif(landlock_abi() == 0, reason="this kernel has no Landlock")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory with a checkpoint-like file, and a data file beside it."""
    root = tmp_path_factory.mktemp("sandbox")
    run = root / "runs" / "r"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "driver.pt").write_bytes(b"weights")
    (root / "train.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    return run


@pytest.fixture(scope="module")
def sandboxed(run_dir):
    """A computer running `exec_response` sandboxed, with the run directory and the data file
    protected, on two workers."""
    cfg = RewardConfig(function=EXEC, answer_after=None, num_workers=2, verify_timeout_s=TIMEOUT_S,
                       sandbox=RewardSandboxConfig(enabled=True, memory_mb=256, file_mb=1,
                                                   processes=8, require_landlock=False))
    computer = RewardComputer(cfg, protect=(str(run_dir.parent), str(run_dir.parent.parent /
                                                                      "train.jsonl")))
    yield computer
    computer.close()


def tree(path: Path) -> dict:
    return {str(p.relative_to(path)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in sorted(path.rglob("*"))}


def score_one(computer: RewardComputer, code: str, **meta) -> tuple[bool, str]:
    computer.errors.clear()
    parts = computer.score([code], [Example(prompt="p", answer="", meta=meta)])
    return parts.failed[0], (computer.errors[0] if computer.errors else "")


def test_a_well_behaved_call_works_in_its_own_directory(sandboxed):
    code = ("import json, os\n"
            "open('scratch.txt', 'w').write(json.dumps([1, 2]))\n"
            "assert json.loads(open('scratch.txt').read()) == [1, 2]\n"
            "assert os.listdir('.') == ['scratch.txt'], os.listdir('.')\n")
    assert score_one(sandboxed, code) == (False, "")
    # Each call starts in a fresh empty directory.
    assert score_one(sandboxed, "import os\nassert os.listdir('.') == []") == (False, "")


@needs_landlock
@pytest.mark.parametrize("code, error", [
    ("open({run}/'checkpoints'/'driver.pt', 'wb').write(b'pwned')", "PermissionError"),
    ("open({run}/'new_file', 'w').write('x')", "PermissionError"),
    ("import shutil; shutil.rmtree({run}/'checkpoints')", "PermissionError"),
    ("import os; os.rename({run}/'checkpoints', {run}/'moved')", "PermissionError"),
    ("print(open({run}/'checkpoints'/'driver.pt', 'rb').read())", "PermissionError"),
    ("print(open({run}.parent.parent/'train.jsonl').read())", "PermissionError"),
    ("import os; print(os.listdir({run}))", "PermissionError"),
    ("print(open({outside}).read())", "PermissionError"),
])
def test_model_output_cannot_touch_the_run_directory_or_read_outside(sandboxed, run_dir,
                                                                     tmp_path, code, error):
    outside = tmp_path / "elsewhere.txt"  # neither protected nor the call's own directory
    outside.write_text("secret")
    before = tree(run_dir.parent.parent)
    code = f"from pathlib import Path\n" + code.format(run=f"Path({str(run_dir)!r})",
                                                       outside=repr(str(outside)))
    failed, message = score_one(sandboxed, code)
    assert failed and f"): {error}: " in message, message  # raised by the code itself
    assert tree(run_dir.parent.parent) == before
    assert (run_dir / "checkpoints" / "driver.pt").read_bytes() == b"weights"


def test_resource_limits_fail_the_sample(sandboxed):
    failed, message = score_one(sandboxed, "x = bytearray(1 << 30)")  # memory_mb 256
    assert failed and "MemoryError" in message
    failed, message = score_one(sandboxed, "open('big', 'wb').write(b'x' * (2 << 20))")  # file_mb 1
    assert failed and "File too large" in message
    failed, message = score_one(sandboxed, "fds = [open('/dev/null') for _ in range(100)]")
    assert failed and "Too many open files" in message


def test_the_cpu_limit_ends_a_busy_call():
    cfg = RewardConfig(function=EXEC, answer_after=None, num_workers=1, verify_timeout_s=60,
                       sandbox=RewardSandboxConfig(enabled=True, cpu_s=1, require_landlock=False))
    with RewardComputer(cfg) as computer:
        start = time.monotonic()
        failed, message = score_one(computer, "while True: pass")
        assert failed and "killed by SIGXCPU (reward.sandbox.cpu_s)" in message, message
        assert time.monotonic() - start < 30  # 1 s of CPU, however busy this machine is


def test_a_light_fork_bomb_is_contained_and_cleaned_up(sandboxed):
    code = ("import os\n"
            "for _ in range(20):\n"
            "    if os.fork() == 0:\n"
            "        os.setsid()  # out of the call's process group: only the sweep finds it\n"
            f"        os.execv('/bin/sleep', ['sleep', '{MARK}'])\n"
            "os.wait()\n")  # as root the forks succeed and this waits: the time limit ends it
    start = time.monotonic()
    failed, message = score_one(sandboxed, code)
    assert failed and ("TimeoutError" in message or "BlockingIOError" in message), message
    assert time.monotonic() - start < TIMEOUT_S + 2
    assert not sleeping_marks(), "processes of the call outlived it"


def sleeping_marks() -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if MARK.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(int(pid))
        except OSError:
            pass
    return out


def test_timeouts_exits_and_garbage_fail_cleanly(sandboxed):
    failed, message = score_one(sandboxed, "import time; time.sleep(60)")
    assert failed and "TimeoutError: no result within reward.verify_timeout_s=3s" in message
    failed, message = score_one(sandboxed, "import os; os._exit(0)")
    assert failed and "SandboxError: the sandboxed call exited with status 0 without a result" \
        in message
    failed, message = score_one(sandboxed, "import sys; sys.exit(1)")
    assert failed and "SystemExit: 1" in message
    # The workers survived all of it (a sandboxed call cannot take its worker down).
    assert sandboxed.pool.restarts == 0


@pytest.mark.skipif(landlock_abi() < 6, reason="Landlock ABI < 6 does not scope signals")
def test_model_output_cannot_signal_the_driver(sandboxed):
    code = f"import os; os.kill({os.getpid()}, 0)"  # signal 0: a permission check only
    failed, message = score_one(sandboxed, code)
    assert failed and "): PermissionError: " in message, message


@pytest.mark.skipif(landlock_abi() < 4, reason="Landlock ABI < 4 does not restrict TCP")
def test_model_output_cannot_open_tcp_connections(sandboxed):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)"
        failed, message = score_one(sandboxed, code)
    assert failed and "): PermissionError: " in message, message


def test_readable_paths_leave_out_the_protected_ones(tmp_path):
    for name in ("a/x", "a/runs/r1/ckpt", "a/runs/r2", "b"):
        (tmp_path / name).mkdir(parents=True)
    protected = [str(tmp_path / "a" / "runs" / "r1")]
    assert readable_paths([str(tmp_path)], protected) == sorted(
        str(tmp_path / p) for p in ("a/x", "a/runs/r2", "b"))
    assert readable_paths([str(tmp_path / "a" / "runs" / "r1" / "ckpt")], protected) == []


def test_without_landlock_the_sandbox_refuses_to_start_unless_told(monkeypatch):
    import rl.rewards.pool
    monkeypatch.setattr(rl.rewards.pool, "landlock_abi", lambda: 0)
    cfg = RewardConfig(function="exact", answer_after=None, num_workers=1,
                       sandbox=RewardSandboxConfig(enabled=True))
    with pytest.raises(ConfigError, match=r"reward\.sandbox\.require_landlock: true, but this "
                                          r"kernel has no Landlock"):
        RewardComputer(cfg)


def test_the_sandbox_needs_workers():
    from rl.config import load_config
    with pytest.raises(ConfigError, match=r"reward\.sandbox\.enabled: got True, expected false "
                                          r"with num_workers 0"):
        load_config(None, ["reward.num_workers=0", "reward.sandbox.enabled=true"])


def test_a_program_run_in_a_subprocess_is_judged_by_its_output(run_dir):
    """The recommended shape for code execution: the plugin runs the model's program in a
    subprocess (which inherits the sandbox) and judges what it prints."""
    cfg = RewardConfig(function="tests.rl.rewards.user_reward_plugins:runs_program",
                       answer_after=None, num_workers=1, verify_timeout_s=20,
                       sandbox=RewardSandboxConfig(enabled=True, require_landlock=False))
    attack = f"open({str(run_dir / 'pwned')!r}, 'w').write('x'); print(42)"
    with RewardComputer(cfg, protect=(str(run_dir),)) as computer:
        parts = computer.score(["print(6 * 7)", "print(41)", attack],
                               [Example(prompt="p", answer="42", meta={})] * 3)
        assert parts.correctness[:2] == [1.0, 0.0] and not any(parts.failed)
        if landlock_abi():
            assert parts.correctness[2] == 0.0  # the write failed, so the program did not print
    assert not (run_dir / "pwned").exists()
