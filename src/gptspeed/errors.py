"""The one exception type for user errors.

A :class:`GptspeedError` is something the user can fix (a bad flag, a missing file, a corrupt
shard). The command line prints its message as a single line on stderr and exits non-zero;
anything else that escapes is a bug and keeps its traceback. :func:`show_value` writes a value the
user gave into such a line.
"""


class GptspeedError(Exception):
    """A user error: ``str(err)`` is one line saying what is wrong and what to do."""


def show_value(value: object) -> str:
    """``value`` for an error line: a number in full unless it is very long, anything else
    shortened by :mod:`reprlib` (a YAML alias can make a value of billions of nested items whose
    full ``repr`` would never end)."""
    import reprlib

    if isinstance(value, int) and not isinstance(value, bool):
        text = str(value)
        return text if len(text) <= 30 else f"{text[:12]}... ({len(text.lstrip('-'))} digits)"
    if isinstance(value, float):
        return repr(value)
    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother, short.maxlist, short.maxdict = 2, 80, 80, 4, 4
    return short.repr(value)
