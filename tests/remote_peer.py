"""A loopback HTTP peer that replays a recorded vLLM stream, for the remote backend's tests.

It answers GET /v1/models and POST /v1/chat/completions with a chosen status and body, keeps
every request it saw (path, headers, JSON body), and can cut the connection in the middle of a
chunked stream, as a network or a dying server does. Bounded: each connection times out.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "remote"
MODEL = "moonshotai/Kimi-K3"


class ReplayPeer:
    def __init__(self, stream: str = "vllm_reasoning_content.sse", *, status: int = 200, error: str = "",
                 cut: bool = False, tls: tuple[Path, Path] | None = None, stall_after: int | None = None) -> None:
        self.body = (DATA / stream).read_bytes()
        self.status = status
        self.error = error
        self.cut = cut  # stop the chunked body without its last chunk, then close
        self.stall_after = stall_after  # lines sent before the peer goes silent (until release, 20 s at most)
        self.release = threading.Event()
        self.stalled = threading.Event()
        self.requests: list[dict[str, Any]] = []
        peer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 20

            def log_message(self, *args: Any) -> None:
                pass

            def _record(self, body: Any) -> None:
                peer.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})

            def _json(self, status: int, doc: Any) -> None:
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                self._record(None)
                if self.path != "/v1/models":
                    self._json(404, {"error": {"message": "not found", "type": "NotFoundError"}})
                    return
                self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                self._record(json.loads(self.rfile.read(length) or b"null"))
                if peer.status != 200:
                    self._json(peer.status, {"object": "error", "message": peer.error, "type": "BadRequestError",
                                             "code": peer.status, "error": {"message": peer.error}})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for n, line in enumerate(peer.body.splitlines(keepends=True)):
                    if n == peer.stall_after:
                        self.wfile.flush()
                        peer.stalled.set()
                        peer.release.wait(20)
                    try:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    except OSError:
                        return  # the client went away
                if peer.cut:
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(b"0\r\n\r\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.scheme = "http"
        if tls is not None:  # (certificate, key): HTTPS with that certificate
            import ssl
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(tls[0]), str(tls[1]))
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            self.scheme = "https"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "ReplayPeer":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 that no trust store knows, and its key (PEM files)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path
