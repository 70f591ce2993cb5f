"""``dynabatch check``: a user's model folder and data checked before a long run (`folder_report`: what
the folder is and how it splits; `route_agreement`: one step of the user's data on each route against
the plain Hugging Face model's logits). See docs/pipeline_hf.md."""

from .agreement import RouteResult, route_agreement
from .folder import FolderReport, Problem, folder_report

__all__ = ["FolderReport", "Problem", "RouteResult", "folder_report", "route_agreement"]
