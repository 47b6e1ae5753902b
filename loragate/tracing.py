"""OpenTelemetry tracing, configured by the standard `OTEL_*` environment variables; off (and free) when
they are unset.

With `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) set, spans go over OTLP/HTTP to it; with
`OTEL_TRACES_EXPORTER=console` they are printed; `OTEL_TRACES_EXPORTER=none` turns tracing off. Nothing
is registered globally: each process holds its own provider. One trace follows a request from the
gateway through the Redis queue into the worker: the gateway puts a W3C `traceparent` into the queued
message and the worker continues from it. Span and attribute names follow the OpenTelemetry GenAI
semantic conventions where they exist (`gen_ai.request.model`, `gen_ai.usage.input_tokens`, …).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import INVALID_SPAN_CONTEXT, NonRecordingSpan, Span, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

PROPAGATOR = TraceContextTextMapPropagator()


def tracing_configured() -> bool:
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").lower()
    if exporter == "none" or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    )
    return bool(endpoint) or exporter in ("otlp", "console")


def make_provider(service_name: str, exporter: SpanExporter | None = None) -> TracerProvider | None:
    """A provider exporting to `exporter` (tests) or as the environment says; None when tracing is off."""
    if exporter is None and not tracing_configured():
        return None
    name = os.environ.get("OTEL_SERVICE_NAME", service_name)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif os.environ.get("OTEL_TRACES_EXPORTER", "").lower() == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


@contextmanager
def span(
    tracer: Tracer | None,
    name: str,
    attributes: Mapping[str, Any] | None = None,
    context: Context | None = None,
) -> Iterator[Span]:
    """A child span of the current (or given) context; a free no-op span when tracing is off."""
    if tracer is None:
        yield NonRecordingSpan(INVALID_SPAN_CONTEXT)
        return
    with tracer.start_as_current_span(name, context=context, attributes=dict(attributes or {})) as s:
        yield s


def inject(span_: Span) -> str | None:
    """The W3C traceparent of `span_`, for the queued message."""
    if not span_.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=set_span_in_context(span_))
    return carrier.get("traceparent")


def extract(traceparent: str | None) -> Context | None:
    return PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None
