"""ValkeyTier against a real valkey-server on 127.0.0.1."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.connection import Encoder, PythonRespSerializer

from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey
from hybridkv.tiers.registry import parse_tier_config
from hybridkv.tiers.valkey.access import ValkeyAuthError, ValkeyTLSError
from hybridkv.tiers.valkey.cluster import Node
from hybridkv.tiers.valkey.config import ValkeyConfig
from hybridkv.tiers.valkey.protocol import Bulk, ErrorReply, ObjectPacker, ReplyReader, SplitValue
from hybridkv.tiers.valkey.tier import ValkeyTier
from hybridkv.tools.pool import LocalPool
from hybridkv.tools.servers import ServerRole
from tests.support.servers import MIB, ValkeyServer, timed, wait_for
from tests.support.tier_data import (
    bad_values,
    check_hung_server_costs_one_timeout,
    check_reads_back,
    check_stored_value_is_header_then_payload,
    new_keys,
    payloads,
    put_new,
    round_trip_test,
)
from tests.support.tls import make_certificates

OP_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server() -> Iterator[LocalPool]:
    with ValkeyServer() as running:
        yield running


@pytest.fixture(scope="module")
def tier(server: LocalPool) -> Iterator[ValkeyTier]:
    with make_tier(server) as built:
        yield built


@pytest.fixture(scope="module")
def raw(server: LocalPool) -> Iterator[redis.Redis]:
    client = redis.Redis(host="127.0.0.1", port=server.valkey_port)
    yield client
    client.close()


def make_tier(server: LocalPool, **options: Any) -> ValkeyTier:
    options.setdefault("op_timeout_s", OP_TIMEOUT_S)
    options.setdefault("retry_interval_s", 0.2)
    return ValkeyTier(ValkeyConfig(port=server.valkey_port, **options))


# -- config and wire format -----------------------------------------------------------


def test_config_from_dict_defaults_and_registry() -> None:
    config = parse_tier_config({"kind": "valkey", "port": 7000, "password": "pw"})
    assert config == ValkeyConfig(port=7000, password="pw")
    assert "pw" not in repr(config)


def test_config_collects_every_problem() -> None:
    raw = {"port": 0, "db": -1, "ssl": "yes", "password": 5, "op_timeout_s": 0, "colour": 1}
    with pytest.raises(ValueError) as caught:
        parse_tier_config({"kind": "valkey", **raw}, where="tiers[2]")
    message = str(caught.value)
    assert message.startswith("tiers[2]: 6 problems:")
    for needle in ("port=0", "db=-1", "ssl='yes'", "password=<hidden>", "op_timeout_s=0",
                   "colour: unknown key"):  # fmt: skip
        assert needle in message, needle
    assert "5" not in message.split("password")[1][:12], "the password value leaked"
    with pytest.raises(ValueError, match="set ssl to true"):
        parse_tier_config({"kind": "valkey", "ssl_ca_certs": "/ca.pem"})


def test_tls_and_auth_settings_reach_the_connections(tmp_path: Path) -> None:
    files = make_certificates(tmp_path)
    ca, cert, key = str(files.ca), str(files.client_cert), str(files.client_key)
    config = ValkeyConfig(
        host="127.0.0.1", port=1, db=3, username="u", password="p", ssl=True,
        ssl_ca_certs=ca, ssl_certfile=cert, ssl_keyfile=key,
    )  # fmt: skip
    with ValkeyTier(config) as tls_tier:  # nothing listens on port 1: only unhealthy
        pool = tls_tier._node_pool(Node("127.0.0.1", 1))
        assert pool.connection_class is redis.SSLConnection
        kwargs = pool.connection_kwargs
        assert (kwargs["db"], kwargs["username"], kwargs["password"]) == (3, "u", "p")
        assert (kwargs["ssl_ca_certs"], kwargs["ssl_certfile"], kwargs["ssl_keyfile"]) == (
            ca, cert, key
        )  # fmt: skip
        tls_tier.check_integrity()


def test_tls_files_that_do_not_load_fail_at_start_naming_them(tmp_path: Path) -> None:
    files = make_certificates(tmp_path)
    missing = str(tmp_path / "missing.pem")
    cases = [
        ({"ssl_ca_certs": missing}, f"ssl_ca_certs={missing!r}"),
        ({"ssl_ca_certs": str(files.client_key)}, "ssl_ca_certs="),  # a key, not a CA
        ({"ssl_certfile": str(files.client_cert), "ssl_keyfile": str(files.server_key)},
         "ssl_certfile="),  # a key of another certificate
        ({"ssl_certfile": missing}, f"ssl_certfile={missing!r}"),
    ]  # fmt: skip
    for options, named in cases:
        config = ValkeyConfig(port=1, ssl=True, **options)  # type: ignore[arg-type]
        with pytest.raises(ValkeyTLSError, match="cannot load the TLS files") as caught:
            ValkeyTier(config)
        assert named in str(caught.value) and "fix: " in str(caught.value), caught.value


arguments = st.lists(st.one_of(st.text(max_size=8), st.binary(max_size=20), st.integers()))


@given(arguments, st.binary(max_size=64), st.binary(max_size=10_000), arguments)
def test_object_packer_sends_the_bytes_redis_would(
    before: list[Any], header: bytes, payload: bytes, after: list[Any]
) -> None:
    value = SplitValue(header, memoryview(payload))
    ours = b"".join(ObjectPacker().pack("SET", *before, value, *after))
    reference = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    theirs = b"".join(reference.pack("SET", *before, header + payload, *after))
    assert ours == theirs


line_text = st.binary(max_size=20).filter(lambda b: b"\r" not in b and b"\n" not in b)
replies = st.lists(
    st.one_of(
        st.tuples(st.just("int"), st.integers(-(2**63), 2**63 - 1)),
        st.tuples(st.just("simple"), line_text),
        st.tuples(st.just("error"), st.text("OMERTY -'>:_", max_size=20).map(ErrorReply)),
        st.tuples(st.just("nil"), st.none()),
        st.tuples(st.sampled_from(["bulk", "into", "into other size"]), st.binary(max_size=3000)),
    ),
    max_size=30,
)


def encode(kind: str, value: Any) -> bytes:
    """The RESP2 bytes a server sends for one reply (the reference encoding)."""
    if kind == "int":
        return b":%d\r\n" % value
    if kind == "simple":
        return b"+" + value + b"\r\n"
    if kind == "error":
        return b"-" + value.message.encode() + b"\r\n"
    if kind == "nil":
        return b"$-1\r\n"
    return b"$%d\r\n%b\r\n" % (len(value), value)


@settings(max_examples=60, deadline=None)
@given(replies, st.lists(st.integers(1, 700), min_size=1, max_size=8))
def test_reply_reader_reads_what_a_server_writes(
    answers: list[tuple[str, Any]], chunks: list[int]
) -> None:
    wire = b"".join(encode(kind, value) for kind, value in answers)
    ours, theirs = socket.socketpair()

    def send() -> None:  # in uneven pieces, as a network delivers them
        position, turn = 0, 0
        while position < len(wire):
            size = chunks[turn % len(chunks)]
            theirs.sendall(wire[position : position + size])
            position, turn = position + size, turn + 1

    sender = threading.Thread(target=send)
    sender.start()
    try:
        reader = ReplyReader(ours, read_bytes=97)
        for kind, value in answers:
            if kind.startswith("into"):
                into = np.full(len(value) + (kind == "into other size"), 7, dtype=np.uint8)
                assert reader.read(into=into) == Bulk(len(value))
                if kind == "into":
                    assert into.tobytes() == value
                else:
                    assert (into == 7).all(), "a bulk of another size touched the buffer"
            else:
                got = reader.read()
                assert got == value and type(got) is type(value)
        assert reader.num_pending_bytes == 0
    finally:
        sender.join()
        ours.close()
        theirs.close()


# -- data path --------------------------------------------------------------------------

test_round_trip_matches_a_dict = round_trip_test(max_object_bytes=200_000)


def test_stats_usage_and_delete(server: LocalPool) -> None:
    with make_tier(server, db=5) as fresh:
        keys, buffers = put_new(fresh, [1000, 2000, 3000])
        outs = [np.empty_like(buf) for buf in buffers]
        assert fresh.get_many_into(keys, outs) == [GetStatus.OK] * 3
        assert fresh.contains_many([*keys, StoreKey("absent")]) == [True] * 3 + [False]
        assert fresh.delete_many([keys[0], StoreKey("absent")]) == 1
        assert fresh.contains_many(keys[:1]) == [False]
        stats = fresh.stats()
        assert (stats.puts, stats.put_bytes, stats.gets, stats.get_bytes) == (3, 6000, 3, 6000)
        assert (stats.queries, stats.hits) == (5, 3)  # the absent key, then the deleted one
        usage = fresh.usage()  # db 5 holds only this test's keys
        assert usage.num_objects == 2 and usage.capacity_bytes == 256 * MIB
        assert usage.used_bytes > 5000
        fresh.check_integrity()


def test_databases_do_not_share_keys(server: LocalPool) -> None:
    with make_tier(server, db=1) as one, make_tier(server, db=2) as two:
        key = new_keys(1)
        assert one.put_many(key, payloads([100])) == [PutStatus.OK]
        assert two.contains_many(key) == [False] and one.contains_many(key) == [True]


def test_stored_value_is_codec_header_then_payload(tier: ValkeyTier, raw: redis.Redis) -> None:
    check_stored_value_is_header_then_payload(tier, raw.get)


def test_bad_values_written_behind_its_back_are_corrupt(tier: ValkeyTier, raw: redis.Redis) -> None:
    keys = new_keys(5)
    (payload,) = payloads([4096], seed=3)
    values = bad_values(keys, payload)
    for key, value in zip(keys, values, strict=True):
        raw.set(key, value)
    raw.lpush(keys[0] + "/list", b"x")  # a key of another type answers an error, not bytes
    before = tier.stats()
    outs = [np.full(4096, 7, dtype=np.uint8) for _ in range(6)]
    statuses = tier.get_many_into([*keys, StoreKey(keys[0] + "/list")], outs)
    assert statuses == [GetStatus.CORRUPT] * 5 + [GetStatus.ERROR]
    assert all((out == 7).all() for out in outs), "a bad object reached the caller"
    after = tier.stats()
    assert (after.corrupt, after.errors) == (before.corrupt + 5, before.errors + 1)
    tier.check_integrity()


def test_full_server_answers_full(caplog: pytest.LogCaptureFixture) -> None:
    with (
        ValkeyServer(maxmemory_bytes=8 * MIB, policy="noeviction") as small,
        make_tier(small) as tier,
        caplog.at_level(logging.WARNING),
    ):
        keys = new_keys(16)
        buffers = payloads([MIB] * 16, seed=4)
        statuses = tier.put_many(keys, buffers)
        assert statuses[0] is PutStatus.OK and statuses[-1] is PutStatus.FULL
        assert set(statuses) == {PutStatus.OK, PutStatus.FULL}
        refused = statuses.count(PutStatus.FULL)
        assert (
            tier.stats().put_skipped_full
            == refused
            == small.status()["valkey_pool"]["refused_puts"]
        )
        outs = [np.empty(MIB, dtype=np.uint8) for _ in keys]
        loaded = tier.get_many_into(keys, outs)
        assert loaded == [GetStatus.OK if s is PutStatus.OK else GetStatus.MISS for s in statuses]
        assert all(
            np.array_equal(o, b)
            for o, b, s in zip(outs, buffers, loaded, strict=True)
            if s is GetStatus.OK
        )
        assert small.status()["valkey_pool"]["evicted_keys"] == 0
        warnings = [r.getMessage() for r in caplog.records if "refused stores" in r.getMessage()]
        assert len(warnings) == 1 and "allkeys-lru" in warnings[0], warnings
        tier.check_integrity()


def test_lru_server_past_maxmemory_evicts_the_oldest() -> None:
    """Under allkeys-lru the server evicts before each write: every store is taken,
    the oldest objects are gone (misses), the newest are read back intact."""
    with (
        ValkeyServer(maxmemory_bytes=8 * MIB, policy="allkeys-lru") as small,
        make_tier(small) as tier,
    ):
        keys = new_keys(48)
        buffers = payloads([MIB] * 48, seed=5)
        statuses: list[PutStatus] = []
        for start in range(0, 48, 4):
            statuses += tier.put_many(keys[start : start + 4], buffers[start : start + 4])
        assert statuses == [PutStatus.OK] * 48
        assert tier.stats().put_skipped_full == 0
        outs = [np.empty(MIB, dtype=np.uint8) for _ in keys]
        loaded = tier.get_many_into(keys, outs)
        present = [i for i, status in enumerate(loaded) if status is GetStatus.OK]
        assert set(loaded) == {GetStatus.OK, GetStatus.MISS}
        assert len(present) < 8, present
        assert all(np.array_equal(outs[i], buffers[i]) for i in present)
        assert set(range(44, 48)) <= set(present), present
        assert not set(range(8)) & set(present), present
        figures = small.status()["valkey_pool"]
        assert figures["evicted_keys"] == 48 - len(present), figures
        assert figures["refused_puts"] == 0, figures
        tier.check_integrity()


def test_password_is_used_and_a_missing_one_fails_at_start() -> None:
    with ValkeyServer(password="s3cret") as locked:
        with make_tier(locked, password="s3cret") as good:
            key = new_keys(1)
            assert good.put_many(key, payloads([10])) == [PutStatus.OK]
            assert good.contains_many(key) == [True]
        started = time.monotonic()
        with pytest.raises(ValkeyAuthError, match="refused user 'default' with no password"):
            make_tier(locked)
        assert time.monotonic() - started < OP_TIMEOUT_S


# -- faults -----------------------------------------------------------------------------


def test_killed_server_answers_misses_at_once_and_recovers() -> None:
    with ValkeyServer() as fault_server, make_tier(fault_server) as tier:
        keys, buffers = put_new(tier, [10_000] * 3, seed=6)
        fault_server.kill(ServerRole.VALKEY)
        found, seconds = timed(lambda: tier.contains_many(keys))
        assert found == [False] * 3 and seconds < OP_TIMEOUT_S and not tier.healthy
        outs = [np.zeros(10_000, dtype=np.uint8) for _ in keys]
        statuses, seconds = timed(lambda: tier.get_many_into(keys, outs))
        assert statuses == [GetStatus.ERROR] * 3 and seconds < 0.2
        assert tier.put_many(keys, buffers) == [PutStatus.ERROR] * 3
        assert tier.stats().errors == 9
        fault_server.restart(ServerRole.VALKEY)
        (fresh,) = new_keys(1)
        wait_for(lambda: tier.put_many([fresh], buffers[:1]) == [PutStatus.OK], timeout_s=10)
        check_reads_back(tier, [fresh], buffers[:1])


def test_hung_server_costs_one_timeout_then_recovers() -> None:
    with ValkeyServer() as fault_server, make_tier(fault_server) as tier:
        keys, buffers = put_new(tier, [10_000] * 2, seed=7)
        fault_server.pause(ServerRole.VALKEY)
        try:
            check_hung_server_costs_one_timeout(tier, keys, OP_TIMEOUT_S)
        finally:
            fault_server.resume(ServerRole.VALKEY)
        wait_for(lambda: tier.contains_many(keys) == [True, True], timeout_s=10)
        check_reads_back(tier, keys, buffers)
