"""The image a request refers to, as an RGB ``PIL.Image``, read under the server's
:class:`MediaPolicy` (vLLM's ``--allowed-media-domains`` / ``--allowed-local-media-path``).

    data:image/png;base64,...   decoded; the media type must be ``image/*``
    http(s)://host/...          only from an allowed domain, only to public addresses
    file:///abs/path, a path    only under the allowed local directory

Every refusal and every failure is a :class:`MediaError` (a ValueError: the request's
fault, a 400), whose message says what was wrong and what to do. The rules:

- Remote: the host must be an allowed domain or a subdomain of one. It is resolved once
  per hop; if any of its addresses is not public (loopback, private, link-local,
  multicast, reserved, unspecified), the fetch is refused, and the connection goes to a
  checked address, so a second DNS answer cannot swap in an internal one (DNS
  rebinding). Redirects are followed by hand, each hop checked as the first; a redirect
  to anything but http(s) is refused. One deadline (``timeout_s``) bounds the whole
  fetch, every hop and every byte; reading stops past ``max_bytes``.
- Local: the path, after resolving symlinks and ``..``, must lie under the allowed
  directory (a relative path is taken under it) and be a regular file.
- Decoding: only the formats in :data:`IMAGE_FORMATS` are opened. The size is read from
  the header and refused above ``max_pixels`` before any pixel is decoded (a
  decompression bomb is a few KiB that claims gigapixels); PIL's own bomb guard
  (``Image.MAX_IMAGE_PIXELS``) ends in a MediaError too. Transparent pixels are laid on
  white, as transformers' ``convert_to_rgb`` does.

The API server calls :func:`load_image` from a thread pool: it blocks, and it imports
neither torch nor anything that does (loom/torch_free.py). :func:`image_hash` keys an
image's tokens in the engine's prefix cache.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import io
import ipaddress
import re
import socket
import ssl
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from urllib.parse import quote, urljoin, urlsplit
from urllib.request import url2pathname

from PIL import Image, UnidentifiedImageError

# What PIL may open: the common web formats. Not the long tail of plugins (EPS runs
# Ghostscript; others see little use and much fuzzing).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")

Resolver = Callable[[str, int], list[str]]  # (host, port) -> its IP addresses
Connector = Callable[[str, int, float], socket.socket]  # (address, port, timeout) -> socket

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how large they may be."""

    allowed_domains: tuple[str, ...] = ()
    """Hosts that http(s) images may come from, each with its subdomains
    (``example.com`` allows ``cdn.example.com``). Empty: no remote images."""
    allowed_local_path: str | None = None
    """The directory that file:// URLs and paths must lie under. None: no local files."""
    timeout_s: float = 10.0
    """The whole of a remote fetch, every redirect and byte of it; a slow DNS lookup counts
    against it, but only the connection and what it carries are cut off at its end."""
    max_bytes: int = 20 * 1024 * 1024
    """The most bytes an image's encoded form may have, from any source."""
    max_pixels: int = 50_000_000
    """The most pixels (width * height) an image may have, read from its header."""
    max_redirects: int = 3

    def __post_init__(self) -> None:
        for domain in self.allowed_domains:
            if not domain or any(c in domain for c in "/@ ") or domain.count(":") == 1:
                raise ValueError(f"allowed media domain {domain!r} is not a host name; "
                                 "give one such as example.com (no scheme, port or path)")
        for name in ("timeout_s", "max_bytes", "max_pixels"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MediaPolicy.{name} must be positive, not "
                                 f"{getattr(self, name)}")
        if self.max_redirects < 0:
            raise ValueError(f"MediaPolicy.max_redirects must be 0 or more, not "
                             f"{self.max_redirects}")


class MediaError(ValueError):
    """An image reference that cannot be loaded; the message says why and what to do."""


