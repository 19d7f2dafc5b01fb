"""Dropout on the Hopper kernels without a GPU: Philox-4x32-10 against Random123's known answers, the
element -> (counter, lane) rule and the kernels' bookkeeping of it (forward and backward thread
layouts), the instances, selection both ways, the pairing of the two directions, and launch plans
that re-fill each call's seed and offset.  Nothing here imports CuPy."""
from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

from flashgen.runtime import dropout, families, plans
from flashgen.runtime.families import mem_eff_fwd, sm80_fwd, sm90_common, sm90_fwd
from flashgen.runtime.registry import Registry
from flashgen.runtime.select import Request, rejection
from flashgen.spec.sm90_bwd import Sm90Bwd
from flashgen.spec.sm90_fwd import Sm90Fwd
from flashgen.spec.sm90_tile import MOD_FIELDS
from philox_reference import keep_mask, philox4x32_10, random_bits
from runtime_fakes import H100, fake_call, hopper_constants, write_build
from test_sm90_bias_cpu import binary, first


@pytest.fixture(autouse=True)
def block_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)


# Random123's kat_vectors for philox4x32 with 10 rounds: (counter, key) -> output
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_philox_matches_the_known_answers(counter, key, expected):
    out = philox4x32_10(np.array(counter, dtype=np.uint32), key)
    assert tuple(int(x) for x in out) == expected


