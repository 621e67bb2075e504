"""TLS for the gRPC channels: server and channel credentials from PEM files.

Plaintext stays the one-host default. A shard given ``--tls-cert`` and
``--tls-key`` serves TLS; with ``--tls-ca`` as well it requires client
certificates signed by that CA (mutual TLS). A worker (or ``imerge health``)
given ``--tls-ca`` verifies the shards against it, and presents its own
``--tls-cert``/``--tls-key`` when it has them.
"""
from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from imerge.core.config import TlsConfig
from imerge.core.errors import ConfigError


def _read(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(config: TlsConfig) -> grpc.ServerCredentials:
    key, cert = _read(config.tls_key), _read(config.tls_cert)
    if key is None or cert is None:
        raise ConfigError("--tls-cert", "a TLS server needs --tls-key and --tls-cert")
    return grpc.ssl_server_credentials([(key, cert)],
                                       root_certificates=_read(config.tls_ca),
                                       require_client_auth=bool(config.tls_ca))


def channel_credentials(config: TlsConfig) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=_read(config.tls_ca), private_key=_read(config.tls_key),
                                        certificate_chain=_read(config.tls_cert))


def server_ssl_context(config: TlsConfig) -> ssl.SSLContext:
    """The data channel's TLS as a shard serves it: the same certificate, and client certificates required
    (signed by ``--tls-ca``) when gRPC requires them."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(config.tls_cert, config.tls_key)
    if config.tls_ca:
        context.load_verify_locations(config.tls_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl_context(config: TlsConfig) -> ssl.SSLContext:
    """The data channel's TLS as a worker speaks it: the shard verified against ``--tls-ca`` (and its host
    name, as gRPC does), the worker's own certificate presented when it has one."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=config.tls_ca or None)
    if config.tls_cert:
        context.load_cert_chain(config.tls_cert, config.tls_key)
    return context
