"""The ext_proc messages Envoy sends for one request (envoy.yaml's shape): its headers, then its
buffered body, as the load tools, the microbench and the tests build them."""

from __future__ import annotations

from collections.abc import Iterable

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb


def headers_message(headers: Iterable[tuple[str, str]], end_of_stream: bool = False) -> pb.ProcessingRequest:
    """The request-headers message (values as Envoy sends them: ``raw_value`` bytes)."""
    req = pb.ProcessingRequest()
    for k, v in headers:
        req.request_headers.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    req.request_headers.end_of_stream = end_of_stream
    return req


def body_message(body: bytes) -> pb.ProcessingRequest:
    """The whole buffered body in one message (BUFFERED / BUFFERED_PARTIAL)."""
    req = pb.ProcessingRequest()
    req.request_body.body = body
    req.request_body.end_of_stream = True
    return req
