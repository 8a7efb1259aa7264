"""`vidmem queue`: run an API-format workflow on a ComfyUI server from a script.

    vidmem queue workflows/api/wan21_t2v_blockswap.json --server http://127.0.0.1:8188 \\
        --set VidMemVideoSampler.steps=4 --set 3.seed=7 --out renders/

It posts the workflow to `/prompt` with a client id, shows progress from ComfyUI's websocket,
reports a rejected workflow's node errors in plain words, waits until `/history/<id>` says the
prompt finished, prints the nodes' text outputs (vidmem's memory receipts), and downloads the
saved files through `/view`. Exit status: 0 success, 1 the server rejected or failed the prompt
(or it timed out), 2 bad command-line input.

Progress comes from a minimal RFC 6455 websocket client (text frames, no extensions), because
that is where ComfyUI sends per-step progress; `/history` stays the authority on completion and is
also polled while waiting, so a lost or refused websocket only costs the progress bar.
Standard library only. It talks to the given server URL and nothing else: proxies from the
environment are ignored and redirects are not followed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .websocket import WebSocket

POLL_S = 1.0  # /history poll interval while waiting


class QueueError(Exception):
    """The server rejected or failed the prompt; the message says what and where."""


class UsageError(Exception):
    """Bad local input (file, --set); nothing was sent."""


# --- the workflow and its overrides ---------------------------------------------------------------

def load_workflow(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"workflow file '{path}' does not exist.") from None
    except ValueError as error:
        raise UsageError(f"workflow file '{path}' is not JSON ({error}).") from None
    if isinstance(data, dict) and "nodes" in data and "links" in data:
        raise UsageError(
            f"'{path}' is a UI-format workflow; queue its API-format twin (vidmem's are in workflows/api/) "
            "or save one from ComfyUI with Export (API)."
        )
    if not isinstance(data, dict) or not all(isinstance(n, dict) and "class_type" in n for n in data.values()):
        raise UsageError(f"'{path}' is not an API-format workflow ({{node id: {{class_type, inputs}}}}).")
    return data


@dataclass(frozen=True)
class Override:
    target: str  # node id, title or class_type
    input: str
    value: object


def parse_override(text: str) -> Override:
    """'3.seed=7' or 'VidMemVideoSampler.steps=4'; the value is JSON where it parses, else a string."""
    left, sep, raw = text.partition("=")
    target, dot, name = left.rpartition(".")
    if not sep or not dot or not target or not name:
        raise UsageError(f"--set {text!r} must look like NODE.INPUT=VALUE, e.g. 3.seed=7 or VidMemVideoSampler.steps=4.")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return Override(target.strip(), name.strip(), value)


def find_nodes(workflow: dict, target: str) -> list[str]:
    """Node ids matching `target`: an id first, then a title, then a class_type."""
    if target in workflow:
        return [target]
    for key in (lambda n: n.get("_meta", {}).get("title"), lambda n: n["class_type"]):
        ids = [nid for nid, node in workflow.items() if key(node) == target]
        if ids:
            return ids
    return []


def apply_overrides(workflow: dict, overrides: list[Override]) -> dict:
    """A copy of `workflow` with each override applied; unknown or ambiguous targets are errors."""
    workflow = json.loads(json.dumps(workflow))
    for o in overrides:
        ids = find_nodes(workflow, o.target)
        if not ids:
            known = ", ".join(f"{nid} ({n['class_type']})" for nid, n in workflow.items())
            raise UsageError(f"--set {o.target}.{o.input}: no node has id, title or class '{o.target}'; nodes: {known}.")
        if len(ids) > 1:
            raise UsageError(f"--set {o.target}.{o.input}: {len(ids)} nodes match '{o.target}' ({', '.join(ids)}); use a node id.")
        inputs = workflow[ids[0]].setdefault("inputs", {})
        if o.input not in inputs:
            raise UsageError(
                f"--set {o.target}.{o.input}: node {ids[0]} ({workflow[ids[0]]['class_type']}) has no input "
                f"'{o.input}'; its inputs: {', '.join(inputs)}."
            )
        inputs[o.input] = o.value
    return workflow


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
        self.url = self.url.rstrip("/")
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())

    def request(self, path: str, body: dict | None = None) -> tuple[int, bytes]:
        """(status, body); an HTTP error status is returned, a connection failure raises QueueError."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        req = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with self._opener.open(req, timeout=self.timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read() if error.fp else b""
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise QueueError(f"cannot reach {self.url}{path}: {reason}") from None

    def get_json(self, path: str):
        status, raw = self.request(path)
        if status != 200:
            raise QueueError(f"GET {path}: HTTP {status}: {raw[:300].decode(errors='replace')}")
        return json.loads(raw)


def describe_node(workflow: dict, node_id: str) -> str:
    node = workflow.get(str(node_id), {})
    title = node.get("_meta", {}).get("title")
    kind = node.get("class_type", "?")
    return f"node {node_id} ({kind}{f', {title!r}' if title and title != kind else ''})"


