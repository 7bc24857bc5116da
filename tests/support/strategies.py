"""hypothesis for the property tests, and what they draw from. hypothesis is an extra of the tests: where
it is missing (a bare GPU machine with the runtime dependencies and pytest), each ``@given`` test is
skipped with the reason and the rest of its module still runs."""

from __future__ import annotations

import pytest

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ModuleNotFoundError:

    class _Absent:
        """Stands in for hypothesis's strategies and health checks: every use gives itself back."""

        def __getattr__(self, name):
            return self

        def __call__(self, *args, **kwargs):
            return self

        def __or__(self, other):
            return self

        __ror__ = __or__

    st = HealthCheck = _Absent()

    def given(*args, **kwargs):
        return pytest.mark.skip(reason="hypothesis is not installed (pip install -e '.[test]')")

    def settings(*args, **kwargs):
        return lambda f: f


__all__ = ["HealthCheck", "given", "json_values", "settings", "st"]

#: any JSON value, nested a little: what a hand-edited or damaged file can hold
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=10,
)
