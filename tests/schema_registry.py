"""A stand-in for a Confluent Schema Registry, for the tests: the REST calls confluent-kafka's
AvroSerializer and streamtrain make (register a subject's schema, fetch a schema by id), on
127.0.0.1. It is no registry (no compatibility checks, no storage): the registry is not what these
tests test, and no registry server installs from the package registries this project uses
(Karapace is not on PyPI, Confluent's is not on Maven Central)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar


class StandInRegistry(BaseHTTPRequestHandler):
    """GET /schemas/ids/<id> (failing ``failures`` times first: 503; answering after ``delays[id]``
    seconds) and POST /subjects/<subject>/versions (an id per distinct schema)."""

    schemas: ClassVar[dict[int, str]] = {}
    delays: ClassVar[dict[int, float]] = {}
    failures = 0
    requests = 0

    def do_GET(self):
        type(self).requests += 1
        match = re.match(r"^/schemas/ids/(\d+)/?$", self.path.split("?")[0])
        if match is None:  # e.g. the serializer's look-up of subject associations, which it may go without
            self._reply(404, {"error_code": 40401, "message": f"no such call: GET {self.path}"})
            return
        schema_id = int(match[1])
        time.sleep(self.delays.get(schema_id, 0.0))
        if type(self).failures > 0:
            type(self).failures -= 1
            self._reply(503, {"error_code": 50301, "message": "overloaded"})
        elif schema_id in self.schemas:
            self._reply(200, {"schema": self.schemas[schema_id]})
        else:
            self._reply(404, {"error_code": 40403, "message": "Schema not found"})

    def do_POST(self):
        type(self).requests += 1
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if not self.path.split("?")[0].rstrip("/").endswith("/versions") or "schema" not in body:
            self._reply(404, {"error_code": 404, "message": f"no such call: POST {self.path}"})
            return
        known = {text: schema_id for schema_id, text in self.schemas.items()}
        schema_id = known.get(body["schema"]) or max(self.schemas, default=0) + 1
        self.schemas[schema_id] = body["schema"]
        self._reply(200, {"id": schema_id})

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@contextmanager
def stand_in_registry(schemas: dict[int, str] | None = None) -> Iterator[str]:
    """Serves a fresh ``StandInRegistry`` holding ``schemas``; yields its URL."""
    StandInRegistry.schemas, StandInRegistry.failures, StandInRegistry.requests = dict(schemas or {}), 0, 0
    StandInRegistry.delays = {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandInRegistry)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
