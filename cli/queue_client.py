"""What `vidmem queue` reads from a ComfyUI server, and how: HTTP to the one server, progress
through `websocket-client`, and a check of every answer before it is used.

A server answer is data from the network, so nothing in it is trusted: JSON that is not JSON,
objects that are lists, missing keys, and output file names that would write outside `--out`
(`..`, absolute paths, names with separators, drive letters) are refused with a message that
says which answer was wrong. Downloads go to a temp file beside the target and are renamed into
place, so an interrupted download never leaves half a file under the expected name.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import websocket  # websocket-client

from ..pipelines.atomic import write_bytes_atomically

SHOWN = 300  # bytes of a bad answer quoted in a message


class QueueError(Exception):
    """The server rejected or failed the prompt, or answered something unusable; the message says what."""


class UsageError(Exception):
    """Bad local input (file, --set); nothing was sent."""


class Unreachable(QueueError):
    """No usable answer came (refused, timed out, not HTTP, cut short, or a 5xx: the server or a proxy in
    front of it failed this one request): while waiting for a prompt that is already queued, a passing
    state, not a verdict on the prompt."""


# --- HTTP to the one server -----------------------------------------------------------------------

class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl} refused", headers, fp)


@dataclass
class Server:
    """The server at `url`; environment proxies are bypassed and redirects refused."""

    url: str
    timeout: float = 30.0
    _opener: urllib.request.OpenerDirector = field(init=False, repr=False)

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(f"--server {self.url!r} must be an http(s) URL such as http://127.0.0.1:8188.")
        try:
            parts.port  # urllib checks the port only when it is read: here, not at the first request
        except ValueError as error:
            raise UsageError(f"--server {self.url!r} has a bad port ({error}); use e.g. http://127.0.0.1:8188.") from None
        self.url = self.url.rstrip("/")
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())

    def request(self, path: str, body: dict | None = None, timeout: float | None = None) -> tuple[int, bytes]:
        """(status, body); an HTTP error status is returned, no usable answer raises Unreachable.
        `timeout`: seconds for this request (None: the server's), e.g. the time a wait has left."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        req = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with self._opener.open(req, timeout=self.timeout if timeout is None else timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read() if error.fp else b""
        except http.client.HTTPException as error:  # a non-HTTP service on the port, or an answer cut short
            raise Unreachable(f"{self.url}{path} answered something that is not HTTP, or cut its answer short "
                              f"({type(error).__name__}); is --server a ComfyUI server?") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise Unreachable(f"cannot reach {self.url}{path}: {reason}") from None

    def get_json(self, path: str, timeout: float | None = None) -> dict:
        status, raw = self.request(path, timeout=timeout)
        if status >= 500:  # the server (or a proxy) failed this request, not the prompt: callers may ask again
            raise Unreachable(f"GET {path}: HTTP {status}: {quote(raw)}")
        if status != 200:
            raise QueueError(f"GET {path}: HTTP {status}: {quote(raw)}")
        return json_object(raw, f"GET {path}")


def quote(raw: bytes) -> str:
    return raw[:SHOWN].decode(errors="replace")


def json_object(raw: bytes, what: str) -> dict:
    """The answer as a JSON object, or QueueError saying which answer was not one."""
    try:
        value = json.loads(raw)
    except ValueError:
        raise QueueError(f"{what}: the server's answer is not JSON ({quote(raw)!r}); is --server a ComfyUI server?") from None
    if not isinstance(value, dict):
        raise QueueError(f"{what}: expected a JSON object from the server, got a {type(value).__name__}.")
    return value


def mapping(value: object, what: str) -> dict:
    """A dict inside an answer, or QueueError naming the key that was not one."""
    if not isinstance(value, dict):
        raise QueueError(f"the server's {what} is a {type(value).__name__}, not a JSON object.")
    return value


# --- progress through the websocket ---------------------------------------------------------------

def websocket_url(server_url: str, client_id: str) -> str:
    parts = urllib.parse.urlsplit(server_url)
    scheme = "wss" if parts.scheme == "https" else "ws"
    query = urllib.parse.urlencode({"clientId": client_id})
    return urllib.parse.urlunsplit((scheme, parts.netloc, f"{parts.path.rstrip('/')}/ws", query, ""))


class ProgressSocket:
    """ComfyUI's `/ws` as JSON messages. websocket-client answers pings and does the close
    handshake; binary frames (image previews) are skipped. Like HTTP it goes to the given server
    only: no proxy from the environment, no redirect."""

    def __init__(self, server_url: str, client_id: str, timeout: float = 10.0) -> None:
        # The TCP (and TLS) connection is opened here, to the server's own host and port, and handed
        # to websocket-client: given a socket it never consults http_proxy from the environment.
        parts = urllib.parse.urlsplit(server_url)
        secure = parts.scheme == "https"
        sock = socket.create_connection((parts.hostname, parts.port or (443 if secure else 80)), timeout=timeout)
        try:
            if secure:
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname)
            self._ws = websocket.create_connection(
                websocket_url(server_url, client_id), timeout=timeout, socket=sock, redirect_limit=0,
            )
        except (websocket.WebSocketException, ValueError, OSError) as error:
            sock.close()
            raise ConnectionError(f"websocket refused: {error}") from None

    def receive(self, timeout: float) -> dict | None:
        """The next JSON message, or None if none arrived within `timeout` (or it was a preview).

        Raises ConnectionError when the socket closed or sent something that is not a JSON object.
        """
        self._ws.settimeout(timeout)
        try:
            opcode, data = self._ws.recv_data()
        except websocket.WebSocketTimeoutException:
            return None
        except (websocket.WebSocketException, OSError) as error:
            raise ConnectionError(f"websocket lost: {error or type(error).__name__}") from None
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            raise ConnectionError("websocket closed by the server")
        if opcode != websocket.ABNF.OPCODE_TEXT:
            return None
        try:
            message = json.loads(data)
        except ValueError:
            raise ConnectionError(f"the websocket sent a message that is not JSON ({quote(data)!r})") from None
        if not isinstance(message, dict):
            raise ConnectionError(f"the websocket sent a JSON {type(message).__name__}, not a message object")
        return message

    def close(self) -> None:
        try:
            self._ws.close(timeout=1.0)
        except (websocket.WebSocketException, OSError):
            pass