def resolve_host(host: str, port: int) -> list[str]:
    """``host``'s addresses as the system resolver gives them, each once, in order."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def connect_tcp(address: str, port: int, timeout: float) -> socket.socket:
    return socket.create_connection((address, port), timeout=timeout)


def load_image(url: str, policy: MediaPolicy, *, resolve: Resolver = resolve_host,
               connect: Connector = connect_tcp) -> Image.Image:
    """The RGB image ``url`` refers to (a data:, http(s): or file: URL, or a path).
    ``resolve`` and ``connect`` reach the network (tests replace them)."""
    try:
        return _decode(_read_bytes(url, policy, resolve, connect), policy)
    except MediaError:
        raise
    except Exception as error:  # whatever the bytes or the network did: the request's
        raise MediaError(f"image_url: cannot load the image ({type(error).__name__}: "
                         f"{error}); check that it is an intact image") from error


def image_hash(image: Image.Image) -> str:
    """A content hash of ``image``: equal for equal pixels (mode, size, palette, bytes),
    different otherwise; stable across processes and runs."""
    digest = hashlib.blake2b(digest_size=32)
    digest.update(f"{image.mode} {image.width}x{image.height}\n".encode())
    palette = image.getpalette()
    if palette is not None:
        digest.update(bytes(palette))
    digest.update(image.tobytes())
    return digest.hexdigest()


def _read_bytes(url: str, policy: MediaPolicy, resolve: Resolver,
                connect: Connector) -> bytes:
    match = _SCHEME.match(url)
    scheme = match.group(1).lower() if match else None
    if scheme == "data":
        return _read_data_url(url, policy)
    if scheme in ("http", "https"):
        return _read_remote(url, policy, resolve, connect)
    if scheme == "file":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaError(f"image_url: a file URL names a host ({parts.netloc}); "
                             "write it as file:///absolute/path")
        return _read_local(url, url2pathname(parts.path), policy)
    if scheme is None:
        return _read_local(url, url, policy)
    raise MediaError(f"image_url: {scheme}: URLs are not supported; send a data:image/..."
                     ";base64 URL, an http(s) URL or a file path")


def _read_data_url(url: str, policy: MediaPolicy) -> bytes:
    header, comma, payload = url[len("data:"):].partition(",")
    media_type, *parameters = [part.strip().lower() for part in header.split(";")]
    if not media_type.startswith("image/"):
        raise MediaError(f"image_url: a data URL of type {media_type or 'text/plain'!r} "
                         "is not an image; send data:image/<format>;base64,<bytes>")
    if not comma or "base64" not in parameters:
        raise MediaError("image_url: an image data URL must be base64: "
                         "data:image/<format>;base64,<bytes>")
    payload = "".join(payload.split())
    if len(payload) // 4 * 3 - 2 > policy.max_bytes:  # too large before decoding it
        raise _too_large(policy)
    try:
        data = base64.b64decode(payload + "=" * (-len(payload) % 4), validate=True)
    except (binascii.Error, ValueError) as error:
        raise MediaError(f"image_url: the data URL's base64 is corrupt ({error}); encode "
                         "the image's bytes with standard base64") from None
    if len(data) > policy.max_bytes:
        raise _too_large(policy)
    return data


def _read_local(url: str, path: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_path is None:
        raise MediaError("image_url: local files are off on this server; start it with "
                         "--allowed-local-media-path DIR to read images under DIR")
    root = Path(policy.allowed_local_path).resolve()
    resolved = (root / path).resolve()  # an absolute path replaces root
    if not resolved.is_relative_to(root):
        raise MediaError(f"image_url: {_shown(url)} is outside the allowed local media "
                         f"directory {root}; put the image under it")
    try:
        status = resolved.stat()
    except FileNotFoundError:
        raise MediaError(f"image_url: no file {_shown(url)}; check the path") from None
    if not stat.S_ISREG(status.st_mode):
        raise MediaError(f"image_url: {_shown(url)} is not a file; check the path")
    if status.st_size > policy.max_bytes:
        raise _too_large(policy)
    with open(resolved, "rb") as file:
        data = file.read(policy.max_bytes + 1)
    if len(data) > policy.max_bytes:  # grew since stat
        raise _too_large(policy)
    return data


def _read_remote(url: str, policy: MediaPolicy, resolve: Resolver,
                 connect: Connector) -> bytes:
    deadline = time.monotonic() + policy.timeout_s
    for _hop in range(policy.max_redirects + 1):
        location, body = _fetch(url, policy, deadline, resolve, connect)
        if location is None:
            return body
        url = urljoin(url, location)
        if urlsplit(url).scheme.lower() not in ("http", "https"):
            raise MediaError(f"image_url: a redirect to {_shown(url)} is not followed "
                             "(only http and https are); link the image itself")
    raise MediaError(f"image_url: more than {policy.max_redirects} redirects; link the "
                     "image itself")


def _fetch(url: str, policy: MediaPolicy, deadline: float, resolve: Resolver,
           connect: Connector) -> tuple[str | None, bytes]:
    """One hop: (the redirect's Location, b"") or (None, the body)."""
    parts = urlsplit(url)
    https = parts.scheme.lower() == "https"
    host = _ascii_host(parts.hostname or "")
    port = parts.port or (443 if https else 80)
    _check_domain(host, policy)
    addresses = _public_addresses(host, port, resolve)
    sock = _connect_any(url, addresses, port, deadline, connect, policy)
    connection = http.client.HTTPConnection(host, port)
    try:
        if https:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            sock = _tls_context().wrap_socket(sock, server_hostname=host)
        connection.sock = _DeadlineSocket(sock, deadline)
        target = quote(parts.path or "/", safe="/%:@!$&'()*+,;=~-._")
        if parts.query:
            target += "?" + quote(parts.query, safe="/%:@!$&'()*+,;=~-._?")
        named = f"[{host}]" if ":" in host else host  # an IPv6 literal
        connection.request("GET", target, headers={
            "Host": named if port == (443 if https else 80) else f"{named}:{port}",
            "Accept": "image/*", "User-Agent": "loom", "Connection": "close"})
        response = connection.getresponse()
        if response.status in _REDIRECTS:
            location = response.getheader("Location")
            if not location:
                raise MediaError(f"image_url: {_shown(url)} answered HTTP "
                                 f"{response.status} without a Location; link the image")
            return location, b""
        if response.status != 200:
            raise MediaError(f"image_url: {_shown(url)} answered HTTP {response.status} "
                             f"{response.reason}; check the URL")
        return None, _read_body(response, policy)
    except TimeoutError:
        raise _timed_out(url, policy) from None
    except (OSError, http.client.HTTPException) as error:
        raise MediaError(f"image_url: cannot fetch {_shown(url)} ({type(error).__name__}: "
                         f"{error}); check the URL") from None
    finally:
        connection.close()
        sock.close()


def _read_body(response: http.client.HTTPResponse, policy: MediaPolicy) -> bytes:
    declared = response.getheader("Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > policy.max_bytes:
        raise _too_large(policy)
    body = bytearray()
    while chunk := response.read1(min(_CHUNK_BYTES, policy.max_bytes + 1 - len(body))):
        body += chunk
        if len(body) > policy.max_bytes:
            raise _too_large(policy)
    return bytes(body)


def _check_domain(host: str, policy: MediaPolicy) -> None:
    if not host:
        raise MediaError("image_url: the URL has no host; send http(s)://host/path")
    if not policy.allowed_domains:
        raise MediaError(f"image_url: remote images are off on this server; start it with "
                         f"--allowed-media-domains {host} to fetch from {host}, or send "
                         "the image as a data URL")
    for domain in policy.allowed_domains:
        domain = _ascii_host(domain)
        if host == domain or host.endswith("." + domain):
            return
    raise MediaError(f"image_url: {host} is not an allowed media domain (allowed: "
                     f"{', '.join(policy.allowed_domains)}); send the image as a data URL "
                     "or add the domain with --allowed-media-domains")


def _public_addresses(host: str, port: int, resolve: Resolver) -> list[str]:
    try:
        addresses = resolve(host, port)
    except OSError as error:
        raise MediaError(f"image_url: cannot resolve {host} ({error}); check the URL") from None
    if not addresses:
        raise MediaError(f"image_url: {host} resolves to no address; check the URL")
    for address in addresses:
        kind = _non_public_kind(address)
        if kind is not None:
            raise MediaError(f"image_url: {host} resolves to {address}, a {kind} address; "
                             "loom fetches images from public addresses only, send the "
                             "image as a data URL instead")
    return addresses


def _non_public_kind(address: str) -> str | None:
    """Which kind of non-public address ``address`` is, None for a public one. An IPv6
    address that carries an IPv4 one (``::ffff:10.0.0.1``, 6to4) is judged by it."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address):
        ip = ip.ipv4_mapped or ip.sixtofour or ip
    for kind in ("unspecified", "loopback", "link_local", "multicast", "private", "reserved"):
        if getattr(ip, "is_" + kind):
            return kind.replace("_", "-")
    return None if ip.is_global else "non-global"


def _connect_any(url: str, addresses: list[str], port: int, deadline: float,
                 connect: Connector, policy: MediaPolicy) -> socket.socket:
    """A connection to the first of ``addresses`` (all checked) that answers."""
    error: OSError | None = None
    for address in addresses:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timed_out(url, policy)
        try:
            return connect(address, port, remaining)
        except TimeoutError:
            raise _timed_out(url, policy) from None
        except OSError as failure:
            error = failure
    raise MediaError(f"image_url: cannot connect to {_shown(url)} ({error}); check the URL")


class _DeadlineSocket:
    """A socket whose every send and receive ends by ``deadline``: one timeout for the
    whole fetch, however slowly a server drips its headers or body. It is what
    http.client needs of a socket: ``sendall``, ``makefile("rb")``, ``close``."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline

    def _arm(self) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline passed")
        self.sock.settimeout(remaining)

    def sendall(self, data: bytes) -> None:
        self._arm()
        self.sock.sendall(data)

    def makefile(self, mode: str) -> io.BufferedReader:
        assert mode == "rb", mode
        return io.BufferedReader(_DeadlineReader(self))

    def close(self) -> None:
        """Nothing: http.client closes its socket once a response is under way (a real
        socket outlives that while its makefile reads); the fetch closes ``sock``."""


class _DeadlineReader(io.RawIOBase):
    def __init__(self, deadline_socket: _DeadlineSocket) -> None:
        self.deadline_socket = deadline_socket

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self.deadline_socket._arm()
        return self.deadline_socket.sock.recv_into(buffer)


def _decode(data: bytes, policy: MediaPolicy) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # reads the header only
    except Image.DecompressionBombError as error:
        raise MediaError(f"image_url: the image is too large to decode ({error}); send a "
                         "smaller image") from None
    except UnidentifiedImageError:
        raise MediaError(f"image_url: the bytes are not an image in a format loom reads "
                         f"({', '.join(IMAGE_FORMATS)}); send one of those") from None
    width, height = image.size
    if width * height > policy.max_pixels:
        raise MediaError(f"image_url: the image is {width}x{height} = {width * height:,} "
                         f"pixels, over this server's limit of {policy.max_pixels:,}; send "
                         "a smaller image")
    try:
        image.load()
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as error:
        raise MediaError(f"image_url: the image cannot be decoded ({error}); send an "
                         "intact image") from None
    return _to_rgb(image)


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if not image.has_transparency_data:
        return image.convert("RGB")
    on_white = Image.new("RGBA", image.size, (255, 255, 255, 255))
    on_white.alpha_composite(image.convert("RGBA"))
    return on_white.convert("RGB")


@cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()


def _ascii_host(host: str) -> str:
    """``host`` lower-cased, an internationalized name in its ASCII (IDNA) form."""
    host = host.strip().rstrip(".").lower()
    try:
        return host.encode("idna").decode("ascii") if not host.isascii() else host
    except UnicodeError:
        raise MediaError(f"image_url: {host!r} is not a valid host name; check the URL") from None


def _too_large(policy: MediaPolicy) -> MediaError:
    return MediaError(f"image_url: the image is larger than this server's limit of "
                      f"{policy.max_bytes:,} bytes; send a smaller image")


def _timed_out(url: str, policy: MediaPolicy) -> MediaError:
    return MediaError(f"image_url: fetching {_shown(url)} took longer than this server's "
                      f"limit of {policy.timeout_s:g} s; send the image as a data URL or "
                      "link a faster host")


def _shown(url: str) -> str:
    """``url`` cut short for an error message."""
    return url if len(url) <= 100 else url[:97] + "..."
