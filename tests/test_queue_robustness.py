"""`vidmem queue` when the server, the network or the user does something unusual: an answer that is
not HTTP, a websocket message of another shape, a slow /history, an --out that is a file, a bad
--timeout, Ctrl-C while waiting. Each ends in one clear line and the right exit status, never a
traceback, and input that is bad before the render is refused before anything is sent."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vidmem.cli import queue as queue_cli
from vidmem.cli.queue_client import QueueError, Server

import test_queue_cli
from test_queue_cli import PROMPT_ID, WORKFLOW, Handler, Stub, queue

stub = test_queue_cli.stub  # the stub server fixture, shared
PACKAGE_PARENT = str(Path(__import__("vidmem").__file__).parent.parent)  # where a subprocess finds `vidmem`


def raw_server(answer: bytes) -> str:
    """A TCP service on 127.0.0.1 that answers every connection with `answer` and hangs up."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def serve():
        while True:
            connection, _ = listener.accept()
            read_request(connection)  # all of it: unread bytes would make the close a reset
            connection.sendall(answer)
            connection.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}"


def read_request(connection: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data and (chunk := connection.recv(65536)):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length and (chunk := connection.recv(65536)):
        body += chunk


@pytest.mark.parametrize("answer", [b"SSH-2.0-OpenSSH_9.6\r\n",
                                    b'HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n{"prompt_id": "p1"}'],
                         ids=["not-http", "cut-short"])
def test_an_answer_that_is_not_http_is_one_clear_line(answer, capsys):
    assert queue(str(WORKFLOW), "--server", raw_server(answer), "--timeout", "5") == 1
    err = capsys.readouterr().err
    assert "answered something that is not HTTP, or cut its answer short" in err and "Traceback" not in err, err


@pytest.mark.parametrize("data", [["odd"], "text", 5])
def test_a_websocket_message_whose_data_is_not_an_object_is_not_ours(data):
    assert queue_cli.ends({"type": "execution_success", "data": data}, PROMPT_ID) is False
    assert queue_cli.ends({"type": "execution_success", "data": {"prompt_id": PROMPT_ID}}, PROMPT_ID) is True


class SlowOnce(Handler):
    """The first /history poll after queueing answers only after the client's request timeout."""

    def do_GET(self):
        if self.path.startswith("/history") and self.server.queued.is_set() and not self.server.slowed.is_set():
            self.server.slowed.set()
            time.sleep(1.5)
        return super().do_GET()


def test_one_slow_history_answer_is_tried_again_until_the_deadline(capsys):
    server = Stub("success", websocket=False)
    server.RequestHandlerClass, server.slowed = SlowOnce, threading.Event()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = Server(server.url, timeout=0.5)
        prompt_id = queue_cli.submit(client, json.loads(WORKFLOW.read_text()), "c")
        entry = queue_cli.wait(client, None, prompt_id, queue_cli.ProgressView({}, io.StringIO()), timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    assert entry["status"]["status_str"] == "success"
    assert "trying again until --timeout" in capsys.readouterr().err


def test_each_poll_waits_at_most_the_time_left(monkeypatch):
    asked = []

    def never_done(path, body=None, timeout=None):
        asked.append(timeout)
        return 200, b"{}"

    client = Server("http://127.0.0.1:9", timeout=3600)
    monkeypatch.setattr(client, "request", never_done)
    monkeypatch.setattr(queue_cli, "POLL_S", 0.05)
    with pytest.raises(QueueError, match="did not finish within 0.3 s"):
        queue_cli.wait(client, None, PROMPT_ID, queue_cli.ProgressView({}, io.StringIO()), timeout=0.3)
    polls = [t for t in asked[:-1]]  # the last request is GET /queue, for the message
    assert polls and all(t is not None and t <= 0.3 for t in polls), asked


@pytest.mark.parametrize("stub, state", [
    ({"websocket": False, "answers": {"/history": (200, b"{}"), "/queue": (200, json.dumps(
        {"queue_running": [[0, PROMPT_ID, {}, {}, []]], "queue_pending": []}).encode())}}, "it is still running on the server"),
    ({"websocket": False, "answers": {"/history": (200, b"{}"), "/queue": (200, json.dumps(
        {"queue_running": [], "queue_pending": [[1, PROMPT_ID, {}, {}, []]]}).encode())}}, "it is still queued on the server"),
    ({"websocket": False, "answers": {"/history": (200, b"{}")}}, "its state on the server is unknown"),
], indirect=["stub"], ids=["running", "queued", "unknown"])
def test_the_timeout_message_says_what_the_server_says_of_the_prompt(stub, state, capsys):
    assert queue(str(WORKFLOW), "--server", stub.url, "--timeout", "1.5") == 1
    err = capsys.readouterr().err
    assert f"prompt {PROMPT_ID} did not finish within 1.5 s; {state}" in err, err


def test_out_that_is_a_file_is_refused_before_anything_is_sent(stub, tmp_path, capsys):
    out = tmp_path / "afile"
    out.write_text("x")
    assert queue(str(WORKFLOW), "--server", stub.url, "--out", str(out), "--timeout", "20") == 2
    assert f"--out {out} is a file, not a folder" in capsys.readouterr().err
    assert stub.posted == [] and out.read_text() == "x"


def test_out_where_nothing_can_be_written_is_refused_before_anything_is_sent(stub, tmp_path, capsys):
    """A folder under a file (as /proc/self refuses files): known before the render, so refused before it."""
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "renders"
    assert queue(str(WORKFLOW), "--server", stub.url, "--out", str(out), "--timeout", "20") == 2
    err = capsys.readouterr().err
    assert f"--out {out}: cannot write there (" in err and "give a writable folder" in err, err
    assert stub.posted == []


def test_the_out_probe_leaves_no_folder_behind(tmp_path):
    """The check makes the missing folders to try a file there, then removes them: a prompt refused later leaves
    nothing behind (the download makes them when files land)."""
    out = tmp_path / "new" / "renders"
    queue_cli.check_wait_and_out(20.0, out)
    assert list(tmp_path.iterdir()) == []


PROMPT_ZH = "色调艳丽，过曝，静态，细节模糊不清"  # Wan's own negative prompt, as its workflows carry it


def workflow_in_chinese(path, encoding: str):
    workflow = json.loads(WORKFLOW.read_text(encoding="utf-8"))
    workflow["3"]["inputs"]["negative_prompt"] = PROMPT_ZH
    path.write_text(json.dumps(workflow, ensure_ascii=False), encoding=encoding)
    return path


def test_a_workflow_saved_with_a_byte_order_mark_is_read_and_its_text_sent_unchanged(stub, tmp_path):
    """UTF-8 with a BOM, as Windows editors save it: read as UTF-8 whatever the locale, the Chinese text intact."""
    path = workflow_in_chinese(tmp_path / "zh.json", "utf-8-sig")
    assert queue(str(path), "--server", stub.url, "--timeout", "20") == 0
    assert stub.posted[0]["prompt"]["3"]["inputs"]["negative_prompt"] == PROMPT_ZH


@pytest.mark.skipif(sys.platform == "win32", reason="sets a POSIX locale")
def test_a_utf8_workflow_is_read_as_utf8_under_an_ascii_locale(tmp_path):
    """The file's encoding, not the locale's: under LANG=C without Python's UTF-8 mode, text files open as ASCII."""
    path = workflow_in_chinese(tmp_path / "zh.json", "utf-8")
    code = ("import sys\nfrom vidmem.cli.queue import load_workflow\n"
            "print(ascii(load_workflow(sys.argv[1])['3']['inputs']['negative_prompt']))")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), PACKAGE_PARENT) if p)}
    done = subprocess.run([sys.executable, "-X", "utf8=0", "-c", code, str(path)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ascii(PROMPT_ZH)


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf"])
def test_a_timeout_that_is_not_a_positive_number_is_refused_before_anything_is_sent(stub, timeout, capsys):
    assert queue(str(WORKFLOW), "--server", stub.url, "--timeout", timeout) == 2
    assert "must be a positive number of seconds" in capsys.readouterr().err
    assert stub.posted == []


def test_ctrl_c_while_waiting_says_the_prompt_is_still_on_the_server(stub, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(queue_cli, "wait", interrupted)
    try:
        assert queue(str(WORKFLOW), "--server", stub.url, "--timeout", "20") == 130
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped as a traceback")
    err = capsys.readouterr().err
    assert f"interrupted: prompt {PROMPT_ID} is still on the server; POST {stub.url}/interrupt stops it" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("node", [{"class_type": "X", "inputs": []}, {"class_type": "X", "inputs": {}, "_meta": "t"}])
def test_inputs_and_meta_that_are_not_objects_are_bad_workflow_files(tmp_path, node, capsys):
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"1": node}))
    assert queue(str(path), "--server", "http://127.0.0.1:9", "--set", "X.seed=1") == 2
    err = capsys.readouterr().err
    assert "node 1's" in err and "not an object" in err and "Traceback" not in err


@pytest.mark.parametrize("stub", [{"answers": {"/prompt": (400, b'{"error": "", "node_errors": {}}')}}], indirect=True)
def test_a_400_that_names_no_problem_quotes_the_answer(stub, capsys):
    assert queue(str(WORKFLOW), "--server", stub.url, "--timeout", "20") == 1
    err = capsys.readouterr().err
    assert """the server rejected the workflow:\n  HTTP 400: '{"error": "", "node_errors": {}}'""" in err, err
