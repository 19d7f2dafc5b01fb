"""Tuning tables (flashgen/runtime/tuning.py): buckets, the file format, which table applies,
and how a table's choice steers selection and the key-split count.  No GPU needed."""
from __future__ import annotations

import json

import pytest

from flashgen.bench import default_grid
from flashgen.runtime import plans, tuning
from flashgen.runtime.registry import Registry
from flashgen.runtime.select import Selector, num_splits_key
from runtime_fakes import (  # noqa: F401 (fixture helpers, not fixtures)
    BWD_SMEM, F16_K64, F16_K64_DROP, F16_K128, F16_K128_BIG, FWD_SMEM, H100, K64, K128_BIG, RTX3090, constants, req,
    write_build,
)


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    d = tmp_path_factory.mktemp("kernels")
    specs = {**BWD_SMEM, **FWD_SMEM}
    write_build(d, [(s, {t: constants(s, smem) for t in ("sm80", "sm90")}) for s, smem in specs.items()])
    return Registry([d])


@pytest.fixture(autouse=True)
def no_table_installed(monkeypatch):
    monkeypatch.delenv("FLASHGEN_TUNING", raising=False)
    yield
    tuning.use_table(None)


def bucket(**overrides):
    args = dict(family="mem_eff_bwd", dtype="f16", head_dim=64, head_dim_value=64, causal=False, num_queries=4096,
                num_keys=4096, batch_heads=64)
    args.update(overrides)
    return tuning.Bucket.of(**args)


@pytest.mark.parametrize("K,Kv,tier", [(1, 1, 32), (32, 32, 32), (33, 8, 64), (64, 96, 96), (128, 128, 128),
                                       (129, 64, 192), (193, 8, 256), (256, 256, 256), (257, 64, 0)])
def test_head_dim_tiers_cover_both_head_dims(K, Kv, tier):
    assert bucket(head_dim=K, head_dim_value=Kv).head_dim == tier


def test_sequence_and_parallelism_round_up_to_powers_of_two():
    b = bucket(num_queries=1000, num_keys=3000, batch_heads=17)
    assert (b.seqlen, b.batch_heads) == (4096, 32)
    assert bucket(num_queries=4096, num_keys=4096, batch_heads=16) == bucket(num_queries=2049, num_keys=1,
                                                                             batch_heads=9)
    assert bucket(num_queries=0, num_keys=0, batch_heads=0).seqlen == 1


def test_backward_buckets_keep_grouped_query_calls_apart_forward_buckets_do_not():
    assert bucket(group=8) != bucket(group=1) == bucket()
    assert bucket(group=5) == bucket(group=8)  # rounded up to a power of two like the other sizes
    assert bucket(family="mem_eff_fwd", group=8) == bucket(family="mem_eff_fwd")


def table(entries, device=H100):
    return tuning.Table(device.name, device.cc, entries, {"command": "test"})


def test_table_round_trips_through_its_file(tmp_path):
    entries = {bucket(): tuning.Choice(tuning.tile_of(F16_K128), "one"),
               bucket(group=4): tuning.Choice(tuning.tile_of(F16_K64)),
               bucket(family="mem_eff_fwd", causal=True): tuning.Choice((("queries_per_block", 32),
                                                                        ("keys_per_block", 128), ("max_k", 128)))}
    path = tmp_path / "t.json"
    table(entries).save(path)
    loaded = tuning.Table.load(path)
    assert loaded.entries == entries and (loaded.device_name, loaded.cc) == (H100.name, 90)
    assert not list(tmp_path.glob(".*tmp"))  # written through a temporary file and renamed
    data = json.loads(path.read_text())
    for row in data["entries"]:
        row.pop("group")  # a table written before buckets had groups: every entry multi-head
    assert set(tuning.Table.from_json(data, "old").entries) == {bucket(), bucket(family="mem_eff_fwd", causal=True)}


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(schema=1), "schema 1, this flashgen reads 2"),
    # a Hopper tile as schema 1 wrote it, without its head-dim tier
    (lambda d: d["entries"][0].update(family="sm90_bwd", tile={"block_m": 64, "block_n": 64, "stages": 2}),
     "malformed entry .*max_k"),
    (lambda d: d["entries"][0].update(splits="sometimes"), "unknown split policy 'sometimes'"),
    (lambda d: d["entries"][0].pop("seqlen"), "malformed entry"),
    (lambda d: d["entries"][0]["tile"].pop("preload"), "malformed entry"),
])
def test_bad_tables_are_refused_naming_the_file(tmp_path, mutate, match):
    data = table({bucket(): tuning.Choice(tuning.tile_of(F16_K128))}).to_json()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match) as e:
        tuning.Table.load(path)
    assert str(path) in str(e.value) and "flashgen tune" in str(e.value)


