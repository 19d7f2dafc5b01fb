"""The Hopper families' compiled-in attention bias without a GPU: which instances serve a bias call,
and that a bias instance is never launched without a bias (nor a plain one with one).  Nothing
here imports CuPy (test_runtime_cpu's fakes stand in for arrays)."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from flashgen.runtime.families import sm90_bwd, sm90_fwd
from flashgen.runtime.select import Request, rejection
from flashgen.spec.sm90_bwd import Sm90Bwd
from flashgen.spec.sm90_fwd import Sm90Fwd
from test_runtime_cpu import H100, FakeArray, fake_call


@pytest.fixture(autouse=True)
def block_cupy(monkeypatch):
    """`import cupy` raises ImportError inside every test, even where CuPy is installed."""
    monkeypatch.setitem(sys.modules, "cupy", None)


def binary(spec):
    """What selection and the launch guard read of a built kernel."""
    return SimpleNamespace(spec=spec, name=spec.name, constants={
        "max_k": spec.max_k, "alignment": 8, "shared_memory_bytes": 200 * 1024})


def request(family, bias, K=64, softcap=False):
    return Request(family, "f16", K, K, 8, False, bias, H100, softcap=softcap, compiled_bias=True)


def first(kernels, req):
    return next((b.name for b in kernels if rejection(b, req) is None), None)


def test_forward_bias_is_compiled_in_and_matched_both_ways():
    """A Hopper call with a bias takes only a bias instance, one without only a plain one, and a bias
    call beyond the bias tiers (head dim 256) is refused with the reason, so example 41 takes it."""
    kernels = [binary(k) for k in Sm90Fwd.default_set() if k.dtype == "f16" and not k.band]
    assert first(kernels, request("sm90_fwd", True)) == "sm90_fwd_f16_k64_q128x128_s2_bias_sm90a"
    assert first(kernels, request("sm90_fwd", False)) == "sm90_fwd_f16_k64_q192x128_s2_sm90a", \
        "plain calls keep the 192-row tile"
    assert first(kernels, request("sm90_fwd", True, K=96)) == "sm90_fwd_f16_k128_q128x128_s2_bias_sm90a", \
        "96 runs on the 128 tier"
    plain = next(b for b in kernels if not b.spec.bias)
    assert rejection(plain, request("sm90_fwd", True)) == "built without bias"
    biased = next(b for b in kernels if b.spec.bias)
    assert "built with bias" in rejection(biased, request("sm90_fwd", False))
    assert first(kernels, request("sm90_fwd", True, K=256)) is None, "no bias instance above head dim 128"
    # example 41's bias kernels (a null-pointer branch) still serve calls without one
    assert Request("mem_eff_fwd", "f16", 64, 64, 8, False, False, H100).compiled_bias is False


def test_backward_bias_with_softcapping_at_head_dim_64_runs_on_the_128_tier():
    """No backward instance has both at head dim 64 (spec: it spilled); the 128 tier's takes the call
    (TMA reads zeros past head dim 64), so such a call is served, not refused."""
    kernels = [binary(k) for k in Sm90Bwd.default_set() if k.dtype == "f16" and not k.band]
    assert first(kernels, request("sm90_bwd", True)) == "sm90_bwd_f16_k64_q128x128_s2_bias_sm90a"
    assert first(kernels, request("sm90_bwd", True, softcap=True)) == "sm90_bwd_f16_k128_q64x128_s2_softcap_bias_sm90a"
    assert first(kernels, request("sm90_bwd", False, softcap=True)) == "sm90_bwd_f16_k64_q128x128_s2_softcap_sm90a"
    assert first(kernels, request("sm90_bwd", True, K=192)) is None


@pytest.mark.parametrize("family,runtime", [(Sm90Fwd, sm90_fwd.RUNTIME), (Sm90Bwd, sm90_bwd.RUNTIME)])
def test_a_bias_instance_is_never_launched_without_a_bias(family, runtime):
    """Launching a kernel by hand (tests, benchmarks) with the other kind of call is a ValueError
    before anything touches the GPU: a bias instance would read through a missing bias."""
    biased = binary(next(k for k in family.default_set() if k.bias))
    plain = binary(next(k for k in family.default_set() if not k.bias))
    direction = family.DIRECTION
    with pytest.raises(ValueError, match=rf"^{biased.name} is built with an attention bias \(compiled in\); "
                                         r"the call has none$"):
        runtime.launch(fake_call(direction), biased)
    with pytest.raises(ValueError, match=rf"^{plain.name} is built without an attention bias \(compiled in\); "
                                         r"the call has one$"):
        runtime.launch(fake_call(direction, bias=FakeArray((2, 3, 5, 7))), plain)
