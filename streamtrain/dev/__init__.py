"""Development tools: a throwaway local Kafka broker, a synthetic click stream and the demo.

The worker never imports them; they serve the tests, the benchmarks, ``make demo`` and the
``produce``, ``dev-kafka`` and ``demo`` commands.
"""
