"""`vidmem queue` against a small stub of ComfyUI's HTTP + websocket API, served on 127.0.0.1 in
the test: success with progress and downloads, a 400's node errors in plain words, an
execution_error, --set overrides by id / title / class, the polling fallback without a websocket,
that nothing but the given URL is contacted (proxies ignored, redirects refused), and that every
answer is checked: names that would leave --out, answers that are not JSON, missing keys."""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from vidmem.cli import queue as queue_cli
from vidmem.cli.queue import add_queue_parser, run_queue

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455, section 1.3: the stub server's handshake


def parse_frame(buffer: bytes) -> tuple[bool, int, bytes, int] | None:
    """The stub server reads the client's (masked) frames: (fin, opcode, payload, bytes used) or None."""
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
    if masked:
        data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
    return fin, opcode, data, at + length

WORKFLOW = Path(__file__).resolve().parents[1] / "workflows" / "api" / "wan21_t2v_blockswap.json"
PROMPT_ID = "prompt-1"
FILES = {"vidmem_00001.mp4": b"\x00\x00\x00\x18ftypisom", "vidmem_preview_00001.webp": b"RIFF\x00\x00\x00\x00WEBP"}


def frame(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    """A server frame (unmasked), any length."""
    head = bytes([(0x80 if fin else 0) | opcode])
    if len(payload) < 126:
        head += bytes([len(payload)])
    elif len(payload) < 1 << 16:
        head += bytes([126]) + len(payload).to_bytes(2, "big")
    else:
        head += bytes([127]) + len(payload).to_bytes(8, "big")
    return head + payload


def text(kind: str, **data) -> bytes:
    return frame(0x1, json.dumps({"type": kind, "data": data}).encode())


class Stub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, scenario: str = "success", websocket: bool = True, answers: dict | None = None, files: list | None = None):
        super().__init__(("127.0.0.1", 0), Handler)
        self.scenario, self.websocket = scenario, websocket
        self.answers = answers or {}  # path -> (status, body bytes): the server answering something odd
        self.files = files  # node 7's output file dicts, when a test gives its own
        self.viewed: list[str] = []
        self.posted: list[dict] = []
        self.paths: list[str] = []
        self.queued = threading.Event()
        self.ws_done = threading.Event()
        self.pongs: list[bytes] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: Stub

    def log_message(self, *args):  # keep pytest output clean
        pass

    def reply(self, status: int, body, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def odd_answer(self) -> bool:
        for prefix, (status, body) in self.server.answers.items():
            if self.path.startswith(prefix) and (prefix != "/history" or self.server.queued.is_set()):
                self.reply(status, body)
                return True
        return False

    def do_POST(self):
        self.server.paths.append(self.path)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/prompt" and "/prompt" in self.server.answers:
            self.server.queued.set()
            return self.odd_answer()
        if self.path != "/prompt":
            return self.reply(404, {})
        self.server.posted.append(body)
        if self.server.scenario == "reject":
            return self.reply(400, {
                "error": {"type": "prompt_outputs_failed_validation", "message": "Prompt outputs failed validation", "details": ""},
                "node_errors": {"2": {"class_type": "VidMemMemoryStrategy", "dependent_outputs": ["7"], "errors": [{
                    "type": "custom_validation_failed", "message": "Failed to validate prompt for output 7",
                    "details": "offload='block_swap' needs blocks_to_swap >= 1; set blocks_to_swap",
                    "extra_info": {"input_name": "blocks_to_swap"},
                }]}, "3": {"class_type": "VidMemVideoSampler", "dependent_outputs": ["7"], "errors": [{
                    "type": "custom_validation_failed", "message": "Custom validation failed for node",
                    "details": f"{name} - width=30 must be a multiple of 16", "extra_info": {"input_name": name},
                } for name in ("width", "height", "frames", "steps", "cfg")]}},
            })
        if self.server.scenario == "redirect":
            self.send_response(307)
            self.send_header("Location", "http://127.0.0.1:9/prompt")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        self.server.queued.set()
        return self.reply(200, {"prompt_id": PROMPT_ID, "number": 0, "node_errors": {}})

    def do_GET(self):
        self.server.paths.append(self.path)
        if self.odd_answer():
            return None
        if self.path.startswith("/ws"):
            return self.websocket() if self.server.websocket else self.reply(404, {})
        if self.path == f"/history/{PROMPT_ID}":
            ready = self.server.queued.is_set() and (self.server.ws_done.is_set() or not self.server.websocket)
            return self.reply(200, {PROMPT_ID: self.history()} if ready else {})
        if self.path.startswith("/view?"):
            from urllib.parse import parse_qs, urlsplit

            query = parse_qs(urlsplit(self.path).query)
            self.server.viewed.append(self.path)
            name = Path(query["filename"][0]).name
            return self.reply(200, FILES.get(name, b"data"), "application/octet-stream")
        return self.reply(404, {})

    def history(self) -> dict:
        if self.server.scenario == "interrupted":
            return {"outputs": {}, "status": {"status_str": "error", "completed": False, "messages": [
                ["execution_start", {"prompt_id": PROMPT_ID}],
                ["execution_interrupted", {"prompt_id": PROMPT_ID, "node_id": "3", "node_type": "VidMemVideoSampler",
                                           "executed": []}],
            ]}}
        if self.server.scenario == "exec_error":
            return {"outputs": {}, "status": {"status_str": "error", "completed": False, "messages": [
                ["execution_start", {"prompt_id": PROMPT_ID}],
                ["execution_error", {"prompt_id": PROMPT_ID, "node_id": "3", "node_type": "VidMemVideoSampler",
                                     "exception_type": "vidmem.memory.strategy.StrategyError",
                                     "exception_message": "blocks_to_swap=99 but this model's transformer has 30 blocks"}],
            ]}}
        files = self.server.files or [{"filename": "vidmem_00001.mp4", "subfolder": "vidmem", "type": "output"}]
        return {"status": {"status_str": "success", "completed": True, "messages": []}, "outputs": {
            "3": {"text": ["Video Sampler: WanPipeline\nswap cost: 1.0% of step time"]},
            "7": {"images": files, "animated": [True]},
            "8": {"images": [{"filename": "vidmem_preview_00001.webp", "subfolder": "vidmem", "type": "output"}],
                  "animated": [True]},
            "9": {"images": [{"filename": "preview.png", "subfolder": "", "type": "temp"}]},
        }}

    def websocket(self):
        key = self.headers["Sec-WebSocket-Key"]
        accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.end_headers()
        self.close_connection = True
        self.wfile.write(text("status", status={"exec_info": {"queue_remaining": 0}}, sid="x"))
        if not self.server.queued.wait(10):
            return
        if self.server.scenario == "garbled":
            self.wfile.write(frame(0x1, b"<<not json>>"))
        p = PROMPT_ID
        self.wfile.write(text("execution_start", prompt_id=p))
        self.wfile.write(text("executing", node="3", display_node="3", prompt_id=p))
        self.wfile.write(frame(0x2, b"\x00\x00\x00\x01binary preview"))  # skipped
        self.wfile.write(frame(0x9, b"hi"))  # ping: the client must pong
        self.wfile.write(text("progress", value=1, max=2, prompt_id=p, node="3"))
        message = json.dumps({"type": "progress", "data": {"value": 2, "max": 2, "prompt_id": p, "node": "3"}}).encode()
        self.wfile.write(frame(0x1, message[:10], fin=False) + frame(0x0, message[10:]))  # fragmented
        self.wfile.write(text("progress", value=1, max=1, prompt_id="someone-else", node="4"))  # ignored
        self.wfile.write(frame(0x1, json.dumps({"type": "executed", "data": {"node": "3", "prompt_id": p,
                                                                              "output": {"text": ["x" * 70000]}}}).encode()))
        kind = "execution_error" if self.server.scenario == "exec_error" else "execution_success"
        self.server.ws_done.set()
        self.wfile.write(text(kind, prompt_id=p))
        self.wfile.flush()
        self.connection.settimeout(5)
        try:  # read the client's frames (pong, close) until it hangs up
            data = b""
            while chunk := self.connection.recv(4096):
                data += chunk
                while (parsed := parse_frame(data)) is not None:
                    _fin, opcode, payload, used = parsed
                    data = data[used:]
                    if opcode == 0xA:
                        self.server.pongs.append(payload)
                    if opcode == 0x8:
                        return
        except OSError:
            return


@contextlib.contextmanager
def serving(server):
    """`server` answering on a thread of its own for the block, then shut down and closed."""
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def stub(request):
    param = getattr(request, "param", ("success", True))
    with serving(Stub(*param) if isinstance(param, tuple) else Stub(**param)) as server:
        yield server


def queue(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="vidmem")
    add_queue_parser(parser.add_subparsers(dest="command", required=True))
    return run_queue(parser.parse_args(["queue", *argv]))


def test_success_shows_progress_prints_receipts_and_downloads_outputs(stub, tmp_path, capsys):
    out = tmp_path / "out"
    assert queue(str(WORKFLOW), "--server", stub.url, "--out", str(out), "--timeout", "20") == 0
    captured = capsys.readouterr()
    assert "node 3 (VidMemVideoSampler, 'Video Sampler (VidMem)') [####################] 2/2" in captured.err
    assert "someone-else" not in captured.err and "node 4" not in captured.err
    assert "swap cost: 1.0% of step time" in captured.out  # the sampler's receipt text
    assert (out / "vidmem" / "vidmem_00001.mp4").read_bytes() == FILES["vidmem_00001.mp4"]
    assert (out / "vidmem" / "vidmem_preview_00001.webp").read_bytes() == FILES["vidmem_preview_00001.webp"]
    assert not list(out.rglob("preview.png")), "temp previews are not downloaded"
    assert stub.pongs == [b"hi"]
    posted = stub.posted[0]
    assert posted["client_id"].startswith("vidmem-queue-") and posted["prompt"] == json.loads(WORKFLOW.read_text())
    assert any(p.startswith(f"/ws?clientId={posted['client_id']}") for p in stub.paths)


def test_set_overrides_by_id_title_and_class(stub, tmp_path):
    code = queue(str(WORKFLOW), "--server", stub.url, "--timeout", "20",
                 "--set", "3.seed=7", "--set", "VidMemVideoSampler.steps=4",
                 "--set", "Memory Strategy (VidMem).blocks_to_swap=1", "--set", "3.prompt=a cat, at dusk",
                 "--set", "VidMemMemoryStrategy.vae_tiling=false", "--set", 'SaveVideo.filename_prefix="7"',
                 "--set", "2.activation_chunks=2", "--set", "2.gpus=2")
    assert code == 0
    prompt = stub.posted[0]["prompt"]
    assert prompt["3"]["inputs"]["seed"] == 7 and prompt["3"]["inputs"]["steps"] == 4
    assert prompt["3"]["inputs"]["prompt"] == "a cat, at dusk"
    assert prompt["2"]["inputs"]["blocks_to_swap"] == 1 and prompt["2"]["inputs"]["vae_tiling"] is False
    assert prompt["7"]["inputs"]["filename_prefix"] == "7"  # quoted JSON stays a string
    # an input the workflow gives text takes the text typed: the choice "2", not the number ComfyUI would refuse
    assert prompt["2"]["inputs"]["activation_chunks"] == "2" and prompt["2"]["inputs"]["gpus"] == "2"
    assert json.loads(WORKFLOW.read_text())["3"]["inputs"]["seed"] == 42, "the file is not modified"


@pytest.mark.parametrize("setting, message", [
    ("VidMemNope.steps=4", "no node has id, title or class 'VidMemNope'"),
    ("3.stepz=4", "node 3 (VidMemVideoSampler) has no input 'stepz'; its inputs: pipeline, strategy, prompt"),
    ("3.steps", "must look like NODE.INPUT=VALUE"),
    ("steps=4", "must look like NODE.INPUT=VALUE"),
])
def test_bad_overrides_fail_before_anything_is_sent(stub, capsys, setting, message):
    assert queue(str(WORKFLOW), "--server", stub.url, "--set", setting) == 2
    assert message in capsys.readouterr().err
    assert stub.paths == []


def test_ambiguous_class_asks_for_an_id(stub, tmp_path, capsys):
    workflow = json.loads(WORKFLOW.read_text())
    workflow["10"] = dict(workflow["3"])
    path = tmp_path / "two_samplers.json"
    path.write_text(json.dumps(workflow))
    assert queue(str(path), "--server", stub.url, "--set", "VidMemVideoSampler.steps=4") == 2
    assert "2 nodes match 'VidMemVideoSampler' (3, 10); use a node id" in capsys.readouterr().err


@pytest.mark.parametrize("stub", [("reject", True)], indirect=True)
def test_400_node_errors_in_plain_words(stub, capsys):
    assert queue(str(WORKFLOW), "--server", stub.url, "--timeout", "20") == 1
    err = capsys.readouterr().err
    assert "the server rejected the workflow" in err and "Prompt outputs failed validation" in err
    assert ("node 2 (VidMemMemoryStrategy, 'Memory Strategy (VidMem)') input 'blocks_to_swap': Failed to validate "
            "prompt for output 7: offload='block_swap' needs blocks_to_swap >= 1") in err
    assert ("node 3 (VidMemVideoSampler, 'Video Sampler (VidMem)') input 'width': "
            "Custom validation failed for node: width=30 must be a multiple of 16\n") in err
    assert err.count("must be a multiple of 16") == 1, "one line for a problem ComfyUI repeats per input"


@pytest.mark.parametrize("stub", [("exec_error", True), ("exec_error", False)], indirect=True, ids=["websocket", "polling"])
def test_execution_error_names_node_and_exception(stub, tmp_path, capsys):
    assert queue(str(WORKFLOW), "--server", stub.url, "--out", str(tmp_path), "--timeout", "20") == 1
    err = capsys.readouterr().err
    assert ("node 3 (VidMemVideoSampler, 'Video Sampler (VidMem)') failed: StrategyError: "
            "blocks_to_swap=99 but this model's transformer has 30 blocks") in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("stub", [("success", False)], indirect=True)
def test_without_a_websocket_it_polls_history(stub, tmp_path, capsys):
    assert queue(str(WORKFLOW), "--server", stub.url, "--out", str(tmp_path), "--timeout", "20") == 0
    assert "polling /history" in capsys.readouterr().err
    assert (tmp_path / "vidmem" / "vidmem_00001.mp4").is_file()


def test_proxies_from_the_environment_are_not_used(stub, tmp_path, monkeypatch):
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # the discard port: a proxied request would fail
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    assert queue(str(WORKFLOW), "--server", stub.url, "--timeout", "20") == 0


@pytest.mark.parametrize("stub", [("redirect", True)], indirect=True)
def test_redirects_are_refused(stub, capsys):
    assert queue(str(WORKFLOW), "--server", stub.url, "--timeout", "5") == 1
    assert "HTTP 307" in capsys.readouterr().err


def test_unreachable_server_is_one_clear_line(tmp_path, capsys):
    assert queue(str(WORKFLOW), "--server", "http://127.0.0.1:9", "--timeout", "5") == 1
    err = capsys.readouterr().err
    assert "cannot reach http://127.0.0.1:9/prompt" in err and "Traceback" not in err
    assert "websocket" not in err  # no note about progress before the one clear line


@pytest.mark.parametrize("content, message", [
    ('{"nodes": [], "links": []}', "is a UI-format workflow"),
    ("not json", "is not JSON"),
    ('{"1": {"inputs": {}}}', "is not an API-format workflow"),
])
def test_bad_workflow_files(tmp_path, capsys, content, message):
    path = tmp_path / "w.json"
    path.write_text(content)
    assert queue(str(path), "--server", "http://127.0.0.1:9") == 2
    assert message in capsys.readouterr().err


def test_server_must_be_http(capsys):
    assert queue(str(WORKFLOW), "--server", "ftp://example") == 2
    assert "must be an http(s) URL" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://127.0.0.1:abc"])
def test_a_bad_port_names_server_through_either_entry(url, capsys):
    assert queue(str(WORKFLOW), "--server", url) == 2
    assert queue_cli.main(["queue", str(WORKFLOW), "--server", url]) == 2
    err = capsys.readouterr().err
    assert err.count(f"vidmem queue: --server '{url}' has a bad port") == 2 and "Traceback" not in err, err


def test_standalone_module_entry_uses_the_same_parser(stub):
    assert queue_cli.main(["queue", str(WORKFLOW), "--server", stub.url, "--timeout", "20"]) == 0


def output(filename, subfolder="vidmem"):
    return {"files": [{"filename": filename, "subfolder": subfolder, "type": "output"}]}


@pytest.mark.parametrize("stub, message", [
    (output("vidmem_00001.mp4", "../../etc"), "subfolder '../../etc' would leave --out"),
    (output("vidmem_00001.mp4", "vidmem/../../.."), "would leave --out"),
    (output("vidmem_00001.mp4", "..\\..\\Windows"), "would leave --out"),
    (output(".."), "'..' is not a file name"),
    (output("."), "'.' is not a file name"),
    (output(""), "'' is not a file name"),
    (output("/etc/passwd", ""), "it is an absolute path"),
    (output("C:\\evil.exe", ""), "it is an absolute path"),
    (output("sub/vidmem_00001.mp4"), "must not contain a path separator"),
    (output("..\\vidmem_00001.mp4"), "must not contain a path separator"),
    (output("vidmem_00001.mp4", "/tmp"), "subfolder '/tmp' is an absolute path"),
    (output("vidmem_00001.mp4", "C:\\Users"), "is an absolute path"),
    (output("a\x00b.mp4"), "NUL character"),
    (output(123), "filename and subfolder must be text"),
    (output("vidmem_00001.mp4", ["x"]), "filename and subfolder must be text"),
], indirect=["stub"], ids=["dotdot-subfolder", "dotdot-inside", "backslash-dotdot", "dotdot-name", "dot-name",
                           "empty-name", "absolute-name", "drive-name", "slash-in-name", "backslash-in-name",
                           "absolute-subfolder", "drive-subfolder", "nul", "number-name", "list-subfolder"])
def test_output_names_that_would_leave_out_are_refused(stub, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert queue(str(WORKFLOW), "--server", stub.url, "--out", str(out), "--timeout", "20") == 1
    err = capsys.readouterr().err
    assert message in err and "Nothing was downloaded" in err and "Traceback" not in err
    assert not out.exists() and {p.name for p in tmp_path.iterdir()} == set(), "nothing written anywhere"
    assert stub.viewed == [], "refused before any download"


def test_a_subfolder_linked_out_of_out_is_refused(stub, tmp_path, capsys):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "vidmem").symlink_to(elsewhere, target_is_directory=True)
    assert queue(str(WORKFLOW), "--server", stub.url, "--out", str(out), "--timeout", "20") == 1
    assert "outside --out" in capsys.readouterr().err
    assert not list(elsewhere.iterdir()) and stub.viewed == []


@pytest.mark.parametrize("stub, message", [
    ({"scenario": "success", "answers": {"/prompt": (200, b"<html>proxy login</html>")}},
     "POST /prompt: the server's answer is not JSON ('<html>proxy login</html>')"),
    ({"scenario": "success", "answers": {"/prompt": (200, b'["prompt-1"]')}}, "expected a JSON object from the server, got a list"),
    ({"scenario": "success", "answers": {"/prompt": (200, b'{"number": 0}')}}, "POST /prompt: the answer has no prompt_id"),
    ({"scenario": "success", "answers": {"/prompt": (200, b'{"prompt_id": 7}')}}, "the answer has no prompt_id"),
    ({"scenario": "success", "answers": {"/prompt": (400, b"bad request")}}, "the server rejected the workflow:\n  bad request"),
    ({"scenario": "success", "answers": {"/prompt": (400, b'{"node_errors": {"3": {"errors": ["x", {"extra_info": 5}]}}}')}},
     "node 3 (VidMemVideoSampler, 'Video Sampler (VidMem)'): error"),
    ({"scenario": "success", "answers": {"/history": (200, b"nope")}}, "GET /history/prompt-1: the server's answer is not JSON"),
    ({"scenario": "success", "answers": {"/history": (200, b"[]")}}, "got a list"),
    ({"scenario": "success", "answers": {"/history": (200, b'{"prompt-1": "done"}')}},
     "history entry of prompt prompt-1 is a str, not a JSON object"),
    ({"scenario": "success", "answers": {"/history": (200, b'{"prompt-1": {"status": [1]}}')}},
     "history 'status' is a list"),
    ({"scenario": "success", "answers": {"/history": (200, json.dumps({"prompt-1": {"status": {"status_str": "success"},
                                                                                   "outputs": []}}).encode())}},
     "history 'outputs' is a list"),
    ({"scenario": "success", "answers": {"/history": (200, json.dumps({"prompt-1": {"status": {"status_str": "success"},
                                                                                   "outputs": {"7": "x"}}}).encode())}},
     "output of node 7 is a str"),
    ({"scenario": "success", "answers": {"/history": (200, json.dumps({"prompt-1": {"status": {"status_str": "error",
                                                                                              "messages": [["x"], 5]}}}).encode())}},
     "prompt ended with status 'error'"),
    ({"scenario": "success", "answers": {"/view": (404, b"gone")}}, "HTTP 404: gone"),
], indirect=["stub"], ids=["prompt-html", "prompt-list", "no-prompt-id", "prompt-id-number", "400-text", "400-odd-shape",
                           "history-text", "history-list", "entry-str", "status-list", "outputs-list", "output-str",
                           "messages-odd", "view-404"])
def test_answers_that_are_not_comfyuis_are_refused_clearly(stub, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert queue(str(WORKFLOW), "--server", stub.url, "--out", str(out), "--timeout", "20") == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not list(out.rglob("*.mp4")) and not list(tmp_path.rglob("*.part"))


@pytest.mark.parametrize("stub", [{"websocket": False, "answers": {"/ws": (200, b"not a websocket")}}], indirect=True)
def test_a_refused_websocket_falls_back_to_polling(stub, tmp_path, capsys):
    assert queue(str(WORKFLOW), "--server", stub.url, "--out", str(tmp_path), "--timeout", "20") == 0
    assert "no websocket" in capsys.readouterr().err
    assert (tmp_path / "vidmem" / "vidmem_00001.mp4").is_file()


@pytest.mark.parametrize("stub", [("garbled", True)], indirect=True)
def test_a_websocket_message_that_is_not_json_costs_only_progress(stub, tmp_path, capsys):
    assert queue(str(WORKFLOW), "--server", stub.url, "--out", str(tmp_path), "--timeout", "20") == 0
    assert "the websocket sent a message that is not JSON" in capsys.readouterr().err
    assert (tmp_path / "vidmem" / "vidmem_00001.mp4").read_bytes() == FILES["vidmem_00001.mp4"]


def test_a_download_that_fails_midway_leaves_no_half_file(stub, tmp_path, monkeypatch, capsys):
    from vidmem.pipelines import atomic

    def broken_replace(source, target):
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "replace", broken_replace)
    assert queue(str(WORKFLOW), "--server", stub.url, "--out", str(tmp_path), "--timeout", "20") == 1
    err = capsys.readouterr().err
    assert f"cannot write {tmp_path / 'vidmem' / 'vidmem_00001.mp4'}: disk full" in err, err
    assert "The outputs are still on the server" in err and "Traceback" not in err
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [], "neither the target nor its temp file is left"


def test_files_of_a_good_answer_land_under_their_subfolder(tmp_path):
    from vidmem.cli.queue_client import output_file

    assert output_file("7", {"filename": "a.mp4", "subfolder": "video\\day1"}).target(tmp_path) == tmp_path / "video" / "day1" / "a.mp4"
    assert output_file("7", {"filename": "a.mp4", "subfolder": "./x/"}).target(tmp_path) == tmp_path / "x" / "a.mp4"
    assert output_file("7", {"filename": "a..b.mp4"}).target(tmp_path) == tmp_path / "a..b.mp4"


class SecondViewFails(Handler):
    """The first output downloads; the second /view answers 500, or drops the connection."""

    def do_GET(self):
        if self.path.startswith("/view?") and "preview" in self.path:
            self.server.viewed.append(self.path)
            if self.server.scenario == "drop":
                self.close_connection = True
                self.connection.shutdown(2)
                return None
            return self.reply(500, b"boom")
        return super().do_GET()


@pytest.mark.parametrize("how, error", [("success", "HTTP 500: boom"), ("drop", "cut its answer short")])
def test_a_later_download_failing_says_what_was_saved_and_what_is_still_on_the_server(how, error, tmp_path, capsys):
    server = Stub(how, websocket=False)
    server.RequestHandlerClass = SecondViewFails
    with serving(server):
        assert queue(str(WORKFLOW), "--server", server.url, "--out", str(tmp_path), "--timeout", "20") == 1
    captured = capsys.readouterr()
    first = tmp_path / "vidmem" / "vidmem_00001.mp4"
    assert first.read_bytes() == FILES["vidmem_00001.mp4"] and f"saved {first}" in captured.out
    assert error in captured.err and "Traceback" not in captured.err, captured.err
    assert (f"The outputs are still on the server (1 of 2 saved here: {first}; not saved: "
            "vidmem/vidmem_preview_00001.webp)") in captured.err, captured.err


class FirstHistory503(Handler):
    """One 503 from /history while the prompt runs (a busy proxy), then ComfyUI's answers."""

    def do_GET(self):
        if self.path.startswith("/history") and self.server.queued.is_set() and not getattr(self.server, "failed", False):
            self.server.failed = True
            return self.reply(503, b"Service Unavailable")
        return super().do_GET()


def test_a_5xx_while_waiting_is_retried_like_no_answer(tmp_path, capsys):
    server = Stub("success", websocket=False)
    server.RequestHandlerClass = FirstHistory503
    with serving(server):
        assert queue(str(WORKFLOW), "--server", server.url, "--out", str(tmp_path), "--timeout", "20") == 0
    err = capsys.readouterr().err
    assert err.count("note: GET /history/prompt-1: HTTP 503: Service Unavailable; trying again until --timeout") == 1, err
    assert (tmp_path / "vidmem" / "vidmem_00001.mp4").read_bytes() == FILES["vidmem_00001.mp4"]


@pytest.mark.parametrize("stub", [{"websocket": False, "answers": {"/history": (500, b"boom")}}], indirect=True)
def test_a_history_that_keeps_failing_ends_at_the_timeout_with_one_note(stub, tmp_path, capsys):
    assert queue(str(WORKFLOW), "--server", stub.url, "--out", str(tmp_path), "--timeout", "3") == 1
    err = capsys.readouterr().err
    assert err.count("note: GET /history/prompt-1: HTTP 500: boom; trying again until --timeout") == 1, err
    assert "prompt prompt-1 did not finish within 3 s" in err and "Traceback" not in err


def test_a_folder_or_unreadable_file_as_the_workflow_is_one_line(tmp_path, capsys):
    assert queue(str(tmp_path), "--server", "http://127.0.0.1:9") == 2
    err = capsys.readouterr().err
    assert f"vidmem queue: cannot read workflow file '{tmp_path}': Is a directory." in err and "Traceback" not in err


class Restarted(Handler):
    """A ComfyUI restarted after taking the prompt (killed for memory, say): its history and queue are empty."""

    def do_GET(self):
        if self.path == "/queue" or self.path.startswith("/history"):
            self.server.paths.append(self.path)
        if self.path == "/queue":
            return self.reply(200, {"queue_running": [], "queue_pending": []})
        if self.path.startswith("/history"):
            return self.reply(200, {})
        return super().do_GET()


def test_a_server_that_lost_the_prompt_is_said_so_at_once_not_after_the_timeout(tmp_path, capsys, monkeypatch):
    from vidmem.cli import queue as queue_module

    monkeypatch.setattr(queue_module, "QUEUE_EVERY", 2)
    server = Stub("success", websocket=False)
    server.RequestHandlerClass = Restarted
    started = time.monotonic()
    with serving(server):
        assert queue(str(WORKFLOW), "--server", server.url, "--out", str(tmp_path), "--timeout", "60") == 1
    err = capsys.readouterr().err
    assert "the server no longer has prompt prompt-1: neither its queue nor its history lists it" in err, err
    assert time.monotonic() - started < 20
    asked = [path for path in server.paths if path == "/queue"]
    polls = [path for path in server.paths if path.startswith("/history")]
    assert len(asked) == 2 and len(polls) == 4  # /queue every QUEUE_EVERY unfinished polls, not every one


class RunningAWhile(Handler):
    """GET /queue lists the prompt as running for the first polls (its history empty), then it finishes."""

    def do_GET(self):
        if self.path == "/queue":
            self.server.polls = getattr(self.server, "polls", 0) + 1
            return self.reply(200, {"queue_running": [[0, PROMPT_ID, {}, {}, ["7"]]], "queue_pending": []})
        if self.path.startswith("/history") and getattr(self.server, "polls", 0) < 3:
            return self.reply(200, {})
        return super().do_GET()


def test_a_prompt_the_queue_lists_is_waited_for(tmp_path, capsys, monkeypatch):
    from vidmem.cli import queue as queue_module

    monkeypatch.setattr(queue_module, "QUEUE_EVERY", 1)
    server = Stub("success", websocket=False)
    server.RequestHandlerClass = RunningAWhile
    with serving(server):
        assert queue(str(WORKFLOW), "--server", server.url, "--out", str(tmp_path), "--timeout", "30") == 0
    assert server.polls >= 3


@pytest.mark.parametrize("stub", [("interrupted", False)], indirect=True)
def test_an_interrupted_prompt_names_the_node_and_fails(stub, tmp_path, capsys):
    assert queue(str(WORKFLOW), "--server", stub.url, "--out", str(tmp_path), "--timeout", "20") == 1
    err = capsys.readouterr().err
    assert "interrupted at node 3" in err and "VidMemVideoSampler" in err, err


def test_an_earlier_file_of_the_same_name_is_kept(stub, tmp_path, capsys):
    """ComfyUI's counters start again when its output folder is emptied: the earlier render is not overwritten."""
    earlier = tmp_path / "vidmem" / "vidmem_00001.mp4"
    earlier.parent.mkdir(parents=True)
    earlier.write_bytes(b"MY EARLIER RENDER")
    assert queue(str(WORKFLOW), "--server", stub.url, "--out", str(tmp_path), "--timeout", "20") == 0
    assert earlier.read_bytes() == b"MY EARLIER RENDER"
    second = tmp_path / "vidmem" / "vidmem_00001 (2).mp4"
    assert second.read_bytes() == FILES["vidmem_00001.mp4"]
    assert f"saved {second}" in capsys.readouterr().out


def test_a_ui_template_is_refused_naming_its_api_twin(tmp_path, capsys):
    import vidmem

    template = Path(vidmem.__file__).parent / "workflows" / "CogVideoX-2b, 12 GB card.json"
    assert queue(str(template), "--server", "http://127.0.0.1:9") == 2
    err = capsys.readouterr().err
    assert "is a UI-format workflow; queue its API-format twin (workflows/api/cogvideox_t2v.json)" in err, err
    assert (Path(vidmem.__file__).parent / "workflows" / "api" / "cogvideox_t2v.json").is_file()


def test_ctrl_c_during_the_download_says_the_prompt_had_finished(tmp_path, capsys, monkeypatch):
    from vidmem.cli import queue_client

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    server = Stub("success", websocket=False)
    with serving(server):
        monkeypatch.setattr(queue_client, "write_bytes_atomically", interrupted)
        assert queue(str(WORKFLOW), "--server", server.url, "--out", str(tmp_path), "--timeout", "20") == 130
    err = capsys.readouterr().err
    assert "prompt prompt-1 had finished; its outputs not saved here are still on the server" in err, err
    assert "/interrupt" not in err
