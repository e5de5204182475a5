"""Images named by a request: data URLs, allowed http(s) domains and an allowed local folder.

A server that fetched any URL a request names could be made to reach hosts only it can see
(request forgery), so remote images come only from the domains the operator lists, checked
before any connection; local files only from under the folder the operator names.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

if TYPE_CHECKING:
    from PIL.Image import Image

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_BYTES = 20 << 20


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from: ``allowed_domains`` (http(s) hosts; none by default) and
    ``allowed_local_path`` (``file://`` URLs under it; None: none), fetched within
    ``timeout_s`` seconds and ``max_bytes`` bytes."""

    allowed_domains: frozenset[str] = frozenset()
    allowed_local_path: Path | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_bytes: int = DEFAULT_MAX_BYTES

    def load_image(self, url: str) -> Image:
        """The image ``url`` names; ``ValueError`` saying why it cannot be had."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return decode_image(_data_url_bytes(url))
        if scheme in ("http", "https"):
            return decode_image(self._fetch(url))
        if scheme == "file":
            return decode_image(self._read_local(url))
        raise ValueError(
            f"image_url: unsupported URL scheme {scheme!r} (data:, http(s): from allowed "
            "domains, file: under the allowed local path)"
        )

    def _fetch(self, url: str) -> bytes:
        host = (urlparse(url).hostname or "").lower()
        if host not in self.allowed_domains:
            raise ValueError(
                f"image_url: domain {host!r} is not allowed (the server fetches images only "
                "from --allowed-media-domains)"
            )
        import httpx

        data = bytearray()
        try:
            with httpx.stream("GET", url, timeout=self.timeout_s) as response:
                response.raise_for_status()
                for chunk in response.iter_bytes():
                    data += chunk
                    if len(data) > self.max_bytes:
                        raise ValueError(f"image_url: the image exceeds {self.max_bytes} bytes")
        except httpx.HTTPError as e:
            raise ValueError(f"image_url: fetching {url} failed: {e}") from None
        return bytes(data)

    def _read_local(self, url: str) -> bytes:
        root = self.allowed_local_path
        if root is None:
            raise ValueError("image_url: local files are not allowed (--allowed-local-media-path)")
        path = Path(unquote(urlparse(url).path)).resolve()
        if not path.is_relative_to(root.resolve()):
            raise ValueError(f"image_url: {path} is not under the allowed local media path")
        if path.stat().st_size > self.max_bytes if path.is_file() else True:
            raise ValueError(f"image_url: {path} is not a file of at most {self.max_bytes} bytes")
        return path.read_bytes()


def _data_url_bytes(url: str) -> bytes:
    header, _, payload = url.partition(",")
    if not header.startswith("data:image/") or not header.endswith(";base64"):
        raise ValueError("image_url: a data URL must be data:image/<type>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image_url: the data URL is not valid base64") from None


def decode_image(data: bytes) -> Image:
    """The decoded image (``ValueError`` if the bytes are not one, or its pixel count is past
    Pillow's decompression-bomb limit)."""
    from PIL import Image as PILImage

    try:
        image = PILImage.open(io.BytesIO(data))
        image.load()
    except PILImage.DecompressionBombError as e:
        raise ValueError(f"image_url: {e}") from None
    except Exception:
        raise ValueError("image_url: the data is not a decodable image") from None
    return image
