"""Per-request tracing with OpenTelemetry, off unless configured.

A request is one span; under it each decoding round (drafted, accepted,
emitted, why a plain round did not speculate) and each engine call the
coordinator makes (draft and target: tokens in, drafts, tokens back), so an
operator sees where a slow request spent its time. Spans go to a file of
JSON lines (``trace_file``, env ``SPECDEC_TRACE_FILE``: for a host without a
collector; each span is written as it ends) and/or over OTLP/HTTP to a
collector named by the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``. The SDK reads the other standard
variables itself: ``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG`` (which
requests are traced; all by default), ``OTEL_SERVICE_NAME``.

Triton's own trace API records the coordinator request's timestamps, but
cannot follow it into its engine calls here: handing the request's Triton
trace to a BLS call makes Triton 2.51 crash (SIGSEGV in
TRITONSERVER_ServerInferAsync) once tracing is on.

Without a configured provider the OpenTelemetry API hands out non-recording
spans: tracing off costs about a microsecond per span."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from opentelemetry import trace

from coordinator.rounds import Round

SERVICE_NAME = "specdec-coordinator"
OTLP_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

tracer = trace.get_tracer("specdec.coordinator")  # follows the provider configure() sets


def configure(trace_file: str = "", environ: Mapping[str, str] | None = None) -> list[str]:
    """Install the exporters the settings ask for (a provider can be set once per
    process: the coordinator's); returns where spans go (empty: tracing off)."""
    environ = os.environ if environ is None else environ
    otlp = next((environ[name] for name in OTLP_VARIABLES if environ.get(name)), "")
    if not trace_file and not otlp:
        return []
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME") or SERVICE_NAME})
    provider = TracerProvider(resource=resource)
    destinations = []
    if trace_file:
        out = open(trace_file, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - open for the process's life
        provider.add_span_processor(SimpleSpanProcessor(
            ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")))
        destinations.append(trace_file)
    if otlp:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        destinations.append(otlp)
    trace.set_tracer_provider(provider)
    return destinations


class RoundSpans:
    """One span per decoding round of a request, from the end of the round
    before it (or the request's start) to its end: what the round's engine
    calls and the coordinator's own work between them took."""

    def __init__(self):
        self._last = time.time_ns()

    def __call__(self, round_: Round) -> None:
        now = time.time_ns()
        span = tracer.start_span("round", start_time=self._last, attributes={
            "specdec.drafter": round_.drafter,
            "specdec.drafted": round_.drafted,
            "specdec.accepted": round_.accepted,
            "specdec.emitted": len(round_.tokens),
            "specdec.context": round_.context,
            "specdec.plain_reason": round_.plain_reason,
            "specdec.draft_seconds": round_.draft_seconds,
            "specdec.target_seconds": round_.target_seconds,
        })
        span.end(end_time=now)
        self._last = now
