"""Envoy's gRPC access log as the end of a request: releases picks made over ext_authz.

pick-fast.yaml logs every finished request to the router's gRPC port (``envoy.access_loggers.http_grpc``,
``buffer_size_bytes: 0``: each entry sent at once). Each entry's ``request_id`` (x-request-id) ends
the pick the HTTP check made for it (extproc.pick.request_ends). Only translation here: the
stream's open and close and each entry's id.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.accesslog.v3 import als_pb2 as pb
from envoy.service.accesslog.v3 import als_pb2_grpc as pb_grpc

from extproc import metrics
from extproc.pick.request_ends import RequestEnds

log = logging.getLogger("extproc.adapters.access_log")


class AccessLogEnds(pb_grpc.AccessLogServiceServicer):  # type: ignore[misc]  # xds-protos ship no types
    """StreamAccessLogs: every HTTP entry's request id ends its held pick, if any."""

    def __init__(self, ends: RequestEnds) -> None:
        self.ends = ends

    async def StreamAccessLogs(self, request_iterator: AsyncIterator[pb.StreamAccessLogsMessage],
                               context: grpc.aio.ServicerContext[pb.StreamAccessLogsMessage,
                                                                 pb.StreamAccessLogsResponse],
                               ) -> pb.StreamAccessLogsResponse:
        self.ends.opened()
        try:
            async for message in request_iterator:
                for entry in message.http_logs.log_entry:
                    self.ends.ended(entry.request.request_id)
        except Exception:  # a broken stream must not leave picks counted: closed() below releases them
            log.exception("reading Envoy's access log stream failed")
            metrics.ERRORS.labels("access_log").inc()
        finally:
            self.ends.closed()
        return pb.StreamAccessLogsResponse()


def add_to_server(ends: RequestEnds, server: grpc.aio.Server) -> None:
    pb_grpc.add_AccessLogServiceServicer_to_server(AccessLogEnds(ends), server)