# --- output files named by the server --------------------------------------------------------------

_DRIVE = re.compile(r"^[A-Za-z]:")


@dataclass(frozen=True)
class OutputFile:
    """One saved file of a history entry, checked: where it goes under --out and how to ask for it."""

    node_id: str
    filename: str
    subfolder: str
    parts: tuple[str, ...]  # the subfolder's parts, each a plain name

    def query(self) -> str:
        return urllib.parse.urlencode({"filename": self.filename, "subfolder": self.subfolder, "type": "output"})

    def target(self, out: Path) -> Path:
        return out.joinpath(*self.parts, self.filename)


def output_file(node_id: str, item: dict) -> OutputFile:
    """A checked OutputFile; QueueError for a name that would land outside --out or is not a name."""
    filename, subfolder = item.get("filename"), item.get("subfolder", "")
    where = f"node {node_id}'s output file {filename!r}"
    if not isinstance(filename, str) or not isinstance(subfolder, str):
        raise QueueError(f"{where} (subfolder {subfolder!r}): filename and subfolder must be text. Nothing was downloaded.")
    problem = _name_problem(filename)
    if problem:
        raise QueueError(f"{where} is refused: {problem}. Nothing was downloaded.")
    if "/" in filename or "\\" in filename:
        raise QueueError(f"{where} is refused: a file name must not contain a path separator. Nothing was downloaded.")
    if subfolder.startswith(("/", "\\")) or _DRIVE.match(subfolder):
        raise QueueError(f"{where} is refused: subfolder {subfolder!r} is an absolute path. Nothing was downloaded.")
    parts = tuple(p for p in re.split(r"[/\\]", subfolder) if p not in ("", "."))
    for part in parts:
        problem = _name_problem(part)
        if problem:
            raise QueueError(f"{where} is refused: subfolder {subfolder!r} would leave --out ({problem}). "
                             "Nothing was downloaded.")
    return OutputFile(str(node_id), filename, subfolder, parts)


