"""GET /vidmem/plan counts the Load LoRA nodes on the Sampler's pipeline as the Sampler's own plan does
(pipelines/planning.py: with_lora(loaded, load_lora(...)) planned with WithLoras), from the files'
headers alone, and names a LoRA it cannot use."""

from __future__ import annotations

import pytest

from test_lora import WAN_LAYERS, kohya_keys, peft_keys, random_lora, write
from test_web_route import TINY, query
from vidmem.memory.plan.planner import PlanOptions, plan_run
from vidmem.memory.units import GiB, human_bytes
from vidmem.nodes.plan_route import PlanRequestError, parse_request, plan_answer
from vidmem.pipelines.lora import load_lora, with_lora
from vidmem.pipelines.planning import plan_strategy

VARIANT = "wan2.1-t2v"
BUDGETS = (8 * GiB, 64 * GiB)
TIERS = {"none": dict(offload="none"), "block_swap": dict(offload="block_swap", blocks_to_swap="1", prefetch_blocks="1"),
         "sequential": dict(offload="sequential", prefetch_blocks="1")}


@pytest.fixture
def loras(tmp_path, monkeypatch, tiny_loaded):
    """A models/ tree ($VIDMEM_MODELS_DIR) whose loras/ holds a rank-16 PEFT LoRA on every block linear of
    the tiny Wan, a rank-4 kohya one (original Wan names, alphas) on the first block, and one for CogVideoX."""
    from vidmem.nodes import host

    monkeypatch.setattr(host, "folder_paths", None)
    monkeypatch.setenv("VIDMEM_MODELS_DIR", str(tmp_path))
    folder = tmp_path / "loras"
    folder.mkdir()
    transformer = tiny_loaded(VARIANT).pipe.transformer
    write(folder / "every-block.safetensors", peft_keys(random_lora(transformer, WAN_LAYERS, rank=16), None))
    first = [name for name in WAN_LAYERS if name.startswith("blocks.0.")]
    write(folder / "kohya.safetensors", kohya_keys("lora_unet_", True)(random_lora(transformer, first, rank=4), 2.0))
    write(folder / "cog.safetensors", {"transformer.transformer_blocks.0.attn1.to_q.lora_A.weight": _zeros(4, 8),
                                       "transformer.transformer_blocks.0.attn1.to_q.lora_B.weight": _zeros(8, 4)})
    return folder


def _zeros(*shape):
    import torch

    return torch.zeros(shape)


def _lora_query(chain=(), **change):
    """The tiny Wan's query with Load LoRA nodes `chain` ((name, strength, expert), from the loader down)."""
    sent = {f"lora{i}_{widget}": str(value) for i, lora in enumerate(chain)
            for widget, value in zip(("lora_name", "strength", "expert"), lora)}
    return query(**sent, **change)


@pytest.fixture
def answer(tiny_folder):
    from vidmem.pipelines.configs import load_model

    folder = tiny_folder(VARIANT)

    def plan(q):
        """The answer to query `q`, or to a request already parsed."""
        request = parse_request(q, [TINY], ["fp32"]) if isinstance(q, dict) else q
        return plan_answer(request, lambda name, dtype: load_model(str(folder), dtype), BUDGETS, device="cuda")
    return plan


def _samplers_plan(loaded, folder, chain, tier):
    """The Sampler's plan for `tier` with the chain's LoRAs loaded for real."""
    for name, strength, expert in chain:
        loaded = with_lora(loaded, load_lora(folder / name, loaded.pipe, strength, expert, name=name))
    return _sampler(loaded, parse_request(query(**TIERS[tier]), [TINY], ["fp32"]))


def _sampler(loaded, request, vram_budget_bytes=1 * GiB):
    """The Sampler's plan (pipelines.planning.plan_strategy) of `loaded` under the strategy the Memory Strategy
    node builds from `request`'s widgets, at its shape."""
    from vidmem.nodes.strategy import build_strategy

    strategy = build_strategy(**dict(request.widgets), activation_chunks=request.activation_chunks)
    return plan_strategy(loaded, request.shape, strategy, vram_budget_bytes, 64 * GiB, PlanOptions(), device="cuda")


@pytest.fixture
def planned(monkeypatch):
    """The plans the route makes with plan_run (the user's row), as Plan objects: their weight bytes."""
    from vidmem.nodes import plan_route

    made = []
    monkeypatch.setattr(plan_route, "plan_run", lambda *a, **k: made.append(plan_run(*a, **k)) or made[-1])
    return made


def _weights(plan) -> list[int]:
    """The denoise stage's weight bytes on the device, phase by phase: where the LoRA tensors are counted."""
    return [phase.weights_bytes for phase in plan.stage("denoise").phases]


