"""The test cluster's certificates: a CA, the apiserver's serving cert, an admin client cert, an SA signing key."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

PrivateKey = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey

SERVICE_DNS_NAMES = (
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attrs)


def _write_key(path: Path, key: PrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _builder(subject: x509.Name, issuer: x509.Name, key: PrivateKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        # Back-dated an hour so a clock a little behind does not reject a cert made a second ago.
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=365))
    )


def _leaf(
    ca_key: PrivateKey, ca_name: x509.Name, subject: x509.Name, usage: x509.ObjectIdentifier,
    sans: list[x509.GeneralName] | None = None,
) -> tuple[x509.Certificate, PrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        _builder(subject, ca_name, key)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=False, crl_sign=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def make_pki(directory: Path, server_ips: Sequence[str]) -> Pki:
    """Writes every file the control plane needs into directory; server_ips go into the serving cert."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(*(directory / n for n in (
        "ca.crt", "ca.key", "apiserver.crt", "apiserver.key", "admin.crt", "admin.key", "sa.key", "sa.pub",
    )))
    # RSA for the CA: kube-controller-manager signs CSRs with it and every client accepts it.
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = _name("tandem-test-ca")
    ca = (
        _builder(ca_name, ca_name, ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pki.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    _write_key(pki.ca_key, ca_key)

    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in ("localhost", *SERVICE_DNS_NAMES)]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in dict.fromkeys(["127.0.0.1", *server_ips])]
    serving, serving_key = _leaf(ca_key, ca_name, _name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH, sans)
    pki.serving_cert.write_bytes(serving.public_bytes(serialization.Encoding.PEM))
    _write_key(pki.serving_key, serving_key)

    # O=system:masters: the group RBAC binds to cluster-admin and the Node authorizer lets through.
    admin, admin_key = _leaf(
        ca_key, ca_name, _name("tandem-admin", "system:masters"), ExtendedKeyUsageOID.CLIENT_AUTH
    )
    pki.admin_cert.write_bytes(admin.public_bytes(serialization.Encoding.PEM))
    _write_key(pki.admin_key, admin_key)

    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(pki.sa_key, sa_key)
    pki.sa_pub.write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return pki


def issue_client_cert(pki: Pki, stem: Path, common_name: str, organization: str) -> tuple[Path, Path]:
    """A client certificate signed by the cluster's CA, as `stem`.crt and `stem`.key: a kubelet's identity
    (CN=system:node:NAME, O=system:nodes) for the Node authorizer."""
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, rsa.RSAPrivateKey)
    ca_name = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes()).subject
    cert, key = _leaf(ca_key, ca_name, _name(common_name, organization), ExtendedKeyUsageOID.CLIENT_AUTH)
    crt, pem = stem.with_suffix(".crt"), stem.with_suffix(".key")
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(pem, key)
    return crt, pem
