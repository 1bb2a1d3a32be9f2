"""Writes the small test datasets beside this file: `python tests/data/make_datasets.py`.

- `gsm8k_{train,eval}.jsonl`: `question` (a word problem) / `answer` (worked steps, then
  `#### N`), the GSM8K layout.
- `math_{train,eval}.jsonl`: `problem` / `solution` (worked steps ending in `\\boxed{...}`), the
  MATH (Hendrycks) layout.

Every problem is written from templates with seeded numbers (ASCII only, so the char tokenizer
of the tiny presets reads every character). About a third of the prompts carry a story
preamble, so prompt lengths spread over ~60-300 characters (= tokens for the char tokenizer):
long enough to exceed vLLM's batched-token budget in one rollout batch. The answers are correct;
the problems are not meant to be learnable by a tiny model in a few steps.
"""
from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 11
SIZES = {"train": 60, "eval": 16}

NAMES = ["Ada", "Ben", "Carla", "Dev", "Elif", "Farid", "Gwen", "Hugo", "Ines", "Jonas"]
PREAMBLES = [
    "The school fair opens on Saturday morning, and every class has a stall to run. The "
    "students spent the whole week planning what to sell and how to keep track of the money. ",
    "It rained all weekend, so the family stayed inside and decided to sort out the storage "
    "room. Everyone had a job, and they wrote the counts on a sheet of paper as they went. ",
    "A small bakery on the corner of the market square bakes fresh goods every morning before "
    "sunrise. The owner keeps careful notes so that nothing is wasted at the end of the day. ",
    "During the summer camp the leaders organise a treasure hunt across the forest. Each team "
    "collects tokens at the checkpoints and the totals are compared in the evening. ",
]


def _story(rng: random.Random, text: str) -> str:
    return (rng.choice(PREAMBLES) + text) if rng.random() < 0.35 else text


