"""CUDA back end: a schedule becomes one persistent kernel.

``codegen`` renders the kernel source from the kinds' Jinja templates (:mod:`fusec.templates`)
and the generated forms of generic ops (``gen``); ``jit`` compiles it with NVRTC (disk cache);
``build`` is the one place that runs lower -> render -> NVRTC -> load. Next: :mod:`fusec.runtime.cuda_step`.
"""
