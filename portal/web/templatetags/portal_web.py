"""Template filters for figures people read: ages, durations, counts, rates."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from django import template
from django.utils import timezone

register = template.Library()


def _compact(seconds: float, *, tenths: bool = True) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s" if tenths and seconds < 10 else f"{seconds:.0f} s"
    if seconds < 3600:
        minutes, rest = divmod(int(seconds), 60)
        return f"{minutes} min {rest} s" if minutes < 10 and rest else f"{minutes} min"
    if seconds < 86400:
        hours, rest = divmod(int(seconds) // 60, 60)
        return f"{hours} h {rest} min" if rest else f"{hours} h"
    return f"{int(seconds // 86400)} d"


@register.filter
def duration(seconds: float | None) -> str:
    """1.2 s, 4 min 3 s, 2 h 5 min, 3 d."""
    if seconds is None:
        return "—"
    return _compact(max(0.0, float(seconds)))


@register.filter
def age(moment: dt.datetime | float | None) -> str:
    """How long ago (a moment, or seconds already counted), compactly: 12 s, 3 min, 2 h."""
    if moment is None:
        return "—"
    seconds = (timezone.now() - moment).total_seconds() if isinstance(moment, dt.datetime) else moment
    return _compact(max(0.0, seconds), tenths=False)


@register.filter
def thousands(value: float | None) -> str:
    """1,234,567; a dash for none."""
    if value is None:
        return "—"
    return f"{value:,.0f}"


@register.filter
def rate(value: float | None) -> str:
    """Records per second, with a decimal below 100."""
    if value is None:
        return "—"
    return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


@register.filter
def status_label(status: str) -> str:
    """partially_succeeded → partially succeeded."""
    return status.replace("_", " ")


@register.filter
def as_json(value: Any) -> str:
    """A value as compact JSON (what people type in the params field), not Python's repr."""
    return json.dumps(value, separators=(", ", ": "))
