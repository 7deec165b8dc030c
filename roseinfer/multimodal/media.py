"""Images from a request, decoded safely: data URLs and base64 always, http(s) URLs only from the
domains the operator allowed, never `file://`.

What a client sends is untrusted, so every limit is checked before the expensive step it guards:
the encoded size before decoding, the pixel count from the header before the pixels are decoded
(a small PNG can declare 100,000 x 100,000 pixels: a decompression bomb), the address a host name
resolves to before connecting (a public name can point at 127.0.0.1 or a cloud metadata address),
and each redirect's target as the first URL's. Every refusal is an `InvalidRequestError` naming
the field, so the request gets a 400 and no other request notices.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import ipaddress
import socket
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from roseinfer.errors import InvalidRequestError

MIB = 1024 * 1024


@dataclass(frozen=True)
class MediaPolicy:
    """The operator's limits on images (`roseinfer serve --allowed-media-domains ...`)."""

    # Hosts whose http(s) URLs may be fetched (exact names, or ".example.com" for its
    # subdomains); empty: no URL is ever fetched, only data URLs and base64 are read.
    allowed_media_domains: tuple[str, ...] = ()
    max_image_bytes: int = 20 * MIB  # encoded, as sent or downloaded
    max_image_pixels: int = 40_000_000  # width x height from the header, checked before decoding
    fetch_timeout: float = 10.0  # seconds for one download, connection included
    max_redirects: int = 3
    limit_per_prompt: int | None = None  # images in one request (None: the model's own limit)


@dataclass(frozen=True)
class LoadedImage:
    """A decoded RGB image and the hash of its encoded bytes (the prefix cache's key for it:
    the same bytes are the same image; different bytes never share cached blocks)."""

    image: object  # PIL.Image.Image
    digest: str = field(repr=False)

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size


def load_image(source: str | bytes, field_name: str, policy: MediaPolicy) -> LoadedImage:
    """An image from a data URL, an http(s) URL the policy allows, or raw / base64 bytes."""
    if isinstance(source, bytes):
        data = source
    elif source.startswith("data:"):
        data = _data_url_bytes(source, field_name, policy)
    elif "://" in source[:16]:
        data = _fetch(source, field_name, policy)
    else:  # Anthropic's and Ollama's bare base64
        data = _base64_bytes(source, field_name, policy)
    return decode_image(data, field_name, policy)


def decode_image(data: bytes, field_name: str, policy: MediaPolicy) -> LoadedImage:
    from PIL import Image, UnidentifiedImageError

    if len(data) > policy.max_image_bytes:
        raise _bad(field_name, f"the image is {len(data)} bytes; the limit is {policy.max_image_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))  # reads the header only
            width, height = image.size
            if width * height > policy.max_image_pixels:
                raise _bad(field_name, f"the image is {width}x{height} pixels; the limit is "
                                       f"{policy.max_image_pixels} pixels")
            image.load()
            image = image.convert("RGB")
    except InvalidRequestError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:  # Pillow's own header check
        raise _bad(field_name, f"the image is over the limit of {policy.max_image_pixels} pixels ({exc})") from exc
    except UnidentifiedImageError as exc:
        raise _bad(field_name, f"is not an image this server can read ({exc})") from exc
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt data
        raise _bad(field_name, f"could not be decoded: {exc}") from exc
    return LoadedImage(image, hashlib.sha256(data).hexdigest())


def _bad(field_name: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field_name}: {message}", field_name)


def _base64_bytes(text: str, field_name: str, policy: MediaPolicy) -> bytes:
    if len(text) > policy.max_image_bytes * 4 // 3 + 4:
        raise _bad(field_name, f"the image is over {policy.max_image_bytes} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _bad(field_name, "is neither a URL nor valid base64") from exc


def _data_url_bytes(url: str, field_name: str, policy: MediaPolicy) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise _bad(field_name, "a data URL needs a comma before its data")
    media_type = header[5:].split(";")[0].strip().lower()
    if media_type and not media_type.startswith("image/"):
        raise _bad(field_name, f"the data URL holds {media_type!r}, not an image")
    if ";base64" not in header.lower():
        raise _bad(field_name, "an image data URL must be base64 (data:image/png;base64,...)")
    return _base64_bytes(payload, field_name, policy)


def host_allowed(host: str, allowed: Sequence[str]) -> bool:
    host = host.lower().rstrip(".")
    for entry in allowed:
        entry = entry.lower().rstrip(".")
        if host == entry or (entry.startswith(".") and host.endswith(entry)):
            return True
    return False


def _check_url(url: str, field_name: str, policy: MediaPolicy) -> tuple[str, str, int]:
    """The URL's scheme, host and port if it may be fetched; raises otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise _bad(field_name, f"{parts.scheme}:// URLs are never fetched; send the image as a data URL")
    if not policy.allowed_media_domains:
        raise _bad(field_name, "this server fetches no image URLs (the operator allows none: "
                               "--allowed-media-domains); send the image as a data URL")
    host = parts.hostname or ""
    if not host_allowed(host, policy.allowed_media_domains):
        raise _bad(field_name, f"{host!r} is not among the domains this server fetches images from")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    # A listed name may resolve to a private or loopback address (or be repointed there later):
    # such an address is fetched only when the operator listed the address itself.
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except OSError as exc:
        raise _bad(field_name, f"{host!r} could not be resolved ({exc})") from exc
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        internal = ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved or ip.is_multicast
        if internal and not host_allowed(address, policy.allowed_media_domains):
            raise _bad(field_name, f"{host!r} resolves to the internal address {address}, which is fetched "
                                   "only when listed in --allowed-media-domains")
    return parts.scheme, host, port


def _fetch(url: str, field_name: str, policy: MediaPolicy) -> bytes:
    import httpx

    deadline = time.monotonic() + policy.fetch_timeout  # httpx's timeouts are per read, not in all
    for _ in range(policy.max_redirects + 1):
        _check_url(url, field_name, policy)
        try:
            with httpx.stream("GET", url, timeout=policy.fetch_timeout, follow_redirects=False) as response:
                if response.is_redirect:
                    url = str(response.next_request.url) if response.next_request else ""
                    continue
                if response.status_code != 200:
                    raise _bad(field_name, f"fetching the image answered HTTP {response.status_code}")
                declared = response.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > policy.max_image_bytes:
                    raise _bad(field_name, f"the image is {declared} bytes; the limit is {policy.max_image_bytes}")
                chunks, size = [], 0
                for chunk in response.iter_bytes():
                    if time.monotonic() > deadline:
                        raise _bad(field_name, f"fetching the image took over {policy.fetch_timeout:g} s")
                    size += len(chunk)
                    if size > policy.max_image_bytes:
                        raise _bad(field_name, f"the image is over {policy.max_image_bytes} bytes")
                    chunks.append(chunk)
                return b"".join(chunks)
        except httpx.HTTPError as exc:
            raise _bad(field_name, f"the image could not be fetched ({type(exc).__name__}: {exc})") from exc
    raise _bad(field_name, f"more than {policy.max_redirects} redirects")
