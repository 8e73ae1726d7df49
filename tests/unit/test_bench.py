"""specdec-bench without a server: prompt sets, aggregation, the cost-model
prediction from measured inputs, tables, the identity check's exit status and
the JSON/PNG files (a fake gRPC client stands in for the server in main())."""

from __future__ import annotations

import json
import math
import string
import sys

import pytest
from tritonclient.utils import InferenceServerException

from tools import bench
from tools.bench import (
    PLAIN,
    BenchError,
    Mode,
    PromptResult,
    aggregate,
    format_prompt_rows,
    format_summary,
    load_prompts,
    make_modes,
    parse_windows,
    predict_best_window,
    predict_fixed,
    prompt_rows,
    run_order,
    summarise,
    write_json,
    write_png,
)
from tools.client import Completion
from tools.prompts import PromptError, file_prompts, random_prompts

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def plain_completion(text="x = 1\n", tokens=40, seconds=10.0, plain_rounds=10, plain_seconds=2.0, ttft=0.5):
    return Completion(text=text, completion_tokens=tokens, seconds=seconds, plain_rounds=plain_rounds,
                      plain_seconds=plain_seconds, time_to_first_chunk=ttft)


def spec_completion(text="x = 1\n", tokens=40, seconds=8.0, drafted=20, accepted=16, rounds=5, rejected=4,
                    draft_seconds=1.6, verify_seconds=1.1, plain_rounds=0, fallback="", ttft=0.3):
    return Completion(text=text, completion_tokens=tokens, seconds=seconds, draft_tokens=drafted,
                      accepted_draft_tokens=accepted, acceptance_rate=accepted / drafted, speculative_rounds=rounds,
                      rejected_rounds=rejected, draft_seconds=draft_seconds, verify_seconds=verify_seconds,
                      plain_rounds=plain_rounds, fallback_reason=fallback, time_to_first_chunk=ttft)


MODES = make_modes(5, [4])  # plain, adaptive (<=5), fixed-4


def one_prompt(spec_text="x = 1\n", prompt_id="p0"):
    return PromptResult(prompt_id, [PLAIN, "adaptive", "fixed-4"], {
        PLAIN: plain_completion(),
        "adaptive": spec_completion(text=spec_text),
        "fixed-4": spec_completion(),
    })


# -- prompts -----------------------------------------------------------------

def test_random_prompts_are_reproducible_random_characters():
    prompts = random_prompts(3, seed=7)
    assert prompts == random_prompts(3, seed=7)
    assert prompts != random_prompts(3, seed=8)
    assert [p for p, _ in prompts] == ["random/0", "random/1", "random/2"]
    allowed = set(string.ascii_letters + string.digits + string.punctuation)
    for _, prompt in prompts:
        assert len(prompt) == 200 and set(prompt) <= allowed
    assert len({prompt for _, prompt in prompts}) == 3


