"""Fixtures shared by the test modules."""
from __future__ import annotations

import pytest

from flashgen.toolchain import probe_toolchain


@pytest.fixture(scope="session")
def toolchain():
    """The real build toolchain; tests that compile skip cleanly where it is incomplete."""
    report = probe_toolchain()
    if not report.ok():
        pytest.skip("no complete toolchain: " + "; ".join(m.message for _, m in report.missing()))
    return report.toolchain()
