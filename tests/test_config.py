import re
from pathlib import Path

import pytest
import yaml

from streamtrain.config import ConfigError, apply_env_overrides, load_config, parse_config

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO / "deploy" / "worker.yaml"


def reference() -> dict:
    return yaml.safe_load(REFERENCE.read_text())


def test_reference_config_loads():
    config = load_config(REFERENCE, environ={})
    assert config.kafka.topic == "clicks"
    assert len(config.features.tables) == 16
    assert config.features.tables[0].num_embeddings == 1_141_730


def test_environment_overrides_any_field():
    config = load_config(
        REFERENCE,
        environ={
            "STREAMTRAIN_KAFKA__BOOTSTRAP_SERVERS": "broker-1:9092,broker-2:9092",
            "STREAMTRAIN_BATCHING__BATCH_SIZE": "512",
            "STREAMTRAIN_FEATURES__TABLES__0__NUM_EMBEDDINGS": "1000",
            "STREAMTRAIN_MODEL__OVER_ARCH_LAYER_SIZES": "[128, 1]",
            "UNRELATED": "x",
            "STREAMTRAIN_KAFKA_LIBS": "/not/a/config/field",
        },
    )
    assert config.kafka.bootstrap_servers == "broker-1:9092,broker-2:9092"
    assert config.batching.batch_size == 512
    assert config.features.tables[0].num_embeddings == 1000
    assert config.model.over_arch_layer_sizes == [128, 1]


def test_env_override_of_a_missing_list_index_names_the_variable():
    with pytest.raises(ConfigError, match="STREAMTRAIN_FEATURES__TABLES__99__NAME"):
        apply_env_overrides(reference(), {"STREAMTRAIN_FEATURES__TABLES__99__NAME": "x"})


@pytest.mark.parametrize(
    "mutate, field, hint",
    [
        (lambda c: c["batching"].update(batch_size=0), "batching.batch_size", "greater than 0"),
        (lambda c: c["kafka"].pop("topic"), "kafka.topic", "STREAMTRAIN_KAFKA__TOPIC"),
        (lambda c: c["batching"].update(batchsize=3), "batching.batchsize", "unknown field"),
        (
            lambda c: c["features"]["tables"][2].update(embedding_dim=0),
            "features.tables.2.embedding_dim",
            "greater than 0",
        ),
        (lambda c: c["features"]["tables"][1].update(embedding_dim=32), "features.tables", "one embedding_dim"),
        (lambda c: c["model"].update(over_arch_layer_sizes=[64, 2]), "model.over_arch_layer_sizes", "end in 1"),
        (
            lambda c: c["features"]["tables"][0].update(field="usr_id"),
            "features.tables.0.field",
            "not a field of ClickEvent",
        ),
        (lambda c: c["features"]["dense"][0].update(field="pid"), "features.dense.0.field", "is string"),
        (lambda c: c["features"].update(label="recent_cate_ids"), "features.label", "integer_list"),
        (
            lambda c: c["kafka"].update(client_config={"sasl.password": "hunter2"}),
            "kafka.client_config",
            "client_config_files",
        ),
        (
            lambda c: c["features"]["tables"].append(dict(c["features"]["tables"][0])),
            "features",
            "repeated: ['user_id']",
        ),
        (
            lambda c: c["kafka"].update(client_config={"enable.auto.commit": "true"}),
            "kafka.client_config",
            "cannot be overridden: the worker commits only trained",
        ),
        (lambda c: c["kafka"].update(client_config={"group.id": "g"}), "kafka.client_config", "set kafka.group_id"),
        (
            lambda c: c["kafka"].update(client_config_files={"auto.offset.reset": "/x"}),
            "kafka.client_config_files",
            "set kafka.start_at",
        ),
        (lambda c: c["kafka"].update(start_at="yesterday"), "kafka.start_at", "2026-11-30T12:00:00Z"),
        (
            lambda c: c["kafka"].update(start_at="2026-11-30T12:00:00"),
            "kafka.start_at",
            "add one, e.g. 2026-11-30T12:00:00Z",
        ),
        (lambda c: c["kafka"].update(start_at=1764504000), "kafka.start_at", "give epoch milliseconds (1764504000000)"),
    ],
)
def test_bad_config_names_the_field_and_the_fix(mutate, field, hint):
    raw = reference()
    mutate(raw)
    with pytest.raises(ConfigError) as error:
        parse_config(raw, environ={})
    message = str(error.value)
    assert field in message and hint in message, message
    assert "hunter2" not in message