def test_truncated_table_is_refused(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text(json.dumps(table({}).to_json())[:20])
    with pytest.raises(ValueError, match="cannot read it"):
        tuning.Table.load(path)


def test_a_table_applies_only_to_its_own_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "_shipped", [])
    choice = tuning.Choice(tuning.tile_of(F16_K128))
    tuning.use_table(table({bucket(): choice}))
    assert tuning.choice(H100, bucket()) == choice
    assert tuning.choice(RTX3090, bucket()) is None  # another GPU: priority order
    assert tuning.choice(H100, bucket(causal=True)) is None  # a bucket it did not measure
    monkeypatch.setenv("FLASHGEN_TUNING", "off")
    assert tuning.choice(H100, bucket()) is None


def test_env_names_a_table_and_shipped_tables_are_the_fallback(tmp_path, monkeypatch):
    shipped = table({bucket(): tuning.Choice(tuning.tile_of(F16_K128))})
    monkeypatch.setattr(tuning, "_shipped", [shipped])
    assert tuning.choice(H100, bucket()).tile == tuning.tile_of(F16_K128)
    path = tmp_path / "mine.json"
    table({bucket(): tuning.Choice(tuning.tile_of(F16_K64), "one")}).save(path)
    monkeypatch.setenv("FLASHGEN_TUNING", str(path))
    assert tuning.choice(H100, bucket()) == tuning.Choice(tuning.tile_of(F16_K64), "one")


def test_installing_a_table_forgets_every_launch_plan():
    plans.remember(("some", "call"), object())
    tuning.use_table(table({}))
    assert plans.lookup(("some", "call")) is None


def test_a_tuned_tile_wins_over_the_priority_order_when_it_accepts_the_call(reg):
    sel = Selector(reg)
    r = req(head_dim=64)
    assert sel.select(r).spec == F16_K64  # priority order: smallest kMaxK that fits
    prefer = tuning.Choice(tuning.tile_of(F16_K128_BIG))
    assert sel.select(r, prefer).spec == F16_K128_BIG
    # the tile the table names cannot serve dropout: the dropout kernel of the priority order serves it
    assert sel.select(req(head_dim=64, dropout=True), prefer).spec == F16_K64_DROP
    # and where the tuned tile does not fit the device (sm86: 99 KB), the priority order again
    assert sel.select(req(head_dim=64, device=RTX3090), prefer).spec == F16_K64


def test_explain_tries_the_tuned_tile_first_and_selects_what_selection_does(reg):
    """With a table's choice, explain lists the kernels in the order find tries them and marks the one it
    picks; the kernel the priority order would have picked says the table's tile came first."""
    sel = Selector(reg)
    prefer = tuning.Choice(tuning.tile_of(F16_K128_BIG))
    for r in (req(head_dim=64), req(head_dim=64, dropout=True), req(head_dim=64, device=RTX3090)):
        rows = sel.explain(r, prefer)
        assert [name for name, _, why in rows if why == "selected"] == [sel.select(r, prefer).name]
        assert sorted(name for name, *_ in rows) == sorted(name for name, *_ in sel.explain(r))  # each kernel once
    rows = sel.explain(req(head_dim=64), prefer)
    assert rows[0][0] == F16_K128_BIG.name and rows[0][2] == "selected"
    passed_over = {name: why for name, _, why in rows}[F16_K64.name]
    assert passed_over.startswith("not tried: the tuning table's tile") and "FLASHGEN_TUNING=off" in passed_over
    # without a choice, the priority order (and no mention of a table)
    assert {name: why for name, _, why in sel.explain(req(head_dim=64))}[F16_K64.name] == "selected"


