"""specdec-compare's pure parts: held-out prompt sets, ratios, identity, the table."""

import argparse
from pathlib import Path

import pytest

from tools.compare import (
    ASSISTED,
    ENGINE,
    ONE_FORWARD,
    ONE_FORWARD_BESIDE,
    PLAIN_GENERATE,
    Measurement,
    format_table,
    parse_modes,
    summarise,
    wait_until_idle,
)
from tools.prompts import copy_prompts, held_out_prompts


class GrpcClient:
    """A stand-in for tritonclient's gRPC client as ``with InferenceServerClient(url)`` uses it."""

    def __init__(self, url):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def words(text: str) -> int:
    return len(text.split())


def test_prompt_sets_are_held_out_problems_of_about_the_length():
    sets = held_out_prompts([40, 400], 2, words)
    for length, prompts in sets.items():
        assert len(prompts) == 2
        for prompt in prompts:
            numbers = [int(n) for n in prompt.prompt_id.split("+")]
            assert all(100 <= n <= 163 for n in numbers)  # never the development range
            assert prompt.tokens == words(prompt.text)
            assert prompt.tokens >= length or len(numbers) == 1
            assert len(numbers) == 1 or prompt.tokens <= 1.3 * length
        assert len({p.prompt_id for p in prompts}) == 2  # distinct problems per prompt
    assert all("+" in p.prompt_id for p in sets[400])  # long prompts join several problems


def measurement(system, tokens_per_second, concurrency=1, length=150, texts=None, first_text=(1.0,)):
    m = Measurement(system, length, concurrency, requests=1, completion_tokens=int(tokens_per_second * 10),
                    seconds=10.0, first_text=list(first_text))
    m.texts = texts or {}
    return m


def test_ratios_against_the_peers_the_servers_plain_mode_and_one_stream():
    runs = [measurement(PLAIN_GENERATE, 4.0), measurement(ASSISTED, 5.0), measurement(ENGINE, 5.0),
            measurement("server plain", 4.0), measurement("server adaptive", 8.0, first_text=(1.1,)),
            measurement("server plain", 12.0, concurrency=4), measurement("server adaptive", 16.0, concurrency=4)]
    summary = summarise(runs, identity=[])
    rows = {(r["system"], r["concurrency"]): r for r in summary["rows"]}
    adaptive = rows["server adaptive", 1]
    assert adaptive["vs_transformers_generate"] == 2.0 and adaptive["vs_transformers_assisted"] == 1.6
    assert adaptive["vs_server_plain"] == 2.0 and abs(adaptive["first_text_vs_server_plain"] - 1.1) < 1e-9
    crowd = rows["server adaptive", 4]
    assert crowd["vs_one_stream"] == 2.0 and abs(crowd["vs_server_plain"] - 16 / 12) < 1e-9
    assert rows[PLAIN_GENERATE, 1]["vs_server_plain"] is None  # peers have no server-plain ratio
    assert abs(summary["serving_overhead"]["150"] - 0.25) < 1e-9  # engine 5.0 over server plain 4.0
    assert "| server adaptive | humaneval 150 | 4 | 16.00 | 4.00x |" in format_table(summary)


def test_time_to_first_text_is_set_against_the_forward_timed_beside_the_server_where_there_is_one():
    from tools.compare import fastest_forward_dtype

    runs = [Measurement(ONE_FORWARD, 150, 1, dtype="float32", first_text=[1.0, 1.2]),
            Measurement(ONE_FORWARD, 150, 1, dtype="bfloat16", first_text=[0.3, 0.5]),
            Measurement(ONE_FORWARD_BESIDE, 150, 1, dtype="bfloat16", first_text=[0.5, 0.5]),
            measurement("server plain", 4.0, first_text=(0.6,))]
    assert fastest_forward_dtype(runs) == "bfloat16" and fastest_forward_dtype(runs[3:]) is None
    rows = {r["system"]: r for r in summarise(runs, identity=[])["rows"]}
    assert rows["server plain"]["first_text_vs_one_forward"] == pytest.approx(1.2)  # 0.6 over 0.5, not over 0.4


