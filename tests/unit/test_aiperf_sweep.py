"""The AIPerf sweep without AIPerf: the table from trimmed real exports of
AIPerf 0.13.0 (tests/data/aiperf_export*.json: a clean template-endpoint run
and one where a request was refused), and the command lines the driver builds."""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

import pytest

from tools import aiperf_sweep
from tools.aiperf_table import ExportError, Run, build_rows, has_errors, markdown, run_metrics

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture(scope="module")
def export() -> dict:
    return json.loads((DATA / "aiperf_export.json").read_text())


@pytest.fixture(scope="module")
def export_with_error() -> dict:
    return json.loads((DATA / "aiperf_export_errors.json").read_text())


def halved(export: dict) -> dict:
    """The export of a run half as fast: throughputs halved, latencies doubled."""
    slower = copy.deepcopy(export)
    for metric in ("output_token_throughput", "request_throughput"):
        slower[metric]["avg"] /= 2
    for metric in ("time_to_first_token", "inter_token_latency", "request_latency"):
        slower[metric]["p50"] *= 2
    return slower


def test_metrics_are_read_from_the_export(export):
    figures = run_metrics(Run("template", 1, "on", export))
    assert figures["output_token_throughput"] == pytest.approx(export["output_token_throughput"]["avg"])
    assert figures["request_throughput"] == pytest.approx(export["request_throughput"]["avg"])
    assert figures["ttft_ms"] == pytest.approx(export["time_to_first_token"]["p50"])
    assert figures["itl_ms"] == pytest.approx(export["inter_token_latency"]["p50"])
    assert figures["request_latency_ms"] == pytest.approx(export["request_latency"]["p50"])
    assert figures["requests"] == 2 and figures["errors"] == 0 and figures["failure"] == ""
    assert figures["error_messages"] == []


def test_errors_and_their_messages_are_read_from_the_export(export_with_error):
    figures = run_metrics(Run("template", 1, "on", export_with_error))
    assert figures["errors"] == 1 and figures["requests"] == 2
    assert "speculation_window must be between 0 and 8" in figures["error_messages"][0]


