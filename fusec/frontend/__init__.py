"""Front end: from a PyTorch model to the fusec IR.

``backend`` is the ``torch.compile`` entry point; ``capture`` runs dynamo's graph through AOT
autograd to core ATen (``custom_ops`` keeps SDPA whole); ``from_fx`` builds the IR
(:mod:`fusec.ir`). Next in the pipeline: the passes (:mod:`fusec.passes`).
"""
