"""Layer beneath the planner and the engine: the plan and its schedule, as data.

The plan format the planner writes and the engine runs (:mod:`.plan`, its rules :mod:`.plan_validation`); what each rank does in one step (:mod:`.actions`, :mod:`.programs`, 1F1B's :mod:`.one_f_one_b`), which point-to-point messages it
posts together (:mod:`.p2p_batches`, with the rendezvous play that proves the batches and collectives
cannot deadlock) and where its step's collectives fall among them (:mod:`.step_collectives`). The planner
prices these programs and the engine runs them, so both read them from here; nothing here imports either.
Pure Python: no torch.
"""
