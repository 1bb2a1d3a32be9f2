"""Reward scoring throughput: in the driver vs the reward worker pool (`rl.rewards.pool`).

    python -m bench.rewards [--samples 512] [--workers 1,2,4] [--reps 3]

Two slow correctness functions over the same N samples:
- `sleep_10ms`: a plugin that sleeps 10 ms a call (an external checker, a code-execution
  reward waiting on its subprocess): the pool's overhead and scaling without CPU contention;
- `math`: math-verify on realistic answers (fractions, roots, multiples of pi, decimals,
  polynomials, boxed or in $..$, half of them wrong): CPU-bound, so bounded by the cores.
Each is timed in the driver (`reward.num_workers: 0`, the old path) and on pools of W workers
(started and warmed before the clock; start time reported apart), in rounds: after a warm-up
batch, each of `--reps` batches of new samples is scored by every path in turn, and a path's
speedup is the median of its per-round ratios to the driver (the load of the moment is shared;
new samples, so that no sympy cache is warm for one path only).
`limit_s`: N x the per-call time / W (per call: 10 ms; for math, the in-driver time / N).
Target (issue 38/41): the pool at W workers at least 0.7 W times faster than the driver on
`sleep_10ms`. Every run must give the same rewards as the driver (checked).
`--smoke`: 16 samples, W = 1, 2, one repetition.
"""
from __future__ import annotations

import os
import random
import statistics
import time

PLUGIN = "bench.rewards:sleep_10ms"


def sleep_10ms(response: str, answer: str, meta: dict) -> float:
    time.sleep(0.01)
    return float(response.strip() == answer.strip())


def math_samples(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(response, reference answer) pairs as a math task's rollouts give them: the final answer
    boxed or in $..$ after some words, in another form than the reference, half of them right."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(1, 30), rng.randint(2, 31)
        forms = [  # (reference, an equal response form, a different one)
            (f"{a}/{b}", f"\\frac{{{2 * a}}}{{{2 * b}}}", f"\\frac{{{a + 1}}}{{{b}}}"),
            (f"{a}\\sqrt{{{b}}}", f"\\sqrt{{{a * a * b}}}", f"{a + 1}\\sqrt{{{b}}}"),
            (f"\\frac{{{a}\\pi}}{{{b}}}", f"\\frac{{{a}}}{{{b}}}\\pi", f"\\frac{{{a}}}{{{b + 1}}}\\pi"),
            (f"{a}.{b:02d}", f"{a * 100 + b}/100", f"{a}.{b + 1:02d}"),
            (f"x^2+{a}x+{b}", f"{b}+{a}x+x^2", f"x^2+{a}x+{b + 1}"),
        ]
        ref, right, wrong = forms[i % len(forms)]
        said = right if rng.random() < 0.5 else wrong
        wrapper = rng.choice([f"So the answer is $\\boxed{{{said}}}$.",
                              f"We get ${said}$", f"Therefore, the final answer is \\boxed{{{said}}}"])
        out.append((f"Working through the steps carefully. {wrapper}", ref))
    return out


def sleep_samples(n: int, seed: int = 0) -> list[tuple[str, str]]:
    return [(str((i + seed) % 7), "3") for i in range(n)]


def time_rounds(function: str, batches: list[list[tuple[str, str]]],
                worker_counts: list[int]) -> dict[int, dict]:
    """Per worker count (0 = in the driver): the seconds to score each batch, timed in rounds
    (one batch scored by every path in turn, so that they share the machine's load of the
    moment), the pool's start time and the rewards. The first batch warms up, untimed."""
    from rl.config import RewardConfig
    from rl.data.example import Example
    from rl.rewards import RewardComputer
    out, computers = {}, {}
    try:
        for w in [0, *worker_counts]:
            t0 = time.perf_counter()
            computers[w] = RewardComputer(RewardConfig(
                function=function, answer_after=None, num_workers=w, verify_timeout_s=60))
            if w:
                computers[w].pool.wait_ready()  # import and warm-up: once per run, off the clock
            out[w] = {"start_s": time.perf_counter() - t0 if w else None, "times": [],
                      "rewards": []}
        for k, batch in enumerate(batches):
            responses = [r for r, _ in batch]
            examples = [Example(prompt="p", answer=a) for _, a in batch]
            for w, computer in computers.items():
                t0 = time.perf_counter()
                parts = computer.score(responses, examples)
                if k:
                    out[w]["times"].append(time.perf_counter() - t0)
                    out[w]["rewards"].append(parts.total)
                assert computer.failures == 0, computer.errors
    finally:
        for computer in computers.values():
            computer.close()
    return out


def main() -> None:
    from bench.common import device_info, parse_args, write_results

    def extra(p):
        p.add_argument("--samples", type=int, default=512)
        p.add_argument("--workers", default="1,2,4")
        p.add_argument("--reps", type=int, default=3)
    args = parse_args(__doc__.splitlines()[0], extra)
    n = 16 if args.smoke else args.samples
    worker_counts = [1, 2] if args.smoke else [int(w) for w in args.workers.split(",")]
    reps = 1 if args.smoke else args.reps
    rows = []
    for name, function, make in [("sleep_10ms", PLUGIN, sleep_samples),
                                 ("math", "math", math_samples)]:
        if name == "math":  # the driver path imports math-verify on its first call: not timed
            from rl.rewards.verifiers import math_equal
            math_equal("$\\frac{1}{2}$", "0.5")
            math_equal("$x^2+1$", "1+x^2")
        got = time_rounds(function, [make(n, seed) for seed in range(reps + 1)], worker_counts)
        base = got[0]
        driver_s = statistics.median(base["times"])
        per_call = 0.01 if name == "sleep_10ms" else driver_s / n
        for w, r in got.items():
            assert r["rewards"] == base["rewards"], f"{name}: rewards differ with {w} workers"
            ratios = [b / t for b, t in zip(base["times"], r["times"])]
            speedup = statistics.median(ratios)
            target = 0.7 * w if name == "sleep_10ms" and w else None
            seconds = statistics.median(r["times"])
            rows.append({"function": name, "where": "pool" if w else "driver", "workers": w,
                         "samples": n, "seconds": seconds, "start_s": r["start_s"],
                         "ms_per_sample": seconds / n * 1e3, "speedup": speedup,
                         "speedup_range": f"{min(ratios):.2f}-{max(ratios):.2f}",
                         "limit_s": n * per_call / max(w, 1), "target_x": target,
                         "met": None if target is None else ("met" if speedup >= target
                                                             else "not met")})
            print(rows[-1], flush=True)
    cpus = len(os.sched_getaffinity(0))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    notes = [f"{n} samples a batch; {cpus} CPUs usable by this process (os.sched_getaffinity), "
             f"load average at the end {load}; after a warm-up batch, {reps} batch(es) of new "
             "samples, each scored by every path in turn (rounds); the rewards of every pool "
             "run equal the driver's",
             "seconds: median time of one RewardComputer.score of a batch; start_s: starting the "
             "pool and warming its workers (math-verify's import and first parse: once per run)",
             "speedup: median over the rounds of driver seconds / this path's (its range beside "
             "it); target_x: 0.7 x workers (sleep_10ms only)",
             "limit_s: samples x per-call time / workers (per call: 10 ms for sleep_10ms, the "
             "driver's median for math); math is CPU-bound, so past the CPU count it cannot "
             "scale"]
    write_results("rewards" + ("_smoke" if args.smoke else ""), args.out, device_info(), rows,
                  list(rows[0]), notes)


if __name__ == "__main__":
    main()
