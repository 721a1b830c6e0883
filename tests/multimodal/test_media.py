"""loom/multimodal/media.py: an image reference becomes an RGB image only where the
server's MediaPolicy allows it, and every refusal is a MediaError that says why.

Remote fetches run against a local http.server through a fake network: the resolver
answers what each test chooses, and a connection to the fake public address PUBLIC goes
to the local server. Both record what they were asked, so a test sees which hosts were
looked up and which addresses were connected to (never one that failed the check).
"""

from __future__ import annotations

import base64
import http.server
import io
import json
import os
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
import zlib
from urllib.parse import parse_qs, urlsplit

import pytest
from PIL import Image, ImageFile

from loom.multimodal import media
from loom.multimodal.media import MediaError, MediaPolicy, image_hash, load_image, load_video

PUBLIC = "93.184.215.14"  # a global address; never reached, the fake network reroutes it
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def encoded(image: Image.Image, format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def gradient(width: int = 8, height: int = 6) -> Image.Image:
    image = Image.new("RGB", (width, height))
    image.putdata([(17 * x % 256, 41 * y % 256, (x * y) % 256)
                   for y in range(height) for x in range(width)])
    return image


CAT = gradient()
CAT_PNG = encoded(CAT)


def pixels(image: Image.Image) -> bytes:
    return image.tobytes()


# --- data URLs ---------------------------------------------------------------------

def test_data_url_png_is_exact_and_jpeg_is_close():
    image = load_image(data_url(CAT_PNG), MediaPolicy())
    assert image.mode == "RGB" and image.size == CAT.size and pixels(image) == pixels(CAT)
    flat = Image.new("RGB", (16, 16), (200, 30, 40))
    jpeg = load_image(data_url(encoded(flat, "JPEG"), "image/jpeg"), MediaPolicy())
    assert jpeg.mode == "RGB" and jpeg.size == (16, 16)
    assert all(abs(a - b) <= 4 for a, b in zip(jpeg.getpixel((8, 8)), (200, 30, 40)))


def test_transparent_pixels_are_laid_on_white():
    image = Image.new("RGBA", (2, 1), (0, 0, 0, 0))
    image.putpixel((1, 0), (10, 20, 30, 255))
    loaded = load_image(data_url(encoded(image)), MediaPolicy())
    assert [loaded.getpixel((x, 0)) for x in range(2)] == [(255, 255, 255), (10, 20, 30)]


def test_data_url_base64_with_line_breaks_and_no_padding():
    payload = base64.b64encode(CAT_PNG).decode().rstrip("=")
    wrapped = "\n".join(payload[i:i + 76] for i in range(0, len(payload), 76))
    image = load_image(f"data:image/png;base64,{wrapped}", MediaPolicy())
    assert pixels(image) == pixels(CAT)


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,!!!not base64!!!", "base64 is corrupt"),
    ("data:image/png;base64,A", "base64 is corrupt"),
    (data_url(b"plain text, not a picture"), "not an image in a format loom reads"),
    (data_url(CAT_PNG[:60]), "cannot be decoded"),  # a PNG cut short
    (data_url(CAT_PNG, "text/plain"), "is not an image"),
    ("data:image/png," + CAT_PNG.hex(), "must be base64"),
    ("ftp://example.com/cat.png", "ftp: URLs are not supported"),
])
def test_bad_data_urls_are_media_errors(url, message):
    with pytest.raises(MediaError, match=message):
        load_image(url, MediaPolicy())


def test_eps_is_not_opened():
    """PIL would hand EPS to Ghostscript; loom reads only the common web formats."""
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 1 1\nshowpage\n"
    with pytest.raises(MediaError, match="not an image in a format loom reads"):
        load_image(data_url(eps, "image/eps"), MediaPolicy())


def test_data_url_over_the_byte_cap():
    policy = MediaPolicy(max_bytes=len(CAT_PNG))
    assert pixels(load_image(data_url(CAT_PNG), policy)) == pixels(CAT)
    policy = MediaPolicy(max_bytes=len(CAT_PNG) - 1)
    with pytest.raises(MediaError, match=f"larger than this server's limit of "
                                         f"{len(CAT_PNG) - 1:,} bytes"):
        load_image(data_url(CAT_PNG), policy)


