"""The neural cost models: pre-trained nets that price a plan's kernels and all-to-alls.

``features``: what the nets read; ``nets``: the nets; ``modelfile``: the file format;
``neural``: ``NeuralCostModel``, the nets behind the ``CostModel`` interface; ``shipped``:
the models shipped with the package, the choice of one for a topology, and its warnings.
"""

from torchrec_neuroshard.costmodel.neural import NeuralComm, NeuralCostModel
from torchrec_neuroshard.costmodel.shipped import (
    DEFAULT_PRETRAINED,
    MAX_WORLD_SIZE_EXTRAPOLATION,
    PRETRAINED_DIR,
    check_world_size,
    cost_model_for,
    feature_range_warning,
    kernel_size_warning,
    load_pretrained,
    model_file,
    model_named,
    pretrained_for,
)

__all__ = [
    "DEFAULT_PRETRAINED", "MAX_WORLD_SIZE_EXTRAPOLATION", "PRETRAINED_DIR", "NeuralComm", "NeuralCostModel",
    "check_world_size", "cost_model_for", "feature_range_warning", "kernel_size_warning", "load_pretrained", "model_file", "model_named",
    "pretrained_for",
]  # fmt: skip
