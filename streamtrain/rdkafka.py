"""librdkafka's C API for what confluent-kafka's ``Consumer`` does not offer: fetched messages
handed over in columns, without a Python object per message.

``Consumer.consume`` makes a ``Message`` for every message, with its value, key and topic
objects: 0.6-1.0 µs of the prefetch thread's CPU an event, most of what reading costs it. A
``FetchQueue`` instead forwards the owned partitions' fetch queues to a queue of its own, and
reads that in batches: one C call fills an array of message pointers, and a compiled loop copies
the payloads back to back and the partitions and offsets into arrays. The messages themselves stay
alive until their batch is dropped, so the dead-letter path still reads a rejected event's key,
timestamp and headers as they came; copying those out of every message costs more than the rest
(librdkafka allocates to find that a message has no headers).

The forwarding must happen before ``Consumer.assign`` (or ``incremental_assign``, for partitions
added to the topic later): librdkafka never overrides a forward the application set, but whatever
it fetched before lies in the consumer's queue already. That queue
keeps everything else (the error callback, librdkafka's logs), served by ``Consumer.poll`` as
before; confluent-kafka's callbacks must run inside its own calls, which is why the consumer's
queue itself cannot be read here.

confluent-kafka does not expose its ``rd_kafka_t``. Its ``Handle`` object holds it first after the
object header (so since 0.9), and ``attach`` checks what it reads: librdkafka's opaque of that
handle must be the ``Consumer`` itself. Where a check fails, ``attach`` returns None and the
source reads through ``Consumer.consume``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from typing import Any

import confluent_kafka
import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

log = logging.getLogger(__name__)

_VOIDP = ctypes.c_void_p


class _Message(ctypes.Structure):
    """``rd_kafka_message_t``, as rdkafka.h declares it: public, and unchanged since 0.9."""

    _fields_ = [
        ("err", ctypes.c_int),
        ("rkt", _VOIDP),
        ("partition", ctypes.c_int32),
        ("payload", _VOIDP),
        ("len", ctypes.c_size_t),
        ("key", _VOIDP),
        ("key_len", ctypes.c_size_t),
        ("offset", ctypes.c_int64),
        ("private", _VOIDP),
    ]


# The compiled loop views a message as 32- and 64-bit words.
_ERR = _Message.err.offset // 4
_PARTITION = _Message.partition.offset // 4
_PAYLOAD = _Message.payload.offset // 8
_LEN = _Message.len.offset // 8
_OFFSET = _Message.offset.offset // 8
_WORDS = ctypes.sizeof(_Message) // 8


def _pointer_to(dtype: types.Type) -> Callable[..., Any]:
    @intrinsic
    def pointer(typingctx, address):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return types.CPointer(dtype)(types.uint64), codegen

    return pointer


_int32s = _pointer_to(types.int32)
_int64s = _pointer_to(types.int64)
_bytes = _pointer_to(types.uint8)


@intrinsic
def _call_with_pointer(typingctx, function, argument):
    """``function(argument)`` for a C function ``void f(void *)`` given by its address: passed at
    run time, so the loop that calls it can be cached on disk."""

    def codegen(context, builder, signature, args):
        voidp = ir.IntType(8).as_pointer()
        callee = builder.inttoptr(args[0], ir.FunctionType(ir.VoidType(), [voidp]).as_pointer())
        builder.call(callee, [builder.inttoptr(args[1], voidp)])
        return context.get_dummy_value()

    return types.void(types.uint64, types.uint64), codegen


@njit(cache=True, nogil=True, boundscheck=False)
def _columns(messages: np.ndarray) -> tuple[np.ndarray, ...]:
    """The messages' payloads back to back (an error message's payload is its text, left out), and
    their partitions, offsets and error codes."""
    n = messages.size
    bounds = np.zeros(n + 1, np.int64)
    partitions = np.empty(n, np.int64)
    offsets = np.empty(n, np.int64)
    errors = np.empty(n, np.int32)
    for i in range(n):
        words32 = carray(_int32s(messages[i]), (2 * _WORDS,))
        words = carray(_int64s(messages[i]), (_WORDS,))
        errors[i] = words32[_ERR]
        partitions[i] = words32[_PARTITION]
        offsets[i] = words[_OFFSET]
        bounds[i + 1] = bounds[i] + (words[_LEN] if words32[_ERR] == 0 and words[_PAYLOAD] != 0 else 0)
    data = np.empty(bounds[n], np.uint8)
    for i in range(n):
        if bounds[i + 1] > bounds[i]:
            payload = carray(_int64s(messages[i]), (_WORDS,))[_PAYLOAD]
            data[bounds[i] : bounds[i + 1]] = carray(_bytes(payload), (bounds[i + 1] - bounds[i],))
    return data, bounds, partitions, offsets, errors


@njit(cache=True, nogil=True)
def _destroy_all(messages: np.ndarray, destroy: int) -> None:
    for i in range(messages.size):
        _call_with_pointer(destroy, messages[i])


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """The librdkafka that confluent-kafka's extension runs on, found among the files this process
    has mapped, with the functions used here declared; None where it cannot be found."""
    import confluent_kafka.cimpl  # maps librdkafka into this process

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[5].strip() for line in maps if "librdkafka" in line}
    except OSError:
        return None
    if len(paths) != 1:
        return None
    lib = ctypes.CDLL(paths.pop())
    declarations = {
        "rd_kafka_version": (ctypes.c_int, []),
        "rd_kafka_opaque": (_VOIDP, [_VOIDP]),
        "rd_kafka_queue_new": (_VOIDP, [_VOIDP]),
        "rd_kafka_queue_get_partition": (_VOIDP, [_VOIDP, ctypes.c_char_p, ctypes.c_int32]),
        "rd_kafka_queue_forward": (None, [_VOIDP, _VOIDP]),
        "rd_kafka_queue_destroy": (None, [_VOIDP]),
        "rd_kafka_consume_batch_queue": (ctypes.c_ssize_t, [_VOIDP, ctypes.c_int, _VOIDP, ctypes.c_size_t]),
        "rd_kafka_message_destroy": (None, [_VOIDP]),
        "rd_kafka_message_timestamp": (ctypes.c_int64, [_VOIDP, ctypes.POINTER(ctypes.c_int)]),
        "rd_kafka_message_headers": (ctypes.c_int, [_VOIDP, ctypes.POINTER(_VOIDP)]),
        "rd_kafka_header_get_all": (
            ctypes.c_int,
            [
                _VOIDP,
                ctypes.c_size_t,
                ctypes.POINTER(ctypes.c_char_p),
                ctypes.POINTER(_VOIDP),
                ctypes.POINTER(ctypes.c_size_t),
            ],
        ),
    }
    for name, (restype, argtypes) in declarations.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    if lib.rd_kafka_version() != confluent_kafka.libversion()[1]:
        return None
    return lib


def _handle(consumer: confluent_kafka.Consumer, lib: ctypes.CDLL) -> int | None:
    """The consumer's ``rd_kafka_t *``, checked; None if what this version holds there is not it."""
    if sys.byteorder != "little" or type(consumer).__basicsize__ < object.__basicsize__ + ctypes.sizeof(_VOIDP):
        return None
    handle = _VOIDP.from_address(id(consumer) + object.__basicsize__).value
    if not handle or lib.rd_kafka_opaque(handle) != id(consumer):
        return None
    return handle


