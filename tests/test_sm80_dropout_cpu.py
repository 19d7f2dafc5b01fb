"""Dropout on the Ampere-class kernels without a GPU: the instances and their twins, the Params ABI
(sm90's dropout fields, checked against the C++ structs by nvcc), the kernels' bookkeeping of the rule
on CuTe's real mma.sync layouts (a host program built with nvcc walks every thread), and which pair of
families draws a dropout call's mask on which GPU (the policy of runtime/dropout.py).  Nothing here
imports CuPy."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from flashgen import generator
from flashgen.build.graph import NVCC_FLAGS, include_dirs
from flashgen.runtime import dropout, families, plans
from flashgen.runtime.arch import DeviceInfo
from flashgen.runtime.families import mem_eff_fwd, sm90_common
from flashgen.runtime.registry import Registry
from flashgen.spec.sm80_bwd import Sm80Bwd
from flashgen.spec.sm80_fwd import Sm80Fwd
from flashgen.spec.sm90_bwd import Sm90Bwd
from flashgen.spec.sm90_fwd import Sm90Fwd
from flashgen.spec.contract import DROPOUT_FIELDS
from runtime_fakes import H100, fake_call, hopper_constants, qkv, write_build

A100 = DeviceInfo(0, "NVIDIA A100-SXM4-80GB", 80, 108, 163 * 1024)
A10 = DeviceInfo(0, "NVIDIA A10", 86, 72, 99 * 1024)
L4 = DeviceInfo(0, "NVIDIA L4", 89, 58, 99 * 1024)
T4 = DeviceInfo(0, "Tesla T4", 75, 40, 64 * 1024)
FORCED_SM80 = "sm80_fwd,sm80_bwd,mem_eff_fwd,mem_eff_bwd"


@pytest.fixture(autouse=True)
def block_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)


def dropout_kernels(cls):
    return [k for k in cls.default_set() if k.dropout]


def test_dropout_instances_are_the_main_tiles_of_tiers_64_and_128_with_twins():
    fwd, bwd = dropout_kernels(Sm80Fwd), dropout_kernels(Sm80Bwd)
    assert {(k.dtype, k.max_k, k.block_m, k.block_n, k.stages) for k in fwd} == {
        (d, 64, 128, 64, 4) for d in ("f16", "bf16")} | {(d, 128, 128, 64, 3) for d in ("f16", "bf16")}
    # the 128 tier's A100/H100 tile and the one within sm86/sm89's 99 KB; the 64 tier's one fits both
    assert {(k.dtype, k.max_k, k.block_m, k.block_n, k.warps) for k in bwd} == {
        (d, m, bm, bn, 8) for d in ("f16", "bf16") for m, bm, bn in ((64, 64, 128), (128, 64, 128), (128, 32, 64))}
    for k in fwd + bwd:
        plain = dataclasses.replace(k, dropout=False)
        assert k.name == plain.name.replace("_sm80", "_dropout_sm80") and k.cpp_type.endswith(", true>")
        assert plain.cpp_type.endswith(", false>")
        if isinstance(k, Sm80Fwd) and k.max_k == 64:  # the plain forward there takes 128 keys (spec/sm80_fwd.py)
            plain = dataclasses.replace(plain, block_n=128)
        assert plain in type(k).default_set(), f"{k.name} has no plain twin"
    for k in fwd:  # each forward's calls have a backward twin of the same dtype and tier
        assert any((b.dtype, b.max_k) == (k.dtype, k.max_k) for b in bwd), k.name
    for k in bwd:
        assert any((f.dtype, f.max_k) == (k.dtype, k.max_k) for f in fwd), k.name
    assert len(fwd) + len(bwd) == 10, "the default sm80 build grows by ten instances"


@pytest.mark.parametrize("cls", [Sm80Fwd, Sm80Bwd])
def test_the_dropout_fields_end_params_as_in_sm90s(cls):
    names = [f.name for f in cls.ABI]
    assert cls.ABI[-len(DROPOUT_FIELDS):] == DROPOUT_FIELDS
    assert names[-4:] == ["dropout_seed", "dropout_offset", "dropout_keep", "dropout_scale"]
    ours, hopper = cls.params_dtype(), Sm90Fwd.params_dtype()
    for field in DROPOUT_FIELDS:
        assert ours.fields[field.name][0] == hopper.fields[field.name][0], field.name
    assert ours.fields["dropout_seed"][1] % 8 == 0 and ours.fields["dropout_offset"][1] % 8 == 0


# A host program over CuTe's layouts (no GPU): for every dropout instance, every thread and every
# accumulator register the kernels mask, the call and byte their bookkeeping reads (sm80_fwd.h drop(),
# sm80_bwd.h draw()/kept()) against the rule's own for the element's (row, key); and the Params structs
# against the spec's ABI (the generated checks).
LAYOUT_CHECK = r"""
#include <cstdio>
#include "flashgen/sm80_fwd.h"
#include "flashgen/sm80_bwd.h"
#include "sm80_fwd_abi.h"
#include "sm80_bwd_abi.h"

