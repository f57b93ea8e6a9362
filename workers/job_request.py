"""The job request: the one schema of the fields every front door takes (the web form, the JSON
API, the OpenAI-compatible API and the CLI), with their bounds, defaults, error messages and
names in OpenAI's API, and the check of a request against it, every problem reported at once,
keyed by field name.

Temperature 0 means greedy; a negative temperature is refused rather than silently treated as
greedy. A missing or blank seed means random (drawn when the job is stored).
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from specpipe.core.sampling import MAX_SEED, MAX_SEED_TEXT, SAMPLERS
from specpipe.core.stopping import check_stop_strings
from specpipe.settings import JOB_DEFAULTS, JobLimits

MAX_TEMP = 100.0
MAX_TOP_K = 2**31 - 1
_INTEGER_TEXT = re.compile(r"[+-]?\d{1,30}")
# JSON Schema patterns (ECMA): no NUL anywhere, and the white space Python's str.strip removes
# that an ECMA pattern's \s does not cover.
_NO_NUL = "[^\\u0000]"
_PY_SPACE = "\\u001c-\\u001f\\u0085"


class JobRequestError(ValueError):
    """A job request with bad fields; `errors` maps field name to a readable reason."""

    def __init__(self, errors: dict[str, str]):
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
        self.errors = errors


@dataclass(frozen=True)
class Number:
    """A whole or real number from `low` to `high`, or to the `JobLimits` field named `limit`;
    `reason` tells a value outside them so, with `{high}` filled in."""

    whole: bool
    low: float
    reason: str
    high: float | None = None
    limit: str | None = None
    above_low: bool = False  # `low` itself is refused
    nullable: bool = False  # null, or a blank form field, means none

    def top(self, limits: JobLimits) -> float:
        """The highest value allowed under `limits`."""
        return getattr(limits, self.limit) if self.limit else self.high

    def clean(self, value: object, limits: JobLimits, from_text: bool) -> float | None:
        """The number `value` holds, or ValueError saying what is wrong with it."""
        if self.nullable and (value is None or (from_text and _blank(value))):
            return None
        number = _integer(value, from_text) if self.whole else _number(value, from_text)
        high = self.top(limits)
        above = self.low < number if self.above_low else self.low <= number
        if not (above and number <= high):
            raise ValueError(self.reason.format(high=high))
        return number

    def json_schema(self, limits: JobLimits) -> dict:
        """The field in JSON Schema (OpenAPI 3.0)."""
        schema: dict = {"type": "integer" if self.whole else "number"}
        if self.above_low:
            schema["exclusiveMinimum"] = True
        schema.update(minimum=self.low, maximum=self.top(limits))
        if self.nullable:
            schema["nullable"] = True
        return schema


@dataclass(frozen=True)
class Prompt:
    """The prompt: text with something besides white space, within `max_prompt_chars`."""

    def clean(self, value: object, limits: JobLimits, from_text: bool) -> str:
        """The prompt, or ValueError saying what is wrong with it."""
        return check_prompt(value, limits.max_prompt_chars)

    def json_schema(self, limits: JobLimits) -> dict:
        """The field in JSON Schema (OpenAPI 3.0)."""
        return {
            "type": "string",
            "minLength": 1,
            "maxLength": limits.max_prompt_chars,
            "pattern": f"^{_NO_NUL}*[^\\s\\u0000{_PY_SPACE}]{_NO_NUL}*$",
        }


@dataclass(frozen=True)
class StopStrings:
    """Stop strings: JSON gives a list, one string or null; the form one string a line."""

    def clean(self, value: object, limits: JobLimits, from_text: bool) -> list[str]:
        """The stop strings, or ValueError saying what is wrong with them."""
        return _stop_strings(value, from_text)

    def json_schema(self, limits: JobLimits) -> dict:
        """The field in JSON Schema (OpenAPI 3.0)."""
        one = {
            "type": "string",
            "minLength": 1,
            "maxLength": limits.max_stop_chars,
            "pattern": f"^{_NO_NUL}+$",
        }
        many = {"type": "array", "items": one, "maxItems": limits.max_stop_strings}
        return {"nullable": True, "oneOf": [one, many]}


@dataclass(frozen=True)
class Choice:
    """One of `options`; a blank form field is `default`."""

    options: tuple[str, ...]
    default: str

    def clean(self, value: object, limits: JobLimits, from_text: bool) -> str:
        """The option chosen, or ValueError listing them."""
        if from_text and value == "":
            return self.default
        if not isinstance(value, str) or value not in self.options:
            raise ValueError(f"must be one of {', '.join(self.options)}")
        return value

    def json_schema(self, limits: JobLimits) -> dict:
        """The field in JSON Schema (OpenAPI 3.0)."""
        return {"type": "string", "enum": list(self.options)}


@dataclass(frozen=True)
class JobField:
    """One field of a job request: its rule, and where OpenAI's API differs, its name there and
    the default OpenAI documents for it."""

    name: str
    rule: Number | Prompt | StopStrings | Choice
    openai_name: str | None = None
    # OpenAI documents temperature 1 and top_p 1: a client that leaves them out samples here as
    # it would anywhere else. Fields without one take the job default there too.
    openai_default: object = None

    @property
    def required(self) -> bool:
        """Whether a request must give it: it has no job default."""
        return self.name not in JOB_DEFAULTS

    @property
    def openai_param(self) -> str:
        """The name OpenAI's API gives it."""
        return self.openai_name or self.name