def _denoise(row: dict) -> int:
    return next(stage["vram_bytes"] for stage in row["stages"] if stage["name"] == "denoise")


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("chain", [
    [("every-block.safetensors", 1.0, "both")],
    [("every-block.safetensors", 0.8, "both"), ("kohya.safetensors", -0.5, "both")],
], ids=["one", "two"])
def test_the_charts_row_is_the_samplers_plan_with_the_loras(loras, answer, tiny_loaded, chain, tier, planned):
    plan = answer(_lora_query(chain, **TIERS[tier]))
    assert plan["status"] == "ok", plan
    mine = plan["rows"][plan["chosen"]]
    sampler = _samplers_plan(tiny_loaded(VARIANT), loras, chain, tier)
    without = _samplers_plan(tiny_loaded(VARIANT), loras, (), tier)
    (charted,) = planned  # the user's row: the tiny LoRAs hide in the reserved bytes' rounding, not in the weights
    assert _weights(charted) == _weights(sampler)
    if tier != "sequential":  # one leaf at a time: the largest leaf, the tiny model's embedding, is not a LoRA'd layer
        assert _weights(sampler) > _weights(without)
    assert _denoise(mine) == sampler.stage("denoise").device_bytes
    assert [stage["vram_bytes"] for stage in mine["stages"]] == [stage.device_bytes for stage in sampler.stages]
    assert [stage["ram_bytes"] for stage in mine["stages"]] == [stage.host_bytes for stage in sampler.stages]
    assert mine["fits"] == sampler.fits
    (line,) = plan["loras"]
    total = sum(load_lora(loras / name, tiny_loaded(VARIANT).pipe).nbytes for name, *_ in chain)
    assert line.startswith(f"LoRAs: {len(chain)} counted, {human_bytes(total)} on their layers"), line
    assert " KiB on their layers" in line  # the tiny LoRAs are under 1 MiB: shown in KiB, not as 0.0 MiB
    assert all(name in line for name, *_ in chain)


def test_strength_zero_plans_as_no_lora_and_a_graph_without_loras_says_nothing(loras, answer):
    plain = answer(_lora_query())
    zero = answer(_lora_query([("every-block.safetensors", 0, "both")]))
    assert plain["loras"] == [] and zero["status"] == "ok"
    assert zero["rows"] == plain["rows"] and zero["chosen"] == plain["chosen"]
    assert zero["loras"] == ["LoRAs: 0 counted, 0 B on their layers (resident with them, streamed with their blocks "
                             "under block_swap and sequential): every-block.safetensors x0 (adds nothing)"]


def test_only_the_header_is_read(loras, answer, monkeypatch):
    """No tensor byte: the file is never mapped, so its data could be anything."""
    from vidmem.memory.storage import files

    def refuse(*args, **kwargs):
        raise AssertionError("a plan must not map a LoRA's tensor data")

    monkeypatch.setattr(files, "map_file", refuse)
    plan = answer(_lora_query([("kohya.safetensors", 1.0, "both")]))
    assert plan["status"] == "ok" and plan["loras"][0].startswith("LoRAs: 1 counted"), plan


@pytest.mark.parametrize("chain, name, words", [
    ([("gone.safetensors", 1.0, "both")], "lora0_lora_name", "is not in models/loras; pick a LoRA the node lists"),
    ([("kohya.safetensors", 1.0, "both"), ("gone.safetensors", 1.0, "both")], "lora1_lora_name", "(2nd after the loader)"),
    ([("kohya.safetensors", "nan", "both")], "lora0_strength", "the Load LoRA node's strength=nan must be a finite number"),
    ([("kohya.safetensors", "9", "both")], "lora0_strength", "strength=9.0 must be from -4.0 to 4.0"),
    ([("kohya.safetensors", 1.0, "middle")], "lora0_expert", "expert='middle' must be one of both"),
])
def test_a_bad_load_lora_widget_is_named(loras, chain, name, words):
    with pytest.raises(PlanRequestError) as caught:
        parse_request(_lora_query(chain), [TINY], ["fp32"])
    assert caught.value.name == name and words in str(caught.value), str(caught.value)


def test_a_bad_train_lora_count_is_named():
    with pytest.raises(PlanRequestError) as caught:
        parse_request(query(trained_loras="-1"), [TINY], ["fp32"])
    assert caught.value.name == "trained_loras"


