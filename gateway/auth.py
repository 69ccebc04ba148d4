"""Authentication: a bearer credential in, a tenant out.

Identity comes only from the credential (``authorization: Bearer <api key>``
metadata), never from a self-declared header. Keys are compared by their
SHA-256 digest; the clear key is never stored or logged.

The header's form: exactly one ``authorization`` entry (a call carrying two or more is
refused UNAUTHENTICATED: a proxy in front may have checked a different one than the
gateway would use); the scheme ``Bearer`` in any case (``bearer``, ``BEARER``: schemes
are case-insensitive, RFC 9110 section 11.1); whitespace around the key is ignored; the
key itself is case-sensitive.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.config import TenantConfig, TenantsFile, hash_api_key
from gateway.core.entitlement import may_call
from gateway.core.errors import Unauthenticated


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    config: TenantConfig

    def may_call(self, model: str) -> bool:
        """Entitlement as ``gateway.core.entitlement`` decides it (exactly the ``models`` list)."""
        return may_call(self.config.models, model)


class TenantDirectory:
    def __init__(self, tenants: TenantsFile) -> None:
        self.settings = tenants
        self._by_digest = {
            digest: Tenant(name, config)
            for name, config in tenants.tenants.items()
            for digest in config.key_sha256
        }
        self.tenants = {name: Tenant(name, config) for name, config in tenants.tenants.items()}
        self._by_subject = {
            subject: Tenant(name, config)
            for name, config in tenants.tenants.items()
            for subject in config.client_cert_subjects
        }

    def authenticate(
        self, metadata: Iterable[tuple[str, str | bytes]], *, peer_subjects: Iterable[str] = ()
    ) -> Tenant:
        """A bearer key, or else a verified client certificate's common name (mTLS).

        ``peer_subjects`` come from the TLS handshake (the certificate chain was verified
        against the configured client CA), never from request metadata."""
        headers = [
            value.decode("latin-1") if isinstance(value, bytes) else value
            for key, value in metadata
            if key == "authorization"
        ]
        if len(headers) > 1:
            raise Unauthenticated("more than one 'authorization' header: send exactly one")
        header = headers[0] if headers else None
        if header is None:
            for subject in peer_subjects:
                tenant = self._by_subject.get(subject)
                if tenant is not None:
                    return tenant
            raise Unauthenticated("missing credential: send metadata 'authorization: Bearer <api key>'")
        scheme, _, credential = header.partition(" ")
        if scheme.lower() != "bearer" or not credential.strip():
            raise Unauthenticated("malformed credential: expected 'authorization: Bearer <api key>'")
        digest = hash_api_key(credential.strip())
        # Constant-time comparison against every digest: lookups must not time differently per tenant.
        found: Tenant | None = None
        for known, tenant in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                found = tenant
        if found is None:
            raise Unauthenticated("unknown credential")
        return found
