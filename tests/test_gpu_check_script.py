"""bench/gpu_check.sh as a lease runs it, on a fake GPU machine: a `python3` stand-in first on PATH that says CUDA
is there, writes each bench's --json and logs what it was asked, so the script's own logic (arguments, the CUDA
check, the order of the parts, the one archive a lease returns, its limits) is checked in seconds without a GPU.
A lease returns at most 8 files from $OUT, named in letters, digits, '.', '_' and '-', and what is there when its
command is killed (/work/.library/device/README.md's limits, docs/gpu.md)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "bench"))

pytestmark = pytest.mark.skipif(not (shutil.which("bash") and shutil.which("timeout") and shutil.which("tar")),
                                reason="bench/gpu_check.sh needs bash, GNU timeout and tar")

# The GPU machine's python3, faked: the CUDA check says True; `import diffusers` fails with $FAKE_IMPORT_ERROR when
# set; pytest and the benches succeed at once, each bench writing '{}' to its last --json; a bench whose arguments
# contain $FAKE_HANG_ON touches $FAKE_HANG_MARK and waits for $FAKE_RELEASE (at most a minute).
FAKE_PYTHON = r"""#!/usr/bin/env bash
printf '%s\n' "$*" >> "$FAKE_LOG"
if [ "$1" = -c ]; then
    case "$2" in
        "import torch; print(torch.cuda.is_available())") echo True ;;
        "import diffusers") [ -z "${FAKE_IMPORT_ERROR:-}" ] || { printf 'Traceback (most recent call last):\n%s\n' \
            "$FAKE_IMPORT_ERROR" >&2; exit 1; } ;;
        *) echo "torch 2.11.0 (fake) cuda 13.0 diffusers 0.42.1 NVIDIA H200 (fake)" ;;
    esac
    exit 0
fi
if [ "$1" = -m ]; then
    [ "$2" = pytest ] && printf 'tests/gpu/test_fake.py::test_one PASSED\n1 passed\n'
    exit 0
fi
json=
while [ $# -gt 0 ]; do [ "$1" = --json ] && json=$2; shift; done
[ -z "$json" ] || echo '{}' > "$json"
if [ -n "${FAKE_HANG_ON:-}" ] && grep -qF -- "$FAKE_HANG_ON" <<< "$(tail -n 1 "$FAKE_LOG")"; then
    touch "$FAKE_HANG_MARK"
    for _ in $(seq 600); do [ -e "$FAKE_RELEASE" ] && break; sleep 0.1; done
fi
echo "fake bench done"
"""


class FakeLease:
    """A fake GPU machine's PATH, an $OUT and a $TMPDIR under `root`; `run` runs the script there."""

    def __init__(self, root: Path, python: str | None = FAKE_PYTHON):
        self.bin, self.out, self.tmp, self.log = root / "bin", root / "out", root / "tmp", root / "calls.log"
        self.bin.mkdir()
        self.tmp.mkdir()
        python_path = self.bin / "python3"
        if python is None:  # this machine's own Python (torch without CUDA)
            python_path.symlink_to(sys.executable)
        else:
            python_path.write_text(python)
            python_path.chmod(0o755)
        smi = self.bin / "nvidia-smi"
        smi.write_text("#!/bin/sh\necho 'NVIDIA H200 (fake)'\n")
        smi.chmod(0o755)
        self.env = {**os.environ, "PATH": f"{self.bin}{os.pathsep}{os.environ['PATH']}", "OUT": str(self.out),
                    "TMPDIR": str(self.tmp), "FAKE_LOG": str(self.log), "FAKE_HANG_MARK": str(root / "hanging"),
                    "FAKE_RELEASE": str(root / "release")}

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SCRIPT), *args], env={**self.env, **env}, capture_output=True, text=True,
                              timeout=300)

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def archive(self) -> dict[str, str]:
        """The returned archive's files by name (all under one folder, gpu-check/)."""
        with tarfile.open(self.out / "gpu-check.tgz") as archive:
            members = [m for m in archive.getmembers() if m.isfile()]
            assert all(m.name.startswith("gpu-check/") for m in members)
            return {m.name.split("/", 1)[1]: archive.extractfile(m).read().decode() for m in members}

    def summary(self) -> dict[str, list[str]]:
        """summary.txt's rows by part: [result, seconds, limit, log]."""
        rows = [line.split("\t") for line in (self.out / "summary.txt").read_text().splitlines()
                if not line.startswith("#")]
        assert rows[0] == ["part", "result", "seconds", "limit", "log"]
        return {row[0]: row[1:] for row in rows[1:]}


@pytest.fixture
def lease(tmp_path):
    return FakeLease(tmp_path)


def test_help_prints_the_header_and_starts_nothing(lease):
    done = lease.run("--help")
    assert done.returncode == 0, done.stderr
    assert "SUITE_SECONDS" in done.stdout and "--dry-run" in done.stdout and "gpu-check.tgz" in done.stdout
    assert not done.stdout.startswith("!")  # the shebang is not part of it
    assert not lease.out.exists() and not any(lease.tmp.iterdir()) and lease.calls() == []  # no run, no folder