template struct FlashgenAbiCheck_sm80_fwd<flashgen::sm80::FwdParams>;
template struct FlashgenAbiCheck_sm80_bwd<flashgen::sm80::BwdParams>;

using namespace cute;
static int failures = 0;

// the rule (dropout.h): element (i, j) is byte `byte` of the call at counter (c0, c1)
struct Place { int c0, c1, byte; };
static Place rule(int i, int j) { return {j / 32 * 4 + j / 2 % 4, i / 16 * 8 + i % 8, 8 * (i / 8 % 2) + 2 * (j / 8 % 4) + j % 2}; }
static void expect(bool ok, char const* what, int tid, int r, int c) {
  if (!ok && failures++ < 20) std::printf("%s: thread %d register (%d, %d)\n", what, tid, r, c);
}

// drop(): registers (2m .. 2m + 1, 8g .. 8g + 7) are one call, drawn at (row of (2m, 0), key of (0, 8g)),
// register (r, c) its byte 8 (r % 2) + (c % 8)
template <class Kernel>
void forward(int row0, int key0) {
  typename Kernel::TiledMma mma;
  for (int tid = 0; tid < Kernel::kThreads; ++tid) {
    auto tScS = flashgen::sm80::rows_cols(mma.get_thread_slice(tid).partition_C(
        make_identity_tensor(Shape<Int<Kernel::kBlockM>, Int<Kernel::kBlockN>>{})));
    for (int r = 0; r < size<0>(tScS); ++r) {
      for (int c = 0; c < size<1>(tScS); ++c) {
        Place const element = rule(row0 + get<0>(tScS(r, c)), key0 + get<1>(tScS(r, c)));
        Place const drawn = rule(row0 + get<0>(tScS(2 * (r / 2), 0)), key0 + get<1>(tScS(0, 8 * (c / 8))));
        expect(element.c0 == drawn.c0 && element.c1 == drawn.c1, "forward: another call", tid, r, c);
        expect(element.byte == 8 * (r % 2) + c % 8, "forward: another byte", tid, r, c);
      }
    }
  }
}

// draw(): lane l draws the call of (query of (0, 4g) + y, key of (2m, 0)), y = its key's parity, and takes
// lane l ^ 4's; register (r, c) reads half c % 2 of the word, at bit 8 (c / 2 % 2) + 2 (r % 2) + shift
template <class Kernel>
void backward(int query0, int key0) {
  typename Kernel::TiledMmaKeys mma;
  auto coords = [&](int tid) {
    return flashgen::sm80::rows_cols(mma.get_thread_slice(tid).partition_C(
        make_identity_tensor(Shape<Int<Kernel::kBlockN>, Int<Kernel::kQueryChunk>>{})));
  };
  for (int tid = 0; tid < Kernel::kKeyThreads; ++tid) {
    auto tScS = coords(tid);
    for (int r = 0; r < size<0>(tScS); ++r) {
      for (int c = 0; c < size<1>(tScS); ++c) {
        Place const element = rule(query0 + get<1>(tScS(r, c)), key0 + get<0>(tScS(r, c)));
        int const key = get<0>(tScS(2 * (r / 2), 0));
        int const drawer = key % 2 == c % 2 ? tid : tid ^ 4;  // the lane whose call fills half c % 2
        auto theirs = coords(drawer);
        int const their_key = get<0>(theirs(2 * (r / 2), 0));
        expect(their_key % 2 == c % 2, "backward: the drawing lane draws the other half", tid, r, c);
        Place const drawn = rule(query0 + get<1>(theirs(0, 4 * (c / 4))) + their_key % 2, key0 + their_key);
        expect(element.c0 == drawn.c0 && element.c1 == drawn.c1, "backward: another call", tid, r, c);
        int const shift = 4 * (key / 16 % 2) + key % 2;
        expect(element.byte == 8 * (c / 2 % 2) + 2 * (r % 2) + shift, "backward: another byte", tid, r, c);
      }
    }
  }
}