def test_a_side_by_side_row_per_endpoint_and_concurrency_with_on_over_off(export):
    runs = [Run("template", 1, "on", export), Run("template", 1, "off", halved(export)),
            Run("template", 2, "on", halved(export)), Run("template", 2, "off", export),
            Run("chat", 1, "on", export), Run("chat", 1, "off", export)]
    rows = build_rows(runs)
    assert [(row["endpoint"], row["concurrency"]) for row in rows] == [("template", 1), ("template", 2), ("chat", 1)]
    assert rows[0]["ratio"]["output_token_throughput"] == pytest.approx(2.0)
    assert rows[0]["ratio"]["request_throughput"] == pytest.approx(2.0)
    assert rows[0]["ratio"]["ttft_ms"] == pytest.approx(0.5)
    assert rows[1]["ratio"]["output_token_throughput"] == pytest.approx(0.5)
    assert rows[2]["ratio"]["itl_ms"] == pytest.approx(1.0)
    assert not has_errors(rows)
    table = markdown(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + 3
    assert "| template | 1 | 2 / 2 |" in lines[2] and "**2.00×**" in lines[2] and lines[2].endswith("| 0 / 0 |")
    assert "**0.50×**" in lines[3]
    assert lines[0].count("|") == lines[2].count("|")


def test_errors_in_a_run_make_the_sweep_fail(export, export_with_error):
    rows = build_rows([Run("template", 1, "on", export_with_error), Run("template", 1, "off", export)])
    assert has_errors(rows)
    assert markdown(rows).splitlines()[2].endswith("| 1 / 0 |")


def test_a_run_without_an_export_is_a_failed_run(export):
    rows = build_rows([Run("template", 1, "on", export),
                       Run("template", 1, "off", None, "aiperf exited with status 1")])
    assert has_errors(rows)
    assert rows[0]["off"] == {"requests": 0, "errors": None, "failure": "aiperf exited with status 1"}
    assert rows[0]["ratio"]["output_token_throughput"] is None
    line = markdown(rows).splitlines()[2]
    assert "| – |" in line and line.endswith("| 0 / failed |")


def test_a_single_mode_leaves_the_other_empty(export):
    rows = build_rows([Run("completions", 4, "on", export)])
    assert rows[0]["off"] is None and not has_errors(rows)
    assert markdown(rows).splitlines()[2].endswith("| 0 / – |")


def test_an_export_of_another_shape_is_refused_by_name(export):
    broken = copy.deepcopy(export)
    broken["inter_token_latency"] = {"unit": "ms", "mean": 1.0}
    with pytest.raises(ExportError, match="inter_token_latency"):
        run_metrics(Run("template", 1, "on", broken))


def test_the_same_endpoint_concurrency_and_mode_twice_is_refused(export):
    with pytest.raises(ValueError, match="two runs"):
        build_rows([Run("chat", 1, "on", export), Run("chat", 1, "on", export)])


SETTINGS = aiperf_sweep.Settings("http://127.0.0.1:8000", "http://127.0.0.1:9000", "coordinator", "/tok", 3, 64, 16,
                                 600)


def _command(endpoint: str, mode: str, tmp_path: Path) -> list[str]:
    plan = aiperf_sweep.Plan(endpoint, 2, mode, 7, tmp_path / f"{endpoint}-{mode}")
    return aiperf_sweep.aiperf_command("/venv/bin/aiperf", plan, SETTINGS, ["--warmup-request-count", "1"])


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_the_template_command_streams_from_tritons_generate_extension(tmp_path):
    command = _command("template", "off", tmp_path)
    assert command[:2] == ["/venv/bin/aiperf", "profile"] and "--streaming" in command
    assert _option(command, "--endpoint-type") == "template"
    assert _option(command, "--url") == "http://127.0.0.1:8000"
    assert _option(command, "--endpoint") == "/v2/models/coordinator/generate_stream"
    extra = json.loads(_option(command, "--extra-inputs"))
    assert extra["response_field"] == "text_output" and extra["speculation_window"] == 0
    # What the template renders must be the coordinator's JSON body.
    rendered = extra["payload_template"].replace("{{ text|tojson }}", json.dumps('say "hi"')).replace(
        "{{ max_tokens }}", "16")
    assert json.loads(rendered) == {"text_input": 'say "hi"', "max_tokens": 16, "stream": True}
    assert _option(command, "--concurrency") == "2" and _option(command, "--request-count") == "3"
    assert _option(command, "--prompt-output-tokens-mean") == "16" and _option(command, "--random-seed") == "7"
    assert _option(command, "--output-artifact-dir") == str(tmp_path / "template-off")
    assert command[-2:] == ["--warmup-request-count", "1"] and "--no-server-metrics" in command


def test_server_metrics_asked_for_after_the_double_dash_are_not_switched_off(tmp_path):
    plan = aiperf_sweep.Plan("template", 1, "on", 1, tmp_path)
    extra = ["--server-metrics", "http://127.0.0.1:8002/metrics"]
    command = aiperf_sweep.aiperf_command("aiperf", plan, SETTINGS, extra)
    assert "--no-server-metrics" not in command and command[-2:] == extra


def test_openai_commands_carry_only_the_speculation_switch(tmp_path):
    for endpoint in ("chat", "completions"):
        off = _command(endpoint, "off", tmp_path)
        assert _option(off, "--endpoint-type") == endpoint and _option(off, "--url") == "http://127.0.0.1:9000"
        assert "--endpoint" not in off
        assert json.loads(_option(off, "--extra-inputs")) == {"speculation_window": 0}
        assert "--extra-inputs" not in _command(endpoint, "on", tmp_path)


def test_an_openai_base_url_with_v1_is_taken_as_openai_clients_take_it(tmp_path):
    plan = aiperf_sweep.Plan("chat", 1, "on", 1, tmp_path)
    for url in ("http://127.0.0.1:9000/v1", "http://127.0.0.1:9000/v1/", "http://127.0.0.1:9000"):
        settings = dataclasses.replace(SETTINGS, openai_url=url)
        assert _option(aiperf_sweep.aiperf_command("aiperf", plan, settings), "--url") == "http://127.0.0.1:9000"


def test_every_run_has_its_own_seed_and_directory(tmp_path):
    plans = aiperf_sweep.plan_runs(["template", "chat"], [1, 2], ["on", "off"], tmp_path, 10)
    assert [plan.name for plan in plans[:4]] == ["template-c1-on", "template-c1-off", "template-c2-on",
                                                 "template-c2-off"]
    assert len({plan.seed for plan in plans}) == len({plan.artifact_dir for plan in plans}) == 8


def test_options_after_a_double_dash_go_to_aiperf():
    options = aiperf_sweep.parse_args(["--concurrency", "1,4", "--modes", "off", "--", "--warmup-request-count", "2"])
    assert options.concurrency == [1, 4] and options.modes == ["off"]
    assert options.aiperf_args == ["--warmup-request-count", "2"]
    with pytest.raises(SystemExit):
        aiperf_sweep.parse_args(["--endpoints", "template,grpc"])


def _fake_aiperf(tmp_path: Path, export: dict, status: int) -> str:
    """A stand-in executable that writes ``export`` where AIPerf would and exits with ``status``."""
    (tmp_path / "export.json").write_text(json.dumps(export))
    script = tmp_path / "aiperf"
    script.write_text(f"""#!{sys.executable}
import shutil, sys
out = sys.argv[sys.argv.index("--output-artifact-dir") + 1]
if {status} == 0:
    shutil.copy({str(tmp_path / 'export.json')!r}, out + "/profile_export_aiperf.json")
print("fake aiperf")
sys.exit({status})
""")
    script.chmod(0o755)
    return str(script)


def test_the_driver_writes_the_table_and_fails_on_errors(tmp_path, export, export_with_error, capsys):
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    argv = ["--endpoints", "template", "--concurrency", "1", "--requests", "2", "--tokenizer", str(tokenizer)]
    clean = tmp_path / "clean"
    clean.mkdir()
    status = aiperf_sweep.main([*argv, "--aiperf", _fake_aiperf(clean, export, 0), "--out", str(clean / "out")])
    assert status == 0
    written = json.loads((clean / "out" / "aiperf_sweep.json").read_text())
    assert [row["endpoint"] for row in written["rows"]] == ["template"] and not written["errors"]
    assert len(written["runs"]) == 2 and "--extra-inputs" in written["runs"][1]["command"]
    assert (clean / "out" / "aiperf_sweep.md").read_text().count("| template | 1 |") == 1

    bad = tmp_path / "bad"
    bad.mkdir()
    assert aiperf_sweep.main([*argv, "--aiperf", _fake_aiperf(bad, export_with_error, 0),
                              "--out", str(bad / "out")]) == aiperf_sweep.EXIT_ERRORS
    failing = tmp_path / "failing"
    failing.mkdir()
    assert aiperf_sweep.main([*argv, "--aiperf", _fake_aiperf(failing, export, 1),
                              "--out", str(failing / "out")]) == aiperf_sweep.EXIT_ERRORS
    assert "aiperf exited with status 1" in capsys.readouterr().err


def test_a_missing_aiperf_says_how_to_get_it(tmp_path, capsys):
    assert aiperf_sweep.main(["--aiperf", str(tmp_path / "nope"), "--out", str(tmp_path)]) == aiperf_sweep.EXIT_USAGE
    assert "make aiperf" in capsys.readouterr().err


def test_a_servers_api_key_reaches_aiperf_and_never_the_sweeps_report(tmp_path, export, monkeypatch):
    key = "the-api-key-0123456789"
    assert aiperf_sweep.key_args("template", key) == ["--header", f"specdec-api-key:{key}"]
    assert aiperf_sweep.key_args("chat", key) == ["--api-key", key]  # OpenAI's Bearer token
    assert aiperf_sweep.key_args("completions", None) == []
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    script = Path(_fake_aiperf(tmp_path, export, 0))
    argv_log = tmp_path / "argv.json"
    script.write_text(script.read_text().replace(
        "import shutil, sys\n", f"import json, shutil, sys\njson.dump(sys.argv, open({str(argv_log)!r}, 'w'))\n"))
    monkeypatch.setenv("SPECDEC_API_KEY", key)
    assert aiperf_sweep.main(["--endpoints", "completions", "--concurrency", "1", "--modes", "on", "--requests", "1",
                              "--tokenizer", str(tokenizer), "--aiperf", str(script),
                              "--out", str(tmp_path / "out")]) == 0
    sent = json.loads(argv_log.read_text())
    assert sent[sent.index("--api-key") + 1] == key
    written = (tmp_path / "out" / "aiperf_sweep.json").read_text()
    assert key not in written and "--api-key '<redacted>'" in written
    assert key not in (tmp_path / "out" / "aiperf_sweep.md").read_text()
