"""One deployment of a model, resolved once for the API and the commands alike: ``devices`` (the
device and dtype a name asks for), ``parallel`` (a job over several processes and its process
group), ``deployment`` (a checked ``Request`` resolved into a frozen ``Deployment``) and
``planning`` (its policy, stage split and capacity for a workload: the one place that calls the
planner)."""
