"""The worker's configuration: YAML on disk, STREAMTRAIN_* environment overrides, validated at the edge.

Every field can be overridden from the environment: the variable name is ``STREAMTRAIN_`` plus the
field's path joined by ``__``, e.g. ``STREAMTRAIN_KAFKA__BOOTSTRAP_SERVERS=broker:9092`` or
``STREAMTRAIN_FEATURES__TABLES__0__NUM_EMBEDDINGS=500000``. Values are parsed as YAML scalars or
flow collections, so ``[64, 16]`` and ``true`` work. A client property's name is dotted, and a shell
cannot export a name with a dot in it: under ``client_config`` and ``client_config_files``, each dot
of the property is written ``__``, so ``STREAMTRAIN_KAFKA__CLIENT_CONFIG__SASL__MECHANISM=PLAIN`` sets
``sasl.mechanism``. Every client property is checked at start-up: a name librdkafka (or the registry
client) does not know, or a value it refuses, stops the worker with exit code 2, naming it.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import time
import types
from collections.abc import Mapping
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from streamtrain.schema import ID_KINDS, NUMBER_KINDS, field_kind, field_nullable, field_schema, load_schema

ENV_PREFIX = "STREAMTRAIN_"
# Holds schemas/, shipped as package data: configs name the bundled schemas as schemas/<name>.avsc.
PACKAGE_DIR = Path(__file__).resolve().parent


class ConfigError(ValueError):
    """A configuration that cannot run; the message names each bad field and how to fix it."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _ClientProperties(_Strict):
    """Client properties with secrets kept out of the YAML: they are read from files instead."""

    # Where the maps sit in the config, for messages and the variables that set them.
    section: ClassVar[str]

    client_config: dict[str, str] = Field(
        default={},
        description="Extra client properties, e.g. security.protocol or sasl.mechanism. A secret "
        "(a name with password or secret in it, a key PEM, user.info) is refused here: use client_config_files.",
    )
    client_config_files: dict[str, Path] = Field(
        default={},
        description="Properties whose values are read from files, so that secrets such as sasl.password or "
        "basic.auth.user.info never sit in the YAML or in a log.",
    )

    @field_validator("client_config")
    @classmethod
    def _no_inline_secrets(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if "password" in key or "secret" in key or key.endswith((".key.pem", "user.info")):
                raise ValueError(f"{key!r} is a secret: put it in a file and name it under client_config_files instead")
        return value

    def client_properties(self) -> dict[str, Any]:
        """The properties, secrets included; never log the result. A file that cannot be read is a
        ConfigError naming its property."""
        props = dict(self.client_config)
        for key, path in self.client_config_files.items():
            try:
                props[key] = Path(path).read_text().strip()
            except OSError as error:
                where = f"{self.section}.client_config_files.{key}"
                variable = property_variable(self.section, "client_config_files", key)
                raise ConfigError(
                    f"invalid worker configuration:\n  {where}: cannot read {path}: {error.strerror or error}; "
                    f"mount the file there, or name another ({variable})"
                ) from None
        return props


def property_variable(section: str, field: str, key: str) -> str:
    """The environment variable that sets client property ``key`` of ``section``'s ``field``: each
    dot of the property written ``__``."""
    return ENV_PREFIX + "__".join([*section.split("."), field, *key.split(".")]).upper()


# Silences librdkafka while it only checks properties (a consumer property in a producer is a warning).
_PROBE_LOG = logging.getLogger("streamtrain.kafka.probe")
_PROBE_LOG.addHandler(logging.NullHandler())
_PROBE_LOG.propagate = False
_UNKNOWN_PROPERTY = re.compile(r'^No such configuration property: "(.+)"$')
_BAD_VALUE = re.compile(r'^Invalid value .*for configuration property "(.+)"$')


def librdkafka_refusal(properties: Mapping[str, Any]) -> str | None:
    """librdkafka's reason for refusing ``properties`` (an unknown name, a bad value, a login half
    set), or None. A client is built with them but without brokers, so nothing connects; it takes
    tens of milliseconds."""
    from confluent_kafka import KafkaException, Producer

    try:
        Producer({**properties, "logger": _PROBE_LOG})
    except KafkaException as error:
        return str(error.args[0].str()).removeprefix("Failed to create producer: ")
    return None


def librdkafka_problems(properties: Mapping[str, Any], section: str, field: str, names_only: bool) -> list[str]:
    """Each property of ``properties`` librdkafka does not know, with the property it likely meant,
    and unless ``names_only`` (values read from files later), each value it refuses. Other refusals
    (a login half set, whose other half may come from a file) are ``check_clients``'s, at start-up."""
    if names_only:
        return [_unknown_property(name, section, field) for name in properties if _unknown_to_librdkafka(name)]
    remaining, problems = dict(properties), []
    while remaining and (refusal := librdkafka_refusal(remaining)) is not None:
        unknown, bad = _UNKNOWN_PROPERTY.match(refusal), _BAD_VALUE.match(refusal)
        if unknown and unknown[1] in remaining:
            name = unknown[1]
            problems.append(_unknown_property(name, section, field))
        elif bad and bad[1] in remaining:
            name = bad[1]
            problems.append(f"{name!r}: librdkafka refuses the value {remaining[name]!r}")
        else:
            break
        del remaining[name]
    return problems


def _unknown_to_librdkafka(name: str) -> bool:
    return bool(_UNKNOWN_PROPERTY.match(librdkafka_refusal({name: ""}) or ""))


def _unknown_property(name: str, section: str, field: str) -> str:
    dotted = name.replace("_", ".")
    if dotted == name or _unknown_to_librdkafka(dotted):
        return f"{name!r}: librdkafka has no such property"
    return (
        f"{name!r}: librdkafka has no such property; did you mean {dotted!r}? In an environment variable, "
        f"write each dot of a property as __: {property_variable(section, field, dotted)}"
    )


# Consumer properties streamtrain sets itself, and why: exactly-once rests on how positions are
# tracked and committed, so client_config may not change them.
OWNED_PROPERTIES = {
    "bootstrap.servers": "set kafka.bootstrap_servers instead",
    "group.id": "set kafka.group_id instead",
    "enable.auto.commit": "the worker commits only trained or snapshotted positions",
    "enable.auto.offset.store": "the worker commits only trained or snapshotted positions",
    "enable.partition.eof": "the worker sets it for --until-end",
    "auto.offset.reset": "set kafka.start_at to choose where reading starts",
    "error_cb": "the worker counts and logs client errors",
    "logger": "librdkafka's log goes to the Python logger streamtrain.kafka",
}


class KafkaConfig(_ClientProperties):
    """The source: the cluster, the topic, and librdkafka's consumer properties (client_config
    overrides the consumer's defaults; the properties exactly-once rests on are refused). The
    dead-letter and delta producers use the same properties."""

    section: ClassVar[str] = "kafka"

    bootstrap_servers: str = Field(
        min_length=1, description="The brokers, comma-separated host:port (librdkafka's bootstrap.servers)."
    )
    topic: str = Field(min_length=1, description="The topic of click events to train on.")
    group_id: str = Field(
        default="streamtrain",
        description="The consumer group the worker commits its trained (or snapshotted) positions to, so lag "
        "dashboards are true; partitions are assigned explicitly, not by the group.",
    )
    connect_timeout_seconds: float = Field(
        default=30.0, gt=0, description="How long start-up waits for a broker to answer before the worker exits 4."
    )
    start_at: str | None = Field(
        default=None,
        description="Where reading starts when no snapshot is restored: earliest, latest, or a time (ISO-8601 "
        "with a timezone, or epoch milliseconds), i.e. each partition's first message whose timestamp is at or "
        "after it. Unset: the group's committed offsets (only without checkpoint.path), else the earliest.",
    )
    partition_discovery_seconds: float = Field(
        default=10.0,
        ge=0,
        description="How often each rank asks for the topic's partition count (one metadata request). Partitions "
        "added while the worker runs are read from their beginning by the rank partition % world size names. "
        "0: never; they are read after a restart.",
    )
    fetch_queue: bool = Field(
        default=True,
        description="Read fetched messages through librdkafka's queue API into arrays (streamtrain/rdkafka.py); "
        "false reads them through confluent-kafka's Consumer.consume, a Python object per message.",
    )

    @field_validator("client_config", "client_config_files")
    @classmethod
    def _not_owned(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if key in OWNED_PROPERTIES:
                raise ValueError(f"{key!r} is set by streamtrain and cannot be overridden: {OWNED_PROPERTIES[key]}")
        return value

    @field_validator("client_config", "client_config_files")
    @classmethod
    def _known_to_librdkafka(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        field = str(info.field_name)
        problems = librdkafka_problems(value, cls.section, field, names_only=field == "client_config_files")
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @field_validator("start_at", mode="before")
    @classmethod
    def _start_at_as_text(cls, value: Any) -> Any:
        # YAML reads an unquoted time as a datetime, and digits as an int.
        if isinstance(value, date):
            return value.isoformat()
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("start_at")
    @classmethod
    def _start_at_understood(cls, value: str | None) -> str | None:
        if value is not None:
            start_position(value)
        return value

    def start_position(self) -> Literal["earliest", "latest"] | int | None:
        """``start_at`` as earliest, latest or epoch milliseconds; None if unset."""
        return None if self.start_at is None else start_position(self.start_at)

    def librdkafka(self) -> dict[str, str]:
        """The librdkafka properties, secrets included; never log the result."""
        return {"bootstrap.servers": self.bootstrap_servers, **self.client_properties()}


def start_position(text: str) -> Literal["earliest", "latest"] | int:
    if text in ("earliest", "latest"):
        return text  # type: ignore[return-value]
    if text.isdigit():
        if int(text) < 10**11:  # before 1973 in milliseconds: epoch seconds, most likely
            raise ValueError(f"{text!r} looks like epoch seconds; give epoch milliseconds ({text}000)")
        return int(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is not earliest, latest, an ISO-8601 time such as 2026-11-30T12:00:00Z, or epoch milliseconds"
        ) from None
    if moment.tzinfo is None:
        raise ValueError(f"{text!r} has no timezone: add one, e.g. {text}Z for UTC")
    # Whole milliseconds, rounded up (a message at or after the time), without float rounding.
    return -((datetime(1970, 1, 1, tzinfo=UTC) - moment) // timedelta(milliseconds=1))


ShardingTypeName = Literal[
    "data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise"
]
ComputeKernelName = Literal["dense", "fused", "fused_uvm", "fused_uvm_caching"]


class EvictionConfig(_Strict):
    """Which live id gives up its row when a managed table is full (streamtrain/idspace.py)."""

    policy: Literal["lru", "lfu", "ttl"] = Field(
        default="lru",
        description="lru: the id seen longest ago gives up its row; lfu: the id seen least often (counts halve "
        "every interval, so old popularity fades); ttl: as lru, and besides, every interval frees the rows of "
        "ids unseen for longer than the horizon.",
    )
    ttl_steps: int | None = Field(
        default=None, gt=0, description="ttl's horizon in steps; set this or ttl_seconds with policy ttl."
    )
    ttl_seconds: float | None = Field(
        default=None,
        gt=0,
        description="ttl's horizon in event time (the newest event of each step); set this or ttl_steps with "
        "policy ttl.",
    )
    interval_steps: int = Field(
        default=100,
        gt=0,
        description="How often, in steps, ttl expires rows, lfu halves its counts and min_count admission halves "
        "its counts of waiting ids.",
    )

    @model_validator(mode="after")
    def _horizon_with_ttl(self) -> EvictionConfig:
        horizons = [n for n in ("ttl_steps", "ttl_seconds") if getattr(self, n) is not None]
        if self.policy == "ttl" and len(horizons) != 1:
            raise ValueError(
                "policy ttl needs exactly one horizon: set either ttl_steps or ttl_seconds (event time)"
                + (" (both are set)" if horizons else "")
            )
        if self.policy != "ttl" and horizons:
            raise ValueError(f"{horizons[0]} is only read with policy: ttl; set that or remove it")
        return self


# Chosen on bench idspace's tailed leg (docs/benchmarks.md#bench-idspace): with a third of the events from ids seen
# once, admitting every id lets the one-offs evict live ids' rows.
DEFAULT_ADMISSION = {"min_count": 2}


class AdmissionConfig(_Strict):
    """Which new ids get a row of a managed table; the others share its unknown row meanwhile."""

    min_count: int | None = Field(
        default=None,
        gt=0,
        le=65_535,
        description="Admit an id once it has been seen this many times (counted in a fixed-size sketch of uint16 "
        "cells, which saturate at 65,535, halved every eviction interval and whenever they average a sighting "
        "each). Set this or probability.",
    )
    probability: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Admit a new id at each sighting with this probability (the same draw on every rank). Set "
        "this or min_count.",
    )

    @model_validator(mode="after")
    def _one_rule(self) -> AdmissionConfig:
        if (self.min_count is None) == (self.probability is None):
            raise ValueError(
                "set exactly one of min_count (e.g. {min_count: 2}) or probability (e.g. {probability: 0.5})"
            )
        return self


class TableConfig(_Strict):
    """One id feature and its embedding table (docs/features.md)."""

    name: str = Field(min_length=1, description="The feature's and its table's name, unique among the tables.")
    field: str = Field(
        min_length=1,
        description="The schema field holding this feature's ids (a path such as user.id for a nested record); "
        "an int, long, string, bytes, boolean or enum, or an array of one.",
    )
    num_embeddings: int = Field(
        gt=0, description="The table's rows. A managed table sets rows instead (num_embeddings is then rows)."
    )
    embedding_dim: int = Field(
        gt=0,
        description="The embedding's width, a multiple of 4 (fbgemm's fused kernel needs it). The built-in "
        "architectures need one width for every table (their interactions pair the embeddings); a model.module's "
        "tables may differ (docs/models.md).",
    )
    pooling: Literal["sum", "mean"] = Field(default="sum", description="How a multi-valued feature's rows are pooled.")
    id_mapping: Literal["modulo", "hash", "managed"] = Field(
        default="modulo",
        description="modulo: id mod num_embeddings, which keeps small integer ids readable in the table; hash: "
        "splitmix64 first, for large or structured ids (string ids are always hashed); managed: every live id "
        "gets a row of its own, with admission and eviction (docs/features.md, Managed ids).",
    )
    rows: int | None = Field(
        default=None,
        ge=2,
        description="id_mapping managed only: the table's size; rows - 1 hold live ids and the last is the "
        "unknown row, shared by ids without a row (yet).",
    )
    buckets: int | None = Field(
        default=None,
        ge=1,
        le=65_536,
        description="id_mapping managed only: the virtual buckets its id map is split into, each a fixed range of "
        "rows that an id's hash picks; each rank owns a contiguous run of them, holds and maps only their ids, and "
        "admits and evicts within each bucket. A snapshot restores at any world size, but only with the same "
        "buckets. Unset: one per 4,096 live rows, at least 1 and at most 1,024.",
    )
    eviction: EvictionConfig | None = Field(
        default=None, description="id_mapping managed only: which live id gives up its row (unset: lru)."
    )
    admission: AdmissionConfig | None = Field(
        default=None,
        description="id_mapping managed only: which new ids get a row. Unset: {min_count: 2}, so an id seen once "
        "never takes a live id's row (docs/features.md, Admission); {probability: 1} admits every new id.",
    )
    sharding_types: list[ShardingTypeName] | None = Field(
        default=None,
        min_length=1,
        description="The sharding planner's choices for this table; unset lets it choose. Without a GPU only "
        "data_parallel, table_wise, column_wise and table_column_wise exist.",
    )
    compute_kernels: list[ComputeKernelName] | None = Field(
        default=None, min_length=1, description="The planner's compute kernels for this table; unset lets it choose."
    )
    shares_table_with: str | None = Field(
        default=None,
        description="Look this feature's ids up in another entry's table: one embedding per id for both (a "
        "user's recent categories and the ad's category), so their dot product in DLRM's interaction is large "
        "exactly when the ad's category is among the recent ones. num_embeddings, embedding_dim, pooling and "
        "id_mapping must match the owner's, which cannot be managed; sharding is the owner's.",
    )

    @model_validator(mode="before")
    @classmethod
    def _managed_sized_by_rows(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        managed = raw.get("id_mapping") == "managed"
        if not managed:
            extra = [k for k in ("rows", "buckets", "eviction", "admission") if raw.get(k) is not None]
            if extra:
                raise ValueError(f"{extra[0]} is only read with id_mapping: managed; set that or remove it")
            return raw
        if raw.get("rows") is None:
            raise ValueError("id_mapping managed needs rows, the table's size (e.g. rows: 100000)")
        if raw.get("admission") is None:
            raw = {**raw, "admission": DEFAULT_ADMISSION}
        given = raw.get("num_embeddings")
        if given is not None and given != raw["rows"]:
            raise ValueError(
                f"num_embeddings {given} disagrees with rows {raw['rows']}: a managed table is sized by rows; "
                "remove num_embeddings"
            )
        return {**raw, "num_embeddings": raw["rows"]}

    @model_validator(mode="after")
    def _managed_rows_are_reset_in_place(self) -> TableConfig:
        if self.id_mapping != "managed":
            return self
        if self.buckets is not None and self.buckets > self.live_rows():
            raise ValueError(f"buckets {self.buckets} exceeds the {self.live_rows()} live rows: each needs a row")
        # Evicted rows are re-initialised in fbgemm's table kernels, on whichever rank holds them;
        # a data-parallel table is a replicated torch parameter with its own optimizer instead.
        if self.sharding_types and "data_parallel" in self.sharding_types:
            raise ValueError(
                "sharding_types: a managed table cannot be data_parallel (its evicted rows are reset in the "
                "sharded table kernels); use table_wise, column_wise or row_wise"
            )
        if self.compute_kernels and "dense" in self.compute_kernels:
            raise ValueError(
                "compute_kernels: a managed table needs a fused kernel (its rows are reset there); remove dense"
            )
        return self

    def live_rows(self) -> int:
        """A managed table's rows for live ids: all but the unknown row."""
        return self.num_embeddings - 1

    def id_buckets(self) -> int:
        """A managed table's virtual buckets (streamtrain/idspace.py)."""
        return self.buckets if self.buckets is not None else min(max(self.live_rows() // 4096, 1), 1024)


class DenseFeature(_Strict):
    """A numeric field fed to the dense arch."""

    field: str = Field(
        min_length=1, description="The schema field: an int, long, float, double or boolean; a null reads as 0.0."
    )
    transform: Literal["none", "log1p"] = Field(
        default="none", description="Applied before the value is made float32; log1p tames heavy tails."
    )


class SchemaRegistryConfig(_ClientProperties):
    """A Confluent Schema Registry; client_config takes the registry client's properties."""

    section: ClassVar[str] = "features.schema_registry"

    url: str = Field(
        pattern=r"^(https?|mock)://",
        description="The registry, e.g. https://registry:8081; credentials in it are refused (they would reach "
        "logs): name a file under client_config_files as basic.auth.user.info.",
    )
    # pydantic validates each model's field as that model declares it.
    client_config: dict[str, str | int | float | bool] = Field(  # type: ignore[assignment]
        default={},
        description="The registry client's properties, typed (max.retries: 3, timeout: 10), unlike librdkafka's; "
        "secrets go under client_config_files.",
    )
    timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        description="How long an unreachable registry is retried before the worker stops with an error (an "
        "outage must not send good events to the dead-letter topic).",
    )

    @field_validator("client_config", "client_config_files")
    @classmethod
    def _known_to_the_registry_client(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        # One at a time: the client checks the values of the names it knows before it names the
        # others. A file's property is tried with a value of the form the secrets take.
        files = info.field_name == "client_config_files"
        unknown = [
            name
            for name, given in value.items()
            if (registry_client_refusal({name: "user:password" if files else given}) or "").startswith(
                "Unrecognized properties"
            )
        ]
        if unknown:
            raise ValueError(f"confluent-kafka's registry client has no properties {unknown}")
        return value

    @field_validator("url")
    @classmethod
    def _no_credentials_in_url(cls, value: str) -> str:
        if "@" in value.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError(
                "credentials in the URL would reach logs: put user:password in a file and name it "
                "under client_config_files as basic.auth.user.info"
            )
        return value


class FeaturesConfig(_Strict):
    """The events' Avro schema and wire format, and what becomes of their fields (docs/features.md)."""

    schema_path: Path = Field(
        default=Path("schemas/click_event.avsc"),
        description="The reader schema: what the features are named against. In the confluent wire format each "
        "payload's writer schema is resolved to it with Avro's rules. A relative path is read from the working "
        "directory, else from the package (the bundled schemas).",
    )
    wire_format: Literal["raw", "confluent"] = Field(
        default="raw",
        description="raw: schemaless Avro bodies written with schema_path. confluent: magic byte 0, a 4-byte "
        "schema id, then the body, as confluent-kafka's AvroSerializer writes; writer schemas come from "
        "schema_registry or from writer_schemas_dir.",
    )
    schema_registry: SchemaRegistryConfig | None = Field(
        default=None, description="With wire_format confluent: where writer schemas are looked up by id."
    )
    writer_schemas_dir: Path | None = Field(
        default=None,
        description="With wire_format confluent, instead of schema_registry: a folder of <id>.avsc writer schemas.",
    )
    tables: list[TableConfig] = Field(min_length=1, description="The id features, one embedding table each.")
    dense: list[DenseFeature] = Field(min_length=1, description="The dense (numeric) features, in order.")
    label: str = Field(
        default="clk",
        description="The single task's label field (0 or 1; a null dead-letters the event). With model.tasks, "
        "leave it out: each task names its own.",
    )
    event_time: str = Field(
        default="event_time",
        description="The event-time field: a long of epoch milliseconds, or timestamp-micros. Freshness and "
        "ttl eviction read it.",
    )
    max_event_time_skew_seconds: float = Field(
        default=3600.0,
        gt=0,
        description="How far past this host's wall time an event time is believed: a later one (a producer "
        "writing microseconds, a wrong clock) is taken as wall time + this for ttl eviction and freshness, "
        "and counted in streamtrain_event_times_clamped_total.",
    )
    non_finite_dense: Literal["dead_letter", "clip"] = Field(
        default="dead_letter",
        description="A NaN or infinite dense value (after its transform, as float32): dead_letter rejects the "
        "event; clip trains it with NaN as 0 and +-inf as +-float32 max.",
    )

    def event_time_bound_ms(self, now: float | None = None) -> int:
        """The latest event time believed at wall time ``now`` (seconds; unset: now). A later one
        is taken as this bound for ttl eviction and freshness (docs/durability.md)."""
        return int(((time.time() if now is None else now) + self.max_event_time_skew_seconds) * 1000)

    @model_validator(mode="after")
    def _unique_names(self) -> FeaturesConfig:
        names = [t.name for t in self.tables]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"table names must be unique; repeated: {duplicated}")
        return self

    @model_validator(mode="after")
    def _shared_tables_match_their_owner(self) -> FeaturesConfig:
        by_name = {t.name: t for t in self.tables}
        owners = [t.name for t in self.tables if t.shares_table_with is None]
        shared = [(i, t) for i, t in enumerate(self.tables) if t.shares_table_with is not None]
        for i, table in shared:  # every owner first: a mismatch with a table that is no owner means nothing
            if table.shares_table_with not in owners:
                raise ValueError(
                    f"features.tables.{i}.shares_table_with: {table.shares_table_with!r} is not another table "
                    f"that has a table of its own; name one of {owners}"
                )
        for i, table in shared:
            owner = by_name[str(table.shares_table_with)]
            if owner.id_mapping == "managed":
                # One table would take rows from two id maps, each giving away rows the other holds.
                raise ValueError(
                    f"features.tables.{i}.shares_table_with: {owner.name} is managed (id_mapping: managed), and a "
                    f"managed table's rows are given by its own feature's id map, which the sharing feature's ids "
                    f"are not in; give {table.name} a table of its own (remove shares_table_with), or map both "
                    f"with hash or modulo"
                )
            for key in ("num_embeddings", "embedding_dim", "pooling", "id_mapping"):
                if getattr(table, key) != getattr(owner, key):
                    raise ValueError(
                        f"features.tables.{i}.{key}: {getattr(table, key)!r}, but the table it shares "
                        f"({owner.name}) has {getattr(owner, key)!r}; set the same"
                    )
            if table.sharding_types or table.compute_kernels:
                raise ValueError(
                    f"features.tables.{i}: a shared table is sharded as its owner ({owner.name}) is; "
                    f"set sharding_types and compute_kernels there"
                )
        return self

    def owned_tables(self) -> list[TableConfig]:
        """The entries that have an embedding table of their own: what is sharded and saved."""
        return [t for t in self.tables if t.shares_table_with is None]

    @model_validator(mode="after")
    def _one_writer_schema_source(self) -> FeaturesConfig:
        sources = [name for name in ("schema_registry", "writer_schemas_dir") if getattr(self, name) is not None]
        if self.wire_format == "confluent" and len(sources) != 1:
            raise ValueError(
                "wire_format confluent needs exactly one source of writer schemas: set either "
                "features.schema_registry.url or features.writer_schemas_dir" + (" (both are set)" if sources else "")
            )
        if self.wire_format == "raw" and sources:
            raise ValueError(f"features.{sources[0]} is only read with wire_format: confluent; set that or remove it")
        return self

    def resolved_schema_path(self) -> Path:
        return _resolved(self.schema_path)

    def resolved_writer_schemas_dir(self) -> Path:
        if self.writer_schemas_dir is None:
            raise ConfigError("features.writer_schemas_dir is not set")
        return _resolved(self.writer_schemas_dir)


def registry_client_refusal(properties: Mapping[str, Any], url: str = "http://127.0.0.1:8081") -> str | None:
    """Why confluent-kafka's SchemaRegistryClient refuses ``properties``, or None; it connects to
    nothing when built."""
    from confluent_kafka.schema_registry import SchemaRegistryClient

    try:
        SchemaRegistryClient({"url": url, **properties})
    except Exception as error:  # ValueError and TypeError by its checks, others by what they met
        return f"{type(error).__name__}: {error}" if not isinstance(error, (ValueError, TypeError)) else str(error)
    return None


def _resolved(path: Path) -> Path:
    """Paths relative to the working directory, else to the package (for the bundled schemas)."""
    path = Path(path)
    return path if path.is_absolute() or path.exists() else PACKAGE_DIR / path


class TaskConfig(_Strict):
    """One prediction target: a binary label read from the schema, with its own head and loss."""

    name: str = Field(
        min_length=1,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="The task's name: its tower's, and the task label of its metrics.",
    )
    label: str = Field(min_length=1, description="The schema field holding this task's label, a number in [0, 1].")
    loss_weight: float = Field(
        default=1.0, gt=0, description="Multiplies this task's summed loss; the tasks' losses are added."
    )
    required: bool = Field(
        default=True,
        description="true: an event whose label is null is dead-lettered (missing_label). false: it trains the "
        "other tasks, and its loss for this task is masked (a purchase not yet known, say).",
    )
    depends_on: str | None = Field(
        default=None,
        description="With model.multitask dbmtl: a task listed before this one, whose tower's last hidden layer "
        "this task's tower also reads (buy depends_on clk: a purchase follows a click).",
    )
    attribution_window_seconds: float | None = Field(
        default=None,
        gt=0,
        description="With delayed_labels: how long after its impression a positive still counts. A label sample "
        "arriving later is not a positive (ignored and counted); the task's matured metrics wait this long.",
    )
    correction: Literal["none", "fnw", "fnc", "es_dfm", "pu"] = Field(
        default="none",
        description="With delayed_labels: how training corrects for positives that arrive after their impression "
        "was trained as a negative (docs/delayed-labels.md). none: as they come (fake negatives bias the model "
        "down); fnw: fake negative weighting; fnc: fake negative calibration (served as b / (1 - b)); es_dfm: "
        "importance weights with the share of positives that arrive late, estimated online; pu: a late positive "
        "takes back the fake negative its impression was trained as.",
    )


def default_tasks(features: FeaturesConfig) -> list[TaskConfig]:
    """The single-label config's one task: ``features.label``, named after it, required."""
    return [TaskConfig(name=features.label, label=features.label)]


class TargetMatchConfig(_Strict):
    """A candidate feature (the ad's category) and a history feature (the user's recent categories),
    both tables in features.tables, whose ids are compared (streamtrain/target_match.py)."""

    candidate: str = Field(min_length=1, description="The table whose one id is looked for (the ad's category).")
    history: str = Field(
        min_length=1, description="The table whose ids are searched for it (the user's recent categories)."
    )


class DCNv2Config(_Strict):
    """dcn_v2's cross network: TorchRec's LowRankCrossNet over [dense vector, embeddings]."""

    num_layers: int = Field(default=2, gt=0, description="Cross layers, each one more degree of feature crossing.")
    low_rank_dim: int = Field(
        default=32, gt=0, description="The rank of each cross layer's weight (U V^T, both [(tables + 1) x dim, rank])."
    )


class DeepFMConfig(_Strict):
    """deepfm's interaction: TorchRec's FMInteractionArch."""

    deep_dimension: int = Field(
        default=32, gt=0, description="Width of the deep layer over [dense vector, embeddings] beside the FM."
    )


class DINConfig(_Strict):
    """din's target attention: the candidate's embedding attends over each id of a history feature,
    kept unpooled in an EmbeddingCollection (streamtrain/models/din.py)."""

    candidate: str = Field(default="cate_id", min_length=1, description="The table whose embedding is the query.")
    history: str = Field(
        default="recent_cate_ids",
        min_length=1,
        description="The table whose ids are attended over, unpooled; every feature sharing its table is too.",
    )
    attention_layer_sizes: list[int] = Field(
        default=[32],
        min_length=1,
        description="The attention MLP over [query, key, query - key, query * key] of each history id, before its "
        "one weight.",
    )


# The architectures streamtrain ships (streamtrain/models/); model.module names a user's instead.
ArchitectureName = Literal["dlrm", "dcn_v2", "deepfm", "din"]


class ModelConfig(_Strict):
    """The net trained over the tables (a built-in architecture, or a user's module), with a head
    per task, and its optimizers."""

    architecture: ArchitectureName = Field(
        default="dlrm",
        description="The built-in architecture trained: dlrm, dcn_v2, deepfm or din (docs/models.md).",
    )
    module: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description='A user\'s model instead of a built-in: "package.module:factory", importable from PYTHONPATH; '
        "the factory takes a streamtrain.models.base.ModelSpec and returns the module (docs/models.md).",
    )
    options: dict[str, Any] = Field(
        default={}, description="Settings for model.module's factory, which reads them as spec.model.options."
    )
    dcn_v2: DCNv2Config = Field(default=DCNv2Config(), description="dcn_v2's cross layers.")
    deepfm: DeepFMConfig = Field(default=DeepFMConfig(), description="deepfm's deep layer.")
    din: DINConfig = Field(default=DINConfig(), description="din's candidate, history and attention MLP.")
    dense_arch_layer_sizes: list[int] = Field(
        default=[64, 16],
        description="The dense arch's MLP over the dense features; the last size must equal the tables' embedding_dim.",
    )
    over_arch_layer_sizes: list[int] = Field(
        default=[64, 32, 1],
        description="Each task's tower over the interaction (with mmoe, over its mix of experts); ends in 1, "
        "the logit.",
    )
    # At most 63: the decoder marks the labels it has read in one int64.
    tasks: list[TaskConfig] | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        description="The prediction targets (at most 63). Unset: one task on features.label, which is DLRM exactly.",
    )
    multitask: Literal["shared_bottom", "mmoe", "dbmtl"] = Field(
        default="shared_bottom",
        description="How the tasks share what sits above the interaction: shared_bottom gives each task a tower "
        "over it; mmoe mixes num_experts expert MLPs with a softmax gate per task; dbmtl is shared_bottom where a "
        "task's tower also reads the tower of the task it depends_on.",
    )
    num_experts: int = Field(default=4, gt=0, description="mmoe: the expert MLPs the tasks' gates mix.")
    expert_layer_sizes: list[int] = Field(default=[64], min_length=1, description="mmoe: each expert's layer sizes.")
    target_matches: list[TargetMatchConfig] = Field(
        default=[],
        description="Pairs of tables whose match count (how many of the history's ids equal the candidate's) "
        "the dense arch reads beside the dense features: target attention's exact-match kernel "
        "(streamtrain/target_match.py).",
    )
    sparse_optimizer: Literal["row_wise_adagrad", "adagrad", "sgd"] = Field(
        default="row_wise_adagrad",
        description="The tables' optimizer, fused into fbgemm's backward pass.",
    )
    sparse_learning_rate: float = Field(default=0.05, gt=0, description="The tables' learning rate.")
    dense_learning_rate: float = Field(
        default=0.001, gt=0, description="The dense layers' (and data-parallel tables') Adam learning rate."
    )
    seed: int = Field(
        default=0, description="Seeds the initial weights and a managed table's fresh rows, the same on every rank."
    )

    @field_validator("over_arch_layer_sizes")
    @classmethod
    def _ends_in_one_logit(cls, value: list[int]) -> list[int]:
        if len(value) < 2 or value[-1] != 1:
            raise ValueError("needs at least two layers and must end in 1 (the click logit), e.g. [64, 32, 1]")
        return value

    @field_validator("tasks")
    @classmethod
    def _unique_task_names(cls, value: list[TaskConfig] | None) -> list[TaskConfig] | None:
        names = [t.name for t in value or ()]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"task names must be unique; repeated: {duplicated}")
        return value

    @model_validator(mode="after")
    def _one_architecture(self) -> ModelConfig:
        if self.module is not None and self.architecture != "dlrm":
            raise ValueError("model.module replaces model.architecture: set one of them")
        if self.options and self.module is None:
            raise ValueError("model.options is only read by model.module's factory; set that or remove it")
        return self

    @model_validator(mode="after")
    def _dependencies_name_earlier_tasks(self) -> ModelConfig:
        seen: set[str] = set()
        for i, task in enumerate(self.tasks or ()):
            if task.depends_on is not None:
                where = f"model.tasks.{i}.depends_on"
                if self.multitask != "dbmtl":
                    raise ValueError(f"{where}: only dbmtl reads it; set model.multitask: dbmtl or remove it")
                if task.depends_on not in seen:
                    # Earlier only: a tower then always reads a tower already computed, and no
                    # dependency can loop.
                    raise ValueError(
                        f"{where}: {task.depends_on!r} is not a task listed before {task.name!r}; "
                        f"list the task it depends on first"
                    )
            seen.add(task.name)
        return self


# Events a step trains on each rank when batching.batch_size is unset, by the device the ranks train
# on (docs/batching.md). On an H200 a step took 6.2-6.7 ms from 1,024 to 32,768 events: host and
# launch work, not GPU work, so a bigger batch is nearly free there. 16,384 trains about 2.5M
# events/s a rank (8,192: 1.3-1.5M; 32,768: 4.9-5.3M, more than one rank's data path decodes), at
# half the updates per event of 32,768. The CPU's step grows with the batch, and 1,024 keeps it short.
DEFAULT_BATCH_SIZE = {"cpu": 1024, "cuda": 16_384}


# How the learning rates follow the batch (docs/batching.md, where the measurements are). The loss
# is the batch's mean, so a larger batch takes fewer, averaged steps per event. Adam's step is about
# its rate whatever the gradient's scale, so it covers the same ground only with a rate as many times
# larger as it takes fewer steps. So does plain SGD's for a row one event looks up (its gradient is
# the event's over the batch size). Adagrad's step for a row is normalised by that row's own
# gradients, and a row that few events look up is stepped once per batch it is in, at any batch
# size: its rate stays. Beyond 32 times the reference, Adam diverged.
MAX_LEARNING_RATE_SCALE = 32.0


class BatchingConfig(_Strict):
    """How each rank's prefetch thread cuts the stream into batches, and how the learning rates
    follow the batch."""

    batch_size: int = Field(
        default=DEFAULT_BATCH_SIZE["cpu"],
        gt=0,
        le=1_000_000,
        description="Events a step trains per rank; unset (or null): 1,024 on CPU, 16,384 on cuda (docs/batching.md).",
        # Filled in before validation, from DEFAULT_BATCH_SIZE for the device distributed.device
        # resolves to: the reference must not show the CPU's as the one default.
        json_schema_extra={"default_by_device": True},
    )
    max_batch_wait_ms: int = Field(
        default=200,
        gt=0,
        le=600_000,
        description="A quiet stream still trains promptly: a batch holding at least one event is cut after this.",
    )
    queue_size: int = Field(
        default=4,
        gt=0,
        le=1024,
        description="Decoded batches the prefetch thread may hold ready; it bounds the worker's memory.",
    )
    learning_rate_scaling: Literal["auto", "none"] = Field(
        default="auto",
        description=(
            "How model.sparse_learning_rate and model.dense_learning_rate follow the global batch (batch_size x "
            "ranks): auto multiplies the dense rate (Adam) and a sgd sparse rate by global batch / "
            "reference_batch_size, at most 32, and leaves an Adagrad sparse rate as it is (docs/batching.md); "
            "none uses both as given."
        ),
    )
    reference_batch_size: int = Field(
        default=1024,
        gt=0,
        le=1_000_000,
        description="The global batch (events a step over all ranks) the learning rates are tuned for.",
    )
    decode_threads: int | None = Field(
        default=None,
        gt=0,
        le=256,
        description=(
            "Threads that decode each batch, the prefetch thread among them (docs/datapath.md); unset: 1 "
            "when the rank trains on the CPU, whose other cores train; with CUDA, the cores per rank less "
            "two (the training thread, librdkafka and the snapshot writer)."
        ),
    )

    map_ahead: bool | None = Field(
        default=None,
        description=(
            "Whether managed tables' ids (docs/features.md) are mapped one batch ahead, on a thread of their own "
            "while the step before trains; unset: on when the rank trains on cuda, whose step leaves the host "
            "idle, off on the CPU, whose step has the cores."
        ),
    )

    @field_validator("decode_threads", "map_ahead", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if value == "" else value  # STREAMTRAIN_BATCHING__DECODE_THREADS= means unset


class MetricsConfig(_Strict):
    """Each rank's Prometheus endpoint (/metrics, /healthz, /readyz) and progress lines (docs/operating.md)."""

    host: str = Field(default="127.0.0.1", description="The address to listen on; 0.0.0.0 in a pod.")
    port: int = Field(
        default=9100, ge=0, le=65535, description="The port of local rank 0; rank r listens on port + LOCAL_RANK."
    )
    log_interval_seconds: float = Field(
        default=5.0,
        gt=0,
        description="How often a progress line is logged; without checkpoint.path, also how often trained "
        "positions are committed.",
    )
    auc_window: int = Field(
        default=100_000, gt=0, description="Events in the windowed progressive AUC, NE and calibration."
    )
    stall_seconds: float = Field(
        default=120.0,
        gt=0,
        description="/healthz fails once the training loop has not turned for this long (a hung collective, say).",
    )
    lag_refresh_seconds: float = Field(
        default=5.0, gt=0, description="How often the consumer lag per partition is refreshed."
    )


class DistributedConfig(_Strict):
    """The ranks: timeouts, the device, the planner's memory and threads (docs/ranks.md, docs/gpus.md)."""

    timeout_seconds: float = Field(
        default=120.0,
        gt=0,
        description="How long a collective waits for a peer before this rank gives up with an error (exit 1).",
    )
    plan_path: Path | None = Field(
        default=None, description="Where rank 0 writes the sharding plan as JSON; unset or empty: nowhere."
    )
    # Here, beside timeout_seconds, since the ranks stop together and a rank's shutdown waits on its peers.
    shutdown_grace_seconds: float = Field(
        default=30.0,
        gt=0,
        description="From a stop (a signal, the end of --until-end or --max-events, a peer's stop) to the exit, "
        "the final snapshot included; past it the worker exits 3 without a clean close.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto",
        description="auto: CUDA when a GPU is visible and the CUDA fbgemm-gpu is installed, else the CPU; cuda "
        "is refused at start when either is missing (streamtrain/device.py).",
    )
    hbm_gb: float | None = Field(
        default=None,
        gt=0,
        description="GPU memory per rank the sharding planner may fill, in GiB. Unset: the GPU's total memory.",
    )
    ddr_gb: float | None = Field(
        default=None,
        gt=0,
        description="Host memory per rank the sharding planner may fill, in GiB. Unset: the host's (or its "
        "cgroup limit) divided by the ranks on the host.",
    )
    intra_op_threads: int | None = Field(
        default=None,
        gt=0,
        description="Threads each rank's operators run on (torch.set_num_threads). Unset: OMP_NUM_THREADS when "
        "set, else the cores this process may use, shared among the host's ranks, less one for the data path "
        "and the snapshot writer. A large step's managed-id map (streamtrain/idspace.py) runs on as many.",
    )

    @field_validator("plan_path", "intra_op_threads", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if value == "" else value  # STREAMTRAIN_DISTRIBUTED__PLAN_PATH= means none


class CheckpointConfig(_Strict):
    """Exactly-once snapshots of the model, the optimizers and the Kafka positions (docs/checkpoints.md)."""

    path: str | None = Field(
        default=None,
        description="A local or shared directory, or an fsspec URL (s3://...); unset disables checkpointing, and "
        "the worker then starts from the consumer group's committed offsets.",
    )
    interval_seconds: float = Field(default=300.0, gt=0, description="Snapshot this often.")
    interval_steps: int | None = Field(default=None, gt=0, description="Also snapshot every N steps; unset: time only.")
    keep_last: int = Field(default=3, gt=0, description="Complete snapshots kept; older ones are removed.")
    async_mode: Literal["thread", "process"] = Field(
        default="thread",
        description="Where dcp.async_save writes: a thread of the worker, or a helper process that does not "
        "compete with training for the GIL (refused on CUDA).",
    )
    max_consecutive_failures: int = Field(
        default=3,
        gt=0,
        description="A failed snapshot is counted (streamtrain_checkpoint_failures_total) and retried at the "
        "next trigger; after this many in a row the worker exits 6, since training on would pile up work that a "
        "crash loses.",
    )
    init_from: str | None = Field(
        default=None,
        description="A warm start: while checkpoint.path holds no snapshot, take the weights from another run's "
        "snapshot (a step-<N> folder, or a checkpoint.path: its newest complete one), at any world size. Its "
        "Kafka positions are not taken. Once this run has snapshots, they win.",
    )
    init_optimizer: bool = Field(
        default=False, description="With init_from: take the optimizer state too; otherwise it starts fresh."
    )

    @model_validator(mode="after")
    def _init_from_needs_a_path(self) -> CheckpointConfig:
        if self.init_from and not self.path:
            raise ValueError("init_from needs checkpoint.path: set it to where this run writes its own snapshots")
        return self


class DeadLetterConfig(_Strict):
    """Events that cannot be decoded, and the error-rate pause (docs/operating.md, Dead letters)."""

    enabled: bool = Field(
        default=True,
        description="Produce events that cannot be decoded to topic (key, value, timestamp and headers as read, "
        "plus streamtrain.error.* and streamtrain.source.* headers) before the batch that covers their offsets "
        "trains. false: they are only logged and counted, and are lost.",
    )
    topic: str | None = Field(
        default=None,
        min_length=1,
        description="Unset: <kafka.topic>.dlq. Created at start with the topic_* settings when missing; if it "
        "cannot be, the worker exits 8 with the command that creates it. While it cannot be written, consumption "
        "blocks and retries, so no event is lost.",
    )
    topic_partitions: int = Field(
        default=1, gt=0, description="The dead-letter topic's partitions, when the worker creates it."
    )
    topic_replication_factor: int | None = Field(
        default=None,
        gt=0,
        description="The dead-letter topic's replication factor, when the worker creates it. Unset: the larger of "
        "the cluster's default.replication.factor and kafka.topic's replication factor.",
    )
    topic_retention_seconds: float | None = Field(
        default=None,
        gt=0,
        description="The dead-letter topic's retention (retention.ms), when the worker creates it. Unset: the "
        "cluster's default (log.retention.hours, 7 days unless changed).",
    )
    delivery_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="One write attempt's bound (librdkafka's message.timeout.ms); a failed write is retried for "
        "as long as it takes.",
    )
    retry_backoff_seconds: float = Field(default=1.0, gt=0, description="The wait before the first retry.")
    retry_backoff_max_seconds: float = Field(
        default=60.0, gt=0, description="The wait doubles after each failed retry, up to this."
    )
    max_error_rate: float = Field(
        default=0.1,
        gt=0,
        le=1,
        description="Consumption pauses for pause_seconds when more than this share of the last window_events "
        "events could not be decoded (1.0: never), then resumes with a fresh window.",
    )
    window_events: int = Field(default=10_000, gt=0, description="The error rate's window, in events.")
    pause_seconds: float = Field(default=60.0, gt=0, description="How long an error-rate pause lasts.")

    def resolved_topic(self, source_topic: str) -> str:
        return self.topic or f"{source_topic}.dlq"


class DelayedLabelsConfig(_Strict):
    """Labels that arrive after their impression (docs/delayed-labels.md): the three fields a joiner adds
    to each sample, read from the schema. An event whose kind is null trains as any event does."""

    kind_field: str = Field(
        default="sample_kind",
        min_length=1,
        description="The sample's kind: a string, or an enum with the symbols impression and label. impression: "
        "an impression with its labels as known at once; label: a positive that arrived later (its task's label "
        "1, the others null). Null: a plain event, trained as without this section.",
    )
    impression_id_field: str = Field(
        default="impression_id",
        min_length=1,
        description="A long naming the impression a sample is about; its Kafka key too, so that an impression "
        "and its late labels share a partition.",
    )
    impression_time_field: str = Field(
        default="impression_time",
        min_length=1,
        description="A long (timestamp-millis or -micros): when the impression was shown. A label sample's "
        "delay is its event time less this.",
    )
    matured_max_pending: int = Field(
        default=500_000,
        gt=0,
        description="Impressions (and as many late positives) each rank holds per task until their window "
        "closes, for the matured metrics; the oldest are dropped past it (streamtrain_matured_dropped_total).",
    )

    def fields(self) -> dict[str, str]:
        """The config's name of each sample field -> the schema field it names."""
        return {
            "kind_field": self.kind_field,
            "impression_id_field": self.impression_id_field,
            "impression_time_field": self.impression_time_field,
        }


class DeliveryConfig(_Strict):
    """Model delivery (docs/model-delivery.md): servable bases exported from the snapshots, and deltas of
    the rows touched since the last one, cut between steps like a snapshot."""

    enabled: bool = Field(
        default=False, description="Publish deltas and bases; needs checkpoint.path (the worker exits 2 without)."
    )
    topic: str | None = Field(
        default=None,
        min_length=1,
        description="The delta topic on kafka.bootstrap_servers; unset: <kafka.topic>.model. Created at start when "
        "missing, with one partition and a retention reaching back to the oldest kept base; if it cannot be, the "
        "worker exits 8 with the command that creates it.",
    )
    topic_replication_factor: int | None = Field(
        default=None,
        gt=0,
        description="The delta topic's replication factor, when the worker creates it. Unset: the larger of the "
        "cluster's default.replication.factor and kafka.topic's replication factor.",
    )
    directory: str | None = Field(
        default=None,
        min_length=1,
        description="Instead of the topic: a directory or fsspec URL of delta-<chain>-<sequence>/part-<i> files, "
        "COMPLETE last; deltas older than the oldest kept base are removed.",
    )
    path: str | None = Field(
        default=None,
        min_length=1,
        description="Where bases are published (base-<version>/, current.json). Unset: <checkpoint.path>/serving.",
    )
    model_id: str | None = Field(
        default=None, min_length=1, description="Names the model in every delta and base. Unset: kafka.topic."
    )
    delta_interval_seconds: float = Field(default=5.0, gt=0, description="Cut a delta this often.")
    delta_interval_steps: int = Field(
        default=0,
        ge=0,
        description="Also cut a delta every N steps; 0: time only. With checkpoint.interval_steps equal to it, "
        "deltas and snapshots fall on the same steps.",
    )
    base_interval_seconds: float = Field(
        default=600.0,
        gt=0,
        description="Export a base from the newest committed snapshot this often, besides the one at start and at "
        "a graceful stop.",
    )
    keep_bases: int = Field(
        default=3,
        gt=0,
        description="Bases kept in delivery.path (older ones are removed, never the one current.json names).",
    )
    delivery_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="One attempt to deliver a delta (librdkafka's message.timeout.ms); a failed one is counted and "
        "retried, doubling the wait up to 30 s, while training goes on.",
    )

    def resolved_topic(self, source_topic: str) -> str:
        return self.topic or f"{source_topic}.model"

    def resolved_path(self, checkpoint_path: str) -> str:
        return self.path or f"{checkpoint_path.rstrip('/')}/serving"

    def resolved_model_id(self, source_topic: str) -> str:
        return self.model_id or source_topic

    def delta_retention_seconds(self) -> float:
        """How far back deltas must reach: to the cut of the oldest base kept, ``keep_bases`` base
        intervals ago, doubled for exports that run late; an hour at least."""
        return max(3600.0, 2 * self.keep_bases * self.base_interval_seconds)


class WorkerConfig(_Strict):
    """The worker's whole configuration: one YAML file, each field overridable from the environment."""

    kafka: KafkaConfig = Field(description="The source cluster and topic.")
    features: FeaturesConfig = Field(description="The schema, the wire format and the features.")
    model: ModelConfig = Field(default=ModelConfig(), description="The model and its optimizers.")
    batching: BatchingConfig = Field(default=BatchingConfig(), description="How batches are cut.")
    metrics: MetricsConfig = Field(default=MetricsConfig(), description="Prometheus and progress lines.")
    distributed: DistributedConfig = Field(default=DistributedConfig(), description="The ranks and the device.")
    checkpoint: CheckpointConfig = Field(default=CheckpointConfig(), description="Snapshots and warm starts.")
    dead_letter: DeadLetterConfig = Field(default=DeadLetterConfig(), description="Undecodable events.")
    delivery: DeliveryConfig = Field(default=DeliveryConfig(), description="Bases and deltas for serving.")
    delayed_labels: DelayedLabelsConfig | None = Field(
        default=None,
        description="Samples of a joiner whose labels arrive late (docs/delayed-labels.md). Unset: every event's "
        "labels are final. Needs model.tasks, each with attribution_window_seconds.",
    )

    @model_validator(mode="after")
    def _deltas_elsewhere(self) -> WorkerConfig:
        if not self.delivery.enabled:
            return self
        topic = self.delivery.resolved_topic(self.kafka.topic)
        if self.delivery.directory is None and topic in (
            self.kafka.topic,
            self.dead_letter.resolved_topic(self.kafka.topic),
        ):
            raise ValueError(
                f"delivery.topic: {topic} is the training or dead-letter topic; deltas would be read as events. "
                f"Leave delivery.topic unset for {self.kafka.topic}.model, or name another topic"
            )
        return self

    @model_validator(mode="after")
    def _dead_letters_elsewhere(self) -> WorkerConfig:
        if self.dead_letter.enabled and self.dead_letter.resolved_topic(self.kafka.topic) == self.kafka.topic:
            raise ValueError("dead_letter.topic: must not be kafka.topic, or dead letters would be read again")
        return self

    @model_validator(mode="after")
    def _one_way_to_name_labels(self) -> WorkerConfig:
        if self.model.tasks is not None and "label" in self.features.model_fields_set:
            raise ValueError(
                "features.label is the single-task form: with model.tasks, each task names its label; remove one"
            )
        return self

    @model_validator(mode="after")
    def _late_labels_have_windows(self) -> WorkerConfig:
        tasks = self.model.tasks
        if self.delayed_labels is None:
            for i, task in enumerate(tasks or ()):
                for name in ("correction", "attribution_window_seconds"):
                    if name in task.model_fields_set and getattr(task, name) not in (None, "none"):
                        raise ValueError(
                            f"model.tasks.{i}.{name}: only read with the delayed_labels section, which names the "
                            f"sample fields; add delayed_labels: {{}} (its defaults: sample_kind, impression_id, "
                            f"impression_time) or remove it"
                        )
            return self
        if tasks is None:
            raise ValueError(
                f"delayed_labels: needs model.tasks, each with its attribution_window_seconds; move "
                f"features.label into them, e.g. model.tasks: [{{name: {self.features.label}, label: "
                f"{self.features.label}, attribution_window_seconds: 3600}}]"
            )
        for i, task in enumerate(tasks):
            if task.attribution_window_seconds is None:
                raise ValueError(
                    f"model.tasks.{i}.attribution_window_seconds: required with delayed_labels (task "
                    f"{task.name!r}): a positive arriving later than it is not one, and the matured metrics wait "
                    f"for it; e.g. attribution_window_seconds: 3600"
                )
        return self

    @model_validator(mode="after")
    def _target_matches_compare_like_ids(self) -> WorkerConfig:
        tables = {t.name: t for t in self.features.tables}
        for i, match in enumerate(self.model.target_matches):
            where = f"model.target_matches.{i}"
            for role in ("candidate", "history"):
                name = getattr(match, role)
                if name not in tables:
                    raise ValueError(
                        f"{where}.{role}: {name!r} is not in features.tables; name one of {sorted(tables)}"
                    )
            if match.candidate == match.history:
                raise ValueError(f"{where}: candidate and history are both {match.candidate!r}; name two features")
            candidate, history = tables[match.candidate], tables[match.history]
            owners = {t.shares_table_with or t.name for t in (candidate, history)}
            if len(owners) == 1:  # one table: a row is one id for both
                continue
            # Managed rows are given per table as ids arrive, so equal rows of two tables are unrelated ids,
            # and a managed table is shared by no other feature.
            same_mapping = candidate.id_mapping == history.id_mapping != "managed"
            if not same_mapping or candidate.num_embeddings != history.num_embeddings:
                managed = "managed" in (candidate.id_mapping, history.id_mapping)
                share = "" if managed else f", or set features.tables: shares_table_with on {match.history!r}"
                raise ValueError(
                    f"{where}: {match.candidate!r} ({candidate.id_mapping}, {candidate.num_embeddings} rows) and "
                    f"{match.history!r} ({history.id_mapping}, {history.num_embeddings} rows) map ids to rows "
                    f"differently, so equal rows would not mean equal ids; give them the same num_embeddings and "
                    f"id_mapping (hash or modulo: a managed table gives rows per table){share}"
                )
        return self

    @model_validator(mode="after")
    def _din_attends_over_two_tables(self) -> WorkerConfig:
        if self.model.architecture != "din":
            return self
        tables = {t.name for t in self.features.tables}
        din = self.model.din
        for role in ("candidate", "history"):
            name = getattr(din, role)
            if name not in tables:
                raise ValueError(f"model.din.{role}: {name!r} is not in features.tables; name one of {sorted(tables)}")
        if din.candidate == din.history:
            raise ValueError(f"model.din: candidate and history are both {din.candidate!r}; name two features")
        return self

    def model_record(self) -> dict[str, Any]:
        """What gives a snapshot's tensors their meaning, for a snapshot's marker and a servable
        base: the features and model sections and the topic, without hosts, client properties or
        paths to secrets (a base leaves the cluster the worker ran in)."""
        # the skew bounds training, not what the tensors mean; left out, a base still loads in an older server
        features = self.features.model_dump(mode="json", exclude={"schema_registry", "max_event_time_skew_seconds"})
        if self.features.schema_registry is not None:
            features["schema_registry"] = {"url": self.features.schema_registry.url}
        return {
            "kafka": {"topic": self.kafka.topic},
            "features": features,
            "model": self.model.model_dump(mode="json"),
            # Bases name the model as the worker's deltas do (delivery.model_id, else the topic).
            "delivery": {"model_id": self.delivery.resolved_model_id(self.kafka.topic)},
        }

    def checkpoint_path_for_delivery(self) -> str:
        """checkpoint.path, which delivery needs. Asked when the worker starts, not when the config
        is parsed: ``streamtrain plan`` and the benchmarks read configs with delivery on and
        checkpoint.path removed or unset."""
        if not self.checkpoint.path:
            raise ConfigError(
                "invalid worker configuration:\n  delivery.enabled needs checkpoint.path: bases are exported "
                "from snapshots, and the delta sequence continues from them; set checkpoint.path "
                "(STREAMTRAIN_CHECKPOINT__PATH) or delivery.enabled: false (STREAMTRAIN_DELIVERY__ENABLED=false)"
            )
        return self.checkpoint.path

    def check_clients(self) -> None:
        """Builds every client's properties as the worker will, secrets read from their files, and
        has librdkafka and the registry client check them, connecting to nothing: a refusal is a
        ConfigError naming the section, at start-up rather than at the first connection. The
        dead-letter and delta producers take kafka's properties."""
        problems = []
        refusal = librdkafka_refusal({"broker.address.family": "v4", **self.kafka.client_properties()})
        if refusal is not None:
            problems.append(f"  kafka.client_config: librdkafka refuses the client properties: {refusal}")
        registry = self.features.schema_registry
        if registry is not None and not registry.url.startswith("mock://"):
            refusal = registry_client_refusal(registry.client_properties(), registry.url)
            if refusal is not None:
                problems.append(
                    f"  features.schema_registry.client_config: the registry client refuses them: {refusal}"
                )
        if problems:
            raise ConfigError("invalid worker configuration:\n" + "\n".join(problems))

    def learning_rate_scales(self, world_size: int) -> tuple[float, float]:
        """What model.sparse_learning_rate and model.dense_learning_rate are multiplied by at
        ``world_size`` ranks (batching.learning_rate_scaling; MAX_LEARNING_RATE_SCALE says why)."""
        batching = self.batching
        ratio = batching.batch_size * world_size / batching.reference_batch_size
        if batching.learning_rate_scaling == "none" or ratio <= 1:
            return 1.0, 1.0
        scale = min(ratio, MAX_LEARNING_RATE_SCALE)
        return (scale if self.model.sparse_optimizer == "sgd" else 1.0), scale

    def tasks(self) -> list[TaskConfig]:
        """The tasks trained, in head order: model.tasks, else the one on features.label."""
        return list(self.model.tasks) if self.model.tasks is not None else default_tasks(self.features)

    @model_validator(mode="after")
    def _dlrm_shapes(self) -> WorkerConfig:
        if self.model.module is not None:  # a user's model checks its own shapes (streamtrain/models/)
            return self
        dims = {t.embedding_dim for t in self.features.tables}
        if len(dims) > 1:
            raise ValueError(
                "features.tables: the built-in architectures' interactions need one embedding_dim for all tables, "
                f"got {sorted(dims)}"
            )
        if self.model.dense_arch_layer_sizes[-1] != dims.pop():
            raise ValueError(
                "model.dense_arch_layer_sizes: the last size must equal the tables' embedding_dim "
                "so the dense vector can interact with the embeddings"
            )
        return self


def apply_env_overrides(raw: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with every STREAMTRAIN_A__B__C variable written to raw[a][b][c]."""
    merged = json.loads(json.dumps(raw, default=str))
    # Only STREAMTRAIN_<SECTION>__<FIELD> names are config; others (STREAMTRAIN_KAFKA_LIBS) are not.
    names = sorted(name for name in environ if name.startswith(ENV_PREFIX) and "__" in name)
    unknown = [
        f"  {name}: {problem}"
        for name in names
        if (problem := _not_a_field(name[len(ENV_PREFIX) :].lower().split("__")))
    ]
    if unknown:
        raise ConfigError("invalid worker configuration:\n" + "\n".join(unknown))
    for name in names:
        value = environ[name]
        path = _property_named(name[len(ENV_PREFIX) :].lower().split("__"))
        node: Any = merged
        for i, key in enumerate(path):
            last = i == len(path) - 1
            slot: str | int = key
            if isinstance(node, list):
                if not key.isdigit() or int(key) >= len(node):
                    raise ConfigError(f"{name}: {key!r} is not an index of a list of {len(node)} items")
                slot = int(key)
            elif not isinstance(node, dict):
                raise ConfigError(f"{name}: {'.'.join(path[:i])} is not a section")
            if last:
                # librdkafka reads every property as text: 1000 stays "1000", true stays "true"
                as_text = not value or (path[0] == "kafka" and path[1] in _PROPERTY_MAPS)
                node[slot] = value if as_text else yaml.safe_load(value)
            else:
                if isinstance(node, dict) and slot not in node:
                    node[slot] = {}
                node = node[slot]
    return merged


_PROPERTY_MAPS = ("client_config", "client_config_files")


def _property_named(path: list[str]) -> list[str]:
    """``path`` with a client property's name joined by dots: in a variable, each dot of a
    property under client_config or client_config_files is written __ (a shell cannot export a
    name with a dot), so CLIENT_CONFIG__SASL__MECHANISM sets sasl.mechanism."""
    for i, key in enumerate(path[:-1]):
        if key in _PROPERTY_MAPS:
            return [*path[: i + 1], ".".join(path[i + 1 :])]
    return path


def _not_a_field(path: list[str]) -> str | None:
    """Why ``path`` names no config field (a typo would otherwise be ignored or reported without the
    variable's name); None if it names one."""
    kind: Any = WorkerConfig
    for i, key in enumerate(path):
        origin = get_origin(kind)
        if origin in (Union, types.UnionType):  # an optional section or value
            kind = next(a for a in get_args(kind) if a is not type(None))
            origin = get_origin(kind)
        where = ".".join(path[:i]) or "the config"
        if origin is dict:  # client properties: any name
            return None
        if origin is list:
            if not key.isdigit():
                return f"{where} is a list: {key!r} is not an index"
            kind = get_args(kind)[0]
        elif isinstance(kind, type) and issubclass(kind, BaseModel):
            if key not in kind.model_fields:
                near = difflib.get_close_matches(key, list(kind.model_fields), n=1)
                hint = f"; did you mean {ENV_PREFIX + '__'.join([*path[:i], near[0]]).upper()}?" if near else ""
                return f"{where} has no field {key!r}{hint}"
            kind = kind.model_fields[key].annotation
        else:
            return f"{where} is a value, not a section"
    return None


def _format_errors(error: ValidationError) -> str:
    lines = []
    for problem in error.errors():
        where = ".".join(str(p) for p in problem["loc"]) or "(top level)"
        env = ENV_PREFIX + "__".join(str(p).upper() for p in problem["loc"])
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden":
            message = "unknown field; check its spelling against the configuration reference (docs/configuration.md)"
        elif problem["type"] == "missing":
            message = f"required; set it in the YAML file or with {env}"
        lines.append(f"  {where}: {message}")
    return "invalid worker configuration:\n" + "\n".join(lines)


def parse_config(raw: dict[str, Any], environ: Mapping[str, str] | None = None) -> WorkerConfig:
    merged = _batch_sized_for_the_device(apply_env_overrides(raw, os.environ if environ is None else environ))
    try:
        config = WorkerConfig.model_validate(merged)
    except ValidationError as error:
        raise ConfigError(_format_errors(error)) from None
    _check_against_schema(config.features, config.model.tasks, config.delayed_labels)
    return config


def _batch_sized_for_the_device(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with batching.batch_size, where unset or null, at DEFAULT_BATCH_SIZE for the device
    distributed.device resolves to on this host (all ranks of a job run on one kind of host)."""
    batching, distributed = raw.get("batching") or {}, raw.get("distributed") or {}
    if not isinstance(batching, dict) or batching.get("batch_size") is not None:
        return raw
    choice = distributed.get("device", "auto") if isinstance(distributed, dict) else "auto"
    if choice not in get_args(DistributedConfig.model_fields["device"].annotation):
        return raw  # the validation names the field
    from streamtrain.device import device_type  # torch: only for the configs that need it

    return {**raw, "batching": {**batching, "batch_size": DEFAULT_BATCH_SIZE[device_type(choice)]}}


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> WorkerConfig:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections (kafka, features, ...)")
    return parse_config(raw, environ)


def _check_against_schema(
    features: FeaturesConfig, tasks: list[TaskConfig] | None = None, delayed: DelayedLabelsConfig | None = None
) -> None:
    """Every configured field must exist in the Avro schema with a type its role can use."""

    path = features.resolved_schema_path()
    try:
        schema = load_schema(path)
    except (OSError, ValueError) as error:
        raise ConfigError(f"features.schema_path: cannot read {path}: {error}") from None
    problems = []

    def check(where: str, field: str, allowed: set[str]) -> None:
        kind = field_kind(schema, field)
        if kind is None:
            known = ", ".join(f["name"] for f in schema["fields"])
            problems.append(f"  {where}: {field!r} is not a field of {schema['name']}; fields are: {known}")
        elif kind not in allowed:
            problems.append(f"  {where}: field {field!r} is {kind}, expected one of {sorted(allowed)}")

    for i, table in enumerate(features.tables):
        check(f"features.tables.{i}.field", table.field, ID_KINDS)
    for i, dense in enumerate(features.dense):
        check(f"features.dense.{i}.field", dense.field, NUMBER_KINDS)
    if tasks is None:
        check("features.label", features.label, NUMBER_KINDS)
    for i, task in enumerate(tasks or ()):
        check(f"model.tasks.{i}.label", task.label, NUMBER_KINDS)
    check("features.event_time", features.event_time, {"integer"})
    if delayed is not None:
        problems += _sample_fields_problems(schema, delayed, tasks or [])
    if problems:
        raise ConfigError("invalid worker configuration:\n" + "\n".join(problems))


# The symbols of a sample's kind (docs/delayed-labels.md): the contract between a joiner and the worker.
SAMPLE_KINDS = ("impression", "label")


def _sample_fields_problems(schema: dict[str, Any], delayed: DelayedLabelsConfig, tasks: list[TaskConfig]) -> list[str]:
    """What keeps ``schema`` from carrying the late-label sample contract, one line per problem."""
    problems = []
    kinds = {"kind_field": {"string", "enum"}, "impression_id_field": {"integer"}, "impression_time_field": {"integer"}}
    named = delayed.fields()
    for name, field in named.items():
        where = f"delayed_labels.{name}"
        kind = field_kind(schema, field)
        if kind is None:
            known = ", ".join(f["name"] for f in schema["fields"])
            problems.append(
                f"  {where}: {field!r} is not a field of {schema['name']}; add it to the schema (the joiner writes "
                f"it) or name the field that holds it; fields are: {known}"
            )
        elif kind not in kinds[name]:
            problems.append(f"  {where}: field {field!r} is {kind}, expected one of {sorted(kinds[name])}")
        elif kind == "enum":
            symbols = field_schema(schema, field)["symbols"]
            missing = [s for s in SAMPLE_KINDS if s not in symbols]
            if missing:
                problems.append(
                    f"  {where}: the enum of {field!r} lacks the symbols {missing}; it needs {list(SAMPLE_KINDS)}"
                )
    if len(set(named.values())) < len(named):
        problems.append(f"  delayed_labels: the three fields must be distinct, got {named}")
    if len(tasks) > 1:
        # A label sample carries one task's positive; the others' labels are null.
        for i, task in enumerate(tasks):
            if field_kind(schema, task.label) is not None and not field_nullable(schema, task.label):
                problems.append(
                    f"  model.tasks.{i}.label: {task.label!r} must be nullable (a union with null) with "
                    f"delayed_labels: a label sample leaves the other tasks' labels null"
                )
    return problems
