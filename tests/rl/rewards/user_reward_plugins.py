"""Reward plugins the tests load as `tests.rl.rewards.user_reward_plugins:NAME`."""


def length_match(response: str, answer: str, meta: dict) -> float:
    """A valid plugin: 1.0 when the response has as many characters as the answer."""
    return float(len(response.strip()) == len(answer)) * meta.get("scale", 1.0)


def raising(response: str, answer: str, meta: dict) -> float:
    if response == "boom":
        raise RuntimeError("plugin exploded")
    return 1.0


def not_finite(response: str, answer: str, meta: dict) -> float:
    return float("nan")


def not_a_number(response: str, answer: str, meta: dict) -> float:
    return "1.0"


NOT_CALLABLE = 3


def records_response(response: str, answer: str, meta: dict) -> float:
    """Appends what it was given, one JSON string a line, to the file `meta["seen"]` names
    (it runs in a reward worker: a list would not come back) and scores 1."""
    import json
    with open(meta["seen"], "a") as f:
        f.write(json.dumps(response) + "\n")
    return 1.0


def scripted(response: str, answer: str, meta: dict) -> float:
    """Does what the response says (the misbehaviours a reward worker must survive): `hang`,
    `exit` (os._exit), `sys.exit`, `segfault`, `nan`, `raise`, `text`, `sleep:SECONDS`;
    anything else scores 1.0."""
    import os
    import sys
    import time
    if response == "hang":
        time.sleep(600)
    elif response == "exit":
        os._exit(3)
    elif response == "sys.exit":
        sys.exit(4)
    elif response == "segfault":
        import ctypes
        ctypes.string_at(0)
    elif response == "nan":
        return float("nan")
    elif response == "raise":
        raise RuntimeError("plugin exploded")
    elif response == "text":
        return "1.0"
    elif response.startswith("sleep:"):
        time.sleep(float(response[len("sleep:"):]))
    return 1.0


def deterministic(response: str, answer: str, meta: dict) -> float:
    """A pure function of its arguments that takes a response-dependent 0-9 ms (so that workers
    finish out of order) and raises on responses ending in 7."""
    import time
    import zlib
    h = zlib.crc32(response.encode())
    time.sleep((h % 10) / 1000)
    if response.endswith("7"):
        raise ValueError(f"no sevens: {response}")
    return (h % 5) / 4 + float(response == answer)


def exec_response(response: str, answer: str, meta: dict) -> float:
    """A code-execution reward at its crudest: runs the response as Python (with `meta` in
    scope) and scores 1.0 if it finishes."""
    exec(response, {"meta": meta})
    return 1.0


def sleeps_10ms(response: str, answer: str, meta: dict) -> float:
    """A slow verifier (the benchmark's): 10 ms per call."""
    import time
    time.sleep(0.01)
    return float(response.strip() == answer)


def runs_program(response: str, answer: str, meta: dict) -> float:
    """A code-execution reward as docs/rewards.md recommends: the response is a Python program,
    run in a subprocess of its own (so it cannot write this function's result); 1.0 when it
    exits 0 and prints the answer, else 0.0."""
    import subprocess
    import sys
    try:
        done = subprocess.run([sys.executable, "-I", "-c", response], capture_output=True,
                              text=True, timeout=meta.get("timeout_s", 2))
    except subprocess.TimeoutExpired:
        return 0.0
    return float(done.returncode == 0 and done.stdout.strip() == answer)
