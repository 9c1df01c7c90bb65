package dev.streamtrain.joiner;

import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import org.apache.avro.generic.GenericRecord;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.common.metrics.Sensor;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;
import org.apache.kafka.common.serialization.ByteArraySerializer;
import org.apache.kafka.common.serialization.Deserializer;
import org.apache.kafka.common.serialization.Serdes;
import org.apache.kafka.streams.AutoOffsetReset;
import org.apache.kafka.streams.KeyValue;
import org.apache.kafka.streams.Topology;
import org.apache.kafka.streams.processor.TimestampExtractor;
import org.apache.kafka.streams.processor.api.Processor;
import org.apache.kafka.streams.processor.api.ProcessorContext;
import org.apache.kafka.streams.processor.api.Record;
import org.apache.kafka.streams.state.Stores;
import org.apache.kafka.streams.state.WindowStore;
import org.apache.kafka.streams.state.WindowStoreIterator;

/**
 * The join: impressions and actions in, samples out, one Kafka Streams task per partition.
 *
 * <p>Both input topics are keyed by impression id and have as many partitions (co-partitioned, as
 * for any Kafka Streams join), so an impression and its actions meet in one task. The task keeps
 * each impression in a window store at its impression time, for the longest attribution window
 * plus the grace, and beside it which tasks have had their label; the store's changelog makes that
 * state exactly once with the output. Kafka Streams hands a task's records over in timestamp
 * order across both topics (the timestamp is each event's own time), so an impression is stored
 * before an action that follows it.
 *
 * <p>An action yields at most one label sample per impression and task: its task's window must
 * hold it, and a duplicate is dropped. What joins nothing goes to the rejects topic, with a
 * reason header, so that every input is accounted for.
 */
final class JoinTopology {
    static final String STORE = "impressions";
    static final String SAMPLES = "samples";
    static final String REJECTS = "rejects";
    /** The rejects topic's headers: why, and for a value that could not be decoded, what was wrong. */
    static final String REASON_HEADER = "streamtrain.joiner.reason";
    static final String DETAIL_HEADER = "streamtrain.joiner.detail";

    private JoinTopology() {}

    static Topology build(JoinerSettings settings, SampleContract contract) {
        Topology topology = new Topology();
        AvroCodec impressions = new AvroCodec(settings.impressionSchema, settings.impressionsSchemaId);
        AvroCodec actions = new AvroCodec(settings.actionSchema, settings.actionsSchemaId);
        // A new joiner reads both topics from their start: no impression is skipped.
        topology.addSource(AutoOffsetReset.earliest(), "impression-source", new EventTime(), new ByteArrayDeserializer(),
                new Decoding(impressions), settings.impressionsTopic);
        topology.addSource(AutoOffsetReset.earliest(), "action-source", new EventTime(), new ByteArrayDeserializer(),
                new Decoding(actions), settings.actionsTopic);
        List<String> tasks = new ArrayList<>(settings.windows.keySet());
        long[] windows = settings.windows.values().stream().mapToLong(Duration::toMillis).toArray();
        boolean rejects = settings.rejectsTopic.isPresent();
        topology.addProcessor("impression-join",
                () -> new ImpressionJoin(new AvroCodec(contract.samples, settings.samplesSchemaId), contract, rejects),
                "impression-source");
        topology.addProcessor("action-join",
                () -> new ActionJoin(new AvroCodec(contract.samples, settings.samplesSchemaId), contract, rejects,
                        impressions, tasks, windows, settings.retention().toMillis()),
                "action-source");
        // The window size matters only for range queries by window end, which the join does not make.
        topology.addStateStore(Stores.windowStoreBuilder(
                Stores.persistentWindowStore(STORE, settings.retention(), Duration.ofMillis(1), false),
                Serdes.Long(), Serdes.ByteArray()), "impression-join", "action-join");
        topology.addSink(SAMPLES, settings.samplesTopic, new ByteArraySerializer(), new ByteArraySerializer(),
                "impression-join", "action-join");
        settings.rejectsTopic.ifPresent(topic -> topology.addSink(REJECTS, topic, new ByteArraySerializer(),
                new ByteArraySerializer(), "impression-join", "action-join"));
        return topology;
    }

    /** A message's value as read: its bytes, and its record unless it could not be decoded. */
    record Event(byte[] value, byte[] payload, GenericRecord record, String malformed) {
        long time() {
            return (Long) record.get(SampleContract.TIME);
        }

        long impressionId() {
            return (Long) record.get(SampleContract.ID);
        }
    }

    /** Never throws: an undecodable value travels on as an Event with its reason, to be rejected. */
    private record Decoding(AvroCodec codec) implements Deserializer<Event> {
        @Override
        public Event deserialize(String topic, byte[] value) {
            try {
                byte[] payload = codec.payload(value);
                GenericRecord record = codec.decodePayload(payload);
                if ((Long) record.get(SampleContract.TIME) < 0) {  // Kafka Streams would drop it, uncounted
                    throw new AvroCodec.Malformed("a negative " + SampleContract.TIME);
                }
                return new Event(value, payload, record, null);
            } catch (AvroCodec.Malformed error) {
                return new Event(value, null, null, error.getMessage());
            }
        }
    }

