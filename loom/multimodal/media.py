"""The image a request refers to, as an RGB ``PIL.Image`` (or a video, as sampled
frames), read under the server's :class:`MediaPolicy` (vLLM's
``--allowed-media-domains`` / ``--allowed-local-media-path``).

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

Videos (:func:`load_video`, a ``video_url`` part) are read from the same sources under
the same rules, with their own byte cap; the container is named from the file's first
bytes (MP4/MOV, WebM/Matroska, AVI; FFmpeg is never left to probe, so no playlist or
concat demuxer reads another file or URL), a frame's size is checked from the stream
before decoding, and a video of more frames than the limit is refused before any is
decoded. Frames are chosen by their index in the file as vLLM's default video loader
chooses them (:func:`sample_indices`), and come with vLLM's metadata: the source's
average frame rate, each chosen frame's index, the file's frame count and duration, so
a family times frame i at ``frames_indices[i] / fps`` seconds, as transformers does.

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
import math
import re
import socket
import ssl
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import quote, urljoin, urlsplit
from urllib.request import url2pathname

from PIL import Image, UnidentifiedImageError

# What PIL may open: the common web formats. Not the long tail of plugins (EPS runs
# Ghostscript; others see little use and much fuzzing).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
# The video containers decoded (with PyAV, whatever codecs its FFmpeg has): told apart by
# their first bytes, so FFmpeg never probes (its playlist demuxers read other files).
VIDEO_CONTAINERS = ("MP4/MOV", "WebM/Matroska", "AVI")
# Frames a video becomes by default, uniform over its frames (vLLM's default num_frames)
VIDEO_NUM_FRAMES = 32

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
    max_video_bytes: int = 100 * 1024 * 1024
    """The most bytes a video's encoded form may have, from any source."""
    max_video_pixels: int = 3840 * 2160
    """The most pixels a video's frame may have, read from its stream before decoding."""
    max_video_frames: int = 18_000
    """The most frames decoded from one video (10 minutes at 30 frames a second)."""
    video_num_frames: int = VIDEO_NUM_FRAMES
    """The frames sampled from a video (``--media-io-kwargs '{"video": {"num_frames": N}}'``)."""
    medium: str = "image"
    """What is being read, "image" or "video" (:func:`load_video` sets it): its part's
    name in messages and the data URL's media type."""

    def __post_init__(self) -> None:
        for domain in self.allowed_domains:
            if not domain or any(c in domain for c in "/@ ") or domain.count(":") == 1:
                raise ValueError(f"allowed media domain {domain!r} is not a host name; "
                                 "give one such as example.com (no scheme, port or path)")
        for name in ("timeout_s", "max_bytes", "max_pixels", "max_video_bytes",
                     "max_video_pixels", "max_video_frames", "video_num_frames"):
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


def load_video(url: str, policy: MediaPolicy, num_frames: int | None = None, *,
               resolve: Resolver = resolve_host,
               connect: Connector = connect_tcp) -> tuple[list[Image.Image], dict[str, Any]]:
    """The video ``url`` refers to, as ``num_frames`` (default: the policy's
    ``video_num_frames``) RGB frames at the indices :func:`sample_indices` picks (all of
    them if it has fewer), and vLLM's metadata of them::

        {"fps": the source's average frame rate, "frames_indices": [each frame's index],
         "total_num_frames": the frames in the file, "duration": total / fps seconds}

    what a family's video processor takes (``multi_modal_data={"video": (frames,
    metadata)}``).
    Read as an image is, under ``policy`` with its video limits (bytes, a frame's pixels,
    frames decoded); decoded with PyAV from the containers in :data:`VIDEO_CONTAINERS`
    only, named by their first bytes (FFmpeg is never left to probe: playlist and concat
    demuxers would read other files and URLs)."""
    reading = replace(policy, medium="video", max_bytes=policy.max_video_bytes)
    num_frames = policy.video_num_frames if num_frames is None else num_frames
    try:
        return _decode_video(_read_bytes(url, reading, resolve, connect), reading, num_frames)
    except MediaError:
        raise
    except Exception as error:  # whatever the bytes or the decoder did: the request's
        raise _refused(reading, f"cannot load the video ({type(error).__name__}: {error}); "
                                "check that it is an intact video") from error