def test_an_unknown_argument_is_refused_before_anything_runs(lease):
    done = lease.run("--dryrun")
    assert done.returncode == 2 and "--dryrun" in done.stderr and "--dry-run" in done.stderr
    assert not lease.out.exists() and lease.calls() == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no CUDA device")
def test_without_cuda_it_stops_at_once_and_creates_nothing(tmp_path):
    lease = FakeLease(tmp_path, python=None)  # the real torch here, which sees no CUDA device
    done = lease.run(BUDGET_SECONDS="0")  # were the check missing, every part would be skipped, quickly
    assert done.returncode == 3, done.stdout + done.stderr
    assert "no CUDA device" in done.stderr and "--dry-run" in done.stderr  # the reason and the way out
    assert not lease.out.exists() and not any(lease.tmp.iterdir())


def test_a_diffusers_that_fails_to_import_shows_its_error(lease):
    error = "ImportError: cannot import name 'cached_download' from 'huggingface_hub'"
    done = lease.run(FAKE_IMPORT_ERROR=error)
    assert done.returncode == 2
    assert error in done.stdout  # the real reason, not only "run --prepare-wheels"
    assert "--prepare-wheels" in done.stdout


@pytest.fixture(scope="module")
def whole_lease(tmp_path_factory):
    """One fake lease with the defaults, run to its end."""
    lease = FakeLease(tmp_path_factory.mktemp("lease"))
    done = lease.run()
    assert done.returncode == 0, done.stdout + done.stderr
    return lease, done


def test_a_lease_returns_one_archive_and_a_summary_within_the_limits_on_files(whole_lease):
    lease, _ = whole_lease
    returned = [path for path in lease.out.rglob("*") if path.is_file()]
    assert sorted(path.name for path in returned) == ["gpu-check.tgz", "summary.txt"]  # at most 8 come back
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", path.name) for path in returned)
    files = lease.archive()
    for name in ("gpu-suite.log", "activations.log", "activations-gpu.json", "speed-goal.log", "speed-goal-gpu.json",
                 "activations-compiled-gpu.json", "speed-compile-gpu.json", "gpu.json", "nvidia-smi.txt", "summary.txt"):
        assert name in files, name
    assert json.loads(files["speed-goal-gpu.json"]) == {}  # what the bench wrote, whole
    assert not any(lease.tmp.iterdir())  # the per-run scratch folder (wheels, package link, parts) is removed


def test_the_summary_gives_each_part_its_exit_seconds_and_limit(whole_lease):
    lease, done = whole_lease
    summary = lease.summary()
    for part, log in (("tests/gpu", "gpu-suite.log"), ("activation block", "activations.log"),
                      ("speed goal", "speed-goal.log"), ("compiled blocks", "speed-compile.log")):
        result, seconds, limit, written = summary[part]
        assert result == "exit 0" and written == log and int(seconds) <= int(limit), part
    assert summary["tests/gpu"][2] == "180"  # the suite's limit: 32 tests took 132 s for 30 on the H200
    assert summary["warm rows"][0] == "skipped: 0 seconds given"
    assert (lease.out / "summary.txt").read_text().splitlines()[-1].startswith("# done: exit 0")


def test_the_plan_is_printed_first_in_the_order_the_parts_run(whole_lease):
    lease, done = whole_lease
    plan = done.stdout.split("\n== ")[0]
    assert plan.startswith("plan: 585s")
    planned = [line.split("  ")[1].strip() for line in plan.splitlines()[1:] if line.startswith("  ")]
    ran = [part for part in lease.summary() if part in planned]
    assert planned[:len(ran)] == ran and "SUITE_SECONDS" in plan


def test_the_goal_runs_right_after_the_eager_activation_block_with_auto_fp8_on_first(whole_lease):
    lease, _ = whole_lease
    benches = [call for call in lease.calls() if call.startswith(("bench/", "-m pytest"))]
    kinds = ["suite" if call.startswith("-m pytest") else
             "activations compiled" if call.startswith("bench/activations.py") and "--compile " in call else
             "activations" if call.startswith("bench/activations.py") else
             re.search(r"--parts (\w+)", call).group(1) if call.startswith("bench/speed.py") else call.split()[0]
             for call in benches]
    assert kinds == ["suite", "activations", "goal", "activations compiled", "compile", "bench/gpu.py"]
    goal = benches[2]
    assert re.search(r"--goal-rows (\S+)", goal).group(1).split(",")[0] == "auto+fp8_on"
    assert " -v " in f" {benches[0]} "  # the suite lists each test as it ends: a time limit keeps the ones done


