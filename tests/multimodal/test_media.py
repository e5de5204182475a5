"""MediaPolicy against a local HTTP server: allowed domains are fetched within the byte limit
and the timeout; other hosts are refused before any connection."""

from __future__ import annotations

import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from mm_models import synthetic_image

from heron.models.registry import MODEL_REGISTRY
from heron.multimodal.architectures import IMAGE_ARCHITECTURES, WHOLE_IMAGE_ARCHITECTURES
from heron.multimodal.media import MediaPolicy


def png_bytes(size: int) -> bytes:
    buffer = io.BytesIO()
    synthetic_image(size, size, 0).save(buffer, format="PNG")
    return buffer.getvalue()


SMALL, LARGE = png_bytes(8), png_bytes(64)


class Files(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/slow.png":
            time.sleep(1.0)
        body = LARGE if self.path == "/large.png" else SMALL
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        pass  # (the slow reply's client has gone: a broken pipe)


@pytest.fixture(scope="module")
def base_url():
    server = QuietServer(("127.0.0.1", 0), Files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_allowed_domain_is_fetched_within_limits(base_url):
    policy = MediaPolicy(frozenset({"127.0.0.1"}), max_bytes=len(SMALL) + 10, timeout_s=0.3)
    assert policy.load_image(f"{base_url}/small.png").size == (8, 8)
    with pytest.raises(ValueError, match="exceeds"):
        policy.load_image(f"{base_url}/large.png")
    with pytest.raises(ValueError, match="failed"):
        policy.load_image(f"{base_url}/slow.png")
    with pytest.raises(ValueError, match="domain 'localhost' is not allowed"):
        policy.load_image(base_url.replace("127.0.0.1", "localhost") + "/small.png")


def test_local_files_only_under_the_allowed_path(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.png").write_bytes(SMALL)
    (tmp_path / "b.png").write_bytes(SMALL)
    policy = MediaPolicy(allowed_local_path=tmp_path / "in")
    assert policy.load_image(f"file://{tmp_path}/in/a.png").size == (8, 8)
    with pytest.raises(ValueError, match="not under the allowed"):
        policy.load_image(f"file://{tmp_path}/in/../b.png")
    with pytest.raises(ValueError, match="local files are not allowed"):
        MediaPolicy().load_image(f"file://{tmp_path}/in/a.png")
    with pytest.raises(ValueError, match="unsupported URL scheme 'ftp'"):
        policy.load_image("ftp://example.com/a.png")


def test_the_front_knows_the_registry_s_image_models():
    """The front's list of image architectures (it imports no model code) is the registry's."""
    readers = {a for a, cls in MODEL_REGISTRY.items() if getattr(cls, "is_multimodal", False)}
    assert readers == IMAGE_ARCHITECTURES
    whole = {a for a, cls in MODEL_REGISTRY.items() if getattr(cls, "images_attend_whole", False)}
    assert whole == WHOLE_IMAGE_ARCHITECTURES
