"""GSM8K and MATH (`\\boxed`) answer extraction."""
import pytest

from rl.data.answers import extract_answer, find_boxed, find_gsm8k


@pytest.mark.parametrize("text, expected", [
    ("Natalia sold 48 clips.\n#### 72", "72"),
    ("so she earns $1,234,567.\n#### 1,234,567", "1234567"),
    ("#### -3 ", "-3"),
    ("first #### 1\nthen #### 2", "2"),  # the last marker wins
])
def test_gsm8k_extraction(text, expected):
    assert extract_answer(text, "gsm8k") == expected


def test_gsm8k_without_marker_or_value_is_none():
    assert extract_answer("the answer is 72", "gsm8k") is None
    assert extract_answer("#### \n", "gsm8k") is None
    assert find_gsm8k("x\n#### 5\nmore") == ("5", 8)


@pytest.mark.parametrize("text, expected", [
    ("so $\\boxed{42}$.", "42"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}} and", "\\frac{\\sqrt{3}}{2}"),  # nested braces
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # escaped braces do not close the box
    ("\\boxed{1} then \\boxed{{2}}", "{2}"),  # the last box wins
    ("\\fbox{7}", "7"),
    ("\\boxed 5$", "5"),
])
def test_boxed_extraction(text, expected):
    assert extract_answer(text, "boxed") == expected


def test_unbalanced_final_box_is_none_and_span_end_is_reported():
    assert extract_answer("\\boxed{1} then \\boxed{\\frac{1}{2}", "boxed") is None
    assert extract_answer("no box here", "boxed") is None
    assert extract_answer("\\boxed{ }", "boxed") is None
    assert find_boxed("a \\boxed{x}$.") == ("x", 11)


def test_auto_and_raw():
    assert extract_answer("work\n#### 1,000", "auto") == "1000"
    assert extract_answer("so \\boxed{\\pi}", "auto") == "\\pi"
    assert extract_answer("  \\frac{1}{2} ", "auto") == "\\frac{1}{2}"
    assert extract_answer(" #### 5 ", "raw") == "#### 5"
    assert extract_answer("   ", "auto") is None
