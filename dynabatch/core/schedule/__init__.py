"""Pipeline op orders: which forward or backward each stage of a rank runs next.

`schedules` builds the orders (static ``gpipe``/``1f1b``, the memory-aware ``adaptive``, the ``auto``
pick) and searches each rank's micro-batch order by simulation (`order_step`); `orders` is the one
derivation of a rank's op order, recorded with the plan (`record_orders`) and read back by the
runner, inspect and recompute (`plan_orders`). Times are seconds, memory bytes.
"""

from .orders import (DEFAULT_FORWARD_FRACTION, ops_of, plan_orders, plan_p2p_s, plan_stage_times, rank_ops,
                     record_orders, slots_of, split_times, stage_limit)
from .schedules import AUTO_PREFERENCE, adaptive_order, order_step, pick_auto, schedule_ops_by_count

__all__ = ["AUTO_PREFERENCE", "DEFAULT_FORWARD_FRACTION", "adaptive_order", "ops_of", "order_step", "pick_auto",
           "plan_orders", "plan_p2p_s", "plan_stage_times", "rank_ops", "record_orders", "schedule_ops_by_count",
           "slots_of", "split_times", "stage_limit"]
