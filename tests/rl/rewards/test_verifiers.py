"""Built-in rewards: math equivalence through math-verify, exact match, format."""
import threading

import pytest

from rl.rewards import exact_reward, format_reward, math_equal, math_reward


@pytest.mark.parametrize("response, answer", [
    ("0.5", "1/2"),
    ("1/2", "0.5"),
    ("$\\frac{1}{2}$", "0.5"),
    ("The answer is \\boxed{\\frac{1}{2}}.", "1/2"),
    ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("so $\\sqrt{2}$", "\\sqrt{2}"),  # a bare LaTeX reference is still understood
    ("x = \\boxed{1+x^2}", "x^2+1"),
    ("#### 1,000", "1000"),
])
def test_equivalent_math_forms_agree(response, answer):
    assert math_equal(response, answer)
    assert math_reward(response, answer, {}) == 1.0


@pytest.mark.parametrize("response, answer", [
    ("0.4", "1/2"), ("\\boxed{\\frac{1}{3}}", "0.5"), ("43", "42"), ("no answer", "7"),
    ("\\boxed{2}", "1/2"), ("-42", "42"),
])
def test_different_answers_disagree(response, answer):
    assert not math_equal(response, answer)


def test_integer_fast_path_matches_math_verify():
    for response, answer in [("42", "42"), ("-8", "-8"), ("042", "42"), ("41", "42")]:
        fast = math_equal(response, answer)
        slow = math_equal(f"$ {response} $", answer)  # not a bare integer: goes to math-verify
        assert fast == slow == (int(response) == int(answer))


def test_unparseable_reference_raises():
    with pytest.raises(ValueError, match="cannot parse the reference answer"):
        math_equal("1.5", "$$")  # math-verify finds nothing at all in an empty formula


def test_math_reward_works_off_the_main_thread():
    results = []
    thread = threading.Thread(
        target=lambda: results.append(math_reward("\\boxed{\\frac{1}{2}}", "0.5", {})))
    thread.start()
    thread.join(timeout=30)
    assert results == [1.0]


def test_exact_reward_normalises_whitespace_and_extracts():
    assert exact_reward(" 42\n", "42", {}) == 1.0
    assert exact_reward("x  +\n 1", "x + 1", {}) == 1.0
    assert exact_reward("so \\boxed{x + 1}.", "x + 1", {}) == 1.0
    assert exact_reward("steps\n#### 1,000", "1000", {}) == 1.0
    assert exact_reward("0.5", "1/2", {}) == 0.0
    assert exact_reward("", "1", {}) == 0.0


@pytest.mark.parametrize("response, form, expected", [
    ("42", "number", 1.0), (" -3\n", "number", 1.0), ("1/2", "number", 1.0),
    ("42 apples", "number", 0.0), ("4 2", "number", 0.0), ("", "number", 0.0),
    ("so $\\boxed{\\frac{1}{2}}$.", "boxed", 1.0), ("\\[\\boxed{7}\\]", "boxed", 1.0),
    ("\\boxed{7} and then more text", "boxed", 0.0), ("\\boxed{\\frac{1}{2}", "boxed", 0.0),
    ("\\boxed{}", "boxed", 0.0), ("42", "boxed", 0.0),
    ("work\n#### 42", "gsm8k", 1.0), ("#### 42\nextra", "gsm8k", 0.0), ("42", "gsm8k", 0.0),
    ("42", "auto", 1.0), ("\\boxed{4}", "auto", 1.0), ("#### 4", "auto", 1.0),
    ("four", "auto", 0.0),
])
def test_format_reward(response, form, expected):
    assert format_reward(response, form) == expected