def test_time_to_first_text_is_set_against_one_transformers_forward_over_the_prompt():
    forward = Measurement(ONE_FORWARD, 150, 1, first_text=[0.5, 0.6, 0.4])  # no tokens: a time only
    runs = [forward, measurement("server plain", 4.0, first_text=(1.0,)),
            measurement("server adaptive", 8.0, first_text=(0.75, 0.9, 0.6)),
            measurement("server plain", 12.0, concurrency=4)]
    rows = {(r["system"], r["concurrency"]): r for r in summarise(runs, identity=[])["rows"]}
    assert rows["server plain", 1]["first_text_vs_one_forward"] == 2.0
    assert abs(rows["server adaptive", 1]["first_text_vs_one_forward"] - 1.5) < 1e-9
    assert rows["server plain", 4]["first_text_vs_one_forward"] is None  # streams wait on each other there
    assert rows[ONE_FORWARD, 1]["tokens_per_second"] is None
    assert "| 2.00x |" in format_table(summarise(runs, identity=[]))


def test_server_rows_are_set_against_what_the_machines_forwards_allow_at_their_acceptance():
    from tools.ceiling import Forwards, ceilings
    from tools.compare import Bound

    target, draft = Forwards(lambda rows: 200.0 + rows, 512), Forwards(lambda rows: 40.0, 512)
    bound = Bound(target, draft, prompt_tokens=150, max_tokens=64, max_window=8)
    adaptive = measurement("server adaptive", 8.0)
    adaptive.drafted, adaptive.accepted = 100, 75
    runs = [measurement("server plain", 4.0), adaptive, measurement("server plain", 12.0, concurrency=4),
            measurement("server plain", 4.0, length=750)]
    rows = {(r["system"], r["concurrency"], r["prompt_tokens"]): r for r in summarise(runs, [], bound)["rows"]}
    plain_ceiling = ceilings(1, 0.0, 8, target, draft, 150, 64)[0].tokens_per_second
    assert rows["server plain", 1, 150]["vs_ceiling"] == pytest.approx(4.0 / plain_ceiling)
    best = max(c.tokens_per_second for c in ceilings(1, 0.75, 8, target, draft, 150, 64))
    assert best > plain_ceiling and rows["server adaptive", 1, 150]["vs_ceiling"] == pytest.approx(8.0 / best)
    four = ceilings(4, 0.0, 8, target, draft, 150, 64)[0].tokens_per_second
    assert rows["server plain", 4, 150]["ceiling_tokens_per_second"] == pytest.approx(four)
    assert rows["server plain", 1, 750]["vs_ceiling"] is None  # the bound is for the shortest prompts' requests
    assert summarise(runs, [])["rows"][0]["vs_ceiling"] is None  # no bound measured (--skip-peers)
    assert "vs ceiling: " in format_table(summarise(runs, [], bound))


def test_a_speculative_text_that_differs_from_plain_is_reported():
    identity = [measurement("server plain", 1, texts={"100": "a", "101": "b"}),
                measurement("server adaptive", 1, texts={"100": "a", "101": "c"})]
    summary = summarise([], identity)
    assert summary["mismatches"] == [{"system": "server adaptive", "prompt": "101", "concurrency": 1}]
    assert "MISMATCH: server adaptive" in format_table(summary)


