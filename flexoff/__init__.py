"""flexoff: high-throughput batch LLM inference on one GPU with too little memory."""

from .errors import FlexoffError

__all__ = ["FlexoffError"]
__version__ = "0.1.0"
