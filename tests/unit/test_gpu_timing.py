"""tools/gpu_timing.py on a CPU with its tiny configs (the real run needs a GPU),
the embedded configs against the published parameter counts, and its JSON
taken as a sim preset by sim_engine/presets.py, the launcher and sim_bench."""

from __future__ import annotations

import json
import math

import pytest
import torch

from launcher import launch, profiles, tritonserver
from sim_engine.presets import PRESETS, UnknownPreset, ideal, preset, preset_from_table
from tools import gpu_timing, sim_bench

FIRST, SECOND = "qwen2.5-coder-1.5b-0.5b", "llama-3.1-8b-3.2-1b"
ROWS, DRAFTS = [1, 8, 32], [1, 2]
TINY_RUN = ["--tiny", "--device", "cpu", "--rows", "1,8,32", "--contexts", "16", "--drafts", "1,2", "--repeats", "3",
            "--warmup", "1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-timing")
    json_path, md_path = out / "table.json", out / "table.md"
    argv = TINY_RUN + ["--pairs", f"{FIRST},{SECOND}", "--output", str(json_path), "--markdown", str(md_path)]
    assert gpu_timing.main(argv) == 0
    return json_path, json.loads(json_path.read_text()), md_path.read_text()


def positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_the_table_records_the_machine_the_models_and_says_tiny_and_upper_bound(run):
    _, table, md = run
    assert table["tiny"] is True and "TINY" in table["note"] and "upper bound" in table["note"]
    assert {"device", "torch", "transformers", "cuda", "dtype"} <= set(table["machine"])
    assert table["machine"]["dtype"] == "bfloat16" and table["stopped"] is None
    names = [m["name"] for m in table["models"]]
    assert names == ["tiny " + n for n in (*gpu_timing.PAIRS[FIRST], *gpu_timing.PAIRS[SECOND])]
    for model in table["models"]:
        assert model["parameters"] > 0 and model["skipped"] is None and model["skipped_points"] == []
        assert [(p["context"], p["rows"]) for p in model["decode"]] == [(16, r) for r in ROWS]
        assert [(p["drafts"], p["rows"]) for p in model["verify"]] == [(k, k + 1) for k in DRAFTS]
        assert all(positive(p["ms"]) for p in model["decode"] + model["verify"])
    assert "TINY" in md and "upper bound" in md and f"#{FIRST}" in md


def test_each_pair_gets_a_preset_of_positive_bases_and_finite_slopes_of_at_least_0(run):
    _, table, _ = run
    assert [p["name"] for p in table["pairs"]] == [FIRST, SECOND] and table["unfitted_pairs"] == []
    for pair in table["pairs"]:
        assert pair["context"] == 16 and pair["served"] == (pair["name"] == FIRST)
        for role in ("target", "draft"):
            step = pair["preset"][role]
            # the slope is clamped at 0: the tiny models' rows cost next to nothing on a fast
            # CPU, so their fitted slope is timing noise and may come out negative
            assert set(step) == {"base_ms", "per_row_ms"} and positive(step["base_ms"])
            assert isinstance(step["per_row_ms"], float) and math.isfinite(step["per_row_ms"])
            assert step["per_row_ms"] >= 0
            decode = next(m for m in table["models"] if m["name"] == f"tiny {pair[role]}")["decode"]
            assert step["base_ms"] == decode[0]["ms"]


def test_the_table_loads_as_a_sim_preset_its_first_pair_or_a_named_one(run):
    path, table, _ = run
    first, second = preset(str(path)), preset(f"{path}#{SECOND}")
    assert first.name == f"{path}#{FIRST}" and second.name == f"{path}#{SECOND}"
    assert first.target.base_ms == table["pairs"][0]["preset"]["target"]["base_ms"]
    assert second.draft.per_row_ms == table["pairs"][1]["preset"]["draft"]["per_row_ms"]
    defaults = PRESETS["h100-8b-1b"]
    assert (first.agreement, first.second_choice) == (defaults.agreement, defaults.second_choice)
    assert "h100-8b-1b" in first.source and "TINY" in first.source and "upper bound" in first.source
    speedup, window = ideal(first)
    assert speedup >= 1.0 and 0 <= window <= 8


