"""TLS and mutual TLS on the listener: a verified client certificate can identify a tenant;
no or untrusted certificates are refused in the handshake."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.backends.local import LocalTriton
from gateway.config import TlsConfig
from tests.conftest import LUMEN_KEY, ROOT, ThreadedGateway, gateway_config

Pem = tuple[bytes, bytes]  # (certificate, key)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pem:
    return (
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer[0].subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return builder.sign(issuer[1] if issuer else key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pem]:
    ca_key = _key()
    ca = _cert("orchid-test-ca", ca_key, None, ca=True)
    out = {"ca": _pem(ca, ca_key)}
    for name, server in (("server", True), ("orchid-client", False)):
        key = _key()
        out[name] = _pem(_cert("localhost" if server else name, key, (ca, ca_key), server=server), key)
    rogue_key = _key()
    out["rogue"] = _pem(_cert("orchid-client", rogue_key, None), rogue_key)  # same CN, untrusted issuer
    return out


@pytest.fixture(scope="module")
def mtls(
    triton: LocalTriton, pki: dict[str, Pem], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ThreadedGateway]:
    directory = tmp_path_factory.mktemp("tls")
    for name, (cert, key) in pki.items():
        (directory / f"{name}.crt").write_bytes(cert)
        (directory / f"{name}.key").write_bytes(key)
    tenants = yaml.safe_load((ROOT / "examples" / "orchid" / "tenants.yaml").read_text())
    tenants["tenants"]["orchid"]["client_cert_subjects"] = ["orchid-client"]
    (directory / "tenants.yaml").write_text(yaml.safe_dump(tenants))
    tls = TlsConfig(
        cert_file=directory / "server.crt",
        key_file=directory / "server.key",
        client_ca_file=directory / "ca.crt",
    )
    running = ThreadedGateway(
        gateway_config(triton.address, tls=tls, tenants_file=directory / "tenants.yaml")
    )
    running.start()
    try:
        yield running
    finally:
        running.stop()


def _request() -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="full-v18")
    tensor = request.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, 8])
    request.raw_input_contents.append(np.zeros(8, dtype=np.int32).tobytes())
    return request


def _call(
    address: str, pki: dict[str, Pem], client: str | None, metadata: tuple[tuple[str, str], ...] = ()
) -> str:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki["ca"][0],
        private_key=pki[client][1] if client else None,
        certificate_chain=pki[client][0] if client else None,
    )
    port = address.rsplit(":", 1)[1]
    with grpc.secure_channel(f"localhost:{port}", credentials) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        reply = stub.ModelInfer(_request(), metadata=metadata, timeout=10)
        return str(reply.model_name)


def test_client_certificate_identifies_the_tenant(mtls: ThreadedGateway, pki: dict[str, Pem]) -> None:
    assert _call(mtls.address, pki, "orchid-client") == "full-v18"  # no bearer: the cert is the identity


def test_bearer_key_still_decides_over_mtls(mtls: ThreadedGateway, pki: dict[str, Pem]) -> None:
    with pytest.raises(grpc.RpcError) as bad:
        _call(mtls.address, pki, "orchid-client", (("authorization", "Bearer wrong"),))
    assert bad.value.code() == grpc.StatusCode.UNAUTHENTICATED  # a bad key is not rescued by the cert
    assert (
        _call(mtls.address, pki, "orchid-client", (("authorization", f"Bearer {LUMEN_KEY}"),)) == "full-v18"
    )


@pytest.mark.parametrize("client", [None, "rogue"])
def test_missing_or_untrusted_certificate_is_refused(
    mtls: ThreadedGateway, pki: dict[str, Pem], client: str | None
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        _call(mtls.address, pki, client, (("authorization", f"Bearer {LUMEN_KEY}"),))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # the TLS handshake failed


def test_plain_listener_is_not_tls(gateway: ThreadedGateway, pki: dict[str, Pem]) -> None:
    with pytest.raises(grpc.RpcError):
        _call(gateway.address, pki, "orchid-client")
