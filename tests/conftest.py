"""Test-session settings shared by every test module."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_program_cache(tmp_path_factory):
    """Every test session gets its own program / reference cache (``nhil.compiler.cache``), so no test reads an
    entry a developer's earlier runs left in ``~/.cache/nhil``; tests that must see the compile stages run set
    ``NHIL_CACHE=0`` themselves."""
    old = os.environ.get("NHIL_CACHE_DIR")
    os.environ["NHIL_CACHE_DIR"] = str(tmp_path_factory.mktemp("nhil-cache"))
    yield
    if old is None:
        os.environ.pop("NHIL_CACHE_DIR", None)
    else:
        os.environ["NHIL_CACHE_DIR"] = old
