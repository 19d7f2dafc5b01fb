"""runtime/host_offsets.py without a GPU: when a torch tensor's host copy of its offsets is reused
(the same object, unchanged by torch) and when it is read again.  A stand-in ``torch`` module keeps
these in CI (no torch there); the last test checks the two torch behaviours they rely on, where
torch is installed."""
from __future__ import annotations

import gc
import sys
import types

import numpy as np
import pytest

from flashgen.runtime import host_offsets
from runtime_fakes import InferenceTensor, Tensor


@pytest.fixture
def fake_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(Tensor=Tensor))  # runtime_fakes' stand-in
    host_offsets.clear()
    yield
    host_offsets.clear()


def test_the_copy_serves_the_same_unchanged_tensor_read_only(fake_torch):
    t = Tensor(0, 3, 7)
    assert host_offsets.lookup(t) is None
    host_offsets.remember(t, t.numpy())
    got = host_offsets.lookup(t)
    assert got.tolist() == [0, 3, 7] and not got.flags.writeable
    t.values[1] = 9  # (a write torch would see bumps _version; this one is the copy's independence)
    assert host_offsets.lookup(t).tolist() == [0, 3, 7]
    assert host_offsets.lookup(Tensor(0, 3, 7)) is None  # equal contents, another tensor


def test_an_in_place_write_makes_it_read_again(fake_torch):
    t = Tensor(0, 3, 7)
    host_offsets.remember(t, t.numpy())
    t.add_(1)
    assert host_offsets.lookup(t) is None
    host_offsets.remember(t, t.numpy())
    assert host_offsets.lookup(t).tolist() == [1, 4, 8]


def test_a_dead_tensors_copy_is_forgotten_and_never_serves_a_newcomer(fake_torch):
    t = Tensor(0, 3, 7)
    host_offsets.remember(t, t.numpy())
    key = id(t)
    del t
    gc.collect()
    assert key not in host_offsets._copies
    u = Tensor(0, 1, 2)  # as if a dead tensor's entry were still filed under u's id, at u's version
    host_offsets._copies[id(u)] = (lambda: None, u._version, np.array([0, 9, 9]))
    assert host_offsets.lookup(u) is None  # its reference is not to u: not u's copy


def test_only_tensors_with_a_version_counter_are_kept_and_the_oldest_go_first(fake_torch):
    host_offsets.remember(np.array([0, 1], dtype=np.int32), np.array([0, 1]))
    assert host_offsets.lookup(np.array([0, 1], dtype=np.int32)) is None and not host_offsets._copies
    frozen = InferenceTensor(0, 1)
    host_offsets.remember(frozen, frozen.numpy())  # no version counter: never reused
    assert host_offsets.lookup(frozen) is None and not host_offsets._copies
    kept = [Tensor(0, i) for i in range(host_offsets._MAX_COPIES + 1)]
    for t in kept:
        host_offsets.remember(t, t.numpy())
    assert host_offsets.lookup(kept[0]) is None and host_offsets.lookup(kept[-1]).tolist() == [0, len(kept) - 1]
    assert len(host_offsets._copies) == host_offsets._MAX_COPIES


def test_torch_bumps_the_version_on_in_place_writes_and_inference_tensors_have_none():
    torch = pytest.importorskip("torch")
    t = torch.zeros(3, dtype=torch.int32)
    for write in (lambda: t.add_(1), lambda: t.copy_(torch.ones(3, dtype=torch.int32)),
                  lambda: t.__setitem__(1, 5)):
        before = t._version
        write()
        assert t._version > before
    with torch.inference_mode():
        frozen = torch.zeros(2)
    with pytest.raises(RuntimeError):
        frozen._version
