"""GET /vidmem/plan opens only files its nodes list: a widget value that names a path is refused.

The route answers any client that reaches ComfyUI's port, so a query must never make it open a file
the nodes do not offer (its existence, readability and JSON-ness would leak; a FIFO would block the
one plan worker). A listed file that vanished before it was read is the request's fault, not a 500.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vidmem.nodes import host, plan_files
from vidmem.nodes.plan_route import PlanRequestError, parse_request
from vidmem.pipelines import step_cache

from test_plan_route_windows import query

MODEL = "wan2.1-t2v-1.3b"
MAG = dict(cache_method="mag_cache", cache_threshold="0.12", cache_retention="0.2", cache_max_skip_steps="4")


@pytest.fixture
def ratios(tmp_path, monkeypatch):
    """A mag_ratios folder with one saved file and a FIFO named like one; no file may be read."""
    folder = tmp_path / "mag_ratios"
    folder.mkdir()
    (folder / "wan.json").write_text("{}")
    os.mkfifo(folder / "fifo.json")
    (tmp_path / "secret.json").write_text('{"model": "x"}')
    monkeypatch.setattr(host, "mag_ratios_folder", lambda: folder)

    def no_read(*args, **kwargs):
        raise AssertionError("a refused request must not open a file")

    monkeypatch.setattr(step_cache, "read_json_file", no_read)
    return folder


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
@pytest.mark.parametrize("name", ["{tmp}/secret.json", "../secret.json", "../../../../../../../../{tmp}/secret.json",
                                  "fifo.json", "/dev/zero", "{tmp}/mag_ratios/wan.json"])
def test_mag_ratios_that_the_step_cache_node_does_not_list_are_refused_before_any_file_is_opened(ratios, name):
    q = query(MODEL, 832, 480, 81, **MAG, cache_mag_ratios=name.format(tmp=ratios.parent))
    with pytest.raises(PlanRequestError, match="Step Cache node's mag_ratios=.* must be one of auto, calibrate, wan.json") as error:
        parse_request(q, [MODEL], ["bf16"])
    assert error.value.name == "cache_mag_ratios"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
@pytest.mark.parametrize("name", ["auto", "calibrate", "wan.json"])
def test_the_step_cache_nodes_own_choices_are_accepted(ratios, name):
    request = parse_request(query(MODEL, 832, 480, 81, **MAG, cache_mag_ratios=name), [MODEL], ["bf16"])
    assert dict(request.cache)["mag_ratios"] == name


def test_a_listed_transformer_file_that_vanished_is_a_request_error_naming_the_widget(tmp_path, monkeypatch):
    gone = tmp_path / "gone.safetensors"
    monkeypatch.setattr(host, "single_file_transformer_names", lambda: [gone.name])
    monkeypatch.setattr(host, "resolve_single_file", lambda name: gone)
    with pytest.raises(PlanRequestError, match="transformer_file='gone.safetensors' is listed but cannot be read") as error:
        parse_request(query(MODEL, 832, 480, 81, transformer_file=gone.name), [MODEL], ["bf16"])
    assert error.value.name == "transformer_file"


def test_listed_model_files_that_vanished_are_a_request_error_naming_the_widget(tmp_path, monkeypatch):
    monkeypatch.setattr(host, "model_file_names", lambda kind: ["gone.safetensors"])
    monkeypatch.setattr(host, "resolve_model_file", lambda kind, name, role: Path(tmp_path / name))
    files = {"loader": plan_files.FILES_LOADER, "loader_model": "gone.safetensors",
             "loader_text_encoder": "gone.safetensors", "loader_vae": "gone.safetensors"}
    with pytest.raises(PlanRequestError, match="model='gone.safetensors' is listed but cannot be read") as error:
        parse_request(query(MODEL, 832, 480, 81) | files, [], ["bf16"])
    assert error.value.name == "model"
    with pytest.raises(PlanRequestError, match="text_encoder_file='gone.safetensors' is listed but cannot") as error:
        parse_request(query(MODEL, 832, 480, 81, text_encoder_file="gone.safetensors"), [MODEL], ["bf16"])
    assert error.value.name == "text_encoder_file"