# --- decompression bombs -----------------------------------------------------------

def claimed_size_png(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header (IHDR) claims ``width`` x ``height``: a few bytes that
    would decode to width * height pixels."""
    png = bytearray(encoded(Image.new("RGB", (1, 1))))
    assert png[12:16] == b"IHDR"
    png[16:24] = struct.pack(">II", width, height)
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))
    return bytes(png)


def test_bomb_is_refused_from_its_header_before_decoding(monkeypatch):
    loads = []
    original_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load",
                        lambda self: loads.append(self.size) or original_load(self))
    bomb = claimed_size_png(8000, 8000)  # 64 Mpx: over 50 Mpx, under PIL's own limit
    assert len(bomb) < 100
    with pytest.raises(MediaError, match="8000x8000 = 64,000,000 pixels, over this "
                                         "server's limit of 50,000,000"):
        load_image(data_url(bomb), MediaPolicy())
    assert loads == []
    load_image(data_url(CAT_PNG), MediaPolicy())
    assert loads == [CAT.size]  # the patch sees a decode when there is one


@pytest.mark.parametrize("max_pixels", [50_000_000, 10**12])
def test_pil_bomb_guard_ends_in_a_media_error(max_pixels):
    """Past twice Image.MAX_IMAGE_PIXELS PIL refuses in Image.open; that too is a
    MediaError, whatever max_pixels allows."""
    with pytest.raises(MediaError, match="too large|over this server's limit"):
        load_image(data_url(claimed_size_png(100_000, 100_000)),
                   MediaPolicy(max_pixels=max_pixels))


# --- local files -------------------------------------------------------------------

@pytest.fixture
def media_dirs(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    (allowed / "sub" / "cat.png").write_bytes(CAT_PNG)
    (outside / "secret.png").write_bytes(CAT_PNG)
    return allowed, outside


def test_local_paths_under_the_allowed_directory(media_dirs):
    allowed, _ = media_dirs
    policy = MediaPolicy(allowed_local_path=str(allowed))
    for url in [str(allowed / "sub" / "cat.png"), f"file://{allowed}/sub/cat.png",
                f"file://localhost{allowed}/sub/cat.png", "sub/cat.png",
                str(allowed / "sub" / ".." / "sub" / "cat.png")]:
        assert pixels(load_image(url, policy)) == pixels(CAT), url
    (allowed / "inner-link.png").symlink_to(allowed / "sub" / "cat.png")
    assert pixels(load_image(str(allowed / "inner-link.png"), policy)) == pixels(CAT)


def test_local_paths_escaping_the_allowed_directory(media_dirs):
    allowed, outside = media_dirs
    (allowed / "escape.png").symlink_to(outside / "secret.png")
    (allowed / "escape-dir").symlink_to(outside)
    policy = MediaPolicy(allowed_local_path=str(allowed))
    for url in [str(outside / "secret.png"), f"file://{outside}/secret.png",
                "../outside/secret.png", f"{allowed}/sub/../../outside/secret.png",
                str(allowed / "escape.png"), str(allowed / "escape-dir" / "secret.png"),
                f"file://{allowed}/escape.png", "/etc/passwd"]:
        with pytest.raises(MediaError, match="outside the allowed local media directory"):
            load_image(url, policy)


def test_local_files_off_and_other_refusals(media_dirs):
    allowed, _ = media_dirs
    with pytest.raises(MediaError, match="local files are off on this server; start it "
                                         "with --allowed-local-media-path"):
        load_image(str(allowed / "sub" / "cat.png"), MediaPolicy())
    policy = MediaPolicy(allowed_local_path=str(allowed))
    with pytest.raises(MediaError, match="no file"):
        load_image(str(allowed / "missing.png"), policy)
    with pytest.raises(MediaError, match="is not a file"):
        load_image(str(allowed / "sub"), policy)
    with pytest.raises(MediaError, match="names a host"):
        load_image(f"file://otherhost{allowed}/sub/cat.png", policy)
    with pytest.raises(MediaError, match="larger than this server's limit"):
        load_image("sub/cat.png", MediaPolicy(allowed_local_path=str(allowed), max_bytes=10))


# --- remote ------------------------------------------------------------------------

class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.server.requests.append((self.path, self.headers["Host"]))
        url = urlsplit(self.path)
        try:
            if url.path == "/cat.png":
                self._answer(200, CAT_PNG)
            elif url.path == "/redirect":
                self._answer(302, b"", location=parse_qs(url.query)["to"][0])
            elif url.path == "/loop":
                self._answer(302, b"", location="/loop")
            elif url.path == "/big":
                self._answer(200, b"\0" * 100_000)
            elif url.path == "/big-undeclared":  # HTTP/1.0: the body ends at close
                self._answer(200, b"\0" * 100_000, declare_length=False)
            elif url.path == "/slow":
                time.sleep(2)
                self._answer(200, CAT_PNG)
            elif url.path == "/drip":  # each byte in time for a per-read timeout
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                for _ in range(1000):
                    self.wfile.write(b"\0")
                    self.wfile.flush()
                    time.sleep(0.05)
            else:
                self._answer(404, b"")
        except OSError:  # the client hung up
            pass

    def _answer(self, status, body, location=None, declare_length=True):
        self.send_response(status)
        if location is not None:
            self.send_header("Location", location)
        if declare_length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


class FakeNetwork:
    """Name lookups answered from ``names``; a connection to PUBLIC reaches the local
    server, to anything else is refused. Records what was looked up and connected to."""

    def __init__(self, server, names: dict[str, list[str]]):
        self.server_port, self.names = server.server_address[1], names
        self.resolved: list[str] = []
        self.connected: list[str] = []
        server.requests.clear()

    def resolve(self, host: str, port: int) -> list[str]:
        self.resolved.append(host)
        if host not in self.names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return self.names[host]

    def connect(self, address: str, port: int, timeout: float) -> socket.socket:
        self.connected.append(address)
        if address != PUBLIC:
            raise ConnectionRefusedError(f"the fake network reaches only {PUBLIC}")
        return socket.create_connection(("127.0.0.1", self.server_port), timeout=timeout)

    def load(self, url: str, policy: MediaPolicy) -> Image.Image:
        return load_image(url, policy, resolve=self.resolve, connect=self.connect)


ALLOW_EXAMPLE = MediaPolicy(allowed_domains=("example.com",))


def test_remote_images_are_off_without_allowed_domains(server):
    network = FakeNetwork(server, {"images.example.com": [PUBLIC]})
    with pytest.raises(MediaError, match="remote images are off on this server; start it "
                                         "with --allowed-media-domains images.example.com"):
        network.load("https://images.example.com/cat.png", MediaPolicy())
    assert network.resolved == [] and network.connected == []


@pytest.mark.parametrize("url", ["http://evil.com/cat.png", "http://notexample.com/cat.png",
                                 "http://example.com.evil.com/cat.png",
                                 f"http://{PUBLIC}/cat.png"])
def test_hosts_outside_the_allowed_domains_are_refused(server, url):
    network = FakeNetwork(server, {"evil.com": [PUBLIC], "notexample.com": [PUBLIC],
                                   "example.com.evil.com": [PUBLIC]})
    with pytest.raises(MediaError, match="is not an allowed media domain"):
        network.load(url, ALLOW_EXAMPLE)
    assert network.resolved == [] and network.connected == []


def test_allowed_domain_and_its_subdomains_are_fetched(server):
    port = server.server_address[1]
    network = FakeNetwork(server, {"example.com": [PUBLIC], "cdn.Example.com": [PUBLIC],
                                   "cdn.example.com": [PUBLIC]})
    for host in ["example.com", "cdn.Example.com"]:
        image = network.load(f"http://{host}:{port}/cat.png", ALLOW_EXAMPLE)
        assert image.mode == "RGB" and pixels(image) == pixels(CAT)
    assert network.connected == [PUBLIC, PUBLIC]
    # the server is spoken to as the host, though reached at the checked address
    assert server.requests == [("/cat.png", f"example.com:{port}"),
                               ("/cat.png", f"cdn.example.com:{port}")]


@pytest.mark.parametrize("addresses, kind", [
    (["127.0.0.1"], "loopback"), (["::1"], "loopback"), (["::ffff:127.0.0.1"], "loopback"),
    (["10.0.0.5"], "private"), (["192.168.1.1"], "private"), (["fc00::1"], "private"),
    (["169.254.169.254"], "link-local"), (["fe80::1"], "link-local"),
    (["0.0.0.0"], "unspecified"), (["224.0.0.1"], "multicast"),
    (["100.64.0.1"], "non-global"), (["2002:7f00:1::"], "loopback"),  # 6to4 of 127.0.0.1
    ([PUBLIC, "10.0.0.5"], "private"),  # one internal answer among public ones is enough
])
def test_non_public_addresses_are_refused(server, addresses, kind):
    network = FakeNetwork(server, {"cdn.example.com": addresses})
    with pytest.raises(MediaError, match=f"resolves to .*, a {kind} address; loom fetches "
                                         "images from public addresses only"):
        network.load("http://cdn.example.com/cat.png", ALLOW_EXAMPLE)
    assert network.connected == []


def test_localhost_is_refused_through_the_system_resolver(server):
    """A real server listens there; the check refuses it, not a failed connection."""
    server.requests.clear()
    with pytest.raises(MediaError, match="localhost resolves to .*, a loopback address"):
        load_image(f"http://localhost:{server.server_address[1]}/cat.png",
                   MediaPolicy(allowed_domains=("localhost",)))
    assert server.requests == []


def test_a_redirect_to_an_internal_address_is_refused(server):
    """The first hop is public and allowed; its redirect names an allowed host that
    resolves to the loopback (where the very server listens): refused before any
    connection there."""
    network = FakeNetwork(server, {"cdn.example.com": [PUBLIC],
                                   "internal.example.com": ["127.0.0.1"]})
    target = f"http://internal.example.com:{server.server_address[1]}/cat.png"
    with pytest.raises(MediaError, match="internal.example.com resolves to 127.0.0.1, a "
                                         "loopback address"):
        network.load(f"http://cdn.example.com/redirect?to={target}", ALLOW_EXAMPLE)
    assert network.resolved == ["cdn.example.com", "internal.example.com"]
    assert network.connected == [PUBLIC]
    assert [path for path, _ in server.requests] == [f"/redirect?to={target}"]


def test_redirects_are_followed_and_checked_each_hop(server):
    network = FakeNetwork(server, {"cdn.example.com": [PUBLIC], "img.example.com": [PUBLIC]})
    image = network.load("http://cdn.example.com/redirect?to=http://img.example.com/cat.png",
                         ALLOW_EXAMPLE)
    assert pixels(image) == pixels(CAT)
    assert network.resolved == ["cdn.example.com", "img.example.com"]
    image = network.load("http://cdn.example.com/redirect?to=/cat.png", ALLOW_EXAMPLE)
    assert pixels(image) == pixels(CAT)
    with pytest.raises(MediaError, match="evil.com is not an allowed media domain"):
        network.load("http://cdn.example.com/redirect?to=http://evil.com/cat.png",
                     ALLOW_EXAMPLE)


def test_a_redirect_to_a_file_is_refused(server, tmp_path):
    (tmp_path / "cat.png").write_bytes(CAT_PNG)
    network = FakeNetwork(server, {"cdn.example.com": [PUBLIC]})
    policy = MediaPolicy(allowed_domains=("example.com",), allowed_local_path=str(tmp_path))
    with pytest.raises(MediaError, match="is not followed"):
        network.load(f"http://cdn.example.com/redirect?to=file://{tmp_path}/cat.png", policy)


def test_redirect_limit(server):
    network = FakeNetwork(server, {"cdn.example.com": [PUBLIC]})
    with pytest.raises(MediaError, match="more than 3 redirects"):
        network.load("http://cdn.example.com/loop", ALLOW_EXAMPLE)
    assert len(server.requests) == 4
    with pytest.raises(MediaError, match="more than 0 redirects"):
        network.load("http://cdn.example.com/redirect?to=/cat.png",
                     MediaPolicy(allowed_domains=("example.com",), max_redirects=0))


def test_each_hop_is_resolved_once_and_reached_at_its_checked_address(server):
    """DNS rebinding: a second answer would be internal, but there is no second lookup;
    the connection goes to the address that was checked."""
    answers = iter([[PUBLIC], ["127.0.0.1"]])
    network = FakeNetwork(server, {})
    network.resolve = lambda host, port: network.resolved.append(host) or next(answers)
    assert pixels(network.load("http://cdn.example.com/cat.png", ALLOW_EXAMPLE)) == pixels(CAT)
    assert network.resolved == ["cdn.example.com"] and network.connected == [PUBLIC]


@pytest.mark.parametrize("path", ["/big", "/big-undeclared"])
def test_remote_byte_cap(server, path):
    network = FakeNetwork(server, {"cdn.example.com": [PUBLIC]})
    with pytest.raises(MediaError, match="larger than this server's limit of 10,000 bytes"):
        network.load(f"http://cdn.example.com{path}",
                     MediaPolicy(allowed_domains=("example.com",), max_bytes=10_000))


@pytest.mark.parametrize("path", ["/slow", "/drip"])
def test_one_deadline_bounds_the_fetch(server, path):
    network = FakeNetwork(server, {"cdn.example.com": [PUBLIC]})
    start = time.monotonic()
    with pytest.raises(MediaError, match=r"took longer than this server's limit of 0.4 s"):
        network.load(f"http://cdn.example.com{path}",
                     MediaPolicy(allowed_domains=("example.com",), timeout_s=0.4))
    assert time.monotonic() - start < 1.5


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_https_verifies_the_host_name_at_the_checked_address(tmp_path, monkeypatch):
    """The connection goes to the checked address; TLS still proves it is the host."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj",
                    "/CN=cdn.example.com", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    tls_server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    tls_server.daemon_threads, tls_server.requests = True, []
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    tls_server.socket = context.wrap_socket(tls_server.socket, server_side=True)
    threading.Thread(target=tls_server.serve_forever, daemon=True).start()
    try:
        port = tls_server.server_address[1]
        network = FakeNetwork(tls_server, {"cdn.example.com": [PUBLIC],
                                           "img.example.com": [PUBLIC]})
        with pytest.raises(MediaError, match="CERTIFICATE_VERIFY_FAILED"):  # system CAs
            network.load(f"https://cdn.example.com:{port}/cat.png", ALLOW_EXAMPLE)
        monkeypatch.setattr(media, "_tls_context",
                            lambda: ssl.create_default_context(cafile=cert))
        image = network.load(f"https://cdn.example.com:{port}/cat.png", ALLOW_EXAMPLE)
        assert pixels(image) == pixels(CAT)
        with pytest.raises(MediaError, match="Hostname mismatch"):
            network.load(f"https://img.example.com:{port}/cat.png", ALLOW_EXAMPLE)
    finally:
        tls_server.shutdown()
        tls_server.server_close()


def test_http_errors_and_unresolvable_hosts(server):
    network = FakeNetwork(server, {"cdn.example.com": [PUBLIC]})
    with pytest.raises(MediaError, match="answered HTTP 404"):
        network.load("http://cdn.example.com/missing.png", ALLOW_EXAMPLE)
    with pytest.raises(MediaError, match="cannot resolve nowhere.example.com"):
        network.load("http://nowhere.example.com/cat.png", ALLOW_EXAMPLE)


# --- policy, hash, torch-free ------------------------------------------------------

@pytest.mark.parametrize("fields, message", [
    ({"allowed_domains": ("https://example.com",)}, "not a host name"),
    ({"allowed_domains": ("example.com:8080",)}, "not a host name"),
    ({"max_bytes": 0}, "max_bytes must be positive"),
    ({"timeout_s": -1.0}, "timeout_s must be positive"),
    ({"max_redirects": -1}, "max_redirects must be 0 or more"),
])
def test_policy_validation(fields, message):
    with pytest.raises(ValueError, match=message):
        MediaPolicy(**fields)


def test_image_hash():
    same = load_image(data_url(CAT_PNG), MediaPolicy())
    assert image_hash(same) == image_hash(CAT) == image_hash(CAT.copy())
    assert len(image_hash(CAT)) == 64
    changed = CAT.copy()
    changed.putpixel((3, 2), (0, 0, 0) if CAT.getpixel((3, 2)) != (0, 0, 0) else (1, 1, 1))
    assert image_hash(changed) != image_hash(CAT)
    assert image_hash(CAT.convert("RGBA")) != image_hash(CAT)  # another mode
    flat = Image.new("RGB", (6, 8), (5, 5, 5))
    assert image_hash(flat) != image_hash(Image.new("RGB", (8, 6), (5, 5, 5)))  # transposed
    palette_a, palette_b = Image.new("P", (2, 2), 0), Image.new("P", (2, 2), 0)
    palette_a.putpalette([255, 0, 0] * 256)
    palette_b.putpalette([0, 0, 255] * 256)
    assert image_hash(palette_a) != image_hash(palette_b)  # same indices, other colours


_TORCH_FREE_CHILD = """
import json, sys
from loom.torch_free import forbid_torch
forbid_torch()
from loom.multimodal.media import MediaPolicy, image_hash, load_image
image = load_image(sys.stdin.read(), MediaPolicy())
print(json.dumps({"hash": image_hash(image), "imported": sorted(
    name for name, module in sys.modules.items()
    if module is not None and name.split(".")[0] in ("torch", "numpy"))}))
"""


def test_loads_in_a_process_without_torch():
    child = subprocess.run([sys.executable, "-c", _TORCH_FREE_CHILD], input=data_url(CAT_PNG),
                           capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, check=False)
    assert child.returncode == 0, child.stderr[-3000:]
    answer = json.loads(child.stdout.splitlines()[-1])
    assert answer == {"hash": image_hash(CAT), "imported": []}


# ----------------------------------------------------------------- videos

def encoded_video(num_frames: int, container: str = "mp4", codec: str = "mpeg4",
                  size: tuple[int, int] = (64, 48), fps: int = 5) -> bytes:
    """A video of ``num_frames`` flat grey frames, frame i of level 6 * i, written by
    PyAV (FFmpeg's encoders)."""
    import av
    import numpy as np

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container) as output:
        stream = output.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = *size, "yuv420p"
        for i in range(num_frames):
            pixels = np.full((size[1], size[0], 3), 6 * i % 256, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return buffer.getvalue()


def video_url(data: bytes, media_type: str = "video/mp4") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def variable_rate_video(times: list[int]) -> bytes:
    """An MP4 of a frame at each of ``times`` (tenths of a second), frame i of level 20 * i."""
    from fractions import Fraction

    import av
    import numpy as np

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as output:
        stream = output.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.codec_context.time_base = Fraction(1, 10)
        for i, tenths in enumerate(times):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 20 * i, np.uint8),
                                               format="rgb24")
            frame.pts, frame.time_base = tenths, Fraction(1, 10)
            for packet in stream.encode(frame):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return buffer.getvalue()


