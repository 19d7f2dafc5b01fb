"""Fixtures shared by the test modules."""
from __future__ import annotations

import sys
import types

import pytest

from flashgen import bench
from flashgen.runtime.registry import Registry
from flashgen.toolchain import probe_toolchain

import bench_fakes
from runtime_fakes import BWD_SMEM, FWD_SMEM, constants, write_build


@pytest.fixture(scope="session")
def toolchain():
    """The real build toolchain; tests that compile skip cleanly where it is incomplete."""
    report = probe_toolchain()
    if not report.ok():
        pytest.skip("no complete toolchain: " + "; ".join(m.message for _, m in report.missing()))
    return report.toolchain()


# --- the runtime's host-side tests (tests/runtime_fakes.py); a module that must never import CuPy
# takes the first two with pytestmark = pytest.mark.usefixtures("cupy_is_never_imported", "block_cupy")

@pytest.fixture(scope="module")
def cupy_is_never_imported():
    # Other test modules may have imported CuPy at collection (on GPU machines); this one must not.
    before = sys.modules.get("cupy")
    yield
    assert sys.modules.get("cupy") is before
    if before is None:
        assert "cupy" not in sys.modules


@pytest.fixture
def block_cupy(monkeypatch):
    """`import cupy` raises ImportError inside every test, even where CuPy is installed."""
    monkeypatch.setitem(sys.modules, "cupy", None)


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    """A build directory of runtime_fakes' kernel set, for sm80 and sm90."""
    d = tmp_path_factory.mktemp("kernels")
    specs = {**BWD_SMEM, **FWD_SMEM}
    write_build(d, [(s, {t: constants(s, smem) for t in ("sm80", "sm90")}) for s, smem in specs.items()])
    return d


@pytest.fixture(scope="module")
def reg(kernel_dir):
    return Registry([kernel_dir])


@pytest.fixture
def host_bench(monkeypatch):
    """bench_point without a GPU (test_bench*.py): CPU inputs (kept for the assertions), no CuPy, torch's
    timing calls on the host clock (bench_fakes.host_torch)."""
    torch = pytest.importorskip("torch")
    made = []

    def cpu_inputs(_torch, p, sets=3):
        made[:] = [[torch.randn(shape) for shape in bench.shapes(p)] for _ in range(sets)]
        return made

    pool = types.SimpleNamespace(free_all_blocks=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(get_default_memory_pool=lambda: pool))
    monkeypatch.setattr(bench, "_inputs", cpu_inputs)
    return types.SimpleNamespace(torch=bench_fakes.host_torch(torch), inputs=made)
