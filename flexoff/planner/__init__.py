"""The planner: hardware profiles, the cost model, and the LP policy search.

It is pure arithmetic on a profile: planning for a GPU needs no GPU.
"""

from .cost_model import CostModel, Placement, PolicyFrame, Prediction, Workload
from .hardware import HardwareProfile, default_profile_path, packaged_profile, resolve_hardware
from .search import SearchResult, pareto_frontier, search_policy
from .sizes import embedding_numel, layer_weight_numel

__all__ = [
    "CostModel", "HardwareProfile", "Placement", "PolicyFrame", "Prediction", "SearchResult", "Workload",
    "default_profile_path", "embedding_numel", "layer_weight_numel", "packaged_profile", "pareto_frontier",
    "resolve_hardware", "search_policy",
]