    /**
     * The event's own time orders the join. A message that could not be decoded takes its
     * partition's time: its timestamp may be anything, and Kafka Streams would drop a negative one.
     */
    private static final class EventTime implements TimestampExtractor {
        @Override
        public long extract(ConsumerRecord<Object, Object> message, long partitionTime) {
            if (message.value() instanceof Event event && event.record() != null) {
                return event.time();
            }
            return Math.max(partitionTime, 0);
        }
    }

    /** What the two processors share: the store, the sample encoder, the rejects and the counters. */
    private abstract static class Join implements Processor<byte[], Event, byte[], byte[]> {
        final AvroCodec samples;
        final SampleContract contract;
        final boolean rejects;
        ProcessorContext<byte[], byte[]> context;
        WindowStore<Long, byte[]> store;
        private final Map<String, Sensor> counters = new HashMap<>();

        Join(AvroCodec samples, SampleContract contract, boolean rejects) {
            this.samples = samples;
            this.contract = contract;
            this.rejects = rejects;
        }

        @Override
        public void init(ProcessorContext<byte[], byte[]> context) {
            this.context = context;
            this.store = context.getStateStore(STORE);
        }

        /** Counted as stream-joiner-metrics {what}-total, per Kafka Streams task. */
        void count(String what) {
            counters.computeIfAbsent(what, name -> context.metrics().addRateTotalSensor("joiner",
                    context.taskId().toString(), name, Sensor.RecordingLevel.INFO)).record();
        }

        void emit(long impressionId, GenericRecord sample, long time, String what) {
            byte[] key = Long.toString(impressionId).getBytes(StandardCharsets.UTF_8);
            context.forward(new Record<>(key, samples.encode(sample), time), SAMPLES);
            count(what);
        }

        void reject(Record<byte[], Event> message, String reason) {
            count("rejected-" + reason);
            if (rejects) {
                Record<byte[], byte[]> rejected = new Record<>(message.key(), message.value().value(),
                        message.timestamp(), message.headers());
                rejected.headers().add(REASON_HEADER, reason.getBytes(StandardCharsets.UTF_8));
                if (message.value().malformed() != null) {
                    rejected.headers().add(DETAIL_HEADER, message.value().malformed().getBytes(StandardCharsets.UTF_8));
                }
                context.forward(rejected, REJECTS);
            }
        }
    }

    /** What the store keeps per impression: which tasks have their label (a bit each), then its Avro payload. */
    static byte[] stored(long labelled, byte[] payload) {
        return ByteBuffer.allocate(8 + payload.length).putLong(labelled).put(payload).array();
    }

    /** An impression: its sample at once, and kept for the actions that follow. */
    private static final class ImpressionJoin extends Join {
        ImpressionJoin(AvroCodec samples, SampleContract contract, boolean rejects) {
            super(samples, contract, rejects);
        }

        @Override
        public void process(Record<byte[], Event> message) {
            Event impression = message.value();
            if (impression.record() == null) {
                reject(message, "malformed_impression");
                return;
            }
            long id = impression.impressionId();
            long time = impression.time();
            if (store.fetch(id, time) != null) {  // a producer's retry, say: trained once
                reject(message, "duplicate_impression");
                return;
            }
            store.put(id, stored(0L, impression.payload()), time);
            emit(id, contract.impressionSample(impression.record()), time, "impression-samples");
        }
    }

    /** An action: a label sample if its impression is in its task's window and not yet labelled for it. */
    private static final class ActionJoin extends Join {
        private final AvroCodec impressions;
        private final List<String> tasks;
        private final long[] windows;
        private final long retention;

        ActionJoin(AvroCodec samples, SampleContract contract, boolean rejects, AvroCodec impressions,
                List<String> tasks, long[] windows, long retention) {
            super(samples, contract, rejects);
            this.impressions = impressions;
            this.tasks = tasks;
            this.windows = windows;
            this.retention = retention;
        }

        @Override
        public void process(Record<byte[], Event> message) {
            Event action = message.value();
            if (action.record() == null) {
                reject(message, "malformed_action");
                return;
            }
            int task = tasks.indexOf(action.record().get(SampleContract.ACTION).toString());
            if (task < 0) {
                reject(message, "unknown_action");
                return;
            }
            long id = action.impressionId();
            long time = action.time();
            KeyValue<Long, byte[]> shown = latestShownBy(id, time);
            if (shown == null) {
                reject(message, "no_impression");
                return;
            }
            if (time - shown.key > windows[task]) {
                reject(message, "outside_window");
                return;
            }
            ByteBuffer stored = ByteBuffer.wrap(shown.value);
            long labelled = stored.getLong();
            if ((labelled & (1L << task)) != 0) {
                reject(message, "duplicate_action");
                return;
            }
            byte[] payload = new byte[stored.remaining()];
            stored.get(payload);
            GenericRecord impression;
            try {
                impression = impressions.decodePayload(payload);
            } catch (AvroCodec.Malformed error) {
                throw new IllegalStateException("the store holds an impression it cannot read back", error);
            }
            store.put(id, stored(labelled | (1L << task), payload), shown.key);
            emit(id, contract.labelSample(impression, tasks.get(task), time), time, "label-samples");
        }

        /** The impression's time and stored value, shown at or before {@code time}; null if none is kept. */
        private KeyValue<Long, byte[]> latestShownBy(long id, long time) {
            try (WindowStoreIterator<byte[]> shown = store.backwardFetch(id, Math.max(0, time - retention), time)) {
                return shown.hasNext() ? shown.next() : null;
            }
        }
    }
}