def test_a_lora_for_another_model_or_expert_is_named_on_the_chart_with_the_fix(loras, answer):
    other = answer(_lora_query([("kohya.safetensors", 1.0, "both"), ("cog.safetensors", 1.0, "both")]))
    assert other["status"] == "error" and other["input"] == "lora1_lora_name", other
    assert "lora_name='cog.safetensors'" in other["error"] and "a LoRA for another model family" in other["error"]
    expert = answer(_lora_query([("kohya.safetensors", 1.0, "high_noise")]))
    assert expert["status"] == "error" and expert["input"] == "lora0_expert", expert
    assert "Set expert to 'both'" in expert["error"]


def test_the_lora_error_says_which_input_it_is_about_not_its_wording(loras, answer, tiny_loaded):
    """The chart's input comes from LoraError.widget: a file named like an expert refusal is still its lora_name."""
    from vidmem.memory.lora import LoraError

    (loras / "expert='both'.safetensors").write_bytes((loras / "cog.safetensors").read_bytes())
    other = answer(_lora_query([("expert='both'.safetensors", 1.0, "both")]))
    assert other["status"] == "error" and other["input"] == "lora0_lora_name", other
    pipe = tiny_loaded(VARIANT).pipe
    for kwargs, widget in [(dict(expert="low_noise"), "expert"), (dict(strength=9.0), "strength"),
                           (dict(), "")]:
        with pytest.raises(LoraError) as caught:
            load_lora(loras / "cog.safetensors", pipe, **kwargs)
        assert caught.value.widget == widget, caught.value


def test_a_file_gone_since_it_was_listed_is_named_not_a_server_error(loras, answer):
    request = parse_request(_lora_query([("kohya.safetensors", 1.0, "both")]), [TINY], ["fp32"])
    (loras / "kohya.safetensors").unlink()
    plan = answer(request)
    assert plan["status"] == "error" and plan["input"] == "lora0_lora_name", plan
    assert "lora_name='kohya.safetensors'" in plan["error"]


def test_the_lora_widgets_and_files_are_in_the_cache_key(loras):
    one = parse_request(_lora_query([("kohya.safetensors", 1.0, "both")]), [TINY], ["fp32"])
    assert one == parse_request(_lora_query([("kohya.safetensors", 1.0, "both")]), [TINY], ["fp32"])
    assert one != parse_request(_lora_query([("kohya.safetensors", 0.5, "both")]), [TINY], ["fp32"])
    assert one != parse_request(_lora_query(), [TINY], ["fp32"])
    write(loras / "kohya.safetensors", {"x.lora_A.weight": _zeros(2, 2), "x.lora_B.weight": _zeros(2, 2)})
    assert one != parse_request(_lora_query([("kohya.safetensors", 1.0, "both")]), [TINY], ["fp32"])  # rewritten


class _Renamed:
    """A planner model whose transformer's weight table names `layer` otherwise: the LoRA's tensors on
    it are not counted (planning.WithLoras logs them), as for a layer the meta model names differently."""

    def __init__(self, model, layer: str) -> None:
        self._model, self._layer = model, layer

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def weights(self, component: str, storage: str | None = None):
        from dataclasses import replace

        base = self._model.weights(component, storage)
        if component != "transformer":
            return base
        modules = tuple(f"{name}.elsewhere" if name == self._layer else name for name in base.table.modules)
        return replace(base, table=replace(base.table, modules=modules, _memo={}))


def test_the_lora_line_states_the_bytes_the_plan_counts(loras, tiny_folder, tiny_loaded):
    """A LoRA layer the planner's model lacks is not counted, so the line does not count it either."""
    from vidmem.nodes.plan_loras import lora_request, planned_with_loras
    from vidmem.pipelines.configs import load_model

    layer = "blocks.0.attn1.to_q"
    model = _Renamed(load_model(str(tiny_folder(VARIANT)), "fp32"), layer)
    planned, (line,) = planned_with_loras(model, (lora_request(0, "kohya.safetensors", 1.0, "both"),))
    spec = load_lora(loras / "kohya.safetensors", tiny_loaded(VARIANT).pipe)
    (lacking,) = [held for held in spec.layers["transformer"] if held.module == layer]
    counted = planned.weights("transformer").nbytes - model.weights("transformer").nbytes
    assert counted == spec.nbytes - sum(t.numel() * t.element_size() for t in lacking.tensors.values()) == \
        planned.lora_bytes() > 0
    assert line.startswith(f"LoRAs: 1 counted, {human_bytes(counted)} on their layers"), (line, human_bytes(spec.nbytes))


def test_a_train_lora_on_the_path_is_said_not_counted(loras, answer):
    plan = answer(_lora_query(trained_loras="1"))
    assert plan["status"] == "ok"
    assert plan["loras"] == ["Train LoRA: 1 on the path, not counted: the LoRA it trains is written by the run; the "
                             "Sampler counts it once it exists"]
    assert plan["rows"] == answer(_lora_query())["rows"]


