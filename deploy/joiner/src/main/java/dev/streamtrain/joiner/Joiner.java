package dev.streamtrain.joiner;

import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.concurrent.CountDownLatch;
import java.util.stream.Collectors;
import org.apache.avro.SchemaFormatter;
import org.apache.kafka.streams.KafkaStreams;
import org.apache.kafka.streams.errors.StreamsUncaughtExceptionHandler;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * {@code java -cp 'libs/*' dev.streamtrain.joiner.Joiner [--sample-schema] joiner.properties}: joins
 * impressions and actions into the sample topic until SIGTERM; {@code --sample-schema} prints the
 * sample schema the worker's features.schema_path should name, and exits.
 *
 * <p>Exit codes: 0 after a requested stop, 1 when Kafka Streams failed, 2 for a bad setting.
 */
public final class Joiner {
    private static final Logger log = LoggerFactory.getLogger(Joiner.class);

    private Joiner() {}

    public static void main(String[] args) throws InterruptedException {
        boolean printSchema = args.length == 2 && args[0].equals("--sample-schema");
        if (args.length != 1 && !printSchema || args[0].equals("--help")) {
            System.err.println("usage: Joiner [--sample-schema] joiner.properties (deploy/joiner/README.md)");
            System.exit(args.length == 1 ? 0 : 2);
        }
        JoinerSettings settings;
        SampleContract contract;
        try {
            settings = JoinerSettings.load(Path.of(args[args.length - 1]));
            contract = new SampleContract(settings.impressionSchema, settings.actionSchema,
                    new ArrayList<>(settings.windows.keySet()));
        } catch (JoinerSettings.Invalid error) {
            System.err.println("joiner: " + error.getMessage());
            System.exit(2);
            return;
        }
        if (printSchema) {
            System.out.println(SchemaFormatter.getInstance("json/pretty").format(contract.samples));
            return;
        }
        System.exit(run(settings, contract));
    }

    private static int run(JoinerSettings settings, SampleContract contract) throws InterruptedException {
        KafkaStreams streams = new KafkaStreams(JoinTopology.build(settings, contract), settings.streams);
        CountDownLatch stopped = new CountDownLatch(1);
        streams.setStateListener((now, before) -> {
            log.info("joiner: {} -> {}", before, now);
            if (now == KafkaStreams.State.NOT_RUNNING || now == KafkaStreams.State.ERROR) {
                stopped.countDown();
            }
        });
        streams.setUncaughtExceptionHandler(error -> {
            log.error("joiner: stopping on an error; what was not committed is redone on restart", error);
            return StreamsUncaughtExceptionHandler.StreamThreadExceptionResponse.SHUTDOWN_CLIENT;
        });
        // SIGTERM: close, committing what was handled, and exit 0 as for any requested stop. halt, as
        // System.exit inside a shutdown hook would wait for the hooks to end, this one among them.
        Runtime.getRuntime().addShutdownHook(new Thread(() -> {
            boolean closed = streams.close(Duration.ofSeconds(30));
            Runtime.getRuntime().halt(closed && streams.state() != KafkaStreams.State.ERROR ? 0 : 1);
        }, "joiner-shutdown"));
        log.info("joiner: {} + {} -> {} (rejects: {}), tasks {}, impressions kept {}", settings.impressionsTopic,
                settings.actionsTopic, settings.samplesTopic, settings.rejectsTopic.orElse("counted only"),
                settings.windows.entrySet().stream().map(e -> e.getKey() + " within " + e.getValue())
                        .collect(Collectors.joining(", ")), settings.retention());
        streams.start();
        stopped.await();
        boolean failed = streams.state() == KafkaStreams.State.ERROR;
        streams.close(Duration.ofSeconds(30));
        return failed ? 1 : 0;
    }
}
