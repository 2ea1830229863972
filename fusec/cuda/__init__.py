"""CUDA back end: a schedule becomes one persistent kernel.

``codegen`` renders the kernel source from the kinds' Jinja templates (:mod:`fusec.templates`)
and the generated forms of generic ops (``gen``); ``jit`` compiles it with NVRTC (disk cache);
``build`` runs the render and NVRTC stages; loading onto the GPU is the runtime's
(:mod:`fusec.runtime.cuda_build`, :mod:`fusec.runtime.cuda_step`).
"""
