"""Helpers of the tests that are not tests: imported as ``support.<module>`` (pyproject.toml puts tests/ on the path)."""