def vllm_indices(total_frames: int, num_frames: int) -> list[int]:
    """vLLM's default (OpenCV) video loader's frame indices, as it computes them."""
    import numpy as np

    if num_frames >= total_frames:
        return list(range(total_frames))
    return np.linspace(0, total_frames - 1, num_frames, dtype=int).tolist()


def test_sample_indices_are_vllms():
    from loom.multimodal.media import sample_indices

    for total in range(1, 300):
        for asked in (1, 2, 3, 4, 7, 8, 16, 32, 299):
            assert sample_indices(total, asked) == vllm_indices(total, asked), (total, asked)
    assert sample_indices(11, 4) == [0, 3, 6, 10]


@pytest.mark.parametrize("container,codec,media_type", [
    ("mp4", "mpeg4", "video/mp4"), ("matroska", "libvpx", "video/webm"),
    ("avi", "mpeg4", "video/x-msvideo")])
def test_a_video_is_sampled_as_vllm_samples_it(container, codec, media_type):
    """The frames at vLLM's default loader's indices, with vLLM's metadata: the source's
    rate, each frame's index in the file, its frame count and duration. 40 frames at 5 a
    second, 8 asked; 11, 4 asked (0, 3, 6, 10: not evenly spread); 3, 8 asked: every one.
    Each frame is the one its index names (every frame of the file differs)."""
    for total, asked in [(40, 8), (11, 4), (3, 8)]:
        url = video_url(encoded_video(total, container, codec), media_type)
        frames, metadata = load_video(url, MediaPolicy(), num_frames=asked)
        indices = vllm_indices(total, asked)
        assert metadata == {"fps": 5.0, "frames_indices": indices, "total_num_frames": total,
                            "duration": total / 5}
        assert all(f.size == (64, 48) and f.mode == "RGB" for f in frames)
        every, _ = load_video(url, MediaPolicy(), num_frames=total)
        assert len({frame.tobytes() for frame in every}) == total
        assert [frame.tobytes() for frame in frames] == [every[i].tobytes() for i in indices]


