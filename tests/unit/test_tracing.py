"""Per-request tracing (coordinator/triton/tracing.py): off unless a trace
file or an OTLP endpoint is set; with a file, a request's rounds are spans
under the request's span, written as JSON lines. A tracer provider can be
set once per process, so each case runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def run(code: str, env: dict[str, str] | None = None) -> str:
    import os

    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**clean, **(env or {})}, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_tracing_is_off_without_a_file_or_an_endpoint():
    out = run("""
        from coordinator.triton import tracing
        print(tracing.configure(""))
        with tracing.tracer.start_as_current_span("specdec request") as span:
            print(span.is_recording())
    """)
    assert out.split() == ["[]", "False"]


def test_rounds_are_spans_under_the_request_written_as_json_lines(tmp_path):
    path = tmp_path / "spans.jsonl"
    out = run(f"""
        from coordinator.rounds import Round
        from coordinator.triton import tracing
        print(tracing.configure({str(path)!r}))
        with tracing.tracer.start_as_current_span("specdec request") as span:
            rounds = tracing.RoundSpans()
            rounds(Round([1], 0, 0, False, plain_reason="first_round"))
            rounds(Round([2, 3, 4], 3, 2, True, drafter="draft_model"))
            print(span.is_recording())
    """, env={"OTEL_SERVICE_NAME": "specdec-test"})
    assert out.split() == [f"['{path}']", "True"]
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    assert [s["name"] for s in spans] == ["round", "round", "specdec request"]
    request = spans[-1]
    assert all(s["parent_id"] == request["context"]["span_id"] for s in spans[:2])
    assert spans[0]["attributes"]["specdec.plain_reason"] == "first_round"
    assert (spans[1]["attributes"]["specdec.drafted"], spans[1]["attributes"]["specdec.accepted"]) == (3, 2)
    assert request["resource"]["attributes"]["service.name"] == "specdec-test"