def test_the_png_is_written(tmp_path):
    from tools.compare import write_png

    runs = [measurement(PLAIN_GENERATE, 4.0), measurement(ASSISTED, 5.0), measurement("server plain", 4.0),
            measurement("server adaptive", 8.0), measurement("server plain", 12.0, concurrency=4),
            measurement(PLAIN_GENERATE, 3.0, length=750), measurement("server plain", 3.0, length=750)]
    write_png(str(tmp_path / "out" / "compare.png"), summarise(runs, identity=[]), "test")
    assert (tmp_path / "out" / "compare.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_copy_heavy_prompts_show_a_held_out_function_then_start_it_again():
    prompts = copy_prompts(2, words)
    assert [p.prompt_id for p in prompts] == ["copy-100", "copy-101"]
    for prompt in prompts:
        signature = next(line for line in prompt.text.splitlines() if line.startswith("def "))
        assert prompt.text.count(signature) == 2 and prompt.text.rstrip().endswith('"""')


def fake_server(monkeypatch, inputs) -> list:
    """Completions of 8 tokens from no server; returns the list each request's ``inputs(mode, text)`` joins."""
    import types

    import tools.client

    sent = []

    def completion(client, request):
        sent.append(request)
        return types.SimpleNamespace(completion_tokens=8, draft_tokens=4, accepted_draft_tokens=3,
                                     time_to_first_chunk=0.1, text="x", fallback_reason="")

    monkeypatch.setattr("tritonclient.grpc.InferenceServerClient", GrpcClient)
    monkeypatch.setattr("tools.compare.server_inputs", lambda mode, text, max_tokens, window: inputs(mode, text))
    monkeypatch.setattr(tools.client, "stream_completion", completion)
    return sent


def test_one_stream_interleaves_the_modes_prompt_by_prompt(monkeypatch):
    """Mode after mode, the first would always meet the least-learnt server."""
    from tools.compare import run_one_stream
    from tools.prompts import Prompt

    sent = fake_server(monkeypatch, lambda mode, text: mode)
    prompts = [Prompt(f"p{i}", f"def f{i}():", 3) for i in range(3)]
    runs = run_one_stream("x", ("plain", "adaptive", "fixed"), prompts, 8, 4, 150)
    assert sent == ["plain", "adaptive", "fixed", "adaptive", "fixed", "plain", "fixed", "plain", "adaptive"]
    assert [m.system for m in runs] == ["server plain", "server adaptive", "server fixed"]
    assert all(m.requests == 3 and m.completion_tokens == 24 and m.seconds > 0 for m in runs)
    # the library's one forward over each prompt, timed a moment before the server's requests on it,
    sent.clear()
    forwards = []
    runs = run_one_stream("x", ("plain", "adaptive"), prompts, 8, 4, 150,
                          one_forward=("bfloat16", lambda text: forwards.append((len(sent), text)) or 0.5))
    # and again a moment after them, so a drift of the host's speed falls on both sides of the ratio
    assert [at for at, _ in forwards] == [0, 2, 2, 4, 4, 6]
    assert all(p.text in text for p, (_, text) in zip([p for p in prompts for _ in (0, 1)], forwards))
    assert len({text for _, text in forwards}) == 6  # each forward's prompt its own
    beside = runs[-1]
    assert (beside.system, beside.dtype, beside.first_text) == (ONE_FORWARD_BESIDE, "bfloat16", [0.5] * 6)


def test_a_load_runs_the_modes_bursts_in_turned_order_and_sums_each_modes_bursts(monkeypatch):
    """Mode after mode, one mode would meet the host's drift alone: ABBA cancels a steady drift."""
    from tools.compare import run_load, run_server
    from tools.prompts import Prompt

    sent = fake_server(monkeypatch, lambda mode, text: (mode, text))
    prompts = [Prompt(f"p{i}", f"def f{i}():", 3) for i in range(2)]

    def burst(mode, number, into):
        return run_server("x", mode, prompts, 1, 8, 4, 150, tag=f"{mode} {number}", into=into)

    runs = run_load(burst, ("plain", "adaptive"), 2)
    assert [mode for mode, _ in sent] == ["plain"] * 2 + ["adaptive"] * 4 + ["plain"] * 2
    assert len({text for _, text in sent}) == 8  # every request's prompt its own: no run reuses another's prefill
    assert [m.system for m in runs] == ["server plain", "server adaptive"]
    assert all(m.requests == 4 and m.completion_tokens == 32 and m.seconds > 0 for m in runs)
    from tools import compare

    with pytest.raises(SystemExit):
        compare.build_parser().parse_args(["--bursts", "x"])
    assert compare.main(["--bursts", "0", "--skip-peers"]) == compare.EXIT_ERROR


def test_modes_are_checked_and_plain_always_runs_first():
    assert parse_modes("adaptive,draft_model") == ("plain", "adaptive", "draft_model")
    assert parse_modes("draft_model, plain,draft_model") == ("plain", "draft_model")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown mode 'eagle'; modes: plain, adaptive"):
        parse_modes("adaptive,eagle")


def test_the_serving_stacks_time_per_round_is_what_the_engines_forwards_do_not_explain():
    m = Measurement("server plain", 150, 1)
    assert m.overhead_per_round is None  # not metered
    # 10 s of requests, 40 rounds; the target's 40 forwards took 8 s (0.2 s each), the draft's 1 s
    m.metered_seconds, m.rounds = 10.0, 40
    m.forwards, m.forward_seconds = {"target": 40, "draft": 20}, {"target": 8.0, "draft": 1.0}
    assert abs(m.overhead_per_round - (1.0 / 40) / 0.2) < 1e-12  # 25 ms a round = 12.5 % of a forward
    row = summarise([m], [])["rows"][0]
    assert row["overhead_per_round_in_target_forwards"] == m.overhead_per_round
    assert "server plain humaneval 150 12.5%" in format_table(summarise([m], []))


def test_steal_is_summed_per_measurement_and_the_serving_overhead_is_also_given_net_of_it():
    engine, plain = measurement(ENGINE, 5.0), measurement("server plain", 4.0)  # 50 and 40 tokens in 10 s
    engine.add_steal(100.0, 101.0)
    plain.add_steal(200.0, 202.0)
    plain.add_steal(None, 300.0)  # a reading that failed adds nothing
    plain.add_steal(300.0, 300.5)
    assert plain.steal_seconds == 2.5 and engine.steal_seconds == 1.0
    assert abs(plain.tokens_per_unstolen_second - 40 / 7.5) < 1e-12
    summary = summarise([engine, plain], [])
    assert abs(summary["serving_overhead"]["150"] - 0.25) < 1e-9
    assert abs(summary["serving_overhead_net_of_steal"]["150"] - ((50 / 9) / (40 / 7.5) - 1)) < 1e-9
    table = format_table(summary)
    assert "less the CPU time the hypervisor stole" in table and "+4.2%" in table
    assert "server plain humaneval 150 x1 25%" in table
    calm = measurement("server fixed", 4.0)
    calm.add_steal(7.0, 7.0)  # measured, and nothing stolen: listed as 0 %, not left out
    assert "server fixed humaneval 150 x1 0%" in format_table(summarise([engine, plain, calm], []))
    never = measurement("server plain", 4.0)
    assert never.steal_seconds is None and never.tokens_per_unstolen_second is None
    assert "hypervisor" not in format_table(summarise([measurement(ENGINE, 5.0), never], []))


def test_host_steal_is_read_from_proc_stat():
    from tools.compare import host_steal_seconds

    first = host_steal_seconds()
    if first is None:
        pytest.skip("no /proc/stat steal field here")
    assert 0 <= first <= host_steal_seconds()


@pytest.mark.parametrize("native_bf16, engine_dtype", [(True, "bfloat16"), (False, "float32")])
def test_the_library_peers_run_in_every_dtype_and_the_engine_in_the_servers(monkeypatch, native_bf16, engine_dtype):
    """The transformers peers load in each dtype asked for (a user keeps the fastest); the in-process
    engine in what the server target's ``auto`` means on this CPU (models stubbed, nothing generated)."""
    pytest.importorskip("torch")
    import transformers

    import cpu_engine.engine as engine_module
    from tests._config_helpers import model_config, parameter
    from tools import compare

    assert parameter(model_config("target", "cpu"), "dtype") == "auto"
    loaded = []

    class Loaded:
        def eval(self):
            return self

    def from_pretrained(path, dtype=None, **kwargs):
        loaded.append(("transformers", dtype))
        return Loaded()

    class Engine:
        def __init__(self, model_dir, dtype, **kwargs):
            loaded.append(("engine", dtype))

    monkeypatch.setattr(engine_module, "cpu_has_native_bf16", lambda cpuinfo=None: native_bf16)
    monkeypatch.setattr(engine_module, "CausalLMEngine", Engine)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path, **kwargs: None)
    assert compare.run_peers(Path("target"), Path("draft"), {}, 8, 1, lambda message: None) == []
    f32, bf16 = engine_module.DTYPES["float32"], engine_module.DTYPES["bfloat16"]
    assert loaded == [("transformers", f32), ("transformers", f32), ("transformers", bf16), ("transformers", bf16),
                      ("engine", engine_dtype)]


