"""Multi-task multi-modal planning (Spindle): a model as a graph of components (`ComponentGraph`), each
step's per-component workload, a per-component device allocation in dependency-ordered waves
(`Allocation`), and the routing of micro-batches to the ranks of each component's group. Torch-free."""

from ..lazy import lazy_names

_NAMES = {
    "COMPONENT_KINDS": "graph", "TOKEN_KINDS": "graph", "Component": "graph", "ComponentGraph": "graph",
    "Task": "graph", "Allocation": "allocation", "Placement": "allocation",
    "GRAPHS": "zoo", "MTMM_TINY": "zoo", "graph_by_name": "zoo", "graph_from_configs": "zoo", "mtmm_graph": "zoo",
    "mtmm_tiny_graph": "zoo", "vision_language_graph": "zoo", "route": "routing",
    "StepSamples": "workload", "Workload": "workload", "ComponentCosts": "workload",
    "ComponentOptions": "allocation", "component_options": "allocation", "plan_allocation": "allocation",
    "simulate_stream": "allocation", "StreamModel": "allocation",
    "PipelineBaseline": "baselines", "one_pipeline": "baselines", "lower_bound": "baselines",
}
__all__ = sorted(_NAMES)

__getattr__ = lazy_names(__name__, _NAMES)
