"""`vidmem queue`: run an API-format workflow on a ComfyUI server from a script.

    vidmem queue workflows/api/wan21_t2v_blockswap.json --server http://127.0.0.1:8188 \\
        --set VidMemVideoSampler.steps=4 --set 3.seed=7 --out renders/

It posts the workflow to `/prompt` with a client id, shows progress from ComfyUI's websocket,
reports a rejected workflow's node errors in plain words, waits until `/history/<id>` says the
prompt finished, prints the nodes' text outputs (vidmem's memory receipts), and downloads the
saved files through `/view` (a file already in --out is kept; the new one takes "name (2).mp4").
Exit status: 0 success, 1 the server rejected or failed the prompt
(or it timed out), 2 bad command-line input, 130 Ctrl-C (the prompt stays on the server).

Progress comes from ComfyUI's websocket (through `websocket-client`), because that is where
ComfyUI sends per-step progress; `/history` stays the authority on completion and is also polled
while waiting, so a lost or refused websocket only costs the progress bar. Every answer is
checked before it is used (queue_client.py): output names that would leave --out, answers that
are not JSON, missing keys are refused with a message. It talks to the given server URL and
nothing else: proxies from the environment are ignored and redirects are not followed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from pathlib import Path

from .queue_client import (
    ProgressSocket,
    QueueError,
    Server,
    Unreachable,
    UsageError,
    download,
    json_object,
    mapping,
    output_files,
    quote,
)

POLL_S = 1.0  # /history poll interval while waiting
# Every this many unfinished polls, GET /queue: does the server still hold the prompt? Not every poll: ComfyUI's
# answer copies every pending prompt's graph under the queue's lock.
QUEUE_EVERY = 5


# --- the workflow and its overrides ---------------------------------------------------------------

def load_workflow(path: Path) -> dict:
    try:
        # UTF-8 whatever the locale (json.dump's files and ComfyUI's exports are UTF-8: a Chinese prompt read as
        # cp1252 is mojibake or an error); "-sig" also takes the byte-order mark Windows editors put first.
        data = json.loads(Path(path).read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise UsageError(f"workflow file '{path}' does not exist.") from None
    except OSError as error:  # a folder, no permission: one line, as for a missing file
        raise UsageError(f"cannot read workflow file '{path}': {error.strerror or error}.") from None
    except ValueError as error:
        raise UsageError(f"workflow file '{path}' is not JSON ({error}).") from None
    if isinstance(data, dict) and "nodes" in data and "links" in data:
        raise UsageError(
            f"'{path}' is a UI-format workflow; queue its API-format twin ({_api_twin(data)}) "
            "or save one from ComfyUI with Export (API)."
        )
    if not isinstance(data, dict) or not all(isinstance(n, dict) and "class_type" in n for n in data.values()):
        raise UsageError(f"'{path}' is not an API-format workflow ({{node id: {{class_type, inputs}}}}).")
    for node_id, node in data.items():  # --set and the messages read these; a list there would crash them
        for key in ("inputs", "_meta"):
            if not isinstance(node.get(key, {}), dict):
                raise UsageError(f"'{path}': node {node_id}'s {key!r} is a {type(node[key]).__name__}, not an object "
                                 "({name: value}); export the workflow again with Export (API).")
    return data


@dataclass(frozen=True)
class Override:
    target: str  # node id, title or class_type
    input: str
    value: object
    text: str = ""  # the value as typed: what an input holding text gets (apply_overrides)


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
    return Override(target.strip(), name.strip(), value, raw)


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
        # An input the workflow gives text (a list's choice: activation_chunks "2", a prompt) keeps text: JSON would
        # make "2" the number 2, which ComfyUI refuses as not in the list.
        as_text = isinstance(inputs[o.input], str) and not isinstance(o.value, str)
        inputs[o.input] = (o.text or json.dumps(o.value)) if as_text else o.value
    return workflow


# --- what the server says, in plain words ----------------------------------------------------------

def describe_node(workflow: dict, node_id: str) -> str:
    node = workflow.get(str(node_id), {})
    title = node.get("_meta", {}).get("title")
    kind = node.get("class_type", "?")
    return f"node {node_id} ({kind}{f', {title!r}' if title and title != kind else ''})"


def node_error_lines(payload: dict, workflow: dict) -> list[str]:
    """A 400 answer of POST /prompt as one line per problem: node id + class + input(s) + message.

    ComfyUI reports a failed VALIDATE_INPUTS once per input with the same text; those become one
    line naming the inputs. Parts of the answer that are not shaped as ComfyUI's are skipped."""
    lines = []
    error = payload.get("error")
    if isinstance(error, dict):
        lines.append(f"{error.get('message', 'rejected')}: {error.get('details', '')}".rstrip(": "))
    elif error:
        lines.append(str(error))
    node_errors = payload.get("node_errors")
    for node_id, entry in (node_errors.items() if isinstance(node_errors, dict) else ()):
        grouped: dict[tuple[str, str], list[str]] = {}
        problems = entry.get("errors") if isinstance(entry, dict) else None
        for problem in problems if isinstance(problems, list) else []:
            if not isinstance(problem, dict):
                continue
            extra = problem.get("extra_info")
            name = extra.get("input_name") if isinstance(extra, dict) else None
            details = str(problem.get("details") or "")
            if name and details.startswith(f"{name} - "):
                details = details[len(name) + 3:]
            grouped.setdefault((str(problem.get("message", "error")), details), []).append(name)
        for (message, details), names in grouped.items():
            # vidmem's own checks start their text with the input they are about ("width=30 must be ..."): that one
            # input, not every input of the node's VALIDATE_INPUTS, which ComfyUI lists with the same text.
            names = [name for name in names if name and details.startswith(f"{name}=")] or names
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
    status = mapping(entry.get("status", {}), "history 'status'")
    messages = status.get("messages", [])
    for item in messages if isinstance(messages, list) else []:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], dict)):
            continue
        kind, data = item
        if kind == "execution_error":
            kind_name = str(data.get("exception_type", "error")).rsplit(".", 1)[-1]  # the class, not its module path
            lines.append(f"{describe_node(workflow, data.get('node_id'))} failed: "
                         f"{kind_name}: {str(data.get('exception_message', '')).strip()}")
        elif kind == "execution_interrupted":
            lines.append(f"interrupted at {describe_node(workflow, data.get('node_id'))}")
    return lines or [f"prompt ended with status {status.get('status_str')!r}"]


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
        """Show one websocket message; one not shaped like ComfyUI's is skipped (progress only)."""
        kind, data = message.get("type"), message.get("data") or {}
        if not isinstance(data, dict) or data.get("prompt_id") not in (None, prompt_id):
            return
        if kind == "executing" and data.get("node") is not None:
            self.show(f"running {describe_node(self.workflow, data['node'])}")
        elif kind == "progress":
            try:
                done, total = int(data.get("value", 0)), max(1, int(data.get("max", 1)))
            except (TypeError, ValueError):
                return
            bar = "#" * (20 * done // total)
            node = describe_node(self.workflow, data.get("node")) if data.get("node") else "progress"
            self.show(f"{node} [{bar:<20}] {done}/{total}")
        elif kind == "execution_cached" and isinstance(data.get("nodes"), list) and data["nodes"]:
            self.show(f"cached: nodes {', '.join(map(str, data['nodes']))}")

    def done(self) -> None:
        if self.tty and self.last:
            self.stream.write("\n")
            self.stream.flush()


# --- the run --------------------------------------------------------------------------------------

def submit(server: Server, workflow: dict, client_id: str) -> str:
    status, raw = server.request("/prompt", {"prompt": workflow, "client_id": client_id})
    if status == 400:
        try:
            payload = json_object(raw, "POST /prompt")
        except QueueError:
            payload = {"error": quote(raw)}
        lines = node_error_lines(payload, workflow) or [f"HTTP 400: {quote(raw)!r}"]  # no error and no node_errors
        raise QueueError("the server rejected the workflow:\n  " + "\n  ".join(lines))
    if status != 200:
        raise QueueError(f"POST /prompt: HTTP {status}: {quote(raw)}")
    payload = json_object(raw, "POST /prompt")
    prompt_id = payload.get("prompt_id")
    if not isinstance(prompt_id, str) or not prompt_id:
        raise QueueError(f"POST /prompt: the answer has no prompt_id ({quote(raw)!r}); is --server a ComfyUI server?")
    for line in node_error_lines({"node_errors": payload.get("node_errors")}, workflow):
        print(f"warning: {line} (that branch will not run)", file=sys.stderr)
    return prompt_id


def finished(server: Server, prompt_id: str, timeout: float | None = None) -> dict | None:
    """The prompt's history entry once it is done, None while it is not (`timeout`: for the request)."""
    entry = server.get_json(f"/history/{urllib.parse.quote(prompt_id)}", timeout).get(prompt_id)
    if entry is None:
        return None
    entry = mapping(entry, f"history entry of prompt {prompt_id}")
    status = mapping(entry.get("status", {}), "history 'status'")
    if status.get("completed") or status.get("status_str") in ("success", "error"):
        return entry
    return None


TERMINAL = ("execution_success", "execution_error", "execution_interrupted")


def wait(server: Server, socket_: ProgressSocket | None, prompt_id: str, view: ProgressView, timeout: float) -> dict:
    """The history entry once the prompt is done. The websocket (if any) drives the view and says
    when to look early; /history is polled every POLL_S seconds regardless and decides. A poll that
    gets no answer (slow, refused, cut short, a 5xx) is tried again until the deadline, each request given
    at most the time left: the server may be restarting. A server that answers but lists the prompt in
    neither its history nor its queue (asked every QUEUE_EVERY polls), twice in a row, has lost it: that ends
    the wait too."""
    deadline = time.monotonic() + timeout
    next_poll = time.monotonic() + POLL_S
    unanswered = ""  # the last poll failure shown
    missing = 0  # /queue answers in a row that did not list the unfinished prompt
    unfinished = 0
    while time.monotonic() < deadline:
        message = None
        if socket_ is not None:
            try:
                message = socket_.receive(timeout=min(POLL_S, max(0.01, deadline - time.monotonic())))
            except ConnectionError as error:
                print(f"note: {error}; polling /history without per-step progress", file=sys.stderr)
                socket_ = None  # progress is lost, completion is not
        else:
            time.sleep(POLL_S)
        if message:
            view.message(message, prompt_id)
        if ends(message, prompt_id) or time.monotonic() >= next_poll:
            next_poll = time.monotonic() + POLL_S
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                entry = finished(server, prompt_id, min(server.timeout, left))
            except Unreachable as error:
                if str(error) != unanswered:  # once per kind of failure, not once a second
                    print(f"note: {error}; trying again until --timeout", file=sys.stderr)
                unanswered = str(error)
                continue
            if entry:
                return entry
            # Neither finished nor queued, twice in a row (once could be the moment between the two requests when
            # it finished): the server lost it, restarted (after running out of memory, say) or had it deleted.
            unfinished += 1
            if unfinished % QUEUE_EVERY:
                continue
            missing = missing + 1 if queue_place(server, prompt_id, min(server.timeout, left)) == "" else 0
            if missing >= 2:
                raise QueueError(f"the server no longer has prompt {prompt_id}: neither its queue nor its history "
                                 "lists it (was ComfyUI restarted, or the prompt deleted?); queue the workflow again.")
    raise QueueError(f"prompt {prompt_id} did not finish within {timeout:g} s; {queue_state(server, prompt_id)}.")


def queue_place(server: Server, prompt_id: str, timeout: float = 5.0) -> str | None:
    """"running" or "pending" where GET /queue lists the prompt, "" where it does not, None where it does not say."""
    try:
        queue = server.get_json("/queue", timeout=timeout)
    except QueueError:
        return None
    if not all(isinstance(queue.get(key), list) for key in ("queue_running", "queue_pending")):
        return None  # not ComfyUI's answer: it says nothing of the prompt
    for key, place in (("queue_running", "running"), ("queue_pending", "pending")):
        items = queue[key]  # ComfyUI's: [[number, prompt_id, ...]]
        if any(isinstance(item, list) and len(item) > 1 and item[1] == prompt_id for item in items):
            return place
    return ""


def queue_state(server: Server, prompt_id: str) -> str:
    """Where the prompt is, from GET /queue, in words; "unknown" when the server does not say."""
    place = queue_place(server, prompt_id, min(server.timeout, 5.0))
    if place is None:
        return "its state on the server is unknown (GET /queue did not say)"
    if place:
        state = "it is still running" if place == "running" else "it is still queued"
        return f"{state} on the server (POST {server.url}/interrupt stops a running prompt)"
    return "the server's queue does not list it; its state is unknown (see GET /history)"


def ends(message: dict | None, prompt_id: str) -> bool:
    """Does this websocket message say our prompt is over (done, failed, interrupted)?"""
    data = (message or {}).get("data") or {}
    if not isinstance(data, dict) or data.get("prompt_id") != prompt_id:  # not shaped like ComfyUI's: not ours
        return False
    kind = message.get("type")
    return kind in TERMINAL or (kind == "executing" and data.get("node") is None)


def _api_twin(ui: dict) -> str:
    """Where a vidmem template's API-format twin is (its `extra.vidmem.api`), else where they all are."""
    twin = ((ui.get("extra") or {}).get("vidmem") or {}).get("api") if isinstance(ui.get("extra"), dict) else None
    if not (isinstance(twin, str) and twin):
        return "vidmem's are in workflows/api/"
    name = Path(twin).name
    return f"workflows/api/{name if name.endswith('.json') else name + '.json'}"


def open_socket(server: Server, client_id: str) -> tuple[ProgressSocket | None, str]:
    """(the progress socket, "") or (None, why not). The note is the caller's to print once the server has
    accepted the prompt: a server that is not there at all refuses the socket first, and its one clear line
    is the /prompt error, not a note about progress."""
    try:
        return ProgressSocket(server.url, client_id), ""
    except (OSError, ConnectionError) as error:
        return None, f"note: no websocket ({error}); polling /history without per-step progress"


def run_queue(args: argparse.Namespace) -> int:
    """`vidmem queue`: 0 on success, 1 when the server rejects or fails the prompt, 2 on bad input, 130 on Ctrl-C."""
    try:
        check_wait_and_out(args.timeout, args.out)
        workflow = apply_overrides(load_workflow(args.workflow), [parse_override(s) for s in args.set or []])
        server = Server(args.server)
    except UsageError as error:
        print(f"vidmem queue: {error}", file=sys.stderr)
        return 2
    client_id = f"vidmem-queue-{uuid.uuid4().hex}"
    view = ProgressView(workflow)
    socket_ = prompt_id = None
    finished_on_server = False
    try:
        socket_, no_socket = open_socket(server, client_id)  # before posting, so no early message is missed
        prompt_id = submit(server, workflow, client_id)
        if no_socket:
            print(no_socket, file=sys.stderr)
        print(f"queued prompt {prompt_id} on {server.url}", file=sys.stderr)
        entry = wait(server, socket_, prompt_id, view, args.timeout)
        finished_on_server = True  # a Ctrl-C from here on stops the download, not the prompt
        view.done()
        if entry.get("status", {}).get("status_str") != "success":
            raise QueueError("the prompt failed:\n  " + "\n  ".join(execution_error_lines(entry, workflow)))
        report(entry, workflow, server, args.out)
    except QueueError as error:
        view.done()
        print(f"vidmem queue: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C stops the waiting here, not the prompt on the server
        view.done()
        if finished_on_server:
            where = f"prompt {prompt_id} had finished; its outputs not saved here are still on the server (/view)"
        elif prompt_id:
            where = f"prompt {prompt_id} is still on the server; POST {server.url}/interrupt stops it if it is running"
        else:
            where = f"the prompt may have been queued; GET {server.url}/queue shows it"
        print(f"\nvidmem queue: interrupted: {where}.", file=sys.stderr)
        return 130
    finally:
        if socket_ is not None:
            socket_.close()
    return 0


def check_wait_and_out(timeout: float, out: Path | None) -> None:
    """--timeout and --out checked before anything is sent (UsageError): a render must not end in a
    refusal that was known before it started."""
    if not (math.isfinite(timeout) and timeout > 0):
        raise UsageError(f"--timeout {timeout:g} must be a positive number of seconds, e.g. 3600.")
    if out is not None and out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder; give a folder (it is created if missing).")
    problem = None if out is None else unwritable_folder(out)
    if problem:
        raise UsageError(f"--out {out}: cannot write there ({problem}); give a writable folder.")


def unwritable_folder(folder: Path) -> str | None:
    """Why no file can be made in `folder` (the OS's words), or None. The folders the probe creates are
    removed again: a run refused later (or a rejected prompt) leaves nothing behind, and the files'
    own writes create them when they land."""
    made = [path for path in (folder, *folder.parents) if not path.exists()]  # deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        return error.strerror or str(error)
    finally:
        for path in made:
            with contextlib.suppress(OSError):
                path.rmdir()
    return None


def report(entry: dict, workflow: dict, server: Server, out: Path | None) -> None:
    """Print each node's text output (vidmem's receipts) and the saved files, downloading them to `out`."""
    files = output_files(entry)  # every name checked before anything is printed or written
    for node_id, output in entry.get("outputs", {}).items():
        texts = output.get("text", [])
        for text in texts if isinstance(texts, list) else []:
            print(f"--- {describe_node(workflow, node_id)}\n{text}")
    if out is None:
        for file in files:
            print(f"output of node {file.node_id}: {'/'.join(file.parts + (file.filename,))} (use --out DIR to download)")
        return
    download(server, files, Path(out), on_saved=lambda path: print(f"saved {path}", flush=True))


def add_queue_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "queue", help="run an API-format workflow on a ComfyUI server and download its outputs",
        description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("workflow", type=Path, help="an API-format workflow JSON (e.g. workflows/api/cogvideox_t2v.json)")
    parser.add_argument("--server", required=True, help="ComfyUI's URL, e.g. http://127.0.0.1:8188")
    parser.add_argument("--set", action="append", metavar="NODE.INPUT=VALUE", help=(
        "override one input before queueing; NODE is a node id, title or class (3.seed=7, "
        "VidMemVideoSampler.steps=4); VALUE is JSON where it parses, else text, and text as typed where the "
        "workflow holds text (2.activation_chunks=2 sends the choice \"2\"); repeatable"))
    parser.add_argument("--out", type=Path, help="download the saved files into this folder")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the prompt (default 3600)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`vidmem queue` alone, for callers in Python: `main(["queue", WORKFLOW, "--server", URL])`."""
    parser = argparse.ArgumentParser(prog="vidmem")
    add_queue_parser(parser.add_subparsers(dest="command", required=True))
    return run_queue(parser.parse_args(argv))