def test_a_variable_rate_videos_rate_is_its_average():
    """10 frames over 1.6 s at uneven times: fps is the source's average, 6.25 (frame i
    at frames_indices[i] / fps seconds, as transformers times it), the indices vLLM's."""
    frames, metadata = load_video(
        video_url(variable_rate_video([0, 1, 2, 3, 6, 9, 12, 13, 14, 15])), MediaPolicy(),
        num_frames=4)
    assert metadata == {"fps": 6.25, "frames_indices": [0, 3, 6, 9], "total_num_frames": 10,
                        "duration": 1.6}
    levels = [frame.getpixel((32, 24))[0] for frame in frames]  # about 20 x the index
    assert all(abs(level - 20 * i) <= 8 for level, i in zip(levels, [0, 3, 6, 9])), levels


def test_frames_are_chosen_again_from_the_decoders_count(monkeypatch):
    """Where the packets miscount the frames, the indices come from the frames decoded."""
    from loom.multimodal import media

    monkeypatch.setattr(media, "_count_packets", lambda data, container_format, policy: 30)
    frames, metadata = load_video(video_url(encoded_video(11)), MediaPolicy(), num_frames=4)
    assert metadata["frames_indices"] == [0, 3, 6, 10] and metadata["total_num_frames"] == 11
    every, _ = load_video(video_url(encoded_video(11)), MediaPolicy(), num_frames=11)
    assert [frame.tobytes() for frame in frames] == [every[i].tobytes() for i in (0, 3, 6, 10)]


