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
which checks again first thing when it runs. Only Samplers that feed an output node are checked:
ComfyUI runs (and validates) only the nodes an output needs, so a Sampler left dangling on the
canvas must not stop the loader. A node of a class vidmem does not know (ComfyUI's or another
pack's) counts as an output, erring on the side of checking. Under "queue selected outputs" the
prompt still holds every branch and nothing says which outputs were picked: a Sampler on a branch
left out is still checked (bypass it, or fix its value).
"""

from __future__ import annotations

import logging

from ..memory import StrategyError
from ..memory.plan.stages import VideoShape
from ..pipelines.family import ModelError
from .strategy import BUDGETS, PARALLEL_WIDGETS, WIDGETS, VidMemMemoryStrategy

log = logging.getLogger("vidmem")

SAMPLER = "VidMemVideoSampler"
STRATEGY = "VidMemMemoryStrategy"
PASS_ON = ("VidMemLoadLoRA", "VidMemTrainLoRA")  # output 0 is the input pipeline, passed on
HIDDEN = {"prompt": "PROMPT", "unique_id": "UNIQUE_ID"}  # the loaders' hidden inputs


def samplers_fed_by(prompt: dict, node_id: str) -> list[tuple[str, dict]]:
    """(id, inputs) of every Video Sampler whose pipeline comes from node `node_id`'s output 0."""
    found, seen, frontier = [], {str(node_id)}, [str(node_id)]
    while frontier:
        source = frontier.pop()
        for nid, node in prompt.items():
            link = node.get("inputs", {}).get("pipeline") if isinstance(node, dict) else None
            if not (isinstance(link, list) and len(link) == 2 and str(link[0]) == source and link[1] == 0):
                continue
            if node.get("class_type") == SAMPLER:
                found.append((str(nid), node["inputs"]))
            elif node.get("class_type") in PASS_ON and str(nid) not in seen:
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
    """ModelError or StrategyError naming the Sampler or Strategy input the model cannot take.

    `model_config()` gives the model's planner model (configs.load_model: config files only); it
    is built only when a Sampler is found. Without a prompt (a direct call) nothing is checked."""
    if not isinstance(prompt, dict) or node_id is None:
        return
    samplers = []
    for sampler_id, inputs in samplers_fed_by(prompt, node_id):
        if feeds_an_output(prompt, sampler_id):
            samplers.append((sampler_id, inputs))
        else:
            log.info("vidmem: Video Sampler (node %s) feeds no output node, so ComfyUI does not run it; not checked "
                     "before loading", sampler_id)
    if not samplers:
        return
    try:
        model = model_config()
    except Exception as error:  # noqa: BLE001 - the load itself reports a model it cannot read, by name
        log.info("vidmem: no check before loading: %s", error)
        return
    for sampler_id, inputs in samplers:
        _check_sampler(prompt, sampler_id, inputs, model)


def _check_sampler(prompt: dict, sampler_id: str, inputs: dict, model) -> None:
    size = [inputs.get(name) for name in ("width", "height", "frames")]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in size):
        try:
            model.check_shape(VideoShape(*size))
        except ModelError as error:
            raise ModelError(f"Video Sampler (node {sampler_id}), checked against {model.name}'s config before "
                             f"loading it: {error}") from None
    link = inputs.get("strategy")
    node = prompt.get(str(link[0])) if isinstance(link, list) and len(link) == 2 else None
    if not isinstance(node, dict) or node.get("class_type") != STRATEGY:
        return
    widgets = node.get("inputs", {})
    _check_strategy_widgets(str(link[0]), widgets)
    blocks = widgets.get("blocks_to_swap")
    if widgets.get("offload") != "block_swap" or not isinstance(blocks, int) or isinstance(blocks, bool):
        return
    for name in model.layout.denoisers:
        count = model.real_block_count(name)
        if blocks > count:
            raise StrategyError(f"Memory Strategy (node {link[0]}), checked against {model.name}'s config before "
                                f"loading it: blocks_to_swap={blocks} but its {name} has {count} blocks; use 1..{count} "
                                "(or offload='sequential' to stream every layer).")


def _check_strategy_widgets(strategy_id: str, widgets: dict) -> None:
    """The Strategy's literal widgets through its own build(): the rules between inputs that ComfyUI's
    per-input min/max cannot see (overlap against tile_size, temporal_overlap against temporal_size,
    a GPU listed twice or alone) refuse the prompt before the model loads, not after. Skipped when
    any widget is linked or missing (its value is known only when the Strategy runs)."""
    names = (*WIDGETS, *BUDGETS, *PARALLEL_WIDGETS, "activation_chunks")
    values = {name: widgets[name] for name in names if name in widgets}
    if any(name not in values for name in WIDGETS) or any(isinstance(v, list) for v in values.values()):
        return
    try:
        VidMemMemoryStrategy().build(**values)
    except StrategyError as error:
        raise StrategyError(f"Memory Strategy (node {strategy_id}), checked before loading the model: {error}") from None
