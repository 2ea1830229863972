"""CUDA back end: a schedule becomes one persistent kernel.

``codegen`` renders the kernel source from the kinds' Jinja templates (:mod:`fusec.templates`)
and the generated forms of generic ops (``gen``); ``jit`` compiles it with NVRTC (disk cache).
The stages ``render`` and ``nvrtc`` that call them are in :mod:`fusec.pipeline`; loading onto the
GPU is the runtime's (:mod:`fusec.runtime.load`, :mod:`fusec.runtime.cuda_step`).
"""
