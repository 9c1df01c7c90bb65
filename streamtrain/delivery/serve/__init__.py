"""``streamtrain serve``: a reference scoring server that follows the newest base and its deltas.

Three rooms, each a module:

- ``follower``: keeps the served state at the newest base plus the deltas of its chain, read from
  a delta source (``sources``: a Kafka topic or a folder);
- ``scorer``: turns a request's events into batches with the worker's own decoder, for one base;
- ``server``: the HTTP server (``ScoringServer``) over both, with its limits for clients it does
  not trust; ``metrics`` holds its Prometheus metrics.
"""

from streamtrain.delivery.serve.server import ScoreOutcome, ScoringServer, ServeLimits
from streamtrain.delivery.serve.sources import DeltaSource, DeltaSourceUnavailable, DirectoryDeltas, KafkaDeltas

__all__ = [
    "DeltaSource",
    "DeltaSourceUnavailable",
    "DirectoryDeltas",
    "KafkaDeltas",
    "ScoreOutcome",
    "ScoringServer",
    "ServeLimits",
]
