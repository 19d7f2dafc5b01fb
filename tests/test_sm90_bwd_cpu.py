"""sm90_bwd's 80-query instances without a GPU: which calls they serve (head dim 128, no bias, mask
lists, dropout, soft-capping or mod; sequences of at least ``min_queries`` queries), that the 64-query
tile takes the rest with the reason, that the family's request carries the call's query count
(capped) into the selection, and which split-head-dim tier a head dim above 128 takes.  Nothing here
imports CuPy."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from flashgen.runtime.families import sm90_bwd, sm90_common
from flashgen.runtime.select import KEYS_CAP, Request, rejection
from flashgen.spec.sm90_bwd import Sm90Bwd
from runtime_fakes import H100, FakeArray, fake_call, hopper_constants


@pytest.fixture(autouse=True)
def block_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)


def binary(spec):
    """What selection reads of a built kernel (a mod instance's record carries the digest asked for)."""
    return SimpleNamespace(spec=spec, name=spec.name, constants=hopper_constants(spec),
                           score_mod={"digest": ""} if spec.score_mod else None)


def first(req):
    kernels = [binary(k) for k in Sm90Bwd.default_set() if k.dtype == "bf16"]
    return next((b.name for b in kernels if rejection(b, req) is None), None)


def request(num_queries, band=False, K=128, bias=False, **options):
    return Request("sm90_bwd", "bf16", K, K, 8, False, bias, H100, band=band, compiled_bias=True,
                   compiled_dropout=True, num_keys=min(max(num_queries, 1), KEYS_CAP), num_queries=num_queries,
                   **options)


Q80 = binary(next(k for k in Sm90Bwd.default_set() if k.block_m == 80 and not k.band and k.dtype == "bf16"))


@pytest.mark.parametrize("band", [False, True])
@pytest.mark.parametrize("num_queries", [1024, 1025, 4096, KEYS_CAP])
def test_sequences_of_1024_queries_or_more_take_80_query_steps(num_queries, band):
    suffix = "_band" if band else ""
    assert first(request(num_queries, band=band)) == f"sm90_bwd_bf16_k128_q80x128_s2{suffix}_sm90a"


@pytest.mark.parametrize("band", [False, True])
@pytest.mark.parametrize("num_queries", [1, 7, 129, 1000, 1023])
def test_shorter_ones_take_the_64_query_tile_with_the_reason(num_queries, band):
    suffix = "_band" if band else ""
    assert first(request(num_queries, band=band)) == f"sm90_bwd_bf16_k128_q64x128_s2{suffix}_sm90a"
    why = rejection(Q80, request(num_queries))
    assert "80-query steps, which pay only from 1024 queries a sequence on" in why
    assert why.endswith(f"the call has {num_queries}")


def test_an_unknown_query_count_never_takes_80_query_steps():
    assert first(request(0)) == "sm90_bwd_bf16_k128_q64x128_s2_sm90a"
    assert rejection(Q80, request(0)).endswith("the call has an unknown number")


@pytest.mark.parametrize("options", [dict(bias=True), dict(softcap=True), dict(score_mod="alibi")])
def test_80_query_steps_are_only_for_plain_calls(options):
    """Bias, soft-capping and score mods keep the 64-query step (the spec builds no 80-query twin)."""
    chosen = first(request(8192, **options))
    assert chosen is not None and "_q64x128_" in chosen


def test_head_dim_64_keeps_its_128_query_step():
    assert first(request(8192, K=64)) == "sm90_bwd_bf16_k64_q128x128_s2_sm90a"


@pytest.mark.parametrize("M, expected", [(7, 7), (3000, 3000), (KEYS_CAP + 5, KEYS_CAP)])
def test_the_family_request_carries_the_calls_query_count(M, expected, monkeypatch):
    monkeypatch.setattr(sm90_common, "device_info", lambda index: H100)
    q, k, v = FakeArray((1, M, 2, 128)), FakeArray((1, 5, 2, 128)), FakeArray((1, 5, 2, 128))
    assert sm90_bwd.RUNTIME.request(fake_call("bwd", arrays=(q, k, v))).num_queries == expected


@pytest.mark.parametrize("K, tier", [(136, 192), (160, 192), (192, 192), (200, 256), (256, 256)])
def test_head_dims_above_128_take_the_smallest_split_tier(K, tier):
    """Head dims 136-192 run on the 192 tier (on 256 a quarter of the work was zero padding)."""
    for band in (False, True):
        suffix = "_band" if band else ""
        assert first(request(4096, band=band, K=K)) == f"sm90_bwd_bf16_k{tier}_q64x64_s2{suffix}_sm90a"
