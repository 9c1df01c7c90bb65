package dev.streamtrain.joiner;

import java.io.IOException;
import java.io.Reader;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.Optional;
import java.util.OptionalInt;
import java.util.Properties;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import org.apache.avro.Schema;
import org.apache.avro.SchemaParseException;
import org.apache.kafka.streams.StreamsConfig;

/**
 * The joiner's settings: the {@code joiner.*} keys of its properties file, checked at start. Every
 * other key is Kafka Streams' own (bootstrap.servers, application.id, state.dir, ...) and passes
 * through, except processing.guarantee: the sample contract is exactly once.
 */
final class JoinerSettings {
    static final String PREFIX = "joiner.";

    final String impressionsTopic;
    final String actionsTopic;
    final String samplesTopic;
    /** Where actions that join nothing, and undecodable messages, go with their reason; empty: counted only. */
    final Optional<String> rejectsTopic;
    final Schema impressionSchema;
    final Schema actionSchema;
    /** Each task's attribution window, in the order of the sample's label fields. */
    final Map<String, Duration> windows;
    /** How long past the longest window an impression is kept for actions that arrive late. */
    final Duration grace;
    /** Schema ids of the Confluent wire format (magic byte 0, 4-byte id); all empty for raw Avro. */
    final OptionalInt impressionsSchemaId;
    final OptionalInt actionsSchemaId;
    final OptionalInt samplesSchemaId;
    final Properties streams;

    /** A setting that is missing or wrong; the message names the key and the fix. */
    static final class Invalid extends Exception {
        private static final long serialVersionUID = 1L;

        Invalid(String message) {
            super(message);
        }
    }

    private static final String DURATION = "(\\d+)(ms|s|m|h|d)";
    private static final Pattern TASK = Pattern.compile("([A-Za-z_][A-Za-z0-9_]*):" + DURATION);

    private JoinerSettings(Properties file, Path directory) throws Invalid {
        impressionsTopic = required(file, "impressions.topic");
        actionsTopic = required(file, "actions.topic");
        samplesTopic = required(file, "samples.topic");
        rejectsTopic = Optional.ofNullable(file.getProperty(PREFIX + "rejects.topic")).filter(s -> !s.isBlank());
        impressionSchema = schema(file, "impression.schema", directory);
        actionSchema = schema(file, "action.schema", directory);
        windows = Collections.unmodifiableMap(windows(required(file, "tasks")));
        grace = duration(file, "grace", "1m");
        String wireFormat = file.getProperty(PREFIX + "wire.format", "raw");
        switch (wireFormat) {
            case "raw" -> {
                impressionsSchemaId = actionsSchemaId = samplesSchemaId = OptionalInt.empty();
            }
            case "confluent" -> {
                impressionsSchemaId = OptionalInt.of(schemaId(file, "impressions.schema.id"));
                actionsSchemaId = OptionalInt.of(schemaId(file, "actions.schema.id"));
                samplesSchemaId = OptionalInt.of(schemaId(file, "samples.schema.id"));
            }
            default -> throw new Invalid(PREFIX + "wire.format: '" + wireFormat + "' is neither raw nor confluent");
        }
        streams = new Properties();
        file.stringPropertyNames().stream()
                .filter(key -> !key.startsWith(PREFIX))
                .forEach(key -> streams.setProperty(key, file.getProperty(key)));
        String guarantee = streams.getProperty(StreamsConfig.PROCESSING_GUARANTEE_CONFIG, StreamsConfig.EXACTLY_ONCE_V2);
        if (!guarantee.equals(StreamsConfig.EXACTLY_ONCE_V2)) {
            throw new Invalid(StreamsConfig.PROCESSING_GUARANTEE_CONFIG + ": '" + guarantee + "' would let a crash "
                    + "duplicate or drop samples; remove it (the joiner runs " + StreamsConfig.EXACTLY_ONCE_V2 + ")");
        }
        streams.setProperty(StreamsConfig.PROCESSING_GUARANTEE_CONFIG, StreamsConfig.EXACTLY_ONCE_V2);
        for (String key : new String[] {StreamsConfig.BOOTSTRAP_SERVERS_CONFIG, StreamsConfig.APPLICATION_ID_CONFIG}) {
            if (streams.getProperty(key, "").isBlank()) {
                throw new Invalid(key + ": required (Kafka Streams' own setting); set it in the properties file");
            }
        }
    }

