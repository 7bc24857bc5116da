"""The one exception type for user errors.

A :class:`GptspeedError` is something the user can fix (a bad flag, a missing file, a corrupt
shard). The command line prints its message as a single line on stderr and exits non-zero;
anything else that escapes is a bug and keeps its traceback.
"""


class GptspeedError(Exception):
    """A user error: ``str(err)`` is one line saying what is wrong and what to do."""