def test_acceptance_comes_from_the_table_where_it_has_it(run, tmp_path):
    path, table, _ = run
    table["pairs"][0]["preset"].update(agreement=0.7, second_choice=0.4)
    edited = tmp_path / "with-acceptance.json"
    edited.write_text(json.dumps(table))
    p = preset_from_table(edited)
    assert (p.agreement, p.second_choice) == (0.7, 0.4) and "acceptance from the table" in p.source


def _edit(table, change):
    table = json.loads(json.dumps(table))
    change(table)
    return json.dumps(table)


BAD_TABLES = {
    "not JSON": (lambda t: "{not json", "not valid JSON"),
    "no pairs": (lambda t: _edit(t, lambda d: d.pop("pairs")), "no field 'pairs'"),
    "empty pairs": (lambda t: _edit(t, lambda d: d.update(pairs=[])), "no field 'pairs'"),
    "no preset": (lambda t: _edit(t, lambda d: d["pairs"][0].pop("preset")), "no field 'preset'"),
    "no draft": (lambda t: _edit(t, lambda d: d["pairs"][0]["preset"].pop("draft")), "no field 'preset.draft'"),
    "no base": (lambda t: _edit(t, lambda d: d["pairs"][0]["preset"]["target"].pop("base_ms")),
                "no field 'preset.target.base_ms'"),
    "zero base": (lambda t: _edit(t, lambda d: d["pairs"][0]["preset"]["target"].update(base_ms=0)),
                  "'preset.target.base_ms' must be above 0"),
    "negative slope": (lambda t: _edit(t, lambda d: d["pairs"][0]["preset"]["draft"].update(per_row_ms=-1)),
                       "'preset.draft.per_row_ms' must be a finite number"),
    "text slope": (lambda t: _edit(t, lambda d: d["pairs"][0]["preset"]["draft"].update(per_row_ms="1")),
                   "'preset.draft.per_row_ms' must be a finite number"),
    "agreement above 1": (lambda t: _edit(t, lambda d: d["pairs"][0]["preset"].update(agreement=1.5)),
                          "'preset.agreement' must be a probability"),
}


@pytest.mark.parametrize("case", BAD_TABLES)
def test_bad_tables_are_refused_naming_the_file_and_the_field(run, tmp_path, case):
    _, table, _ = run
    make, message = BAD_TABLES[case]
    bad = tmp_path / "bad.json"
    bad.write_text(make(table))
    with pytest.raises(UnknownPreset, match="bad.json") as error:
        preset(str(bad))
    assert message in str(error.value)


def test_a_missing_file_and_an_unknown_pair_are_refused(run, tmp_path):
    path, _, _ = run
    with pytest.raises(UnknownPreset, match="missing.json: cannot read it"):
        preset(str(tmp_path / "missing.json"))
    with pytest.raises(UnknownPreset, match=f"no pair 'nope'; pairs in the file: {FIRST}, {SECOND}"):
        preset(f"{path}#nope")
    with pytest.raises(UnknownPreset, match="or a timing table"):
        preset("h100")


def test_the_launcher_refuses_a_bad_table_at_start(run, tmp_path, capsys):
    path, table, _ = run
    bad = tmp_path / "bad.json"
    bad.write_text(_edit(table, lambda d: d["pairs"][0]["preset"]["target"].pop("per_row_ms")))
    repository = launch.PROJECT_ROOT / "model_repository"
    profiles.check("sim", f"{path}#{SECOND}", repository)
    with pytest.raises(profiles.ProfileError, match="no field 'preset.target.per_row_ms'"):
        profiles.check("sim", str(bad), repository)
    assert launch.main(["--profile", "sim", "--sim-preset", str(bad)]) == 2
    assert "no field 'preset.target.per_row_ms'" in capsys.readouterr().err


def test_the_engines_get_the_tables_path_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pair = launch.PreparedPair(tmp_path, tmp_path, tmp_path)
    install = tritonserver.TritonInstall(tmp_path / "tritonserver", tmp_path / "backends", tmp_path / "lib")
    env = launch.server_environment(launch.ServerOptions(sim_preset=f"tables/t.json#{FIRST}"), pair, install)
    assert env[profiles.PRESET_VAR] == f"{tmp_path.resolve()}/tables/t.json#{FIRST}"
    env = launch.server_environment(launch.ServerOptions(sim_preset="a100-8b-1b"), pair, install)
    assert env[profiles.PRESET_VAR] == "a100-8b-1b"