def _name_problem(name: str) -> str | None:
    if name in ("", ".", ".."):
        return f"{name!r} is not a file name"
    if "\x00" in name:
        return "it contains a NUL character"
    if _DRIVE.match(name) or PurePosixPath(name).is_absolute():
        return "it is an absolute path"
    return None


def output_files(entry: dict) -> list[OutputFile]:
    """Every saved output file of a history entry (previews of type 'temp' are not downloaded)."""
    files = []
    for node_id, output in mapping(entry.get("outputs", {}), "history 'outputs'").items():
        for values in mapping(output, f"output of node {node_id}").values():
            for item in values if isinstance(values, list) else []:
                if isinstance(item, dict) and item.get("filename") is not None and item.get("type", "output") == "output":
                    files.append(output_file(node_id, item))
    return files


def download(server: Server, files: list[OutputFile], out: Path, on_saved=lambda path: None) -> list[Path]:
    """Each file into `out`, through a temp file renamed into place; every name was checked first, and a file
    already there is kept (the new one takes the next free name: `free_name`).
    `on_saved(path)` is called as each file lands, so a later failure does not hide what was saved; the
    failure's message says which files were saved and which are still only on the server."""
    root = out.resolve()
    for file in files:  # refuse before the first byte is written (a subfolder may be a link out)
        target = file.target(out)
        if not target.resolve().is_relative_to(root):
            raise QueueError(f"node {file.node_id}'s output file {file.filename!r} would be written to {target.resolve()}, "
                             f"outside --out {root}. Nothing was downloaded.")
    saved = []
    for file in files:
        try:
            status, data = server.request(f"/view?{file.query()}")
        except Unreachable as error:  # the prompt is done: no wait left to retry in
            raise QueueError(f"{error}. {_still_on_server(saved, files)}; download them through /view.") from None
        if status != 200:
            raise QueueError(f"GET /view?{file.query()}: HTTP {status}: {quote(data)}. {_still_on_server(saved, files)}; "
                             "download them through /view.")
        target = free_name(file.target(out))
        try:
            saved.append(write_bytes_atomically(target, data))
        except OSError as error:
            raise QueueError(f"cannot write {target}: {error.strerror or error}. {_still_on_server(saved, files)}; free "
                             "the space or pick another --out and download them through /view.") from None
        on_saved(saved[-1])
    return saved


def free_name(target: Path) -> Path:
    """`target`, or where a file of that name is already there (an earlier render: ComfyUI's counters start again
    when its output folder is emptied, or on another server), the first free "name (2).mp4", "name (3).mp4"..."""
    if not target.exists() and not target.is_symlink():
        return target
    for number in range(2, 10_000):
        candidate = target.with_name(f"{target.stem} ({number}){target.suffix}")
        if not candidate.exists() and not candidate.is_symlink():
            return candidate
    raise QueueError(f"{target} and 9,998 numbered copies of it exist already; pick another --out.")


def _still_on_server(saved: list[Path], files: list[OutputFile]) -> str:
    """Which outputs a failed download left where: the first len(saved) of `files` landed."""
    left = ", ".join("/".join(file.parts + (file.filename,)) for file in files[len(saved):])
    return (f"The outputs are still on the server ({len(saved)} of {len(files)} saved here"
            + (f": {', '.join(map(str, saved))}" if saved else "") + f"; not saved: {left})")
