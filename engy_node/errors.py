"""Errors a user can cause, each carrying a title and a message that names the fix.

`cli.py` turns an `EngyError` into one line on stderr and an exit code; nothing else in the
node prints tracebacks for them. Each area subclasses it so callers can tell a bad config file
from a missing model without parsing strings.
"""

import contextlib
from collections.abc import Iterator


class EngyError(Exception):
    """A problem the user can fix; `str(err)` says what to change."""

    title = "error"
    exit_code = 2


class ConfigError(EngyError):
    title = "config"


class ModelError(EngyError):
    title = "model"


class RoleError(EngyError):
    title = "role"


def collapse(error: BaseException) -> BaseException:
    """The one real error inside nested exception groups, or `error` itself when there are
    several. trio wraps every nursery failure in a group; callers that handle one specific
    failure (a dropped connection, a user error) want the leaf. A `trio.Cancelled` beside one
    real error does not count: the cancelled scope delivers it again at the next checkpoint."""
    import trio

    leaves: list[BaseException] = []
    pending = [error]
    while pending:
        current = pending.pop()
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        else:
            leaves.append(current)
    if len(leaves) > 1:
        leaves = [leaf for leaf in leaves if not isinstance(leaf, trio.Cancelled)] or leaves
    return leaves[0] if len(leaves) == 1 else error


@contextlib.contextmanager
def single_failure() -> Iterator[None]:
    """Raise a failure inside it as itself when trio wrapped one real error in exception
    groups (see `collapse`); several real errors stay a group."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaf = collapse(group)
        if leaf is group:
            raise
        raise leaf from None
