"""``flexoff eval ARGS``: lm-evaluation-harness's own command line, with the ``flexoff`` model
registered (lm_eval has no plugin discovery of its own; see flexoff.harness.lm_eval_adapter).

Every argument goes to lm_eval's parser unchanged, so its flags and help are lm_eval's:
``flexoff eval --model flexoff --model_args pretrained=DIR --tasks hellaswag``.
``python -m flexoff.commands.lm_eval ARGS`` does the same.
"""

from __future__ import annotations

import sys
from importlib.util import find_spec
from pathlib import Path

from ..errors import FlexoffError, error_line


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from ..harness import lm_eval_adapter  # noqa: F401  (registers the model, or says lm_eval is missing)
    except FlexoffError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    # lm_eval's parser reads sys.argv itself (and inserts its `run` subcommand there).
    saved = sys.argv
    sys.argv = ["flexoff eval", *argv]
    try:
        cli_evaluate()
    except FlexoffError as exc:  # a bad model_args value or path: one line, as the flexoff command says it
        print(error_line(exc), file=sys.stderr)
        return 2
    except SystemExit as exc:  # lm_eval's --help, or a usage error its parser printed
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except (ValueError, TypeError, OSError) as exc:
        if not _from_lm_evals_config(exc):
            raise
        print(error_line(FlexoffError(f"lm_eval: {exc}")), file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    return 0


def _from_lm_evals_config(exc: BaseException) -> bool:
    """Whether lm_eval's checks of its own arguments raised ``exc`` (an unknown task, a missing
    --output_path, a config file that is not there): a user's error, not a failure of the run."""
    config = Path(find_spec("lm_eval.config").origin).parent
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).is_relative_to(config)


if __name__ == "__main__":
    sys.exit(main())