def node_error_lines(payload: dict, workflow: dict) -> list[str]:
    """A 400 answer of POST /prompt as one line per problem: node id + class + input(s) + message.

    ComfyUI reports a failed VALIDATE_INPUTS once per input with the same text; those become one
    line naming the inputs."""
    lines = []
    error = payload.get("error")
    if isinstance(error, dict):
        lines.append(f"{error.get('message', 'rejected')}: {error.get('details', '')}".rstrip(": "))
    elif error:
        lines.append(str(error))
    for node_id, entry in (payload.get("node_errors") or {}).items():
        grouped: dict[tuple[str, str], list[str]] = {}
        for problem in entry.get("errors", []):
            name = (problem.get("extra_info") or {}).get("input_name")
            details = problem.get("details") or ""
            if name and details.startswith(f"{name} - "):
                details = details[len(name) + 3:]
            grouped.setdefault((problem.get("message", "error"), details), []).append(name)
        for (message, details), names in grouped.items():
            lines.append(f"{describe_node(workflow, node_id)}{_inputs_phrase(names)}: {message}{': ' + details if details else ''}")
    return lines


def _inputs_phrase(names: list[str | None]) -> str:
    names = [n for n in names if n]
    if not names:
        return ""
    if len(names) == 1:
        return f" input '{names[0]}'"
    shown = ", ".join(f"'{n}'" for n in names[:3])
    return f" inputs {shown}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def execution_error_lines(entry: dict, workflow: dict) -> list[str]:
    lines = []
    for kind, data in entry.get("status", {}).get("messages", []):
        if kind == "execution_error":
            kind_name = str(data.get("exception_type", "error")).rsplit(".", 1)[-1]  # the class, not its module path
            lines.append(f"{describe_node(workflow, data.get('node_id'))} failed: "
                         f"{kind_name}: {data.get('exception_message', '').strip()}")
        elif kind == "execution_interrupted":
            lines.append(f"interrupted at {describe_node(workflow, data.get('node_id'))}")
    return lines or [f"prompt ended with status {entry.get('status', {}).get('status_str')!r}"]


