"""Answer extraction on outputs real models write (issue #21): the marker's number, not its sentence."""

from __future__ import annotations

import pytest

from megatrain_cli.data.answers import extract_answer


@pytest.mark.parametrize("text,answer", [
    ("The answer is 6, which is the number of apples.", "6"),  # a number needs no trailing space
    ("The answer is 6; she keeps the rest.", "6"),
    ("So the answer is 12. Checking: 3 * 4 = 12.", "12"),
    ("The answer is 5. Wait, that is wrong: the answer is 7.", "7"),  # the last marker on a line wins
    ("The answer is: 5\nOn reflection, the answer is: 8", "8"),
    ("#### 15 + 18 = 33\n####", "33"),  # a trailing empty "####" hides nothing; the value after "="
    ("Total: 40.\n#### 40\n#### ", "40"),
    ("The answer is: $1,234.50.", "$1,234.50"),
    ("The answer is 3/4.", "3/4"),
    ("The answer is: (1, 2)", "(1, 2)"),  # not a number: kept whole for the string comparison
    ("He had 3 apples and ate 1, so 2 are left.", "2"),
])
def test_extraction_on_model_outputs(text, answer):
    assert extract_answer(text) == answer