def test_file_prompts_accept_json_strings_objects_and_plain_lines(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('"def f():\\n    "\n\nplain text line\n{"task_id": "T/1", "prompt": "def g():"}\n42\n')
    assert file_prompts(path) == [
        ("prompts.jsonl:1", "def f():\n    "),
        ("prompts.jsonl:3", "plain text line"),
        ("T/1", "def g():"),
        ("prompts.jsonl:5", "42"),
    ]
    assert load_prompts(f"file:{path}", first=0, last=0, count=1, seed=0)[0][0] == ("prompts.jsonl:1", "def f():\n    ")


def test_empty_or_missing_prompt_files_are_usage_errors(tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(PromptError, match="no prompts"):
        file_prompts(tmp_path / "empty.txt")
    with pytest.raises(BenchError, match="cannot read"):
        load_prompts(f"file:{tmp_path / 'missing.txt'}", first=0, last=0, count=1, seed=0)
    with pytest.raises(BenchError, match="humaneval, random or file:PATH"):
        load_prompts("mbpp", first=0, last=0, count=1, seed=0)


def test_humaneval_range_and_the_reserved_problems_note():
    prompts, notes = load_prompts("humaneval", first=0, last=2, count=0, seed=0)
    assert [p for p, _ in prompts] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert notes == []
    prompts, notes = load_prompts("humaneval", first=98, last=101, count=0, seed=0)
    assert len(prompts) == 4 and len(notes) == 1 and "reserved" in notes[0]
    with pytest.raises(BenchError, match="0-163"):
        load_prompts("humaneval", first=0, last=164, count=0, seed=0)


# -- modes -------------------------------------------------------------------

def test_modes_plain_adaptive_and_fixed_windows():
    assert make_modes(5, [4, 1]) == [
        Mode("plain", 0), Mode("adaptive", 5, True), Mode("fixed-1", 1, False), Mode("fixed-4", 4, False)
    ]
    assert parse_windows("1,2, 4,6") == [1, 2, 4, 6]
    with pytest.raises(BenchError):
        make_modes(5, [2, 2])
    with pytest.raises(BenchError):
        make_modes(0)


def test_modes_rotate_so_each_runs_first_equally_often():
    modes = make_modes(5, [2])
    orders = [[m.name for m in run_order(modes, i)] for i in range(3)]
    assert orders == [["plain", "adaptive", "fixed-2"], ["adaptive", "fixed-2", "plain"],
                      ["fixed-2", "plain", "adaptive"]]
    two = make_modes(5)
    assert [m.name for m in run_order(two, 1)] == ["adaptive", "plain"]  # alternation with two modes


# -- aggregation and prediction -------------------------------------------------

def test_aggregate_sums_over_prompts():
    totals = aggregate([spec_completion(ttft=0.1), spec_completion(tokens=20, seconds=2.0, ttft=0.3),
                        spec_completion(ttft=0.2, fallback="recent acceptance 0.10 below fallback_threshold 0.3")])
    assert totals.prompts == 3
    assert totals.tokens_per_second == 100 / 18.0
    assert totals.acceptance == 48 / 60
    assert totals.alpha == 48 / (48 + 12)
    assert totals.tokens_per_round == 100 / 15
    assert totals.p50_time_to_first_chunk == 0.2
    assert totals.fallbacks == 1
    empty = aggregate([])
    assert empty.tokens_per_second is None and empty.alpha is None and empty.p50_time_to_first_chunk is None


def test_fixed_window_prediction_uses_the_formula_with_measured_inputs():
    summary = summarise([one_prompt()], MODES)
    # t_plain = 2.0 s / 10 plain rounds = 0.2 s; fixed-4: 1.6 s / 20 drafts = 0.08 s -> c = 0.4,
    # 1.1 s / 5 rounds = 0.22 s -> v = 1.1, alpha = 16 / (16 + 4) = 0.8
    # E(4) = 1 + 0.8 + 0.64 + 0.512 + 0.4096 = 3.3616; predicted = 3.3616 / (4 * 0.4 + 1.1) = 3.3616 / 2.7
    assert math.isclose(summary["t_plain_seconds"], 0.2)
    fixed = summary["modes"][2]
    assert fixed["mode"] == "fixed-4"
    assert math.isclose(fixed["draft_cost"], 0.4)
    assert math.isclose(fixed["verify_cost"], 1.1)
    assert math.isclose(fixed["alpha"], 0.8)
    assert math.isclose(fixed["predicted_speedup"], 3.3616 / 2.7)
    assert fixed["predicted_window"] == 4
    # measured: 40 tokens in 8 s vs 40 in 10 s -> 1.25x
    assert math.isclose(fixed["speedup"], 1.25)
    assert math.isclose(fixed["measured_over_predicted"], 1.25 / (3.3616 / 2.7))
    assert math.isclose(fixed["tokens_per_round"], 40 / 5)
    plain = summary["modes"][0]
    assert plain["predicted_speedup"] is None and plain["speedup"] == 1.0


def test_best_window_prediction_prefers_measured_verify_costs():
    # alpha 0.9, c 0.1, own v 1.0; the fixed mode measured v(5) = 2.0:
    # K=4: E = 1 + .9 + .81 + .729 + .6561 = 4.0951, / (0.4 + 1.0) = 2.925
    # K=5: E = 4.68559, / (0.5 + 2.0) = 1.874 -> K = 4 wins
    k, speedup = predict_best_window(0.9, 0.1, 5, {5: 2.0}, 1.0)
    assert k == 4 and math.isclose(speedup, 4.0951 / 1.4)
    # without the measured v(5), K = 5 wins: 4.68559 / 1.5
    k, speedup = predict_best_window(0.9, 0.1, 5, {}, 1.0)
    assert k == 5 and math.isclose(speedup, 4.68559 / 1.5)
    # alpha 0.5, c 0.5, v 1: K=1 gives exactly 1.5 / 1.5 = 1, never better -> plain
    assert predict_best_window(0.5, 0.5, 5, {}, 1.0) == (0, 1.0)
    assert predict_best_window(None, 0.5, 5, {}, 1.0) is None
    assert predict_fixed(0.8, 4, None, 1.0) is None


def test_adaptive_prediction_in_the_summary_uses_the_fixed_modes_verify_cost():
    summary = summarise([one_prompt()], MODES)
    adaptive = summary["modes"][1]
    assert summary["fixed_verify_costs"] == {"4": pytest.approx(1.1)}
    expected = predict_best_window(0.8, 0.4, 5, {4: 1.1}, 1.1)
    assert adaptive["predicted_window"] == expected[0]
    assert math.isclose(adaptive["predicted_speedup"], expected[1])


# -- identity check and exit status -------------------------------------------

def test_identical_texts_exit_zero():
    summary = summarise([one_prompt(), one_prompt(prompt_id="p1")], MODES)
    assert summary["mismatches"] == 0 and summary["exit_code"] == 0
    assert all(row["mismatches"] == 0 for row in summary["modes"])


def test_a_speculative_text_that_differs_from_plain_exits_one():
    summary = summarise([one_prompt(), one_prompt(spec_text="x = 2\n", prompt_id="p1")], MODES)
    assert summary["exit_code"] == 1
    assert summary["mismatches"] == 1
    assert summary["mismatched"] == [{"prompt": "p1", "mode": "adaptive"}]
    assert [row["mismatches"] for row in summary["modes"]] == [0, 1, 0]
    text = format_summary(summary, MODES)
    assert "| adaptive | ≤5" in text and "1/2 |" in text
    assert "MISMATCH: adaptive text differs from plain on p1" in text


# -- formatting ----------------------------------------------------------------

def test_tables():
    result = one_prompt(spec_text="other")
    lines = format_prompt_rows(result, MODES)
    assert len(lines) == 3
    assert lines[0].startswith("| p0 | plain | 40 | 4.00 | 1.00x |") and lines[0].endswith("| ref |")
    assert "| 1.25x | 0.80 | 0.80 | 8.00 | 0.30 | **NO** |" in lines[1]
    assert lines[2].endswith("| yes |")
    summary = summarise([result], MODES)
    table = format_summary(summary, MODES).splitlines()
    assert table[0].startswith("| mode | K | tok/s | vs plain |")
    assert table[2].startswith("| plain | 0 | 4.00 | 1.00x |")
    assert table[4].startswith(
        "| fixed-4 | 4 | 5.00 | 1.25x | 0.80 | 0.80 | 8.00 | 0.30 | 0.40 | 1.10 | 1.25x | 100% |")
    assert "t_plain = 200.0 ms" in "\n".join(table)


def test_summary_flags_fallbacks_and_a_low_measured_over_predicted():
    result = one_prompt()
    result.completions["fixed-4"] = spec_completion(seconds=20.0, plain_rounds=3, fallback="recent acceptance low")
    text = format_summary(summarise([result], MODES), MODES)
    assert "40% ⚠" in text  # measured 0.5x vs predicted 1.245x: 0.5 / 1.245 = 40 %
    assert "fixed-4: 1 of 1 prompts stopped speculating" in text


# -- files ---------------------------------------------------------------------

def test_json_and_png_files(tmp_path):
    results = [one_prompt(), one_prompt(prompt_id="p1")]
    summary = summarise(results, MODES)
    write_json(tmp_path / "out" / "bench.json", {"summary": summary, "rows": prompt_rows(results, MODES)})
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert data["summary"]["exit_code"] == 0
    assert len(data["rows"]) == 6
    row = data["rows"][1]
    assert row["prompt"] == "p0" and row["mode"] == "adaptive" and row["position"] == 1
    assert row["identical"] is True and row["text"] == "x = 1\n" and "deltas" not in row
    write_png(tmp_path / "out" / "bench.png", summary, title="test")
    assert (tmp_path / "out" / "bench.png").read_bytes().startswith(PNG_SIGNATURE)


# -- main() with a fake server ---------------------------------------------------

class FakeClient:
    ready = True

    def __init__(self, url):
        self.url = url

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def is_model_ready(self, name):
        if self.ready is None:
            raise InferenceServerException("failed to connect to all addresses")
        return self.ready


@pytest.fixture
def fake_server(monkeypatch):
    """Plain decoding: 4 tok/s; any speculative mode: 5 tok/s; identical texts
    unless the prompt contains 'diverge' (then adaptive differs)."""
    sent = []

    def fake_build_inputs(prompt, max_tokens, **kwargs):
        return {"prompt": prompt, "max_tokens": max_tokens, **kwargs}

    def fake_stream(client, inputs, **_):
        sent.append(inputs)
        if inputs["speculation_window"] == 0:
            return plain_completion()
        diverge = "diverge" in inputs["prompt"] and inputs["adaptive_window"]
        return spec_completion(text="x = 2\n" if diverge else "x = 1\n")

    monkeypatch.setattr(bench, "build_inputs", fake_build_inputs)
    monkeypatch.setattr(bench, "stream_completion", fake_stream)
    monkeypatch.setattr(bench.grpcclient, "InferenceServerClient", FakeClient)
    FakeClient.ready = True
    return sent


def test_main_writes_json_and_png(fake_server, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a\nb\nc\n")
    out = tmp_path / "results"
    code = bench.main(["--prompts", f"file:{prompts}", "--fixed-windows", "1,4", "--max-tokens", "16",
                       "--json", str(out / "bench.json"), "--png", str(out / "bench.png"), "--per-prompt"])
    assert code == 0
    # greedy, one request per prompt and mode, the modes' windows as asked
    assert len(fake_server) == 3 * 4
    assert {(i["speculation_window"], i["adaptive_window"]) for i in fake_server} == {
        (0, None), (5, True), (1, False), (4, False)}
    assert all(i["temperature"] == 0.0 and i["max_tokens"] == 16 for i in fake_server)
    data = json.loads((out / "bench.json").read_text())
    assert data["command"].startswith("specdec-bench --prompts file:")
    assert data["timestamp"].endswith("+00:00")
    assert data["settings"]["fixed_windows"] == [1, 4]
    assert [m["name"] for m in data["modes"]] == ["plain", "adaptive", "fixed-1", "fixed-4"]
    assert len(data["rows"]) == 12 and data["exit_code"] == 0 and data["incomplete"] is None
    assert [row["mode"] for row in data["summary"]["modes"]] == ["plain", "adaptive", "fixed-1", "fixed-4"]
    assert (out / "bench.png").read_bytes().startswith(PNG_SIGNATURE)
    printed = capsys.readouterr().out
    assert "| prompts.txt:2 | fixed-4 |" in printed and "| mode | K |" in printed


def test_main_exits_one_on_a_mismatch(fake_server, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a\nplease diverge\n")
    assert bench.main(["--prompts", f"file:{prompts}", "--json", str(tmp_path / "b.json")]) == 1
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["summary"]["mismatched"] == [{"prompt": "prompts.txt:2", "mode": "adaptive"}]
    assert data["exit_code"] == 1


def test_main_without_a_server_exits_two(fake_server, capsys):
    FakeClient.ready = None
    assert bench.main(["--prompts", "random", "--count", "2"]) == 2
    assert "cannot reach the server at localhost:8001" in capsys.readouterr().err


def test_a_window_above_the_servers_cap_is_explained(fake_server, monkeypatch, capsys):
    def reject(client, inputs, **_):
        raise InferenceServerException("speculation_window must be between 0 and the server's speculation_window (5)")

    monkeypatch.setattr(bench, "stream_completion", reject)
    assert bench.main(["--prompts", "random", "--count", "1", "--fixed-windows", "6"]) == 2
    assert "SPECDEC_SPECULATION_WINDOW raises it" in capsys.readouterr().err


def test_png_without_matplotlib_fails_before_running(fake_server, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert bench.main(["--prompts", "random", "--count", "1", "--png", "x.png"]) == 2
    assert "--png needs matplotlib" in capsys.readouterr().err
    assert fake_server == []  # nothing was sent
    # without --png, matplotlib is not needed
    assert bench.main(["--prompts", "random", "--count", "1"]) == 0


def test_a_run_cut_short_keeps_the_completed_prompts_and_exits_two(fake_server, monkeypatch, tmp_path):
    served = bench.stream_completion

    def fail_on_the_second_prompt(client, inputs, **kwargs):
        if len(fake_server) >= 2:  # both modes of the first prompt were served
            raise InferenceServerException("connection lost")
        return served(client, inputs, **kwargs)

    monkeypatch.setattr(bench, "stream_completion", fail_on_the_second_prompt)
    assert bench.main(["--prompts", "random", "--count", "3", "--json", str(tmp_path / "b.json")]) == 2
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["incomplete"] == "server error: connection lost" and data["exit_code"] == 2
    assert data["summary"]["prompts"] == 1 and len(data["rows"]) == 2