class ProgressView:
    """One status line on a terminal (rewritten in place), plain lines otherwise."""

    def __init__(self, workflow: dict, stream=None) -> None:
        self.workflow, self.stream = workflow, stream or sys.stderr
        self.tty = self.stream.isatty()
        self.last = ""

    def show(self, text: str) -> None:
        if text == self.last:
            return
        self.last = text
        if self.tty:
            self.stream.write("\r\x1b[K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def message(self, message: dict, prompt_id: str) -> None:
        kind, data = message.get("type"), message.get("data") or {}
        if data.get("prompt_id") not in (None, prompt_id):
            return
        if kind == "executing" and data.get("node") is not None:
            self.show(f"running {describe_node(self.workflow, data['node'])}")
        elif kind == "progress":
            done, total = int(data.get("value", 0)), max(1, int(data.get("max", 1)))
            bar = "#" * (20 * done // total)
            node = describe_node(self.workflow, data.get("node")) if data.get("node") else "progress"
            self.show(f"{node} [{bar:<20}] {done}/{total}")
        elif kind == "execution_cached" and data.get("nodes"):
            self.show(f"cached: nodes {', '.join(map(str, data['nodes']))}")

    def done(self) -> None:
        if self.tty and self.last:
            self.stream.write("\n")
            self.stream.flush()


# --- the run --------------------------------------------------------------------------------------

def submit(server: Server, workflow: dict, client_id: str) -> str:
    status, raw = server.request("/prompt", {"prompt": workflow, "client_id": client_id})
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = {"error": raw[:300].decode(errors="replace")}
    if status == 400:
        raise QueueError("the server rejected the workflow:\n  " + "\n  ".join(node_error_lines(payload, workflow)))
    if status != 200 or "prompt_id" not in payload:
        raise QueueError(f"POST /prompt: HTTP {status}: {raw[:300].decode(errors='replace')}")
    for line in node_error_lines({"node_errors": payload.get("node_errors")}, workflow):
        print(f"warning: {line} (that branch will not run)", file=sys.stderr)
    return payload["prompt_id"]


def finished(server: Server, prompt_id: str) -> dict | None:
    entry = server.get_json(f"/history/{urllib.parse.quote(prompt_id)}").get(prompt_id)
    status = (entry or {}).get("status", {})
    if entry and (status.get("completed") or status.get("status_str") in ("success", "error")):
        return entry
    return None


TERMINAL = ("execution_success", "execution_error", "execution_interrupted")


def wait(server: Server, socket_: WebSocket | None, prompt_id: str, view: ProgressView, timeout: float) -> dict:
    """The history entry once the prompt is done. The websocket (if any) drives the view and says
    when to look early; /history is polled every POLL_S seconds regardless and decides."""
    deadline = time.monotonic() + timeout
    next_poll = time.monotonic() + POLL_S
    while time.monotonic() < deadline:
        message = None
        if socket_ is not None:
            try:
                message = socket_.receive(timeout=min(POLL_S, max(0.01, deadline - time.monotonic())))
            except (OSError, ConnectionError, ValueError):
                socket_ = None  # progress is lost, completion is not
        else:
            time.sleep(POLL_S)
        if message:
            view.message(message, prompt_id)
        if ends(message, prompt_id) or time.monotonic() >= next_poll:
            next_poll = time.monotonic() + POLL_S
            entry = finished(server, prompt_id)
            if entry:
                return entry
    raise QueueError(f"prompt {prompt_id} did not finish within {timeout:.0f} s (it is still queued or running on the server).")


def ends(message: dict | None, prompt_id: str) -> bool:
    """Does this websocket message say our prompt is over (done, failed, interrupted)?"""
    if not message or (message.get("data") or {}).get("prompt_id") != prompt_id:
        return False
    kind, data = message.get("type"), message.get("data") or {}
    return kind in TERMINAL or (kind == "executing" and data.get("node") is None)


def output_files(entry: dict) -> list[tuple[str, dict]]:
    """(node id, file dict) for every saved output file in a history entry."""
    files = []
    for node_id, output in entry.get("outputs", {}).items():
        for values in output.values():
            for item in values if isinstance(values, list) else []:
                if isinstance(item, dict) and item.get("filename") and item.get("type", "output") == "output":
                    files.append((node_id, item))
    return files


def safe_target(out: Path, file: dict) -> Path:
    """out/subfolder/filename with every '..', absolute part and separator trick removed."""
    parts = [p for p in str(file.get("subfolder", "")).replace("\\", "/").split("/") if p not in ("", ".", "..")]
    name = Path(str(file["filename"]).replace("\\", "/")).name or "output"
    return out.joinpath(*parts, name)


def download(server: Server, files: list[tuple[str, dict]], out: Path) -> list[Path]:
    saved = []
    for _node_id, file in files:
        query = urllib.parse.urlencode({k: file.get(k, "") for k in ("filename", "subfolder", "type")})
        status, data = server.request(f"/view?{query}")
        if status != 200:
            raise QueueError(f"GET /view?{query}: HTTP {status}")
        target = safe_target(out, file)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        saved.append(target)
    return saved


def open_socket(server: Server, client_id: str) -> WebSocket | None:
    try:
        return WebSocket(server.url, client_id)
    except (OSError, ConnectionError) as error:
        print(f"note: no websocket ({error}); polling /history without per-step progress", file=sys.stderr)
        return None


def run_queue(args: argparse.Namespace) -> int:
    """`vidmem queue`: 0 on success, 1 when the server rejects or fails the prompt, 2 on bad input."""
    try:
        workflow = apply_overrides(load_workflow(args.workflow), [parse_override(s) for s in args.set or []])
        server = Server(args.server)
    except UsageError as error:
        print(f"vidmem queue: {error}", file=sys.stderr)
        return 2
    client_id = f"vidmem-queue-{uuid.uuid4().hex}"
    socket_ = open_socket(server, client_id)  # before posting, so no early message is missed
    view = ProgressView(workflow)
    try:
        prompt_id = submit(server, workflow, client_id)
        print(f"queued prompt {prompt_id} on {server.url}", file=sys.stderr)
        entry = wait(server, socket_, prompt_id, view, args.timeout)
        view.done()
        if entry.get("status", {}).get("status_str") != "success":
            raise QueueError("the prompt failed:\n  " + "\n  ".join(execution_error_lines(entry, workflow)))
        report(entry, workflow, server, args.out)
    except QueueError as error:
        view.done()
        print(f"vidmem queue: {error}", file=sys.stderr)
        return 1
    finally:
        if socket_ is not None:
            socket_.close()
    return 0


def report(entry: dict, workflow: dict, server: Server, out: Path | None) -> None:
    """Print each node's text output (vidmem's receipts) and the saved files, downloading them to `out`."""
    for node_id, output in entry.get("outputs", {}).items():
        for text in output.get("text", []):
            print(f"--- {describe_node(workflow, node_id)}\n{text}")
    files = output_files(entry)
    if out is None:
        for node_id, file in files:
            print(f"output of node {node_id}: {file.get('subfolder', '')}/{file['filename']} (use --out DIR to download)")
        return
    for path in download(server, files, Path(out)):
        print(f"saved {path}")


def add_queue_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "queue", help="run an API-format workflow on a ComfyUI server and download its outputs",
        description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("workflow", type=Path, help="an API-format workflow JSON (e.g. workflows/api/cogvideox_t2v.json)")
    parser.add_argument("--server", required=True, help="ComfyUI's URL, e.g. http://127.0.0.1:8188")
    parser.add_argument("--set", action="append", metavar="NODE.INPUT=VALUE", help=(
        "override one input before queueing; NODE is a node id, title or class (3.seed=7, "
        "VidMemVideoSampler.steps=4); VALUE is JSON where it parses, else text; repeatable"))
    parser.add_argument("--out", type=Path, help="download the saved files into this folder")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the prompt (default 3600)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m vidmem.queue_cli queue ...`) with the same parser as `vidmem queue`."""
    parser = argparse.ArgumentParser(prog="vidmem")
    add_queue_parser(parser.add_subparsers(dest="command", required=True))
    return run_queue(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
