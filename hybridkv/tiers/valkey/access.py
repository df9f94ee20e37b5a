"""Who the Valkey server lets in: the tier's TLS files, TLS handshake and login.

Runs wherever a Valkey tier is built (worker and scheduler processes). Each
refusal here is a configuration error, raised once when the tier starts with
the setting to fix; an unreachable server is not (it may come up later: the
tier's health gate waits for it).
"""

from __future__ import annotations

import ssl

from hybridkv.tiers.valkey.config import ValkeyConfig

X509_V_ERR_HOSTNAME_MISMATCH = 62
"""OpenSSL's verify code for a certificate not issued for the host dialled."""
MAX_CHAINED = 8
"""How far ``refusal`` follows an exception's causes looking for the TLS error."""


class ValkeyAuthError(PermissionError):
    """The server refused the tier's user or password."""


class ValkeyTLSError(ConnectionError):
    """TLS cannot work as configured: a file does not load, the server's certificate
    does not verify, or the server refused the handshake."""


def check_tls_files(name: str, config: ValkeyConfig) -> None:
    """Raise ``ValkeyTLSError`` if a configured CA, certificate or key file does not load
    (missing, unreadable, not PEM, a key that does not match its certificate)."""
    if not config.ssl:
        return
    context = ssl.create_default_context()
    files = ""
    try:
        if config.ssl_ca_certs:
            files = f"ssl_ca_certs={config.ssl_ca_certs!r}"
            context.load_verify_locations(cafile=config.ssl_ca_certs)
        if config.ssl_certfile or config.ssl_keyfile:
            files = f"ssl_certfile={config.ssl_certfile!r}, ssl_keyfile={config.ssl_keyfile!r}"
            context.load_cert_chain(config.ssl_certfile or "", config.ssl_keyfile)
    except OSError as exc:  # ssl.SSLError is one
        raise ValkeyTLSError(
            f"tier {name}: cannot load the TLS files {files}: {exc.strerror or exc}; fix: "
            "point them at readable PEM files (a client key must match its certificate)"
        ) from None


def refusal(
    name: str, config: ValkeyConfig, exc: BaseException, auth_error: type[Exception]
) -> ValkeyAuthError | ValkeyTLSError | None:
    """The error to raise at start for ``exc`` (the first call's failure), or None when
    the server is only unreachable. ``auth_error``: the client's refused-login error.
    Never shows the password."""
    address = f"valkey at {config.host}:{config.port}"
    if isinstance(exc, auth_error):
        user = config.username or "default"
        given = "a password" if config.password else "no password"
        return ValkeyAuthError(
            f"tier {name}: {address} refused user {user!r} with {given} "
            f"({type(exc).__name__}); fix: set this tier's 'username' and 'password' to an "
            "ACL user of that server"
        )
    failure = _ssl_error(exc)
    if isinstance(failure, ssl.SSLCertVerificationError):
        if failure.verify_code == X509_V_ERR_HOSTNAME_MISMATCH:
            fix = "'host' to a name or address the server's certificate is issued for"
        else:
            fix = "'ssl_ca_certs' to the CA file that signed the server's certificate"
        trusted = repr(config.ssl_ca_certs) if config.ssl_ca_certs else "the system's CAs"
        return ValkeyTLSError(
            f"tier {name}: TLS certificate verification failed for {address}: "
            f"{failure.verify_message.rstrip('.')} (trusting {trusted}); fix: set this "
            f"tier's {fix}"
        )
    if failure is not None:
        return ValkeyTLSError(
            f"tier {name}: {address} refused the TLS handshake: {failure.strerror or failure}; "
            "fix: if the server requires client certificates (tls-auth-clients), set this "
            "tier's 'ssl_certfile' and 'ssl_keyfile' to a certificate its CA signed; if that "
            "port does not serve TLS, set 'ssl' to false"
        )
    return None


def _ssl_error(exc: BaseException | None) -> ssl.SSLError | None:
    """The ``ssl.SSLError`` behind ``exc`` (the client raises its own error from it)."""
    for _ in range(MAX_CHAINED):
        if exc is None or isinstance(exc, ssl.SSLError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None
