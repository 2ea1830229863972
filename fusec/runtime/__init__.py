"""Runtime: what runs a compiled step.

``cuda_step`` loads the CUBIN with the driver API and launches one decode step (status records,
pointer tables, CUDA graph); ``compiled`` is the callable a compilation returns (GPU or CPU
simulator); ``artifacts`` keeps each compiled graph's schedule and kernel source on disk for later
processes; ``timing`` and ``profile`` time the step and draw its per-SM timeline.
"""