def sample_indices(total_frames: int, num_frames: int) -> list[int]:
    """Which of a video's ``total_frames`` frames become its ``num_frames``, as vLLM's
    default (OpenCV) video loader picks them: every frame if there are no more than
    that, else ``num_frames`` indices spread uniformly from the first frame to the last,
    rounded down (``np.linspace(0, total_frames - 1, num_frames, dtype=int)``, to the
    bit: the same float products, floored)::

        sample_indices(11, 4) -> [0, 3, 6, 10]     (0, 3.33, 6.67, 10)
        sample_indices(3, 8)  -> [0, 1, 2]
    """
    if total_frames <= num_frames:
        return list(range(total_frames))
    if num_frames == 1:
        return [0]
    step = (total_frames - 1) / (num_frames - 1)
    return [math.floor(i * step) for i in range(num_frames - 1)] + [total_frames - 1]


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
            raise _refused(policy, f"a file URL names a host ({parts.netloc}); "
                           "write it as file:///absolute/path")
        return _read_local(url, url2pathname(parts.path), policy)
    if scheme is None:
        return _read_local(url, url, policy)
    raise _refused(policy, f"{scheme}: URLs are not supported; send a data:{policy.medium}/..."
                   ";base64 URL, an http(s) URL or a file path")


def _read_data_url(url: str, policy: MediaPolicy) -> bytes:
    header, comma, payload = url[len("data:"):].partition(",")
    media_type, *parameters = [part.strip().lower() for part in header.split(";")]
    if not media_type.startswith(policy.medium + "/"):
        raise _refused(policy, f"a data URL of type {media_type or 'text/plain'!r} is not "
                       f"{_an(policy.medium)}; send data:{policy.medium}/<format>;base64,<bytes>")
    if not comma or "base64" not in parameters:
        raise _refused(policy, f"a data URL must be base64: "
                       f"data:{policy.medium}/<format>;base64,<bytes>")
    payload = "".join(payload.split())
    if len(payload) // 4 * 3 - 2 > policy.max_bytes:  # too large before decoding it
        raise _too_large(policy)
    try:
        data = base64.b64decode(payload + "=" * (-len(payload) % 4), validate=True)
    except (binascii.Error, ValueError) as error:
        raise _refused(policy, f"the data URL's base64 is corrupt ({error}); encode "
                       f"the {policy.medium}'s bytes with standard base64") from None
    if len(data) > policy.max_bytes:
        raise _too_large(policy)
    return data