    static JoinerSettings load(Path path) throws Invalid {
        Properties file = new Properties();
        try (Reader reader = Files.newBufferedReader(path)) {
            file.load(reader);
        } catch (IOException error) {
            throw new Invalid(path + ": cannot read the properties file (" + error + ")");
        }
        return new JoinerSettings(file, path.toAbsolutePath().getParent());
    }

    /** How long an impression stays in the store: the longest window, then the grace. */
    Duration retention() {
        return windows.values().stream().max(Duration::compareTo).orElseThrow().plus(grace);
    }

    private static String required(Properties file, String key) throws Invalid {
        String value = file.getProperty(PREFIX + key, "").strip();
        if (value.isEmpty()) {
            throw new Invalid(PREFIX + key + ": required; set it in the properties file");
        }
        return value;
    }

    /** A schema file, relative to the properties file's folder unless absolute. */
    private static Schema schema(Properties file, String key, Path directory) throws Invalid {
        Path path = directory.resolve(required(file, key));
        try {
            return new Schema.Parser().parse(path.toFile());
        } catch (IOException | SchemaParseException error) {
            throw new Invalid(PREFIX + key + ": cannot read an Avro schema from " + path + " (" + error.getMessage() + ")");
        }
    }

    private static Map<String, Duration> windows(String tasks) throws Invalid {
        Map<String, Duration> windows = new LinkedHashMap<>();
        for (String entry : tasks.split(",")) {
            Matcher task = TASK.matcher(entry.strip());
            if (!task.matches()) {
                throw new Invalid(PREFIX + "tasks: '" + entry.strip() + "' is not task:window (e.g. clk:30m,buy:7d; "
                        + "the window in ms, s, m, h or d)");
            }
            if (windows.put(task.group(1), parse(task.group(2), task.group(3))) != null) {
                throw new Invalid(PREFIX + "tasks: '" + task.group(1) + "' is listed twice");
            }
        }
        if (windows.size() > 63) {
            throw new Invalid(PREFIX + "tasks: " + windows.size() + " tasks; the worker trains at most 63");
        }
        return windows;
    }

    private static Duration duration(Properties file, String key, String fallback) throws Invalid {
        String value = file.getProperty(PREFIX + key, fallback).strip();
        Matcher duration = Pattern.compile(DURATION).matcher(value);
        if (!duration.matches()) {
            throw new Invalid(PREFIX + key + ": '" + value + "' is not a duration such as 90s, 30m or 7d");
        }
        return parse(duration.group(1), duration.group(2));
    }

    private static Duration parse(String amount, String unit) {
        long value = Long.parseLong(amount);
        return switch (unit) {
            case "ms" -> Duration.ofMillis(value);
            case "s" -> Duration.ofSeconds(value);
            case "m" -> Duration.ofMinutes(value);
            case "h" -> Duration.ofHours(value);
            default -> Duration.ofDays(value);
        };
    }

    private static int schemaId(Properties file, String key) throws Invalid {
        String value = file.getProperty(PREFIX + key, "").strip();
        if (value.isEmpty()) {
            throw new Invalid(PREFIX + key + ": required with wire.format confluent; register the schema and set its id");
        }
        try {
            return Integer.parseInt(value);
        } catch (NumberFormatException error) {
            throw new Invalid(PREFIX + key + ": '" + value + "' is not a schema id (an integer the registry gave)");
        }
    }
}
