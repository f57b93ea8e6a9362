"""The job request: the fields every front door takes (the web form, the JSON API, the
OpenAI-compatible API and the CLI), their bounds and defaults, and the check of a request
against them, every problem reported at once, keyed by field name.

Temperature 0 means greedy; a negative temperature is refused rather than silently treated as
greedy. A missing or blank seed means random (drawn when the job is stored).
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping

from specpipe.core.sampling import MAX_SEED, MAX_SEED_TEXT, SAMPLERS
from specpipe.core.stopping import check_stop_strings
from specpipe.settings import JOB_DEFAULTS, JobLimits

FIELDS = (
    "prompt",
    "max_new_tokens",
    "temp",
    "top_p",
    "top_k",
    "seed",
    "draft_k",
    "stop",
    "sampler",
)
MAX_TEMP = 100.0
MAX_TOP_K = 2**31 - 1
_INTEGER_TEXT = re.compile(r"[+-]?\d{1,30}")


class JobRequestError(ValueError):
    """A job request with bad fields; `errors` maps field name to a readable reason."""

    def __init__(self, errors: dict[str, str]):
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
        self.errors = errors


def parse_job_request(raw: Mapping[str, object], limits: JobLimits, from_text: bool) -> dict:
    """Check `raw` and return clean values; raises JobRequestError listing every bad field.

    `from_text` accepts form strings for the numbers and stop strings one per line; a blank or
    missing seed means random.
    """
    errors: dict[str, str] = {}
    clean: dict[str, object] = {}
    max_tokens, max_k = limits.max_new_tokens, limits.max_draft_k
    checks = {
        "prompt": lambda v: check_prompt(v, limits.max_prompt_chars),
        "max_new_tokens": lambda v: _in_range(
            _integer(v, from_text), 1, max_tokens, f"must be between 1 and {max_tokens}"
        ),
        "temp": lambda v: _in_range(
            _number(v, from_text), 0.0, MAX_TEMP, f"must be between 0 (greedy) and {MAX_TEMP:g}"
        ),
        "top_p": lambda v: _top_p(_number(v, from_text)),
        "top_k": lambda v: _in_range(
            _integer(v, from_text), 0, MAX_TOP_K, "must be 0 (off) or a positive whole number"
        ),
        "seed": lambda v: _seed(v, from_text),
        "draft_k": lambda v: _in_range(
            _integer(v, from_text), 0, max_k, f"must be between 0 (no speculation) and {max_k}"
        ),
        "stop": lambda v: _stop_strings(v, from_text),
        "sampler": lambda v: _sampler(v, from_text),
    }
    for name, check in checks.items():
        if name not in raw:
            if name == "prompt":
                errors[name] = "is required"
            else:
                clean[name] = copy.copy(JOB_DEFAULTS[name])
            continue
        try:
            clean[name] = check(raw[name])
        except ValueError as exc:
            errors[name] = str(exc)
    if errors:
        raise JobRequestError(errors)
    return clean


def _sampler(value: object, from_text: bool) -> str:
    if from_text and value == "":  # the form's default
        return JOB_DEFAULTS["sampler"]
    if not isinstance(value, str) or value not in SAMPLERS:
        raise ValueError(f"must be one of {', '.join(SAMPLERS)}")
    return value


def check_prompt(value: object, max_chars: int) -> str:
    """The prompt, or ValueError saying what is wrong with it."""
    if not isinstance(value, str):
        raise ValueError("must be text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("is not valid UTF-8") from None
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    if not value.strip():
        raise ValueError("is empty")
    if len(value) > max_chars:
        raise ValueError(f"is longer than {max_chars} characters")
    return value


def _filled(text: str) -> str:
    """A form field's text without surrounding blanks; a blank field is missing."""
    if not text.strip():
        raise ValueError("is required")
    return text.strip()


def _integer(value: object, from_text: bool) -> int:
    if from_text and isinstance(value, str):
        text = _filled(value)
        if not _INTEGER_TEXT.fullmatch(text):
            raise ValueError("must be a whole number")
        return int(text)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("must be a whole number")
    return value


def _number(value: object, from_text: bool) -> float:
    if from_text and isinstance(value, str):
        text = _filled(value)
        try:
            number = float(text)
        except ValueError:
            raise ValueError("must be a number") from None
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be a number")
    else:
        number = float(value)
    if not math.isfinite(number):
        raise ValueError("must be a finite number")
    return number


def _in_range(value, low, high, what: str):
    if not low <= value <= high:
        raise ValueError(what)
    return value


def _top_p(value: float) -> float:
    if not 0.0 < value <= 1.0:
        raise ValueError("must be above 0 and at most 1")
    return value


def _seed(value: object, from_text: bool) -> int | None:
    if value is None or (from_text and isinstance(value, str) and not value.strip()):
        return None
    return _in_range(
        _integer(value, from_text), 0, MAX_SEED, f"must be between 0 and {MAX_SEED_TEXT}"
    )


def _stop_strings(value: object, from_text: bool) -> list[str]:
    """Form text holds one stop string per line (blank lines skipped); JSON holds a list of
    strings, one string, or null for none."""
    if value is None:
        return []
    if isinstance(value, str):
        if not from_text:
            return check_stop_strings([value])
        lines = value.replace("\r\n", "\n").split("\n")
        return check_stop_strings([line for line in lines if line.strip()])
    if from_text or not isinstance(value, list):
        raise ValueError("must be text or a list of text")
    return check_stop_strings(value)