def test_split_policies():
    assert num_splits_key(K64, 4, 1, 4096, H100, policy="auto") == 64  # 4096 / 64 key blocks
    assert num_splits_key(K64, 4, 1, 4096, H100, policy="key_blocks") == 64
    assert num_splits_key(K64, 4, 1, 4096, H100, policy="one") == 1
    assert num_splits_key(K64, 4, 1, 4096, H100, policy="wave") == 64  # one wave is 99 blocks: 64 key blocks
    assert num_splits_key(K64, 4, 1, 16384, H100, policy="wave") == 99  # ceil(132 SMs * 3 blocks / 4)
    assert num_splits_key(K64, 1000, 1, 4096, H100, policy="auto") == 1  # B*H fills the GPU
    assert num_splits_key(K64, 1000, 1, 4096, H100, policy="key_blocks") == 64  # the table may still split
    assert num_splits_key(K128_BIG, 4, 1, 4096, H100, policy="wave") == 32  # 4096 / 128 < ceil(132 / 4)


# === flashgen tune's bookkeeping, with the measurements faked ===================================

@pytest.fixture
def fake_measurements(monkeypatch):
    """tune() with a fake CuPy and device, two candidates per direction and scripted timings."""
    import sys
    import types

    from flashgen import tune as tune_module
    from flashgen.runtime import device as device_module

    fake = types.ModuleType("cupy")
    fake.__version__ = "fake"
    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(device_module, "device_info", lambda index: H100)
    monkeypatch.setattr("flashgen.runtime.registry.default_registry", lambda: None)
    tiles = {"fwd": [("prio", tuning.Choice((("queries_per_block", 64), ("keys_per_block", 64), ("max_k", 64)))),
                     ("other", tuning.Choice((("queries_per_block", 32), ("keys_per_block", 128), ("max_k", 128))))],
             "bwd": [("prio", tuning.Choice(tuning.tile_of(F16_K64))),
                     ("split1", tuning.Choice(tuning.tile_of(F16_K64), "one"))]}
    monkeypatch.setattr(tune_module, "candidates", lambda registry, device, p, direction: tiles[direction])
    measured = []

    def measure(p, direction, registry, device, repeats, options):
        measured.append((p.seqlen, direction))
        # the backward's "one" split is 10% faster at seqlen 1024 and a tie elsewhere
        fast = direction == "bwd" and p.seqlen == 1024
        return {"default": 1.0, "prio": 1.0, "other": 1.0, "split1": 0.9 if fast else 0.995}

    monkeypatch.setattr(tune_module, "measure_choices", measure)
    # no registry here: the example-41 families, as on a GPU without sm90a kernels
    monkeypatch.setattr(tune_module, "family_for", lambda direction, registry, device: f"mem_eff_{direction}")
    return tune_module, measured


def test_tune_records_only_clear_wins_and_saves_after_every_point(fake_measurements, tmp_path, monkeypatch):
    tune_module, measured = fake_measurements
    out = tmp_path / "table.json"
    points = default_grid(dtypes=("f16",), head_dims=(64,), seqlens=(512, 1024))
    saves = []
    real_save = tuning.Table.save
    monkeypatch.setattr(tuning.Table, "save", lambda self, path: (saves.append(len(self.measured["points"])),
                                                                  real_save(self, path)))
    table = tune_module.tune(points, 3, lambda line: None, "flashgen tune", out)
    assert saves == list(range(1, 2 * len(points) + 1))  # written after every point and direction
    assert len(measured) == 2 * len(points)
    # only the backward at 1024 beat the priority order by more than 1% (0.995 is within it)
    assert {(b.family, b.seqlen, c.splits) for b, c in table.entries.items()} == {("mem_eff_bwd", 1024, "one")}
    assert tuning.Table.load(out).entries == table.entries


def test_grouped_query_points_tune_backward_buckets_of_their_own_group(fake_measurements, tmp_path):
    """A --group 4 point's backward win goes to the group-4 bucket: the runtime then takes it for a group-4
    backward (any group rounding up to 4), not for the multi-head call of the same size; a multi-head point
    and its grouped twin are measured and resumed apart.  The forward, whose buckets have no group, is
    measured at the multi-head points only."""
    tune_module, measured = fake_measurements
    out = tmp_path / "table.json"
    points = default_grid(dtypes=("f16",), head_dims=(64,), seqlens=(1024,), groups=(1, 4))
    table = tune_module.tune(points, 3, lambda line: None, "flashgen tune", out)
    assert sorted(measured) == [(1024, "bwd")] * 4 + [(1024, "fwd")] * 2
    assert {(b.causal, b.group) for b in table.entries} == {(False, 1), (True, 1), (False, 4), (True, 4)}
    tuning.use_table(table)
    grouped = bucket(num_queries=1024, num_keys=1024, batch_heads=16 * 32, group=3)
    assert tuning.choice(H100, grouped) == tuning.choice(H100, bucket(num_queries=1024, num_keys=1024,
                                                                      batch_heads=16 * 32, group=4))
    assert tuning.choice(H100, bucket(num_queries=1024, num_keys=1024, batch_heads=16 * 32, group=2)) is None
    measured.clear()
    tune_module.tune(points, 3, lambda line: None, "flashgen tune", out)  # everything measured: resumed, none timed
    assert measured == []


