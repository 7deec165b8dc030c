"""roseinfer.multimodal.media: images decoded under the operator's limits; each bad input is a 400
naming the field, and nothing is fetched that the operator did not allow."""

from __future__ import annotations

import base64
import http.server
import io
import threading

import pytest
from PIL import Image

from roseinfer.errors import InvalidRequestError
from roseinfer.multimodal.media import MediaPolicy, load_image

FIELD = "messages[0].content[1].image_url"


def png_bytes(width: int = 8, height: int = 6, color=(200, 30, 60)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def test_a_data_url_and_bare_base64_decode_to_the_same_rgb_pixels():
    data = png_bytes()
    from_url = load_image(data_url(data), FIELD, MediaPolicy())
    from_base64 = load_image(base64.b64encode(data).decode(), FIELD, MediaPolicy())
    assert from_url.size == (8, 6) and from_url.image.mode == "RGB"
    assert from_url.image.getpixel((3, 2)) == (200, 30, 60)
    assert from_url.digest == from_base64.digest
    assert load_image(data_url(png_bytes(color=(1, 2, 3))), FIELD, MediaPolicy()).digest != from_url.digest


@pytest.mark.parametrize("source, message", [
    ("data:image/png;base64,@@@", "neither a URL nor valid base64"),
    (data_url(b"this is not an image"), "not an image this server can read"),
    (data_url(png_bytes(64, 64)[:60]), "could not be decoded"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("data:image/png,rawbytes", "must be base64"),
    ("file:///etc/passwd", "file:// URLs are never fetched"),
    ("ftp://example.com/a.png", "never fetched"),
    ("https://example.com/a.png", "fetches no image URLs"),
])
def test_bad_images_are_refused_naming_the_field(source, message):
    with pytest.raises(InvalidRequestError, match=message) as caught:
        load_image(source, FIELD, MediaPolicy())
    assert caught.value.param == FIELD


def test_a_decompression_bomb_is_refused_from_its_header_before_decoding():
    # 20,000 x 20,000 one-colour pixels compress to a few hundred kB: the header is what is checked.
    buffer = io.BytesIO()
    Image.new("1", (20_000, 20_000)).save(buffer, format="PNG")
    bomb = buffer.getvalue()
    assert len(bomb) < 2_000_000
    with pytest.raises(InvalidRequestError, match="over the limit of 40000000 pixels"):
        load_image(data_url(bomb), FIELD, MediaPolicy())
    with pytest.raises(InvalidRequestError, match="the image is 8x6 pixels; the limit is 40"):
        load_image(png_bytes(), FIELD, MediaPolicy(max_image_pixels=40))
    with pytest.raises(InvalidRequestError, match="the limit is 20"):
        load_image(png_bytes(), FIELD, MediaPolicy(max_image_bytes=20))


@pytest.fixture(scope="module")
def image_server():
    """A loopback HTTP server: /a.png an image, /hop a redirect to it, /big more than 1 kB."""
    image = png_bytes(5, 5, (9, 9, 9))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/hop":
                self.send_response(302)
                self.send_header("Location", "/a.png")
                self.end_headers()
                return
            body = image if self.path == "/a.png" else b"x" * 4096
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_urls_are_fetched_only_from_allowed_hosts_and_never_from_unlisted_internal_addresses(image_server):
    listed = MediaPolicy(allowed_media_domains=("127.0.0.1",))
    assert load_image(f"{image_server}/a.png", FIELD, listed).image.getpixel((0, 0)) == (9, 9, 9)
    assert load_image(f"{image_server}/hop", FIELD, listed).size == (5, 5)
    with pytest.raises(InvalidRequestError, match="not among the domains"):
        load_image(f"{image_server}/a.png", FIELD, MediaPolicy(allowed_media_domains=("example.com",)))
    # "localhost" resolves to loopback: listing the name is not enough, the address must be listed.
    port = image_server.rsplit(":", 1)[1]
    with pytest.raises(InvalidRequestError, match="internal address"):
        load_image(f"http://localhost:{port}/a.png", FIELD, MediaPolicy(allowed_media_domains=("localhost",)))
    with pytest.raises(InvalidRequestError, match="over 1024 bytes|the limit is 1024"):
        load_image(f"{image_server}/big", FIELD, MediaPolicy(allowed_media_domains=("127.0.0.1",),
                                                             max_image_bytes=1024))
