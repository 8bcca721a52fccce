"""The runtime: it executes a policy's block schedule on the machine.

Read it in this order: ``engine`` (an engine per model and policy; it forms each block's GPU
batches and runs them), ``block_run`` (one block in flight), ``schedule`` (the pure list of a
block's steps) and ``interpreter`` (one handler per step; it hands ``block_run`` back events).
Below them: ``batch`` (a GPU batch's token state and its stage math, and whether it still runs),
``kv``/``kv_groups``/``kv_state``/``kv_storage`` (its cache), ``activations``, ``weight_store`` (tiered
weights), ``tiers`` (pinned memory, disk, streams, the host worker), ``sampler``/``sampling``/
``stopping`` (the next token and when a sequence ends), ``pipeline`` (a pipeline stage's
messages), ``block_forming`` (prompts into blocks), ``memory`` and ``metrics``.
``docs/ARCHITECTURE.md`` walks one decode step through them.
"""
