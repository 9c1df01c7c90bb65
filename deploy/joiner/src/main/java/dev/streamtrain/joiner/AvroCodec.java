package dev.streamtrain.joiner;

import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.ByteBuffer;
import java.util.OptionalInt;
import org.apache.avro.Schema;
import org.apache.avro.generic.GenericDatumReader;
import org.apache.avro.generic.GenericDatumWriter;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.io.BinaryDecoder;
import org.apache.avro.io.BinaryEncoder;
import org.apache.avro.io.DecoderFactory;
import org.apache.avro.io.EncoderFactory;

/**
 * Avro values of one schema on one topic: raw binary (the worker's default wire format), or the
 * Confluent wire format (magic byte 0, the 4-byte schema id, then the binary) when a schema id is
 * given. Without a registry client the joiner reads one writer schema per topic: a framed value
 * under another id is refused, never decoded with the wrong schema.
 */
final class AvroCodec {
    private static final byte MAGIC = 0;

    /** A value this codec refuses; the reason goes into the rejects topic's header. */
    static final class Malformed extends Exception {
        private static final long serialVersionUID = 1L;

        Malformed(String reason) {
            super(reason);
        }
    }

    private final Schema schema;
    private final OptionalInt schemaId;
    private final GenericDatumReader<GenericRecord> reader;
    private final GenericDatumWriter<GenericRecord> writer;

    AvroCodec(Schema schema, OptionalInt schemaId) {
        this.schema = schema;
        this.schemaId = schemaId;
        this.reader = new GenericDatumReader<>(schema);
        this.writer = new GenericDatumWriter<>(schema);
    }

    /** The Avro binary of a value, without its frame. */
    byte[] payload(byte[] value) throws Malformed {
        if (value == null) {
            throw new Malformed("a null value (a tombstone)");
        }
        if (schemaId.isEmpty()) {
            return value;
        }
        if (value.length < 5 || value[0] != MAGIC) {
            throw new Malformed("not in the Confluent wire format (no magic byte 0 and schema id)");
        }
        int id = ByteBuffer.wrap(value, 1, 4).getInt();
        if (id != schemaId.getAsInt()) {
            throw new Malformed("schema id " + id + ", not " + schemaId.getAsInt() + ", the one the joiner reads");
        }
        byte[] payload = new byte[value.length - 5];
        System.arraycopy(value, 5, payload, 0, payload.length);
        return payload;
    }

    /** Decodes an unframed payload; the whole of it must be one record. */
    GenericRecord decodePayload(byte[] payload) throws Malformed {
        BinaryDecoder decoder = DecoderFactory.get().binaryDecoder(payload, null);
        try {
            GenericRecord record = reader.read(null, decoder);
            if (!decoder.isEnd()) {
                throw new Malformed("trailing bytes after a " + schema.getFullName());
            }
            return record;
        } catch (IOException | RuntimeException error) {  // Avro reports bad bytes both ways
            throw new Malformed("not a " + schema.getFullName() + " in Avro binary (" + error + ")");
        }
    }

    byte[] encode(GenericRecord record) {
        ByteArrayOutputStream out = new ByteArrayOutputStream(256);
        if (schemaId.isPresent()) {
            out.write(MAGIC);
            out.writeBytes(ByteBuffer.allocate(4).putInt(schemaId.getAsInt()).array());
        }
        BinaryEncoder encoder = EncoderFactory.get().directBinaryEncoder(out, null);
        try {
            writer.write(record, encoder);
            encoder.flush();
        } catch (IOException error) {
            throw new UncheckedIOException(error);  // a ByteArrayOutputStream does not fail
        }
        return out.toByteArray();
    }
}