@pytest.mark.parametrize("expert", ["high_noise", "low_noise", "both"])
def test_wan_22s_expert_is_planned_on_the_expert_the_sampler_puts_it_on(tmp_path, monkeypatch, tiny_loaded, tiny_folder,
                                                                        expert, planned):
    """Two experts: the LoRA's tensors on transformer, transformer_2 or both, as Load LoRA puts them."""
    from vidmem.nodes import host
    from vidmem.pipelines.configs import load_model

    monkeypatch.setattr(host, "folder_paths", None)
    monkeypatch.setenv("VIDMEM_MODELS_DIR", str(tmp_path))
    (tmp_path / "loras").mkdir()
    loaded = tiny_loaded("wan2.2-a14b")
    path = write(tmp_path / "loras" / "distill.safetensors",
                 peft_keys(random_lora(loaded.pipe.transformer, WAN_LAYERS, rank=16), None))
    request = parse_request(_lora_query([("distill.safetensors", 1.0, expert)], **TIERS["block_swap"]), [TINY], ["fp32"])
    folder = tiny_folder("wan2.2-a14b")
    plan = plan_answer(request, lambda name, dtype: load_model(str(folder), dtype), BUDGETS, device="cuda")
    assert plan["status"] == "ok", plan
    with_it = with_lora(loaded, load_lora(path, loaded.pipe, 1.0, expert))
    sampler, plain = _sampler(with_it, request), _sampler(loaded, request)
    (charted,) = planned
    assert _weights(charted) == _weights(sampler)
    grew = [mine > base for mine, base in zip(_weights(sampler), _weights(plain))]
    assert grew == {"high_noise": [True, False], "low_noise": [False, True], "both": [True, True]}[expert], grew


def test_a_lora_on_load_video_model_files_is_planned_on_the_files_storage_as_the_sampler_plans_it(tmp_path, monkeypatch,
                                                                                                 planned):
    """fp8-scaled tiny Wan files, memory-mapped: the LoRA's tensors on the recognised model's layers."""
    from types import SimpleNamespace

    from test_plan_route_files import FOLDERS, query as files_query
    from vidmem.nodes import host, plan_files
    from vidmem.pipelines.comfy_files import LoadOptions, load_model_files, shipped_catalogue
    from vidmem.pipelines.loader import DTYPES
    from vidmem.pipelines.tiny_files import save_tiny_comfy_files

    files = save_tiny_comfy_files("wan2.1-t2v", tmp_path, "fp8_scaled", reference=False).files
    folders = {key: tmp_path / sub for key, sub in {**FOLDERS, "loras": "loras"}.items()}
    folders["loras"].mkdir()
    monkeypatch.setattr(host, "folder_paths", SimpleNamespace(
        models_dir=str(tmp_path), get_folder_paths=lambda key: [str(folders[key])],
        get_filename_list=lambda key: sorted(p.name for p in folders[key].glob("*") if p.is_file())))
    plan_files.recognise.cache_clear()
    loaded = load_model_files(files, LoadOptions(dtype="bf16", vae_dtype="fp32"),
                              shipped_catalogue([tmp_path / "vidmem_configs"]))  # as the route matches them
    first = [name for name in WAN_LAYERS if name.startswith("blocks.0.")]
    path = write(folders["loras"] / "kohya.safetensors",
                 kohya_keys("lora_unet_", True)(random_lora(loaded.pipe.transformer, first, rank=8), 4.0))
    q = {**files_query(files), "offload": "block_swap", "blocks_to_swap": "1", "lora0_lora_name": "kohya.safetensors"}
    request = parse_request(q, [], list(DTYPES))
    plan = plan_answer(request, lambda *a: pytest.fail("a files request is not a folder"), BUDGETS, device="cuda")
    assert plan["status"] == "ok" and plan["loras"][0].startswith("LoRAs: 1 counted"), plan
    with_it = with_lora(loaded, load_lora(path, loaded.pipe))
    sampler, plain = _sampler(with_it, request, 8 * GiB), _sampler(loaded, request, 8 * GiB)
    (charted,) = planned
    assert _weights(charted) == _weights(sampler) > _weights(plain)


def test_the_nodes_modules_import_no_private_name_from_one_another():
    """A helper two node modules share is public where it lives (plan_files.listed_stat for plan_loras)."""
    import ast
    from pathlib import Path

    import vidmem.nodes

    private = [(path.name, node.module, alias.name) for path in sorted(Path(vidmem.nodes.__file__).parent.glob("*.py"))
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom) and node.level == 1
               for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert private == []