def call_bits(seed, offset, sequence, heads, head, i, j, threshold):
    """dropout.h's DropoutStream::keep_bits, one byte at a time from the documented rule."""
    stream = (offset + sequence * heads + head) % 2**64
    counter = ((j // 32) * 4 + (j // 2) % 4, (i // 16) * 8 + i % 8, stream % 2**32, stream >> 32)
    words = philox4x32_10(np.array(counter, dtype=np.uint32), (seed % 2**32, seed >> 32))
    values = [(int(words[lane // 4]) >> (8 * (lane % 4))) & 0xFF for lane in range(16)]
    return sum(int(v < threshold) << lane for lane, v in enumerate(values))


def test_the_rule_reads_each_element_from_its_documented_call_and_lane():
    seed, offset, heads, threshold = 0x0123456789ABCDEF, 2**64 - 3, 3, 150  # offset + b*H + h wraps
    bits = random_bits(seed, offset, 1, heads, 2, 40, 72) < threshold
    for i, j in ((0, 0), (7, 9), (8, 1), (15, 15), (16, 30), (39, 33), (21, 63), (3, 70)):
        lane = 8 * (i // 8 % 2) + 2 * (j // 8 % 4) + j % 2
        assert bool(call_bits(seed, offset, 1, heads, 2, i, j, threshold) >> lane & 1) == bits[i, j]
    # one call's 16 elements: rows {i, i + 8} x keys {j, j + 1, j + 8, j + 9, ..., j + 25}, bytes 0 .. 15
    i, j = 18, 38
    call = [(i + di, j + dj) for di in (0, 8) for dj in (0, 1, 8, 9, 16, 17, 24, 25)]
    assert {(a // 16 * 8 + a % 8, b // 32 * 4 + b // 2 % 4) for a, b in call} == {(i // 16 * 8 + i % 8, 4 + 3)}
    assert sorted(8 * (a // 8 % 2) + 2 * (b // 8 % 4) + b % 2 for a, b in call) == list(range(16))


def test_the_forward_threads_bookkeeping_matches_the_rule():
    """FwdKernel::consume: register r of a consumer thread is row row0 + 8 (r / 2 % 2), key 8 (r / 4) + col0 +
    r % 2 of a 128-key block; draw() keeps call g's (keys 32g + col0 ..) 16 bits at 16 (g % 2) of keep[g / 2]
    and the softmax reads register r's at keep_bit(r) -- as the rule says, for every lane of a warpgroup."""
    seed, offset, p, heads = 77, 5, 0.3, 2
    threshold = dropout.keep_threshold(p)
    mask = keep_mask(seed, offset, p, 1, heads, 64, 256)[0, 1]
    key0 = 128  # the block
    keep_bit = lambda r: 16 * (r // 16 % 2) + 8 * (r // 2 % 2) + 2 * (r // 4 % 4) + r % 2  # noqa: E731
    for tid in range(128):
        lane = tid % 32
        row0, col0 = 16 * (tid // 32) + lane // 4, 2 * (lane % 4)
        keep = [0, 0]
        for g in range(4):
            keep[g // 2] |= call_bits(seed, offset, 0, heads, 1, row0, key0 + 32 * g + col0, threshold) << (16 * (g % 2))
        for r in range(64):
            row, key = row0 + 8 * (r // 2 % 2), key0 + 8 * (r // 4) + col0 + r % 2
            assert bool(keep[r // 32] >> keep_bit(r) & 1) == mask[row, key], (tid, r)


@pytest.mark.parametrize("block_m", [128, 64])  # the k64 and k128 instances' query tiles, 128 keys each
def test_the_backward_threads_bookkeeping_matches_the_rule(block_m):
    """BwdKernel::consume holds S^T: register r of thread tid (warpgroup wg) is key 64 wg + 16 warp + lane / 4 +
    8 (r / 2 % 2) and query 8 (r / 4) + col0 + r % 2 of a step.  draw(): each thread of a warpgroup writes
    words tid % 128, + 128, .. of s.keep[wg], word w holding the bits of the calls of key group w % 8 and query
    groups 2 (w / 8) and + 1; then each thread reads word 32 (r / 8) + keep_words' offset, shifted by
    keep_shift, at keep_bit(r) -- exactly as the kernel indexes them, for every lane of both warpgroups."""
    seed, offset, p, heads = 2**63 + 11, 0, 0.5, 4
    threshold = dropout.keep_threshold(p)
    query0, key0 = 2 * block_m, 128  # the step's first query, the CTA's key block
    mask = keep_mask(seed, offset, p, 2, heads, query0 + block_m, key0 + 128)[1, 3]
    keep = [[None] * (2 * block_m) for _ in range(2)]  # SharedStorage::keep
    for tid in range(256):
        wg = tid // 128
        for word in range(tid % 128, 2 * block_m, 128):
            c, q = word % 8, word // 8 * 2
            query = query0 + 16 * (q // 8) + q % 8
            key = key0 + 64 * wg + 32 * (c // 4) + 2 * (c % 4)
            assert keep[wg][word] is None, "each word written once"
            keep[wg][word] = (call_bits(seed, offset, 1, heads, 3, query, key, threshold)
                              | call_bits(seed, offset, 1, heads, 3, query + 1, key, threshold) << 16)
    keep_bit = lambda r: 16 * (r % 2) + 8 * (r // 4 % 2) + 2 * (r // 2 % 2)  # noqa: E731
    for tid in range(256):
        wg, warp, lane = tid // 128, tid // 32 % 4, tid % 32
        key_row, col0 = 64 * wg + 16 * warp + lane // 4, 2 * (lane % 4)
        keep_words = 8 * (lane % 4) + 4 * (warp // 2) + lane // 8
        keep_shift = 4 * (warp % 2) + (lane // 4) % 2
        for r in range(block_m // 2):
            word = keep[wg][keep_words + 32 * (r // 8)] >> keep_shift
            key, query = key0 + key_row + 8 * (r // 2 % 2), query0 + 8 * (r // 4) + col0 + r % 2
            assert bool(word >> keep_bit(r) & 1) == mask[query, key], (tid, r)
    for warp in range(4):  # a warp's reads of a word group: 16 distinct words on 16 distinct banks
        words = {8 * (lane % 4) + 4 * (warp // 2) + lane // 8 for lane in range(32)}
        assert len(words) == len({w % 32 for w in words}) == 16


def test_keep_fraction_threshold_and_fields():
    assert dropout.keep_threshold(0.1) == 230 and dropout.keep_threshold(1e-9) == 256
    assert dropout.keep_threshold(0.001) == 256, "p below 1/512 keeps every element: the threshold is 9 bits"
    assert keep_mask(3, 0, 0.001, 1, 2, 40, 70).all() and not keep_mask(3, 0, 0.999, 1, 2, 40, 70).any()
    mask = keep_mask(3, 0, 0.2, 2, 2, 100, 300)
    assert abs(mask.mean() - 205 / 256) < 0.01
    assert not np.array_equal(mask, keep_mask(3, 1, 0.2, 2, 2, 100, 300)), "another offset, another mask"
    p = fake_call(dropout_p=0.25, seed=2**64 - 1).p
    assert dropout.fields(p) == {"dropout_seed": 2**64 - 1, "dropout_offset": 0, "dropout_keep": 192,
                                      "dropout_scale": 1 / 0.75}
    assert dropout.fields(fake_call().p) == {}


def test_dropout_instances_are_eight_per_direction_each_with_a_plain_twin():
    for cls in (Sm90Fwd, Sm90Bwd):
        kernels = cls.default_set()
        dropout = [k for k in kernels if k.dropout]
        assert {(k.dtype, k.max_k, k.band) for k in dropout} == {(d, m, b) for d in ("f16", "bf16") for m in (64, 128)
                                                                 for b in (False, True)}
        assert len(dropout) == 8
        for k in dropout:
            twin = dataclasses.replace(k, dropout=False)
            staged = hasattr(k, "staged_o") and dataclasses.replace(twin, staged_o=True)
            assert twin in kernels or staged in kernels, f"{k.name} has no plain twin"
            assert k.name.endswith("_dropout_sm90a") and k.cpp_type.endswith(", true, flashgen::sm90::NoScoreMod>")
            assert not (k.bias or k.sparse or getattr(k, "softcap", False))
        names = [f.name for f in cls.ABI]
        mods = len(MOD_FIELDS)  # a score mod's fields come last
        assert names[-4 - mods:-mods] == ["dropout_seed", "dropout_offset", "dropout_keep", "dropout_scale"]
        dtype = cls.params_dtype()
        assert dtype.fields["dropout_seed"][1] % 8 == 0 and dtype.fields["dropout_offset"][1] % 8 == 0
    fwd = {(k.max_k, k.block_m, k.block_n, k.stages) for k in Sm90Fwd.default_set() if k.dropout}
    assert fwd == {(64, 128, 128, 2), (128, 128, 128, 2)}
    bwd = {(k.max_k, k.block_m, k.block_n) for k in Sm90Bwd.default_set() if k.dropout}
    assert bwd == {(64, 128, 128), (128, 64, 128)}, "each tier's one tile"


def dropout_request(family, dropout, K=64, band=False):
    return Request(family, "f16", K, K, 8, dropout, False, H100, band=band, compiled_bias=True,
                   compiled_dropout=True)


@pytest.mark.parametrize("cls", [Sm90Fwd, Sm90Bwd])
def test_selection_matches_dropout_both_ways(cls):
    family = cls.FAMILY
    kernels = [binary(k) for k in cls.default_set() if k.dtype == "f16"]
    tile = "q128x128" if family == "sm90_fwd" else "q64x128"
    assert first(kernels, dropout_request(family, True)) == f"{family}_f16_k64_q128x128_s2_dropout_sm90a"
    assert first(kernels, dropout_request(family, True, K=96, band=True)) == \
        f"{family}_f16_k128_{tile}_s2_band_dropout_sm90a", "96 runs on the 128 tier"
    assert first(kernels, dropout_request(family, True, K=192)) is None
    assert not first(kernels, dropout_request(family, False)).endswith("_dropout_sm90a")
    plain = next(b for b in kernels if not b.spec.dropout)
    assert rejection(plain, dropout_request(family, True)) == "built without dropout"
    dropped = next(b for b in kernels if b.spec.dropout)
    assert rejection(dropped, dropout_request(family, False)) == \
        "built with dropout (compiled in): a call without it takes a kernel without"


@pytest.fixture
def hopper(tmp_path, monkeypatch):
    """A registry of f16 sm90 kernels (both directions' dropout instances) and an H100."""
    monkeypatch.setattr(sm90_common, "device_info", lambda index: H100)
    monkeypatch.setattr(dropout, "device_info", lambda index: H100)
    monkeypatch.delenv(plans.FAMILIES_VARIABLE, raising=False)

    def registry(kernels):
        directory = tmp_path / f"build{len(list(tmp_path.iterdir()))}"
        write_build(directory, [(k, {"sm90a": hopper_constants(k)}) for k in kernels])
        return Registry([directory])
    return registry


def dropout_call(direction, registry, **options):
    call = fake_call(direction, dropout_p=0.1, seed=1, **options)
    return dataclasses.replace(call, options={**call.options, "registry": registry})


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_a_dropout_call_runs_on_the_sm90_pair_in_both_directions_or_neither(direction, hopper, monkeypatch):
    """The sm90 families take a dropout call only where both directions' dropout kernels are built, and
    then example 41 and the Ampere families refuse it (test_sm80_dropout_cpu.py: when that pair draws)."""
    both = [k for cls in (Sm90Fwd, Sm90Bwd) for k in cls.default_set() if k.dtype == "f16"]
    own, example41 = families.serving(direction)[0], families.serving(direction)[-1]
    call = dropout_call(direction, hopper(both))
    assert own.unfit(call) is None and own.refusal(call) is None
    assert example41.unfit(call) == "the sm90 pair draws this dropout call's mask, in both directions (runtime/dropout.py)"
    forward_only = dropout_call(direction, hopper([k for k in both if k.FAMILY == "sm90_fwd"]))
    assert own.unfit(forward_only).startswith("sm90 pair: no sm90_bwd dropout kernel for f16, head dim 64, band=False")
    assert example41.unfit(forward_only) is None, "example 41 draws both directions' mask"
    assert "without attn_bias, block masks or softcap" in own.unfit(dropout_call(direction, hopper(both), softcap=2.0))
    assert own.unfit(dropout_call(direction, hopper(both), window=(4, 4))) is None, "band instances take windows"
    assert sm80_fwd.RUNTIME.unfit(call) == example41.unfit(call)
    monkeypatch.setenv(plans.FAMILIES_VARIABLE, f"sm90_{direction},mem_eff_fwd,mem_eff_bwd")
    assert own.unfit(call).startswith("sm90 pair: dropout needs both sm90_fwd and sm90_bwd")
    assert mem_eff_fwd.unfit_example41(call) is None


def test_a_dropout_plan_writes_each_calls_seed_and_offset():
    params = np.zeros(1, dtype=Sm90Fwd.params_dtype())
    launches = []
    plan = plans.LaunchPlan.from_params(1, 0, (1, 1, 1), (384, 1, 1), 0, params, sm90_fwd.POINTERS, True, {},
                                        launcher=lambda *a: launches.append(bytes(plan.buffer)),
                                        rng_fields=dropout.RNG_FIELDS)
    for seed, offset in ((2**64 - 1, 3), (5, 2**40)):
        plan.launch((0x1000, 0x2000), seed, offset, 0)
        record = np.frombuffer(launches[-1], dtype=Sm90Fwd.params_dtype())[0]
        assert (int(record["dropout_seed"]), int(record["dropout_offset"])) == (seed, offset)
        assert (int(record["out_ptr"]), int(record["lse_ptr"])) == (0x1000, 0x2000)
