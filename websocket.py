"""A minimal websocket client (RFC 6455: text frames, no extensions), standard library only.

Enough to read ComfyUI's progress messages from `/ws`: JSON text messages, fragments, ping/pong;
binary frames (image previews) are skipped.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import ssl
import struct
import urllib.parse

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455, section 1.3


class WebSocket:
    """Reads JSON text messages; answers pings; skips binary frames (ComfyUI's image previews)."""

    def __init__(self, url: str, client_id: str, timeout: float = 10.0) -> None:
        parts = urllib.parse.urlsplit(url)
        secure = parts.scheme == "https"
        port = parts.port or (443 if secure else 80)
        sock = socket.create_connection((parts.hostname, port), timeout=timeout)
        if secure:
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname)
        self._sock, self._buffer = sock, b""
        self._message_op, self._fragments = 0x1, []
        key = base64.b64encode(os.urandom(16)).decode()
        path = f"{parts.path.rstrip('/')}/ws?clientId={urllib.parse.quote(client_id)}"
        sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        head = self._read_until(b"\r\n\r\n").decode("latin-1")
        status = head.split("\r\n", 1)[0]
        accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        if status.split()[1:2] != ["101"] or f"sec-websocket-accept: {accept.lower()}" not in head.lower():
            sock.close()
            raise OSError(f"websocket handshake refused: {status}")

    def receive(self, timeout: float) -> dict | None:
        """The next JSON text message, or None if none arrived within `timeout` seconds."""
        self._sock.settimeout(timeout)
        try:
            while True:
                opcode, payload = self._next_message()
                if opcode == 0x1:
                    return json.loads(payload.decode())
                if opcode == 0x8:
                    raise ConnectionError("websocket closed by the server")
                if opcode == 0x9:
                    self._send(0xA, payload)  # pong
        except socket.timeout:
            return None  # a partial frame stays in the buffer for the next call

    def close(self) -> None:
        try:
            self._send(0x8, struct.pack("!H", 1000))
        except OSError:
            pass
        self._sock.close()

    def _next_message(self) -> tuple[int, bytes]:
        """One whole message; fragments are joined, control frames returned as they come."""
        while True:
            fin, opcode, data = self._next_frame()
            if opcode >= 0x8:  # control frames may arrive between fragments
                return opcode, data
            if opcode:  # the first frame of a message names its type
                self._message_op, self._fragments = opcode, []
            self._fragments.append(data)
            if fin:
                payload, self._fragments = b"".join(self._fragments), []
                return self._message_op, payload

    def _next_frame(self) -> tuple[bool, int, bytes]:
        while True:
            frame = parse_frame(self._buffer)
            if frame is not None:
                fin, opcode, data, used = frame
                self._buffer = self._buffer[used:]
                return fin, opcode, data
            chunk = self._sock.recv(65536)
            if not chunk:
                raise ConnectionError("websocket connection closed")
            self._buffer += chunk

    def _send(self, opcode: int, payload: bytes) -> None:
        mask = os.urandom(4)  # a client masks every frame it sends
        header = bytes([0x80 | opcode, 0x80 | len(payload)])  # control payloads are < 126 bytes
        self._sock.sendall(header + mask + _unmask(payload, mask))

    def _read_until(self, marker: bytes) -> bytes:
        while marker not in self._buffer:
            chunk = self._sock.recv(4096)
            if not chunk:
                raise ConnectionError("connection closed during the websocket handshake")
            self._buffer += chunk
        head, _, self._buffer = self._buffer.partition(marker)
        return head


def parse_frame(buffer: bytes) -> tuple[bool, int, bytes, int] | None:
    """(fin, opcode, payload, bytes used) of the first whole frame in `buffer`, or None if incomplete."""
    if len(buffer) < 2:
        return None
    fin, opcode = bool(buffer[0] & 0x80), buffer[0] & 0x0F
    masked, length, at = buffer[1] & 0x80, buffer[1] & 0x7F, 2
    if length in (126, 127):
        size = 2 if length == 126 else 8
        if len(buffer) < at + size:
            return None
        length = int.from_bytes(buffer[at:at + size], "big")
        at += size
    mask = buffer[at:at + 4] if masked else b""
    at += len(mask)
    if len(mask) < (4 if masked else 0) or len(buffer) < at + length:
        return None
    data = buffer[at:at + length]
    return fin, opcode, _unmask(data, mask) if masked else data, at + length


def _unmask(data: bytes, mask: bytes) -> bytes:
    return bytes(b ^ mask[i % 4] for i, b in enumerate(data))


# --- reporting ------------------------------------------------------------------------------------
