"""Runtime: what runs a compiled step.

Only loads and launches what the compile stages made (:mod:`fusec.pipeline`, through the artifact
cache :mod:`fusec.cache`), importing neither. ``load`` is stage ``load`` (the CPU simulator or the
CUDA module); ``cuda_step`` loads the CUBIN with the driver API and launches one decode step
(status records, pointer tables, CUDA graph); ``timing`` and ``profile`` time the step and draw
its per-SM timeline; ``lookup_kernels`` compiles, loads and launches the two small kernels of
prompt lookup's per-step bookkeeping (:mod:`fusec.prompt_lookup`).
"""
