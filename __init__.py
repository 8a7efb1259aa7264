"""ComfyUI entry point for the vidmem node pack. Imports nothing heavy; touches no device."""

if __package__:  # ComfyUI imports this folder as a package; pytest may import the file bare
    from .vidmem.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
    from .vidmem.nodes.host import register_routes

    WEB_DIRECTORY = "./web"
    register_routes()  # read-only GET /vidmem/memory for the web meter; does nothing outside ComfyUI

    __all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
