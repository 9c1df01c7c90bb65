"""Development tools: a throwaway local Kafka broker, a synthetic click stream and the demo.

The worker never imports them; they serve the tests, the benchmarks, ``make demo`` and the
``produce``, ``dev-kafka`` and ``demo`` commands.
"""

from pathlib import Path

# The source checkout: deploy/worker.yaml, the broker jars `make setup` fetches into .cache/ and
# the benchmarks' results/ and docs/bench/ are there, not in an installed package.
CHECKOUT = Path(__file__).resolve().parents[2]