@pytest.mark.parametrize("url,message", [
    (video_url(b"#EXTM3U\n#EXT-X-VERSION:3\nfile:///etc/hostname\n", "video/mp4"),
     "not a video in a container loom reads (MP4/MOV, WebM/Matroska, AVI)"),
    (video_url(b"\x00\x00\x00\x18ftypisom" + b"\x00" * 40), "cannot load the video"),
    (video_url(b"hi", "image/png"), "a data URL of type 'image/png' is not a video"),
    ("data:video/mp4;base64,@@@@", "base64 is corrupt"),
    ("https://example.com/a.mp4", "remote videos are off on this server"),
    ("/etc/hostname", "local files are off on this server"),
])
def test_bad_videos_are_media_errors(url, message):
    with pytest.raises(MediaError, match="^video_url: ") as raised:
        load_video(url, MediaPolicy())
    assert message in str(raised.value)


def test_video_limits():
    data = encoded_video(12)
    with pytest.raises(MediaError, match="more than 10 frames, this server's limit"):
        load_video(video_url(data), MediaPolicy(max_video_frames=10))
    with pytest.raises(MediaError, match="frames are 64x48, over this server's limit of 3,000"):
        load_video(video_url(data), MediaPolicy(max_video_pixels=3000))
    with pytest.raises(MediaError, match="the video is larger than this server's limit of 100 "):
        load_video(video_url(data), MediaPolicy(max_video_bytes=100))
    assert len(load_video(video_url(data), MediaPolicy(max_video_frames=12))[0]) == 12


def test_the_policy_sets_how_many_frames_a_video_gives():
    """--media-io-kwargs '{"video": {"num_frames": 4}}' reaches load_video through the
    server's policy (chat_images.media_policy)."""
    from loom.config import ModelConfig
    from loom.entrypoints.chat_images import media_policy

    policy = media_policy(ModelConfig(model="m", media_io_kwargs={"video": {"num_frames": 4}}))
    assert policy.video_num_frames == 4
    assert len(load_video(video_url(encoded_video(12)), policy)[0]) == 4
    assert len(load_video(video_url(encoded_video(12)), MediaPolicy())[0]) == 12
    with pytest.raises(ValueError, match="video_num_frames must be positive"):
        MediaPolicy(video_num_frames=0)
