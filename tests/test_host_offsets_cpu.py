"""runtime/host_offsets.py without a GPU: when a torch tensor's host copy of its offsets is reused
(the same object, unchanged by torch) and when it is read again."""
from __future__ import annotations

import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flashgen.runtime import host_offsets  # noqa: E402


@pytest.fixture(autouse=True)
def empty_cache():
    host_offsets.clear()
    yield
    host_offsets.clear()


def offsets(*values):
    return torch.tensor(values, dtype=torch.int32)


def test_the_copy_serves_the_same_unchanged_tensor_read_only():
    t = offsets(0, 3, 7)
    assert host_offsets.lookup(t) is None
    host_offsets.remember(t, t.numpy())
    got = host_offsets.lookup(t)
    assert got.tolist() == [0, 3, 7] and not got.flags.writeable
    assert host_offsets.lookup(offsets(0, 3, 7)) is None  # equal contents, another tensor


def test_an_in_place_write_makes_it_read_again():
    t = offsets(0, 3, 7)
    host_offsets.remember(t, t.numpy())
    t.add_(1)
    assert host_offsets.lookup(t) is None
    host_offsets.remember(t, t.numpy())
    assert host_offsets.lookup(t).tolist() == [1, 4, 8]
    t[1] = 5  # indexing writes bump the version too
    assert host_offsets.lookup(t) is None


def test_a_dead_tensors_copy_is_forgotten_and_never_serves_a_newcomer():
    t = offsets(0, 3, 7)
    host_offsets.remember(t, t.numpy())
    key = id(t)
    del t
    gc.collect()
    assert key not in host_offsets._copies
    u = offsets(0, 1, 2)  # as if a dead tensor's entry were still filed under u's id, at u's version
    host_offsets._copies[id(u)] = (lambda: None, u._version, np.array([0, 9, 9]))
    assert host_offsets.lookup(u) is None  # its reference is not to u: not u's copy


def test_only_torch_tensors_with_a_version_counter_are_kept_and_the_oldest_go_first():
    host_offsets.remember(np.array([0, 1], dtype=np.int32), np.array([0, 1]))
    assert host_offsets.lookup(np.array([0, 1], dtype=np.int32)) is None and not host_offsets._copies
    with torch.inference_mode():
        frozen = offsets(0, 1)
    host_offsets.remember(frozen, frozen.numpy())  # no version counter: never reused
    assert host_offsets.lookup(frozen) is None
    kept = [offsets(0, i) for i in range(host_offsets._MAX_COPIES + 1)]
    for t in kept:
        host_offsets.remember(t, t.numpy())
    assert host_offsets.lookup(kept[0]) is None and host_offsets.lookup(kept[-1]).tolist() == [0, len(kept) - 1]
    assert len(host_offsets._copies) == host_offsets._MAX_COPIES
