"""A real OTLP/HTTP receiver for the tests (`POST /v1/traces`, protobuf), on 127.0.0.1: it keeps
every span it is sent, with its service name, so a test can check that one client request is one
trace across the proxy and both vLLM servers."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[dict] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._keep(body)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()

    def _keep(self, body: bytes) -> None:
        req = ExportTraceServiceRequest.FromString(body)
        got = []
        for rs in req.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs = {}
                    for a in s.attributes:
                        v = a.value
                        attrs[a.key] = v.string_value if v.HasField("string_value") else (v.int_value if v.HasField("int_value") else str(v))
                    got.append(
                        {
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex() or None,
                            "name": s.name,
                            "service": service,
                            "start_ns": s.start_time_unix_nano,
                            "attrs": attrs,
                        }
                    )
        with self._lock:
            self.spans.extend(got)

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.spans)

    def env(self, service: str | None = None) -> dict[str, str]:
        """The variables that point an exporter here (spans sent within 200 ms)."""
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }
        if service:
            env["OTEL_SERVICE_NAME"] = service
        return env

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
