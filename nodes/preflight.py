"""Before a loader reads any weight: what the graph will ask of the model, checked against its config.

ComfyUI's VALIDATE_INPUTS sees only a node's own widget values (a linked input is None when the
prompt is queued), so a Sampler cannot learn there that its 840 px or its Strategy's 50 swapped
blocks do not suit the model: it learns when it runs, after the loader has loaded the model
(minutes for a 14B). The loader runs first and knows the model, and ComfyUI hands a node the
prompt it runs in (hidden input PROMPT). So a loader, before it loads, follows its pipeline output
to the Video Samplers it feeds (through Load LoRA and Train LoRA), reads their literal width,
height and frames and their Memory Strategy's widgets, and checks them: the Strategy's through its
own build() (the rules between its inputs), blocks_to_swap and the size against the model's config
(a small file, built on the meta device). A problem is raised naming the node, the input and the
fix, with nothing loaded. Only literal values of known nodes are checked;
anything else (a value from another node, a graph shape not understood) is left to the Sampler,
which checks again first thing when it runs. A training graph is checked the same way: the Train
LoRA and Prepare Training Data nodes the loader feeds, their Memory Strategy's widgets through build()
and one_process_only (they run on ComfyUI's device only: no gpus list, no context parallelism), and
Train LoRA's literal widgets through TrainSettings (activation_offload on needs gradient_checkpointing);
their STRING inputs (buckets, lora_name) are refused earlier still, by their VALIDATE_INPUTS. Only nodes
that feed an output node are checked:
ComfyUI runs (and validates) only the nodes an output needs, so a node left dangling on the
canvas must not stop the loader. A node of a class vidmem does not know (ComfyUI's or another
pack's) counts as an output, erring on the side of checking. Under "queue selected outputs" the
prompt still holds every branch and nothing says which outputs were picked: a Sampler on a branch
left out is still checked (bypass it, or fix its value).
"""

from __future__ import annotations

import logging
from dataclasses import fields

from ..memory import StrategyError
from ..memory.plan.stages import VideoShape
from ..pipelines.family import ModelError
from ..training import TrainingError, TrainSettings
from .strategy import BUDGETS, PARALLEL_WIDGETS, WIDGETS, VidMemMemoryStrategy, one_process_only

log = logging.getLogger("vidmem")

SAMPLER = "VidMemVideoSampler"
STRATEGY = "VidMemMemoryStrategy"
TRAIN = "VidMemTrainLoRA"
PASS_ON = ("VidMemLoadLoRA", TRAIN)  # output 0 is the input pipeline, passed on
LABELS = {SAMPLER: "Video Sampler", TRAIN: "Train LoRA", "VidMemPrepareTrainingData": "Prepare Training Data"}
TRAINERS = (TRAIN, "VidMemPrepareTrainingData")  # run in ComfyUI's process only (strategy.one_process_only)
HIDDEN = {"prompt": "PROMPT", "unique_id": "UNIQUE_ID"}  # the loaders' hidden inputs


def samplers_fed_by(prompt: dict, node_id: str) -> list[tuple[str, dict]]:
    """(id, inputs) of every Video Sampler whose pipeline comes from node `node_id`'s output 0."""
    return [(nid, inputs) for nid, _, inputs in nodes_fed_by(prompt, node_id, (SAMPLER,))]


def nodes_fed_by(prompt: dict, node_id: str, classes: tuple[str, ...]) -> list[tuple[str, str, dict]]:
    """(id, class, inputs) of every node of `classes` whose pipeline comes from node `node_id`'s output 0,
    directly or through the nodes that pass it on (PASS_ON)."""
    found, seen, frontier = [], {str(node_id)}, [str(node_id)]
    while frontier:
        source = frontier.pop()
        for nid, node in prompt.items():
            link = node.get("inputs", {}).get("pipeline") if isinstance(node, dict) else None
            if not (isinstance(link, list) and len(link) == 2 and str(link[0]) == source and link[1] == 0):
                continue
            if node.get("class_type") in classes:
                found.append((str(nid), node["class_type"], node["inputs"]))
            if node.get("class_type") in PASS_ON and str(nid) not in seen:
                seen.add(str(nid))
                frontier.append(str(nid))
    return found


def feeds_an_output(prompt: dict, node_id: str) -> bool:
    """Whether an output node is reachable from node `node_id` (so ComfyUI runs it): one of vidmem's
    classes with OUTPUT_NODE, or any class vidmem does not know (the save nodes of ComfyUI and of other
    packs; assumed an output, so that a Sampler is never skipped by mistake)."""
    from . import NODE_CLASS_MAPPINGS as ours  # here: the package imports the loaders, which import this module

    seen, frontier = {str(node_id)}, [str(node_id)]
    while frontier:
        source = frontier.pop()
        for nid, node in prompt.items():
            if str(nid) in seen or not isinstance(node, dict) or not _reads_from(node, source):
                continue
            cls = ours.get(node.get("class_type"))
            if cls is None or getattr(cls, "OUTPUT_NODE", False) is True:
                return True
            seen.add(str(nid))
            frontier.append(str(nid))
    return False


def _reads_from(node: dict, source: str) -> bool:
    """Whether any input of `node` links to an output of node `source`."""
    return any(isinstance(v, list) and len(v) == 2 and str(v[0]) == source for v in node.get("inputs", {}).values())


