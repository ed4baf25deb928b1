"""Reading a final answer out of a solution text, and comparing two answers.

Used for the gold answers of the data (so train and eval read them the same way) and for model
outputs. Markers are tried from the most explicit to the least: MetaMathQA's 'The answer is: X',
GSM8K's '#### X', LaTeX '\\boxed{X}', and finally the last number in the text. The eval's 'strict'
mode stops before that last guess (lm-evaluation-harness's strict-match reads only '#### X'; its
flexible-extract takes the last number), so a score says which it used.
"""

from __future__ import annotations

import math
import re

# Lazy up to the next marker or the line's end: the LAST marker of a text wins, on one line too.
ANSWER_IS = re.compile(r"the answer is\s*:?[ \t]*(.*?)(?=the answer is|$)", re.IGNORECASE | re.MULTILINE)
HASHES = re.compile(r"####[ \t]*(.*?)(?=####|$)", re.MULTILINE)
BOXED = "\\boxed{"
# A number as people write it: sign, thousands commas, decimals, a fraction, an optional leading '$'.
NUMBER = re.compile(r"-?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?|-?\.\d+")
# A number that ends at a space, the end, or punctuation that ends a clause ('6, which ...', '6.').
LEADING_NUMBER = re.compile(rf"^({NUMBER.pattern})(?=\s|$|[,;:!?)]|\.(?:\s|$))")
FRAC = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
TOLERANCE = 1e-6
EXTRACT_MODES = ("strict", "flexible")


def extract_answer(text: str, mode: str = "flexible") -> str | None:
    """The final answer of a solution text, as written (trimmed), or None when it has none.
    `mode` 'strict': only an answer after a marker; 'flexible': else the text's last number too."""
    if mode not in EXTRACT_MODES:
        raise ValueError(f"extract: expected one of {', '.join(EXTRACT_MODES)}, got {mode!r}")
    if not text:
        return None
    for pattern in (ANSWER_IS, HASHES):
        # The last marker with an answer after it: a trailing empty '####' does not hide an earlier one.
        for match in reversed(list(pattern.finditer(text))):
            answer = _clean_marked(match.group(1))
            if answer is not None:
                return answer
    boxed = _last_boxed(text)
    if boxed is not None:
        return _clean_marked(boxed)
    if mode == "strict":
        return None
    numbers = NUMBER.findall(text)
    return _clean_marked(numbers[-1]) if numbers else None


def _clean_marked(answer: str) -> str | None:
    """The answer after a marker: its line, without a final full stop or trailing words after a number."""
    answer = answer.strip().splitlines()[0].strip() if answer.strip() else ""
    answer = answer.rstrip(".").strip()
    if "=" in answer:  # '15 + 18 = 33', 'x = 5': the value is what the last '=' gives
        answer = answer.rsplit("=", 1)[1].strip().rstrip(".").strip()
    if normalize_number(answer) is None:
        # '8 apples' -> '8'; but keep '5\\sqrt{2}' or '(1, 2)' whole for the string comparison.
        lead = LEADING_NUMBER.match(answer)
        if lead:
            answer = lead.group(1)
    return answer or None


def _last_boxed(text: str) -> str | None:
    start = text.rfind(BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: the output was cut off


def normalize_number(s: str | None) -> float | None:
    """The numeric value of an answer string ('$1,234.50', '-3', '1/2', '\\frac{1}{2}', '7.'), or None."""
    if s is None:
        return None
    t = s.strip().replace("\\$", "").replace("$", "").replace(" ", "").replace("\\!", "").replace("{,}", ",")
    t = t.rstrip(".")
    if t.endswith("%"):
        t = t[:-1]
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d*)?", t):
        t = t.replace(",", "")  # only real thousands separators: '1,2' is a tuple, not twelve
    frac = FRAC.match(t)
    if frac:
        t = f"{frac.group(1)}{frac.group(2)}/{frac.group(3)}"
    if t.count("/") == 1:
        num, den = t.split("/")
        a, b = _to_float(num), _to_float(den)
        if a is None or b is None or b == 0:
            return None
        return a / b
    return _to_float(t)


def _to_float(t: str) -> float | None:
    if not re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", t):
        return None  # rejects 'nan', 'inf' and words that float() would accept
    value = float(t)
    return value if math.isfinite(value) else None


def normalize_text(s: str) -> str:
    """A string answer stripped of formatting that does not change it (spaces, '$', \\text{}, case)."""
    t = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    t = t.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("dfrac", "frac")
    t = t.replace("tfrac", "frac").replace("\\$", "").replace("$", "")
    return re.sub(r"\s+", "", t).rstrip(".").lower()


def answers_match(pred: str | None, gold: str | None) -> bool:
    """Numerically equal (within 1e-6, relative for large values) when both parse, else equal as text."""
    if pred is None or gold is None:
        return False
    p, g = normalize_number(pred), normalize_number(gold)
    if p is not None and g is not None:
        return abs(p - g) <= TOLERANCE * max(1.0, abs(g))
    return normalize_text(pred) == normalize_text(gold)
