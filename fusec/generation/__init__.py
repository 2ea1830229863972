"""The parts of :func:`fusec.generate` (``fusec/generate.py``: the prefill, the decode loop and
its CUDA-graph chunks): its arguments (:mod:`.arguments`), the compiled decode steps
(:mod:`.steps`), token selection on the device (:mod:`.selection`) and a batch's device state
(:mod:`.batch`)."""
