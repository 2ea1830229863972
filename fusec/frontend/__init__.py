"""Front end: from a PyTorch model to the fusec IR.

``backend`` is the ``torch.compile`` entry point; ``capture`` runs dynamo's graph through AOT
autograd to core ATen (``custom_ops`` keeps SDPA whole); ``from_fx`` builds the IR
(:mod:`fusec.ir`). Next in the pipeline: the passes (:mod:`fusec.passes`).
"""

from fusec.package_check import check_package as _check_package

_check_package()   # a folder that shadows the package: one clear ImportError, not a failure deep in a compile