def _read_local(url: str, path: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_path is None:
        raise _refused(policy, f"local files are off on this server; start it with "
                       f"--allowed-local-media-path DIR to read {policy.medium}s under DIR")
    root = Path(policy.allowed_local_path).resolve()
    resolved = (root / path).resolve()  # an absolute path replaces root
    if not resolved.is_relative_to(root):
        raise _refused(policy, f"{_shown(url)} is outside the allowed local media "
                       f"directory {root}; put the {policy.medium} under it")
    try:
        status = resolved.stat()
    except FileNotFoundError:
        raise _refused(policy, f"no file {_shown(url)}; check the path") from None
    if not stat.S_ISREG(status.st_mode):
        raise _refused(policy, f"{_shown(url)} is not a file; check the path")
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
            raise _refused(policy, f"a redirect to {_shown(url)} is not followed "
                           f"(only http and https are); link the {policy.medium} itself")
    raise _refused(policy, f"more than {policy.max_redirects} redirects; link the "
                   f"{policy.medium} itself")


def _fetch(url: str, policy: MediaPolicy, deadline: float, resolve: Resolver,
           connect: Connector) -> tuple[str | None, bytes]:
    """One hop: (the redirect's Location, b"") or (None, the body)."""
    parts = urlsplit(url)
    https = parts.scheme.lower() == "https"
    host = _ascii_host(parts.hostname or "", policy)
    port = parts.port or (443 if https else 80)
    _check_domain(host, policy)
    addresses = _public_addresses(host, port, resolve, policy)
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
            "Accept": f"{policy.medium}/*", "User-Agent": "loom", "Connection": "close"})
        response = connection.getresponse()
        if response.status in _REDIRECTS:
            location = response.getheader("Location")
            if not location:
                raise _refused(policy, f"{_shown(url)} answered HTTP "
                               f"{response.status} without a Location; link the {policy.medium}")
            return location, b""
        if response.status != 200:
            raise _refused(policy, f"{_shown(url)} answered HTTP {response.status} "
                           f"{response.reason}; check the URL")
        return None, _read_body(response, policy)
    except TimeoutError:
        raise _timed_out(url, policy) from None
    except (OSError, http.client.HTTPException) as error:
        raise _refused(policy, f"cannot fetch {_shown(url)} ({type(error).__name__}: "
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
        raise _refused(policy, "the URL has no host; send http(s)://host/path")
    if not policy.allowed_domains:
        raise _refused(policy, f"remote {policy.medium}s are off on this server; start it "
                       f"with --allowed-media-domains {host} to fetch from {host}, or "
                       f"send the {policy.medium} as a data URL")
    for domain in policy.allowed_domains:
        domain = _ascii_host(domain, policy)
        if host == domain or host.endswith("." + domain):
            return
    raise _refused(policy, f"{host} is not an allowed media domain (allowed: "
                   f"{', '.join(policy.allowed_domains)}); send the {policy.medium} as a "
                   "data URL or add the domain with --allowed-media-domains")


def _public_addresses(host: str, port: int, resolve: Resolver,
                      policy: MediaPolicy) -> list[str]:
    try:
        addresses = resolve(host, port)
    except OSError as error:
        raise _refused(policy, f"cannot resolve {host} ({error}); check the URL") from None
    if not addresses:
        raise _refused(policy, f"{host} resolves to no address; check the URL")
    for address in addresses:
        kind = _non_public_kind(address)
        if kind is not None:
            raise _refused(policy, f"{host} resolves to {address}, a {kind} address; "
                           f"loom fetches {policy.medium}s from public addresses only, send "
                           f"the {policy.medium} as a data URL instead")
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
    raise _refused(policy, f"cannot connect to {_shown(url)} ({error}); check the URL")


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
        raise _refused(policy, f"the image is too large to decode ({error}); send a "
                       "smaller image") from None
    except UnidentifiedImageError:
        raise _refused(policy, f"the bytes are not an image in a format loom reads "
                       f"({', '.join(IMAGE_FORMATS)}); send one of those") from None
    width, height = image.size
    if width * height > policy.max_pixels:
        raise _refused(policy, f"the image is {width}x{height} = {width * height:,} "
                       f"pixels, over this server's limit of {policy.max_pixels:,}; send "
                       "a smaller image")
    try:
        image.load()
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as error:
        raise _refused(policy, f"the image cannot be decoded ({error}); send an "
                       "intact image") from None
    return _to_rgb(image)


def _container(data: bytes) -> str | None:
    """The FFmpeg demuxer for ``data``'s container, by its first bytes; None if it is not
    one of :data:`VIDEO_CONTAINERS`."""
    if data[4:8] == b"ftyp":
        return "mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    return None


def _decode_video(data: bytes, policy: MediaPolicy,
                  num_frames: int) -> tuple[list[Image.Image], dict[str, Any]]:
    container_format = _container(data)
    if container_format is None:
        raise _refused(policy, f"the bytes are not a video in a container loom reads "
                               f"({', '.join(VIDEO_CONTAINERS)}); send one of those")
    # The frames are chosen before decoding, from the count of the stream's packets (one
    # a frame in these containers); a decoder that makes another count of them has the
    # frames chosen again from its count, so every chosen index is a frame of the file.
    # (vLLM's OpenCV loader takes the container's stated count, or duration x rate, and
    # FFmpeg's guessed rate: the same numbers for an intact file of constant rate; for a
    # variable rate, the average rate times frame i as transformers' index / fps does.)
    total = _count_packets(data, container_format, policy)
    indices = sample_indices(total, num_frames)
    frames, decoded, fps = _decode_frames(data, container_format, policy, indices)
    if decoded != total:
        total, indices = decoded, sample_indices(decoded, num_frames)
        frames, _, fps = _decode_frames(data, container_format, policy, indices)
    return frames, {"fps": fps, "frames_indices": indices, "total_num_frames": total,
                    "duration": total / fps}


def _open_video(data: bytes, container_format: str, policy: MediaPolicy) -> tuple[Any, Any]:
    """The container and its first video stream, whose frame size is within the limit."""
    try:
        import av
    except ImportError:
        raise _refused(policy, "this server cannot decode video: PyAV is not installed "
                               "(pip install av)") from None

    container = av.open(io.BytesIO(data), mode="r", format=container_format)
    if not container.streams.video:
        container.close()
        raise _refused(policy, "the file has no video stream; send a video")
    stream = container.streams.video[0]
    width, height = stream.codec_context.width, stream.codec_context.height
    if width * height > policy.max_video_pixels:
        container.close()
        raise _refused(policy, f"the video's frames are {width}x{height}, over this "
                               f"server's limit of {policy.max_video_pixels:,} pixels; "
                               "send a smaller video")
    return container, stream


def _too_many_frames(policy: MediaPolicy) -> MediaError:
    return _refused(policy, f"the video has more than {policy.max_video_frames:,} frames, "
                            "this server's limit; send a shorter video")


def _count_packets(data: bytes, container_format: str, policy: MediaPolicy) -> int:
    """The video stream's packets, read without decoding any; refused past the limit."""
    container, stream = _open_video(data, container_format, policy)
    with container:
        count = 0
        for packet in container.demux(stream):
            if packet.size:  # (the demuxer ends with an empty packet)
                count += 1
                if count > policy.max_video_frames:
                    raise _too_many_frames(policy)
    return count


def _decode_frames(data: bytes, container_format: str, policy: MediaPolicy,
                   indices: list[int]) -> tuple[list[Image.Image], int, float]:
    """(the frames at ``indices``, in order, as RGB images; the frames decoded; the
    stream's average frame rate, else FFmpeg's guess of it, else the frames' own)."""
    container, stream = _open_video(data, container_format, policy)
    wanted = set(indices)
    chosen: list[Image.Image] = []
    decoded, last_time = 0, 0.0
    with container:
        for frame in container.decode(stream):
            if decoded >= policy.max_video_frames:
                raise _too_many_frames(policy)
            if frame.width * frame.height > policy.max_video_pixels:
                raise _refused(policy, f"a frame is {frame.width}x{frame.height}, over this "
                                       f"server's limit of {policy.max_video_pixels:,} pixels")
            if decoded in wanted:
                chosen.append(_to_rgb(frame.to_image()))
            if frame.time is not None:
                last_time = frame.time
            decoded += 1
        rate = stream.average_rate or stream.guessed_rate
    if not decoded:
        raise _refused(policy, "the video has no frames; send a video")
    if rate:
        return chosen, decoded, float(rate)
    if decoded > 1 and last_time > 0:
        return chosen, decoded, (decoded - 1) / last_time
    raise _refused(policy, "the video states no frame rate and its frames no times; send "
                           "a video with a frame rate")


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


def _ascii_host(host: str, policy: MediaPolicy) -> str:
    """``host`` lower-cased, an internationalized name in its ASCII (IDNA) form."""
    host = host.strip().rstrip(".").lower()
    try:
        return host.encode("idna").decode("ascii") if not host.isascii() else host
    except UnicodeError:
        raise _refused(policy, f"{host!r} is not a valid host name; check the URL") from None


def _too_large(policy: MediaPolicy) -> MediaError:
    return _refused(policy, f"the {policy.medium} is larger than this server's limit of "
                    f"{policy.max_bytes:,} bytes; send a smaller {policy.medium}")


def _timed_out(url: str, policy: MediaPolicy) -> MediaError:
    return _refused(policy, f"fetching {_shown(url)} took longer than this server's "
                    f"limit of {policy.timeout_s:g} s; send the {policy.medium} as a data URL or "
                    "link a faster host")


def _an(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _refused(policy: MediaPolicy, message: str) -> MediaError:
    """A refusal of the part being read (``image_url``, ``video_url``), saying why."""
    return MediaError(f"{policy.medium}_url: {message}")


def _shown(url: str) -> str:
    """``url`` cut short for an error message."""
    return url if len(url) <= 100 else url[:97] + "..."