def test_ratios_are_taken_against_each_peers_fastest_dtype():
    """bfloat16 generate beats float32 here, float32 assisted generation beats bfloat16, and the
    one forward over the prompt is quicker in float32: each ratio uses the faster of the two."""
    runs = [measurement(PLAIN_GENERATE, 2.0), measurement(PLAIN_GENERATE, 4.0),
            measurement(ASSISTED, 5.0), measurement(ASSISTED, 1.0),
            Measurement(ONE_FORWARD, 150, 1, first_text=[0.5], dtype="float32"),
            Measurement(ONE_FORWARD, 150, 1, first_text=[2.0], dtype="bfloat16"),
            measurement("server adaptive", 8.0, first_text=(1.0,))]
    for m, dtype in zip(runs[:4], ("float32", "bfloat16", "float32", "bfloat16")):
        m.dtype = dtype
    summary = summarise(runs, identity=[])
    adaptive = next(r for r in summary["rows"] if r["system"] == "server adaptive")
    assert adaptive["vs_transformers_generate"] == 2.0  # against bfloat16's 4.0, not float32's 2.0
    assert adaptive["vs_transformers_assisted"] == 1.6  # against float32's 5.0
    assert adaptive["first_text_vs_one_forward"] == 2.0  # against float32's 0.5 s
    table = format_table(summary)
    assert f"| {PLAIN_GENERATE} (bfloat16) | humaneval 150 | 1 | 4.00 | 1.00x |" in table
    assert f"| {PLAIN_GENERATE} (float32) | humaneval 150 | 1 | 2.00 | 0.50x |" in table


