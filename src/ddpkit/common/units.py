"""Sizes as a person reads them: the largest binary unit that keeps the number at or above 1,
three significant figures at most, no trailing zeros ('4 TiB', '1.54 GiB', '474 MiB', '12 KiB',
'300 bytes'). Every size ddpkit prints goes through `size`."""

from __future__ import annotations

UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def size(n: float | None) -> str:
    """'4 TiB' for 4 * 2**40; '?' when unknown; negative sizes keep their sign."""
    if n is None:
        return "?"
    sign, value = ("-" if n < 0 else ""), abs(float(n))
    unit = 0
    while value >= 1023.5 and unit < len(UNITS) - 1:  # 1023.9 MiB reads as 1 GiB, not 1024 MiB
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{sign}{value:.0f} bytes"
    # three significant figures, then drop the zeros a person does not read ('4.00' -> '4')
    digits = 2 if value < 10 else 1 if value < 100 else 0
    text = f"{value:.{digits}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return f"{sign}{text} {UNITS[unit]}"
