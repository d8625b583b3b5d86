"""Reading a request's images: a PIL image, encoded bytes, a ``data:`` URL, a ``file://`` URL under the
allowed folder, or an ``http(s)`` URL of an allowed domain; every limit checked before the pixels are decoded.

Each failure is an :class:`~pagedllm.errors.InvalidParameterError` naming the request's field, so the server
answers 400 in the OpenAI shape. Decoding is CPU work: the server calls this off its event loop.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
import time
import urllib.parse
from typing import TYPE_CHECKING, Any

from pagedllm.errors import InvalidParameterError

if TYPE_CHECKING:
    from PIL import Image

    from pagedllm.config import MultiModalSection

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - pillow is a dependency of the vision extra
        raise InvalidParameterError(
            "image input needs Pillow: pip install 'pagedllm[vision]'", "multi_modal_data"
        ) from e
    return Image


def load_image(source: Any, config: MultiModalSection, field: str) -> Image.Image:
    """``source`` as an RGB PIL image, or a 400-style error naming ``field``."""
    Image = _pil()
    if isinstance(source, Image.Image):
        _check_pixels(source.width, source.height, config, field)
        return source if source.mode == "RGB" else source.convert("RGB")  # (read already: no second copy)
    if isinstance(source, (bytes, bytearray)):
        return decode_image(bytes(source), config, field)
    if isinstance(source, str):
        return decode_image(read_url(source, config, field), config, field)
    raise InvalidParameterError(
        f"{field}: an image must be a PIL image, bytes or a URL string, got {type(source).__name__}", field
    )


def read_url(url: str, config: MultiModalSection, field: str) -> bytes:
    """The encoded image a URL names (``data:``, ``file://`` or ``http(s)://``), within max_image_bytes."""
    limit = config.max_image_bytes
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise InvalidParameterError(f"{field}: a data: URL must be 'data:image/<type>;base64,<data>'", field)
        if not header[5:].startswith("image/"):
            raise InvalidParameterError(f"{field}: a data: URL must hold an image/* type, got {header[5:-7]!r}", field)
        if len(payload) > limit * 4 // 3 + 4:  # checked before decoding
            raise InvalidParameterError(f"{field}: the image is larger than {limit} bytes (max_image_bytes)", field)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidParameterError(f"{field}: the data: URL's payload is not valid base64", field) from None
    try:
        parsed = urllib.parse.urlparse(url)
        parsed.port  # noqa: B018 -- raises on a port out of range
    except ValueError as e:
        raise InvalidParameterError(f"{field}: not a valid URL ({e})", field) from None
    if parsed.scheme == "file":
        return _read_local(urllib.parse.unquote(parsed.path), config, field)
    if parsed.scheme in ("http", "https"):
        return _fetch(url, parsed, config, field)
    raise InvalidParameterError(
        f"{field}: unsupported image URL scheme {parsed.scheme or url[:16]!r}; send a data: URL "
        "(or an http(s) URL of a domain in --allowed-media-domains, a file:// URL under --allowed-local-media-path)",
        field,
    )


def _read_local(path: str, config: MultiModalSection, field: str) -> bytes:
    """A regular file under the allowed folder: the path is checked where it was opened (a symlink swapped in
    after a check cannot lead out), and at most max_image_bytes + 1 bytes are read."""
    root = config.allowed_local_media_path
    if root is None:
        raise InvalidParameterError(
            f"{field}: file:// image URLs are off; the server allows them under --allowed-local-media-path", field
        )
    limit = config.max_image_bytes
    base = os.path.realpath(root)
    outside = InvalidParameterError(f"{field}: {path!r} is outside the allowed local media path", field)
    if "\0" in path:
        raise InvalidParameterError(f"{field}: the file path holds a NUL character", field)
    if os.path.commonpath([os.path.realpath(path), base]) != base:
        raise outside  # never opened
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO does not block the open
    except OSError as e:
        raise InvalidParameterError(f"{field}: cannot read {path!r}: {e.strerror}", field) from None
    try:
        opened = os.path.realpath(f"/proc/self/fd/{fd}") if os.path.isdir("/proc/self/fd") else os.path.realpath(path)
        if os.path.commonpath([opened, base]) != base:  # a link swapped in between the check and the open
            raise outside
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidParameterError(f"{field}: {path!r} is not a regular file", field)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise InvalidParameterError(f"{field}: cannot read {path!r}: {e.strerror}", field) from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise InvalidParameterError(f"{field}: the image is larger than {limit} bytes (max_image_bytes)", field)
    return data


def _fetch(url: str, parsed: urllib.parse.ParseResult, config: MultiModalSection, field: str) -> bytes:
    host = (parsed.hostname or "").lower()
    if host not in config.domains():
        raise InvalidParameterError(
            f"{field}: the server does not fetch images from {host!r}; allowed domains: "
            f"{', '.join(sorted(config.domains())) or 'none (send a data: URL)'}",
            field,
        )
    import httpx

    limit = config.max_image_bytes
    timeout = config.media_fetch_timeout
    deadline = time.monotonic() + timeout  # for the whole fetch: each read's timeout alone lets a trickle go on
    too_large = InvalidParameterError(f"{field}: the image is larger than {limit} bytes (max_image_bytes)", field)
    try:
        # the body as sent (no decompression: a small gzip could unpack past any limit), no redirect, no
        # credentials or proxies from the environment
        with httpx.stream(
            "GET",
            url,
            timeout=timeout,
            follow_redirects=False,
            headers={"Accept-Encoding": "identity"},
            trust_env=False,
        ) as r:
            if r.status_code != 200:
                raise InvalidParameterError(f"{field}: fetching the image answered HTTP {r.status_code}", field)
            encoding = r.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                raise InvalidParameterError(f"{field}: the image was sent with Content-Encoding {encoding!r}", field)
            length = r.headers.get("content-length", "")
            if length.isdigit() and int(length) > limit:
                raise too_large
            body = bytearray()
            for chunk in r.iter_raw():
                body += chunk
                if len(body) > limit:
                    raise too_large
                if time.monotonic() > deadline:
                    raise InvalidParameterError(
                        f"{field}: fetching the image took longer than {timeout} s (media_fetch_timeout)", field
                    )
            return bytes(body)
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise InvalidParameterError(f"{field}: fetching the image failed: {type(e).__name__}", field) from None


def decode_image(data: bytes, config: MultiModalSection, field: str) -> Image.Image:
    Image = _pil()
    if len(data) > config.max_image_bytes:
        raise InvalidParameterError(
            f"{field}: the image is larger than {config.max_image_bytes} bytes (max_image_bytes)", field
        )
    try:
        image = Image.open(io.BytesIO(data), formats=list(FORMATS))  # reads the header only
    except Image.DecompressionBombError:  # far past any pixel limit: PIL refuses it itself
        raise InvalidParameterError(
            f"{field}: the image has more pixels than max_image_pixels ({config.max_image_pixels})", field
        ) from None
    except Exception:  # PIL raises UnidentifiedImageError, or others for a broken header
        raise InvalidParameterError(
            f"{field}: not an image in a supported format ({', '.join(FORMATS)})", field
        ) from None
    _check_pixels(image.width, image.height, config, field)
    try:
        image.load()
        return image.convert("RGB")
    except Exception as e:  # a truncated or corrupt body
        raise InvalidParameterError(f"{field}: the image could not be decoded ({e})", field) from None


def _check_pixels(width: int, height: int, config: MultiModalSection, field: str) -> None:
    if width * height > config.max_image_pixels:
        raise InvalidParameterError(
            f"{field}: the image has {width}x{height} = {width * height} pixels, more than max_image_pixels "
            f"({config.max_image_pixels})",
            field,
        )
    if width < 1 or height < 1:
        raise InvalidParameterError(f"{field}: the image is empty ({width}x{height})", field)


def encode_data_url(image: Image.Image, fmt: str = "PNG") -> str:
    """An image as a ``data:`` URL (for clients and tests)."""
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"
