"""Real HTTP servers for the streaming tests: ``RangeServer``, a file server that honours byte ranges, and
``FaultProxy``, a proxy in front of it (or of an S3 server) that injects faults.

Real servers on 127.0.0.1, not mocks of ``http.client``: what streaming has to get right happens on the wire
(keep-alive reuse, ranged reads, resuming after a reset, giving up on a stalled body, a redirect to another
host), and only a socket shows it. Both are context managers that leave no thread or socket behind.
"""

from tests.fault_proxy import FaultProxy
from tests.range_server import RangeServer, RequestRecord, byte_range, strong_etag

__all__ = ["FaultProxy", "RangeServer", "RequestRecord", "byte_range", "strong_etag"]