JOB_FIELDS = (
    JobField("prompt", Prompt()),
    JobField(
        "max_new_tokens",
        Number(whole=True, low=1, limit="max_new_tokens", reason="must be between 1 and {high}"),
        openai_name="max_tokens",
    ),
    JobField(
        "temp",
        Number(whole=False, low=0, high=MAX_TEMP, reason="must be between 0 (greedy) and {high:g}"),
        openai_name="temperature",
        openai_default=1.0,
    ),
    JobField(
        "top_p",
        Number(whole=False, low=0, above_low=True, high=1, reason="must be above 0 and at most 1"),
        openai_default=1.0,
    ),
    JobField(
        "top_k",
        Number(
            whole=True, low=0, high=MAX_TOP_K, reason="must be 0 (off) or a positive whole number"
        ),
    ),
    JobField(
        "seed",
        Number(
            whole=True,
            low=0,
            high=MAX_SEED,
            nullable=True,
            reason=f"must be between 0 and {MAX_SEED_TEXT}",
        ),
    ),
    JobField(
        "draft_k",
        Number(
            whole=True,
            low=0,
            limit="max_draft_k",
            reason="must be between 0 (no speculation) and {high}",
        ),
    ),
    JobField("stop", StopStrings()),
    JobField("sampler", Choice(SAMPLERS, default=JOB_DEFAULTS["sampler"])),
)
FIELDS = tuple(field.name for field in JOB_FIELDS)
FIELD_BY_NAME = {field.name: field for field in JOB_FIELDS}


class Bounds(NamedTuple):
    """The lowest and highest value of a number field."""

    low: float
    high: float


def number_bounds(limits: JobLimits) -> dict[str, Bounds]:
    """Each number field's bounds under `limits`, by field name (the form's min and max)."""
    return {
        field.name: Bounds(field.rule.low, field.rule.top(limits))
        for field in JOB_FIELDS
        if isinstance(field.rule, Number)
    }


def parse_job_request(raw: Mapping[str, object], limits: JobLimits, from_text: bool) -> dict:
    """Check `raw` and return clean values; raises JobRequestError listing every bad field.

    `from_text` accepts form strings for the numbers and stop strings one per line; a blank or
    missing seed means random.
    """
    errors: dict[str, str] = {}
    clean: dict[str, object] = {}
    for field in JOB_FIELDS:
        if field.name not in raw:
            if field.required:
                errors[field.name] = "is required"
            else:
                clean[field.name] = copy.copy(JOB_DEFAULTS[field.name])
            continue
        try:
            clean[field.name] = field.rule.clean(raw[field.name], limits, from_text)
        except ValueError as exc:
            errors[field.name] = str(exc)
    if errors:
        raise JobRequestError(errors)
    return clean


def json_schema(limits: JobLimits) -> dict:
    """A job request in JSON Schema (OpenAPI 3.0): the JSON API's request body."""
    return {
        "type": "object",
        "required": [field.name for field in JOB_FIELDS if field.required],
        "additionalProperties": False,
        "properties": {field.name: field.rule.json_schema(limits) for field in JOB_FIELDS},
    }


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


def _blank(value: object) -> bool:
    return isinstance(value, str) and not value.strip()


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
