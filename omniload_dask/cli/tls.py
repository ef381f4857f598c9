"""The command line's TLS options: ``--tls-ca-file``, ``--tls-cert``, ``--tls-key``.

Every subcommand that connects to a scheduler takes them; without them a connection takes
Dask's configuration (``distributed.comm.tls.*``, e.g. from ``DASK_DISTRIBUTED__COMM__TLS__*``
variables), as ``distributed.Client`` does::

    omniload status --address tls://scheduler:8786 \\
        --tls-ca-file ca.pem --tls-cert trainer.pem --tls-key trainer.key --once
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from omniload_dask.errors import JobError

__all__ = ["add_tls_options", "security_of"]


def add_tls_options(parser: argparse.ArgumentParser) -> None:
    """Add the TLS options to the subcommand ``parser``."""
    g = parser.add_argument_group("TLS (default: Dask's config, distributed.comm.tls.*)")
    g.add_argument("--tls-ca-file", help="CA certificate (PEM) the scheduler's is signed by")
    g.add_argument("--tls-cert", help="this client's certificate (PEM)")
    g.add_argument("--tls-key", help="this client's private key (PEM)")


def security_of(args: argparse.Namespace) -> Any:
    """The ``distributed.Security`` the TLS options give, or None (Dask's config) without any.

    A CA without a certificate (or the reverse) is an error naming what is missing; the key
    may be left out when it is in the certificate's file.
    """
    given = {
        "--tls-ca-file": args.tls_ca_file,
        "--tls-cert": args.tls_cert,
        "--tls-key": args.tls_key,
    }
    if not any(given.values()):
        return None
    missing = [flag for flag, value in given.items() if not value and flag != "--tls-key"]
    if missing:
        raise JobError(
            f"TLS: give {' and '.join(missing)} too (and --tls-key unless the key is in the "
            "certificate's file)"
        )
    for flag, value in given.items():
        if value and not Path(value).is_file():
            raise JobError(f"{flag}: no such file {value!r}")
    from distributed import Security

    return Security(
        require_encryption=True,
        tls_ca_file=args.tls_ca_file,
        tls_client_cert=args.tls_cert,
        tls_client_key=args.tls_key,
    )