def test_sim_bench_takes_a_table_and_refuses_a_bad_one(run, tmp_path, capsys):
    path, table, _ = run
    text, _ = sim_bench.report([], f"{path}#{SECOND}", 128)
    assert f"target {table['pairs'][1]['preset']['target']['base_ms']} ms" in text
    with pytest.raises(SystemExit) as exit_:
        sim_bench.main(["--preset", str(tmp_path / "missing.json"), "--url", "http://127.0.0.1:1"])
    assert exit_.value.code == 2 and "missing.json: cannot read it" in capsys.readouterr().err


def test_the_budget_stops_adding_measurements_and_keeps_what_it_has(tmp_path):
    out = tmp_path / "t.json"
    argv = TINY_RUN[:3] + ["--rows", "1,2,4,8,16,32,64", "--contexts", "16,64", "--repeats", "5",
                           "--budget-seconds", "1", "--output", str(out)]
    assert gpu_timing.main(argv) == 0
    table = json.loads(out.read_text())
    assert table["stopped"] == "the budget of 1 s was spent"
    assert table["models"][0]["decode"] and table["models"][-1]["skipped"] == "the budget was spent before it"


@pytest.mark.parametrize("argv,message", [
    (["--rows", "0,1"], "argument --rows: each value must be from 1 to 256"),
    (["--rows", "1,x"], "argument --rows: comma-separated integers from 1 to 256"),
    (["--rows", "2,4"], "argument --rows: must include 1"),
    (["--rows", "1"], "argument --rows: must include 1"),
    (["--contexts", "99999"], "argument --contexts: each value must be from 1 to 16384"),
    (["--drafts", "17"], "argument --drafts: each value must be from 1 to 16"),
    (["--repeats", "0"], "argument --repeats: must be from 1 to 1000"),
    (["--warmup", "-1"], "argument --warmup: must be from 0 to 100"),
    (["--budget-seconds", "0"], "argument --budget-seconds: must be from 1.0 to 86400.0"),
    (["--pairs", "qwen,llama-3.1-8b-3.2-1b"], "argument --pairs: unknown pair(s) qwen; valid pairs: qwen2.5-coder"),
    (["--contexts", "128", "--fit-context", "512"], "argument --fit-context: 512 is not one of --contexts 128"),
    (["--device", "tpu"], "argument --device: cpu, cuda or cuda:N"),
])
def test_bad_options_are_refused_naming_the_option_and_the_limit(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_timing.main(["--tiny", "--device", "cpu"] + argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_cuda_device_is_refused(capsys):
    with pytest.raises(SystemExit):
        gpu_timing.main([])
    assert "argument --device: cuda but torch" in capsys.readouterr().err


# Published parameter counts (the models' cards) and the values that differ between them.
PUBLISHED = {
    "Qwen/Qwen2.5-Coder-0.5B-Instruct": (0.49e9, True),
    "Qwen/Qwen2.5-Coder-1.5B-Instruct": (1.54e9, True),
    "Qwen/Qwen2.5-Coder-7B-Instruct": (7.61e9, False),
    "meta-llama/Llama-3.2-1B-Instruct": (1.24e9, True),
    "meta-llama/Llama-3.1-8B-Instruct": (8.03e9, False),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_the_embedded_configs_give_the_published_parameter_counts(name):
    config = gpu_timing.config_of(gpu_timing.MODELS[name])
    published, tied = PUBLISHED[name]
    assert gpu_timing.count_parameters(config) == pytest.approx(published, rel=0.02)
    assert config.tie_word_embeddings is tied
    assert {m for pair in gpu_timing.PAIRS.values() for m in pair} == set(gpu_timing.MODELS) == set(PUBLISHED)


def test_a_slope_is_fitted_by_least_squares_and_a_negative_one_is_clamped_to_0():
    entry = {"name": "m", "skipped": None,
             "decode": [{"context": 16, "rows": r, "ms": ms} for r, ms in ((1, 5.0), (8, 5.7), (32, 8.1))]}
    step, _ = gpu_timing.step_time(entry, 16)
    assert step["base_ms"] == 5.0 and step["per_row_ms"] == pytest.approx(0.1, abs=1e-6) == step["slope_ms"]
    entry["decode"][2]["ms"] = 4.0  # noise: more rows timed faster
    step, _ = gpu_timing.step_time(entry, 16)
    assert step["slope_ms"] < 0 and step["per_row_ms"] == 0.0
