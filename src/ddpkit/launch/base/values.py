"""Parsers of `ddpkit run`'s option values: each returns the checked value or raises a
ConfigError naming the flag, the value and the fix."""

from __future__ import annotations

import math
import os
import re
from typing import Any

from ddpkit.common import protocol
from ddpkit.errors import ConfigError

RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def endpoint(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--rdzv {text!r} is not HOST:PORT", fix="e.g. --rdzv node0:29400")
    return text


RDZV_SETTINGS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "read_timeout",
    "timeout",
    "is_host",
)


def rdzv_conf(text: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not part.strip():
            continue
        if not sep or key not in RDZV_SETTINGS or not value.strip():
            raise ConfigError(
                f"--rdzv-conf {text!r}: {part.strip()!r} is not KEY=VALUE with a known key",
                fix=f"keys: {', '.join(RDZV_SETTINGS)}; e.g. --rdzv-conf last_call_timeout=5",
            )
        pairs.append((key, value.strip()))
    return tuple(pairs)


def stdin(text: str) -> str:
    word = str(text).strip().lower()
    if word in ("auto", "none") or (word.isdigit() and len(word) < 7):
        return word
    raise ConfigError(
        f"--stdin {text!r} is not a rank, none or auto", fix="e.g. --stdin 0, or --stdin none"
    )


def ranks(text: str, world: int) -> frozenset[int]:
    try:
        ranks = frozenset(int(r) for r in text.split(",") if r.strip())
    except ValueError:
        ranks = frozenset({-1})
    if not ranks or min(ranks) < 0 or max(ranks) >= world:
        raise ConfigError(
            f"--ranks {text!r} is not a list of ranks of this job (0 to {world - 1})",
            fix="e.g. --ranks 0 or --ranks 0,1",
        )
    return ranks


def run_id(text: str) -> str:
    if not RUN_ID.fullmatch(text) or ".." in text:
        raise ConfigError(
            f"--run-id {text[:80]!r} is not a job id: letters, digits, '.', '_' and '-', "
            "at most 64, starting with a letter or digit",
            fix="e.g. --run-id exp42-lr3e-4",
        )
    return text


def step_range(text: str) -> tuple[int, int]:
    """'20-25' (or '20', one step) as (20, 25): steps numbered from 1, at most
    protocol.MOST_PROFILE_STEPS of them."""
    first, _, last = str(text).strip().partition("-")
    try:
        a, b = int(first), int(last or first)
    except ValueError:
        raise ConfigError(
            f"--profile-steps {text!r} is not a range of steps", fix="e.g. --profile-steps 20-25"
        ) from None
    most = protocol.MOST_PROFILE_STEPS
    if not 1 <= a <= b or b - a >= most:
        raise ConfigError(
            f"--profile-steps {text!r}: steps are numbered from 1, first to last, at most {most}",
            fix="e.g. --profile-steps 20-25",
        )
    return a, b


def number(
    value: object,
    flag: str,
    kind: type,
    minimum: float,
    allowed: str = "",
    maximum: float | None = None,
) -> Any:
    """A finite number of `kind` in [minimum, maximum], or a ConfigError naming the flag."""
    try:
        number = kind(str(value).strip()) if kind is float else kind(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(
            f"{flag} {value!r} is not {allowed or 'a number'}",
            fix=f"see `ddpkit run --help` for {flag}",
        ) from None
    if kind is float and not math.isfinite(number):
        raise ConfigError(
            f"{flag} {value!r} is not a finite number of seconds",
            fix=f"give {flag} a number of seconds" + (" (0: off)" if "hang" in flag else ""),
        )
    if number < minimum:
        raise ConfigError(
            f"{flag} {value!r} must be at least {minimum:g}",
            fix=f"see `ddpkit run --help` for {flag}",
        )
    if maximum is not None and number > maximum:
        raise ConfigError(
            f"{flag} {value!r} is more than {maximum:g}",
            fix=f"use a value up to {maximum:g}",
        )
    return number


def cores() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1
