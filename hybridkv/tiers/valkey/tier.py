"""The Valkey tier: the shared pool for shops that already run Valkey or Redis.

Runs in the worker process (bytes) and in the scheduler process
(``contains_many``, and ``sight_many``'s marks of hashes seen). One object
per key: the codec header followed by the payload. Every call is one
pipelined round trip (``SET NX``/``GET``/``EXISTS``/``DEL``). The
``redis`` client connects (TLS, AUTH, SELECT, pool); stores send the
caller's buffer straight to the socket (header and payload as separate
pieces, no joined copy); replies are read off the socket as they arrive
(``ReplyReader``), each value into a reusable staging buffer, checked
against its header and checksum, then copied out: no bytes object per value.

With ``cluster``, keys are spread over the shards of a Valkey Cluster by
hash slot (``cluster.SlotMap``, read from ``CLUSTER SLOTS``): a call sends
one pipeline to each shard it touches, then reads each shard's replies.

A server that refuses the configured user or password, a TLS file that
does not load, a server certificate that does not verify, or a refused TLS
handshake is a configuration error, raised once at start (``access``:
``ValkeyAuthError`` never showing the password, ``ValkeyTLSError``). Other
failures are values: socket timeouts (``op_timeout_s``)
bound every call, a dead or hung server (any shard) marks the tier unhealthy
(``HealthGate``) and calls answer miss/ERROR at once until a background PING
of every shard succeeds. A server at ``maxmemory`` under ``noeviction``
answers OOM: FULL. A redirect (the cluster moved a slot) is an ERROR and the
next call reads the slot map again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hybridkv.tiers.base import (
    Buffer,
    GetStatus,
    PutStatus,
    StoreKey,
    Tier,
    TierStats,
    TierUsage,
    check_batch,
)
from hybridkv.tiers.codec import HEADER_BYTES, pack_header, verify_object
from hybridkv.tiers.health import HealthGate
from hybridkv.tiers.log_once import LogOnce
from hybridkv.tiers.memory import allocate_arena
from hybridkv.tiers.valkey.access import check_tls_files, refusal
from hybridkv.tiers.valkey.cluster import REDIRECTS, Node, SlotMap
from hybridkv.tiers.valkey.config import TLS_FILES, ValkeyConfig
from hybridkv.tiers.valkey.protocol import Bulk, ErrorReply, ObjectPacker, ReplyReader, SplitValue

logger = logging.getLogger(__name__)


class ValkeyTier(Tier):
    """A ``Tier`` over one Valkey/Redis server or a Valkey Cluster. Thread-safe (a
    connection pool per server).

    ``usage()`` is the servers' view (``DBSIZE``, ``used_memory``,
    ``maxmemory``, summed over shards): it includes other clients' keys.
    """

    marks_sightings = True

    def __init__(self, config: ValkeyConfig, *, name: str = "valkey") -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise ImportError(
                f"the valkey tier needs pip install 'hybridkv[valkey]': {exc}"
            ) from exc
        check_tls_files(name, config)

        self.name = name
        self.load_weight = config.load_weight
        self.config = config
        options: dict[str, Any] = {"ssl_" + key[4:]: getattr(config, key) for key in TLS_FILES}
        self._redis = redis
        self._pool_options: dict[str, Any] = dict(
            connection_class=redis.SSLConnection if config.ssl else redis.Connection,
            db=config.db,
            username=config.username,
            password=config.password,
            socket_timeout=config.op_timeout_s,
            socket_connect_timeout=min(1.0, config.op_timeout_s),
            retry=Retry(NoBackoff(), 0),  # the gate decides when to try again
            command_packer=ObjectPacker(),
            protocol=2,  # what ReplyReader reads; RESP3 would also allow push messages
            **(options if config.ssl else {}),
        )
        self._seed = Node(config.host, config.port)
        self._pools: dict[Node, Any] = {}
        self._pools_lock = threading.Lock()
        self._slots: SlotMap | None = None
        """Cluster mode: the current map; None until read (again)."""
        # OSError covers timeouts and resets; ValueError a reply we cannot parse.
        self._errors: tuple[type[Exception], ...] = (redis.RedisError, OSError, ValueError)
        self._local = threading.local()
        self._stats = TierStats()
        self._stats_lock = threading.Lock()
        self._log = LogOnce(logger, name)
        self._closed = False
        self._gate = HealthGate(
            name, self._probe, retry_interval_s=config.retry_interval_s, log=logger
        )
        self._check_access(redis.AuthenticationError)

    @property
    def healthy(self) -> bool:
        return self._gate.healthy

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        found = [False] * len(keys)

        def read(i: int, replies: ReplyReader) -> None:
            found[i] = self._checked(replies.read()) == 1

        self._exchange("lookup", [("EXISTS", key) for key in keys], read)
        self._bump(queries=len(keys), hits=sum(found))
        return found

    def put_many(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None = None,
    ) -> list[PutStatus]:
        """``SET NX`` each object: an existing key keeps its first value (EXISTS)."""
        check_batch(keys, buffers, checksums)
        statuses = [PutStatus.ERROR] * len(keys)

        def read(i: int, replies: ReplyReader) -> None:
            statuses[i] = self._put_status(self._checked(replies.read()), len(buffers[i]))

        commands = [
            ("SET", key, SplitValue(pack_header(key, buf), buf.data), "NX")
            for key, buf in zip(keys, buffers, strict=True)
        ]
        self._exchange("store", commands, read)
        return statuses

    def get_many_into(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[GetStatus]:
        """Each value is read into a staging buffer, checked, then copied out."""
        check_batch(keys, buffers)
        statuses = [GetStatus.ERROR] * len(keys)

        def read(i: int, replies: ReplyReader) -> None:
            staging = self._staging(HEADER_BYTES + len(buffers[i]))
            answer = self._checked(replies.read(into=staging))
            statuses[i] = self._get_status(keys[i], answer, staging, buffers[i])

        self._exchange("load", [("GET", key) for key in keys], read)
        return statuses

    def delete_many(self, keys: Sequence[StoreKey]) -> int:
        removed = [0]

        def read(_i: int, replies: ReplyReader) -> None:
            reply = self._checked(replies.read())
            removed[0] += reply if isinstance(reply, int) else 0

        if keys and self.config.cluster:  # one DEL may not name keys of several slots
            self._exchange("delete", [("DEL", key) for key in keys], read, keys_per_command=0)
        elif keys:
            self._exchange("delete", [("DEL", *keys)], read, keys_per_command=0)
        return removed[0]

    def sight_many(self, keys: Sequence[StoreKey], ttl_s: int) -> list[bool]:
        """``SET NX EX`` a one-byte mark at each key (``connector.sightings``); True
        where the key existed. Errors answer False: a first sighting."""
        before = [False] * len(keys)

        def read(i: int, replies: ReplyReader) -> None:
            before[i] = self._checked(replies.read()) is None  # NX: nil where it existed

        self._exchange("sight", [("SET", key, b"1", "NX", "EX", ttl_s) for key in keys], read)
        return before

    def usage(self) -> TierUsage:
        if not self._closed and self._gate.allow():
            try:
                totals = [0, 0, 0]
                for node in self._nodes():
                    client = self._client(node)
                    memory = client.info("memory")
                    totals[0] += int(client.dbsize())
                    totals[1] += int(memory.get("used_memory", 0))
                    totals[2] += int(memory.get("maxmemory", 0))
                return TierUsage(
                    num_objects=totals[0], used_bytes=totals[1], capacity_bytes=totals[2] or None
                )
            except self._errors as exc:
                self._gate.mark_failed(f"usage: {exc!r}")
        return TierUsage(num_objects=0, used_bytes=0, capacity_bytes=None)

    def stats(self) -> TierStats:
        with self._stats_lock:
            return TierStats(**self._stats.as_dict())

    def check_integrity(self) -> None:
        stats = self.stats()
        assert stats.hits <= stats.queries, stats
        assert all(value >= 0 for value in stats.as_dict().values()), stats
        with self._pools_lock:
            pools = list(self._pools.values())
        for pool in pools:
            assert pool.connection_kwargs["retry"].get_retries() == 0, "retries would stall"

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._gate.close()
            with self._pools_lock:
                for pool in self._pools.values():
                    pool.disconnect()

    # -- helpers -----------------------------------------------------------------------

    def _exchange(
        self,
        what: str,
        commands: list[tuple[Any, ...]],
        read: Callable[[int, ReplyReader], None],
        *,
        keys_per_command: int = 1,
    ) -> None:
        """Send ``commands`` in one write per server, then ``read(i, replies)`` each reply
        as it arrives (a load checks and copies out one value while the next is on the
        wire). In a cluster each command goes to the shard of its key (``command[1]``).

        Commands left unanswered by a failure count as errors (``keys_per_command``
        each); a connection is never reused after an exchange that did not complete.
        """
        answered = 0
        if commands and not self._closed and self._gate.allow():
            sent: list[tuple[Any, Any, list[int]]] = []  # (pool, connection, command indices)
            try:
                for node, indices in self._route(commands).items():
                    pool = self._node_pool(node)
                    connection = pool.get_connection()
                    sent.append((pool, connection, indices))
                    packed = connection.pack_commands([commands[i] for i in indices])
                    connection.send_packed_command(packed)
                for _, connection, indices in sent:
                    # redis-py owns connecting, TLS and AUTH; replies we read ourselves.
                    replies = ReplyReader(connection._sock)
                    for i in indices:
                        read(i, replies)
                        answered += 1
                    if replies.num_pending_bytes:  # the stream is out of step
                        connection.disconnect()
            except self._errors as exc:
                self._gate.mark_failed(f"{what}: {exc!r}")
                for _, connection, _ in sent:  # unread replies would reach the next caller
                    connection.disconnect()
            finally:
                for pool, connection, _ in sent:
                    pool.release(connection)
        self._bump(errors=(len(commands) - answered) * keys_per_command)

    def _route(self, commands: list[tuple[Any, ...]]) -> dict[Node, list[int]]:
        """Command indices per server: all to the one server, or by slot in a cluster."""
        if not self.config.cluster:
            return {self._seed: list(range(len(commands)))}
        slots = self._slot_map()
        routes: dict[Node, list[int]] = {}
        for i, command in enumerate(commands):
            node = slots.node_of(command[1])
            if node is None:
                raise self._redis.exceptions.ClusterDownError(
                    f"no shard serves the slot of {command[1]}"
                )
            routes.setdefault(node, []).append(i)
        return routes

    def _slot_map(self) -> SlotMap:
        slots = self._slots
        if slots is None:
            reply = self._client(self._seed).execute_command("CLUSTER SLOTS")
            slots = SlotMap.from_reply(reply, self.config.host)
            self._slots = slots
        return slots

    def _nodes(self) -> list[Node]:
        return self._slot_map().nodes if self.config.cluster else [self._seed]

    def _node_pool(self, node: Node) -> Any:
        with self._pools_lock:
            if node not in self._pools:
                options = self._pool_options | {"host": node.host, "port": node.port}
                self._pools[node] = self._redis.ConnectionPool(**options)
            return self._pools[node]

    def _client(self, node: Node) -> Any:
        return self._redis.Redis(connection_pool=self._node_pool(node))

    def _checked(self, answer: Any) -> Any:
        """``answer``; a redirect also drops the slot map, to be read again."""
        if _is_redirect(answer):
            self._slots = None
            self._log.warning(
                "redirect", "the cluster answered %r: reading its slots again", answer.message
            )
        return answer

    def _staging(self, num_bytes: int) -> Buffer:
        """This thread's reusable receive buffer (touched once, then warm)."""
        arena: Buffer | None = getattr(self._local, "arena", None)
        if arena is None or len(arena) < num_bytes:
            size = max(num_bytes, 2 * len(arena) if arena is not None else 0)
            arena, _ = allocate_arena(size, pin_memory=False)
            self._local.arena = arena
        return arena[:num_bytes]

    def _bump(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def _put_status(self, answer: Any, payload_bytes: int) -> PutStatus:
        if answer == b"OK":
            self._bump(puts=1, put_bytes=payload_bytes)
            return PutStatus.OK
        if answer is None:
            return PutStatus.EXISTS
        if isinstance(answer, ErrorReply) and answer.message.startswith("OOM"):
            self._log.warning(
                "full",
                "the server refused stores: %s; they are skipped and counted (fix: "
                "maxmemory-policy allkeys-lru, or a larger maxmemory)",
                answer.message,
            )
            self._bump(put_skipped_full=1)
            return PutStatus.FULL
        if not _is_redirect(answer):  # logged by _checked
            self._log.warning("store", "a SET answered %r", answer)
        self._bump(errors=1)
        return PutStatus.ERROR

    def _get_status(self, key: StoreKey, answer: Any, stored: Buffer, out: Buffer) -> GetStatus:
        if answer is None:
            return GetStatus.MISS
        if not isinstance(answer, Bulk):
            if not _is_redirect(answer):  # logged by _checked
                self._log.warning("load", "a GET answered %r", answer)
            self._bump(errors=1)
            return GetStatus.ERROR
        problem: str | None
        if answer.num_bytes != len(stored):
            problem = f"stored {answer.num_bytes} bytes, expected {len(stored)}"
        else:
            error = verify_object(stored[:HEADER_BYTES], key, stored[HEADER_BYTES:])
            problem = None if error is None else error.value
        if problem is not None:
            self._log.warning("corrupt", "object %s is corrupt: %s", key, problem)
            self._bump(corrupt=1)
            return GetStatus.CORRUPT
        np.copyto(out, stored[HEADER_BYTES:])
        self._bump(gets=1, get_bytes=len(out))
        return GetStatus.OK

    def _probe(self) -> bool:
        """Every server answers PING (in a cluster, after reading the slot map again)."""
        self._slots = None
        return all(self._client(node).ping() for node in self._nodes())

    def _check_access(self, auth_error: type[Exception]) -> None:
        """Raise ``ValkeyAuthError`` or ``ValkeyTLSError`` if the server refuses us; an
        unreachable server is only unhealthy (it may come up later)."""
        try:
            self._client(self._seed).ping()
        except self._errors as exc:
            refused = refusal(self.name, self.config, exc, auth_error)
            if refused is not None:
                self.close()
                raise refused from None
            # The first call finds out again and marks the gate.
            logger.debug("tier %s: not reachable at start: %r", self.name, exc)


def _is_redirect(answer: Any) -> bool:
    return isinstance(answer, ErrorReply) and answer.message.startswith(REDIRECTS)
