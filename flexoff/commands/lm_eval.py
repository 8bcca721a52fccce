"""``python -m flexoff.commands.lm_eval ARGS``: lm-evaluation-harness's command line with the ``flexoff``
model registered (lm_eval has no plugin discovery of its own; see flexoff.harness.lm_eval_adapter)."""

from __future__ import annotations

import sys

from ..errors import FlexoffError, error_line


def main() -> None:
    try:
        from ..harness import lm_eval_adapter  # noqa: F401  (registers the model)
    except FlexoffError as exc:  # lm_eval is not installed
        print(error_line(exc), file=sys.stderr)
        raise SystemExit(2) from None
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "lm_eval"
    try:
        cli_evaluate()
    except FlexoffError as exc:  # a bad model_args value or path: one line, as the flexoff command says it
        print(error_line(exc), file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
