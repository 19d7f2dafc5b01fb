"""Score mods compiled into the Hopper kernels, without a GPU: the generated functors, the instances a
mods file adds (names, generate --mods), what the manifest records, selection by name and digest,
the "not built" error and the checks of captured tensors.  Nothing here imports CuPy (tests/runtime_fakes.py's
fakes stand in for arrays)."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from flashgen.build import manifest
from flashgen.build.graph import Job
from flashgen.cli import main
from flashgen.errors import UnsupportedError
from flashgen.mods import BUILTIN_MODS, ModError, ScoreMod
from flashgen.runtime import families, score_mods as runtime_mods
from flashgen.runtime.families import sm90_common
from flashgen.runtime.registry import Registry
from flashgen.spec import default_kernels, mod_kernels, score_mods
from flashgen.spec.sm90_bwd import Sm90Bwd
from flashgen.spec.sm90_fwd import Sm90Fwd
from runtime_fakes import H100, FakeArray, fake_call, hopper_constants, qkv, write_build

EXAMPLE = Path(__file__).parent / "score_mods_example.py"
ALIBI = BUILTIN_MODS["alibi"]


@pytest.fixture(autouse=True)
def block_cupy(monkeypatch):
    """`import cupy` raises ImportError inside every test; FakeArrays pass as the arrays validation views."""
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setattr(runtime_mods, "as_array", lambda x, name: x)


@pytest.fixture(autouse=True)
def declared(monkeypatch):
    """Declarations made by a test end with it."""
    monkeypatch.setattr(score_mods, "_declared", dict(score_mods._declared))


def test_the_alibi_functor_reads_its_slope_through_the_params():
    code = score_mods.functor("alibi")
    assert code.startswith(f"// score mod alibi (digest {ALIBI.digest()[:16]}): score - slope[h] * abs(q_idx - kv_idx)")
    assert "struct ScoreMod_alibi {\n  static constexpr bool kEnabled = true;" in code
    assert "      float const* t = static_cast<float const*>(p.mod_ptr[0]);\n" in code
    assert "      long long const at = i0 * p.mod_stride[0][0];\n      return __ldg(t + at);" in code
    assert "    return static_cast<float>((score - (slope(h) * abs((q_idx - kv_idx)))));" in code
    grad = code[code.index("grad(Params"):]
    assert "slope" not in grad and "return static_cast<float>(1);" in grad, "grad reads no tensor it does not use"
    assert score_mods.functor("") == "" and score_mods.cpp_type("") == "flashgen::sm90::NoScoreMod"


def test_a_custom_functor_indexes_every_tensor_with_its_strides_and_dtype():
    score_mods.declare({"doc_bias": ScoreMod("doc[b, kv_idx] == doc[b, q_idx] ? score + w[h] : score - 1e4",
                                             tensors={"doc": "i32[B, N]", "w": "bf16[H]"}, grad="1")})
    code = score_mods.functor("doc_bias")
    assert "int const* t = static_cast<int const*>(p.mod_ptr[0]);" in code
    assert "long long const at = i0 * p.mod_stride[0][0] + i1 * p.mod_stride[0][1];" in code
    assert "unsigned short const* t = static_cast<unsigned short const*>(p.mod_ptr[1]);" in code
    assert "static_cast<float>(cutlass::bfloat16_t::bitcast(__ldg(t + at)))" in code
    assert "((doc(b, kv_idx) == doc(b, q_idx)) ? (score + w(h)) : (score - 1e4f))" in code
    k = mod_kernels(["doc_bias"])[0]
    assert k.cpp_type.endswith(", ScoreMod_doc_bias>") and k.score_mod_functor == code


@pytest.mark.parametrize("mod,message", [
    (ScoreMod("score *\n + 2", grad="1"), "ScoreMod bad, line 2, column 2: expected a number"),
    (ScoreMod("score + 1", grad="dscore"), "ScoreMod bad grad, line 1, column 1: unknown name 'dscore'"),
    (ScoreMod("score + 1"), "grad= .* is required; gradients into captured tensors are not computed"),
    (ScoreMod("score + a[0] + b2[0] + c[0] + d[0] + e[0]", grad="1",
              tensors={n: "f32[1]" for n in ("a", "b2", "c", "d", "e")}), "at most 4 captured tensors"),
])
def test_a_malformed_declaration_is_refused_before_anything_is_generated(mod, message):
    with pytest.raises(ModError, match=message):
        score_mods.declare({"bad": mod})
    with pytest.raises(ModError, match="score mod 'bad' is not declared"):
        score_mods.functor("bad")


def test_a_mods_file_adds_instances_named_by_their_mods():
    names = score_mods.declare_file(EXAMPLE)
    assert names == ["tanh_cap", "tempered"]
    kernels = mod_kernels(names + ["alibi"])  # alibi is in the default set already
    assert len(kernels) == 2 * 16
    alibi = {k.name for cls in (Sm90Fwd, Sm90Bwd) for k in cls.default_set() if k.score_mod}
    assert {k.name.replace("_mod_tempered_", "_mod_alibi_") for k in kernels if k.score_mod == "tempered"} == alibi
    assert all(f"_mod_{k.score_mod}_" in k.name for k in kernels)


def test_generate_with_a_mods_file_renders_its_instances(tmp_path):
    result = CliRunner().invoke(main, ["generate", "--mods", str(EXAMPLE), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    source = (tmp_path / "sm90_fwd" / "sm90_fwd_bf16_k128_q128x128_s2_band_mod_tempered_sm90a.cu").read_text()
    assert "struct ScoreMod_tempered {" in source and "return static_cast<float>((score * temp(h)));" in source
    assert "FwdKernel<cutlass::bfloat16_t, 128, 128, 128, 2, true, false, false, false, false, ScoreMod_tempered>" in source
    check = CliRunner().invoke(main, ["generate", "--check", "--mods", str(EXAMPLE), "--out", str(tmp_path)])
    assert check.exit_code == 0 and f"{len(default_kernels()) + 2 * 16} instance sources" in check.output
    plain = CliRunner().invoke(main, ["generate", "--check", "--out", str(tmp_path)])
    assert plain.exit_code == 1 and "extra: " in plain.output, "the mods' sources are not the default set's"
    bad = tmp_path / "bad.py"
    bad.write_text("from flashgen.mods import ScoreMod\nm = ScoreMod('score +', grad='1')\n")
    result = CliRunner().invoke(main, ["generate", "--mods", str(bad), "--out", str(tmp_path)])
    assert result.exit_code == 1 and "ScoreMod m, line 1, column 8: expected a number" in result.output


def test_the_manifest_records_the_declaration_and_the_registry_reads_it(tmp_path):
    alibi = next(k for k in Sm90Fwd.default_set() if k.score_mod)
    record = manifest.kernel_record(Job(alibi, "sm90a", tmp_path / "x.cu"))
    assert record["score_mod"] == {"name": "alibi", "expr": ALIBI.expr, "grad": "1", "tensors": {"slope": "f32[H]"},
                                   "digest": ALIBI.digest()}
    plain = next(k for k in Sm90Fwd.default_set() if not k.score_mod)
    assert "score_mod" not in manifest.kernel_record(Job(plain, "sm90a", tmp_path / "y.cu"))
    write_build(tmp_path, [(alibi, {"sm90a": hopper_constants(alibi)}), (plain, {"sm90a": hopper_constants(plain)})])
    data = json.loads((tmp_path / manifest.MANIFEST_NAME).read_text())
    for entry in data["kernels"]:
        if entry["name"] == alibi.name:
            entry["score_mod"] = record["score_mod"]
    (tmp_path / manifest.MANIFEST_NAME).write_text(json.dumps(data))
    reg = Registry([tmp_path])
    assert reg.binaries[(alibi.name, "sm90a")].score_mod["digest"] == ALIBI.digest()
    assert reg.binaries[(plain.name, "sm90a")].score_mod is None
    assert score_mods.from_record(record["score_mod"]) == ALIBI
    with pytest.raises(ModError, match="does not match its digest"):
        score_mods.from_record(dict(record["score_mod"], expr="score + slope[h]"))


class FakeRegistry:
    """The registry as selection and validation read it: binaries per family, and their mod records."""

    def __init__(self, specs, digest=None):
        self.by_family = {}
        for spec in specs:
            rec = None
            if spec.score_mod:
                rec = dict(score_mods.record(spec.score_mod), **({"digest": digest} if digest else {}))
            b = SimpleNamespace(spec=spec, name=spec.name, target="sm90a", constants=hopper_constants(spec), score_mod=rec)
            self.by_family.setdefault(spec.FAMILY, []).append(b)
        self.binaries = {(b.name, b.target): b for bs in self.by_family.values() for b in bs}

    def for_device(self, family, device):
        if family not in self.by_family:
            raise UnsupportedError(f"no {family} kernel can run on {device.name}")
        return sorted(self.by_family[family], key=lambda b: b.spec.priority)


def mod_call(direction, registry, score_mod="alibi", tensors=None, arrays=None, **options):
    """A validated score-mod call over FakeArrays (B=2, M=5, N=7, H=3, K=64)."""
    q, k, v = arrays or qkv()
    options = dict(score_mod=score_mod, mod_tensors=tensors if tensors is not None else {
        "slope": FakeArray((3,), np.float32)}, registry=registry, attn_bias=None, block_mask=None, **options)
    call = fake_call(direction, arrays=(q, k, v), **options)
    return dataclasses.replace(call, score_mod=runtime_mods.bind(options, call.p, q, k))


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_a_score_mod_call_picks_the_mod_instance_on_a_hopper_gpu(direction, monkeypatch):
    monkeypatch.setattr(sm90_common, "device_info", lambda index: H100)
    cls = Sm90Fwd if direction == "fwd" else Sm90Bwd
    reg = FakeRegistry([k for k in cls.default_set() if k.dtype == "f16"])
    hopper = families.serving(direction)[0]
    call = mod_call(direction, reg)
    assert call.score_mod.name == "alibi" and call.score_mod.digest == ALIBI.digest()
    chosen = hopper.kernel(call, hopper.request(call))
    assert chosen.spec.score_mod == "alibi" and chosen.spec.max_k == 64 and not chosen.spec.band
    band = mod_call(direction, reg, causal="top_left")
    assert hopper.kernel(band, hopper.request(band)).spec.band
    plain = hopper.kernel(fake_call(direction, registry=reg), hopper.request(fake_call(direction, registry=reg)))
    assert plain.spec.score_mod == "", "a call without a mod never takes a mod instance"
    for other in families.serving(direction)[1:]:
        assert "no score mods" in families.score_mod_refusal(other, call)


def test_an_instance_built_from_another_declaration_is_refused(monkeypatch):
    monkeypatch.setattr(sm90_common, "device_info", lambda index: H100)
    reg = FakeRegistry([k for k in Sm90Fwd.default_set() if k.dtype == "f16"], digest="0" * 64)
    hopper = families.serving("fwd")[0]
    call = mod_call("fwd", reg)
    assert hopper.kernel(call, hopper.request(call)) is None
    assert "built from another declaration of score mod 'alibi'" in hopper.refusal(call)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_a_mod_that_is_not_built_names_the_command_that_builds_it(direction, monkeypatch):
    monkeypatch.setattr(sm90_common, "device_info", lambda index: H100)
    cls = Sm90Fwd if direction == "fwd" else Sm90Bwd
    reg = FakeRegistry([k for k in cls.default_set() if not k.score_mod])
    with pytest.raises(UnsupportedError, match=r"score mod 'alibi' is not built: build its sm90 instances with "
                                               r"`flashgen build --arch sm90a --kernels '\*_mod_alibi_\*' "
                                               r"--out <dir>`"):
        families.dispatch(mod_call(direction, reg))
    with pytest.raises(UnsupportedError, match=r"score mod 'tempered' is not built: .*`flashgen build --mods <the mods "
                                               r"file declaring it> --arch sm90a --kernels '\*_mod_tempered_\*'"):
        mod_call(direction, reg, score_mod="tempered", tensors={})
    with pytest.raises(UnsupportedError, match="is not built"):
        mod_call(direction, reg, score_mod=ScoreMod("score * 2", grad="2"), tensors={})


def test_a_custom_mod_is_found_by_its_manifest_record_or_its_declaration(monkeypatch):
    monkeypatch.setattr(sm90_common, "device_info", lambda index: H100)
    score_mods.declare_file(EXAMPLE)
    reg = FakeRegistry(mod_kernels(["tempered"]))
    temp = {"temp": FakeArray((3,), np.float32)}
    by_name = mod_call("fwd", reg, score_mod="tempered", tensors=temp).score_mod
    by_declaration = mod_call("fwd", reg, score_mod=score_mods.lookup("tempered"), tensors=temp).score_mod
    assert by_name.name == by_declaration.name == "tempered" and by_name.digest == by_declaration.digest
    assert by_name.fields() == {"mod_ptr_0": temp["temp"].data.ptr, "mod_stride_0_0": 1}


@pytest.mark.parametrize("tensors,error,message", [
    ({}, ModError, r"ScoreMod alibi captures \['slope'\]; got none"),
    ({"slope": FakeArray((3,), np.float16)}, TypeError, r"tensor 'slope' must be float32 \(f32\[H\]\), got float16"),
    ({"slope": FakeArray((4,), np.float32)}, ValueError, r"declared f32\[H\] \(H=3\); got shape \(4,\)"),
    ({"slope": FakeArray((3,), np.float32, device=1)}, ValueError,
     r"mod_tensors\['slope'\] is on GPU 1, q is on GPU 0"),
    ({"slope": FakeArray((3,), np.float32, strides=(2,))}, ValueError, r"mod_tensors\['slope'\] must be contiguous"),
    ({"slope": SimpleNamespace(requires_grad=True, dtype="torch.float32", shape=(3,))}, UnsupportedError,
     r"requires grad, but gradients into captured tensors are not computed"),
    ([1.0], TypeError, "mod_tensors must be a dict"),
])
def test_captured_tensors_are_checked_before_launch(tensors, error, message):
    with pytest.raises(error, match=message):
        mod_call("fwd", FakeRegistry([]), tensors=tensors)


@pytest.mark.parametrize("options,message", [
    (dict(softcap=2.0), "with softcap"),
    (dict(dropout_p=0.1, seed=1), "with dropout"),
    (dict(causal="bottom_right", arrays=qkv(M=9, N=7)), "with causal='bottom_right' with more queries than keys"),
])
def test_options_no_mod_instance_takes_are_refused(options, message):
    with pytest.raises(UnsupportedError, match=f"score mod 'alibi' {message}"):
        mod_call("fwd", FakeRegistry([]), **options)


def test_names_that_are_no_built_score_mod_say_what_to_do():
    reg = FakeRegistry([])
    with pytest.raises(UnsupportedError, match="run-time option softcap=c"):
        mod_call("fwd", reg, score_mod="softcap", tensors={})
    with pytest.raises(ValueError, match=r"'document' is a mask mod: pass it as a block mask, "
                                         r"block_mask=flashgen.block_mask\('document', B, H, M, N, mod_tensors=...\)"):
        mod_call("fwd", reg, score_mod="document", tensors={})
    with pytest.raises(TypeError, match="score_mod must be a mod's name or a flashgen.mods.ScoreMod"):
        mod_call("fwd", reg, score_mod=3, tensors={})
    options = dict(score_mod=None, mod_tensors={"slope": 1}, registry=reg)
    with pytest.raises(ValueError, match="mod_tensors without score_mod"):
        runtime_mods.bind(options, None, None, None)


def test_a_planned_call_passes_captured_tensors_by_sorted_name_and_the_plan_points_each_at_its_own():
    """api's plan signature takes the tensors by name in sorted order; the plan's pointer words follow
    the same order into the declaration's mod_ptr slots, whatever order the declaration has."""
    from flashgen.runtime import api

    z, a = FakeArray((3,), np.float32), FakeArray((3,), np.float32)
    mod = ScoreMod("score * z[h] + a[h]", tensors={"z": "f32[H]", "a": "f32[H]"}, grad="z[h]")
    bound = runtime_mods.BoundScoreMod("zed", mod.digest(), mod, ("z", "a"), (z, a))
    assert bound.plan_pointers() == ("mod_ptr_1", "mod_ptr_0")
    assert api._mod_arrays("zed", {"z": z, "a": a}) == ((a, z), ("a", "z"))
    assert api._mod_arrays("zed", None) == api._mod_arrays("zed", {}) == api._mod_arrays(None, None) == ((), ())
    # what validation refuses gets an array no signature takes, so the call goes there
    assert api._mod_arrays(None, {"z": z}) == ((None,), ())
    assert api._mod_arrays("zed", [z]) == ((None,), ())