def test_peer_dtypes_are_checked():
    from tools.compare import build_parser

    assert build_parser().parse_args(["--peer-dtypes", "bfloat16"]).peer_dtypes == ("bfloat16",)
    assert build_parser().parse_args([]).peer_dtypes == ("float32", "bfloat16")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--peer-dtypes", "float16"])


def test_a_one_stream_request_is_timed_until_the_engines_are_idle_again():
    """Work a request leaves running (a draft catch-up it no longer needs) is charged to it,
    not to the next request it would slow down."""
    readings = iter([{"target": 1, "draft": 1}, {"target": 0, "draft": 1}, {"target": 0, "draft": 0}])
    calls = []

    def running_calls():
        calls.append(1)
        return next(readings)

    assert wait_until_idle("http://metrics", poll=0.0, running_calls=running_calls)
    assert len(calls) == 3
    # engines without the gauge (the trtllm profile), no metrics port, or one that cannot be read: no wait
    assert not wait_until_idle("http://metrics", running_calls=lambda: {})
    assert not wait_until_idle(None, running_calls=lambda: {"draft": 1})

    def unreadable():
        raise OSError("connection refused")

    assert not wait_until_idle("http://metrics", running_calls=unreadable)
    assert not wait_until_idle("http://metrics", timeout=0.0, poll=0.0, running_calls=lambda: {"draft": 1})


def test_no_serving_overhead_line_without_the_in_process_engine():
    with_engine = format_table(summarise([measurement(ENGINE, 5.0), measurement("server plain", 4.0)], []))
    assert "serving overhead (in-process engine" in with_engine and "150-token prompts +25.0%" in with_engine
    skipped_peers = format_table(summarise([measurement("server plain", 4.0)], []))
    assert "serving overhead" not in skipped_peers


def test_the_in_process_engine_takes_the_servers_forward_settings(monkeypatch):
    """The serving overhead compares the server with the same engine in-process:
    it must shape forwards as the server's target does (its max_num_tokens,
    prompt_block, ...), whatever else the target's config holds."""
    import tritonclient.grpc as grpcclient

    from tools import compare

    class Client(GrpcClient):
        def get_model_config(self, model, as_json=False):
            assert model == "target" and as_json
            return {"config": {"parameters": {"max_num_tokens": {"string_value": "512"},
                                              "prompt_block": {"string_value": "auto"},
                                              "model_dir": {"string_value": "/models/target"}}}}

    monkeypatch.setattr(grpcclient, "InferenceServerClient", Client)
    assert compare.server_engine_settings("localhost:8001") == {"max_num_tokens": 512, "prompt_block": "auto"}

    class Unreachable(Client):
        def get_model_config(self, model, as_json=False):
            raise ConnectionError("no server")

    monkeypatch.setattr(grpcclient, "InferenceServerClient", Unreachable)
    assert compare.server_engine_settings("localhost:8001") == {}



def test_the_forecasts_accuracy_over_the_load_runs_is_read_from_the_epoch_histogram():
    from tools import compare

    def exposition(counts):  # cumulative counts at -0.15, 0.15, +inf per regime
        lines = ["# HELP specdec_forecast_epoch_error_ratio x", "# TYPE specdec_forecast_epoch_error_ratio histogram"]
        for regime, (low, high, total) in counts.items():
            for bound, count in (("-0.5", 0), ("-0.15", low), ("0.15", high), ("+Inf", total)):
                lines.append(f'specdec_forecast_epoch_error_ratio_bucket{{regime="{regime}",le="{bound}"}} {count}')
            lines.append(f'specdec_forecast_epoch_error_ratio_count{{regime="{regime}"}} {total}')
            lines.append(f'specdec_forecast_epoch_error_ratio_sum{{regime="{regime}"}} 0')
        return "\n".join(lines) + "\n"

    before = exposition({"plain": (1, 2, 2), "speculate": (0, 0, 0)})
    after = exposition({"plain": (1, 8, 9), "speculate": (3, 4, 4)})
    accuracy = compare.forecast_accuracy(before, after)
    assert accuracy["plain"] == {"epochs": 7, "within_aim": 6, "median_between": [-0.15, 0.15]}
    assert accuracy["speculate"] == {"epochs": 4, "within_aim": 1, "median_between": [-0.5, -0.15]}
    assert compare.forecast_accuracy(after, after) == {}  # no epoch between the scrapes
