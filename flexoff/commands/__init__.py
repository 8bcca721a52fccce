"""Every command of flexoff, on top of the library: ``flexoff run`` (:mod:`.main`), ``search`` and
``profile`` (:mod:`.search`), ``batch`` and ``bench`` (:mod:`.harness`), ``python -m
flexoff.commands.reference`` and ``flexoff eval`` (:mod:`.lm_eval`, lm-eval's command line).

Commands parse flags into a :class:`flexoff.job.Job`, make the LLM through the API, call the
library, and print; no module below this package parses flags or prints.
"""
