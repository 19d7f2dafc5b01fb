"""sm90_fwd's staged-O instances without a GPU: which calls they serve (few key blocks, or any in a
band instance), that the 176-key tile takes the longer unmasked ones, and that the family's request
carries the call's key count (capped) into the selection.  Nothing here imports CuPy."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from flashgen.runtime.families import sm90_common, sm90_fwd
from flashgen.runtime.select import KEYS_CAP, Request, rejection
from flashgen.spec.sm90_fwd import Sm90Fwd
from runtime_fakes import H100, FakeArray, fake_call, hopper_constants


@pytest.fixture(autouse=True)
def block_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)


def binary(spec):
    """What selection reads of a built kernel (hopper_constants: ``staged_max_key_blocks`` as
    FwdKernel::kServedKeyBlocks computes it, 16 for an unmasked staged instance, else 0)."""
    return SimpleNamespace(spec=spec, name=spec.name, constants=hopper_constants(spec))


def first(req, band=False):
    kernels = [binary(k) for k in Sm90Fwd.default_set() if k.dtype == "bf16" and k.band == band]
    return next((b.name for b in kernels if rejection(b, req) is None), None)


STAGED = binary(next(k for k in Sm90Fwd.default_set() if k.staged_o and not k.band and k.dtype == "bf16"))


def request(num_keys, band=False, K=128):
    return Request("sm90_fwd", "bf16", K, K, 8, False, False, H100, band=band, compiled_bias=True,
                   num_keys=num_keys)


@pytest.mark.parametrize("num_keys", [1, 7, 129, 1000, 2048])
def test_calls_of_at_most_16_key_blocks_take_the_staged_tile(num_keys):
    assert first(request(num_keys)) == "sm90_fwd_bf16_k128_q128x128_s2_staged_o_sm90a"


@pytest.mark.parametrize("num_keys", [2049, 8192, KEYS_CAP])
def test_longer_calls_take_the_176_key_tile_with_the_reason(num_keys):
    assert first(request(num_keys)) == "sm90_fwd_bf16_k128_q128x176_s2_sm90a"
    why = rejection(STAGED, request(num_keys))
    assert "at most 16 key blocks (2048 keys)" in why and f"the call has {num_keys}" in why
    assert why.endswith(" or more") == (num_keys == KEYS_CAP)


def test_an_unknown_key_count_never_takes_a_limited_tile():
    assert first(request(0)) == "sm90_fwd_bf16_k128_q128x176_s2_sm90a"
    assert "an unknown number" in rejection(STAGED, request(0))


@pytest.mark.parametrize("num_keys", [0, 7, 2048, 16384])
def test_the_band_tile_is_staged_at_every_length(num_keys):
    assert first(request(num_keys, band=True), band=True) == "sm90_fwd_bf16_k128_q128x128_s2_band_staged_o_sm90a"


def test_the_176_key_tile_is_head_dim_128s_unmasked_plain_tile_only():
    wide = [k for k in Sm90Fwd.default_set() if k.block_n == 176]
    assert {(k.dtype, k.max_k, k.band, k.staged_o, k.bias, k.dropout, k.sparse, k.score_mod, k.stages)
            for k in wide} == {(d, 128, False, False, False, False, False, "", 2) for d in ("f16", "bf16")}
    # the band and bias calls keep their 128-key tiles
    assert first(request(8192, band=True), band=True) == "sm90_fwd_bf16_k128_q128x128_s2_band_staged_o_sm90a"


def test_head_dim_64_has_no_staged_tile():
    assert first(request(512, K=64)) == "sm90_fwd_bf16_k64_q192x128_s2_sm90a"


@pytest.mark.parametrize("N, expected", [(7, 7), (3000, 3000), (KEYS_CAP + 5, KEYS_CAP)])
def test_the_family_request_carries_the_calls_key_count(N, expected, monkeypatch):
    monkeypatch.setattr(sm90_common, "device_info", lambda index: H100)
    q, k, v = FakeArray((1, 5, 2, 128)), FakeArray((1, N, 2, 128)), FakeArray((1, N, 2, 128))
    assert sm90_fwd.RUNTIME.request(fake_call("fwd", arrays=(q, k, v))).num_keys == expected
