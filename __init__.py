"""vidmem: run CogVideoX and Wan video models on GPUs too small for them, and say what fits first.

This folder is both the ComfyUI custom-node folder and the `vidmem` Python package. ComfyUI imports
a custom-node folder under a module name made from its path; pip imports it as `vidmem` (for the
`vidmem` command), which needs no nodes. Only the first registers nodes and the web route, so the
CLI stays light. Neither imports anything heavy or touches a device here.
"""

__version__ = "0.1.0"

if __package__ and __name__ != "vidmem":  # loaded by ComfyUI (or as ComfyUI does, in tests)
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
    from .nodes.routes import register_routes

    WEB_DIRECTORY = "./web"
    register_routes()  # read-only GET /vidmem/memory for the web meter; does nothing outside ComfyUI

    __all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