def start_until_part_hangs(lease: FakeLease, hang_on: str, **env: str) -> subprocess.Popen:
    """The script in its own process group (as a lease runs it), once the part whose bench is called with `hang_on`
    has started and hangs (at most a minute)."""
    script = subprocess.Popen(["bash", str(SCRIPT)], env={**lease.env, "FAKE_HANG_ON": hang_on, **env},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    hanging = Path(lease.env["FAKE_HANG_MARK"])
    for _ in range(600):
        if hanging.exists() or script.poll() is not None:
            break
        time.sleep(0.1)
    assert hanging.exists(), f"the part with {hang_on} never started"
    return script


def test_a_lease_killed_mid_part_still_returns_the_parts_done(tmp_path):
    """The lease's command killed outright (no trap runs) while the goal part runs: the archive written after the
    activation block is there, whole, with the suite's and the activation block's files."""
    lease = FakeLease(tmp_path)
    try:
        script = start_until_part_hangs(lease, "--parts goal")
        os.killpg(script.pid, signal.SIGKILL)
        script.wait(timeout=30)
    finally:
        (tmp_path / "release").touch()  # the fake bench, in timeout's own process group, ends too
    files = lease.archive()
    assert {"gpu-suite.log", "activations.log", "activations-gpu.json"} <= set(files)
    assert "speed-goal-gpu.json" not in files  # the part under way when the command was killed
    assert lease.summary()["activation block"][0] == "exit 0"
    assert sorted(path.name for path in lease.out.iterdir()) == ["gpu-check.tgz", "summary.txt"]


def test_a_term_mid_part_stops_that_part_at_once_and_records_it(tmp_path):
    """A lease's stop (TERM to the script's process group, KILL some seconds later) while the goal part hangs: the
    part runs in `timeout`'s own process group, which that TERM does not reach, so the script passes it on and exits
    (143) at once, not at the part's limit (160 s; the fake bench hangs for a minute at most), with the part's row in
    the summary and the archive of the parts done before it."""
    lease = FakeLease(tmp_path)
    try:
        script = start_until_part_hangs(lease, "--parts goal")
        os.killpg(script.pid, signal.SIGTERM)
        try:
            returncode = script.wait(timeout=40)  # a bound far under the fake's hang, not a measurement
        except subprocess.TimeoutExpired:
            os.killpg(script.pid, signal.SIGKILL)
            pytest.fail("the script waited for the part under way to end by itself before acting on the TERM")
    finally:
        (tmp_path / "release").touch()  # were the part not stopped, its fake bench ends too
    assert returncode == 143
    summary = lease.summary()
    result, _, limit, log = summary["speed goal"]
    assert (result, limit, log) == ("interrupted (TERM)", "160", "speed-goal.log")
    assert summary["activation block"][0] == "exit 0"
    assert (lease.out / "summary.txt").read_text().splitlines()[-1].startswith("# done: exit 143")
    files = lease.archive()
    assert {"gpu-suite.log", "activations.log", "activations-gpu.json", "summary.txt"} <= set(files)
    assert "interrupted (TERM) after" in files["speed-goal.log"]
    assert "fake bench done" not in files["speed-goal.log"]  # the bench was stopped, not left to end by itself
    assert sorted(path.name for path in lease.out.iterdir()) == ["gpu-check.tgz", "summary.txt"]
    assert not any(lease.tmp.iterdir())  # the scratch folder is removed as at a normal end


def test_every_setup_step_and_part_runs_under_a_time_limit():
    """Setup steps (wheels, python checks, nvidia-smi) under `timeout 60`; parts under `timeout -k`, so that one that
    ignores the TERM at its limit is killed, not left to run past the lease's command."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    commands = [line.strip() for line in text.splitlines()
                if re.search(r"\b(python3|nvidia-smi)\b", line) and not line.lstrip().startswith(("#", "echo"))
                and "pip download" not in line]  # --prepare-wheels runs here, with internet, not on the lease
    for line in commands:
        assert line.startswith("run ") or re.search(r"timeout 60 (python3|nvidia-smi)\b", line), line
    run_body = text.split("\nrun() {", 1)[1].split("\n}", 1)[0]
    assert 'timeout -k "$KILL_GRACE" "$LIMIT"' in run_body


def test_the_speed_bench_refuses_cuda_where_there_is_none_before_building(monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("checks the refusal where torch sees no CUDA device")
    import speed

    def build(config):
        raise AssertionError("built before refusing --device cuda")

    monkeypatch.setattr(speed, "build", build)
    with pytest.raises(SystemExit):
        speed.main(["--device", "cuda", "--parts", "goal", "--blocks", "2", "--steps", "1"])
    error = capsys.readouterr().err
    assert "--device cuda" in error and "no CUDA device" in error and "--device cpu" in error


def test_the_activation_bench_replaces_its_json_whole(tmp_path):
    """Written after every count: each write a new file renamed onto the last (a reader or a killed lease never
    finds it truncated), and no temporary file left beside it."""
    import activations

    path = tmp_path / "activations-gpu.json"
    activations.write(path, {"rows": 1})
    first = path.stat().st_ino
    activations.write(path, {"rows": 2})
    assert json.loads(path.read_text()) == {"rows": 2}
    assert path.stat().st_ino != first  # a new file, not the old one rewritten in place
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
