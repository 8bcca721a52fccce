"""Errors of the harness; each is a FlexoffError, so the CLI prints one line and exits with 2."""

from ..errors import FlexoffError


class JobMismatchError(FlexoffError):
    """An output file that belongs to a different job (another model, input or settings)."""


class ResultsFileError(FlexoffError):
    """An output file that is not a flexoff results file, or is damaged before its last line."""


class ScenarioError(FlexoffError):
    """An unknown scenario, or a scenario data file with missing or malformed fields."""
