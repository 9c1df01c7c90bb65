"""The HTTP server: ``/score``, ``/healthz``, ``/readyz`` and ``/metrics`` over a follower (the
state served) and a scorer per base (decoding).

HTTP is aiohttp's server rather than ``http.server``: HTTP/1.1 keep-alive for clients that send
many small score requests, a bounded request size, and requests handled concurrently on one event
loop while the scoring itself runs in a thread (torch releases the GIL); its runner also starts
and stops cleanly inside a test process, on a port the OS picks. Decoding and encoding hold no
lock; the forward pass holds the follower's state lock shared.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from streamtrain.delivery.deltas import DeltaId
from streamtrain.delivery.serve.follower import Follower
from streamtrain.delivery.serve.metrics import ServeMetrics
from streamtrain.delivery.serve.sources import DeltaSource, DeltaSourceUnavailable

log = logging.getLogger(__name__)


@dataclass
class ScoreOutcome:
    results: list[dict[str, Any]]
    tasks: list[str]
    base_version: int
    step: int
    delta_sequence: int


@dataclass(frozen=True)
class ServeLimits:
    """What one client may ask of the server (``streamtrain serve``'s flags of the same names)."""

    max_request_bytes: int = 8 * 2**20
    max_events: int = 10_000
    max_in_flight: int = 8
    token_file: Path | None = None
    body_timeout_seconds: float = 10.0


class ScoringServer:
    """The server: a follower thread, and aiohttp on its own thread. ``start()`` returns once the
    first base is loaded and HTTP listens; ``ready`` turns true once the deltas present at start
    are applied.

    Limits, so that it can face clients it does not trust: a body over ``max_request_bytes`` or
    with over ``max_events`` events gets 413; a body not received within ``body_timeout_seconds``
    gets 408, so a slow client gives its slot back; over ``max_in_flight`` requests at once get 503
    with ``Retry-After`` (before their bodies are read); with ``token_file``, /score wants
    ``Authorization: Bearer <the file's content>`` (401 otherwise). Every answer is counted by
    outcome, an unforeseen failure too (500, ``error``). TLS is the mesh's job."""

    def __init__(
        self,
        model_dir: str | Path,
        deltas: DeltaSource | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        base_wait_seconds: float = 60.0,
        start_timeout_seconds: float = 60.0,
        on_delta_applied: Callable[[DeltaId, float], None] | None = None,
        limits: ServeLimits | None = None,
    ):
        """``on_delta_applied(delta, wall time)`` is called on the follower thread once a delta is
        served (``bench delivery`` times the deltas by it)."""
        self.model_dir = Path(model_dir)
        self.host = host
        self.port = port
        self.start_timeout_seconds = start_timeout_seconds
        self.limits = limits or ServeLimits()
        self._token = _read_token(self.limits.token_file) if self.limits.token_file is not None else None
        self.metrics = ServeMetrics()
        self.follower = Follower(self.model_dir, deltas, self.metrics, base_wait_seconds, on_delta_applied)
        self._in_flight = 0  # touched on the event loop only
        self._pool = ThreadPoolExecutor(self.limits.max_in_flight, thread_name_prefix="streamtrain-score")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._threads: list[threading.Thread] = []

    @property
    def ready(self) -> bool:
        return self.follower.ready.is_set()

    def start(self) -> None:
        deadline = time.monotonic() + self.start_timeout_seconds
        while True:  # a server may start before the first export
            try:
                base = self.follower.newest_base()
                if base is not None:
                    self.follower.load(base, max(deadline - time.monotonic(), 1.0))
                    break
                why = "no base"
            except DeltaSourceUnavailable:
                raise
            except Exception as error:  # removed meanwhile, or not a base: wait for the next
                why = f"the newest base cannot be loaded ({error})"
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{why} under {self.model_dir} after {self.start_timeout_seconds:.0f}s: run "
                    f"`streamtrain export` (or a worker with delivery on) to publish one there"
                )
            time.sleep(0.2)
        follower = threading.Thread(target=self.follower.run, name="streamtrain-serve-deltas", daemon=True)
        follower.start()
        listening = threading.Event()
        http = threading.Thread(target=self._serve_http, args=(listening,), name="streamtrain-serve-http", daemon=True)
        http.start()
        self._threads = [follower, http]
        if not listening.wait(30):
            raise RuntimeError(f"the HTTP server did not start on {self.host}:{self.port}")

    def stop(self) -> None:
        self.follower.stopping.set()
        if self._loop is not None and self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        for thread in self._threads:
            thread.join(timeout=10)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.follower.source is not None:
            self.follower.source.close()

    def wait_ready(self, timeout: float) -> bool:
        return self.follower.ready.wait(timeout)

    def __enter__(self) -> ScoringServer:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    # --- HTTP ----------------------------------------------------------------------------
    def _serve_http(self, listening: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        app = web.Application(client_max_size=self.limits.max_request_bytes)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/score", self._score)
        self._runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, self.host, self.port)
        loop.run_until_complete(site.start())
        server = site._server
        assert server is not None
        self.port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
        self._loop = loop
        listening.set()
        loop.run_forever()
        loop.close()

    async def _healthz(self, _request: web.Request) -> web.Response:
        alive = all(thread.is_alive() for thread in self._threads)
        return web.json_response({"ok": alive}, status=200 if alive else 500)

    async def _readyz(self, request: web.Request) -> web.Response:
        """200 while the state served is current: the deltas present at start applied, no gap
        waiting for a base, the delta source readable; else 503 and why. With ``?allow_stale=1``
        only the first matters: a load balancer's probe keeps scoring on while every replica
        waits for the same base."""
        follower = self.follower
        behind = follower.behind if self.ready else "applying the deltas present at start"
        if self.ready and request.query.get("allow_stale") == "1" and behind is not None:
            behind, stale = None, behind
        else:
            stale = None
        body: dict[str, Any] = {
            "ready": behind is None,
            "base_version": follower.manifest.base_version,
            "next_delta_sequence": follower.next_sequence,
        }
        if behind is not None or stale is not None:
            body["reason"] = behind or stale
        return web.json_response(body, status=200 if behind is None else 503)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _refused(self, status: int, outcome: str, reason: str, **headers: str) -> web.Response:
        self.metrics.score_requests.labels(outcome).inc()
        return web.json_response({"error": reason}, status=status, headers=headers)

    async def _score(self, request: web.Request) -> web.Response:
        try:
            return await self._scored(request)
        except web.HTTPException:  # aiohttp's own answers
            raise
        except Exception as error:  # counted, not aiohttp's bare 500
            log.exception("a score request failed")
            return self._refused(500, "error", f"the server failed: {type(error).__name__}")

    async def _scored(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        limits = self.limits
        # A header that is not UTF-8 reaches here as surrogates: as bytes again, it is simply another token.
        sent = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if self._token is not None and not hmac.compare_digest(sent, b"Bearer " + self._token):
            return self._refused(401, "unauthorized", "a bearer token is needed", **{"WWW-Authenticate": "Bearer"})
        if self._in_flight >= limits.max_in_flight:
            return self._refused(
                503, "busy", f"{limits.max_in_flight} requests are being scored; retry", **{"Retry-After": "1"}
            )
        self._in_flight += 1
        try:
            if (request.content_length or 0) > limits.max_request_bytes:
                return self._refused(413, "too_large", f"the body is over {limits.max_request_bytes} bytes")
            try:
                data = await asyncio.wait_for(request.read(), limits.body_timeout_seconds)
            except web.HTTPRequestEntityTooLarge:
                return self._refused(413, "too_large", f"the body is over {limits.max_request_bytes} bytes")
            except TimeoutError:
                slow = self._refused(
                    408, "slow_body", f"the body did not arrive within {limits.body_timeout_seconds:g}s"
                )
                slow.force_close()  # the rest of that body is never read
                return slow
            loop = asyncio.get_running_loop()
            try:
                events = await loop.run_in_executor(self._pool, _events, data)
            except (ValueError, RecursionError) as error:
                return self._refused(400, "bad_request", f"bad request: {error!r:.300}")
            if len(events) > limits.max_events:
                return self._refused(413, "too_many_events", f"{len(events)} events; at most {limits.max_events}")
            outcome = await loop.run_in_executor(self._pool, self.score, events)
        finally:
            self._in_flight -= 1
        self.metrics.score_requests.labels("ok").inc()
        self.metrics.score_seconds.observe(time.perf_counter() - started)
        return web.json_response(
            {
                "tasks": outcome.tasks,
                "base_version": outcome.base_version,
                "step": outcome.step,
                "delta_sequence": outcome.delta_sequence,
                "results": outcome.results,
            }
        )

    def score(self, events: list[Any]) -> ScoreOutcome:
        """Probabilities for ``events``: each a string (base64 of an Avro payload in the topic's
        wire format) or an object (the event's fields by the reader schema's names). Decoding runs
        without the state lock; only the forward pass holds it (shared), so one request sees one
        whole state and deltas wait for forward passes only."""
        while True:
            served = self.follower.served
            assert served is not None
            results, batches = served.scorer.decode(events)
            with self.follower.lock.read():
                now = self.follower.served
                assert now is not None
                if now.model is served.model:  # else a new base came meanwhile: decode with its config
                    for kept, batch in batches:
                        for event, row in zip(kept, now.model.score(batch).tolist(), strict=True):
                            results[event] = {"probabilities": row}
                    break
        rejected = sum("error" in r for r in results)
        self.metrics.rejected_events.inc(rejected)
        self.metrics.scored_events.inc(len(results) - rejected)
        manifest = now.model.manifest
        return ScoreOutcome(results, manifest.tasks, manifest.base_version, now.step, now.next_sequence - 1)


def _events(data: bytes) -> list[Any]:
    body = json.loads(data)
    events = body.get("events") if isinstance(body, dict) else None
    if not isinstance(events, list):
        raise ValueError('the body must be a JSON object {"events": [...]}')
    return events


def _read_token(path: Path) -> bytes:
    token = path.read_bytes().strip()
    if not token:
        raise ValueError(f"the token file {path} is empty: write the bearer token clients send into it")
    return token
