"""Launch plans for packed (varlen) calls without a GPU: what puts a call's offsets into its plan's
key, which calls get none, which Params fields a plan points at the offsets, and how a replay clears
the rows past the last sequence."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest

from flashgen.runtime import api, host_offsets, validate
from flashgen.runtime.families import sm90_common
from runtime_fakes import FakeArray, Tensor, fake_call


@pytest.fixture(autouse=True)
def fake_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(Tensor=Tensor))  # runtime_fakes' stand-in
    host_offsets.clear()
    yield
    host_offsets.clear()


def offsets(*values):
    return Tensor(*values)


def test_offsets_join_the_key_only_when_their_contents_are_known_without_a_read():
    cu_q, cu_k = offsets(0, 5, 9), offsets(0, 7, 12)
    assert api._packed_offsets(None, None) == ((), None)  # not packed: planned as ever
    assert api._packed_offsets(cu_q, cu_k) is None  # never read: the full path reads them
    host_offsets.remember(cu_q, cu_q.numpy())
    assert api._packed_offsets(cu_q, cu_k) is None  # one of the two unknown
    host_offsets.remember(cu_k, cu_k.numpy())
    arrays, contents = api._packed_offsets(cu_q, cu_k)
    assert arrays == (cu_q, cu_k)
    assert [np.frombuffer(c, np.int32).tolist() for c in contents] == [[0, 5, 9], [0, 7, 12]]
    cu_k.add_(0)  # an in-place write, even one that changes nothing: read again
    assert api._packed_offsets(cu_q, cu_k) is None
    assert api._packed_offsets(np.array([0, 5, 9], np.int32), np.array([0, 7, 12], np.int32)) is None


def test_a_call_whose_offsets_validation_copied_leaves_no_plan():
    """The kernels read a copy of strided (or other-device) offsets, which a plan, pointing at the
    caller's arrays, would not see."""
    cu_q, cu_k = FakeArray((3,), np.int32, ptr=4096), FakeArray((3,), np.int32, ptr=8192)
    p = SimpleNamespace(seqstart_q=cu_q, seqstart_k=cu_k)
    assert not validate.offsets_copied(p, {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k})
    copy = FakeArray((3,), np.int32, ptr=1 << 20)
    assert validate.offsets_copied(SimpleNamespace(seqstart_q=copy, seqstart_k=cu_k),
                                   {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k})
    assert validate.offsets_copied(SimpleNamespace(seqstart_q=cu_q, seqstart_k=cu_k),
                                   {"cu_seqlens_q": cu_q, "cu_seqlens_k": np.array([0, 1, 2], np.int32)})
    assert not validate.offsets_copied(SimpleNamespace(seqstart_q=None), {})


def test_a_packed_plan_points_seqstart_at_the_offsets_and_records_where_the_sequences_end():
    call = fake_call("fwd")
    assert sm90_common.trailing_pointers(call) == () and sm90_common.packed_ends(call.p) == ()
    call.p.seqstart_q, call.p.seqstart_k = FakeArray((3,), np.int32), FakeArray((3,), np.int32)
    call.p.starts_q, call.p.starts_k = np.array([0, 2, 4], np.int32), np.array([0, 3, 6], np.int32)
    assert sm90_common.trailing_pointers(call) == ("seqstart_q", "seqstart_k")
    assert sm90_common.packed_ends(call.p) == (4, 6)


class Rows:
    """A contiguous [1, rows, H, K] output as a replay allocates it: its address and size."""

    def __init__(self, rows, ptr, row_bytes=256):
        self.shape, self.ptr, self.nbytes = (1, rows, 2, 64), ptr, rows * row_bytes


@pytest.mark.parametrize("ends,cleared", [
    ((), []),                                                     # not packed
    ((10, 12), []),                                               # every row in a sequence
    ((7, 12), [(1000 + 7 * 256, 3 * 256)]),                       # dq past row 7 (forward: out)
    ((10, 9), [(2000 + 9 * 256, 3 * 256), (3000 + 9 * 256, 3 * 256)]),  # dk, dv past row 9
])
def test_a_replay_clears_the_rows_past_the_last_sequence_on_its_stream(monkeypatch, ends, cleared):
    memsets = []
    runtime = SimpleNamespace(memsetAsync=lambda ptr, value, size, stream: memsets.append((ptr, value, size, stream)))
    monkeypatch.setattr(sm90_common, "cupy_module", lambda: SimpleNamespace(cuda=SimpleNamespace(runtime=runtime)))
    memory = SimpleNamespace(ptr=lambda x: x.ptr)
    sm90_common.zero_replayed_rows(memory, ends, (Rows(10, 1000), Rows(12, 2000), Rows(12, 3000)), 77)
    assert memsets == [(ptr, 0, size, 77) for ptr, size in cleared]