int main() {
@CALLS@
  std::printf("%d failures\n", failures);
  return failures != 0;
}
"""


def layout_program() -> str:
    calls = []
    for k in dropout_kernels(Sm80Fwd):  # a block past the first, of a tile past the first
        calls.append(f"  forward<{k.cpp_type}>({3 * k.block_m}, {5 * k.block_n});")
    for k in dropout_kernels(Sm80Bwd):  # query chunk 1 of a step past the first, a key block past the first
        calls.append(f"  backward<{k.cpp_type}>({3 * k.block_m + k.block_m // 2}, {5 * k.block_n});")
    return LAYOUT_CHECK.replace("@CALLS@", "\n".join(calls))


@pytest.mark.nvcc
def test_the_kernels_bookkeeping_matches_the_rule_on_cutes_layouts(toolchain, tmp_path):
    source = tmp_path / "layouts.cu"
    source.write_text(layout_program())
    exe = tmp_path / "layouts"
    abi = [f"-I{generator.INSTANCES_DIR / family}" for family in ("sm80_fwd", "sm80_bwd")]
    subprocess.run([str(toolchain.nvcc), *NVCC_FLAGS, *(f"-I{d}" for d in include_dirs(toolchain)), *abi,
                    "-o", str(exe), str(source)], check=True, capture_output=True, timeout=600)
    result = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "0 failures", result.stdout


# The policy: which pair draws a call's mask on which GPU, under FLASHGEN_FAMILIES, with which kernels built


def sm80_constants(spec):
    """What a build would read back from an sm80 instance's cubin."""
    smem = (2 * spec.max_k * (spec.block_m + spec.stages * spec.block_n) if spec.FAMILY == "sm80_fwd"
            else __import__("flashgen.spec.sm80_bwd", fromlist=["shared_bytes"]).shared_bytes(
                spec.max_k, spec.block_m, spec.block_n, spec.warps))
    known = dict(threads_per_block=128 if spec.FAMILY == "sm80_fwd" else 32 * spec.warps, min_blocks_per_sm=1,
                 shared_memory_bytes=smem, block_m=spec.block_m, block_n=spec.block_n, max_k=spec.max_k,
                 stages=getattr(spec, "stages", 0), alignment=8, params_bytes=type(spec).params_dtype().itemsize,
                 aux_threads=128)
    return {c.name: known[c.name] for c in type(spec).CONSTANTS}


@pytest.fixture
def build(tmp_path, monkeypatch):
    """A registry of f16 kernels (the sm90 pair for sm90a, the sm80 pair for sm80 and plain sm90: the
    families asked), on the GPU ``info`` the test sets."""
    monkeypatch.delenv(plans.FAMILIES_VARIABLE, raising=False)

    def registry(info, sm90=True, sm80=True, only=None):
        for module in (sm90_common, dropout):
            monkeypatch.setattr(module, "device_info", lambda index: info)
        kernels = []
        if sm90:
            kernels += [(k, {"sm90a": hopper_constants(k)}) for cls in (Sm90Fwd, Sm90Bwd) for k in cls.default_set()
                        if k.dtype == "f16" and not k.score_mod]
        if sm80:
            kernels += [(k, {"sm80": sm80_constants(k), "sm90": sm80_constants(k)}) for cls in (Sm80Fwd, Sm80Bwd)
                        for k in cls.default_set() if k.dtype == "f16"]
        if only is not None:
            kernels = [(k, t) for k, t in kernels if only(k)]
        directory = tmp_path / f"build{len(list(tmp_path.iterdir()))}"
        write_build(directory, kernels)
        return Registry([directory])
    return registry


def dropout_call(direction, registry, K=64, Kv=None, **options):
    call = fake_call(direction, dropout_p=0.1, seed=1, arrays=qkv(K=K, Kv=Kv), **options)
    return dataclasses.replace(call, options={**call.options, "registry": registry})


def taker(call):
    """The first family of the call's direction that takes it (dispatch's choice), by name."""
    return next((f.name for f in families.serving(call.direction) if f.refusal(call) is None), None)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("info,sm90,pair", [(H100, True, "sm90"), (H100, False, "sm80"), (A100, False, "sm80"),
                                            (A10, False, "sm80"), (L4, False, "sm80")])
def test_each_gpu_draws_on_one_pair_in_both_directions(direction, info, sm90, pair, build):
    """The first pair built for the GPU takes the call, the other pair and example 41 refuse it saying
    which pair draws it; on an sm86/sm89 part the 128 tier's backward takes the tile within 99 KB."""
    registry = build(info, sm90=sm90)
    for K in (64, 96, 128):
        call = dropout_call(direction, registry, K=K)
        chosen, _ = dropout.drawing_pair(call)
        assert chosen.name == pair
        assert taker(call) == f"{pair}_{direction}"
        expected = f"the {pair} pair draws this dropout call's mask, in both directions (runtime/dropout.py)"
        assert mem_eff_fwd.unfit_example41(call) == expected
        if pair == "sm90":
            assert families.runtime(f"sm80_{direction}").refusal(call) == expected
        kernel = families.runtime(taker(call)).kernel(call, families.runtime(taker(call)).request(call))
        assert kernel.spec.dropout and kernel.spec.max_k == (64 if K == 64 else 128)
        if pair == "sm80" and direction == "bwd" and K > 64:
            assert kernel.spec.block_m * kernel.spec.block_n == (64 * 128 if info.cc in (80, 90) else 32 * 64)