class FetchedMessage:
    """One fetched message, read in place: the accessors of confluent-kafka's ``Message`` that
    the dead-letter path uses."""

    __slots__ = ("_message", "_owner")

    def __init__(self, owner: FetchedMessages, message: _Message):
        self._owner = owner  # keeps the message alive
        self._message = message

    def partition(self) -> int:
        with self._owner.reading(self._message) as m:
            return m.partition

    def offset(self) -> int:
        with self._owner.reading(self._message) as m:
            return m.offset

    def value(self) -> bytes | None:
        with self._owner.reading(self._message) as m:
            return ctypes.string_at(m.payload, m.len) if m.payload else None

    def key(self) -> bytes | None:
        with self._owner.reading(self._message) as m:
            return ctypes.string_at(m.key, m.key_len) if m.key else None

    def error_text(self) -> str | None:
        """An error message's text, which librdkafka puts where a payload would be."""
        with self._owner.reading(self._message) as m:
            return ctypes.string_at(m.payload, m.len).decode("utf-8", "replace") if m.err and m.payload else None

    def timestamp(self) -> tuple[int, int]:
        kind = ctypes.c_int()
        with self._owner.reading(self._message) as m:
            at = self._owner.lib.rd_kafka_message_timestamp(ctypes.addressof(m), ctypes.byref(kind))
        return kind.value, at

    def headers(self) -> list[tuple[str, bytes | None]] | None:
        lib, headers = self._owner.lib, _VOIDP()
        found: list[tuple[str, bytes | None]] = []
        name, value, size = ctypes.c_char_p(), _VOIDP(), ctypes.c_size_t()
        with self._owner.reading(self._message) as m:
            if lib.rd_kafka_message_headers(ctypes.addressof(m), ctypes.byref(headers)):
                return None  # RD_KAFKA_RESP_ERR__NOENT: it has none
            while not lib.rd_kafka_header_get_all(
                headers, len(found), ctypes.byref(name), ctypes.byref(value), ctypes.byref(size)
            ):
                text = (name.value or b"").decode("utf-8", "replace")
                found.append((text, ctypes.string_at(value, size.value) if value.value else None))
        return found


