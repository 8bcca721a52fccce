"""The Python batch API: ``LLM(model).generate(prompts, SamplingParams(...))``.

``llm`` holds the ``LLM`` (it checks its arguments, resolves its deployment through
:mod:`flexoff.deploy` and builds the engine), ``args`` the checks of its arguments and vLLM's
prompt dicts, ``results`` what it hands back.
"""

from ..deploy.deployment import DEFAULT_POLICY
from ..outputs import RequestOutput
from .llm import LLM
from .results import GenerationResult, ScoreOutput

__all__ = ["DEFAULT_POLICY", "GenerationResult", "LLM", "RequestOutput", "ScoreOutput"]