def test_several_passes_record_each_choices_median_taken_in_alternating_order(fake_measurements, tmp_path,
                                                                             monkeypatch):
    """With three passes a choice is recorded only where it beat the priority order in every pass and by
    more than 1% in the medians: one that won two passes by 10-20% and lost the third records nothing;
    every other pass times the candidates in reverse, and each point keeps its passes' times."""
    tune_module, _ = fake_measurements
    orders, passes_done = [], {}

    def measure(p, direction, registry, device, repeats, options):
        key = (p.causal, p.seqlen, direction)
        n = passes_done[key] = passes_done.get(key, 0) + 1
        orders.append((direction, n, [label for label, _ in options]))
        # the forward's "other" wins two passes by far (median 0.9) and loses the third; the backward's
        # "one" split wins all three, by 10%, 2% and 5% (median 0.95)
        return {"default": 1.0, "prio": 1.0, "other": {1: 0.8, 2: 0.9, 3: 1.02}[n],
                "split1": {1: 0.9, 2: 0.98, 3: 0.95}[n]}

    monkeypatch.setattr(tune_module, "measure_choices", measure)
    points = default_grid(dtypes=("f16",), head_dims=(64,), seqlens=(512,))
    table = tune_module.tune(points, 3, lambda line: None, "flashgen tune", tmp_path / "t.json", passes=3)
    assert {(b.family, c.splits) for b, c in table.entries.items()} == {("mem_eff_bwd", "one")}
    assert [order for direction, _, order in orders if direction == "fwd"][:3] == [["prio", "other"],
                                                                                  ["other", "prio"],
                                                                                  ["prio", "other"]]
    record = next(m for m in table.measured["points"] if m["direction"] == "fwd")
    assert record["ms"]["other"] == 0.9 and [run["other"] for run in record["passes"]] == [0.8, 0.9, 1.02]
    assert record["chosen"] == "default"
    assert table.measured["passes"] == 3
    with pytest.raises(ValueError, match="passes must be at least 1"):
        tune_module.tune(points, 3, lambda line: None, "flashgen tune", tmp_path / "u.json", passes=0)
    # a table resumes only with the passes it was measured with (one, for tables from before --passes)
    with pytest.raises(ValueError, match=r"with 3 pass\(es\) a point, this run asks for 1: pass --passes 3"):
        tune_module.tune(points, 3, lambda line: None, "flashgen tune", tmp_path / "t.json")


def gpu_free_measure_choices(monkeypatch):
    """flashgen.tune with a fake CuPy and API module and inputs, so measure_choices runs without a GPU."""
    import sys
    import types

    from flashgen import runtime
    from flashgen import tune as tune_module

    fake = types.ModuleType("cupy")
    fake.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(runtime, "api", types.ModuleType("flashgen.runtime.api"), raising=False)
    monkeypatch.setitem(sys.modules, "flashgen.runtime.api", runtime.api)
    monkeypatch.setattr(tune_module, "inputs", lambda p: ["inputs"])
    return tune_module