class FetchedMessages(Sequence[FetchedMessage]):
    """The messages of one ``FetchQueue.read``, destroyed once this is dropped, or when the queue
    closes: librdkafka's handle must outlive its messages."""

    def __init__(self, queue: FetchQueue, pointers: np.ndarray):
        self.lib = queue.lib
        self._lock = queue.lock
        self._pointers = pointers
        self._destroy = weakref.finalize(self, _destroy_under, queue.lock, pointers, queue.destroy_address)
        self._destroy.atexit = False  # at exit the consumer may be gone before them

    def __len__(self) -> int:
        return len(self._pointers)

    def __getitem__(self, index: int) -> FetchedMessage:  # type: ignore[override]
        return FetchedMessage(self, _Message.from_address(int(self._pointers[index])))

    @contextlib.contextmanager
    def reading(self, message: _Message) -> Iterator[_Message]:
        """``message``, with ``destroy`` held off while it is read; refused once that ran."""
        with self._lock:
            if not self._destroy.alive:
                raise RuntimeError("a fetched message was read after its consumer closed")
            yield message

    def destroy(self) -> None:
        self._destroy()


def _destroy_under(lock: threading.RLock, pointers: np.ndarray, destroy: int) -> None:
    with lock:
        _destroy_all(pointers, destroy)


class FetchQueue:
    """The fetched messages of ``partitions``, read in batches; see the module's docstring."""

    def __init__(self, lib: ctypes.CDLL, handle: int, topic: str, partitions: Sequence[int]):
        self.lib = lib
        self.destroy_address: int = ctypes.cast(lib.rd_kafka_message_destroy, _VOIDP).value or 0
        # Serializes reading the queue, reading a message and destroying them, against close().
        self.lock = threading.RLock()
        self._handle = handle
        self._topic = topic
        self._queue: int | None = lib.rd_kafka_queue_new(handle)
        self._live: weakref.WeakSet[FetchedMessages] = weakref.WeakSet()
        try:
            self.forward(partitions)
        except LookupError:
            self.close()
            raise

    def forward(self, partitions: Sequence[int]) -> None:
        """Makes this queue take the fetched messages of ``partitions`` too; call it before they are
        assigned (also for partitions added to the topic later)."""
        with self.lock:
            for partition in partitions:
                fetch_queue = self.lib.rd_kafka_queue_get_partition(self._handle, self._topic.encode(), partition)
                if not fetch_queue:
                    raise LookupError(f"librdkafka does not know {self._topic} [{partition}]")
                self.lib.rd_kafka_queue_forward(fetch_queue, self._queue)
                self.lib.rd_kafka_queue_destroy(fetch_queue)  # the forward holds it

    @classmethod
    def attach(cls, consumer: confluent_kafka.Consumer, topic: str, partitions: Sequence[int]) -> FetchQueue | None:
        """The queue of ``consumer``'s ``partitions``; call it before ``consumer.assign``. None, with
        the reason logged, where this process's confluent-kafka cannot be read this way."""
        lib = _library()
        handle = _handle(consumer, lib) if lib is not None else None
        if lib is None or handle is None:
            log.warning(
                "the librdkafka handle of this confluent-kafka (librdkafka %s) cannot be read; events "
                "are read through Consumer.consume, which costs more CPU an event",
                confluent_kafka.libversion()[0],
            )
            return None
        try:
            return cls(lib, handle, topic, partitions)
        except LookupError as error:
            log.warning("%s; events are read through Consumer.consume", error)
            return None

    def read(self, max_events: int, timeout: float) -> tuple[FetchedMessages, tuple[np.ndarray, ...]]:
        """Up to ``max_events`` messages, waiting at most ``timeout`` seconds for the first, with what
        ``_columns`` makes of them."""
        pointers = np.zeros(max_events, np.uint64)
        with self.lock:
            if self._queue is None:
                raise RuntimeError("the fetch queue is closed")
            count = self.lib.rd_kafka_consume_batch_queue(
                self._queue, int(timeout * 1000), pointers.ctypes.data, max_events
            )
            if count < 0:
                raise RuntimeError("librdkafka refused to read the fetch queue")
            pointers = pointers[:count]
            messages = FetchedMessages(self, pointers)
            self._live.add(messages)
            return messages, _columns(pointers)

    def close(self) -> None:
        """Destroys the messages still held, then the queue; the consumer may close after this."""
        with self.lock:
            for messages in list(self._live):
                messages.destroy()
            if self._queue is not None:
                self.lib.rd_kafka_queue_destroy(self._queue)
                self._queue = None
