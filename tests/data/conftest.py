"""Fixtures of the data package's tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def no_requests(monkeypatch):
    """no_network for requests (what pooch downloads the named corpora through): any request fails."""
    import requests

    def refuse(*args, **kwargs):
        raise OSError("the network must not be used in tests")

    monkeypatch.setattr(requests.adapters.HTTPAdapter, "send", refuse)
