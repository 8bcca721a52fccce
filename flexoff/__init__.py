"""flexoff: high-throughput batch LLM inference on one GPU with too little memory."""

from .api import LLM, GenerationResult, RequestOutput, ScoreOutput
from .errors import FlexoffError
from .runtime.metrics import Metrics
from .policy import CompressionConfig, Policy, TierFractions
from .runtime.sampling import SamplingParams

__all__ = [
    "LLM", "CompressionConfig", "FlexoffError", "GenerationResult", "Metrics", "Policy", "RequestOutput",
    "SamplingParams", "ScoreOutput", "TierFractions",
]
__version__ = "0.1.0"
