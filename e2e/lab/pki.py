"""Certificates for one lab: a cluster CA, the apiserver's serving cert, client certs for each
component, the service-account signing key, and the training operator's webhook cert.

ECDSA P-256 keys keep generation fast (milliseconds, not the seconds RSA takes on a busy
2-core machine). Everything is written as PEM files under the lab's pki/ directory.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=30)
# The training operator's cert rotator replaces any webhook cert that expires within its
# look-ahead window (90 days), so the webhook CA and cert get a long life.
WEBHOOK_VALIDITY = dt.timedelta(days=3650)


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path

    def cert_pem(self) -> bytes:
        return self.cert.read_bytes()

    def key_pem(self) -> bytes:
        return self.key.read_bytes()


@dataclass(frozen=True)
class ClientIdentity:
    """A client certificate identity: the apiserver maps CN to the user, O to groups."""

    file_stem: str
    common_name: str
    organizations: tuple[str, ...] = ()


ADMIN = ClientIdentity("admin", "lab-admin", ("system:masters",))
SCHEDULER = ClientIdentity("scheduler", "system:kube-scheduler")
# The controller-manager runs all its controllers under its own identity
# (--use-service-account-credentials=false), so it needs more than the bootstrap role gives.
CONTROLLER_MANAGER = ClientIdentity("controller-manager", "system:kube-controller-manager", ("system:masters",))
# kwok plays every kubelet and the training operator is a cluster-wide controller; both run
# with full rights here because RBAC for them is not what the lab tests (the operator's own
# RBAC is, through impersonation).
KWOK = ClientIdentity("kwok", "lab-kwok", ("system:masters",))
TRAINING_OPERATOR = ClientIdentity("training-operator", "lab-training-operator", ("system:masters",))
FAKE_GPU = ClientIdentity("fake-gpu", "lab-fake-gpu", ("system:masters",))
# The optional components (`up --with trainer-v2,kueue`): cluster-wide controllers like the training operator.
JOBSET = ClientIdentity("jobset", "lab-jobset", ("system:masters",))
TRAINER = ClientIdentity("trainer", "lab-trainer", ("system:masters",))
KUEUE = ClientIdentity("kueue", "lab-kueue", ("system:masters",))

CLIENTS = (ADMIN, SCHEDULER, CONTROLLER_MANAGER, KWOK, TRAINING_OPERATOR, FAKE_GPU, JOBSET, TRAINER, KUEUE)

# The training operator's cert rotator checks the CA against this name (its CAName) and the
# serving cert against "<webhook-service-name>.<namespace>.svc".
WEBHOOK_CA_NAME = "training-operator-ca"
WEBHOOK_DNS_NAME = "training-operator.kubeflow.svc"


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write(pair: KeyPair, cert: x509.Certificate, key) -> KeyPair:
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    # RSA keys go out as PKCS#1 ("RSA PRIVATE KEY"): the webhook cert rotator only parses that.
    fmt = (serialization.PrivateFormat.TraditionalOpenSSL if isinstance(key, rsa.RSAPrivateKey)
           else serialization.PrivateFormat.PKCS8)
    pair.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption()))
    pair.key.chmod(0o600)
    return pair


def _name(cn: str, orgs: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    attrs += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    return x509.Name(attrs)


def make_ca(
    directory: Path, stem: str, common_name: str, dns_names: tuple[str, ...] = (), rsa_key: bool = False,
    validity: dt.timedelta = VALIDITY,
) -> KeyPair:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048) if rsa_key else _new_key()
    now = dt.datetime.now(dt.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if dns_names:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]), critical=False
        )
    cert = builder.sign(key, hashes.SHA256())
    return _write(KeyPair(directory / f"{stem}.crt", directory / f"{stem}.key"), cert, key)


def _load(pair: KeyPair) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate(pair.cert_pem())
    key = serialization.load_pem_private_key(pair.key_pem(), password=None)
    return cert, key


def make_leaf(
    directory: Path,
    ca: KeyPair,
    stem: str,
    common_name: str,
    organizations: tuple[str, ...] = (),
    dns_names: tuple[str, ...] = (),
    ip_addresses: tuple[str, ...] = (),
    server: bool = False,
    client: bool = False,
    validity: dt.timedelta = VALIDITY,
) -> KeyPair:
    ca_cert, ca_key = _load(ca)
    key = _new_key()
    now = dt.datetime.now(dt.timezone.utc)
    usages = []
    if server:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    if client:
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, organizations))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_encipherment=False, content_commitment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False
        )
    )
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return _write(KeyPair(directory / f"{stem}.crt", directory / f"{stem}.key"), cert, key)


@dataclass(frozen=True)
class LabPKI:
    ca: KeyPair
    apiserver: KeyPair
    clients: dict[str, KeyPair]
    service_account: KeyPair  # cert field holds the public key PEM
    webhook_ca: KeyPair
    webhook_server: KeyPair


def make_lab_pki(directory: Path, service_ip: str, extra_ips: tuple[str, ...] = ()) -> LabPKI:
    """`extra_ips`: more addresses the apiserver is reached at (a real node's gateway)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = make_ca(directory, "ca", "finetune-lab-ca")
    apiserver = make_leaf(
        directory, ca, "apiserver", "kube-apiserver",
        dns_names=("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                   "kubernetes.default.svc.cluster.local"),
        ip_addresses=("127.0.0.1", service_ip, *extra_ips),
        server=True,
    )
    clients = {
        ident.file_stem: make_leaf(directory, ca, ident.file_stem, ident.common_name, ident.organizations, client=True)
        for ident in CLIENTS
    }
    sa_key = _new_key()
    sa = KeyPair(directory / "sa.pub", directory / "sa.key")
    sa.key.write_bytes(
        sa_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    sa.key.chmod(0o600)
    sa.cert.write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    # The training operator's webhook: its own CA (the rotator insists the CA is valid for the
    # DNS name WEBHOOK_CA_NAME), and a serving cert for both the in-cluster service name (what
    # the rotator checks) and 127.0.0.1 (where the lab's apiserver actually calls it).
    webhook_ca = make_ca(
        directory, "webhook-ca", WEBHOOK_CA_NAME, dns_names=(WEBHOOK_CA_NAME,), rsa_key=True,
        validity=WEBHOOK_VALIDITY,
    )
    webhook_server = make_leaf(
        directory, webhook_ca, "webhook", WEBHOOK_DNS_NAME,
        dns_names=(WEBHOOK_DNS_NAME,), ip_addresses=("127.0.0.1",), server=True,
        validity=WEBHOOK_VALIDITY,
    )
    return LabPKI(ca, apiserver, clients, sa, webhook_ca, webhook_server)
