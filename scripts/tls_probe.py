"""What TLS costs the data channel per GB on this machine: the raw-socket probe of ``imerge bench datapath``,
plaintext and over TLS (Python's ``ssl``, as the data channel uses it), 1 MiB and 4 MiB frames.

Needs the test extras (``trustme`` makes the certificates): ``python scripts/tls_probe.py``.
"""
from __future__ import annotations

import ssl

import trustme

from imerge.bench.socket_probe import MIB, probe


def main() -> None:
    authority = trustme.CA()
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    authority.issue_cert("localhost").configure_cert(server)
    client = ssl.create_default_context()
    authority.configure_trust(client)
    print("| channel | frame | receive CPU s/GB | send CPU s/GB | GB/s |")
    print("|---|---|---|---|---|")
    for name, tls in (("plaintext", None), ("TLS", (server, client))):
        for size in (1 * MIB, 4 * MIB):
            result = probe(size, tls=tls)
            print(f"| {name} | {size // MIB} MiB | {result.receive_cpu_s_per_gb:.2f} | "
                  f"{result.send_cpu_s_per_gb:.2f} | {result.gb_per_s:.2f} |")


if __name__ == "__main__":
    main()
