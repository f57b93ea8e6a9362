"""The swarm's own certificate authority, for TLS between hosts' Redis servers.

The operator makes the CA once, on a machine of their own (`make_ca`: an EC P-256 key, mode
0600, and a self-signed CA certificate), and for each host a certificate of its Redis signed by
it (`issue`: an EC P-256 key of the host's own, a certificate for server authentication that
names the addresses other hosts dial it at, and a copy of the CA's certificate), which goes to
that host: the files `specpipe join` starts its Redis with (`TlsFiles`), and the CA every
process there verifies the other hosts' servers against. `check_host_files` says, before a
server starts with them, whether such files fit together and name the host's address.

EC P-256 with SHA-256: what every OpenSSL that Redis builds against serves and verifies.
Nothing here is hand-made: keys, certificates and their verification are `cryptography`'s.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from specpipe.ops.redis_server import TlsFiles
from specpipe.settings import CA_CERT_FILE, TLS_CERT_FILE, TLS_KEY_FILE, write_private

CA_KEY_FILE = "ca.key"
CA_NAME = "specpipe swarm CA"
CA_DAYS = 3650  # the CA: ten years, made once
HOST_DAYS = 825  # a host's certificate: the longest the CA/Browser Forum ever allowed
# A certificate is dated a little in the past, so that a host whose clock is slightly behind
# the operator's accepts it at once.
BACKDATE = timedelta(minutes=5)
_DNS_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")


CA_FOLDER = "ca"  # the swarm CA's, in the instance folder of the machine that keeps it


class CaError(ValueError):
    """Bad input to the CA, or host files that do not fit; the message is one line."""


class CaExists(CaError):
    """A CA (or a host's files) is already there, and replacing it was not asked for."""


@dataclass(frozen=True)
class Authority:
    """The CA's certificate and its key (PEM files)."""

    cert: Path
    key: Path

    @classmethod
    def in_dir(cls, directory: Path) -> Authority:
        """The CA kept in `directory` (`ca.pem`, `ca.key`), whether it exists or not."""
        return cls(cert=Path(directory) / CA_CERT_FILE, key=Path(directory) / CA_KEY_FILE)

    def exists(self) -> bool:
        """Whether either of its files is there."""
        return self.cert.exists() or self.key.exists()


def host_files(directory: Path) -> TlsFiles:
    """The files `issue` writes into `directory`, and `specpipe join` reads from it."""
    directory = Path(directory)
    return TlsFiles(
        cert=directory / TLS_CERT_FILE, key=directory / TLS_KEY_FILE, ca=directory / CA_CERT_FILE
    )


def parse_address(text: str) -> x509.IPAddress | x509.DNSName:
    """`text` as a certificate's subjectAltName entry: an IP address (v4 or v6), else a DNS
    name. CaError when it is neither (a URL, a port, a wildcard, `300.1.2.3`, …)."""
    value = text.strip()
    try:
        return x509.IPAddress(ipaddress.ip_address(value))
    except ValueError:
        pass
    name = value.lower().removesuffix(".")
    labels = name.split(".")
    plausible = (
        0 < len(name) <= 253
        and all(_DNS_LABEL.fullmatch(label) for label in labels)
        and not labels[-1].isdigit()  # all digits: an IPv4 address that is not one
    )
    if not plausible:
        raise CaError(f"{text!r} is neither an IP address nor a DNS name")
    return x509.DNSName(name)


def make_ca(
    directory: Path, *, name: str = CA_NAME, days: int = CA_DAYS, overwrite: bool = False
) -> Authority:
    """Make a CA in `directory` (owner-only): its key `ca.key` (mode 0600) and its
    self-signed certificate `ca.pem`, valid for `days`. CaExists when a CA is there already,
    unless `overwrite` (then every certificate the old one issued stops verifying)."""
    if days < 1:
        raise CaError(f"a CA must be valid for a day at least, not {days}")
    authority = Authority.in_dir(directory)
    if authority.exists() and not overwrite:
        raise CaExists(f"a CA is already in {Path(directory)}")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _private_dir(Path(directory))
    write_private(authority.key, key_pem(key))
    _write_public(authority.cert, cert.public_bytes(serialization.Encoding.PEM))
    return authority


def issue(
    authority: Authority,
    addresses: Sequence[str],
    out_dir: Path,
    *,
    name: str | None = None,
    days: int = HOST_DAYS,
    overwrite: bool = False,
) -> TlsFiles:
    """Issue a certificate for a host's Redis, reached at `addresses` (IP addresses or DNS
    names, all in its subjectAltName), named `name` (default: the first address): its key
    `redis.key` (mode 0600), its certificate `redis.pem` and a copy of the CA's `ca.pem`, in
    `out_dir` (owner-only). Valid for `days`, and never past the CA's own end. Everything is
    checked before anything is written: CaError for a bad address or CA, CaExists when
    `out_dir` holds such files already, unless `overwrite`."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = certify(authority, key.public_key(), addresses, name=name, days=days)
    ca_cert, _ = load_authority(authority)
    files = host_files(out_dir)
    if not overwrite and any(path.exists() for path in (files.cert, files.key, files.ca)):
        raise CaExists(f"{Path(out_dir)} already holds a host's TLS files")
    _private_dir(Path(out_dir))
    write_private(files.key, key_pem(key))
    _write_public(files.cert, cert)
    _write_public(files.ca, ca_cert.public_bytes(serialization.Encoding.PEM))
    return files


def certify(
    authority: Authority,
    public_key: ec.EllipticCurvePublicKey,
    addresses: Sequence[str],
    *,
    name: str | None = None,
    days: int = HOST_DAYS,
) -> bytes:
    """A certificate (PEM) for the Redis of a host holding the private half of `public_key`,
    reached at `addresses` (all in its subjectAltName), named `name` (default: the first
    address), valid for `days` and never past the CA's own end; CaError for a bad address, a
    bad number of days or a CA that cannot be read."""
    if not addresses:
        raise CaError("a certificate needs at least one address")
    if days < 1:
        raise CaError(f"a certificate must be valid for a day at least, not {days}")
    names = [parse_address(address) for address in addresses]
    ca_cert, ca_key = load_authority(authority)
    now = datetime.now(UTC)
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name or addresses[0].strip())])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(min(now + timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def load_authority(authority: Authority) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA's certificate and key; CaError when they are missing, unreadable or no pair."""
    cert = load_certificate(authority.cert)
    key = load_key(authority.key, "CA key")
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise CaError(f"{authority.key} is not the key of {authority.cert}")
    return cert, key


def load_key(path: Path, what: str = "key"):
    """The PEM private key at `path` (no passphrase); CaError naming it as `what` when it is
    missing or not one."""
    try:
        return serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except FileNotFoundError:
        raise CaError(f"no {what} at {path}") from None
    except (OSError, ValueError, TypeError) as exc:
        raise CaError(f"cannot read the {what} {path}: {_reason(exc)}") from None


def load_certificate(path: Path) -> x509.Certificate:
    """The PEM certificate at `path`; CaError when it is missing or not one."""
    try:
        return x509.load_pem_x509_certificate(Path(path).read_bytes())
    except FileNotFoundError:
        raise CaError(f"no certificate at {path}") from None
    except (OSError, ValueError) as exc:
        raise CaError(f"cannot read the certificate {path}: {_reason(exc)}") from None


def check_host_files(files: TlsFiles, address: str, now: datetime | None = None) -> None:
    """Nothing when `files` (a host's certificate, its key and the CA) fit together and the
    certificate, valid now, names `address` for server authentication, as a client dialling
    it there checks; CaError saying what is wrong otherwise."""
    cert = load_certificate(files.cert)
    ca_cert = load_certificate(files.ca)
    key = load_key(files.key)
    if key.public_key() != cert.public_key():
        raise CaError(f"{files.key} is not the key of {files.cert}")
    verifier = (
        PolicyBuilder()
        .store(Store([ca_cert]))
        .time(now or datetime.now(UTC))
        .build_server_verifier(parse_address(address))
    )
    try:
        verifier.verify(cert, [])
    except VerificationError as exc:
        why = _reason(exc).split(" (encountered processing", 1)[0]
        raise CaError(
            f"{files.cert} does not verify against {files.ca} for {address}: {why}"
        ) from None


def certificate_names(path: Path) -> list[str]:
    """The addresses (IPs and DNS names) the certificate at `path` names in its subjectAltName."""
    cert = load_certificate(path)
    try:
        alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(entry.value) for entry in alt]


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    """A CA signs certificates (and revocation lists); a server signs its TLS handshakes."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


def _private_dir(directory: Path) -> None:
    """`directory`, and each folder above it that is missing, made owner-only (0700)."""
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    for folder in reversed(missing):
        folder.mkdir(mode=0o700, exist_ok=True)


def _write_public(path: Path, data: bytes) -> None:
    """A certificate: anyone may read it; written whole, never half."""
    partial = path.with_name(path.name + ".new")
    partial.write_bytes(data)
    partial.chmod(0o644)
    partial.replace(path)


def _reason(exc: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(exc).split()) or type(exc).__name__
