"""Long batch jobs and HELM-style benchmarks on top of ``flexoff.LLM``.

- ``flexoff batch`` (:mod:`.batch`): a JSONL file of prompts in, a JSONL file of results out,
  appended a block at a time and resumable after a crash, Ctrl-C or ``kill -9``.
- ``flexoff bench`` (:mod:`.bench`): the scenarios of FlexGen's HELM run (:mod:`.scenarios`),
  scored with HELM's metrics (:mod:`.metrics`), with throughput and padding efficiency.
- :mod:`.lm_eval_adapter`: the ``flexoff`` model for lm-evaluation-harness.

The results files and their crash safety are described in :mod:`.store`.
"""
