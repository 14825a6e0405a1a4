"""Which lines does the operator want to see? The level threshold and the hidden component groups
(`LogFilter`, `hidden_by`), the threshold `l` steps to next, and the search (`compile_search`:
a substring, or a regular expression after `re:`).

Ambiguity resolves toward showing a line: a level this view does not know (not one of
`LEVELS`) passes every level threshold, and components are listed by what is hidden, so one
first seen after the filter was set is shown until someone hides it. A surprise line costs a
glance; a hidden one can cost an incident.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "LEVELS",
    "LEVEL_RANK",
    "LEVEL_THRESHOLDS",
    "LogFilter",
    "SHOW_ALL",
    "Search",
    "SearchError",
    "compile_search",
    "hidden_by",
    "next_level",
]

LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error", "critical")
"""Known levels, lowest first: the names Python's logging gives, which the hub passes on."""
LEVEL_RANK = {level: rank for rank, level in enumerate(LEVELS)}
# `l` steps through these; "critical" is left out because a threshold that shows only the
# lines nobody could miss anyway is not worth a key press.
LEVEL_THRESHOLDS: tuple[str, ...] = ("debug", "info", "warning", "error")


_REGEX_PREFIX = "re:"


@dataclass(frozen=True, slots=True)
class LogFilter:
    """Which lines the view shows. Components are listed by what is hidden, not what is
    shown, so a component that appears later is visible without anyone opting in."""

    min_level: str = "debug"
    hidden_components: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.min_level not in LEVEL_RANK:
            raise ValueError(f"unknown log level {self.min_level!r}; use one of {', '.join(LEVELS)}")


SHOW_ALL = LogFilter()
"""The filter a new buffer starts with: every level, every component."""


class SearchError(ValueError):
    """The search text is not a valid regular expression; the message says where."""


@dataclass(frozen=True, slots=True)
class Search:
    query: str
    """As typed, for the status line."""
    pattern: re.Pattern[str]


def hidden_by(level: str, group: str, log_filter: LogFilter) -> Literal["component", "level"] | None:
    """Why `log_filter` hides a line of this level and component group, or None when it shows
    it. A line both filters hide counts under "component", the coarser switch, so each hidden
    line is counted exactly once."""
    if group in log_filter.hidden_components:
        return "component"
    rank = LEVEL_RANK.get(level)
    if rank is not None and rank < LEVEL_RANK[log_filter.min_level]:
        return "level"
    return None


def next_level(level: str) -> str:
    """The threshold after `level` in `LEVEL_THRESHOLDS`, wrapping from the last to the first."""
    if level not in LEVEL_THRESHOLDS:
        return LEVEL_THRESHOLDS[0]
    return LEVEL_THRESHOLDS[(LEVEL_THRESHOLDS.index(level) + 1) % len(LEVEL_THRESHOLDS)]


def compile_search(query: str) -> Search | None:
    """A search for `query`, case-insensitive: a plain substring, or a regular expression when
    it starts with `re:`. None for an empty query (no search).

    Raises:
        SearchError: the regular expression does not compile; the message quotes the error.
    """
    if not query:
        return None
    if query.startswith(_REGEX_PREFIX):
        try:
            pattern = re.compile(query[len(_REGEX_PREFIX) :], re.IGNORECASE)
        except re.error as err:
            raise SearchError(
                f"{query!r} is not a valid regular expression ({err}); fix it, or drop the re: prefix to search for the text"
            ) from None
    else:
        pattern = re.compile(re.escape(query), re.IGNORECASE)
    return Search(query, pattern)
