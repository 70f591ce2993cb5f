"""dynabatch: cost-balanced dynamic micro-batching for variable-length training data."""

from .shapes import SHAPES_SCHEMA, Shapes

__all__ = ["SHAPES_SCHEMA", "Shapes"]
__version__ = "0.1.0"
