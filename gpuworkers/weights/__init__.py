"""Model weights from object storage: an ``s3://bucket/prefix/`` source resolved to a host-local directory.

The flow, one module each: `listing` reads the prefix and names its content by a digest; `store` is
the host's on-disk cache of such contents (locks, atomic entries, least-recently-used eviction);
`download` fetches one listing into a directory and checks it; `holds` keeps an entry on disk while
a process has its model loaded; `resolve` ties them together for `gpuworkers.sources`.

This package is imported by every slot process; boto3 is imported only when a client is made.
"""

from __future__ import annotations


class WeightsUnavailableError(Exception):
    """The store could not be read now (connection lost, throttled, a checksum off): a retry may succeed."""
