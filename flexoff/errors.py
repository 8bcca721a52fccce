"""User-facing errors: each one becomes a single line and exit code 2 in the CLI.

Python callers may catch them as the built-in kinds they are: a value out of range is a
ValueError, an argument of the wrong type a TypeError.
"""


class FlexoffError(Exception):
    """Base class for every error caused by user input or the user's environment."""


class ArgumentTypeError(FlexoffError, TypeError):
    """An argument of the wrong type, e.g. text where a number belongs."""


class UnknownModelError(FlexoffError, ValueError):
    """A model name that is neither in the registry nor a checkpoint directory."""


class HubError(UnknownModelError):
    """A Hugging Face Hub id that cannot be used: unknown, gated, unreachable, not cached offline, or
    without weights flexoff reads."""


class CheckpointError(FlexoffError):
    """A checkpoint file that is missing, unreadable, corrupt or of the wrong shape."""


class UnsupportedModelError(FlexoffError):
    """A checkpoint whose architecture or format flexoff cannot run faithfully."""


class PromptError(FlexoffError, ValueError):
    """Prompts that cannot be run: empty, too long, or malformed in a file."""


class OutputError(FlexoffError):
    """A results or metrics destination that cannot be written."""


class SamplingError(FlexoffError, ValueError):
    """Sampling parameters out of range."""


class PolicyError(FlexoffError, ValueError):
    """A policy that is invalid, or that cannot fit the machine."""


class ConfigError(FlexoffError, ValueError):
    """Malformed sizes, profiles or other configuration values."""


class TokenizerError(FlexoffError, ValueError):
    """No usable tokenizer for text input or output."""


class NonFiniteError(FlexoffError):
    """A model that computes NaN or infinity: non-finite weights, or an overflow in its dtype."""


class MissingSolverError(FlexoffError, ImportError):
    """No LP solver that the planner can run is installed."""


class ClosedError(FlexoffError, RuntimeError):
    """A call on an LLM after its close()."""


def error_line(exc: BaseException) -> str:
    """The one line a user sees for ``exc``: messages quoted from other libraries may span lines."""
    return "flexoff: error: " + " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
