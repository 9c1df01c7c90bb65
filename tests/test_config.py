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
    config = load_config(REFERENCE, environ={
        "STREAMTRAIN_KAFKA__BOOTSTRAP_SERVERS": "broker-1:9092,broker-2:9092",
        "STREAMTRAIN_BATCHING__BATCH_SIZE": "512",
        "STREAMTRAIN_FEATURES__TABLES__0__NUM_EMBEDDINGS": "1000",
        "STREAMTRAIN_MODEL__OVER_ARCH_LAYER_SIZES": "[128, 1]",
        "UNRELATED": "x",
        "STREAMTRAIN_KAFKA_LIBS": "/not/a/config/field",
    })
    assert config.kafka.bootstrap_servers == "broker-1:9092,broker-2:9092"
    assert config.batching.batch_size == 512
    assert config.features.tables[0].num_embeddings == 1000
    assert config.model.over_arch_layer_sizes == [128, 1]


def test_env_override_of_a_missing_list_index_names_the_variable():
    with pytest.raises(ConfigError, match="STREAMTRAIN_FEATURES__TABLES__99__NAME"):
        apply_env_overrides(reference(), {"STREAMTRAIN_FEATURES__TABLES__99__NAME": "x"})


@pytest.mark.parametrize("mutate, field, hint", [
    (lambda c: c["batching"].update(batch_size=0), "batching.batch_size", "greater than 0"),
    (lambda c: c["kafka"].pop("topic"), "kafka.topic", "STREAMTRAIN_KAFKA__TOPIC"),
    (lambda c: c["batching"].update(batchsize=3), "batching.batchsize", "unknown field"),
    (lambda c: c["features"]["tables"][2].update(embedding_dim=0), "features.tables.2.embedding_dim",
     "greater than 0"),
    (lambda c: c["features"]["tables"][1].update(embedding_dim=32), "features.tables", "one embedding_dim"),
    (lambda c: c["model"].update(over_arch_layer_sizes=[64, 2]), "model.over_arch_layer_sizes", "end in 1"),
    (lambda c: c["features"]["tables"][0].update(field="usr_id"), "features.tables.0.field",
     "not a field of ClickEvent"),
    (lambda c: c["features"]["dense"][0].update(field="pid"), "features.dense.0.field", "is string"),
    (lambda c: c["features"].update(label="recent_cate_ids"), "features.label", "integer_list"),
    (lambda c: c["kafka"].update(client_config={"sasl.password": "hunter2"}), "kafka.client_config",
     "client_config_files"),
    (lambda c: c["features"]["tables"].append(dict(c["features"]["tables"][0])), "features",
     "repeated: ['user_id']"),
])
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
