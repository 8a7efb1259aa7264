"""ComfyUI for plan screenshots: its arguments as main.py's, the plan on the Memory Strategy node for a GPU.

A `--cpu` host plans for its CPU (no CUDA context, weights used in place), which is not what a user
with a GPU sees. This runs ComfyUI's main.py from the current folder (the ComfyUI checkout) and,
once vidmem's routes module is loaded, makes GET /vidmem/plan plan for a CUDA device; nothing else
changes and nothing runs on a GPU. For tests/browser/plan_screenshots.mjs only, with the real-size
headers of `python tests/workflow_runner.py place-headers` as the models (docs/verification.md):

    cd /path/to/ComfyUI && python /path/to/vidmem/tests/browser/gpu_plan_server.py --cpu \\
        --listen 127.0.0.1 --port 8189 --base-directory /path/to/base-with-headers
"""

import os
import runpy
import sys
import threading
import time

# What gpus=auto counts under context parallelism on the GPU machine the plan is for (this host shows none).
VISIBLE_GPUS = int(os.environ.get("VIDMEM_PLAN_VISIBLE_GPUS", "2"))


def plan_for_cuda() -> None:
    while True:
        for name, module in list(sys.modules.items()):
            if name.endswith("nodes.routes") and hasattr(module, "plan_answer") and hasattr(module, "_register_plan_route"):
                answer = module.plan_answer
                module.plan_answer = lambda request, load, budgets, device=None: answer(request, load, budgets, device="cuda",
                                                                                      visible_gpus=VISIBLE_GPUS)
                print(f"gpu_plan_server: {name} plans for cuda", flush=True)
                return
        time.sleep(0.2)


if __name__ == "__main__":
    threading.Thread(target=plan_for_cuda, daemon=True).start()
    sys.argv = ["main.py", *sys.argv[1:]]
    sys.path.insert(0, ".")
    runpy.run_path("main.py", run_name="__main__")
