"""KunServe on SGLang data-parallel replicas: drop replicated layers, not precision.

Under a KV overload, replicas drop complementary parts of their (replicated) decoder layers,
turn the freed weight memory into KV, and serve the merged group as a pipeline; they restore
when the load falls. This package holds the engine-agnostic pieces, pure Python on plain
dataclasses (no SGLang import), so the live executor, the tests and the cluster simulator use
them unchanged:

    cost.py        chunk cost model alpha(p*c + c^2 + c) + beta*c + gamma, fitted by least squares
    planner.py     the greedy drop plan (merge the two smallest groups) and its restore plan
    lookahead.py   balanced micro-batches for the merged group's pipeline, bubble share
    controller.py  when to drop and when to restore, from a global view of the replicas
"""