# ---- GSM8K style ---------------------------------------------------------------------------
def gsm8k_problem(rng: random.Random) -> tuple[str, str]:
    name, other = rng.sample(NAMES, 2)
    kind = rng.randrange(6)
    if kind == 0:
        a, b, c = rng.randint(12, 60), rng.randint(2, 9), rng.randint(3, 30)
        q = (f"{name} has {a} marbles. {name} buys {b} bags with {c} marbles each. "
             f"How many marbles does {name} have now?")
        steps = [f"The bags hold {b} * {c} = {b * c} marbles.",
                 f"{name} has {a} + {b * c} = {a + b * c} marbles."]
        ans = a + b * c
    elif kind == 1:
        price, n = rng.randint(2, 9), rng.randint(3, 12)
        paid = (price * n // 10 + 1) * 10  # the next round ten above the cost
        q = (f"{name} buys {n} notebooks at ${price} each and pays with ${paid}. "
             "How much change does the shop give back?")
        steps = [f"The notebooks cost {n} * {price} = ${n * price}.",
                 f"The change is {paid} - {n * price} = ${paid - n * price}."]
        ans = paid - n * price
    elif kind == 2:
        per_day, days, eaten = rng.randint(3, 12), rng.randint(4, 14), rng.randint(1, 20)
        q = (f"A hen lays {per_day} eggs a day. After {days} days {other} has eaten {eaten} of "
             "them. How many eggs are left?")
        steps = [f"The hen lays {per_day} * {days} = {per_day * days} eggs.",
                 f"{per_day * days} - {eaten} = {per_day * days - eaten} eggs are left."]
        ans = per_day * days - eaten
    elif kind == 3:
        total, share = rng.randint(4, 20) * 6, rng.choice([2, 3, 6])
        part = {2: "half", 3: "a third", 6: "a sixth"}[share]
        q = (f"{name} and {other} collect {total} shells together. {name} keeps {part} of them "
             f"and gives the rest to {other}. How many shells does {other} get?")
        kept = total // share
        steps = [f"{name} keeps {total} / {share} = {kept} shells.",
                 f"{other} gets {total} - {kept} = {total - kept} shells."]
        ans = total - kept
    elif kind == 4:
        speed, hours, extra = rng.randint(30, 80), rng.randint(2, 6), rng.randint(5, 40)
        q = (f"A train travels at {speed} km per hour for {hours} hours, then another {extra} km "
             "to reach the station. How far does it travel in all?")
        steps = [f"In {hours} hours it covers {speed} * {hours} = {speed * hours} km.",
                 f"In all: {speed * hours} + {extra} = {speed * hours + extra} km."]
        ans = speed * hours + extra
    else:
        rows, seats, empty = rng.randint(5, 25), rng.randint(8, 20), rng.randint(3, 40)
        q = (f"A hall has {rows} rows of {seats} seats. At the concert {empty} seats stay empty. "
             "How many people sit in the hall?")
        steps = [f"The hall has {rows} * {seats} = {rows * seats} seats.",
                 f"{rows * seats} - {empty} = {rows * seats - empty} people sit in the hall."]
        ans = rows * seats - empty
    return _story(rng, q), "\n".join(steps) + f"\n#### {ans}"


# ---- MATH style ----------------------------------------------------------------------------
def _frac(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"\\frac{{{x.numerator}}}{{{x.denominator}}}"


def math_problem(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(6)
    if kind == 0:
        a, x, b = rng.randint(2, 9), rng.randint(-9, 12), rng.randint(-20, 20)
        c = a * x + b
        p = f"Solve for $x$: ${a}x + {b} = {c}$." if b >= 0 else f"Solve for $x$: ${a}x - {-b} = {c}$."
        s = f"Subtract {b} from both sides: ${a}x = {c - b}$. Divide by {a}: $x = \\boxed{{{x}}}$."
    elif kind == 1:
        n, d = rng.randint(2, 40), rng.randint(2, 40)
        f = Fraction(n, d)
        p = f"Simplify $\\frac{{{n}}}{{{d}}}$."
        s = (f"The greatest common divisor of {n} and {d} is {n // f.numerator}, so "
             f"$\\frac{{{n}}}{{{d}}} = \\boxed{{{_frac(f)}}}$.")
    elif kind == 2:
        n = rng.randint(5, 40)
        p = f"What is the sum of the first ${n}$ positive integers?"
        s = f"The sum is $\\frac{{{n}({n}+1)}}{{2}} = \\boxed{{{n * (n + 1) // 2}}}$."
    elif kind == 3:
        a, b = Fraction(rng.randint(1, 9), rng.randint(2, 9)), Fraction(rng.randint(1, 9), rng.randint(2, 9))
        p = f"Compute ${_frac(a)} + {_frac(b)}$. Express your answer as a common fraction."
        s = f"With a common denominator, ${_frac(a)} + {_frac(b)} = \\boxed{{{_frac(a + b)}}}$."
    elif kind == 4:
        w, h = rng.randint(3, 30), rng.randint(3, 30)
        p = (f"A rectangle has width ${w}$ and height ${h}$. What is the length of its perimeter "
             "plus its area?")
        s = (f"The perimeter is $2({w} + {h}) = {2 * (w + h)}$ and the area is ${w * h}$, so the "
             f"answer is ${2 * (w + h)} + {w * h} = \\boxed{{{2 * (w + h) + w * h}}}$.")
    else:
        base, exp = rng.randint(2, 5), rng.randint(2, 6)
        m = rng.choice([7, 9, 10, 11])
        p = f"What is the remainder when ${base}^{{{exp}}}$ is divided by ${m}$?"
        s = f"${base}^{{{exp}}} = {base ** exp}$ and ${base ** exp} = {m} \\cdot {base ** exp // m} + {base ** exp % m}$, so the remainder is $\\boxed{{{base ** exp % m}}}$."
    return _story(rng, p), s


def build(kind: str) -> dict[str, list[dict]]:
    """Rows per split, a pure function of the constants above; no problem is in both splits."""
    rng = random.Random(f"{SEED}-{kind}")
    make, (pk, ak) = ((gsm8k_problem, ("question", "answer")) if kind == "gsm8k"
                      else (math_problem, ("problem", "solution")))
    rows, seen = [], set()
    while len(rows) < sum(SIZES.values()):
        prompt, answer = make(rng)
        if prompt not in seen:
            seen.add(prompt)
            rows.append({pk: prompt, ak: answer})
    return {"train": rows[:SIZES["train"]], "eval": rows[SIZES["train"]:]}


def write_all(out_dir: Path = HERE) -> list[Path]:
    paths = []
    for kind in ("gsm8k", "math"):
        for split, rows in build(kind).items():
            path = out_dir / f"{kind}_{split}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            paths.append(path)
    return paths


if __name__ == "__main__":
    for p in write_all():
        print(p)
