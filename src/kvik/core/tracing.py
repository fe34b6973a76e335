"""OpenTelemetry tracing for the server and the gateway: off by default, and free when off.

`configure()` (from `kvik serve --otlp-traces-endpoint` or the gateway's `tracing` section) imports
the OpenTelemetry SDK, builds a tracer provider with a parent-based trace-id-ratio sampler and an
OTLP/HTTP (protobuf) batch exporter, and makes log records carry the current trace and span ids.
Until then nothing here imports OpenTelemetry: `span()` hands back one shared no-op context manager
and `start_span()` returns None, so the hot path pays a global read per call and creates no spans.

Propagation is W3C Trace Context (`traceparent`/`tracestate` headers) only; baggage is not
forwarded, so nothing a client puts in headers travels further than the first hop unless it is a
trace context.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from kvik.core.errors import ConfigError

# Set by configure(); None means tracing is off.
_tracer: Any = None
_provider: Any = None
_propagator: Any = None
_NO_SPAN = contextlib.nullcontext()

# Put before the logger name in a log format when tracing is on (the record factory fills both
# fields; "-" outside a span), so the message stays last and JSON log lines stay parseable.
LOG_TRACE_FIELDS = "trace_id=%(trace_id)s span_id=%(span_id)s"
TRACE_HEADERS = ("traceparent", "tracestate")
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(slots=True, frozen=True)
class TracingConfig:
    """Where and how much to trace.

    endpoint: the OTLP/HTTP traces URL (`http://collector:4318/v1/traces`); a URL with no path gets
    `/v1/traces` appended, as OTEL_EXPORTER_OTLP_ENDPOINT does. sample_ratio: the fraction of new
    traces kept (0..1); a request that arrives with a `traceparent` follows its sampled flag.
    """

    endpoint: str
    sample_ratio: float = 1.0
    service_name: str = "kvik"

    def __post_init__(self) -> None:
        parts = urlsplit(self.endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"otlp traces endpoint: give an http(s) URL such as "
                              f"http://127.0.0.1:4318/v1/traces, got {self.endpoint!r}")
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ConfigError(f"trace sample ratio: must be between 0 and 1, got {self.sample_ratio}")

    @property
    def traces_url(self) -> str:
        if urlsplit(self.endpoint).path in ("", "/"):
            return self.endpoint.rstrip("/") + "/v1/traces"
        return self.endpoint


def configure(config: TracingConfig, exporter: Any = None) -> None:
    """Turn tracing on for this process (a second call replaces the first provider). `exporter`:
    an OpenTelemetry SpanExporter to use instead of OTLP (tests, embedding); spans then go to it
    one by one as they end."""
    global _tracer, _provider, _propagator
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError as exc:
        raise ConfigError("tracing needs the OpenTelemetry SDK: pip install 'kvik[tracing]' "
                          f"({exc})") from None
    if _provider is not None:
        _provider.shutdown()
    resource = Resource.create({"service.name": config.service_name, "service.version": _kvik_version()})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
    if exporter is None:
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.traces_url)))
    else:
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        provider.add_span_processor(SimpleSpanProcessor(exporter))
    _provider = provider
    _propagator = TraceContextTextMapPropagator()
    _tracer = provider.get_tracer("kvik", _kvik_version())
    _install_log_correlation()


def _kvik_version() -> str:
    try:
        return importlib.metadata.version("kvik")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def shutdown() -> None:
    """Export what is buffered and stop (also runs at interpreter exit)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


def log_format(base: str) -> str:
    """`base` with the trace and span ids before `%(name)s` (or at the end) when tracing is on."""
    if _tracer is None:
        return base
    if "%(name)s" in base:
        return base.replace("%(name)s", f"{LOG_TRACE_FIELDS} %(name)s", 1)
    return f"{base} {LOG_TRACE_FIELDS}"


def span(name: str, attributes: Mapping[str, Any] | None = None) -> contextlib.AbstractContextManager:
    """A child span of the current one for the `with` block (exceptions recorded), or a no-op."""
    if _tracer is None:
        return _NO_SPAN
    return _tracer.start_as_current_span(name, attributes=attributes)


