"""The demo's server: it starts once the worker's first base is there, follows the delta topic on the
real broker, answers /score over HTTP, and reports its freshness against the trained step."""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.request

import pytest

from delivery_states import held_out, small_config, train_states
from streamtrain.config import parse_config
from streamtrain.delivery.artifact import export_snapshot
from streamtrain.dev.demo_serve import DemoServer
from streamtrain.dev.kafka import free_port

pytestmark = pytest.mark.integration


def test_demo_server_waits_for_the_first_base_then_serves_and_reports_freshness(kafka, topic_name, tmp_path):
    states = tmp_path / "states"
    (snapshot,) = train_states(states, 1, small_config(), [2], [1])
    raw = small_config()
    raw["kafka"] = {"bootstrap_servers": kafka.bootstrap_servers, "topic": topic_name}
    raw["checkpoint"] = {"path": str(tmp_path / "snapshots")}
    raw["delivery"] = {"enabled": True}
    config = parse_config(raw, environ={})
    demo = DemoServer(config, lambda: 5.0, port=free_port())
    demo.start()
    try:
        time.sleep(1)  # no base yet: it waits, and the demo goes on
        assert demo.server is None and demo.thread.is_alive()
        # The topic the worker would have created by then.
        kafka.create_topic(f"{topic_name}.model", 1)
        export_snapshot(snapshot, None, tmp_path / "snapshots" / "serving", version=1, new_chain=True)
        deadline = time.monotonic() + 60
        while demo.server is None and time.monotonic() < deadline:
            threading.Event().wait(0.2)
        assert demo.server is not None, "the server did not start on the first base"
        payloads, _records = held_out(3)
        request = urllib.request.Request(
            f"http://127.0.0.1:{demo.port}/score",
            json.dumps({"events": [base64.b64encode(p).decode() for p in payloads]}).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert all("probabilities" in r for r in json.loads(reply.read())["results"])
        # The states' events carry no event time; as if the newest event trained were 5 s old:
        demo.server.metrics.high_water_ms = int(time.time() * 1000) - 5000
        line = demo.freshness_line(demo.server)
        assert line.startswith("serving: step 2, 3 behind training, delta -1, freshness ")
        assert 5.0 <= float(line.split("freshness ")[1].split("s ")[0]) < 15.0
    finally:
        demo.stop()
    assert not demo.thread.is_alive()