def test_the_ampere_pair_serves_a_hopper_where_only_it_is_built_or_forced(build, monkeypatch):
    both = build(H100)
    call = dropout_call("fwd", both)
    assert dropout.drawing_pair(call)[0].name == "sm90"
    monkeypatch.setenv(plans.FAMILIES_VARIABLE, FORCED_SM80)
    assert dropout.drawing_pair(call)[0].name == "sm80"
    for direction in ("fwd", "bwd"):
        assert taker(dropout_call(direction, both)) == f"sm80_{direction}"
    monkeypatch.setenv(plans.FAMILIES_VARIABLE, "sm80_fwd,sm90_bwd,mem_eff_fwd,mem_eff_bwd")
    pair, why = dropout.drawing_pair(call)
    assert pair is None and why == (
        "sm90 pair: dropout needs both sm90_fwd and sm90_bwd (one mask for both directions); FLASHGEN_FAMILIES "
        "leaves one out; sm80 pair: dropout needs both sm80_fwd and sm80_bwd (one mask for both directions); "
        "FLASHGEN_FAMILIES leaves one out")
    for direction in ("fwd", "bwd"):
        assert taker(dropout_call(direction, both)) == f"mem_eff_{direction}", "example 41 in both directions"


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_a_pair_with_one_direction_unbuilt_leaves_the_call_to_the_next_or_to_example_41(direction, build):
    """The decision reads only what both directions' calls share: with the sm90 backward unbuilt the sm80
    pair draws both directions; with the sm80 backward's dropout instance unbuilt too, example 41 does."""
    no_sm90_bwd = build(H100, only=lambda k: not (k.FAMILY == "sm90_bwd" and k.dropout))
    assert taker(dropout_call(direction, no_sm90_bwd)) == f"sm80_{direction}"
    neither = build(A100, only=lambda k: not (k.FAMILY == "sm80_bwd" and k.dropout))
    call = dropout_call(direction, neither)
    assert taker(call) == f"mem_eff_{direction}"
    assert families.runtime(f"sm80_{direction}").refusal(call) == (
        "sm90 pair: a compute-capability 9.0 GPU (H100, H200); GPU 0 is NVIDIA A100-SXM4-80GB (sm_80); "
        "sm80 pair: no sm80_bwd dropout kernel for f16, head dim 64, band=False is built for this GPU")


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_refusals_say_what_no_pair_takes(direction, build):
    registry = build(A100, sm90=False)
    own = families.runtime(f"sm80_{direction}")
    why = {"softcap": own.refusal(dropout_call(direction, registry, softcap=2.0)),
           "head dim": own.refusal(dropout_call(direction, registry, K=192)),
           "dims": own.refusal(dropout_call(direction, registry, K=64, Kv=128))}
    assert why["softcap"] == "dropout without attn_bias, block masks or softcap (the example-41 families draw such masks)"
    assert why["head dim"] == "dropout with equal q/v head dims up to 128; the call has 192 and 192"
    assert why["dims"].startswith("equal q/v head dims only")
    assert own.refusal(dropout_call(direction, registry, window=(4, 4))) is None, "windows run on the pair"
    assert own.refusal(dropout_call(direction, registry, causal="bottom_right")) is None
    turing = build(T4, sm90=False)
    assert dropout.drawing_pair(dropout_call(direction, turing))[0] is None
    assert taker(dropout_call(direction, turing)) == f"mem_eff_{direction}"


def test_validation_leaves_past_example_41s_offsets_to_either_pair(monkeypatch):
    monkeypatch.delenv(plans.FAMILIES_VARIABLE, raising=False)
    p = fake_call(dropout_p=0.1, seed=1).p
    for info, expected in ((A100, True), (A10, True), (H100, True), (T4, False)):
        monkeypatch.setattr(dropout, "device_info", lambda index, info=info: info)
        assert dropout.may_draw(p) is expected, info.name
    monkeypatch.setattr(dropout, "device_info", lambda index: A100)
    monkeypatch.setenv(plans.FAMILIES_VARIABLE, "sm90_fwd,sm90_bwd,mem_eff_fwd,mem_eff_bwd")
    assert not dropout.may_draw(p), "an A100 with only the sm90 pair allowed: example 41's limits apply"
