"""flashgen.packed_offsets without a GPU (a fake CuPy): offsets validated once, kept in copies of their
own, and read by no call that takes them; what a plan's key gets from them."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from flashgen.runtime import api, packed, validate
from hostile_fakes import FakeDevArray, make_fake_cupy


@pytest.fixture
def fake_cupy(monkeypatch):
    m = make_fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", m)
    return m


def test_offsets_are_validated_once_into_copies_of_their_own(fake_cupy):
    given = np.array([0, 5, 5, 12], np.int32)
    offsets = packed.packed_offsets(given, device=0)
    assert offsets.host.tolist() == [0, 5, 5, 12] and not offsets.host.flags.writeable
    assert offsets.array.host.tolist() == [0, 5, 5, 12] and offsets.device == 0 and offsets.sequences == 3
    given[1] = 9  # the caller's array changes later: the offsets do not
    assert offsets.host.tolist() == [0, 5, 5, 12] and offsets.array.host.tolist() == [0, 5, 5, 12]
    assert packed.packed_offsets(offsets) is offsets
    assert repr(offsets) == "PackedOffsets(3 sequences, 12 rows, GPU 0)"


@pytest.mark.parametrize("bad,error,match", [
    (np.array([0, 5, 12], np.int64), TypeError, "must be int32"),
    (np.array([0], np.int32), ValueError, "at least 2 entries"),
    (np.array([[0, 5]], np.int32), ValueError, "1-D"),
    (np.array([1, 5], np.int32), ValueError, "start at 0"),
    (np.array([0, 5, 3], np.int32), ValueError, "never decrease"),
])
def test_bad_offsets_are_refused_when_built(fake_cupy, bad, error, match):
    with pytest.raises(error, match=match):
        packed.packed_offsets(bad, device=0)


@pytest.mark.parametrize("device", [-1, True, 1.0, "0"])
def test_a_device_that_is_not_a_gpu_index_is_refused(fake_cupy, device):
    with pytest.raises(ValueError, match="device must be a GPU index"):
        packed.packed_offsets(np.array([0, 5], np.int32), device=device)


def test_calls_read_no_packed_offsets_and_check_each_calls_rows(fake_cupy):
    offsets = packed.packed_offsets(np.array([0, 5, 12], np.int32), device=0)

    def no_read(a):
        raise AssertionError("a call read offsets that were validated when built")

    fake_cupy.asnumpy = no_read
    cu, host = validate.read_offsets(offsets, "cu_seqlens_q", 12)
    assert cu is offsets.array and host is offsets.host
    with pytest.raises(ValueError, match="cu_seqlens_k ends at 12 but the packed sequence has 10 rows"):
        validate.read_offsets(offsets, "cu_seqlens_k", 10)


def test_packed_offsets_key_a_plan_by_their_contents_and_point_it_at_their_own_copy(fake_cupy):
    q_offsets = packed.packed_offsets(np.array([0, 5, 12], np.int32), device=0)
    k_offsets = packed.packed_offsets(np.array([0, 7, 9], np.int32), device=0)
    arrays, contents = api._packed_offsets(q_offsets, k_offsets)
    assert arrays == (q_offsets.array, k_offsets.array)
    assert [np.frombuffer(c, np.int32).tolist() for c in contents] == [[0, 5, 12], [0, 7, 9]]
    assert api._packed_offsets(q_offsets, FakeDevArray((3,), np.int32)) is None  # a CuPy array: read per call
    p = type("P", (), {"seqstart_q": q_offsets.array, "seqstart_k": k_offsets.array})()
    assert not validate.offsets_copied(p, {"cu_seqlens_q": q_offsets, "cu_seqlens_k": k_offsets})