def server_span(name: str, headers: Iterable[tuple[bytes, bytes]],
                attributes: Mapping[str, Any] | None = None) -> contextlib.AbstractContextManager:
    """The span of a request this process serves, continuing the trace in its `traceparent`
    (ASGI header pairs), current for the `with` block. A no-op when tracing is off."""
    if _tracer is None:
        return _NO_SPAN
    from opentelemetry.trace import SpanKind

    carrier = {}
    for key, value in headers:
        name_text = key.decode("latin-1").lower()
        if name_text in TRACE_HEADERS:
            carrier[name_text] = value.decode("latin-1")
    parent = _propagator.extract(carrier) if carrier else None
    return _tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)


def traced(name: str) -> Callable[[F], F]:
    """Decorate a function (sync or async) so each call runs in a span `name` when tracing is on;
    when off the wrapper only reads one global."""
    def decorate(function: F) -> F:
        if inspect.iscoroutinefunction(function):
            @functools.wraps(function)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                if _tracer is None:
                    return await function(*args, **kwargs)
                with _tracer.start_as_current_span(name):
                    return await function(*args, **kwargs)
            return run_async  # type: ignore[return-value]

        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> Any:
            if _tracer is None:
                return function(*args, **kwargs)
            with _tracer.start_as_current_span(name):
                return function(*args, **kwargs)
        return run  # type: ignore[return-value]

    return decorate


def start_span(name: str, *, parent: Any = None, client: bool = False, start_time: float | None = None,
               attributes: Mapping[str, Any] | None = None) -> Any:
    """A span the caller ends (`end_span`), child of `parent` (a span) or else of the current span;
    None when tracing is off or this trace is not sampled, so callers skip their bookkeeping.
    start_time: wall-clock seconds (time.time())."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    context = trace.set_span_in_context(parent) if parent is not None else None
    kind = trace.SpanKind.CLIENT if client else trace.SpanKind.INTERNAL
    started = _tracer.start_span(name, context=context, kind=kind, attributes=attributes,
                                 start_time=None if start_time is None else _ns(start_time))
    return started if started.is_recording() else None


def end_span(span_: Any, end_time: float | None = None, error: str | None = None) -> None:
    """End a span from `start_span` (None is ignored); `error` marks it failed with that description."""
    if span_ is None:
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span_.set_status(Status(StatusCode.ERROR, error))
    span_.end(end_time=None if end_time is None else _ns(end_time))


def record_span(name: str, parent: Any, start: float, end: float,
                attributes: Mapping[str, Any] | None = None) -> None:
    """A finished child span of `parent` from timestamps taken elsewhere (wall-clock seconds)."""
    child = start_span(name, parent=parent, start_time=start, attributes=attributes)
    end_span(child, max(start, end))


def inject(headers: MutableMapping[str, str], span_: Any = None) -> None:
    """Add `traceparent` (and `tracestate`) for `span_` (or the current span) to outgoing headers.
    An unsampled trace is propagated too, so the next hop does not start a sampled one."""
    if _tracer is None:
        return
    from opentelemetry import trace

    context = trace.set_span_in_context(span_) if span_ is not None else None
    _propagator.inject(headers, context=context)


def set_attributes(attributes: Mapping[str, Any], span_: Any = None) -> None:
    """Set attributes on `span_` or the current span (None values are left out)."""
    if _tracer is None:
        return
    from opentelemetry import trace

    target = span_ if span_ is not None else trace.get_current_span()
    if target.is_recording():
        target.set_attributes({key: value for key, value in attributes.items() if value is not None})


def current_trace_id() -> str | None:
    """The current trace id as 32 hex digits, or None (off, or outside a sampled span)."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _install_log_correlation() -> None:
    """Every log record gets `trace_id` and `span_id` (of the span current where it was logged)."""
    from opentelemetry import trace

    previous = logging.getLogRecordFactory()
    if getattr(previous, "kvik_trace_ids", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            record.trace_id = format(context.trace_id, "032x")
            record.span_id = format(context.span_id, "016x")
        else:
            record.trace_id = record.span_id = "-"
        return record

    factory.kvik_trace_ids = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
