"""vidmem: run CogVideoX and Wan video models on GPUs too small for them, and say what fits first."""

__version__ = "0.1.0"
