"""flashgen tune on a GPU (flashgen/tune.py): a grouped-query point is timed on grouped-query inputs,
backward only, and its choice lands in its group's backward bucket.

Needs CuPy, an H100/H200 and sm90_bwd kernels on FLASHGEN_KERNEL_PATH; skipped cleanly otherwise.
"""
from __future__ import annotations

import pytest

cupy = pytest.importorskip("cupy")
from attention_reference import gpu_marks, hopper_kernels  # noqa: E402
from flashgen import tune  # noqa: E402
from flashgen.bench import Point  # noqa: E402
from flashgen.runtime import api  # noqa: E402
from flashgen.spec.sm90_bwd import Sm90Bwd  # noqa: E402

HAVE_GPU, pytestmark = gpu_marks()
needs_sm90 = pytest.mark.skipif(not hopper_kernels(Sm90Bwd.FAMILY),
                                reason="needs a 9.0 GPU and sm90_bwd kernels (flashgen build --arch sm90a)")


@needs_sm90
def test_a_grouped_query_point_is_timed_on_its_own_shapes(tmp_path, monkeypatch):
    heads_seen = []
    backward = api.attention_backward

    def spy(grad_out, q, k, v, *args, **kwargs):
        heads_seen.append((q.shape[2], k.shape[2], v.shape[2], grad_out.shape[2]))
        return backward(grad_out, q, k, v, *args, **kwargs)

    monkeypatch.setattr(api, "attention_backward", spy)
    point = Point("f16", 64, True, 2, 8, 256, group=4)
    table = tune.tune([point], 2, lambda line: None, "test", tmp_path / "table.json")
    assert heads_seen and set(heads_seen) == {(8, 2, 2, 8)}
    assert [(m["direction"], m["point"]["group"]) for m in table.measured["points"]] == [("bwd", 4)]
    assert all(bucket.group == 4 for bucket in table.entries)