def check_before_loading(prompt, node_id, model_config) -> None:
    """ModelError or StrategyError naming the Sampler or Strategy input the model cannot take; TrainingError
    or StrategyError naming a training node's input or Strategy that training cannot run (no model needed).

    `model_config()` gives the model's planner model (configs.load_model: config files only); it
    is built only when a Sampler is found. Without a prompt (a direct call) nothing is checked."""
    if not isinstance(prompt, dict) or node_id is None:
        return
    for trainer_id, class_type, inputs in _run_by_comfyui(prompt, nodes_fed_by(prompt, node_id, TRAINERS)):
        _check_trainer(prompt, trainer_id, class_type, inputs)
    samplers = [(nid, inputs) for nid, _, inputs in _run_by_comfyui(prompt, nodes_fed_by(prompt, node_id, (SAMPLER,)))]
    if not samplers:
        return
    try:
        model = model_config()
    except Exception as error:  # noqa: BLE001 - the load itself reports a model it cannot read, by name
        log.info("vidmem: no check before loading: %s", error)
        return
    for sampler_id, inputs in samplers:
        _check_sampler(prompt, sampler_id, inputs, model)


def _run_by_comfyui(prompt: dict, nodes: list[tuple[str, str, dict]]) -> list[tuple[str, str, dict]]:
    """Those of `nodes` that feed an output node: ComfyUI runs (and validates) only those."""
    run = []
    for nid, class_type, inputs in nodes:
        if feeds_an_output(prompt, nid):
            run.append((nid, class_type, inputs))
        else:
            log.info("vidmem: %s (node %s) feeds no output node, so ComfyUI does not run it; not checked before "
                     "loading", LABELS.get(class_type, class_type), nid)
    return run


def _check_trainer(prompt: dict, node_id: str, class_type: str, inputs: dict) -> None:
    """A training node's settings and Memory Strategy, before the model loads: Train LoRA's literal widgets
    through TrainSettings, the Strategy's through build() and one_process_only (training runs on ComfyUI's
    device only, so a gpus list or context parallelism would fail it only after the load)."""
    label = LABELS[class_type]
    if class_type == TRAIN:
        _check_train_settings(node_id, inputs)
    strategy_id, widgets = _linked_strategy(prompt, inputs)
    choice = _check_strategy_widgets(strategy_id, widgets) if strategy_id is not None else None
    if choice is None:
        return
    try:
        one_process_only(choice, label)
    except StrategyError as error:
        raise StrategyError(f"Memory Strategy (node {strategy_id}) of {label} (node {node_id}), checked before loading "
                            f"the model: {error}") from None


def _check_train_settings(node_id: str, inputs: dict) -> None:
    """Train LoRA's literal widgets through TrainSettings (whose fields the widgets are named after): the
    rules between inputs that ComfyUI's per-input checks cannot see. Skipped when any of them is linked
    (its value is known only when the node runs, which checks again)."""
    from . import NODE_CLASS_MAPPINGS as ours  # here: the package imports the loaders, which import this module

    spec = ours[TRAIN].INPUT_TYPES()
    widgets = {*spec["required"], *spec.get("optional", {})}
    values = {f.name: inputs[f.name] for f in fields(TrainSettings) if f.name in widgets and f.name in inputs}
    if any(isinstance(value, list) for value in values.values()):
        return
    try:
        TrainSettings(**values)
    except TrainingError as error:
        raise TrainingError(f"Train LoRA (node {node_id}), checked before loading the model: {error}") from None


def _linked_strategy(prompt: dict, inputs: dict) -> tuple[str | None, dict]:
    """(id, widgets) of the Memory Strategy node linked to `inputs`' strategy, or (None, {})."""
    link = inputs.get("strategy")
    node = prompt.get(str(link[0])) if isinstance(link, list) and len(link) == 2 else None
    if not isinstance(node, dict) or node.get("class_type") != STRATEGY:
        return None, {}
    return str(link[0]), node.get("inputs", {})


def _check_sampler(prompt: dict, sampler_id: str, inputs: dict, model) -> None:
    size = [inputs.get(name) for name in ("width", "height", "frames")]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in size):
        try:
            model.check_shape(VideoShape(*size))
        except ModelError as error:
            raise ModelError(f"Video Sampler (node {sampler_id}), checked against {model.name}'s config before "
                             f"loading it: {error}") from None
    strategy_id, widgets = _linked_strategy(prompt, inputs)
    if strategy_id is None:
        return
    _check_strategy_widgets(strategy_id, widgets)
    blocks = widgets.get("blocks_to_swap")
    if widgets.get("offload") != "block_swap" or not isinstance(blocks, int) or isinstance(blocks, bool):
        return
    for name in model.layout.denoisers:
        count = model.real_block_count(name)
        if blocks > count:
            raise StrategyError(f"Memory Strategy (node {strategy_id}), checked against {model.name}'s config before "
                                f"loading it: blocks_to_swap={blocks} but its {name} has {count} blocks; use 1..{count} "
                                "(or offload='sequential' to stream every layer).")


def _check_strategy_widgets(strategy_id: str, widgets: dict):
    """The Strategy's literal widgets through its own build(): the rules between inputs that ComfyUI's
    per-input min/max cannot see (overlap against tile_size, temporal_overlap against temporal_size,
    a GPU listed twice or alone) refuse the prompt before the model loads, not after. Returns the
    StrategyChoice built; None, unchecked, when any widget is linked or missing (its value is known
    only when the Strategy runs)."""
    names = (*WIDGETS, *BUDGETS, *PARALLEL_WIDGETS, "activation_chunks")
    values = {name: widgets[name] for name in names if name in widgets}
    if any(name not in values for name in WIDGETS) or any(isinstance(v, list) for v in values.values()):
        return None
    try:
        return VidMemMemoryStrategy().build(**values)["result"][0]
    except StrategyError as error:
        raise StrategyError(f"Memory Strategy (node {strategy_id}), checked before loading the model: {error}") from None
