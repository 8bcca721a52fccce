"""Every command of flexoff, on top of the library: ``flexoff run`` (:mod:`.main`), ``search`` and
``profile`` (:mod:`.search`), ``batch`` and ``bench`` (:mod:`.harness`), ``python -m
flexoff.commands.reference`` and ``python -m flexoff.commands.lm_eval``.

Commands parse flags into a :class:`flexoff.job.Job`, make the LLM through the API, call the
library, and print; no module below this package parses flags or prints.
"""
