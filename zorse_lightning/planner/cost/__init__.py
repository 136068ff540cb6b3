"""The cost model: what a plan costs in time and memory, priced from a profile and an inventory.

Its parts, from the bottom: :mod:`.comm` (links, transfers, collectives), :mod:`.compute`
(a stage's microbatch and the closed form's pipeline formula), :mod:`.memory` (one GPU's
bytes), :mod:`.update` (the optimizer step), :mod:`.context` (the records they pass on),
:mod:`.boundaries` and :mod:`.chain` (what crosses between stages, and the chain of the closed
form), :mod:`.evaluate` (a whole plan, the closed form) and :mod:`.simulate` (the engine's own
programs played in event time: the prediction of what runs). The search and the baselines
price every plan here, so all of them are compared in one model.
"""
