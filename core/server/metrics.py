"""Prometheus metrics of one server, in its own ``CollectorRegistry`` (several apps, one process: no clashes).

Under ``hookllm serve --api-server-count N`` each API server process counts its own requests,
in prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set by the parent), and
``/metrics`` from any of them sums every process's counters and histograms. The engine's gauges
are read from the stats the engine last reported, the same in every process; its first report
comes as it starts, so they are right (``hookllm:num_kv_blocks`` the cache's size) before any request.

Every latency counts from the request's arrival: ``ArrivalTimeMiddleware`` notes it as the HTTP
request comes in, before its body is read, its prompt rendered and tokenized, or it waits in
the engine's queue, so a request that waited 40 s reports 40 s.

Each metric vLLM also reports has both names, ``hookllm:X`` and ``vllm:X`` (``both``), with the
same labels, types and buckets, fed by the same calls: routers and dashboards built for vLLM
read the ``vllm:`` ones. In multiprocess mode each name is summed across processes alike.
"""

from __future__ import annotations

import os
import time
from contextvars import ContextVar
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from hookllm.sched.scheduler import SchedulerStats

from hookllm.engine.async_llm import AsyncLLM

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
# A whole request, or its first token behind a long queue, takes minutes on a loaded server.
REQUEST_LATENCY_BUCKETS = LATENCY_BUCKETS + (60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def both(name: str) -> tuple[str, ...]:
    """A metric's two names: hookllm's, and vLLM's, which routers and dashboards built for vLLM read."""
    return ("hookllm:" + name, "vllm:" + name)


def own(name: str) -> tuple[str, ...]:
    """A metric vLLM has no counterpart of: hookllm's name only."""
    return ("hookllm:" + name,)


class Named:
    """One metric under each of its names (``both``): every update goes to all of them, so the
    twins report the same values by construction (one observation, one call)."""

    def __init__(self, metrics: list[Any]):
        self._metrics = metrics

    @classmethod
    def declare(cls, kind: type, names: tuple[str, ...], doc: str, labelnames: list[str],
                registry: CollectorRegistry, **options: Any) -> "Named":
        """A prometheus_client ``kind`` (Counter, Histogram) of each name, in ``registry``."""
        return cls([kind(name, doc, labelnames, registry=registry, **options) for name in names])

    def labels(self, **labels: str) -> "Named":
        return Named([metric.labels(**labels) for metric in self._metrics])

    def inc(self, amount: float = 1) -> None:
        for metric in self._metrics:
            metric.inc(amount)

    def observe(self, value: float) -> None:
        for metric in self._metrics:
            metric.observe(value)


class ServerMetrics:
    def __init__(self, engine: AsyncLLM, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.engine_metrics = EngineMetrics(engine, model_name)
        self.registry.register(self.engine_metrics)

        def declare(kind: type, names: tuple[str, ...], doc: str, **options: Any) -> Named:
            return Named.declare(kind, names, doc, list(labels), self.registry, **options).labels(**labels)

        self.prompt_tokens = declare(Counter, both("prompt_tokens"), "Prompt tokens of admitted requests.")
        self.generation_tokens = declare(Counter, both("generation_tokens"), "Generated tokens.")
        self.ttft = declare(Histogram, both("time_to_first_token_seconds"),
                            "Time from the request's arrival at the server to its first token.",
                            buckets=REQUEST_LATENCY_BUCKETS)
        self.tpot = declare(Histogram, both("time_per_output_token_seconds"), "Time between output tokens.",
                            buckets=LATENCY_BUCKETS)
        self.e2e = declare(Histogram, both("e2e_request_latency_seconds"),
                           "Time from the request's arrival at the server to its last token (finished requests).",
                           buckets=REQUEST_LATENCY_BUCKETS)
        self._finished = Named.declare(Counter, both("request_success"), "Finished requests by finish reason "
                                       "(stop, length, abort, error).", ["model_name", "finished_reason"],
                                       self.registry)
        self._grpc_requests = Counter("hookllm:grpc_requests", "gRPC calls by method and status code.",
                                      ["model_name", "method", "code"], registry=self.registry)
        self._model_name = model_name

    def grpc_request(self, method: str, code: str) -> None:
        """A gRPC call ended with status ``code`` (OK, INVALID_ARGUMENT, CANCELLED, ...)."""
        self._grpc_requests.labels(model_name=self._model_name, method=method, code=code).inc()

    def request_finished(self, reason: str) -> None:
        self._finished.labels(model_name=self._model_name, finished_reason=reason).inc()

    def render(self) -> bytes:
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            return generate_latest(self.registry)
        # Every API server process's counters and histograms, summed; the engine's gauges once.
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        registry.register(self.engine_metrics)
        return generate_latest(registry)


class EngineMetrics:
    """The engine's state, read at scrape time from the stats of its last report: one sample per
    engine (``hookllm serve --data-parallel-size``), labelled ``engine`` "0", "1", ... Gauges, the
    prefix cache's counters (tokens since the engine started), which prefix-aware routers read,
    and with ``--enable-lora`` the adapters in use, which LoRA-aware routers read."""

    GAUGES: tuple[tuple[tuple[str, ...], str, Callable[[SchedulerStats], float]], ...] = (
        (both("num_requests_running"), "Requests in the running batch.", lambda s: s.num_running_reqs),
        (both("num_requests_waiting"), "Requests waiting to be scheduled.", lambda s: s.num_waiting_reqs),
        (both("kv_cache_usage_perc"), "Fraction of KV-cache blocks in use (0..1).", lambda s: s.kv_cache_usage),
        (own("num_used_kv_blocks"), "KV-cache blocks in use.", lambda s: s.num_used_blocks),
        (own("num_kv_blocks"), "KV-cache blocks in all.", lambda s: s.num_blocks),
    )
    COUNTERS: tuple[tuple[tuple[str, ...], str, Callable[[SchedulerStats], float]], ...] = (
        (both("prefix_cache_queries"), "Prompt tokens looked up in the prefix cache.", lambda s: s.prefix_cache_queries),
        (both("prefix_cache_hits"), "Prompt tokens found in the prefix cache.", lambda s: s.prefix_cache_hits),
    )

    SPEC_COUNTERS: tuple[tuple[tuple[str, ...], str, Callable[[SchedulerStats], float]], ...] = (
        (both("spec_decode_num_drafts"), "Drafts verified (one per request per speculating step).",
         lambda s: s.spec_num_drafts),
        (both("spec_decode_num_draft_tokens"), "Draft tokens verified.", lambda s: s.spec_num_draft_tokens),
        (both("spec_decode_num_accepted_tokens"), "Draft tokens accepted.", lambda s: s.spec_num_accepted_tokens),
    )

    def __init__(self, engine: AsyncLLM, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        engines = self.engine.engine_stats()
        for family_type, metrics in ((GaugeMetricFamily, self.GAUGES), (CounterMetricFamily, self.COUNTERS)):
            for names, doc, read in metrics:
                values = [read(stats) for stats in engines]
                for name in names:
                    family = family_type(name, doc, labels=["model_name", "engine"])
                    for index, value in enumerate(values):
                        family.add_metric([self.model_name, str(index)], value)
                    yield family
        if self.engine.config.enable_lora:
            yield from self._lora_info(engines)
        if self.engine.config.speculative_config is not None:
            yield from self._spec_decode(engines)

    def _spec_decode(self, engines: list[SchedulerStats]) -> Iterator[CounterMetricFamily]:
        """vLLM's speculative decoding counters: drafts (a request's verification in a step), the
        draft tokens verified, those accepted, and the accepted ones by position (``position``
        label, 0 the first draft after the request's last token)."""
        for names, doc, read in self.SPEC_COUNTERS:
            for name in names:
                family = CounterMetricFamily(name, doc, labels=["model_name", "engine"])
                for index, stats in enumerate(engines):
                    family.add_metric([self.model_name, str(index)], read(stats))
                yield family
        for name in both("spec_decode_num_accepted_tokens_per_pos"):
            family = CounterMetricFamily(name, "Accepted draft tokens, by their position in the drafts.",
                                         labels=["model_name", "engine", "position"])
            for index, stats in enumerate(engines):
                for position, count in enumerate(stats.spec_accepted_per_position):
                    family.add_metric([self.model_name, str(index), str(position)], count)
            yield family

    def _lora_info(self, engines: list[SchedulerStats]) -> Iterator[GaugeMetricFamily]:
        """vLLM's ``lora_requests_info``: the adapters (names, comma-separated) of the running and
        of the waiting requests, and ``max_lora`` (the batch's adapter slots), in its labels; its
        value the time of the reading, so that a reader can tell the latest label set (vLLM's way)."""
        labels = ["model_name", "engine", "max_lora", "running_lora_adapters", "waiting_lora_adapters"]
        now = time.time()
        for name in both("lora_requests_info"):
            family = GaugeMetricFamily(name, "Running stats on LoRA requests.", labels=labels)
            for index, stats in enumerate(engines):
                family.add_metric([self.model_name, str(index), str(self.engine.config.max_loras),
                                   ",".join(stats.running_lora_adapters), ",".join(stats.waiting_lora_adapters)], now)
            yield family


_arrival: ContextVar[float] = ContextVar("hookllm_request_arrival")


class ArrivalTimeMiddleware:
    """Pure ASGI: notes when each HTTP request arrives (``time.perf_counter()``), for
    ``request_arrival`` in whatever handles it. The app's outermost layer."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            _arrival.set(time.perf_counter())  # the handler's task and the tasks it starts see it
        await self.app(scope, receive, send)


def request_arrival() -> float:
    """When the HTTP request being handled arrived at the server (``time.perf_counter()``)."""
    return _arrival.get()


class RequestTimer:
    """One request's latencies from its ``arrival`` (``request_arrival``): the first token feeds
    TTFT; each later output's gap since the one before, shared among its tokens, feeds TPOT once
    per token; the finished request's whole time feeds the end-to-end latency."""

    def __init__(self, metrics: ServerMetrics, arrival: float, num_prompt_tokens: int):
        self.metrics = metrics
        self.arrival = arrival
        self.last = arrival
        self.end: float | None = None
        self.first_token_latency: float | None = None
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = 0
        metrics.prompt_tokens.inc(num_prompt_tokens)

    def output(self, count: int, finished: bool) -> None:
        """An output with ``count`` new tokens arrived from the engine; ``finished``: its last."""
        now = time.perf_counter()
        if count > 0:
            if self.num_tokens == 0:
                self.first_token_latency = now - self.arrival
                self.metrics.ttft.observe(self.first_token_latency)
            else:
                # Several tokens at once (steps that piled up while this consumer was busy)
                # share the gap: TPOT's sum stays the time from the first token to the last.
                for _ in range(count):
                    self.metrics.tpot.observe((now - self.last) / count)
            self.num_tokens += count
            self.last = now
            self.metrics.generation_tokens.inc(count)
        if finished:
            self.end = now
            self.metrics.e2e.observe(now - self.arrival)

    @property
    def latency(self) -> float:
        """Seconds from arrival to the last output (to now, for a request that has not finished)."""
        return (time.perf_counter() if self.end is None else self.end) - self.arrival
