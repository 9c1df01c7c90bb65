package dev.streamtrain.joiner;

import java.util.ArrayList;
import java.util.HashSet;
import java.util.List;
import java.util.Set;
import org.apache.avro.JsonProperties;
import org.apache.avro.LogicalTypes;
import org.apache.avro.Schema;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericRecord;

/**
 * The sample topic's contract, derived from the impression schema and the task list: every
 * impression field as it is, then one nullable int label per task (named after the task), then
 * {@code sample_kind} ("impression" or "label") and {@code impression_time}.
 *
 * <p>An impression sample is the impression with every label 0 (none known yet); a label sample is
 * the impression again, its event_time the action's, its task's label 1 and the others null (not
 * known from this event; the worker masks them).
 */
final class SampleContract {
    static final String ID = "impression_id";
    static final String TIME = "event_time";
    static final String KIND = "sample_kind";
    static final String IMPRESSION_TIME = "impression_time";
    static final String ACTION = "action";

    final Schema samples;
    private final List<String> tasks;

    SampleContract(Schema impressions, Schema actions, List<String> tasks) throws JoinerSettings.Invalid {
        this.tasks = List.copyOf(tasks);
        if (impressions.getType() != Schema.Type.RECORD || actions.getType() != Schema.Type.RECORD) {
            throw new JoinerSettings.Invalid("joiner.impression.schema and joiner.action.schema must be Avro records");
        }
        requireField(impressions, "joiner.impression.schema", ID, Schema.Type.LONG);
        requireField(impressions, "joiner.impression.schema", TIME, Schema.Type.LONG);
        requireField(actions, "joiner.action.schema", ID, Schema.Type.LONG);
        requireField(actions, "joiner.action.schema", ACTION, Schema.Type.STRING);
        requireField(actions, "joiner.action.schema", TIME, Schema.Type.LONG);
        List<Schema.Field> fields = new ArrayList<>();
        for (Schema.Field field : impressions.getFields()) {
            fields.add(new Schema.Field(field, field.schema()));
        }
        Schema label = Schema.createUnion(Schema.create(Schema.Type.NULL), Schema.create(Schema.Type.INT));
        for (String task : tasks) {
            fields.add(new Schema.Field(task, label, "The " + task + " task's label: 0 on an impression sample, 1 "
                    + "on a label sample for " + task + ", null on a label sample for another task.",
                    JsonProperties.NULL_VALUE));
        }
        fields.add(new Schema.Field(KIND, Schema.create(Schema.Type.STRING),
                "\"impression\": the impression as it was shown, at once; \"label\": a label that arrived later."));
        fields.add(new Schema.Field(IMPRESSION_TIME,
                LogicalTypes.timestampMillis().addToSchema(Schema.create(Schema.Type.LONG)),
                "When the impression was shown; a label sample's event_time is when its action happened."));
        Set<String> taken = new HashSet<>();
        for (Schema.Field field : fields) {
            if (!taken.add(field.name())) {
                throw new JoinerSettings.Invalid("joiner.tasks: the sample would have two fields named '"
                        + field.name() + "' (the impression schema has it already); rename the task or the field");
            }
        }
        samples = Schema.createRecord(impressions.getName() + "Sample", "An impression, or a label that arrived "
                + "for it later, as streamtrain's joiner writes it (deploy/joiner/README.md).",
                impressions.getNamespace(), false, fields);
    }

    private static void requireField(Schema schema, String setting, String name, Schema.Type type)
            throws JoinerSettings.Invalid {
        Schema.Field field = schema.getField(name);
        if (field == null || field.schema().getType() != type) {
            throw new JoinerSettings.Invalid(setting + ": " + schema.getFullName() + " needs a field '" + name
                    + "' of type " + type.getName() + (field == null ? "" : ", not " + field.schema()));
        }
    }

    /** The impression at once: its labels all 0. */
    GenericRecord impressionSample(GenericRecord impression) {
        GenericRecord sample = copy(impression, "impression");
        for (String task : tasks) {
            sample.put(task, 0);
        }
        return sample;
    }

    /** A positive for {@code task} at {@code actionTime}; the other tasks' labels stay null. */
    GenericRecord labelSample(GenericRecord impression, String task, long actionTime) {
        GenericRecord sample = copy(impression, "label");
        sample.put(TIME, actionTime);
        sample.put(task, 1);
        return sample;
    }

    private GenericRecord copy(GenericRecord impression, String kind) {
        GenericRecord sample = new GenericData.Record(samples);
        for (Schema.Field field : impression.getSchema().getFields()) {
            sample.put(field.name(), impression.get(field.pos()));
        }
        sample.put(KIND, kind);
        sample.put(IMPRESSION_TIME, impression.get(TIME));
        return sample;
    }
}