def test_secrets_are_read_from_files(tmp_path):
    secret = tmp_path / "password"
    secret.write_text("s3cr3t\n")
    raw = reference()
    raw["kafka"]["client_config_files"] = {"sasl.password": str(secret)}
    config = parse_config(raw, environ={})
    assert config.kafka.librdkafka()["sasl.password"] == "s3cr3t"
    assert "s3cr3t" not in repr(config)


def test_missing_file_and_bad_yaml_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("kafka: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_an_unknown_environment_field_is_refused_naming_the_variable_and_the_nearest_field():
    with pytest.raises(ConfigError) as error:
        load_config(
            REFERENCE,
            environ={
                "STREAMTRAIN_KAFKA__TOPICS": "clicks",
                "STREAMTRAIN_FEATURES__TABLES__0__NUM_EMBEDDING": "10",
                "STREAMTRAIN_BATCHING__BATCH_SIZE__X": "1",
            },
        )
    message = str(error.value)
    assert "STREAMTRAIN_KAFKA__TOPICS: kafka has no field 'topics'; did you mean STREAMTRAIN_KAFKA__TOPIC?" in message
    assert "did you mean STREAMTRAIN_FEATURES__TABLES__0__NUM_EMBEDDINGS?" in message
    assert "STREAMTRAIN_BATCHING__BATCH_SIZE__X: batching.batch_size is a value, not a section" in message


def test_streamtrain_variables_without_a_field_path_are_not_config():
    others = ["KAFKA_LIBS", "RUN_RECORD", "BENCH_RESULTS", "FUZZ_PAYLOADS", "TEST_KILL_TRIALS"]
    config = load_config(
        REFERENCE,
        environ={f"STREAMTRAIN_{name}": "x" for name in others}
        | {"STREAMTRAIN_KAFKA__CLIENT_CONFIG__SECURITY.PROTOCOL": "SSL"},
    )
    assert config.kafka.client_config["security.protocol"] == "SSL"


def test_a_dotted_client_property_is_written_with_double_underscores_in_a_variable(tmp_path):
    secret = tmp_path / "password"
    secret.write_text("s3cr3t\n")
    config = load_config(
        REFERENCE,
        environ={
            "STREAMTRAIN_KAFKA__CLIENT_CONFIG__SECURITY__PROTOCOL": "SASL_PLAINTEXT",
            "STREAMTRAIN_KAFKA__CLIENT_CONFIG__SASL__MECHANISM": "SCRAM-SHA-512",
            "STREAMTRAIN_KAFKA__CLIENT_CONFIG__SASL__USERNAME": "trainer",
            "STREAMTRAIN_KAFKA__CLIENT_CONFIG_FILES__SASL__PASSWORD": str(secret),
            "STREAMTRAIN_KAFKA__CLIENT_CONFIG__TOPIC.METADATA.REFRESH.INTERVAL.MS": "1000",  # dots still do
        },
    )
    assert config.kafka.client_config == {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "trainer",
        "topic.metadata.refresh.interval.ms": "1000",
    }
    assert config.kafka.librdkafka()["sasl.password"] == "s3cr3t"
    config.check_clients()  # librdkafka takes them all


def test_a_client_property_librdkafka_does_not_know_is_refused_naming_it_and_the_variable_meant():
    with pytest.raises(ConfigError) as error:
        load_config(
            REFERENCE,
            environ={
                "STREAMTRAIN_KAFKA__CLIENT_CONFIG__SASL_MECHANISM": "PLAIN",  # a property named sasl_mechanism
                "STREAMTRAIN_KAFKA__CLIENT_CONFIG__FETCH__WAIT__MAX__MS": "soon",
                "STREAMTRAIN_KAFKA__CLIENT_CONFIG_FILES__SSL__KEY__PASWORD": "/run/secrets/key-password",
            },
        )
    message = str(error.value)
    assert (
        "kafka.client_config: 'fetch.wait.max.ms': librdkafka refuses the value 'soon'; 'sasl_mechanism': librdkafka "
        "has no such property; did you mean 'sasl.mechanism'? In an environment variable, write each dot of a "
        "property as __: STREAMTRAIN_KAFKA__CLIENT_CONFIG__SASL__MECHANISM" in message
    ), message
    assert "kafka.client_config_files: 'ssl.key.pasword': librdkafka has no such property" in message, message


def test_a_registry_client_property_it_does_not_know_is_refused_naming_it():
    raw = reference()
    raw["features"] |= {
        "wire_format": "confluent",
        "schema_registry": {"url": "https://registry:8081", "client_config": {"max.retries": 1, "max_retries": 1}},
    }
    with pytest.raises(
        ConfigError, match=r"features.schema_registry.client_config: .* no properties \['max_retries'\]"
    ):
        parse_config(raw, environ={})


def test_at_start_a_login_half_set_or_a_secret_file_missing_is_refused_naming_the_section(tmp_path):
    half = load_config(
        REFERENCE,
        environ={
            "STREAMTRAIN_KAFKA__CLIENT_CONFIG__SECURITY__PROTOCOL": "SASL_PLAINTEXT",
            "STREAMTRAIN_KAFKA__CLIENT_CONFIG__SASL__MECHANISM": "SCRAM-SHA-512",
        },
    )
    with pytest.raises(
        ConfigError, match=re.escape("kafka.client_config: librdkafka refuses the client properties: sasl.username")
    ):
        half.check_clients()
    missing = load_config(
        REFERENCE, environ={"STREAMTRAIN_KAFKA__CLIENT_CONFIG_FILES__SASL__PASSWORD": str(tmp_path / "nope")}
    )
    with pytest.raises(ConfigError) as error:
        missing.check_clients()
    assert f"kafka.client_config_files.sasl.password: cannot read {tmp_path / 'nope'}" in str(error.value)
    assert "STREAMTRAIN_KAFKA__CLIENT_CONFIG_FILES__SASL__PASSWORD" in str(error.value)


def test_an_empty_plan_path_means_none():
    config = load_config(REFERENCE, environ={"STREAMTRAIN_DISTRIBUTED__PLAN_PATH": ""})
    assert config.distributed.plan_path is None


def test_shutdown_grace_is_a_distributed_field():
    assert load_config(REFERENCE, environ={}).distributed.shutdown_grace_seconds == 30.0
    config = load_config(REFERENCE, environ={"STREAMTRAIN_DISTRIBUTED__SHUTDOWN_GRACE_SECONDS": "2.5"})
    assert config.distributed.shutdown_grace_seconds == 2.5


@pytest.mark.parametrize(
    "given, position",
    [
        ("earliest", "earliest"),
        ("latest", "latest"),
        ("1764504000123", 1764504000123),
        ("2025-11-30T12:00:00Z", 1764504000000),
        ("2025-11-30T13:00:00+01:00", 1764504000000),
        (None, None),
    ],
)
def test_start_at_is_earliest_latest_or_a_time(given, position):
    environ = {} if given is None else {"STREAMTRAIN_KAFKA__START_AT": given}
    assert load_config(REFERENCE, environ=environ).kafka.start_position() == position