def test_choices_are_timed_in_rounds_that_start_one_choice_further_on(monkeypatch):
    """Every choice is timed in every round under its own one-entry table, after an untimed call (the
    new table dropped the plans); each round starts one choice further down the list, so the default is
    not always the first timed on a cool GPU; a choice's time is the median of all its rounds' calls."""
    tune_module = gpu_free_measure_choices(monkeypatch)
    monkeypatch.setattr(tune_module, "family_for", lambda direction, registry, device: "sm90_fwd")
    monkeypatch.setattr(tune_module, "bucket_of", lambda p, family: "bucket")
    monkeypatch.setattr(tune_module, "run_call", lambda api, direction, p, sets: "call")
    installed = []
    monkeypatch.setattr(tuning, "use_table", lambda table: installed.append(
        None if table is None else dict(table.entries).get("bucket", "default")))
    monkeypatch.setattr(tuning, "choice", lambda device, bucket: installed[-1])  # what the runtime would consult
    rounds, slow = [], {"default": 0.0, "a": 0.0, "b": 0.0}

    def event_times(fn, warmup, repeats):
        label = installed[-1]
        rounds.append((label, warmup, repeats))
        slow[label] += 1.0  # each round of a choice a millisecond slower: the median is the middle round's
        return [slow[label]] * repeats

    monkeypatch.setattr(tune_module, "event_times", event_times)
    point = default_grid(dtypes=("f16",), head_dims=(64,), seqlens=(512,))[0]
    times = tune_module.measure_choices(point, "fwd", None, H100, 30, only=[("a", "a"), ("b", "b")])
    per_round = 30 // tune_module.ROUNDS
    assert [label for label, _, _ in rounds[:6]] == ["default", "a", "b", "a", "b", "default"]
    assert [label for label, _, _ in rounds[::3]] == ["default", "a", "b", "default", "a"][:tune_module.ROUNDS]
    assert all(warmup >= 1 and repeats == per_round for _, warmup, repeats in rounds)
    assert len(rounds) == 3 * tune_module.ROUNDS and installed[-1] is None  # the table is taken back
    assert times == {label: float((tune_module.ROUNDS + 1) // 2) for label in ("default", "a", "b")}


@pytest.mark.parametrize("setting", ["off", "", "/elsewhere/table.json"])
def test_choices_are_timed_only_where_the_runtime_consults_the_tuners_tables(monkeypatch, setting):
    """FLASHGEN_TUNING=off makes the runtime ignore every table, so each choice would time the priority
    order; measure_choices refuses before timing anything.  A table named by the variable is fine: the
    tuner's own, installed with use_table, comes first."""
    tune_module = gpu_free_measure_choices(monkeypatch)
    monkeypatch.setattr(tune_module, "run_call", lambda api, direction, p, sets: "call")
    monkeypatch.setattr(tune_module, "family_for", lambda direction, registry, device: "mem_eff_bwd")
    monkeypatch.setattr(tuning, "_env_table", lambda path: table({}))
    monkeypatch.setenv("FLASHGEN_TUNING", setting)
    timed = []
    monkeypatch.setattr(tune_module, "event_times", lambda fn, warmup, repeats: timed.append(1) or [1.0])
    point = default_grid(dtypes=("f16",), head_dims=(64,), seqlens=(512,))[0]
    only = [("k128", tuning.Choice(tuning.tile_of(F16_K128)))]
    if setting == "off":
        with pytest.raises(ValueError, match="does not consult .*FLASHGEN_TUNING='off': unset it"):
            tune_module.measure_choices(point, "bwd", None, H100, 5, only=only)
        assert timed == [1]  # the default alone, before the first choice was refused
    else:
        times = tune_module.measure_choices(point, "bwd", None, H100, 5, only=only)
        assert set(times) == {"default", "k128"}
    assert tuning._override is None  # the tuner's table is taken back either way


def test_tune_resumes_and_refuses_another_gpus_table(fake_measurements, tmp_path):
    tune_module, measured = fake_measurements
    out = tmp_path / "table.json"
    points = default_grid(dtypes=("f16",), head_dims=(64,), seqlens=(512, 1024))
    tune_module.tune(points[:2], 3, lambda line: None, "flashgen tune", out)  # "interrupted" after two points
    done = len(measured)
    table = tune_module.tune(points, 3, lambda line: None, "flashgen tune", out)
    assert len(measured) - done == 2 * (len(points) - 2)  # only the points the file did not hold
    assert len(table.measured["points"]) == 2 * len(points)
    assert table.measured["command"] == "flashgen tune"  # the same command resumed is named once
    grouped = default_grid(dtypes=("f16",), head_dims=(64,), seqlens=(512,), groups=(4,))
    table = tune_module.tune(grouped, 3, lambda line: None, "flashgen tune --group 4", out)
    assert table.measured["command"] == "flashgen tune; resumed by: flashgen tune --group 4"  # both are kept
    other = tmp_path / "other.json"
    tuning.Table(RTX3090.name, RTX3090.cc, {}, {"points": []}).save(other)
    with pytest.raises(ValueError, match="RTX 3090.*pass another --out"):
        tune_module.tune(points, 3, lambda line: None, "flashgen tune", other)


def test_tune_times_the_family_the_runtime_dispatches_to():
    """The first family in dispatch order with kernels for the GPU: sm90 where built, else example 41."""
    from types import SimpleNamespace

    from flashgen.errors import UnsupportedError
    from flashgen.tune import family_for

    def registry(*built):
        def for_device(family, device):
            if family not in built:
                raise UnsupportedError(f"no {family} kernel")
            return ["a kernel"]
        return SimpleNamespace(for_device=for_device)

    everything = registry("sm90_fwd", "sm90_bwd", "mem_eff_fwd", "mem_eff_bwd")
    assert [family_for(d, everything, H100) for d in ("fwd", "bwd")] == ["sm90_fwd", "sm90_bwd"]
    example41 = registry("mem_eff_fwd", "mem_eff_bwd")
    assert [family_for(d, example41, RTX3090) for d in ("fwd", "bwd")] == ["mem_eff_fwd", "mem_eff_bwd"]


def test_tune_refuses_a_direction_that_flashgen_families_leaves_empty(monkeypatch):
    """FLASHGEN_FAMILIES naming only forward families leaves the backward nothing to time: an
    UnsupportedError that names the variable, not an IndexError."""
    from types import SimpleNamespace

    from flashgen.errors import UnsupportedError
    from flashgen.tune import family_for

    monkeypatch.setenv("FLASHGEN_FAMILIES", "sm80_fwd,mem_eff_fwd")
    everything = SimpleNamespace(for_device=lambda family, device: ["a kernel"])
    assert family_for("fwd", everything, H100) == "sm80_fwd"
    with pytest.raises(UnsupportedError, match="no bwd family to tune: FLASHGEN_FAMILIES"):
        family_for("bwd", everything, H100)


@pytest.mark.parametrize("path", sorted(tuning.SHIPPED.glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_entry_names_a_kernel_the_default_set_builds_at_its_buckets_tier(path):
    """A shipped table's tile must be a kernel the wheel builds, of the head-dim tier its bucket is for:
    schema-1 tiles without a tier put the H200's bf16 d128 backward on the k192 kernel, and a tile pruned
    from the default set later would silently fall back."""
    from flashgen.spec import FAMILIES

    table = tuning.Table.load(path)
    assert table.entries
    for b, c in table.entries.items():
        kernels = [k for k in FAMILIES[b.family].default_set() if k.dtype == b.dtype]
        assert c.tile in {tuning.tile_of(k) for k in kernels}, (b, c)
        # the tuner's tier: the smallest that takes the bucket's head dims
        assert dict(c.tile)["max_k"] == min(k.max_k for k in kernels if k.max_k >= b.head_dim), (b, c)


def test_doctor_reports_the_table_in_use_and_entries_no_built_kernel_has(reg, tmp_path, monkeypatch):
    """doctor's tuning lines: the table for the GPU and its entries that select nothing on this build (a tile
    of another tier, or pruned since); none for a GPU without a table; off; an unreadable named table."""
    stray = tuning.Choice(tuple((axis, 12345) for axis, _ in tuning.tile_of(F16_K128)))
    tuning.use_table(table({bucket(): tuning.Choice(tuning.tile_of(F16_K128)),
                            bucket(num_queries=512, num_keys=512): stray}))
    lines = tuning.report(H100, reg)
    assert lines[0] == "tuning: <memory>, 2 buckets" and len(lines) == 2
    assert "no built kernel has the tile of mem_eff_bwd f16 d64 512 tokens" in lines[1] and "12345" in lines[1]
    assert tuning.report(RTX3090, reg) == [
        "tuning: no table for NVIDIA GeForce RTX 3090 (sm_86): the priority order; `flashgen tune` measures one"]
    monkeypatch.setenv("FLASHGEN_TUNING", "off")
    assert tuning.report(H100, reg) == ["tuning: off (FLASHGEN_TUNING=off): the priority order everywhere"]
    tuning.use_table(None)
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps(dict(table({}).to_json(), schema=1)))
    monkeypatch.setenv("FLASHGEN_TUNING", str(bad))
    [line] = tuning.report(H100, reg)
    assert "schema 1, this flashgen reads 2" in line and "flashgen tune" in line
