"""The numba kernels of dynabatch, each beside a readable plain-Python reference.

Every planning kernel lives here. The one numba kernel outside this package is the token cache's read
kernel (`pread_ragged`, beside `pread_ragged_reference`), which lives in `dynabatch.index.reads` because
reading files is the loader's job, not planning (``tests/test_layout.py`` fails on a kernel anywhere else).

Every ``@njit(cache=True)`` kernel that code outside this package calls has a ``*_reference``
function in the same module computing the same result with plain loops; the tests
(``tests/test_kernels_reference.py``, and ``tests/test_plan.py`` for the DP) compare each pair on
random inputs. Small helpers used only by other kernels are covered through their caller's
reference. The submodules import nothing from the rest of dynabatch except one another.

====================  ==============================  ==========================================
module                kernel                          reference
====================  ==============================  ==========================================
`.dp`                 `dp_kernel`                     `dp_reference`
                      `enumerate_segments`,           steps of `dp_kernel`, covered by
                      `dp_for_cap`, `dp_mod_ranks`,   `dp_reference`
                      `_one_stage_search`,
                      `_caps_by_makespan`,
                      `_slowest_rank_s`, `_backtrack`,
                      `_partition_times`
`.objective`          `objective_kernel`              `objective_reference`
`.assign`             `assign_ranks`                  `assign_ranks_reference`
                      `simulate_rank`                 `simulate_rank_reference`
                      `candidate_orders`             `candidate_orders_reference`
                      `_rank_stats`, `_max_without`   helpers of `assign_ranks`
                      `balance_simulated`             `balance_simulated_reference`
                      `_rank_span`                    helper of `balance_simulated`
`.op_tables`          `static_table`                  `static_table_reference`
                      `stream_row`                    `stream_row_reference`
                      `multimodel_table`              `multimodel_table_reference`
                      `codes_table`, `table_codes`    `codes_table_reference`, `table_codes_reference`
                      `warmup_forwards`,              helpers of the tables, covered by their
                      `one_f_one_b_row`, `_put`       references
`.simulate`           `simulate_table_kernel`         `simulate_table_reference`
                      `makespan_table_kernel`         `makespan_table_reference`
                      `schedule_kernel`               `schedule_reference`
                      `simulate_kernel`               `simulate_reference`
                      `makespan_kernel`               `makespan_reference`
                      `run_table`, `run_ops`,         the event loop of the table kernels and of
                      `op_ready`, `gated_start`,      `spill_timing_kernel`, covered by both
                      `_run_copies`
`.inflight`           `inflight_table_kernel`         `inflight_table_reference`
                      `held_table_kernel`             `held_table_reference`
                      `inflight_kernel`               `inflight_reference`
`.times`              `split_kernel`                  `split_reference`
                      `chunk_times`                   `chunk_times_reference`
`.spill`              `spill_timing_kernel`           `spill_timing_reference` (compared in
                                                      ``tests/test_multimodel_sim_spill.py``)
`.cost`               `padded_features`               `padded_features_reference`
                      `profiled_lookup`               `profiled_lookup_reference`
                      `round_up`, `dot`,              helpers of the DP and of
                      `_interp_axis`                  `profiled_lookup`
`.schedules`          `adaptive_kernel`               `adaptive_reference`
                      `_order_ranks` (its Python      `order_ranks_schedule_reference`,
                      faces `order_ranks_schedule`,   `order_ranks_stages_reference`
                      `order_ranks_stages`)
                      `stage_candidates`              `stage_candidates_reference`
                      `rank_ops_kernel`               `rank_ops_reference`
                      `record_slots_kernel`           `record_slots_reference`
`.stage_assign`       `assign_stages`                 `assign_stages_reference`
                      `_stats`                        helper of `assign_stages`
`.packing`            `budget_cuts`                   `budget_cuts_reference`
                      `pack_rows`                     `pack_rows_reference`
`.rows`               `pad_rows`                      `pad_rows_reference`
`.caps`               `pick_caps`                     `pick_caps_reference`
                      `pick_caps_between`             checked against `pick_caps`
`.bounds`             `capped_partition_cost`         `capped_partition_cost_reference`
`.recompute`          `stage_peaks`                   `stage_peaks_reference`
`.stage_order`        `insertion_search`              `insertion_search_reference`
                      `_span`                         helper of `insertion_search`
`.residency`          `active_peak_kernel`            `active_peak_reference`
`.flushfree`          `flushfree_kernel`              `flushfree_reference`
                      `stage_loads`                   `stage_loads_reference`
`.global_batches`     `greedy_cuts`                   `greedy_cuts_reference`
`.allocation`         `lpt_kernel`                    `lpt_reference`
                      `options_kernel`                `options_reference` (compared in
                                                      ``tests/test_multitask_allocation.py``)
                      `gpipe_makespan_kernel`         `makespan_kernel` on `gpipe_codes`
                      `block_frontier_kernel`         `block_frontier_reference`
                      `pareto_sum_kernel`             `pareto_sum_reference`
                      `min_sum_kernel`                `min_sum_reference`
                      `lpt_ordered`, `_pareto`,       helpers, covered by their callers'
                      `_undominated`, `stage_time`    references
`.allocation_stream`  `stream_kernel`                 `stream_reference` (compared in
                                                      ``tests/test_multitask_allocation.py``)
====================  ==============================  ==========================================

Callers pass arrays through `.arrays.kernel_array` and scalars as ``np.int64``, not literals, where
types would otherwise vary: numba compiles a kernel (and what it calls) once per argument type.

Processes that start together on an empty cache compile each kernel once between them, not once each
(`.compile_once`: every kernel module takes numba's ``njit`` from there, so the lock is installed before
any kernel can compile; importing this package alone imports no numba).
"""
