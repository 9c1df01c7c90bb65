"""Writer schemas by id, for payloads in the Confluent wire format.

A Confluent-framed payload is magic byte 0, a 4-byte big-endian schema id, then the Avro body
written with that schema. The decoder asks a ``SchemaSource`` for the writer schema of each id it
meets once, and resolves it against the worker's reader schema. Two sources exist:

  - ``SchemaDirectory``: ``<dir>/<id>.avsc`` files, for air-gapped or pinned deployments;
  - ``SchemaRegistry``: a Confluent Schema Registry, through confluent-kafka's client.

Both answer None for an id that does not exist (its events go to the dead-letter topic), and raise
``BadWriterSchema`` for an answer that is not JSON (its events go there too, as bad_writer_schema).
A registry that cannot be reached is retried, never taken to mean "unknown": that would send good
events to the dead-letter topic during a registry outage.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Protocol

from streamtrain.config import FeaturesConfig, SchemaRegistryConfig
from streamtrain.retry import Backoff, retry

log = logging.getLogger(__name__)


class SchemaSourceUnavailable(RuntimeError):
    """The schema source could not answer within its timeout; the worker stops rather than guess."""


class BadWriterSchema(ValueError):
    """The writer schema of an id is not a valid Avro schema; the message says where it came from and why."""


class SchemaSource(Protocol):
    def writer_schema(self, schema_id: int) -> dict[str, Any] | None:
        """The parsed JSON of the Avro schema registered under ``schema_id``, or None if there is none;
        raises ``BadWriterSchema`` if that is not JSON."""


class SchemaDirectory:
    """Writer schemas as ``<id>.avsc`` files; read on first use, so files added later are found."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"writer schema directory {self.path} does not exist")

    def writer_schema(self, schema_id: int) -> dict[str, Any] | None:
        file = self.path / f"{schema_id}.avsc"
        if not file.exists():
            log.error("no writer schema %s in %s", file.name, self.path)
            return None
        return _parsed(file.read_bytes(), f"{file}")


class SchemaRegistry:
    """A Confluent Schema Registry; ``client`` may be any SchemaRegistryClient, e.g. its mock."""

    def __init__(self, config: SchemaRegistryConfig, client: Any = None):
        from confluent_kafka.schema_registry import SchemaRegistryClient

        self.config = config
        self.client = client or SchemaRegistryClient({"url": config.url, **config.client_properties()})

    def writer_schema(self, schema_id: int) -> dict[str, Any] | None:
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        def fetch() -> Any:
            try:
                return self.client.get_schema(schema_id)
            except SchemaRegistryError as error:
                if error.http_status_code == 404:
                    log.error("schema id %d is not registered at %s", schema_id, self.config.url)
                    return None
                raise

        def retrying(failure: Exception, _attempt: int, wait: float) -> None:
            log.warning(
                "schema registry %s failed for id %d (%s); retrying in %.1fs", self.config.url, schema_id, failure, wait
            )

        try:
            # Connection refused and timeouts come as requests/httpx errors: every error is retried.
            schema = retry(
                fetch,
                Backoff(initial=0.5, maximum=10.0, timeout=self.config.timeout_seconds),
                retry_on=Exception,
                on_retry=retrying,
            )
        except Exception as failure:
            raise SchemaSourceUnavailable(
                f"schema registry {self.config.url} did not answer for schema id {schema_id} within "
                f"{self.config.timeout_seconds:.0f}s: {failure}"
            ) from failure
        if schema is None:
            return None
        if (schema.schema_type or "AVRO") != "AVRO":
            log.error("schema id %d is %s, not Avro", schema_id, schema.schema_type)
            return None
        if schema.references:
            # Named types from other subjects would have to be fetched and inlined; not supported yet.
            log.error("schema id %d uses schema references, which streamtrain does not resolve", schema_id)
            return None
        return _parsed(schema.schema_str, f"schema id {schema_id} at {self.config.url}")


def _parsed(text: str | bytes, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8
        raise BadWriterSchema(f"{where} is not JSON: {error}") from error


def schema_source(features: FeaturesConfig) -> SchemaSource | None:
    """The configured source of writer schemas; None for raw (schemaless) payloads."""
    if features.wire_format == "raw":
        return None
    if features.schema_registry is not None:
        return SchemaRegistry(features.schema_registry)
    return SchemaDirectory(features.resolved_writer_schemas_dir())
