"""The pieces of bench/cost_model_accuracy.py: the cases, the grid around a searched policy, the
runs in child processes and the tables."""
