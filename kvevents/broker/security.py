"""A SASL_SSL client listener for the local broker: TLS with a self-signed certificate and
SASL/PLAIN users, for tests and local setups that must look like a secured cluster.

:func:`make_self_signed_tls` writes a PKCS12 keystore (key + certificate for ``127.0.0.1`` and
``localhost``), a truststore holding the certificate (the broker's own inter-broker client
trusts it) and the certificate as PEM (librdkafka's ``ssl.ca.location``), with the JDK's
``keytool``. :class:`SaslSslListener` renders the broker properties that replace the
plaintext client listener (``LocalBroker(extra_properties=..., client_config=...)``) and the
matching librdkafka settings. The KRaft controller listener stays PLAINTEXT on the loopback
address. Passwords go into the broker's config file (mode 0600) and the client config, never
into a log line or a command line.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SaslSslListener", "TlsFiles", "make_self_signed_tls"]


@dataclass(frozen=True)
class TlsFiles:
    """What :func:`make_self_signed_tls` wrote."""

    keystore: Path
    truststore: Path
    certificate_pem: Path
    password: str = field(repr=False)


def make_self_signed_tls(directory: Path, days: int = 2) -> TlsFiles:
    """A self-signed certificate for ``127.0.0.1``/``localhost`` in ``directory`` (keytool)."""
    keytool = shutil.which("keytool")
    if keytool is None:
        java_home = os.environ.get("JAVA_HOME")
        candidate = Path(java_home, "bin", "keytool") if java_home else None
        if candidate is None or not candidate.exists():
            raise RuntimeError("keytool not found (it comes with the JDK that runs the broker)")
        keytool = str(candidate)
    directory.mkdir(parents=True, exist_ok=True)
    password = secrets.token_urlsafe(18)
    files = TlsFiles(directory / "broker.p12", directory / "trust.p12", directory / "ca.pem", password)
    for path in (files.keystore, files.truststore, files.certificate_pem):
        path.unlink(missing_ok=True)
    # The store password goes through keytool's environment (-storepass:env), not its argv.
    env = dict(os.environ, KVEVENTS_TLS_PASSWORD=password)
    store = ["-storetype", "PKCS12", "-storepass:env", "KVEVENTS_TLS_PASSWORD"]
    steps = [
        ["-genkeypair", "-alias", "broker", "-keyalg", "RSA", "-keysize", "2048", "-validity", str(days),
         "-dname", "CN=localhost", "-ext", "SAN=ip:127.0.0.1,dns:localhost", "-keystore", str(files.keystore),
         *store],
        ["-exportcert", "-rfc", "-alias", "broker", "-keystore", str(files.keystore), "-file",
         str(files.certificate_pem), *store],
        ["-importcert", "-noprompt", "-alias", "ca", "-file", str(files.certificate_pem), "-keystore",
         str(files.truststore), *store],
    ]  # fmt: skip
    for step in steps:
        done = subprocess.run([keytool, *step], capture_output=True, text=True, env=env, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(
                f"keytool {step[0]} failed (exit {done.returncode}): {done.stderr.strip()[-500:]}"
            )
    return files


def _jaas_quote(value: str) -> str:
    if '"' in value or "\\" in value:
        raise ValueError("SASL user names and passwords must not contain quotes or backslashes")
    return f'"{value}"'


@dataclass(frozen=True)
class SaslSslListener:
    """A SASL_SSL (PLAIN) client listener; ``users`` maps user names to passwords, the first
    one is also what the broker itself uses on its inter-broker connections."""

    tls: TlsFiles
    users: Mapping[str, str] = field(repr=False)

    def __post_init__(self) -> None:
        if not self.users:
            raise ValueError("a SASL listener needs at least one user")

    def broker_properties(self, host: str, client_port: int, controller_port: int) -> dict[str, str]:
        """Properties that replace the local broker's plaintext client listener."""
        broker_user, broker_password = next(iter(self.users.items()))
        jaas = " ".join(
            [
                "org.apache.kafka.common.security.plain.PlainLoginModule required",
                f"username={_jaas_quote(broker_user)} password={_jaas_quote(broker_password)}",
                *(f"user_{name}={_jaas_quote(password)}" for name, password in self.users.items()),
            ]
        )
        return {
            "listeners": f"SASL_SSL://{host}:{client_port},CONTROLLER://{host}:{controller_port}",
            "advertised.listeners": f"SASL_SSL://{host}:{client_port},CONTROLLER://{host}:{controller_port}",
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "SASL_SSL",
            "sasl.enabled.mechanisms": "PLAIN",
            "sasl.mechanism.inter.broker.protocol": "PLAIN",
            "listener.name.sasl_ssl.plain.sasl.jaas.config": jaas + ";",
            "ssl.keystore.type": "PKCS12",
            "ssl.keystore.location": str(self.tls.keystore),
            "ssl.keystore.password": self.tls.password,
            "ssl.key.password": self.tls.password,
            "ssl.truststore.type": "PKCS12",
            "ssl.truststore.location": str(self.tls.truststore),
            "ssl.truststore.password": self.tls.password,
        }

    def client_config(self, user: str, password: str | None = None) -> dict[str, str]:
        """librdkafka settings for ``user`` (password from ``users`` unless given)."""
        return {
            "security.protocol": "SASL_SSL",
            "sasl.mechanisms": "PLAIN",
            "sasl.username": user,
            "sasl.password": self.users[user] if password is None else password,
            "ssl.ca.location": str(self.tls.certificate_pem),
        }
